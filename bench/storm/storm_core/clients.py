"""The clients of a storm: official `openai` SDK clients (their own retries and backoff), or raw
HTTP/1.1 clients on a fixed schedule (the published replay). All are released together at
t = 0; every answer a client receives is recorded as an Attempt."""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

from .scenarios import MESSAGES, MODEL, Storm


@dataclass
class Attempt:
    """One answer a client received."""

    t_ms: float  # when it arrived, relative to t = 0
    status: int
    source: str  # x-llm-governor-source, "" when absent
    retry_after_ms: Optional[float]  # the hint as the SDKs read it
    held_ms: Optional[float]  # x-llm-governor-held-ms: the gateway held the request this long
    pool: str = ""  # x-llm-governor-pool: the request was steered to this fallback pool


@dataclass
class CallResult:
    client: int
    call: int
    ok: bool
    start_ms: float
    end_ms: float
    error: str = ""
    attempts: list = field(default_factory=list)
    tenant: str = ""


class Clock:
    """t = 0 is the moment the clients are released."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.t0_unix_ms = 0.0
        self.started = asyncio.Event()

    def start(self) -> None:
        self.t0 = time.monotonic() * 1000
        self.t0_unix_ms = time.time() * 1000
        self.started.set()

    def now_ms(self) -> float:
        return time.monotonic() * 1000 - self.t0


def retry_after_s(headers) -> Optional[float]:
    """The SDKs' reading: `retry-after-ms`, then `retry-after` in seconds or as an HTTP date."""
    for name, div in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        v = headers.get(name)
        if v is None:
            continue
        try:
            return float(v) / div
        except ValueError:
            continue
    v = headers.get("retry-after")
    try:
        parsed = email.utils.parsedate_tz(v) if v else None
    except (TypeError, ValueError):
        parsed = None
    if parsed is None:
        return None
    return max(0.0, email.utils.mktime_tz(parsed) - time.time())


def attempt_from(t_ms: float, status: int, headers) -> Attempt:
    hint = retry_after_s(headers)
    held = headers.get("x-llm-governor-held-ms")
    return Attempt(t_ms, status, headers.get("x-llm-governor-source", ""),
                   None if hint is None else hint * 1000, None if held is None else float(held),
                   headers.get("x-llm-governor-pool", ""))


def strategy_c_delay_ms(attempt: int, draw: int) -> float:
    """The published schedule: min(250 * 2^(attempt-1) + rand(0, 250), 1500)."""
    return min(250 * (2 ** (attempt - 1)) + draw, 1500)


def sdk_backoff_s(retries_done: int) -> float:
    """openai-python's fallback when no hint: 0.5 s * 2^n, capped 8 s, minus up to 25 %."""
    return min(0.5 * 2.0 ** retries_done, 8.0) * (1 - 0.25 * random.random())


class RawClient:
    """One keep-alive HTTP/1.1 connection sending a pre-encoded chat completion.

    The replay's 120 clients must really start together: building 120 SDK requests in one
    Python process takes hundreds of ms on this machine, which would smear the first wave past
    what the published fixture means by "120 clients start at t = 0". The replay clients are
    not SDK clients anyway (their schedule is the point), so they send bytes prepared before
    t = 0 and read status and headers exactly as the SDKs interpret them.
    """

    def __init__(self, base_url: str, api_key: str):
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
        self.request = (
            f"POST {u.path.rstrip('/')}/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.reader = self.writer = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def call(self) -> tuple:
        """(status, lower-cased headers) of one request; reconnects once if the peer closed."""
        for attempt in range(2):
            try:
                if self.writer is None:
                    await self.connect()
                self.writer.write(self.request)
                await self.writer.drain()
                head = await self.reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                if "content-length" in headers:
                    await self.reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    while True:
                        size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        await self.reader.readexactly(size + 2)
                        if size == 0:
                            break
                if headers.get("connection", "").lower() == "close":
                    await self.close()
                return status, headers
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                await self.close()
                if attempt:
                    raise
        raise ConnectionError("unreachable")

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        self.reader = self.writer = None


async def warm_up(clients: list) -> None:
    """Warms every SDK client before t = 0: the SDK's first call builds its machinery and opens
    the connection, which otherwise smears the "simultaneous" first wave over hundreds of ms.
    GET /v1/models is a 404 at the simulator (never logged), outside the filter's pools, and
    LiteLLM answers it itself. It goes under a credential of its own: a request outside every
    pool is still in pool `default`, which every limit applies to, so under the storm's key
    the 30 warm-ups were charged to an `account` limit (the fleet storm's first window of 30
    went to them: no call got through before t = 20 s)."""
    warm_key = {"authorization": "Bearer sk-storm-warm-up"}

    async def warm(c):
        try:
            await c.models.list(extra_headers=warm_key)
        except Exception:  # noqa: BLE001 - only the side effects matter
            pass
    await asyncio.gather(*(warm(c) for c in clients))


class SdkClients:
    """One `openai.AsyncOpenAI` per client (max_retries=3, its own connection); each makes
    `storm.calls_per_client` calls in turn. A response hook records every answer it receives."""

    # The SDK's max_retries; None leaves its default.
    MAX_RETRIES: Optional[int] = 3

    def __init__(self, storm: Storm, base_url, api_key: str, clock: Clock):
        import openai

        self.storm, self.clock = storm, clock
        self.warming = True
        self.current: list = [[] for _ in range(storm.clients)]  # attempts of each client's current call
        retries = {} if self.MAX_RETRIES is None else {"max_retries": self.MAX_RETRIES}
        self.clients = [
            openai.AsyncOpenAI(
                base_url=url_of(base_url, i), api_key=api_key, timeout=30.0, **retries,
                http_client=openai.DefaultAsyncHttpx2Client(event_hooks={"response": [self._hook(i)]}),
            )
            for i in range(storm.clients)
        ]

    def _hook(self, i: int):
        async def on_response(response):
            if not self.warming:
                self.current[i].append(attempt_from(self.clock.now_ms(), response.status_code, response.headers))
        return on_response

    async def prepare(self) -> None:
        await warm_up(self.clients)
        self.warming = False

    async def run(self, i: int, go: asyncio.Event, results: list) -> None:
        await go.wait()
        if self.storm.start_spread_ms:
            # Workers that come up one after another: client i starts i/n of the spread in.
            await asyncio.sleep(self.storm.start_spread_ms * i / self.storm.clients / 1000)
        for call in range(self.storm.calls_per_client):
            self.current[i] = attempts = []
            start = self.clock.now_ms()
            try:
                # An output limit when the storm sets one: a reserving token budget then holds
                # what the call may really use, not the config's `default_output_tokens`.
                limit = {} if self.storm.max_tokens is None else {"max_tokens": self.storm.max_tokens}
                await self.clients[i].chat.completions.create(model=MODEL, messages=MESSAGES, **limit)
                ok, error = True, ""
            except Exception as err:  # noqa: BLE001 - every failure is a data point
                ok, error = False, type(err).__name__
            results[i].append(CallResult(i, call, ok, start, self.clock.now_ms(), error, attempts))

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


# Common English words, for prompts that read (and tokenize) like prose.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will them who more its about "
    "said into than out up then some what only time other could like these two may first any new now way my "
    "over such our very even most also after made many before must through back years where much your well "
    "should down people because each just those how too state good make world still see own men work long "
    "here get both between life being under never day same another know while last might us great old year "
    "off come since against go came right used take three himself few house use during without again place "
    "around however home small found thought went say part once general high upon school every does got left "
    "number course until always away something fact though water less public put think almost hand enough far "
    "took head yet government system better set told nothing night end why called eyes find going look asked "
    "later knew point next city business give group toward young let room side social given present several "
    "order national second possible rather per face among form important often things looked early white case "
    "become large big need four within felt along children saw best church ever least power development light "
    "thing seemed family interest want members mind country area others done turned although open service "
    "certain kind problem began different door thus help sense means whole matter perhaps itself times law "
    "human line above name example action company hands local show whether five history gave today either act "
    "feet across taken past quite anything seen having death week experience body word half really field car "
    "words already themselves information tell together college shall money period held keep sure probably "
    "free seems political real cannot behind question air office making brought whose special major heard "
    "problems became study ago moment available known result street economic boy river garden morning letter"
).split()


def prose(chars: int, rng: random.Random) -> str:
    """English-looking prose of about `chars` characters: sentences of 6 to 18 common words."""
    out: list = []
    n = 0
    while n < chars:
        words = rng.choices(_WORDS, k=rng.randint(6, 18))
        sentence = " ".join(words).capitalize() + rng.choice((".", ".", ".", "?"))
        out.append(sentence)
        n += len(sentence) + 1
    return " ".join(out)[:chars].rstrip() + "."


class LoopClients(SdkClients):
    """`storm.clients` clients of the official SDK (`openai.AsyncOpenAI` with its default
    max_retries, 30 s timeout, its own connection), each calling again and again until
    `storm.duration_s`: a chat completion with a fresh prompt of about `storm.prompt_chars`
    characters (varied by up to 5 %) and `storm.max_tokens`. A call running at `duration_s`
    finishes (the run's timeout aside). A response hook records every answer it receives."""

    MAX_RETRIES = None

    def __init__(self, storm: Storm, base_url, api_key: str, clock: Clock):
        super().__init__(storm, base_url, api_key, clock)
        self.rng = [random.Random(storm.seed * 1000 + i) for i in range(storm.clients)]

    def messages(self, i: int) -> list:
        rng = self.rng[i]
        chars = round(self.storm.prompt_chars * rng.uniform(0.95, 1.05))
        return [{"role": "user", "content": "Summarize the following text in one paragraph. " + prose(chars, rng)}]

    def next_request(self, i: int):
        """What client i sends next, made before its call is timed."""
        return self.messages(i)

    async def send(self, i: int, messages) -> None:
        await self.clients[i].chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=self.storm.max_tokens)

    async def run(self, i: int, go: asyncio.Event, results: list) -> None:
        await go.wait()
        call = 0
        while self.clock.now_ms() < self.storm.duration_s * 1000:
            self.current[i] = attempts = []
            request = self.next_request(i)
            start = self.clock.now_ms()
            try:
                await self.send(i, request)
                ok, error = True, ""
            except asyncio.CancelledError:
                results[i].append(CallResult(i, call, False, start, self.clock.now_ms(), "run timeout", attempts,
                                             self.tenant_of(i)))
                raise
            except Exception as err:  # noqa: BLE001 - every failure is a data point
                ok, error = False, type(err).__name__
            results[i].append(CallResult(i, call, ok, start, self.clock.now_ms(), error, attempts, self.tenant_of(i)))
            call += 1
            await self.pause(i)

    def tenant_of(self, i: int) -> str:
        """The tenant client i calls for ("" when the storm has none)."""
        return ""

    async def pause(self, i: int) -> None:
        """What client i does between calls: nothing, unless its tenant reads its answer."""


class AgentClients(LoopClients):
    """`storm.clients` coding agents on the official `anthropic` SDK (`AsyncAnthropic` with its
    default retries, 60 s timeout, its own connection), each a conversation until
    `storm.duration_s`: the shared system prompt (`storm.system_chars` of prose, marked
    `cache_control`), the turns so far with a breakpoint on the newest block (as agent SDKs
    place them), `max_tokens` `storm.max_tokens`. Each turn adds the answer and a tool result of
    400 to 1,200 characters; after 6 turns a new task starts. A response hook records every
    answer."""

    TURNS = 6

    def __init__(self, storm: Storm, base_url: str, api_key: str, clock: Clock):
        # SdkClients' fields, with Anthropic's SDK instead of OpenAI's (its hook, warm-up and close
        # and LoopClients' loop are theirs).
        import anthropic

        self.storm, self.clock = storm, clock
        self.warming = True
        self.current: list = [[] for _ in range(storm.clients)]
        root = base_url[:-len("/v1")] if base_url.endswith("/v1") else base_url
        self.clients = [
            anthropic.AsyncAnthropic(
                base_url=root, api_key=api_key, timeout=60.0,
                http_client=anthropic.DefaultAsyncHttpxClient(event_hooks={"response": [self._hook(i)]}),
            )
            for i in range(storm.clients)
        ]
        self.system = [{"type": "text", "text": prose(storm.system_chars, random.Random(storm.seed)),
                        "cache_control": {"type": "ephemeral"}}]
        self.rng = [random.Random(storm.seed * 1000 + i) for i in range(storm.clients)]
        self.turns = [self.task(i) for i in range(storm.clients)]

    def task(self, i: int) -> list:
        return [("user", "Here is the next task. " + prose(self.rng[i].randint(400, 1200), self.rng[i]))]

    def next_request(self, i: int) -> list:
        """The turns as the SDK sends them, the newest block marked as a breakpoint."""
        out = [{"role": role, "content": [{"type": "text", "text": text}]} for role, text in self.turns[i]]
        out[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        return out

    async def send(self, i: int, messages: list) -> None:
        answer = await self.clients[i].messages.create(
            model="claude-sonnet-4-5", max_tokens=self.storm.max_tokens, system=self.system, messages=messages)
        text = "".join(getattr(b, "text", "") for b in answer.content) or "ok"
        rng = self.rng[i]
        self.turns[i] = self.turns[i] + [("assistant", text), ("user", "Tool result: " + prose(rng.randint(400, 1200), rng))]
        if len(self.turns[i]) > 2 * self.TURNS:
            self.turns[i] = self.task(i)


class TenantClients(LoopClients):
    """The tenants of `storm.tenants` (scenarios.Tenant), one `openai.AsyncOpenAI` per client
    (its tenant's timeout and `x-tenant-id`, the SDK's default retries, its own connection),
    each calling again and again until `storm.duration_s`, pausing its tenant's `think_s` after
    each call. `extra_body(tenant)`, when the gateway needs one (LiteLLM's priority), is sent
    with every call. A response hook records every answer."""

    def __init__(self, storm: Storm, base_url, api_key: str, clock: Clock, extra_body=None):
        import openai

        self.storm, self.clock = storm, clock
        self.tenant = [t for t in storm.tenants for _ in range(t.clients)]
        self.extra = [extra_body(t) if extra_body else None for t in self.tenant]
        self.warming = True
        self.current: list = [[] for _ in self.tenant]
        self.clients = [
            openai.AsyncOpenAI(
                base_url=url_of(base_url, i), api_key=api_key, timeout=t.timeout_s,
                default_headers={"x-tenant-id": t.name},
                http_client=openai.DefaultAsyncHttpx2Client(event_hooks={"response": [self._hook(i)]}),
            )
            for i, t in enumerate(self.tenant)
        ]

    def next_request(self, i: int):
        return MESSAGES

    async def send(self, i: int, messages) -> None:
        await self.clients[i].chat.completions.create(model=MODEL, messages=messages, extra_body=self.extra[i])

    def tenant_of(self, i: int) -> str:
        return self.tenant[i].name

    async def pause(self, i: int) -> None:
        if self.tenant[i].think_s:
            await asyncio.sleep(self.tenant[i].think_s)


class ScheduledClients:
    """Raw clients making at most `max_attempts` attempts inside `budget_ms`, on the published
    fixed schedule ("fixed") or obeying the hint as the SDKs read it ("obey")."""

    def __init__(self, storm: Storm, base_url, api_key: str, clock: Clock):
        self.storm, self.clock = storm, clock
        self.current: list = [[] for _ in range(storm.clients)]
        self.raw = [RawClient(url_of(base_url, i), api_key) for i in range(storm.clients)]
        # Strategy C draws: client-major order from one generator seeded 107, so a run is reproducible.
        rng = random.Random(storm.seed)
        self.draws = [[rng.randrange(0, 251) for _ in range(storm.max_attempts)] for _ in range(storm.clients)]

    async def prepare(self) -> None:
        await asyncio.gather(*(c.connect() for c in self.raw))

    async def run(self, i: int, go: asyncio.Event, results: list) -> None:
        await go.wait()
        storm, now = self.storm, self.clock.now_ms
        attempts = self.current[i]
        start, scheduled, error = now(), 0.0, ""
        for attempt in range(1, storm.max_attempts + 1):
            if scheduled > now():
                await asyncio.sleep((scheduled - now()) / 1000)
            left_s = None if storm.budget_ms is None else max(0.001, (storm.budget_ms - now()) / 1000)
            try:
                # The budget is total: an answer that comes after it is a failure, whoever held it.
                status, headers = await asyncio.wait_for(self.raw[i].call(), timeout=left_s)
            except asyncio.TimeoutError:
                await self.raw[i].close()
                error = "budget expired waiting for an answer"
                break
            except (ConnectionError, OSError, asyncio.IncompleteReadError) as err:
                status, headers, error = 0, {}, type(err).__name__
            t = now()
            if status:
                attempts.append(attempt_from(t, status, headers))
            if 200 <= status < 300:
                results[i].append(CallResult(i, 0, True, start, t, "", attempts))
                return
            error = f"HTTP {status}" if status else error
            if headers.get("x-should-retry") == "false" or attempt == storm.max_attempts:
                break
            if storm.client_kind == "fixed":
                # The published replay schedules from the attempt's scheduled time.
                nxt = scheduled + strategy_c_delay_ms(attempt, self.draws[i][attempt - 1])
            else:
                hint = retry_after_s(headers)
                nxt = t + 1000 * (hint if hint is not None and 0 < hint <= 120 else sdk_backoff_s(attempt - 1))
            if storm.budget_ms is not None and nxt > storm.budget_ms:
                error += " (next attempt past budget)"
                break
            scheduled = nxt
        results[i].append(CallResult(i, 0, False, start, now(), error, attempts))

    async def close(self) -> None:
        for c in self.raw:
            await c.close()


def url_of(base_url, i: int) -> str:
    """Client i's gateway: one for all (a string), or each client's own (a list: clients pinned
    to the replicas of a fleet, as behind a balancer with sticky connections)."""
    return base_url if isinstance(base_url, str) else base_url[i]


async def run_clients(storm: Storm, base_url, api_key: str, clock: Clock,
                      on_release: Callable[[], None], extra_body=None) -> list:
    """Releases every client at once (on_release runs just before t = 0) and returns one
    CallResult per call, client-major; calls cut off by `storm.run_timeout_s` fail as "run timeout"
    (a "loop" storm has no fixed number of calls: only the one each client was making).
    `extra_body(tenant)` is what a "tenants" storm's clients send besides the request."""
    if storm.client_kind == "tenants":
        clients = TenantClients(storm, base_url, api_key, clock, extra_body)
    else:
        kind = {"sdk": SdkClients, "loop": LoopClients, "agents": AgentClients}.get(storm.client_kind, ScheduledClients)
        clients = kind(storm, base_url, api_key, clock)
    await clients.prepare()
    results: list = [[] for _ in range(storm.clients)]
    go = asyncio.Event()
    tasks = [asyncio.create_task(clients.run(i, go, results)) for i in range(storm.clients)]
    await asyncio.sleep(0)  # each task runs up to go.wait()
    on_release()
    clock.start()
    go.set()
    _, pending = await asyncio.wait(tasks, timeout=storm.run_timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await clients.close()
    out = []
    for i, done in enumerate(results):
        for call in range(len(done), storm.calls_per_client):
            attempts = clients.current[i] if call == len(done) else []
            done.append(CallResult(i, call, False, 0.0, storm.run_timeout_s * 1000, "run timeout", attempts))
        out.extend(done)
    return out

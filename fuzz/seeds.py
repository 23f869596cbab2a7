#!/usr/bin/env python3
"""Seed corpora for the fuzz targets, extracted from the provider tables in core/tests/.

The tests hold real provider headers and bodies; this turns them into one file per seed under
fuzz/seeds/<target>/, in the input format each target reads (see fuzz/src/lib.rs). Run it
again after the tables change: `python3 fuzz/seeds.py` (it rewrites fuzz/seeds/ whole).
"""

import json
import pathlib
import re
import shutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEEDS = ROOT / "fuzz" / "seeds"
TESTS = ROOT / "core" / "tests"

# A Rust string or byte-string literal: raw (r#"..."#), or quoted with escapes.
LITERAL = re.compile(
    r'(?P<b>b?)(?:r(?P<hashes>#*)"(?P<raw>.*?)"(?P=hashes)|"(?P<esc>(?:[^"\\]|\\.)*)")',
    re.S,
)
# ("name", value) where value is any literal.
PAIR = re.compile(r'\(\s*"(?P<name>[a-zA-Z0-9_-]+)"\s*,\s*(?P<value>b?r?#*"(?:[^"\\]|\\.)*"#*)\s*\)')
CONST = re.compile(r"const\s+(?P<name>[A-Z_0-9]+)\s*:\s*&str\s*=\s*", re.S)


def unescape(text, is_bytes):
    """The bytes of a quoted Rust literal's body."""
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        n = text[i + 1]
        if n == "\n":  # line continuation: skip the newline and leading whitespace
            i += 2
            while i < len(text) and text[i] in " \t\n":
                i += 1
            continue
        simple = {"n": b"\n", "r": b"\r", "t": b"\t", "0": b"\0", "\\": b"\\", '"': b'"', "'": b"'"}
        if n in simple:
            out += simple[n]
            i += 2
        elif n == "x":
            v = int(text[i + 2 : i + 4], 16)
            out += bytes([v]) if is_bytes else chr(v).encode()
            i += 4
        elif n == "u":
            end = text.index("}", i)
            out += chr(int(text[i + 3 : end], 16)).encode()
            i = end + 1
        else:
            raise ValueError(f"unknown escape \\{n}")
    return bytes(out)


def literal_bytes(src):
    m = LITERAL.match(src)
    if not m:
        return None
    if m.group("raw") is not None:
        return m.group("raw").encode()
    return unescape(m.group("esc"), bool(m.group("b")))


def literals(text):
    for m in LITERAL.finditer(text):
        if m.group("raw") is not None:
            yield m.group("raw").encode()
        else:
            yield unescape(m.group("esc"), bool(m.group("b")))


def consts(text):
    """const NAME: &str = <literal>; in a test file."""
    out = {}
    for m in CONST.finditer(text):
        value = literal_bytes(text[m.end() :])
        if value is not None:
            out[m.group("name")] = value
    return out


def header_lists(text):
    """Every bracketed list of ("name", value) pairs, as a list of (name, bytes)."""
    lists = []
    for m in re.finditer(r"&\[", text):
        depth, j = 0, m.start() + 1
        while j < len(text):
            depth += {"[": 1, "]": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        pairs = [(p.group("name"), literal_bytes(p.group("value"))) for p in PAIR.finditer(text[m.start() : j])]
        pairs = [(n, v) for n, v in pairs if v is not None]
        if pairs:
            lists.append(pairs)
    return lists


def wire(headers):
    """A header map in the proxy-wasm wire format, as the host hands it over."""
    out = len(headers).to_bytes(4, "little")
    for n, v in headers:
        out += len(n.encode()).to_bytes(4, "little") + len(v).to_bytes(4, "little")
    for n, v in headers:
        out += n.encode() + b"\0" + v + b"\0"
    return out


def http(headers, body=b"", pseudo=()):
    lines = [f"{n}: ".encode() + v for n, v in list(pseudo) + list(headers)]
    return b"".join(line + b"\n" for line in lines) + b"\n" + body


class Corpus:
    def __init__(self):
        self.files = {}

    def add(self, target, name, data):
        seen = self.files.setdefault(target, {})
        if data in seen.values():
            return
        seen[f"{name}-{len(seen):03}"] = data

    def write(self):
        shutil.rmtree(SEEDS, ignore_errors=True)
        for target, files in sorted(self.files.items()):
            d = SEEDS / target
            d.mkdir(parents=True)
            for name, data in files.items():
                (d / name).write_bytes(data)
            print(f"{target}: {len(files)} seeds")


def provider_cases(text, bodies):
    """The Case { path, status, headers, body } rows of core/tests/provider_responses.rs."""
    for m in re.finditer(r"Case \{(.*?)\n        \}", text, re.S):
        row = m.group(1)
        status = int(re.search(r"status:\s*(\d+)", row).group(1))
        body_name = re.search(r"body:\s*([A-Z_0-9]+|\"\")", row).group(1)
        body = bodies.get(body_name, b"")
        lists = header_lists(row)
        yield status, (lists[0] if lists else []), body


def main():
    corpus = Corpus()
    texts = {p.stem: p.read_text() for p in sorted(TESTS.glob("*.rs"))}
    time_src = (ROOT / "core" / "src" / "time.rs").read_text()
    time_tests = time_src[time_src.index("mod tests") :]

    # Configs: every JSON object literal of the tests that is not a provider body, including
    # the rejected ones of core/tests/config.rs (unknown fields, wrong types, out of range).
    provider_keys = {"error", "type", "id", "choices", "candidates", "usageMetadata"}
    for stem, text in texts.items():
        for lit in literals(text):
            try:
                v = json.loads(lit)
            except ValueError:
                continue
            if isinstance(v, dict) and not set(v) & provider_keys:
                corpus.add("config_parse", stem, lit)
    corpus.add("config_parse", "empty", b"")
    corpus.add("config_parse", "empty-object", b"{}")

    # Error bodies with every governed status (and one that is not).
    provider_text = texts["provider_responses"]
    provider_bodies = consts(provider_text)
    bad_text = texts["bad_input"]
    hostile = [lit for lit in literals(bad_text[bad_text.index("fn hostile_bodies_never_panic") :])][:12]
    for body in list(provider_bodies.values()) + [b for b in hostile if len(b) < 4096]:
        for status in (429, 503, 529, 200):
            corpus.add("classify", f"status-{status}", status.to_bytes(2, "big") + body)

    # Headers and bodies of every provider row, for the delay computation; also their headers
    # alone for the rate-limit snapshot.
    for status, headers, body in provider_cases(provider_text, provider_bodies):
        for dialect in ("auto", "openai", "anthropic", "gemini"):
            corpus.add("provider_delay", f"provider-{status}-{dialect}", http(headers, body, [(":dialect", dialect.encode())]))
        corpus.add("ratelimit_parse", "provider", http(headers))
    for stem in ("ratelimit_headers", "bad_input", "provider_responses", "cooldown", "hold", "limits"):
        for headers in header_lists(texts.get(stem, "")):
            corpus.add("ratelimit_parse", stem, http(headers))
            corpus.add("provider_delay", stem, http(headers, b'{"error":{"type":"requests"}}'))
            corpus.add("wire_headers", stem, wire(headers))
            corpus.add("wire_headers", stem, http(headers))
    # Each malformed value of bad_input.rs on its own, next to an exhausted dimension.
    ignored = bad_text[bad_text.index("const IGNORED") : bad_text.index("#[test]")]
    for p in PAIR.finditer(ignored):
        value = literal_bytes(p.group("value"))
        headers = [("x-ratelimit-remaining-requests", b"0"), (p.group("name"), value)]
        corpus.add("provider_delay", "bad-input", http(headers, b"{}"))
        corpus.add("ratelimit_parse", "bad-input", http(headers))

    # Every header value and the time.rs table values, as bare text.
    for stem, text in texts.items():
        for headers in header_lists(text):
            for name, value in headers:
                if any(k in name for k in ("retry", "reset", "timeout", "ratelimit")):
                    corpus.add("time_formats", stem, value)
    for lit in literals(time_tests):
        if len(lit) <= 64:
            corpus.add("time_formats", "time-rs", lit)
    for body in provider_bodies.values():
        m = re.search(rb'"retryDelay":"([^"]*)"', body)
        if m:
            corpus.add("time_formats", "gemini-retry-delay", m.group(1))

    # Usage bodies: whole, cut in two at the middle, and cut inside the usage object.
    budget_bodies = consts(texts["token_budgets"])
    for name, body in budget_bodies.items():
        if name == "CFG":
            continue
        corpus.add("usage_chunks", name.lower(), b"\x00" + body)  # byte by byte
        corpus.add("usage_chunks", name.lower(), bytes([31 << 3]) + body)  # in 32-byte chunks
        mid = min(len(body) // 2, 255)
        corpus.add("usage_chunks", name.lower(), b"\x01" + bytes([mid]) + body)
        at = body.find(b"_tokens")
        if at < 0:
            at = body.find(b"TokenCount")
        if at >= 0:
            # Cut every 64 bytes up to the usage key, then just before and after it.
            cuts = [64] * (at // 64) + [at % 64 + 1, 3]
            cuts = cuts[-7:]
            corpus.add("usage_chunks", name.lower(), bytes([len(cuts)]) + bytes(cuts) + body)

    # Deadline headers of the hold tables, with the default config and a tight one.
    hold_text = texts["hold"]
    for headers in header_lists(hold_text[hold_text.index("fn deadline_headers_are_read_safely") :]):
        corpus.add("hold_budget", "hold", http(headers))
        corpus.add("hold_budget", "hold", http(headers, pseudo=[(":max_ms", b"10000"), (":margin_ms", b"2000")]))
    corpus.add("hold_budget", "off", http([("x-stainless-timeout", b"600")], pseudo=[(":max_ms", b"0")]))
    corpus.add(
        "hold_budget",
        "custom",
        http([("x-deadline-ms", b"2500"), ("x-deadline-ms", b"900")], pseudo=[(":deadline", b"x-deadline-ms")]),
    )
    corpus.add("wire_headers", "empty", b"")
    corpus.add("wire_headers", "status", wire([(":status", b"429"), ("retry-after", b"3")]))
    # Rate-limit service answers (RateLimitResponse, ReserveResponse, and a truncated one).
    corpus.add("rls_answers", "over_limit", bytes.fromhex("0802120c08021800220608011080e1eb17"))
    corpus.add("rls_answers", "ok", bytes.fromhex("0801"))
    corpus.add("rls_answers", "reserve_ok", bytes.fromhex("0801120572") + b"es-1")
    corpus.add("rls_answers", "truncated", bytes.fromhex("12050102"))
    # Request bodies: the token estimator's sample set (bench/estimate/samples.jsonl).
    samples = ROOT / "bench" / "estimate" / "samples.jsonl"
    for line in samples.read_text(encoding="utf-8").splitlines():
        sample = json.loads(line)
        corpus.add("request_estimate", sample["name"], json.dumps(sample["body"], ensure_ascii=False).encode()[:4096])

    # Anthropic bodies with cache breakpoints (issue 32): system, tools, messages, odd places.
    prompts = {
        "system": {"model": "claude-sonnet-4-5", "max_tokens": 16000, "messages": [{"role": "user", "content": "hi"}],
                   "system": [{"type": "text", "text": "You are an agent. " * 40, "cache_control": {"type": "ephemeral"}}]},
        "conversation": {"max_tokens": 64, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "task"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x",
                                           "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
            "tools": [{"name": "read", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]},
        "odd": {"cache_control": {"type": "ephemeral"}, "system": "plain", "messages": [
            {"role": "user", "content": "s", "cache_control": {"type": "ephemeral", "ttl": "2d"}},
            {"role": "user", "content": [{"type": "mystery", "cache_control": None}]}]},
        # Tools after the messages (as the SDKs write them): the body cut in half inside the
        # messages knows no prefix, since the tools come first in cache order.
        "tools-last": {"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
                       "messages": [{"role": "user", "content": "long " * 40}],
                       "tools": [{"name": "read", "input_schema": {"type": "object"}}]},
    }
    for name, body in prompts.items():
        corpus.add("prompt_prefixes", name, json.dumps(body).encode())

    corpus.write()


if __name__ == "__main__":
    main()

//! llm-sim: an LLM provider simulator (OpenAI, Azure OpenAI, Anthropic, Gemini) with scriptable
//! rate limits, quotas and overloads, for testing llm-governor end to end.
//!
//! Usage: `llm-sim [--listen 127.0.0.1:8081] [--scenario '<json>']`

mod decision;
mod dialect;
mod http;
mod providers;
mod scenario;
mod server;
mod sim;
mod timefmt;
mod tpm;

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use scenario::Scenario;
use sim::State;

const USAGE: &str = "usage: llm-sim [--listen 127.0.0.1:PORT] [--scenario '<json>']

  --listen ADDR       loopback address to listen on (default 127.0.0.1:8081; port 0 picks one)
  --scenario JSON     initial scenario (default {\"mode\":\"ok\"}); see README.md
  -h, --help          this text
  -V, --version       print the version

Prints `llm-sim listening on 127.0.0.1:PORT` once listening.";

struct Args {
    listen: SocketAddr,
    scenario: Scenario,
}

fn parse_args(args: &[String]) -> Result<Option<Args>, String> {
    let mut listen = "127.0.0.1:8081".to_string();
    let mut scenario = Scenario::default();
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (arg, None),
        };
        let mut value = || -> Result<String, String> {
            if let Some(v) = inline.clone() {
                return Ok(v);
            }
            i += 1;
            args.get(i)
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match name {
            "-h" | "--help" => return Ok(None),
            "-V" | "--version" => {
                println!("llm-sim {}", env!("CARGO_PKG_VERSION"));
                std::process::exit(0);
            }
            "--listen" => listen = value()?,
            "--scenario" => scenario = Scenario::parse(value()?.as_bytes())?,
            _ => return Err(format!("unknown argument: {arg}")),
        }
        i += 1;
    }
    let listen: SocketAddr = listen
        .parse()
        .map_err(|_| format!("--listen: not an IP:PORT address: {listen}"))?;
    if !listen.ip().is_loopback() {
        return Err(format!(
            "--listen: llm-sim only listens on loopback addresses, not {}",
            listen.ip()
        ));
    }
    Ok(Some(Args { listen, scenario }))
}

/// Binds and returns the listener and the shared state.
pub fn bind(
    listen: SocketAddr,
    scenario: Scenario,
) -> std::io::Result<(TcpListener, server::Shared)> {
    let listener = TcpListener::bind(listen)?;
    Ok((listener, Arc::new(Mutex::new(State::new(scenario)))))
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&argv) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("llm-sim: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let (listener, state) = match bind(args.listen, args.scenario) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("llm-sim: cannot listen on {}: {e}", args.listen);
            return ExitCode::from(1);
        }
    };
    let addr = listener.local_addr().unwrap_or(args.listen);
    let mut out = std::io::stdout();
    let _ = writeln!(out, "llm-sim listening on {addr}");
    let _ = out.flush();
    server::serve(listener, state);
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::io::{BufRead, BufReader, Read};
    use std::net::TcpStream;
    use std::thread;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn cli_args() {
        let a = parse_args(&s(&["--listen", "127.0.0.1:0"]))
            .unwrap()
            .unwrap();
        assert_eq!(a.listen.port(), 0);
        let a = parse_args(&s(&[
            "--listen=127.0.0.1:9",
            "--scenario",
            r#"{"mode":"quota"}"#,
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(a.scenario.mode, scenario::Mode::Quota);
        assert_eq!(parse_args(&s(&[])).unwrap().unwrap().listen.port(), 8081);
        assert!(parse_args(&s(&["--listen", "0.0.0.0:1"])).is_err());
        assert!(parse_args(&s(&["--listen"])).is_err());
        assert!(parse_args(&s(&["--bogus"])).is_err());
        assert!(parse_args(&s(&["--scenario", r#"{"nope":1}"#])).is_err());
        assert!(parse_args(&s(&["--help"])).unwrap().is_none());
    }

    struct Resp {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Resp {
        fn header(&self, n: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.as_str())
        }
        fn json(&self) -> serde_json::Value {
            serde_json::from_str(&self.body).unwrap()
        }
    }

    /// Minimal HTTP/1.1 client response reader (content-length or chunked).
    fn read_resp(r: &mut BufReader<TcpStream>) -> Resp {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let status: u16 = line.split(' ').nth(1).unwrap().parse().unwrap();
        let mut headers = Vec::new();
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let (k, v) = l.split_once(':').unwrap();
            headers.push((k.to_ascii_lowercase(), v.trim().to_string()));
        }
        let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        let body = if get("transfer-encoding").as_deref() == Some("chunked") {
            http::read_chunked(r).unwrap()
        } else {
            let n: usize = get("content-length").unwrap().parse().unwrap();
            let mut b = vec![0; n];
            r.read_exact(&mut b).unwrap();
            b
        };
        Resp {
            status,
            headers,
            body: String::from_utf8(body).unwrap(),
        }
    }

    struct Conn {
        w: TcpStream,
        r: BufReader<TcpStream>,
    }

    impl Conn {
        fn open(addr: SocketAddr) -> Conn {
            let w = TcpStream::connect(addr).unwrap();
            let r = BufReader::new(w.try_clone().unwrap());
            Conn { w, r }
        }
        fn send(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Resp {
            let mut req = format!(
                "{method} {path} HTTP/1.1\r\nhost: sim\r\ncontent-length: {}\r\n",
                body.len()
            );
            for (k, v) in headers {
                req.push_str(&format!("{k}: {v}\r\n"));
            }
            req.push_str("\r\n");
            req.push_str(body);
            self.w.write_all(req.as_bytes()).unwrap();
            read_resp(&mut self.r)
        }
    }

    fn start() -> SocketAddr {
        let (listener, state) = bind("127.0.0.1:0".parse().unwrap(), Scenario::default()).unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || server::serve(listener, state));
        addr
    }

    #[test]
    fn server_end_to_end() {
        let addr = start();
        // One keep-alive connection for everything below.
        let mut c = Conn::open(addr);
        let auth = [("authorization", "Bearer sk-a")];
        let chat = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#;

        assert_eq!(c.send("GET", "/_sim/health", &[], "").status, 200);

        // Success.
        let r = c.send("POST", "/v1/chat/completions", &auth, chat);
        assert_eq!(r.status, 200);
        let j = r.json();
        assert_eq!(j["object"], "chat.completion");
        assert_eq!(j["model"], "gpt-4o-mini");
        assert_eq!(j["choices"][0]["message"]["content"], providers::CONTENT);
        assert!(j["usage"]["total_tokens"].as_u64().unwrap() > 0);
        assert_eq!(r.header("x-ratelimit-limit-requests"), Some("60"));
        assert!(r.header("x-request-id").is_some());

        // 429 by limit: 2 per 5 s window.
        let sc = c.send(
            "POST",
            "/_sim/scenario",
            &[],
            r#"{"limit":{"requests":2,"window_ms":5000}}"#,
        );
        assert_eq!(sc.status, 200, "{}", sc.body);
        assert_eq!(
            c.send("POST", "/v1/chat/completions", &auth, chat).status,
            200
        );
        let second = c.send("POST", "/v1/chat/completions", &auth, chat);
        assert_eq!(second.status, 200);
        assert_eq!(second.header("x-ratelimit-remaining-requests"), Some("0"));
        let r = c.send("POST", "/v1/chat/completions", &auth, chat);
        assert_eq!(r.status, 429);
        assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
        assert_eq!(r.json()["error"]["type"], "requests");
        assert_eq!(r.header("retry-after"), Some("5"));
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
        // Another key is not limited.
        let r = c.send(
            "POST",
            "/v1/chat/completions",
            &[("authorization", "Bearer sk-b")],
            chat,
        );
        assert_eq!(r.status, 200);

        // Anthropic 429 with no retry-after still says when via the reset header.
        c.send(
            "POST",
            "/_sim/scenario",
            &[],
            r#"{"mode":"rate_limited","retry_after":"none","retry_after_s":2}"#,
        );
        let r = c.send(
            "POST",
            "/v1/messages",
            &[("x-api-key", "ak")],
            r#"{"model":"claude-x","max_tokens":10,"messages":[]}"#,
        );
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), None);
        assert_eq!(
            r.header("anthropic-ratelimit-requests-remaining"),
            Some("0")
        );
        assert!(r
            .header("anthropic-ratelimit-requests-reset")
            .unwrap()
            .ends_with('Z'));
        assert_eq!(r.json()["error"]["type"], "rate_limit_error");

        // Streaming (OpenAI) ends with [DONE] and carries usage when asked.
        c.send("POST", "/_sim/scenario", &[], "{}");
        let r = c.send(
            "POST",
            "/v1/chat/completions",
            &auth,
            r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#,
        );
        assert_eq!(r.status, 200);
        assert!(r
            .header("content-type")
            .unwrap()
            .starts_with("text/event-stream"));
        assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
        assert!(r.body.contains("\"total_tokens\""));
        assert!(r.body.contains("chat.completion.chunk"));

        // Anthropic stream.
        let r = c.send(
            "POST",
            "/v1/messages",
            &[("x-api-key", "ak")],
            r#"{"stream":true}"#,
        );
        assert!(r.body.contains("event: message_start"));
        assert!(r
            .body
            .trim_end()
            .ends_with("data: {\"type\":\"message_stop\"}"));

        // Gemini per-day quota.
        c.send("POST", "/_sim/scenario", &[], r#"{"mode":"gemini_day"}"#);
        let r = c.send(
            "POST",
            "/v1beta/models/gemini-2.0-flash:generateContent?key=g",
            &[],
            "{}",
        );
        assert_eq!(r.status, 429);
        assert_eq!(
            r.json()["error"]["details"][0]["violations"][0]["quotaId"],
            "GenerateRequestsPerDayPerProjectPerModel-FreeTier"
        );

        // Bad scenario.
        let r = c.send("POST", "/_sim/scenario", &[], r#"{"modes":"ok"}"#);
        assert_eq!(r.status, 400);
        assert!(r.json()["error"].as_str().unwrap().contains("modes"));

        // The log saw every provider request and no admin request.
        let log = c.send("GET", "/_sim/requests", &[], "").json();
        assert_eq!(log["total"], 9);
        assert_eq!(log["by_status"]["429"], 3);
        assert_eq!(log["by_key"]["sk-a"]["429"], 1);
        assert_eq!(log["requests"][8]["key"], "g");
        assert_eq!(log["requests"][8]["dialect"], "gemini");

        // Reset clears it.
        assert_eq!(c.send("POST", "/_sim/reset", &[], "").status, 200);
        assert_eq!(c.send("GET", "/_sim/requests", &[], "").json()["total"], 0);
    }

    /// `GET /_sim/requests` once `in_flight` is back to 0: a server thread ends a request just
    /// after writing its last byte, which a client can read a moment earlier.
    fn settled_log(c: &mut Conn) -> serde_json::Value {
        for _ in 0..200 {
            let log = c.send("GET", "/_sim/requests", &[], "").json();
            if log["in_flight"] == 0 {
                return log;
            }
            thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("requests still in flight");
    }

    #[test]
    fn server_concurrency_limit_holds_slots_through_latency_and_streams() {
        let addr = start();
        let mut admin = Conn::open(addr);
        let chat = r#"{"model":"gpt-4o","messages":[]}"#;
        let sc = admin.send(
            "POST",
            "/_sim/scenario",
            &[],
            r#"{"max_concurrency":2,"latency_ms":600}"#,
        );
        assert_eq!(sc.status, 200, "{}", sc.body);

        // Five requests of one key at once, each held open 600 ms: two are served, three get
        // the dialect's 429 with a 1 s hint.
        let start_line = Arc::new(std::sync::Barrier::new(5));
        let clients: Vec<_> = (0..5)
            .map(|_| {
                let start_line = start_line.clone();
                thread::spawn(move || {
                    let mut c = Conn::open(addr);
                    start_line.wait();
                    c.send(
                        "POST",
                        "/v1/chat/completions",
                        &[("authorization", "Bearer sk-c")],
                        chat,
                    )
                })
            })
            .collect();
        let answers: Vec<Resp> = clients.into_iter().map(|t| t.join().unwrap()).collect();
        let ok = answers.iter().filter(|r| r.status == 200).count();
        let limited: Vec<&Resp> = answers.iter().filter(|r| r.status == 429).collect();
        assert_eq!((ok, limited.len()), (2, 3));
        for r in &limited {
            assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
            assert_eq!(r.header("retry-after"), Some("1"));
            // Not an exhausted requests-per-minute window.
            assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("59"));
        }
        let log = settled_log(&mut admin);
        assert_eq!(log["max_in_flight"], 2);
        assert_eq!(log["max_in_flight_by_key"]["sk-c"], 2);
        let entries = log["requests"].as_array().unwrap();
        let rejected: Vec<_> = entries
            .iter()
            .filter(|e| e["decision"] == "concurrency")
            .collect();
        assert_eq!(rejected.len(), 3);
        for e in rejected {
            assert_eq!(e["status"], 429);
            assert_eq!(e["hint_ms"], 1000);
            assert_eq!(e["in_flight_key"], 2);
        }
        assert_eq!(entries.iter().filter(|e| e["decision"] == "ok").count(), 2);

        // A stream holds its slot until its last event is written (no latency here).
        admin.send(
            "POST",
            "/_sim/scenario",
            &[],
            r#"{"max_concurrency":1,"stream_delay_ms":150}"#,
        );
        let streamer = thread::spawn(move || {
            Conn::open(addr).send(
                "POST",
                "/v1/messages",
                &[("x-api-key", "ak")],
                r#"{"stream":true}"#,
            )
        });
        let mut seen = false;
        for _ in 0..100 {
            if admin.send("GET", "/_sim/requests", &[], "").json()["in_flight"] == 1 {
                seen = true;
                break;
            }
            thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(seen, "the stream never showed as in flight");
        let mut c = Conn::open(addr);
        let r = c.send("POST", "/v1/messages", &[("x-api-key", "ak")], "{}");
        assert_eq!(r.status, 429);
        assert_eq!(r.json()["error"]["type"], "rate_limit_error");
        assert_eq!(r.header("retry-after"), Some("1"));
        let other = c.send("POST", "/v1/messages", &[("x-api-key", "ak2")], "{}");
        assert_eq!(other.status, 200);
        let streamed = streamer.join().unwrap();
        assert_eq!(streamed.status, 200);
        assert!(streamed.body.contains("event: message_stop"));
        settled_log(&mut admin);
        assert_eq!(
            c.send("POST", "/v1/messages", &[("x-api-key", "ak")], "{}")
                .status,
            200
        );
        let log = settled_log(&mut admin);
        assert_eq!(log["max_in_flight_by_key"]["ak"], 1);
        assert_eq!(log["max_in_flight"], 2);

        // Reset forgets the maxima.
        admin.send("POST", "/_sim/reset", &[], "");
        let log = admin.send("GET", "/_sim/requests", &[], "").json();
        assert_eq!(
            (
                &log["in_flight"],
                &log["max_in_flight"],
                &log["max_in_flight_by_key"]
            ),
            (&json!(0), &json!(0), &json!({}))
        );
    }

    #[test]
    fn server_tpm_answers_like_openai() {
        let addr = start();
        let mut c = Conn::open(addr);
        let sc = c.send("POST", "/_sim/scenario", &[], r#"{"tpm":{"tokens":1000}}"#);
        assert_eq!(sc.status, 200, "{}", sc.body);
        let auth = [("authorization", "Bearer sk-t")];
        let chat = format!(
            r#"{{"model":"gpt-4o","max_tokens":200,"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "word ".repeat(300)
        );
        let est = chat.len() as u64 / 4;
        let counted = est + 200;
        assert!((501..=1000).contains(&counted), "{counted}");

        // Served: usage is the estimate and min(max_tokens, 5); the headers are the bucket's.
        let r = c.send("POST", "/v1/chat/completions", &auth, &chat);
        assert_eq!(r.status, 200, "{}", r.body);
        let u = &r.json()["usage"];
        assert_eq!(
            (u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64()),
            (Some(est), Some(5))
        );
        assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("1000"));
        let remaining: u64 = r
            .header("x-ratelimit-remaining-tokens")
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(remaining, 1000 - counted);
        // Until full: `counted` tokens at 1,000 per minute (60 ms each).
        assert_eq!(
            r.header("x-ratelimit-reset-tokens"),
            Some(timefmt::go_duration_ms(counted * 60).as_str())
        );

        // The second does not fit: OpenAI's TPM 429, the hint in both headers.
        let r = c.send("POST", "/v1/chat/completions", &auth, &chat);
        assert_eq!(r.status, 429);
        let e = &r.json()["error"];
        assert_eq!(
            (e["code"].as_str(), e["type"].as_str()),
            (Some("rate_limit_exceeded"), Some("tokens"))
        );
        let msg = e["message"].as_str().unwrap();
        let want = format!("Rate limit reached for gpt-4o in organization org-sim on tokens per min (TPM): Limit 1000, Used {counted}, Requested {counted}. Please try again in ");
        assert!(msg.starts_with(&want), "{msg}");
        let hint_ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
        let full_wait = (2 * counted - 1000) * 60;
        assert!(
            (full_wait.saturating_sub(1000)..=full_wait).contains(&hint_ms),
            "{hint_ms}"
        );
        assert_eq!(
            r.header("retry-after"),
            Some(hint_ms.div_ceil(1000).to_string().as_str())
        );
        assert!(msg.contains(&format!(
            "try again in {}.",
            timefmt::go_duration_ms(hint_ms)
        )));
        let left: u64 = r
            .header("x-ratelimit-remaining-tokens")
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            (1000 - counted..=1000 - counted + 1).contains(&left),
            "{left}"
        );

        // A stream asked to include usage reports it in its last chunk.
        let stream = chat.replace(
            r#""max_tokens":200"#,
            r#""max_tokens":3,"stream":true,"stream_options":{"include_usage":true}"#,
        );
        let r = c.send(
            "POST",
            "/v1/chat/completions",
            &[("authorization", "Bearer sk-t2")],
            &stream,
        );
        assert_eq!(r.status, 200);
        let usage_chunk = r
            .body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .find(|v| v["usage"].is_object())
            .unwrap();
        let u = &usage_chunk["usage"];
        assert_eq!(
            (u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64()),
            (Some(stream.len() as u64 / 4), Some(3))
        );

        // The log has what was counted and why the 429.
        let log = c.send("GET", "/_sim/requests", &[], "").json();
        let entries = log["requests"].as_array().unwrap();
        let fields: Vec<_> = entries
            .iter()
            .map(|e| {
                (
                    e["decision"].as_str().unwrap().to_string(),
                    e["counted_tokens"].as_u64(),
                )
            })
            .collect();
        assert_eq!(
            fields,
            vec![
                ("ok".to_string(), Some(counted)),
                ("tokens_exhausted".to_string(), Some(counted)),
                ("ok".to_string(), Some(stream.len() as u64 / 4 + 3)),
            ]
        );
        assert_eq!(entries[1]["hint_ms"].as_u64(), Some(hint_ms));

        // Junk output limits are ignored (counted as the completion, 5), never a crash.
        for junk in [r#""-5""#, "-5", "1e400", "18446744073709551615"] {
            let body = format!(r#"{{"model":"gpt-4o","max_tokens":{junk},"messages":[]}}"#);
            let r = c.send(
                "POST",
                "/v1/chat/completions",
                &[("authorization", "Bearer sk-junk")],
                &body,
            );
            assert!(r.status == 200 || r.status == 429, "{junk}: {}", r.status);
        }
        let log = c.send("GET", "/_sim/requests", &[], "").json();
        let junk: Vec<_> = log["requests"].as_array().unwrap()[3..]
            .iter()
            .map(|e| {
                (
                    e["status"].as_u64(),
                    e["decision"].as_str().map(String::from),
                )
            })
            .collect();
        assert_eq!(junk[0], (Some(200), Some("ok".into())));
        assert_eq!(junk[1], (Some(200), Some("ok".into())));
        // 1e400 is not valid JSON: the body is not read at all, the count is the completion.
        assert_eq!(junk[2], (Some(200), Some("ok".into())));
        assert_eq!(junk[3], (Some(429), Some("tokens_too_large".into())));
    }

    #[test]
    fn server_rejects_malformed_http() {
        let addr = start();
        let mut c = Conn::open(addr);
        c.w.write_all(b"NOT HTTP AT ALL\r\n\r\n").unwrap();
        let r = read_resp(&mut c.r);
        assert_eq!(r.status, 400);
        assert_eq!(r.header("connection"), Some("close"));
        let mut rest = Vec::new();
        assert_eq!(c.r.read_to_end(&mut rest).unwrap(), 0);

        // Chunked request body over a real socket, then the connection stays usable.
        let mut c = Conn::open(addr);
        c.w.write_all(
            b"POST /v1/messages HTTP/1.1\r\nx-api-key: k\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{\"mo\r\nA\r\ndel\":\"m1\"}\r\n0\r\n\r\n",
        )
        .unwrap();
        let r = read_resp(&mut c.r);
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["model"], "m1");
        assert_eq!(c.send("GET", "/_sim/health", &[], "").status, 200);
    }
}

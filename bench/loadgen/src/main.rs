//! `bench-loadgen --addr 127.0.0.1:PORT --rate RPS --duration S [--conns C] [--warmup S]
//!  [--path P] [--header 'name: value']... [--tenants N] [--body JSON]`
//!
//! Each of C connections owns every C-th slot of one global timetable (slot j leaves at
//! start + j / rate), like wrk2. A connection that is still waiting when its next slot comes
//! sends late, and that lateness counts in the latency, which is measured from the slot.
//! Prints one JSON object: sent, answered, status counts, p50/p90/p99/p99.9/max in µs.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

struct Args {
    addr: String,
    rate: f64,
    duration: f64,
    warmup: f64,
    conns: usize,
    path: String,
    headers: Vec<String>,
    tenants: usize,
    body: String,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        addr: String::new(),
        rate: 1000.0,
        duration: 10.0,
        warmup: 1.0,
        conns: 16,
        path: "/v1/chat/completions".into(),
        headers: Vec::new(),
        tenants: 1000,
        body: r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#.into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--addr" => a.addr = v,
            "--rate" => a.rate = num(&v)?,
            "--duration" => a.duration = num(&v)?,
            "--warmup" => a.warmup = num(&v)?,
            "--conns" => a.conns = num(&v)? as usize,
            "--path" => a.path = v,
            "--header" => a.headers.push(v),
            "--tenants" => a.tenants = num(&v)? as usize,
            "--body" => a.body = v,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.addr.is_empty() || a.rate <= 0.0 || a.conns == 0 {
        return Err("--addr and a positive --rate and --conns are required".into());
    }
    Ok(a)
}

#[derive(Default)]
struct Tally {
    latencies_ns: Vec<u64>,
    statuses: Vec<(u16, u64)>,
    errors: u64,
    sent: u64,
}

impl Tally {
    fn status(&mut self, s: u16) {
        match self.statuses.iter_mut().find(|(c, _)| *c == s) {
            Some((_, n)) => *n += 1,
            None => self.statuses.push((s, 1)),
        }
    }
}

/// Read one HTTP/1.1 response with a Content-Length body; returns its status and whether the
/// server is closing the connection.
fn read_response(r: &mut BufReader<TcpStream>, line: &mut String) -> std::io::Result<(u16, bool)> {
    line.clear();
    r.read_line(line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
    let mut len = 0usize;
    let mut close = false;
    loop {
        line.clear();
        if r.read_line(line)? == 0 {
            return Err(std::io::Error::other("connection closed"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((n, v)) = l.split_once(':') {
            if n.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            } else if n.eq_ignore_ascii_case("connection") {
                close = v.trim().eq_ignore_ascii_case("close");
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok((status, close))
}

fn connect(addr: &str) -> std::io::Result<(TcpStream, BufReader<TcpStream>)> {
    let s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let r = BufReader::with_capacity(64 * 1024, s.try_clone()?);
    Ok((s, r))
}

fn worker(a: &Args, me: usize, start: Instant, requests: &[Vec<u8>]) -> Tally {
    let mut t = Tally::default();
    let interval = 1.0 / a.rate;
    let total = ((a.warmup + a.duration) * a.rate) as usize;
    let warm = (a.warmup * a.rate) as usize;
    let mut conn = None;
    let mut line = String::new();
    let mut j = me;
    while j < total {
        let due = start + Duration::from_secs_f64(j as f64 * interval);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if conn.is_none() {
            conn = connect(&a.addr).ok();
        }
        let outcome = match conn.as_mut() {
            Some((s, r)) => s
                .write_all(&requests[j % requests.len()])
                .and_then(|_| read_response(r, &mut line)),
            None => Err(std::io::Error::other("connect failed")),
        };
        let done = Instant::now();
        let failed = !matches!(outcome, Ok((_, false)));
        if j >= warm {
            t.sent += 1;
            match outcome {
                Ok((status, _)) => {
                    t.status(status);
                    t.latencies_ns
                        .push(done.duration_since(due).as_nanos() as u64);
                }
                Err(_) => t.errors += 1,
            }
        }
        if failed {
            conn = None;
        }
        j += a.conns;
    }
    t
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench-loadgen: {e}");
            std::process::exit(2);
        }
    };
    // Default timer slack (50 µs) would land in every measured latency.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1, 0, 0, 0);
    }
    let host = a.addr.clone();
    let requests: Vec<Vec<u8>> = (0..a.tenants.max(1))
        .map(|i| {
            let mut r = format!(
                "POST {} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nx-tenant-id: tenant-{i}\r\n",
                a.path,
                a.body.len()
            );
            for h in &a.headers {
                r.push_str(h);
                r.push_str("\r\n");
            }
            r.push_str("\r\n");
            r.push_str(&a.body);
            r.into_bytes()
        })
        .collect();
    let start = Instant::now() + Duration::from_millis(100);
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..a.conns)
            .map(|i| {
                let (a, requests) = (&a, &requests);
                s.spawn(move || worker(a, i, start, requests))
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let mut all = Tally::default();
    for t in tallies {
        all.latencies_ns.extend(t.latencies_ns);
        all.errors += t.errors;
        all.sent += t.sent;
        for (s, n) in t.statuses {
            for _ in 0..n {
                all.status(s);
            }
        }
    }
    all.latencies_ns.sort_unstable();
    let pct = |p: f64| -> f64 {
        if all.latencies_ns.is_empty() {
            return 0.0;
        }
        let i = ((p / 100.0) * (all.latencies_ns.len() as f64 - 1.0)).round() as usize;
        all.latencies_ns[i] as f64 / 1000.0
    };
    let statuses: Vec<String> = all
        .statuses
        .iter()
        .map(|(s, n)| format!("\"{s}\":{n}"))
        .collect();
    println!(
        "{{\"rate\":{},\"sent\":{},\"answered\":{},\"errors\":{},\"status\":{{{}}},\"p50_us\":{:.1},\"p90_us\":{:.1},\"p99_us\":{:.1},\"p999_us\":{:.1},\"max_us\":{:.1}}}",
        a.rate,
        all.sent,
        all.latencies_ns.len(),
        all.errors,
        statuses.join(","),
        pct(50.0),
        pct(90.0),
        pct(99.0),
        pct(99.9),
        pct(100.0)
    );
}

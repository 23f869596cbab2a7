//! The command line (plain std: no argument-parsing crate).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::fault::Answer;
use crate::service::RateLimitHeaders;

pub const USAGE: &str = "\
limitador-rls: a Limitador-compatible rate-limit service (test fixture for llm-governor)

USAGE: limitador-rls [OPTIONS]

  --listen ADDR                    gRPC address, loopback only (default 127.0.0.1:8081;
                                   port 0 picks a free one; the chosen one is printed)
  --limits FILE                    Limitador limits YAML (default: no limits); re-read when it
                                   changes
  --limits-poll-ms N               how often FILE is checked for changes (default 1000; 0: never)
  --redis URL                      counters and reservations in Redis (e.g. redis://127.0.0.1:6379)
  --memory                         counters and reservations in this process (the default)
  --redis-timeout-ms N             Redis response and connection timeout (default 350); a whole
                                   call gets 2 x N before it is answered UNAVAILABLE
  --rate-limit-headers MODE        NONE (default) or DRAFT_VERSION_03
  --max-reservation-ttl-ms N       ceiling of a Reserve's ttl (default 60000)
  --max-reservation-fraction F     one hold is at most F x a limit's max_value, 0 < F <= 1
                                   (default 0.5)
  --delay-ms N                     every answer leaves N ms late (default 0)
  --toggle-delay-ms N              the delay SIGUSR1 switches to and back from (default 1000)
  --answer MODE                    ok (default), garbage (bytes that are no protobuf message),
                                   unavailable (gRPC UNAVAILABLE), no-reservations (Reserve
                                   and Commit answer UNIMPLEMENTED, as limitador-server
                                   released before its reservations does) or no-check
                                   (CheckRateLimit answers UNIMPLEMENTED, as a server with
                                   Envoy's RLS alone does)
  -h, --help / -V, --version

Run time: GET or POST /faults[?delay_ms=N][&answer=MODE] (HTTP/1.1 on the gRPC port) sets what
the query names and answers the faults as JSON. SIGUSR1 swaps the delay between --delay-ms and
--toggle-delay-ms.
On start it prints one line to stdout: `limitador-rls listening on 127.0.0.1:PORT`.
";

#[derive(Clone, Debug, PartialEq)]
pub enum StorageKind {
    Memory,
    Redis(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub listen: SocketAddr,
    pub limits: Option<PathBuf>,
    pub limits_poll: Duration,
    pub storage: StorageKind,
    pub redis_timeout: Duration,
    pub rate_limit_headers: RateLimitHeaders,
    pub max_reservation_ttl: Duration,
    pub max_reservation_fraction: f64,
    pub delay_ms: u64,
    pub toggle_delay_ms: u64,
    pub answer: Answer,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            listen: SocketAddr::from(([127, 0, 0, 1], 8081)),
            limits: None,
            limits_poll: Duration::from_millis(1000),
            storage: StorageKind::Memory,
            redis_timeout: Duration::from_millis(350),
            rate_limit_headers: RateLimitHeaders::None,
            max_reservation_ttl: Duration::from_millis(60_000),
            max_reservation_fraction: 0.5,
            delay_ms: 0,
            toggle_delay_ms: 1000,
            answer: Answer::Ok,
        }
    }
}

/// What the command line asks for.
#[derive(Debug, PartialEq)]
pub enum Command {
    Run(Settings),
    Help,
    Version,
}

fn number<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse::<T>()
        .map_err(|_| format!("{flag}: not a valid number: {v:?}"))
}

/// Parses the arguments (without the program name).
pub fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Command, String> {
    let mut s = Settings::default();
    let mut memory = false;
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        let flag = flag.as_str();
        if matches!(flag, "-h" | "--help") {
            return Ok(Command::Help);
        }
        if matches!(flag, "-V" | "--version") {
            return Ok(Command::Version);
        }
        if flag == "--memory" {
            memory = true;
            continue;
        }
        // Accept both `--flag value` and `--flag=value`.
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (flag, None),
        };
        let mut value = || -> Result<String, String> {
            match &inline {
                Some(v) => Ok(v.clone()),
                None => args.next().ok_or_else(|| format!("{flag} needs a value")),
            }
        };
        match flag {
            "--listen" => {
                let v = value()?;
                let addr: SocketAddr = v
                    .parse()
                    .map_err(|_| format!("--listen: not IP:PORT: {v:?}"))?;
                if !addr.ip().is_loopback() {
                    return Err(format!("--listen: loopback addresses only, got {addr}"));
                }
                s.listen = addr;
            }
            "--limits" => s.limits = Some(PathBuf::from(value()?)),
            "--limits-poll-ms" => {
                s.limits_poll = Duration::from_millis(number(flag, &value()?)?)
            }
            "--redis" => {
                let v = value()?;
                if !(v.starts_with("redis://") || v.starts_with("redis+unix://") || v.starts_with("unix://")) {
                    return Err(format!("--redis: expected redis://HOST:PORT, got {v:?}"));
                }
                s.storage = StorageKind::Redis(v);
            }
            "--redis-timeout-ms" => {
                let ms: u64 = number(flag, &value()?)?;
                if ms == 0 {
                    return Err("--redis-timeout-ms must be at least 1".into());
                }
                s.redis_timeout = Duration::from_millis(ms);
            }
            "--rate-limit-headers" => {
                let v = value()?;
                s.rate_limit_headers = RateLimitHeaders::parse(&v).ok_or_else(|| {
                    format!("--rate-limit-headers: NONE or DRAFT_VERSION_03, got {v:?}")
                })?;
            }
            "--max-reservation-ttl-ms" => {
                let ms: u64 = number(flag, &value()?)?;
                if ms == 0 {
                    return Err("--max-reservation-ttl-ms must be at least 1".into());
                }
                s.max_reservation_ttl = Duration::from_millis(ms);
            }
            "--max-reservation-fraction" => {
                let f: f64 = number(flag, &value()?)?;
                if !(f > 0.0 && f <= 1.0) {
                    return Err(format!("--max-reservation-fraction: 0 < F <= 1, got {f}"));
                }
                s.max_reservation_fraction = f;
            }
            "--delay-ms" => s.delay_ms = number(flag, &value()?)?,
            "--toggle-delay-ms" => s.toggle_delay_ms = number(flag, &value()?)?,
            "--answer" => {
                let v = value()?;
                s.answer = Answer::parse(&v).ok_or_else(|| {
                    format!("--answer: ok, garbage, unavailable, no-reservations or no-check, got {v:?}")
                })?;
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    if memory && matches!(s.storage, StorageKind::Redis(_)) {
        return Err("--memory and --redis exclude each other".into());
    }
    Ok(Command::Run(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, String> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn defaults_are_the_servers() {
        let Command::Run(s) = parse(&[]).unwrap() else {
            panic!()
        };
        assert_eq!(s.storage, StorageKind::Memory);
        assert_eq!(s.max_reservation_ttl, Duration::from_secs(60));
        assert_eq!(s.max_reservation_fraction, 0.5);
        assert_eq!(s.rate_limit_headers, RateLimitHeaders::None);
        assert_eq!(s.listen.port(), 8081);
    }

    #[test]
    fn all_flags() {
        let Command::Run(s) = parse(&[
            "--listen",
            "127.0.0.1:0",
            "--limits=/tmp/l.yaml",
            "--redis",
            "redis://127.0.0.1:6390",
            "--redis-timeout-ms",
            "200",
            "--rate-limit-headers",
            "DRAFT_VERSION_03",
            "--max-reservation-ttl-ms",
            "5000",
            "--max-reservation-fraction",
            "1.0",
            "--delay-ms",
            "10",
            "--toggle-delay-ms",
            "3000",
            "--answer",
            "garbage",
        ])
        .unwrap() else {
            panic!()
        };
        assert_eq!(s.listen.port(), 0);
        assert_eq!(s.limits, Some(PathBuf::from("/tmp/l.yaml")));
        assert_eq!(s.storage, StorageKind::Redis("redis://127.0.0.1:6390".into()));
        assert_eq!(s.redis_timeout, Duration::from_millis(200));
        assert_eq!(s.rate_limit_headers, RateLimitHeaders::DraftVersion03);
        assert_eq!(s.max_reservation_ttl, Duration::from_secs(5));
        assert_eq!(s.max_reservation_fraction, 1.0);
        assert_eq!((s.delay_ms, s.toggle_delay_ms), (10, 3000));
        assert_eq!(s.answer, Answer::Garbage);
    }

    #[test]
    fn rejects() {
        assert!(parse(&["--listen", "0.0.0.0:1"]).is_err());
        assert!(parse(&["--max-reservation-fraction", "0"]).is_err());
        assert!(parse(&["--max-reservation-fraction", "1.5"]).is_err());
        assert!(parse(&["--rate-limit-headers", "draft"]).is_err());
        assert!(parse(&["--answer", "slow"]).is_err());
        assert!(parse(&["--memory", "--redis", "redis://127.0.0.1:1"]).is_err());
        assert!(parse(&["--redis", "127.0.0.1:6379"]).is_err());
        assert!(parse(&["--delay-ms"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
        assert_eq!(parse(&["-h"]).unwrap(), Command::Help);
    }
}

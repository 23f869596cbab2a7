//! The binary as a test would run it: the ready line, `/faults` (garbage, unavailable, delay)
//! and SIGUSR1. Faults are process-wide, so everything here runs against child processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use limitador_rls::pb::Code;

const LIMITS: &str = "- {namespace: f, max_value: 1000, seconds: 60, conditions: [], variables: []}\n";

struct Instance {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(args: &[&str]) -> Instance {
    let limits = limits_file(&format!("faults-{}", free_port()), LIMITS);
    let mut child = Command::new(env!("CARGO_BIN_EXE_limitador-rls"))
        .args(["--memory", "--listen", "127.0.0.1:0", "--limits"])
        .arg(&limits)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("limitador-rls listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    Instance { child, addr }
}

/// One HTTP/1.1 request to `/faults`; returns (status line, body).
fn http(addr: SocketAddr, method: &str, target: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.lines().next().unwrap_or("").to_string();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

async fn should(addr: SocketAddr, timeout_ms: u64) -> (Result<i32, tonic::Status>, Duration) {
    let mut c = limitador_rls::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(channel(addr, timeout_ms));
    let t = Instant::now();
    let r = c
        .should_rate_limit(rls_request("f", &[("k", "v")], 1))
        .await
        .map(|r| r.into_inner().overall_code);
    (r, t.elapsed())
}

#[tokio::test]
async fn faults_over_http() {
    let i = spawn(&[]);
    assert_eq!(should(i.addr, 2000).await.0.unwrap(), Code::Ok as i32);

    let (status, body) = http(i.addr, "GET", "/faults");
    assert!(status.contains("200"), "{status}");
    assert_eq!(body, "{\"delay_ms\":0,\"answer\":\"ok\"}\n");

    let (status, _) = http(i.addr, "POST", "/faults?answer=garbage");
    assert!(status.contains("200"), "{status}");
    let err = should(i.addr, 2000).await.0.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal, "{err:?}");

    http(i.addr, "POST", "/faults?answer=unavailable");
    let err = should(i.addr, 2000).await.0.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");

    let (_, body) = http(i.addr, "POST", "/faults?answer=ok&delay_ms=300");
    assert_eq!(body, "{\"delay_ms\":300,\"answer\":\"ok\"}\n");
    let (r, took) = should(i.addr, 2000).await;
    assert_eq!(r.unwrap(), Code::Ok as i32);
    assert!(took >= Duration::from_millis(300), "{took:?}");
    let (r, took) = should(i.addr, 100).await;
    assert!(r.is_err());
    assert!(took < Duration::from_millis(290), "{took:?}");

    let (status, _) = http(i.addr, "POST", "/faults?answer=slow");
    assert!(status.contains("400"), "{status}");
}

#[tokio::test]
async fn start_flags_and_sigusr1() {
    let i = spawn(&["--answer", "unavailable"]);
    assert_eq!(
        should(i.addr, 2000).await.0.unwrap_err().code(),
        tonic::Code::Unavailable
    );
    drop(i);

    let i = spawn(&["--delay-ms", "0", "--toggle-delay-ms", "400"]);
    let (r, took) = should(i.addr, 2000).await;
    assert_eq!(r.unwrap(), Code::Ok as i32);
    assert!(took < Duration::from_millis(300), "{took:?}");
    let usr1 = || {
        let ok = Command::new("kill")
            .args(["-USR1", &i.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
        std::thread::sleep(Duration::from_millis(100));
    };
    usr1();
    let (r, took) = should(i.addr, 2000).await;
    assert_eq!(r.unwrap(), Code::Ok as i32);
    assert!(took >= Duration::from_millis(400), "{took:?}");
    usr1();
    let (_, took) = should(i.addr, 2000).await;
    assert!(took < Duration::from_millis(300), "{took:?}");
}

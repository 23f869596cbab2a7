//! Two instances on one Redis share counters and reservations; Redis down is UNAVAILABLE
//! fast; Redis back is OK again without a restart. Skipped (with a message) when
//! `redis-server` is not on PATH.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use limitador_rls::config::{Settings, StorageKind};
use limitador_rls::pb::{descriptor, Code, CommitRequest, ReserveRequest};
use limitador_rls::server::start;

const LIMITS: &str = r#"
- namespace: shared
  max_value: 5
  seconds: 60
  conditions: ["descriptors[0].kind == 'req'"]
  variables: ["descriptors[0].account"]
- namespace: shared
  max_value: 100
  seconds: 60
  conditions: ["descriptors[0].kind == 'tok'"]
  variables: ["descriptors[0].account"]
"#;

fn redis(port: u16) -> Child {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server");
    let until = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < until, "redis-server did not start on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

async fn instance(url: &str, limits: &std::path::Path) -> SocketAddr {
    let settings = Settings {
        listen: "127.0.0.1:0".parse().unwrap(),
        limits: Some(limits.to_path_buf()),
        storage: StorageKind::Redis(url.to_string()),
        redis_timeout: Duration::from_millis(200),
        ..Settings::default()
    };
    start(&settings).await.unwrap().addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_redis_and_survive_its_restart() {
    if Command::new("redis-server").arg("--version").output().is_err() {
        eprintln!("SKIPPED: redis-server is not installed");
        return;
    }
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let mut server = redis(port);
    let limits = limits_file("shared", LIMITS);
    let a = instance(&url, &limits).await;
    let b = instance(&url, &limits).await;
    let (mut ea, mut eb) = (envoy(a), envoy(b));
    let req = |hits| rls_request("shared", &[("kind", "req"), ("account", "acme")], hits);

    // One counter of 5 across both instances.
    let code = |r: tonic::Response<limitador_rls::pb::RateLimitResponse>| r.into_inner().overall_code;
    assert_eq!(code(ea.should_rate_limit(req(3)).await.unwrap()), Code::Ok as i32);
    assert_eq!(code(eb.should_rate_limit(req(2)).await.unwrap()), Code::Ok as i32);
    assert_eq!(code(ea.should_rate_limit(req(1)).await.unwrap()), Code::OverLimit as i32);
    assert_eq!(code(eb.should_rate_limit(req(1)).await.unwrap()), Code::OverLimit as i32);

    // A hold made on A is seen on B, and B can settle it.
    let (mut ka, mut kb) = (kuadrant(a), kuadrant(b));
    let tok = || vec![descriptor([("kind", "tok"), ("account", "acme")])];
    let reserve = |amount| ReserveRequest {
        domain: "shared".into(),
        descriptors: tok(),
        amount,
        ttl: Some(prost_types::Duration { seconds: 30, nanos: 0 }),
    };
    let held = ka.reserve(reserve(50)).await.unwrap().into_inner();
    assert_eq!(held.code, Code::Ok as i32);
    assert!(!held.reservation_id.is_empty());
    assert_eq!(kb.reserve(reserve(51)).await.unwrap().into_inner().code, Code::OverLimit as i32);
    let settled = kb
        .commit(CommitRequest {
            domain: "shared".into(),
            descriptors: tok(),
            reservation_id: held.reservation_id.clone(),
            actual_amount: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(settled.reservation_released);
    assert_eq!(ka.reserve(reserve(90)).await.unwrap().into_inner().code, Code::Ok as i32);

    // Redis down: UNAVAILABLE, fast, on every call.
    server.kill().unwrap();
    server.wait().unwrap();
    for _ in 0..3 {
        let t = Instant::now();
        let err = ea.should_rate_limit(req(1)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert!(t.elapsed() < Duration::from_millis(600), "took {:?}", t.elapsed());
        let err = ka.reserve(reserve(1)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    }

    // Redis back (empty: no persistence): OK again, no restart of either instance; after a
    // heartbeat or two the very first call is OK.
    let mut server = redis(port);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(code(ea.should_rate_limit(req(1)).await.unwrap()), Code::Ok as i32);
    for (name, client) in [("a", &mut ea), ("b", &mut eb)] {
        let until = Instant::now() + Duration::from_secs(3);
        loop {
            match client.should_rate_limit(req(1)).await {
                Ok(r) => {
                    assert_eq!(r.into_inner().overall_code, Code::Ok as i32);
                    break;
                }
                Err(e) => {
                    assert_eq!(e.code(), tonic::Code::Unavailable);
                    assert!(Instant::now() < until, "instance {name} did not recover: {e:?}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    let r = ka.reserve(reserve(10)).await.unwrap().into_inner();
    assert_eq!(r.code, Code::Ok as i32);
    server.kill().unwrap();
    server.wait().unwrap();
    std::fs::remove_file(limits).ok();
}

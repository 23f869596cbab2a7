#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use limitador_rls::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient as EnvoyClient;
use limitador_rls::pb::kuadrant::service::ratelimit::v1::rate_limit_service_client::RateLimitServiceClient as KuadrantClient;
use limitador_rls::pb::{descriptor, RateLimitRequest};
use tonic::transport::{Channel, Endpoint};

pub fn channel(addr: SocketAddr, timeout_ms: u64) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_millis(timeout_ms))
        .timeout(Duration::from_millis(timeout_ms))
        .connect_lazy()
}

pub fn envoy(addr: SocketAddr) -> EnvoyClient<Channel> {
    EnvoyClient::new(channel(addr, 3000))
}

pub fn kuadrant(addr: SocketAddr) -> KuadrantClient<Channel> {
    KuadrantClient::new(channel(addr, 3000))
}

pub fn rls_request(domain: &str, entries: &[(&str, &str)], hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: vec![descriptor(entries.iter().copied())],
        hits_addend: hits,
    }
}

/// A limits file in the temp dir, unique to this test.
pub fn limits_file(name: &str, yaml: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "limitador-rls-test-{}-{name}.yaml",
        std::process::id()
    ));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

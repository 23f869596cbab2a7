//! Putting it together: the limiter from the settings, the limits file (loaded at start,
//! polled for changes), the gRPC services plus `/faults` on one port.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::http::{StatusCode, Uri};
use limitador::reservation::ReservationLimits;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;
use tonic::service::Routes;

use crate::config::{Settings, StorageKind};
use crate::fault::faults;
use crate::limiter::Limiter;
use crate::limits::load_limits;
use crate::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer as EnvoyServer;
use crate::pb::kuadrant::service::ratelimit::v1::rate_limit_service_server::RateLimitServiceServer as KuadrantServer;
use crate::service::Rls;

/// The limiter the settings ask for, with the limits file loaded (`configure_with`).
pub async fn build_limiter(settings: &Settings) -> Result<Arc<Limiter>, String> {
    let reservations = ReservationLimits {
        max_fraction: settings.max_reservation_fraction,
        max_ttl: settings.max_reservation_ttl,
    };
    let limiter = match &settings.storage {
        StorageKind::Memory => Limiter::memory(reservations),
        StorageKind::Redis(url) => Limiter::redis(url, settings.redis_timeout, reservations).await?,
    };
    if let Some(path) = &settings.limits {
        let limits = load_limits(path)?;
        limiter
            .configure_with(limits)
            .await
            .map_err(|e| format!("{}: cannot apply the limits: {e}", path.display()))?;
    }
    Ok(Arc::new(limiter))
}

/// `GET|POST /faults[?delay_ms=N][&answer=MODE]`: applies what the query names, answers the state.
async fn faults_handler(uri: Uri) -> (StatusCode, String) {
    match faults().apply_query(uri.query().unwrap_or("")) {
        Ok(()) => (StatusCode::OK, faults().to_json()),
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

/// Both gRPC services and `/faults`.
pub fn routes(rls: Rls) -> Routes {
    let mut routes = Routes::new(EnvoyServer::new(rls.clone())).add_service(KuadrantServer::new(rls));
    let router = std::mem::take(routes.axum_router_mut());
    *routes.axum_router_mut() = router.route(
        "/faults",
        axum::routing::get(faults_handler).post(faults_handler),
    );
    routes
}

/// A running instance.
pub struct Running {
    pub addr: SocketAddr,
    pub server: JoinHandle<Result<(), String>>,
}

/// Binds, loads, and serves in the background. The caller prints the address.
pub async fn start(settings: &Settings) -> Result<Running, String> {
    let limiter = build_limiter(settings).await?;
    let listener = TcpListener::bind(settings.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", settings.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("--listen {}: {e}", settings.listen))?;
    if let (Some(path), false) = (&settings.limits, settings.limits_poll.is_zero()) {
        tokio::spawn(watch_limits(
            path.clone(),
            settings.limits_poll,
            Arc::clone(&limiter),
            settings.redis_timeout * 2,
        ));
    }
    let rls = Rls::new(limiter, settings.rate_limit_headers, settings.redis_timeout * 2);
    let server = tonic::transport::Server::builder()
        .accept_http1(true)
        .add_routes(routes(rls))
        .serve_with_incoming(TcpListenerStream::new(listener).map(no_delay));
    let server = tokio::spawn(async move { server.await.map_err(|e| e.to_string()) });
    Ok(Running { addr, server })
}

/// Answers go out at once (TCP_NODELAY), as a rate-limit service's must: with Nagle's
/// algorithm on, a second answer on an HTTP/2 connection waits for the client's delayed ACK of
/// the first (~40 ms on Linux), which shows as a 40 ms call whenever two calls overlap.
fn no_delay(conn: std::io::Result<tokio::net::TcpStream>) -> std::io::Result<tokio::net::TcpStream> {
    let conn = conn?;
    conn.set_nodelay(true)?;
    Ok(conn)
}

fn stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Re-reads the limits file when its modification time or size changes. A file that does
/// not parse leaves the limits as they were.
async fn watch_limits(path: PathBuf, every: Duration, limiter: Arc<Limiter>, deadline: Duration) {
    let mut seen = stamp(&path);
    loop {
        tokio::time::sleep(every).await;
        let now = stamp(&path);
        if now.is_none() || now == seen {
            continue;
        }
        seen = now;
        match load_limits(&path) {
            Err(e) => eprintln!("limitador-rls: limits not reloaded: {e}"),
            Ok(limits) => {
                let n = limits.len();
                match tokio::time::timeout(deadline, limiter.configure_with(limits)).await {
                    Ok(Ok(())) => eprintln!("limitador-rls: reloaded {n} limits from {}", path.display()),
                    Ok(Err(e)) => eprintln!("limitador-rls: limits not reloaded: {e}"),
                    Err(_) => eprintln!("limitador-rls: limits not reloaded: the storage did not answer"),
                }
            }
        }
    }
}

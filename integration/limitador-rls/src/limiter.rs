//! The limiter: the `limitador` crate's `RateLimiter` over its in-memory storage, or its
//! `AsyncRateLimiter` over its plain async Redis storage (not `redis_cached`: counters and
//! reservations live in Redis only, so instances on one Redis share them).

use std::time::Duration;

use limitador::errors::LimitadorError;
use limitador::limit::{Context, Limit, Namespace};
use limitador::reservation::{CommitResult, ReservationId, ReservationLimits, ReserveResult};
use limitador::storage::redis::AsyncRedisStorage;
use limitador::{AsyncRateLimiter, AsyncRateLimiterBuilder, CheckResult, RateLimiterBuilder};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

type Result<T> = std::result::Result<T, LimitadorError>;

/// How many counters the in-memory storage keeps (Limitador's default cache size).
pub const MEMORY_CACHE_SIZE: u64 = 10_000;

/// How often the Redis connection is pinged (see [`Limiter::redis`]).
pub const HEARTBEAT: Duration = Duration::from_millis(200);

pub enum Limiter {
    Memory(limitador::RateLimiter),
    Redis(AsyncRateLimiter),
}

impl Limiter {
    pub fn memory(reservations: ReservationLimits) -> Limiter {
        Limiter::Memory(
            RateLimiterBuilder::new(MEMORY_CACHE_SIZE)
                .reservation_limits(reservations)
                .build(),
        )
    }

    /// Connects to Redis (once: it fails at once if Redis is not there). Every command has a
    /// response timeout and every (re)connection attempt a connection timeout of `timeout`; a
    /// lost connection is re-opened by the next command, with no retry loop, so while Redis is
    /// down each command fails within about `timeout` instead of waiting on back-off.
    ///
    /// A background `PING` every [`HEARTBEAT`] keeps the connection state fresh, so the first
    /// call after Redis comes back finds a live connection instead of being the one that
    /// notices and re-opens it (answered `UNAVAILABLE`).
    pub async fn redis(
        url: &str,
        timeout: Duration,
        reservations: ReservationLimits,
    ) -> std::result::Result<Limiter, String> {
        let client = redis::Client::open(url).map_err(|e| format!("--redis {url}: {e}"))?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(timeout)
            .set_connection_timeout(timeout)
            .set_number_of_retries(0);
        let manager = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| format!("cannot connect to Redis at {url}: {e}"))?;
        let mut heartbeat = manager.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(HEARTBEAT).await;
                let _: redis::RedisResult<String> =
                    redis::cmd("PING").query_async(&mut heartbeat).await;
            }
        });
        let storage = AsyncRedisStorage::new_with_conn_manager(manager)
            .await
            .map_err(|e| format!("cannot load Limitador's scripts into Redis at {url}: {e}"))?;
        let storage = limitador::storage::AsyncStorage::with_counter_storage(Box::new(storage));
        Ok(Limiter::Redis(
            AsyncRateLimiterBuilder::new(storage)
                .reservation_limits(reservations)
                .build(),
        ))
    }

    pub fn storage_name(&self) -> &'static str {
        match self {
            Limiter::Memory(_) => "memory",
            Limiter::Redis(_) => "redis",
        }
    }

    /// `ShouldRateLimit`: check and, if no limit is exceeded, add `delta` to every counter.
    pub async fn check_rate_limited_and_update(
        &self,
        ns: &Namespace,
        ctx: &Context<'_>,
        delta: u64,
    ) -> Result<CheckResult> {
        match self {
            Limiter::Memory(l) => l.check_rate_limited_and_update(ns, ctx, delta),
            Limiter::Redis(l) => l.check_rate_limited_and_update(ns, ctx, delta).await,
        }
    }

    /// `CheckRateLimit`: check only.
    pub async fn is_rate_limited(
        &self,
        ns: &Namespace,
        ctx: &Context<'_>,
        delta: u64,
    ) -> Result<CheckResult> {
        match self {
            Limiter::Memory(l) => l.is_rate_limited(ns, ctx, delta),
            Limiter::Redis(l) => l.is_rate_limited(ns, ctx, delta).await,
        }
    }

    /// `Report`: add `delta` whatever the counters' values.
    pub async fn update_counters(&self, ns: &Namespace, ctx: &Context<'_>, delta: u64) -> Result<()> {
        match self {
            Limiter::Memory(l) => l.update_counters(ns, ctx, delta),
            Limiter::Redis(l) => l.update_counters(ns, ctx, delta).await,
        }
    }

    pub async fn reserve(
        &self,
        ns: &Namespace,
        ctx: &Context<'_>,
        amount: u64,
        ttl: Option<Duration>,
    ) -> Result<ReserveResult> {
        match self {
            Limiter::Memory(l) => l.reserve(ns, ctx, amount, ttl),
            Limiter::Redis(l) => l.reserve(ns, ctx, amount, ttl).await,
        }
    }

    pub async fn commit_reservation(
        &self,
        ns: &Namespace,
        ctx: &Context<'_>,
        id: Option<&ReservationId>,
        actual: u64,
    ) -> Result<CommitResult> {
        match self {
            Limiter::Memory(l) => l.commit_reservation(ns, ctx, id, actual),
            Limiter::Redis(l) => l.commit_reservation(ns, ctx, id, actual).await,
        }
    }

    /// Replaces the limits (counters of limits that stay are kept).
    pub async fn configure_with(&self, limits: Vec<Limit>) -> Result<()> {
        match self {
            Limiter::Memory(l) => l.configure_with(limits),
            Limiter::Redis(l) => l.configure_with(limits).await,
        }
    }
}

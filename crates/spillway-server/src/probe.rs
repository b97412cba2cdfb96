//! The store probe: while the store is Redis, one peek every
//! [`PROBE_INTERVAL`] ([`RedisStore::probe`](spillway_redis::RedisStore::probe)),
//! so that `/readyz` and `spillway_store_healthy` see a dead Redis, and a
//! Redis back again, without waiting for traffic, and the store logs each
//! change of state on an idle service too.

use std::sync::Arc;
use std::time::Duration;

use crate::state::Live;

/// How often the store is probed.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// The longest a probe waits, beyond the store's own timeout (a cluster
/// that reconnects can take longer than one call).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The key the probe peeks at: a NUL byte first, which no HTTP client can
/// put in a key the rules read.
const PROBE_KEY: &str = "\u{0}spillway-probe";

/// Probes the store of the engine in use every [`PROBE_INTERVAL`] until
/// `stopped` resolves. With Redis healthy, `/readyz` turns unready within
/// `PROBE_INTERVAL` plus the store's timeout of Redis's death (at once if
/// a request finds it first).
pub async fn watch_store(live: Arc<Live>, stopped: impl Future<Output = ()>) {
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            () = &mut stopped => return,
            _ = tick.tick() => {}
        }
        let engine = live.current();
        if let Some(redis) = engine.store().redis() {
            // A failure is the breaker's to log, once.
            let _ = tokio::time::timeout(PROBE_TIMEOUT, redis.probe(PROBE_KEY)).await;
        }
    }
}

//! The local deny cache: once Redis has denied a key with a `retry_after`,
//! this instance denies that key again on its own until then, so a client
//! hammering while denied (an attacker, a retry loop) costs no round trip.
//!
//! Exactness: the entry expires at `sent + retry_after`, where `sent` is when
//! the request that was denied left this process, which is no later than the
//! server's clock reading. So the cache never denies a request that Redis
//! would admit. The `Retry-After` it reports counts from when the answer
//! arrived, so it never tells a client to come back too early either.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use spillway::Decision;
use tokio::time::Instant;

const SHARDS: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Entry {
    // Deny requests of at least `cost` until then.
    until: Instant,
    cost: u64,
    // What Redis said, and when the answer arrived.
    decision: Decision,
    received: Instant,
}

#[derive(Debug)]
pub(crate) struct DenyCache {
    shards: Vec<Mutex<HashMap<Box<str>, Entry>>>,
    max_per_shard: usize,
}

impl DenyCache {
    pub(crate) fn new(max_entries: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            max_per_shard: max_entries.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<Box<str>, Entry>> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let h = BuildHasherDefault::<DefaultHasher>::default().hash_one(key);
        &self.shards[(h % SHARDS as u64) as usize]
    }

    /// The cached denial for a request of `cost` on `key` (a Redis key,
    /// which names the rule too), with its times brought up to `now`.
    pub(crate) fn lookup(&self, key: &str, cost: u64, now: Instant) -> Option<Decision> {
        let shard = self.shard(key).lock();
        let entry = shard.get(key)?;
        if now >= entry.until || cost < entry.cost {
            return None;
        }
        let waited = now.saturating_duration_since(entry.received);
        let mut d = entry.decision;
        d.retry_after = d
            .retry_after
            .map(|r| r.saturating_sub(waited).max(Duration::from_micros(1)));
        d.reset_after = d.reset_after.saturating_sub(waited);
        Some(d)
    }

    /// Remembers a denial that Redis answered: the request left at `sent`
    /// and the answer arrived at `received`.
    pub(crate) fn record(
        &self,
        key: &str,
        cost: u64,
        decision: Decision,
        sent: Instant,
        received: Instant,
    ) {
        let Some(retry_after) = decision.retry_after else {
            return;
        };
        let entry = Entry {
            until: sent + retry_after,
            cost,
            decision,
            received,
        };
        let mut shard = self.shard(key).lock();
        if shard.len() >= self.max_per_shard {
            shard.retain(|_, e| e.until > received);
            if shard.len() >= self.max_per_shard {
                return;
            }
        }
        shard.insert(Box::from(key), entry);
    }

    /// Forgets `key` (after an admin reset, say).
    pub(crate) fn forget(&self, key: &str) {
        self.shard(key).lock().remove(key);
    }
}

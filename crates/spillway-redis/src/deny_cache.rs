//! The local deny cache: once Redis has denied a key with a `retry_after`,
//! this instance denies that key again on its own until then, so a client
//! hammering while denied (an attacker, a retry loop) costs no round trip.
//!
//! Exactness: the entry expires at `sent + retry_after`, where `sent` is when
//! the request that was denied left this process, which is no later than the
//! server's clock reading. So the cache never denies a request that Redis
//! would admit, but for one case: a refund (of a cluster request another
//! node denied, of a shaped request whose client left) frees room that the
//! caches of other instances cannot see. So an entry lives at most
//! [`MAX_AGE`], whatever its `retry_after`, and this instance forgets the
//! keys it refunds. The `Retry-After` it reports counts from when the answer
//! arrived, so it never tells a client to come back too early either.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use spillway::Decision;
use tokio::time::Instant;

const SHARDS: usize = 16;

/// The longest a denial is cached: how long a refund elsewhere can go
/// unseen. A client hammering a denied key still costs one round trip a
/// second at most.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(1);

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
        if !d.refill_after.is_zero() {
            d.refill_after = d
                .refill_after
                .saturating_sub(waited)
                .max(Duration::from_micros(1));
        }
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
            until: sent + retry_after.min(MAX_AGE),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn denial(retry_after: Duration) -> Decision {
        Decision {
            allowed: false,
            limit: 1,
            remaining: 0,
            reset_after: retry_after,
            refill_after: retry_after,
            retry_after: Some(retry_after),
            delay: Duration::ZERO,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_denial_is_cached_a_second_at_most() {
        let cache = DenyCache::new(10);
        let now = Instant::now();
        cache.record("k", 1, denial(Duration::from_secs(3600)), now, now);
        tokio::time::advance(Duration::from_millis(999)).await;
        let d = cache.lookup("k", 1, Instant::now()).expect("still cached");
        // Its Retry-After still counts down from the hour, and so do the
        // times until a unit and the whole quota come back.
        assert!(d.retry_after.unwrap() > Duration::from_secs(3598));
        let left = Duration::from_secs(3600) - Duration::from_millis(999);
        assert_eq!((d.refill_after, d.reset_after), (left, left));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(cache.lookup("k", 1, Instant::now()).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_denial_is_cached_until_its_retry_after() {
        let cache = DenyCache::new(10);
        let now = Instant::now();
        cache.record("k", 1, denial(Duration::from_millis(30)), now, now);
        assert!(cache.lookup("k", 1, now).is_some());
        assert!(
            cache.lookup("k", 0, now).is_none(),
            "a lighter request asks Redis"
        );
        tokio::time::advance(Duration::from_millis(30)).await;
        assert!(cache.lookup("k", 1, Instant::now()).is_none());
    }
}

//! The memory store's receipts of settles: the ids it has applied, each
//! remembered for [`SETTLE_RECEIPT_TTL`](super::SETTLE_RECEIPT_TTL), at most
//! [`MAX_RECEIPTS`] at once (the oldest go first).
//!
//! A receipt is a 64-bit fingerprint of the id under a key drawn when the
//! store is built, not the id itself: 16 bytes a receipt, however long the
//! ids. Two live ids share a fingerprint with a chance of about one in
//! 2^64 / [`MAX_RECEIPTS`], and a client cannot aim for it without the key.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;

use crate::clock::Micros;

/// The most receipts held, all shards together: about 32 MiB at most.
pub const MAX_RECEIPTS: usize = 1 << 20;

const SHARDS: usize = 16;

/// Which settle ids have been applied lately.
#[derive(Debug)]
pub(super) struct Receipts {
    hasher: RandomState,
    ttl: Micros,
    shards: Box<[Mutex<Shard>]>,
}

#[derive(Debug, Default)]
struct Shard {
    /// Fingerprint → when its receipt expires.
    live: HashMap<u64, Micros>,
    /// The receipts in the order they were made, to expire and evict.
    order: VecDeque<(Micros, u64)>,
}

impl Receipts {
    /// Receipts that live `ttl` µs.
    pub(super) fn new(ttl: Micros) -> Self {
        Self {
            hasher: RandomState::new(),
            ttl,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    /// Records `id` as settled at `now`, unless it was already: returns
    /// whether this is its first settle within the receipts' time.
    pub(super) fn first(&self, id: &str, now: Micros) -> bool {
        let fingerprint = self.hasher.hash_one(id);
        let shard = &self.shards[(fingerprint >> 60) as usize % SHARDS];
        let mut shard = shard
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Shard { live, order } = &mut *shard;
        while let Some(&(expires, oldest)) = order.front() {
            if expires > now && order.len() < MAX_RECEIPTS / SHARDS {
                break;
            }
            order.pop_front();
            // Only if it is still that receipt (not one made again since).
            if live.get(&oldest) == Some(&expires) {
                live.remove(&oldest);
            }
        }
        if live.get(&fingerprint).is_some_and(|&expires| expires > now) {
            return false;
        }
        let expires = now.saturating_add(self.ttl);
        live.insert(fingerprint, expires);
        order.push_back((expires, fingerprint));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_new_once_until_its_receipt_expires() {
        let r = Receipts::new(1_000);
        assert!(r.first("a", 0));
        assert!(!r.first("a", 999));
        assert!(r.first("b", 999));
        assert!(r.first("a", 1_000));
        assert!(!r.first("a", 1_500));
        assert!(!r.first("b", 1_998));
    }

    #[test]
    fn the_oldest_receipts_go_past_the_bound() {
        let r = Receipts::new(u64::MAX / 2);
        for i in 0..MAX_RECEIPTS + 2 * SHARDS * 1024 {
            r.first(&i.to_string(), 0);
        }
        let held: usize = r.shards.iter().map(|s| s.lock().unwrap().live.len()).sum();
        assert!(held <= MAX_RECEIPTS, "{held}");
        // The first ids were forgotten; the last are remembered.
        assert!(r.first("0", 0));
        assert!(!r.first(&(MAX_RECEIPTS + 2 * SHARDS * 1024 - 1).to_string(), 0));
    }
}

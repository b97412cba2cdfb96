//! How a store is set up (its options, what it does when Redis cannot
//! answer) and what it counts.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[cfg(doc)]
use crate::Error;

/// What to do when Redis cannot answer (down, or slower than the timeout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnError {
    /// Admit every request: the API stays up, unlimited, until Redis is
    /// back. The default: a rate limiter should not take the API down.
    #[default]
    FailOpen,
    /// Refuse to decide: the store returns [`Error::Unavailable`] or the
    /// Redis error, which the HTTP layer turns into a 503.
    FailClosed,
    /// Decide in memory, each instance enforcing its share of every limit
    /// (limit and burst divided by `instances`), until Redis is back.
    Local {
        /// How many service instances share the limits.
        instances: NonZeroU32,
    },
}

/// How the store talks to Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// The longest a check may wait for Redis (default 50 ms).
    pub timeout: Duration,
    /// Prepended to every key (default `spillway:`).
    pub key_prefix: String,
    /// What to do while Redis cannot answer (default [`OnError::FailOpen`]).
    pub on_error: OnError,
    /// The failure policy of the rules named here (store rule names), in
    /// place of `on_error`: a login limit can fail closed while the
    /// general limits fail open. A request is refused while Redis cannot
    /// answer if any of its rules fails closed; otherwise its `local` rules
    /// are decided in memory and the others admit.
    pub rule_on_error: BTreeMap<String, OnError>,
    /// After a failure, how long to apply `on_error` without asking Redis,
    /// before trying it again (default 250 ms, so Redis is used again well
    /// within a second of coming back).
    pub retry_interval: Duration,
    /// How many denied keys to remember locally (default 100 000; 0 turns
    /// the deny cache off).
    pub deny_cache_entries: usize,
    /// How often this instance looks whether the overrides in Redis
    /// changed (default 1 s): an override set elsewhere holds here within
    /// that (see [`RedisStore::set_override`](crate::RedisStore::set_override)).
    pub override_refresh: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_millis(50),
            key_prefix: "spillway:".to_string(),
            on_error: OnError::FailOpen,
            rule_on_error: BTreeMap::new(),
            retry_interval: Duration::from_millis(250),
            deny_cache_entries: 100_000,
            override_refresh: Duration::from_secs(1),
        }
    }
}

/// Counters of what the store did, since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Script calls sent to Redis (a cluster request may need several).
    pub redis_calls: u64,
    /// Calls that failed or timed out.
    pub redis_errors: u64,
    /// Requests admitted without a decision because Redis could not answer.
    pub fail_open: u64,
    /// Requests decided by the in-memory fallback.
    pub local: u64,
    /// Requests denied from the deny cache, without a round trip.
    pub deny_cache_hits: u64,
    /// Charges given back (a cluster request another node denied, a shaped
    /// request whose client left).
    pub refunds: u64,
    /// Refunds that failed every attempt: their charges stay until their
    /// window frees them, stricter than exact, never looser.
    pub refund_errors: u64,
    /// Calls that failed on a data error (a key of another type, a corrupt
    /// state): the failure policy decided that request, and the store was
    /// not marked down.
    pub data_errors: u64,
    /// Settles applied (a script call each; one sent again and found
    /// applied already is not counted).
    pub settles: u64,
    /// Settles that failed every attempt: their reservations stand as
    /// charged.
    pub settle_errors: u64,
    /// Reservations given back because no settle named them in time (by
    /// this process's calls: another instance's calls give back the rest).
    pub reservations_given_back: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) redis_calls: AtomicU64,
    pub(crate) redis_errors: AtomicU64,
    pub(crate) fail_open: AtomicU64,
    pub(crate) local: AtomicU64,
    pub(crate) deny_cache_hits: AtomicU64,
    pub(crate) refunds: AtomicU64,
    pub(crate) refund_errors: AtomicU64,
    pub(crate) data_errors: AtomicU64,
    pub(crate) settles: AtomicU64,
    pub(crate) settle_errors: AtomicU64,
    pub(crate) given_back: AtomicU64,
    // Refund receipts: this process's random prefix and a sequence.
    pub(crate) receipt_prefix: u64,
    pub(crate) receipts: AtomicU64,
}

impl Counters {
    pub(crate) fn new() -> Self {
        use std::hash::{BuildHasher, RandomState};
        Self {
            receipt_prefix: RandomState::new().hash_one(std::process::id()),
            ..Self::default()
        }
    }
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

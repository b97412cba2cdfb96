//! What the benches share: the quota, the keys, and one interface over our
//! limiters and governor's, so both are driven by the same code.

// Each bench target uses its own part of this module.
#![allow(dead_code)]

use std::hash::Hash;
use std::hint::black_box;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use spillway::algorithm::{FixedWindow, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket};
use spillway::clock::MonotonicClock;
use spillway::store::{Check, MemoryOptions, MemoryStore, RateLimiter, Rule, RuleId, SharedState};
use spillway::{Algorithm, Quota};

/// What every subject allows. A key must stay live for the whole run, or
/// our store would forget it (a key whose state is back to fresh is dropped)
/// and the bench would time insertions instead of checks. So every key is
/// charged before timing (see `Prefill` in `memory.rs`): half its capacity,
/// and it is never denied during the run; or all of it, and it stays denied.
///
/// The buckets (ours and governor's, configured identically) hold a burst of
/// `LIMIT` and refill one unit per `REFILL`: a key drained to zero earns back
/// one check per 10 s, so it stays denied even when a million keys are
/// visited in turn. (Governor counts in `u64` nanoseconds, so burst times
/// refill must stay under 584 years.)
///
/// The windows allow `LIMIT` per `WINDOW`: a year, so no window ends during
/// a run (they are aligned to multiples of 365 days since the Unix epoch).
pub(crate) const LIMIT: u32 = 1_000_000_000;
pub(crate) const REFILL: Duration = Duration::from_secs(10);
pub(crate) const WINDOW: Duration = Duration::from_secs(365 * 24 * 60 * 60);

pub(crate) fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

/// The buckets' rate: one per `REFILL`.
pub(crate) fn bucket_rate() -> Quota {
    Quota::new(nz(1), REFILL).expect("a valid quota")
}

/// The windows' quota: `LIMIT` per `WINDOW`.
pub(crate) fn window_quota() -> Quota {
    Quota::new(nz(LIMIT), WINDOW).expect("a valid quota")
}

/// The buckets' configuration in governor's terms.
pub(crate) fn governor_quota() -> governor::Quota {
    governor::Quota::with_period(REFILL)
        .expect("a nonzero period")
        .allow_burst(nz(LIMIT))
}

/// Our store sized so that no key is ever evicted: the bound is kept per
/// shard, and a random spread of `keys` overfills some shards' even share.
pub(crate) fn options(keys: usize) -> MemoryOptions {
    let default = MemoryOptions::default();
    MemoryOptions {
        max_keys: NonZeroUsize::new((2 * keys).max(default.max_keys.get())).expect("nonzero"),
        ..default
    }
}

/// One of our limiters, on the monotonic clock, sized for `keys` keys.
pub(crate) fn ours<A: Algorithm, K: Hash + Eq>(algorithm: A, keys: usize) -> RateLimiter<A, K>
where
    A::State: SharedState,
{
    RateLimiter::with_options(algorithm, MonotonicClock::new(), options(keys))
}

/// Governor's keyed limiter as most users build it: the dashmap store and
/// the default (quanta) clock.
pub(crate) fn governor<K: Hash + Eq + Clone>() -> governor::DefaultKeyedRateLimiter<K> {
    governor::RateLimiter::keyed(governor_quota())
}

/// Our token bucket, configured as governor's.
pub(crate) fn token_bucket() -> TokenBucket {
    TokenBucket::new(bucket_rate(), nz(LIMIT))
}

/// Every algorithm of ours, as (name, limiter) pairs through `visit`.
pub(crate) trait Visit {
    fn visit<S: Subject<Key = u64>>(&mut self, name: &str, make: &dyn Fn(usize) -> S);
}

pub(crate) fn each_subject(v: &mut impl Visit) {
    v.visit("token_bucket", &|n| ours::<_, u64>(token_bucket(), n));
    v.visit("leaky_bucket_police", &|n| {
        ours::<_, u64>(LeakyBucket::police(bucket_rate(), nz(LIMIT)), n)
    });
    v.visit("leaky_bucket_shape", &|n| {
        ours::<_, u64>(LeakyBucket::shape(bucket_rate(), nz(LIMIT)), n)
    });
    v.visit("fixed_window", &|n| {
        ours::<_, u64>(FixedWindow::new(window_quota()), n)
    });
    v.visit("sliding_window", &|n| {
        ours::<_, u64>(SlidingWindow::new(window_quota()), n)
    });
    v.visit("sliding_log", &|n| {
        ours::<_, u64>(SlidingLog::new(window_quota()), n)
    });
    v.visit("governor", &|_| governor::<u64>());
}

/// The `i`th distinct key: spread over all 64 bits, as real identifiers
/// hashed or assigned at random would be.
pub(crate) fn key(i: u64) -> u64 {
    // splitmix64's finaliser: a bijection, so distinct `i` give distinct keys.
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// How many checks a visiting order holds before it wraps: a power of two,
/// larger than the biggest key set, so that a pass looks random.
pub(crate) const ACCESSES: usize = 1 << 20;

/// A fixed, reproducible visiting order over `keys` key indices (xorshift),
/// without end.
pub(crate) fn order(keys: usize) -> impl Iterator<Item = u64> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    std::iter::repeat_with(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % keys as u64
    })
}

/// The first `ACCESSES` keys of `order`.
pub(crate) fn access(keys: usize) -> Vec<u64> {
    order(keys).map(key).take(ACCESSES).collect()
}

/// A limiter as the benches see it.
pub(crate) trait Subject: Sync {
    type Key: Sync;

    /// One request of cost 1, now: admitted or not.
    fn check(&self, key: &Self::Key) -> bool;

    /// One request of cost `cost`, now: admitted or not.
    fn charge(&self, key: &Self::Key, cost: u32) -> bool;

    /// Keys held.
    fn len(&self) -> usize;

    /// What our store reports for its tables, when it is ours.
    fn table_bytes(&self) -> Option<usize> {
        None
    }
}

/// One of our limiters keyed by `$k`, checked with what `|$key| $query`
/// makes of the bench's key: the `u64` itself, or a text key as `&str` (as
/// the service does).
macro_rules! limiter_subject {
    ($k:ty, $bench_key:ty, |$key:ident| $query:expr) => {
        impl<A: Algorithm> Subject for RateLimiter<A, $k>
        where
            A::State: SharedState,
        {
            type Key = $bench_key;

            fn check(&self, $key: &$bench_key) -> bool {
                RateLimiter::check(self, $query, 1)
                    .expect("cost fits")
                    .allowed
            }

            fn charge(&self, $key: &$bench_key, cost: u32) -> bool {
                RateLimiter::check(self, $query, u64::from(cost))
                    .expect("cost fits")
                    .allowed
            }

            fn len(&self) -> usize {
                RateLimiter::len(self)
            }

            fn table_bytes(&self) -> Option<usize> {
                Some(RateLimiter::table_bytes(self))
            }
        }
    };
}

limiter_subject!(u64, u64, |key| key);
limiter_subject!(String, String, |key| key.as_str());
// Short keys inline in the entry: what the memory store holds.
limiter_subject!(compact_str::CompactString, String, |key| key.as_str());

/// The service's store (rules by name, text keys) with one rule, the token
/// bucket: what `spillway serve` and the middleware check through.
pub(crate) fn memory_store(keys: usize) -> MemoryStore {
    MemoryStore::new(vec![Rule::new("bench", token_bucket())], options(keys))
}

/// [`memory_store`] with `overrides` overrides of keys its benches never
/// visit (`other-N`, a limit each), as an operator who set them for some
/// customers: what the check of every other key pays for them.
pub(crate) fn memory_store_with_overrides(keys: usize, overrides: usize) -> MemoryStore {
    let store = memory_store(keys);
    for i in 0..overrides {
        let entry = spillway::store::OverrideEntry {
            applied: spillway::store::Override::limit(1_000),
            spec: "{}".into(),
        };
        let target = spillway::store::Target::Key(format!("other-{i}").into());
        store.set_override(RuleId(0), target, entry).expect("fits");
    }
    store
}

impl Subject for MemoryStore {
    type Key = String;

    fn check(&self, key: &String) -> bool {
        self.charge(key, 1)
    }

    fn charge(&self, key: &String, cost: u32) -> bool {
        self.check_now(&[Check {
            rule: RuleId(0),
            key,
            cost: u64::from(cost),
        }])
        .expect("cost fits")
        .allowed
    }

    fn len(&self) -> usize {
        MemoryStore::len(self, RuleId(0))
    }
}

impl<K: Hash + Eq + Clone + Send + Sync> Subject for governor::DefaultKeyedRateLimiter<K> {
    type Key = K;

    fn check(&self, key: &K) -> bool {
        self.check_key(key).is_ok()
    }

    fn charge(&self, key: &K, cost: u32) -> bool {
        matches!(self.check_key_n(key, nz(cost)), Ok(Ok(())))
    }

    fn len(&self) -> usize {
        governor::RateLimiter::len(self)
    }
}

/// Checks `n` keys of `access` (whose length is a power of two), starting at
/// `from` and wrapping.
pub(crate) fn visit<S: Subject>(subject: &S, access: &[S::Key], from: usize, n: u64) {
    let mask = access.len() - 1;
    let mut i = from;
    for _ in 0..n {
        black_box(subject.check(&access[i & mask]));
        i = i.wrapping_add(1);
    }
}

/// The wall time for `iters` checks split over one thread per part, all
/// sharing `subject`: a part is a visiting order and where to start in it.
/// The time runs from the moment all threads have started to the moment the
/// last one ends, so thread start-up is not counted.
pub(crate) fn run_threads<S: Subject>(
    subject: &S,
    parts: &[(&[S::Key], usize)],
    iters: u64,
) -> Duration {
    if let [(access, from)] = parts {
        let start = Instant::now();
        visit(subject, access, *from, iters);
        return start.elapsed();
    }
    let threads = parts.len() as u64;
    let barrier = Barrier::new(parts.len());
    let spans: Vec<(Instant, Instant)> = thread::scope(|scope| {
        let handles: Vec<_> = parts
            .iter()
            .enumerate()
            .map(|(t, &(access, from))| {
                let barrier = &barrier;
                let share = iters / threads + u64::from((t as u64) < iters % threads);
                scope.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    visit(subject, access, from, share);
                    (start, Instant::now())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a bench thread panicked"))
            .collect()
    });
    let start = spans.iter().map(|s| s.0).min().expect("threads ran");
    let end = spans.iter().map(|s| s.1).max().expect("threads ran");
    end - start
}

//! Where the time of one in-memory check goes: the clock read, the hash, the
//! shard lock, the table probe and the algorithm, each timed alone, next to
//! the same parts of governor (its quanta clock, its SipHash hasher); and the
//! floors: the least any limiter shared between threads can cost per check.
//!
//! Run with `cargo bench -p spillway --bench breakdown`. BENCHMARKS.md
//! explains how the parts add up.

mod common;

use std::hash::{BuildHasher, RandomState};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use crossbeam_utils::CachePadded;
use governor::clock::Clock as _;
use hashbrown::HashMap;
use parking_lot::Mutex;
use spillway::Algorithm;
use spillway::algorithm::{Calendar, FixedWindow, LeakyBucket, Period, SlidingLog, SlidingWindow};
use spillway::clock::{Clock, MonotonicClock, SystemClock};

use common::{
    ACCESSES, LIMIT, REFILL, Subject, access, bucket_rate, key, nz, order, ours, token_bucket,
    window_quota,
};

fn clocks(c: &mut Criterion) {
    let mut g = c.benchmark_group("clock");
    g.throughput(Throughput::Elements(1));
    let ours = MonotonicClock::new();
    g.bench_function("spillway_monotonic", |b| b.iter(|| ours.now()));
    g.bench_function("spillway_system", |b| b.iter(|| SystemClock.now()));
    g.bench_function("std_instant_now", |b| b.iter(Instant::now));
    let quanta = governor::clock::DefaultClock::default();
    g.bench_function("governor_quanta", |b| b.iter(|| quanta.now()));
    g.finish();
}

fn hashes(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Elements(1));
    let fold = foldhash::fast::RandomState::default();
    let sip = RandomState::new();
    let text = String::from("client-123456");
    g.bench_function("foldhash_u64", |b| {
        b.iter(|| fold.hash_one(black_box(7u64)))
    });
    g.bench_function("siphash_u64", |b| b.iter(|| sip.hash_one(black_box(7u64))));
    g.bench_function("foldhash_str", |b| {
        b.iter(|| fold.hash_one(black_box(text.as_str())))
    });
    g.bench_function("siphash_str", |b| {
        b.iter(|| sip.hash_one(black_box(text.as_str())))
    });
    g.finish();
}

/// One algorithm's transition on a state in cache, the time moving on by a
/// microsecond a call.
fn step<A: Algorithm>(c: &mut Criterion, name: &str, alg: A, prefill: u64) {
    let mut g = c.benchmark_group("algorithm");
    g.throughput(Throughput::Elements(1));
    let start = MonotonicClock::new().now();
    g.bench_function(name, |b| {
        let mut state = A::State::default();
        alg.check(&mut state, prefill, start).expect("fits");
        let mut now = start;
        b.iter(|| {
            now += 1;
            alg.check(&mut state, 1, black_box(now)).expect("fits")
        });
    });
    g.finish();
}

fn algorithms(c: &mut Criterion) {
    let half = u64::from(LIMIT / 2);
    step(c, "token_bucket", token_bucket(), half);
    step(
        c,
        "leaky_bucket_police",
        LeakyBucket::police(bucket_rate(), nz(LIMIT)),
        half,
    );
    step(
        c,
        "leaky_bucket_shape",
        LeakyBucket::shape(bucket_rate(), nz(LIMIT)),
        half,
    );
    step(c, "fixed_window", FixedWindow::new(window_quota()), half);
    // A calendar month in a zone with daylight saving: the period of each
    // time is looked up in the zone's rules.
    let paris = Calendar::new(Period::Month, "Europe/Paris".parse().expect("a zone"));
    step(
        c,
        "fixed_window_calendar_month",
        FixedWindow::calendar(nz(LIMIT), paris),
        half,
    );
    step(
        c,
        "sliding_window",
        SlidingWindow::new(window_quota()),
        half,
    );
    // The log keeps one entry per microsecond charged, so it grows here.
    step(c, "sliding_log", SlidingLog::new(window_quota()), half);

    // A floor for comparison, not an algorithm of ours: GCRA over `u64`
    // microseconds for an interval that is a whole number of them, with the
    // same outputs (admitted, remaining, reset after, retry after).
    let mut g = c.benchmark_group("algorithm");
    g.throughput(Throughput::Elements(1));
    g.bench_function("reference_u64_gcra", |b| {
        let interval = black_box(REFILL.as_micros() as u64);
        let tolerance = interval * u64::from(LIMIT);
        let start = MonotonicClock::new().now();
        let mut tat = start + interval * u64::from(LIMIT / 2);
        let mut now = start;
        b.iter(|| {
            now += 1;
            let after = tat.max(now) + interval;
            let used = after - now;
            if used <= tolerance {
                tat = after;
                (true, (tolerance - used) / interval, used, 0)
            } else {
                let wait = used - tolerance;
                (false, 0, used - interval, wait)
            }
        });
    });
    g.finish();
}

type ModelShard = Mutex<HashMap<u64, [u64; 2], foldhash::fast::RandomState>>;

/// A model of the store's table with nothing else: 64 cache-padded
/// `parking_lot` mutexes over `hashbrown` maps with foldhash, the state two
/// `u64`s, found and written.
struct Model {
    shards: Vec<CachePadded<ModelShard>>,
    hasher: foldhash::fast::RandomState,
}

impl Model {
    fn new(keys: usize) -> Self {
        let hasher = foldhash::fast::RandomState::default();
        let shards = (0..64)
            .map(|_| CachePadded::new(Mutex::new(HashMap::with_hasher(hasher))))
            .collect();
        let model = Self { shards, hasher };
        for i in 0..keys as u64 {
            let k = key(i);
            model.shard(k).lock().insert(k, [i, 0]);
        }
        model
    }

    fn shard(&self, k: u64) -> &ModelShard {
        &self.shards[self.shard_index(k)]
    }

    fn shard_index(&self, k: u64) -> usize {
        let h = self.hasher.hash_one(k);
        // The same bits as the store's `shard_of`.
        ((((h >> 24) & 0xFFFF_FFFF) * 64) >> 32) as usize
    }

    fn touch(&self, k: u64, now: u64) -> bool {
        let mut shard = self.shard(k).lock();
        match shard.get_mut(&k) {
            Some(state) => {
                state[0] = state[0].max(now) + 1;
                true
            }
            None => false,
        }
    }
}

impl Subject for Model {
    type Key = u64;

    fn check(&self, key: &u64) -> bool {
        self.touch(*key, 0)
    }

    fn charge(&self, _: &u64, _: u32) -> bool {
        true
    }

    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

/// A key and its two-`u64` state, side by side.
type InlineSlot = (u64, [u64; 2]);

/// The model table's work in a table with one probe sequence instead of
/// two: open addressing, each slot the key and its two-`u64` state inline
/// (24 bytes), linear probing from the key's hash, filled to 80% (30 bytes
/// a key, inside the 32 the issue allows), behind the same 64 mutexes. A
/// hit reads the slot's line (and at times the next), where `hashbrown`
/// reads its control bytes and then the entry, two lines far apart. A
/// model only: `u64::MAX` marks an empty slot, it never grows, never
/// deletes, never evicts.
struct InlineModel {
    shards: Vec<CachePadded<Mutex<Vec<InlineSlot>>>>,
    hasher: foldhash::fast::RandomState,
}

impl InlineModel {
    const EMPTY: u64 = u64::MAX;

    fn new(keys: usize) -> Self {
        let hasher = foldhash::fast::RandomState::default();
        let per_shard = (keys / 64) * 5 / 4 + 16;
        let shards = (0..64)
            .map(|_| CachePadded::new(Mutex::new(vec![(Self::EMPTY, [0, 0]); per_shard])))
            .collect();
        let model = Self { shards, hasher };
        for i in 0..keys as u64 {
            let k = key(i);
            assert_ne!(k, Self::EMPTY, "a key the model cannot hold");
            let (shard, start) = model.place(k);
            let mut slots = model.shards[shard].lock();
            let len = slots.len();
            let mut at = start;
            while slots[at].0 != Self::EMPTY {
                at = if at + 1 == len { 0 } else { at + 1 };
            }
            slots[at] = (k, [i, 0]);
        }
        model
    }

    /// The key's shard (the store's bits) and first slot (other bits,
    /// mapped onto the shard's length by a multiply, not a modulo).
    fn place(&self, k: u64) -> (usize, usize) {
        let h = self.hasher.hash_one(k);
        let shard = ((((h >> 24) & 0xFFFF_FFFF) * 64) >> 32) as usize;
        let len = self.shards[shard].lock().len() as u64;
        (shard, (((h & 0xFF_FFFF) * len) >> 24) as usize)
    }

    fn touch(&self, k: u64, now: u64) -> bool {
        let h = self.hasher.hash_one(k);
        let shard = ((((h >> 24) & 0xFFFF_FFFF) * 64) >> 32) as usize;
        let mut slots = self.shards[shard].lock();
        let len = slots.len();
        let mut at = (((h & 0xFF_FFFF) * len as u64) >> 24) as usize;
        loop {
            let slot = &mut slots[at];
            if slot.0 == k {
                slot.1[0] = slot.1[0].max(now) + 1;
                return true;
            }
            if slot.0 == Self::EMPTY {
                return false;
            }
            at = if at + 1 == len { 0 } else { at + 1 };
        }
    }
}

/// The floor of a shared limiter (see [`floors`]) as a subject: read the
/// clock, then one compare-and-swap on the key's 8-byte state in a plain
/// array. What two threads gain on it bounds what any limiter whose keys
/// both threads update can gain.
struct ClockThenCas {
    states: Vec<AtomicU64>,
    clock: MonotonicClock,
}

impl ClockThenCas {
    fn new(keys: usize) -> Self {
        Self {
            states: (0..keys).map(|_| AtomicU64::new(0)).collect(),
            clock: MonotonicClock::new(),
        }
    }
}

impl Subject for ClockThenCas {
    type Key = u64;

    fn check(&self, key: &u64) -> bool {
        let now = self.clock.now();
        let state = &self.states[(*key % self.states.len() as u64) as usize];
        let old = state.load(Ordering::Relaxed);
        state
            .compare_exchange(old, old.max(now) + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    fn charge(&self, _: &u64, _: u32) -> bool {
        true
    }

    fn len(&self) -> usize {
        self.states.len()
    }
}

/// Two threads on 10k keys, either all visiting every key (as in the
/// `memory` bench) or each visiting its own half. With disjoint halves the
/// threads never write the same entry, though they still share the locks
/// (and governor's shard reader counts): the difference is what writing
/// shared entries costs, the lines moving between the cores' caches.
fn scaling(c: &mut Criterion) {
    fn three<S: Subject<Key = u64>>(c: &mut Criterion, name: &str, subject: &S) {
        let n = 10_000u64;
        let all = access(n as usize);
        let halves: Vec<Vec<u64>> = (0..2u64)
            .map(|t| {
                order(n as usize / 2)
                    .map(|i| key(i + t * n / 2))
                    .take(ACCESSES)
                    .collect()
            })
            .collect();
        let mut g = c.benchmark_group("scaling_10k");
        g.throughput(Throughput::Elements(1));
        g.bench_function(format!("{name}/1t"), |b| {
            b.iter_custom(|iters| common::run_threads(subject, &[(&all, 0)], iters));
        });
        g.bench_function(format!("{name}/2t_shared"), |b| {
            b.iter_custom(|iters| {
                common::run_threads(subject, &[(&all, 0), (&all, all.len() / 2)], iters)
            });
        });
        g.bench_function(format!("{name}/2t_disjoint"), |b| {
            b.iter_custom(|iters| {
                common::run_threads(subject, &[(&halves[0], 0), (&halves[1], 0)], iters)
            });
        });
        g.finish();
    }
    let n = 10_000;
    let limiter = ours::<_, u64>(token_bucket(), n);
    let theirs = common::governor::<u64>();
    for i in 0..n as u64 {
        limiter.charge(&key(i), LIMIT / 2);
        theirs.charge(&key(i), LIMIT / 2);
    }
    three(c, "token_bucket", &limiter);
    three(c, "governor", &theirs);
    let model = Model::new(n);
    three(c, "model_table", &model);
    three(c, "clock_then_cas", &ClockThenCas::new(n));
    // Each thread on the keys of its own shards: no cache line is written
    // by both, neither a lock nor an entry.
    let own: Vec<Vec<u64>> = (0..2)
        .map(|t| {
            order(n)
                .map(key)
                .filter(|&k| model.shard_index(k) % 2 == t)
                .take(ACCESSES)
                .collect()
        })
        .collect();
    let mut g = c.benchmark_group("scaling_10k");
    g.throughput(Throughput::Elements(1));
    g.bench_function("model_table/2t_own_shards", |b| {
        b.iter_custom(|iters| common::run_threads(&model, &[(&own[0], 0), (&own[1], 0)], iters));
    });
    g.finish();
}

fn stores(c: &mut Criterion) {
    for (label, n) in [("10k", 10_000usize), ("1M", 1_000_000)] {
        let mut g = c.benchmark_group(format!("store_{label}"));
        g.throughput(Throughput::Elements(1));
        let visits = access(n);
        let mask = visits.len() - 1;

        let limiter = ours::<_, u64>(token_bucket(), n);
        let theirs = common::governor::<u64>();
        for i in 0..n as u64 {
            limiter.charge(&key(i), LIMIT / 2);
            theirs.charge(&key(i), LIMIT / 2);
        }
        let clock = MonotonicClock::new();
        g.bench_function("check", |b| {
            let mut i = 0;
            b.iter(|| {
                i += 1;
                limiter.check(&visits[i & mask], 1).expect("fits").allowed
            });
        });
        g.bench_function("check_at_fixed_now", |b| {
            let now = clock.now();
            let mut i = 0;
            b.iter(|| {
                i += 1;
                limiter
                    .check_at(&visits[i & mask], 1, now)
                    .expect("fits")
                    .allowed
            });
        });
        g.bench_function("governor_check_key", |b| {
            let mut i = 0;
            b.iter(|| {
                i += 1;
                theirs.check_key(&visits[i & mask]).is_ok()
            });
        });
        drop((limiter, theirs));

        let model = Model::new(n);
        touches(&mut g, "model_table", &visits, &clock, |k, now| {
            model.touch(k, now)
        });
        drop(model);
        let inline = InlineModel::new(n);
        touches(&mut g, "inline_table", &visits, &clock, |k, now| {
            inline.touch(k, now)
        });
        g.finish();
    }
}

/// `{name}_lock_probe_write`: a model table's `touch` over `visits`, with
/// a counter for the time; `{name}_with_clock`: the same reading the clock
/// per check, as a limiter must (at 1M keys the read waits for the
/// previous check's misses).
fn touches(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    visits: &[u64],
    clock: &MonotonicClock,
    touch: impl Fn(u64, u64) -> bool,
) {
    let mask = visits.len() - 1;
    g.bench_function(format!("{name}_lock_probe_write"), |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            touch(visits[i & mask], i as u64)
        });
    });
    g.bench_function(format!("{name}_with_clock"), |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            touch(visits[i & mask], clock.now())
        });
    });
}

/// Floors: the least a check can cost in any limiter whose keys share state
/// between threads, with nothing of a real table, each part alone and then
/// together. Every such check updates its key's state with at least one
/// atomic read-modify-write (a lock takes one to lock and one to unlock),
/// and one that reads the time reads a clock (quanta's, as governor does).
/// `clock_then_cas` is both on a plain array, with the key's slot found by
/// an index and not a lookup: below it, no exact limiter that reads the
/// clock per check can go, whatever its table. BENCHMARKS.md compares these
/// with half of governor's time per check.
fn floors(c: &mut Criterion) {
    let mut g = c.benchmark_group("floor");
    g.throughput(Throughput::Elements(1));
    let lock = CachePadded::new(Mutex::new(0u64));
    g.bench_function("lock_write_unlock", |b| {
        b.iter(|| {
            let mut v = lock.lock();
            *v += 1;
        });
    });
    let cell = CachePadded::new(AtomicU64::new(0));
    g.bench_function("cas", |b| {
        b.iter(|| {
            let old = cell.load(Ordering::Relaxed);
            cell.compare_exchange(old, old + 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
    });
    let clock = MonotonicClock::new();
    for (label, n) in [("10k", 10_000usize), ("1M", 1_000_000)] {
        // One 8-byte state per key, indexed directly: smaller and simpler
        // than any table that holds the keys themselves.
        let states: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
        let slots: Vec<usize> = order(n).take(ACCESSES).map(|i| i as usize).collect();
        let mask = slots.len() - 1;
        g.bench_function(format!("clock_then_cas/{label}"), |b| {
            let mut i = 0;
            b.iter(|| {
                i += 1;
                let now = clock.now();
                let state = &states[slots[i & mask]];
                let old = state.load(Ordering::Relaxed);
                state
                    .compare_exchange(old, old.max(now) + 1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            });
        });
    }
    // At 1M keys, the same with the key held beside its state, as any
    // table must (the key, then an 8- or 16-byte state, in one line; each
    // key's slot found by an index, as if the table were a perfect hash
    // 100% full): the slots no longer fit the cache the 8-byte array nearly
    // does, and the clock read waits for the previous check's miss.
    let n = 1_000_000;
    let slots: Vec<usize> = order(n).take(ACCESSES).map(|i| i as usize).collect();
    keyed_slots::<2>(&mut g, "clock_then_cas/1M_16B_slots", &clock, n, &slots);
    keyed_slots::<3>(&mut g, "clock_then_cas/1M_24B_slots", &clock, n, &slots);
    g.finish();
}

/// Clock, then one CAS on the state beside the key in an `N`-word slot
/// (the key, then `N - 1` words of state), one slot for each of `keys`
/// keys, visited in `order`.
fn keyed_slots<const N: usize>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    clock: &MonotonicClock,
    keys: usize,
    order: &[usize],
) {
    let slots: Vec<[AtomicU64; N]> = (0..keys as u64)
        .map(|i| std::array::from_fn(|w| AtomicU64::new(if w == 0 { key(i) } else { 0 })))
        .collect();
    let mask = order.len() - 1;
    g.bench_function(name, |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            let now = clock.now();
            let slot = &slots[order[i & mask]];
            if slot[0].load(Ordering::Relaxed) == u64::MAX {
                return false;
            }
            let old = slot[1].load(Ordering::Relaxed);
            slot[1]
                .compare_exchange(old, old.max(now) + 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
    });
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .without_plots()
        .configure_from_args();
    clocks(&mut c);
    hashes(&mut c);
    algorithms(&mut c);
    stores(&mut c);
    floors(&mut c);
    scaling(&mut c);
    c.final_summary();
}

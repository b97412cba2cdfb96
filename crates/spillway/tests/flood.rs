//! Key floods against the in-memory store, in process: millions of
//! distinct keys (random source addresses, some with long texts) while an
//! abuser sits at its limit and regular users keep using their quota.
//!
//! What holds through the flood, under both [`OnFull`] policies: the bytes
//! the store counts stay within `max_memory`, the process's resident set
//! grows by at most [`rss_bound`], the abuser is denied on every try (no
//! eviction hands it a fresh quota) and every regular user's count is
//! exactly what it spent.
//!
//! The CI form floods 1 million keys; `cargo test -p spillway --release
//! --test flood -- --ignored` floods 10 million (`scripts/flood.sh` runs
//! both stores' long forms). The flood is alone in its test binary, so the
//! resident set it reads is its own.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway::clock::FakeClock;
use spillway::store::{Check, MemoryOptions, MemoryStore, OnFull, Rule, RuleId};

/// The start of an hour, in 2023 (µs).
const HOUR_START: u64 = 472_222 * 3_600_000_000;

/// The bound under test.
const MAX_MEMORY: usize = 64 << 20;

/// How much the resident set may grow over `max_memory`: the allocator's
/// own overhead on the long keys' texts (their allocations of 25 to 64
/// bytes take 8 to 16 bytes more each), pages freed but not yet returned,
/// and the test's own buffers.
fn rss_bound() -> usize {
    MAX_MEMORY + MAX_MEMORY / 4 + (16 << 20)
}

/// The resident set, in bytes.
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The `i`th flood key: an address from a scrambled counter, and for every
/// fourth a long text (a user agent, say) that the store keeps on the heap.
fn flood_key(i: u64, out: &mut String) {
    use std::fmt::Write;
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let [a, b, c, d, ..] = (z ^ (z >> 31)).to_le_bytes();
    out.clear();
    let _ = write!(out, "{a}.{b}.{c}.{d}:{i}");
    if i.is_multiple_of(4) {
        out.push_str("|Mozilla/5.0 (X11; Linux x86_64) flood");
    }
}

struct Flooded {
    admitted_abuser: usize,
    peak_bytes: usize,
    peak_rss_growth: usize,
    held: usize,
    capacity: usize,
}

/// Floods `keys` distinct keys through a store of one token bucket (100 an
/// hour, bursts of 100) bounded by [`MAX_MEMORY`], the clock moving 1 µs a
/// request (the whole flood stays well inside the hour, so nothing refills
/// by much). Every 1 000 flood keys, the abuser tries again and one of 1 000
/// regular users spends one more.
fn flood(keys: u64, on_full: OnFull) -> Flooded {
    let rss_before = rss();
    let clock = FakeClock::new(HOUR_START);
    let limit = 100;
    let per_hour = Quota::per_hour(NonZeroU32::new(limit).expect("nonzero"));
    let bucket = TokenBucket::new(per_hour, NonZeroU32::new(limit).expect("nonzero"));
    let options = MemoryOptions {
        max_memory: NonZeroUsize::new(MAX_MEMORY),
        on_full,
        ..MemoryOptions::default()
    };
    let store = MemoryStore::with_clock(vec![Rule::new("per-ip", bucket)], options, clock.clone());
    let check = |key: &str, cost| {
        let c = Check {
            rule: RuleId(0),
            key,
            cost,
        };
        store.check_now(&[c]).expect("fits").decisions[0]
    };
    // The abuser takes its whole quota; each regular user takes 10.
    assert!(check("mallory", u64::from(limit)).allowed);
    let users: Vec<String> = (0..1_000).map(|u| format!("user-{u}")).collect();
    let mut spent = vec![10u64; users.len()];
    for user in &users {
        assert!(check(user, 10).allowed);
    }
    let (mut admitted_abuser, mut peak_bytes, mut peak_rss) = (0, 0, 0);
    let mut key = String::new();
    for i in 0..keys {
        clock.advance(Duration::from_micros(1));
        flood_key(i, &mut key);
        check(&key, 1);
        if i.is_multiple_of(1_000) {
            admitted_abuser += usize::from(check("mallory", 1).allowed);
            let u = (i / 1_000) as usize % users.len();
            assert!(check(&users[u], 1).allowed, "{} was denied", users[u]);
            spent[u] += 1;
        }
        if i.is_multiple_of(100_000) {
            peak_bytes = peak_bytes.max(store.memory_bytes());
            peak_rss = peak_rss.max(rss().saturating_sub(rss_before));
        }
    }
    peak_bytes = peak_bytes.max(store.memory_bytes());
    peak_rss = peak_rss.max(rss().saturating_sub(rss_before));
    // Every regular user's count is exactly what it spent: the refill
    // over the flood (1 µs a request) is far below one token (36 s).
    assert!(Duration::from_micros(keys) < Duration::from_secs(36));
    for (user, spent) in users.iter().zip(&spent) {
        let left = check(user, 0).remaining;
        assert_eq!(left, u64::from(limit) - spent, "{user}");
    }
    assert_eq!(check("mallory", 0).remaining, 0);
    Flooded {
        admitted_abuser,
        peak_bytes,
        peak_rss_growth: peak_rss,
        held: store.len(RuleId(0)),
        capacity: store.capacity(RuleId(0)),
    }
}

fn assert_bounded(keys: u64, on_full: OnFull) {
    let f = flood(keys, on_full);
    eprintln!(
        "{keys} keys, {on_full:?}: {} held of {}, peak {:.1} MiB counted, RSS +{:.1} MiB",
        f.held,
        f.capacity,
        f.peak_bytes as f64 / f64::from(1 << 20),
        f.peak_rss_growth as f64 / f64::from(1 << 20),
    );
    assert_eq!(f.admitted_abuser, 0, "the abuser was handed a fresh quota");
    assert!(f.peak_bytes <= MAX_MEMORY, "{} bytes counted", f.peak_bytes);
    assert!(f.held <= f.capacity);
    assert!(
        f.peak_rss_growth <= rss_bound(),
        "RSS grew by {} bytes, over {}",
        f.peak_rss_growth,
        rss_bound()
    );
}

#[test]
fn a_flood_of_a_million_keys_stays_bounded_and_spares_used_keys() {
    // One test, so that the two floods never share the resident set.
    assert_bounded(1_000_000, OnFull::Evict);
    assert_bounded(1_000_000, OnFull::DenyNew);
}

#[test]
#[ignore = "the long form: 10 million keys (about a minute in release)"]
fn a_flood_of_ten_million_keys_stays_bounded_and_spares_used_keys() {
    assert_bounded(10_000_000, OnFull::Evict);
    assert_bounded(10_000_000, OnFull::DenyNew);
}

//! The in-memory store's state file: how long writing and reading it take
//! for a million keys, how large it is, and what a write costs the checks
//! running beside it (their latency while a write goes on, against
//! without).
//!
//! Run with `cargo bench -p spillway --bench state_file` (a million keys;
//! `-- 100k` for a hundred thousand). Under `cargo test` it runs on a
//! thousand keys, once.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use spillway::Quota;
use spillway::algorithm::{FixedWindow, SlidingLog, TokenBucket};
use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId, Store};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

/// Three rules of three algorithms, `keys` keys in each.
fn filled(keys: usize) -> MemoryStore {
    let rules = vec![
        Rule::new("window", FixedWindow::new(Quota::per_hour(nz(1_000)))),
        Rule::new(
            "bucket",
            TokenBucket::new(Quota::per_hour(nz(1_000)), nz(100)),
        ),
        Rule::new("log", SlidingLog::new(Quota::per_hour(nz(10)))),
    ];
    let store = MemoryStore::new(rules, options());
    for i in 0..keys {
        let key = format!("api_key=client-{i:08}");
        for rule in 0..3 {
            let cost = 1 + (i % 3) as u64;
            store
                .check_now(&[Check {
                    rule: RuleId(rule),
                    key: &key,
                    cost,
                }])
                .expect("a check");
        }
    }
    store
}

/// Room for every key: a store at its bound leaves some out of a restore
/// (its shards split the keys afresh).
fn options() -> MemoryOptions {
    MemoryOptions {
        max_keys: std::num::NonZeroUsize::new(2_000_000).expect("nonzero"),
        max_memory: None,
        ..MemoryOptions::default()
    }
}

/// The latencies of checks of held keys over `run`, sorted, in ns.
fn latencies(store: &MemoryStore, keys: usize, stop: &AtomicBool) -> Vec<u64> {
    let mut seen = Vec::with_capacity(1 << 20);
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("api_key=client-{:08}", (i * 7919) % keys);
        let started = Instant::now();
        store
            .check_now(&[Check {
                rule: RuleId(0),
                key: &key,
                cost: 0,
            }])
            .expect("a check");
        seen.push(started.elapsed().as_nanos() as u64);
        i += 1;
    }
    seen.sort_unstable();
    seen
}

fn quantile(sorted: &[u64], q: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * q) as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let benching = args.iter().any(|a| a == "--bench");
    let keys = match (benching, args.iter().any(|a| a == "100k")) {
        (false, _) => 1_000,
        (true, true) => 100_000,
        (true, false) => 1_000_000,
    };
    let store = Arc::new(filled(keys));
    let mut file = Vec::new();
    let mut saves = Vec::new();
    for _ in 0..if benching { 5 } else { 1 } {
        file.clear();
        let started = Instant::now();
        store.save_state(&mut file).expect("saved");
        saves.push(started.elapsed());
    }
    saves.sort();
    let restarted = MemoryStore::new(store.rules().to_vec(), options());
    let started = Instant::now();
    let restored = restarted.restore_state(&file).expect("restored");
    let read = started.elapsed();
    assert_eq!(restored.keys as usize, 3 * keys);
    println!(
        "{} keys ({keys} in each of 3 rules): write {:.0} ms (median of {}), {:.1} MiB, {:.1} bytes a key; read {:.0} ms",
        3 * keys,
        saves[saves.len() / 2].as_secs_f64() * 1e3,
        saves.len(),
        file.len() as f64 / (1 << 20) as f64,
        file.len() as f64 / (3 * keys) as f64,
        read.as_secs_f64() * 1e3,
    );

    // Checks on another thread, without a write beside them, then with
    // writes one after another.
    let run = if benching {
        Duration::from_secs(3)
    } else {
        Duration::from_millis(50)
    };
    for writing in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        let checker = {
            let (store, stop) = (store.clone(), stop.clone());
            thread::spawn(move || latencies(&store, keys, &stop))
        };
        let started = Instant::now();
        while started.elapsed() < run {
            if writing {
                let mut out = Vec::with_capacity(file.len());
                store.save_state(&mut out).expect("saved");
            } else {
                thread::sleep(Duration::from_millis(10));
            }
        }
        stop.store(true, Ordering::Relaxed);
        let seen = checker.join().expect("the checker");
        println!(
            "checks {}: {} checks, p50 {} ns, p99 {} ns, p99.99 {} ns, max {} us",
            if writing {
                "while writing"
            } else {
                "alone        "
            },
            seen.len(),
            quantile(&seen, 0.5),
            quantile(&seen, 0.99),
            quantile(&seen, 0.9999),
            seen.last().copied().unwrap_or(0) / 1000,
        );
    }
}

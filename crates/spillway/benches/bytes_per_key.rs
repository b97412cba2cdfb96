//! Bytes per key: every algorithm of the in-memory store and governor's
//! keyed limiter, holding 100k to 2M distinct `u64` keys (and string keys
//! for the token bucket and governor).
//!
//! Each configuration runs in a fresh child process. It counts the bytes
//! requested from the allocator while the limiter is built and filled (a
//! counting global allocator, from `stats_alloc`), and also reads the growth
//! of the resident set, which includes the allocator's own overhead. Hash
//! tables grow in powers of two, so bytes per key jump at some counts and
//! fall between them: hence several counts.
//!
//! Run with `cargo bench -p spillway --bench bytes_per_key`, optionally with
//! filters (`-- token_bucket governor`). Under `cargo test` it only checks
//! that every configuration runs, on a thousand keys.

mod common;

use std::alloc::System;
use std::env;
use std::mem::size_of;
use std::process::Command;

use spillway::Algorithm;
use spillway::algorithm::{FixedWindow, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket};
use spillway::clock::MonotonicClock;
use spillway::store::{MemoryOptions, RateLimiter, SharedState};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

use common::{LIMIT, Subject, Visit, each_subject, key, ours, token_bucket};

#[global_allocator]
static ALLOCATOR: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Counts on both sides of the tables' growth steps: ours have 64 shards,
/// governor's 8, and a table doubles when it is 7/8 full, so 500k, 1M and
/// 2M all sit just past a step, and 750k and 1.5M just before one.
const COUNTS: [usize; 7] = [
    100_000, 250_000, 500_000, 750_000, 1_000_000, 1_500_000, 2_000_000,
];

/// Configurations beyond `each_subject`'s.
const EXTRA: [&str; 4] = [
    "token_bucket/str",
    "token_bucket/compact_str",
    "governor/str",
    "token_bucket/default_options",
];

/// What one configuration measured.
struct Measured {
    keys: usize,
    held: usize,
    heap: isize,
    rss: isize,
    table: Option<usize>,
}

/// The resident set size in bytes.
fn rss() -> isize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<isize>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Builds a limiter with `make`, fills it with `keys` keys, each charged
/// half its capacity so that none is forgotten, and measures.
fn measure<S: Subject>(
    make: impl FnOnce() -> S,
    key_of: impl Fn(u64) -> S::Key,
    keys: usize,
) -> Measured {
    let rss_before = rss();
    let region = Region::new(ALLOCATOR);
    let subject = make();
    for i in 0..keys as u64 {
        assert!(
            subject.charge(&key_of(i), LIMIT / 2),
            "the fill is admitted"
        );
    }
    let stats = region.change();
    let rss = rss() - rss_before;
    let heap = stats.bytes_allocated as isize - stats.bytes_deallocated as isize;
    Measured {
        keys,
        held: subject.len(),
        heap,
        rss,
        table: subject.table_bytes(),
    }
}

/// Measures the configuration called `name`, if there is one.
fn run(name: &str, keys: usize) -> Option<Measured> {
    struct Find<'a> {
        name: &'a str,
        keys: usize,
        found: Option<Measured>,
    }
    impl Visit for Find<'_> {
        fn visit<S: Subject<Key = u64>>(&mut self, name: &str, make: &dyn Fn(usize) -> S) {
            if name == self.name {
                self.found = Some(measure(|| make(self.keys), key, self.keys));
            }
        }
    }
    let client = |i: u64| format!("client-{i:06}");
    match name {
        "token_bucket/str" => Some(measure(
            || ours::<_, String>(token_bucket(), keys),
            client,
            keys,
        )),
        "token_bucket/compact_str" => Some(measure(
            || ours::<_, compact_str::CompactString>(token_bucket(), keys),
            client,
            keys,
        )),
        "governor/str" => Some(measure(common::governor::<String>, client, keys)),
        "token_bucket/default_options" => Some(measure(
            || {
                RateLimiter::<_, u64>::with_options(
                    token_bucket(),
                    MonotonicClock::new(),
                    MemoryOptions::default(),
                )
            },
            key,
            keys,
        )),
        _ => {
            let mut find = Find {
                name,
                keys,
                found: None,
            };
            each_subject(&mut find);
            find.found
        }
    }
}

fn names() -> Vec<String> {
    struct Names(Vec<String>);
    impl Visit for Names {
        fn visit<S: Subject<Key = u64>>(&mut self, name: &str, _: &dyn Fn(usize) -> S) {
            self.0.push(name.to_owned());
        }
    }
    let mut names = Names(Vec::new());
    each_subject(&mut names);
    names.0.extend(EXTRA.map(String::from));
    names.0
}

/// The same configuration measured in a fresh process, so that neither the
/// allocator's free lists nor the resident set carry anything over.
fn in_child(name: &str, keys: usize) -> Measured {
    let exe = env::current_exe().expect("the bench's own path");
    let out = Command::new(exe)
        .args(["--child", name, &keys.to_string()])
        .output()
        .expect("the child runs");
    assert!(
        out.status.success(),
        "{name} at {keys}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let field = |k: &str| -> isize {
        text.split_whitespace()
            .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1)
    };
    Measured {
        keys,
        held: field("held") as usize,
        heap: field("heap"),
        rss: field("rss"),
        table: usize::try_from(field("table")).ok(),
    }
}

fn per_key(bytes: isize, keys: usize) -> f64 {
    bytes as f64 / keys as f64
}

fn sizes() {
    fn entry<A: Algorithm>(name: &str)
    where
        A::State: SharedState,
    {
        let cell = size_of::<(u64, <A::State as SharedState>::Cell)>();
        println!("  {name:<22} {cell:>3} bytes");
    }
    println!("Size of one table entry, (u64 key, state as the table holds it):");
    entry::<TokenBucket>("token_bucket");
    entry::<LeakyBucket>("leaky_bucket");
    entry::<FixedWindow>("fixed_window");
    entry::<SlidingWindow>("sliding_window");
    entry::<SlidingLog>("sliding_log (+ heap)");
    println!(
        "  {:<22} {:>3} bytes",
        "governor",
        size_of::<(u64, governor::state::InMemoryState)>()
    );
    println!("(hashbrown adds one control byte per slot and keeps at most 7/8 of slots full.)");
    println!();
}

fn main() {
    let args: Vec<String> = env::args().skip(1).collect();
    if let [flag, name, keys] = args.as_slice()
        && flag == "--child"
    {
        let m = run(name, keys.parse().expect("a key count")).expect("a known configuration");
        let table = m.table.map_or(-1, |t| t as isize);
        println!(
            "held={} heap={} rss={} table={table}",
            m.held, m.heap, m.rss
        );
        return;
    }
    if !args.iter().any(|a| a == "--bench") {
        // `cargo test --benches`: check that every configuration runs.
        for name in names() {
            let m = run(&name, 1_000).expect("a known configuration");
            assert_eq!(m.held, m.keys, "{name}");
        }
        return;
    }
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    sizes();
    println!(
        "{:<30} {:>9} {:>9} {:>11} {:>11} {:>11}",
        "configuration", "keys", "held", "heap B/key", "RSS B/key", "table B/key"
    );
    for name in names() {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        for keys in COUNTS {
            let m = in_child(&name, keys);
            let table = m.table.map_or("-".to_owned(), |t| {
                format!("{:.1}", per_key(t as isize, keys))
            });
            println!(
                "{name:<30} {keys:>9} {:>9} {:>11.1} {:>11.1} {table:>11}",
                m.held,
                per_key(m.heap, keys),
                per_key(m.rss, keys),
            );
        }
    }
}

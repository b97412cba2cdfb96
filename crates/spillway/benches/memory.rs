//! Throughput of one in-memory check, for every algorithm of the in-memory
//! store and for governor's keyed limiter on the same quota, in the same run.
//!
//! Keys are inserted before timing and then visited in a precomputed
//! pseudo-random order, so the hash tables are probed as under real traffic.
//! With two threads both share one limiter, and the time is the wall time
//! for all their checks together. Every figure is checks per second.
//!
//! Run with `cargo bench -p spillway --bench memory`, or pass a filter such
//! as `'^token_bucket/10k/'`. BENCHMARKS.md explains the set-up and records
//! the results.

mod common;

use std::cell::OnceCell;
use std::time::Duration;

use criterion::{Criterion, Throughput};

use common::{
    ACCESSES, LIMIT, Subject, Visit, access, each_subject, key, order, ours, token_bucket,
};

const KEY_COUNTS: [(&str, usize); 3] = [("1", 1), ("10k", 10_000), ("1M", 1_000_000)];

/// How keys are charged before timing.
#[derive(Clone, Copy)]
enum Prefill {
    /// Every key has half its burst used: the checks timed are admitted.
    Live,
    /// Every other key (in insertion order) is exhausted: about half the
    /// checks timed are denied.
    HalfDenied,
}

fn prefill<S: Subject>(subject: &S, keys: impl Iterator<Item = S::Key>, how: Prefill) {
    for (i, k) in keys.enumerate() {
        let cost = match how {
            Prefill::HalfDenied if i % 2 == 0 => LIMIT,
            _ => LIMIT / 2,
        };
        assert!(subject.charge(&k, cost), "prefill is admitted");
    }
}

/// The wall time for `iters` checks split over `threads` threads sharing
/// `subject` and one visiting order (each thread starts at its own point).
fn run<S: Subject>(subject: &S, access: &[S::Key], threads: usize, iters: u64) -> Duration {
    let parts: Vec<(&[S::Key], usize)> = (0..threads)
        .map(|t| (access, t * (access.len() / threads)))
        .collect();
    common::run_threads(subject, &parts, iters)
}

/// After a configuration has run: how many keys are held (none may have
/// been forgotten or evicted) and what share of a pass was denied.
fn report<S: Subject>(id: &str, subject: &S, access: &[S::Key], keys: usize) {
    let denied = access.iter().filter(|k| !subject.check(k)).count();
    eprintln!(
        "  [{id}] {} of {keys} keys held; {:.1}% of {} checks denied",
        subject.len(),
        100.0 * denied as f64 / access.len() as f64,
        access.len(),
    );
}

/// Times `subject` (built lazily, only if a filter selects it) with 1 and 2
/// threads, then reports on it.
fn bench_config<S: Subject>(
    c: &mut Criterion,
    group: &str,
    id: &str,
    threads: &[usize],
    keys: usize,
    build: impl FnOnce() -> (S, Vec<S::Key>),
) {
    let built = OnceCell::new();
    let mut build = Some(build);
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(1));
    for &t in threads {
        g.bench_function(format!("{id}/{t}t"), |b| {
            let (subject, access) = built.get_or_init(|| build.take().expect("built once")());
            b.iter_custom(|iters| run(subject, access, t, iters));
        });
    }
    g.finish();
    if let Some((subject, access)) = built.get().filter(|_| keys > 0) {
        report(&format!("{group}/{id}"), subject, access, keys);
    }
}

struct U64Keys<'c>(&'c mut Criterion);

impl Visit for U64Keys<'_> {
    fn visit<S: Subject<Key = u64>>(&mut self, name: &str, make: &dyn Fn(usize) -> S) {
        for (label, n) in KEY_COUNTS {
            let keyed = |how| {
                move || {
                    let subject = make(n);
                    prefill(&subject, (0..n as u64).map(key), how);
                    (subject, access(n))
                }
            };
            bench_config(self.0, name, label, &[1, 2], n, keyed(Prefill::Live));
            if n > 1 {
                let id = format!("{label}/half_denied");
                bench_config(self.0, name, &id, &[1], n, keyed(Prefill::HalfDenied));
            }
        }
    }
}

fn u64_keys(c: &mut Criterion) {
    each_subject(&mut U64Keys(c));
}

/// Pure arithmetic on the key, touching nothing shared: how much two
/// threads gain over one on this machine at this moment. On a shared
/// machine another process may hold a core; a limiter can scale no better
/// than this.
struct Control;

impl Subject for Control {
    type Key = u64;

    fn check(&self, key: &u64) -> bool {
        let mut x = *key;
        for _ in 0..16 {
            x = common::key(x);
        }
        x & 1 == 0
    }

    fn charge(&self, _: &u64, _: u32) -> bool {
        true
    }

    fn len(&self) -> usize {
        0
    }
}

fn control(c: &mut Criterion, id: &str) {
    bench_config(c, "control", id, &[1, 2], 0, || (Control, access(1 << 10)));
}

/// The text of the `i`th string key.
fn client(i: u64) -> String {
    format!("client-{i:06}")
}

fn string_keys(c: &mut Criterion) {
    // One hot key, hammered from both threads: the service's store against
    // governor.
    let hot = || vec![client(0); ACCESSES];
    bench_config(c, "memory_store", "1/str", &[1, 2], 1, || {
        let store = common::memory_store(1);
        prefill(&store, std::iter::once(client(0)), Prefill::Live);
        (store, hot())
    });
    bench_config(c, "governor", "1/str", &[1, 2], 1, || {
        let theirs = common::governor::<String>();
        prefill(&theirs, std::iter::once(client(0)), Prefill::Live);
        (theirs, hot())
    });
    for (label, n) in KEY_COUNTS.into_iter().filter(|&(_, n)| n > 1) {
        let id = format!("{label}/str");
        let visits = || order(n).map(client).take(ACCESSES).collect::<Vec<_>>();
        bench_config(c, "token_bucket", &id, &[1, 2], n, || {
            let ours = ours::<_, String>(token_bucket(), n);
            prefill(&ours, (0..n as u64).map(client), Prefill::Live);
            (ours, visits())
        });
        // Held inline (keys of up to 24 bytes), as the memory store holds
        // them.
        bench_config(c, "token_bucket_compact", &id, &[1, 2], n, || {
            let ours = ours::<_, compact_str::CompactString>(token_bucket(), n);
            prefill(&ours, (0..n as u64).map(client), Prefill::Live);
            (ours, visits())
        });
        bench_config(c, "memory_store", &id, &[1, 2], n, || {
            let store = common::memory_store(n);
            prefill(&store, (0..n as u64).map(client), Prefill::Live);
            (store, visits())
        });
        // Overrides set for other keys: what a check pays for there being
        // some (no one's own is met).
        bench_config(c, "memory_store_10k_overrides", &id, &[1, 2], n, || {
            let store = common::memory_store_with_overrides(n, 10_000);
            prefill(&store, (0..n as u64).map(client), Prefill::Live);
            (store, visits())
        });
        bench_config(c, "governor", &id, &[1, 2], n, || {
            let theirs = common::governor::<String>();
            prefill(&theirs, (0..n as u64).map(client), Prefill::Live);
            (theirs, visits())
        });
    }
}

fn config() -> Criterion {
    // About 3 s per figure, so that the whole run takes about 4 minutes on
    // 2 cores (under 10 even when the machine is busy).
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(700))
        .measurement_time(Duration::from_secs(2))
        .without_plots()
}

// What `criterion_group!` and `criterion_main!` expand to, written out so
// that no public item needs docs.
fn main() {
    let mut c = config().configure_from_args();
    // Before and after, as the machine's load may change in between.
    control(&mut c, "spin");
    u64_keys(&mut c);
    string_keys(&mut c);
    control(&mut c, "spin_end");
    c.final_summary();
}

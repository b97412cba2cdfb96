//! Paired ratios, for a shared and noisy machine: ours against governor, and
//! two threads against one, measured in alternating slices of about 20 ms so
//! that both sides of each ratio see the same load from other processes.
//! Each line gives the median of the per-pair ratios and their quartiles.
//!
//! Run with `cargo bench -p spillway --bench paired`, optionally with
//! filters (`-- 10k`, `-- hot`: a section runs only if a filter starts with
//! its label, `1`, `10k`, `1M` or `hot`). Under `cargo test` it only runs each pair once, on
//! tiny slices.

mod common;

use std::env;

use spillway::algorithm::FixedWindow;

use common::{LIMIT, Subject, access, key, ours, run_threads, token_bucket, window_quota};

/// Checks per second of `ops` checks over `threads` threads.
fn rate<S: Subject>(subject: &S, access: &[S::Key], threads: usize, ops: u64) -> f64 {
    let parts: Vec<(&[S::Key], usize)> = (0..threads)
        .map(|t| (access, t * (access.len() / threads)))
        .collect();
    ops as f64 / run_threads(subject, &parts, ops).as_secs_f64()
}

struct Pairs {
    rounds: usize,
    slice_secs: f64,
    filters: Vec<String>,
}

impl Pairs {
    /// Alternates `a` and `b` (each given a number of checks, returning
    /// checks per second) and prints the median of `a / b`.
    fn pair(&self, name: &str, mut a: impl FnMut(u64) -> f64, mut b: impl FnMut(u64) -> f64) {
        if !self.filters.is_empty() && !self.filters.iter().any(|f| name.contains(f.as_str())) {
            return;
        }
        // Size each slice from a first, untimed, run.
        let probe = 20_000;
        let ops_a = ((a(probe) * self.slice_secs) as u64).max(1_000);
        let ops_b = ((b(probe) * self.slice_secs) as u64).max(1_000);
        let (mut ratios, mut ra, mut rb) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..self.rounds {
            // Alternate which side goes first, so neither always follows the other.
            let (x, y) = if round % 2 == 0 {
                let x = a(ops_a);
                (x, b(ops_b))
            } else {
                let y = b(ops_b);
                (a(ops_a), y)
            };
            ratios.push(x / y);
            ra.push(x);
            rb.push(y);
        }
        let q = |v: &mut Vec<f64>, p: f64| {
            v.sort_by(f64::total_cmp);
            v[((v.len() - 1) as f64 * p).round() as usize]
        };
        println!(
            "{name:<44} {:>6.2}x  [{:.2} .. {:.2}]   {:>7.2} vs {:>7.2} M/s",
            q(&mut ratios, 0.5),
            q(&mut ratios, 0.25),
            q(&mut ratios, 0.75),
            q(&mut ra, 0.5) / 1e6,
            q(&mut rb, 0.5) / 1e6,
        );
    }
}

impl Pairs {
    /// Whether any pair of the section `label` may be selected: sections
    /// are skipped (their limiters not even filled) unless a filter starts
    /// with their label, or there is no filter.
    fn wants(&self, label: &str) -> bool {
        self.filters.is_empty() || self.filters.iter().any(|f| f.starts_with(label))
    }

    /// Two threads against one on the same limiter.
    fn scaling<S: Subject>(&self, name: &str, subject: &S, visits: &[S::Key]) {
        self.pair(
            &format!("{name} 2 threads / 1 thread"),
            |ops| rate(subject, visits, 2, ops),
            |ops| rate(subject, visits, 1, ops),
        );
    }
}

/// Spins on the key, touching nothing shared: what two threads can gain on
/// this machine at this moment.
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

fn main() {
    let args: Vec<String> = env::args().skip(1).collect();
    let benching = args.iter().any(|a| a == "--bench");
    let pairs = Pairs {
        rounds: if benching { 41 } else { 1 },
        slice_secs: if benching { 0.02 } else { 0.0001 },
        filters: args
            .iter()
            .filter(|a| !a.starts_with("--"))
            .cloned()
            .collect(),
    };
    println!(
        "{:<44} {:>7}  {:<16} {:>9}",
        "ratio (a / b)", "median", "[quartiles]", "a vs b"
    );
    let control = Control;
    let few = access(1 << 10);
    pairs.pair(
        "control: 2 threads / 1 thread",
        |n| rate(&control, &few, 2, n),
        |n| rate(&control, &few, 1, n),
    );
    for (label, n) in [("1", 1usize), ("10k", 10_000), ("1M", 1_000_000)] {
        if !pairs.wants(label) {
            continue;
        }
        let visits = access(n);
        let tb = ours::<_, u64>(token_bucket(), n);
        let fw = ours::<_, u64>(FixedWindow::new(window_quota()), n);
        let gov = common::governor::<u64>();
        for i in 0..n as u64 {
            tb.charge(&key(i), LIMIT / 2);
            fw.charge(&key(i), LIMIT / 2);
            gov.charge(&key(i), LIMIT / 2);
        }
        for threads in [1, 2] {
            pairs.pair(
                &format!("{label}/{threads}t: token_bucket / governor"),
                |ops| rate(&tb, &visits, threads, ops),
                |ops| rate(&gov, &visits, threads, ops),
            );
            pairs.pair(
                &format!("{label}/{threads}t: fixed_window / governor"),
                |ops| rate(&fw, &visits, threads, ops),
                |ops| rate(&gov, &visits, threads, ops),
            );
        }
        pairs.scaling(&format!("{label}: token_bucket"), &tb, &visits);
        pairs.scaling(&format!("{label}: fixed_window"), &fw, &visits);
        pairs.scaling(&format!("{label}: governor"), &gov, &visits);
    }
    if pairs.wants("hot") {
        hot_key(&pairs);
    }
}

/// One string key hammered from every thread (an attacker on every core),
/// through the service's store, against governor with `String` keys.
fn hot_key(pairs: &Pairs) {
    let key = String::from("client-000000");
    let visits = vec![key.clone(); 1 << 10];
    let store = common::memory_store(1);
    let gov = common::governor::<String>();
    store.charge(&key, LIMIT / 2);
    gov.charge(&key, LIMIT / 2);
    for threads in [1, 2] {
        pairs.pair(
            &format!("hot/str/{threads}t: memory_store / governor"),
            |ops| rate(&store, &visits, threads, ops),
            |ops| rate(&gov, &visits, threads, ops),
        );
    }
    // The same key through one limiter, without the store's rules and
    // verdicts: what the store adds.
    let limiter = ours::<_, compact_str::CompactString>(token_bucket(), 1);
    limiter.charge(&key, LIMIT / 2);
    pairs.pair(
        "hot/str/1t: memory_store / limiter",
        |ops| rate(&store, &visits, 1, ops),
        |ops| rate(&limiter, &visits, 1, ops),
    );
    pairs.scaling("hot/str: memory_store", &store, &visits);
    pairs.scaling("hot/str: governor", &gov, &visits);
}

//! The conformance suite on a real redis-server, standalone and as a
//! 3-master cluster: the Lua scripts must make exactly the in-memory store's
//! decisions.

use std::sync::atomic::{AtomicUsize, Ordering};

use spillway::algorithm::Renewed;
use spillway::store::{Check, Renew, Rule, Settle, Settled, Verdict};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_conformance::{Harness, HarnessError};
use spillway_redis::{Error, RedisOptions, RedisStore, Topology};
use tokio::runtime::Runtime;

struct Redis<'rt> {
    store: RedisStore,
    runtime: &'rt Runtime,
}

impl Harness for Redis<'_> {
    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
        self.runtime
            .block_on(self.store.check_at(checks, now_us))
            .map_err(harness_error)
    }

    fn reserve(
        &mut self,
        id: &str,
        checks: &[Check<'_>],
        now_us: u64,
    ) -> Result<Verdict, HarnessError> {
        self.runtime
            .block_on(self.store.reserve_at(id, checks, now_us))
            .map_err(harness_error)
    }

    fn settle(
        &mut self,
        id: &str,
        settles: &[Settle<'_>],
        now_us: u64,
    ) -> Result<Settled, HarnessError> {
        self.runtime
            .block_on(self.store.settle_at(id, settles, now_us))
            .map_err(harness_error)
    }

    fn renew(&mut self, renews: &[Renew<'_>], now_us: u64) -> Result<Vec<Renewed>, HarnessError> {
        self.runtime
            .block_on(self.store.renew_at(renews, now_us))
            .map_err(harness_error)
    }
}

fn harness_error(e: Error) -> HarnessError {
    match e {
        Error::Check(e) => e.into(),
        other => HarnessError::Other(other.to_string()),
    }
}

fn run_suite(topology: Topology) {
    let runtime = Runtime::new().expect("a tokio runtime");
    // Each case gets its own key prefix: they share one server.
    static CASE: AtomicUsize = AtomicUsize::new(0);
    let report = spillway_conformance::run_all(|rules: Vec<Rule>| {
        let options = RedisOptions {
            key_prefix: format!("conformance:{}:", CASE.fetch_add(1, Ordering::Relaxed)),
            // Generous: a debug build on a loaded 2-core machine.
            timeout: std::time::Duration::from_secs(5),
            ..RedisOptions::default()
        };
        let store = runtime
            .block_on(RedisStore::connect(topology.clone(), rules, options))
            .expect("the store connects");
        Redis {
            store,
            runtime: &runtime,
        }
    });
    assert!(report.cases > 0);
}

#[test]
fn standalone_passes_the_conformance_suite() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    run_suite(Topology::Standalone(server.url()));
}

#[test]
fn cluster_passes_the_conformance_suite() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    run_suite(Topology::Cluster(cluster.urls()));
}

/// Random requests, the same to the in-memory store and to the Redis
/// scripts, decision for decision: every algorithm, one check (each
/// algorithm's own script) or two (the general one), costs from 0 to above
/// capacity, time moving on in small and large steps. A deterministic
/// generator: a failure names its step and repeats.
#[test]
fn random_requests_decide_as_the_memory_store_does() {
    use spillway::Quota;
    use spillway::algorithm::{FixedWindow, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket};
    use spillway::store::{MemoryOptions, MemoryStore, RuleId};
    use std::num::NonZeroU32;
    use std::time::Duration;

    let Some(server) = RedisServer::start() else {
        return;
    };
    let nz = |n| NonZeroU32::new(n).expect("nonzero");
    // Tight enough that every algorithm denies often at these steps.
    let quota = Quota::new(nz(4), Duration::from_millis(10)).expect("a quota");
    let rules = vec![
        Rule::new("fw", FixedWindow::new(quota)),
        Rule::new("sl", SlidingLog::new(quota)),
        Rule::new("sw", SlidingWindow::new(quota)),
        Rule::new("tb", TokenBucket::new(quota, nz(3))),
        Rule::new("shape", LeakyBucket::shape(quota, nz(2))),
        Rule::new("police", LeakyBucket::police(quota, nz(3))),
    ];
    let runtime = Runtime::new().expect("a tokio runtime");
    let redis = runtime
        .block_on(RedisStore::connect(
            Topology::Standalone(server.url()),
            rules.clone(),
            RedisOptions {
                key_prefix: "random:".into(),
                timeout: Duration::from_secs(5),
                deny_cache_entries: 0,
                ..RedisOptions::default()
            },
        ))
        .expect("the store connects");
    let memory = MemoryStore::new(rules.clone(), MemoryOptions::default());

    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let keys = ["a", "b"];
    let mut now: u64 = 1_764_500_000_000_000;
    for step in 0..3_000 {
        // Time never goes back here: once a key is idle, the memory store
        // may forget it (on its next touch, or a sweep) while Redis keeps
        // it until its TTL, and a clock set back behind that point then
        // finds a fresh key in one and the old entries in the other. The
        // conformance files set the clock back on keys both still hold.
        now = match next(20) {
            0 => now + 1_000 * next(5_000), // idle for up to 5 s
            1 => now,                       // the same microsecond
            _ => now + next(400),
        };
        let count = if next(3) == 0 { 2 } else { 1 };
        let checks: Vec<Check<'_>> = (0..count)
            .map(|_| Check {
                rule: RuleId(next(rules.len() as u64) as usize),
                key: keys[next(2) as usize],
                cost: if next(10) == 0 { 5 } else { next(4) },
            })
            .collect();
        let theirs = memory.check_at(&checks, now);
        let ours = runtime.block_on(redis.check_at(&checks, now));
        match (theirs, ours) {
            (Ok(m), Ok(r)) => {
                assert_eq!(m.allowed, r.allowed, "step {step} at {now}: {checks:?}");
                assert_eq!(m.decisions, r.decisions, "step {step} at {now}: {checks:?}");
            }
            (Err(_), Err(Error::Check(_))) => {}
            (m, r) => panic!("step {step} at {now}: {checks:?}: memory {m:?}, redis {r:?}"),
        }
    }
}

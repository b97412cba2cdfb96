//! Settles on a real redis-server: the Lua scripts settle exactly as the
//! in-memory store does (random sequences of checks and settles, on both,
//! compared decision by decision), once per id, on a cluster across slots,
//! on the server's clock, and in the local fallback for its own charges.

use std::num::NonZeroU32;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::{
    AnyAlgorithm, Charged, FixedWindow, LeakyBucket, LeakyMode, SlidingLog, SlidingWindow,
    TokenBucket,
};
use spillway::clock::FakeClock;
use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId, Settle, Store};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_redis::{OnError, RedisOptions, RedisStore, Topology};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// Every algorithm, with quotas whose emission intervals are fractional.
fn rules() -> Vec<Rule> {
    let quota = |limit, ms| Quota::new(nz(limit), Duration::from_millis(ms)).unwrap();
    let algorithms: Vec<AnyAlgorithm> = vec![
        FixedWindow::new(quota(7, 1_000)).into(),
        SlidingLog::new(quota(7, 1_000)).into(),
        SlidingWindow::new(quota(7, 1_000)).into(),
        TokenBucket::new(quota(3, 1_000), nz(7)).into(),
        LeakyBucket::new(quota(3, 1_000), nz(7), LeakyMode::Shape).into(),
        LeakyBucket::new(quota(3, 1_000), nz(7), LeakyMode::Police).into(),
    ];
    algorithms
        .into_iter()
        .enumerate()
        .map(|(i, a)| Rule::new(format!("r{i}"), a))
        .collect()
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// An admitted request's charges, not settled yet: its settle id, and each
/// check's rule, key and charge.
type Open = (String, Vec<(RuleId, &'static str, Charged)>);

/// Runs random sequences of checks and settles on the memory store and on
/// Redis at `topology`, comparing every decision and every settle's outcome.
async fn differential(topology: Topology, seeds: u64) {
    let keys = ["a", "b"];
    let mut compared = 0;
    for seed in 0..seeds {
        let mut rng = Rng(seed);
        let rules = rules();
        let memory =
            MemoryStore::with_clock(rules.clone(), MemoryOptions::default(), FakeClock::new(0));
        let prefix = format!("settle:{seed}:");
        let store = RedisStore::connect(topology.clone(), rules.clone(), options(&prefix))
            .await
            .expect("connects");
        // Charges admitted so far, to settle.
        let mut open: Vec<Open> = Vec::new();
        let mut now = 1_000_000_000 + rng.below(1_000_000);
        for step in 0..40 {
            now += [0, 1, 999, 50_000, 333_333, 1_200_000][rng.below(6) as usize];
            if !open.is_empty() && rng.below(3) == 0 {
                let (id, charged) = open.swap_remove(rng.below(open.len() as u64) as usize);
                let settles: Vec<Settle<'_>> = charged
                    .iter()
                    .map(|&(rule, key, charged)| Settle {
                        rule,
                        key,
                        charged,
                        // As often a give-back as an overrun, up to
                        // past the debt's cap.
                        actual: if rng.below(2) == 0 {
                            rng.below(charged.cost + 1)
                        } else {
                            charged.cost + rng.below(2 * 7 + 3)
                        },
                    })
                    .collect();
                let want = memory.settle_at(&id, &settles, now).unwrap();
                let got = store.settle_at(&id, &settles, now).await.unwrap();
                assert_eq!(got, want, "seed {seed}, step {step}: settle {settles:?}");
                if rng.below(4) == 0 {
                    // Sent again: applied once only, on both.
                    let again = store.settle_at(&id, &settles, now).await.unwrap();
                    assert!(!again.applied);
                    assert_eq!(again.decisions, want.decisions);
                }
            } else {
                let n = 1 + rng.below(2) as usize;
                let checks: Vec<Check<'_>> = (0..n)
                    .map(|_| Check {
                        rule: RuleId(rng.below(6) as usize),
                        key: keys[rng.below(2) as usize],
                        cost: rng.below(5),
                    })
                    .collect();
                let want = memory.check_at(&checks, now).unwrap();
                let got = store.check_at(&checks, now).await.unwrap();
                assert_eq!(
                    got.decisions, want.decisions,
                    "seed {seed}, step {step}: check {checks:?}"
                );
                if want.allowed && checks.iter().any(|c| c.cost > 0) {
                    let charged = checks
                        .iter()
                        .zip(&want.decisions)
                        .map(|(c, d)| (c.rule, c.key, Charged::of(c.cost, now, d)))
                        .collect();
                    open.push((format!("s{seed}-{step}"), charged));
                }
            }
            compared += 1;
        }
    }
    assert!(compared > 0);
}

fn options(prefix: &str) -> RedisOptions {
    RedisOptions {
        key_prefix: prefix.to_string(),
        timeout: Duration::from_secs(5),
        ..RedisOptions::default()
    }
}

#[tokio::test]
async fn a_standalone_server_settles_as_the_memory_store_does() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    differential(Topology::Standalone(server.url()), 60).await;
}

#[tokio::test]
async fn a_cluster_settles_as_the_memory_store_does_across_slots() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    differential(Topology::Cluster(cluster.urls()), 15).await;
}

/// On the server's own clock, through [`Store::settle`]: a reservation
/// given back, an overrun into debt, and a settle sent twice.
#[tokio::test]
async fn a_settle_on_the_servers_clock_applies_once() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let hour = Duration::from_secs(3600);
    let rules = vec![
        Rule::new("fw", FixedWindow::new(Quota::new(nz(100), hour).unwrap())),
        Rule::new(
            "tb",
            TokenBucket::new(Quota::new(nz(100), hour).unwrap(), nz(100)),
        ),
    ];
    let s = RedisStore::connect(Topology::Standalone(server.url()), rules, options("clock:"))
        .await
        .expect("connects");
    let request: Vec<Check<'_>> = (0..2)
        .map(|r| Check {
            rule: RuleId(r),
            key: "k",
            cost: 50,
        })
        .collect();
    let verdict = s.check(&request).await.unwrap();
    assert!(verdict.allowed);
    let settle = |actual| -> Vec<Settle<'_>> {
        request
            .iter()
            .zip(&verdict.decisions)
            .map(|(c, d)| Settle {
                rule: c.rule,
                key: c.key,
                charged: Charged::of(c.cost, verdict.decided_at, d),
                actual,
            })
            .collect()
    };
    let settled = s.settle("once", &settle(10)).await.unwrap();
    assert!(settled.applied);
    for d in &settled.decisions {
        assert_eq!(d.remaining, 90, "{d:?}");
    }
    let again = s.settle("once", &settle(10)).await.unwrap();
    assert!(!again.applied);
    assert_eq!(again.decisions[0].remaining, 90);
    assert_eq!(s.stats().settles, 1);

    // Another request, 50 reserved, 190 used: 140 past the 90 left.
    let verdict = s.check(&request).await.unwrap();
    assert!(verdict.allowed);
    let settles: Vec<Settle<'_>> = request
        .iter()
        .zip(&verdict.decisions)
        .map(|(c, d)| Settle {
            rule: c.rule,
            key: c.key,
            charged: Charged::of(c.cost, verdict.decided_at, d),
            actual: 190,
        })
        .collect();
    let debt = s.settle("over", &settles).await.unwrap();
    assert!(debt.applied);
    let denied = s.check(&request[..1]).await.unwrap();
    assert!(!denied.allowed);
    assert!(denied.decisions[0].retry_after.is_some());
    let denied = s.check(&request[1..]).await.unwrap();
    assert!(!denied.allowed);
    // 100 over empty at 36 s a unit: more than an hour to wait.
    let wait = denied.decisions[0].retry_after.unwrap();
    assert!(wait > Duration::from_secs(3600), "{wait:?}");

    let bad = s.settle("", &settles).await.expect_err("an empty id");
    assert!(bad.to_string().contains("settle id"), "{bad}");
}

/// A charge the local fallback made while Redis was down is settled there,
/// and one admitted without a decision (fail-open) is settled nowhere.
#[tokio::test]
async fn the_local_fallback_settles_its_own_charges() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let minute = Duration::from_secs(60);
    let rule = Rule::new("fw", FixedWindow::new(Quota::new(nz(8), minute).unwrap()));
    let s = RedisStore::connect(
        Topology::Standalone(server.url()),
        vec![rule],
        RedisOptions {
            on_error: OnError::Local { instances: nz(2) },
            timeout: Duration::from_millis(200),
            retry_interval: Duration::from_secs(30),
            ..RedisOptions::default()
        },
    )
    .await
    .expect("connects");
    server.kill();
    let check = [Check {
        rule: RuleId(0),
        key: "k",
        cost: 4,
    }];
    let verdict = s.check(&check).await.unwrap();
    assert!(verdict.allowed, "4 of this instance's 4");
    assert!(!s.check(&check).await.unwrap().allowed);
    let settle = [Settle {
        rule: RuleId(0),
        key: "k",
        charged: Charged::of(4, verdict.decided_at, &verdict.decisions[0]),
        actual: 1,
    }];
    let settled = s.settle("local", &settle).await.unwrap();
    assert!(settled.applied);
    assert_eq!(settled.decisions[0].remaining, 3);
    let three = [Check {
        rule: RuleId(0),
        key: "k",
        cost: 3,
    }];
    assert!(
        s.check(&three).await.unwrap().allowed,
        "3 came back locally"
    );
    let nothing = [Settle {
        charged: Charged {
            at: 0,
            ..settle[0].charged
        },
        ..settle[0]
    }];
    let skipped = s.settle("open", &nothing).await.unwrap();
    assert!(!skipped.applied);
}

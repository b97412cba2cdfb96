//! Concurrency leases on a real redis-server: a renew whose answer was lost
//! and is sent again holds one slot, not two; a key's leases are one sorted
//! set whose every operation costs the same few commands however many
//! leases it holds. On a Redis Cluster, a lease decided beside a rule of
//! another node is named by its own node's clock: its release, renew and
//! refund act on it and no other, and one taken while the other node does
//! not answer is named by nobody rather than wrongly.

use std::num::NonZeroU32;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::{Charged, Concurrency, FixedWindow};
use spillway::store::{Check, Renew, Rule, RuleId, Settle, Store};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_redis::{RedisOptions, RedisStore, Topology};

const KEY: &str = "spillway:{r:k}:ls";

async fn store(server: &RedisServer, slots: u32, options: RedisOptions) -> RedisStore {
    let quota = Quota::new(NonZeroU32::new(slots).unwrap(), Duration::from_secs(30)).unwrap();
    let rules = vec![Rule::new("r", Concurrency::new(quota))];
    RedisStore::connect(Topology::Standalone(server.url()), rules, options)
        .await
        .expect("connects")
}

fn take() -> [Check<'static>; 1] {
    [Check {
        rule: RuleId(0),
        key: "k",
        cost: 1,
    }]
}

/// Takes a slot and answers the charge that names its lease.
async fn lease(store: &RedisStore) -> Charged {
    let verdict = store.check(&take()).await.expect("answers");
    assert!(verdict.allowed);
    Charged::of(1, verdict.decided_at, &verdict.decisions[0])
}

fn renew(charged: Charged) -> [Renew<'static>; 1] {
    [Renew {
        rule: RuleId(0),
        key: "k",
        charged,
    }]
}

/// The members of the key's set and their scores (the time each slot's
/// lease ends, in µs), from the raw RESP reply (of a few members: the
/// reply is read in one piece).
fn members(server: &RedisServer) -> Vec<(String, u64)> {
    let reply = server.command(&format!("ZRANGE {KEY} 0 -1 WITHSCORES"));
    let items: Vec<&str> = reply
        .split("\r\n")
        .filter(|l| !l.is_empty() && !l.starts_with('*') && !l.starts_with('$'))
        .collect();
    items
        .chunks_exact(2)
        .map(|p| (p[0].to_string(), p[1].parse().expect("a score")))
        .collect()
}

/// Every command the server has run, scripts' own included.
fn commands_run(server: &RedisServer) -> u64 {
    server
        .command("INFO commandstats")
        .lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[tokio::test]
async fn a_renew_whose_answer_was_lost_and_is_sent_again_holds_one_slot() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let options = RedisOptions {
        timeout: Duration::from_millis(100),
        ..RedisOptions::default()
    };
    let s = store(&server, 2, options).await;
    let charged = lease(&s).await;
    // A first renew loads the script the renews run.
    assert!(s.renew(&renew(charged)).await.expect("answers")[0].was_held);
    let taken = members(&server);
    assert_eq!(taken.len(), 1);
    // Redis hangs while the next renew is on its way: the call times out,
    // and Redis runs it once it goes on.
    tokio::time::sleep(Duration::from_millis(20)).await;
    server.pause();
    let lost = s.renew(&renew(charged)).await;
    server.resume();
    assert!(lost.is_err(), "{lost:?}");
    let mut ran = false;
    for _ in 0..100 {
        let now = members(&server);
        if now.len() == 1 && now[0].1 > taken[0].1 {
            ran = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ran, "the renew Redis received ran: {:?}", members(&server));
    // The renewer sends it again: the same lease, held, one slot of two.
    let again = s.renew(&renew(charged)).await.expect("answers");
    assert!(again[0].was_held && again[0].decision.allowed);
    assert_eq!(again[0].decision.remaining, 1);
    assert_eq!(members(&server).len(), 1);
    // And its release frees it.
    let release = [Settle {
        rule: RuleId(0),
        key: "k",
        charged,
        actual: 0,
    }];
    s.settle("release-1", &release).await.expect("answers");
    assert!(members(&server).is_empty());
}

#[tokio::test]
async fn a_busy_keys_leases_cost_the_same_few_commands_as_an_idle_keys() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let s = store(&server, 5_000, RedisOptions::default()).await;
    // The cost of a take, a renew and a release on a key with one lease...
    let cost_of = async |s: &RedisStore| {
        let before = commands_run(&server);
        let charged = lease(s).await;
        let taken = commands_run(&server) - before;
        let before = commands_run(&server);
        assert!(s.renew(&renew(charged)).await.expect("answers")[0].was_held);
        let renewed = commands_run(&server) - before;
        let before = commands_run(&server);
        let release = [Settle {
            rule: RuleId(0),
            key: "k",
            charged,
            actual: 0,
        }];
        s.settle(&format!("release-{}", charged.at), &release)
            .await
            .expect("answers");
        let released = commands_run(&server) - before;
        (taken, renewed, released)
    };
    let idle = cost_of(&s).await;
    assert!(idle.0 <= 20 && idle.1 <= 20 && idle.2 <= 20, "{idle:?}");
    // ...and on a key with 3,000 more held: a renew and a release from the
    // middle of the set (the old log walked to them from its newest end),
    // and a take, renew and release of a new one.
    let mut held = Vec::new();
    for _ in 0..3_000 {
        held.push(lease(&s).await);
    }
    let before = commands_run(&server);
    assert!(s.renew(&renew(held[100])).await.expect("answers")[0].was_held);
    let renewed = commands_run(&server) - before;
    let before = commands_run(&server);
    let release = [Settle {
        rule: RuleId(0),
        key: "k",
        charged: held[1_500],
        actual: 0,
    }];
    s.settle("middle", &release).await.expect("answers");
    let released = commands_run(&server) - before;
    let busy = cost_of(&s).await;
    for n in [renewed, released, busy.0, busy.1, busy.2] {
        assert!(
            n <= 20,
            "{n} commands: renew {renewed}, release {released}, {busy:?}"
        );
    }
    assert_eq!(server.command(&format!("ZCARD {KEY}")).trim(), ":2999");
}

/// A fixed window of a thousand an hour and `slots` in flight with leases
/// of `lease`, on a cluster, with no deny cache and `options`' failure
/// policy.
async fn two_rules(
    cluster: &RedisCluster,
    slots: u32,
    lease: Duration,
    options: RedisOptions,
) -> RedisStore {
    let hourly = Quota::new(NonZeroU32::new(1_000).unwrap(), Duration::from_secs(3600)).unwrap();
    let rules = vec![
        Rule::new("fw", FixedWindow::new(hourly)),
        Rule::new(
            "cc",
            Concurrency::new(Quota::new(NonZeroU32::new(slots).unwrap(), lease).unwrap()),
        ),
    ];
    let options = RedisOptions {
        timeout: Duration::from_millis(200),
        deny_cache_entries: 0,
        ..options
    };
    RedisStore::connect(Topology::Cluster(cluster.urls()), rules, options)
        .await
        .expect("connects")
}

/// [`two_rules`], with a key whose two rules live on different masters.
async fn cluster_of_two_nodes(
    cluster: &RedisCluster,
    slots: u32,
    lease: Duration,
) -> (RedisStore, &'static str, usize, usize) {
    let store = two_rules(cluster, slots, lease, RedisOptions::default()).await;
    for key in ["k", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9"] {
        let fw = cluster.master_of(&format!("spillway:{{fw:{key}}}:fwi:3600000000"));
        let cc = cluster.master_of(&format!("spillway:{{cc:{key}}}:ls"));
        if let (Some(fw), Some(cc)) = (fw, cc)
            && fw != cc
        {
            return (store, key, fw, cc);
        }
    }
    panic!("no key whose two rules live on two masters");
}

fn both(key: &str) -> [Check<'_>; 2] {
    [
        Check {
            rule: RuleId(0),
            key,
            cost: 1,
        },
        Check {
            rule: RuleId(1),
            key,
            cost: 1,
        },
    ]
}

async fn in_flight(store: &RedisStore, key: &str) -> u64 {
    let peek = [Check {
        rule: RuleId(1),
        key,
        cost: 0,
    }];
    store.check(&peek).await.expect("answers").decisions[0].remaining
}

#[tokio::test]
async fn on_a_cluster_a_lease_beside_another_nodes_rule_is_released_and_renewed_by_its_name() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let (s, key, _, _) = cluster_of_two_nodes(&cluster, 2, Duration::from_secs(30)).await;
    // The verdict's time is one node's, the lease the other's: ten
    // requests, each released at once, leave every slot free.
    for n in 0..10 {
        let v = s.check(&both(key)).await.expect("answers");
        assert!(v.allowed);
        let charged = Charged::of(1, v.decided_at, &v.decisions[1]);
        let renew = [Renew {
            rule: RuleId(1),
            key,
            charged,
        }];
        let r = s.renew(&renew).await.expect("answers");
        assert!(r[0].was_held, "request {n}: its own lease, renewed");
        assert_eq!(in_flight(&s, key).await, 1, "request {n}: one slot");
        let release = [Settle {
            rule: RuleId(1),
            key,
            charged,
            actual: 0,
        }];
        s.settle(&format!("r{n}"), &release).await.expect("answers");
        assert_eq!(in_flight(&s, key).await, 2, "request {n}: released");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_refund_gives_back_the_requests_own_lease() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let (s, key, _, _) = cluster_of_two_nodes(&cluster, 10_000, Duration::from_secs(60)).await;
    let s = std::sync::Arc::new(s);
    // The fixed window is spent: a request of both rules is admitted by
    // the concurrency rule's node and denied by the other, and refunded,
    // while requests of the concurrency rule alone take and release slots.
    let fw = [Check {
        rule: RuleId(0),
        key,
        cost: 1_000,
    }];
    assert!(s.check(&fw).await.expect("answers").allowed);
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let s = s.clone();
            tokio::spawn(async move {
                for i in 0..60 {
                    if t % 2 == 0 {
                        assert!(!s.check(&both(key)).await.expect("answers").allowed);
                    } else {
                        let one = [Check {
                            rule: RuleId(1),
                            key,
                            cost: 1,
                        }];
                        let v = s.check(&one).await.expect("answers");
                        assert!(v.allowed);
                        let charged = Charged::of(1, v.decided_at, &v.decisions[0]);
                        let release = [Settle {
                            rule: RuleId(1),
                            key,
                            charged,
                            actual: 0,
                        }];
                        s.settle(&format!("b{t}-{i}"), &release)
                            .await
                            .expect("answers");
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("the task");
    }
    assert_eq!(in_flight(&s, key).await, 10_000, "every slot free");
}

#[tokio::test]
async fn on_a_cluster_a_lease_taken_while_another_node_is_away_is_named_by_its_first_renew() {
    let Some(mut cluster) = RedisCluster::start() else {
        return;
    };
    let (s, key, fw, cc) = cluster_of_two_nodes(&cluster, 3, Duration::from_secs(2)).await;
    // The fixed window's node hangs: two requests are let in (fail open),
    // their slots taken on the other node.
    cluster.nodes_mut()[fw].pause();
    let mut charges = Vec::new();
    for _ in 0..2 {
        let v = s.check(&both(key)).await.expect("answers");
        assert!(v.allowed);
        charges.push(Charged::of(1, v.decided_at, &v.decisions[1]));
    }
    cluster.nodes_mut()[fw].resume();
    // The verdict has no time of the concurrency node's: the charges name
    // no lease. The slots the checks took are held by nobody until they
    // end (the strict side: 2 of 3); each request takes a slot of its own
    // at the first renew that finds one free, named by that renew.
    let mut named = [false; 2];
    for _ in 0..6 {
        for (n, c) in charges.iter_mut().enumerate() {
            let renew = [Renew {
                rule: RuleId(1),
                key,
                charged: *c,
            }];
            let r = s.renew(&renew).await.expect("answers");
            assert_eq!(r[0].was_held, named[n], "request {n}: {r:?}");
            if r[0].decision.allowed && !named[n] {
                *c = r[0].names(*c);
                named[n] = true;
            }
        }
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    // Both hold a slot of their own, renewed; the others ended: one free.
    assert_eq!(named, [true, true]);
    assert_eq!(in_flight(&s, key).await, 1);
    let members = cluster.nodes()[cc].command(&format!("ZCARD spillway:{{cc:{key}}}:ls"));
    assert_eq!(members.trim(), ":2");
}

#[tokio::test]
async fn a_lease_named_by_its_holder_is_taken_at_its_renew_and_released_by_its_name() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let s = store(&server, 2, RedisOptions::default()).await;
    // A request let in while Redis was away: its front end draws a name.
    let drawn = Concurrency::drawn(1, 0x5eed);
    for sent in 0..2 {
        let r = s.renew(&renew(drawn)).await.expect("answers");
        assert_eq!(r[0].was_held, sent == 1, "{r:?}");
        assert_eq!(r[0].decision.remaining, 1);
    }
    let release = [Settle {
        rule: RuleId(0),
        key: "k",
        charged: drawn,
        actual: 0,
    }];
    s.settle("drawn-release", &release).await.expect("answers");
    assert!(members(&server).is_empty(), "{:?}", members(&server));
}

#[tokio::test]
async fn on_a_cluster_a_request_refused_fail_closed_gives_back_its_own_lease() {
    let Some(mut cluster) = RedisCluster::start() else {
        return;
    };
    let (_, key, fw, _) = cluster_of_two_nodes(&cluster, 2, Duration::from_secs(30)).await;
    let options = RedisOptions {
        on_error: spillway_redis::OnError::FailClosed,
        ..RedisOptions::default()
    };
    let s = two_rules(&cluster, 2, Duration::from_secs(30), options).await;
    assert_eq!(in_flight(&s, key).await, 2);
    // The fixed window's node hangs while request A is on its way: its
    // slot is taken, then A is refused (fail_closed) and gives it back.
    // Meanwhile B takes the other slot.
    cluster.nodes_mut()[fw].pause();
    let s2 = s.clone();
    let a = tokio::spawn(async move { s2.check(&both(key)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let only = [Check {
        rule: RuleId(1),
        key,
        cost: 1,
    }];
    let vb = s.check(&only).await.expect("answers");
    assert!(vb.allowed);
    let b = Charged::of(1, vb.decided_at, &vb.decisions[0]);
    assert!(a.await.expect("the task").is_err(), "A is refused");
    cluster.nodes_mut()[fw].resume();
    // A gave back its own slot, not B's: B is held, and B's release frees
    // the last.
    assert_eq!(in_flight(&s, key).await, 1);
    let release = [Settle {
        rule: RuleId(1),
        key,
        charged: b,
        actual: 0,
    }];
    s.settle("release-b", &release).await.expect("answers");
    assert_eq!(in_flight(&s, key).await, 2);
}

//! Reservations given back when no settle comes in time
//! (`Rule::release_unsettled_after`), on a real redis-server and a real
//! Redis Cluster: given back on the server's clock by any call that meets
//! the key; a key holds at most `MAX_HOLDS_PER_KEY` open; a reservation
//! refunded because another node denied its request is closed with it,
//! and never given back a second time.

use std::num::NonZeroU32;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::{Charged, SlidingLog};
use spillway::store::{Check, Hold, MAX_HOLDS_PER_KEY, Rule, RuleId, Settle, Store};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_redis::{RedisOptions, RedisStore, Topology};

/// A budget on a sliding log of an hour: on the server's real clock, no
/// window edge for a test to cross.
fn tokens(limit: u32, within: Duration) -> Rule {
    let quota = Quota::per_hour(NonZeroU32::new(limit).unwrap());
    Rule::new("tokens", SlidingLog::new(quota)).release_unsettled_after(within)
}

fn charge(key: &str, cost: u64) -> [Check<'_>; 1] {
    [Check {
        rule: RuleId(0),
        key,
        cost,
    }]
}

async fn left(store: &RedisStore, key: &str) -> u64 {
    store
        .check(&charge(key, 0))
        .await
        .expect("answers")
        .decisions[0]
        .remaining
}

async fn standalone(server: &RedisServer, rule: Rule) -> RedisStore {
    RedisStore::connect(
        Topology::Standalone(server.url()),
        vec![rule],
        RedisOptions::default(),
    )
    .await
    .expect("connects")
}

#[tokio::test]
async fn a_reservation_is_given_back_on_the_servers_clock_and_a_late_settle_charges_in_full() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = standalone(&server, tokens(1_000, Duration::from_millis(300))).await;
    // Real times are past 2^47 µs: what the store keeps of a charge must
    // be exact there too.
    let v = store
        .reserve("r1", &charge("k", 600))
        .await
        .expect("answers");
    assert!(v.allowed);
    assert_eq!(left(&store, "k").await, 400);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(left(&store, "k").await, 1_000);
    assert_eq!(store.stats().reservations_given_back, 1);
    let late = [Settle {
        rule: RuleId(0),
        key: "k",
        charged: Charged::of(600, v.decided_at, &v.decisions[0]).held_open(),
        actual: 250,
    }];
    let settled = store.settle("r1", &late).await.expect("answers");
    assert!(settled.applied);
    assert_eq!(settled.decisions[0].remaining, 750);
    // Nothing is left of it.
    assert_eq!(server.command("EXISTS spillway:{tokens:k}:sl:rs"), ":0\r\n");
}

fn within(within: Duration) -> Hold<'static> {
    Hold { only: None, within }
}

/// `reserve_held`: the script is told the shorter time.
#[tokio::test]
async fn a_reservation_held_for_less_than_its_rules_time_is_given_back_at_its_own() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = standalone(&server, tokens(1_000, Duration::from_secs(3600))).await;
    let short = store
        .reserve_held("r1", &charge("k", 600), within(Duration::from_millis(300)))
        .await
        .expect("answers");
    assert!(short.allowed);
    let long = store
        .reserve_held("r2", &charge("k", 100), within(Duration::from_secs(7200)))
        .await
        .expect("answers");
    assert!(long.allowed);
    assert_eq!(left(&store, "k").await, 300);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // r1 is back; r2 is held for the rule's hour.
    assert_eq!(left(&store, "k").await, 900);
    assert_eq!(store.stats().reservations_given_back, 1);
}

/// A check whose charge is not held (a rule the request met but will not
/// settle) is charged as a check is, and still gives back its key's
/// reservations that are due.
#[tokio::test]
async fn only_the_charges_a_reservation_names_are_held() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = standalone(&server, tokens(1_000, Duration::from_millis(300))).await;
    let not_held = Hold {
        only: Some(&[false]),
        within: Duration::MAX,
    };
    assert!(
        store
            .reserve_held("r1", &charge("k", 100), not_held)
            .await
            .expect("answers")
            .allowed
    );
    assert!(
        store
            .reserve("r2", &charge("k", 200))
            .await
            .expect("answers")
            .allowed
    );
    assert_eq!(left(&store, "k").await, 700);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // r2 is given back by a call that holds nothing; r1 stands.
    let again = store
        .reserve_held("r3", &charge("k", 1), not_held)
        .await
        .expect("answers");
    assert_eq!(again.decisions[0].remaining, 899);
    assert_eq!(store.stats().reservations_given_back, 1);
    assert_eq!(server.command("ZCARD spillway:{tokens:k}:sl:rs"), ":0\r\n");
}

#[tokio::test]
async fn a_key_holds_a_bounded_number_open_and_denies_one_more_until_one_is_settled() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = standalone(&server, tokens(5_000, Duration::from_secs(3600))).await;
    let mut first = None;
    for i in 0..MAX_HOLDS_PER_KEY {
        let v = store
            .reserve(&format!("r{i}"), &charge("k", 1))
            .await
            .expect("answers");
        assert!(v.allowed);
        first.get_or_insert(v);
    }
    let open = MAX_HOLDS_PER_KEY as u64;
    let denied = store
        .reserve("one-more", &charge("k", 1))
        .await
        .expect("answers");
    assert!(!denied.allowed);
    let wait = denied.decisions[0].retry_after.expect("a wait");
    assert!(
        wait > Duration::from_secs(3590) && wait <= Duration::from_secs(3600),
        "{wait:?}"
    );
    assert_eq!(denied.decisions[0].remaining, 5_000 - open);
    // Nothing was charged, nothing given back: no count lost.
    assert_eq!(left(&store, "k").await, 5_000 - open);
    assert_eq!(
        server.command("ZCARD spillway:{tokens:k}:sl:rs"),
        format!(":{MAX_HOLDS_PER_KEY}\r\n")
    );
    // One settled: one more fits.
    let v = first.expect("reserved");
    let settle = [Settle {
        rule: RuleId(0),
        key: "k",
        charged: Charged::of(1, v.decided_at, &v.decisions[0]).held_open(),
        actual: 1,
    }];
    store.settle("r0", &settle).await.expect("answers");
    let v = store
        .reserve("one-more", &charge("k", 1))
        .await
        .expect("answers");
    assert!(v.allowed);
    assert_eq!(left(&store, "k").await, 5_000 - open - 1);
}

/// A cluster store of `tokens` (given back after `within`) and `gate` (one
/// an hour), and a key whose two rules live on two masters: (store, key,
/// the gate's master).
async fn two_nodes(
    cluster: &RedisCluster,
    within: Duration,
    options: RedisOptions,
) -> (RedisStore, &'static str, usize) {
    let one = Quota::per_hour(NonZeroU32::new(1).unwrap());
    let rules = vec![
        tokens(1_000, within),
        Rule::new("gate", SlidingLog::new(one)),
    ];
    let store = RedisStore::connect(Topology::Cluster(cluster.urls()), rules, options)
        .await
        .expect("connects");
    for key in ["k", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9"] {
        let a = cluster.master_of(&format!("spillway:{{tokens:{key}}}:sl"));
        let b = cluster.master_of(&format!("spillway:{{gate:{key}}}:sl"));
        if let (Some(a), Some(b)) = (a, b)
            && a != b
        {
            return (store, key, b);
        }
    }
    panic!("no key whose two rules live on two masters");
}

/// A check of the gate alone: the first shuts it for the hour.
fn gate(key: &str) -> [Check<'_>; 1] {
    [Check {
        rule: RuleId(1),
        key,
        cost: 1,
    }]
}

fn both(key: &str, cost: u64) -> [Check<'_>; 2] {
    [
        Check {
            rule: RuleId(0),
            key,
            cost,
        },
        Check {
            rule: RuleId(1),
            key,
            cost: 1,
        },
    ]
}

/// The other node answers (a denial) only after the reservation's time
/// has passed: the refund finds it given back already, and gives nothing
/// back a second time.
#[tokio::test]
async fn on_a_cluster_a_refund_after_the_reservation_was_given_back_gives_nothing_twice() {
    let Some(mut cluster) = RedisCluster::start() else {
        return;
    };
    let options = RedisOptions {
        timeout: Duration::from_secs(5),
        ..RedisOptions::default()
    };
    let (store, key, gate_node) = two_nodes(&cluster, Duration::from_millis(200), options).await;
    assert!(
        store
            .check(&charge(key, 100))
            .await
            .expect("answers")
            .allowed
    );
    assert!(store.check(&gate(key)).await.expect("answers").allowed);
    cluster.nodes_mut()[gate_node].pause();
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move { store.reserve("r1", &both(key, 500)).await })
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    cluster.nodes_mut()[gate_node].resume();
    let denied = waiting.await.expect("joined").expect("answers");
    assert!(!denied.allowed);
    // The 100 kept stay: 500 given back once, not twice.
    assert_eq!(left(&store, key).await, 900);
}

/// The other node does not answer and the request is let in (fail_open):
/// the reservation held on the node that answered cannot be settled by a
/// verdict that is not Redis's, so it is closed and stands, never given
/// back for free.
#[tokio::test]
async fn on_a_cluster_a_reservation_let_in_by_the_failure_policy_stands() {
    let Some(mut cluster) = RedisCluster::start() else {
        return;
    };
    let options = RedisOptions {
        timeout: Duration::from_millis(300),
        retry_interval: Duration::from_millis(200),
        ..RedisOptions::default()
    };
    let (store, key, gate_node) = two_nodes(&cluster, Duration::from_millis(500), options).await;
    cluster.nodes_mut()[gate_node].pause();
    let v = store.reserve("r1", &both(key, 400)).await.expect("answers");
    cluster.nodes_mut()[gate_node].resume();
    assert!(v.allowed && !v.is_decided(1));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(left(&store, key).await, 600);
    assert_eq!(store.stats().reservations_given_back, 0);
}

#[tokio::test]
async fn on_a_cluster_a_reservation_refunded_with_its_denied_request_is_never_given_back() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let within = Duration::from_millis(300);
    let (store, key, _) = two_nodes(&cluster, within, RedisOptions::default()).await;
    // 100 charged and kept (never given back), then the gate shut.
    assert!(
        store
            .check(&charge(key, 100))
            .await
            .expect("answers")
            .allowed
    );
    assert!(store.check(&gate(key)).await.expect("answers").allowed);
    // Reserved on one node, denied on the other: refunded, and closed.
    let denied = store.reserve("r1", &both(key, 500)).await.expect("answers");
    assert!(!denied.allowed);
    assert_eq!(left(&store, key).await, 900);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Given back a second time, the 100 kept would go too.
    assert_eq!(left(&store, key).await, 900);
    assert_eq!(store.stats().reservations_given_back, 0);
}

#[tokio::test]
async fn a_reset_key_forgets_its_reservations() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = standalone(&server, tokens(1_000, Duration::from_millis(200))).await;
    assert!(
        store
            .reserve("r1", &charge("k", 400))
            .await
            .expect("answers")
            .allowed
    );
    assert!(store.reset(RuleId(0), "k").await.expect("answers"));
    assert!(
        store
            .check(&charge("k", 300))
            .await
            .expect("answers")
            .allowed
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(left(&store, "k").await, 700, "the 400 went with the reset");
    assert_eq!(store.stats().reservations_given_back, 0);
}

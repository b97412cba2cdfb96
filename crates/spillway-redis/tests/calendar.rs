//! Calendar windows (a day, a week, a month in a time zone) on a real
//! redis-server and a real Redis Cluster, on a virtual clock: every
//! decision is the in-memory store's, across a daylight saving change and
//! a month's end, and a settle moves only its own period.

use std::num::NonZeroU32;

use spillway::algorithm::{Calendar, Charged, FixedWindow, Period};
use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId, Settle};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_redis::{RedisOptions, RedisStore, Topology};

fn calendar(name: &str, limit: u32, period: Period, zone: &str) -> Rule {
    let calendar = Calendar::new(period, zone.parse().expect("a zone"));
    Rule::new(
        name,
        FixedWindow::calendar(NonZeroU32::new(limit).expect("nonzero"), calendar),
    )
}

fn rules() -> Vec<Rule> {
    vec![
        calendar("daily", 3, Period::Day, "America/New_York"),
        calendar("monthly", 5, Period::Month, "UTC"),
        calendar("weekly", 4, Period::Week, "Europe/Paris"),
    ]
}

const HOUR: u64 = 3_600_000_000;
/// 2026-03-08T05:00:00Z: midnight in New York on the day its clocks go
/// forward (a day of 23 hours).
const MARCH_8: u64 = 1_772_946_000_000_000;
/// 2028-02-28T12:00:00Z (2028 is a leap year).
const FEB_28: u64 = 1_835_352_000_000_000;

/// (rule, cost, time): each rule's key is "k".
fn steps() -> Vec<(usize, u64, u64)> {
    let mut steps = Vec::new();
    for (i, t) in [
        MARCH_8 - HOUR,
        MARCH_8 - 1,
        MARCH_8,
        MARCH_8 + 2 * HOUR,
        MARCH_8 + 3 * HOUR,
        MARCH_8 + 22 * HOUR,
        MARCH_8 + 23 * HOUR - 1,
        MARCH_8 + 23 * HOUR,
        MARCH_8 + 47 * HOUR,
    ]
    .into_iter()
    .enumerate()
    {
        steps.push((0, 1 + (i as u64 % 2), t));
    }
    for t in [
        FEB_28,
        FEB_28 + HOUR,
        FEB_28 + 2 * HOUR,
        FEB_28 + 35 * HOUR,
        FEB_28 + 36 * HOUR - 1,
        FEB_28 + 36 * HOUR,
        FEB_28 + 37 * HOUR,
    ] {
        steps.push((1, 2, t));
        steps.push((2, 1, t));
    }
    steps
}

async fn agrees_with_memory(store: &RedisStore) {
    let memory = MemoryStore::new(rules(), MemoryOptions::default());
    for (rule, cost, t) in steps() {
        let checks = [Check {
            rule: RuleId(rule),
            key: "k",
            cost,
        }];
        let ours = memory.check_at(&checks, t).expect("decides");
        let redis = store.check_at(&checks, t).await.expect("answers");
        assert_eq!(
            redis.decisions, ours.decisions,
            "rule {rule}, cost {cost} at {t}"
        );
    }
    // A settle gives back only in its own period: a charge of the 29th,
    // settled on March 1st, changes nothing of March.
    let t = FEB_28 + 24 * HOUR;
    let checks = [Check {
        rule: RuleId(1),
        key: "s",
        cost: 4,
    }];
    let v = store.check_at(&checks, t).await.expect("answers");
    assert!(v.allowed);
    let charged = Charged::of(4, v.decided_at, &v.decisions[0]);
    let settle = [Settle {
        rule: RuleId(1),
        key: "s",
        charged,
        actual: 1,
    }];
    let march = FEB_28 + 37 * HOUR;
    let peek = [Check {
        cost: 0,
        ..checks[0]
    }];
    store
        .check_at(
            &[Check {
                cost: 2,
                ..checks[0]
            }],
            march,
        )
        .await
        .expect("answers");
    let settled = store
        .settle_at("s1", &settle, march)
        .await
        .expect("answers");
    assert!(settled.applied);
    let left = store
        .check_at(&peek, march)
        .await
        .expect("answers")
        .decisions[0]
        .remaining;
    assert_eq!(
        left, 3,
        "March's 2 stand; February's give-back is not March's"
    );
}

#[tokio::test]
async fn on_redis_calendar_windows_decide_as_in_memory() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::connect(
        Topology::Standalone(server.url()),
        rules(),
        RedisOptions::default(),
    )
    .await
    .expect("connects");
    agrees_with_memory(&store).await;
    // Each zone and period has keys of its own.
    let keys = server.command("KEYS *fwc*");
    assert!(keys.contains("fwc:calendar_day:America/New_York"), "{keys}");
}

#[tokio::test]
async fn on_a_cluster_calendar_windows_decide_as_in_memory() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let store = RedisStore::connect(
        Topology::Cluster(cluster.urls()),
        rules(),
        RedisOptions::default(),
    )
    .await
    .expect("connects");
    agrees_with_memory(&store).await;
}

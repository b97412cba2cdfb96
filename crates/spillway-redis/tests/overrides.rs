//! Overrides on a real redis-server and a real Redis Cluster: every
//! decision under keys' own and prefixes' overrides (raised, lowered, a
//! limit of 0, ending, removed) is the in-memory store's, on a virtual
//! clock; an override set on one instance holds on three others within
//! the refresh; a key's count is kept across setting and removing one.

use std::num::NonZeroU32;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use spillway::Quota;
use spillway::algorithm::{Calendar, FixedWindow, LeakyBucket, Period, SlidingWindow, TokenBucket};
use spillway::clock::FakeClock;
use spillway::store::{
    Check, MemoryOptions, MemoryStore, Override, OverrideEntry, Rule, RuleId, Store, Target,
};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_redis::{RedisOptions, RedisStore, Topology};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

fn rules() -> Vec<Rule> {
    let calendar = Calendar::new(Period::Day, "UTC".parse().expect("a zone"));
    vec![
        Rule::new("fw", FixedWindow::new(Quota::per_minute(nz(5)))),
        Rule::new("tb", TokenBucket::new(Quota::per_minute(nz(10)), nz(5))),
        Rule::new("sw", SlidingWindow::new(Quota::per_minute(nz(6)))),
        Rule::new("cal", FixedWindow::calendar(nz(3), calendar)),
        Rule::new(
            "lb",
            LeakyBucket::shape(Quota::per_minute(nz(60)), nz(4)).with_delay(1),
        ),
    ]
}

fn options() -> RedisOptions {
    RedisOptions {
        timeout: Duration::from_secs(2),
        ..RedisOptions::default()
    }
}

/// The next minute on the wall clock: a virtual time near the real one,
/// so that an override's expiry in Redis (on its own clock) is still
/// ahead, and the start of a window, so that the scenario stays in one.
fn next_minute() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970");
    now.as_secs().div_ceil(60) * 60 * 1_000_000
}

fn entry(o: Override) -> OverrideEntry {
    OverrideEntry {
        applied: o,
        spec: "{}".into(),
    }
}

enum Step {
    /// (rule, key, cost) checked as one request, at the time.
    Check(Vec<(usize, &'static str, u64)>),
    Set(usize, Target, Override),
    Remove(usize, Target),
}

fn key(k: &str) -> Target {
    Target::Key(k.into())
}

fn prefix(p: &str) -> Target {
    Target::Prefix(p.into())
}

/// The scenario, each step at an offset (µs) from `t0`.
fn steps(t0: u64) -> Vec<(u64, Step)> {
    use Step::*;
    let s = 1_000_000;
    let one = |r, k, c| Check(vec![(r, k, c)]);
    let mut steps = vec![
        // acme uses 4 of 5, then is raised to 8: 4 more.
        (0, one(0, "acme", 2)),
        (s, one(0, "acme", 2)),
        (2 * s, Set(0, key("acme"), Override::limit(8))),
    ];
    for i in 0..5 {
        steps.push((3 * s + i, one(0, "acme", 1)));
    }
    steps.extend([
        // Removed: back to 5, the 8 used still count.
        (4 * s, Remove(0, key("acme"))),
        (4 * s + 1, one(0, "acme", 0)),
        (4 * s + 2, one(0, "acme", 1)),
        // A prefix lowers every tenant- key; one key of it has its own.
        (5 * s, Set(0, prefix("tenant-"), Override::limit(2))),
        (5 * s + 1, Set(0, key("tenant-vip"), Override::limit(6))),
        (6 * s, one(0, "tenant-a", 1)),
        (6 * s + 1, one(0, "tenant-a", 1)),
        (6 * s + 2, one(0, "tenant-a", 1)),
        (6 * s + 3, one(0, "tenant-vip", 4)),
        (6 * s + 4, one(0, "tenant-vip", 2)),
        (6 * s + 5, one(0, "tenant-vip", 1)),
        (6 * s + 6, one(0, "other", 3)),
        // A cost over what the prefix takes is stopped, not counted.
        (6 * s + 7, one(0, "tenant-b", 3)),
        (6 * s + 8, one(0, "tenant-b", 2)),
        // A limit of 0 for ten seconds, on a request of two rules: the
        // bucket admits, is not charged; a look is admitted.
        (
            7 * s,
            Set(0, key("stop"), Override::limit(0).until(t0 + 17 * s)),
        ),
        (8 * s, Check(vec![(1, "stop", 1), (0, "stop", 1)])),
        (8 * s + 1, one(0, "stop", 0)),
        (8 * s + 2, one(1, "stop", 0)),
        // It ends: counted again.
        (17 * s, one(0, "stop", 5)),
        (17 * s + 1, one(0, "stop", 1)),
        // A bucket's rate and burst, a sliding window, a calendar day, a
        // shaping bucket's delay.
        (
            18 * s,
            Set(1, key("b"), Override::limit(60).with_burst(nz(2))),
        ),
        (18 * s + 1, one(1, "b", 2)),
        (18 * s + 2, one(1, "b", 1)),
        (19 * s, one(1, "b", 1)),
        (20 * s, Set(2, prefix("s"), Override::limit(2))),
        (20 * s + 1, one(2, "sx", 1)),
        (20 * s + 2, one(2, "sx", 1)),
        (20 * s + 3, one(2, "sx", 1)),
        (21 * s, Set(3, key("c"), Override::limit(1))),
        (21 * s + 1, one(3, "c", 1)),
        (21 * s + 2, one(3, "c", 1)),
        (22 * s, Remove(3, key("c"))),
        (22 * s + 1, one(3, "c", 2)),
        (22 * s + 2, one(3, "c", 1)),
        (
            23 * s,
            Set(4, prefix(""), Override::limit(120).with_delay(3)),
        ),
        (23 * s + 1, one(4, "l", 1)),
        (23 * s + 2, one(4, "l", 1)),
        (23 * s + 3, one(4, "l", 1)),
        (23 * s + 4, one(4, "l", 1)),
        (23 * s + 5, one(4, "l", 1)),
        // Removing a prefix: tenant-a back to 5, its 2 still counted.
        (24 * s, Remove(0, prefix("tenant-"))),
        (24 * s + 1, one(0, "tenant-a", 3)),
        (24 * s + 2, one(0, "tenant-a", 1)),
    ]);
    steps
}

async fn agrees_with_memory(store: &RedisStore) {
    let t0 = next_minute();
    let clock = FakeClock::new(t0);
    let memory = MemoryStore::with_clock(rules(), MemoryOptions::default(), clock.clone());
    for (offset, step) in steps(t0) {
        let t = t0 + offset;
        clock.set(t);
        match step {
            Step::Set(rule, target, o) => {
                memory
                    .set_override(RuleId(rule), target.clone(), entry(o))
                    .expect("fits");
                store
                    .set_override(RuleId(rule), target, entry(o))
                    .await
                    .expect("sets");
            }
            Step::Remove(rule, target) => {
                assert!(memory.remove_override(RuleId(rule), &target).is_some());
                let removed = store.remove_override(RuleId(rule), &target).await;
                assert!(removed.expect("removes").is_some());
            }
            Step::Check(parts) => {
                let checks: Vec<Check<'_>> = parts
                    .iter()
                    .map(|&(rule, key, cost)| Check {
                        rule: RuleId(rule),
                        key,
                        cost,
                    })
                    .collect();
                let ours = memory.check_at(&checks, t).expect("decides");
                let redis = store.check_at(&checks, t).await.expect("answers");
                assert_eq!(
                    (redis.allowed, &redis.decisions),
                    (ours.allowed, &ours.decisions),
                    "{parts:?} at +{offset} us"
                );
            }
        }
    }
    // What the scenario is about, said plainly once (the memory store is
    // the reference; these hold for both).
    let peek = |rule, key| {
        [Check {
            rule: RuleId(rule),
            key,
            cost: 0,
        }]
    };
    let t = t0 + 25_000_000;
    let acme = store.check_at(&peek(0, "acme"), t).await.expect("answers");
    assert_eq!(acme.decisions[0].limit, 5);
    assert_eq!(acme.decisions[0].remaining, 0, "the 8 used were kept");
}

#[tokio::test]
async fn on_redis_overrides_decide_as_in_memory() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::connect(Topology::Standalone(server.url()), rules(), options())
        .await
        .expect("connects");
    agrees_with_memory(&store).await;
    // A key's own override lives beside its state, with the override's end.
    let own = server.command("KEYS *stop*:ov");
    assert!(own.contains("{fw:stop}:fwi:60000000:ov"), "{own}");
}

#[tokio::test]
async fn on_a_cluster_overrides_decide_as_in_memory() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let store = RedisStore::connect(Topology::Cluster(cluster.urls()), rules(), options())
        .await
        .expect("connects");
    agrees_with_memory(&store).await;
}

/// Four instances on one Redis, each refreshing every 100 ms: what one sets
/// holds on the others within the refresh (and a key's own override of a
/// rule that has some at once); a removal likewise.
#[tokio::test]
async fn an_override_set_on_one_instance_holds_on_three_others_within_the_refresh() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let refresh = Duration::from_millis(100);
    // A window of a year: the test never sees one end.
    let year = Quota::new(nz(5), Duration::from_secs(365 * 86_400)).expect("a quota");
    let rules = vec![Rule::new("fw", FixedWindow::new(year))];
    let mut stores = Vec::new();
    for _ in 0..4 {
        let options = RedisOptions {
            override_refresh: refresh,
            deny_cache_entries: 0,
            ..options()
        };
        let store = RedisStore::connect(Topology::Standalone(server.url()), rules.clone(), options)
            .await
            .expect("connects");
        stores.push(store);
    }
    let check = |key| {
        [Check {
            rule: RuleId(0),
            key,
            cost: 1,
        }]
    };
    // Each of the four uses one of k's 5.
    for store in &stores {
        assert!(store.check(&check("k")).await.expect("answers").allowed);
    }
    let set_at = tokio::time::Instant::now();
    stores[0]
        .set_override(RuleId(0), key("k"), entry(Override::limit(0)))
        .await
        .expect("sets");
    // On the first at once; on the others as soon as they refreshed.
    assert!(!stores[0].check(&check("k")).await.expect("answers").allowed);
    let mut seen_after = Vec::new();
    let mut used = 4;
    for store in &stores[1..] {
        loop {
            let v = store.check(&check("k")).await.expect("answers");
            if v.decisions[0].limit == 0 {
                assert!(!v.allowed);
                break;
            }
            // Not seen yet: decided on k's own quota meanwhile.
            used += u64::from(v.allowed);
            assert!(
                set_at.elapsed() < refresh * 3,
                "not seen within the refresh"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen_after.push(set_at.elapsed());
    }
    assert!(
        seen_after.iter().all(|d| *d <= refresh * 2),
        "{seen_after:?}"
    );
    // The rule has keys' own overrides now: a second one holds everywhere
    // at once, read in the script.
    tokio::time::sleep(refresh * 2).await;
    stores[1]
        .set_override(RuleId(0), key("j"), entry(Override::limit(0)))
        .await
        .expect("sets");
    for store in &stores {
        assert!(!store.check(&check("j")).await.expect("answers").allowed);
    }
    // A prefix: within the refresh.
    stores[2]
        .set_override(RuleId(0), prefix("p-"), entry(Override::limit(1)))
        .await
        .expect("sets");
    tokio::time::sleep(refresh * 2).await;
    for store in &stores {
        assert_eq!(
            store.check(&check("p-1")).await.expect("answers").decisions[0].limit,
            1
        );
    }
    // Removed on one: k counts again on its own quota on every instance,
    // what it used kept (nothing counted while it was stopped).
    stores[3]
        .remove_override(RuleId(0), &key("k"))
        .await
        .expect("removes");
    for store in &stores {
        let v = store
            .check(&[Check {
                cost: 0,
                ..check("k")[0]
            }])
            .await
            .expect("answers");
        assert_eq!(v.decisions[0].limit, 5);
        assert_eq!(v.decisions[0].remaining, 5u64.saturating_sub(used));
    }
    // And each lists what Redis holds once refreshed.
    for store in &stores {
        store.refresh_overrides().await.expect("reads");
        assert_eq!(store.overrides().len(), 2);
    }
}

/// A refresh that read the table before a set cannot put back, in the
/// setter's own copy, what the set replaced: the set holds here at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_racing_a_set_keeps_it() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    // A big table, so that a refresh takes a while to read and parse.
    server.command(
        "EVAL \"for i=1,50000 do redis.call('HSET', KEYS[1], 'p:fw:x'..i, '1 - - 0'..string.char(10)..'{}') end return 1\" 1 spillway:{overrides}",
    );
    let options = RedisOptions {
        override_refresh: Duration::from_secs(3600),
        timeout: Duration::from_secs(5),
        ..RedisOptions::default()
    };
    let a = std::sync::Arc::new(
        RedisStore::connect(Topology::Standalone(server.url()), rules(), options.clone())
            .await
            .expect("connects"),
    );
    let b = RedisStore::connect(Topology::Standalone(server.url()), rules(), options)
        .await
        .expect("connects");
    let mut lost = 0;
    for i in 0..20u64 {
        // Another instance's change, so that a's next refresh reads.
        b.set_override(RuleId(0), key(&format!("b{i}")), entry(Override::limit(1)))
            .await
            .expect("sets");
        let target = key(&format!("a{i}"));
        let racing = a.clone();
        let refresh = tokio::spawn(async move { racing.refresh_overrides().await });
        tokio::time::sleep(Duration::from_micros(i % 10 * 300)).await;
        a.set_override(RuleId(0), target.clone(), entry(Override::limit(0)))
            .await
            .expect("sets");
        refresh.await.expect("joins").expect("reads");
        lost += usize::from(a.overrides().get("fw", &target).is_none());
    }
    assert_eq!(lost, 0, "sets lost from the setter's own copy");
}

/// Rows past their time are deleted by the refresh that finds them, and a
/// table of many is read whatever the checks' timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_past_their_time_are_deleted_and_a_big_table_is_read() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    server.command(
        "EVAL \"for i=1,20000 do redis.call('HSET', KEYS[1], 'k:fw:x'..i, '1 - - 1'..string.char(10)..'{}') end redis.call('HSET', KEYS[1], 'p:fw:live', '1 - - 0'..string.char(10)..'{}') redis.call('INCR', KEYS[2]) return 1\" 2 spillway:{overrides} spillway:{overrides}:v",
    );
    let store = RedisStore::connect(
        Topology::Standalone(server.url()),
        rules(),
        RedisOptions::default(),
    )
    .await
    .expect("connects");
    store.refresh_overrides().await.expect("reads");
    assert_eq!(store.overrides().len(), 1, "only the one in force");
    assert!(!store.overrides().has_keys("fw"));
    assert_eq!(server.command("HLEN spillway:{overrides}").trim(), ":1");
}

/// A limit of 0 holds while Redis is away too, under the `local` failure
/// policy (read from this instance's copy of the overrides); other keys
/// are counted locally.
#[tokio::test]
async fn a_stop_holds_under_the_local_policy_while_redis_is_away() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let options = RedisOptions {
        on_error: spillway_redis::OnError::Local { instances: nz(1) },
        deny_cache_entries: 0,
        timeout: Duration::from_millis(200),
        ..RedisOptions::default()
    };
    let store = RedisStore::connect(Topology::Standalone(server.url()), rules(), options)
        .await
        .expect("connects");
    store
        .set_override(RuleId(0), key("k"), entry(Override::limit(0)))
        .await
        .expect("sets");
    let one = |key| {
        [Check {
            rule: RuleId(0),
            key,
            cost: 1,
        }]
    };
    assert!(!store.check(&one("k")).await.expect("answers").allowed);
    server.kill();
    let during = store
        .check(&one("k"))
        .await
        .expect("the local policy answers");
    assert!(!during.allowed, "{during:?}");
    assert_eq!(during.decisions[0].limit, 0);
    assert!(store.check(&one("other")).await.expect("answers").allowed);
}

/// A reload that changes a rule's window: a key's own override, which
/// carries its rule's parameters beside the key, is written again under
/// the new rule (a fixed window's key names its window, so it moves; a
/// bucket's keeps its name and would keep the old rate).
#[tokio::test]
async fn a_reload_that_changes_a_window_writes_the_keys_own_overrides_again() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rules = |window: Duration| {
        vec![
            Rule::new("fw", FixedWindow::new(Quota::new(nz(5), window).unwrap())),
            Rule::new(
                "tb",
                TokenBucket::new(Quota::new(nz(10), window).unwrap(), nz(5)),
            ),
        ]
    };
    let before = RedisStore::connect(
        Topology::Standalone(server.url()),
        rules(Duration::from_secs(60)),
        options(),
    )
    .await
    .expect("connects");
    for rule in [0, 1] {
        before
            .set_override(RuleId(rule), key("k"), entry(Override::limit(600)))
            .await
            .expect("sets");
    }
    let after = before
        .with_rules(rules(Duration::from_secs(3600)))
        .expect("rules");
    let written = after
        .rewrite_own_overrides(before.rules())
        .await
        .expect("written");
    assert_eq!(written, 2);
    let check = |rule, cost| {
        let after = &after;
        async move {
            after
                .check(&[Check {
                    rule: RuleId(rule),
                    key: "k",
                    cost,
                }])
                .await
                .expect("answers")
        }
    };
    // The fixed window's override holds under its new window's key.
    assert_eq!(check(0, 1).await.decisions[0].limit, 600);
    // The bucket's refills at 600 an hour now, not 600 a minute (a cost
    // is at most the rule's own capacity: 120 of 5).
    for _ in 0..120 {
        assert!(check(1, 5).await.allowed);
    }
    let denied = check(1, 1).await;
    assert!(!denied.allowed);
    let wait = denied.decisions[0].retry_after.expect("a wait");
    assert!(wait > Duration::from_secs(5), "{wait:?}");
    // A reload that changes nothing writes nothing.
    let same = after.with_rules(after.rules().to_vec()).expect("rules");
    assert_eq!(
        same.rewrite_own_overrides(after.rules())
            .await
            .expect("answers"),
        0
    );
}

//! Overrides in the in-memory store: they hold in the same check (one
//! rule, several, under threads), keep a key's count when set and removed,
//! stop a request of several rules without charging any, follow a reload,
//! and 10,000 of them leave every other key as it was.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::{FixedWindow, SlidingWindow, TokenBucket};
use spillway::clock::FakeClock;
use spillway::store::{
    Check, MemoryOptions, MemoryStore, Override, OverrideEntry, Rule, RuleId, Target,
};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

fn entry(o: Override) -> OverrideEntry {
    OverrideEntry {
        applied: o,
        spec: "{}".into(),
    }
}

fn key(k: &str) -> Target {
    Target::Key(k.into())
}

fn check(rule: usize, key: &str, cost: u64) -> Check<'_> {
    Check {
        rule: RuleId(rule),
        key,
        cost,
    }
}

fn store() -> (MemoryStore<FakeClock>, FakeClock) {
    let clock = FakeClock::new(3_600_000_000 * 500_000);
    let rules = vec![
        Rule::new("window", FixedWindow::new(Quota::per_hour(nz(3)))),
        Rule::new("bucket", TokenBucket::new(Quota::per_hour(nz(10)), nz(10))),
    ];
    (
        MemoryStore::with_clock(rules, MemoryOptions::default(), clock.clone()),
        clock,
    )
}

#[test]
fn a_limit_of_zero_stops_a_request_of_two_rules_and_charges_neither() {
    let (store, clock) = store();
    store
        .set_override(
            RuleId(0),
            key("k"),
            entry(Override::limit(0).until(clock_now(&clock) + 60_000_000)),
        )
        .expect("fits");
    let v = store
        .check_now(&[check(1, "k", 1), check(0, "k", 1)])
        .expect("decides");
    assert!(!v.allowed);
    assert!(v.decisions[0].allowed, "the bucket would have admitted it");
    assert_eq!(v.decisions[0].remaining, 10, "and was not charged");
    assert_eq!(v.decisions[1].limit, 0);
    assert_eq!(v.decisions[1].retry_after, Some(Duration::from_secs(60)));
    // Ended: counted again, from nothing used.
    clock.advance(Duration::from_secs(60));
    let v = store.check_now(&[check(0, "k", 1)]).expect("decides");
    assert!(v.allowed);
    assert_eq!(v.decisions[0].remaining, 2);
}

fn clock_now(clock: &FakeClock) -> u64 {
    use spillway::clock::Clock;
    clock.now()
}

#[test]
fn overrides_follow_a_reload_that_keeps_the_rule_and_one_that_rebuilds_its_table() {
    let (store, _clock) = store();
    store
        .set_override(RuleId(0), key("k"), entry(Override::limit(5)))
        .expect("fits");
    for _ in 0..4 {
        assert!(
            store
                .check_now(&[check(0, "k", 1)])
                .expect("decides")
                .allowed
        );
    }
    // The limit in the file changes: the table is kept, with its count and
    // the override.
    let raised = Rule::new("window", FixedWindow::new(Quota::per_hour(nz(4))));
    let kept = store.reconfigure(vec![raised]);
    let v = kept.check_now(&[check(0, "k", 1)]).expect("decides");
    assert_eq!((v.decisions[0].limit, v.decisions[0].remaining), (5, 0));
    // The window changes: counted afresh, and the override (another limit
    // over the new window) still holds.
    let daily = Rule::new(
        "window",
        FixedWindow::new(Quota::new(nz(3), Duration::from_secs(86_400)).expect("a quota")),
    );
    let rebuilt = kept.reconfigure(vec![daily]);
    let v = rebuilt.check_now(&[check(0, "k", 1)]).expect("decides");
    assert_eq!((v.decisions[0].limit, v.decisions[0].remaining), (5, 4));
}

#[test]
fn ten_thousand_overrides_leave_every_other_key_as_it_was() {
    let (store, _clock) = store();
    for i in 0..10_000 {
        let target = key(&format!("other-{i}"));
        store
            .set_override(RuleId(0), target, entry(Override::limit(1)))
            .expect("fits");
    }
    for i in 0..2_000 {
        let k = format!("k-{i}");
        let v = store.check_now(&[check(0, &k, 1)]).expect("decides");
        assert_eq!(v.decisions[0].limit, 3, "{k}");
        let other = format!("other-{i}");
        let v = store.check_now(&[check(0, &other, 1)]).expect("decides");
        assert_eq!(v.decisions[0].limit, 1, "{other}");
        assert!(
            !store
                .check_now(&[check(0, &other, 1)])
                .expect("decides")
                .allowed
        );
    }
    // Removed: the key's bit stays, the book says none; its one charge
    // under the override still counts.
    store.remove_override(RuleId(0), &key("other-0"));
    let v = store.check_now(&[check(0, "other-0", 1)]).expect("decides");
    assert_eq!((v.decisions[0].limit, v.decisions[0].remaining), (3, 1));
}

#[test]
fn under_threads_a_raised_key_admits_exactly_its_new_limit() {
    let clock = FakeClock::new(0);
    let rule = Rule::new("w", SlidingWindow::new(Quota::per_minute(nz(100))));
    let store = Arc::new(MemoryStore::with_clock(
        vec![rule],
        MemoryOptions::default(),
        clock,
    ));
    store
        .set_override(
            RuleId(0),
            Target::Prefix("t-".into()),
            entry(Override::limit(1_000)),
        )
        .expect("fits");
    let admitted: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                s.spawn(move || {
                    (0..1_000)
                        .filter(|_| {
                            store
                                .check_now(&[check(0, "t-1", 1)])
                                .expect("decides")
                                .allowed
                        })
                        .count() as u64
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a worker"))
            .sum()
    });
    assert_eq!(admitted, 1_000);
}

#[test]
fn a_cost_the_rule_cannot_take_is_an_error_under_a_raise_too() {
    let (store, _clock) = store();
    store
        .set_override(RuleId(1), key("k"), entry(Override::limit(50)))
        .expect("fits");
    // The bucket's own burst is 10: 20 is refused, alone or in a batch.
    let alone = store.check_now(&[check(1, "k", 20)]);
    assert!(
        matches!(alone, Err(spillway::Error::CostTooLarge { .. })),
        "{alone:?}"
    );
    let batch = store.check_now(&[check(0, "k", 1), check(1, "k", 20)]);
    assert!(
        matches!(batch, Err(spillway::Error::CostTooLarge { .. })),
        "{batch:?}"
    );
}

#[test]
fn an_override_set_while_a_reload_rebuilds_its_table_holds_in_the_new_store() {
    // A reload that changes the rule's window builds it a new table and
    // marks the overrides it finds; one set on the old store meanwhile
    // must be marked there too, or the new store never applies it.
    let (old, _clock) = store();
    let old = Arc::new(old);
    let rules = vec![
        Rule::new("window", FixedWindow::new(Quota::per_minute(nz(3)))),
        Rule::new("bucket", TokenBucket::new(Quota::per_hour(nz(10)), nz(10))),
    ];
    for round in 0..300 {
        let k = format!("k{round}");
        let setter = {
            let (old, k) = (old.clone(), k.clone());
            std::thread::spawn(move || {
                old.set_override(RuleId(0), key(&k), entry(Override::limit(0)))
                    .unwrap();
            })
        };
        let new = old.reconfigure(rules.clone());
        setter.join().unwrap();
        let verdict = new.check_now(&[check(0, &k, 1)]).unwrap();
        assert!(!verdict.allowed, "round {round}: the override did not hold");
    }
}

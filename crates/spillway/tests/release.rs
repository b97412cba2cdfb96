//! Reservations the in-memory store gives back when no settle comes in
//! time (`Rule::release_unsettled_after`), across a reload and a reset.

use std::num::NonZeroU32;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::{Charged, FixedWindow, TokenBucket};
use spillway::clock::FakeClock;
use spillway::store::{Check, Hold, MemoryOptions, MemoryStore, Rule, RuleId, Settle};

const WITHIN: Duration = Duration::from_secs(60);

fn per_hour(n: u32) -> Quota {
    Quota::per_hour(NonZeroU32::new(n).unwrap())
}

fn tokens() -> Rule {
    Rule::new("tokens", FixedWindow::new(per_hour(1_000))).release_unsettled_after(WITHIN)
}

fn charge(rule: usize, cost: u64) -> [Check<'static>; 1] {
    [Check {
        rule: RuleId(rule),
        key: "k",
        cost,
    }]
}

fn within(within: Duration) -> Hold<'static> {
    Hold { only: None, within }
}

fn left(store: &MemoryStore<FakeClock>, rule: usize) -> u64 {
    store.check_now(&charge(rule, 0)).unwrap().decisions[0].remaining
}

#[test]
fn a_reload_that_renumbers_the_rule_gives_the_reservation_back_where_it_was_charged() {
    let clock = FakeClock::new(0);
    let old = MemoryStore::with_clock(vec![tokens()], MemoryOptions::default(), clock.clone());
    assert!(old.reserve_now("r1", &charge(0, 400)).unwrap().allowed);
    let other = Rule::new("other", FixedWindow::new(per_hour(5)));
    let new = old.reconfigure(vec![other, tokens()]);
    assert_eq!(left(&new, 1), 600);
    clock.advance(WITHIN);
    // The old store (an engine still serving a request) meets it first:
    // it is given back in the table the new store counts in.
    assert_eq!(left(&old, 0), 1_000);
    assert_eq!(left(&new, 1), 1_000);
    assert_eq!(new.reservations_released(), 1);
}

#[test]
fn a_reservation_of_a_rule_started_afresh_by_a_reload_takes_nothing_from_the_new_counts() {
    let clock = FakeClock::new(0);
    let old = MemoryStore::with_clock(vec![tokens()], MemoryOptions::default(), clock.clone());
    assert!(old.reserve_now("r1", &charge(0, 400)).unwrap().allowed);
    // The same name, another algorithm: a new table, counted afresh.
    let ten = NonZeroU32::new(1_000).unwrap();
    let bucket = Rule::new("tokens", TokenBucket::new(per_hour(1_000), ten));
    let new = old.reconfigure(vec![bucket]);
    assert!(new.check_now(&charge(0, 300)).unwrap().allowed);
    clock.advance(WITHIN);
    // 300 charged 60 s ago, refilled by 1,000 an hour: 16.7 back.
    assert_eq!(left(&new, 0), 716);
    assert_eq!(new.reservations_released(), 1);
}

#[test]
fn a_reset_key_forgets_its_reservations() {
    let clock = FakeClock::new(0);
    let store = MemoryStore::with_clock(vec![tokens()], MemoryOptions::default(), clock.clone());
    assert!(store.reserve_now("r1", &charge(0, 400)).unwrap().allowed);
    assert!(store.reset(RuleId(0), "k"));
    assert!(store.check_now(&charge(0, 300)).unwrap().allowed);
    clock.advance(WITHIN);
    assert_eq!(left(&store, 0), 700, "the 400 went with the reset");
    assert_eq!(store.reservations_released(), 0);
}

#[test]
fn a_held_charge_is_settled_only_under_its_id() {
    let store =
        MemoryStore::with_clock(vec![tokens()], MemoryOptions::default(), FakeClock::new(0));
    let v = store.reserve_now("r1", &charge(0, 400)).unwrap();
    let settle = [Settle {
        rule: RuleId(0),
        key: "k",
        charged: Charged::of(400, v.decided_at, &v.decisions[0]).held_open(),
        actual: 100,
    }];
    assert!(store.settle_once_now(&settle).is_err());
    assert_eq!(left(&store, 0), 600);
    assert!(store.settle_now("r1", &settle).unwrap().applied);
    assert_eq!(left(&store, 0), 900);
}

#[test]
fn a_key_holds_a_bounded_number_open_and_denies_one_more_until_one_is_settled() {
    use spillway::store::MAX_HOLDS_PER_KEY;
    let clock = FakeClock::new(0);
    let rule =
        Rule::new("tokens", FixedWindow::new(per_hour(5_000))).release_unsettled_after(WITHIN);
    let store = MemoryStore::with_clock(vec![rule], MemoryOptions::default(), clock.clone());
    let mut first = None;
    for i in 0..MAX_HOLDS_PER_KEY {
        clock.advance(Duration::from_micros(1));
        let v = store.reserve_now(&format!("r{i}"), &charge(0, 1)).unwrap();
        assert!(v.allowed);
        first.get_or_insert(v);
    }
    let open = MAX_HOLDS_PER_KEY as u64;
    let denied = store.reserve_now("one-more", &charge(0, 1)).unwrap();
    assert!(!denied.allowed);
    // Until the first one's time: 60 s after it, 999 µs ago.
    assert_eq!(
        denied.decisions[0].retry_after,
        Some(WITHIN - Duration::from_micros(open - 1))
    );
    assert_eq!(left(&store, 0), 5_000 - open);
    let v = first.unwrap();
    let settle = [Settle {
        rule: RuleId(0),
        key: "k",
        charged: Charged::of(1, v.decided_at, &v.decisions[0]).held_open(),
        actual: 1,
    }];
    store.settle_now("r0", &settle).unwrap();
    assert!(
        store
            .reserve_now("one-more", &charge(0, 1))
            .unwrap()
            .allowed
    );
    assert_eq!(left(&store, 0), 5_000 - open - 1);
}

#[test]
fn a_reservation_held_for_less_than_its_rules_time_is_given_back_at_its_own() {
    let clock = FakeClock::new(0);
    let store = MemoryStore::with_clock(vec![tokens()], MemoryOptions::default(), clock.clone());
    let short = Duration::from_secs(5);
    assert!(
        store
            .reserve_held_now("r1", &charge(0, 400), within(short))
            .unwrap()
            .allowed
    );
    // Longer than the rule's time: held for the rule's.
    assert!(
        store
            .reserve_held_now("r2", &charge(0, 100), within(WITHIN * 2))
            .unwrap()
            .allowed
    );
    clock.advance(short - Duration::from_micros(1));
    assert_eq!(left(&store, 0), 500);
    clock.advance(Duration::from_micros(1));
    assert_eq!(left(&store, 0), 900, "r1 given back at 5 s");
    clock.advance(WITHIN - short);
    assert_eq!(left(&store, 0), 1_000, "r2 given back at the rule's 60 s");
    assert_eq!(store.reservations_released(), 2);
}

#[test]
fn a_rule_that_does_not_release_holds_nothing_whatever_the_time_asked() {
    let clock = FakeClock::new(0);
    let kept = Rule::new("kept", FixedWindow::new(per_hour(1_000)));
    let store = MemoryStore::with_clock(vec![kept], MemoryOptions::default(), clock.clone());
    let v = store
        .reserve_held_now("r1", &charge(0, 400), within(Duration::from_secs(1)))
        .unwrap();
    assert!(v.allowed);
    clock.advance(Duration::from_secs(2));
    assert_eq!(left(&store, 0), 600);
    assert_eq!(store.reservations_released(), 0);
}

/// A request that met two releasing rules but settles only one of them
/// (a budget, and a rule Kuadrant's `Reserve` also reaches): only that
/// one's charge is held, and given back if not settled; the other's
/// stands, as a check's does.
#[test]
fn only_the_charges_a_reservation_names_are_held() {
    let clock = FakeClock::new(0);
    let requests =
        Rule::new("requests", FixedWindow::new(per_hour(100))).release_unsettled_after(WITHIN);
    let store = MemoryStore::with_clock(
        vec![tokens(), requests],
        MemoryOptions::default(),
        clock.clone(),
    );
    let both = [charge(0, 400)[0], charge(1, 1)[0]];
    let hold = Hold {
        only: Some(&[true, false]),
        within: Duration::MAX,
    };
    assert!(store.reserve_held_now("r1", &both, hold).unwrap().allowed);
    clock.advance(WITHIN);
    assert_eq!(
        left(&store, 0),
        1_000,
        "the budget's reservation is given back"
    );
    assert_eq!(left(&store, 1), 99, "the request stays counted");
    assert_eq!(store.reservations_released(), 1);
}

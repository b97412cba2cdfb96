//! The in-memory store's state file: a store restored from it decides
//! every later request exactly as the store that wrote it would have, for
//! every algorithm; the run-time tables come back; a rule changed since is
//! left out; and a file that is foreign, of another version, damaged at
//! any byte or cut short at any length is an error that changes nothing.
//!
//! Time is a [`FakeClock`]; nothing sleeps.

use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::{
    Calendar, Concurrency, FixedWindow, LeakyBucket, LeakyMode, Period, SlidingLog, SlidingWindow,
    TokenBucket,
};
use spillway::clock::FakeClock;
use spillway::store::{
    Check, ListEntry, Listed, MemoryOptions, MemoryStore, OnFull, Override, OverrideEntry, Rule,
    RuleId, StateFileError, Store, Target, TierEntry,
};

/// 2026-10-24 12:00 UTC, a day before Paris leaves summer time, a week
/// before the month ends.
const START: u64 = 1_792_843_200_000_000;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

/// One rule of every algorithm.
fn rules() -> Vec<Rule> {
    let quota = |n, secs| Quota::new(nz(n), Duration::from_secs(secs)).unwrap();
    let paris = Calendar::new(Period::Month, "Europe/Paris".parse().unwrap());
    vec![
        Rule::new("fixed", FixedWindow::new(quota(20, 60))),
        Rule::new("month", FixedWindow::calendar(nz(200), paris)),
        Rule::new("sliding", SlidingWindow::new(quota(20, 60))),
        Rule::new("log", SlidingLog::new(quota(8, 10))),
        Rule::new("bucket", TokenBucket::new(quota(3, 10), nz(10))),
        Rule::new(
            "shape",
            LeakyBucket::new(quota(5, 10), nz(5), LeakyMode::Shape),
        ),
        Rule::new(
            "police",
            LeakyBucket::new(quota(5, 10), nz(5), LeakyMode::Police),
        ),
        Rule::new("leases", Concurrency::new(quota(3, 30))),
    ]
}

/// A deterministic stream of requests: which rules, which key, what cost,
/// and how long after the one before.
struct Requests {
    seed: u64,
    /// How many clients.
    keys: u64,
    /// The longest time between two requests, in milliseconds.
    gap: u64,
}

impl Requests {
    fn new(seed: u64, keys: u64) -> Self {
        Self {
            seed,
            keys,
            gap: 400,
        }
    }

    fn next(&mut self) -> u64 {
        // splitmix64
        self.seed = self.seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Sends `n` requests to each store (the same ones, at the same
    /// times) and returns every decision, as text to compare.
    fn send(
        &mut self,
        stores: &[&MemoryStore<FakeClock>],
        clock: &FakeClock,
        n: usize,
    ) -> Vec<String> {
        let rules = stores[0].rules().len();
        let mut seen = Vec::new();
        for _ in 0..n {
            clock.advance(Duration::from_millis(self.next() % self.gap));
            let key = format!("client-{}", self.next() % self.keys);
            let first = (self.next() % rules as u64) as usize;
            let cost = 1 + self.next() % 2;
            let mut checks = vec![Check {
                rule: RuleId(first),
                key: &key,
                cost,
            }];
            if self.next().is_multiple_of(4) {
                // Now and then a request of two rules, decided at once.
                let second = (first + 1 + (self.next() % (rules as u64 - 1)) as usize) % rules;
                checks.push(Check {
                    rule: RuleId(second),
                    key: &key,
                    cost: 1,
                });
            }
            for store in stores {
                let verdict = store.check_now(&checks).unwrap();
                seen.push(format!("{:?}", (verdict.allowed, &verdict.decisions)));
            }
        }
        seen
    }
}

fn store(clock: &FakeClock) -> MemoryStore<FakeClock> {
    MemoryStore::with_clock(rules(), MemoryOptions::default(), clock.clone())
}

fn saved(store: &MemoryStore<FakeClock>) -> Vec<u8> {
    let mut file = Vec::new();
    store.save_state(&mut file).unwrap();
    file
}

#[test]
fn a_restored_store_decides_as_the_one_that_wrote_it_for_every_algorithm() {
    let clock = FakeClock::new(START);
    let original = store(&clock);
    // Eight busy clients: every rule's keys deep in their quota.
    let mut requests = Requests {
        seed: 7,
        keys: 8,
        gap: 100,
    };
    requests.send(&[&original], &clock, 3_000);
    let file = saved(&original);

    // A second later, a new process with the same rules.
    clock.advance(Duration::from_secs(1));
    let restarted = store(&clock);
    let restored = restarted.restore_state(&file).unwrap();
    assert!(restored.keys > 50, "{restored:?}");
    assert!(restored.rules_left.is_empty(), "{restored:?}");
    // Across Paris's change of time and the month's end: every decision
    // of both stores, for another week of requests, is the same.
    let mut later = Requests::new(8, 40);
    let mut both = later.send(&[&original, &restarted], &clock, 1_000);
    // Then fewer clients, each busier.
    later.keys = 4;
    for _ in 0..60 {
        both.extend(later.send(&[&original, &restarted], &clock, 100));
        clock.advance(Duration::from_secs(3 * 3_600));
    }
    let (mut allowed, mut denied) = (0, 0);
    for pair in both.chunks(2) {
        assert_eq!(pair[0], pair[1]);
        if pair[0].starts_with("(true") {
            allowed += 1;
        } else {
            denied += 1;
        }
    }
    // Both kinds were decided, so the comparison meant something.
    assert!(allowed > 500 && denied > 300, "{allowed} {denied}");
}

#[test]
fn a_fresh_store_would_not_have_decided_the_same() {
    // The comparison above fails without the file: a store that starts
    // empty lets in what the first one denies.
    let clock = FakeClock::new(START);
    let original = store(&clock);
    Requests::new(7, 40).send(&[&original], &clock, 3_000);
    let empty = store(&clock);
    let seen = Requests::new(8, 40).send(&[&original, &empty], &clock, 200);
    assert!(seen.chunks(2).any(|pair| pair[0] != pair[1]));
}

#[test]
fn the_run_time_tables_come_back_and_those_ended_do_not() {
    let clock = FakeClock::new(START);
    let original = store(&clock);
    let soon = START + 60_000_000;
    let entry = |o: Override| OverrideEntry {
        applied: o,
        spec: "{\"by\":\"ops\"}".into(),
    };
    original
        .set_override(
            RuleId(0),
            Target::Key("acme".into()),
            entry(Override::limit(500)),
        )
        .unwrap();
    original
        .set_override(
            RuleId(4),
            Target::Prefix("tenant-".into()),
            entry(Override::limit(0)),
        )
        .unwrap();
    original
        .set_override(
            RuleId(0),
            Target::Key("brief".into()),
            entry(Override::limit(9).until(soon)),
        )
        .unwrap();
    let tiers = original.tiers().unwrap();
    let tier = |name: &str, until| TierEntry {
        tier: name.into(),
        until,
        spec: "{}".into(),
    };
    tiers.set("k-pro", tier("pro", None));
    tiers.set("k-trial", tier("trial", Some(soon)));
    let block = |until| ListEntry {
        allow: false,
        rule: None,
        status: 403,
        until,
        spec: "{}".into(),
    };
    let net = Listed::network("2001:db8::".parse().unwrap(), 32).unwrap();
    original.lists().unwrap().set(net.clone(), block(None));
    original
        .lists()
        .unwrap()
        .set(Listed::ApiKey("k-leaked".into()), block(Some(soon)));
    let file = saved(&original);

    // Restarted after the brief entries ended.
    clock.set(soon);
    let restarted = store(&clock);
    assert_eq!(restarted.restore_state(&file).unwrap().entries, 4);
    let book = restarted.overrides();
    assert_eq!(book.find("fixed", "acme", soon), Some(Override::limit(500)));
    assert_eq!(book.find("fixed", "brief", soon), None);
    assert_eq!(
        book.get("fixed", &Target::Key("acme".into()))
            .unwrap()
            .spec
            .as_ref(),
        "{\"by\":\"ops\"}"
    );
    // The override is applied: 500 an hour for acme, a stop for tenants.
    let acme = [Check {
        rule: RuleId(0),
        key: "acme",
        cost: 1,
    }];
    assert_eq!(restarted.check_now(&acme).unwrap().decisions[0].limit, 500);
    let tenant = [Check {
        rule: RuleId(4),
        key: "tenant-9",
        cost: 1,
    }];
    assert!(!restarted.check_now(&tenant).unwrap().allowed);
    assert_eq!(
        restarted.tiers().unwrap().tier_of("k-pro", soon).as_deref(),
        Some("pro")
    );
    assert_eq!(restarted.tiers().unwrap().tier_of("k-trial", soon), None);
    assert!(restarted.lists().unwrap().get(&net, None).is_some());
    assert!(
        restarted
            .lists()
            .unwrap()
            .get(&Listed::ApiKey("k-leaked".into()), None)
            .is_none()
    );
}

#[test]
fn a_rule_renamed_or_rewindowed_since_is_left_out_and_named() {
    let clock = FakeClock::new(START);
    let before = MemoryStore::with_clock(
        vec![
            Rule::new("kept", FixedWindow::new(Quota::per_hour(nz(10)))),
            Rule::new("rewindowed", FixedWindow::new(Quota::per_hour(nz(10)))),
            Rule::new("renamed", FixedWindow::new(Quota::per_hour(nz(10)))),
        ],
        MemoryOptions::default(),
        clock.clone(),
    );
    for rule in 0..3 {
        for key in ["a", "b"] {
            before
                .check_now(&[Check {
                    rule: RuleId(rule),
                    key,
                    cost: 3,
                }])
                .unwrap();
        }
    }
    let file = saved(&before);
    let after = MemoryStore::with_clock(
        vec![
            // A new limit keeps the counts, as a reload does.
            Rule::new("kept", FixedWindow::new(Quota::per_hour(nz(20)))),
            Rule::new("rewindowed", FixedWindow::new(Quota::per_minute(nz(10)))),
            Rule::new("new-name", FixedWindow::new(Quota::per_hour(nz(10)))),
        ],
        MemoryOptions::default(),
        clock.clone(),
    );
    let restored = after.restore_state(&file).unwrap();
    assert_eq!(restored.keys, 2);
    assert_eq!(
        restored.rules_left,
        vec![("rewindowed".to_string(), 2), ("renamed".to_string(), 2)]
    );
    let peek = |rule| {
        after
            .check_now(&[Check {
                rule: RuleId(rule),
                key: "a",
                cost: 0,
            }])
            .unwrap()
            .decisions[0]
            .remaining
    };
    assert_eq!((peek(0), peek(1), peek(2)), (17, 10, 10));
}

#[test]
fn keys_past_a_smaller_store_are_left_out_and_counted() {
    let clock = FakeClock::new(START);
    let rule = || vec![Rule::new("r", FixedWindow::new(Quota::per_hour(nz(10))))];
    let big = MemoryStore::with_clock(rule(), MemoryOptions::default(), clock.clone());
    for i in 0..1_000 {
        let key = format!("k{i}");
        big.check_now(&[Check {
            rule: RuleId(0),
            key: &key,
            cost: 1,
        }])
        .unwrap();
    }
    let options = MemoryOptions {
        max_keys: NonZeroUsize::new(100).unwrap(),
        shards: NonZeroUsize::new(1).unwrap(),
        on_full: OnFull::DenyNew,
        ..MemoryOptions::default()
    };
    let small = MemoryStore::with_clock(rule(), options, clock);
    let restored = small.restore_state(&saved(&big)).unwrap();
    assert_eq!((restored.keys, restored.keys_left), (100, 900));
    assert_eq!(small.len(RuleId(0)), 100);
    // Evicting, the keys taken back make room by forgetting others taken
    // back before them: counted as left out too.
    let options = MemoryOptions {
        on_full: OnFull::Evict,
        ..options
    };
    let small = MemoryStore::with_clock(rule(), options, FakeClock::new(START));
    let restored = small.restore_state(&saved(&big)).unwrap();
    assert_eq!((restored.keys, restored.keys_left), (100, 900));
}

#[test]
fn keys_idle_by_the_restart_are_left_out() {
    let clock = FakeClock::new(START);
    let original = store(&clock);
    Requests::new(3, 40).send(&[&original], &clock, 500);
    let file = saved(&original);
    // Two months on, every window has ended and every bucket refilled.
    clock.advance(Duration::from_secs(62 * 86_400));
    let restarted = store(&clock);
    let restored = restarted.restore_state(&file).unwrap();
    assert_eq!(restored.keys, 0);
    assert!(restored.keys_left > 100);
}

/// A store with counts in it, and its file.
fn a_file() -> (FakeClock, Vec<u8>) {
    let clock = FakeClock::new(START);
    let original = store(&clock);
    Requests::new(11, 40).send(&[&original], &clock, 300);
    original
        .set_override(
            RuleId(0),
            Target::Key("client-1".into()),
            OverrideEntry {
                applied: Override::limit(2),
                spec: "{}".into(),
            },
        )
        .unwrap();
    let file = saved(&original);
    (clock, file)
}

/// Whether `store` holds nothing: no key of any rule, no override.
fn untouched(store: &MemoryStore<FakeClock>) -> bool {
    (0..store.rules().len()).all(|r| store.len(RuleId(r)) == 0) && store.overrides().is_empty()
}

#[test]
fn a_file_damaged_at_any_byte_is_refused_and_changes_nothing() {
    let (clock, file) = a_file();
    let restarted = store(&clock);
    for at in 0..file.len() {
        let mut bad = file.clone();
        bad[at] ^= 0x5A;
        let e = restarted.restore_state(&bad).unwrap_err();
        let expected = match at {
            0..16 => matches!(e, StateFileError::Foreign),
            16..20 => matches!(e, StateFileError::Version { .. }),
            _ => matches!(e, StateFileError::Damaged { .. }),
        };
        assert!(expected, "byte {at}: {e}");
        assert!(untouched(&restarted), "byte {at}");
    }
}

#[test]
fn a_file_cut_short_at_any_length_is_refused() {
    let (clock, file) = a_file();
    let restarted = store(&clock);
    for len in 0..file.len() {
        let e = restarted.restore_state(&file[..len]).unwrap_err();
        assert!(
            matches!(e, StateFileError::Foreign | StateFileError::Damaged { .. }),
            "{len}: {e}"
        );
        assert!(untouched(&restarted), "{len}");
    }
    // And one with something after its end.
    let mut longer = file.clone();
    longer.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
    assert!(restarted.restore_state(&longer).is_err());
    assert!(restarted.restore_state(&file).is_ok());
}

#[test]
fn a_foreign_file_or_another_version_says_so() {
    let (clock, file) = a_file();
    let restarted = store(&clock);
    let toml = b"[store]\nstate_file = \"state.bin\"\n";
    let e = restarted.restore_state(toml).unwrap_err();
    assert_eq!(
        e.to_string(),
        "not a Spillway state file (it does not start with the state file's signature)"
    );
    let mut newer = file.clone();
    newer[16..20].copy_from_slice(&2u32.to_le_bytes());
    let e = restarted.restore_state(&newer).unwrap_err();
    assert_eq!(
        e.to_string(),
        "written in state file format 2; this Spillway reads format 1"
    );
    let mut damaged = file.clone();
    let last = damaged.len() - 1;
    damaged[last] ^= 1;
    let e = restarted.restore_state(&damaged).unwrap_err().to_string();
    assert!(e.starts_with("damaged at byte "), "{e}");
    assert!(e.ends_with("a frame's checksum does not match"), "{e}");
}

#[test]
fn the_file_is_replaced_whole_and_readable_by_its_owner_only() {
    let dir = std::env::temp_dir().join(format!("spillway-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.bin");
    let clock = FakeClock::new(START);
    let original = store(&clock);
    assert!(store(&clock).restore_state_file(&path).unwrap().is_none());
    Requests::new(5, 40).send(&[&original], &clock, 200);
    let first = original.save_state_file(&path).unwrap();
    Requests::new(6, 40).send(&[&original], &clock, 200);
    let second = original.save_state_file(&path).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), second.bytes);
    assert_ne!(first, second);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    // No temporary file left beside it.
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["state.bin"]);
    // A write killed midway left its temporary: the next start removes it.
    std::fs::write(dir.join(".state.bin.0123456789abcdef.tmp"), b"half").unwrap();
    std::fs::write(dir.join(".other.0.tmp"), b"not ours").unwrap();
    let restarted = store(&clock);
    let restored = restarted.restore_state_file(&path).unwrap().unwrap();
    assert_eq!(restored.keys, second.keys);
    std::fs::remove_file(dir.join(".other.0.tmp")).unwrap();
    // A file that cannot be written is an error, and leaves no temporary.
    let e = original
        .save_state_file(&dir.join("missing/state.bin"))
        .unwrap_err();
    assert!(matches!(e, StateFileError::Io(_)), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_save_while_checks_go_on_holds_each_count_as_it_was_at_some_moment() {
    // Four threads admit requests of one key while another saves: the
    // count restored is between what was admitted before the save began
    // and what was admitted when it ended.
    let clock = FakeClock::new(START);
    let rule = || {
        vec![Rule::new(
            "r",
            FixedWindow::new(Quota::per_hour(nz(1_000_000))),
        )]
    };
    let original = Arc::new(MemoryStore::with_clock(
        rule(),
        MemoryOptions::default(),
        clock.clone(),
    ));
    let used = |store: &MemoryStore<FakeClock>, key: &str| {
        1_000_000
            - store
                .check_now(&[Check {
                    rule: RuleId(0),
                    key,
                    cost: 0,
                }])
                .unwrap()
                .decisions[0]
                .remaining
    };
    thread::scope(|s| {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for t in 0..4 {
            let (store, stop) = (original.clone(), stop.clone());
            s.spawn(move || {
                let key = format!("k{t}");
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    store
                        .check_now(&[Check {
                            rule: RuleId(0),
                            key: &key,
                            cost: 1,
                        }])
                        .unwrap();
                }
            });
        }
        for _ in 0..20 {
            let before: Vec<u64> = (0..4).map(|t| used(&original, &format!("k{t}"))).collect();
            let file = saved(&original);
            let after: Vec<u64> = (0..4).map(|t| used(&original, &format!("k{t}"))).collect();
            let restarted =
                MemoryStore::with_clock(rule(), MemoryOptions::default(), clock.clone());
            restarted.restore_state(&file).unwrap();
            for t in 0..4 {
                let got = used(&restarted, &format!("k{t}"));
                assert!(
                    before[t] <= got && got <= after[t],
                    "{} {got} {}",
                    before[t],
                    after[t]
                );
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
}

#[test]
fn a_reservation_held_open_is_given_back_at_its_time_after_a_restart() {
    let within = Duration::from_secs(60);
    let rules = || {
        vec![
            Rule::new("tokens", FixedWindow::new(Quota::per_hour(nz(1_000))))
                .release_unsettled_after(within),
        ]
    };
    let clock = FakeClock::new(START);
    let original = MemoryStore::with_clock(rules(), MemoryOptions::default(), clock.clone());
    let charge = |cost| {
        [Check {
            rule: RuleId(0),
            key: "k",
            cost,
        }]
    };
    assert!(original.reserve_now("early", &charge(300)).unwrap().allowed);
    clock.advance(Duration::from_secs(30));
    assert!(original.reserve_now("late", &charge(200)).unwrap().allowed);
    let file = saved(&original);

    // Restarted 45 s after the first: its time has passed, the second's
    // has not.
    clock.advance(Duration::from_secs(15));
    let restarted = MemoryStore::with_clock(rules(), MemoryOptions::default(), clock.clone());
    assert_eq!(restarted.restore_state(&file).unwrap().reservations, 2);
    let remaining = |store: &MemoryStore<FakeClock>| {
        store.check_now(&charge(0)).unwrap().decisions[0].remaining
    };
    // Neither is given back yet: the first is due at 60 s.
    assert_eq!(remaining(&restarted), 500);
    clock.advance(Duration::from_secs(15));
    assert_eq!(remaining(&restarted), 800);
    clock.advance(Duration::from_secs(30));
    assert_eq!(remaining(&restarted), 1_000);
    assert_eq!(restarted.reservations_released(), 2);

    // One past its time when the store starts is given back at once.
    let later = MemoryStore::with_clock(rules(), MemoryOptions::default(), clock.clone());
    clock.set(START + 75_000_000);
    later.restore_state(&file).unwrap();
    assert_eq!(remaining(&later), 800);
}

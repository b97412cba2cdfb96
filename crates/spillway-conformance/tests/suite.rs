//! The suite itself: it is not empty, it covers what it claims to, and its
//! runner reports every mismatch instead of stopping at the first, and
//! fails a store that gets a check or a settle wrong.

use std::collections::BTreeMap;

use spillway::algorithm::LeakyMode;
use spillway::algorithm::Renewed;
use spillway::clock::FakeClock;
use spillway::store::{Check, MemoryOptions, MemoryStore, Renew, Rule, Settle, Settled, Verdict};
use spillway_conformance::{
    ALGORITHMS, Action, AlgorithmConfig, Case, Expected, ExpectedDecision, Harness, HarnessError,
    Step, StepCheck, VECTOR_FILES, cases, parse, run,
};

/// A one-check request's check and expected decision.
fn one(step: &Step) -> Option<(&StepCheck, ExpectedDecision)> {
    let request = step.check()?;
    match (&request.checks[..], &request.expected) {
        ([check], Expected::Verdict { decisions, .. }) => Some((check, decisions[0])),
        _ => None,
    }
}

/// Cases whose every rule uses `algorithm`.
fn cases_of(algorithm: &str) -> Vec<&'static Case> {
    cases()
        .iter()
        .filter(|c| c.rules.iter().all(|r| r.config.name() == algorithm))
        .collect()
}

#[test]
fn every_file_parses_and_every_algorithm_has_its_own_file() {
    for (file, text) in VECTOR_FILES {
        let parsed = parse(file, text).unwrap_or_else(|e| panic!("{e}"));
        assert!(parsed.len() >= 5, "{file} has only {} cases", parsed.len());
    }
    for algorithm in ALGORITHMS {
        let file = format!("{algorithm}.toml");
        assert!(
            cases().iter().any(|c| c.file == file),
            "no vector file for {algorithm}"
        );
        for case in cases().iter().filter(|c| c.file == file) {
            assert!(
                case.rules.iter().all(|r| r.config.name() == algorithm),
                "{file}: case {:?} uses another algorithm",
                case.name
            );
        }
    }
}

#[test]
fn every_algorithm_has_enough_cases_and_steps() {
    for algorithm in ALGORITHMS {
        let cases = cases_of(algorithm);
        let steps: usize = cases.iter().map(|c| c.steps.len()).sum();
        assert!(cases.len() >= 7, "{algorithm}: {} cases", cases.len());
        assert!(steps >= 30, "{algorithm}: {steps} steps");
    }
    let multi = cases().iter().filter(|c| c.rules.len() > 1).count();
    assert!(multi >= 5, "{multi} multi-rule cases");
}

/// What each algorithm's vectors must exercise.
#[test]
fn every_algorithm_covers_the_edge_cases() {
    for algorithm in ALGORITHMS {
        let mut seen: BTreeMap<&str, bool> = [
            "fresh key",
            "admission",
            "denial",
            "peek",
            "peek on a fresh key",
            "cost above capacity",
            "cost above one",
            "several keys",
            "denied at t + retry_after - 1, admitted at t + retry_after",
        ]
        .into_iter()
        .map(|k| (k, false))
        .collect();
        for case in cases_of(algorithm) {
            let mut keys = std::collections::HashSet::new();
            for (i, step) in case.steps.iter().enumerate() {
                let Some(request) = step.check() else {
                    continue;
                };
                for c in &request.checks {
                    if keys.insert(c.key.clone()) {
                        *seen.get_mut("fresh key").unwrap() = true;
                        if c.cost == 0 {
                            *seen.get_mut("peek on a fresh key").unwrap() = true;
                        }
                    }
                    if c.cost > 1 {
                        *seen.get_mut("cost above one").unwrap() = true;
                    }
                }
                if keys.len() > 1 {
                    *seen.get_mut("several keys").unwrap() = true;
                }
                if matches!(request.expected, Expected::CostTooLarge) {
                    *seen.get_mut("cost above capacity").unwrap() = true;
                }
                let Some((check, decision)) = one(step) else {
                    continue;
                };
                let flag = match (check.cost, decision.allowed) {
                    (0, _) => "peek",
                    (_, true) => "admission",
                    (_, false) => "denial",
                };
                *seen.get_mut(flag).unwrap() = true;
                // Two consecutive steps that probe a denial's retry_after
                // from both sides.
                if let (Some(retry), Some(next), Some(after)) = (
                    decision.retry_after_us,
                    case.steps.get(i + 1).and_then(one),
                    case.steps.get(i + 2).and_then(one),
                ) {
                    let at = step.t_us + retry;
                    let same = |c: &StepCheck| c.key == check.key && c.cost == check.cost;
                    if same(next.0)
                        && same(after.0)
                        && case.steps[i + 1].t_us == at - 1
                        && !next.1.allowed
                        && case.steps[i + 2].t_us == at
                        && after.1.allowed
                    {
                        *seen
                            .get_mut("denied at t + retry_after - 1, admitted at t + retry_after")
                            .unwrap() = true;
                    }
                }
            }
        }
        let missing: Vec<_> = seen.iter().filter(|(_, s)| !**s).map(|(k, _)| *k).collect();
        assert!(missing.is_empty(), "{algorithm} lacks: {missing:?}");
    }
}

#[test]
fn multi_rule_cases_cover_partial_denials() {
    let multi: Vec<_> = cases()
        .iter()
        .filter(|c| c.file == "multi_rule.toml")
        .collect();
    let requests = || multi.iter().flat_map(|c| &c.steps).filter_map(Step::check);
    let partial_denial = requests().any(|s| {
        matches!(&s.expected, Expected::Verdict { allowed: false, decisions }
            if decisions.iter().any(|d| d.allowed))
    });
    let same_key_two_rules = requests().any(|s| {
        s.checks
            .iter()
            .any(|a| s.checks.iter().any(|b| a.key == b.key && a.rule != b.rule))
    });
    let error =
        requests().any(|s| s.checks.len() > 1 && matches!(s.expected, Expected::CostTooLarge));
    assert!(partial_denial && same_key_two_rules && error);
    let algorithms: std::collections::HashSet<_> = multi
        .iter()
        .flat_map(|c| &c.rules)
        .map(|r| r.config.name())
        .collect();
    assert_eq!(algorithms.len(), ALGORITHMS.len(), "{algorithms:?}");
}

/// A store that gets `remaining` wrong by one on every decision, a
/// settle's too.
struct OffByOne(MemoryStore<FakeClock>);

impl Harness for OffByOne {
    fn reserve(
        &mut self,
        id: &str,
        checks: &[Check<'_>],
        now_us: u64,
    ) -> Result<Verdict, HarnessError> {
        let mut verdict = self.0.reserve_at(id, checks, now_us)?;
        for d in &mut verdict.decisions {
            d.remaining += 1;
        }
        Ok(verdict)
    }

    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
        let mut verdict = self.0.check_at(checks, now_us)?;
        for d in &mut verdict.decisions {
            d.remaining += 1;
        }
        Ok(verdict)
    }

    fn settle(
        &mut self,
        id: &str,
        settles: &[Settle<'_>],
        now_us: u64,
    ) -> Result<Settled, HarnessError> {
        let mut settled = self.0.settle_at(id, settles, now_us)?;
        for d in &mut settled.decisions {
            d.remaining += 1;
        }
        Ok(settled)
    }

    fn renew(&mut self, renews: &[Renew<'_>], now_us: u64) -> Result<Vec<Renewed>, HarnessError> {
        let mut renewed = self.0.renew_at(renews, now_us)?;
        for r in &mut renewed {
            r.decision.remaining += 1;
        }
        Ok(renewed)
    }
}

#[test]
fn the_runner_reports_every_mismatch() {
    let new = |rules: Vec<Rule>| {
        OffByOne(MemoryStore::with_clock(
            rules,
            MemoryOptions::default(),
            FakeClock::new(0),
        ))
    };
    let report = run(cases(), new);
    let decisions: usize = cases()
        .iter()
        .flat_map(|c| &c.steps)
        .map(|s| match &s.action {
            Action::Check(request) => match &request.expected {
                Expected::Verdict { decisions, .. } => decisions.len(),
                Expected::CostTooLarge => 0,
            },
            Action::Settle(settle) => settle.decisions.len(),
            Action::Renew(_) => 1,
        })
        .sum();
    assert!(!report.passed());
    assert_eq!(report.mismatches.len(), decisions);
    assert!(report.mismatches.iter().all(|m| m.field == "remaining"));
    let first = &report.mismatches[0];
    let text = first.to_string();
    assert!(
        text.contains(&first.case) && text.contains("remaining"),
        "{text}"
    );
    assert!(
        text.starts_with(&format!("{}:{}:", first.file, first.line)),
        "{text}"
    );
}

#[test]
#[should_panic(expected = "failed steps")]
fn run_all_panics_listing_the_mismatches() {
    spillway_conformance::run_all(|rules| {
        OffByOne(MemoryStore::with_clock(
            rules,
            MemoryOptions::default(),
            FakeClock::new(0),
        ))
    });
}

#[test]
fn inconsistent_vectors_are_rejected() {
    let base = r#"
[[case]]
name = "c"
rule = { algorithm = "token_bucket", limit = 1, period_us = 1_000, burst = 2 }
steps = [{ t_us = 0, cost = 1, allowed = true, remaining = 1, reset_after_us = 1_000 }]
"#;
    assert!(parse("x.toml", base).is_ok());
    let bad = [
        // a denial without retry_after_us
        base.replace("allowed = true", "allowed = false"),
        // a cost above the burst that is not an error
        base.replace("cost = 1", "cost = 3"),
        // a delay from a token bucket
        base.replace(
            "reset_after_us = 1_000",
            "reset_after_us = 1_000, delay_us = 5",
        ),
        // an unknown field
        base.replace("remaining", "remainder"),
        // a field of another algorithm
        base.replace("burst = 2", "burst = 2, window_us = 5"),
        // a period that is too long
        base.replace("period_us = 1_000", "period_us = 1_000_000_000_000_000"),
    ];
    for text in bad {
        assert!(parse("x.toml", &text).is_err(), "accepted:\n{text}");
    }
    let multi = r#"
[[case]]
name = "m"
rules = [
  { name = "a", algorithm = "fixed_window", limit = 1, window_us = 1_000 },
  { name = "b", algorithm = "fixed_window", limit = 1, window_us = 1_000 },
]

[[case.steps]]
t_us = 0
checks = [{ rule = "a", cost = 1 }, { rule = "b", cost = 1 }]
allowed = true
decisions = [
  { allowed = true, remaining = 0, reset_after_us = 1_000 },
  { allowed = true, remaining = 0, reset_after_us = 1_000 },
]
"#;
    let cases = parse("m.toml", multi).unwrap();
    assert_eq!(cases[0].steps[0].line, 9);
    assert_eq!(cases[0].steps[0].check().unwrap().checks[1].rule, 1);
    // The overall verdict must follow from the decisions.
    let contradictory = multi.replacen("allowed = true\n", "allowed = false\n", 1);
    assert!(parse("m.toml", &contradictory).is_err());
    // A rule that does not exist.
    assert!(parse("m.toml", &multi.replace("rule = \"b\"", "rule = \"z\"")).is_err());
}

/// What a request step expects, to change by hand.
fn expected_mut(step: &mut Step) -> &mut Expected {
    match &mut step.action {
        Action::Check(request) => &mut request.expected,
        Action::Settle(_) | Action::Renew(_) => panic!("not a request"),
    }
}

fn memory(rules: Vec<Rule>) -> MemoryStore<FakeClock> {
    MemoryStore::with_clock(rules, MemoryOptions::default(), FakeClock::new(0))
}

/// The in-memory store, with an optional change to every verdict.
struct Tampered(MemoryStore<FakeClock>, fn(&mut Verdict));

impl Harness for Tampered {
    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
        let mut verdict = self.0.check_at(checks, now_us)?;
        (self.1)(&mut verdict);
        Ok(verdict)
    }

    fn reserve(
        &mut self,
        id: &str,
        checks: &[Check<'_>],
        now_us: u64,
    ) -> Result<Verdict, HarnessError> {
        let mut verdict = self.0.reserve_at(id, checks, now_us)?;
        (self.1)(&mut verdict);
        Ok(verdict)
    }

    fn settle(
        &mut self,
        id: &str,
        settles: &[Settle<'_>],
        now_us: u64,
    ) -> Result<Settled, HarnessError> {
        Ok(self.0.settle_at(id, settles, now_us)?)
    }

    fn renew(&mut self, renews: &[Renew<'_>], now_us: u64) -> Result<Vec<Renewed>, HarnessError> {
        Ok(self.0.renew_at(renews, now_us)?)
    }
}

#[test]
fn the_runner_checks_every_field() {
    // 10 per second (T = 100_000), a queue of 2, shaping. Each step gets
    // something wrong on purpose.
    let text = r#"
[[case]]
name = "wrong on purpose"
rule = { algorithm = "leaky_bucket", limit = 10, period_us = 1_000_000, capacity = 2 }
steps = [
  { t_us = 0, cost = 1, allowed = true, remaining = 0, reset_after_us = 1 },
  { t_us = 0, cost = 1, allowed = true, remaining = 0, reset_after_us = 200_000, delay_us = 5 },
  { t_us = 0, cost = 1, allowed = false, remaining = 0, reset_after_us = 200_000, retry_after_us = 7 },
  { t_us = 0, cost = 0, allowed = false, remaining = 0, reset_after_us = 200_000, retry_after_us = 1 },
  { t_us = 0, cost = 3, allowed = false, remaining = 0, reset_after_us = 200_000, retry_after_us = 1 },
  { t_us = 0, cost = 0, allowed = true, remaining = 0, reset_after_us = 200_000 },
]
"#;
    // Step 5 is invalid as written (cost 3 > capacity 2 must be an error),
    // and step 6 right: swap their expectations by hand to make a store
    // that errs where a verdict was expected, and the reverse.
    let with_step5 = text.replace(
        "cost = 3, allowed = false, remaining = 0, reset_after_us = 200_000, retry_after_us = 1",
        "cost = 3, error = \"cost_too_large\"",
    );
    let mut cases = parse("wrong.toml", &with_step5).unwrap();
    let steps = &mut cases[0].steps;
    *expected_mut(&mut steps[4]) = steps[5].check().unwrap().expected.clone();
    *expected_mut(&mut steps[5]) = Expected::CostTooLarge;

    let report = run(&cases, |rules| Tampered(memory(rules), |_| {}));
    let found: Vec<(usize, &str)> = report
        .mismatches
        .iter()
        .map(|m| (m.step, m.field))
        .collect();
    assert_eq!(
        found,
        [
            (1, "remaining"),
            (1, "reset_after_us"),
            (2, "delay_us"),
            (3, "retry_after_us"),
            (4, "allowed"),
            (4, "allowed"),
            (4, "retry_after_us"),
            (5, "outcome"),
            (6, "outcome"),
        ],
        "{report}"
    );
    assert_eq!(report.mismatches[4].check, None);
    assert_eq!(report.mismatches[5].check, Some(1));

    // `limit` is checked against the rule's capacity on every decision.
    let good = parse(
        "good.toml",
        r#"
[[case]]
name = "right"
rule = { algorithm = "token_bucket", limit = 1, period_us = 1_000, burst = 2 }
steps = [{ t_us = 0, cost = 1, allowed = true, remaining = 1, reset_after_us = 1_000 }]
"#,
    )
    .unwrap();
    assert!(run(&good, |rules| Tampered(memory(rules), |_| {})).passed());
    let report = run(&good, |rules| {
        Tampered(memory(rules), |v| v.decisions[0].limit = 3)
    });
    let fields: Vec<_> = report.mismatches.iter().map(|m| m.field).collect();
    assert!(fields.contains(&"limit"), "{report}");
    // And a decision too many.
    let report = run(&good, |rules| {
        Tampered(memory(rules), |v| v.decisions.push(v.decisions[0]))
    });
    let fields: Vec<_> = report.mismatches.iter().map(|m| m.field).collect();
    assert!(fields.contains(&"decisions"), "{report}");
}

/// An algorithm as the settle vectors must cover it: the leaky bucket once
/// per mode.
fn variant(config: &AlgorithmConfig) -> &'static str {
    match config {
        AlgorithmConfig::LeakyBucket {
            mode: LeakyMode::Shape,
            ..
        } => "leaky_bucket shape",
        AlgorithmConfig::LeakyBucket {
            mode: LeakyMode::Police,
            ..
        } => "leaky_bucket police",
        other => other.name(),
    }
}

/// What the settle vectors must exercise, for every algorithm and both
/// leaky bucket modes.
#[test]
fn settle_vectors_cover_every_algorithm() {
    let settles: Vec<&Case> = cases().iter().filter(|c| c.file == "settle.toml").collect();
    let variants = [
        "fixed_window",
        "sliding_log",
        "sliding_window",
        "token_bucket",
        "leaky_bucket shape",
        "leaky_bucket police",
    ];
    for variant_name in variants {
        let mut seen: BTreeMap<&str, bool> = [
            "give-back",
            "overrun",
            "sent again",
            "after the charge ended",
            "far beyond one quota",
            "a charge between the charge and its settle",
            "after an overrun, denied at t + retry_after - 1, admitted at t + retry_after",
        ]
        .into_iter()
        .map(|k| (k, false))
        .collect();
        let mut mark = |flag| *seen.get_mut(flag).unwrap() = true;
        for case in settles
            .iter()
            .filter(|c| c.rules.len() == 1 && variant(&c.rules[0].config) == variant_name)
        {
            let capacity = case.rules[0].config.capacity();
            let mut overrun_at = None;
            for (i, step) in case.steps.iter().enumerate() {
                let Some(settle) = step.settle() else {
                    continue;
                };
                let charge = &case.steps[settle.charge];
                let (check, decision) = one(charge).expect("a one-check charge");
                let actual = settle.actuals[0];
                if !settle.applied {
                    mark("sent again");
                    continue;
                }
                if actual < check.cost {
                    mark("give-back");
                }
                if actual > check.cost {
                    mark("overrun");
                    overrun_at.get_or_insert(i);
                }
                if actual > check.cost + capacity {
                    mark("far beyond one quota");
                }
                if step.t_us >= charge.t_us + decision.reset_after_us {
                    mark("after the charge ended");
                }
                let between = case.steps[settle.charge + 1..i].iter().filter_map(one);
                if between
                    .clone()
                    .any(|(c, d)| c.key == check.key && c.cost > 0 && d.allowed)
                {
                    mark("a charge between the charge and its settle");
                }
            }
            // A denial after an overrun, probed from both sides.
            let Some(from) = overrun_at else {
                continue;
            };
            for (i, step) in case.steps.iter().enumerate().skip(from) {
                let Some((check, decision)) = one(step) else {
                    continue;
                };
                let (Some(retry), Some(next), Some(after)) = (
                    decision.retry_after_us,
                    case.steps.get(i + 1).and_then(one),
                    case.steps.get(i + 2).and_then(one),
                ) else {
                    continue;
                };
                let at = step.t_us + retry;
                let same = |c: &StepCheck| c.key == check.key && c.cost == check.cost;
                if same(next.0)
                    && same(after.0)
                    && case.steps[i + 1].t_us == at - 1
                    && !next.1.allowed
                    && case.steps[i + 2].t_us == at
                    && after.1.allowed
                {
                    mark(
                        "after an overrun, denied at t + retry_after - 1, admitted at t + retry_after",
                    );
                }
            }
        }
        let missing: Vec<_> = seen.iter().filter(|(_, s)| !**s).map(|(k, _)| *k).collect();
        assert!(missing.is_empty(), "{variant_name} lacks: {missing:?}");
    }
    // Several rules settled at once, and a reservation of 0 charged whole
    // at the settle.
    let multi = settles.iter().flat_map(|c| {
        c.steps
            .iter()
            .filter_map(move |s| Some((c, s.settle()?)))
            .filter(|(_, s)| s.actuals.len() > 1)
    });
    assert!(multi.clone().any(|(case, settle)| {
        let request = case.steps[settle.charge].check().unwrap();
        request
            .checks
            .iter()
            .any(|a| a.rule != request.checks[0].rule)
    }));
    assert!(multi.clone().any(|(case, settle)| {
        let request = case.steps[settle.charge].check().unwrap();
        request
            .checks
            .iter()
            .zip(&settle.actuals)
            .any(|(c, &actual)| c.cost == 0 && actual > 0)
    }));
}

/// The in-memory store with its settles changed: `settle` stands for the
/// store's, given the store, the id, the settles and the time.
type WrongSettle =
    fn(&MemoryStore<FakeClock>, &str, &[Settle<'_>], u64) -> Result<Settled, spillway::Error>;

struct BadSettle(MemoryStore<FakeClock>, WrongSettle);

impl Harness for BadSettle {
    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
        Ok(self.0.check_at(checks, now_us)?)
    }

    fn reserve(
        &mut self,
        id: &str,
        checks: &[Check<'_>],
        now_us: u64,
    ) -> Result<Verdict, HarnessError> {
        Ok(self.0.reserve_at(id, checks, now_us)?)
    }

    fn settle(
        &mut self,
        id: &str,
        settles: &[Settle<'_>],
        now_us: u64,
    ) -> Result<Settled, HarnessError> {
        Ok((self.1)(&self.0, id, settles, now_us)?)
    }

    fn renew(&mut self, renews: &[Renew<'_>], now_us: u64) -> Result<Vec<Renewed>, HarnessError> {
        Ok(self.0.renew_at(renews, now_us)?)
    }
}

/// Each way of getting a settle wrong fails the settle vectors (and the
/// concurrency vectors, whose releases are settles), and nothing else: the
/// other files have no settles.
#[test]
fn a_store_whose_settle_is_wrong_fails() {
    let wrong: [(&str, WrongSettle); 4] = [
        // Not idempotent: every send is a new settle.
        ("not idempotent", |store, _, settles, now| {
            static SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut settled = store.settle_at(&format!("send {n}"), settles, now)?;
            settled.applied = true;
            Ok(settled)
        }),
        // Settles one unit more than the actual cost.
        ("off by one", |store, id, settles, now| {
            let more: Vec<Settle<'_>> = settles
                .iter()
                .map(|s| Settle {
                    actual: s.actual + 1,
                    ..*s
                })
                .collect();
            store.settle_at(id, &more, now)
        }),
        // Settles as of now, as if the charge had just been made.
        (
            "forgets when the charge was made",
            |store, id, settles, now| {
                let now_charged: Vec<Settle<'_>> = settles
                    .iter()
                    .map(|s| Settle {
                        charged: spillway::algorithm::Charged {
                            at: now,
                            ..s.charged
                        },
                        ..*s
                    })
                    .collect();
                store.settle_at(id, &now_charged, now)
            },
        ),
        // Changes nothing, and says it did.
        ("a no-op", |store, _, settles, now| {
            let peeks: Vec<Check<'_>> = settles
                .iter()
                .map(|s| Check {
                    rule: s.rule,
                    key: s.key,
                    cost: 0,
                })
                .collect();
            Ok(Settled {
                applied: true,
                decisions: store.check_at(&peeks, now)?.decisions.into_vec(),
            })
        }),
    ];
    // What the store's own settle gets wrong, if anything, is not what these
    // tests are about.
    let right = run(cases(), |rules| {
        BadSettle(memory(rules), |store, id, settles, now| {
            store.settle_at(id, settles, now)
        })
    });
    for (what, settle) in wrong {
        let report = run(cases(), |rules| BadSettle(memory(rules), settle));
        assert!(
            report
                .mismatches
                .iter()
                .any(|m| !right.mismatches.contains(m)),
            "{what}: passed"
        );
        assert!(
            report
                .mismatches
                .iter()
                .all(|m| ["settle.toml", "concurrency.toml", "release.toml"].contains(&&*m.file)),
            "{what}: {report}"
        );
        if what == "not idempotent" {
            assert!(
                report.mismatches.iter().any(|m| m.field == "applied"),
                "{what}: {report}"
            );
        }
    }
}

#[test]
fn inconsistent_settles_are_rejected() {
    let base = r#"
[[case]]
name = "s"
rule = { algorithm = "fixed_window", limit = 10, window_us = 1_000 }
steps = [
  { t_us = 100, cost = 6, id = "r1", allowed = true, remaining = 4, reset_after_us = 900 },
  { t_us = 150, settle = "r1", actual = 2, applied = true, remaining = 8, reset_after_us = 850 },
  { t_us = 200, settle = "r1", actual = 2, applied = false, remaining = 8, reset_after_us = 800 },
]
"#;
    let cases = parse("s.toml", base).unwrap_or_else(|e| panic!("{e}"));
    let settle = cases[0].steps[1].settle().unwrap();
    assert_eq!((settle.charge, settle.actuals.as_slice()), (0, &[2][..]));
    let bad = [
        // an unknown id
        base.replace("settle = \"r1\", actual = 2, applied = true", "settle = \"r9\", actual = 2, applied = true"),
        // a settle before its charge is named
        base.replace("cost = 6, id = \"r1\"", "cost = 6"),
        // two requests of one id
        base.replace(
            "  { t_us = 150, settle",
            "  { t_us = 120, cost = 1, id = \"r1\", allowed = true, remaining = 3, reset_after_us = 880 },\n  { t_us = 150, settle",
        ),
        // an id on a denial, and on a peek
        base.replace(
            "  { t_us = 150, settle",
            "  { t_us = 120, cost = 5, id = \"r2\", allowed = false, remaining = 4, reset_after_us = 880, retry_after_us = 880 },\n  { t_us = 150, settle",
        ),
        base.replace(
            "  { t_us = 150, settle",
            "  { t_us = 120, cost = 0, id = \"r2\", allowed = true, remaining = 4, reset_after_us = 880 },\n  { t_us = 150, settle",
        ),
        // actuals for a one-check charge, which must be `actual`
        base.replace("actual = 2, applied = true", "actuals = [2], applied = true"),
        // no actual at all
        base.replace("actual = 2, applied = true", "applied = true"),
        // a retry_after, a delay or an allowed on a settle
        base.replace("reset_after_us = 850", "reset_after_us = 850, retry_after_us = 1"),
        base.replace("reset_after_us = 850", "reset_after_us = 850, delay_us = 0"),
        base.replace("applied = true,", "applied = true, allowed = true,"),
        // a request's fields on a settle
        base.replace("settle = \"r1\", actual = 2, applied = true", "settle = \"r1\", cost = 1, actual = 2, applied = true"),
        // the first settle not applied, the second applied
        base.replace("applied = true", "applied = false"),
        base.replace("applied = false", "applied = true"),
        // sent again after the store may have forgotten the id (600 s)
        base.replace("{ t_us = 200, settle", "{ t_us = 600_000_150, settle"),
        // `applied` on a request
        base.replace("id = \"r1\", allowed", "id = \"r1\", applied = true, allowed"),
    ];
    for text in bad {
        assert!(parse("s.toml", &text).is_err(), "accepted:\n{text}");
    }
    let multi = r#"
[[case]]
name = "m"
rules = [
  { name = "a", algorithm = "fixed_window", limit = 5, window_us = 1_000 },
  { name = "b", algorithm = "fixed_window", limit = 5, window_us = 1_000 },
]

[[case.steps]]
t_us = 0
checks = [{ rule = "a", cost = 1 }, { rule = "b", cost = 0 }]
id = "r1"
allowed = true
decisions = [
  { allowed = true, remaining = 4, reset_after_us = 1_000 },
  { allowed = true, remaining = 5, reset_after_us = 0 },
]

[[case.steps]]
t_us = 0
settle = "r1"
actuals = [1, 2]
applied = true
decisions = [
  { remaining = 4, reset_after_us = 1_000 },
  { remaining = 3, reset_after_us = 1_000 },
]
"#;
    let cases = parse("m.toml", multi).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cases[0].steps[1].settle().unwrap().actuals, [1, 2]);
    let bad = [
        // as many actuals as checks
        multi.replace("actuals = [1, 2]", "actuals = [1]"),
        // one actual for two checks
        multi.replace("actuals = [1, 2]", "actual = 1"),
        // as many decisions as checks
        multi.replace("  { remaining = 3, reset_after_us = 1_000 },\n", ""),
        // the decisions inline
        multi.replace(
            "applied = true\ndecisions",
            "applied = true\nremaining = 4\ndecisions",
        ),
    ];
    for text in bad {
        assert!(parse("m.toml", &text).is_err(), "accepted:\n{text}");
    }
}

#[test]
fn the_runner_checks_every_settle_field() {
    // 10 per window of 1_000; each settle gets something wrong on purpose.
    let text = r#"
[[case]]
name = "settles wrong on purpose"
rule = { algorithm = "fixed_window", limit = 10, window_us = 1_000 }
steps = [
  { t_us = 100, cost = 6, id = "r1", allowed = true, remaining = 4, reset_after_us = 900 },
  { t_us = 100, settle = "r1", actual = 2, applied = true, remaining = 7, reset_after_us = 900 },
  { t_us = 100, settle = "r1", actual = 2, applied = false, remaining = 8, reset_after_us = 1 },
  { t_us = 100, cost = 5, id = "r2", allowed = true, remaining = 3, reset_after_us = 900 },
  { t_us = 100, settle = "r2", actual = 5, applied = true, remaining = 3, reset_after_us = 900 },
]
"#;
    let mut cases = parse("wrong.toml", text).unwrap_or_else(|e| panic!("{e}"));
    // Step 3 sends r1 again, which the store applies only once: expect it
    // applied, by hand, as a store that is not idempotent would answer.
    if let Action::Settle(s) = &mut cases[0].steps[2].action {
        s.applied = true;
    }
    let report = run(&cases, |rules| Tampered(memory(rules), |_| {}));
    let found: Vec<(usize, &str)> = report
        .mismatches
        .iter()
        .map(|m| (m.step, m.field))
        .collect();
    assert_eq!(
        found,
        [(2, "remaining"), (3, "applied"), (3, "reset_after_us")],
        "{report}"
    );

    // A settle whose request the store denied (here, a store that says it
    // denied step 4) has nothing to settle: the runner says so, and sends
    // nothing.
    let report = run(&cases, |rules| {
        Tampered(memory(rules), |v| {
            if v.decisions[0].remaining == 3 {
                v.allowed = false;
                v.decisions[0].allowed = false;
                v.decisions[0].retry_after = Some(std::time::Duration::from_micros(900));
            }
        })
    });
    let outcome = report
        .mismatches
        .iter()
        .find(|m| m.step == 5)
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(outcome.field, "outcome", "{report}");
    assert!(outcome.actual.contains("denial"), "{report}");
}

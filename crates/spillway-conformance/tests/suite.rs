//! The suite itself: it is not empty, it covers what it claims to, and its
//! runner reports every mismatch instead of stopping at the first.

use std::collections::BTreeMap;

use spillway::clock::FakeClock;
use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, Verdict};
use spillway_conformance::{
    ALGORITHMS, Case, Expected, ExpectedDecision, Harness, HarnessError, Step, StepCheck,
    VECTOR_FILES, cases, parse, run,
};

/// A one-check step's check and expected decision.
fn one(step: &Step) -> Option<(&StepCheck, ExpectedDecision)> {
    match (&step.checks[..], &step.expected) {
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
                for c in &step.checks {
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
                if matches!(step.expected, Expected::CostTooLarge) {
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
    let partial_denial = multi.iter().flat_map(|c| &c.steps).any(|s| {
        matches!(&s.expected, Expected::Verdict { allowed: false, decisions }
            if decisions.iter().any(|d| d.allowed))
    });
    let same_key_two_rules = multi.iter().flat_map(|c| &c.steps).any(|s| {
        s.checks
            .iter()
            .any(|a| s.checks.iter().any(|b| a.key == b.key && a.rule != b.rule))
    });
    let error = multi
        .iter()
        .flat_map(|c| &c.steps)
        .any(|s| s.checks.len() > 1 && matches!(s.expected, Expected::CostTooLarge));
    assert!(partial_denial && same_key_two_rules && error);
    let algorithms: std::collections::HashSet<_> = multi
        .iter()
        .flat_map(|c| &c.rules)
        .map(|r| r.config.name())
        .collect();
    assert_eq!(algorithms.len(), ALGORITHMS.len(), "{algorithms:?}");
}

/// A store that gets `remaining` wrong by one on every decision.
struct OffByOne(MemoryStore<FakeClock>);

impl Harness for OffByOne {
    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
        let mut verdict = self.0.check_at(checks, now_us)?;
        for d in &mut verdict.decisions {
            d.remaining += 1;
        }
        Ok(verdict)
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
        .map(|s| match &s.expected {
            Expected::Verdict { decisions, .. } => decisions.len(),
            Expected::CostTooLarge => 0,
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
    assert_eq!(cases[0].steps[0].checks[1].rule, 1);
    // The overall verdict must follow from the decisions.
    let contradictory = multi.replacen("allowed = true\n", "allowed = false\n", 1);
    assert!(parse("m.toml", &contradictory).is_err());
    // A rule that does not exist.
    assert!(parse("m.toml", &multi.replace("rule = \"b\"", "rule = \"z\"")).is_err());
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
    (steps[4].expected, steps[5].expected) = (steps[5].expected.clone(), Expected::CostTooLarge);

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

//! Running the vectors against a store: [`Harness`], [`run_all`].

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use spillway::Decision;
use spillway::algorithm::{Charged, Renewed};
use spillway::store::{Check, Renew, Rule, RuleId, Settle, Settled, Verdict};

use crate::vectors::{
    Action, Case, CheckStep, Expected, ExpectedDecision, RenewStep, SettleStep, cases,
};

/// A store under test, as the suite drives it.
///
/// The suite builds one harness per case (with the case's rules) and calls
/// [`check`](Harness::check), [`settle`](Harness::settle) or
/// [`renew`](Harness::renew) once per step.
/// The trait is synchronous: an asynchronous store's harness blocks on its
/// own runtime.
pub trait Harness {
    /// Decides on one request, all its checks at once, at `now_us`
    /// microseconds on the store's clock: the store must use this time, not
    /// its own. `checks[i].rule` indexes the rules the harness was built
    /// with.
    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError>;

    /// Decides on one request as [`check`](Harness::check) does, holding
    /// the charges of rules that release them open under `id` (the store's
    /// [`reserve`](spillway::store::Store::reserve)).
    fn reserve(
        &mut self,
        id: &str,
        checks: &[Check<'_>],
        now_us: u64,
    ) -> Result<Verdict, HarnessError>;

    /// Settles an admitted request's charges, at `now_us` on the store's
    /// clock, once per `id` (the store's
    /// [`settle`](spillway::store::Store::settle)).
    fn settle(
        &mut self,
        id: &str,
        settles: &[Settle<'_>],
        now_us: u64,
    ) -> Result<Settled, HarnessError>;

    /// Renews concurrency leases at `now_us` on the store's clock (the
    /// store's [`renew`](spillway::store::Store::renew)).
    fn renew(&mut self, renews: &[Renew<'_>], now_us: u64) -> Result<Vec<Renewed>, HarnessError>;
}

impl<H: Harness + ?Sized> Harness for &mut H {
    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
        (**self).check(checks, now_us)
    }

    fn reserve(
        &mut self,
        id: &str,
        checks: &[Check<'_>],
        now_us: u64,
    ) -> Result<Verdict, HarnessError> {
        (**self).reserve(id, checks, now_us)
    }

    fn settle(
        &mut self,
        id: &str,
        settles: &[Settle<'_>],
        now_us: u64,
    ) -> Result<Settled, HarnessError> {
        (**self).settle(id, settles, now_us)
    }

    fn renew(&mut self, renews: &[Renew<'_>], now_us: u64) -> Result<Vec<Renewed>, HarnessError> {
        (**self).renew(renews, now_us)
    }
}

/// A request that a store answered with an error instead of a verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HarnessError {
    /// A check's cost exceeds its rule's capacity (what the vectors call
    /// `cost_too_large`).
    CostTooLarge,
    /// Anything else (a lost connection, an unknown rule...). Always a
    /// failure.
    Other(String),
}

impl fmt::Display for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CostTooLarge => f.write_str("cost_too_large"),
            Self::Other(message) => write!(f, "error: {message}"),
        }
    }
}

impl std::error::Error for HarnessError {}

impl From<spillway::Error> for HarnessError {
    fn from(e: spillway::Error) -> Self {
        match e {
            spillway::Error::CostTooLarge { .. } => Self::CostTooLarge,
            other => Self::Other(other.to_string()),
        }
    }
}

/// One value a store got wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The vector file.
    pub file: String,
    /// The case's name.
    pub case: String,
    /// The step, counting from 1.
    pub step: usize,
    /// The step's line in the vector file.
    pub line: usize,
    /// The step's time.
    pub t_us: u64,
    /// The check within the step (of a settle: within the request it
    /// settles), counting from 1, when the field is one check's decision.
    pub check: Option<usize>,
    /// Which field: `allowed`, `limit`, `remaining`, `reset_after_us`,
    /// `retry_after_us`, `delay_us`, `decisions` (their number), `applied`
    /// (of a settle) or `outcome` (a verdict where an error was expected,
    /// or the reverse; a settle that failed, or whose request charged
    /// nothing).
    pub field: &'static str,
    /// What the vectors say.
    pub expected: String,
    /// What the store said.
    pub actual: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: case {:?}, step {} (t_us = {})",
            self.file, self.line, self.case, self.step, self.t_us
        )?;
        if let Some(check) = self.check {
            write!(f, ", check {check}")?;
        }
        write!(
            f,
            ": {}: expected {}, got {}",
            self.field, self.expected, self.actual
        )
    }
}

/// What a run found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// How many cases ran.
    pub cases: usize,
    /// How many steps ran.
    pub steps: usize,
    /// Every value the store got wrong, in order.
    pub mismatches: Vec<Mismatch>,
}

impl Report {
    /// The store answered every step as expected.
    pub fn passed(&self) -> bool {
        self.mismatches.is_empty()
    }

    /// Panics, listing every mismatch, unless the run passed.
    pub fn assert_passed(&self) {
        assert!(self.passed(), "{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failed_steps = {
            let mut steps: Vec<_> = self
                .mismatches
                .iter()
                .map(|m| (&m.file, &m.case, m.step))
                .collect();
            steps.dedup();
            steps.len()
        };
        write!(
            f,
            "conformance: {} cases, {} steps, {} failed steps ({} mismatched values)",
            self.cases,
            self.steps,
            failed_steps,
            self.mismatches.len()
        )?;
        for m in &self.mismatches {
            write!(f, "\n  {m}")?;
        }
        Ok(())
    }
}

/// Runs every embedded vector ([`cases`]) against the store that
/// `new_harness` builds, one fresh harness per case, built from the case's
/// rules. Every step of every case runs, whatever fails before it.
///
/// # Panics
///
/// At the end, if anything did not match, listing every mismatch. Use
/// [`run`] to get the [`Report`] instead.
pub fn run_all<H, F>(new_harness: F) -> Report
where
    H: Harness,
    F: FnMut(Vec<Rule>) -> H,
{
    let report = run(cases(), new_harness);
    report.assert_passed();
    report
}

/// Runs `cases` against the store that `new_harness` builds, one fresh
/// harness per case, and reports every mismatch without panicking.
pub fn run<H, F>(cases: &[Case], mut new_harness: F) -> Report
where
    H: Harness,
    F: FnMut(Vec<Rule>) -> H,
{
    let mut report = Report::default();
    for case in cases {
        let mut harness = new_harness(case.store_rules());
        report.cases += 1;
        report.steps += case.steps.len();
        report.mismatches.extend(run_case(case, &mut harness));
    }
    report
}

/// Runs one case's steps, in order, on `harness` (which should be fresh),
/// and returns every mismatch.
pub fn run_case<H: Harness + ?Sized>(case: &Case, harness: &mut H) -> Vec<Mismatch> {
    let mut mismatches = Vec::new();
    // What the store answered to each request that a settle names, by step.
    let mut charges: HashMap<usize, Result<Verdict, HarnessError>> = HashMap::new();
    for (i, step) in case.steps.iter().enumerate() {
        let mut report = |check: Option<usize>, field, expected: String, actual: String| {
            mismatches.push(Mismatch {
                file: case.file.clone(),
                case: case.name.clone(),
                step: i + 1,
                line: step.line,
                t_us: step.t_us,
                check,
                field,
                expected,
                actual,
            });
        };
        match &step.action {
            Action::Check(request) => {
                let checks: Vec<Check<'_>> = request
                    .checks
                    .iter()
                    .map(|c| Check {
                        rule: RuleId(c.rule),
                        key: &c.key,
                        cost: c.cost,
                    })
                    .collect();
                let held = request
                    .checks
                    .iter()
                    .any(|c| case.rules[c.rule].release_after.is_some());
                let answer = match &request.id {
                    Some(id) if held => harness.reserve(id, &checks, step.t_us),
                    _ => harness.check(&checks, step.t_us),
                };
                compare(case, request, &answer, &mut report);
                if request.id.is_some() {
                    charges.insert(i, answer);
                }
            }
            Action::Settle(settle) => {
                let request = case.steps[settle.charge]
                    .check()
                    .expect("a settle names a request");
                let charged = charges.get(&settle.charge);
                match settles_of(case, request, &settle.actuals, charged) {
                    Ok(settles) => {
                        let answer = harness.settle(&settle.id, &settles, step.t_us);
                        compare_settled(case, request, settle, answer, &mut report);
                    }
                    Err(nothing) => report(
                        None,
                        "outcome",
                        format!("a settle of step {}'s charges", settle.charge + 1),
                        nothing,
                    ),
                }
            }
            Action::Renew(renew) => {
                let request = case.steps[renew.charge]
                    .check()
                    .expect("a renew names a request");
                let lease = charges.get(&renew.charge);
                match settles_of(case, request, &[0], lease) {
                    Ok(settles) => {
                        let [
                            Settle {
                                rule, key, charged, ..
                            },
                        ] = settles[..]
                        else {
                            unreachable!("a renew names a one-check request")
                        };
                        let answer = harness.renew(&[Renew { rule, key, charged }], step.t_us);
                        compare_renewed(case, request, renew, answer, &mut report);
                    }
                    Err(nothing) => report(
                        None,
                        "outcome",
                        format!("a renew of step {}'s lease", renew.charge + 1),
                        nothing,
                    ),
                }
            }
        }
    }
    mismatches
}

/// The settles of `request`'s charges, built from what the store answered
/// it (`charged`); or, when it charged nothing, what it answered instead.
fn settles_of<'a>(
    case: &Case,
    request: &'a CheckStep,
    actuals: &[u64],
    charged: Option<&Result<Verdict, HarnessError>>,
) -> Result<Vec<Settle<'a>>, String> {
    let verdict = match charged {
        Some(Ok(verdict)) if verdict.allowed => verdict,
        Some(Ok(_)) => return Err("a denial, which charged nothing".into()),
        Some(Err(e)) => return Err(e.to_string()),
        None => return Err("no answer".into()),
    };
    if verdict.decisions.len() != request.checks.len() {
        return Err(format!(
            "{} decisions for {} checks",
            verdict.decisions.len(),
            request.checks.len()
        ));
    }
    Ok(request
        .checks
        .iter()
        .zip(&verdict.decisions)
        .zip(actuals)
        .map(|((check, decision), &actual)| {
            let charged = Charged::of(check.cost, verdict.decided_at, decision);
            let held = case.rules[check.rule].release_after.is_some() && check.cost > 0;
            Settle {
                rule: RuleId(check.rule),
                key: &check.key,
                charged: if held { charged.held_open() } else { charged },
                actual,
            }
        })
        .collect())
}

fn compare_settled(
    case: &Case,
    request: &CheckStep,
    settle: &SettleStep,
    answer: Result<Settled, HarnessError>,
    report: &mut impl FnMut(Option<usize>, &'static str, String, String),
) {
    let settled = match answer {
        Ok(settled) => settled,
        Err(e) => {
            let expected = format!("settled, applied = {}", settle.applied);
            return report(None, "outcome", expected, e.to_string());
        }
    };
    if settled.applied != settle.applied {
        report(
            None,
            "applied",
            settle.applied.to_string(),
            settled.applied.to_string(),
        );
    }
    compare_decisions(case, request, &settle.decisions, &settled.decisions, report);
}

/// Compares a renew's answer. The lease keeps its name: later renews and
/// settles name it by the answer to the request that took it.
fn compare_renewed(
    case: &Case,
    request: &CheckStep,
    renew: &RenewStep,
    answer: Result<Vec<Renewed>, HarnessError>,
    report: &mut impl FnMut(Option<usize>, &'static str, String, String),
) {
    let renewed = match answer.as_deref() {
        Ok([renewed]) => *renewed,
        Ok(other) => {
            return report(None, "renewed", "1".into(), other.len().to_string());
        }
        Err(e) => {
            let expected = format!("renewed, was_held = {}", renew.was_held);
            return report(None, "outcome", expected, e.to_string());
        }
    };
    if renewed.was_held != renew.was_held {
        report(
            None,
            "was_held",
            renew.was_held.to_string(),
            renewed.was_held.to_string(),
        );
    }
    compare_decisions(
        case,
        request,
        std::slice::from_ref(&renew.decision),
        &[renewed.decision],
        report,
    );
}

fn compare(
    case: &Case,
    request: &CheckStep,
    answer: &Result<Verdict, HarnessError>,
    report: &mut impl FnMut(Option<usize>, &'static str, String, String),
) {
    match (&request.expected, answer) {
        (Expected::CostTooLarge, Err(HarnessError::CostTooLarge)) => {}
        (Expected::CostTooLarge, Err(other)) => {
            report(None, "outcome", "cost_too_large".into(), other.to_string());
        }
        (Expected::CostTooLarge, Ok(verdict)) => {
            report(
                None,
                "outcome",
                "cost_too_large".into(),
                format!("a verdict, allowed = {}", verdict.allowed),
            );
        }
        (Expected::Verdict { allowed, .. }, Err(e)) => {
            report(
                None,
                "outcome",
                format!("a verdict, allowed = {allowed}"),
                e.to_string(),
            );
        }
        (Expected::Verdict { allowed, decisions }, Ok(verdict)) => {
            if verdict.allowed != *allowed {
                report(
                    None,
                    "allowed",
                    allowed.to_string(),
                    verdict.allowed.to_string(),
                );
            }
            compare_decisions(case, request, decisions, &verdict.decisions, report);
        }
    }
}

/// Compares one decision per check of `request`.
fn compare_decisions(
    case: &Case,
    request: &CheckStep,
    want: &[ExpectedDecision],
    got: &[Decision],
    report: &mut impl FnMut(Option<usize>, &'static str, String, String),
) {
    if got.len() != want.len() {
        report(
            None,
            "decisions",
            want.len().to_string(),
            got.len().to_string(),
        );
    }
    for (i, (check, (want, got))) in request.checks.iter().zip(want.iter().zip(got)).enumerate() {
        let limit = case.rules[check.rule].config.capacity();
        compare_decision(want, limit, got, &mut |field, expected, actual| {
            report(Some(i + 1), field, expected, actual);
        });
    }
}

fn compare_decision(
    want: &ExpectedDecision,
    limit: u64,
    got: &Decision,
    report: &mut impl FnMut(&'static str, String, String),
) {
    if got.allowed != want.allowed {
        report("allowed", want.allowed.to_string(), got.allowed.to_string());
    }
    if got.limit != limit {
        report("limit", limit.to_string(), got.limit.to_string());
    }
    if got.remaining != want.remaining {
        report(
            "remaining",
            want.remaining.to_string(),
            got.remaining.to_string(),
        );
    }
    if got.reset_after != Duration::from_micros(want.reset_after_us) {
        report(
            "reset_after_us",
            want.reset_after_us.to_string(),
            micros(got.reset_after),
        );
    }
    if got.retry_after != want.retry_after_us.map(Duration::from_micros) {
        report(
            "retry_after_us",
            want.retry_after_us
                .map_or_else(|| "none".into(), |us| us.to_string()),
            got.retry_after.map_or_else(|| "none".into(), micros),
        );
    }
    if got.delay != Duration::from_micros(want.delay_us) {
        report("delay_us", want.delay_us.to_string(), micros(got.delay));
    }
}

/// A duration as the vectors write it, or exactly when it is not whole
/// microseconds.
fn micros(d: Duration) -> String {
    if d.subsec_nanos().is_multiple_of(1_000) {
        d.as_micros().to_string()
    } else {
        format!("{d:?}")
    }
}

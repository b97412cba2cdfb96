//! The test vectors: their file format and the parsed types.
//!
//! The vectors live in `crates/spillway-conformance/vectors/`, one TOML file
//! per algorithm plus `multi_rule.toml`, `settle.toml` and a few on the
//! clock, and are embedded in the crate
//! ([`VECTOR_FILES`]), so the suite runs from any directory. Every expected
//! value in them was computed by hand from the definitions in
//! `docs/algorithms.md`, with the arithmetic in a comment beside the values
//! that are not obvious. They were never copied from the code's output: the
//! point is to check the code against the definitions.
//!
//! # Format
//!
//! All times and durations are integer microseconds. A file is a list of
//! `[[case]]`s. A case has a `name`, its rules, and `steps` run in order on a
//! fresh store (every key starts never seen):
//!
//! ```toml
//! [[case]]
//! name = "fresh key, exhaustion, next window"
//! rule = { algorithm = "fixed_window", limit = 3, window_us = 1_000_000 }
//! steps = [
//!   { t_us = 250_000, cost = 1, allowed = true, remaining = 2, reset_after_us = 750_000 },
//!   # a comment says how a value was computed
//!   { t_us = 700_000, cost = 3, allowed = false, remaining = 2, reset_after_us = 300_000, retry_after_us = 300_000 },
//!   { t_us = 700_000, cost = 4, error = "cost_too_large" },
//! ]
//! ```
//!
//! **Rules.** `rule = { ... }` for a case with one rule, or
//! `rules = [{ name = "...", ... }, ...]` for several (the name defaults to
//! the algorithm's). A rule has an `algorithm` and a `limit`, plus:
//!
//! | algorithm | fields |
//! |---|---|
//! | `fixed_window`, `sliding_log`, `sliding_window` | `window_us` |
//! | `token_bucket` | `period_us` (the rate is `limit` per `period_us`), `burst` |
//! | `leaky_bucket` | `period_us`, `capacity`, `mode` (`"shape"`, the default, or `"police"`), `delay` (nginx's `delay=n`; shape only, default 0) |
//! | `concurrency` | `lease_us` (`limit` is the slots) |
//!
//! Any rule but a concurrency rule may also have `release_after_us`: its
//! reservations are given back by the store when no settle names them
//! within that time (`Rule::release_unsettled_after`).
//!
//! **Steps.** A step happens at `t_us`. Its request is either one check,
//! written inline as `rule` (a rule name; only needed when the case has
//! several), `key` (default [`DEFAULT_KEY`]) and `cost`, or several, as
//! `checks = [{ rule = "...", key = "...", cost = 1 }, ...]`, all decided at
//! once. What the store must answer is either `error = "cost_too_large"` (some
//! check's cost exceeds its rule's capacity: nothing is charged), or a verdict:
//!
//! - `allowed`: the request as a whole;
//! - for a one-check step, that check's decision inline: `remaining`,
//!   `reset_after_us`, `retry_after_us` (present exactly when denied) and
//!   `delay_us` (default 0);
//! - for a `checks` step, `decisions = [{ allowed = ..., remaining = ...,
//!   ... }, ...]`, one per check in order. When the request is denied, the
//!   rules that would have admitted it are not charged, and their decision
//!   (`allowed = true`) reports their state as a cost-0 peek would.
//!
//! A decision's `limit` is not written: it must equal the rule's capacity
//! (`limit` for the windows, `burst` or `capacity` for the buckets), and the
//! runner checks it on every decision.
//!
//! A step with nested `decisions` does not fit on one TOML line, so such
//! cases write their steps as `[[case.steps]]` tables instead of an inline
//! `steps = [...]` array; both mean the same.
//!
//! **Settles.** A request that is admitted and costs something under at
//! least one of its checks may name its charges with `id = "r1"`. A later
//! step settles them at their actual costs (`Store::settle`):
//!
//! ```toml
//! # rule = { algorithm = "fixed_window", limit = 10, window_us = 1_000 }
//! { t_us = 100, cost = 6, id = "r1", allowed = true, remaining = 4, reset_after_us = 900 },
//! # 6 reserved, 2 used: 4 come back
//! { t_us = 150, settle = "r1", actual = 2, applied = true, remaining = 8, reset_after_us = 850 },
//! # sent again: nothing changes
//! { t_us = 200, settle = "r1", actual = 2, applied = false, remaining = 8, reset_after_us = 800 },
//! ```
//!
//! The runner sends the settle id `settle` (`"r1"`), with one part per check
//! of the request named: its rule and key, charged with
//! [`Charged::of`](spillway::algorithm::Charged::of) its cost, the verdict's
//! `decided_at` and that check's decision (the store's own answers), at the
//! actual cost `actual` (a one-check request) or `actuals = [...]` (one per
//! check, a cost-0 check included). What the store must answer: `applied`,
//! `true` the first time and `false` when the same settle is sent again,
//! and each key's state after it, as a cost-0 check reports it: inline
//! `remaining` and `reset_after_us` for a one-check request, else
//! `decisions = [{ remaining = ..., reset_after_us = ... }, ...]`, one per
//! check. Such a decision is always allowed, never delayed and has no
//! retry_after, so those fields are not written; its `limit` is checked as
//! any other.
//!
//! A request with an `id` whose checks include a rule with
//! `release_after_us` is sent as a reservation under that id
//! (`Store::reserve`), and the parts of its settles whose rule has it and
//! whose cost is not 0 are held (`Charged::held`): such a charge not
//! settled by its time plus `release_after_us` is settled at 0 as of its
//! time by the store itself, and a settle that comes later charges its
//! whole `actual`.
//!
//! **Renews.** A concurrency lease that an admitted one-check request
//! named with `id = "r1"` is renewed by `renew = "r1"` (`Store::renew`),
//! with the lease as it stands: as admitted, or as the last admitted renew
//! of that id left it (its time and decision). Later settles of `"r1"` (a
//! release is `actual = 0`) name that lease too. What the store must
//! answer: `was_held` (the lease was still held), and the decision inline
//! as for a one-check request (`allowed`, `remaining`, `reset_after_us`,
//! and `retry_after_us` exactly when denied).
//!
//! ```toml
//! # rule = { algorithm = "concurrency", limit = 1, lease_us = 1_000 }
//! { t_us = 0, cost = 1, id = "r1", allowed = true, remaining = 0, reset_after_us = 1_000 },
//! { t_us = 900, renew = "r1", was_held = true, allowed = true, remaining = 0, reset_after_us = 1_000 },
//! ```
//!
//! When the files are parsed, they are also checked for consistency: unknown
//! fields, a `retry_after_us` on an admission or none on a denial, a
//! `delay_us` outside a shaping leaky bucket, an overall `allowed` that does
//! not match the decisions, or a cost above capacity that is not expected to
//! be `cost_too_large` (and the reverse) are all errors. So are an `id` on a
//! request that charges nothing (denied, an error, every cost 0) or that an
//! earlier request has, a settle of an `id` no earlier request has, a
//! number of `actuals` or `decisions` other than the request's checks, a
//! request's field on a settle (`cost`, `allowed`, `retry_after_us`,
//! `delay_us`...), and an `applied` other than `true` for the first settle
//! of an id and `false` for a later one. A settle sent again is pinned down
//! only within `SETTLE_RECEIPT_TTL` of the first (after it the store may
//! have forgotten the id), so a later one is an error too.
//!
//! # Points the definitions leave open
//!
//! `docs/algorithms.md` gives a shaping leaky bucket's delay for an admitted
//! request as the backlog in front of it, and says that a cost-0 request
//! "peeks". The vectors take a peek's `delay` to be 0: it holds no place in
//! the queue, so there is nothing to wait for.
//!
//! A key in debt (a settle charged it past its quota) has used more than
//! its limit, and the formulas for `remaining` then give a negative number.
//! The vectors take it to be 0: nothing more can be admitted. A peek stays
//! allowed, in debt too, as "always `allowed`" says.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::num::NonZeroU32;
use std::sync::OnceLock;
use std::time::Duration;

use serde::Deserialize;
use spillway::Quota;
use spillway::algorithm::{
    AnyAlgorithm, Concurrency, FixedWindow, LeakyBucket, LeakyMode, SlidingLog, SlidingWindow,
    TokenBucket,
};
use spillway::store::{MAX_SETTLE_ID, Rule, SETTLE_RECEIPT_TTL};

/// The vector files, embedded in the crate: `(file name, TOML text)`.
pub const VECTOR_FILES: &[(&str, &str)] = &[
    (
        "fixed_window.toml",
        include_str!("../vectors/fixed_window.toml"),
    ),
    (
        "sliding_log.toml",
        include_str!("../vectors/sliding_log.toml"),
    ),
    (
        "sliding_window.toml",
        include_str!("../vectors/sliding_window.toml"),
    ),
    (
        "token_bucket.toml",
        include_str!("../vectors/token_bucket.toml"),
    ),
    (
        "leaky_bucket.toml",
        include_str!("../vectors/leaky_bucket.toml"),
    ),
    (
        "multi_rule.toml",
        include_str!("../vectors/multi_rule.toml"),
    ),
    ("settle.toml", include_str!("../vectors/settle.toml")),
    ("release.toml", include_str!("../vectors/release.toml")),
    (
        "concurrency.toml",
        include_str!("../vectors/concurrency.toml"),
    ),
    (
        "wall_clock.toml",
        include_str!("../vectors/wall_clock.toml"),
    ),
    (
        "clock_set_back.toml",
        include_str!("../vectors/clock_set_back.toml"),
    ),
];

/// The six algorithms' names, as written in the vectors (and in
/// configuration files).
pub const ALGORITHMS: [&str; 6] = [
    "fixed_window",
    "sliding_log",
    "sliding_window",
    "token_bucket",
    "leaky_bucket",
    "concurrency",
];

/// The key of a check that does not name one.
pub const DEFAULT_KEY: &str = "key";

/// Every case of every embedded vector file, parsed once.
///
/// # Panics
///
/// If an embedded file is malformed: a bug in this crate, which its own
/// tests catch.
///
/// ```
/// let cases = spillway_conformance::cases();
/// assert!(cases.iter().any(|c| c.file == "token_bucket.toml"));
/// ```
pub fn cases() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| {
        let mut all = Vec::new();
        for (file, text) in VECTOR_FILES {
            match parse(file, text) {
                Ok(cases) => all.extend(cases),
                Err(e) => panic!("malformed conformance vectors: {e}"),
            }
        }
        all
    })
}

/// One case: rules, and steps to run in order on a fresh store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// The file it comes from, such as `"fixed_window.toml"`.
    pub file: String,
    /// Its name, unique within the file.
    pub name: String,
    /// The rules of the store, indexed by [`StepCheck::rule`].
    pub rules: Vec<RuleSpec>,
    /// The requests and settles, in time order, with what the store must
    /// answer.
    pub steps: Vec<Step>,
}

impl Case {
    /// The rules to build the store with, in order (rule `i` is
    /// `RuleId(i)`).
    pub fn store_rules(&self) -> Vec<Rule> {
        self.rules.iter().map(RuleSpec::to_rule).collect()
    }
}

/// A rule of a case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSpec {
    /// Its name, unique within the case.
    pub name: String,
    /// The algorithm and its configuration.
    pub config: AlgorithmConfig,
    /// How long its reservations stay open unsettled before the store
    /// gives them back ([`Rule::release_unsettled_after`]), if it does.
    pub release_after: Option<Duration>,
}

impl RuleSpec {
    /// The store rule.
    pub fn to_rule(&self) -> Rule {
        let rule = Rule::new(self.name.as_str(), self.config.to_algorithm());
        match self.release_after {
            Some(within) => rule.release_unsettled_after(within),
            None => rule,
        }
    }
}

/// An algorithm with its configuration, as the vectors state it.
///
/// The quota's period is the window for the window algorithms and sets the
/// rate (`limit` per period) for the buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlgorithmConfig {
    /// `fixed_window`.
    FixedWindow {
        /// `limit` per window of `period`.
        quota: Quota,
    },
    /// `sliding_log`.
    SlidingLog {
        /// `limit` per window of `period`.
        quota: Quota,
    },
    /// `sliding_window`.
    SlidingWindow {
        /// `limit` per window of `period`.
        quota: Quota,
    },
    /// `token_bucket`.
    TokenBucket {
        /// The refill rate.
        quota: Quota,
        /// The capacity.
        burst: NonZeroU32,
    },
    /// `leaky_bucket`.
    LeakyBucket {
        /// The drain rate.
        quota: Quota,
        /// The queue's size.
        capacity: NonZeroU32,
        /// Shape (delay) or police (admit or reject at once).
        mode: LeakyMode,
        /// Units of backlog that are not delayed (nginx's `delay=`); 0 when
        /// policing.
        delay: u32,
    },
    /// `concurrency`.
    Concurrency {
        /// `limit` slots, each lease lasting `period`.
        quota: Quota,
    },
}

impl AlgorithmConfig {
    /// The algorithm's name, one of [`ALGORITHMS`].
    pub const fn name(&self) -> &'static str {
        match self {
            Self::FixedWindow { .. } => "fixed_window",
            Self::SlidingLog { .. } => "sliding_log",
            Self::SlidingWindow { .. } => "sliding_window",
            Self::TokenBucket { .. } => "token_bucket",
            Self::LeakyBucket { .. } => "leaky_bucket",
            Self::Concurrency { .. } => "concurrency",
        }
    }

    /// The most a single request may cost, which is also every decision's
    /// `limit`: the limit for the windows, the burst or capacity for the
    /// buckets.
    pub fn capacity(&self) -> u64 {
        match self {
            Self::FixedWindow { quota }
            | Self::SlidingLog { quota }
            | Self::SlidingWindow { quota }
            | Self::Concurrency { quota } => u64::from(quota.limit().get()),
            Self::TokenBucket { burst, .. } => u64::from(burst.get()),
            Self::LeakyBucket { capacity, .. } => u64::from(capacity.get()),
        }
    }

    /// The core crate's algorithm.
    pub fn to_algorithm(&self) -> AnyAlgorithm {
        match *self {
            Self::FixedWindow { quota } => FixedWindow::new(quota).into(),
            Self::SlidingLog { quota } => SlidingLog::new(quota).into(),
            Self::SlidingWindow { quota } => SlidingWindow::new(quota).into(),
            Self::TokenBucket { quota, burst } => TokenBucket::new(quota, burst).into(),
            Self::LeakyBucket {
                quota,
                capacity,
                mode,
                delay,
            } => LeakyBucket::new(quota, capacity, mode)
                .with_delay(delay)
                .into(),
            Self::Concurrency { quota } => Concurrency::new(quota).into(),
        }
    }
}

/// One step of a case, at one time: a request, the settle of an earlier
/// request's charges, or the renew of its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The line of the vector file it starts on, for messages.
    pub line: usize,
    /// When it happens, in microseconds on the store's clock.
    pub t_us: u64,
    /// What happens, and what the store must answer.
    pub action: Action,
}

impl Step {
    /// The request, unless the step is a settle.
    pub fn check(&self) -> Option<&CheckStep> {
        match &self.action {
            Action::Check(check) => Some(check),
            Action::Settle(_) | Action::Renew(_) => None,
        }
    }

    /// The settle, unless the step is a request.
    pub fn settle(&self) -> Option<&SettleStep> {
        match &self.action {
            Action::Settle(settle) => Some(settle),
            Action::Check(_) | Action::Renew(_) => None,
        }
    }
}

/// What a step does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A request: its checks, decided at once.
    Check(CheckStep),
    /// A settle of the charges an earlier request made.
    Settle(SettleStep),
    /// A renew of the lease an earlier request took.
    Renew(RenewStep),
}

/// A renew of the lease an earlier one-check request took (`renew = "r1"`),
/// and what the store must answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenewStep {
    /// The index in [`Case::steps`] of that request.
    pub charge: usize,
    /// Whether the lease was still held.
    pub was_held: bool,
    /// The lease's decision: admitted when the slots are held now.
    pub decision: ExpectedDecision,
}

/// A request, and what the store must answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckStep {
    /// The request's checks, all decided at once.
    pub checks: Vec<StepCheck>,
    /// The name later settles give the charges it made (`id = "r1"`): only
    /// on an admitted request that charged something.
    pub id: Option<String>,
    /// What the store must answer.
    pub expected: Expected,
}

/// A settle of an earlier request's charges (`settle = "r1"`), and what the
/// store must answer.
///
/// The runner settles each check of that request: its rule and key, charged
/// with [`Charged::of`](spillway::algorithm::Charged::of) its cost, the
/// verdict's `decided_at` and its decision, the store's own answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettleStep {
    /// The settle's id: the `id` of the request it settles, which is also
    /// what the store is sent, so a second settle of one request is the
    /// same settle sent again.
    pub id: String,
    /// The index in [`Case::steps`] of that request.
    pub charge: usize,
    /// What each check of that request actually cost, in order.
    pub actuals: Vec<u64>,
    /// Whether the store must apply it: `true` the first time, `false` when
    /// it is sent again.
    pub applied: bool,
    /// Each key's state after it, one per check, in order: what a cost-0
    /// check would report (allowed, never delayed, no `retry_after`).
    pub decisions: Vec<ExpectedDecision>,
}

/// One (rule, key, cost) of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepCheck {
    /// The index of the rule in [`Case::rules`].
    pub rule: usize,
    /// The key it counts by.
    pub key: String,
    /// The cost; 0 only peeks.
    pub cost: u64,
}

/// What the store must answer for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// A verdict: admitted or denied, with one decision per check.
    Verdict {
        /// Every rule admitted the request (and each was charged).
        allowed: bool,
        /// One per check, in order.
        decisions: Vec<ExpectedDecision>,
    },
    /// A check's cost exceeds its rule's capacity: the request fails with
    /// an error, and nothing is charged.
    CostTooLarge,
}

/// The expected decision of one check. Its `limit` is the rule's
/// [capacity](AlgorithmConfig::capacity).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedDecision {
    /// This rule admits the request.
    pub allowed: bool,
    /// Cost that would still be admitted, after this decision.
    pub remaining: u64,
    /// Until the key's state is back to empty (or full), in µs.
    pub reset_after_us: u64,
    /// On a denial only: until the same request would be admitted, in µs.
    pub retry_after_us: Option<u64>,
    /// How long a shaping leaky bucket holds the request, in µs.
    pub delay_us: u64,
}

/// A vector file that cannot be parsed, or that contradicts itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VectorError {
    /// The file.
    pub file: String,
    /// Where in it, as precisely as known ("case \"x\", step 3", "line 12").
    pub location: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for VectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.location.is_empty() {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}: {}: {}", self.file, self.location, self.message)
        }
    }
}

impl std::error::Error for VectorError {}

/// Parses one vector file (see the [module docs](self) for the format), and
/// checks it for consistency.
///
/// ```
/// let text = r#"
/// [[case]]
/// name = "one"
/// rule = { algorithm = "fixed_window", limit = 1, window_us = 1_000 }
/// steps = [{ t_us = 0, cost = 1, allowed = true, remaining = 0, reset_after_us = 1_000 }]
/// "#;
/// let cases = spillway_conformance::parse("mine.toml", text).unwrap();
/// assert_eq!(cases[0].steps.len(), 1);
///
/// // A denial must say when to come back.
/// let bad = text.replace("allowed = true", "allowed = false");
/// assert!(spillway_conformance::parse("mine.toml", &bad).is_err());
/// ```
pub fn parse(file: &str, text: &str) -> Result<Vec<Case>, VectorError> {
    let err = |location: String, message: String| VectorError {
        file: file.to_owned(),
        location,
        message,
    };
    let raw: RawFile = toml::from_str(text).map_err(|e| err(String::new(), e.to_string()))?;
    let mut names = HashSet::new();
    let mut cases = Vec::with_capacity(raw.cases.len());
    for (i, raw_case) in raw.cases.into_iter().enumerate() {
        let location = format!("case {} ({:?})", i + 1, raw_case.name);
        if !names.insert(raw_case.name.clone()) {
            return Err(err(location, "a case of that name comes earlier".into()));
        }
        let case = raw_case
            .convert(file, text)
            .map_err(|(where_, message)| err(format!("{location}{where_}"), message))?;
        cases.push(case);
    }
    Ok(cases)
}

// The file as written; converted once into the types above.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(rename = "case", default)]
    cases: Vec<RawCase>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCase {
    name: String,
    rule: Option<RawRule>,
    rules: Option<Vec<RawRule>>,
    #[serde(default)]
    steps: Vec<toml::Spanned<RawStep>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Option<String>,
    algorithm: String,
    limit: u32,
    window_us: Option<u64>,
    period_us: Option<u64>,
    burst: Option<u32>,
    capacity: Option<u32>,
    mode: Option<String>,
    delay: Option<u32>,
    lease_us: Option<u64>,
    release_after_us: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStep {
    t_us: u64,
    id: Option<String>,
    settle: Option<String>,
    renew: Option<String>,
    was_held: Option<bool>,
    actual: Option<u64>,
    actuals: Option<Vec<u64>>,
    applied: Option<bool>,
    rule: Option<String>,
    key: Option<String>,
    cost: Option<u64>,
    checks: Option<Vec<RawCheck>>,
    error: Option<String>,
    allowed: Option<bool>,
    remaining: Option<u64>,
    reset_after_us: Option<u64>,
    retry_after_us: Option<u64>,
    delay_us: Option<u64>,
    decisions: Option<Vec<RawDecision>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheck {
    rule: Option<String>,
    key: Option<String>,
    cost: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDecision {
    // Required of a request's decisions; a settle's are always allowed.
    allowed: Option<bool>,
    remaining: u64,
    reset_after_us: u64,
    retry_after_us: Option<u64>,
    delay_us: Option<u64>,
}

/// Where in a case (appended to the case's location), and what is wrong.
type FileError = (String, String);

fn problem(where_: impl Into<String>, message: impl Into<String>) -> FileError {
    (where_.into(), message.into())
}

impl RawCase {
    fn convert(self, file: &str, text: &str) -> Result<Case, FileError> {
        let raw_rules = match (self.rule, self.rules) {
            (Some(rule), None) => vec![rule],
            (None, Some(rules)) if !rules.is_empty() => rules,
            (None, Some(_)) => return Err(problem("", "`rules` is empty")),
            (None, None) => return Err(problem("", "needs `rule` or `rules`")),
            (Some(_), Some(_)) => return Err(problem("", "has both `rule` and `rules`")),
        };
        let mut rules = Vec::with_capacity(raw_rules.len());
        for (i, raw) in raw_rules.into_iter().enumerate() {
            let rule = raw
                .convert()
                .map_err(|m| problem(format!(", rule {}", i + 1), m))?;
            if rules.iter().any(|r: &RuleSpec| r.name == rule.name) {
                return Err(problem(
                    format!(", rule {}", i + 1),
                    format!("another rule is named {:?}", rule.name),
                ));
            }
            rules.push(rule);
        }
        if self.steps.is_empty() {
            return Err(problem("", "has no steps"));
        }
        let mut steps = Vec::with_capacity(self.steps.len());
        let mut named = Named::default();
        for (i, spanned) in self.steps.into_iter().enumerate() {
            let line = line_of(text, spanned.span().start);
            let step = spanned
                .into_inner()
                .convert(&rules, line, &steps, &mut named)
                .map_err(|m| problem(format!(", step {} ({file}:{line})", i + 1), m))?;
            steps.push(step);
        }
        Ok(Case {
            file: file.to_owned(),
            name: self.name,
            rules,
            steps,
        })
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(0, |before| before.matches('\n').count())
        + 1
}

impl RawRule {
    fn convert(self) -> Result<RuleSpec, String> {
        let limit =
            NonZeroU32::new(self.limit).ok_or_else(|| "`limit` must be at least 1".to_owned())?;
        let given = [
            ("window_us", self.window_us.is_some()),
            ("period_us", self.period_us.is_some()),
            ("burst", self.burst.is_some()),
            ("capacity", self.capacity.is_some()),
            ("mode", self.mode.is_some()),
            ("delay", self.delay.is_some()),
            ("lease_us", self.lease_us.is_some()),
        ];
        let (allowed_fields, period_field): (&[&str], _) = match self.algorithm.as_str() {
            "fixed_window" | "sliding_log" | "sliding_window" => (&["window_us"], "window_us"),
            "token_bucket" => (&["period_us", "burst"], "period_us"),
            "leaky_bucket" => (&["period_us", "capacity", "mode", "delay"], "period_us"),
            "concurrency" => (&["lease_us"], "lease_us"),
            other => {
                return Err(format!(
                    "unknown `algorithm` {other:?}; expected one of {ALGORITHMS:?}"
                ));
            }
        };
        if let Some((field, _)) = given
            .iter()
            .find(|(field, set)| *set && !allowed_fields.contains(field))
        {
            return Err(format!("`{field}` does not apply to {}", self.algorithm));
        }
        let period = self
            .window_us
            .or(self.period_us)
            .or(self.lease_us)
            .ok_or_else(|| format!("`{period_field}` is missing"))?;
        let quota = Quota::new(limit, Duration::from_micros(period))
            .map_err(|e| format!("`{period_field}`: {}", e.message()))?;
        let nonzero = |value: Option<u32>, field: &str| {
            let value = value.ok_or_else(|| format!("`{field}` is missing"))?;
            NonZeroU32::new(value).ok_or_else(|| format!("`{field}` must be at least 1"))
        };
        let config = match self.algorithm.as_str() {
            "fixed_window" => AlgorithmConfig::FixedWindow { quota },
            "sliding_log" => AlgorithmConfig::SlidingLog { quota },
            "sliding_window" => AlgorithmConfig::SlidingWindow { quota },
            "concurrency" => AlgorithmConfig::Concurrency { quota },
            "token_bucket" => AlgorithmConfig::TokenBucket {
                quota,
                burst: nonzero(self.burst, "burst")?,
            },
            _ => {
                let mode = match self.mode.as_deref() {
                    None | Some("shape") => LeakyMode::Shape,
                    Some("police") => LeakyMode::Police,
                    Some(other) => {
                        return Err(format!(
                            "unknown `mode` {other:?}; expected \"shape\" or \"police\""
                        ));
                    }
                };
                if mode == LeakyMode::Police && self.delay.is_some() {
                    return Err("`delay` applies to mode \"shape\" only".into());
                }
                AlgorithmConfig::LeakyBucket {
                    quota,
                    capacity: nonzero(self.capacity, "capacity")?,
                    mode,
                    delay: self.delay.unwrap_or(0),
                }
            }
        };
        let release_after = match self.release_after_us {
            Some(_) if self.algorithm == "concurrency" => {
                return Err(
                    "`release_after_us`: a concurrency rule's leases end by themselves".into(),
                );
            }
            Some(0) => return Err("`release_after_us` must be at least 1".into()),
            other => other.map(Duration::from_micros),
        };
        let name = self.name.unwrap_or_else(|| config.name().to_owned());
        Ok(RuleSpec {
            name,
            config,
            release_after,
        })
    }
}

/// What the steps converted so far have named: the step of each charge's
/// `id`, and when each was first settled.
#[derive(Default)]
struct Named {
    charges: HashMap<String, usize>,
    first_settled: HashMap<String, u64>,
}

impl RawStep {
    /// `earlier` are the case's steps before this one.
    fn convert(
        self,
        rules: &[RuleSpec],
        line: usize,
        earlier: &[Step],
        named: &mut Named,
    ) -> Result<Step, String> {
        let action = match (&self.settle, &self.renew) {
            (Some(_), Some(_)) => return Err("has both `settle` and `renew`".into()),
            (Some(id), None) => Action::Settle(self.convert_settle(id, earlier, named)?),
            (None, Some(id)) => Action::Renew(self.convert_renew(rules, id, earlier, named)?),
            (None, None) => Action::Check(self.convert_check(rules, earlier.len(), named)?),
        };
        Ok(Step {
            line,
            t_us: self.t_us,
            action,
        })
    }

    /// The first of `fields` the step has (by their names in a file).
    fn first_set(&self, fields: &[&'static str]) -> Option<&'static str> {
        fields.iter().copied().find(|&field| match field {
            "id" => self.id.is_some(),
            "was_held" => self.was_held.is_some(),
            "actual" => self.actual.is_some(),
            "actuals" => self.actuals.is_some(),
            "applied" => self.applied.is_some(),
            "rule" => self.rule.is_some(),
            "key" => self.key.is_some(),
            "cost" => self.cost.is_some(),
            "checks" => self.checks.is_some(),
            "error" => self.error.is_some(),
            "allowed" => self.allowed.is_some(),
            "remaining" => self.remaining.is_some(),
            "reset_after_us" => self.reset_after_us.is_some(),
            "retry_after_us" => self.retry_after_us.is_some(),
            "delay_us" => self.delay_us.is_some(),
            "decisions" => self.decisions.is_some(),
            other => unreachable!("`{other}` is not a step's field"),
        })
    }

    /// A request, the step at `index`.
    fn convert_check(
        &self,
        rules: &[RuleSpec],
        index: usize,
        named: &mut Named,
    ) -> Result<CheckStep, String> {
        let settle_fields = ["actual", "actuals", "applied"];
        if let Some(field) = self.first_set(&settle_fields) {
            return Err(format!("`{field}` goes with `settle`"));
        }
        if self.was_held.is_some() {
            return Err("`was_held` goes with `renew`".into());
        }
        let checks = self.convert_checks(rules)?;
        let expected = self.convert_expected(checks.len())?;
        check_definitions(rules, &checks, &expected)?;
        if let Some(id) = &self.id {
            check_charge(id, &checks, &expected)?;
            if named.charges.insert(id.clone(), index).is_some() {
                return Err(format!("an earlier step has `id = {id:?}`"));
            }
        }
        Ok(CheckStep {
            checks,
            id: self.id.clone(),
            expected,
        })
    }

    /// A settle of the charges of the earlier step named `id`.
    fn convert_settle(
        &self,
        id: &str,
        earlier: &[Step],
        named: &mut Named,
    ) -> Result<SettleStep, String> {
        let request_fields = ["cost", "checks", "rule", "key", "id", "error", "was_held"];
        if let Some(field) = self.first_set(&request_fields) {
            return Err(format!(
                "`{field}` on a settle: it settles the checks of the request it names"
            ));
        }
        let peek_fields = ["allowed", "retry_after_us", "delay_us"];
        if let Some(field) = self.first_set(&peek_fields) {
            return Err(format!("`{field}` on a settle: {PEEK}"));
        }
        let &charge = named
            .charges
            .get(id)
            .ok_or_else(|| format!("`settle = {id:?}`: no earlier request has `id = {id:?}`"))?;
        let checks = earlier[charge]
            .check()
            .map_or(0, |request| request.checks.len());
        let actuals = match (self.actual, &self.actuals) {
            (Some(_), Some(_)) => return Err("has both `actual` and `actuals`".into()),
            (None, None) => {
                return Err("needs `actual` (one check) or `actuals` (one per check)".into());
            }
            (Some(actual), None) if checks == 1 => vec![actual],
            (Some(_), None) => {
                return Err(format!(
                    "{id:?} has {checks} checks: write `actuals`, one per check"
                ));
            }
            (None, Some(_)) if checks == 1 => {
                return Err(format!("{id:?} has one check: write `actual`"));
            }
            (None, Some(actuals)) if actuals.len() == checks => actuals.clone(),
            (None, Some(actuals)) => {
                return Err(format!(
                    "{} `actuals` for the {checks} checks of {id:?}",
                    actuals.len()
                ));
            }
        };
        let applied = self.applied.ok_or("`applied` is missing")?;
        match named.first_settled.get(id) {
            None if !applied => {
                return Err(format!(
                    "the first settle of {id:?} is `applied = true`: the store has not seen the id"
                ));
            }
            None => {
                named.first_settled.insert(id.to_owned(), self.t_us);
            }
            Some(first) if applied => {
                return Err(format!(
                    "{id:?} was settled at t_us = {first}: sent again, it is `applied = false`"
                ));
            }
            Some(&first) => {
                let ttl = u64::try_from(SETTLE_RECEIPT_TTL.as_micros()).unwrap_or(u64::MAX);
                if self.t_us < first || self.t_us - first >= ttl {
                    return Err(format!(
                        "{id:?} was settled at t_us = {first}: a settle sent again is only \
                         pinned down within SETTLE_RECEIPT_TTL after the first, on a clock \
                         that has not gone back"
                    ));
                }
            }
        }
        let decisions = self.settled_decisions(checks)?;
        Ok(SettleStep {
            id: id.to_owned(),
            charge,
            actuals,
            applied,
            decisions,
        })
    }

    /// A renew of the lease of the earlier step named `id`.
    fn convert_renew(
        &self,
        rules: &[RuleSpec],
        id: &str,
        earlier: &[Step],
        named: &Named,
    ) -> Result<RenewStep, String> {
        let other_fields = [
            "cost",
            "checks",
            "rule",
            "key",
            "id",
            "error",
            "actual",
            "actuals",
            "applied",
            "decisions",
            "delay_us",
        ];
        if let Some(field) = self.first_set(&other_fields) {
            return Err(format!(
                "`{field}` on a renew: it renews the lease of the request it names"
            ));
        }
        let &charge = named
            .charges
            .get(id)
            .ok_or_else(|| format!("`renew = {id:?}`: no earlier request has `id = {id:?}`"))?;
        let checks = earlier[charge].check().map_or(&[][..], |r| &r.checks[..]);
        match checks {
            [check]
                if matches!(
                    rules[check.rule].config,
                    AlgorithmConfig::Concurrency { .. }
                ) => {}
            _ => {
                return Err(format!(
                    "`renew = {id:?}`: only a one-check request of a concurrency rule has a lease"
                ));
            }
        }
        let decision = RawDecision {
            allowed: Some(self.allowed.ok_or("`allowed` is missing")?),
            remaining: self.remaining.ok_or("`remaining` is missing")?,
            reset_after_us: self.reset_after_us.ok_or("`reset_after_us` is missing")?,
            retry_after_us: self.retry_after_us,
            delay_us: None,
        };
        Ok(RenewStep {
            charge,
            was_held: self.was_held.ok_or("`was_held` is missing")?,
            decision: decision.convert()?,
        })
    }

    /// A settle's decisions: inline for a one-check charge, else one of
    /// `decisions` per check.
    fn settled_decisions(&self, checks: usize) -> Result<Vec<ExpectedDecision>, String> {
        if checks == 1 {
            if self.decisions.is_some() {
                return Err("`decisions` goes with `actuals`; write the decision inline".into());
            }
            let decision = RawDecision {
                allowed: None,
                remaining: self.remaining.ok_or("`remaining` is missing")?,
                reset_after_us: self.reset_after_us.ok_or("`reset_after_us` is missing")?,
                retry_after_us: None,
                delay_us: None,
            };
            return Ok(vec![decision.convert_settled()?]);
        }
        if self.remaining.is_some() || self.reset_after_us.is_some() {
            return Err("with `actuals`, the decisions go inside `decisions`".into());
        }
        let raw = self.decisions.as_ref().ok_or("`decisions` is missing")?;
        if raw.len() != checks {
            return Err(format!("{} `decisions` for {checks} `actuals`", raw.len()));
        }
        raw.iter()
            .enumerate()
            .map(|(i, d)| {
                d.convert_settled()
                    .map_err(|m| format!("decision {}: {m}", i + 1))
            })
            .collect()
    }

    /// The step's checks: its `checks`, or the one check written inline
    /// with `cost` (and `rule` and `key`).
    fn convert_checks(&self, rules: &[RuleSpec]) -> Result<Vec<StepCheck>, String> {
        let key = |key: Option<&str>| key.unwrap_or(DEFAULT_KEY).to_owned();
        match (&self.checks, self.cost) {
            (Some(_), Some(_)) => Err("has both `checks` and `cost`".into()),
            (None, None) => Err("needs `cost` (one check) or `checks`".into()),
            (None, Some(cost)) => Ok(vec![StepCheck {
                rule: rule_index(rules, self.rule.as_deref())?,
                key: key(self.key.as_deref()),
                cost,
            }]),
            (Some(checks), None) => {
                if self.rule.is_some() || self.key.is_some() {
                    return Err("`rule` and `key` go inside `checks`".into());
                }
                if checks.is_empty() {
                    return Err("`checks` is empty".into());
                }
                checks
                    .iter()
                    .map(|c| {
                        Ok(StepCheck {
                            rule: rule_index(rules, c.rule.as_deref())?,
                            key: key(c.key.as_deref()),
                            cost: c.cost,
                        })
                    })
                    .collect()
            }
        }
    }

    /// What the step expects of its `checks` checks: the error, or a
    /// verdict with its decisions (one inline, or one per check).
    fn convert_expected(&self, checks: usize) -> Result<Expected, String> {
        let inline_fields = ["remaining", "reset_after_us", "retry_after_us", "delay_us"];
        match (self.error.as_deref(), self.allowed) {
            (Some(_), Some(_)) => Err("has both `error` and `allowed`".into()),
            (None, None) => Err("needs `allowed` or `error`".into()),
            (Some(error), None) => {
                if error != "cost_too_large" {
                    return Err(format!(
                        "unknown `error` {error:?}; the only one is \"cost_too_large\""
                    ));
                }
                if let Some(field) = self.first_set(&inline_fields) {
                    return Err(format!("`{field}` with an `error`"));
                }
                if self.decisions.is_some() {
                    return Err("`decisions` with an `error`".into());
                }
                Ok(Expected::CostTooLarge)
            }
            (None, Some(allowed)) if self.checks.is_none() => self.inline_verdict(allowed),
            (None, Some(allowed)) => {
                if let Some(field) = self.first_set(&inline_fields) {
                    return Err(format!("`{field}` goes inside `decisions` with `checks`"));
                }
                self.verdict_per_check(allowed, checks)
            }
        }
    }

    /// The verdict of a step with one inline check: its decision is written
    /// in the step itself.
    fn inline_verdict(&self, allowed: bool) -> Result<Expected, String> {
        if self.decisions.is_some() {
            return Err("`decisions` goes with `checks`; write the decision inline".into());
        }
        let decision = RawDecision {
            allowed: Some(allowed),
            remaining: self.remaining.ok_or("`remaining` is missing")?,
            reset_after_us: self.reset_after_us.ok_or("`reset_after_us` is missing")?,
            retry_after_us: self.retry_after_us,
            delay_us: self.delay_us,
        };
        Ok(Expected::Verdict {
            allowed,
            decisions: vec![decision.convert()?],
        })
    }

    /// The verdict of a step with `checks`: one of its `decisions` per
    /// check, which must agree with `allowed`.
    fn verdict_per_check(&self, allowed: bool, checks: usize) -> Result<Expected, String> {
        let raw = self.decisions.as_ref().ok_or("`decisions` is missing")?;
        if raw.len() != checks {
            return Err(format!("{} `decisions` for {} `checks`", raw.len(), checks));
        }
        let decisions = raw
            .iter()
            .enumerate()
            .map(|(i, d)| d.convert().map_err(|m| format!("decision {}: {m}", i + 1)))
            .collect::<Result<Vec<_>, _>>()?;
        if allowed != decisions.iter().all(|d| d.allowed) {
            return Err(format!(
                "`allowed = {allowed}` contradicts the decisions: a request is admitted \
                 exactly when every rule admits it"
            ));
        }
        Ok(Expected::Verdict { allowed, decisions })
    }
}

/// The index in `rules` of the rule a check names, or of the only rule.
fn rule_index(rules: &[RuleSpec], name: Option<&str>) -> Result<usize, String> {
    match name {
        Some(name) => rules
            .iter()
            .position(|r| r.name == name)
            .ok_or_else(|| format!("no rule is named {name:?}")),
        None if rules.len() == 1 => Ok(0),
        None => Err("the case has several rules: name one with `rule`".into()),
    }
}

/// Refuses a step whose expectation the definitions rule out without any
/// arithmetic: `cost_too_large` exactly when a cost exceeds its rule's
/// capacity, and a delay only from a shaping leaky bucket, never on a peek.
fn check_definitions(
    rules: &[RuleSpec],
    checks: &[StepCheck],
    expected: &Expected,
) -> Result<(), String> {
    let too_large = checks
        .iter()
        .position(|c| c.cost > rules[c.rule].config.capacity());
    match (expected, too_large) {
        (Expected::CostTooLarge, None) => {
            return Err("expects `cost_too_large`, but every cost fits its rule".into());
        }
        (Expected::Verdict { .. }, Some(i)) => {
            return Err(format!(
                "check {}'s cost exceeds its rule's capacity: expect `error = \"cost_too_large\"`",
                i + 1
            ));
        }
        (Expected::Verdict { decisions, .. }, None) => {
            for (i, (check, d)) in checks.iter().zip(decisions).enumerate() {
                let shaping = matches!(
                    rules[check.rule].config,
                    AlgorithmConfig::LeakyBucket {
                        mode: LeakyMode::Shape,
                        ..
                    }
                );
                if d.delay_us > 0 && !shaping {
                    return Err(format!(
                        "check {}: a `delay_us` only comes from a shaping leaky bucket",
                        i + 1
                    ));
                }
                if d.delay_us > 0 && check.cost == 0 {
                    return Err(format!("check {}: a peek is never delayed", i + 1));
                }
            }
        }
        (Expected::CostTooLarge, Some(_)) => {}
    }
    Ok(())
}

/// Why a settle's decisions are written without `allowed`,
/// `retry_after_us` and `delay_us`.
const PEEK: &str = "its decisions are what a cost-0 check reports: allowed, never delayed, \
                    with no retry_after";

/// Refuses an `id` on a request that charged nothing to settle, or that the
/// store would refuse as a settle id.
fn check_charge(id: &str, checks: &[StepCheck], expected: &Expected) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_SETTLE_ID {
        return Err(format!(
            "`id` must be 1 to {MAX_SETTLE_ID} bytes, as a settle id"
        ));
    }
    if !matches!(expected, Expected::Verdict { allowed: true, .. }) {
        return Err("`id` on a request that is not admitted: it charges nothing to settle".into());
    }
    if checks.iter().all(|c| c.cost == 0) {
        return Err("`id` on a request of cost 0: it charges nothing to settle".into());
    }
    Ok(())
}

impl RawDecision {
    fn convert(&self) -> Result<ExpectedDecision, String> {
        let allowed = self.allowed.ok_or("`allowed` is missing")?;
        match (allowed, self.retry_after_us) {
            (true, Some(_)) => return Err("`retry_after_us` on an admission".into()),
            (false, None) => return Err("a denial needs `retry_after_us`".into()),
            _ => {}
        }
        if !allowed && self.delay_us.is_some() {
            return Err("`delay_us` on a denial".into());
        }
        Ok(ExpectedDecision {
            allowed,
            remaining: self.remaining,
            reset_after_us: self.reset_after_us,
            retry_after_us: self.retry_after_us,
            delay_us: self.delay_us.unwrap_or(0),
        })
    }

    /// A settle's decision: a cost-0 check's.
    fn convert_settled(&self) -> Result<ExpectedDecision, String> {
        let peek_fields = [
            ("allowed", self.allowed.is_some()),
            ("retry_after_us", self.retry_after_us.is_some()),
            ("delay_us", self.delay_us.is_some()),
        ];
        if let Some((field, _)) = peek_fields.iter().find(|(_, set)| *set) {
            return Err(format!("`{field}` on a settle: {PEEK}"));
        }
        Ok(ExpectedDecision {
            allowed: true,
            remaining: self.remaining,
            reset_after_us: self.reset_after_us,
            retry_after_us: None,
            delay_us: 0,
        })
    }
}

//! The decision engine: the one place where a request's charges become an
//! [`Outcome`].
//!
//! Every front end is an adapter around it. The middleware (and so `spillway
//! proxy`) [plans](Engine::plan) a request's parts into [`Charge`]s; `POST
//! /v1/check` plans parts or names a rule ([`Engine::charge_named`]); the
//! Envoy service maps descriptors onto rules ([`Engine::charge`],
//! [`Engine::charge_own`]). All of them call [`Engine::decide`] (or
//! [`Engine::decide_now`]) and render the [`Ruling`] it returns: the
//! outcome, each rule's decision, which rule the headers report, and the
//! header fields as data ([`Engine::fields`]).
//!
//! What exists here once, for every front end:
//! - the actions: a denial by a `reject` rule refuses the request and
//!   charges nothing; a denial only by `shadow` or `degrade` rules lets it
//!   through, and the rules that admitted it are charged by a second store
//!   call without the denying ones;
//! - the most restrictive rule (the one the headers report): the rejecting
//!   rule, else the least remaining, then the smallest limit;
//! - a rule's announced window and `Retry-After`, in whole seconds rounded
//!   up, in integers;
//! - what a store failure means (a request that can never be decided is a
//!   bad request; anything else is the store's failure, after its own
//!   failure policy);
//! - the observer's report of every rule of every decided request.
//!
//! A ruling whose charges must outlive the decision (a shaped request that
//! waits, later a cost settled when the response ends) gives them up as a
//! [`Held`] charge, which is given back or kept.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use http::request::Parts;
use smallvec::SmallVec;
use spillway::algorithm::Charged;
use spillway::store::{Check, Listing, RuleId, Settle, Store, StoreError, Verdict};
use spillway::{Algorithm as _, AnyAlgorithm, Decision};

use crate::budget::ResponseCost;
use crate::error::RuleMismatch;
use crate::headers::{self, Applied, RateLimitFields};
use crate::key::{Identity, KeyPart, KeyText};
use crate::rules::{Action, Cost, MissingClientAddr, Policy};

/// A few of something: requests rarely match more than two rules, and
/// these live for one request, so they stay off the heap.
pub(crate) type Small<T> = SmallVec<[T; 2]>;

/// What one rule did with one request, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleOutcome {
    /// The rule admitted the request.
    Allowed,
    /// The rule denied the request and it was refused.
    Rejected,
    /// The rule denied the request, which went through anyway (shadow mode).
    Shadowed,
    /// The rule denied the request, which went through marked as limited.
    Degraded,
    /// The store could not decide; the request got its failure answer.
    Error,
    /// The store could not decide this rule, whose failure policy
    /// admitted the request (`fail_open`): the request went on uncounted
    /// by it, and its headers report no quota for it.
    Undecided,
}

impl RuleOutcome {
    /// What a denial by a rule with `action` comes to.
    pub const fn of_denial(action: Action) -> Self {
        match action {
            Action::Reject => Self::Rejected,
            Action::Shadow => Self::Shadowed,
            Action::Degrade => Self::Degraded,
        }
    }
}

/// Called once per rule of every decided request, by the engine: whichever
/// front end asked.
pub trait Observer: Send + Sync + 'static {
    /// `rule` decided `outcome`; `decision` is the store's answer, when
    /// there was one.
    fn observe(&self, rule: &str, outcome: RuleOutcome, decision: Option<&Decision>);

    /// A budget rule's reservation opened (its response began) or closed
    /// (see [`BudgetEvent`]). Nothing by default.
    fn budget(&self, rule: &str, event: BudgetEvent) {
        let _ = (rule, event);
    }

    /// A request was refused by a block list entry with `status` (no rule
    /// counted it). Nothing by default.
    fn blocked(&self, status: http::StatusCode) {
        let _ = status;
    }

    /// A concurrency rule's lease was renewed, lost, released, or could
    /// not be released (see [`LeaseEvent`]). Nothing by default.
    fn lease(&self, rule: &str, event: LeaseEvent) {
        let _ = (rule, event);
    }
}

/// What became of a concurrency rule's lease while its request ran, for
/// metrics. (Its acquisition is the rule's decision,
/// [`Observer::observe`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEvent {
    /// Still held, it runs again from now.
    Renewed,
    /// It had ended (the store could not be reached for longer than the
    /// lease) and its slot had been taken: the request runs on without
    /// one. Renewing goes on, and takes a slot again once one is free.
    Lost,
    /// It had ended, and a free slot was taken afresh.
    Retaken,
    /// The response ended (or the client left): the slot was given back.
    Released,
    /// The slot could not be given back before the lease ended (the store
    /// could not be reached): it came back when the lease ended.
    Expired,
}

/// What became of a budget rule's reservation, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetEvent {
    /// A response under the rule began: its reservation is open.
    Opened,
    /// Its response ended, and the reservation was settled (or kept).
    Closed {
        /// How it was settled.
        how: Settled,
        /// What the request's charges came to before the settle (the
        /// reservation, and what a cut stream charged as it went).
        charged: u64,
        /// What it was settled at (`charged` when the reservation was
        /// kept).
        actual: u64,
    },
    /// A settle charged more than the reservation and left the key with
    /// nothing: at its limit, or past it in debt, which later requests
    /// wait out. (A peek's `remaining` is 0 in both cases: they are not
    /// told apart.)
    Exhausted,
}

/// How a budget reservation was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// At what its response was measured to cost.
    Measured,
    /// At what was counted when the client left mid-response.
    Left,
    /// At what the client was sent before the stream was cut at the budget.
    Cut,
    /// At nothing: a 4xx that measured nothing, or a 5xx its rule gives
    /// back.
    Released,
    /// Not: nothing could be measured, and the reservation stands.
    Kept,
    /// Not: its settle token was sent after it expired (`POST /v1/settle`
    /// of `spillway serve`), and the reservation stands.
    Expired,
}

impl Settled {
    /// The name metrics give it.
    pub const fn name(&self) -> &'static str {
        match self {
            Self::Measured => "measured",
            Self::Left => "left",
            Self::Cut => "cut",
            Self::Released => "released",
            Self::Kept => "kept",
            Self::Expired => "expired",
        }
    }
}

/// What became of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// No rule applies to the request.
    Unlimited,
    /// Admitted, after `delay` (shaping). `limited` names the `degrade`
    /// rules that denied it, `shadowed` the `shadow` rules that did.
    Admitted {
        /// How long to hold the request before serving it.
        delay: Duration,
        /// The degrade rules that denied it.
        limited: Vec<String>,
        /// The shadow rules that denied it.
        shadowed: Vec<String>,
    },
    /// Denied by a `reject` rule (or by a cost above a rule's capacity,
    /// under [`OverCapacity::Deny`]): refuse it.
    Rejected {
        /// The rule.
        rule: String,
        /// The exact time until the same request would be admitted (or
        /// the rule's [`retry_after_hint`](crate::HttpRule::retry_after_hint),
        /// if shorter).
        retry_after: Duration,
        /// The status to answer with: 429, or the rule's
        /// [`deny_status`](crate::HttpRule::deny_status).
        status: http::StatusCode,
    },
    /// The request can never be decided (a bad cost header, a cost above a
    /// capacity under [`OverCapacity::Refuse`]): a client error, with this
    /// message.
    BadRequest(String),
    /// The store could not decide, and its failure policy is to refuse:
    /// the store's error.
    Unavailable(String),
    /// Refused by a block list entry ([`ListBook`](spillway::store::ListBook)):
    /// at once, counting nothing.
    Blocked {
        /// The entry's status: 403 or 429.
        status: http::StatusCode,
        /// Until the block ends, if it does.
        retry_after: Option<Duration>,
    },
}

// Defined with the header fields, whose `RateLimit` uses it too.
pub use crate::headers::retry_after_secs;

impl Outcome {
    /// The `Retry-After` of a rejection, in seconds ([`retry_after_secs`]).
    pub fn retry_after_secs(&self) -> Option<u64> {
        match self {
            Self::Rejected { retry_after, .. } => Some(retry_after_secs(*retry_after)),
            Self::Blocked { retry_after, .. } => retry_after.map(retry_after_secs),
            _ => None,
        }
    }
}

/// One rule's charge of one request: the store rule, the key, the cost. It
/// is charged only if the request is admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    id: RuleId,
    // The policy's rule and which of its quotas (0: the default, i + 1:
    // tier i); none for a store rule of the caller's own. Two u32s, not
    // two usizes: a request's charges then fit in 128 bytes, which a move
    // copies in registers rather than by a call to memcpy (no policy has
    // four billion rules: each takes hundreds of bytes).
    of: Option<(u32, u32)>,
    key: KeyText,
    cost: u64,
}

impl Charge {
    /// The store rule charged.
    pub fn rule_id(&self) -> RuleId {
        self.id
    }

    /// The policy rule charged (its index in [`Policy::rules`]), if it is
    /// one.
    pub fn policy_rule(&self) -> Option<usize> {
        self.of().map(|(index, _)| index)
    }

    /// The policy rule charged and which of its quotas.
    #[inline]
    fn of(&self) -> Option<(usize, usize)> {
        self.of
            .map(|(index, quota)| (index as usize, quota as usize))
    }

    /// The key counted.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The cost.
    pub fn cost(&self) -> u64 {
        self.cost
    }
}

/// A request's charges, in the order they were planned.
pub type Charges = SmallVec<[Charge; 2]>;

/// Why a request's parts could not be planned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unplanned {
    /// The request is malformed: a 400's message.
    BadRequest(String),
    /// Rule `index` counts by the client's address, which the request does
    /// not carry, and the policy says this is an error
    /// ([`MissingClientAddr::Error`]).
    NoClientAddr(usize),
    /// A block list entry refuses the request: [`Outcome::Blocked`].
    Blocked {
        /// The entry's status: 403 or 429.
        status: http::StatusCode,
        /// Until the block ends, if it does.
        retry_after: Option<Duration>,
    },
}

impl Unplanned {
    /// The outcome of a request refused before any rule counted it, if
    /// this is one: a bad request, or a block.
    pub fn outcome(&self) -> Option<Outcome> {
        match self {
            Self::BadRequest(message) => Some(Outcome::BadRequest(message.clone())),
            Self::Blocked {
                status,
                retry_after,
            } => Some(Outcome::Blocked {
                status: *status,
                retry_after: *retry_after,
            }),
            Self::NoClientAddr(_) => None,
        }
    }
}

/// What a charge above its rule's capacity (one that can never be
/// admitted) comes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OverCapacity {
    /// The request is the client's error: [`Outcome::BadRequest`].
    #[default]
    Refuse,
    /// The request is denied by that rule, whatever its action, and
    /// nothing is charged: the other rules are only looked at (cost 0).
    /// What Envoy's rate limit services answer (`OVER_LIMIT`).
    Deny,
}

/// How [`Engine::decide`] treats what it is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Asking {
    /// What a charge above its rule's capacity comes to.
    pub over_capacity: OverCapacity,
    /// The request is denied by the caller already: nothing is charged,
    /// every rule is only looked at (cost 0).
    pub look_only: bool,
    /// A reservation its caller settles itself (Kuadrant's `Reserve`):
    /// the charges of every store rule that gives back what is not settled
    /// in time ([`Rule::release_unsettled_after`](spillway::store::Rule::release_unsettled_after))
    /// are held open ([`Store::reserve_held`]). `false`: only the charges
    /// of budgets that release are.
    pub hold_every: bool,
    /// The longest a held charge stays open: the shorter of this and its
    /// rule's time. For a caller whose settle token lives no longer, so
    /// that a settle it can still send is never met by a reservation given
    /// back. `None`: its rule's time.
    pub hold_at_most: Option<Duration>,
}

/// The engine's answer on one request: the outcome, each charge's
/// decision, the rule the headers report, and what stays held.
#[derive(Debug, Clone)]
pub struct Ruling {
    outcome: Outcome,
    charges: Charges,
    // Per charge: what the store answered, and whether it denies.
    answered: Small<Answered>,
    // The charge that refused the request, if one did.
    rejected_by: Option<usize>,
    // The charges that were charged, and the store's time of the charge.
    charged: Option<(Small<usize>, u64)>,
    reported: Option<usize>,
    // The reservations the store holds open, if the request made any.
    hold: Option<Box<Hold>>,
}

/// What [`Engine::admit_now`] made of a request: admitted at once, with
/// the header fields its response carries, or ruled in full.
// Not boxed: a box would cost every ruled request (every denial) an
// allocation; the value is made where it is matched, in the same call.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Admission {
    /// Admitted with no delay, nothing held, marked or to settle.
    Admitted(RateLimitFields),
    /// Anything else.
    Ruled(Ruling),
}

/// What became of one charge of a ruling. One value per charge, not one
/// list per field: a ruling is made (and moved) on every request.
#[derive(Debug, Clone, Copy, Default)]
struct Answered {
    // The store's last decision on it, if it was asked and decided (not
    // admitted by a failure policy).
    decision: Option<Decision>,
    // Denied whatever the store said (above its capacity).
    over_capacity: bool,
    // Denied by its `reject` rule.
    rejecting: bool,
    // The store could not decide it, and admitted it by its failure
    // policy.
    undecided: bool,
}

impl Answered {
    /// Denies the request outright.
    fn denies(&self) -> bool {
        self.over_capacity || self.rejecting
    }
}

/// The reservations a request's charges hold open in the store: the id
/// they are held under, and which charges are held (those of budget rules
/// that give back what is not settled in time).
#[derive(Debug, Clone)]
struct Hold {
    id: Arc<str>,
    held: Small<bool>,
}

impl Ruling {
    /// A ruling that asked no store.
    fn without_store(outcome: Outcome, charges: Charges) -> Self {
        Self {
            outcome,
            charges,
            answered: SmallVec::new(),
            rejected_by: None,
            charged: None,
            reported: None,
            hold: None,
        }
    }

    /// What became of the request.
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// The charges, as planned.
    pub fn charges(&self) -> &[Charge] {
        &self.charges
    }

    /// Charge `i`'s decision: the last the store gave for it, if it was
    /// asked and decided it (see [`is_undecided`](Self::is_undecided)).
    pub fn decision(&self, i: usize) -> Option<&Decision> {
        self.answered.get(i).and_then(|a| a.decision.as_ref())
    }

    /// Whether the store could not decide charge `i`, which its rule's
    /// failure policy admitted (`fail_open`): it has no decision, and no
    /// header reports a quota for it.
    pub fn is_undecided(&self, i: usize) -> bool {
        self.answered.get(i).is_some_and(|a| a.undecided)
    }

    /// The charge that refused the request, if one did.
    pub fn rejected_by(&self) -> Option<usize> {
        self.rejected_by
    }

    /// Whether charge `i` denies the request outright: its `reject` rule
    /// denied, or (under [`OverCapacity::Deny`]) it can never be admitted.
    pub fn denies(&self, i: usize) -> bool {
        self.answered.get(i).is_some_and(Answered::denies)
    }

    /// The charge the rate-limit headers report: the one that refused the
    /// request, else the one with the least remaining (then the smallest
    /// limit); none when no charge was decided.
    pub fn reported(&self) -> Option<usize> {
        self.reported
    }

    /// [`reported`](Self::reported) among charges `among` only (the checks
    /// of one Envoy descriptor, say).
    pub fn reported_among(&self, among: std::ops::Range<usize>) -> Option<usize> {
        most_restrictive(among, &self.answered)
    }

    /// What the request charged, held until the caller lets it go: given
    /// back if the request is abandoned ([`Held::give_back`]). `None` when
    /// nothing was charged. A charge the store could not decide (admitted
    /// by its failure policy) was never made, and is not held: settling it
    /// would give back what was never taken.
    pub fn into_held(self) -> Option<Held> {
        let (charged, at) = self.charged?;
        let (hold, held) = self
            .hold
            .map_or((None, Small::new()), |h| (Some(h.id), h.held));
        let mut charges = self.charges;
        let answered = self.answered;
        let unmade = charged
            .iter()
            .filter(|&&i| answered[i].undecided)
            .map(|&i| charges[i].clone())
            .collect();
        let charges = charged
            .iter()
            .filter(|&&i| !answered[i].undecided)
            .map(|&i| {
                let c = &mut charges[i];
                let charge = Charge {
                    key: std::mem::take(&mut c.key),
                    ..*c
                };
                let decision = answered[i].decision.as_ref();
                let charged = decision.map_or(
                    Charged {
                        cost: charge.cost,
                        at,
                        reset_after: 0,
                        held: false,
                    },
                    |d| Charged::of(charge.cost, at, d),
                );
                // Held open by the store under the request's id.
                let is_held = held.get(i).copied().unwrap_or(false);
                (
                    charge,
                    if is_held {
                        charged.held_open()
                    } else {
                        charged
                    },
                )
            })
            .collect();
        Some(Held {
            charges,
            unmade,
            hold,
        })
    }

    /// The outcome, and (with `hold`) what the request charged
    /// ([`into_held`](Self::into_held)).
    pub fn into_outcome(mut self, hold: bool) -> (Outcome, Option<Held>) {
        let outcome = std::mem::replace(&mut self.outcome, Outcome::Unlimited);
        (outcome, if hold { self.into_held() } else { None })
    }

    /// Whether anything charged waits (a shaping delay): what a front end
    /// must hold for.
    pub fn waits(&self) -> bool {
        self.charged.as_ref().is_some_and(|(charged, _)| {
            charged
                .iter()
                .any(|&i| self.decision(i).is_some_and(|d| !d.delay.is_zero()))
        })
    }
}

/// A [`Held`]'s parts: the charges the store could not make, those it
/// made, and the id it holds reservations open under.
pub(crate) type HeldParts = (Vec<Charge>, Vec<(Charge, Charged)>, Option<Arc<str>>);

/// The charges of an admitted request, held open until its response ends.
#[derive(Debug)]
pub struct Held {
    charges: Vec<(Charge, Charged)>,
    // The charges the store could not make (admitted by a failure policy):
    // a concurrency rule's slot is taken for them once the store answers.
    unmade: Vec<Charge>,
    // The id the store holds the charges of releasing rules open under.
    hold: Option<Arc<str>>,
}

impl Held {
    /// The charges the store could not make (it could not be reached, and
    /// the rule's failure policy admitted the request), the ones it made,
    /// and the id it holds reservations open under.
    pub(crate) fn into_parts(self) -> HeldParts {
        (self.unmade, self.charges, self.hold)
    }

    /// A `Held` of these charges: the inverse of
    /// [`into_parts`](Self::into_parts).
    pub(crate) fn from_parts(
        unmade: Vec<Charge>,
        charges: Vec<(Charge, Charged)>,
        hold: Option<Arc<str>>,
    ) -> Self {
        Self {
            charges,
            unmade,
            hold,
        }
    }

    /// Each charge held, and what the store charged for it: what a
    /// [`Settle`] of it must say.
    pub fn charges(&self) -> &[(Charge, Charged)] {
        &self.charges
    }

    /// The id the store holds the reservations of rules that give back
    /// what is not settled in time open under
    /// ([`Store::reserve`]): the settle of a charge that is
    /// [held](Charged::held) must be sent under it. `None` when no charge
    /// is held.
    pub fn hold_id(&self) -> Option<&str> {
        self.hold.as_deref()
    }

    /// The id to settle these charges under: the hold's, else a new one.
    pub(crate) fn settle_id(&self) -> String {
        self.hold.as_deref().map_or_else(settle_id, str::to_owned)
    }

    /// Gives every charge back (the request was abandoned before it was
    /// served): each settled at nothing, as of its time, so that a bucket
    /// that has refilled since hands nothing out twice, and a sliding log
    /// gives back only the charge's own entry.
    pub async fn give_back<St: Store>(self, engine: &Engine<St>) -> Result<(), St::Error> {
        let settles: Small<Settle<'_>> = self
            .charges
            .iter()
            .map(|(c, charged)| Settle {
                rule: c.id,
                key: &c.key,
                charged: *charged,
                actual: 0,
            })
            .collect();
        engine
            .store
            .settle(&self.settle_id(), &settles)
            .await
            .map(drop)
    }
}

/// A settle id no other settle of this process, nor (but with a chance of
/// about 2^-64) of another, has: a random prefix drawn once, and a count.
pub(crate) fn settle_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    use std::sync::LazyLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static PREFIX: LazyLock<u64> = LazyLock::new(|| RandomState::new().hash_one(0u8));
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{:016x}-{:x}",
        *PREFIX,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// One rule's decision on a request, as a decision API reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported<'a> {
    /// The rule's name.
    pub rule: &'a str,
    /// The tier whose quota applied, if not the default.
    pub tier: Option<&'a str>,
    /// The key the request was counted under.
    pub key: &'a str,
    /// What the request cost under this rule.
    pub cost: u64,
    /// What the rule does with a denial.
    pub action: Action,
    /// The store's decision.
    pub decision: &'a Decision,
}

/// The wall clock in µs since the Unix epoch: the time an entry of the
/// store's run-time tables ends on.
fn wall_micros() -> u64 {
    spillway::clock::Clock::now(&spillway::clock::SystemClock)
}

/// The policy on its store, and the observer: what decides requests. Every
/// front end holds one (the middleware through
/// [`RateLimitLayer`](crate::RateLimitLayer)).
pub struct Engine<St> {
    store: St,
    policy: Policy,
    observer: Option<Arc<dyn Observer>>,
    // Whether a request without the client's address has been logged: an
    // error once per engine, not one per request.
    pub(crate) logged_missing_addr: AtomicBool,
    // Whether a rule is a budget, whose responses are measured: read on
    // every admitted request, so made once.
    pub(crate) budgets: bool,
    // Whether a rule is a concurrency rule, whose slots are held until the
    // response ends: likewise.
    pub(crate) leases: bool,
    // Whether a budget rule gives back what is not settled in time, whose
    // charges the store holds open: likewise.
    releasing: bool,
    // Whether a rule has tiers: a request's tier is looked for only then.
    tiered: bool,
    // The leases of the requests in flight, renewed while they run.
    book: crate::leases::LeaseBook,
}

impl<St> std::fmt::Debug for Engine<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl<St> Engine<St> {
    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// The observer.
    pub fn observer(&self) -> Option<&Arc<dyn Observer>> {
        self.observer.as_ref()
    }
}

impl<St: Store> Engine<St> {
    /// The policy on `store`, which must have been built with
    /// [`Policy::store_rules`], in that order. Rules of the store's after
    /// those are the caller's own ([`charge_own`](Self::charge_own)).
    pub fn new(policy: Policy, store: St) -> Result<Self, RuleMismatch> {
        let expected: Vec<String> = policy
            .store_rules()
            .iter()
            .map(|r| r.name().to_string())
            .collect();
        let found: Vec<String> = store.rules().iter().map(|r| r.name().to_string()).collect();
        let same_algorithms = policy
            .store_rules()
            .iter()
            .zip(store.rules())
            .all(|(a, b)| a.algorithm() == b.algorithm());
        if !found.starts_with(&expected) || !same_algorithms {
            return Err(RuleMismatch { expected, found });
        }
        let budgets = policy
            .rules
            .iter()
            .any(|r| matches!(r.cost, Cost::Response(_)));
        let releasing = policy.rules.iter().any(releases);
        let tiered = policy.rules.iter().any(|r| !r.tiers.is_empty());
        let shortest = store
            .rules()
            .iter()
            .filter_map(|r| match r.algorithm() {
                AnyAlgorithm::Concurrency(c) => Some(Duration::from_micros(c.lease_micros())),
                _ => None,
            })
            .min();
        let leases = shortest.is_some();
        let book = crate::leases::LeaseBook::new(shortest.unwrap_or(Duration::from_secs(30)));
        Ok(Self {
            store,
            policy,
            observer: None,
            logged_missing_addr: AtomicBool::new(false),
            budgets,
            leases,
            releasing,
            tiered,
            book,
        })
    }

    /// The same engine, calling `observer` for every rule of every decided
    /// request.
    pub fn observed(self, observer: Option<Arc<dyn Observer>>) -> Self {
        Self { observer, ..self }
    }

    /// The budget of `charge`'s rule, if it is a budget rule (its cost is
    /// [`Cost::Response`]).
    pub fn response_cost(&self, charge: &Charge) -> Option<&ResponseCost> {
        match &self.policy.rules()[charge.policy_rule()?].cost {
            Cost::Response(budget) => Some(budget),
            _ => None,
        }
    }

    /// Whether any rule is a budget rule ([`Cost::Response`]), whose
    /// charges a front end holds until the response ends.
    pub fn has_budgets(&self) -> bool {
        self.budgets
    }

    /// The lease of `charge`'s rule, if it is a concurrency rule: how long
    /// a slot is held unless renewed.
    pub fn lease_of(&self, charge: &Charge) -> Option<Duration> {
        match self.store.rules()[charge.id.0].algorithm() {
            AnyAlgorithm::Concurrency(c) => Some(Duration::from_micros(c.lease_micros())),
            _ => None,
        }
    }

    /// The leases of the requests in flight.
    pub(crate) fn lease_book(&self) -> &crate::leases::LeaseBook {
        &self.book
    }

    /// Whether any rule is a concurrency rule, whose slots a front end
    /// holds until the response ends and renews meanwhile.
    pub fn has_leases(&self) -> bool {
        self.leases
    }

    /// Whether a front end must hold what `ruling` charged until the
    /// response ends: a shaping delay to wait out, a budget to settle, or a
    /// slot to give back.
    pub fn holds(&self, ruling: &Ruling) -> bool {
        ruling.waits()
            || ((self.budgets || self.leases)
                && ruling
                    .charges()
                    .iter()
                    .any(|c| self.response_cost(c).is_some() || self.lease_of(c).is_some()))
    }

    /// The name a charge is reported under: its policy rule's, or its store
    /// rule's.
    pub fn rule_name(&self, charge: &Charge) -> &str {
        match charge.of() {
            Some((index, _)) => &self.policy.rules[index].name,
            None => self.store.rules()[charge.id.0].name(),
        }
    }

    /// The tier whose quota a charge counts under, if not the default.
    pub fn tier_name(&self, charge: &Charge) -> Option<&str> {
        let (index, quota) = charge.of()?;
        let tier = quota.checked_sub(1)?;
        Some(&self.policy.rules[index].tiers[tier].0)
    }

    /// What a charge's rule does with a denial: its policy rule's action;
    /// a store rule of the caller's own rejects.
    pub fn action(&self, charge: &Charge) -> Action {
        charge
            .of()
            .map_or(Action::Reject, |(index, _)| self.policy.rules[index].action)
    }

    /// A charge of policy rule `index` under its quota for `tier` (its
    /// default quota when it has none for that tier).
    pub fn charge(
        &self,
        index: usize,
        tier: Option<&str>,
        key: impl Into<KeyText>,
        cost: u64,
    ) -> Charge {
        let rule = &self.policy.rules[index];
        let quota = rule.quota_index(tier);
        let id = RuleId(rule.first_id + quota);
        Charge {
            id,
            of: Some((index as u32, quota as u32)),
            key: key.into(),
            cost,
        }
    }

    /// A charge of the policy rule called `rule` under its quota for
    /// `tier`; the message of a client error for a rule, or a tier, that
    /// no rule has.
    pub fn charge_named(
        &self,
        rule: &str,
        tier: Option<&str>,
        key: String,
        cost: u64,
    ) -> Result<Charge, String> {
        let Some(index) = self.policy.rules.iter().position(|r| r.name == rule) else {
            return Err(format!("Unknown rule `{rule}`."));
        };
        if let Some(tier) = tier
            && !self
                .policy
                .rules
                .iter()
                .any(|r| r.tiers().any(|t| t == tier))
        {
            return Err(format!(
                "Unknown tier `{tier}`: no rule has a quota for it."
            ));
        }
        // A known tier this rule has no quota for is counted under the
        // rule's default quota, as the middleware counts it.
        Ok(self.charge(index, tier, key, cost))
    }

    /// A charge of the policy rule called `rule` for `key`, as a decision
    /// API names them (`POST /v1/check`): counted where the middleware
    /// counts the requests that key comes from.
    ///
    /// - The key must be one the rule's key parts (or, when it has one, its
    ///   fallback) build: `api_key=VALUE` for `key = [api_key]`. Any other
    ///   key would be counted apart from every request's, in a counter no
    ///   request meets. `free_form` takes any key, for callers that count
    ///   keys of their own (or of another front end's, such as Envoy's
    ///   descriptors); so does a rule made
    ///   [`by_name_only`](crate::HttpRule::by_name_only).
    /// - The tier is the one the key's API key (or bearer token) is in, by
    ///   the policy's table, as for a request with that key; a `tier` that
    ///   is not that one is refused. A key whose API key is in no tier may
    ///   be given one (the tier a trusted layer would have set).
    ///
    /// The message of a client error otherwise.
    pub fn charge_for_key(
        &self,
        rule: &str,
        tier: Option<&str>,
        key: String,
        cost: u64,
        free_form: bool,
    ) -> Result<Charge, String> {
        let Some(r) = self.policy.rules.iter().find(|r| r.name == rule) else {
            return Err(format!("Unknown rule `{rule}`."));
        };
        // A rule no request matches (Envoy's descriptor file) has keys of
        // the descriptors' own.
        if free_form || !r.over_http {
            return self.charge_named(rule, tier, key, cost);
        }
        let (parts, values) = Self::key_parts(r, &key)?;
        let now = wall_micros();
        let resolved: Option<Arc<str>> =
            parts
                .iter()
                .zip(&values)
                .find_map(|(part, value)| match part {
                    KeyPart::ApiKey | KeyPart::Credential(_) => self
                        .store
                        .tiers()
                        .and_then(|book| book.tier_of(value, now))
                        .or_else(|| {
                            self.policy
                                .api_key_tiers
                                .get(value)
                                .map(|t| t.as_str().into())
                        }),
                    _ => None,
                });
        let tier = match (tier, resolved.as_deref()) {
            (Some(given), Some(has)) if given != has => {
                return Err(format!(
                    "The API key of `key` is in tier `{has}`, not `{given}`."
                ));
            }
            (given, has) => given.or(has),
        };
        self.charge_named(rule, tier, key, cost)
    }

    /// Whether `key` is one that requests can have under the policy rule
    /// called `rule` (one its key parts, or its fallback's, build; any key
    /// for a rule no request matches): the message of a client error
    /// otherwise. What an operator naming a key (an override) is held to.
    pub fn key_error(&self, rule: &str, key: &str) -> Option<String> {
        let Some(r) = self.policy.rules.iter().find(|r| r.name == rule) else {
            return Some(format!("Unknown rule `{rule}`."));
        };
        if !r.over_http {
            return None;
        }
        if key.len() > crate::key::MAX_KEY_LEN {
            return Some(format!(
                "`key` is {} bytes long: a request's key past {} bytes is kept as its hash \
                 (`sha256:...`, as the admin API's key listing shows it); name that.",
                key.len(),
                crate::key::MAX_KEY_LEN
            ));
        }
        Self::key_parts(r, key).err()
    }

    /// The key parts of `r` that build `key`, and the values they took.
    fn key_parts<'r>(
        r: &'r crate::HttpRule,
        key: &str,
    ) -> Result<(&'r [KeyPart], Vec<String>), String> {
        let by_key = crate::key::values_of(key, &r.key);
        let by_fallback = || crate::key::values_of(key, &r.fallback);
        match (by_key, by_fallback()) {
            (Some(values), _) => Ok((&r.key, values)),
            (None, Some(values)) => Ok((&r.fallback, values)),
            (None, None) => {
                let mut expected = format!("`{}`", crate::key::shape_of(&r.key));
                if !r.fallback.is_empty() && r.fallback != r.key {
                    expected.push_str(&format!(
                        " (or, from its fallback, `{}`)",
                        crate::key::shape_of(&r.fallback)
                    ));
                }
                Err(format!(
                    "`key` cannot come from a request under rule `{}`, whose keys look like \
                     {expected}, values escaped (`%` `|` `=` as %25 %7C %3D); \
                     `\"free_form_key\": true` counts any key.",
                    r.name
                ))
            }
        }
    }

    /// A charge of store rule `id`, one of the caller's own after the
    /// policy's (see [`new`](Self::new)): reported under the store rule's
    /// name, and a denial by it rejects. `None` for a rule the store does
    /// not have or one of the policy's.
    pub fn charge_own(&self, id: RuleId, key: impl Into<KeyText>, cost: u64) -> Option<Charge> {
        let own = self.policy.store_rule_count()..self.store.rules().len();
        own.contains(&id.0).then(|| Charge {
            id,
            of: None,
            key: key.into(),
            cost,
        })
    }

    /// The charges a request's parts make: every rule that matches, with
    /// its key and cost. A rule that counts by the client's address, on
    /// parts that carry none, does not apply, unless `missing` says that is
    /// an error; nor does a concurrency rule to parts marked
    /// [`NotServed`](crate::NotServed).
    pub fn plan(&self, parts: &Parts, missing: MissingClientAddr) -> Result<Charges, Unplanned> {
        let policy = &self.policy;
        let client = Identity::of(parts, &policy.clients);
        let addr_required = missing == MissingClientAddr::Error;
        // Looked for only under a policy with tiers; an error only matters
        // to a rule that has them.
        let tiered = self.tiered;
        let runtime = match tiered {
            true => self.runtime_tier(&client),
            false => Ok(None),
        };
        let tier = match &runtime {
            Ok(None) if !tiered => Ok(None),
            Ok(Some(tier)) => Ok(Some(&**tier)),
            Ok(None) => policy.tier_of(&client),
            Err(m) => Err(m.as_str()),
        };
        let not_served = self.leases && parts.extensions.get::<crate::NotServed>().is_some();
        // The lists, read only while they hold an entry: one snapshot.
        let lists = self.store.lists().and_then(|l| l.snapshot());
        // The clock, read once and only if an entry names the request.
        let clock = std::cell::OnceCell::new();
        let now = || *clock.get_or_init(wall_micros);
        let ip = client.addr;
        // A key the lists name cannot escape them by being sent twice.
        // Read only when the lists are.
        let api_key = match &lists {
            Some(l) => match client.api_key() {
                Err(m) if l.has_api_keys() => return Err(Unplanned::BadRequest(m.clone())),
                key => key.as_ref().ok().and_then(Option::as_deref),
            },
            None => None,
        };
        let blocked = |status: u16, until: Option<u64>| {
            let status = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::FORBIDDEN);
            if let Some(o) = &self.observer {
                o.blocked(status);
            }
            Unplanned::Blocked {
                status,
                retry_after: until.map(|u| Duration::from_micros(u.saturating_sub(now()))),
            }
        };
        // Every rule's entries: a block refuses the request, an allow lets
        // it past every rule (a rule's own block still holds).
        let every = lists
            .as_ref()
            .map_or(Listing::Unlisted, |l| l.every_rule(ip, api_key, &now));
        if let Listing::Blocked { status, until } = every {
            return Err(blocked(status, until));
        }
        let rules_listed = lists.as_ref().filter(|l| l.has_rules());
        let mut charges = SmallVec::new();
        for (index, rule) in policy.rules.iter().enumerate() {
            if !rule
                .matches(parts, client.peer_trusted)
                .map_err(|m| Unplanned::BadRequest(m.to_string()))?
            {
                continue;
            }
            let key = rule
                .key_of(&client, parts)
                .map_err(|m| Unplanned::BadRequest(format!("rule `{}`: {m}", rule.name)))?;
            // The rule's own entries, whether or not the request has what
            // it counts by: a block of its address holds either way.
            let own = rules_listed.map_or(Listing::Unlisted, |l| {
                l.of_rule(&rule.name, ip, api_key, key.as_deref(), &now)
            });
            if let Listing::Blocked { status, until } = own {
                return Err(blocked(status, until));
            }
            let Some(key) = key else {
                // `ip` is `None` only when there is no peer address at all.
                if addr_required && client.ip.is_none() && rule.needs_ip() {
                    return Err(Unplanned::NoClientAddr(index));
                }
                continue;
            };
            match (own, every) {
                (Listing::Blocked { status, until }, _) => return Err(blocked(status, until)),
                // Let past this rule.
                (Listing::Allowed, _) | (_, Listing::Allowed) => continue,
                _ => {}
            }
            let tier = match tier {
                Ok(tier) => tier,
                Err(_) if rule.tiers.is_empty() => None,
                Err(m) => {
                    let m = format!("rule `{}`: {m}", rule.name);
                    return Err(Unplanned::BadRequest(m));
                }
            };
            let quota = rule.quota_index(tier);
            // The quota's algorithm: a tier may be of another kind.
            if not_served && matches!(rule.algorithm_of(quota), AnyAlgorithm::Concurrency(_)) {
                continue;
            }
            let cost = cost_of(&rule.cost, &client, parts, || {
                rule.algorithm_of(quota).capacity()
            })
            .map_err(Unplanned::BadRequest)?;
            let id = RuleId(rule.first_id + quota);
            charges.push(Charge {
                id,
                of: Some((index as u32, quota as u32)),
                key,
                cost,
            });
        }
        Ok(charges)
    }

    /// The tier a request's API key was put in at run time (the store's
    /// [`TierBook`](spillway::store::TierBook)), unless a trusted layer
    /// named the tier; an error (a 400's message) when the book holds keys
    /// and the API key was sent twice or cannot be read, so that a key in
    /// a stricter tier cannot escape it that way.
    fn runtime_tier(&self, client: &Identity) -> Result<Option<Arc<str>>, String> {
        if client.tier().is_some() {
            return Ok(None);
        }
        let Some(book) = self.store.tiers().filter(|b| !b.is_empty()) else {
            return Ok(None);
        };
        match client.api_key() {
            Ok(Some(key)) => Ok(book.tier_of(key, wall_micros())),
            Ok(None) => Ok(None),
            Err(m) => Err(m.clone()),
        }
    }

    /// Plans a request's parts and decides it, for a caller that describes
    /// a request rather than serving it (a decision API): a rule that
    /// counts by the client's address does not apply to parts without one.
    pub async fn decide_parts(&self, parts: &Parts) -> Ruling {
        self.decide_parts_asking(parts, Asking::default()).await
    }

    /// [`decide_parts`](Self::decide_parts), decided as `asking` says (a
    /// caller whose settle tokens live a bounded time holds nothing
    /// longer: [`Asking::hold_at_most`]).
    pub async fn decide_parts_asking(&self, parts: &Parts, asking: Asking) -> Ruling {
        match self.plan(parts, MissingClientAddr::SkipRule) {
            Ok(charges) => self.decide(charges, asking).await,
            Err(unplanned) => {
                let outcome = unplanned.outcome().expect("skipped, not required");
                Ruling::without_store(outcome, SmallVec::new())
            }
        }
    }

    /// Decides on a request's charges: all go to the store in one call
    /// (two when only non-rejecting rules denied), charged as the outcome
    /// says. A store that answers at once ([`decide_now`](Self::decide_now))
    /// is not waited for; the wait for one that must be is boxed, so that
    /// the future of a caller that awaits this stays small (it is moved
    /// whole through every layer above it).
    pub async fn decide(&self, charges: Charges, asking: Asking) -> Ruling {
        match self.decide_now(charges, asking) {
            Ok(ruling) => ruling,
            Err(charges) => Box::pin(self.decide_waiting(charges, asking)).await,
        }
    }

    /// [`decide`](Self::decide), waiting for the store.
    async fn decide_waiting(&self, charges: Charges, asking: Asking) -> Ruling {
        if charges.is_empty() {
            return Ruling::without_store(Outcome::Unlimited, charges);
        }
        let mut deciding = Deciding::new(self, charges, asking);
        let hold = deciding.hold.as_ref().map(|h| h.id.clone());
        let within = asking.hold_at_most.unwrap_or(Duration::MAX);
        loop {
            let Some(asked) = deciding.ask() else { break };
            let answered = match &hold {
                Some(id) => {
                    let held = deciding.held_asked();
                    let hold = spillway::store::Hold {
                        only: Some(&held),
                        within,
                    };
                    self.store.reserve_held(id, &asked, hold).await
                }
                None => self.store.check(&asked).await,
            };
            drop(asked);
            match answered {
                Ok(verdict) => deciding.answer(&verdict),
                Err(e) => return deciding.failed(&e),
            }
        }
        deciding.conclude()
    }

    /// [`decide`](Self::decide) on a store that answers without waiting
    /// ([`Store::try_check_now`]); the charges back, with nothing charged,
    /// on a store that has to be waited for.
    // The charges come back by value, for the caller to wait with: boxing
    // them would add an allocation to every request that waits.
    #[allow(clippy::result_large_err)]
    pub fn decide_now(&self, charges: Charges, asking: Asking) -> Result<Ruling, Charges> {
        if charges.is_empty() {
            return Ok(Ruling::without_store(Outcome::Unlimited, charges));
        }
        if charges.len() == 1 && asking == Asking::default() && !self.releasing {
            return self.decide_one_now(charges);
        }
        self.decide_now_in_turns(charges, asking)
    }

    /// [`decide_now`](Self::decide_now), asking the store in turns until
    /// every charge is decided: what any request may need (a rule that
    /// denied softly is asked no more, the others are asked again).
    #[allow(clippy::result_large_err)]
    fn decide_now_in_turns(&self, charges: Charges, asking: Asking) -> Result<Ruling, Charges> {
        let mut deciding = Deciding::new(self, charges, asking);
        let hold = deciding.hold.as_ref().map(|h| h.id.clone());
        let within = asking.hold_at_most.unwrap_or(Duration::MAX);
        loop {
            let Some(asked) = deciding.ask() else { break };
            let answered = match &hold {
                Some(id) => {
                    let held = deciding.held_asked();
                    let hold = spillway::store::Hold {
                        only: Some(&held),
                        within,
                    };
                    self.store.try_reserve_now(id, &asked, hold)
                }
                None => self.store.try_check_now(&asked),
            };
            drop(asked);
            match answered {
                None => return Err(deciding.charges),
                Some(Ok(verdict)) => deciding.answer(&verdict),
                Some(Err(e)) => return Ok(deciding.failed(&e)),
            }
        }
        Ok(deciding.conclude())
    }

    /// [`decide_now`](Self::decide_now) on the commonest request: one
    /// charge, asked as it is (no reservation to hold open, nothing only
    /// looked at, no cost above capacity to deny). One ask decides it, so
    /// the turns' lists are not built: the answer is taken as
    /// [`Deciding::answer`] takes it, and concluded the same way (a test
    /// holds the two rulings equal on every kind of answer).
    #[allow(clippy::result_large_err)]
    #[inline(always)]
    fn decide_one_now(&self, charges: Charges) -> Result<Ruling, Charges> {
        match self.ask_one_now(&charges[0]) {
            None => Err(charges),
            Some(Ok(verdict)) => Ok(self.rule_one(charges, &verdict)),
            Some(Err(e)) => Ok(Deciding::new(self, charges, Asking::default()).failed(&e)),
        }
    }

    /// Asks the store, without waiting, for one charge as it is.
    #[inline(always)]
    fn ask_one_now(&self, charge: &Charge) -> Option<Result<Verdict, St::Error>> {
        let check = [Check {
            rule: charge.id,
            key: &charge.key,
            cost: charge.cost,
        }];
        self.store.try_check_now(&check)
    }

    /// The ruling on one charge asked as it is, once the store answered.
    #[inline(always)]
    fn rule_one(&self, charges: Charges, verdict: &Verdict) -> Ruling {
        let Some(&decision) = verdict.decisions.first() else {
            // No store answers a check with no decision: what the turns
            // make of it, from that answer.
            return self.rule_in_turns(charges, verdict);
        };
        let decided = verdict.is_decided(0);
        let mut answered = Answered {
            decision: decided.then_some(decision),
            undecided: !decided,
            ..Answered::default()
        };
        let mut rejected_by = None;
        let mut denied_softly = SmallVec::new();
        let mut charged = None;
        if verdict.allowed {
            charged = Some((smallvec::smallvec![0], verdict.decided_at));
        } else if !decision.allowed {
            if self.action(&charges[0]) == Action::Reject {
                answered.rejecting = true;
                rejected_by = Some(0);
            } else {
                denied_softly.push(0);
            }
        } else {
            // Denied with no denying decision: the turns ask again.
            return self.rule_in_turns(charges, verdict);
        }
        let deciding = Deciding {
            engine: self,
            charges,
            asking: Asking::default(),
            answered: smallvec::smallvec![answered],
            rejected_by,
            denied_softly,
            charged,
            active: SmallVec::new(),
            look_only: false,
            hold: None,
        };
        deciding.conclude()
    }

    /// The turns' ruling on charges the store answered `verdict` for at
    /// their first ask: [`decide_now_in_turns`](Self::decide_now_in_turns)
    /// from its second ask on. A store that answered at once and then
    /// would have to be waited for (none does) leaves the request
    /// unavailable rather than charged in part.
    #[cold]
    fn rule_in_turns(&self, charges: Charges, verdict: &Verdict) -> Ruling {
        let mut deciding = Deciding::new(self, charges, Asking::default());
        deciding.answer(verdict);
        loop {
            let Some(asked) = deciding.ask() else { break };
            let answered = self.store.try_check_now(&asked);
            drop(asked);
            match answered {
                Some(Ok(verdict)) => deciding.answer(&verdict),
                Some(Err(e)) => return deciding.failed(&e),
                None => {
                    let error = "the store stopped answering at once";
                    return Ruling::without_store(
                        Outcome::Unavailable(error.to_string()),
                        deciding.charges,
                    );
                }
            }
        }
        deciding.conclude()
    }

    /// [`decide_now`](Self::decide_now) for the middleware, whose commonest
    /// request (one charge under a policy with no budget and no
    /// concurrency rule) is admitted at once: then only the header fields
    /// its response carries are made, not a [`Ruling`]. Anything else (a
    /// denial, a shaping delay, a check the store could not decide, an
    /// error, several charges) is ruled in full. A test holds both ways
    /// to the same fields and outcome.
    #[allow(clippy::result_large_err)]
    #[inline(always)]
    pub(crate) fn admit_now(&self, charges: Charges) -> Result<Admission, Charges> {
        if charges.len() != 1 || self.releasing || self.budgets || self.leases {
            return self
                .decide_now(charges, Asking::default())
                .map(Admission::Ruled);
        }
        let verdict = match self.ask_one_now(&charges[0]) {
            None => return Err(charges),
            Some(Ok(verdict)) => verdict,
            Some(Err(e)) => {
                let ruling = Deciding::new(self, charges, Asking::default()).failed(&e);
                return Ok(Admission::Ruled(ruling));
            }
        };
        let admitted = verdict
            .decisions
            .first()
            .filter(|d| verdict.allowed && d.delay.is_zero() && verdict.undecided.is_empty());
        let Some(decision) = admitted else {
            return Ok(Admission::Ruled(self.rule_one(charges, &verdict)));
        };
        let charge = &charges[0];
        self.observe(charge, RuleOutcome::Allowed, Some(decision));
        let options = &self.policy.headers;
        if !(options.legacy || options.ietf || options.openai) {
            return Ok(Admission::Admitted(RateLimitFields::default()));
        }
        let described = Described {
            applied: smallvec::smallvec![Decided {
                id: charge.id,
                of: charge.of(),
                decision: *decision,
                window_secs: self.window_secs(charge, decision),
            }],
            reported: 0,
        };
        Ok(Admission::Admitted(described.fields(self)))
    }

    /// The rate-limit header fields that describe `ruling`, as configured
    /// ([`HeaderOptions`](crate::HeaderOptions)); empty when no rule
    /// decided or no header is to be sent.
    pub fn fields(&self, ruling: &Ruling) -> RateLimitFields {
        let options = &self.policy.headers;
        if !(options.legacy || options.ietf || options.openai) {
            return RateLimitFields::default();
        }
        self.described(ruling).fields(self)
    }

    /// What the header fields of `ruling` are made of, small enough for a
    /// response future to carry.
    pub(crate) fn described(&self, ruling: &Ruling) -> Described {
        let mut applied = Small::new();
        let mut reported = 0;
        for (i, charge) in ruling.charges.iter().enumerate() {
            let Some(decision) = ruling.decision(i) else {
                continue;
            };
            if ruling.reported == Some(i) {
                reported = applied.len();
            }
            applied.push(Decided {
                id: charge.id,
                of: charge.of(),
                decision: *decision,
                window_secs: self.window_secs(charge, decision),
            });
        }
        Described { applied, reported }
    }

    /// Every decided rule of `ruling`, as a decision API reports it.
    pub fn report<'a>(&'a self, ruling: &'a Ruling) -> impl Iterator<Item = Reported<'a>> + 'a {
        ruling
            .charges
            .iter()
            .enumerate()
            .filter_map(move |(i, charge)| {
                Some(Reported {
                    rule: self.rule_name(charge),
                    tier: self.tier_name(charge),
                    key: &charge.key,
                    cost: charge.cost,
                    action: self.action(charge),
                    decision: ruling.decision(i)?,
                })
            })
    }

    /// The window the headers announce for a decision on `charge`: the time
    /// its quota takes to refill the decision's limit, in whole seconds.
    fn window_secs(&self, charge: &Charge, decision: &Decision) -> u64 {
        match charge.of() {
            Some((index, quota)) => self.policy.rules[index].window_secs(quota, decision.limit),
            None => {
                headers::window_secs_of(self.store.rules()[charge.id.0].algorithm(), decision.limit)
            }
        }
    }

    /// Reports one charge's outcome to the observer.
    fn observe(&self, charge: &Charge, outcome: RuleOutcome, decision: Option<&Decision>) {
        if let Some(observer) = &self.observer {
            observer.observe(self.rule_name(charge), outcome, decision);
        }
    }
}

/// A request's cost under a rule: fixed, from a trusted header (a
/// [`RequestCost`](crate::RequestCost) extension first), by route, or (a
/// budget) its reservation under a quota of `capacity`.
fn cost_of(
    cost: &Cost,
    client: &Identity,
    parts: &Parts,
    capacity: impl FnOnce() -> u64,
) -> Result<u64, String> {
    match cost {
        Cost::Response(budget) => budget.reservation(parts, client.peer_trusted, capacity()),
        Cost::Fixed(c) => Ok(*c),
        Cost::Routes { routes, default } => Ok(Cost::of_routes(routes, *default, parts)),
        Cost::Header { name, default } => match parts.extensions.get::<crate::RequestCost>() {
            Some(crate::RequestCost(c)) => Ok(*c),
            None => match parts.headers.get(name).filter(|_| client.peer_trusted) {
                None => Ok(*default),
                Some(v) => v
                    .to_str()
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .ok_or_else(|| format!("header `{name}` must be a non-negative integer cost")),
            },
        },
    }
}

/// Of the charges `among`, the one to report: the first that denies the
/// request, else the decided one with the least remaining (then the
/// smallest limit).
fn most_restrictive(among: std::ops::Range<usize>, answered: &[Answered]) -> Option<usize> {
    let denies = |i: usize| answered.get(i).is_some_and(Answered::denies);
    among.clone().find(|&i| denies(i)).or_else(|| {
        among
            .filter_map(|i| answered.get(i).and_then(|a| a.decision).map(|d| (i, d)))
            .min_by_key(|(_, d)| (d.remaining, d.limit))
            .map(|(i, _)| i)
    })
}

/// Whether a charge of policy rule `rule` is a reservation the store holds
/// open: a budget that gives back what is not settled in time
/// ([`ResponseCost::release_unsettled_after`]). Only a budget's charges
/// are settled (its response is metered), so no other rule's are held,
/// whatever its store rule says.
fn releases(rule: &crate::HttpRule) -> bool {
    matches!(&rule.cost, Cost::Response(b) if b.release_after.is_some())
}

/// Whether the store holds a reservation of `rule` open, and gives it back
/// when it is not settled in time (a concurrency rule's leases end by
/// themselves).
fn store_releases(rule: &spillway::store::Rule) -> bool {
    rule.release_after().is_some()
        && !matches!(
            rule.algorithm(),
            spillway::algorithm::AnyAlgorithm::Concurrency(_)
        )
}

/// One decision in the making: the loop of [`Engine::decide`], one store
/// answer at a time, so that the same steps serve a store that must be
/// waited for and one that answers at once.
struct Deciding<'e, St> {
    engine: &'e Engine<St>,
    charges: Charges,
    asking: Asking,
    answered: Small<Answered>,
    rejected_by: Option<usize>,
    denied_softly: Small<usize>,
    charged: Option<(Small<usize>, u64)>,
    // The charges still to be asked, by index; empty once decided.
    active: Small<usize>,
    // Only look: every cost is 0.
    look_only: bool,
    // The reservations to hold open, when a charge's rule gives back what
    // is not settled in time.
    hold: Option<Box<Hold>>,
}

impl<'e, St: Store> Deciding<'e, St> {
    /// Starts deciding on charges (at least one).
    // Inlined, as `conclude` is: the charges and the ruling are a few
    // hundred bytes, and moving them in and out of calls (a memcpy each)
    // cost more than the calls (callgrind, the layer bench).
    #[inline(always)]
    fn new(engine: &'e Engine<St>, charges: Charges, asking: Asking) -> Self {
        let n = charges.len();
        let answered: Small<Answered> = match asking.over_capacity {
            OverCapacity::Refuse => smallvec::smallvec![Answered::default(); n],
            OverCapacity::Deny => charges
                .iter()
                .map(|c| Answered {
                    over_capacity: c.cost > engine.store.rules()[c.id.0].algorithm().capacity(),
                    ..Answered::default()
                })
                .collect(),
        };
        let look_only = asking.look_only || answered.iter().any(|a| a.over_capacity);
        // Looked for only under a policy that has such a rule.
        let hold = ((engine.releasing || asking.hold_every) && !look_only)
            .then(|| {
                let store_rules = engine.store.rules();
                let held: Small<bool> = charges
                    .iter()
                    .map(|c| {
                        c.cost > 0
                            && (c
                                .of()
                                .is_some_and(|(i, _)| releases(&engine.policy.rules[i]))
                                || (asking.hold_every && store_releases(&store_rules[c.id.0])))
                    })
                    .collect();
                held.contains(&true).then(|| {
                    Box::new(Hold {
                        id: Arc::from(settle_id()),
                        held,
                    })
                })
            })
            .flatten();
        Self {
            hold,
            engine,
            asking,
            answered,
            rejected_by: None,
            denied_softly: SmallVec::new(),
            charged: None,
            active: (0..n).collect(),
            look_only,
            charges,
        }
    }

    /// The checks to ask the store next; `None` once decided.
    fn ask(&self) -> Option<Small<Check<'_>>> {
        (!self.active.is_empty()).then(|| {
            self.active
                .iter()
                .map(|&i| {
                    let c = &self.charges[i];
                    Check {
                        rule: c.id,
                        key: &c.key,
                        cost: if self.look_only { 0 } else { c.cost },
                    }
                })
                .collect()
        })
    }

    /// For each check [`ask`](Self::ask) gives, whether the store holds
    /// its charge open: only those the caller will settle (a budget's, or
    /// every one a [`Asking::hold_every`] caller settles), never another
    /// rule's that the request also met, whatever its store rule says.
    fn held_asked(&self) -> Small<bool> {
        let held = self.hold.as_ref().map(|h| &h.held);
        self.active
            .iter()
            .map(|&i| held.and_then(|h| h.get(i)).copied().unwrap_or(false))
            .collect()
    }

    /// Takes the store's answer on what [`ask`](Self::ask) gave.
    fn answer(&mut self, verdict: &Verdict) {
        for (j, (&i, d)) in self.active.iter().zip(&verdict.decisions).enumerate() {
            // A stand-in for a check the store could not decide is no
            // decision: nothing reports its made-up quota.
            let decided = verdict.is_decided(j);
            let answered = &mut self.answered[i];
            answered.decision = decided.then_some(*d);
            answered.undecided = !decided;
        }
        if verdict.allowed {
            let charged = std::mem::take(&mut self.active);
            self.charged = Some((charged, verdict.decided_at));
            return;
        }
        let denying: Small<usize> = self
            .active
            .iter()
            .zip(&verdict.decisions)
            .filter(|(_, d)| !d.allowed)
            .map(|(&i, _)| i)
            .collect();
        let engine = self.engine;
        let rejecting: Small<usize> = denying
            .iter()
            .copied()
            .filter(|&i| engine.action(&self.charges[i]) == Action::Reject)
            .collect();
        if let Some(&first) = rejecting.first() {
            for &i in &rejecting {
                self.answered[i].rejecting = true;
            }
            self.rejected_by = Some(first);
            self.active.clear();
            return;
        }
        self.denied_softly.extend_from_slice(&denying);
        // The verdict's decisions are the active checks', in order: one
        // pass, not a search of the denying for each check (which made a
        // request of n checks cost n² here).
        let mut decided = verdict.decisions.iter();
        self.active
            .retain(|_| decided.next().is_some_and(|d| d.allowed));
    }

    /// The ruling when the store could not decide: a request that can
    /// never be decided is the client's error; otherwise the store is
    /// unavailable (its failure policy has been applied already).
    fn failed(self, error: &St::Error) -> Ruling {
        let engine = self.engine;
        for charge in &self.charges {
            engine.observe(charge, RuleOutcome::Error, None);
        }
        let outcome = match error.invalid_request() {
            Some(e) => Outcome::BadRequest(self.request_error(e)),
            None => {
                tracing::warn!(error = %error, "rate limit store unavailable");
                Outcome::Unavailable(error.to_string())
            }
        };
        Ruling::without_store(outcome, self.charges)
    }

    /// The message of a store error that is the request's fault.
    fn request_error(&self, e: &spillway::Error) -> String {
        match e {
            spillway::Error::CostTooLarge { index, source } => {
                // `index` is the check's among those asked, which are the
                // first ask's: every charge, in order.
                let rule = self
                    .charges
                    .get(*index)
                    .map_or("?", |c| self.engine.rule_name(c));
                format!(
                    "This request costs {} under rule `{rule}`, whose capacity is {}: it can never be admitted.",
                    source.cost, source.capacity
                )
            }
            other => other.to_string(),
        }
    }

    /// The ruling, once the store has decided.
    #[inline(always)]
    fn conclude(self) -> Ruling {
        let engine = self.engine;
        let charges = &self.charges;
        let answered = &self.answered;
        let denied_by_capacity = answered.iter().position(|a| a.over_capacity);
        if engine.observer.is_some() {
            for (charge, a) in charges.iter().zip(answered) {
                let outcome = match a.decision {
                    _ if a.over_capacity => RuleOutcome::Rejected,
                    Some(d) if !d.allowed => RuleOutcome::of_denial(engine.action(charge)),
                    Some(_) => RuleOutcome::Allowed,
                    None if a.undecided => RuleOutcome::Undecided,
                    None => continue,
                };
                engine.observe(charge, outcome, a.decision.as_ref());
            }
        }
        let rejected_by = denied_by_capacity.or(self.rejected_by);
        let reported = most_restrictive(0..charges.len(), answered);
        let outcome = match rejected_by {
            Some(i) => {
                let name = engine.rule_name(&charges[i]);
                tracing::debug!(rule = name, key = %charges[i].key, "rate limited");
                let retry_after = answered[i]
                    .decision
                    .and_then(|d| d.retry_after)
                    .unwrap_or(headers::UNKNOWN_RETRY_AFTER);
                let rule = charges[i]
                    .of()
                    .map(|(index, _)| &engine.policy.rules[index]);
                let retry_after = match rule.and_then(|r| r.retry_hint) {
                    Some(hint) => retry_after.min(hint),
                    None => retry_after,
                };
                Outcome::Rejected {
                    rule: name.to_string(),
                    retry_after,
                    status: rule.map_or(http::StatusCode::TOO_MANY_REQUESTS, |r| r.deny_status),
                }
            }
            None if self.asking.look_only => Outcome::Admitted {
                delay: Duration::ZERO,
                limited: Vec::new(),
                shadowed: Vec::new(),
            },
            None => {
                let mut limited = Vec::new();
                let mut shadowed = Vec::new();
                for &i in &self.denied_softly {
                    let name = engine.rule_name(&charges[i]);
                    if engine.action(&charges[i]) == Action::Shadow {
                        tracing::info!(rule = name, key = %charges[i].key, "shadow rule would have denied");
                        shadowed.push(name.to_string());
                    } else {
                        limited.push(name.to_string());
                    }
                }
                let delay = self
                    .answered
                    .iter()
                    .filter_map(|a| a.decision)
                    .filter(|d| d.allowed)
                    .map(|d| d.delay)
                    .max()
                    .unwrap_or_default();
                Outcome::Admitted {
                    delay,
                    limited,
                    shadowed,
                }
            }
        };
        Ruling {
            outcome,
            answered: self.answered,
            rejected_by,
            // Looking charges nothing: there is nothing to give back.
            charged: self.charged.filter(|_| !self.look_only),
            reported,
            charges: self.charges,
            hold: self.hold,
        }
    }
}

/// What a ruling's header fields are made of: each decided charge's store
/// rule, policy rule and quota, decision and window in seconds, and which
/// of them the fields report.
#[derive(Debug, Default, Clone)]
pub(crate) struct Described {
    applied: Small<Decided>,
    reported: usize,
}

/// One decided charge, as the header fields need it.
#[derive(Debug, Clone, Copy)]
struct Decided {
    id: RuleId,
    of: Option<(usize, usize)>,
    decision: Decision,
    window_secs: u64,
}

impl Described {
    /// The fields, with the rules' names (made in advance for the
    /// policy's rules).
    pub(crate) fn fields<St: Store>(&self, engine: &Engine<St>) -> RateLimitFields {
        let policy = &engine.policy;
        let options = &policy.headers;
        // No header family on: `Engine::fields` answered before this.
        if self.applied.is_empty() {
            return RateLimitFields::default();
        }
        // The budget rule with the least left, for the OpenAI-style family.
        let tokens = options
            .openai
            .then(|| {
                self.applied
                    .iter()
                    .filter(|d| {
                        d.of.is_some_and(|(i, _)| matches!(policy.rules[i].cost, Cost::Response(_)))
                    })
                    .map(|d| d.decision)
                    .min_by_key(|d| d.remaining)
            })
            .flatten();
        // The names of the store's own rules are serialized here; the
        // policy's were when the rule was made.
        let own: Small<String> = self
            .applied
            .iter()
            .filter(|d| d.of.is_none())
            .map(|d| headers::sf_name(engine.store.rules()[d.id.0].name()))
            .collect();
        let mut own = own.iter();
        let applied: Small<Applied<'_>> = self
            .applied
            .iter()
            .map(|d| match d.of {
                Some((index, quota)) => Applied {
                    name: &policy.rules[index].sf_name,
                    decision: d.decision,
                    window_secs: d.window_secs,
                    presented: policy.rules[index].presented.get(quota),
                },
                None => Applied {
                    name: own.next().map_or("\"?\"", String::as_str),
                    decision: d.decision,
                    window_secs: d.window_secs,
                    presented: None,
                },
            })
            .collect();
        RateLimitFields::new(options, &applied, self.reported, tokens.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use spillway::Quota;
    use spillway::algorithm::{FixedWindow, TokenBucket};
    use spillway::clock::FakeClock;
    use spillway::store::{MemoryOptions, MemoryStore, Rule};

    use super::*;
    use crate::HttpRule;

    fn per_minute(n: u32) -> Quota {
        Quota::per_minute(NonZeroU32::new(n).expect("nonzero"))
    }

    /// An engine on a store at 42.8 s into a minute, with the policy's
    /// rules and then `own`.
    fn engine(policy: Policy, own: Vec<Rule>) -> Engine<MemoryStore<FakeClock>> {
        let mut rules = policy.store_rules();
        rules.extend(own);
        let clock = FakeClock::new(42_800_000);
        let store = MemoryStore::with_clock(rules, MemoryOptions::default(), clock);
        Engine::new(policy, store).expect("the policy's rules")
    }

    fn fields(engine: &Engine<MemoryStore<FakeClock>>, ruling: &Ruling) -> Vec<(String, String)> {
        engine
            .fields(ruling)
            .iter()
            .map(|(name, value)| {
                let value = std::str::from_utf8(value).expect("text");
                (name.to_string(), value.to_string())
            })
            .collect()
    }

    /// What an engine's observer heard, in order.
    #[derive(Default)]
    struct Heard(std::sync::Mutex<Vec<String>>);

    impl Observer for Heard {
        fn observe(&self, rule: &str, outcome: RuleOutcome, decision: Option<&Decision>) {
            let said = format!("{rule} {outcome:?} {decision:?}");
            self.0.lock().expect("not poisoned").push(said);
        }
    }

    /// The one-charge path and the middleware's admission rule as the
    /// turns do, on every kind of answer a store gives: admitted, admitted
    /// after a shaping delay, denied by a `reject`, a `shadow` and a
    /// `degrade` rule, a cost above capacity refused. Triplet engines on
    /// triplet clocks see the same requests, one decided each way; their
    /// observers hear the same. A request admitted at once gets from
    /// `admit_now` the fields and the outcome the turns' ruling gives.
    #[test]
    fn one_charge_is_ruled_as_the_turns_rule_it() {
        use spillway::algorithm::{LeakyBucket, LeakyMode};
        let three = NonZeroU32::new(3).expect("nonzero");
        let algorithms: [(&str, spillway::algorithm::AnyAlgorithm); 3] = [
            ("bucket", TokenBucket::new(per_minute(3), three).into()),
            ("window", FixedWindow::new(per_minute(3)).into()),
            (
                "shaped",
                LeakyBucket::new(per_minute(3), three, LeakyMode::Shape).into(),
            ),
        ];
        let mut seen = std::collections::BTreeSet::new();
        for (name, algorithm) in algorithms {
            for action in [Action::Reject, Action::Shadow, Action::Degrade] {
                let triplet = || {
                    let policy = Policy::new([HttpRule::new(name, algorithm).action(action)]);
                    let clock = FakeClock::new(42_800_000);
                    let store = MemoryStore::with_clock(
                        policy.store_rules(),
                        MemoryOptions::default(),
                        clock.clone(),
                    );
                    let heard = Arc::new(Heard::default());
                    let observer: Arc<dyn Observer> = heard.clone();
                    let engine = Engine::new(policy, store).expect("its rules");
                    (engine.observed(Some(observer)), clock, heard)
                };
                let (one, one_clock, one_heard) = triplet();
                let (turns, turns_clock, turns_heard) = triplet();
                let (admit, admit_clock, admit_heard) = triplet();
                for (i, cost) in [1, 1, 2, 1, 1, 9, 1, 3, 1].into_iter().enumerate() {
                    let charges = |e: &Engine<_>| smallvec::smallvec![e.charge(0, None, "k", cost)];
                    let a = one.decide_one_now(charges(&one));
                    let b = turns.decide_now_in_turns(charges(&turns), Asking::default());
                    let c = admit.admit_now(charges(&admit));
                    let (a, b) = (a.expect("in memory"), b.expect("in memory"));
                    let what = format!("{name}, {action:?}, request {i}");
                    assert_eq!(format!("{a:?}"), format!("{b:?}"), "{what}");
                    assert_eq!(fields(&one, &a), fields(&turns, &b), "{what}");
                    match c.expect("in memory") {
                        Admission::Admitted(fields) => {
                            seen.insert("admitted at once");
                            let fields: Vec<_> = fields
                                .iter()
                                .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v).into()))
                                .collect();
                            assert_eq!(fields, super::tests::fields(&turns, &b), "{what}");
                            assert!(!turns.holds(&b), "{what}");
                            let admitted = Outcome::Admitted {
                                delay: Duration::ZERO,
                                limited: Vec::new(),
                                shadowed: Vec::new(),
                            };
                            assert_eq!(b.outcome(), &admitted, "{what}");
                        }
                        Admission::Ruled(c) => {
                            seen.insert("ruled");
                            assert_eq!(format!("{c:?}"), format!("{b:?}"), "{what}");
                        }
                    }
                    seen.insert(match a.outcome() {
                        Outcome::Admitted { delay, .. } if !delay.is_zero() => "delayed",
                        Outcome::Admitted { limited, .. } if !limited.is_empty() => "degraded",
                        Outcome::Admitted { shadowed, .. } if !shadowed.is_empty() => "shadowed",
                        Outcome::Admitted { .. } => "admitted",
                        Outcome::Rejected { .. } => "rejected",
                        Outcome::BadRequest(_) => "over capacity",
                        _ => "other",
                    });
                    assert_eq!(
                        format!("{:?}", a.into_outcome(true)),
                        format!("{:?}", b.into_outcome(true)),
                        "{what}"
                    );
                    for clock in [&one_clock, &turns_clock, &admit_clock] {
                        clock.advance(std::time::Duration::from_secs(7));
                    }
                }
                let heard = |h: &Heard| h.0.lock().expect("not poisoned").clone();
                assert_eq!(heard(&one_heard), heard(&turns_heard), "{name}, {action:?}");
                assert_eq!(
                    heard(&admit_heard),
                    heard(&turns_heard),
                    "{name}, {action:?}"
                );
            }
        }
        let every = [
            "admitted",
            "admitted at once",
            "degraded",
            "delayed",
            "over capacity",
            "rejected",
            "ruled",
            "shadowed",
        ];
        assert_eq!(seen, every.into_iter().collect());
    }

    /// A charge given back after its bucket refilled gives nothing: the
    /// refill already returned it, and a refund would hand it out twice.
    #[tokio::test]
    async fn a_charge_given_back_after_its_bucket_refilled_hands_nothing_out_twice() {
        let ten = NonZeroU32::new(10).expect("nonzero");
        let policy = Policy::new([HttpRule::new("api", TokenBucket::new(per_minute(10), ten))]);
        let clock = FakeClock::new(0);
        let store = MemoryStore::with_clock(
            policy.store_rules(),
            MemoryOptions::default(),
            clock.clone(),
        );
        let engine = Engine::new(policy, store).expect("the policy's rules");
        let all = || {
            engine
                .charge_named("api", None, "k".into(), 10)
                .expect("a rule")
        };
        let first = engine
            .decide_now(smallvec::smallvec![all()], Asking::default())
            .expect("in memory");
        let held = first.into_held().expect("charged");
        // A minute on, the bucket is full again, and emptied by another.
        clock.advance(std::time::Duration::from_secs(60));
        let second = engine
            .decide_now(smallvec::smallvec![all()], Asking::default())
            .expect("in memory");
        assert!(matches!(second.outcome(), Outcome::Admitted { .. }));
        held.give_back(&engine).await.expect("in memory");
        let peek = engine
            .decide_now(
                smallvec::smallvec![
                    engine
                        .charge_named("api", None, "k".into(), 0)
                        .expect("a rule")
                ],
                Asking::default(),
            )
            .expect("in memory");
        assert_eq!(peek.decision(0).expect("decided").remaining, 0);
    }

    #[test]
    fn one_rule_is_described_with_the_values_made_for_its_quota() {
        let policy = Policy::new([HttpRule::new("api", FixedWindow::new(per_minute(100)))]);
        let engine = engine(policy, Vec::new());
        let charge = engine
            .charge_named("api", None, "k".into(), 58)
            .expect("a rule");
        let ruling = engine
            .decide_now(smallvec::smallvec![charge], Asking::default())
            .expect("in memory");
        assert!(matches!(ruling.outcome(), Outcome::Admitted { .. }));
        let fields = fields(&engine, &ruling);
        let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
                "ratelimit-policy",
                "ratelimit"
            ]
        );
        assert_eq!(fields[0].1, "100");
        assert_eq!(fields[1].1, "42");
        assert_eq!(fields[3].1, "\"api\";q=100;w=60");
        // 17.2 s to the window's end, rounded up.
        assert_eq!(fields[4].1, "\"api\";r=42;t=18");
    }

    #[test]
    fn a_store_rule_of_the_callers_own_is_reported_under_its_name_and_rejects() {
        let policy = Policy::new([HttpRule::new("api", FixedWindow::new(per_minute(100)))]);
        let own = Rule::new("own:2-per-minute", FixedWindow::new(per_minute(2)));
        let engine = engine(policy, vec![own]);
        assert!(engine.charge_own(RuleId(0), "k", 1).is_none());
        assert!(engine.charge_own(RuleId(2), "k", 1).is_none());
        let charge = || engine.charge_own(RuleId(1), "k", 1).expect("own");
        for _ in 0..2 {
            let ruling = engine
                .decide_now(smallvec::smallvec![charge()], Asking::default())
                .expect("in memory");
            assert!(matches!(ruling.outcome(), Outcome::Admitted { .. }));
        }
        let ruling = engine
            .decide_now(smallvec::smallvec![charge()], Asking::default())
            .expect("in memory");
        assert_eq!(
            ruling.outcome(),
            &Outcome::Rejected {
                rule: "own:2-per-minute".into(),
                retry_after: Duration::from_millis(17_200),
                status: http::StatusCode::TOO_MANY_REQUESTS,
            }
        );
        assert_eq!(ruling.outcome().retry_after_secs(), Some(18));
        let fields = fields(&engine, &ruling);
        assert!(fields.contains(&(
            "ratelimit-policy".into(),
            "\"own:2-per-minute\";q=2;w=60".into()
        )));
        assert!(fields.contains(&("ratelimit".into(), "\"own:2-per-minute\";r=0;t=18".into())));
    }

    #[test]
    fn a_cost_over_capacity_denies_and_the_others_are_only_looked_at_when_asked_so() {
        let policy = Policy::new([
            HttpRule::new("small", FixedWindow::new(per_minute(5))),
            HttpRule::new(
                "bucket",
                TokenBucket::new(per_minute(10), NonZeroU32::new(10).expect("nonzero")),
            ),
        ]);
        let engine = engine(policy, Vec::new());
        let charges = |cost| -> Charges {
            smallvec::smallvec![
                engine.charge(0, None, "k", cost),
                engine.charge(1, None, "k", cost)
            ]
        };
        // Refused: the client's error, as the middleware answers it.
        let refused = engine
            .decide_now(charges(7), Asking::default())
            .expect("in memory");
        assert!(
            matches!(refused.outcome(), Outcome::BadRequest(m) if m.contains("rule `small`")),
            "{:?}",
            refused.outcome()
        );
        // Denied: by the rule it can never pass, charging neither.
        let deny = Asking {
            over_capacity: OverCapacity::Deny,
            look_only: false,
            hold_every: false,
            hold_at_most: None,
        };
        let denied = engine.decide_now(charges(7), deny).expect("in memory");
        assert!(matches!(denied.outcome(), Outcome::Rejected { rule, .. } if rule == "small"));
        assert!(denied.denies(0));
        assert!(!denied.denies(1));
        assert_eq!(denied.reported(), Some(0));
        assert_eq!(denied.decision(1).map(|d| d.remaining), Some(10));
        assert!(denied.into_held().is_none());
        // Looking only charges nothing either.
        let look = Asking {
            over_capacity: OverCapacity::Deny,
            look_only: true,
            hold_every: false,
            hold_at_most: None,
        };
        let looked = engine.decide_now(charges(3), look).expect("in memory");
        assert!(matches!(looked.outcome(), Outcome::Admitted { .. }));
        assert_eq!(looked.decision(0).map(|d| d.remaining), Some(5));
        let charged = engine.decide_now(charges(3), deny).expect("in memory");
        assert_eq!(charged.decision(0).map(|d| d.remaining), Some(2));
        assert_eq!(charged.decision(1).map(|d| d.remaining), Some(7));
        assert_eq!(charged.reported(), Some(0));
        assert_eq!(charged.into_held().map(|h| h.charges.len()), Some(2));
    }
}

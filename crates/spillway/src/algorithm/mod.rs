//! The six algorithms, each a pure transition over integer microseconds.
//!
//! An [`Algorithm`] is a configuration (a quota and whatever else the
//! algorithm needs). Its [`check`](Algorithm::check) takes the key's state,
//! the request's cost and the time, and returns the [`Decision`], updating
//! the state in place when the request is admitted. Nothing here reads a
//! clock or does I/O, so the in-memory store, the Redis scripts and the
//! simulator all run the same transitions.
//!
//! See `docs/algorithms.md` for the definitions, with their formulas.
#![doc = ""]
// crates/spillway/docs/algorithms.md is a link to the repository's
// docs/algorithms.md: the guide stays with the others, and the package,
// which may only include its own files, holds a copy of it.
#![doc = include_str!("../../docs/algorithms.md")]

mod any;
pub mod calendar;
pub mod concurrency;
pub mod fixed_window;
mod gcra;
pub mod leaky_bucket;
pub mod sliding_log;
pub mod sliding_window;
pub mod token_bucket;

use std::fmt;

pub use any::{AnyAlgorithm, AnyState, AnyUndo};
pub use calendar::{Calendar, Period};
pub use concurrency::{Concurrency, Lease, LeaseState, Renewed};
pub use fixed_window::FixedWindow;
pub use leaky_bucket::{LeakyBucket, LeakyMode};
pub use sliding_log::SlidingLog;
pub use sliding_window::SlidingWindow;
pub use token_bucket::TokenBucket;

use crate::Quota;
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;

/// A rate-limiting algorithm with its configuration.
///
/// The contract every implementation keeps (and the conformance suite checks):
/// - `check` changes `state` only when it admits a request of cost > 0
///   (dropping state that has already expired is allowed: it is invisible);
/// - cost 0 never changes anything and is always allowed;
/// - a cost above [`capacity`](Algorithm::capacity) is [`CostTooLarge`];
/// - a denial's `retry_after` is exact: at `now + retry_after` the same
///   request is admitted, one microsecond earlier it is not;
/// - [`undo`](Algorithm::undo) with the [`Undo`](Algorithm::Undo) of a
///   [`check_undoable`](Algorithm::check_undoable) leaves a state that
///   decides every later request exactly as the state before that check
///   (less what had expired by then), even on a clock set back.
pub trait Algorithm: Clone + fmt::Debug + Send + Sync + 'static {
    /// What the algorithm remembers about one key. `Default` is a key never
    /// seen, and any state whose [`idle_at`](Algorithm::idle_at) has passed
    /// behaves exactly like it.
    type State: Default + Clone + fmt::Debug + Send + Sync + 'static;

    /// How to take back one charge that
    /// [`check_undoable`](Algorithm::check_undoable) has just made, as when
    /// another rule of the same request denies it. Cheap to make: a copy of
    /// the state before the charge when the state is a few integers, only
    /// the charge itself for the sliding log (whose log may be long).
    type Undo: fmt::Debug;

    /// The quota this algorithm enforces.
    fn quota(&self) -> Quota;

    /// The most a single request can cost.
    fn capacity(&self) -> u64;

    /// Decides on a request of `cost` at `now`, charging `state` if it is
    /// admitted.
    fn check(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge>;

    /// [`check`](Algorithm::check), and when it charges the state (admits
    /// a cost above 0), how to [`undo`](Algorithm::undo) that charge. `None`
    /// when nothing was charged: a denial or a cost of 0 has nothing to take
    /// back.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::{Algorithm, TokenBucket};
    /// use spillway::clock::{Clock, FakeClock};
    /// use spillway::Quota;
    ///
    /// let nz = |n| NonZeroU32::new(n).unwrap();
    /// let clock = FakeClock::new(5_000_000);
    /// let tb = TokenBucket::new(Quota::per_second(nz(10)), nz(3));
    /// let mut state = Default::default();
    /// let (decision, undo) = tb.check_undoable(&mut state, 2, clock.now()).unwrap();
    /// assert_eq!((decision.allowed, decision.remaining), (true, 1));
    /// // Another rule denied the request: the tokens go back.
    /// tb.undo(&mut state, undo.expect("admitted, so charged"));
    /// assert_eq!(tb.check(&mut state, 0, clock.now()).unwrap().remaining, 3);
    /// // A denial charges nothing, so there is nothing to undo.
    /// tb.check(&mut state, 3, clock.now()).unwrap();
    /// let (denied, undo) = tb.check_undoable(&mut state, 1, clock.now()).unwrap();
    /// assert!(!denied.allowed);
    /// assert!(undo.is_none());
    /// ```
    fn check_undoable(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<(Decision, Option<Self::Undo>), CostTooLarge>;

    /// Takes back the charge that `undo` came from. `state` is the state
    /// that check charged, with any charge made since already undone (undo
    /// the newest first). The state then decides every later request as the
    /// one before the check would have (less what had expired by then), even
    /// after the clock was set back, when [`refund`](Algorithm::refund) may
    /// not find the charge. On a fresh state (the key was forgotten in
    /// between) it leaves a state no more charged than the one before the
    /// check.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use spillway::algorithm::{Algorithm, FixedWindow};
    /// use spillway::clock::{Clock, FakeClock};
    /// use spillway::Quota;
    ///
    /// let fw = FixedWindow::new(Quota::new(NonZeroU32::new(2).unwrap(), Duration::from_micros(1_000)).unwrap());
    /// let clock = FakeClock::new(1_500);
    /// let mut state = Default::default();
    /// fw.check(&mut state, 1, clock.now()).unwrap();
    /// // The clock is set back into the previous window: the charge still
    /// // counts in the stored window, which a refund at this time would miss.
    /// clock.set(900);
    /// let (_, undo) = fw.check_undoable(&mut state, 1, clock.now()).unwrap();
    /// assert_eq!(fw.check(&mut state.clone(), 0, clock.now()).unwrap().remaining, 0);
    /// fw.undo(&mut state, undo.unwrap());
    /// assert_eq!(fw.check(&mut state, 0, clock.now()).unwrap().remaining, 1);
    /// ```
    fn undo(&self, state: &mut Self::State, undo: Self::Undo);

    /// Gives back a charge of `cost` that was admitted at `charged_at`, as
    /// when a request admitted earlier will not be served after all.
    /// Refunding right after the charge, on a clock that has not gone back,
    /// restores a state equivalent to the one before it; to take back a
    /// charge just made, [`undo`](Algorithm::undo) is exact in every case.
    fn refund(&self, state: &mut Self::State, cost: u64, charged_at: Micros);

    /// Settles an admitted charge at its `actual` cost, at `now`, once the
    /// cost is known (the tokens of a response, the bytes sent): the
    /// difference is given back when `actual` is lower, and charged when it
    /// is higher, as of the charge's time. Over the quota is debt: later
    /// requests are denied, with an exact `retry_after`, until it is paid
    /// back. `actual == charged.cost` changes nothing. Each algorithm's
    /// rule is in `docs/algorithms.md`, "Settling a charge":
    /// - the windows adjust the window the charge went to; a give-back
    ///   after that window ended changes nothing (its count decides nothing
    ///   any more), an overrun is counted in the window of `now`;
    /// - the sliding log adjusts the entry the charge went to, never
    ///   another; gone from the window, as the windows;
    /// - the buckets move by the part of the difference refill has not
    ///   already paid back by `now`, the charge having ended at
    ///   `charged.at + charged.reset_after`: a give-back after the bucket
    ///   refilled past the charge gives nothing, so no cost is handed out
    ///   twice.
    ///
    /// A store makes a settle idempotent (the same settle twice changes
    /// nothing); this transition does not know settles apart.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::{Algorithm, Charged, TokenBucket};
    /// use spillway::Quota;
    ///
    /// let nz = |n| NonZeroU32::new(n).unwrap();
    /// // 10 a second, 10 at most.
    /// let tb = TokenBucket::new(Quota::per_second(nz(10)), nz(10));
    /// let mut state = Default::default();
    /// // 5 reserved at 0 s...
    /// let reserved = tb.check(&mut state, 5, 0).unwrap();
    /// let charged = Charged::of(5, 0, &reserved);
    /// // ...but the response cost 15, 5 more than the bucket holds: the
    /// // next unit fits once 6 have come back, at 0.6 s.
    /// tb.settle(&mut state, charged, 15, 0);
    /// let denied = tb.check(&mut state, 1, 0).unwrap();
    /// assert!(!denied.allowed);
    /// assert_eq!(denied.retry_after.unwrap().as_micros(), 600_000);
    /// assert!(tb.check(&mut state, 1, 600_000).unwrap().allowed);
    /// ```
    fn settle(&self, state: &mut Self::State, charged: Charged, actual: u64, now: Micros);

    /// From this time on the state is the same as a fresh one, so the key can
    /// be forgotten (and a Redis key can expire).
    fn idle_at(&self, state: &Self::State) -> Micros;
}

/// Fails when `cost` can never fit in `capacity`.
fn ensure_fits(cost: u64, capacity: u64) -> Result<(), CostTooLarge> {
    if cost > capacity {
        Err(CostTooLarge { cost, capacity })
    } else {
        Ok(())
    }
}

/// `ceil(a / b)` for `b > 0`.
fn div_ceil(a: u128, b: u128) -> u128 {
    a.div_ceil(b)
}

/// Narrows a duration in microseconds, saturating: only absurd
/// configurations get near the limit.
fn to_micros(v: u128) -> Micros {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// `count` plus a settle's overrun `extra`, owing at most one quota: the
/// result is at most `2 * quota` (or `count`, were it above already). A
/// key in debt waits at most about one period more than a full one, and
/// every store's arithmetic stays exact (Lua's below 2^53).
fn owing_at_most_one_quota(count: u64, extra: u64, quota: u64) -> u64 {
    count
        .saturating_add(extra)
        .min(count.max(quota.saturating_mul(2)))
}

/// An admitted charge, as a later [`settle`](Algorithm::settle) names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charged {
    /// The cost charged (a reservation).
    pub cost: u64,
    /// The time of the decision that charged it (the store's clock).
    pub at: Micros,
    /// That decision's `reset_after`, in microseconds: a bucket's charge
    /// ends at `at + reset_after`, when the bucket would be whole again with
    /// nothing charged after it.
    pub reset_after: Micros,
    /// The charge is a reservation the store holds open under its
    /// request's settle id ([`Store::reserve`](crate::store::Store::reserve)
    /// on a rule that [releases](crate::store::Rule::release_unsettled_after)
    /// what is not settled in time): the settle that names it closes it,
    /// and finds it already given back if it was not settled in time.
    pub held: bool,
}

impl Charged {
    /// The charge of `cost` that `decision`, made at `at`, admitted.
    pub fn of(cost: u64, at: Micros, decision: &Decision) -> Self {
        Self {
            cost,
            at,
            reset_after: u64::try_from(decision.reset_after.as_micros()).unwrap_or(u64::MAX),
            held: false,
        }
    }

    /// The same charge, held open ([`held`](Self::held)).
    pub fn held_open(self) -> Self {
        Self { held: true, ..self }
    }
}

/// [`Algorithm::check_undoable`] for the algorithms whose state is a few
/// integers: the undo is a copy of the state before the check, which puts
/// it back exactly whatever the clock did.
fn check_keeping_a_copy<A>(
    alg: &A,
    state: &mut A::State,
    cost: u64,
    now: Micros,
) -> Result<(Decision, Option<A::State>), CostTooLarge>
where
    A: Algorithm,
    A::State: Copy,
{
    let before = *state;
    let decision = alg.check(state, cost, now)?;
    Ok((decision, (decision.allowed && cost > 0).then_some(before)))
}

/// Charges `cost` at `now` on a copy of `before` and undoes the charge.
/// The state must then decide every request (every cost, at every time
/// from `now` until well after `before` is idle) exactly as `before` does.
/// Earlier than `now` (a clock set back after the undo) it may also decide
/// as `before` less what had expired at `now`, which a denial at `now`
/// would have dropped too. Returns the state after the undo.
#[cfg(test)]
fn assert_undo_restores<A: Algorithm>(
    alg: &A,
    before: &A::State,
    cost: u64,
    now: Micros,
) -> A::State {
    let mut state = before.clone();
    let (decision, undo) = alg.check_undoable(&mut state, cost, now).expect("fits");
    assert!(decision.allowed, "the charge to undo is admitted");
    alg.undo(&mut state, undo.expect("an admitted charge can be undone"));
    let mut denied = before.clone();
    assert!(alg.check(&mut denied, 0, now).expect("a peek fits").allowed);
    let period = alg.quota().period_micros();
    let from = now.saturating_sub(2 * period);
    let to = alg.idle_at(before).max(now) + 2 * period;
    let step = usize::try_from(((to - from) / 5_000).max(1)).expect("small");
    for t in (from..=to).step_by(step).chain([now]) {
        for c in 0..=alg.capacity() {
            let got = alg.check(&mut state.clone(), c, t);
            let want = alg.check(&mut before.clone(), c, t);
            if t < now && got != want {
                assert_eq!(got, alg.check(&mut denied.clone(), c, t), "cost {c} at {t}");
            } else {
                assert_eq!(got, want, "cost {c} at {t}, after undoing {cost} at {now}");
            }
        }
    }
    state
}

/// Charges `cost` at `now` on a copy of `before` and settles it at once at
/// `actual` (at most the capacity): the state must then decide every
/// request (every cost, at every time from `now` until well after both are
/// idle) exactly as a copy of `before` that was charged `actual` in the
/// first place. Returns the settled state.
#[cfg(test)]
fn assert_settle_as_if_charged<A: Algorithm>(
    alg: &A,
    before: &A::State,
    cost: u64,
    actual: u64,
    now: Micros,
) -> A::State {
    let mut settled = before.clone();
    let decision = alg.check(&mut settled, cost, now).expect("fits");
    assert!(decision.allowed, "the charge to settle is admitted");
    alg.settle(&mut settled, Charged::of(cost, now, &decision), actual, now);
    let mut direct = before.clone();
    assert!(alg.check(&mut direct, actual, now).expect("fits").allowed);
    let period = alg.quota().period_micros();
    let to = alg.idle_at(&settled).max(alg.idle_at(&direct)).max(now) + 2 * period;
    let step = usize::try_from(((to - now) / 5_000).max(1)).expect("small");
    for t in (now..=to).step_by(step) {
        for c in 0..=alg.capacity() {
            assert_eq!(
                alg.check(&mut settled.clone(), c, t),
                alg.check(&mut direct.clone(), c, t),
                "cost {c} at {t}, {cost} settled at {actual} at {now}"
            );
        }
    }
    settled
}

/// A denial of `cost` at `now` whose `retry_after` is exact: admitted then,
/// denied a microsecond before.
#[cfg(test)]
fn assert_retry_exact<A: Algorithm>(alg: &A, state: &A::State, cost: u64, now: Micros) -> Micros {
    let denied = alg.check(&mut state.clone(), cost, now).expect("fits");
    assert!(!denied.allowed, "{cost} at {now} is denied");
    let retry = u64::try_from(denied.retry_after.expect("a denial").as_micros()).expect("small");
    assert!(retry > 0);
    assert!(
        !alg.check(&mut state.clone(), cost, now + retry - 1)
            .expect("fits")
            .allowed
    );
    assert!(
        alg.check(&mut state.clone(), cost, now + retry)
            .expect("fits")
            .allowed
    );
    retry
}

//! One type for "any of the six", for stores that hold several rules.

use super::concurrency::{LeaseState, LeaseUndo};
use super::fixed_window::FixedWindowState;
use super::gcra::Tat;
use super::sliding_log::{SlidingLogState, SlidingLogUndo};
use super::sliding_window::SlidingWindowState;
use super::{
    Algorithm, Charged, Concurrency, FixedWindow, LeakyBucket, LeakyMode, Renewed, SlidingLog,
    SlidingWindow, TokenBucket,
};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;
use crate::quota::Quota;
use std::num::NonZeroU32;

/// Any of the six algorithms, chosen at run time (from a configuration
/// file, say).
///
/// ```
/// use std::num::NonZeroU32;
/// use spillway::algorithm::{Algorithm, AnyAlgorithm, FixedWindow};
/// use spillway::Quota;
///
/// let any = AnyAlgorithm::from(FixedWindow::new(Quota::per_minute(NonZeroU32::new(100).unwrap())));
/// assert_eq!(any.name(), "fixed_window");
/// assert_eq!(any.capacity(), 100);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnyAlgorithm {
    /// See [`FixedWindow`].
    FixedWindow(FixedWindow),
    /// See [`SlidingLog`].
    SlidingLog(SlidingLog),
    /// See [`SlidingWindow`].
    SlidingWindow(SlidingWindow),
    /// See [`TokenBucket`].
    TokenBucket(TokenBucket),
    /// See [`LeakyBucket`].
    LeakyBucket(LeakyBucket),
    /// See [`Concurrency`].
    Concurrency(Concurrency),
}

/// The state of any of the six algorithms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AnyState {
    /// A key never seen (or forgotten): fresh for every algorithm.
    #[default]
    Fresh,
    /// A fixed window's count.
    FixedWindow(FixedWindowState),
    /// A sliding log.
    SlidingLog(SlidingLogState),
    /// A concurrency rule's leases.
    Leases(LeaseState),
    /// A sliding window's counts.
    SlidingWindow(SlidingWindowState),
    /// A token or leaky bucket's timestamp.
    Bucket(Tat),
}

/// How to take back a charge that [`AnyAlgorithm`] has just made: the
/// chosen algorithm's own [`Undo`](Algorithm::Undo), or, when the key was
/// fresh, "fresh again".
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use spillway::algorithm::{Algorithm, AnyAlgorithm, AnyState, SlidingLog};
/// use spillway::clock::{Clock, FakeClock};
/// use spillway::Quota;
///
/// let any = AnyAlgorithm::from(SlidingLog::new(Quota::new(NonZeroU32::new(2).unwrap(), Duration::from_micros(1_000)).unwrap()));
/// let clock = FakeClock::new(10_000);
/// let mut state = AnyState::default();
/// let (_, undo) = any.check_undoable(&mut state, 2, clock.now()).unwrap();
/// assert!(!any.check(&mut state.clone(), 1, clock.now()).unwrap().allowed);
/// any.undo(&mut state, undo.unwrap());
/// assert_eq!(state, AnyState::Fresh);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnyUndo(Undo);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Undo {
    /// The key was fresh before the charge.
    Fresh,
    FixedWindow(FixedWindowState),
    SlidingLog(SlidingLogUndo),
    SlidingWindow(SlidingWindowState),
    Bucket(Tat),
    Leases(LeaseUndo),
}

impl AnyAlgorithm {
    /// This algorithm with its limit and capacity divided among `instances`
    /// (rounded down, at least 1): what one of `instances` service
    /// instances enforces on its own when they cannot share a store.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::{Algorithm, AnyAlgorithm, TokenBucket};
    /// use spillway::Quota;
    ///
    /// let nz = |n| NonZeroU32::new(n).unwrap();
    /// let shared = AnyAlgorithm::from(TokenBucket::new(Quota::per_minute(nz(100)), nz(10)));
    /// let alone = shared.share(nz(4));
    /// assert_eq!(alone.quota().limit().get(), 25);
    /// assert_eq!(alone.capacity(), 2);
    /// ```
    pub fn share(&self, instances: NonZeroU32) -> Self {
        let n = instances.get();
        let part = |v: u32| NonZeroU32::new(v / n).unwrap_or(NonZeroU32::MIN);
        let quota = self.quota();
        let quota = Quota::new(part(quota.limit().get()), quota.period())
            .expect("the period was already valid");
        match self {
            Self::FixedWindow(a) => a.with_limit(quota.limit()).into(),
            Self::SlidingLog(_) => SlidingLog::new(quota).into(),
            Self::SlidingWindow(_) => SlidingWindow::new(quota).into(),
            Self::TokenBucket(a) => TokenBucket::new(quota, part(a.burst().get())).into(),
            Self::LeakyBucket(a) => {
                let capacity = part(u32::try_from(a.capacity()).unwrap_or(u32::MAX));
                LeakyBucket::new(quota, capacity, a.mode())
                    .with_delay(a.undelayed() / n)
                    .into()
            }
            Self::Concurrency(_) => Concurrency::new(quota).into(),
        }
    }

    /// The algorithm's name, as written in configuration files.
    pub const fn name(&self) -> &'static str {
        match self {
            Self::FixedWindow(_) => "fixed_window",
            Self::SlidingLog(_) => "sliding_log",
            Self::SlidingWindow(_) => "sliding_window",
            Self::TokenBucket(_) => "token_bucket",
            Self::LeakyBucket(_) => "leaky_bucket",
            Self::Concurrency(_) => "concurrency",
        }
    }

    /// Whether a key's state under `old` means the same under `self`: the
    /// same algorithm (a leaky bucket in the same mode) over the same
    /// window, whatever the limit or the burst. A store keeps such a rule's
    /// keys when it is reconfigured, so that raising or lowering a limit
    /// mid-window carries every key's count over rather than handing each a
    /// fresh quota. A window's count and a log are kept as they are; a
    /// bucket keeps its time of being full again, so what was used is then
    /// repaid at the new rate.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use spillway::algorithm::{AnyAlgorithm, FixedWindow, SlidingLog};
    /// use spillway::Quota;
    ///
    /// let per_minute = |n| Quota::per_minute(NonZeroU32::new(n).unwrap());
    /// let five = AnyAlgorithm::from(FixedWindow::new(per_minute(5)));
    /// let ten = AnyAlgorithm::from(FixedWindow::new(per_minute(10)));
    /// assert!(ten.keeps_state_of(&five));
    /// let hourly = Quota::new(NonZeroU32::new(10).unwrap(), Duration::from_secs(3600)).unwrap();
    /// assert!(!AnyAlgorithm::from(FixedWindow::new(hourly)).keeps_state_of(&five));
    /// assert!(!AnyAlgorithm::from(SlidingLog::new(per_minute(5))).keeps_state_of(&five));
    /// ```
    pub fn keeps_state_of(&self, old: &AnyAlgorithm) -> bool {
        self.state_meaning() == old.state_meaning()
    }

    /// What a key's state means under this algorithm, as text: two
    /// algorithms whose states mean the same have the same text
    /// ([`keeps_state_of`](Self::keeps_state_of)), and a state file records
    /// it beside each rule's keys, so that they are read back only into a
    /// rule where they still mean what they did.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::{AnyAlgorithm, FixedWindow, TokenBucket};
    /// use spillway::Quota;
    ///
    /// let nz = |n| NonZeroU32::new(n).unwrap();
    /// let window = AnyAlgorithm::from(FixedWindow::new(Quota::per_minute(nz(5))));
    /// assert_eq!(window.state_meaning(), "fixed_window 60000000");
    /// let bucket = AnyAlgorithm::from(TokenBucket::new(Quota::per_second(nz(10)), nz(20)));
    /// assert_eq!(bucket.state_meaning(), "token_bucket 1000000");
    /// ```
    pub fn state_meaning(&self) -> String {
        let period = self.quota().period_micros();
        match self {
            // Leases end when they say, under any lease time, and
            // forgetting them would let a new limit's worth in beside those
            // inside.
            Self::Concurrency(_) => "concurrency".to_string(),
            Self::LeakyBucket(a) => {
                let mode = match a.mode() {
                    LeakyMode::Shape => "shape",
                    LeakyMode::Police => "police",
                };
                format!("leaky_bucket {mode} {period}")
            }
            // A calendar's periods are not a fixed length's windows, nor
            // another calendar's.
            Self::FixedWindow(a) => match a.calendar_of() {
                Some(c) => format!(
                    "fixed_window {} {} {period}",
                    c.period().name(),
                    c.zone().name()
                ),
                None => format!("fixed_window {period}"),
            },
            other => format!("{} {period}", other.name()),
        }
    }
}

/// Runs `$body` with `$a` bound to the concrete algorithm and `$s` to its
/// state, turning a state of another kind (or `Fresh`) into a fresh one.
macro_rules! dispatch {
    ($self:expr, $state:expr, |$a:ident, $s:ident| $body:expr) => {
        match $self {
            AnyAlgorithm::FixedWindow($a) => {
                let $s = state_of!($state, FixedWindow);
                $body
            }
            AnyAlgorithm::SlidingLog($a) => {
                let $s = state_of!($state, SlidingLog);
                $body
            }
            AnyAlgorithm::SlidingWindow($a) => {
                let $s = state_of!($state, SlidingWindow);
                $body
            }
            AnyAlgorithm::TokenBucket($a) => {
                let $s = state_of!($state, Bucket);
                $body
            }
            AnyAlgorithm::LeakyBucket($a) => {
                let $s = state_of!($state, Bucket);
                $body
            }
            AnyAlgorithm::Concurrency($a) => {
                let $s = state_of!($state, Leases);
                $body
            }
        }
    };
}

macro_rules! state_of {
    ($state:expr, $variant:ident) => {{
        if !matches!($state, AnyState::$variant(_)) {
            *$state = AnyState::$variant(Default::default());
        }
        match $state {
            AnyState::$variant(s) => s,
            _ => unreachable!("just set to this variant"),
        }
    }};
}

impl Algorithm for AnyAlgorithm {
    type State = AnyState;
    type Undo = AnyUndo;

    fn quota(&self) -> Quota {
        match self {
            Self::FixedWindow(a) => a.quota(),
            Self::SlidingLog(a) => a.quota(),
            Self::SlidingWindow(a) => a.quota(),
            Self::TokenBucket(a) => a.quota(),
            Self::LeakyBucket(a) => a.quota(),
            Self::Concurrency(a) => a.quota(),
        }
    }

    fn capacity(&self) -> u64 {
        match self {
            Self::FixedWindow(a) => a.capacity(),
            Self::SlidingLog(a) => a.capacity(),
            Self::SlidingWindow(a) => a.capacity(),
            Self::TokenBucket(a) => a.capacity(),
            Self::LeakyBucket(a) => a.capacity(),
            Self::Concurrency(a) => a.capacity(),
        }
    }

    fn check(
        &self,
        state: &mut AnyState,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge> {
        let fresh = matches!(state, AnyState::Fresh);
        let decision = dispatch!(self, state, |a, s| a.check(s, cost, now));
        if fresh && !matches!(decision, Ok(Decision { allowed: true, .. })) {
            // Keep "never seen" cheap to recognise.
            *state = AnyState::Fresh;
        }
        decision
    }

    fn check_undoable(
        &self,
        state: &mut AnyState,
        cost: u64,
        now: Micros,
    ) -> Result<(Decision, Option<AnyUndo>), CostTooLarge> {
        if matches!(state, AnyState::Fresh) {
            let decision = self.check(state, cost, now)?;
            let undo = (decision.allowed && cost > 0).then_some(AnyUndo(Undo::Fresh));
            return Ok((decision, undo));
        }
        let (decision, undo) = match self {
            Self::FixedWindow(a) => {
                let (d, u) = a.check_undoable(state_of!(state, FixedWindow), cost, now)?;
                (d, u.map(Undo::FixedWindow))
            }
            Self::SlidingLog(a) => {
                let (d, u) = a.check_undoable(state_of!(state, SlidingLog), cost, now)?;
                (d, u.map(Undo::SlidingLog))
            }
            Self::SlidingWindow(a) => {
                let (d, u) = a.check_undoable(state_of!(state, SlidingWindow), cost, now)?;
                (d, u.map(Undo::SlidingWindow))
            }
            Self::TokenBucket(a) => {
                let (d, u) = a.check_undoable(state_of!(state, Bucket), cost, now)?;
                (d, u.map(Undo::Bucket))
            }
            Self::LeakyBucket(a) => {
                let (d, u) = a.check_undoable(state_of!(state, Bucket), cost, now)?;
                (d, u.map(Undo::Bucket))
            }
            Self::Concurrency(a) => {
                let (d, u) = a.check_undoable(state_of!(state, Leases), cost, now)?;
                (d, u.map(Undo::Leases))
            }
        };
        Ok((decision, undo.map(AnyUndo)))
    }

    fn undo(&self, state: &mut AnyState, undo: AnyUndo) {
        match (self, undo.0) {
            (_, Undo::Fresh) => *state = AnyState::Fresh,
            (Self::FixedWindow(a), Undo::FixedWindow(u)) => {
                a.undo(state_of!(state, FixedWindow), u);
            }
            (Self::SlidingLog(a), Undo::SlidingLog(u)) => a.undo(state_of!(state, SlidingLog), u),
            (Self::SlidingWindow(a), Undo::SlidingWindow(u)) => {
                a.undo(state_of!(state, SlidingWindow), u);
            }
            (Self::TokenBucket(a), Undo::Bucket(u)) => a.undo(state_of!(state, Bucket), u),
            (Self::LeakyBucket(a), Undo::Bucket(u)) => a.undo(state_of!(state, Bucket), u),
            (Self::Concurrency(a), Undo::Leases(u)) => a.undo(state_of!(state, Leases), u),
            // Made by another algorithm: no charge of this one to take back.
            _ => {}
        }
    }

    fn refund(&self, state: &mut AnyState, cost: u64, charged_at: Micros) {
        if !matches!(state, AnyState::Fresh) {
            dispatch!(self, state, |a, s| a.refund(s, cost, charged_at));
        }
    }

    fn settle(&self, state: &mut AnyState, charged: Charged, actual: u64, now: Micros) {
        // A forgotten key has nothing left to give back; an overrun is
        // charged to a fresh state.
        if matches!(state, AnyState::Fresh) && actual <= charged.cost {
            return;
        }
        dispatch!(self, state, |a, s| a.settle(s, charged, actual, now));
    }

    #[inline]
    fn idle_at(&self, state: &AnyState) -> Micros {
        match (self, state) {
            (Self::FixedWindow(a), AnyState::FixedWindow(s)) => a.idle_at(s),
            (Self::SlidingLog(a), AnyState::SlidingLog(s)) => a.idle_at(s),
            (Self::SlidingWindow(a), AnyState::SlidingWindow(s)) => a.idle_at(s),
            (Self::TokenBucket(a), AnyState::Bucket(s)) => a.idle_at(s),
            (Self::LeakyBucket(a), AnyState::Bucket(s)) => a.idle_at(s),
            (Self::Concurrency(a), AnyState::Leases(s)) => a.idle_at(s),
            // Fresh, or a state this algorithm would start over from.
            _ => 0,
        }
    }
}

impl AnyAlgorithm {
    /// `charged` once given back whole (settled at 0): a charge of nothing
    /// at its time, as a later settle of what the request cost must name
    /// it. A bucket's charge of nothing ends where the given-back one
    /// began: its end moves back by the cost's time (rounded down, so
    /// never before it). The windows and the log name a charge by its
    /// time alone.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::{AnyAlgorithm, Charged, TokenBucket};
    /// use spillway::Quota;
    ///
    /// let nz = |n| NonZeroU32::new(n).unwrap();
    /// // 10 a second: a unit is 100 ms.
    /// let tb = AnyAlgorithm::from(TokenBucket::new(Quota::per_second(nz(10)), nz(10)));
    /// let charged = Charged { cost: 8, at: 0, reset_after: 800_000, held: true };
    /// let back = tb.given_back(charged);
    /// assert_eq!((back.cost, back.at, back.reset_after), (0, 0, 0));
    /// ```
    pub fn given_back(&self, charged: Charged) -> Charged {
        let reset_after = match self {
            Self::TokenBucket(_) | Self::LeakyBucket(_) => {
                let i = self.quota().emission_interval();
                let back = u128::from(charged.cost) * u128::from(i.micros) / u128::from(i.per);
                charged
                    .reset_after
                    .saturating_sub(u64::try_from(back).unwrap_or(u64::MAX))
            }
            _ => charged.reset_after,
        };
        Charged {
            cost: 0,
            reset_after,
            ..charged
        }
    }

    /// Renews a concurrency rule's lease ([`Concurrency::renew`]); `None`
    /// for the other algorithms, which hold no leases.
    pub fn renew(
        &self,
        state: &mut AnyState,
        charged: Charged,
        now: Micros,
    ) -> Option<Result<Renewed, CostTooLarge>> {
        match self {
            Self::Concurrency(a) => Some(a.renew(state_of!(state, Leases), charged, now)),
            _ => None,
        }
    }
}

impl From<FixedWindow> for AnyAlgorithm {
    fn from(a: FixedWindow) -> Self {
        Self::FixedWindow(a)
    }
}

impl From<SlidingLog> for AnyAlgorithm {
    fn from(a: SlidingLog) -> Self {
        Self::SlidingLog(a)
    }
}

impl From<SlidingWindow> for AnyAlgorithm {
    fn from(a: SlidingWindow) -> Self {
        Self::SlidingWindow(a)
    }
}

impl From<TokenBucket> for AnyAlgorithm {
    fn from(a: TokenBucket) -> Self {
        Self::TokenBucket(a)
    }
}

impl From<LeakyBucket> for AnyAlgorithm {
    fn from(a: LeakyBucket) -> Self {
        Self::LeakyBucket(a)
    }
}

impl From<Concurrency> for AnyAlgorithm {
    fn from(a: Concurrency) -> Self {
        Self::Concurrency(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{LeakyMode, assert_undo_restores};
    use std::time::Duration;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn undo_puts_back_the_state_before_the_charge_for_each_algorithm() {
        let quota = Quota::new(nz(4), Duration::from_micros(1000)).unwrap();
        let all: [AnyAlgorithm; 7] = [
            FixedWindow::new(quota).into(),
            SlidingLog::new(quota).into(),
            SlidingWindow::new(quota).into(),
            TokenBucket::new(quota, nz(4)).into(),
            LeakyBucket::new(quota, nz(4), LeakyMode::Shape).into(),
            LeakyBucket::new(quota, nz(4), LeakyMode::Police).into(),
            Concurrency::new(quota).into(),
        ];
        for any in all {
            // A key never seen is fresh again.
            let fresh = AnyState::Fresh;
            assert_eq!(assert_undo_restores(&any, &fresh, 4, 10_300), fresh);
            let mut s = AnyState::Fresh;
            any.check(&mut s, 2, 10_300).unwrap();
            // Now, and on a clock set back.
            for (cost, now) in [(2, 10_300), (1, 10_100)] {
                let after = assert_undo_restores(&any, &s, cost, now);
                assert_eq!(after, s, "{} {cost} at {now}", any.name());
            }
        }
    }

    #[test]
    fn a_concurrency_rule_keeps_its_leases_whatever_its_new_lease_or_limit() {
        let lease = |slots, secs| {
            AnyAlgorithm::from(Concurrency::new(
                Quota::new(nz(slots), Duration::from_secs(secs)).unwrap(),
            ))
        };
        assert!(lease(5, 30).keeps_state_of(&lease(5, 60)));
        assert!(lease(2, 30).keeps_state_of(&lease(5, 30)));
        let log = AnyAlgorithm::from(SlidingLog::new(
            Quota::new(nz(5), Duration::from_secs(30)).unwrap(),
        ));
        assert!(!lease(5, 30).keeps_state_of(&log));
        assert!(!log.keeps_state_of(&lease(5, 30)));
    }

    #[test]
    fn an_undo_of_another_algorithm_changes_nothing() {
        let quota = Quota::new(nz(4), Duration::from_micros(1000)).unwrap();
        let (fw, log) = (
            AnyAlgorithm::from(FixedWindow::new(quota)),
            AnyAlgorithm::from(SlidingLog::new(quota)),
        );
        let mut s = AnyState::Fresh;
        fw.check(&mut s, 1, 0).unwrap();
        let (_, undo) = fw.check_undoable(&mut s, 1, 0).unwrap();
        let before = s.clone();
        log.undo(&mut s, undo.unwrap());
        assert_eq!(s, before);
    }
}

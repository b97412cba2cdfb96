//! Concurrency: at most `slots` requests in flight per key, each slot a
//! lease that ends by itself.
//!
//! A request takes a slot when it is admitted and gives it back when it has
//! been served (a [`settle`](Algorithm::settle) at cost 0: a release). A
//! slot that is never given back, because the process that held it died
//! or lost the store, is free again when its lease ends, `lease` after it
//! was taken or last [renewed](Concurrency::renew): a crash leaks nothing
//! past one lease. A request that runs longer than its lease renews it
//! while it runs.
//!
//! The state is a log of leases `(stamp, slots)`, oldest first, as in the
//! sliding log whose window is the lease: a lease is held while
//! `now < stamp + lease`. Each lease has an entry of its own, its stamp
//! unique on its key: taken at `now`, or a microsecond after the newest
//! lease when that one is stamped `now` or later (the same microsecond, a
//! clock set back). A charge names its lease by the decision that made it:
//! the stamp is `at + reset_after - lease` ([`Concurrency::stamp`]), the
//! newest lease being the one just taken. A denial's `retry_after` is exact for a world where nobody
//! releases: the time until enough leases end. Most slots come back sooner,
//! when their requests finish; a front end says so (see
//! `docs/algorithms.md`).
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::Duration;
//! use spillway::algorithm::{Algorithm, Charged, Concurrency};
//! use spillway::Quota;
//!
//! // 2 in flight, leases of 30 s.
//! let cc = Concurrency::new(Quota::new(NonZeroU32::new(2).unwrap(), Duration::from_secs(30)).unwrap());
//! let mut state = Default::default();
//! let first = cc.check(&mut state, 1, 0).unwrap();
//! assert!(cc.check(&mut state, 1, 1_000).unwrap().allowed);
//! let third = cc.check(&mut state, 1, 2_000).unwrap();
//! assert!(!third.allowed);
//! // With nobody releasing, the first lease ends at 30 s.
//! assert_eq!(third.retry_after, Some(Duration::from_micros(30_000_000 - 2_000)));
//! // The first request is served: its slot comes back at once.
//! cc.settle(&mut state, Charged::of(1, 0, &first), 0, 3_000);
//! assert!(cc.check(&mut state, 1, 3_000).unwrap().allowed);
//! ```

#[cfg(test)]
use super::sliding_log::LogEntry;
use super::sliding_log::{SlidingLogState, SlidingLogUndo};
use super::{Algorithm, Charged, SlidingLog};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;
use crate::quota::Quota;

/// The concurrency algorithm's configuration: `quota.limit()` slots per
/// key, each lease lasting `quota.period()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Concurrency {
    // The log of leases is a sliding log whose window is the lease: the
    // same transitions, so the same state in every store.
    leases: SlidingLog,
}

/// What a [`Concurrency::renew`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewed {
    /// The lease was still held and now runs from `at`. `false` when it had
    /// ended (or been released): then the slots were taken afresh if they
    /// fit, which [`decision`](Self::decision) tells.
    pub was_held: bool,
    /// Whether the slots are held now, for `lease` from `at`, and the key's
    /// state as it now stands.
    pub decision: Decision,
    /// The time of the renew: with [`decision`](Self::decision), what the
    /// next renew or the release names the lease by
    /// (`Charged::of(cost, at, &decision)`).
    pub at: Micros,
}

impl Concurrency {
    /// `quota.limit()` slots per key, each lease lasting `quota.period()`.
    pub const fn new(quota: Quota) -> Self {
        Self {
            leases: SlidingLog::new(quota),
        }
    }

    /// How many slots a key has.
    pub fn slots(&self) -> u64 {
        self.leases.capacity()
    }

    /// How long a lease lasts unless renewed, in microseconds.
    pub fn lease_micros(&self) -> Micros {
        self.leases.quota().period_micros()
    }

    /// The stamp of the lease `charged` names: the decision that took (or
    /// last renewed) it was made at `charged.at`, and its lease was then the
    /// newest, ending `reset_after` later.
    pub fn stamp(&self, charged: &Charged) -> Micros {
        charged
            .at
            .saturating_add(charged.reset_after)
            .saturating_sub(self.lease_micros())
            .max(charged.at)
    }

    /// Renews the lease `charged` names ([`stamp`](Self::stamp)) at `now`:
    /// if it is still held, it now runs from `now`,
    /// whatever else is in flight (a request inside the upstream is never
    /// pushed out by a newcomer); if it has ended, its slots are taken
    /// afresh when they fit, and denied as a check would be when they do
    /// not. Renewing twice from the same `charged` is not idempotent: the
    /// second finds no lease at `charged.at` and takes new slots, which
    /// hold at most one lease too many (the first ends by itself).
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use spillway::algorithm::{Algorithm, Charged, Concurrency};
    /// use spillway::Quota;
    ///
    /// let cc = Concurrency::new(Quota::new(NonZeroU32::new(1).unwrap(), Duration::from_micros(1_000)).unwrap());
    /// let mut state = Default::default();
    /// let taken = cc.check(&mut state, 1, 0).unwrap();
    /// // Renewed at 900 µs: held until 1 900, not 1 000.
    /// let renewed = cc.renew(&mut state, Charged::of(1, 0, &taken), 900).unwrap();
    /// assert!(renewed.was_held && renewed.decision.allowed);
    /// assert_eq!(renewed.at, 900);
    /// assert!(!cc.check(&mut state, 1, 1_899).unwrap().allowed);
    /// // Not renewed again: another request may have the slot at 1 900.
    /// assert!(cc.check(&mut state, 1, 1_900).unwrap().allowed);
    /// let lost = cc.renew(&mut state, Charged::of(1, renewed.at, &renewed.decision), 2_000).unwrap();
    /// assert!(!lost.was_held && !lost.decision.allowed);
    /// ```
    pub fn renew(
        &self,
        state: &mut SlidingLogState,
        charged: Charged,
        now: Micros,
    ) -> Result<Renewed, CostTooLarge> {
        let cost = charged.cost;
        let stamp = self.stamp(&charged);
        // A peek drops the leases that have ended.
        self.leases.check(state, 0, now)?;
        let held = cost > 0 && state.entries.iter().any(|e| e.at == stamp && e.cost > 0);
        if !held {
            let decision = self.leases.decide(state, cost, now, true)?;
            return Ok(Renewed {
                was_held: false,
                decision,
                at: now,
            });
        }
        self.leases.refund(state, cost, stamp);
        // Back in, newest. It fitted with the lease in, so it fits now,
        // unless the limit was lowered since (a reload kept the key): the
        // request is inside all the same, and keeps its slot rather than be
        // pushed out.
        let mut decision = self.leases.decide(state, cost, now, true)?;
        if !decision.allowed {
            self.leases.charge(state, cost, now, true);
            decision = self.leases.check(state, 0, now)?;
        }
        Ok(Renewed {
            was_held: true,
            decision,
            at: now,
        })
    }
}

impl Algorithm for Concurrency {
    type State = SlidingLogState;
    type Undo = SlidingLogUndo;

    fn quota(&self) -> Quota {
        self.leases.quota()
    }

    fn capacity(&self) -> u64 {
        self.leases.capacity()
    }

    fn check(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge> {
        self.leases.decide(state, cost, now, true)
    }

    fn check_undoable(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<(Decision, Option<Self::Undo>), CostTooLarge> {
        // The charge is the newest entry, of its own: the sliding log's
        // undo takes it out.
        let decision = self.check(state, cost, now)?;
        let undo = (decision.allowed && cost > 0).then_some(SlidingLogUndo { cost });
        Ok((decision, undo))
    }

    fn undo(&self, state: &mut Self::State, undo: Self::Undo) {
        self.leases.undo(state, undo);
    }

    /// Takes back a charge made at `charged_at`, right after it was made:
    /// it is the newest lease (stamped `charged_at` or a little later).
    /// Later, a charge made since by another request may be taken instead
    /// (the same count; that request's lease then ends with the one it
    /// replaced, never later).
    fn refund(&self, state: &mut Self::State, cost: u64, charged_at: Micros) {
        if let Some(newest) = state.entries.back()
            && newest.at >= charged_at
        {
            let at = newest.at;
            self.leases.refund(state, cost, at);
        }
    }

    /// A release is a settle at `actual` 0: the lease's slots come back at
    /// once. Only the lease `charged` names ([`Concurrency::stamp`]) gives
    /// back: one that has ended gives nothing (its slots already came
    /// back), and no other lease is touched. A settle above the charge
    /// holds more slots, until the lease ends.
    fn settle(&self, state: &mut Self::State, charged: Charged, actual: u64, now: Micros) {
        let at = self.stamp(&charged);
        self.leases
            .settle(state, Charged { at, ..charged }, actual, now);
    }

    fn idle_at(&self, state: &Self::State) -> Micros {
        self.leases.idle_at(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::assert_retry_exact;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn cc(slots: u32, lease: u64) -> Concurrency {
        Concurrency::new(
            Quota::new(
                NonZeroU32::new(slots).unwrap(),
                Duration::from_micros(lease),
            )
            .unwrap(),
        )
    }

    #[test]
    fn a_lease_ends_exactly_at_its_time_and_a_denial_says_when() {
        let a = cc(2, 1_000);
        let mut s = SlidingLogState::default();
        a.check(&mut s, 1, 100).unwrap();
        a.check(&mut s, 1, 400).unwrap();
        assert_eq!(assert_retry_exact(&a, &s, 1, 500), 600);
        assert_eq!(assert_retry_exact(&a, &s, 2, 500), 900);
        let d = a.check(&mut s.clone(), 0, 500).unwrap();
        assert_eq!((d.limit, d.remaining), (2, 0));
        assert_eq!(d.reset_after, Duration::from_micros(900));
    }

    #[test]
    fn a_release_frees_only_its_own_lease_and_once_ended_frees_nothing() {
        let a = cc(3, 1_000);
        let mut s = SlidingLogState::default();
        let first = a.check(&mut s, 1, 100).unwrap();
        let second = a.check(&mut s, 2, 200).unwrap();
        a.settle(&mut s, Charged::of(2, 200, &second), 0, 300);
        assert_eq!(
            s,
            SlidingLogState::from_entries([LogEntry { at: 100, cost: 1 }])
        );
        // The first lease ended at 1 100; a third was taken since. The late
        // release takes nothing from it.
        a.check(&mut s, 1, 1_150).unwrap();
        let before = s.clone();
        a.settle(&mut s, Charged::of(1, 100, &first), 0, 1_200);
        assert_eq!(s, before);
    }

    #[test]
    fn leases_of_one_microsecond_have_stamps_of_their_own_and_a_stale_token_frees_none() {
        let a = cc(3, 1_000);
        let mut s = SlidingLogState::default();
        let first = a.check(&mut s, 1, 7).unwrap();
        let second = a.check(&mut s, 1, 7).unwrap();
        assert_eq!(s.entries.len(), 2);
        // The second lasts a microsecond longer: its stamp is 8.
        assert_eq!(second.reset_after.as_micros(), 1_001);
        let (c1, c2) = (Charged::of(1, 7, &first), Charged::of(1, 7, &second));
        assert_eq!((a.stamp(&c1), a.stamp(&c2)), (7, 8));
        a.settle(&mut s, c1, 0, 50);
        assert_eq!(a.check(&mut s, 0, 50).unwrap().remaining, 2);
        // The first's release sent again, or renewed after it: nothing of
        // the second's is taken.
        a.settle(&mut s, c1, 0, 60);
        assert_eq!(a.check(&mut s, 0, 60).unwrap().remaining, 2);
        let r = a.renew(&mut s, c1, 70).unwrap();
        assert!(!r.was_held);
        assert_eq!(s.total(), 2, "a slot taken afresh, the second's kept");
        a.settle(&mut s, c2, 0, 80);
        assert_eq!(
            s,
            SlidingLogState::from_entries([LogEntry { at: 70, cost: 1 }])
        );
    }

    #[test]
    fn a_lease_taken_on_a_clock_set_back_is_named_by_its_decision() {
        let a = cc(3, 1_000);
        let mut s = SlidingLogState::default();
        a.check(&mut s, 1, 500).unwrap();
        // The clock goes back to 400: the lease is stamped 501.
        let d = a.check(&mut s, 1, 400).unwrap();
        let charged = Charged::of(1, 400, &d);
        assert_eq!(a.stamp(&charged), 501);
        let r = a.renew(&mut s, charged, 450).unwrap();
        assert!(r.was_held);
        assert_eq!(s.total(), 2);
        a.settle(&mut s, Charged::of(1, r.at, &r.decision), 0, 460);
        assert_eq!(
            s,
            SlidingLogState::from_entries([LogEntry { at: 500, cost: 1 }])
        );
    }

    #[test]
    fn a_renewed_lease_is_never_taken_over_and_an_ended_one_is_taken_afresh() {
        let a = cc(1, 1_000);
        let mut s = SlidingLogState::default();
        let d = a.check(&mut s, 1, 0).unwrap();
        let mut charged = Charged::of(1, 0, &d);
        // Renewed every 900 µs through 90 lease times.
        for t in (900..90_000).step_by(900) {
            assert!(!a.check(&mut s, 1, t).unwrap().allowed, "taken over at {t}");
            let r = a.renew(&mut s, charged, t).unwrap();
            assert!(r.was_held && r.decision.allowed, "lost at {t}");
            assert_eq!(r.at, t);
            charged = Charged::of(1, r.at, &r.decision);
        }
        // Renewed too late: the lease ended, and someone else has the slot.
        let last = charged.at;
        a.check(&mut s, 1, last + 1_000).unwrap();
        let r = a.renew(&mut s, charged, last + 1_100).unwrap();
        assert!(!r.was_held && !r.decision.allowed);
        // Ended and free: taken afresh.
        let mut s = SlidingLogState::default();
        let d = a.check(&mut s, 1, 0).unwrap();
        let r = a.renew(&mut s, Charged::of(1, 0, &d), 5_000).unwrap();
        assert!(!r.was_held && r.decision.allowed);
        assert_eq!((r.at, s.total()), (5_000, 1));
    }

    #[test]
    fn a_lease_held_when_the_limit_is_lowered_is_renewed_not_pushed_out() {
        let (two, one) = (cc(2, 1_000), cc(1, 1_000));
        let mut s = SlidingLogState::default();
        let d = two.check(&mut s, 1, 0).unwrap();
        two.check(&mut s, 1, 10).unwrap();
        // Reloaded to one slot: two are inside. Each renews and stays.
        let r = one.renew(&mut s, Charged::of(1, 0, &d), 500).unwrap();
        assert!(r.was_held && r.decision.allowed, "{r:?}");
        assert_eq!(s.total(), 2);
        assert_eq!(s.entries.back().unwrap().at, 500);
        assert!(!one.check(&mut s, 1, 600).unwrap().allowed);
    }

    #[test]
    fn a_renew_at_the_newest_leases_microsecond_takes_the_next() {
        let a = cc(3, 1_000);
        let mut s = SlidingLogState::default();
        let d = a.check(&mut s, 1, 100).unwrap();
        a.check(&mut s, 1, 500).unwrap();
        let r = a.renew(&mut s, Charged::of(1, 100, &d), 500).unwrap();
        assert!(r.was_held);
        assert_eq!(
            s,
            SlidingLogState::from_entries([
                LogEntry { at: 500, cost: 1 },
                LogEntry { at: 501, cost: 1 }
            ])
        );
        // Renewed again from the renew's answer: its stamp is 501.
        let again = a
            .renew(&mut s, Charged::of(1, r.at, &r.decision), 600)
            .unwrap();
        assert!(again.was_held);
        assert_eq!(s.total(), 2);
        // A second renew from the old time finds nothing there and takes a
        // slot afresh: one too many, until the lease ends.
        let stale = a.renew(&mut s, Charged::of(1, 100, &d), 700).unwrap();
        assert!(!stale.was_held && stale.decision.allowed);
        assert_eq!(s.total(), 3);
    }
}

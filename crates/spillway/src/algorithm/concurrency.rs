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
//! The state is the key's leases ([`LeaseState`]), each with a name, the
//! time it ends and its slots; a lease is held while `now < ends`. A lease
//! taken at `now` ends at `now + lease`, or, when a lease held already ends
//! then or later (one taken the same microsecond, a clock set back), a
//! microsecond after the last: it is the last to end. Its name is that
//! first end. So a name is unique on its key, the decision that took the
//! lease names it (`at + reset_after`: [`Concurrency::lease_id`]), and a
//! reload that changes the lease's length renames nothing. A renew moves
//! the end of a lease, never its name: the same charge names it for as long
//! as it is held, and a renew sent twice does what one does. A denial's
//! `retry_after` is exact for a world where nobody releases: the time until
//! enough leases end. Most slots come back sooner, when their requests
//! finish; a front end says so (see `docs/algorithms.md`).
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

use std::collections::VecDeque;

use super::{Algorithm, Charged, ensure_fits};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;
use crate::quota::Quota;

/// The concurrency algorithm's configuration: `quota.limit()` slots per
/// key, each lease lasting `quota.period()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Concurrency {
    quota: Quota,
}

/// One lease on a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Its name, unique on its key: the time it first ended, when it was
    /// taken (see the [module](self)).
    pub id: Micros,
    /// When it ends unless renewed: it is held while `now < ends`.
    pub ends: Micros,
    /// The slots it holds.
    pub slots: u64,
}

/// A key's leases, the first to end first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseState {
    leases: VecDeque<Lease>,
    // The slots of all the leases, kept so a check is O(1) when no lease
    // ends.
    held: u64,
    // The leases released before they ended: each name and the end it had
    // then, plus a margin (`RELEASE_MARGIN`). Until then a renew of it does
    // not take it back (every token of the lease has expired by then). At
    // most `MAX_RELEASED`, the oldest forgotten first; dropped by the
    // renews and settles that find them past. A check never reads them.
    released: VecDeque<(Micros, Micros)>,
    // The latest of those ends: when the state is fresh again.
    released_until: Micros,
}

/// The least name [`Concurrency::drawn`] draws.
const DRAWN: Micros = 1 << 52;

/// The most releases a key remembers (see [`Concurrency::renew`]): past
/// that, the oldest is forgotten, and a renew that raced it may take its
/// slot back until its lease ends.
pub const MAX_RELEASED: usize = 1024;

/// How long after the end it had a released lease is remembered, at most
/// (and at most its lease): a token issued at its last renew expires on
/// the clock of the server that issued it, which may be a little behind
/// the store's.
pub const RELEASE_MARGIN: Micros = 10_000_000;

impl LeaseState {
    /// The slots held by the leases in the state (some may have ended
    /// since the last check).
    pub fn held(&self) -> u64 {
        self.held
    }

    /// The leases, the first to end first.
    pub fn leases(&self) -> impl ExactSizeIterator<Item = &Lease> {
        self.leases.iter()
    }

    /// Builds a state from its leases, as read back from another store.
    pub fn from_leases(leases: impl IntoIterator<Item = Lease>) -> Self {
        let mut state = Self::default();
        for lease in leases {
            state.insert(lease);
        }
        state
    }

    /// The leases released before they ended that it remembers, oldest
    /// first: each name, and until when a renew of it is refused.
    pub fn released(&self) -> impl ExactSizeIterator<Item = (Micros, Micros)> + '_ {
        self.released.iter().copied()
    }

    /// The same state, also remembering `released` (as
    /// [`released`](Self::released) gave them, read back from a file).
    pub fn with_released(mut self, released: impl IntoIterator<Item = (Micros, Micros)>) -> Self {
        for (id, until) in released {
            self.release(id, until, 0);
        }
        self
    }

    /// How many leases the state has room for without allocating.
    pub fn capacity(&self) -> usize {
        self.leases.capacity()
    }

    /// Drops the leases that have ended at `now`.
    fn drop_ended(&mut self, now: Micros) {
        while let Some(first) = self.leases.front() {
            if first.ends > now {
                break;
            }
            self.held -= first.slots;
            self.leases.pop_front();
        }
    }

    /// When the lease named `id` would have ended, if it was released and
    /// would not have ended yet at `now`; forgets the releases long past.
    fn released_until(&mut self, id: Micros, now: Micros) -> Option<Micros> {
        while self
            .released
            .front()
            .is_some_and(|&(_, until)| until <= now)
        {
            self.released.pop_front();
        }
        self.released
            .iter()
            .find(|&&(name, until)| name == id && until > now)
            .map(|&(_, until)| until)
    }

    /// Remembers that the lease named `id` was released, until `until`.
    fn release(&mut self, id: Micros, until: Micros, now: Micros) {
        while self
            .released
            .front()
            .is_some_and(|&(_, until)| until <= now)
        {
            self.released.pop_front();
        }
        if self.released.len() == MAX_RELEASED {
            self.released.pop_front();
        }
        self.released.push_back((id, until));
        self.released_until = self.released_until.max(until);
    }

    /// Where the lease named `id` is.
    fn find(&self, id: Micros) -> Option<usize> {
        self.leases.iter().rposition(|l| l.id == id)
    }

    /// Puts `lease` in its place, after the leases that end no later.
    fn insert(&mut self, lease: Lease) {
        let at = self.leases.partition_point(|l| l.ends <= lease.ends);
        self.held += lease.slots;
        self.leases.insert(at, lease);
    }

    fn remove(&mut self, i: usize) -> Lease {
        let lease = self.leases.remove(i).expect("a lease's position");
        self.held -= lease.slots;
        lease
    }

    /// When the last lease ends.
    fn last_end(&self) -> Option<Micros> {
        self.leases.back().map(|l| l.ends)
    }

    /// When `n` (at least 1) of the slots held have come back, if nobody
    /// releases: when the lease that holds the `n`-th slot to come back
    /// ends.
    fn nth_end(&self, n: u64) -> Option<Micros> {
        let mut back = 0;
        self.leases.iter().find_map(|l| {
            back += l.slots;
            (back >= n).then_some(l.ends)
        })
    }
}

/// How to take back a lease that [`Concurrency`] has just taken: its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseUndo {
    id: Micros,
}

/// What a [`Concurrency::renew`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewed {
    /// The lease was still held and now runs until `lease` after
    /// [`at`](Self::at). `false` when it had ended (or been released):
    /// then its slots were taken afresh, under the same name, if they fit,
    /// which [`decision`](Self::decision) tells.
    pub was_held: bool,
    /// Whether the slots are held now, and the key's state as it now
    /// stands.
    pub decision: Decision,
    /// The time of the renew: the lease now runs until `at + lease`. The
    /// lease keeps its name: the charge that named it names it still
    /// ([`names`](Self::names)).
    pub at: Micros,
}

impl Renewed {
    /// The charge that names the lease after this renew of `renewed`: the
    /// same, unless it named none (a request let in while its store could
    /// not decide) and this renew took one.
    pub fn names(&self, renewed: Charged) -> Charged {
        if renewed.reset_after == 0 && self.decision.allowed && !self.was_held {
            Charged::of(renewed.cost, self.at, &self.decision)
        } else {
            renewed
        }
    }
}

impl Concurrency {
    /// `quota.limit()` slots per key, each lease lasting `quota.period()`.
    pub const fn new(quota: Quota) -> Self {
        Self { quota }
    }

    /// How many slots a key has.
    pub fn slots(&self) -> u64 {
        u64::from(self.quota.limit().get())
    }

    /// How long a lease lasts unless renewed, in microseconds.
    pub fn lease_micros(&self) -> Micros {
        self.quota.period_micros()
    }

    /// The name of the lease `charged` names: the time it was first to
    /// end, `at + reset_after` (the decision that took it was made at `at`,
    /// and its lease was then the last to end). The name does not depend on
    /// the lease's length, which a reload may change. `None` for a charge
    /// that took no lease (`reset_after` 0).
    pub fn lease_id(&self, charged: &Charged) -> Option<Micros> {
        (charged.reset_after > 0).then(|| charged.at.saturating_add(charged.reset_after))
    }

    /// A charge of `slots` that names a lease no store took, drawn from
    /// `random`: for a request let in without a lease (its store could not
    /// decide), whose first renew takes one under this name if a slot is
    /// free. A renew sent again then finds it held, as for any other lease.
    /// The names drawn are from 2^52 µs on (the year 2112): no lease a
    /// store takes is named so far ahead, and Lua's numbers hold them
    /// exactly.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use spillway::algorithm::{Concurrency, LeaseState};
    /// use spillway::Quota;
    ///
    /// let cc = Concurrency::new(Quota::new(NonZeroU32::new(2).unwrap(), Duration::from_secs(30)).unwrap());
    /// let mut state = LeaseState::default();
    /// let drawn = Concurrency::drawn(1, 0xdead_beef);
    /// assert!(!cc.renew(&mut state, drawn, 1_000).unwrap().was_held);
    /// assert!(cc.renew(&mut state, drawn, 1_000).unwrap().was_held);
    /// assert_eq!(state.held(), 1);
    /// ```
    pub fn drawn(slots: u64, random: u64) -> Charged {
        Charged {
            cost: slots,
            at: 0,
            reset_after: DRAWN | (random & (DRAWN - 1)),
            held: false,
        }
    }

    /// Takes `slots` at `now` in a lease of its own, the last to end: at
    /// `now + lease`, or a microsecond after the lease that ends last, if
    /// that one ends as late or later (taken the same microsecond, a clock
    /// set back, a longer lease before a reload). Its name is that end,
    /// which no lease held has: each lease's name is its first end, and
    /// ends only grow.
    fn take(&self, state: &mut LeaseState, slots: u64, now: Micros) -> Micros {
        let fresh = now.saturating_add(self.lease_micros());
        let id = state
            .last_end()
            .map_or(fresh, |last| fresh.max(last.saturating_add(1)));
        state.leases.push_back(Lease {
            id,
            ends: id,
            slots,
        });
        state.held += slots;
        id
    }

    /// How long until `needed` fits: until enough of the leases have ended
    /// (`needed` at most the limit); zero if it fits now.
    fn fits_after(&self, state: &LeaseState, needed: u64, now: Micros) -> Micros {
        let limit = self.slots();
        if state.held + needed <= limit {
            return 0;
        }
        state
            .nth_end(state.held + needed - limit)
            .map_or(0, |ends| ends.saturating_sub(now))
    }

    /// The key's state at `now`, with nothing taken: what a check of cost
    /// 0 answers.
    fn standing(&self, state: &LeaseState, now: Micros) -> Decision {
        let limit = self.slots();
        let remaining = limit.saturating_sub(state.held);
        Decision::allow(
            limit,
            remaining,
            self.reset_after(state, now),
            self.refill_after(state, remaining, now),
        )
    }

    /// When one more slot is free than `remaining` (none when every slot
    /// is).
    fn refill_after(&self, state: &LeaseState, remaining: u64, now: Micros) -> Micros {
        if remaining >= self.slots() {
            return 0;
        }
        self.fits_after(state, remaining + 1, now)
    }

    /// When the last lease ends.
    fn reset_after(&self, state: &LeaseState, now: Micros) -> Micros {
        state.last_end().map_or(0, |last| last.saturating_sub(now))
    }

    /// Renews the lease `charged` names ([`lease_id`](Self::lease_id)) at
    /// `now`: if it is still held, it now runs until `now + lease` (never
    /// less than it did), whatever else is in flight: a request inside the
    /// upstream is never pushed out by a newcomer, nor by a limit lowered
    /// since. If it has ended, its slots are taken afresh under the same
    /// name when they fit, and denied as a check would be when they do not.
    /// Renewing twice from the same charge does what renewing once does.
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
    /// let lease = Charged::of(1, 0, &taken);
    /// // Renewed at 900 µs: held until 1 900, not 1 000. Sent twice, it
    /// // holds one slot still.
    /// let renewed = cc.renew(&mut state, lease, 900).unwrap();
    /// assert!(renewed.was_held && renewed.decision.allowed);
    /// assert!(cc.renew(&mut state, lease, 900).unwrap().was_held);
    /// assert_eq!(state.held(), 1);
    /// assert!(!cc.check(&mut state, 1, 1_899).unwrap().allowed);
    /// // Not renewed again: another request may have the slot at 1 900.
    /// assert!(cc.check(&mut state, 1, 1_900).unwrap().allowed);
    /// let lost = cc.renew(&mut state, lease, 2_000).unwrap();
    /// assert!(!lost.was_held && !lost.decision.allowed);
    /// ```
    pub fn renew(
        &self,
        state: &mut LeaseState,
        charged: Charged,
        now: Micros,
    ) -> Result<Renewed, CostTooLarge> {
        let cost = charged.cost;
        ensure_fits(cost, self.slots())?;
        state.drop_ended(now);
        let id = self.lease_id(&charged);
        let held = id.filter(|_| cost > 0).and_then(|id| state.find(id));
        let renewed = |was_held, decision| Renewed {
            was_held,
            decision,
            at: now,
        };
        if let Some(i) = held {
            let mut lease = state.remove(i);
            lease.ends = lease.ends.max(now.saturating_add(self.lease_micros()));
            state.insert(lease);
            return Ok(renewed(true, self.standing(state, now)));
        }
        // Released, and its request served: not taken back before the
        // lease would have ended (a renew that raced its release).
        if let Some(until) = id
            .filter(|_| cost > 0)
            .and_then(|id| state.released_until(id, now))
        {
            let limit = self.slots();
            let remaining = limit.saturating_sub(state.held);
            let wait = until
                .saturating_sub(now)
                .max(self.fits_after(state, cost, now));
            return Ok(renewed(
                false,
                Decision::deny(
                    limit,
                    remaining,
                    self.reset_after(state, now),
                    self.refill_after(state, remaining, now),
                    wait,
                ),
            ));
        }
        // No lease yet, or one that does not fit: as a check.
        let Some(id) = id.filter(|_| cost > 0 && state.held + cost <= self.slots()) else {
            return Ok(renewed(false, self.check(state, cost, now)?));
        };
        state.insert(Lease {
            id,
            ends: now.saturating_add(self.lease_micros()),
            slots: cost,
        });
        Ok(renewed(false, self.standing(state, now)))
    }
}

impl Algorithm for Concurrency {
    type State = LeaseState;
    type Undo = LeaseUndo;

    fn quota(&self) -> Quota {
        self.quota
    }

    fn capacity(&self) -> u64 {
        self.slots()
    }

    fn check(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge> {
        self.check_undoable(state, cost, now).map(|(d, _)| d)
    }

    fn check_undoable(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<(Decision, Option<Self::Undo>), CostTooLarge> {
        let limit = self.slots();
        ensure_fits(cost, limit)?;
        state.drop_ended(now);
        // Cost 0 only looks: allowed even over the limit (a limit lowered
        // while leases were held).
        if cost == 0 {
            return Ok((self.standing(state, now), None));
        }
        if state.held + cost <= limit {
            let id = self.take(state, cost, now);
            return Ok((self.standing(state, now), Some(LeaseUndo { id })));
        }
        let remaining = limit.saturating_sub(state.held);
        let denied = Decision::deny(
            limit,
            remaining,
            self.reset_after(state, now),
            self.refill_after(state, remaining, now),
            // The earliest time enough leases have ended.
            self.fits_after(state, cost, now),
        );
        Ok((denied, None))
    }

    fn undo(&self, state: &mut Self::State, undo: Self::Undo) {
        if let Some(i) = state.find(undo.id) {
            state.remove(i);
        }
    }

    /// Takes back a lease taken at `charged_at`, right after it was taken:
    /// the last taken, the one with the greatest name, if it was taken then
    /// or later (named `charged_at + lease` or more: a lease taken earlier
    /// is named less, unless the lease was longer before a reload). Later,
    /// a lease taken since by another request may be taken instead (the
    /// same count). A caller that knows the lease's name gives it back by
    /// name: a settle at 0.
    fn refund(&self, state: &mut Self::State, cost: u64, charged_at: Micros) {
        let first = charged_at.saturating_add(self.lease_micros());
        let own = (0..state.leases.len())
            // Names drawn by their holders (from 2^52) were taken by
            // renews, not by this charge.
            .filter(|&i| (first..DRAWN).contains(&state.leases[i].id))
            .max_by_key(|&i| state.leases[i].id);
        let Some(i) = own else {
            return;
        };
        let lease = &mut state.leases[i];
        let taken = cost.min(lease.slots);
        lease.slots -= taken;
        state.held -= taken;
        if state.leases[i].slots == 0 {
            state.leases.remove(i);
        }
    }

    /// A release is a settle at `actual` 0: the lease's slots come back at
    /// once. Only the lease `charged` names ([`Concurrency::lease_id`])
    /// gives back: one that has ended gives nothing (its slots already came
    /// back), and no other lease is touched. A lease holds at most
    /// `actual` slots after a settle: a settle above the charge leaves it
    /// as it is (a lease is given back, never grown).
    fn settle(&self, state: &mut Self::State, charged: Charged, actual: u64, now: Micros) {
        state.drop_ended(now);
        let Some(i) = self.lease_id(&charged).and_then(|id| state.find(id)) else {
            return;
        };
        let lease = &mut state.leases[i];
        let kept = lease.slots.min(actual);
        state.held -= lease.slots - kept;
        lease.slots = kept;
        if kept == 0 {
            let gone = state.remove(i);
            let margin = RELEASE_MARGIN.min(self.lease_micros());
            state.release(gone.id, gone.ends.saturating_add(margin), now);
        }
    }

    fn idle_at(&self, state: &Self::State) -> Micros {
        state.last_end().unwrap_or(0).max(state.released_until)
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

    fn lease(id: Micros, ends: Micros, slots: u64) -> Lease {
        Lease { id, ends, slots }
    }

    fn leases_of(s: &LeaseState) -> Vec<Lease> {
        s.leases().copied().collect()
    }

    #[test]
    fn a_lease_ends_exactly_at_its_time_and_a_denial_says_when() {
        let a = cc(2, 1_000);
        let mut s = LeaseState::default();
        a.check(&mut s, 1, 100).unwrap();
        a.check(&mut s, 1, 400).unwrap();
        assert_eq!(assert_retry_exact(&a, &s, 1, 500), 600);
        assert_eq!(assert_retry_exact(&a, &s, 2, 500), 900);
        let d = a.check(&mut s.clone(), 0, 500).unwrap();
        assert_eq!((d.limit, d.remaining), (2, 0));
        assert_eq!(d.reset_after, Duration::from_micros(900));
        assert_eq!(d.refill_after, Duration::from_micros(600));
    }

    #[test]
    fn a_release_frees_only_its_own_lease_and_once_ended_frees_nothing() {
        let a = cc(3, 1_000);
        let mut s = LeaseState::default();
        let first = a.check(&mut s, 1, 100).unwrap();
        let second = a.check(&mut s, 2, 200).unwrap();
        a.settle(&mut s, Charged::of(2, 200, &second), 0, 300);
        assert_eq!(leases_of(&s), [lease(1_100, 1_100, 1)]);
        // The first lease ended at 1 100; a third was taken since. The late
        // release takes nothing from it.
        a.check(&mut s, 1, 1_150).unwrap();
        let before = s.clone();
        a.settle(&mut s, Charged::of(1, 100, &first), 0, 1_200);
        assert_eq!(s, before);
    }

    #[test]
    fn a_settle_gives_slots_back_and_never_grows_a_lease() {
        let a = cc(4, 1_000);
        let mut s = LeaseState::default();
        let d = a.check(&mut s, 3, 100).unwrap();
        let charged = Charged::of(3, 100, &d);
        a.settle(&mut s, charged, 5, 200);
        assert_eq!(s.held(), 3);
        a.settle(&mut s, charged, 1, 300);
        assert_eq!(leases_of(&s), [lease(1_100, 1_100, 1)]);
        // The same settle again, or one that asks for more: nothing moves.
        a.settle(&mut s, charged, 1, 400);
        a.settle(&mut s, charged, 2, 400);
        assert_eq!(s.held(), 1);
        a.settle(&mut s, charged, 0, 500);
        assert!(leases_of(&s).is_empty());
    }

    #[test]
    fn leases_of_one_microsecond_have_names_of_their_own_and_a_stale_token_frees_none() {
        let a = cc(3, 1_000);
        let mut s = LeaseState::default();
        let first = a.check(&mut s, 1, 7).unwrap();
        let second = a.check(&mut s, 1, 7).unwrap();
        assert_eq!(s.leases().len(), 2);
        // The second lasts a microsecond longer: its name is 1 008.
        assert_eq!(second.reset_after.as_micros(), 1_001);
        let (c1, c2) = (Charged::of(1, 7, &first), Charged::of(1, 7, &second));
        assert_eq!(
            (a.lease_id(&c1), a.lease_id(&c2)),
            (Some(1_007), Some(1_008))
        );
        a.settle(&mut s, c1, 0, 50);
        assert_eq!(a.check(&mut s, 0, 50).unwrap().remaining, 2);
        // The first's release sent again: nothing of the second's is taken.
        a.settle(&mut s, c1, 0, 60);
        assert_eq!(a.check(&mut s, 0, 60).unwrap().remaining, 2);
        // Renewed after its release (a renew that raced it): not taken
        // back before the lease would have ended, at 1 007, and a margin
        // (the lease, here) after.
        let r = a.renew(&mut s, c1, 70).unwrap();
        assert!(!r.was_held && !r.decision.allowed);
        assert_eq!(r.decision.retry_after, Some(Duration::from_micros(1_937)));
        assert_eq!(s.held(), 1);
        a.settle(&mut s, c2, 0, 80);
        assert!(leases_of(&s).is_empty());
        assert_eq!(a.idle_at(&s), 2_008);
        // After that, a renew takes it afresh (the store lost it while the
        // request ran), and a renew sent twice takes it once.
        for _ in 0..2 {
            a.renew(&mut s, c1, 2_010).unwrap();
            assert_eq!(s.held(), 1);
        }
        assert_eq!(leases_of(&s), [lease(1_007, 3_010, 1)]);
    }

    #[test]
    fn a_lease_taken_on_a_clock_set_back_is_named_by_its_decision() {
        let a = cc(3, 1_000);
        let mut s = LeaseState::default();
        a.check(&mut s, 1, 500).unwrap();
        // The clock goes back to 400: the lease ends last, at 1 501, its
        // name.
        let d = a.check(&mut s, 1, 400).unwrap();
        let charged = Charged::of(1, 400, &d);
        assert_eq!(a.lease_id(&charged), Some(1_501));
        let r = a.renew(&mut s, charged, 450).unwrap();
        assert!(r.was_held);
        assert_eq!(s.held(), 2);
        a.settle(&mut s, charged, 0, 460);
        assert_eq!(leases_of(&s), [lease(1_500, 1_500, 1)]);
    }

    #[test]
    fn a_renewed_lease_is_never_taken_over_and_an_ended_one_is_taken_afresh() {
        let a = cc(1, 1_000);
        let mut s = LeaseState::default();
        let d = a.check(&mut s, 1, 0).unwrap();
        let charged = Charged::of(1, 0, &d);
        // Renewed every 900 µs through 90 lease times, each renew sent
        // twice (an answer lost and the renew sent again).
        for t in (900..90_000).step_by(900) {
            assert!(!a.check(&mut s, 1, t).unwrap().allowed, "taken over at {t}");
            for _ in 0..2 {
                let r = a.renew(&mut s, charged, t).unwrap();
                assert!(r.was_held && r.decision.allowed, "lost at {t}");
                assert_eq!((r.at, s.held()), (t, 1));
            }
        }
        // Renewed too late: the lease ended, and someone else has the slot.
        let last = 89_100;
        a.check(&mut s, 1, last + 1_000).unwrap();
        let r = a.renew(&mut s, charged, last + 1_100).unwrap();
        assert!(!r.was_held && !r.decision.allowed);
        assert_eq!(r.decision.retry_after, Some(Duration::from_micros(900)));
        // Ended and free: taken afresh.
        let mut s = LeaseState::default();
        let d = a.check(&mut s, 1, 0).unwrap();
        let r = a.renew(&mut s, Charged::of(1, 0, &d), 5_000).unwrap();
        assert!(!r.was_held && r.decision.allowed);
        assert_eq!(leases_of(&s), [lease(1_000, 6_000, 1)]);
    }

    #[test]
    fn a_lease_held_when_the_limit_is_lowered_is_renewed_not_pushed_out() {
        let (two, one) = (cc(2, 1_000), cc(1, 1_000));
        let mut s = LeaseState::default();
        let d = two.check(&mut s, 1, 0).unwrap();
        two.check(&mut s, 1, 10).unwrap();
        // Reloaded to one slot: two are inside. Each renews and stays.
        let r = one.renew(&mut s, Charged::of(1, 0, &d), 500).unwrap();
        assert!(r.was_held && r.decision.allowed, "{r:?}");
        assert_eq!(s.held(), 2);
        assert_eq!(s.leases().last(), Some(&lease(1_000, 1_500, 1)));
        assert!(!one.check(&mut s, 1, 600).unwrap().allowed);
    }

    #[test]
    fn a_renew_never_shortens_a_lease_and_an_undo_takes_back_only_its_own() {
        let a = cc(3, 1_000);
        let mut s = LeaseState::default();
        let d = a.check(&mut s, 1, 100).unwrap();
        // A renew on a clock set back keeps the lease's end.
        a.renew(&mut s, Charged::of(1, 100, &d), 50).unwrap();
        assert_eq!(leases_of(&s), [lease(1_100, 1_100, 1)]);
        let (_, undo) = a.check_undoable(&mut s, 1, 100).unwrap();
        a.renew(&mut s, Charged::of(1, 100, &d), 200).unwrap();
        a.undo(&mut s, undo.unwrap());
        assert_eq!(leases_of(&s), [lease(1_100, 1_200, 1)]);
    }

    #[test]
    fn a_refund_takes_the_last_lease_taken_at_the_charge_or_after() {
        let a = cc(3, 1_000);
        let mut s = LeaseState::default();
        let d = a.check(&mut s, 1, 100).unwrap();
        a.check(&mut s, 1, 200).unwrap();
        // The first renewed: it now ends last, but it was taken before.
        a.renew(&mut s, Charged::of(1, 100, &d), 300).unwrap();
        a.refund(&mut s, 1, 250);
        assert_eq!(s.held(), 2, "taken before 250: not refunded");
        a.refund(&mut s, 1, 200);
        assert_eq!(leases_of(&s), [lease(1_100, 1_300, 1)]);
    }

    #[test]
    fn a_request_that_holds_no_lease_takes_one_at_its_renew_and_is_named_by_it() {
        let a = cc(2, 1_000);
        let mut s = LeaseState::default();
        a.check(&mut s, 1, 0).unwrap();
        let none = Charged {
            cost: 1,
            at: 0,
            reset_after: 0,
            held: false,
        };
        let r = a.renew(&mut s, none, 300).unwrap();
        assert!(!r.was_held && r.decision.allowed);
        let named = r.names(none);
        assert_eq!(a.lease_id(&named), Some(1_300));
        // Named, it renews as any other; the charge without a name releases
        // nothing.
        assert!(a.renew(&mut s, named, 400).unwrap().was_held);
        assert_eq!(a.renew(&mut s, named, 400).unwrap().names(named), named);
        a.settle(&mut s, none, 0, 500);
        assert_eq!(s.held(), 2);
        a.settle(&mut s, named, 0, 500);
        assert_eq!(s.held(), 1);
    }

    #[test]
    fn a_reload_that_changes_the_lease_renames_nothing() {
        let (minute, third) = (cc(2, 60_000), cc(2, 20_000));
        let mut s = LeaseState::default();
        let d = minute.check(&mut s, 1, 1_000).unwrap();
        let charged = Charged::of(1, 1_000, &d);
        assert_eq!(third.lease_id(&charged), minute.lease_id(&charged));
        // Renewed under the shorter lease: the same slot, held on.
        let r = third.renew(&mut s, charged, 2_000).unwrap();
        assert!(r.was_held);
        assert_eq!(s.held(), 1);
        // A take under the shorter lease ends after the longer one.
        let e = third.check(&mut s, 1, 2_000).unwrap();
        let other = Charged::of(1, 2_000, &e);
        assert_eq!(third.lease_id(&other), Some(61_001));
        // Each release frees its own.
        third.settle(&mut s, charged, 0, 3_000);
        assert_eq!(leases_of(&s), [lease(61_001, 61_001, 1)]);
        minute.settle(&mut s, other, 0, 3_000);
        assert!(leases_of(&s).is_empty());
    }
}

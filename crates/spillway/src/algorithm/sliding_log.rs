//! Sliding log: exactly `limit` in any window of length `W`.
//!
//! The state is the list of admitted requests `(timestamp, cost)` still inside
//! the window `(now - W, now]`. A request is admitted when the costs in the
//! log plus its own fit in the limit. It is exact wherever the window is
//! placed, and it costs memory: up to `limit` entries per key (each entry has
//! a cost of at least 1 and they sum to at most `limit`). Requests admitted
//! at the same microsecond share one entry.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::Duration;
//! use spillway::algorithm::{Algorithm, SlidingLog};
//! use spillway::Quota;
//!
//! let log = SlidingLog::new(Quota::new(NonZeroU32::new(2).unwrap(), Duration::from_micros(1000)).unwrap());
//! let mut state = Default::default();
//! assert!(log.check(&mut state, 1, 100).unwrap().allowed);
//! assert!(log.check(&mut state, 1, 600).unwrap().allowed);
//! let denied = log.check(&mut state, 1, 900).unwrap();
//! // The entry from t=100 leaves the window at t=1100.
//! assert_eq!(denied.retry_after, Some(Duration::from_micros(200)));
//! assert!(!log.check(&mut state, 1, 1099).unwrap().allowed);
//! assert!(log.check(&mut state, 1, 1100).unwrap().allowed);
//! ```

use std::collections::VecDeque;

use super::{Algorithm, Charged, ensure_fits, owing_at_most_one_quota};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;
use crate::quota::Quota;

/// The sliding log algorithm's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingLog {
    quota: Quota,
}

/// One admitted request (or several admitted at the same microsecond).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogEntry {
    /// When it was admitted.
    pub at: Micros,
    /// The cost admitted at that time.
    pub cost: u64,
}

/// A key's log, oldest entry first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingLogState {
    /// The admitted requests still inside the window, oldest first.
    pub entries: VecDeque<LogEntry>,
    // The sum of the entries' costs, kept so a check is O(1) when nothing
    // expires.
    total: u64,
}

impl SlidingLogState {
    /// The sum of the costs in the log.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Builds a state from its entries (oldest first), as read back from
    /// another store.
    pub fn from_entries(entries: impl IntoIterator<Item = LogEntry>) -> Self {
        let entries: VecDeque<LogEntry> = entries.into_iter().collect();
        let total = entries.iter().map(|e| e.cost).sum();
        Self { entries, total }
    }
}

/// How to take back a charge the sliding log has just made: the charge
/// itself, since copying a log of up to `limit` entries would cost more than
/// the check.
///
/// An admitted charge always lands in the newest entry: a new one stamped
/// `now`, or, when the newest entry is stamped `now` or later (the same
/// microsecond, or a clock set back), that entry. Taking the charge back out
/// of it, and removing the entry if that empties it, restores the log
/// exactly.
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use spillway::algorithm::{Algorithm, SlidingLog};
/// use spillway::clock::{Clock, FakeClock};
/// use spillway::Quota;
///
/// let log = SlidingLog::new(Quota::new(NonZeroU32::new(3).unwrap(), Duration::from_micros(1_000)).unwrap());
/// let clock = FakeClock::new(1_700);
/// let mut state = Default::default();
/// log.check(&mut state, 1, clock.now()).unwrap();
/// clock.set(2_000);
/// log.check(&mut state, 1, clock.now()).unwrap();
/// let before = state.clone();
/// // The clock is set back: the charge joins the entry stamped 2 000 (a
/// // refund at 1 500 would look for it in the one stamped 1 700).
/// clock.set(1_500);
/// let (decision, undo) = log.check_undoable(&mut state, 1, clock.now()).unwrap();
/// assert_eq!(decision.remaining, 0);
/// assert_eq!(state.entries.back().unwrap().cost, 2);
/// log.undo(&mut state, undo.unwrap());
/// assert_eq!(state, before);
/// assert_eq!(log.check(&mut state, 0, clock.now()).unwrap().remaining, 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingLogUndo {
    pub(super) cost: u64,
}

impl SlidingLog {
    /// At most `quota.limit()` in any window of `quota.period()`.
    pub const fn new(quota: Quota) -> Self {
        Self { quota }
    }

    fn limit(&self) -> u64 {
        u64::from(self.quota.limit().get())
    }

    fn window(&self) -> u64 {
        self.quota.period_micros()
    }

    /// Drops the entries that have left the window `(now - W, now]`.
    fn expire(&self, state: &mut SlidingLogState, now: Micros) {
        let w = self.window();
        while let Some(front) = state.entries.front() {
            if front.at.saturating_add(w) > now {
                break;
            }
            state.total -= front.cost;
            state.entries.pop_front();
        }
    }

    /// How long until `needed` fits: until enough of the oldest entries
    /// have left the window (`needed` at most the limit); zero if it fits
    /// now.
    fn fits_after(&self, state: &SlidingLogState, needed: u64, now: Micros) -> Micros {
        let limit = self.limit();
        let mut left = state.total;
        if left + needed <= limit {
            return 0;
        }
        for entry in &state.entries {
            left -= entry.cost;
            if left + needed <= limit {
                return entry.at.saturating_add(self.window()).saturating_sub(now);
            }
        }
        0
    }

    /// When one more unit fits than `remaining` (none when the log is
    /// empty: the quota is whole).
    fn refill_after(&self, state: &SlidingLogState, remaining: u64, now: Micros) -> Micros {
        if remaining >= self.limit() {
            return 0;
        }
        self.fits_after(state, remaining + 1, now)
    }

    /// When the newest entry leaves the window.
    fn reset_after(&self, state: &SlidingLogState, now: Micros) -> Micros {
        state.entries.back().map_or(0, |newest| {
            newest.at.saturating_add(self.window()).saturating_sub(now)
        })
    }

    /// [`check`](Algorithm::check).
    fn decide(
        &self,
        state: &mut SlidingLogState,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge> {
        let limit = self.limit();
        ensure_fits(cost, limit)?;
        self.expire(state, now);
        // Cost 0 only looks: allowed even over the limit (in debt, or with
        // a lowered limit).
        if cost == 0 || state.total + cost <= limit {
            if cost > 0 {
                self.charge(state, cost, now);
            }
            let remaining = limit.saturating_sub(state.total);
            return Ok(Decision::allow(
                limit,
                remaining,
                self.reset_after(state, now),
                self.refill_after(state, remaining, now),
            ));
        }
        // A total over the limit is possible: the limit was lowered and the
        // store kept the key's log.
        let remaining = limit.saturating_sub(state.total);
        Ok(Decision::deny(
            limit,
            remaining,
            self.reset_after(state, now),
            self.refill_after(state, remaining, now),
            // The earliest time enough of the oldest entries have expired.
            self.fits_after(state, cost, now),
        ))
    }

    /// Charges `cost` at `now`: into the newest entry when it is stamped
    /// `now` or later, else into one of its own.
    fn charge(&self, state: &mut SlidingLogState, cost: u64, now: Micros) {
        match state.entries.back_mut() {
            // Same microsecond, or time went backwards: charge the newest
            // entry, which expires no earlier than `now` would.
            Some(newest) if newest.at >= now => newest.cost += cost,
            _ => state.entries.push_back(LogEntry { at: now, cost }),
        }
        state.total += cost;
    }
}

impl Algorithm for SlidingLog {
    type State = SlidingLogState;
    type Undo = SlidingLogUndo;

    fn quota(&self) -> Quota {
        self.quota
    }

    fn capacity(&self) -> u64 {
        self.limit()
    }

    fn check(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge> {
        self.decide(state, cost, now)
    }

    fn check_undoable(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<(Decision, Option<Self::Undo>), CostTooLarge> {
        let decision = self.check(state, cost, now)?;
        let undo = (decision.allowed && cost > 0).then_some(SlidingLogUndo { cost });
        Ok((decision, undo))
    }

    fn undo(&self, state: &mut Self::State, undo: Self::Undo) {
        // The charge is in the newest entry (see `SlidingLogUndo`). On a
        // fresh log there is nothing to take it from.
        if let Some(newest) = state.entries.back_mut() {
            let taken = undo.cost.min(newest.cost);
            newest.cost -= taken;
            state.total -= taken;
            if newest.cost == 0 {
                state.entries.pop_back();
            }
        }
    }

    fn refund(&self, state: &mut Self::State, cost: u64, charged_at: Micros) {
        let entries = &mut state.entries;
        // The charge is in the entry stamped `charged_at`, or (if time went
        // backwards when it was made) in the oldest later one.
        let Some(i) = entries
            .iter()
            .rposition(|e| e.at == charged_at)
            .or_else(|| entries.iter().position(|e| e.at > charged_at))
        else {
            return;
        };
        let taken = cost.min(entries[i].cost);
        entries[i].cost -= taken;
        state.total -= taken;
        if entries[i].cost == 0 {
            entries.remove(i);
        }
    }

    fn settle(&self, state: &mut Self::State, charged: Charged, actual: u64, now: Micros) {
        self.expire(state, now);
        // The charge is in the entry stamped with its time; if that entry
        // has left the window, the charge no longer counts.
        let at = state.entries.iter().rposition(|e| e.at == charged.at);
        if actual < charged.cost {
            let Some(i) = at else {
                return;
            };
            let entry = &mut state.entries[i];
            let taken = (charged.cost - actual).min(entry.cost);
            entry.cost -= taken;
            state.total -= taken;
            if entry.cost == 0 {
                state.entries.remove(i);
            }
        } else if actual > charged.cost {
            let total = owing_at_most_one_quota(state.total, actual - charged.cost, self.limit());
            let extra = total - state.total;
            if extra == 0 {
                return;
            }
            state.total = total;
            match (at, state.entries.back_mut()) {
                (Some(i), _) => {
                    let entry = &mut state.entries[i];
                    entry.cost = entry.cost.saturating_add(extra);
                }
                // Gone from the window: the overrun was served now.
                (None, Some(newest)) if newest.at >= now => {
                    newest.cost = newest.cost.saturating_add(extra);
                }
                (None, _) => state.entries.push_back(LogEntry {
                    at: now,
                    cost: extra,
                }),
            }
        }
    }

    fn idle_at(&self, state: &Self::State) -> Micros {
        state
            .entries
            .back()
            .map_or(0, |newest| newest.at.saturating_add(self.window()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn log(limit: u32, window: u64) -> SlidingLog {
        SlidingLog::new(
            Quota::new(
                NonZeroU32::new(limit).unwrap(),
                Duration::from_micros(window),
            )
            .unwrap(),
        )
    }

    #[test]
    fn entry_expires_exactly_at_the_window_edge() {
        let a = log(1, 1000);
        let mut s = SlidingLogState::default();
        assert!(a.check(&mut s, 1, 0).unwrap().allowed);
        assert!(!a.check(&mut s, 1, 999).unwrap().allowed);
        assert!(a.check(&mut s, 1, 1000).unwrap().allowed);
    }

    #[test]
    fn retry_after_skips_entries_too_small_to_help() {
        let a = log(4, 1000);
        let mut s = SlidingLogState::default();
        a.check(&mut s, 1, 0).unwrap();
        a.check(&mut s, 1, 100).unwrap();
        a.check(&mut s, 2, 200).unwrap();
        // Cost 3 needs the first three units gone: the entry at 200 must go.
        let d = a.check(&mut s, 3, 300).unwrap();
        assert_eq!(d.retry_after, Some(Duration::from_micros(900)));
        assert_eq!(d.remaining, 0);
        assert_eq!(d.reset_after, Duration::from_micros(900));
    }

    #[test]
    fn same_microsecond_shares_an_entry_and_refund_takes_it_back() {
        let a = log(5, 1000);
        let mut s = SlidingLogState::default();
        a.check(&mut s, 2, 7).unwrap();
        a.check(&mut s, 1, 7).unwrap();
        assert_eq!(s.entries.len(), 1);
        a.refund(&mut s, 1, 7);
        a.refund(&mut s, 2, 7);
        assert!(s.entries.is_empty());
        assert_eq!(s.total(), 0);
    }

    #[test]
    fn denial_and_peek_log_nothing() {
        let a = log(1, 1000);
        let mut s = SlidingLogState::default();
        assert!(a.check(&mut s, 0, 0).unwrap().allowed);
        assert!(s.entries.is_empty());
        a.check(&mut s, 1, 0).unwrap();
        a.check(&mut s, 1, 1).unwrap();
        assert_eq!(s.entries.len(), 1);
    }

    #[test]
    fn undo_takes_the_charge_out_of_the_newest_entry() {
        use crate::algorithm::assert_undo_restores;
        let a = log(4, 1000);
        let fresh = SlidingLogState::default();
        assert_eq!(assert_undo_restores(&a, &fresh, 4, 1_200), fresh);
        let mut s = fresh.clone();
        a.check(&mut s, 1, 100).unwrap();
        a.check(&mut s, 1, 600).unwrap();
        // The newest entry's microsecond (the charge joins it); later (a new
        // entry); a clock set back to between the entries, and before both
        // (the charge joins the newest entry, where a refund at that time
        // would look for it in the entry stamped 100).
        for (cost, now) in [(1, 600), (2, 900), (1, 300), (2, 50)] {
            assert_eq!(
                assert_undo_restores(&a, &s, cost, now),
                s,
                "{cost} at {now}"
            );
        }
        // What expired by the charge stays dropped, as after a denial.
        let kept = SlidingLogState::from_entries([LogEntry { at: 600, cost: 1 }]);
        assert_eq!(assert_undo_restores(&a, &s, 2, 1_300), kept);
        assert_eq!(assert_undo_restores(&a, &s, 1, 1_650), fresh);
    }

    #[test]
    fn charges_undone_newest_first_restore_the_log() {
        let a = log(5, 1000);
        let mut s = SlidingLogState::default();
        a.check(&mut s, 1, 500).unwrap();
        let before = s.clone();
        // Two charges of one request, the second on a clock set back.
        let (_, first) = a.check_undoable(&mut s, 2, 700).unwrap();
        let (_, second) = a.check_undoable(&mut s, 1, 650).unwrap();
        assert_eq!(s.entries.len(), 2);
        a.undo(&mut s, second.unwrap());
        a.undo(&mut s, first.unwrap());
        assert_eq!(s, before);
        // A denial and a peek charge nothing, so give nothing to undo.
        assert!(a.check_undoable(&mut s, 5, 700).unwrap().1.is_none());
        assert!(a.check_undoable(&mut s, 0, 700).unwrap().1.is_none());
    }

    #[test]
    fn a_settle_adjusts_the_entry_the_charge_went_to_and_never_another() {
        use crate::algorithm::{Charged, assert_retry_exact, assert_settle_as_if_charged};
        let a = log(5, 1000);
        let mut busy = SlidingLogState::default();
        a.check(&mut busy, 1, 100).unwrap();
        a.check(&mut busy, 1, 600).unwrap();
        for before in [SlidingLogState::default(), busy.clone()] {
            for (cost, actual) in [(2, 0), (2, 1), (1, 3)] {
                // At a time of its own, and at the newest entry's.
                for now in [700, 600] {
                    assert_settle_as_if_charged(&a, &before, cost, actual, now);
                }
            }
        }
        // The entry left the window: the give-back touches no other entry.
        let mut s = busy.clone();
        let d = a.check(&mut s, 2, 700).unwrap();
        a.check(&mut s, 1, 1_650).unwrap();
        let mut later = s.clone();
        a.check(&mut later, 0, 1_750).unwrap();
        a.settle(&mut s, Charged::of(2, 700, &d), 0, 1_750);
        assert_eq!(s, later);
        // An overrun after it left counts from now.
        a.settle(&mut s, Charged::of(2, 700, &d), 4, 1_750);
        assert_eq!(
            s,
            SlidingLogState::from_entries([
                LogEntry { at: 1_650, cost: 1 },
                LogEntry { at: 1_750, cost: 2 }
            ])
        );
        // Debt is one quota at most: 10 counted of a limit of 5.
        let mut s = SlidingLogState::default();
        let d = a.check(&mut s, 2, 100).unwrap();
        a.check(&mut s, 1, 200).unwrap();
        a.settle(&mut s, Charged::of(2, 100, &d), 50, 300);
        assert_eq!(s.total, 10);
        assert_eq!(s.entries[0], LogEntry { at: 100, cost: 9 });
        // Debt: denied until the entry leaves, exactly.
        let mut s = SlidingLogState::default();
        let d = a.check(&mut s, 2, 100).unwrap();
        a.settle(&mut s, Charged::of(2, 100, &d), 9, 300);
        assert_eq!(assert_retry_exact(&a, &s, 1, 300), 800);
    }
}

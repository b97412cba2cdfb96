//! Fixed window: at most `limit` per aligned window.
//!
//! Window `k` covers `[k*W, (k+1)*W)` on the clock's scale (the Unix epoch
//! for the real clocks), and its count starts at zero. It is the cheapest
//! algorithm (16 bytes of state) and the least exact: `limit` at the end of
//! one window plus `limit` at the start of the next is `2 * limit` within a
//! few microseconds.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::Duration;
//! use spillway::algorithm::{Algorithm, FixedWindow};
//! use spillway::Quota;
//!
//! let fw = FixedWindow::new(Quota::per_second(NonZeroU32::new(2).unwrap()));
//! let mut state = Default::default();
//! assert!(fw.check(&mut state, 1, 999_000).unwrap().allowed);
//! assert!(fw.check(&mut state, 1, 999_000).unwrap().allowed);
//! let denied = fw.check(&mut state, 1, 999_500).unwrap();
//! assert!(!denied.allowed);
//! // The next window starts at 1 s: 500 µs from now.
//! assert_eq!(denied.retry_after, Some(Duration::from_micros(500)));
//! assert!(fw.check(&mut state, 1, 1_000_000).unwrap().allowed);
//! ```

use std::num::NonZeroU32;

use super::calendar::Calendar;
use super::{Algorithm, Charged, check_keeping_a_copy, ensure_fits, owing_at_most_one_quota};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;
use crate::quota::Quota;

/// The fixed window algorithm's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    // The quota's parts, with the calendar in what would be the quota's
    // padding: 16 bytes, as a quota alone.
    limit: NonZeroU32,
    /// Windows of calendar periods, in place of the quota's period.
    calendar: Option<Calendar>,
    period: Micros,
}

/// A key's count in its current window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FixedWindowState {
    /// The index of the window the count belongs to (`now / window`, or
    /// the calendar period's index).
    pub window: u64,
    /// The cost admitted in that window.
    pub count: u64,
}

impl FixedWindow {
    /// `quota.limit()` per aligned window of `quota.period()`.
    pub const fn new(quota: Quota) -> Self {
        Self {
            limit: quota.limit(),
            calendar: None,
            period: quota.period_micros(),
        }
    }

    /// `limit` per calendar period (a day, a week, a month in a time zone):
    /// the count starts afresh at each period's first instant, and a
    /// denial waits exactly until then, whatever the period's length
    /// (daylight saving, months of 28 to 31 days). Its quota's period is
    /// the calendar's nominal one ([`Period::nominal`](super::Period::nominal)).
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use spillway::algorithm::{Algorithm, Calendar, FixedWindow, Period};
    ///
    /// let monthly = FixedWindow::calendar(
    ///     NonZeroU32::new(2).unwrap(),
    ///     Calendar::new(Period::Month, "UTC".parse().unwrap()),
    /// );
    /// let mut state = Default::default();
    /// let feb_28_noon = 1_835_352_000_000_000; // 2028-02-28T12:00:00Z
    /// assert!(monthly.check(&mut state, 2, feb_28_noon).unwrap().allowed);
    /// let denied = monthly.check(&mut state, 1, feb_28_noon).unwrap();
    /// // 2028 is a leap year: March starts 36 hours later.
    /// assert_eq!(denied.retry_after, Some(Duration::from_secs(36 * 3600)));
    /// ```
    pub fn calendar(limit: NonZeroU32, calendar: Calendar) -> Self {
        let quota = Quota::new(limit, calendar.period().nominal())
            .expect("a calendar's nominal period is valid");
        Self {
            calendar: Some(calendar),
            ..Self::new(quota)
        }
    }

    /// The calendar whose periods are the windows, if they are.
    pub const fn calendar_of(&self) -> Option<Calendar> {
        self.calendar
    }

    /// The same windows with another limit.
    pub fn with_limit(&self, limit: NonZeroU32) -> Self {
        Self { limit, ..*self }
    }

    fn limit(&self) -> u64 {
        u64::from(self.limit.get())
    }

    /// The index of the window that holds `t`.
    #[inline]
    fn index(&self, t: Micros) -> u64 {
        match &self.calendar {
            None => t / self.period,
            Some(c) => calendar_index(c, t),
        }
    }

    /// When window `k` ends (the next one starts).
    #[inline]
    fn end(&self, k: u64) -> Micros {
        match &self.calendar {
            None => k.saturating_add(1).saturating_mul(self.period),
            Some(c) => calendar_start(c, k.saturating_add(1)),
        }
    }
}

// Out of line: the time zone arithmetic would keep a plain window's check
// from being inlined where it is called.
#[cold]
#[inline(never)]
fn calendar_index(c: &Calendar, t: Micros) -> u64 {
    c.index(t)
}

#[cold]
#[inline(never)]
fn calendar_start(c: &Calendar, k: u64) -> Micros {
    c.start(k)
}

/// The calendar period of `now` (or `stored`, if later) and its end.
#[cold]
#[inline(never)]
fn calendar_window(c: &Calendar, now: Micros, stored: u64) -> (u64, Micros) {
    let k = c.index(now).max(stored);
    (k, c.start(k.saturating_add(1)))
}

impl Algorithm for FixedWindow {
    type State = FixedWindowState;
    /// The state before the charge.
    type Undo = FixedWindowState;

    fn quota(&self) -> Quota {
        Quota::from_parts(self.limit, self.period)
    }

    fn capacity(&self) -> u64 {
        self.limit()
    }

    // Inlined into the store's check, as it was before calendars gave it a
    // second (out of line) branch: called, it made a fixed window's check
    // through the store 15% slower (the paired bench).
    #[inline]
    fn check(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge> {
        let limit = self.limit();
        ensure_fits(cost, limit)?;
        // The window of now; if time went backwards, the stored one: keep
        // counting in it rather than free its capacity.
        let (k, window_end) = match &self.calendar {
            None => {
                let w = self.period;
                let k = (now / w).max(state.window);
                (k, (k + 1).saturating_mul(w))
            }
            Some(c) => calendar_window(c, now, state.window),
        };
        if k > state.window {
            *state = FixedWindowState {
                window: k,
                count: 0,
            };
        }
        let until_end = window_end.saturating_sub(now);
        // Cost 0 only looks: allowed even over the limit (in debt, or with
        // a lowered limit).
        if cost == 0 || state.count + cost <= limit {
            state.count += cost;
            let reset = if state.count > 0 { until_end } else { 0 };
            // Nothing comes back before the window ends, and then all of it.
            Ok(Decision::allow(
                limit,
                limit.saturating_sub(state.count),
                reset,
                reset,
            ))
        } else {
            // A count over the limit is possible: the limit was lowered
            // and the store kept the key's count.
            Ok(Decision::deny(
                limit,
                limit.saturating_sub(state.count),
                until_end,
                until_end,
                until_end,
            ))
        }
    }

    fn check_undoable(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<(Decision, Option<Self::Undo>), CostTooLarge> {
        check_keeping_a_copy(self, state, cost, now)
    }

    fn undo(&self, state: &mut Self::State, undo: Self::Undo) {
        *state = undo;
    }

    fn refund(&self, state: &mut Self::State, cost: u64, charged_at: Micros) {
        if self.index(charged_at) == state.window {
            state.count = state.count.saturating_sub(cost);
        }
    }

    fn settle(&self, state: &mut Self::State, charged: Charged, actual: u64, now: Micros) {
        let current = self.index(now);
        if state.window < current {
            // The stored window has ended: a give-back has nothing to
            // change (that window's count decides nothing any more), and
            // an overrun was served now, so it counts in the window of now.
            if actual <= charged.cost {
                return;
            }
            *state = FixedWindowState {
                window: current,
                count: 0,
            };
        }
        if actual < charged.cost {
            if self.index(charged.at) == state.window {
                state.count = state.count.saturating_sub(charged.cost - actual);
            }
        } else if actual > charged.cost {
            let limit = self.limit();
            let count = owing_at_most_one_quota(state.count, actual - charged.cost, limit);
            // A check on Redis adds its cost (the limit at most) before it
            // looks, in a 33-bit count: the debt leaves room for it.
            state.count = count.min(state.count.max(MAX_REDIS_COUNT - limit));
        }
    }

    #[inline]
    fn idle_at(&self, state: &Self::State) -> Micros {
        if state.count == 0 {
            0
        } else {
            self.end(state.window)
        }
    }
}

/// The largest count the Redis store's fixed window holds (33 bits).
const MAX_REDIS_COUNT: u64 = (1 << 33) - 1;

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn fw(limit: u32, window: u64) -> FixedWindow {
        FixedWindow::new(
            Quota::new(
                NonZeroU32::new(limit).unwrap(),
                Duration::from_micros(window),
            )
            .unwrap(),
        )
    }

    #[test]
    fn boundary_burst_admits_twice_the_limit() {
        let a = fw(3, 1000);
        let mut s = FixedWindowState::default();
        for _ in 0..3 {
            assert!(a.check(&mut s, 1, 999).unwrap().allowed);
        }
        assert!(!a.check(&mut s, 1, 999).unwrap().allowed);
        for _ in 0..3 {
            assert!(a.check(&mut s, 1, 1000).unwrap().allowed);
        }
    }

    #[test]
    fn cost_above_limit_is_an_error_and_exact_limit_fits() {
        let a = fw(3, 1000);
        let mut s = FixedWindowState::default();
        assert_eq!(
            a.check(&mut s, 4, 0),
            Err(CostTooLarge {
                cost: 4,
                capacity: 3
            })
        );
        assert!(a.check(&mut s, 3, 0).unwrap().allowed);
    }

    #[test]
    fn time_going_backwards_frees_nothing() {
        let a = fw(1, 1000);
        let mut s = FixedWindowState::default();
        assert!(a.check(&mut s, 1, 5_500).unwrap().allowed);
        let d = a.check(&mut s, 1, 4_000).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_micros(2_000)));
    }

    #[test]
    fn refund_restores_the_count() {
        let a = fw(2, 1000);
        let mut s = FixedWindowState::default();
        a.check(&mut s, 2, 10).unwrap();
        a.refund(&mut s, 2, 10);
        assert_eq!(a.check(&mut s, 0, 10).unwrap().remaining, 2);
        assert_eq!(a.idle_at(&s), 0);
    }

    #[test]
    fn undo_puts_back_the_state_before_the_charge() {
        use crate::algorithm::assert_undo_restores;
        let a = fw(3, 1000);
        let fresh = FixedWindowState::default();
        assert_eq!(assert_undo_restores(&a, &fresh, 3, 1_200), fresh);
        let mut s = fresh;
        a.check(&mut s, 1, 1_200).unwrap();
        // The same window; the next one, which starts a new count; a clock
        // set back, which charges the stored window (where a refund at that
        // time would not look).
        for (cost, now) in [(2, 1_500), (3, 2_000), (1, 900), (2, 0)] {
            assert_eq!(
                assert_undo_restores(&a, &s, cost, now),
                s,
                "{cost} at {now}"
            );
        }
    }

    #[test]
    fn a_settle_adjusts_the_window_the_charge_went_to() {
        use crate::algorithm::{Charged, assert_retry_exact, assert_settle_as_if_charged};
        let a = fw(5, 1000);
        let mut busy = FixedWindowState::default();
        a.check(&mut busy, 2, 1_100).unwrap();
        for before in [FixedWindowState::default(), busy] {
            for (cost, actual) in [(3, 0), (3, 1), (1, 3)] {
                assert_settle_as_if_charged(&a, &before, cost, actual, 1_200);
            }
        }
        // Debt: over the limit until the window ends.
        let mut s = FixedWindowState::default();
        let d = a.check(&mut s, 2, 1_100).unwrap();
        a.settle(&mut s, Charged::of(2, 1_100, &d), 12, 1_300);
        assert_eq!(assert_retry_exact(&a, &s, 1, 1_300), 700);
        // After the window ended, a give-back changes nothing...
        let mut s = FixedWindowState::default();
        let d = a.check(&mut s, 4, 1_100).unwrap();
        a.check(&mut s, 1, 2_100).unwrap();
        let later = s;
        a.settle(&mut s, Charged::of(4, 1_100, &d), 0, 2_200);
        assert_eq!(s, later);
        // ...and an overrun counts in the window it was served in.
        a.settle(&mut s, Charged::of(4, 1_100, &d), 7, 2_200);
        assert_eq!(
            s,
            FixedWindowState {
                window: 2,
                count: 4
            }
        );
        // Also when nothing was charged since the charge's window ended.
        let mut s = FixedWindowState::default();
        let d = a.check(&mut s, 4, 1_100).unwrap();
        a.settle(&mut s, Charged::of(4, 1_100, &d), 6, 2_200);
        assert_eq!(
            s,
            FixedWindowState {
                window: 2,
                count: 2
            }
        );
        // Debt is one quota at most: 10 counted of a limit of 5.
        let mut s = FixedWindowState::default();
        let d = a.check(&mut s, 4, 1_100).unwrap();
        a.settle(&mut s, Charged::of(4, 1_100, &d), 40, 1_200);
        assert_eq!(s.count, 10);
        // Also for a key forgotten since, and after a window with no charge.
        let mut s = FixedWindowState::default();
        a.settle(&mut s, Charged::of(4, 1_100, &d), 6, 3_500);
        assert_eq!(
            s,
            FixedWindowState {
                window: 3,
                count: 2
            }
        );
    }

    /// New York, whose clocks went forward at 02:00 on 2026-03-08: that
    /// day is 23 hours long, from 05:00 UTC to 04:00 UTC the next day.
    fn new_york_daily(limit: u32) -> FixedWindow {
        use super::super::calendar::{Calendar, Period};
        FixedWindow::calendar(
            NonZeroU32::new(limit).unwrap(),
            Calendar::new(Period::Day, "America/New_York".parse().unwrap()),
        )
    }

    const HOUR: u64 = 3_600_000_000;
    /// 2026-03-08T05:00:00Z: midnight in New York.
    const MARCH_8: u64 = 1_772_946_000_000_000;

    #[test]
    fn a_calendar_day_waits_exactly_until_the_next_local_midnight() {
        let a = new_york_daily(2);
        let mut s = FixedWindowState::default();
        let noon = MARCH_8 + 11 * HOUR; // 12:00 EDT (16:00 UTC)
        assert!(a.check(&mut s, 2, noon).unwrap().allowed);
        let denied = a.check(&mut s, 1, noon).unwrap();
        assert!(!denied.allowed);
        // Midnight is 23 h after the last, so 12 h after noon.
        let next = MARCH_8 + 23 * HOUR;
        assert_eq!(denied.retry_after, Some(Duration::from_micros(next - noon)));
        assert_eq!(denied.reset_after, Duration::from_micros(next - noon));
        assert!(!a.check(&mut s, 1, next - 1).unwrap().allowed);
        assert!(a.check(&mut s, 1, next).unwrap().allowed);
        assert_eq!(a.idle_at(&s), next + 24 * HOUR);
    }

    #[test]
    fn a_calendar_days_refund_and_settle_touch_only_their_own_day() {
        let a = new_york_daily(10);
        let mut s = FixedWindowState::default();
        let noon = MARCH_8 + 11 * HOUR;
        let d = a.check(&mut s, 6, noon).unwrap();
        let charged = Charged::of(6, noon, &d);
        a.settle(&mut s, charged, 2, noon + HOUR);
        assert_eq!(s.count, 2);
        a.refund(&mut s, 2, noon);
        assert_eq!(s.count, 0);
        // A settle on the next day gives nothing back to it.
        let d = a.check(&mut s, 6, noon).unwrap();
        let charged = Charged::of(6, noon, &d);
        let tomorrow = MARCH_8 + 23 * HOUR + HOUR;
        a.settle(&mut s, charged, 0, tomorrow);
        assert_eq!(a.check(&mut s, 0, noon).unwrap().remaining, 4);
    }
}

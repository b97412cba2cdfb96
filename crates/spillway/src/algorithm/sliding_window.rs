//! Sliding window counter: the previous window's count, weighted by how much
//! of it the sliding window still covers, plus the current window's count.
//!
//! With `e` the time elapsed in the current aligned window,
//! `estimate = prev * (W - e) / W + curr`, and a request of cost `c` is
//! admitted when `estimate + c <= limit`. The comparison is done in exact
//! integers (`prev * (W - e) + (curr + c) * W <= limit * W`), never on a
//! rounded estimate. Two counters and a window index: 24 bytes per key.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::Duration;
//! use spillway::algorithm::{Algorithm, SlidingWindow};
//! use spillway::Quota;
//!
//! let sw = SlidingWindow::new(Quota::new(NonZeroU32::new(10).unwrap(), Duration::from_micros(1000)).unwrap());
//! let mut state = Default::default();
//! assert!(sw.check(&mut state, 10, 500).unwrap().allowed);
//! // At t=1250 the previous window still weighs 75%: 7.5 of 10 used.
//! let d = sw.check(&mut state, 3, 1250).unwrap();
//! assert!(!d.allowed);
//! // 3 fit once the weight is down to 70%: at t=1300.
//! assert_eq!(d.retry_after, Some(Duration::from_micros(50)));
//! assert!(sw.check(&mut state, 3, 1300).unwrap().allowed);
//! ```

use super::{Algorithm, Charged, check_keeping_a_copy, ensure_fits, owing_at_most_one_quota};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;
use crate::quota::Quota;

/// The sliding window counter's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    quota: Quota,
}

/// The counts of a key's current and previous aligned windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlidingWindowState {
    /// The index of the current window (`now / window`).
    pub window: u64,
    /// The cost admitted in the window before it.
    pub prev: u64,
    /// The cost admitted in the current window.
    pub curr: u64,
}

impl SlidingWindow {
    /// About `quota.limit()` in any window of `quota.period()`.
    pub const fn new(quota: Quota) -> Self {
        Self { quota }
    }

    fn limit(&self) -> u64 {
        u64::from(self.quota.limit().get())
    }

    fn window(&self) -> u64 {
        self.quota.period_micros()
    }

    /// Moves the state to the window containing `now`; returns the time
    /// elapsed in it.
    fn roll(&self, state: &mut SlidingWindowState, now: Micros) -> u64 {
        let w = self.window();
        let k = now / w;
        if k < state.window {
            // Time went backwards: stay in the stored window and give the
            // previous one its full weight, which frees nothing.
            return 0;
        }
        if k == state.window + 1 {
            *state = SlidingWindowState {
                window: k,
                prev: state.curr,
                curr: 0,
            };
        } else if k > state.window {
            *state = SlidingWindowState {
                window: k,
                prev: 0,
                curr: 0,
            };
        }
        now - k * w
    }

    fn reset_after(&self, state: &SlidingWindowState, now: Micros) -> Micros {
        self.idle_at(state).saturating_sub(now)
    }

    /// How long until a request of `cost` (at most the limit, and more than
    /// fits now) fits, the state rolled to `now`'s window: in this window,
    /// once the previous window's weight has dropped enough, or in the next,
    /// where this window's count is the previous one and decays from full
    /// weight.
    fn fits_after(&self, state: &SlidingWindowState, cost: u64, now: Micros) -> Micros {
        let (l, w) = (u128::from(self.limit()), u128::from(self.window()));
        let (prev, curr, c) = (
            u128::from(state.prev),
            u128::from(state.curr),
            u128::from(cost),
        );
        let window_start = u128::from(state.window) * w;
        let in_this_window = match l.checked_sub(curr + c) {
            Some(room) if prev > 0 => {
                let e_ok = w.saturating_sub(mul_div(room, w, prev));
                (e_ok < w).then_some(e_ok)
            }
            _ => None,
        };
        let fits_at = match in_this_window {
            Some(e_ok) => window_start + e_ok,
            None if curr == 0 => window_start + w,
            None => window_start + w + w.saturating_sub(mul_div(l - c, w, curr)),
        };
        super::to_micros(fits_at).saturating_sub(now)
    }

    /// When one more unit fits than `remaining`; zero when the quota is
    /// whole. Up to two windows away: the count of this window weighs on
    /// the next one, decaying from full weight, so a single unit counted now
    /// is whole again only when the next window ends.
    fn refill_after(&self, state: &SlidingWindowState, remaining: u64, now: Micros) -> Micros {
        if remaining >= self.limit() {
            return 0;
        }
        self.fits_after(state, remaining + 1, now)
    }
}

/// `a * b / d` rounded down (`d > 0`): in 64 bits when the product fits, as
/// it does for every usual limit and window, else in 128.
fn mul_div(a: u128, b: u128, d: u128) -> u128 {
    if let (Ok(a64), Ok(b64), Ok(d64)) = (u64::try_from(a), u64::try_from(b), u64::try_from(d))
        && let Some(product) = a64.checked_mul(b64)
    {
        return u128::from(product / d64);
    }
    a * b / d
}

impl Algorithm for SlidingWindow {
    type State = SlidingWindowState;
    /// The state before the charge.
    type Undo = SlidingWindowState;

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
        let limit = self.limit();
        ensure_fits(cost, limit)?;
        let e = self.roll(state, now);
        let (l, w) = (u128::from(limit), u128::from(self.window()));
        let (prev, curr) = (u128::from(state.prev), u128::from(state.curr));
        let weighted_prev = prev * (w - u128::from(e));
        let used = |curr: u128| weighted_prev + curr * w;
        let remaining = |curr: u128| super::to_micros((l * w).saturating_sub(used(curr)) / w);

        let c = u128::from(cost);
        // Cost 0 only looks: allowed even when a clock set back gives the
        // previous window its full weight again and the sum is over the limit.
        if cost == 0 || used(curr + c) <= l * w {
            state.curr += cost;
            let left = remaining(u128::from(state.curr));
            return Ok(Decision::allow(
                limit,
                left,
                self.reset_after(state, now),
                self.refill_after(state, left, now),
            ));
        }
        let left = remaining(curr);
        Ok(Decision::deny(
            limit,
            left,
            self.reset_after(state, now),
            self.refill_after(state, left, now),
            self.fits_after(state, cost, now),
        ))
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
        let k = charged_at / self.window();
        if k == state.window {
            state.curr = state.curr.saturating_sub(cost);
        } else if k + 1 == state.window {
            state.prev = state.prev.saturating_sub(cost);
        }
    }

    fn settle(&self, state: &mut Self::State, charged: Charged, actual: u64, now: Micros) {
        self.roll(state, now);
        let k = charged.at / self.window();
        // The charge's window is this one or the previous one, whose count
        // still weighs; older, its count decides nothing any more.
        let in_prev = k + 1 == state.window;
        let count = if in_prev {
            &mut state.prev
        } else {
            &mut state.curr
        };
        if actual < charged.cost {
            if k == state.window || in_prev {
                *count = count.saturating_sub(charged.cost - actual);
            }
        } else if actual > charged.cost {
            // Older, the overrun was served since: in the window of `now`.
            *count = owing_at_most_one_quota(*count, actual - charged.cost, self.limit());
        }
    }

    fn idle_at(&self, state: &Self::State) -> Micros {
        let w = self.window();
        if state.curr > 0 {
            (state.window + 2).saturating_mul(w)
        } else if state.prev > 0 {
            (state.window + 1).saturating_mul(w)
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn sw(limit: u32, window: u64) -> SlidingWindow {
        SlidingWindow::new(
            Quota::new(
                NonZeroU32::new(limit).unwrap(),
                Duration::from_micros(window),
            )
            .unwrap(),
        )
    }

    /// `refill_after`, the RateLimit field's `t`: the next unit comes back as
    /// the previous window's weight falls, long before the whole quota
    /// does; a lone unit counted in this window only when the next ends.
    #[test]
    fn the_next_unit_comes_back_as_the_previous_window_fades() {
        let w = 60_000_000;
        let alg = sw(100, w);
        let mut state = SlidingWindowState::default();
        assert!(alg.check(&mut state, 100, 10 * w + 1).unwrap().allowed);
        // Half way through the next window the 100 weigh 50.
        let d = alg.check(&mut state, 0, 11 * w + w / 2).unwrap();
        assert_eq!(d.remaining, 50);
        assert_eq!(d.reset_after, Duration::from_micros(w / 2));
        // 51 fit once the weight is down to 49%: 0.6 s later.
        assert_eq!(d.refill_after, Duration::from_micros(600_000));
        let later = alg
            .check(&mut state.clone(), 51, 11 * w + w / 2 + 600_000)
            .unwrap();
        assert!(later.allowed);
        // One request at the start of a window: 99 left until it weighs
        // nothing, at the end of the next window.
        let mut state = SlidingWindowState::default();
        let d = alg.check(&mut state, 1, 20 * w).unwrap();
        assert_eq!(d.remaining, 99);
        assert_eq!(d.refill_after, Duration::from_micros(2 * w));
        assert_eq!(d.reset_after, Duration::from_micros(2 * w));
    }

    #[test]
    fn no_early_floor_of_the_weighted_count() {
        // prev = 3 at weight 0.5 is 1.5: with limit 3, 1 more fits, 2 do not.
        let a = sw(3, 1000);
        let mut s = SlidingWindowState {
            window: 0,
            prev: 0,
            curr: 3,
        };
        assert!(!a.check(&mut s, 2, 1500).unwrap().allowed);
        let d = a.check(&mut s, 1, 1500).unwrap();
        assert!(d.allowed);
        // 3 - 1.5 - 1 = 0.5 left: rounds down to 0.
        assert_eq!(d.remaining, 0);
    }

    #[test]
    fn retry_after_in_the_next_window_when_current_is_full() {
        let a = sw(4, 1000);
        let mut s = SlidingWindowState::default();
        assert!(a.check(&mut s, 4, 200).unwrap().allowed);
        let d = a.check(&mut s, 1, 300).unwrap();
        // Next window: 4 * (1000 - e)/1000 + 1 <= 4 needs e >= 250.
        assert_eq!(d.retry_after, Some(Duration::from_micros(950)));
        assert!(!a.check(&mut s, 1, 1249).unwrap().allowed);
        assert!(a.check(&mut s, 1, 1250).unwrap().allowed);
    }

    #[test]
    fn a_skipped_window_clears_both_counts() {
        let a = sw(2, 1000);
        let mut s = SlidingWindowState::default();
        a.check(&mut s, 2, 10).unwrap();
        assert_eq!(a.idle_at(&s), 2000);
        assert_eq!(a.check(&mut s, 2, 2000).unwrap().remaining, 0);
        assert_eq!(
            s,
            SlidingWindowState {
                window: 2,
                prev: 0,
                curr: 2
            }
        );
    }

    #[test]
    fn undo_puts_back_the_state_before_the_charge() {
        use crate::algorithm::assert_undo_restores;
        let a = sw(4, 1000);
        let fresh = SlidingWindowState::default();
        assert_eq!(assert_undo_restores(&a, &fresh, 4, 1_200), fresh);
        let mut s = fresh;
        a.check(&mut s, 2, 300).unwrap();
        a.check(&mut s, 1, 1_200).unwrap();
        // The same window; the next, which rolls the counts; one after a
        // skipped window, which clears them; a clock set back, which gives
        // the previous window its full weight.
        for (cost, now) in [(1, 1_500), (2, 2_100), (4, 5_000), (1, 800)] {
            assert_eq!(
                assert_undo_restores(&a, &s, cost, now),
                s,
                "{cost} at {now}"
            );
        }
    }

    #[test]
    fn a_settle_adjusts_the_window_the_charge_went_to_while_it_weighs() {
        use crate::algorithm::{Charged, assert_retry_exact, assert_settle_as_if_charged};
        let a = sw(5, 1000);
        let mut busy = SlidingWindowState::default();
        a.check(&mut busy, 2, 500).unwrap();
        a.check(&mut busy, 1, 1_100).unwrap();
        for before in [SlidingWindowState::default(), busy] {
            for (cost, actual) in [(2, 0), (2, 1), (1, 2)] {
                assert_settle_as_if_charged(&a, &before, cost, actual, 1_200);
            }
        }
        // Settled in the next window: the previous count still weighs, and
        // is the one adjusted.
        let mut s = SlidingWindowState::default();
        let d = a.check(&mut s, 4, 900).unwrap();
        a.settle(&mut s, Charged::of(4, 900, &d), 1, 1_500);
        assert_eq!(
            s,
            SlidingWindowState {
                window: 1,
                prev: 1,
                curr: 0
            }
        );
        // Debt, paid back as the count decays.
        let mut s = SlidingWindowState::default();
        let d = a.check(&mut s, 2, 900).unwrap();
        a.settle(&mut s, Charged::of(2, 900, &d), 10, 900);
        assert_retry_exact(&a, &s, 1, 900);
        // Debt is one quota at most: each count 10 at most, of 5.
        let mut s = SlidingWindowState::default();
        let d = a.check(&mut s, 4, 900).unwrap();
        a.check(&mut s, 1, 1_100).unwrap();
        a.settle(&mut s, Charged::of(4, 900, &d), 40, 1_200);
        assert_eq!((s.prev, s.curr), (10, 1));
        // Two windows on, its count decides nothing: nothing to give back;
        // an overrun counts now.
        let mut s = SlidingWindowState::default();
        let d = a.check(&mut s, 4, 900).unwrap();
        a.settle(&mut s, Charged::of(4, 900, &d), 0, 2_100);
        assert_eq!(
            s,
            SlidingWindowState {
                window: 2,
                prev: 0,
                curr: 0
            }
        );
        a.settle(&mut s, Charged::of(4, 900, &d), 6, 2_100);
        assert_eq!(
            s,
            SlidingWindowState {
                window: 2,
                prev: 0,
                curr: 2
            }
        );
    }
}

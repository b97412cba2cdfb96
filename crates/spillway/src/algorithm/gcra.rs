//! The exact virtual-scheduling arithmetic shared by the token bucket and the
//! leaky bucket.
//!
//! Both buckets keep one timestamp: the time at which the bucket is back to
//! full (token bucket) or the queue has drained (leaky bucket). One unit of
//! cost moves it by `T = period / limit` µs, a fraction. Timestamps are kept
//! in units of `1 / per` µs (`per` being the reduced denominator of `T`), so
//! every step is an exact integer operation; they are stored as whole
//! microseconds plus a remainder so that the state stays in two `u64`s.

use super::Charged;
use crate::clock::Micros;
use crate::quota::Interval;

/// A timestamp `micros + frac / per` µs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tat {
    /// Whole microseconds.
    pub micros: Micros,
    /// The fraction of a microsecond, in units of `1 / per`, below `per`.
    pub frac: u64,
}

impl Tat {
    pub(super) fn scaled(self, per: u64) -> u128 {
        u128::from(self.micros) * u128::from(per) + u128::from(self.frac)
    }

    pub(super) fn from_scaled(v: u128, per: u64) -> Self {
        let per = u128::from(per);
        match u64::try_from(v / per) {
            Ok(micros) => Self {
                micros,
                frac: (v % per) as u64,
            },
            Err(_) => Self {
                micros: u64::MAX,
                frac: 0,
            },
        }
    }

    /// The first whole microsecond at or after this time.
    pub(super) fn ceil_micros(self) -> Micros {
        if self.frac > 0 {
            self.micros.saturating_add(1)
        } else {
            self.micros
        }
    }
}

/// One bucket check in scaled units.
pub(super) struct Step {
    pub admitted: bool,
    /// Whole units of cost that still fit after the decision.
    pub remaining: u64,
    /// Until the bucket is full / the queue empty, after the decision.
    pub reset_after: Micros,
    /// Until one more unit fits than `remaining`, after the decision.
    pub refill_after: Micros,
    /// When denied: until the request would fit.
    pub retry_after: Micros,
    /// Backlog in front of the request, in scaled units, before it was added.
    pub backlog: u128,
}

impl Step {
    /// The decision, without any shaping delay.
    pub fn decision(&self, capacity: u64) -> crate::Decision {
        if self.admitted {
            crate::Decision::allow(
                capacity,
                self.remaining,
                self.reset_after,
                self.refill_after,
            )
        } else {
            crate::Decision::deny(
                capacity,
                self.remaining,
                self.reset_after,
                self.refill_after,
                self.retry_after,
            )
        }
    }
}

/// Decides whether `cost` fits in a bucket of `capacity` units at `now`,
/// updating `tat` if it does.
pub(super) fn step(tat: &mut Tat, i: Interval, capacity: u64, cost: u64, now: Micros) -> Step {
    if i.per == 1
        && let Some(s) = step_whole(tat, i.micros, capacity, cost, now)
    {
        return s;
    }
    let per = i.per;
    let unit = u128::from(i.micros);
    let now_s = u128::from(now) * u128::from(per);
    let stored = tat.scaled(per);
    let start = stored.max(now_s);
    let backlog = start - now_s;
    let tolerance = u128::from(capacity) * unit;
    let after = start + u128::from(cost) * unit;
    let remaining = |backlog: u128| (tolerance.saturating_sub(backlog) / unit) as u64;
    let ceil_micros = |scaled: u128| super::to_micros(super::div_ceil(scaled, u128::from(per)));
    // One more unit fits once the backlog is down to what leaves room for
    // `left + 1` units of the tolerance (`left` the units that fit now).
    let refill = |backlog: u128, left: u64| {
        if left >= capacity {
            return 0;
        }
        ceil_micros((backlog + (u128::from(left) + 1) * unit).saturating_sub(tolerance))
    };
    // Cost 0 only looks, and is allowed even when a clock set back leaves
    // more backlog than the capacity.
    if cost == 0 || after - now_s <= tolerance {
        if cost > 0 {
            *tat = Tat::from_scaled(after, per);
        }
        let left = after - now_s;
        let units = remaining(left);
        Step {
            admitted: true,
            remaining: units,
            reset_after: ceil_micros(left),
            refill_after: refill(left, units),
            retry_after: 0,
            backlog,
        }
    } else {
        // `stored > now_s` here, since a cost within capacity always fits an
        // empty bucket; so is the time at which it fits.
        let fits_at = stored - (tolerance - u128::from(cost) * unit);
        let units = remaining(backlog);
        Step {
            admitted: false,
            remaining: units,
            reset_after: ceil_micros(backlog),
            refill_after: refill(backlog, units),
            retry_after: ceil_micros(fits_at - now_s),
            backlog,
        }
    }
}

/// [`step`] when one unit is a whole number of microseconds (`per == 1`, as
/// for 100 per minute or 10 per second) and nothing overflows 64 bits: the
/// same arithmetic without the 128-bit divisions. `None` when it would
/// overflow, for the general path to take over.
fn step_whole(tat: &mut Tat, unit: u64, capacity: u64, cost: u64, now: Micros) -> Option<Step> {
    let start = tat.micros.max(now);
    let backlog = start - now;
    let tolerance = capacity.checked_mul(unit)?;
    let after = start.checked_add(cost.checked_mul(unit)?)?;
    let remaining = |backlog: u64| tolerance.saturating_sub(backlog) / unit;
    let refill = |backlog: u64, left: u64| {
        if left >= capacity {
            return 0;
        }
        backlog
            .saturating_add((left + 1).saturating_mul(unit))
            .saturating_sub(tolerance)
    };
    let left = after - now;
    if cost == 0 || left <= tolerance {
        if cost > 0 {
            *tat = Tat {
                micros: after,
                frac: 0,
            };
        }
        let units = remaining(left);
        Some(Step {
            admitted: true,
            remaining: units,
            reset_after: left,
            refill_after: refill(left, units),
            retry_after: 0,
            backlog: u128::from(backlog),
        })
    } else {
        let fits_at = tat.micros - (tolerance - cost * unit);
        let units = remaining(backlog);
        Some(Step {
            admitted: false,
            remaining: units,
            reset_after: backlog,
            refill_after: refill(backlog, units),
            retry_after: fits_at - now,
            backlog: u128::from(backlog),
        })
    }
}

/// Gives back `cost` units.
pub(super) fn refund(tat: &mut Tat, i: Interval, cost: u64) {
    let back = u128::from(cost) * u128::from(i.micros);
    *tat = Tat::from_scaled(tat.scaled(i.per).saturating_sub(back), i.per);
}

/// Moves a bucket from a charge of `charged.cost` to one of `actual`, as
/// of the charge's time. The charge held the backlog up to its end, `end`
/// (`charged.at + charged.reset_after`); what refill has paid back by
/// `now` is not moved again:
/// - less: the charge's tail of `cost - actual` units goes, as much of it
///   as is still in the backlog at `now` (none once `now` is past `end`:
///   the bucket has since refilled those units, and giving them back
///   would hand them out twice);
/// - more: `actual - cost` units more, as if charged at `end`, less what
///   refill has paid back by `now`; past the capacity, that is debt. The
///   overrun counts for twice the capacity at most, and the backlog after
///   it is at most twice the capacity's (one quota owed at most).
pub(super) fn settle(
    tat: &mut Tat,
    i: Interval,
    capacity: u64,
    charged: Charged,
    actual: u64,
    now: Micros,
) {
    let per = u128::from(i.per);
    let unit = u128::from(i.micros);
    let now_s = u128::from(now) * per;
    let end_s = u128::from(charged.at.saturating_add(charged.reset_after)) * per;
    let stored = tat.scaled(i.per);
    if actual < charged.cost {
        let back = u128::from(charged.cost - actual) * unit;
        let outstanding = end_s.saturating_sub(now_s).min(back);
        if outstanding > 0 {
            *tat = Tat::from_scaled(stored.saturating_sub(outstanding), i.per);
        }
    } else if actual > charged.cost {
        // Two quotas of overrun at most: the backlog is capped at that.
        let extra = u128::from((actual - charged.cost).min(capacity.saturating_mul(2))) * unit;
        let outstanding = (end_s + extra).saturating_sub(now_s).min(extra);
        if outstanding > 0 {
            let most = now_s + 2 * u128::from(capacity) * unit;
            let settled = (stored.max(now_s) + outstanding).min(stored.max(most));
            *tat = Tat::from_scaled(settled, i.per);
        }
    }
}

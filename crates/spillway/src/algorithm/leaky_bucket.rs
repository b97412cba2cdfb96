//! Leaky bucket: requests leave at a constant rate, or are turned away.
//!
//! The bucket is a queue of at most `capacity` units draining at `limit` per
//! `period`: one unit every `T = period / limit`. The state is the time at
//! which the queue will have drained. A request of cost `c` is admitted when
//! the backlog in front of it plus its own `c` units fit in the capacity.
//!
//! - [`LeakyMode::Shape`] (the default): an admitted request gets a `delay`
//!   equal to the backlog in front of it, so that requests leave exactly `T`
//!   apart. That is traffic shaping; the HTTP layer holds the request for its
//!   delay. With [`with_delay(n)`](LeakyBucket::with_delay), like nginx's
//!   `delay=n`, the first `n` units of backlog pass without waiting.
//! - [`LeakyMode::Police`]: admit or reject at once, never delay (nginx's
//!   `nodelay`). Its decisions equal a token bucket's with `burst = capacity`.
//!
//! A capacity of 1 queues nothing; capacity `C` corresponds to nginx's
//! `burst = C - 1`.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::Duration;
//! use spillway::algorithm::{Algorithm, LeakyBucket};
//! use spillway::Quota;
//!
//! // 10 per second (one every 100 ms), queue of 3.
//! let lb = LeakyBucket::shape(Quota::per_second(NonZeroU32::new(10).unwrap()), NonZeroU32::new(3).unwrap());
//! let mut state = Default::default();
//! let delays: Vec<_> = (0..3).map(|_| lb.check(&mut state, 1, 0).unwrap().delay).collect();
//! assert_eq!(delays, [Duration::ZERO, Duration::from_millis(100), Duration::from_millis(200)]);
//! let full = lb.check(&mut state, 1, 0).unwrap();
//! assert!(!full.allowed);
//! assert_eq!(full.retry_after, Some(Duration::from_millis(100)));
//! ```

use std::num::NonZeroU32;
use std::time::Duration;

use super::gcra::{self, Tat};
use super::{Algorithm, Charged, check_keeping_a_copy, ensure_fits};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;
use crate::quota::{Interval, Quota};

/// Whether admitted requests wait for their turn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum LeakyMode {
    /// Delay admitted requests so they leave at a constant rate.
    #[default]
    Shape,
    /// Admit or reject at once; never delay.
    Police,
}

/// The leaky bucket's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeakyBucket {
    quota: Quota,
    capacity: NonZeroU32,
    mode: LeakyMode,
    // Units of backlog that pass without delay (nginx's `delay=`); only
    // meaningful when shaping.
    undelayed: u32,
    interval: Interval,
}

/// The time at which a key's queue will have drained.
pub type LeakyBucketState = Tat;

impl LeakyBucket {
    /// A shaping bucket: admitted requests are delayed to leave at `quota`'s
    /// rate; at most `capacity` units are queued.
    pub fn shape(quota: Quota, capacity: NonZeroU32) -> Self {
        Self::new(quota, capacity, LeakyMode::Shape)
    }

    /// A policing bucket: the same admissions as [`shape`](Self::shape), with
    /// no delay.
    pub fn police(quota: Quota, capacity: NonZeroU32) -> Self {
        Self::new(quota, capacity, LeakyMode::Police)
    }

    /// A bucket in the given mode.
    pub fn new(quota: Quota, capacity: NonZeroU32, mode: LeakyMode) -> Self {
        Self {
            quota,
            capacity,
            mode,
            undelayed: 0,
            interval: quota.emission_interval(),
        }
    }

    /// Lets the first `n` units of backlog through without delay, like
    /// nginx's `delay=n`; the rest are delayed. `n >= capacity` is police.
    pub fn with_delay(mut self, n: u32) -> Self {
        self.undelayed = n;
        self
    }

    /// The mode.
    pub const fn mode(&self) -> LeakyMode {
        self.mode
    }

    /// The units of backlog that are not delayed (see [`with_delay`](Self::with_delay)).
    pub const fn undelayed(&self) -> u32 {
        self.undelayed
    }
}

impl Algorithm for LeakyBucket {
    type State = LeakyBucketState;
    /// The state before the charge.
    type Undo = LeakyBucketState;

    fn quota(&self) -> Quota {
        self.quota
    }

    fn capacity(&self) -> u64 {
        u64::from(self.capacity.get())
    }

    fn check(
        &self,
        state: &mut Self::State,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge> {
        let capacity = self.capacity();
        ensure_fits(cost, capacity)?;
        let s = gcra::step(state, self.interval, capacity, cost, now);
        let mut decision = s.decision(capacity);
        if !s.admitted {
            return Ok(decision);
        }
        if self.mode == LeakyMode::Shape && cost > 0 {
            let free = u128::from(self.undelayed) * u128::from(self.interval.micros);
            let wait = s.backlog.saturating_sub(free);
            let micros = super::to_micros(super::div_ceil(wait, u128::from(self.interval.per)));
            decision.delay = Duration::from_micros(micros);
        }
        Ok(decision)
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

    fn refund(&self, state: &mut Self::State, cost: u64, _charged_at: Micros) {
        gcra::refund(state, self.interval, cost);
    }

    fn settle(&self, state: &mut Self::State, charged: Charged, actual: u64, now: Micros) {
        gcra::settle(state, self.interval, self.capacity(), charged, actual, now);
    }

    fn idle_at(&self, state: &Self::State) -> Micros {
        state.ceil_micros()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn departures_are_exactly_one_interval_apart_even_when_fractional() {
        // 3 per second: departures at 0, 1/3 s, 2/3 s, rounded up.
        let lb = LeakyBucket::shape(Quota::per_second(nz(3)), nz(10));
        let mut s = Tat::default();
        let departures: Vec<u64> = (0..4)
            .map(|_| lb.check(&mut s, 1, 0).unwrap().delay.as_micros() as u64)
            .collect();
        assert_eq!(departures, [0, 333_334, 666_667, 1_000_000]);
    }

    #[test]
    fn police_never_delays_and_capacity_one_never_queues() {
        let lb = LeakyBucket::police(Quota::per_second(nz(10)), nz(2));
        let mut s = Tat::default();
        assert_eq!(lb.check(&mut s, 1, 0).unwrap().delay, Duration::ZERO);
        assert_eq!(lb.check(&mut s, 1, 0).unwrap().delay, Duration::ZERO);
        assert!(!lb.check(&mut s, 1, 0).unwrap().allowed);

        let one = LeakyBucket::shape(Quota::per_second(nz(10)), nz(1));
        let mut s = Tat::default();
        assert!(one.check(&mut s, 1, 0).unwrap().allowed);
        assert!(!one.check(&mut s, 1, 99_999).unwrap().allowed);
        assert!(one.check(&mut s, 1, 100_000).unwrap().allowed);
    }

    #[test]
    fn nginx_delay_lets_the_first_units_through() {
        let lb = LeakyBucket::shape(Quota::per_second(nz(10)), nz(5)).with_delay(2);
        let mut s = Tat::default();
        let delays: Vec<u128> = (0..5)
            .map(|_| lb.check(&mut s, 1, 0).unwrap().delay.as_millis())
            .collect();
        assert_eq!(delays, [0, 0, 0, 100, 200]);
    }

    #[test]
    fn undo_puts_back_the_state_before_the_charge() {
        use crate::algorithm::assert_undo_restores;
        let quota = Quota::new(nz(3), Duration::from_micros(1000)).unwrap();
        for lb in [
            LeakyBucket::shape(quota, nz(5)).with_delay(1),
            LeakyBucket::police(quota, nz(5)),
        ] {
            let fresh = Tat::default();
            assert_eq!(assert_undo_restores(&lb, &fresh, 5, 10_000), fresh);
            let mut s = fresh;
            lb.check(&mut s, 2, 10_000).unwrap();
            for (cost, now) in [(3, 10_000), (4, 10_500), (5, 20_000), (1, 9_800)] {
                assert_eq!(
                    assert_undo_restores(&lb, &s, cost, now),
                    s,
                    "{cost} at {now}"
                );
            }
        }
    }

    #[test]
    fn a_settle_moves_the_queue_like_the_token_bucket() {
        use crate::algorithm::{Charged, assert_settle_as_if_charged};
        let lb = LeakyBucket::police(Quota::per_second(nz(3)), nz(6));
        for (cost, actual) in [(4, 1), (2, 5), (3, 3)] {
            assert_settle_as_if_charged(&lb, &Tat::default(), cost, actual, 50_000);
        }
        // Shaped: a give-back shortens the wait of the requests behind.
        let lb = LeakyBucket::shape(Quota::per_second(nz(2)), nz(10));
        let mut s = Tat::default();
        let first = lb.check(&mut s, 4, 0).unwrap();
        let queued = lb.check(&mut s.clone(), 1, 0).unwrap();
        assert_eq!(queued.delay.as_millis(), 2_000);
        lb.settle(&mut s, Charged::of(4, 0, &first), 1, 0);
        assert_eq!(lb.check(&mut s, 1, 0).unwrap().delay.as_millis(), 500);
    }
}

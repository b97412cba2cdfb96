//! The five algorithms, each a pure transition over integer microseconds.
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
#![doc = include_str!("../../../../docs/algorithms.md")]

mod any;
pub mod fixed_window;
mod gcra;
pub mod leaky_bucket;
pub mod sliding_log;
pub mod sliding_window;
pub mod token_bucket;

use std::fmt;

pub use any::{AnyAlgorithm, AnyState};
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
///   request is admitted, one microsecond earlier it is not.
pub trait Algorithm: Clone + fmt::Debug + Send + Sync + 'static {
    /// What the algorithm remembers about one key. `Default` is a key never
    /// seen, and any state whose [`idle_at`](Algorithm::idle_at) has passed
    /// behaves exactly like it.
    type State: Default + Clone + fmt::Debug + Send + Sync + 'static;

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

    /// Gives back a charge of `cost` that was admitted at `charged_at`, as
    /// when another rule of the same request denied it. Refunding right after
    /// the charge restores a state equivalent to the one before it.
    fn refund(&self, state: &mut Self::State, cost: u64, charged_at: Micros);

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

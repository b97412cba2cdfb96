//! What an algorithm says about one request: [`Decision`].

use std::time::Duration;

/// The outcome of checking one request against one limit.
///
/// Every field is exact: durations are rounded up to the microsecond, counts
/// down, so that a client that trusts them never retries too early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The request is admitted and has been charged.
    pub allowed: bool,
    /// The size of the quota: a window's limit or a bucket's capacity.
    pub limit: u64,
    /// How much more cost would be admitted right now, after this decision.
    pub remaining: u64,
    /// Time until the key's state is back to empty (window) or full (bucket):
    /// until the whole quota is back, if nothing else arrives.
    pub reset_after: Duration,
    /// Time until more than `remaining` is available: until the quota gives
    /// back its next unit, if nothing else arrives; zero when it is whole.
    /// What draft-ietf-httpapi-ratelimit-headers-11 calls the `t` of the
    /// `RateLimit` field ("the number of seconds until additional quota is
    /// made available"). At most [`reset_after`](Self::reset_after): at most
    /// one window, except for the sliding window counter, whose count
    /// weighs on the next window too: up to two.
    pub refill_after: Duration,
    /// Only on a denial: the exact wait until a request of the same cost
    /// would be admitted, if nothing else arrives meanwhile.
    pub retry_after: Option<Duration>,
    /// Leaky bucket in shape mode: how long to hold the admitted request
    /// before it may leave. Zero otherwise.
    pub delay: Duration,
}

impl Decision {
    pub(crate) fn allow(limit: u64, remaining: u64, reset_after: u64, refill_after: u64) -> Self {
        Self {
            allowed: true,
            limit,
            remaining,
            reset_after: Duration::from_micros(reset_after),
            refill_after: Duration::from_micros(refill_after),
            retry_after: None,
            delay: Duration::ZERO,
        }
    }

    pub(crate) fn deny(
        limit: u64,
        remaining: u64,
        reset_after: u64,
        refill_after: u64,
        retry_after: u64,
    ) -> Self {
        Self {
            allowed: false,
            limit,
            remaining,
            reset_after: Duration::from_micros(reset_after),
            refill_after: Duration::from_micros(refill_after),
            retry_after: Some(Duration::from_micros(retry_after)),
            delay: Duration::ZERO,
        }
    }
}

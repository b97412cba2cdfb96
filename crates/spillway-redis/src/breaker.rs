//! Circuit breakers: after Redis fails to answer, the failure policy
//! decides without asking it until the retry interval has passed; then one
//! request (the probe) asks again while the others keep to the policy, and
//! its answer closes the breaker or opens it for another interval.
//!
//! One breaker per cluster slot (one in all on a standalone server), so a
//! node that is down or slow turns the policy on for its own keys only.
//! Only a failure to answer trips one: a data error (a key of the wrong
//! type, a corrupt state) fails that request, never the store.
//!
//! The store's own passage between answering and not is logged once each
//! way: a warning when the first breaker opens, a line when the last one
//! closes; never one per request.

use std::fmt::Display;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Redis Cluster's slot count.
const SLOTS: usize = 16_384;

/// The breakers of one connection, shared by every store made on it.
#[derive(Debug)]
pub(crate) struct Breakers {
    epoch: Instant,
    retry_interval: Duration,
    breakers: Box<[Breaker]>,
    // How many breakers are open or half open: each breaker's passage from
    // closed to open adds one, and back takes one away (both are swaps, so
    // the count stays exact under races).
    open: AtomicUsize,
}

#[derive(Debug, Default)]
struct Breaker {
    // 0 while closed; else when the breaker half-opens, in ms after
    // `epoch`, plus one (so that 0 stays free).
    open_until: AtomicU64,
    // A probe is on its way while half open.
    probing: AtomicBool,
}

/// Whether a call may go to Redis.
#[derive(Debug)]
pub(crate) enum Gate<'a> {
    /// Closed: ask Redis.
    Closed,
    /// Half open, and this request is the probe: ask Redis, then report.
    Probe(Probe<'a>),
    /// Open (or half open with a probe on its way): apply the policy.
    Open,
}

/// The right to probe one breaker; given back if the request is dropped
/// before its answer arrives, so that the next request probes instead.
#[derive(Debug)]
pub(crate) struct Probe<'a> {
    breaker: &'a Breaker,
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        self.breaker.probing.store(false, Ordering::Release);
    }
}

impl Breakers {
    /// The breakers of a cluster connection (`cluster`) or a standalone one.
    pub(crate) fn new(cluster: bool, retry_interval: Duration) -> Self {
        let count = if cluster { SLOTS } else { 1 };
        Self {
            epoch: Instant::now(),
            retry_interval,
            breakers: (0..count).map(|_| Breaker::default()).collect(),
            open: AtomicUsize::new(0),
        }
    }

    fn of(&self, slot: u16) -> &Breaker {
        &self.breakers[usize::from(slot) % self.breakers.len()]
    }

    fn millis(&self, at: Instant) -> u64 {
        let elapsed = at.saturating_duration_since(self.epoch).as_millis();
        u64::try_from(elapsed).unwrap_or(u64::MAX - 1) + 1
    }

    /// Whether a call for `slot` may go to Redis at `now`.
    pub(crate) fn gate(&self, slot: u16, now: Instant) -> Gate<'_> {
        let breaker = self.of(slot);
        let open_until = breaker.open_until.load(Ordering::Acquire);
        if open_until == 0 {
            return Gate::Closed;
        }
        if self.millis(now) < open_until {
            return Gate::Open;
        }
        match breaker
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Gate::Probe(Probe { breaker }),
            Err(_) => Gate::Open,
        }
    }

    /// Redis answered for `slot`: the breaker closes. The last breaker to
    /// close logs that Redis answers again.
    pub(crate) fn answered(&self, slot: u16) {
        let breaker = self.of(slot);
        // A load first: a closed breaker (the usual case) is not written.
        if breaker.open_until.load(Ordering::Relaxed) != 0
            && breaker.open_until.swap(0, Ordering::AcqRel) != 0
            && self.open.fetch_sub(1, Ordering::AcqRel) == 1
        {
            tracing::info!(
                slot,
                "Redis answers again: every rule is decided by it from now on"
            );
        }
    }

    /// Redis failed to answer for `slot` at `now` (with `error`): the
    /// breaker opens for the retry interval. The first breaker to open logs
    /// a warning that the failure policies decide.
    pub(crate) fn failed(&self, slot: u16, now: Instant, error: &dyn Display) {
        let until = self.millis(now + self.retry_interval);
        if self.of(slot).open_until.swap(until, Ordering::AcqRel) == 0
            && self.open.fetch_add(1, Ordering::AcqRel) == 0
        {
            tracing::warn!(
                slot,
                error = %error,
                retry_interval_ms = self.retry_interval.as_millis(),
                "Redis does not answer: each rule's failure policy (on_error) decides \
                 its keys until Redis answers again"
            );
        }
    }

    /// Whether every breaker is closed.
    pub(crate) fn all_closed(&self) -> bool {
        self.open_count() == 0
    }

    /// How many breakers are open or half open.
    pub(crate) fn open_count(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_probe_at_a_time_once_the_interval_has_passed() {
        let breakers = Breakers::new(true, Duration::from_millis(250));
        assert!(matches!(breakers.gate(7, Instant::now()), Gate::Closed));
        breakers.failed(7, Instant::now(), &"down");
        assert!(matches!(breakers.gate(7, Instant::now()), Gate::Open));
        // Another slot (another node's, perhaps) is not concerned.
        assert!(matches!(breakers.gate(8, Instant::now()), Gate::Closed));
        tokio::time::advance(Duration::from_millis(250)).await;
        let probe = breakers.gate(7, Instant::now());
        assert!(matches!(probe, Gate::Probe(_)));
        assert!(matches!(breakers.gate(7, Instant::now()), Gate::Open));
        // A probe dropped unanswered lets the next request probe.
        drop(probe);
        let probe = breakers.gate(7, Instant::now());
        assert!(matches!(probe, Gate::Probe(_)));
        breakers.answered(7);
        drop(probe);
        assert!(matches!(breakers.gate(7, Instant::now()), Gate::Closed));
        assert!(breakers.all_closed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_opens_it_for_another_interval() {
        let breakers = Breakers::new(false, Duration::from_millis(100));
        breakers.failed(0, Instant::now(), &"down");
        tokio::time::advance(Duration::from_millis(100)).await;
        let Gate::Probe(probe) = breakers.gate(0, Instant::now()) else {
            panic!("expected a probe");
        };
        breakers.failed(0, Instant::now(), &"down");
        drop(probe);
        assert!(matches!(breakers.gate(0, Instant::now()), Gate::Open));
        assert_eq!(breakers.open_count(), 1);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(matches!(breakers.gate(0, Instant::now()), Gate::Probe(_)));
    }
}

//! Time, as the algorithms see it: an integer number of microseconds.
//!
//! The algorithms never read a clock. A store reads its [`Clock`] once per
//! call and passes `now` in, so tests can drive time by hand with
//! [`FakeClock`] and the Redis store can use the server's clock instead.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Microseconds on a clock's own scale. For [`SystemClock`] and
/// [`MonotonicClock`] that scale is "since the Unix epoch", so fixed windows
/// line up with wall-clock minutes and hours.
pub type Micros = u64;

/// A source of time for a store.
pub trait Clock: Send + Sync + 'static {
    /// The current time in microseconds.
    fn now(&self) -> Micros;
}

/// Wall-clock time read at start, then advanced by a monotonic timer.
///
/// It never goes backwards (an NTP step does not move it) and its values are
/// microseconds since the Unix epoch, so windows stay aligned to wall-clock
/// boundaries. This is the in-memory store's default clock. The timer is
/// `quanta`'s: the CPU's time-stamp counter, calibrated against the OS
/// clock, where it is invariant (read in a few nanoseconds, where
/// `clock_gettime` takes tens), and the OS's monotonic clock elsewhere.
///
/// ```
/// use spillway::clock::{Clock, MonotonicClock};
/// let clock = MonotonicClock::new();
/// let a = clock.now();
/// assert!(clock.now() >= a);
/// ```
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    timer: quanta::Clock,
    // The timer's raw reading at `origin_micros`. Elapsed time is taken
    // from raw readings (one scaling of a difference, in nanoseconds)
    // rather than through `quanta::Instant` and `Duration`, which split
    // it into seconds and nanoseconds only for `as_micros` to join them.
    origin_raw: u64,
    // The wall-clock time at `origin_raw`, so readings are comparable with the
    // Unix time used in `X-RateLimit-Reset`.
    origin_micros: Micros,
}

impl MonotonicClock {
    /// A clock anchored at the current wall-clock time.
    pub fn new() -> Self {
        let timer = quanta::Clock::new();
        Self {
            origin_raw: timer.raw(),
            timer,
            origin_micros: SystemClock.now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Micros {
        // Zero if the reading is before the origin (a core whose counter
        // lags), as `Instant::duration_since` would give.
        let nanos = self.timer.delta_as_nanos(self.origin_raw, self.timer.raw());
        self.origin_micros.saturating_add(nanos / 1000)
    }
}

/// The system's wall clock, in microseconds since the Unix epoch.
///
/// It can jump when the system time is set; the algorithms tolerate that
/// (time going backwards never frees capacity), but prefer
/// [`MonotonicClock`] for a single process.
///
/// ```
/// use spillway::clock::{Clock, SystemClock};
/// // Later than 2020-01-01.
/// assert!(SystemClock.now() > 1_577_836_800_000_000);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Micros {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX)
    }
}

/// A clock that moves only when told to. Clones share one time.
///
/// ```
/// use std::time::Duration;
/// use spillway::clock::{Clock, FakeClock};
/// let clock = FakeClock::new(1_000);
/// let shared = clock.clone();
/// clock.advance(Duration::from_millis(2));
/// assert_eq!(shared.now(), 3_000);
/// shared.set(10);
/// assert_eq!(clock.now(), 10);
/// ```
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    micros: Arc<AtomicU64>,
}

impl FakeClock {
    /// A fake clock that reads `start` microseconds.
    pub fn new(start: Micros) -> Self {
        Self {
            micros: Arc::new(AtomicU64::new(start)),
        }
    }

    /// Moves the time forward by `by` (whole microseconds; the rest is dropped).
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.micros
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(by))
            })
            .ok();
    }

    /// Sets the time, forwards or backwards.
    pub fn set(&self, micros: Micros) {
        self.micros.store(micros, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Micros {
        self.micros.load(Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Micros {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_starts_at_wall_time() {
        let wall = SystemClock.now();
        let mono = MonotonicClock::new().now();
        // Both read within a second of each other.
        assert!(mono.abs_diff(wall) < 1_000_000, "{mono} vs {wall}");
    }

    #[test]
    fn monotonic_clock_counts_elapsed_microseconds() {
        let clock = MonotonicClock::new();
        let a = clock.now();
        std::thread::sleep(Duration::from_millis(20));
        let b = clock.now();
        // A sleep lasts at least what it asks (only a lower bound holds on
        // a loaded machine); 5% off that for the counter's calibration.
        assert!(b - a >= 19_000, "{a} then {b}");
    }

    #[test]
    fn fake_clock_saturates_instead_of_wrapping() {
        let clock = FakeClock::new(u64::MAX - 1);
        clock.advance(Duration::from_secs(1));
        assert_eq!(clock.now(), u64::MAX);
    }
}

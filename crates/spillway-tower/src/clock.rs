//! A clock that follows tokio's time, so that tests under
//! `tokio::time::pause()` move the in-memory store's time with `advance`.

use spillway::clock::{Clock, Micros, SystemClock};
use tokio::time::Instant;

/// Tokio's clock, anchored at the wall-clock time it was created (so fixed
/// windows stay aligned to wall-clock boundaries). Under
/// `tokio::time::pause()` it stands still until `advance`. Create it inside
/// the runtime whose time it should follow.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    start: Instant,
    wall: Micros,
}

impl TokioClock {
    /// A clock reading the current wall-clock time, moving with tokio's.
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            wall: SystemClock.now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Micros {
        let elapsed = Instant::now().saturating_duration_since(self.start);
        self.wall
            .saturating_add(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
    }
}

//! What the tests of fixed windows on the wall clock share.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How close to a minute's end a test may start: its requests must all fall
/// within this margin of its start.
const MARGIN: Duration = Duration::from_secs(5);

/// Waits, when the wall clock is within [`MARGIN`] of a minute's end, until
/// the next minute has begun.
///
/// A fixed window runs on the server's clock, aligned to its length: a
/// one-minute window ends on every minute, an hour's or a week's on one of
/// them. A test whose requests straddled that boundary would see its counts
/// start afresh (a CI run saw a count of 1 of 3 where its test expected
/// 3 of 3), so every test that counts in a fixed window starts clear of one.
///
/// It blocks the thread rather than the task: under tokio's paused time a
/// task's sleep would end at once, the wall clock unmoved.
pub fn clear_of_a_minute_boundary() {
    let into_minute = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
        % 60.0;
    let left = 60.0 - into_minute;
    if left < MARGIN.as_secs_f64() {
        std::thread::sleep(Duration::from_secs_f64(left + 0.1));
    }
}

//! Every algorithm on the same short burst, with the numbers a client would
//! see in its headers.
//!
//! Run with: `cargo run --release -p example-quickstart`
//!
//! The clock is a `FakeClock`, so the run is instant and the same every time:
//! each algorithm gets a quota of 4 per second (token and leaky buckets hold 4)
//! and sees 6 requests at t = 0, then one request at 250 ms, 500 ms and 1 s.

use std::num::NonZeroU32;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::{
    AnyAlgorithm, FixedWindow, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket,
};
use spillway::clock::{Clock, FakeClock};
use spillway::store::{MemoryOptions, RateLimiter};

fn main() {
    let four = NonZeroU32::new(4).expect("nonzero");
    let quota = Quota::per_second(four);
    let algorithms: [(&str, AnyAlgorithm); 6] = [
        ("fixed_window", FixedWindow::new(quota).into()),
        ("sliding_log", SlidingLog::new(quota).into()),
        ("sliding_window", SlidingWindow::new(quota).into()),
        ("token_bucket", TokenBucket::new(quota, four).into()),
        (
            "leaky_bucket (shape)",
            LeakyBucket::shape(quota, four).into(),
        ),
        (
            "leaky_bucket (police)",
            LeakyBucket::police(quota, four).into(),
        ),
    ];
    let arrivals_ms = [0, 0, 0, 0, 0, 0, 250, 500, 1000];

    for (name, algorithm) in algorithms {
        println!("\n{name}: 4 per second");
        println!("   t (ms)  outcome   remaining  reset (ms)  retry-after (ms)  delay (ms)");
        // Start one microsecond into a window, so the fixed window's
        // boundary sits at t = 1 s like everyone else's refill.
        let clock = FakeClock::new(1_000_000);
        let limiter: RateLimiter<_, String, _> =
            RateLimiter::with_options(algorithm, clock.clone(), MemoryOptions::default());
        let start = clock.now();
        for at in arrivals_ms {
            clock.set(start + at * 1_000);
            let d = limiter
                .check("client-1", 1)
                .expect("cost 1 fits every quota here");
            let outcome = if d.allowed { "admitted" } else { "DENIED" };
            let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
            println!(
                "   {at:>6}  {outcome:<8}  {:>9}  {:>10}  {:>16}  {:>10}",
                d.remaining,
                ms(d.reset_after),
                d.retry_after.map_or("-".to_string(), ms),
                ms(d.delay),
            );
        }
    }
}

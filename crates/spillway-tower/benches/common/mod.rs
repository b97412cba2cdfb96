//! What the `http` and `layer` benches share: the app, with and without the
//! rate limiter, and the peer they are measured against.

use std::num::NonZeroU32;

use axum::Router;
use axum::routing::get;
use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway_tower::{HeaderOptions, HttpRule, Policy, RateLimitLayer};

/// The app: a hello world.
pub fn hello() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

/// The app behind the layer: a per-IP token bucket that never denies (a
/// million a second, a burst of a billion), writing the header fields
/// `headers` asks for. A token a microsecond, not a nanosecond: real
/// limits are whole microseconds a token (100 a second is 10,000), which
/// the bucket's arithmetic takes in 64 bits; a nanosecond's takes 128.
pub fn limited(headers: HeaderOptions) -> Router {
    let burst = NonZeroU32::new(1_000_000_000).expect("nonzero");
    let rate = NonZeroU32::new(1_000_000).expect("nonzero");
    let rule = HttpRule::new("per-ip", TokenBucket::new(Quota::per_second(rate), burst));
    hello().layer(RateLimitLayer::in_memory(
        Policy::new([rule]).headers(headers),
    ))
}

/// The peer: the app behind `tower_governor` keyed by the peer's IP, the
/// same limit (a token a microsecond, a burst of a billion); `headers`
/// turns on its `x-ratelimit-limit` and `x-ratelimit-remaining`.
pub fn governed(headers: bool) -> Router {
    use tower_governor::GovernorLayer;
    use tower_governor::governor::GovernorConfigBuilder;
    let mut builder = GovernorConfigBuilder::default();
    builder
        .period(std::time::Duration::from_micros(1))
        .burst_size(1_000_000_000);
    if headers {
        let config = builder.use_headers().finish().expect("a valid limit");
        hello().layer(GovernorLayer::new(config))
    } else {
        let config = builder.finish().expect("a valid limit");
        hello().layer(GovernorLayer::new(config))
    }
}

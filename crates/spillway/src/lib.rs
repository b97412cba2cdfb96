//! Spillway's core: exact rate-limiting algorithms and an in-memory store.
//!
//! - [`algorithm`]: the six algorithms (fixed window, sliding log, sliding
//!   window counter, token bucket, leaky bucket, concurrency), each a pure transition
//!   `(config, state, cost, now) -> Decision` over integer microseconds.
//! - [`clock`]: where `now` comes from, including a [`FakeClock`](clock::FakeClock)
//!   for tests.
//! - [`store`]: the [`Store`](store::Store) trait every backend implements,
//!   and the in-memory store.
//!
//! Nothing here does I/O or knows about HTTP or Redis.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::Duration;
//! use spillway::algorithm::TokenBucket;
//! use spillway::clock::FakeClock;
//! use spillway::store::RateLimiter;
//! use spillway::Quota;
//!
//! let clock = FakeClock::new(0);
//! let per_second = Quota::per_second(NonZeroU32::new(2).unwrap());
//! let limiter = RateLimiter::with_clock(TokenBucket::new(per_second, NonZeroU32::new(2).unwrap()), clock.clone());
//! assert!(limiter.check(&7u64, 1).unwrap().allowed);
//! assert!(limiter.check(&7u64, 1).unwrap().allowed);
//! let denied = limiter.check(&7u64, 1).unwrap();
//! assert_eq!(denied.retry_after, Some(Duration::from_millis(500)));
//! clock.advance(Duration::from_millis(500));
//! assert!(limiter.check(&7u64, 1).unwrap().allowed);
//! ```

pub mod algorithm;
pub mod clock;
pub mod decision;
pub mod error;
pub mod quota;
pub mod store;

pub use algorithm::{Algorithm, AnyAlgorithm};
pub use decision::Decision;
pub use error::{ConfigError, CostTooLarge, Error};
pub use quota::Quota;

// The crate's README (its crates.io page) is compiled and run as doc tests.
// The repository's README is tested by examples/docs: a package may only
// include its own files.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

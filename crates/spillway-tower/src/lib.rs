//! Rate limiting middleware for tower and axum, on any Spillway store.
//!
//! [`RateLimitLayer`] applies a [`Policy`] (a list of [`HttpRule`]s plus how
//! to identify clients and what headers to send) to every request:
//!
//! - every rule that matches the request (method, path pattern, host) is
//!   checked, all in **one store call**: if any `reject` rule denies, the
//!   request is answered `429 Too Many Requests` and no rule is charged;
//! - keys are built from the API key, client IP (forwarded headers believed
//!   only from trusted proxies), user id, route, method or any header, and
//!   bounded in length;
//! - tiers (free, pro...) get their own quotas, from an API-key table or a
//!   trusted layer's header or extension;
//! - every response carries `X-RateLimit-Limit/Remaining/Reset` and the IETF
//!   draft fields `RateLimit-Policy` and `RateLimit`
//!   (draft-ietf-httpapi-ratelimit-headers-11); a 429 carries an exact
//!   `Retry-After` (whole seconds, rounded up, never 0) and a problem+json body;
//! - `shadow` rules only report, `degrade` rules mark the request as
//!   [`Limited`]; a leaky bucket in shape mode holds the request for its
//!   delay (a timer, never a busy wait) and gives its slot back if the client
//!   leaves, or if the server stops meanwhile ([`Draining`]: then a 503);
//!   a server may cap how many it holds at once ([`HoldCap`]: past it, a 503);
//! - a store that cannot decide gives a 503 (fail-closed) or whatever its
//!   failure policy says; never a 500;
//! - a rule that counts by IP, on a request without the peer's address (an
//!   axum app served without `into_make_service_with_connect_info`), is a
//!   500 saying how to fix it, logged once, unless the policy says to skip
//!   the rule ([`MissingClientAddr`]): never a limit that silently applies to
//!   nobody.
//!
//! Every request is decided by the [`Engine`] (`engine.rs`): the one place
//! where the store's decisions become an [`Outcome`], for this middleware
//! and for any other front end (a decision API, an Envoy rate limit
//! service), which call it themselves. The middleware is an adapter around
//! it, in tower's file layout: `layer.rs` ([`RateLimitLayer`]), `service.rs`
//! ([`RateLimit`]), `future.rs`, `error.rs`. See docs/architecture.md.

pub mod budget;
mod clock;
pub mod engine;
mod error;
mod future;
pub mod headers;
pub mod host;
pub mod key;
mod layer;
mod leases;
mod metered;
pub mod problem;
pub mod read_request;
mod response;
mod rules;
mod service;
pub mod usage;

pub use clock::TokioClock;
pub use engine::{
    Asking, BudgetEvent, Charge, Charges, Engine, Held, LeaseEvent, Observer, Outcome,
    OverCapacity, Reported, RuleOutcome, Ruling, Settled, Unplanned, retry_after_secs,
};
pub use error::RuleMismatch;
pub use future::{BoxFuture, ResponseBody, ResponseFuture};
pub use headers::{HeaderOptions, RateLimitFields, ResetFormat};
pub use key::{
    ClientAddr, Clients, Credential, ForwardedHeader, Ipv6Prefix, KeyPart, Tier, UserId,
};
pub use layer::RateLimitLayer;
pub use read_request::{ReadBody, ReadRequest, ReadRequestLayer};
pub use rules::{
    Action, BodyFormat, Cost, Glob, HttpRule, METHOD_OVERRIDES, MissingClientAddr, OtherPaths,
    Policy, RouteCost,
};
pub use service::{
    Draining, FieldsAside, HoldCap, HoldPlace, Limited, NotServed, RateLimit, RequestCost,
    X_SPILLWAY_LIMITED,
};

// The crate's README (its crates.io page) is compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

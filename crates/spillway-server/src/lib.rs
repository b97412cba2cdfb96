//! The Spillway service: the library behind the `spillway` command.
//!
//! - `spillway serve`: [`run`] serves the HTTP API ([`app()`]: `POST
//!   /v1/check`, `/healthz`, `/readyz`, `/metrics`, `/openapi.json`, the
//!   admin API; HTTP/1.1 by a server of its own, HTTP/2 by hyper) and the
//!   Envoy rate limit service ([`envoy`]), reloading the configuration
//!   ([`config`]) on SIGHUP and file change ([`reload`]); see
//!   `docs/server.md`.
//! - `spillway proxy`: [`proxy`].
//! - `spillway simulate`: its logic lives in the `spillway-sim` crate.
//!
//! Each front end ([`api`], [`envoy`], [`proxy`]) is an adapter of the
//! decision engine (`spillway_tower::Engine`) of the configuration loaded
//! now ([`state`]). The binary only parses its flags, sets up logging,
//! binds and calls the library. See docs/architecture.md.

pub mod api;
pub mod config;
pub mod envoy;
mod http1;
pub mod metrics;
pub mod probe;
pub mod proxy;
pub mod reload;
mod run;
pub mod snapshot;
pub mod state;
pub mod store;

pub use api::app;
pub use config::{ConfigSource, Overrides};
pub use run::run;
pub use state::State;

// The crate's README (its crates.io page) is compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

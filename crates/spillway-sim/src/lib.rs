//! `spillway simulate`: Spillway's algorithms side by side on the same
//! traffic, measured and plotted.
//!
//! Time is virtual: each request carries its arrival time in microseconds
//! and goes straight into the pure [`Algorithm::check`](spillway::Algorithm::check),
//! the same transition the stores run. Nothing sleeps, so a minute of
//! traffic takes milliseconds.
//!
//! - [`scenario`]: the built-in traffic (steady, bursty, the boundary burst,
//!   Poisson, a hammering client, many clients on one key);
//! - [`trace`]: replaying a CSV trace `timestamp,key,cost`;
//! - [`run()`]: one scenario through one algorithm;
//! - [`measure`]: what is measured, and how the error against the exact
//!   sliding log is defined;
//! - [`report`], [`chart`], `page`: the table, JSON, index.html and SVG charts;
//! - [`backend`]: a slow backend behind no limit, a rate limit and a
//!   concurrency limit: requests in flight and latency over time;
//! - [`simulate()`]: the whole command.
//!
//! ```
//! use spillway_sim::{AlgorithmKind, run_scenario};
//! use spillway_sim::scenario::{Params, ScenarioKind};
//!
//! // 100 per 10 s; 100 requests just before a window boundary, 100 just after.
//! let p = Params::default();
//! let result = run_scenario(&ScenarioKind::BoundaryBurst.build(&p), &AlgorithmKind::ALL, &p).unwrap();
//! let fixed = &result.get(AlgorithmKind::FixedWindow).unwrap().metrics;
//! assert_eq!(fixed.max_in_window, 200); // twice the limit within 10 s
//! let exact = &result.get(AlgorithmKind::SlidingLog).unwrap().metrics;
//! assert_eq!(exact.max_in_window, 100);
//! assert_eq!(exact.wrongly_admitted + exact.wrongly_denied, 0);
//! ```

pub mod backend;
pub mod chart;
mod contender;
mod error;
pub mod measure;
mod page;
pub mod report;
mod rng;
pub mod run;
pub mod scenario;
mod simulate;
pub mod trace;

pub use contender::AlgorithmKind;
pub use error::SimError;
pub use measure::Measurements;
pub use report::Report;
pub use run::{Run, run};
pub use simulate::{
    AlgorithmRun, Options, ScenarioRun, parse_duration, run_scenario, scenario_chart, scenarios,
    simulate,
};

// The crate's README (its crates.io page) is compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

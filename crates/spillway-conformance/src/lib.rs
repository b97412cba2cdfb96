//! The conformance suite every Spillway store must pass.
//!
//! Test vectors (a configuration, then a sequence of requests at given
//! times, each with the decisions the store must return, and settles of
//! their charges at their actual costs) pin down the five algorithms, the
//! multi-rule semantics and settling to the microsecond. They are TOML
//! files embedded in this crate; every expected value was computed by hand
//! from `docs/algorithms.md`. See [`vectors`] for the format.
//!
//! A store takes part by implementing [`Harness`] (two synchronous methods:
//! decide on these checks at this time, settle these charges at this time)
//! and calling [`run_all`] with a function that builds a fresh harness from
//! a case's rules. Every step of every case runs, and at the end every
//! mismatch is listed with its file, line, case, step and field.
//!
//! ```
//! use spillway::clock::FakeClock;
//! use spillway::algorithm::Renewed;
//! use spillway::store::{Check, MemoryOptions, MemoryStore, Renew, Settle, Settled, Verdict};
//! use spillway_conformance::{Harness, HarnessError};
//!
//! struct Memory(MemoryStore<FakeClock>);
//!
//! impl Harness for Memory {
//!     fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
//!         Ok(self.0.check_at(checks, now_us)?)
//!     }
//!
//!     fn reserve(&mut self, id: &str, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
//!         Ok(self.0.reserve_at(id, checks, now_us)?)
//!     }
//!
//!     fn settle(
//!         &mut self,
//!         id: &str,
//!         settles: &[Settle<'_>],
//!         now_us: u64,
//!     ) -> Result<Settled, HarnessError> {
//!         Ok(self.0.settle_at(id, settles, now_us)?)
//!     }
//!
//!     fn renew(&mut self, renews: &[Renew<'_>], now_us: u64) -> Result<Vec<Renewed>, HarnessError> {
//!         Ok(self.0.renew_at(renews, now_us)?)
//!     }
//! }
//!
//! let report = spillway_conformance::run_all(|rules| {
//!     Memory(MemoryStore::with_clock(rules, MemoryOptions::default(), FakeClock::new(0)))
//! });
//! assert!(report.passed());
//! assert!(report.cases > 0);
//! ```

pub mod hostile;
pub mod redis_server;
pub mod runner;
pub mod vectors;

pub use runner::{Harness, HarnessError, Mismatch, Report, run, run_all, run_case};
pub use vectors::{
    ALGORITHMS, Action, AlgorithmConfig, Case, CheckStep, DEFAULT_KEY, Expected, ExpectedDecision,
    RenewStep, RuleSpec, SettleStep, Step, StepCheck, VECTOR_FILES, VectorError, cases, parse,
};

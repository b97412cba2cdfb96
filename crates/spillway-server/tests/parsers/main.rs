//! Property tests of every parser of untrusted bytes or files in the
//! service (issue 17, item 8): arbitrary input and mutations of valid input
//! (`spillway_conformance::hostile`) into each, asserting no panic, an
//! answer within a bound, an error that names what is wrong, and valid
//! input accepted.
//!
//! CI runs each property's default count; `PROPTEST_CASES=N cargo test -p
//! spillway-server --test parsers` runs N cases of each.

mod api;
mod config;
mod envoy;
mod wire;

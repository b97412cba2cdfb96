//! Integration tests of the rate-limiting middleware.
//!
//! axum routers (and one plain `tower::service_fn` service) are driven with
//! `oneshot` under tokio's paused clock; the in-memory store reads that clock
//! through [`spillway_tower::TokioClock`], so `tokio::time::advance` is the
//! only way time passes, and nothing sleeps. Every expected number is
//! derived from the rule under test (its quota, burst, cost), not copied
//! from a run.
//!
//! One module per item of the middleware's issue: the layer itself, keys,
//! rule matching (tiers, costs, the single store call), headers, denials,
//! actions, leaky-bucket shaping and store errors (on a real Redis server).

mod actions;
mod budget;
mod client_addr;
mod concurrency;
mod denied;
mod headers;
mod keys;
mod layer;
mod lists;
mod parsed_headers;
mod rules;
mod shaping;
mod store_errors;
mod support;

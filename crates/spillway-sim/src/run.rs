//! The virtual-clock runner: feeds a scenario's requests to an algorithm.
//!
//! Time is the requests' own timestamps: nothing sleeps and no clock is
//! read. Each key has its own state, and each request is one call of the
//! pure [`Algorithm::check`], exactly what a store does with the time it
//! read.

use std::mem::size_of;

use spillway::Decision;
use spillway::algorithm::fixed_window::FixedWindowState;
use spillway::algorithm::sliding_log::{LogEntry, SlidingLogState};
use spillway::algorithm::sliding_window::SlidingWindowState;
use spillway::algorithm::token_bucket::TokenBucketState;
use spillway::algorithm::{Algorithm, AnyAlgorithm, AnyState, Lease, LeaseState};

use crate::error::SimError;
use crate::scenario::{Request, Scenario, Traffic};

/// What happened when a scenario was run through one algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// The requests sent, in order. For a closed-loop scenario this is what
    /// the client sent given the answers it got.
    pub requests: Vec<Request>,
    /// The decision on each request, index for index.
    pub decisions: Vec<Decision>,
    /// The largest state any key had at any point, in bytes (see
    /// [`state_bytes`]).
    pub max_state_bytes: usize,
}

/// Runs `scenario` through `algorithm`.
///
/// ```
/// use spillway_sim::{AlgorithmKind, run};
/// use spillway_sim::scenario::{Params, ScenarioKind};
///
/// let p = Params::default();
/// let steady = ScenarioKind::SteadyAbove.build(&p);
/// let log = AlgorithmKind::SlidingLog.build(p.quota().unwrap(), p.burst);
/// let outcome = run(&steady, &log).unwrap();
/// // 200 per 10 s offered for a minute, 100 per 10 s admitted.
/// let admitted = outcome.decisions.iter().filter(|d| d.allowed).count();
/// assert_eq!((outcome.requests.len(), admitted), (1200, 600));
/// ```
pub fn run(scenario: &Scenario, algorithm: &AnyAlgorithm) -> Result<Run, SimError> {
    let mut runner = Runner {
        scenario,
        algorithm,
        states: vec![AnyState::Fresh; scenario.keys.len()],
        outcome: Run {
            requests: Vec::new(),
            decisions: Vec::new(),
            max_state_bytes: 0,
        },
    };
    match &scenario.traffic {
        Traffic::Fixed(requests) => {
            runner.outcome.requests.reserve(requests.len());
            runner.outcome.decisions.reserve(requests.len());
            for r in requests {
                runner.step(*r)?;
            }
        }
        Traffic::Hammer(h) => {
            let mut next_job = scenario.start;
            // Jobs that have arrived and are not admitted yet.
            let mut queued: u64 = 0;
            let mut t = scenario.start;
            loop {
                if queued == 0 {
                    t = t.max(next_job);
                }
                if t >= scenario.end {
                    break;
                }
                while next_job <= t {
                    queued += 1;
                    next_job += h.job_interval;
                }
                let request = Request {
                    at: t,
                    key: 0,
                    client: 0,
                    cost: 1,
                };
                if runner.step(request)?.allowed {
                    // The next queued job goes out at once.
                    queued -= 1;
                } else {
                    t += h.retry_interval;
                }
            }
        }
    }
    Ok(runner.outcome)
}

struct Runner<'a> {
    scenario: &'a Scenario,
    algorithm: &'a AnyAlgorithm,
    states: Vec<AnyState>,
    outcome: Run,
}

impl Runner<'_> {
    fn step(&mut self, r: Request) -> Result<Decision, SimError> {
        let state = &mut self.states[r.key as usize];
        let decision = self
            .algorithm
            .check(state, r.cost, r.at)
            .map_err(|source| SimError::CostTooLarge {
                at: r.at,
                key: self.scenario.keys[r.key as usize].clone(),
                source,
            })?;
        let bytes = state_bytes(state);
        let out = &mut self.outcome;
        out.max_state_bytes = out.max_state_bytes.max(bytes);
        out.requests.push(r);
        out.decisions.push(decision);
        Ok(decision)
    }
}

/// The bytes one key's state takes: the algorithm's own state type (what
/// `RateLimiter<A>` stores inline per key), plus, for the sliding log and
/// a concurrency rule's leases, the heap buffer of its entries (allocated capacity, not just the entries in
/// use). A key never seen takes 0. Not counted: the key itself and the hash
/// table's slot, the same for every algorithm, and the allocator's own
/// overhead.
///
/// ```
/// use spillway::algorithm::AnyState;
/// use spillway_sim::run::state_bytes;
/// assert_eq!(state_bytes(&AnyState::Fresh), 0);
/// assert_eq!(state_bytes(&AnyState::FixedWindow(Default::default())), 16);
/// ```
pub fn state_bytes(state: &AnyState) -> usize {
    match state {
        AnyState::Fresh => 0,
        AnyState::FixedWindow(_) => size_of::<FixedWindowState>(),
        AnyState::SlidingWindow(_) => size_of::<SlidingWindowState>(),
        AnyState::Bucket(_) => size_of::<TokenBucketState>(),
        AnyState::SlidingLog(log) => {
            size_of::<SlidingLogState>() + log.entries.capacity() * size_of::<LogEntry>()
        }
        AnyState::Leases(leases) => {
            size_of::<LeaseState>() + leases.capacity() * size_of::<Lease>()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AlgorithmKind;
    use crate::scenario::{Params, ScenarioKind};

    #[test]
    fn the_hammer_retries_every_denial_and_never_loses_a_job() {
        let p = Params::default();
        let s = ScenarioKind::Hammer.build(&p);
        let Traffic::Hammer(h) = s.traffic else {
            unreachable!()
        };
        let alg = AlgorithmKind::SlidingLog.build(p.quota().unwrap(), p.burst);
        let out = run(&s, &alg).unwrap();
        // A denial is followed by a retry one retry interval later.
        for (i, d) in out.decisions.iter().enumerate() {
            if !d.allowed && i + 1 < out.requests.len() {
                assert_eq!(
                    out.requests[i + 1].at,
                    out.requests[i].at + h.retry_interval
                );
            }
        }
        // Demand is 2x the limit, so it saturates: L per W admitted.
        let admitted = out.decisions.iter().filter(|d| d.allowed).count();
        assert_eq!(admitted, 600);
        // Denied for the rest of each window, it retries every 10 ms.
        assert!(out.requests.len() > 5 * admitted);
    }

    #[test]
    fn state_bytes_of_each_algorithm() {
        let p = Params::default();
        let s = ScenarioKind::SteadyAt.build(&p);
        let bytes = |k: AlgorithmKind| {
            run(&s, &k.build(p.quota().unwrap(), p.burst))
                .unwrap()
                .max_state_bytes
        };
        assert_eq!(bytes(AlgorithmKind::FixedWindow), 16);
        assert_eq!(bytes(AlgorithmKind::SlidingWindow), 24);
        assert_eq!(bytes(AlgorithmKind::TokenBucket), 16);
        // 100 entries of 16 bytes in a buffer of 128, plus the deque and total.
        assert_eq!(bytes(AlgorithmKind::SlidingLog), 40 + 128 * 16);
    }
}

//! The simulator runs the same transitions as the in-memory store: fed the
//! same requests at the same times, `RateLimiter` on a `FakeClock` makes the
//! same decision on every request, field for field.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use spillway::clock::FakeClock;
use spillway::store::{MemoryOptions, RateLimiter};
use spillway_sim::scenario::{Params, ScenarioKind};
use spillway_sim::trace::parse_trace;
use spillway_sim::{AlgorithmKind, run_scenario};

fn params() -> Params {
    let limit = NonZeroU32::new(20).unwrap();
    Params {
        limit,
        window: 1_000_000,
        burst: NonZeroU32::new(5).unwrap(),
        duration: 4_000_000,
        seed: 7,
    }
}

/// A trace with several keys, costs above 1 and repeated timestamps.
fn trace() -> String {
    let mut csv = String::from("timestamp,key,cost\n");
    for i in 0..400u64 {
        let key = ["alice", "bob", "carol"][(i % 3) as usize];
        csv.push_str(&format!("{},{key},{}\n", i * 7_919 % 3_000_000, 1 + i % 4));
    }
    csv
}

#[test]
fn simulated_decisions_equal_the_in_memory_stores() {
    let p = params();
    let mut scenarios: Vec<_> = ScenarioKind::ALL.iter().map(|k| k.build(&p)).collect();
    scenarios.push(parse_trace(&trace()).unwrap());
    let quota = p.quota().unwrap();
    for scenario in &scenarios {
        let result = run_scenario(scenario, &AlgorithmKind::ALL, &p).unwrap();
        for run in &result.runs {
            let clock = FakeClock::new(0);
            // Few shards and frequent sweeps, so that forgetting idle keys
            // is exercised too: it must not change any decision.
            let options = MemoryOptions {
                max_keys: NonZeroUsize::new(1_000).unwrap(),
                shards: NonZeroUsize::new(2).unwrap(),
                sweep_interval: Duration::from_millis(50),
                ..MemoryOptions::default()
            };
            let store: RateLimiter<_, String, _> =
                RateLimiter::with_options(run.kind.build(quota, p.burst), clock.clone(), options);
            let outcome = &run.outcome;
            assert!(!outcome.requests.is_empty());
            for (i, (r, simulated)) in outcome.requests.iter().zip(&outcome.decisions).enumerate() {
                clock.set(r.at);
                let key = scenario.keys[r.key as usize].as_str();
                let stored = store.check(key, r.cost).unwrap();
                assert_eq!(
                    &stored, simulated,
                    "{} / {}: request {i} ({r:?})",
                    scenario.name, run.kind
                );
            }
        }
    }
}

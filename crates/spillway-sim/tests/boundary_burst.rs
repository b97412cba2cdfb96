//! The boundary burst: the whole limit at the end of one window and again at
//! the start of the next. The fixed window lets both through; the exact
//! sliding log only one of them.

use std::num::NonZeroU32;

use spillway_sim::scenario::{Params, ScenarioKind};
use spillway_sim::{AlgorithmKind, run_scenario};

fn params(limit: u32, window: u64) -> Params {
    let limit = NonZeroU32::new(limit).unwrap();
    Params {
        limit,
        window,
        burst: limit,
        duration: 6 * window,
        seed: 1,
    }
}

#[test]
fn fixed_window_admits_twice_the_limit_within_w_and_sliding_log_exactly_the_limit() {
    for (limit, window) in [(100, 10_000_000), (7, 1_000_000), (1_000, 60_000_000)] {
        let p = params(limit, window);
        let limit = u64::from(limit);
        let scenario = ScenarioKind::BoundaryBurst.build(&p);
        let result = run_scenario(&scenario, &AlgorithmKind::ALL, &p).unwrap();
        let metrics = |k| &result.get(k).unwrap().metrics;

        let fixed = metrics(AlgorithmKind::FixedWindow);
        assert_eq!(fixed.max_in_window, 2 * limit, "L = {limit}");
        assert_eq!(fixed.max_in_window_ratio, 2.0);
        // Everything it admitted past the first L of each episode was over
        // the exact limit.
        assert_eq!(fixed.denied, 0);
        assert_eq!(fixed.wrongly_admitted, fixed.admitted / 2);

        let log = metrics(AlgorithmKind::SlidingLog);
        assert_eq!(log.max_in_window, limit, "L = {limit}");
        assert_eq!(log.admitted, log.requests / 2);
        assert_eq!((log.wrongly_admitted, log.wrongly_denied), (0, 0));

        // Shaping spaces departures T = W/L apart: never more than L in W.
        assert_eq!(metrics(AlgorithmKind::LeakyShape).max_in_window, limit);
    }
}

#[test]
fn the_sliding_log_is_exact_on_every_scenario() {
    let p = params(20, 1_000_000);
    for kind in ScenarioKind::ALL {
        let scenario = kind.build(&p);
        let result = run_scenario(&scenario, &[AlgorithmKind::SlidingLog], &p).unwrap();
        let m = &result.runs[0].metrics;
        assert!(m.max_in_window <= 20, "{kind}: {}", m.max_in_window);
        assert_eq!((m.wrongly_admitted, m.wrongly_denied), (0, 0), "{kind}");
    }
}

#[test]
fn police_mode_decides_like_a_token_bucket_and_shape_mode_only_delays() {
    let p = params(20, 1_000_000);
    for kind in [
        ScenarioKind::Poisson,
        ScenarioKind::Bursty,
        ScenarioKind::SharedKey,
    ] {
        let scenario = kind.build(&p);
        let result = run_scenario(&scenario, &AlgorithmKind::ALL, &p).unwrap();
        let allowed = |k| -> Vec<bool> {
            let run = result.get(k).unwrap();
            run.outcome.decisions.iter().map(|d| d.allowed).collect()
        };
        let token = allowed(AlgorithmKind::TokenBucket);
        assert_eq!(token, allowed(AlgorithmKind::LeakyPolice), "{kind}");
        assert_eq!(token, allowed(AlgorithmKind::LeakyShape), "{kind}");
        let shape = &result.get(AlgorithmKind::LeakyShape).unwrap().metrics;
        assert!(shape.delay_max_us.unwrap() > 0, "{kind}");
        assert!(shape.max_in_window <= 20, "{kind}");
    }
}

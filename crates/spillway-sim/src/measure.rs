//! What is measured on a [`Run`].
//!
//! - **admitted / denied**: requests (not cost units).
//! - **max in W**: the largest total cost admitted for one key in any window
//!   of length `W`, wherever it is placed (a sliding maximum over the
//!   admission times, not over aligned windows). For the shaping leaky
//!   bucket it is measured on the times requests *leave* (arrival + delay),
//!   which is what the protected service sees; for the others leaving is
//!   admitting.
//! - **delay**: mean and maximum shaping delay over the admitted requests
//!   (shaping leaky bucket only).
//! - **state bytes per key**: see [`state_bytes`](crate::run::state_bytes).
//! - **wrongly admitted / wrongly denied**, against the exact sliding log:
//!   for every request, the exact rule "at most `L` in `(t - W, t]`" is
//!   applied to the history *this algorithm* admitted so far. A request the
//!   algorithm admitted although that window plus its cost exceeds `L` is
//!   wrongly admitted; one it denied although it would fit is wrongly
//!   denied. Each decision is judged on the state it was made in, so one
//!   early mistake is not counted again in every decision that follows (as
//!   comparing with an independent sliding log on the same stream would).
//!   Shares are of all requests. The sliding log scores 0 by construction;
//!   for the buckets, which enforce a rate rather than a window, the figure
//!   is how far their policy is from "L in any W", not an approximation
//!   error.

use std::collections::VecDeque;

use serde::Serialize;
use spillway::algorithm::{Algorithm, AnyAlgorithm, LeakyMode};
use spillway::clock::Micros;

use crate::run::Run;
use crate::scenario::Scenario;

/// The measurements of one algorithm on one scenario: a row of the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measurements {
    /// The algorithm's name (see [`AlgorithmKind::name`](crate::AlgorithmKind::name)).
    pub algorithm: String,
    /// Requests sent.
    pub requests: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Requests denied.
    pub denied: u64,
    /// The most cost admitted for one key in any window of length `W`.
    pub max_in_window: u64,
    /// `max_in_window / L`: 2.0 is the fixed window's boundary burst.
    pub max_in_window_ratio: f64,
    /// Mean shaping delay of admitted requests, µs (shaping only).
    pub delay_mean_us: Option<f64>,
    /// Largest shaping delay, µs (shaping only).
    pub delay_max_us: Option<u64>,
    /// The largest state one key had, in bytes.
    pub state_bytes_per_key: usize,
    /// Requests admitted that the exact rule would have denied.
    pub wrongly_admitted: u64,
    /// Requests denied that the exact rule would have admitted.
    pub wrongly_denied: u64,
    /// `wrongly_admitted / requests`, as a percentage.
    pub wrongly_admitted_pct: f64,
    /// `wrongly_denied / requests`, as a percentage.
    pub wrongly_denied_pct: f64,
    /// How evenly clients sharing a key were served (several clients only).
    pub clients: Option<ClientSpread>,
}

/// The share of its requests each client got admitted, summarised over
/// clients.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ClientSpread {
    /// The least-served client's admitted / sent, as a percentage.
    pub min_pct: f64,
    /// The median client's.
    pub median_pct: f64,
    /// The best-served client's.
    pub max_pct: f64,
}

/// Measures `outcome`, the run of `scenario` through `algorithm`, reported
/// under `name`.
pub fn measure(
    name: &str,
    algorithm: &AnyAlgorithm,
    scenario: &Scenario,
    outcome: &Run,
) -> Measurements {
    let quota = algorithm.quota();
    let limit = u64::from(quota.limit().get());
    let window = quota.period_micros();
    let shaping =
        matches!(algorithm, AnyAlgorithm::LeakyBucket(lb) if lb.mode() == LeakyMode::Shape);
    let keys = scenario.keys.len();

    let mut admitted = 0u64;
    let mut delays = Vec::new();
    // Per key: (leaving time, cost) of the admitted requests.
    let mut left: Vec<Vec<(Micros, u64)>> = vec![Vec::new(); keys];
    let mut exact: Vec<ExactWindow> = (0..keys).map(|_| ExactWindow::default()).collect();
    let (mut wrongly_admitted, mut wrongly_denied) = (0u64, 0u64);
    for (r, d) in outcome.requests.iter().zip(&outcome.decisions) {
        let key = r.key as usize;
        let fits = exact[key].fits(r.at, r.cost, limit, window);
        match (d.allowed, fits) {
            (true, false) => wrongly_admitted += 1,
            (false, true) => wrongly_denied += 1,
            _ => {}
        }
        if d.allowed {
            admitted += 1;
            exact[key].admit(r.at, r.cost);
            let delay = u64::try_from(d.delay.as_micros()).unwrap_or(u64::MAX);
            left[key].push((r.at.saturating_add(delay), r.cost));
            if shaping {
                delays.push(delay);
            }
        }
    }

    let max_in_window = left
        .iter_mut()
        .map(|times| {
            times.sort_by_key(|&(t, _)| t);
            max_in_window(times, window)
        })
        .max()
        .unwrap_or(0);
    let requests = outcome.requests.len() as u64;
    let pct = |n: u64| {
        if requests == 0 {
            0.0
        } else {
            100.0 * n as f64 / requests as f64
        }
    };
    Measurements {
        algorithm: name.to_owned(),
        requests,
        admitted,
        denied: requests - admitted,
        max_in_window,
        max_in_window_ratio: max_in_window as f64 / limit as f64,
        delay_mean_us: shaping.then(|| {
            if delays.is_empty() {
                0.0
            } else {
                delays.iter().sum::<u64>() as f64 / delays.len() as f64
            }
        }),
        delay_max_us: shaping.then(|| delays.iter().copied().max().unwrap_or(0)),
        state_bytes_per_key: outcome.max_state_bytes,
        wrongly_admitted,
        wrongly_denied,
        wrongly_admitted_pct: pct(wrongly_admitted),
        wrongly_denied_pct: pct(wrongly_denied),
        clients: (scenario.clients > 1).then(|| client_spread(scenario.clients, outcome)),
    }
}

/// The largest total cost in any half-open window of length `window`, over
/// `(time, cost)` pairs sorted by time: two pointers, O(n).
///
/// ```
/// use spillway_sim::measure::max_in_window;
/// // 3 at 0..2, 1 at 10: in any 10 µs, at most 3 (10 is outside [0, 10)).
/// let admitted = [(0, 1), (1, 1), (2, 1), (10, 1)];
/// assert_eq!(max_in_window(&admitted, 10), 3);
/// assert_eq!(max_in_window(&admitted, 11), 4);
/// ```
pub fn max_in_window(sorted: &[(Micros, u64)], window: Micros) -> u64 {
    let (mut best, mut sum, mut first) = (0, 0, 0);
    for &(t, cost) in sorted {
        sum += cost;
        // Past the end of time (`ts + W` over u64::MAX) an entry never
        // leaves: saturating there would drop the entry just added.
        while sorted[first]
            .0
            .checked_add(window)
            .is_some_and(|end| end <= t)
        {
            sum -= sorted[first].1;
            first += 1;
        }
        best = best.max(sum);
    }
    best
}

/// The exact sliding log's rule over one key's admitted history: what is
/// admitted at `ts` counts while `t < ts + W`.
#[derive(Debug, Default)]
struct ExactWindow {
    entries: VecDeque<(Micros, u64)>,
    total: u64,
}

impl ExactWindow {
    fn fits(&mut self, now: Micros, cost: u64, limit: u64, window: Micros) -> bool {
        while let Some(&(at, c)) = self.entries.front() {
            if at.checked_add(window).is_none_or(|end| end > now) {
                break;
            }
            self.total -= c;
            self.entries.pop_front();
        }
        self.total + cost <= limit
    }

    fn admit(&mut self, at: Micros, cost: u64) {
        self.entries.push_back((at, cost));
        self.total += cost;
    }
}

fn client_spread(clients: u32, outcome: &Run) -> ClientSpread {
    let mut sent = vec![0u64; clients as usize];
    let mut admitted = vec![0u64; clients as usize];
    for (r, d) in outcome.requests.iter().zip(&outcome.decisions) {
        sent[r.client as usize] += 1;
        admitted[r.client as usize] += u64::from(d.allowed);
    }
    let mut shares: Vec<f64> = sent
        .iter()
        .zip(&admitted)
        .filter(|&(&s, _)| s > 0)
        .map(|(&s, &a)| 100.0 * a as f64 / s as f64)
        .collect();
    shares.sort_by(f64::total_cmp);
    let at = |i: usize| shares.get(i).copied().unwrap_or(0.0);
    ClientSpread {
        min_pct: at(0),
        median_pct: at(shares.len() / 2),
        max_pct: at(shares.len().saturating_sub(1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_in_window_counts_costs_and_handles_ties() {
        assert_eq!(max_in_window(&[], 10), 0);
        assert_eq!(max_in_window(&[(5, 3), (5, 4)], 1), 7);
        assert_eq!(max_in_window(&[(0, 2), (9, 2), (19, 2)], 10), 4);
    }

    #[test]
    fn exact_window_is_half_open_like_the_sliding_log() {
        let mut w = ExactWindow::default();
        assert!(w.fits(0, 1, 1, 10));
        w.admit(0, 1);
        assert!(!w.fits(9, 1, 1, 10));
        assert!(w.fits(10, 1, 1, 10));
    }
}

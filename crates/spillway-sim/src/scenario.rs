//! The traffic: built-in scenarios, generated from a quota and a seed.
//!
//! Every scenario but one is a fixed list of requests, so every algorithm
//! sees exactly the same arrivals. The exception is [`ScenarioKind::Hammer`]:
//! a client that reacts to its denials, so what it sends depends on what the
//! algorithm answered ([`Traffic::Hammer`]).

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;
use std::time::Duration;

use spillway::Quota;
use spillway::clock::Micros;

use crate::error::SimError;
use crate::rng::Rng;

/// The quota and the run every scenario is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// `L`: the limit per window (and the buckets' rate per window).
    pub limit: NonZeroU32,
    /// `W`: the window (and the buckets' rate period), in µs.
    pub window: Micros,
    /// The token bucket's burst and the leaky bucket's capacity.
    pub burst: NonZeroU32,
    /// How much traffic to simulate, in µs.
    pub duration: Micros,
    /// Seeds the random arrivals (Poisson, bursty, many clients).
    pub seed: u64,
}

impl Params {
    /// The quota `limit` per `window`, if the window is a valid period.
    pub fn quota(&self) -> Result<Quota, SimError> {
        Ok(Quota::new(self.limit, Duration::from_micros(self.window))?)
    }

    fn limit(&self) -> u64 {
        u64::from(self.limit.get())
    }
}

impl Default for Params {
    /// 100 per 10 s, burst 100, one minute of traffic, seed 1.
    fn default() -> Self {
        Self {
            limit: NonZeroU32::new(100).expect("nonzero"),
            window: 10_000_000,
            burst: NonZeroU32::new(100).expect("nonzero"),
            duration: 60_000_000,
            seed: 1,
        }
    }
}

/// One request: when, for which key, from which client, how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Arrival time, µs.
    pub at: Micros,
    /// Index into [`Scenario::keys`].
    pub key: u32,
    /// Who sent it (several clients may share a key). For a trace, the key.
    pub client: u32,
    /// Its cost (1 for every built-in scenario).
    pub cost: u64,
}

/// The closed-loop client of [`ScenarioKind::Hammer`].
///
/// Work arrives every `job_interval`. The client sends the oldest unsent job
/// at once; when it is denied, it ignores `retry_after` and sends it again
/// `retry_interval` later, until it is admitted; then it sends the next
/// queued job straight away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hammer {
    /// Time between two jobs (the client's demand), µs.
    pub job_interval: Micros,
    /// Time between a denial and the retry, µs.
    pub retry_interval: Micros,
}

/// What a scenario sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Traffic {
    /// A fixed list of requests in time order, the same for every algorithm.
    Fixed(Vec<Request>),
    /// One client on key 0 that retries its denied requests; what it sends
    /// depends on the answers.
    Hammer(Hammer),
}

/// A named stream of requests over `[start, end)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scenario {
    /// Short name, used for file names (`boundary_burst.svg`).
    pub name: String,
    /// One sentence on what the traffic is.
    pub description: String,
    /// The keys requests are charged to; requests refer to them by index.
    pub keys: Vec<String>,
    /// How many distinct clients send (see [`Request::client`]).
    pub clients: u32,
    /// Time of the first possible request, µs.
    pub start: Micros,
    /// Nothing is sent at or after this time, µs.
    pub end: Micros,
    /// The requests.
    pub traffic: Traffic,
}

/// The built-in scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScenarioKind {
    /// Evenly spaced requests at half the limit.
    SteadyBelow,
    /// Evenly spaced requests at exactly the limit: `L` per `W`.
    SteadyAt,
    /// Evenly spaced requests at twice the limit.
    SteadyAbove,
    /// On/off: Poisson at 4x the limit for `W/4`, then silent for `W`.
    Bursty,
    /// The whole limit in the last `W/100` of a window and again in the
    /// first `W/100` of the next, every third window.
    BoundaryBurst,
    /// Poisson arrivals at the limit (`L` per `W` on average).
    Poisson,
    /// A client with twice the limit's worth of work that retries every
    /// denial after `W/1000` (10 ms for a 10 s window).
    Hammer,
    /// 25 clients on one key (a shared API key, a NAT address), each Poisson
    /// at 0.06 of the limit: 1.5x the limit together.
    SharedKey,
}

impl ScenarioKind {
    /// Every built-in scenario, in the order they are reported.
    pub const ALL: [Self; 8] = [
        Self::SteadyBelow,
        Self::SteadyAt,
        Self::SteadyAbove,
        Self::Bursty,
        Self::BoundaryBurst,
        Self::Poisson,
        Self::Hammer,
        Self::SharedKey,
    ];

    /// The name used on the command line and in file names.
    pub const fn name(self) -> &'static str {
        match self {
            Self::SteadyBelow => "steady_below",
            Self::SteadyAt => "steady_at",
            Self::SteadyAbove => "steady_above",
            Self::Bursty => "bursty",
            Self::BoundaryBurst => "boundary_burst",
            Self::Poisson => "poisson",
            Self::Hammer => "hammer",
            Self::SharedKey => "shared_key",
        }
    }

    /// The scenario's traffic for `params`.
    ///
    /// ```
    /// use spillway_sim::scenario::{Params, ScenarioKind, Traffic};
    ///
    /// let s = ScenarioKind::SteadyAt.build(&Params::default());
    /// let Traffic::Fixed(requests) = &s.traffic else { unreachable!() };
    /// // 100 per 10 s for a minute, one every 100 ms.
    /// assert_eq!(requests.len(), 600);
    /// assert_eq!(requests[1].at - requests[0].at, 100_000);
    /// ```
    ///
    /// A zero window, which [`Params::quota`] rejects, is taken as 1 µs.
    pub fn build(self, p: &Params) -> Scenario {
        let (l, w) = (p.limit(), p.window.max(1));
        let end = p.duration;
        let one_key = |description: String, traffic| Scenario {
            name: self.name().to_owned(),
            description,
            keys: vec!["k".to_owned()],
            clients: 1,
            start: 0,
            end,
            traffic,
        };
        match self {
            Self::SteadyBelow => one_key(
                "evenly spaced at half the limit".into(),
                Traffic::Fixed(steady(l, w, 1, 2, end)),
            ),
            Self::SteadyAt => one_key(
                "evenly spaced at exactly the limit".into(),
                Traffic::Fixed(steady(l, w, 1, 1, end)),
            ),
            Self::SteadyAbove => one_key(
                "evenly spaced at twice the limit".into(),
                Traffic::Fixed(steady(l, w, 2, 1, end)),
            ),
            Self::Bursty => one_key(
                "Poisson at 4x the limit for W/4, then silent for W".into(),
                Traffic::Fixed(on_off(&mut Rng::new(p.seed, 1), l, w, end)),
            ),
            Self::BoundaryBurst => {
                let mut scenario = one_key(
                    "the whole limit in the last W/100 of a window and again in the first W/100 of the next, every 3 windows".into(),
                    Traffic::Fixed(boundary_bursts(l, w, end)),
                );
                if let Traffic::Fixed(r) = &scenario.traffic {
                    let last = r.last().map_or(0, |r| r.at + 1);
                    scenario.end = scenario.end.max(last);
                }
                scenario
            }
            Self::Poisson => {
                let mut rng = Rng::new(p.seed, 2);
                let mean_gap = w as f64 / l as f64;
                one_key(
                    "Poisson arrivals at the limit on average".into(),
                    Traffic::Fixed(poisson(&mut rng, mean_gap, 0, end, 0, 0)),
                )
            }
            Self::Hammer => one_key(
                "twice the limit's worth of work; every denied request is sent again W/1000 later"
                    .into(),
                Traffic::Hammer(Hammer {
                    job_interval: (w / (2 * l)).max(1),
                    retry_interval: (w / 1_000).max(1),
                }),
            ),
            Self::SharedKey => Scenario {
                name: self.name().to_owned(),
                description: format!(
                    "{SHARED_CLIENTS} clients on one key, each Poisson at 0.06x the limit (1.5x together)"
                ),
                keys: vec!["shared".to_owned()],
                clients: SHARED_CLIENTS,
                start: 0,
                end,
                traffic: Traffic::Fixed(shared_key(&mut Rng::new(p.seed, 3), l, w, end)),
            },
        }
    }
}

impl fmt::Display for ScenarioKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScenarioKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown scenario `{s}`: expected one of {}, or all",
                    names.join(", ")
                )
            })
    }
}

/// Requests at `num/den` times the limit, evenly spaced from 0: request `i`
/// at `floor(i * W * den / (L * num))`.
fn steady(l: u64, w: Micros, num: u64, den: u64, end: Micros) -> Vec<Request> {
    (0u128..)
        .map(|i| i * u128::from(w) * u128::from(den) / (u128::from(l) * u128::from(num)))
        .map_while(|at| u64::try_from(at).ok().filter(|&at| at < end))
        .map(|at| Request {
            at,
            key: 0,
            client: 0,
            cost: 1,
        })
        .collect()
}

/// Poisson arrivals with the given mean gap (µs) over `[from, to)`.
fn poisson(
    rng: &mut Rng,
    mean_gap: f64,
    from: Micros,
    to: Micros,
    key: u32,
    client: u32,
) -> Vec<Request> {
    let mut requests = Vec::new();
    let mut t = from as f64;
    loop {
        t += rng.exponential(mean_gap);
        let at = t.floor() as Micros;
        if at >= to {
            return requests;
        }
        requests.push(Request {
            at,
            key,
            client,
            cost: 1,
        });
    }
}

/// Poisson at 4x the limit for `W/4`, then silent for `W`, over `[0, end)`.
fn on_off(rng: &mut Rng, l: u64, w: Micros, end: Micros) -> Vec<Request> {
    let (on, off) = ((w / 4).max(1), w);
    let mean_gap = w as f64 / (4 * l) as f64;
    let mut requests = Vec::new();
    let mut from = 0;
    while from < end {
        let to = (from + on).min(end);
        requests.extend(poisson(rng, mean_gap, from, to, 0, 0));
        from += on + off;
    }
    requests
}

/// How many clients share the key of [`ScenarioKind::SharedKey`].
const SHARED_CLIENTS: u32 = 25;

/// [`SHARED_CLIENTS`] clients on key 0, each Poisson at 0.06 of the limit
/// over `[0, end)`, merged in time order.
fn shared_key(rng: &mut Rng, l: u64, w: Micros, end: Micros) -> Vec<Request> {
    // Each client: 0.06 L per W.
    let mean_gap = w as f64 * 100.0 / (6 * l) as f64;
    let mut requests: Vec<Request> = (0..SHARED_CLIENTS)
        .flat_map(|c| poisson(rng, mean_gap, 0, end, 0, c))
        .collect();
    requests.sort_by_key(|r| (r.at, r.client));
    requests
}

/// `L` requests evenly spread over `[b - d, b)` and `L` over `[b, b + d)`,
/// with `d = W/100`, at the boundaries `b = W, 4W, 7W, ...` (the first one
/// even if it runs past `end`), so that each episode starts from a fresh
/// state for every algorithm.
fn boundary_bursts(l: u64, w: Micros, end: Micros) -> Vec<Request> {
    let d = (w / 100).max(1);
    let mut requests = Vec::new();
    let mut b = w;
    while b == w || b + d <= end {
        for half in [b - d, b] {
            requests.extend((0..l).map(|i| Request {
                at: half + i * d / l,
                key: 0,
                client: 0,
                cost: 1,
            }));
        }
        b += 3 * w;
    }
    requests
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(s: &Scenario) -> &[Request] {
        match &s.traffic {
            Traffic::Fixed(r) => r,
            Traffic::Hammer(_) => panic!("not fixed"),
        }
    }

    #[test]
    fn every_fixed_scenario_is_sorted_and_inside_its_span() {
        let p = Params::default();
        for kind in ScenarioKind::ALL {
            let s = kind.build(&p);
            if let Traffic::Fixed(r) = &s.traffic {
                assert!(!r.is_empty(), "{kind}");
                assert!(r.windows(2).all(|w| w[0].at <= w[1].at), "{kind}");
                assert!(r.iter().all(|q| q.at >= s.start && q.at < s.end), "{kind}");
                assert!(r.iter().all(|q| (q.key as usize) < s.keys.len()), "{kind}");
                assert!(r.iter().all(|q| q.client < s.clients), "{kind}");
            }
        }
    }

    #[test]
    fn rates_are_what_the_names_say() {
        let p = Params::default();
        // A minute at 100 per 10 s is 600 requests.
        let count = |k: ScenarioKind| fixed(&k.build(&p)).len();
        assert_eq!(count(ScenarioKind::SteadyBelow), 300);
        assert_eq!(count(ScenarioKind::SteadyAt), 600);
        assert_eq!(count(ScenarioKind::SteadyAbove), 1200);
        let poisson = count(ScenarioKind::Poisson);
        assert!((500..700).contains(&poisson), "{poisson}");
        let shared = count(ScenarioKind::SharedKey);
        assert!((800..1000).contains(&shared), "{shared}");
    }

    #[test]
    fn boundary_burst_straddles_the_window_boundary() {
        let p = Params::default();
        let r = fixed(&ScenarioKind::BoundaryBurst.build(&p)).to_vec();
        // Boundaries at 10 s and 40 s; 70 s is past the minute.
        assert_eq!(r.len(), 400);
        let before = r.iter().filter(|q| (9_900_000..10_000_000).contains(&q.at));
        let after = r
            .iter()
            .filter(|q| (10_000_000..10_100_000).contains(&q.at));
        assert_eq!((before.count(), after.count()), (100, 100));
    }

    #[test]
    fn a_seed_reproduces_the_traffic() {
        let p = Params::default();
        let q = Params { seed: 2, ..p };
        let a = ScenarioKind::Poisson.build(&p);
        assert_eq!(a, ScenarioKind::Poisson.build(&p));
        assert_ne!(a, ScenarioKind::Poisson.build(&q));
    }

    #[test]
    fn names_round_trip() {
        for kind in ScenarioKind::ALL {
            assert_eq!(kind.name().parse::<ScenarioKind>(), Ok(kind));
        }
        assert!(
            "nope"
                .parse::<ScenarioKind>()
                .unwrap_err()
                .contains("steady_at")
        );
    }
}

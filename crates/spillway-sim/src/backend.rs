//! A slow backend: what a limit on requests in flight does that a rate
//! limit cannot.
//!
//! Requests arrive at random (Poisson), each needing a random amount of
//! work (exponential: most are quick, a few take long). The backend does
//! `workers` requests' worth of work at once, shared among the requests
//! inside it (processor sharing): with `n > workers` inside, each goes at
//! `workers / n` of its speed, so every request inside slows as more come
//! in. The traffic is steady at 70% of what the backend can do; for the
//! middle third of the run the backend slows down (each request needs twice
//! the work: a dependency got slow), which makes the same traffic 140% of
//! what it can do; for the last third the backend is itself again and the
//! traffic surges to 130% of what it can do.
//!
//! Three front doors, each the real algorithm's transitions:
//! - none;
//! - a rate limit sized for the backend as it usually is: a token bucket of
//!   `workers / mean work` a second, with a burst of `workers`;
//! - a concurrency limit of `workers` slots ([`Concurrency`]): a slot taken
//!   when a request is admitted and given back (a settle at 0) when its
//!   response ends.
//!
//! Both limits turn the surge away. But the rate limit admits as many
//! requests a second when the backend slows as when it does not: the
//! requests inside pile up and every one waits longer. The concurrency
//! limit admits a request only when one has left,
//! so the backend never has more than `workers` inside, whatever its speed,
//! and the requests it serves stay fast; it turns away what it cannot
//! serve, at once.

use std::collections::BinaryHeap;
use std::num::NonZeroU32;
use std::time::Duration;

use serde::Serialize;
use spillway::algorithm::{Algorithm, Charged, Concurrency, TokenBucket};
use spillway::clock::Micros;
use spillway::{Decision, Quota};

use crate::error::SimError;
use crate::rng::Rng;

/// The slices of time the run is measured in, for the chart.
pub const SLICES: usize = 120;

/// The backend and its traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BackendParams {
    /// Requests the backend works on at full speed at once.
    pub workers: u32,
    /// The mean work of a request, µs (at full speed).
    pub mean_work_us: Micros,
    /// How long the run lasts, µs.
    pub duration_us: Micros,
    /// The seed of the arrivals and the work.
    pub seed: u64,
}

impl Default for BackendParams {
    /// 10 workers, 200 ms a request on average (the backend serves 50 a
    /// second), a minute, seed 1.
    fn default() -> Self {
        Self {
            workers: 10,
            mean_work_us: 200_000,
            duration_us: 60_000_000,
            seed: 1,
        }
    }
}

impl BackendParams {
    /// What the backend serves a second, as it usually is.
    fn capacity_per_second(&self) -> f64 {
        f64::from(self.workers) * 1e6 / self.mean_work_us as f64
    }
}

/// One front door's run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Door {
    /// What stands in front of the backend.
    pub name: &'static str,
    /// Requests that were served.
    pub served: u64,
    /// Requests turned away.
    pub denied: u64,
    /// The most requests inside the backend at once.
    pub max_in_flight: u64,
    /// The median and 99th percentile time to serve, ms.
    pub p50_ms: f64,
    /// See `p50_ms`.
    pub p99_ms: f64,
    /// Per slice of time: the most requests inside.
    #[serde(skip)]
    pub in_flight: Vec<u64>,
    /// Per slice of time: the median and 99th percentile time to serve
    /// of the requests that ended in it, ms (0 when none did).
    #[serde(skip)]
    pub latency: Vec<(f64, f64)>,
}

/// The three front doors on the same traffic.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendRun {
    /// The backend and its traffic.
    pub params: BackendParams,
    /// Requests offered.
    pub offered: u64,
    /// None, a rate limit, a concurrency limit.
    pub doors: Vec<Door>,
}

/// A front door's algorithm.
enum Limit {
    None,
    Rate(TokenBucket, <TokenBucket as Algorithm>::State),
    Slots(Concurrency, <Concurrency as Algorithm>::State),
}

impl Limit {
    fn admit(&mut self, now: Micros) -> Result<Option<Decision>, SimError> {
        let decided = match self {
            Self::None => return Ok(None),
            Self::Rate(a, s) => a.check(s, 1, now),
            Self::Slots(a, s) => a.check(s, 1, now),
        };
        decided
            .map(Some)
            .map_err(|e| SimError::Backend(e.to_string()))
    }

    /// The request admitted at `at` by `decision` has ended at `now`.
    fn ended(&mut self, at: Micros, decision: Option<Decision>, now: Micros) {
        if let (Self::Slots(a, s), Some(d)) = (self, decision) {
            a.settle(s, Charged::of(1, at, &d), 0, now);
        }
    }
}

/// A request inside the backend, ordered by when its work is done on the
/// backend's work clock (the earliest first).
#[derive(Debug, PartialEq)]
struct Inside {
    done_at_work: f64,
    arrived: Micros,
    decision: Option<Decision>,
}

impl Eq for Inside {}

impl PartialOrd for Inside {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Inside {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.done_at_work.total_cmp(&self.done_at_work)
    }
}

/// Runs the traffic of `p` through the three front doors.
///
/// ```
/// use spillway_sim::backend::{BackendParams, run_backend};
///
/// let run = run_backend(&BackendParams::default()).unwrap();
/// let door = |name| run.doors.iter().find(|d| d.name == name).unwrap();
/// // The concurrency limit keeps the backend at its 10 workers, whatever
/// // its speed; the rate limit, sized for its usual speed, does not.
/// assert!(door("concurrency limit").max_in_flight <= 10);
/// assert!(door("rate limit").max_in_flight > 10);
/// assert!(door("concurrency limit").p99_ms < door("rate limit").p99_ms);
/// ```
pub fn run_backend(p: &BackendParams) -> Result<BackendRun, SimError> {
    let workers = NonZeroU32::new(p.workers)
        .ok_or_else(|| SimError::Backend("the backend needs at least 1 worker".into()))?;
    if p.mean_work_us == 0 || p.duration_us == 0 {
        return Err(SimError::Backend(
            "the work and the duration must be longer than zero".into(),
        ));
    }
    let arrivals = arrivals(p);
    let per_second = (p.capacity_per_second().round() as u32).max(1);
    let rate = TokenBucket::new(
        Quota::per_second(NonZeroU32::new(per_second).expect("at least 1")),
        workers,
    );
    let lease = Quota::new(workers, Duration::from_secs(30)).expect("a valid lease");
    let doors = [
        ("no limit", Limit::None),
        ("rate limit", Limit::Rate(rate, Default::default())),
        (
            "concurrency limit",
            Limit::Slots(Concurrency::new(lease), Default::default()),
        ),
    ];
    let doors = doors
        .into_iter()
        .map(|(name, limit)| door(p, name, limit, &arrivals))
        .collect::<Result<_, _>>()?;
    Ok(BackendRun {
        params: *p,
        offered: arrivals.len() as u64,
        doors,
    })
}

/// The arrivals (time, work at full speed), in order: 70% of what the
/// backend serves, twice the work in the middle third, 130% in the last.
fn arrivals(p: &BackendParams) -> Vec<(Micros, f64)> {
    let mut rng = Rng::new(p.seed, 29);
    let slow = (p.duration_us / 3, 2 * p.duration_us / 3);
    let mut out = Vec::new();
    let mut t = 0f64;
    loop {
        let load = if (t as Micros) < slow.1 { 0.7 } else { 1.3 };
        let rate = load * p.capacity_per_second() / 1e6;
        t += rng.exponential(1.0 / rate);
        let at = t as Micros;
        if at >= p.duration_us {
            return out;
        }
        let mean = p.mean_work_us as f64
            * if (slow.0..slow.1).contains(&at) {
                2.0
            } else {
                1.0
            };
        out.push((at, rng.exponential(mean).max(1.0)));
    }
}

/// One front door's run: events in time order, the backend's work clock
/// moving at `min(1, workers / inside)`.
fn door(
    p: &BackendParams,
    name: &'static str,
    mut limit: Limit,
    arrivals: &[(Micros, f64)],
) -> Result<Door, SimError> {
    let workers = f64::from(p.workers);
    let slice = p.duration_us.div_ceil(SLICES as u64);
    let mut inside: BinaryHeap<Inside> = BinaryHeap::new();
    let (mut now, mut work) = (0f64, 0f64);
    let (mut served, mut denied, mut most) = (0u64, 0u64, 0u64);
    let mut in_flight = vec![0u64; SLICES];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); SLICES];
    let mut all = Vec::new();
    let mut next = arrivals.iter().peekable();
    let slice_of = |t: f64| ((t as u64) / slice).min(SLICES as u64 - 1) as usize;
    loop {
        let speed = |n: usize| {
            if n == 0 {
                0.0
            } else {
                (workers / n as f64).min(1.0)
            }
        };
        let n = inside.len();
        // When the first request inside is done, at this speed.
        let done = inside
            .peek()
            .map(|first| now + (first.done_at_work - work) / speed(n));
        let arrival = next.peek().map(|&&(at, _)| at as f64);
        match (done, arrival) {
            (None, None) => break,
            (Some(d), a) if a.is_none_or(|a| d <= a) => {
                work += (d - now) * speed(n);
                now = d;
                let first = inside.pop().expect("one inside");
                let took = (now - first.arrived as f64) / 1e3;
                times[slice_of(now)].push(took);
                all.push(took);
                served += 1;
                limit.ended(first.arrived, first.decision, now.ceil() as Micros);
            }
            (_, Some(a)) => {
                work += (a - now) * speed(n);
                now = a;
                let (at, need) = *next.next().expect("an arrival");
                match limit.admit(at)? {
                    Some(d) if !d.allowed => denied += 1,
                    decision => {
                        inside.push(Inside {
                            done_at_work: work + need,
                            arrived: at,
                            decision,
                        });
                        let n = inside.len() as u64;
                        most = most.max(n);
                        let s = slice_of(now);
                        in_flight[s] = in_flight[s].max(n);
                    }
                }
            }
            (Some(_), None) => unreachable!("matched above"),
        }
    }
    let latency = times
        .iter_mut()
        .map(|t| (percentile(t, 0.5), percentile(t, 0.99)))
        .collect();
    Ok(Door {
        name,
        served,
        denied,
        max_in_flight: most,
        p50_ms: percentile(&mut all.clone(), 0.5),
        p99_ms: percentile(&mut all, 0.99),
        in_flight,
        latency,
    })
}

/// The `q` quantile of `values` (0 when there are none).
fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let i = ((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1;
    values[i]
}

/// Rows of the chart: one per front door.
const ROW_HEIGHT: u32 = 230;
const WIDTH: u32 = 1000;
const HEADER: u32 = 70;
const INSIDE: plotters::style::RGBColor = plotters::style::RGBColor(31, 90, 180);
const P99: plotters::style::RGBColor = plotters::style::RGBColor(210, 40, 40);
const P50: plotters::style::RGBColor = plotters::style::RGBColor(120, 120, 120);
const SLOW: plotters::style::RGBColor = plotters::style::RGBColor(252, 240, 215);

/// One panel of the chart: `caption`, time on the x axis to `max.0`, a y
/// axis to `max.1` with `y_labels` pixels for its labels, and the slow
/// third (`slow`, in seconds) shaded.
fn panel<'a, 'b>(
    area: &'a plotters::drawing::DrawingArea<
        plotters::backend::SVGBackend<'b>,
        plotters::coord::Shift,
    >,
    caption: String,
    y_labels: u32,
    max: (f64, f64),
    slow: (f64, f64),
) -> Result<
    plotters::chart::ChartContext<
        'a,
        plotters::backend::SVGBackend<'b>,
        plotters::coord::cartesian::Cartesian2d<
            plotters::coord::types::RangedCoordf64,
            plotters::coord::types::RangedCoordf64,
        >,
    >,
    String,
> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(30)
        .y_label_area_size(y_labels)
        .build_cartesian_2d(0f64..max.0, 0f64..max.1)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .max_light_lines(0)
        .x_labels(7)
        .y_labels(5)
        .x_desc("time (s)")
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 13))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series([Rectangle::new(
            [(slow.0, 0.0), (slow.1, max.1)],
            SLOW.filled(),
        )])
        .map_err(|e| err(&e))?;
    Ok(chart)
}

/// The chart of `run`, as SVG text: a row per front door, the requests
/// inside the backend on the left and the time to serve on the right, over
/// time; the slow third shaded.
pub fn backend_chart(run: &BackendRun) -> Result<String, SimError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| SimError::Chart {
        scenario: "slow-backend".into(),
        message: e.to_string(),
    };
    let p = &run.params;
    let x_max = p.duration_us as f64 / 1e6;
    let x_at = |i: usize| x_max * (i as f64 + 0.5) / SLICES as f64;
    let slow = (x_max / 3.0, 2.0 * x_max / 3.0);
    let mut svg = String::new();
    {
        let rows = run.doors.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEADER + rows * ROW_HEIGHT))
            .into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let (header, body) = root.split_vertically(HEADER);
        header
            .draw(&Text::new(
                format!(
                    "slow-backend: {} workers, {} ms of work a request on average, 70% loaded; \
                     twice the work in the shaded third, 130% loaded in the last",
                    p.workers,
                    p.mean_work_us / 1000
                ),
                (12, 8),
                ("sans-serif", 19).into_font().color(&BLACK),
            ))
            .map_err(|e| err(&e))?;
        header
            .draw(&Text::new(
                "left: requests inside the backend (most per slice; the red line: its workers); \
                 right: time to serve, ms (grey p50, red p99); each row on its own scale",
                (12, 36),
                ("sans-serif", 15).into_font().color(&BLACK),
            ))
            .map_err(|e| err(&e))?;
        let areas = body.split_evenly((run.doors.len(), 2));
        for (row, door) in run.doors.iter().enumerate() {
            // Each row on its own scale: a limit that holds the backend at
            // its workers would be a flat line on the scale of one that
            // does not.
            let inside_max = (door.max_in_flight.max(u64::from(p.workers)) as f64 * 1.2).max(1.0);
            let latency_max = door.latency.iter().map(|l| l.1).fold(1.0, f64::max) * 1.1;
            let caption = format!(
                "{}: {} served, {} denied, at most {} inside",
                door.name, door.served, door.denied, door.max_in_flight
            );
            let mut left = panel(&areas[2 * row], caption, 48, (x_max, inside_max), slow)
                .map_err(|e| err(&e))?;
            left.draw_series(LineSeries::new(
                door.in_flight
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| (x_at(i), n as f64)),
                INSIDE.stroke_width(2),
            ))
            .map_err(|e| err(&e))?;
            left.draw_series(LineSeries::new(
                [(0.0, f64::from(p.workers)), (x_max, f64::from(p.workers))],
                P99.stroke_width(1),
            ))
            .map_err(|e| err(&e))?;
            let caption = format!("p50 {:.0} ms, p99 {:.0} ms", door.p50_ms, door.p99_ms);
            let mut right = panel(&areas[2 * row + 1], caption, 56, (x_max, latency_max), slow)
                .map_err(|e| err(&e))?;
            for (pick, color, width) in [(0usize, P50, 1u32), (1, P99, 2)] {
                right
                    .draw_series(LineSeries::new(
                        door.latency
                            .iter()
                            .enumerate()
                            .filter(|(_, l)| l.1 > 0.0)
                            .map(|(i, l)| (x_at(i), if pick == 0 { l.0 } else { l.1 })),
                        color.stroke_width(width),
                    ))
                    .map_err(|e| err(&e))?;
            }
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

impl std::fmt::Display for BackendRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.params;
        writeln!(
            f,
            "slow-backend: {} workers, {} ms of work a request on average, {} requests offered \
             (70% of what it serves; in the middle third it needs twice the work; in the last, \
             130%)",
            p.workers,
            p.mean_work_us / 1000,
            self.offered
        )?;
        writeln!(
            f,
            "    {:<20} {:>8} {:>8} {:>14} {:>10} {:>10}",
            "front door", "served", "denied", "most inside", "p50 ms", "p99 ms"
        )?;
        for d in &self.doors {
            writeln!(
                f,
                "    {:<20} {:>8} {:>8} {:>14} {:>10.0} {:>10.0}",
                d.name, d.served, d.denied, d.max_in_flight, d.p50_ms, d.p99_ms
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_concurrency_limit_keeps_a_slowed_backend_at_its_workers() {
        let p = BackendParams::default();
        let run = run_backend(&p).unwrap();
        let door = |name| run.doors.iter().find(|d| d.name == name).unwrap();
        let (none, rate, slots) = (
            door("no limit"),
            door("rate limit"),
            door("concurrency limit"),
        );
        // Every request offered is served or denied, by each door.
        for d in &run.doors {
            assert_eq!(d.served + d.denied, run.offered, "{}", d.name);
        }
        assert_eq!(none.denied, 0);
        assert!(slots.max_in_flight <= u64::from(p.workers));
        // In the slow third, 140% of what the backend can do arrives: with
        // no limit, or a rate limit sized for the usual speed, requests
        // pile up inside, and every one of them waits.
        assert!(
            none.max_in_flight > 5 * u64::from(p.workers),
            "{}",
            none.max_in_flight
        );
        assert!(
            rate.max_in_flight > 2 * u64::from(p.workers),
            "{}",
            rate.max_in_flight
        );
        assert!(
            slots.p99_ms * 3.0 < rate.p99_ms,
            "{} {}",
            slots.p99_ms,
            rate.p99_ms
        );
        // The slow third is where they part: the rate limit denies nothing
        // there, and the backend fills up.
        let slow = SLICES / 3 + 5..2 * SLICES / 3;
        let most = |d: &Door| slow.clone().map(|s| d.in_flight[s]).max().unwrap();
        assert!(
            most(rate) > 3 * most(slots),
            "{} {}",
            most(rate),
            most(slots)
        );
        // The surge of the last third: both limits turn it away.
        assert!(rate.denied > run.offered / 20, "{}", rate.denied);
        assert!(slots.denied > rate.denied);
    }

    #[test]
    fn a_seed_reproduces_the_run_and_bad_parameters_are_errors() {
        let p = BackendParams::default();
        assert_eq!(run_backend(&p).unwrap(), run_backend(&p).unwrap());
        for bad in [
            BackendParams { workers: 0, ..p },
            BackendParams {
                mean_work_us: 0,
                ..p
            },
            BackendParams {
                duration_us: 0,
                ..p
            },
        ] {
            assert!(run_backend(&bad).is_err());
        }
    }

    #[test]
    fn the_chart_and_the_table_show_every_door() {
        let run = run_backend(&BackendParams::default()).unwrap();
        let svg = backend_chart(&run).unwrap();
        let table = run.to_string();
        for d in &run.doors {
            assert!(svg.contains(d.name) && table.contains(d.name), "{}", d.name);
        }
    }

    #[test]
    fn percentiles_are_of_the_values_given() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), 50.0);
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }
}

//! SVG charts: one per scenario, one panel per algorithm.
//!
//! Each panel plots, over time, the cost admitted in the trailing window
//! `(t - W, t]` (so the limit `L` is a horizontal line and the fixed
//! window's 2x shows as a peak above it), next to the cost offered in the
//! same trailing window. Each point is the maximum over its slice of time,
//! so a peak narrower than a pixel still shows. For the shaping leaky
//! bucket the admitted line counts requests when they leave. With several
//! keys (a trace), the panels show the busiest key.

use plotters::coord::Shift;
use plotters::prelude::*;
use spillway::clock::Micros;

use crate::error::SimError;
use crate::run::Run;
use crate::scenario::Scenario;

/// Points per line: enough to see a 10 s window's shape over a minute, and
/// few enough to keep a chart near 30 kB.
const SLICES: usize = 160;
const PANEL_HEIGHT: u32 = 210;
const WIDTH: u32 = 1000;
const HEADER: u32 = 86;

/// One panel: an algorithm's run.
#[derive(Debug, Clone, Copy)]
pub struct Panel<'a> {
    /// Its name, shown above the panel.
    pub name: &'a str,
    /// What it did.
    pub outcome: &'a Run,
    /// Measure admissions when requests leave (shaping), not when they arrive.
    pub by_departure: bool,
    /// The most admitted in any window (from the table), for the caption.
    pub max_in_window: u64,
}

/// Draws `scenario`'s chart with a panel per algorithm, for the quota
/// `limit` per `window` (µs). Returns the SVG text.
pub fn render(
    scenario: &Scenario,
    panels: &[Panel<'_>],
    limit: u64,
    window: Micros,
) -> Result<String, SimError> {
    let err = |e: &dyn std::fmt::Display| SimError::Chart {
        scenario: scenario.name.clone(),
        message: e.to_string(),
    };
    let key = busiest_key(scenario, panels);
    // At least 1 µs wide, even for a trace whose every row is at the end
    // of time (u64::MAX).
    let start = scenario.start.min(Micros::MAX - 1);
    let span = (start, scenario.end.max(start + 1));
    let lines: Vec<(Vec<u64>, Vec<u64>)> = panels
        .iter()
        .map(|p| {
            let (offered, admitted) = series(p, key);
            (
                trailing_envelope(&offered, window, span),
                trailing_envelope(&admitted, window, span),
            )
        })
        .collect();
    let top = lines
        .iter()
        .flat_map(|(_, a)| a.iter().copied())
        .max()
        .unwrap_or(0)
        .max(limit);
    let y_max = (top as f64 * 1.15).ceil().max(1.0);
    let x_max = (span.1 - span.0) as f64 / 1e6;

    let rows = panels.len().div_ceil(2).max(1) as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEADER + rows * PANEL_HEIGHT))
            .into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let (header, body) = root.split_vertically(HEADER);
        draw_header(&header, scenario, key, limit, window).map_err(|e| err(&e))?;
        let areas = body.split_evenly((rows as usize, 2));
        for ((area, panel), (offered, admitted)) in areas.iter().zip(panels).zip(&lines) {
            draw_panel(area, panel, offered, admitted, limit, x_max, y_max).map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

/// Draws the chart's title, what it plots (the window, the busiest `key`
/// if there are several, the limit) and the legend.
fn draw_header<DB: DrawingBackend>(
    header: &DrawingArea<DB, Shift>,
    scenario: &Scenario,
    key: usize,
    limit: u64,
    window: Micros,
) -> DrawResult<(), DB> {
    let key_note = if scenario.keys.len() > 1 {
        format!(", busiest key `{}`", scenario.keys[key])
    } else {
        String::new()
    };
    header.draw(&Text::new(
        format!("{}: {}", scenario.name, scenario.description),
        (12, 8),
        ("sans-serif", 21).into_font().color(&BLACK),
    ))?;
    header.draw(&Text::new(
        format!(
            "cost admitted (and offered) in the trailing window (t - W, t], W = {}{key_note}; limit L = {limit}",
            crate::report::fmt_micros(window)
        ),
        (12, 34),
        ("sans-serif", 16).into_font().color(&BLACK),
    ))?;
    let legend: [(&str, RGBColor); 3] = [
        ("admitted", ADMITTED),
        ("offered", OFFERED),
        ("limit L", LIMIT),
    ];
    for (i, (label, color)) in legend.into_iter().enumerate() {
        let x = 12 + 130 * i as i32;
        header.draw(&PathElement::new(
            vec![(x, 67), (x + 24, 67)],
            color.stroke_width(3),
        ))?;
        header.draw(&Text::new(
            label,
            (x + 30, 60),
            ("sans-serif", 16).into_font().color(&BLACK),
        ))?;
    }
    Ok(())
}

/// Draws one algorithm's panel in `area`: its caption, the axes over
/// `0..x_max` seconds and `0..y_max`, and its offered, admitted and limit
/// lines (one value per slice of time).
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel<'_>,
    offered: &[u64],
    admitted: &[u64],
    limit: u64,
    x_max: f64,
    y_max: f64,
) -> DrawResult<(), DB> {
    let x_at = |i: usize| x_max * (i as f64 + 0.5) / SLICES as f64;
    let caption = format!(
        "{}{}: max {} in any W ({:.2}x L)",
        panel.name,
        if panel.by_departure {
            " (by departure)"
        } else {
            ""
        },
        panel.max_in_window,
        panel.max_in_window as f64 / limit as f64
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 17))
        .margin(8)
        .x_label_area_size(34)
        .y_label_area_size(52)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .max_light_lines(0)
        .x_labels(7)
        .y_labels(5)
        .x_desc("time (s)")
        .y_desc("in last W")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 14))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    // Offered can be far above the limit (the hammer): clipped to the
    // plot, so the admitted lines stay readable.
    let clip = |v: u64| (v as f64).min(y_max);
    chart.draw_series(LineSeries::new(
        corners(offered).map(|(i, v)| (x_at(i), clip(v))),
        OFFERED.stroke_width(1),
    ))?;
    chart.draw_series(LineSeries::new(
        corners(admitted).map(|(i, v)| (x_at(i), v as f64)),
        ADMITTED.stroke_width(2),
    ))?;
    // Solid (plotters draws a dashed line as one element per dash,
    // which would double the file), and on top, so that it shows
    // where the admitted line runs along it.
    chart.draw_series(LineSeries::new(
        [(0.0, limit as f64), (x_max, limit as f64)],
        LIMIT.stroke_width(1),
    ))?;
    Ok(())
}

const ADMITTED: RGBColor = RGBColor(31, 90, 180);
const OFFERED: RGBColor = RGBColor(175, 175, 175);
const LIMIT: RGBColor = RGBColor(210, 40, 40);

/// The points of a line that are not in the middle of a flat run: the same
/// line with far fewer points when traffic is steady.
fn corners(values: &[u64]) -> impl Iterator<Item = (usize, u64)> + '_ {
    values.iter().enumerate().filter_map(move |(i, &v)| {
        let flat = i > 0 && i + 1 < values.len() && values[i - 1] == v && values[i + 1] == v;
        (!flat).then_some((i, v))
    })
}

/// The key with the most requests in the first panel's run.
fn busiest_key(scenario: &Scenario, panels: &[Panel<'_>]) -> usize {
    let mut counts = vec![0u64; scenario.keys.len()];
    if let Some(p) = panels.first() {
        for r in &p.outcome.requests {
            counts[r.key as usize] += 1;
        }
    }
    (0..counts.len()).max_by_key(|&k| counts[k]).unwrap_or(0)
}

/// `(time, cost)` of the requests offered and admitted for `key`, each
/// sorted by time.
type Events = Vec<(Micros, u64)>;

fn series(panel: &Panel<'_>, key: usize) -> (Events, Events) {
    let (mut offered, mut admitted) = (Vec::new(), Vec::new());
    for (r, d) in panel.outcome.requests.iter().zip(&panel.outcome.decisions) {
        if r.key as usize != key {
            continue;
        }
        offered.push((r.at, r.cost));
        if d.allowed {
            let delay = if panel.by_departure {
                u64::try_from(d.delay.as_micros()).unwrap_or(u64::MAX)
            } else {
                0
            };
            admitted.push((r.at.saturating_add(delay), r.cost));
        }
    }
    offered.sort_by_key(|e| e.0);
    admitted.sort_by_key(|e| e.0);
    (offered, admitted)
}

/// For each of [`SLICES`] equal slices of `span`, the largest value the
/// trailing-window sum `sum of cost over events with t - W < time <= t`
/// takes anywhere in the slice. `events` must be sorted by time.
fn trailing_envelope(events: &[(Micros, u64)], window: Micros, span: (Micros, Micros)) -> Vec<u64> {
    let (start, end) = span;
    let len = u128::from(end - start);
    // An event enters at its time and leaves at its time + W; both lists
    // are sorted, so one merge walks them.
    let (mut add, mut remove, mut value) = (0usize, 0usize, 0u64);
    let next_time = |add: usize, remove: usize| {
        let a = events.get(add).map(|e| e.0);
        let r = events
            .get(remove)
            .map(|e| e.0.saturating_add(window))
            .filter(|_| remove < add);
        match (a, r) {
            (Some(a), Some(r)) => Some(a.min(r)),
            (a, r) => a.or(r),
        }
    };
    let mut apply_at = |t: Micros, add: &mut usize, remove: &mut usize| {
        while *remove < *add && events[*remove].0.saturating_add(window) == t {
            value -= events[*remove].1;
            *remove += 1;
        }
        while *add < events.len() && events[*add].0 == t {
            value += events[*add].1;
            *add += 1;
        }
        value
    };
    let mut out = Vec::with_capacity(SLICES);
    for i in 0..SLICES {
        let from = start + (len * i as u128 / SLICES as u128) as u64;
        let to = start + (len * (i as u128 + 1) / SLICES as u128) as u64;
        let mut current = None;
        while let Some(t) = next_time(add, remove) {
            if t > from {
                break;
            }
            current = Some(apply_at(t, &mut add, &mut remove));
        }
        let mut best = current.unwrap_or_else(|| apply_at(from, &mut add, &mut remove));
        while let Some(t) = next_time(add, remove) {
            if t >= to {
                break;
            }
            best = best.max(apply_at(t, &mut add, &mut remove));
        }
        out.push(best);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corners_drop_only_the_middle_of_flat_runs() {
        let kept: Vec<_> = corners(&[0, 1, 1, 1, 2, 2]).collect();
        assert_eq!(kept, [(0, 0), (1, 1), (3, 1), (4, 2), (5, 2)]);
    }

    #[test]
    fn envelope_catches_a_peak_narrower_than_a_slice() {
        // 1 s per slice. Two events 10 µs apart, W = 20 µs.
        let events = [(5_000_000, 1), (5_000_010, 1)];
        let env = trailing_envelope(&events, 20, (0, SLICES as u64 * 1_000_000));
        assert_eq!(env[5], 2);
        assert_eq!(env[4], 0);
        assert_eq!(env[6], 0);
    }

    #[test]
    fn envelope_of_a_steady_stream_is_flat_at_the_window_count() {
        // One every 10 µs, W = 100 µs: 10 in any trailing window once full.
        let events: Vec<_> = (0..1000).map(|i| (i * 10, 1)).collect();
        let env = trailing_envelope(&events, 100, (0, 10_000));
        assert!(env[5..SLICES - 5].iter().all(|&v| v == 10), "{env:?}");
    }

    #[test]
    fn an_entry_leaves_exactly_w_after_it_entered() {
        // At t = 10 the entry from t = 0 has left and the new one entered.
        let events = [(0, 1), (10, 1)];
        let env = trailing_envelope(&events, 10, (0, 2000));
        assert!(env.iter().all(|&v| v <= 1), "{env:?}");
    }
}

//! The results: a [`Report`] that prints as a table, serialises to JSON and
//! renders as the charts' index.html.

use std::fmt::{self, Write as _};

use serde::Serialize;
use spillway::clock::Micros;

use crate::measure::Measurements;
use crate::scenario::Params;

/// Every scenario's measurements, with the settings that produced them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// `L`.
    pub limit: u32,
    /// `W`, µs.
    pub window_us: Micros,
    /// The buckets' burst / capacity.
    pub burst: u32,
    /// Simulated time per scenario, µs (a trace brings its own).
    pub duration_us: Micros,
    /// The seed of the random arrivals.
    pub seed: u64,
    /// One entry per scenario.
    pub scenarios: Vec<ScenarioReport>,
    /// The slow backend behind no limit, a rate limit and a concurrency
    /// limit, when asked for (see [`crate::backend`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<crate::backend::BackendRun>,
    /// Its chart's file name, when charts were written.
    #[serde(skip)]
    pub backend_chart: Option<String>,
}

/// The measurements of every algorithm on one scenario.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioReport {
    /// The scenario's name.
    pub name: String,
    /// What its traffic is.
    pub description: String,
    /// The chart's file name, when charts were written.
    pub chart: Option<String>,
    /// One row per algorithm.
    pub rows: Vec<Measurements>,
}

impl Report {
    /// An empty report for `params`.
    pub fn new(params: &Params) -> Self {
        Self {
            limit: params.limit.get(),
            window_us: params.window,
            burst: params.burst.get(),
            duration_us: params.duration,
            seed: params.seed,
            scenarios: Vec::new(),
            backend: None,
            backend_chart: None,
        }
    }

    /// The settings in one line.
    pub fn settings(&self) -> String {
        format!(
            "limit L = {} per window W = {}; burst (token bucket) and capacity (leaky bucket) = {}; {} of traffic; seed {}",
            self.limit,
            fmt_micros(self.window_us),
            self.burst,
            fmt_micros(self.duration_us),
            self.seed
        )
    }

    /// A self-contained HTML page: a summary of what each algorithm did
    /// and which to pick when, then the scenarios that separate them, then
    /// those where they agree, each table with its columns' meanings.
    pub fn to_html(&self, command: &str) -> String {
        crate::page::to_html(self, command)
    }
}

pub(crate) const HEADERS: [&str; 9] = [
    "algorithm",
    "requests",
    "admitted",
    "denied",
    "max in any W",
    "delay mean / max",
    "state B/key",
    "wrongly admitted",
    "wrongly denied",
];

pub(crate) fn cells(m: &Measurements) -> [String; 9] {
    let delay = match (m.delay_mean_us, m.delay_max_us) {
        (Some(mean), Some(max)) => format!(
            "{} / {}",
            fmt_micros(mean.round() as Micros),
            fmt_micros(max)
        ),
        _ => "-".to_owned(),
    };
    [
        m.algorithm.clone(),
        m.requests.to_string(),
        m.admitted.to_string(),
        m.denied.to_string(),
        format!("{} ({:.2}x)", m.max_in_window, m.max_in_window_ratio),
        delay,
        m.state_bytes_per_key.to_string(),
        format!(
            "{} ({})",
            m.wrongly_admitted,
            fmt_pct(m.wrongly_admitted_pct)
        ),
        format!("{} ({})", m.wrongly_denied, fmt_pct(m.wrongly_denied_pct)),
    ]
}

/// The per-client lines of a scenario with several clients on one key.
pub(crate) fn spread_lines(s: &ScenarioReport) -> Option<String> {
    let mut out = String::new();
    for row in &s.rows {
        let c = row.clients?;
        if out.is_empty() {
            out.push_str("share of each client's requests admitted, min / median / max:\n");
        }
        let _ = writeln!(
            out,
            "    {:<20} {:.1}% / {:.1}% / {:.1}%",
            row.algorithm, c.min_pct, c.median_pct, c.max_pct
        );
    }
    (!out.is_empty()).then_some(out)
}

impl fmt::Display for Report {
    /// The terminal table: one block per scenario.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.settings())?;
        for s in &self.scenarios {
            writeln!(f)?;
            writeln!(f, "{}: {}", s.name, s.description)?;
            let rows: Vec<[String; 9]> = s.rows.iter().map(cells).collect();
            let mut widths = HEADERS.map(str::len);
            for row in &rows {
                for (w, cell) in widths.iter_mut().zip(row) {
                    *w = (*w).max(cell.chars().count());
                }
            }
            let line = |f: &mut fmt::Formatter<'_>, cells: &[&str]| {
                for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
                    if i == 0 {
                        write!(f, "  {cell:<w$}")?;
                    } else {
                        write!(f, "  {cell:>w$}")?;
                    }
                }
                writeln!(f)
            };
            line(f, &HEADERS)?;
            for row in &rows {
                line(f, &row.each_ref().map(String::as_str))?;
            }
            if let Some(spread) = spread_lines(s) {
                write!(f, "{spread}")?;
            }
        }
        if let Some(backend) = &self.backend {
            writeln!(f)?;
            write!(f, "{backend}")?;
        }
        Ok(())
    }
}

/// A duration in µs, in the largest unit that keeps it readable:
/// `0`, `750 µs`, `12.5 ms`, `1.25 s`, `10 s`, `2 min`.
///
/// ```
/// use spillway_sim::report::fmt_micros;
/// assert_eq!(fmt_micros(10_000_000), "10 s");
/// assert_eq!(fmt_micros(1_250_000), "1.25 s");
/// assert_eq!(fmt_micros(12_500), "12.5 ms");
/// assert_eq!(fmt_micros(750), "750 µs");
/// assert_eq!(fmt_micros(120_000_000), "2 min");
/// ```
pub fn fmt_micros(us: Micros) -> String {
    let trim = |v: f64, unit: &str| {
        let s = format!("{v:.2}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        format!("{s} {unit}")
    };
    match us {
        0 => "0".to_owned(),
        _ if us < 1_000 => format!("{us} µs"),
        _ if us < 1_000_000 => trim(us as f64 / 1e3, "ms"),
        _ if us < 60_000_000 || !us.is_multiple_of(60_000_000) => trim(us as f64 / 1e6, "s"),
        _ => format!("{} min", us / 60_000_000),
    }
}

/// A percentage with enough digits to tell 0.003% from 0.
pub(crate) fn fmt_pct(p: f64) -> String {
    if p == 0.0 {
        "0%".to_owned()
    } else if p < 0.01 {
        format!("{p:.4}%")
    } else {
        format!("{p:.2}%")
    }
}

pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_keep_small_figures_visible() {
        assert_eq!(fmt_pct(0.0), "0%");
        assert_eq!(fmt_pct(0.003), "0.0030%");
        assert_eq!(fmt_pct(12.345), "12.35%");
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(escape("<a & \"b\">"), "&lt;a &amp; &quot;b&quot;&gt;");
    }
}

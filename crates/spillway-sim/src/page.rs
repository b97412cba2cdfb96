//! The charts' index.html: a summary of what each algorithm did on this run
//! and which to pick when, then the scenarios that separate the algorithms,
//! then those where they agree; each table with its columns' meanings.

use std::fmt::Write as _;

use crate::measure::Measurements;
use crate::report::{
    HEADERS, Report, ScenarioReport, cells, escape, fmt_micros, fmt_pct, spread_lines,
};

/// How far apart two algorithms must be on a scenario for it to separate
/// them: this share of the requests admitted, or this many `L` in the most
/// admitted in any window.
const APART_SHARE: f64 = 0.02;
const APART_RATIO: f64 = 0.05;

/// What each algorithm does, in a few words.
fn what_it_does(algorithm: &str) -> &'static str {
    match algorithm {
        "fixed_window" => "counts per aligned window; the count restarts at each boundary",
        "sliding_log" => "remembers every admission of the last W: exact",
        "sliding_window" => "weights the previous window's count by how much of it is still in W",
        "token_bucket" => "a rate of L per W, with bursts up to the burst",
        "leaky_bucket_shape" => "one request every W / L; the others wait their turn",
        "leaky_bucket_police" => "one request every W / L, the others refused at once",
        _ => "",
    }
}

/// The meaning of the columns, beside each table.
const LEGEND: &str = "<p class=\"legend\"><b>requests / admitted / denied</b>: requests, not cost units. \
<b>max in any W</b>: the most cost admitted for one key in any window of length W, wherever it \
is placed, and that as a multiple of L (leaky_bucket_shape: when requests leave, after their \
delay). <b>delay</b>: how long leaky_bucket_shape held the requests it admitted. \
<b>state B/key</b>: the largest state one key had, in bytes. <b>wrongly admitted / denied</b>: \
decisions the exact rule \"at most L in any W\" would have taken the other way, judged on the \
algorithm's own history, as a share of all requests; the buckets enforce a rate, not a window, \
so for them it is how far that rate is from \"L in any W\".</p>\n";

/// The spread of a scenario's rows: the share of requests admitted, and the
/// most admitted in any window (in `L`), largest minus smallest.
fn spread(s: &ScenarioReport) -> (f64, f64) {
    let range = |f: &dyn Fn(&Measurements) -> f64| {
        let values = s.rows.iter().map(f);
        let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
        if s.rows.is_empty() { 0.0 } else { hi - lo }
    };
    (
        range(&|m| m.admitted as f64 / m.requests.max(1) as f64),
        range(&|m| m.max_in_window_ratio),
    )
}

/// Whether the scenario tells the algorithms apart.
fn separates(s: &ScenarioReport) -> bool {
    let (share, ratio) = spread(s);
    share >= APART_SHARE || ratio >= APART_RATIO
}

/// One algorithm's figures over every scenario of the run.
struct Overall<'a> {
    algorithm: &'a str,
    worst: Option<(&'a str, &'a Measurements)>,
    boundary: Option<&'a Measurements>,
    // The scenario where it admitted, and denied, most wrongly.
    admitted_wrongly: Option<(&'a str, f64)>,
    denied_wrongly: Option<(&'a str, f64)>,
    state: usize,
    delay_max: Option<u64>,
}

fn overall<'a>(report: &'a Report, algorithm: &'a str) -> Overall<'a> {
    let mut o = Overall {
        algorithm,
        worst: None,
        boundary: None,
        admitted_wrongly: None,
        denied_wrongly: None,
        state: 0,
        delay_max: None,
    };
    for s in &report.scenarios {
        let Some(m) = s.rows.iter().find(|m| m.algorithm == algorithm) else {
            continue;
        };
        if o.worst
            .is_none_or(|(_, w)| m.max_in_window_ratio > w.max_in_window_ratio)
        {
            o.worst = Some((&s.name, m));
        }
        if s.name == "boundary_burst" {
            o.boundary = Some(m);
        }
        if o.admitted_wrongly
            .is_none_or(|(_, p)| m.wrongly_admitted_pct > p)
        {
            o.admitted_wrongly = Some((&s.name, m.wrongly_admitted_pct));
        }
        if o.denied_wrongly
            .is_none_or(|(_, p)| m.wrongly_denied_pct > p)
        {
            o.denied_wrongly = Some((&s.name, m.wrongly_denied_pct));
        }
        o.state = o.state.max(m.state_bytes_per_key);
        o.delay_max = o.delay_max.max(m.delay_max_us);
    }
    o
}

/// The worst share and where, or `0%` when there was none.
fn worst_pct(worst: Option<(&str, f64)>) -> String {
    match worst {
        Some((name, p)) if p > 0.0 => format!("{} ({name})", fmt_pct(p)),
        _ => "0%".to_string(),
    }
}

/// The summary: one row per algorithm, then which to pick when.
fn summary(h: &mut String, report: &Report) {
    let algorithms: Vec<&str> = report
        .scenarios
        .first()
        .map(|s| s.rows.iter().map(|m| m.algorithm.as_str()).collect())
        .unwrap_or_default();
    let all: Vec<Overall<'_>> = algorithms.iter().map(|a| overall(report, a)).collect();
    let _ = writeln!(
        h,
        "<h2 id=\"summary\">At a glance</h2>\n<p>What each algorithm did over the {} scenarios of \
         this run.</p>\n<table>\n<tr><th>algorithm</th>\
         <th class=\"text\">what it does</th><th>most in any W (scenario)</th><th>at a window boundary</th>\
         <th>wrongly admitted</th><th>wrongly denied</th><th>state B/key</th><th>delay max</th></tr>",
        report.scenarios.len(),
    );
    for o in &all {
        let worst = o.worst.map_or("-".to_string(), |(name, m)| {
            format!(
                "{} ({:.2}x, {name})",
                m.max_in_window, m.max_in_window_ratio
            )
        });
        let boundary = o.boundary.map_or("-".to_string(), |m| {
            format!("{} ({:.2}x)", m.max_in_window, m.max_in_window_ratio)
        });
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td class=\"text\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(o.algorithm),
            escape(what_it_does(o.algorithm)),
            escape(&worst),
            escape(&boundary),
            escape(&worst_pct(o.admitted_wrongly)),
            escape(&worst_pct(o.denied_wrongly)),
            o.state,
            o.delay_max.map_or("-".to_string(), fmt_micros),
        );
    }
    h.push_str("</table>\n");
    h.push_str(
        "<p class=\"legend\"><b>most in any W</b>: the largest cost admitted for one key in any \
         window of length W over all scenarios, as a multiple of L, and the scenario. <b>at a \
         window boundary</b>: the same in <code>boundary_burst</code> (L requests just before a \
         boundary and L just after). <b>wrongly admitted / denied</b>: the largest share of a \
         scenario's requests (see below), and the scenario. <b>state B/key</b>: the largest state \
         of one key.</p>\n",
    );
    let find = |name: &str| all.iter().find(|o| o.algorithm == name);
    let ratio = |o: Option<&Overall<'_>>| {
        o.and_then(|o| o.worst).map_or("-".to_string(), |(_, m)| {
            format!("{:.2}x", m.max_in_window_ratio)
        })
    };
    let mut picks = Vec::new();
    if let Some(o) = find("sliding_log") {
        picks.push(format!(
            "<b>Logins, and other small limits that must hold exactly</b>: <code>sliding_log</code>. \
             It admitted at most {} of L in any W here, at up to {} bytes a key, which grow with L.",
            ratio(Some(o)),
            o.state
        ));
    }
    if let Some(o) = find("sliding_window") {
        picks.push(format!(
            "<b>Per-client API limits</b>: <code>sliding_window</code>. At most {} of L in any W \
             here, in {} bytes a key whatever L; its estimate erred on up to {} of a scenario's \
             requests admitting and {} denying.",
            ratio(Some(o)),
            o.state,
            worst_pct(o.admitted_wrongly),
            worst_pct(o.denied_wrongly)
        ));
    }
    if let Some(o) = find("token_bucket") {
        picks.push(format!(
            "<b>A rate that allows bursts</b> (clients that batch): <code>token_bucket</code>. \
             It lets a full burst through after a quiet spell, so it admitted up to {} of L in \
             one W here: that is its policy, not an error.",
            ratio(Some(o))
        ));
    }
    if let Some(o) = find("leaky_bucket_shape") {
        picks.push(format!(
            "<b>An upstream that cannot take bursts</b>: <code>leaky_bucket_shape</code>, which \
             spaces requests W / L apart and held some up to {} here; \
             <code>leaky_bucket_police</code> refuses them instead.",
            o.delay_max.map_or("0".to_string(), fmt_micros)
        ));
    }
    if let Some(o) = find("fixed_window") {
        picks.push(format!(
            "<b><code>fixed_window</code></b> only where twice the limit across a boundary is \
             acceptable: it admitted {} of L in one W here.",
            ratio(Some(o))
        ));
    }
    if !picks.is_empty() {
        h.push_str("<h3>Which to pick</h3>\n<ul>\n");
        for p in picks {
            let _ = writeln!(h, "<li>{p}</li>");
        }
        h.push_str("</ul>\n");
    }
}

/// One scenario: its table, the columns' meanings, its spread and chart.
fn scenario(h: &mut String, s: &ScenarioReport) {
    let _ = writeln!(
        h,
        "<h3 id=\"{0}\">{0}</h3>\n<p>{1}</p>\n<table>\n<tr>",
        escape(&s.name),
        escape(&s.description)
    );
    for c in HEADERS {
        let _ = write!(h, "<th>{}</th>", escape(c));
    }
    h.push_str("</tr>\n");
    for row in &s.rows {
        h.push_str("<tr>");
        for cell in cells(row) {
            let _ = write!(h, "<td>{}</td>", escape(&cell));
        }
        h.push_str("</tr>\n");
    }
    h.push_str("</table>\n");
    h.push_str(LEGEND);
    if let Some(spread) = spread_lines(s) {
        let _ = writeln!(h, "<pre>{}</pre>", escape(&spread));
    }
    if let Some(chart) = &s.chart {
        let _ = writeln!(
            h,
            "<p><img src=\"{0}\" alt=\"admitted over time per algorithm, {1}\"></p>",
            escape(chart),
            escape(&s.name)
        );
    }
}

/// The slow backend's section: what it shows, its table and its chart.
fn backend(h: &mut String, run: &crate::backend::BackendRun, chart: Option<&str>) {
    let p = &run.params;
    let _ = writeln!(
        h,
        "<h2 id=\"slow-backend\">Requests in flight: a slow backend</h2>\n<p>A backend of {} \
         workers, {} ms of work a request on average (exponential: most quick, a few long), \
         {} requests offered at 70% of what it serves; in the middle third each request needs \
         twice the work, so the same traffic is 140% of what it can do; in the last third the \
         backend is itself again and the traffic surges to 130%. In front of it: no \
         limit; a rate limit sized for its usual speed (a token bucket of what it serves a \
         second, burst {}); and a concurrency limit of {} slots, each given back when its \
         response ends. Both limits turn the surge away. But the rate limit lets as many in a \
         second when the backend slows: the \
         requests inside pile up, and every one waits. The concurrency limit lets one in only \
         when one has left: the backend never has more inside than it has workers, the \
         requests it serves stay fast, and what it cannot serve is turned away at once.</p>",
        p.workers,
        p.mean_work_us / 1000,
        run.offered,
        p.workers,
        p.workers
    );
    h.push_str(
        "<table>\n<tr><th>front door</th><th>served</th><th>denied</th>\
                <th>most inside</th><th>p50 ms</th><th>p99 ms</th></tr>\n",
    );
    for d in &run.doors {
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0}</td><td>{:.0}</td></tr>",
            escape(d.name),
            d.served,
            d.denied,
            d.max_in_flight,
            d.p50_ms,
            d.p99_ms
        );
    }
    h.push_str("</table>\n");
    if let Some(chart) = chart {
        let _ = writeln!(
            h,
            "<p><img src=\"{}\" alt=\"requests inside the backend and time to serve over time, per front door\"></p>",
            escape(chart)
        );
    }
}

/// A self-contained HTML page with the summary, every table and chart.
pub(crate) fn to_html(report: &Report, command: &str) -> String {
    let mut h = String::new();
    h.push_str(concat!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
        "<title>spillway simulate</title>\n<style>\n",
        "body{font-family:sans-serif;max-width:1040px;margin:2em auto;padding:0 1em;color:#222}\n",
        "table{border-collapse:collapse;font-size:14px;margin:.5em 0 .3em}\n",
        "th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}\n",
        "th:first-child,td:first-child,td.text,th.text{text-align:left}\n",
        "th{background:#f3f3f3}\nimg{max-width:100%;border:1px solid #ddd}\n",
        "code{background:#f3f3f3;padding:1px 4px}\n",
        ".legend{font-size:13px;color:#555;margin:.2em 0 1em}\nli{margin:.3em 0}\n",
        "</style>\n</head>\n<body>\n<h1>spillway simulate</h1>\n"
    ));
    let _ = writeln!(h, "<p>{}</p>", escape(&report.settings()));
    let _ = writeln!(
        h,
        "<p>Generated by <code>{}</code>. The columns are defined beside each table, and in \
         <code>docs/algorithms.md</code>, section \"Measured: the algorithms side by side\".</p>",
        escape(command)
    );
    summary(&mut h, report);
    let (apart, alike): (Vec<&ScenarioReport>, Vec<&ScenarioReport>) =
        report.scenarios.iter().partition(|s| separates(s));
    let mut apart = apart;
    // The most separating first.
    apart.sort_by(|a, b| {
        let (sa, ra) = spread(a);
        let (sb, rb) = spread(b);
        (sb + rb).total_cmp(&(sa + ra))
    });
    if !apart.is_empty() {
        h.push_str("<h2 id=\"apart\">Where the algorithms differ</h2>\n");
        for s in apart {
            scenario(&mut h, s);
        }
    }
    if !alike.is_empty() {
        let _ = writeln!(
            h,
            "<h2 id=\"alike\">Where they agree</h2>\n<p>Every algorithm admitted the same share of \
             requests here (within {:.0}% of them) and the same most in any W (within {APART_RATIO} L).</p>",
            APART_SHARE * 100.0
        );
        for s in alike {
            scenario(&mut h, s);
        }
    }
    if let Some(run) = &report.backend {
        backend(&mut h, run, report.backend_chart.as_deref());
    }
    h.push_str("</body>\n</html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(algorithm: &str, admitted: u64, ratio: f64) -> Measurements {
        Measurements {
            algorithm: algorithm.to_string(),
            requests: 100,
            admitted,
            denied: 100 - admitted,
            max_in_window: (ratio * 100.0) as u64,
            max_in_window_ratio: ratio,
            delay_mean_us: None,
            delay_max_us: None,
            state_bytes_per_key: 16,
            wrongly_admitted: 0,
            wrongly_denied: 0,
            wrongly_admitted_pct: 0.0,
            wrongly_denied_pct: 0.0,
            clients: None,
        }
    }

    fn scenario_of(name: &str, rows: Vec<Measurements>) -> ScenarioReport {
        ScenarioReport {
            name: name.to_string(),
            description: format!("{name} traffic"),
            chart: None,
            rows,
        }
    }

    /// The summary comes first, then the scenarios that separate the
    /// algorithms (the most separating first), then those where they agree;
    /// every table has its legend.
    #[test]
    fn the_page_leads_with_the_summary_and_the_separating_scenarios() {
        let report = Report {
            limit: 100,
            window_us: 10_000_000,
            burst: 100,
            duration_us: 60_000_000,
            seed: 1,
            backend: None,
            backend_chart: None,
            scenarios: vec![
                scenario_of(
                    "same",
                    vec![row("fixed_window", 50, 0.5), row("sliding_log", 50, 0.5)],
                ),
                scenario_of(
                    "a_little",
                    vec![row("fixed_window", 80, 1.0), row("sliding_log", 70, 1.0)],
                ),
                scenario_of(
                    "boundary_burst",
                    vec![row("fixed_window", 100, 2.0), row("sliding_log", 50, 1.0)],
                ),
            ],
        };
        let html = to_html(&report, "spillway simulate");
        let at = |needle: &str| html.find(needle).unwrap_or_else(|| panic!("{needle}"));
        assert!(at("At a glance") < at("Which to pick"));
        assert!(at("Which to pick") < at("id=\"boundary_burst\""));
        assert!(at("id=\"boundary_burst\"") < at("id=\"a_little\""));
        assert!(at("id=\"a_little\"") < at("Where they agree"));
        assert!(at("Where they agree") < at("id=\"same\""));
        assert_eq!(html.matches("class=\"legend\"").count(), 1 + 3);
        // The summary's worst burst and boundary figures are this run's.
        assert!(html.contains("200 (2.00x, boundary_burst)"), "{html}");
        assert!(html.contains("admitted 2.00x of L in one W here"), "{html}");
    }
}

//! `spillway simulate`: run, measure, print, and write the charts.

use std::fs;
use std::io::{BufReader, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use spillway::clock::Micros;

use crate::chart::{self, Panel};
use crate::contender::AlgorithmKind;
use crate::error::SimError;
use crate::measure::{Measurements, measure};
use crate::report::{Report, ScenarioReport};
use crate::run::{Run, run};
use crate::scenario::{Params, Scenario, ScenarioKind};
use crate::trace::read_trace;

/// What to simulate and where the results go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// The quota, burst, duration and seed.
    pub params: Params,
    /// The built-in scenarios to run.
    pub scenarios: Vec<ScenarioKind>,
    /// A CSV trace to replay as one more scenario (see [`crate::trace`]).
    pub trace: Option<PathBuf>,
    /// The algorithms to compare.
    pub algorithms: Vec<AlgorithmKind>,
    /// Where to write one SVG per scenario and `index.html`, if anywhere.
    pub out: Option<PathBuf>,
    /// Print JSON instead of the table.
    pub json: bool,
    /// Also run the slow backend behind three front doors
    /// ([`crate::backend`]), with the duration and seed of `params`.
    pub backend: bool,
    /// The command line, shown in index.html as what generated it.
    pub command: String,
}

impl Default for Options {
    /// Every scenario and algorithm with [`Params::default`], table only.
    fn default() -> Self {
        Self {
            params: Params::default(),
            scenarios: ScenarioKind::ALL.to_vec(),
            trace: None,
            algorithms: AlgorithmKind::ALL.to_vec(),
            out: None,
            json: false,
            backend: false,
            command: "spillway simulate".to_owned(),
        }
    }
}

/// One algorithm's run of a scenario and its measurements.
#[derive(Debug, Clone)]
pub struct AlgorithmRun {
    /// Which algorithm.
    pub kind: AlgorithmKind,
    /// Every request and decision.
    pub outcome: Run,
    /// What was measured on them.
    pub metrics: Measurements,
}

/// One scenario run through every algorithm.
#[derive(Debug, Clone)]
pub struct ScenarioRun {
    /// The traffic.
    pub scenario: Scenario,
    /// One run per algorithm, in the order asked for.
    pub runs: Vec<AlgorithmRun>,
}

impl ScenarioRun {
    /// The run of `kind`, if it was asked for.
    pub fn get(&self, kind: AlgorithmKind) -> Option<&AlgorithmRun> {
        self.runs.iter().find(|r| r.kind == kind)
    }
}

/// Runs `scenario` through each of `kinds`, configured from `params`.
///
/// ```
/// use spillway_sim::{AlgorithmKind, run_scenario};
/// use spillway_sim::scenario::{Params, ScenarioKind};
///
/// let p = Params::default();
/// let burst = ScenarioKind::BoundaryBurst.build(&p);
/// let result = run_scenario(&burst, &AlgorithmKind::ALL, &p).unwrap();
/// let most = |k| result.get(k).unwrap().metrics.max_in_window;
/// assert_eq!(most(AlgorithmKind::FixedWindow), 200);
/// assert_eq!(most(AlgorithmKind::SlidingLog), 100);
/// ```
pub fn run_scenario(
    scenario: &Scenario,
    kinds: &[AlgorithmKind],
    params: &Params,
) -> Result<ScenarioRun, SimError> {
    let quota = params.quota()?;
    let runs = kinds
        .iter()
        .map(|&kind| {
            let algorithm = kind.build(quota, params.burst);
            let outcome = run(scenario, &algorithm)?;
            let metrics = measure(kind.name(), &algorithm, scenario, &outcome);
            Ok(AlgorithmRun {
                kind,
                outcome,
                metrics,
            })
        })
        .collect::<Result<_, SimError>>()?;
    Ok(ScenarioRun {
        scenario: scenario.clone(),
        runs,
    })
}

/// The scenarios `options` asks for: the built-ins in order, then the trace.
/// Fails on an invalid quota (checked first: a zero window would make no
/// sense of any scenario) and on an unreadable trace.
pub fn scenarios(options: &Options) -> Result<Vec<Scenario>, SimError> {
    options.params.quota()?;
    let mut scenarios: Vec<Scenario> = options
        .scenarios
        .iter()
        .map(|k| k.build(&options.params))
        .collect();
    if let Some(path) = &options.trace {
        let trace_err = |source| SimError::Trace {
            path: path.clone(),
            source,
        };
        let file = fs::File::open(path).map_err(|e| trace_err(e.into()))?;
        scenarios.push(read_trace(BufReader::new(file)).map_err(trace_err)?);
    }
    Ok(scenarios)
}

/// The chart of one scenario run, as SVG text.
pub fn scenario_chart(run: &ScenarioRun, params: &Params) -> Result<String, SimError> {
    let panels: Vec<Panel<'_>> = run
        .runs
        .iter()
        .map(|a| Panel {
            name: a.kind.name(),
            outcome: &a.outcome,
            by_departure: a.kind == AlgorithmKind::LeakyShape,
            max_in_window: a.metrics.max_in_window,
        })
        .collect();
    chart::render(
        &run.scenario,
        &panels,
        u64::from(params.limit.get()),
        params.window,
    )
}

/// The whole command: runs the scenarios, prints the table (or JSON) to
/// `stdout`, and writes a chart per scenario and index.html when
/// `options.out` is set. Returns the report.
///
/// One scenario is run (through every algorithm) and charted at a time, so
/// only one scenario's decisions are held in memory.
pub fn simulate(options: &Options, stdout: &mut dyn Write) -> Result<Report, SimError> {
    let to_stdout = |source| SimError::Write {
        path: PathBuf::from("-"),
        source,
    };
    let scenarios = scenarios(options)?;
    if let Some(dir) = &options.out {
        fs::create_dir_all(dir).map_err(|source| SimError::Write {
            path: dir.to_owned(),
            source,
        })?;
    }
    let mut report = Report::new(&options.params);
    let (mut simulating, mut decisions) = (Duration::ZERO, 0);
    for scenario in &scenarios {
        let started = Instant::now();
        let run = run_scenario(scenario, &options.algorithms, &options.params)?;
        simulating += started.elapsed();
        decisions += run
            .runs
            .iter()
            .map(|a| a.outcome.requests.len())
            .sum::<usize>();
        let chart_file = match &options.out {
            Some(dir) => {
                let name = format!("{}.svg", scenario.name);
                write_file(dir.join(&name), &scenario_chart(&run, &options.params)?)?;
                Some(name)
            }
            None => None,
        };
        report.scenarios.push(ScenarioReport {
            name: scenario.name.clone(),
            description: scenario.description.clone(),
            chart: chart_file,
            rows: run.runs.into_iter().map(|a| a.metrics).collect(),
        });
    }
    if options.backend {
        let params = crate::backend::BackendParams {
            duration_us: options.params.duration,
            seed: options.params.seed,
            ..crate::backend::BackendParams::default()
        };
        let run = crate::backend::run_backend(&params)?;
        if let Some(dir) = &options.out {
            write_file(
                dir.join("slow-backend.svg"),
                &crate::backend::backend_chart(&run)?,
            )?;
            report.backend_chart = Some("slow-backend.svg".into());
        }
        report.backend = Some(run);
    }
    if let Some(dir) = &options.out {
        write_file(dir.join("index.html"), &report.to_html(&options.command))?;
    }
    if options.json {
        serde_json::to_writer_pretty(&mut *stdout, &report).map_err(|e| to_stdout(e.into()))?;
        writeln!(stdout).map_err(to_stdout)?;
        return Ok(report);
    }
    write!(stdout, "{report}").map_err(to_stdout)?;
    writeln!(
        stdout,
        "\nsimulated {decisions} decisions ({} scenario(s) x {} algorithm(s)) in {:.1} ms",
        scenarios.len(),
        options.algorithms.len(),
        simulating.as_secs_f64() * 1e3
    )
    .map_err(to_stdout)?;
    if let Some(dir) = &options.out {
        writeln!(
            stdout,
            "wrote {} chart(s) and index.html to {}",
            scenarios.len() + usize::from(options.backend),
            dir.display()
        )
        .map_err(to_stdout)?;
    }
    Ok(report)
}

fn write_file(path: PathBuf, text: &str) -> Result<(), SimError> {
    fs::write(&path, text).map_err(|source| SimError::Write { path, source })
}

/// Parses a duration with a unit: `250us`, `100ms`, `10s`, `1m` (or
/// `1min`), `2h`. Whole numbers only; the result is in µs.
///
/// ```
/// use spillway_sim::parse_duration;
/// assert_eq!(parse_duration("10s"), Ok(10_000_000));
/// assert_eq!(parse_duration("1min"), Ok(60_000_000));
/// assert!(parse_duration("10").unwrap_err().contains("unit"));
/// ```
pub fn parse_duration(s: &str) -> Result<Micros, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number followed by a unit"))?;
    let scale: u64 = match unit.trim() {
        "us" | "µs" => 1,
        "ms" => 1_000,
        "s" => 1_000_000,
        "m" | "min" => 60_000_000,
        "h" => 3_600_000_000,
        "" => return Err(format!("`{s}` needs a unit: us, ms, s, m or h")),
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{s}`: use us, ms, s, m or h"
            ));
        }
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("`{s}` is too long"))
}

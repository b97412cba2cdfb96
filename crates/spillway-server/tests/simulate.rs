//! `spillway simulate` end to end: the built binary, run as a user would.

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Output};

const ALGORITHMS: [&str; 6] = [
    "fixed_window",
    "sliding_log",
    "sliding_window",
    "token_bucket",
    "leaky_bucket_shape",
    "leaky_bucket_police",
];

const SCENARIOS: [&str; 8] = [
    "steady_below",
    "steady_at",
    "steady_above",
    "bursty",
    "boundary_burst",
    "poisson",
    "hammer",
    "shared_key",
];

fn spillway(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = fs::remove_dir_all(&dir);
    dir
}

#[test]
fn simulate_prints_the_table_and_writes_charts_and_index() {
    let out = temp_dir("simulate-all");
    let run = spillway(&[
        "simulate",
        "--duration",
        "30s",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    for algorithm in ALGORITHMS {
        // Once per scenario's block.
        let rows = stdout
            .lines()
            .filter(|l| l.starts_with(&format!("  {algorithm} ")))
            .count();
        assert_eq!(rows, SCENARIOS.len(), "{algorithm} in\n{stdout}");
    }
    for column in [
        "admitted",
        "denied",
        "max in any W",
        "state B/key",
        "wrongly admitted",
    ] {
        assert!(stdout.contains(column), "{column} in\n{stdout}");
    }
    let index = fs::read_to_string(out.join("index.html")).unwrap();
    for scenario in SCENARIOS {
        let svg = fs::read_to_string(out.join(format!("{scenario}.svg"))).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("limit L"),
            "{scenario}"
        );
        assert!(
            index.contains(&format!("src=\"{scenario}.svg\"")),
            "{scenario}"
        );
    }
    assert!(index.contains("<td>leaky_bucket_police</td>"));
}

#[test]
fn simulate_json_selects_scenarios_and_algorithms() {
    let run = spillway(&[
        "simulate",
        "--scenario",
        "boundary_burst",
        "--algorithm",
        "fixed_window,sliding_log",
        "--limit",
        "10",
        "--window",
        "1s",
        "--json",
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let json = String::from_utf8(run.stdout).unwrap();
    assert!(json.trim_start().starts_with('{'), "{json}");
    assert_eq!(json.matches("\"algorithm\"").count(), 2, "{json}");
    assert!(json.contains("\"name\": \"boundary_burst\""), "{json}");
    // The fixed window's boundary burst: 2 x 10 within one window.
    assert!(json.contains("\"max_in_window\": 20"), "{json}");
    assert!(json.contains("\"max_in_window\": 10"), "{json}");
}

#[test]
fn simulate_reports_a_bad_trace_row_by_line_and_fails() {
    let dir = temp_dir("simulate-trace");
    fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("bad.csv");
    fs::write(&trace, "timestamp,key,cost\n1,a,1\n2,a\n").unwrap();
    let run = spillway(&["simulate", "--trace", trace.to_str().unwrap()]);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("line 3: expected 3 fields"), "{stderr}");
}

#[test]
fn simulate_rejects_unknown_names_and_bad_durations() {
    let run = spillway(&["simulate", "--algorithm", "nope"]);
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("unknown algorithm `nope`"));
    let run = spillway(&["simulate", "--window", "10"]);
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("needs a unit"));
    let run = spillway(&["simulate", "--window", "0s"]);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("invalid quota: `period`"), "{stderr}");
}

#[test]
fn simulate_backend_sets_a_concurrency_limit_beside_a_rate_limit_on_a_slow_backend() {
    let run = spillway(&[
        "simulate",
        "--scenario",
        "steady_at",
        "--algorithm",
        "token_bucket",
        "--backend",
        "--json",
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).expect("JSON");
    let doors = report["backend"]["doors"].as_array().expect("doors");
    let names: Vec<&str> = doors.iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["no limit", "rate limit", "concurrency limit"]);
    let most = |i: usize| doors[i]["max_in_flight"].as_u64().unwrap();
    let workers = report["backend"]["params"]["workers"].as_u64().unwrap();
    assert!(most(2) <= workers && most(1) > workers, "{doors:?}");
    // Without the flag, no backend.
    let plain = spillway(&["simulate", "--scenario", "steady_at", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&plain.stdout).expect("JSON");
    assert!(report.get("backend").is_none());
}

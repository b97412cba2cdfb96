//! Replaying a trace file through the whole command.

use std::fs;
use std::path::PathBuf;

use spillway_sim::{AlgorithmKind, Options, SimError, simulate};

fn write(name: &str, text: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("spillway-sim-trace");
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    fs::write(&path, text).unwrap();
    path
}

fn options(trace: PathBuf) -> Options {
    Options {
        scenarios: Vec::new(),
        trace: Some(trace),
        ..Options::default()
    }
}

#[test]
fn a_bad_row_is_reported_with_the_file_and_its_line() {
    let path = write(
        "bad.csv",
        "timestamp,key,cost\n1000,alice,1\n2000,bob,1\n3000,carol,one\n",
    );
    let err = simulate(&options(path.clone()), &mut Vec::new()).unwrap_err();
    let SimError::Trace { source, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(source.line(), Some(4));
    let message = err.to_string();
    assert!(message.contains("bad.csv"), "{message}");
    assert!(message.contains("line 4: cost `one`"), "{message}");
}

#[test]
fn a_good_trace_is_replayed_as_the_trace_scenario() {
    // 30 requests from one key within 300 ms, then another key.
    let mut csv = String::from("timestamp,key,cost\n");
    for i in 0..30 {
        csv.push_str(&format!(
            "{},alice,1\n",
            1_700_000_000_000_000u64 + i * 10_000
        ));
    }
    csv.push_str("1700000000500000,bob,2\n");
    let mut out = Vec::new();
    let report = simulate(&options(write("good.csv", &csv)), &mut out).unwrap();
    assert_eq!(report.scenarios.len(), 1);
    let trace = &report.scenarios[0];
    assert_eq!(trace.name, "trace");
    assert_eq!(trace.rows.len(), AlgorithmKind::ALL.len());
    for row in &trace.rows {
        // 31 requests, all within a window of 10 s: the limit of 100 holds.
        assert_eq!((row.requests, row.admitted), (31, 31), "{}", row.algorithm);
    }
    let table = String::from_utf8(out).unwrap();
    assert!(
        table.contains("trace: replay of a trace: 31 requests on 2 keys"),
        "{table}"
    );
}

#[test]
fn a_missing_trace_file_is_an_error_naming_it() {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("no-such-trace.csv");
    let err = simulate(&options(path), &mut Vec::new()).unwrap_err();
    assert!(err.to_string().contains("no-such-trace.csv"), "{err}");
}

#[test]
fn a_cost_above_the_capacity_names_the_request() {
    let path = write("too_big.csv", "5,alice,1\n6,alice,101\n");
    let err = simulate(&options(path), &mut Vec::new()).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("`alice`") && message.contains("101"),
        "{message}"
    );
}

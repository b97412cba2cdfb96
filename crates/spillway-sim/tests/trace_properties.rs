//! The trace reader over arbitrary text (issue 17, item 8): a trace file is
//! whatever the user hands `spillway simulate --trace`, so any text either
//! replays, table and chart included, or is refused with an error that
//! names its line; never a panic, and never slower than a bound.
//!
//! The cases are arbitrary text, traces valid by construction (timestamps
//! at the end of time and costs up to the burst included), and valid traces
//! mutated (`spillway_conformance::hostile`). CI runs 256 of each;
//! `PROPTEST_CASES=20000 cargo test -p spillway-sim --test
//! trace_properties` runs that many.

use std::time::Duration;

use proptest::prelude::*;
use spillway_conformance::hostile::{config, mutation, within};
use spillway_sim::measure::max_in_window;
use spillway_sim::scenario::{Params, Traffic};
use spillway_sim::trace::{parse_trace, read_trace};
use spillway_sim::{AlgorithmKind, SimError, parse_duration, run_scenario, scenario_chart};

/// The most one case may take, parsing, running the five algorithms and
/// drawing the chart: a valid trace of 40 rows takes about a millisecond.
const BOUND: Duration = Duration::from_secs(10);

/// Why the simulator refused a trace.
#[derive(Debug)]
enum Refused {
    Trace(String, Option<usize>),
    Sim(SimError),
}

/// What the simulator makes of `text`: parsed, run through every
/// algorithm, measured and charted, within [`BOUND`]. `Ok` is the number
/// of rows replayed; `Err` the error, checked to say what is wrong.
fn simulate(text: String) -> Result<usize, String> {
    let lines = text.lines().count().max(1);
    let shown = format!("{text:?}");
    let outcome = within(BOUND, move || {
        let scenario = parse_trace(&text).map_err(|e| Refused::Trace(e.to_string(), e.line()))?;
        let p = Params::default();
        let run = run_scenario(&scenario, &AlgorithmKind::ALL, &p).map_err(Refused::Sim)?;
        scenario_chart(&run, &p).map_err(Refused::Sim)?;
        let Traffic::Fixed(requests) = &scenario.traffic else {
            unreachable!("a trace is fixed traffic")
        };
        Ok(requests.len())
    })
    .unwrap_or_else(|e| panic!("{e:?} for {shown}"));
    match outcome {
        Ok(rows) => Ok(rows),
        // The one error without a line.
        Err(Refused::Trace(message, None)) => {
            assert_eq!(message, "no requests in the trace", "for {shown}");
            Err(message)
        }
        Err(Refused::Trace(message, Some(line))) => {
            assert!(
                message.starts_with(&format!("line {line}: ")) && line <= lines,
                "{message} (of {lines} lines) for {shown}"
            );
            Err(message)
        }
        // The one refusal of a parsed trace: a cost no algorithm of this
        // quota could ever admit, named with its key.
        Err(Refused::Sim(e)) => {
            assert!(
                matches!(e, SimError::CostTooLarge { .. }),
                "{e} for {shown}"
            );
            Err(e.to_string())
        }
    }
}

/// A timestamp: small, or at the end of time.
fn timestamp() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..100_000_000u64,
        Just(u64::MAX),
        (u64::MAX - 100_000_000)..=u64::MAX,
        any::<u64>(),
    ]
}

/// A valid row: a timestamp, a key and a cost up to the default burst
/// (100), which every algorithm can admit.
fn row() -> impl Strategy<Value = String> {
    (timestamp(), "[a-z0-9.:_ -]{0,6}[a-z]", 0..=100u64)
        .prop_map(|(at, key, cost)| format!("{at},{key},{cost}"))
}

/// A valid trace: an optional header, comments, blank lines and rows; and
/// how many rows.
fn trace() -> impl Strategy<Value = (String, usize)> {
    (
        any::<bool>(),
        proptest::collection::vec(
            prop_oneof![
                8 => row().prop_map(Some),
                1 => Just(None),
            ],
            1..40,
        ),
    )
        .prop_map(|(header, lines)| {
            let mut text = String::new();
            if header {
                text.push_str("timestamp,key,cost\n");
            }
            let mut rows = 0;
            for line in lines {
                match line {
                    Some(row) => {
                        text.push_str(&row);
                        rows += 1;
                    }
                    None => text.push_str("# a comment, with commas"),
                }
                text.push('\n');
            }
            (text, rows)
        })
}

/// Pieces of trace syntax, and numbers at and past their limits.
const PIECES: &[&[u8]] = &[
    b",",
    b"\n",
    b"\r\n",
    b"#",
    b" ",
    b"-",
    b"0",
    b"18446744073709551615",
    b"18446744073709551616",
    b"1e3",
    b"timestamp,key,cost",
    b"\0",
    "\u{feff}".as_bytes(),
    b",,",
];

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn any_text_replays_or_names_its_line(text in "(?s).{0,200}") {
        let _ = simulate(text);
    }

    /// A trace file is bytes: one that is not UTF-8 names the line.
    #[test]
    fn any_bytes_read_or_name_their_line(
        text in "[0-9a-z,\n]{0,60}",
        bytes in proptest::collection::vec(any::<u8>(), 0..20),
        at in any::<usize>(),
    ) {
        let mut file = text.into_bytes();
        let at = at % (file.len() + 1);
        file.splice(at..at, bytes);
        let lines = file.split(|&b| b == b'\n').count();
        if let Err(e) = read_trace(&file[..]) {
            let shown = String::from_utf8_lossy(&file);
            match e.line() {
                Some(line) => prop_assert!(line <= lines, "{} for {:?}", e, shown),
                None => prop_assert_eq!(e.to_string(), "no requests in the trace", "{:?}", shown),
            }
        }
    }

    #[test]
    fn text_of_trace_characters_replays_or_names_its_line(
        text in "[0-9a-z,# \n\r-]{0,300}"
    ) {
        let _ = simulate(text);
    }

    #[test]
    fn a_valid_trace_replays_every_row((text, rows) in trace()) {
        match simulate(text) {
            Ok(replayed) => prop_assert_eq!(replayed, rows),
            // Only a trace of comments may be refused.
            Err(e) => prop_assert_eq!(rows, 0, "{}", e),
        }
    }

    #[test]
    fn a_mutated_trace_replays_or_names_its_line(
        (text, _) in trace(),
        mutations in proptest::collection::vec(mutation(PIECES), 1..5),
    ) {
        let bytes = spillway_conformance::hostile::apply(text.as_bytes(), &mutations);
        // A trace is read as text: an overwritten byte may not be UTF-8.
        let _ = simulate(String::from_utf8_lossy(&bytes).into_owned());
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// The command's own text arguments (`--window`, `--duration`,
    /// `--algorithms`): a value or an error that quotes them.
    #[test]
    fn any_duration_or_algorithm_list_is_one_or_an_error(text in "(?s).{0,40}") {
        if let Err(e) = parse_duration(&text) {
            prop_assert!(e.contains(text.trim()), "{}", e);
        }
        if let Err(e) = AlgorithmKind::parse_list(&text) {
            prop_assert!(!e.is_empty());
        }
    }

    #[test]
    fn a_valid_duration_reads_back(n in 0..1_000_000u64, unit in 0..5usize) {
        let (name, scale) = [("us", 1), ("ms", 1_000), ("s", 1_000_000), ("m", 60_000_000), ("h", 3_600_000_000)][unit];
        prop_assert_eq!(parse_duration(&format!("{n}{name}")), Ok(n * scale));
    }
}

/// What proptest found, kept with the exact input: a row at the end of
/// time (u64::MAX µs) panicked twice. The measure's window walk saturated
/// `ts + W` to u64::MAX and so dropped the row it had just added (index
/// out of bounds), and the chart's span was `start + 1` (overflow).
#[test]
fn a_trace_at_the_end_of_time_replays() {
    assert_eq!(simulate("18446744073709551615,a,1\n".into()), Ok(1));
    assert_eq!(
        simulate("18446744073709551615,i,85\n18446744073709551614,j,10\n".into()),
        Ok(2)
    );
    assert_eq!(max_in_window(&[(u64::MAX, 1)], 10), 1);
    assert_eq!(max_in_window(&[(u64::MAX - 5, 2), (u64::MAX, 1)], 10), 3);
}

/// Found while writing the byte property: a trace file with a byte that
/// is not UTF-8 was "stream did not contain valid UTF-8", without a line.
#[test]
fn a_byte_that_is_not_utf8_names_its_line() {
    let e = read_trace(&b"1,a,1\n2,b\xff,1\n"[..]).unwrap_err();
    assert_eq!(e.to_string(), "line 2: the line is not UTF-8 text");
}

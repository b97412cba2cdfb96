//! Replaying your own traffic: a CSV trace of `timestamp,key,cost`.
//!
//! - `timestamp`: when the request arrived, in whole **microseconds** (on
//!   any scale: since the Unix epoch keeps fixed windows aligned as they
//!   would be in production; from 0 works too).
//! - `key`: what the limit is counted on (a client id, an address); any text
//!   without a comma, surrounding spaces trimmed.
//! - `cost`: a whole number, usually 1.
//!
//! A first line `timestamp,key,cost` is taken as a header; blank lines and
//! lines starting with `#` are skipped. Rows may come in any order: they are
//! replayed in timestamp order (rows with the same timestamp in file order).
//! A bad row stops the reading with its line number (1-based).
//!
//! ```
//! use spillway_sim::trace::parse_trace;
//!
//! let s = parse_trace("timestamp,key,cost\n1000,alice,1\n500,bob,2\n").unwrap();
//! assert_eq!(s.keys, ["alice", "bob"]);
//! assert_eq!((s.start, s.end), (500, 1001));
//!
//! let err = parse_trace("timestamp,key,cost\n1000,alice,1\n1500,bob,lots\n").unwrap_err();
//! assert_eq!(err.to_string(), "line 3: cost `lots` is not a whole number");
//! ```

use std::collections::HashMap;
use std::io::BufRead;

use crate::scenario::{Request, Scenario, Traffic};

pub use crate::error::TraceError;

/// Reads a trace from `text`; see the [module docs](self) for the format.
pub fn parse_trace(text: &str) -> Result<Scenario, TraceError> {
    read_trace(text.as_bytes())
}

/// Reads a trace line by line; see the [module docs](self) for the format.
/// The scenario is named `trace`, with one client per key.
pub fn read_trace(reader: impl BufRead) -> Result<Scenario, TraceError> {
    let mut keys: Vec<String> = Vec::new();
    let mut ids: HashMap<String, u32> = HashMap::new();
    let mut requests = Vec::new();
    let mut seen_row = false;
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|e| match e.kind() {
            // A byte that is not UTF-8: where it is.
            std::io::ErrorKind::InvalidData => TraceError::Row {
                line: line_no,
                message: "the line is not UTF-8 text".into(),
            },
            _ => e.into(),
        })?;
        let row = line.trim();
        if row.is_empty() || row.starts_with('#') {
            continue;
        }
        let first = !seen_row;
        seen_row = true;
        if first && is_header(row) {
            continue;
        }
        let bad = |message: String| TraceError::Row {
            line: line_no,
            message,
        };
        let fields: Vec<&str> = row.split(',').map(str::trim).collect();
        let [at, key, cost] = fields[..] else {
            return Err(bad(format!(
                "expected 3 fields `timestamp,key,cost`, found {}",
                fields.len()
            )));
        };
        let at: u64 = at.parse().map_err(|_| {
            bad(format!(
                "timestamp `{at}` is not a whole number of microseconds"
            ))
        })?;
        if key.is_empty() {
            return Err(bad("the key is empty".into()));
        }
        let cost: u64 = cost
            .parse()
            .map_err(|_| bad(format!("cost `{cost}` is not a whole number")))?;
        let id = match ids.get(key) {
            Some(&id) => id,
            None => {
                let id = u32::try_from(keys.len())
                    .map_err(|_| bad("more than 2^32 distinct keys".into()))?;
                ids.insert(key.to_owned(), id);
                keys.push(key.to_owned());
                id
            }
        };
        requests.push(Request {
            at,
            key: id,
            client: id,
            cost,
        });
    }
    // Stable: equal timestamps keep their order in the file.
    requests.sort_by_key(|r| r.at);
    let (Some(first), Some(last)) = (requests.first(), requests.last()) else {
        return Err(TraceError::Empty);
    };
    let (start, end) = (first.at, last.at.saturating_add(1));
    let clients = u32::try_from(keys.len()).unwrap_or(u32::MAX);
    Ok(Scenario {
        name: "trace".to_owned(),
        description: format!(
            "replay of a trace: {} requests on {} keys",
            requests.len(),
            keys.len()
        ),
        keys,
        clients,
        start,
        end,
        traffic: Traffic::Fixed(requests),
    })
}

fn is_header(row: &str) -> bool {
    let fields: Vec<String> = row
        .split(',')
        .map(|f| f.trim().to_ascii_lowercase())
        .collect();
    fields == ["timestamp", "key", "cost"]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requests(s: &Scenario) -> &[Request] {
        match &s.traffic {
            Traffic::Fixed(r) => r,
            Traffic::Hammer(_) => unreachable!(),
        }
    }

    #[test]
    fn header_comments_and_blank_lines_are_optional() {
        let with = parse_trace("# from the gateway\ntimestamp,key,cost\n\n5,a,1\n").unwrap();
        let without = parse_trace("5,a,1").unwrap();
        assert_eq!(requests(&with), requests(&without));
    }

    #[test]
    fn rows_are_replayed_in_time_order_ties_in_file_order() {
        let s = parse_trace("20,a,1\n10,b,1\n10,c,3\n").unwrap();
        let order: Vec<_> = requests(&s)
            .iter()
            .map(|r| (r.at, s.keys[r.key as usize].as_str(), r.cost))
            .collect();
        assert_eq!(order, [(10, "b", 1), (10, "c", 3), (20, "a", 1)]);
        assert_eq!(s.clients, 3);
    }

    #[test]
    fn each_kind_of_bad_row_names_its_line() {
        let cases = [
            ("1,a,1\n2,b\n", 2, "expected 3 fields"),
            ("1,a,1\n\n-3,b,1\n", 3, "timestamp `-3`"),
            ("1.5,a,1\n", 1, "timestamp `1.5`"),
            ("timestamp,key,cost\n1, ,1\n", 2, "key is empty"),
            ("1,a,1,extra\n", 1, "found 4"),
            ("1,a,\n", 1, "cost ``"),
        ];
        for (text, line, needle) in cases {
            let err = parse_trace(text).unwrap_err();
            assert_eq!(err.line(), Some(line), "{text:?}: {err}");
            assert!(err.to_string().contains(needle), "{text:?}: {err}");
        }
    }

    #[test]
    fn a_header_later_in_the_file_is_a_bad_row() {
        let err = parse_trace("1,a,1\ntimestamp,key,cost\n").unwrap_err();
        assert_eq!(err.line(), Some(2));
    }

    #[test]
    fn an_empty_trace_is_an_error() {
        assert!(matches!(
            parse_trace("timestamp,key,cost\n"),
            Err(TraceError::Empty)
        ));
    }
}

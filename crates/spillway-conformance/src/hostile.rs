//! Hostile input for the property tests of every parser of untrusted bytes
//! (issue 17, item 8): valid inputs mutated so that the cases reach deep
//! into a parser rather than stop at its first byte check, a bound on each
//! case's time, and the case count, raised by `PROPTEST_CASES` for a long
//! run.
//!
//! ```
//! use proptest::prelude::*;
//! use proptest::strategy::ValueTree;
//! use proptest::test_runner::TestRunner;
//! use spillway_conformance::hostile::{Mutation, apply, mutated};
//!
//! // Overwrite the second byte, then repeat the first two.
//! let out = apply(b"abc", &[Mutation::Set(1, b'X'), Mutation::Duplicate(0, 2)]);
//! assert_eq!(out, b"aXaXc");
//!
//! // Mutations of two valid inputs, with pieces of their syntax inserted.
//! let strategy = mutated(&[b"a = 1\n", b"[t]\n"], &[b"=", b"\""]);
//! let mut runner = TestRunner::deterministic();
//! let case = strategy.new_tree(&mut runner).unwrap().current();
//! assert!(case.len() < 200);
//! ```

use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::Config;

/// The cases per property: `PROPTEST_CASES` if it is set, else `default`
/// (what CI runs, small enough to keep the suite short).
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// A proptest configuration of [`cases`]`(default)` cases, whose
/// shrinking stops after a minute: a case that hangs takes its whole
/// bound each time it is shrunk.
pub fn config(default: u32) -> Config {
    Config {
        cases: cases(default),
        max_shrink_time: 60_000,
        ..Config::default()
    }
}

/// One change to a valid input. Positions are taken modulo the input's
/// length (plus one where the end is a position too), so any `usize` is a
/// valid one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mutation {
    /// Overwrite the byte at this position.
    Set(usize, u8),
    /// Flip one bit (`.1 % 8`) of the byte at this position.
    Flip(usize, u8),
    /// Cut the input here.
    Truncate(usize),
    /// Insert these bytes here.
    Insert(usize, Vec<u8>),
    /// Repeat the slice (start, length) in place.
    Duplicate(usize, usize),
    /// Remove the slice (start, length).
    Remove(usize, usize),
}

/// `input` with `mutations` applied in order.
pub fn apply(input: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = input.to_vec();
    for m in mutations {
        let len = bytes.len();
        let gap = |i: usize| i % (len + 1);
        match m {
            Mutation::Set(i, b) if len > 0 => bytes[i % len] = *b,
            Mutation::Flip(i, bit) if len > 0 => bytes[i % len] ^= 1 << (bit % 8),
            Mutation::Set(..) | Mutation::Flip(..) => {}
            Mutation::Truncate(i) => bytes.truncate(gap(*i)),
            Mutation::Insert(i, piece) => {
                let i = gap(*i);
                bytes.splice(i..i, piece.iter().copied());
            }
            Mutation::Duplicate(i, n) => {
                let i = gap(*i);
                let copy = bytes[i..(i + n).min(len)].to_vec();
                bytes.splice(i..i, copy);
            }
            Mutation::Remove(i, n) => {
                let i = gap(*i);
                bytes.drain(i..(i + n).min(len));
            }
        }
    }
    bytes
}

/// Any one [`Mutation`]; what is inserted is one of `pieces` (the input's
/// own syntax: delimiters, keywords, numbers at their limits) or a few
/// arbitrary bytes.
pub fn mutation(pieces: &'static [&'static [u8]]) -> impl Strategy<Value = Mutation> {
    let insert = prop_oneof![
        proptest::sample::select(pieces).prop_map(<[u8]>::to_vec),
        proptest::collection::vec(any::<u8>(), 1..8),
    ];
    prop_oneof![
        3 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        3 => (any::<usize>(), insert).prop_map(|(i, p)| Mutation::Insert(i, p)),
        1 => (any::<usize>(), 1..64usize).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
        1 => (any::<usize>(), 1..32usize).prop_map(|(i, n)| Mutation::Remove(i, n)),
    ]
}

/// One of `seeds` (valid inputs), changed by one to four mutations.
pub fn mutated(
    seeds: &'static [&'static [u8]],
    pieces: &'static [&'static [u8]],
) -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::sample::select(seeds),
        proptest::collection::vec(mutation(pieces), 1..5),
    )
        .prop_map(|(seed, mutations)| apply(seed, &mutations))
}

/// Why a case bounded by [`within`] has no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unanswered {
    /// It panicked, with this message.
    Panicked(String),
    /// It took longer than the bound.
    Hung(Duration),
}

/// Runs `f` on a thread of its own and waits at most `bound` for its
/// result: a hang fails the case instead of the whole run (the thread is
/// left behind), and a panic is caught with its message.
pub fn within<T: Send + 'static>(
    bound: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Unanswered> {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
            panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string())
        });
        let _ = done.send(outcome);
    });
    match result.recv_timeout(bound) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(message)) => Err(Unanswered::Panicked(message)),
        Err(_) => Err(Unanswered::Hung(bound)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mutation_takes_any_position_even_of_an_empty_input() {
        let all = [
            Mutation::Set(usize::MAX, 0),
            Mutation::Flip(usize::MAX, 200),
            Mutation::Truncate(usize::MAX),
            Mutation::Insert(usize::MAX, b"x".to_vec()),
            Mutation::Duplicate(usize::MAX, 64),
            Mutation::Remove(usize::MAX, 64),
        ];
        for input in [&b""[..], b"a", b"abcdef"] {
            for m in &all {
                let _ = apply(input, std::slice::from_ref(m));
            }
        }
        assert_eq!(apply(b"abc", &[Mutation::Flip(0, 8 + 5)]), b"Abc");
        assert_eq!(apply(b"abc", &[Mutation::Truncate(1)]), b"a");
        assert_eq!(
            apply(b"abc", &[Mutation::Insert(3, b"!".to_vec())]),
            b"abc!"
        );
        assert_eq!(apply(b"abcd", &[Mutation::Remove(1, 2)]), b"ad");
    }

    #[test]
    fn within_tells_a_panic_and_a_hang_from_an_answer() {
        assert_eq!(within(Duration::from_secs(5), || 7), Ok(7));
        assert_eq!(
            within(Duration::from_secs(5), || -> u8 { panic!("no {}", "way") }),
            Err(Unanswered::Panicked("no way".into()))
        );
        // Blocked until `release` is dropped, after the bound.
        let (release, blocked) = mpsc::channel::<()>();
        let hang = Duration::from_millis(50);
        assert_eq!(
            within(hang, move || blocked.recv().is_err()),
            Err(Unanswered::Hung(hang))
        );
        drop(release);
    }
}

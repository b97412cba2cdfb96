//! The simulator's one error type.

use std::path::PathBuf;

use spillway::clock::Micros;
use spillway::{ConfigError, CostTooLarge};

/// Everything that can stop a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The quota is not valid (a zero or too long window, say).
    #[error("invalid quota: {0}")]
    Config(#[from] ConfigError),
    /// The trace file could not be read or has a bad row.
    #[error("trace {path}: {source}", path = .path.display())]
    Trace {
        /// The trace file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: TraceError,
    },
    /// A request costs more than the algorithm could ever admit.
    #[error("request at {at} µs for key `{key}`: {source}")]
    CostTooLarge {
        /// When it was sent.
        at: Micros,
        /// Its key.
        key: String,
        /// Its cost and the capacity.
        #[source]
        source: CostTooLarge,
    },
    /// Drawing a chart failed.
    #[error("drawing the chart of {scenario}: {message}")]
    Chart {
        /// The scenario whose chart it is.
        scenario: String,
        /// What plotters said.
        message: String,
    },
    /// Writing an output file, or the table, failed.
    #[error("writing {path}: {source}", path = .path.display())]
    Write {
        /// The file (`-` for standard output).
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The slow backend's simulation cannot run as asked.
    #[error("backend simulation: {0}")]
    Backend(String),
}

/// Why a trace cannot be replayed.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A row that is not `timestamp,key,cost`.
    #[error("line {line}: {message}")]
    Row {
        /// 1-based line number in the file.
        line: usize,
        /// What is wrong with the row.
        message: String,
    },
    /// The file has no rows.
    #[error("no requests in the trace")]
    Empty,
    /// Reading failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl TraceError {
    /// The line of the bad row, if the error is about one.
    pub fn line(&self) -> Option<usize> {
        match self {
            Self::Row { line, .. } => Some(*line),
            _ => None,
        }
    }
}

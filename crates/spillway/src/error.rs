//! The errors of the core crate.
//!
//! A denial is not an error: it is a [`Decision`](crate::Decision) with
//! `allowed == false`. These are the things that can never succeed.

use std::fmt;

/// A request whose cost exceeds the capacity of its limit: it could never be
/// admitted, so no `retry_after` would be true.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cost {cost} exceeds the capacity {capacity}: it can never be admitted")]
pub struct CostTooLarge {
    /// The cost that was asked for.
    pub cost: u64,
    /// The most any single request can cost under this limit.
    pub capacity: u64,
}

/// An invalid configuration value, naming the field it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    field: &'static str,
    message: &'static str,
}

impl ConfigError {
    /// An error about `field`.
    pub const fn new(field: &'static str, message: &'static str) -> Self {
        Self { field, message }
    }

    /// The name of the offending field.
    pub const fn field(&self) -> &'static str {
        self.field
    }

    /// What is wrong with it.
    pub const fn message(&self) -> &'static str {
        self.message
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` {}", self.field, self.message)
    }
}

/// Every error a store can return for a check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// One request of the batch can never be admitted.
    #[error("check {index}: {source}")]
    CostTooLarge {
        /// Which check of the batch.
        index: usize,
        /// The cost and the capacity.
        #[source]
        source: CostTooLarge,
    },
    /// A check names a rule the store does not have.
    #[error("check {index}: no rule with id {rule}")]
    UnknownRule {
        /// Which check of the batch.
        index: usize,
        /// The id it named.
        rule: usize,
    },
    /// A settle's id is empty or longer than
    /// [`MAX_SETTLE_ID`](crate::store::MAX_SETTLE_ID) bytes.
    #[error(
        "a settle id must be 1 to {} bytes, not {len}",
        crate::store::MAX_SETTLE_ID
    )]
    SettleId {
        /// The id's length in bytes.
        len: usize,
    },
    /// A renew names a rule that holds no leases (not a concurrency rule).
    #[error("renew {index}: rule {rule} is not a concurrency rule: it holds no leases")]
    NotALease {
        /// Which renew of the batch.
        index: usize,
        /// The rule it named.
        rule: usize,
    },
    /// An override cannot stand for its rule's quota
    /// ([`Override::fits`](crate::store::Override::fits)).
    #[error("rule `{rule}`: {reason}")]
    Override {
        /// The rule's name.
        rule: String,
        /// Why not.
        reason: String,
    },
}

//! Errors in setting up the middleware.

/// The policy and the store do not describe the same rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the store's rules do not match the policy's: expected {expected:?}, the store has {found:?}"
)]
pub struct RuleMismatch {
    /// The rule names the policy needs ([`Policy::store_rules`](crate::Policy::store_rules)).
    pub expected: Vec<String>,
    /// The rule names the store was built with.
    pub found: Vec<String>,
}

//! [`RateLimitLayer`]: applies a [`Policy`] on a [`Store`].

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use spillway::Decision;
use spillway::store::{MemoryOptions, MemoryStore, Store};
use tower_layer::Layer;

use crate::error::RuleMismatch;
use crate::rules::{Action, Policy};
use crate::service::{Decided, RateLimit};

/// What happened to one rule of one request, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The rule admitted the request.
    Allowed,
    /// The rule denied the request and it was answered 429.
    Rejected,
    /// The rule denied the request, which went through anyway (shadow mode).
    Shadowed,
    /// The rule denied the request, which went through marked as limited.
    Degraded,
    /// The store could not decide; the request got its failure answer.
    Error,
}

/// Called once per rule of every decided request.
pub trait Observer: Send + Sync + 'static {
    /// `rule` decided `outcome`; `decision` is the store's answer, when
    /// there was one.
    fn observe(&self, rule: &str, outcome: Outcome, decision: Option<&Decision>);
}

pub(crate) struct Shared<St> {
    pub store: St,
    pub policy: Policy,
    pub observer: Option<Arc<dyn Observer>>,
    // Whether a request without the client's address has been logged: an
    // error once per layer, not one per request.
    pub logged_missing_addr: AtomicBool,
}

/// Applies a [`Policy`]'s rules to every request, on a [`Store`]. Cheap to
/// clone: everything is behind one `Arc`.
///
/// ```
/// use std::num::NonZeroU32;
/// use axum::{Router, routing::get};
/// use spillway::Quota;
/// use spillway::algorithm::TokenBucket;
/// use spillway_tower::{HttpRule, Policy, RateLimitLayer};
///
/// let per_ip = HttpRule::new(
///     "per-ip",
///     TokenBucket::new(Quota::per_second(NonZeroU32::new(10).unwrap()), NonZeroU32::new(20).unwrap()),
/// );
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(RateLimitLayer::in_memory(Policy::new([per_ip])));
/// ```
pub struct RateLimitLayer<St> {
    shared: Arc<Shared<St>>,
}

impl RateLimitLayer<MemoryStore> {
    /// The policy on a fresh in-memory store (default options).
    pub fn in_memory(policy: Policy) -> Self {
        let store = MemoryStore::new(policy.store_rules(), MemoryOptions::default());
        Self::from_parts(policy, store)
    }
}

impl<St: Store> RateLimitLayer<St> {
    /// The policy on `store`, which must have been built with
    /// [`Policy::store_rules`], in that order. Rules of the store's after
    /// those are the caller's own: the layer never checks them.
    pub fn new(policy: Policy, store: St) -> Result<Self, RuleMismatch> {
        let expected: Vec<String> = policy
            .store_rules()
            .iter()
            .map(|r| r.name().to_string())
            .collect();
        let found: Vec<String> = store.rules().iter().map(|r| r.name().to_string()).collect();
        let same_algorithms = policy
            .store_rules()
            .iter()
            .zip(store.rules())
            .all(|(a, b)| a.algorithm() == b.algorithm());
        if !found.starts_with(&expected) || !same_algorithms {
            return Err(RuleMismatch { expected, found });
        }
        Ok(Self::from_parts(policy, store))
    }

    fn from_parts(policy: Policy, store: St) -> Self {
        Self {
            shared: Arc::new(Shared {
                store,
                policy,
                observer: None,
                logged_missing_addr: AtomicBool::new(false),
            }),
        }
    }

    /// Calls `observer` for every rule of every decided request.
    pub fn observer(self, observer: impl Observer) -> Self {
        let shared =
            Arc::into_inner(self.shared).expect("set the observer before cloning the layer");
        Self {
            shared: Arc::new(Shared {
                observer: Some(Arc::new(observer)),
                ..shared
            }),
        }
    }

    /// Applies the policy to a request (its head), charging the store as
    /// the verdict says, without serving it: what the middleware does before
    /// it calls the inner service, for callers that answer for themselves
    /// (a decision API). A shaping delay is reported, not waited for. A
    /// rule that counts by the client's address does not apply to parts
    /// without one ([`ClientAddr`](crate::ClientAddr)): the caller describes
    /// the request, and leaving the address out asks about the other rules
    /// ([`MissingClientAddr`](crate::MissingClientAddr) is the middleware's).
    pub async fn decide(&self, parts: &http::request::Parts) -> Decided {
        crate::service::decide(&self.shared, parts).await
    }

    /// The observer, for front ends that decide without the middleware (the
    /// Envoy rate limit service) but report the same way.
    pub fn observer_ref(&self) -> Option<&dyn Observer> {
        self.shared.observer.as_deref()
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.shared.store
    }

    /// This layer's policy and observer on another store, which must start
    /// with the policy's rules as for [`new`](Self::new): a store re-made
    /// with rules of the caller's own after them, say.
    pub fn on_store<S2: Store>(&self, store: S2) -> Result<RateLimitLayer<S2>, RuleMismatch> {
        let layer = RateLimitLayer::new(self.shared.policy.clone(), store)?;
        let shared = Arc::into_inner(layer.shared).expect("not cloned yet");
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                observer: self.shared.observer.clone(),
                ..shared
            }),
        })
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.shared.policy
    }
}

impl<St> Clone for RateLimitLayer<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St> fmt::Debug for RateLimitLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", &self.shared.policy)
            .finish_non_exhaustive()
    }
}

impl<S, St> Layer<S> for RateLimitLayer<St> {
    type Service = RateLimit<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, self.shared.clone())
    }
}

pub(crate) fn outcome_of(action: Action) -> Outcome {
    match action {
        Action::Reject => Outcome::Rejected,
        Action::Shadow => Outcome::Shadowed,
        Action::Degrade => Outcome::Degraded,
    }
}

//! [`RateLimitLayer`]: applies a [`Policy`] on a [`Store`].

use std::fmt;
use std::sync::Arc;

use spillway::store::{MemoryOptions, MemoryStore, Store};
use tower_layer::Layer;

use crate::engine::{Engine, Observer};
use crate::error::RuleMismatch;
use crate::rules::Policy;
use crate::service::RateLimit;

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
    engine: Arc<Engine<St>>,
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
        Engine::new(policy, store).map(Self::from_engine)
    }

    fn from_parts(policy: Policy, store: St) -> Self {
        Self::new(policy, store).expect("the store was made from the policy's rules")
    }

    /// The layer over `engine`.
    pub fn from_engine(engine: Engine<St>) -> Self {
        Self {
            engine: Arc::new(engine),
        }
    }

    /// Calls `observer` for every rule of every decided request.
    pub fn observer(self, observer: impl Observer) -> Self {
        let engine =
            Arc::into_inner(self.engine).expect("set the observer before cloning the layer");
        Self::from_engine(engine.observed(Some(Arc::new(observer))))
    }

    /// The engine that decides the layer's requests: for front ends that
    /// decide without serving (a decision API, the Envoy rate limit
    /// service) on the same policy, store and observer.
    pub fn engine(&self) -> &Arc<Engine<St>> {
        &self.engine
    }

    /// The store.
    pub fn store(&self) -> &St {
        self.engine.store()
    }

    /// This layer's policy and observer on another store, which must start
    /// with the policy's rules as for [`new`](Self::new): a store re-made
    /// with rules of the caller's own after them, say.
    pub fn on_store<S2: Store>(&self, store: S2) -> Result<RateLimitLayer<S2>, RuleMismatch> {
        let engine = Engine::new(self.engine.policy().clone(), store)?
            .observed(self.engine.observer().cloned());
        Ok(RateLimitLayer::from_engine(engine))
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        self.engine.policy()
    }
}

impl<St> Clone for RateLimitLayer<St> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
        }
    }
}

impl<St> fmt::Debug for RateLimitLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", self.engine.policy())
            .finish_non_exhaustive()
    }
}

impl<S, St> Layer<S> for RateLimitLayer<St> {
    type Service = RateLimit<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, self.engine.clone())
    }
}

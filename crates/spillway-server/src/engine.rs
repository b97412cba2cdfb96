//! The running configuration: the store, the middleware layer built on it,
//! and the swap that replaces them on reload without losing counters.

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, Store, Verdict};
use spillway_redis::{Error as StoreError, RedisOptions, RedisStore};
use spillway_tower::RateLimitLayer;

use crate::config::{Config, StoreKind};

/// Called with every store call's latency and outcome, for metrics.
pub trait StoreObserver: Send + Sync + 'static {
    /// A store call took `seconds`; `error` when it failed.
    fn store_call(&self, seconds: f64, error: Option<&StoreError>);
}

/// The configured store: in memory or Redis. Its errors are the Redis
/// store's (which wraps the core's).
#[derive(Clone)]
pub struct AnyStore {
    inner: StoreImpl,
    observer: Option<Arc<dyn StoreObserver>>,
}

#[derive(Clone)]
enum StoreImpl {
    Memory(Arc<MemoryStore>),
    Redis(RedisStore),
}

impl std::fmt::Debug for AnyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            StoreImpl::Memory(s) => s.fmt(f),
            StoreImpl::Redis(s) => s.fmt(f),
        }
    }
}

impl AnyStore {
    /// The in-memory store, if that is what this is.
    pub fn memory(&self) -> Option<&MemoryStore> {
        match &self.inner {
            StoreImpl::Memory(s) => Some(s),
            StoreImpl::Redis(_) => None,
        }
    }

    /// The Redis store, if that is what this is.
    pub fn redis(&self) -> Option<&RedisStore> {
        match &self.inner {
            StoreImpl::Redis(s) => Some(s),
            StoreImpl::Memory(_) => None,
        }
    }

    fn observe(&self, started: Instant, error: Option<&StoreError>) {
        if let Some(o) = &self.observer {
            o.store_call(started.elapsed().as_secs_f64(), error);
        }
    }
}

impl Store for AnyStore {
    type Error = StoreError;

    fn rules(&self) -> &[Rule] {
        match &self.inner {
            StoreImpl::Memory(s) => s.rules(),
            StoreImpl::Redis(s) => s.rules(),
        }
    }

    async fn check(&self, checks: &[Check<'_>]) -> Result<Verdict, StoreError> {
        let started = Instant::now();
        let result = match &self.inner {
            StoreImpl::Memory(s) => s.check_now(checks).map_err(StoreError::from),
            StoreImpl::Redis(s) => s.check(checks).await,
        };
        self.observe(started, result.as_ref().err());
        result
    }

    fn try_check_now(&self, checks: &[Check<'_>]) -> Option<Result<Verdict, StoreError>> {
        let StoreImpl::Memory(s) = &self.inner else {
            return None;
        };
        let started = Instant::now();
        let result = s.check_now(checks).map_err(StoreError::from);
        self.observe(started, result.as_ref().err());
        Some(result)
    }

    async fn refund(&self, checks: &[Check<'_>], charged_at: u64) -> Result<(), StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => s.refund_at(checks, charged_at).map_err(StoreError::from),
            StoreImpl::Redis(s) => s.refund(checks, charged_at).await,
        }
    }
}

/// One configuration, running: what a request is decided with.
#[derive(Debug)]
pub struct Engine {
    /// The configuration it was built from.
    pub config: Config,
    /// The middleware layer (its store is [`Engine::store`]).
    pub layer: RateLimitLayer<AnyStore>,
}

impl Engine {
    /// Builds the engine for `config`: connects to Redis if configured. When
    /// `previous` is given (a reload), the in-memory counters of unchanged
    /// rules carry over, and an unchanged Redis connection is reused.
    pub async fn build(
        config: Config,
        previous: Option<&Engine>,
        observer: Option<Arc<dyn StoreObserver>>,
    ) -> Result<Self, StoreError> {
        let rules = config.policy.store_rules();
        let inner = match (&config.store.kind, previous.map(|p| &p.store().inner)) {
            (StoreKind::Memory, Some(StoreImpl::Memory(old))) => {
                StoreImpl::Memory(Arc::new(old.reconfigure(rules)))
            }
            (StoreKind::Memory, _) => {
                let options = MemoryOptions {
                    max_keys: config.store.max_keys,
                    ..MemoryOptions::default()
                };
                StoreImpl::Memory(Arc::new(MemoryStore::new(rules, options)))
            }
            (StoreKind::Redis(topology), _) => {
                let options = RedisOptions {
                    timeout: config.store.timeout,
                    on_error: config.store.on_error,
                    ..RedisOptions::default()
                };
                StoreImpl::Redis(RedisStore::connect(topology.clone(), rules, options).await?)
            }
        };
        let store = AnyStore { inner, observer };
        let layer = RateLimitLayer::new(config.policy.clone(), store)
            .expect("the store was built from the policy's rules");
        Ok(Self { config, layer })
    }

    /// The store.
    pub fn store(&self) -> &AnyStore {
        self.layer.store()
    }
}

/// The engine in use, replaced whole on reload: requests in flight finish
/// on the engine they started with.
#[derive(Debug)]
pub struct Shared {
    engine: ArcSwap<Engine>,
}

impl Shared {
    /// Starts with `engine`.
    pub fn new(engine: Engine) -> Self {
        Self {
            engine: ArcSwap::from_pointee(engine),
        }
    }

    /// The current engine.
    pub fn engine(&self) -> Arc<Engine> {
        self.engine.load_full()
    }

    /// Replaces the engine.
    pub fn replace(&self, engine: Engine) {
        self.engine.store(Arc::new(engine));
    }
}

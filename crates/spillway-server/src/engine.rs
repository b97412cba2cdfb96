//! The running configuration: the store, the middleware layer built on it,
//! and the swap that replaces them on reload without losing counters.

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use spillway::Quota;
use spillway::algorithm::FixedWindow;
use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId, Store, Verdict};
use spillway_redis::{Error as StoreError, RedisOptions, RedisStore};
use spillway_tower::{Observer, RateLimitLayer};

use crate::config::descriptors::UnitLimit;
use crate::config::{Config, StoreKind};

/// How many distinct limit overrides (`requests_per_unit` and `unit`
/// pairs) the Envoy service counts at once; each is a store rule of its
/// own, with its own table of up to `max_keys` keys.
pub const MAX_LIMIT_OVERRIDES: usize = 64;

/// The store rule of a limit Envoy sent with a descriptor: a fixed window
/// of `requests_per_unit` per `unit`, as envoyproxy/ratelimit counts one.
/// Its name (`envoy-override:100-per-minute`) cannot be a configured
/// rule's.
pub fn override_rule(limit: UnitLimit) -> Rule {
    let quota = Quota::new(limit.requests_per_unit, limit.unit.duration())
        .expect("a unit is a whole number of seconds, at most a year");
    Rule::new(override_name(limit), FixedWindow::new(quota))
}

/// The name of [`override_rule`]`(limit)`.
pub fn override_name(limit: UnitLimit) -> String {
    format!(
        "{OVERRIDE_PREFIX}{}-per-{}",
        limit.requests_per_unit,
        limit.unit.name()
    )
}

/// The prefix of the store rules of limit overrides, which configured rule
/// names may not start with.
pub const OVERRIDE_PREFIX: &str = "envoy-override:";

/// Why a limit override could not be counted.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    /// [`MAX_LIMIT_OVERRIDES`] distinct overrides are counted already.
    #[error(
        "{MAX_LIMIT_OVERRIDES} distinct limit overrides are counted already: no room for another"
    )]
    TooMany,
    /// The store refused the rule.
    #[error(transparent)]
    Store(#[from] StoreError),
}

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
    /// The limit overrides Envoy has sent so far, whose rules follow the
    /// policy's in the store, in this order.
    overrides: Vec<UnitLimit>,
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
        // The overrides seen so far stay counted, as the rules do.
        let overrides = previous.map(|p| p.overrides.clone()).unwrap_or_default();
        let mut rules = config.policy.store_rules();
        rules.extend(overrides.iter().copied().map(override_rule));
        let inner = match (&config.store.kind, previous.map(|p| &p.store().inner)) {
            (StoreKind::Memory, Some(StoreImpl::Memory(old))) => {
                StoreImpl::Memory(Arc::new(old.reconfigure(rules)))
            }
            (StoreKind::Memory, _) => {
                let options = MemoryOptions {
                    max_keys: config.store.max_keys,
                    on_full: config.store.on_full,
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
        Ok(Self {
            config,
            layer,
            overrides,
        })
    }

    /// The same engine, with `observer` called for every rule of every
    /// decided request.
    pub fn observed(self, observer: impl Observer) -> Self {
        Self {
            layer: self.layer.observer(observer),
            ..self
        }
    }

    /// The store.
    pub fn store(&self) -> &AnyStore {
        self.layer.store()
    }

    /// The store rule counting limit override `limit`, if this engine has
    /// one (see [`Shared::with_overrides`]).
    pub fn override_id(&self, limit: UnitLimit) -> Option<RuleId> {
        let first = self.store().rules().len() - self.overrides.len();
        self.overrides
            .iter()
            .position(|&o| o == limit)
            .map(|i| RuleId(first + i))
    }

    /// The store rule of the limit override named `name`
    /// ([`override_name`]), if this engine counts it.
    pub fn override_named(&self, name: &str) -> Option<RuleId> {
        let limit = self.overrides.iter().find(|&&o| override_name(o) == name)?;
        self.override_id(*limit)
    }

    /// This engine with a store rule for `limit` after the others: every
    /// counter carries over (the same tables in memory, the same keys in
    /// Redis, on the same connection).
    fn with_override(&self, limit: UnitLimit) -> Result<Self, OverrideError> {
        if self.overrides.len() >= MAX_LIMIT_OVERRIDES {
            return Err(OverrideError::TooMany);
        }
        let old = self.store();
        let mut rules = old.rules().to_vec();
        rules.push(override_rule(limit));
        let inner = match &old.inner {
            StoreImpl::Memory(s) => StoreImpl::Memory(Arc::new(s.reconfigure(rules))),
            StoreImpl::Redis(s) => StoreImpl::Redis(s.with_rules(rules)?),
        };
        let store = AnyStore {
            inner,
            observer: old.observer.clone(),
        };
        let layer = self
            .layer
            .on_store(store)
            .expect("the store starts with the policy's rules");
        let mut overrides = self.overrides.clone();
        overrides.push(limit);
        Ok(Self {
            config: self.config.clone(),
            layer,
            overrides,
        })
    }
}

/// The engine in use, replaced whole on reload and when a new limit
/// override arrives: requests in flight finish on the engine they started
/// with.
#[derive(Debug)]
pub struct Shared {
    engine: ArcSwap<Engine>,
    // Held by whoever makes the next engine from the current one, so that
    // a reload and a new override do not each drop the other's change.
    changing: tokio::sync::Mutex<()>,
}

impl Shared {
    /// Starts with `engine`.
    pub fn new(engine: Engine) -> Self {
        Self {
            engine: ArcSwap::from_pointee(engine),
            changing: tokio::sync::Mutex::new(()),
        }
    }

    /// The current engine.
    pub fn engine(&self) -> Arc<Engine> {
        self.engine.load_full()
    }

    /// Waits until no one else is making the next engine, and keeps others
    /// waiting until the guard is dropped: hold it from reading the current
    /// engine until [`replace`](Self::replace).
    pub async fn changing(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changing.lock().await
    }

    /// Replaces the engine.
    pub fn replace(&self, engine: Engine) {
        self.engine.store(Arc::new(engine));
    }

    /// The current engine, made to count every one of `limits` first if it
    /// does not yet (see [`Engine::override_id`]).
    pub async fn with_overrides(&self, limits: &[UnitLimit]) -> Result<Arc<Engine>, OverrideError> {
        let _changing = self.changing().await;
        let mut engine = self.engine();
        for &limit in limits {
            if engine.override_id(limit).is_none() {
                engine = Arc::new(engine.with_override(limit)?);
                self.engine.store(engine.clone());
                tracing::info!(rule = %override_name(limit), "counting a new limit override");
            }
        }
        Ok(engine)
    }
}

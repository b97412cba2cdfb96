//! What the front ends share: the configuration loaded now ([`Loaded`]:
//! the config, the decision engine on its store, the Envoy overrides
//! counted), swapped whole on reload ([`Live`]), and the metrics.

use std::sync::Arc;

use arc_swap::ArcSwap;
use spillway::store::{MemoryOptions, MemoryStore, RuleId, Store as _};
use spillway_redis::{Error as StoreError, RedisOptions, RedisStore};
use spillway_tower::{Observer, RateLimitLayer};

use crate::config::descriptors::{UnitLimit, override_name, override_rule};
use crate::config::{Config, StoreKind};
use crate::metrics::{DecisionObserver, Metrics};
use crate::store::{AnyStore, StoreImpl, StoreObserver};

/// How many distinct limit overrides (`requests_per_unit` and `unit`
/// pairs) the Envoy service counts at once; each is a store rule of its
/// own, with its own table of up to `max_keys` keys.
pub const MAX_LIMIT_OVERRIDES: usize = 64;

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

/// One configuration, loaded: what a request is decided with.
#[derive(Debug)]
pub struct Loaded {
    /// The configuration it was built from.
    pub config: Config,
    /// The middleware layer (its store is [`Loaded::store`]).
    pub layer: RateLimitLayer<AnyStore>,
    /// The limit overrides Envoy has sent so far, whose rules follow the
    /// policy's in the store, in this order.
    overrides: Vec<UnitLimit>,
}

impl Loaded {
    /// Builds the engine for `config`: connects to Redis if configured. When
    /// `previous` is given (a reload), the in-memory counters of unchanged
    /// rules carry over, and an unchanged Redis connection is reused.
    pub async fn build(
        config: Config,
        previous: Option<&Loaded>,
        observer: Option<Arc<dyn StoreObserver>>,
    ) -> Result<Self, StoreError> {
        // The overrides seen so far stay counted, as the rules do.
        let overrides = previous.map(|p| p.overrides.clone()).unwrap_or_default();
        let mut rules = config.policy.store_rules();
        rules.extend(overrides.iter().copied().map(override_rule));
        // The same Redis with the same options: the same connection, so
        // that a reload costs no reconnection (and its first calls no
        // wait on a new one, past the store timeout under load).
        let same_store = previous.is_some_and(|p| p.config.store == config.store);
        let inner = match (&config.store.kind, previous.map(|p| &p.store().inner)) {
            (StoreKind::Memory, Some(StoreImpl::Memory(old))) => {
                StoreImpl::Memory(Arc::new(old.reconfigure(rules)))
            }
            (StoreKind::Memory, _) => {
                let options = MemoryOptions {
                    max_keys: config.store.max_keys,
                    on_full: config.store.on_full,
                    max_memory: config.store.max_memory,
                    ..MemoryOptions::default()
                };
                StoreImpl::Memory(Arc::new(MemoryStore::new(rules, options)))
            }
            (StoreKind::Redis(_), Some(StoreImpl::Redis(old))) if same_store => {
                StoreImpl::Redis(old.with_rules(rules)?)
            }
            (StoreKind::Redis(topology), _) => {
                let options = RedisOptions {
                    timeout: config.store.timeout,
                    on_error: config.store.on_error,
                    rule_on_error: config.store.rule_on_error.clone(),
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
    /// one (see [`Live::with_overrides`]).
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
pub struct Live {
    loaded: ArcSwap<Loaded>,
    // Held by whoever makes the next engine from the current one, so that
    // a reload and a new override do not each drop the other's change.
    changing: tokio::sync::Mutex<()>,
}

impl Live {
    /// Starts with `engine`.
    pub fn new(engine: Loaded) -> Self {
        Self {
            loaded: ArcSwap::from_pointee(engine),
            changing: tokio::sync::Mutex::new(()),
        }
    }

    /// The current engine.
    pub fn current(&self) -> Arc<Loaded> {
        self.loaded.load_full()
    }

    /// Waits until no one else is making the next engine, and keeps others
    /// waiting until the guard is dropped: hold it from reading the current
    /// engine until [`replace`](Self::replace).
    pub async fn changing(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changing.lock().await
    }

    /// Replaces the engine.
    pub fn replace(&self, engine: Loaded) {
        self.loaded.store(Arc::new(engine));
    }

    /// The current engine, made to count every one of `limits` first if it
    /// does not yet (see [`Loaded::override_id`]).
    pub async fn with_overrides(&self, limits: &[UnitLimit]) -> Result<Arc<Loaded>, OverrideError> {
        let _changing = self.changing().await;
        let mut engine = self.current();
        for &limit in limits {
            if engine.override_id(limit).is_none() {
                engine = Arc::new(engine.with_override(limit)?);
                self.loaded.store(engine.clone());
                tracing::info!(rule = %override_name(limit), "counting a new limit override");
            }
        }
        Ok(engine)
    }
}

/// What the endpoints share: the engine in use and the metrics it reports
/// to. Cheap to clone.
#[derive(Debug, Clone)]
pub struct State {
    /// The engine in use, replaced on reload.
    pub live: Arc<Live>,
    /// The metrics every engine of this service reports to.
    pub metrics: Arc<Metrics>,
}

impl State {
    /// Builds the engine for `config` (connecting to Redis if configured),
    /// reporting to fresh metrics.
    pub async fn new(config: Config) -> Result<Self, StoreError> {
        let metrics = Arc::new(Metrics::new());
        let engine = Loaded::counted(config, None, &metrics).await?;
        Ok(Self {
            live: Arc::new(Live::new(engine)),
            metrics,
        })
    }
}

impl Loaded {
    /// [`build`](Self::build), with the store calls and decisions counted
    /// in `metrics`; `previous` is the engine it replaces, if any (see
    /// [`Loaded::build`]: unchanged in-memory counters carry over).
    pub async fn counted(
        config: Config,
        previous: Option<&Loaded>,
        metrics: &Arc<Metrics>,
    ) -> Result<Loaded, StoreError> {
        let observer: Arc<dyn StoreObserver> = metrics.clone();
        let engine = Loaded::build(config, previous, Some(observer)).await?;
        Ok(engine.observed(DecisionObserver(metrics.clone())))
    }
}

//! What the front ends share: the configuration loaded now ([`Loaded`]:
//! the config, the decision engine on its store, the Envoy overrides
//! counted), swapped whole on reload ([`Live`]), and the metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use spillway::store::{MemoryOptions, MemoryStore, RuleId, Store as _};
use spillway_redis::{Error as StoreError, RedisOptions, RedisStore};
use spillway_tower::{HoldCap, Observer, RateLimitLayer, ReadRequestLayer};
use tokio::time::Instant;

use crate::config::descriptors::{UnitLimit, override_name, override_rule};
use crate::config::{Config, StoreKind};
use crate::metrics::{DecisionObserver, Metrics};
use crate::store::{AnyStore, StoreImpl, StoreObserver};

/// How many distinct limit overrides (`requests_per_unit` and `unit`
/// pairs) the Envoy service counts at once; each is a store rule of its
/// own, with its own table of up to `max_keys` keys. When all are counted,
/// a new override takes the slot of the least recently used one that has
/// gone unused for longer than its unit (see [`Live::with_overrides`]).
pub const MAX_LIMIT_OVERRIDES: usize = 64;

/// Why a limit override could not be counted.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    /// [`MAX_LIMIT_OVERRIDES`] distinct overrides are counted already, and
    /// each was used within its unit.
    #[error(
        "{MAX_LIMIT_OVERRIDES} distinct limit overrides are counted already, \
         each used within its unit: no room for another"
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
    /// The limit overrides Envoy has sent and still counts.
    overrides: Overrides,
    /// What reads a request's JSON body for the rules that reserve what it
    /// asks ([`Policy::request_fields`](spillway_tower::Policy::request_fields)):
    /// the proxy puts it in front of the layer; none when no rule does.
    pub read_request: Option<ReadRequestLayer>,
}

/// The limit overrides an engine counts, one slot each, whose rules follow
/// the policy's in the store, in this order.
#[derive(Debug, Clone)]
struct Overrides {
    // What the slots' last-use stamps count from. It passes from engine to
    // engine (reloads, new overrides), so that their stamps compare.
    epoch: Instant,
    slots: Vec<Slot>,
}

/// One counted limit override.
#[derive(Debug, Clone)]
struct Slot {
    limit: UnitLimit,
    // When a call last brought the override: milliseconds since the epoch,
    // or `RETIRED`. Shared by every engine that counts it (the `Arc`), so
    // that a call decided on an engine being replaced still counts as use.
    // An atomic rather than a lock: every call with an override stamps it.
    last_used: Arc<AtomicU64>,
}

/// The stamp of a slot given to another override: a call that meets it
/// treats the override as not counted, as on the engine that replaced it.
const RETIRED: u64 = u64::MAX;

impl Overrides {
    fn new(epoch: Instant) -> Self {
        Self {
            epoch,
            slots: Vec::new(),
        }
    }

    /// `now` as a stamp: milliseconds since the epoch.
    fn stamp(&self, now: Instant) -> u64 {
        let ms = now.saturating_duration_since(self.epoch).as_millis();
        u64::try_from(ms).unwrap_or(RETIRED - 1).min(RETIRED - 1)
    }

    /// The least recently used slot that has gone unused for longer than
    /// its unit at `now`, and its stamp. Its fixed window has then ended
    /// with no count in the next: no key's count is lost with it.
    fn idle(&self, now: Instant) -> Option<(usize, u64)> {
        let now = self.stamp(now);
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| {
                let last = slot.last_used.load(Ordering::Relaxed);
                let unit =
                    u64::try_from(slot.limit.unit.duration().as_millis()).unwrap_or(u64::MAX);
                (last != RETIRED && now.saturating_sub(last) > unit).then_some((i, last))
            })
            .min_by_key(|&(_, last)| last)
    }
}

/// Sets each rule's overrides under the quotas of its tiers that do not
/// hold them: an override is set under every quota its rule has, so a tier
/// a reload added (or one added while no instance ran) takes the
/// default quota's. One that a tier's quota cannot take is logged.
pub(crate) async fn overrides_under_every_tier(policy: &spillway_tower::Policy, store: &AnyStore) {
    use spillway::store::Store as _;
    let Ok(book) = store.overrides().await else {
        return;
    };
    if book.is_empty() {
        return;
    }
    let now = spillway::clock::Clock::now(&spillway::clock::SystemClock);
    for (index, rule) in policy.rules().iter().enumerate() {
        let default = policy.rule_id(index, None);
        let listed = book.list(store.rules()[default.0].name(), now);
        for tier in rule.tiers() {
            let id = policy.rule_id(index, Some(tier));
            let name = store.rules()[id.0].name().to_string();
            for (target, entry) in &listed {
                if book.get(&name, target).is_some() {
                    continue;
                }
                let set = match store.override_fits(id, &entry.applied) {
                    Ok(()) => store
                        .set_override(id, target.clone(), entry.clone())
                        .await
                        .map(|_| ()),
                    Err(e) => Err(e),
                };
                if let Err(e) = set {
                    tracing::warn!(rule = %rule.name(), tier, target = ?target, error = %e,
                        "an override could not be set under a tier's quota");
                }
            }
        }
    }
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
        // The overrides seen so far stay counted, as the rules do, with
        // their last use.
        let overrides =
            previous.map_or_else(|| Overrides::new(Instant::now()), |p| p.overrides.clone());
        let mut rules = config.policy.store_rules();
        // An Envoy rule's reservations (Kuadrant's `Reserve`) given back
        // when nobody commits them in time.
        for (i, envoy) in config.envoy_rules.iter().enumerate() {
            if let Some(within) = envoy.reserve_released {
                let id = config.policy.rule_id(i, None).0;
                rules[id] = rules[id].clone().release_unsettled_after(within);
            }
        }
        rules.extend(overrides.slots.iter().map(|s| override_rule(s.limit)));
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
        // On Redis a key's own override carries its rule's parameters:
        // written again for the rules this reload changed.
        if let (Some(redis), Some(previous)) = (store.redis(), previous)
            && let Err(e) = redis.rewrite_own_overrides(previous.store().rules()).await
        {
            tracing::warn!(error = %e,
                "the keys' own overrides of the rules this reload changed could not all be \
                 written again: set them again once Redis answers");
        }
        overrides_under_every_tier(&config.policy, &store).await;
        let layer = RateLimitLayer::new(config.policy.clone(), store)
            .expect("the store was built from the policy's rules");
        let fields = config.policy.request_fields();
        let bounds = config.proxy_bounds;
        let read_request = (!fields.is_empty()).then(|| {
            let layer = ReadRequestLayer::new(fields)
                .max_body(bounds.max_read_body.get())
                .max_buffered(bounds.max_read_bodies.get());
            // The bodies read before a reload still hold their bytes: one
            // allowance for them and the new ones.
            match previous.and_then(|p| p.read_request.as_ref()) {
                Some(old) => layer.sharing_buffers_with(old),
                None => layer,
            }
        });
        Ok(Self {
            config,
            layer,
            overrides,
            read_request,
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
        self.slot_of(limit).map(|(id, _)| id)
    }

    /// The store rule of the limit override named `name`
    /// ([`override_name`]), if this engine counts it.
    pub fn override_named(&self, name: &str) -> Option<RuleId> {
        let slot = self
            .overrides
            .slots
            .iter()
            .find(|s| override_name(s.limit) == name)?;
        self.override_id(slot.limit)
    }

    /// The store rule counting limit override `limit`, as
    /// [`override_id`](Self::override_id), marked used at `now` (a call
    /// brings it): none if this engine does not count it, or if its slot
    /// has just been given to another override.
    pub(crate) fn use_override(&self, limit: UnitLimit, now: Instant) -> Option<RuleId> {
        let (id, slot) = self.slot_of(limit)?;
        let now = self.overrides.stamp(now);
        let last = &slot.last_used;
        let seen = last.load(Ordering::Relaxed);
        // A write only when the stamp moves (once a millisecond at most),
        // so that busy calls share the slot's cache line unwritten. The
        // maximum, not a plain store: it keeps `RETIRED`, so a call either
        // stamps before the slot is taken (which then fails) or sees it
        // taken.
        if seen == RETIRED || (now > seen && last.fetch_max(now, Ordering::Relaxed) == RETIRED) {
            return None;
        }
        Some(id)
    }

    /// The slot of `limit` and its store rule, if this engine counts it.
    fn slot_of(&self, limit: UnitLimit) -> Option<(RuleId, &Slot)> {
        let slots = &self.overrides.slots;
        let first = self.store().rules().len() - slots.len();
        slots
            .iter()
            .enumerate()
            .find(|(_, s)| s.limit == limit)
            .map(|(i, s)| (RuleId(first + i), s))
    }

    /// This engine with a store rule for `limit`, used at `now`: after the
    /// others, or, with [`MAX_LIMIT_OVERRIDES`] counted, in the slot of the
    /// least recently used override idle for longer than its unit, which
    /// is returned. Every other rule's counters carry over (the same tables
    /// in memory, the same keys in Redis, on the same connection).
    fn with_override(
        &self,
        limit: UnitLimit,
        now: Instant,
    ) -> Result<(Self, Option<UnitLimit>), OverrideError> {
        let mut overrides = self.overrides.clone();
        let slot = Slot {
            limit,
            last_used: Arc::new(AtomicU64::new(overrides.stamp(now))),
        };
        let old = self.store();
        let mut rules = old.rules().to_vec();
        let first = rules.len() - overrides.slots.len();
        let mut replaced = None;
        if overrides.slots.len() < MAX_LIMIT_OVERRIDES {
            rules.push(override_rule(limit));
            overrides.slots.push(slot);
        } else {
            // Taken only if no call has used it since it was found idle:
            // the slot's stamp is set to `RETIRED` only if unchanged.
            let (i, seen) = loop {
                let (i, seen) = overrides.idle(now).ok_or(OverrideError::TooMany)?;
                let taken = overrides.slots[i].last_used.compare_exchange(
                    seen,
                    RETIRED,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
                if taken.is_ok() {
                    break (i, seen);
                }
            };
            let old_slot = std::mem::replace(&mut overrides.slots[i], slot);
            rules[first + i] = override_rule(limit);
            replaced = Some((old_slot, seen));
        }
        match self.with_rules(rules, overrides) {
            Ok(engine) => Ok((engine, replaced.map(|(s, _)| s.limit))),
            Err(e) => {
                // Still counted by this engine: in use again.
                if let Some((slot, seen)) = replaced {
                    slot.last_used.store(seen, Ordering::Relaxed);
                }
                Err(e)
            }
        }
    }

    /// This engine on the store rules `rules`, counting `overrides` (the
    /// last of `rules`).
    fn with_rules(
        &self,
        rules: Vec<spillway::store::Rule>,
        overrides: Overrides,
    ) -> Result<Self, OverrideError> {
        let old = self.store();
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
        Ok(Self {
            config: self.config.clone(),
            layer,
            overrides,
            read_request: self.read_request.clone(),
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
    ///
    /// With [`MAX_LIMIT_OVERRIDES`] counted already, a new override takes
    /// the slot of the least recently used one that no call has brought
    /// for longer than its unit: its fixed window has ended, so its counts
    /// have all expired and nothing is lost. The other rules keep their
    /// counters. When every slot was used within its unit, the new override
    /// is [`OverrideError::TooMany`].
    pub async fn with_overrides(&self, limits: &[UnitLimit]) -> Result<Arc<Loaded>, OverrideError> {
        let _changing = self.changing().await;
        let mut engine = self.current();
        let now = Instant::now();
        for &limit in limits {
            if engine.override_id(limit).is_none() {
                let (next, replaced) = engine.with_override(limit, now)?;
                engine = Arc::new(next);
                self.loaded.store(engine.clone());
                match replaced {
                    None => {
                        tracing::info!(rule = %override_name(limit), "counting a new limit override");
                    }
                    Some(old) => tracing::info!(
                        rule = %override_name(limit),
                        replaced = %override_name(old),
                        "counting a new limit override in the slot of one unused for longer than its unit"
                    ),
                }
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
    /// The forward-auth hook's answers held for their shaping turn, all
    /// together: at most `[proxy] max_held` (read at start), as in
    /// `spillway proxy`; past it a shaped request is answered 503.
    pub held: HoldCap,
    /// Signs the settle tokens of budget rules when the configuration
    /// names no `settle_key` (drawn at start).
    pub(crate) settle_key: crate::api::SettleKey,
    /// The lock on `[store] state_file`, held while this service runs.
    pub(crate) state_lock: Option<Arc<crate::snapshot::StateLock>>,
}

/// Why a service could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store could not be built (Redis unreachable, a rule it refuses).
    #[error("the store: {0}")]
    Store(#[from] StoreError),
    /// `[store] state_file` could not be read.
    #[error(transparent)]
    StateFile(#[from] crate::snapshot::RestoreError),
}

impl State {
    /// Builds the engine for `config` (connecting to Redis if configured),
    /// reporting to fresh metrics; with `[store] state_file`, reads the
    /// in-memory store's counts and tables back from it first (see
    /// [`snapshot`](crate::snapshot)).
    pub async fn new(config: Config) -> Result<Self, StartError> {
        let metrics = Arc::new(Metrics::new());
        let held = HoldCap::new(config.proxy_bounds.max_held);
        let state_file = config.store.state_file.clone();
        let engine = Loaded::counted(config, None, &metrics).await?;
        let in_memory = engine.store().memory().is_some();
        let live = Arc::new(Live::new(engine));
        let state_lock = match state_file {
            Some(file) if in_memory => {
                Some(Arc::new(crate::snapshot::restore(&file, &live).await?))
            }
            _ => None,
        };
        Ok(Self {
            live,
            metrics,
            held,
            settle_key: crate::api::SettleKey::random(),
            state_lock,
        })
    }

    /// With `[store] state_file`, starts writing it every `snapshot_every`:
    /// [`finish`](crate::snapshot::Snapshots::finish) it once the service
    /// has stopped admitting requests, for the last write.
    pub fn snapshots(&self) -> Option<crate::snapshot::Snapshots> {
        self.state_lock.as_ref()?;
        let file = self.live.current().config.store.state_file.clone()?;
        Some(crate::snapshot::Snapshots::start(
            file,
            self.live.clone(),
            self.metrics.clone(),
        ))
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

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use super::*;
    use crate::config::descriptors::Unit;

    fn per(n: u32, unit: Unit) -> UnitLimit {
        UnitLimit {
            requests_per_unit: NonZeroU32::new(n).unwrap(),
            unit,
        }
    }

    /// `n` token-bucket rules of 100 a minute, each keyed by IP, and `store`
    /// as the `[store]` section.
    fn rules(n: usize, store: &str) -> Config {
        let mut text = format!("[store]\n{store}\n");
        for i in 0..n {
            text += &format!(
                "[[rules]]\nname = \"r{i}\"\nalgorithm = \"token_bucket\"\nlimit = 100\nwindow = \"1m\"\n"
            );
        }
        Config::parse(&text).unwrap()
    }

    /// The keys each of `n` rules can hold, and the bytes the store counts
    /// as it starts (its tables, made at once within a byte budget).
    async fn capacity(n: usize, store: &str) -> (usize, usize) {
        let engine = Loaded::build(rules(n, store), None, None).await.unwrap();
        let memory = engine.store().memory().expect("in memory");
        let each = (0..n).map(|i| memory.capacity(RuleId(i))).min().unwrap();
        (each, memory.memory_bytes())
    }

    /// Without `max_memory` in the file, the in-memory store is bounded by
    /// the default: however many rules a flood spreads over, their tables
    /// together stay within 256 MiB, and each rule holds as many keys as
    /// `max_keys` (less the sixteenth a budgeted table keeps free) only
    /// while its share of the bytes allows. An explicit size wins, larger
    /// or smaller.
    #[tokio::test]
    async fn the_in_memory_store_is_bounded_by_default() {
        let max = crate::config::DEFAULT_MAX_MEMORY.get();
        let (by_keys, _) = capacity(1, "max_memory = \"4GiB\"").await;
        assert!(by_keys > 900_000, "about max_keys: {by_keys}");
        let mut last = usize::MAX;
        for n in [1, 2, 4, 8] {
            let (each, bytes) = capacity(n, "").await;
            eprintln!(
                "{n} rules: {each} keys each, {:.1} MiB of tables",
                bytes as f64 / f64::from(1 << 20)
            );
            assert!(bytes <= max, "{n} rules: {bytes} bytes");
            assert!(each <= by_keys && each <= last, "{n} rules: {each}");
            last = each;
        }
        assert_eq!(capacity(1, "").await.0, by_keys, "one rule: max_keys binds");
        assert!(last < by_keys / 2, "8 rules share the bytes: {last} each");
        // Set larger, max_keys binds again; set smaller, the bytes do.
        let (each, bytes) = capacity(8, "max_memory = \"2GiB\"").await;
        assert_eq!(each, by_keys);
        assert!(bytes > max && bytes <= 2 << 30, "{bytes}");
        let (each, bytes) = capacity(8, "max_memory = \"16MiB\"").await;
        assert!(
            each < last && bytes <= 16 << 20,
            "{each} keys, {bytes} bytes"
        );
    }

    /// A call still on the engine a slot was taken from finds its override
    /// gone (and so asks for the engine that replaced it), rather than
    /// charging a table no engine counts any more; a slot a call marks
    /// used is not taken.
    #[tokio::test(start_paused = true)]
    async fn a_taken_slot_is_gone_for_calls_on_the_old_engine() {
        let config = Config::parse(
            "[[rules]]\nname = \"r\"\nlimit = 1\nwindow = \"1m\"\nalgorithm = \"fixed_window\"\n",
        )
        .unwrap();
        let live = Live::new(Loaded::build(config, None, None).await.unwrap());
        let n = u32::try_from(MAX_LIMIT_OVERRIDES).unwrap();
        let limits: Vec<UnitLimit> = (1..=n).map(|i| per(i, Unit::Second)).collect();
        let full = live.with_overrides(&limits).await.unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        // 1 a second is used now: 2 a second is the one that goes.
        let now = Instant::now();
        assert!(full.use_override(per(1, Unit::Second), now).is_some());
        let next = live
            .with_overrides(&[per(100, Unit::Minute)])
            .await
            .unwrap();
        assert!(next.override_id(per(2, Unit::Second)).is_none());
        assert!(next.override_id(per(1, Unit::Second)).is_some());
        // The old engine still has the rule, but a call on it is told the
        // override is not counted.
        assert!(full.override_id(per(2, Unit::Second)).is_some());
        assert!(full.use_override(per(2, Unit::Second), now).is_none());
        assert!(full.use_override(per(3, Unit::Second), now).is_some());
        // The slots' stamps carry over to the new engine.
        assert!(next.use_override(per(3, Unit::Second), now).is_some());
        assert!(
            live.with_overrides(&[per(101, Unit::Minute)])
                .await
                .unwrap()
                .override_id(per(3, Unit::Second))
                .is_some(),
            "3 a second was marked used through the old engine"
        );
    }
}

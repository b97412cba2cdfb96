//! The configured store, in memory or on Redis, with the metrics' view of
//! every call.

use std::sync::Arc;
use std::time::Instant;

use spillway::algorithm::Renewed;
use spillway::store::{
    Check, Hold, ListBook, ListEntry, Listed, MemoryStore, Override, OverrideBook, OverrideEntry,
    Renew, Rule, RuleId, Settle, Settled, Store, Target, TierBook, TierEntry, Verdict,
};
use spillway_redis::{Error as StoreError, RedisStore};

/// The wall clock in µs since the Unix epoch.
fn wall_micros() -> u64 {
    spillway::clock::Clock::now(&spillway::clock::SystemClock)
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
    pub(crate) inner: StoreImpl,
    pub(crate) observer: Option<Arc<dyn StoreObserver>>,
}

#[derive(Clone)]
pub(crate) enum StoreImpl {
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
    /// Settles under a fresh id that nobody will send again (a cost
    /// reported after the response): with no receipt in memory, and with
    /// one that lives only as long as the store's own retries on Redis.
    pub async fn settle_unrepeated(
        &self,
        id: &str,
        settles: &[Settle<'_>],
    ) -> Result<Settled, StoreError> {
        let started = Instant::now();
        let result = match &self.inner {
            StoreImpl::Memory(s) => s.settle_once_now(settles).map_err(StoreError::from),
            StoreImpl::Redis(s) => s.settle_unrepeated(id, settles).await,
        };
        self.observe(started, result.as_ref().err());
        result
    }

    /// Sets the override of `target` under store rule `rule`: in this
    /// process's memory, or in Redis for every instance.
    pub async fn set_override(
        &self,
        rule: RuleId,
        target: Target,
        entry: OverrideEntry,
    ) -> Result<Option<OverrideEntry>, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.set_override(rule, target, entry)?),
            StoreImpl::Redis(s) => s.set_override(rule, target, entry).await,
        }
    }

    /// Whether store rule `rule` can take `o` (its algorithm takes it; on
    /// Redis, the script does its arithmetic exactly): the error says why
    /// not.
    pub fn override_fits(&self, rule: RuleId, o: &Override) -> Result<(), StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => {
                let r = s.rules().get(rule.0).ok_or(spillway::Error::UnknownRule {
                    index: 0,
                    rule: rule.0,
                })?;
                o.applied_to(r.algorithm()).map(|_| ()).map_err(|reason| {
                    spillway::Error::Override {
                        rule: r.name().to_string(),
                        reason,
                    }
                    .into()
                })
            }
            StoreImpl::Redis(s) => s.override_fits(rule, o),
        }
    }

    /// Removes the override of `target` under store rule `rule`.
    pub async fn remove_override(
        &self,
        rule: RuleId,
        target: &Target,
    ) -> Result<Option<OverrideEntry>, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.remove_override(rule, target)),
            StoreImpl::Redis(s) => s.remove_override(rule, target).await,
        }
    }

    /// Every override, as the store holds them now (on Redis, read again
    /// if they changed since this instance last did).
    pub async fn overrides(&self) -> Result<&OverrideBook, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.overrides()),
            StoreImpl::Redis(s) => {
                s.refresh_overrides().await?;
                Ok(s.overrides())
            }
        }
    }

    /// Puts `api_key` in a tier: in this process's memory, or in Redis for
    /// every instance.
    pub async fn set_tier(
        &self,
        api_key: &str,
        entry: TierEntry,
    ) -> Result<Option<TierEntry>, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.tiers().and_then(|t| {
                // What has passed its time goes when something is set.
                t.purge(wall_micros());
                t.set(api_key, entry)
            })),
            StoreImpl::Redis(s) => s.set_tier(api_key, entry).await,
        }
    }

    /// Takes `api_key` out of the tier it was put in.
    pub async fn remove_tier(&self, api_key: &str) -> Result<Option<TierEntry>, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.tiers().and_then(|t| t.remove(api_key))),
            StoreImpl::Redis(s) => s.remove_tier(api_key).await,
        }
    }

    /// The API keys put in a tier, as the store holds them now (on Redis,
    /// read again if they changed since this instance last did).
    pub async fn tier_book(&self) -> Result<&TierBook, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.tiers().expect("the memory store keeps tiers")),
            StoreImpl::Redis(s) => {
                s.refresh_overrides().await?;
                Ok(s.tier_book())
            }
        }
    }

    /// Sets a list entry: in this process's memory, or in Redis for every
    /// instance.
    pub async fn set_listed(
        &self,
        listed: Listed,
        entry: ListEntry,
    ) -> Result<Option<ListEntry>, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.lists().and_then(|l| {
                l.purge(wall_micros());
                l.set(listed, entry)
            })),
            StoreImpl::Redis(s) => s.set_listed(listed, entry).await,
        }
    }

    /// Removes a list entry.
    pub async fn remove_listed(
        &self,
        listed: &Listed,
        rule: Option<&str>,
    ) -> Result<Option<ListEntry>, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.lists().and_then(|l| l.remove(listed, rule))),
            StoreImpl::Redis(s) => s.remove_listed(listed, rule).await,
        }
    }

    /// The lists, as the store holds them now (on Redis, read again if
    /// they changed since this instance last did).
    pub async fn list_book(&self) -> Result<&ListBook, StoreError> {
        match &self.inner {
            StoreImpl::Memory(s) => Ok(s.lists().expect("the memory store keeps lists")),
            StoreImpl::Redis(s) => {
                s.refresh_overrides().await?;
                Ok(s.list_book())
            }
        }
    }

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

    fn tiers(&self) -> Option<&TierBook> {
        match &self.inner {
            StoreImpl::Memory(s) => s.tiers(),
            StoreImpl::Redis(s) => s.tiers(),
        }
    }

    fn lists(&self) -> Option<&ListBook> {
        match &self.inner {
            StoreImpl::Memory(s) => s.lists(),
            StoreImpl::Redis(s) => s.lists(),
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

    async fn reserve(&self, id: &str, checks: &[Check<'_>]) -> Result<Verdict, StoreError> {
        let started = Instant::now();
        let result = match &self.inner {
            StoreImpl::Memory(s) => s.reserve_now(id, checks).map_err(StoreError::from),
            StoreImpl::Redis(s) => s.reserve(id, checks).await,
        };
        self.observe(started, result.as_ref().err());
        result
    }

    async fn reserve_held(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
    ) -> Result<Verdict, StoreError> {
        let started = Instant::now();
        let result = match &self.inner {
            StoreImpl::Memory(s) => s
                .reserve_held_now(id, checks, hold)
                .map_err(StoreError::from),
            StoreImpl::Redis(s) => s.reserve_held(id, checks, hold).await,
        };
        self.observe(started, result.as_ref().err());
        result
    }

    fn try_reserve_now(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
    ) -> Option<Result<Verdict, StoreError>> {
        let StoreImpl::Memory(s) = &self.inner else {
            return None;
        };
        let started = Instant::now();
        let result = s
            .reserve_held_now(id, checks, hold)
            .map_err(StoreError::from);
        self.observe(started, result.as_ref().err());
        Some(result)
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

    async fn settle(&self, id: &str, settles: &[Settle<'_>]) -> Result<Settled, StoreError> {
        let started = Instant::now();
        let result = match &self.inner {
            StoreImpl::Memory(s) => s.settle_now(id, settles).map_err(StoreError::from),
            StoreImpl::Redis(s) => s.settle(id, settles).await,
        };
        self.observe(started, result.as_ref().err());
        result
    }

    fn try_settle_once_now(&self, settles: &[Settle<'_>]) -> Option<Result<Settled, StoreError>> {
        let StoreImpl::Memory(s) = &self.inner else {
            return None;
        };
        let started = Instant::now();
        let result = s.settle_once_now(settles).map_err(StoreError::from);
        self.observe(started, result.as_ref().err());
        Some(result)
    }

    async fn renew(&self, renews: &[Renew<'_>]) -> Result<Vec<Renewed>, StoreError> {
        let started = Instant::now();
        let result = match &self.inner {
            StoreImpl::Memory(s) => s.renew_now(renews).map_err(StoreError::from),
            StoreImpl::Redis(s) => s.renew(renews).await,
        };
        self.observe(started, result.as_ref().err());
        result
    }
}

// The crate's documentation is its README, so that crates.io and docs.rs
// say the same and the README's example is a doc test.
#![doc = include_str!("../README.md")]

mod breaker;
mod call;
mod cluster;
mod deny_cache;
mod fallback;
mod give_back;
mod keys;
mod options;
mod overrides;
mod renew;
mod script;
mod standalone;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use breaker::{Breakers, Gate};
use call::{Group, Mode, Prepared, Reply};
use deny_cache::DenyCache;
use spillway::Decision;
use spillway::store::{MemoryOptions, MemoryStore, RuleId};
use tokio::time::Instant;

pub use call::ScriptCall;
pub use keys::KeyCursor;
use options::{Counters, bump};
pub use options::{OnError, RedisOptions, Stats};
pub use script::MAX_SLIDING_LOG_LIMIT;

use redis::aio::ConnectionManagerConfig;
use spillway::algorithm::Renewed;
use spillway::store::{Check, Hold, Renew, Rule, Settle, Settled, Store, Verdict};
use spillway::{Algorithm, CostTooLarge};

/// Everything that can go wrong talking to Redis.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request itself is invalid (unknown rule, a cost that can never fit).
    #[error(transparent)]
    Check(#[from] spillway::Error),
    /// Redis answered with an error, or the connection failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Redis did not answer in time.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// A rule that the Lua script cannot run exactly.
    #[error("rule `{rule}`: {reason}")]
    Rule {
        /// The rule's name.
        rule: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The script answered something it never sends.
    #[error("unexpected reply from the script: {0}")]
    Reply(String),
    /// Redis failed recently and the policy is fail_closed: it is not asked
    /// again until the retry interval has passed.
    #[error("redis is unavailable (it failed less than the retry interval ago)")]
    Unavailable,
}

/// Where the store's data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server: `redis://host:port/db`.
    Standalone(String),
    /// A Redis Cluster, given by some of its nodes' URLs.
    Cluster(Vec<String>),
}

#[derive(Clone)]
enum Connection {
    Standalone(standalone::Standalone),
    Cluster(cluster::Cluster),
}

/// A [`Store`] on Redis or Redis Cluster.
///
/// On a standalone server, every request costs one script call, whatever
/// the number of rules. On a cluster, the checks are grouped by slot (a
/// script may only touch keys of one slot) and the groups run in parallel;
/// if one group denies while another admitted, the admitted charges are
/// given back by a second call. Between the two calls another request may
/// see those charges and be denied: a window of at most two timeouts in
/// which the cluster can be stricter than exact, never looser. A refund
/// that fails is sent again in the background (a receipt makes a second
/// delivery give nothing back), and counted in [`Stats::refund_errors`]
/// if every attempt fails.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
    connection: Connection,
}

struct Inner {
    rules: Vec<Rule>,
    params: Vec<script::Params>,
    scripts: Scripts,
    #[cfg(feature = "test-time")]
    test_scripts: Scripts,
    options: RedisOptions,
    deny_cache: Option<DenyCache>,
    // Each rule's failure policy.
    on_error: Vec<OnError>,
    // The in-memory fallback of `OnError::Local`, when a rule has it.
    local: Option<MemoryStore>,
    // Shared with the stores `with_rules` makes on the same connection.
    breakers: Arc<Breakers>,
    counters: Arc<Counters>,
    // This instance's copy of the overrides, shared as the breakers are.
    overrides: Arc<overrides::Shared>,
}

impl Inner {
    /// The store's state for `rules`; the local fallback keeps the counters
    /// of `local_before`'s unchanged rules.
    fn new(
        rules: Vec<Rule>,
        options: RedisOptions,
        local_before: Option<&MemoryStore>,
        breakers: Arc<Breakers>,
        counters: Arc<Counters>,
        overrides: Arc<overrides::Shared>,
    ) -> Result<Self, Error> {
        let params = rules
            .iter()
            .map(|r| script::params(r.name(), r.algorithm()))
            .collect::<Result<Vec<_>, _>>()?;
        let on_error: Vec<OnError> = rules
            .iter()
            .map(|r| {
                options
                    .rule_on_error
                    .get(r.name())
                    .copied()
                    .unwrap_or(options.on_error)
            })
            .collect();
        for (rule, policy) in rules.iter().zip(&on_error) {
            if let OnError::Local { instances } = policy {
                let limit = rule.algorithm().quota().limit();
                if limit.get() < instances.get() {
                    return Err(Error::Rule {
                        rule: rule.name().to_string(),
                        reason: "a `local` failure policy gives each instance its share of \
                                 the limit, and this limit is below the instance count: \
                                 use fail_closed or fail_open for it",
                    });
                }
            }
        }
        let any_local = on_error.iter().any(|p| matches!(p, OnError::Local { .. }));
        let local = any_local.then(|| {
            // Every rule, in the store's order (so that a check's rule is
            // the same index); each `local` one with its share.
            let shared: Vec<Rule> = rules
                .iter()
                .zip(&on_error)
                .map(|(r, policy)| match policy {
                    OnError::Local { instances } => {
                        Rule::new(r.name(), r.algorithm().share(*instances))
                    }
                    _ => r.clone(),
                })
                .collect();
            match local_before {
                Some(before) => before.reconfigure(shared),
                None => MemoryStore::new(shared, MemoryOptions::default()),
            }
        });
        let deny_cache =
            (options.deny_cache_entries > 0).then(|| DenyCache::new(options.deny_cache_entries));
        Ok(Self {
            rules,
            params,
            scripts: Scripts::new(false),
            #[cfg(feature = "test-time")]
            test_scripts: Scripts::new(true),
            options,
            deny_cache,
            on_error,
            local,
            breakers,
            counters,
            overrides,
        })
    }
}

/// The general script and the single-check ones, as Redis runs them
/// (EVALSHA, loaded again on NOSCRIPT by `redis::Script`), and their
/// sources (sent with EVAL after a cluster redirection).
struct Scripts {
    general: redis::Script,
    single: [redis::Script; script::SINGLE_SCRIPTS],
    general_source: String,
    single_sources: [String; script::SINGLE_SCRIPTS],
}

impl Scripts {
    fn new(time_override: bool) -> Self {
        let general_source = script::source(time_override);
        let single_sources: [String; script::SINGLE_SCRIPTS] =
            std::array::from_fn(|family| script::single_source(family, time_override));
        Self {
            general: redis::Script::new(&general_source),
            single: std::array::from_fn(|family| redis::Script::new(&single_sources[family])),
            general_source,
            single_sources,
        }
    }

    /// The source of single-check script `family`, or of the general one.
    fn source(&self, family: Option<usize>) -> &str {
        match family {
            Some(family) => &self.single_sources[family],
            None => &self.general_source,
        }
    }
}

/// How the store connects to a server (each node, on a cluster): each
/// attempt within `timeout`, one reconnection attempt after a failure, and
/// no command ever sent twice.
fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(100))
}

/// The decisions of a verdict, a stand-in ([`unknown`]) where Redis gave
/// none, and the indices of those (the verdict's `undecided`).
fn stand_in_for_unknown(
    decisions: Vec<Option<Decision>>,
    prepared: &[Prepared],
) -> (spillway::store::Decisions, Vec<usize>) {
    let mut undecided = Vec::new();
    let decisions = decisions
        .into_iter()
        .zip(prepared)
        .enumerate()
        .map(|(i, (d, p))| {
            d.unwrap_or_else(|| {
                undecided.push(i);
                unknown(p.capacity)
            })
        })
        .collect();
    (decisions, undecided)
}

/// A stand-in decision for a check whose state is unknown (Redis did not
/// answer, or the deny cache answered for another rule): admitted, its
/// limit, nothing known used. Its verdict lists it as undecided, so that
/// no one reports it as a quota.
fn unknown(capacity: u64) -> Decision {
    Decision {
        allowed: true,
        limit: capacity,
        remaining: capacity,
        reset_after: Duration::ZERO,
        refill_after: Duration::ZERO,
        retry_after: None,
        delay: Duration::ZERO,
    }
}

impl RedisStore {
    /// Connects to Redis and prepares `rules`. Fails if Redis cannot be
    /// reached, or a rule's quota is too large for exact arithmetic in Lua.
    pub async fn connect(
        topology: Topology,
        rules: Vec<Rule>,
        options: RedisOptions,
    ) -> Result<Self, Error> {
        // Made before connecting: a quota the scripts cannot take is a
        // configuration error, whether Redis is up or not.
        let timeout = options.timeout;
        let breakers = Arc::new(Breakers::new(
            matches!(topology, Topology::Cluster(_)),
            options.retry_interval,
        ));
        let inner = Inner::new(
            rules,
            options,
            None,
            breakers,
            Arc::new(Counters::new()),
            Arc::default(),
        )?;
        let connect_within = timeout.max(Duration::from_secs(1));
        let connection = match topology {
            Topology::Standalone(url) => {
                let node = tokio::time::timeout(
                    connect_within,
                    standalone::Standalone::connect(url, manager_config(timeout)),
                )
                .await
                .map_err(|_| Error::Timeout(connect_within))??;
                Connection::Standalone(node)
            }
            Topology::Cluster(nodes) => {
                // Each node's connection is a connection manager as above;
                // the store routes calls to them itself (cluster.rs).
                // Its fetch of the slot map ends within `connect_within`.
                let cluster =
                    cluster::Cluster::connect(nodes, manager_config(timeout), connect_within)
                        .await?;
                Connection::Cluster(cluster)
            }
        };
        let store = Self {
            inner: Arc::new(inner),
            connection,
        };
        // The overrides set so far hold from the first request on.
        if let Err(e) = store.refresh_overrides().await {
            tracing::warn!(error = %e, "could not read the overrides from redis");
        }
        store.spawn_override_refresh();
        Ok(store)
    }

    /// A store for `rules` on this store's connection: the same Redis, the
    /// same options and statistics, no new connection. A rule's counters
    /// live in Redis under its name, so every rule kept by name and
    /// algorithm keeps them; so does the in-memory fallback of
    /// [`OnError::Local`]. Fails, as [`connect`](Self::connect) does, if
    /// a rule's quota is too large for exact arithmetic in Lua.
    pub fn with_rules(&self, rules: Vec<Rule>) -> Result<Self, Error> {
        let inner = Inner::new(
            rules,
            self.inner.options.clone(),
            self.inner.local.as_ref(),
            self.inner.breakers.clone(),
            self.inner.counters.clone(),
            self.inner.overrides.clone(),
        )?;
        Ok(Self {
            inner: Arc::new(inner),
            connection: self.connection.clone(),
        })
    }

    /// Decides as if the server's clock read `now` (µs). Only for the
    /// conformance suite: built with the `test-time` feature, which the
    /// service never enables.
    #[cfg(feature = "test-time")]
    pub async fn check_at(&self, checks: &[Check<'_>], now: u64) -> Result<Verdict, Error> {
        self.decide_at(None, checks, now).await
    }

    /// Reserves as if the server's clock read `now` (µs): the conformance
    /// suite's [`Store::reserve`], with the `test-time` feature.
    #[cfg(feature = "test-time")]
    pub async fn reserve_at(
        &self,
        id: &str,
        checks: &[Check<'_>],
        now: u64,
    ) -> Result<Verdict, Error> {
        spillway::store::check_settle_id(id)?;
        self.decide_at(Some(id), checks, now).await
    }

    #[cfg(feature = "test-time")]
    async fn decide_at(
        &self,
        hold: Option<&str>,
        checks: &[Check<'_>],
        now: u64,
    ) -> Result<Verdict, Error> {
        let prepared = self.prepare_at(checks, Some(now))?;
        let groups = self.groups(&prepared);
        let results = self
            .run(
                &self.inner.test_scripts,
                &prepared,
                &groups,
                &[],
                Some(now),
                hold,
            )
            .await;
        self.settle(
            &self.inner.test_scripts,
            &prepared,
            &groups,
            results,
            Some(now),
            hold,
        )
        .await
        .map_err(|failed| failed.error)
    }

    /// Settles as if the server's clock read `now` (µs): the conformance
    /// suite's [`Store::settle`], with the `test-time` feature.
    #[cfg(feature = "test-time")]
    pub async fn settle_at(
        &self,
        id: &str,
        settles: &[Settle<'_>],
        now: u64,
    ) -> Result<Settled, Error> {
        self.settle_charges(id, settles, Some(now), give_back::receipt_ms())
            .await
    }

    /// Renews leases as if the server's clock read `now` (µs): the
    /// conformance suite's [`Store::renew`], with the `test-time` feature.
    #[cfg(feature = "test-time")]
    pub async fn renew_at(&self, renews: &[Renew<'_>], now: u64) -> Result<Vec<Renewed>, Error> {
        self.renew_leases(renews, Some(now)).await
    }

    /// The script call the store makes for `checks` on a standalone server
    /// (its source, keys and arguments), for inspection and benchmarks.
    pub fn script_call(&self, checks: &[Check<'_>]) -> Result<ScriptCall, Error> {
        let prepared = self.prepare(checks)?;
        let group: Vec<usize> = (0..prepared.len()).collect();
        let family = call::single_family(&prepared, &group, Mode::Decide);
        let mut call = ScriptCall {
            source: match family {
                Some(family) => script::single_source(family, false),
                None => script::source(false),
            },
            keys: Vec::new(),
            args: Vec::new(),
        };
        call::assemble(&prepared, &group, None, Mode::Decide, family, &mut call);
        Ok(call)
    }

    /// Settles as [`Store::settle`] does, for a caller that never sends
    /// the same settle again (a cost reported after the response, under an
    /// id drawn for it): its receipt lives only as long as this store's own
    /// retries of it need (ten seconds and a little more), not
    /// [`SETTLE_RECEIPT_TTL`](spillway::store::SETTLE_RECEIPT_TTL), so
    /// that many reports cost Redis little.
    pub async fn settle_unrepeated(
        &self,
        id: &str,
        settles: &[Settle<'_>],
    ) -> Result<Settled, Error> {
        let receipt = u64::try_from(self.own_retries().as_millis()).unwrap_or(u64::MAX);
        self.settle_charges(id, settles, None, receipt).await
    }

    /// What the store has done so far.
    pub fn stats(&self) -> Stats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            redis_calls: get(&c.redis_calls),
            redis_errors: get(&c.redis_errors),
            fail_open: get(&c.fail_open),
            local: get(&c.local),
            deny_cache_hits: get(&c.deny_cache_hits),
            refunds: get(&c.refunds),
            refund_errors: get(&c.refund_errors),
            data_errors: get(&c.data_errors),
            settles: get(&c.settles),
            settle_errors: get(&c.settle_errors),
            reservations_given_back: get(&c.given_back),
        }
    }

    /// How many breakers are open or half open: on a cluster, the slots
    /// whose Redis failed to answer within the retry interval (one breaker
    /// per slot); on a standalone server, 1 or 0.
    pub fn open_breakers(&self) -> usize {
        self.inner.breakers.open_count()
    }

    /// Whether Redis answers: no breaker is open (on a cluster, no slot's
    /// last call failed to answer within the retry interval).
    pub fn is_healthy(&self) -> bool {
        self.inner.breakers.all_closed()
    }

    /// Asks Redis once, whatever the breakers say, for a peek (cost 0: it
    /// charges nothing and writes nothing) of `key` under the first rule,
    /// and says whether it answered. Like a request's call, its answer
    /// closes the breaker of the key's slot and a failure to answer opens
    /// it (logging the change of state, if it is one); no failure policy
    /// is applied. A service probes now and then, so that
    /// [`is_healthy`](Self::is_healthy) sees a dead Redis, and a Redis
    /// back again, without waiting for traffic. Without rules there is
    /// nothing to ask: `Ok`.
    pub async fn probe(&self, key: &str) -> Result<(), Error> {
        if self.inner.rules.is_empty() {
            return Ok(());
        }
        let checks = [Check {
            rule: RuleId(0),
            key,
            cost: 0,
        }];
        let prepared = self.prepare(&checks)?;
        let groups = self.groups(&prepared);
        let group = &groups[0];
        let inner = &*self.inner;
        let result = self
            .call(&inner.scripts, &prepared, group, None, Mode::Decide)
            .await;
        match &result {
            Ok(_) => inner.breakers.answered(group.slot),
            Err(error) if is_outage(error) => {
                bump(&inner.counters.redis_errors);
                inner.breakers.failed(group.slot, Instant::now(), error);
            }
            Err(_) => bump(&inner.counters.redis_errors),
        }
        result.map(drop)
    }

    /// The production path: the deny cache, the breakers, Redis, then the
    /// failure policy.
    async fn check_with_fallback(
        &self,
        checks: &[Check<'_>],
        hold: Option<(&str, Hold<'_>)>,
    ) -> Result<Verdict, Error> {
        let inner = &*self.inner;
        let mut prepared = self.prepare(checks)?;
        let hold = hold.map(|(id, hold)| {
            let within = u64::try_from(hold.within.as_micros())
                .unwrap_or(u64::MAX)
                .max(1);
            for (i, p) in prepared.iter_mut().enumerate() {
                if p.release_us > 0 {
                    p.release_us = p.release_us.min(within);
                    p.held = hold.holds(i);
                }
            }
            id
        });
        let now = Instant::now();
        if let Some(verdict) = self.cached_denial(&prepared, now) {
            bump(&inner.counters.deny_cache_hits);
            return Ok(verdict);
        }
        let groups = self.groups(&prepared);
        // Held until the answer is in, so that one request at a time
        // probes a half-open breaker. A group whose breaker is open is not
        // asked, but the others are: a denial from any of them wins.
        let mut probes = Vec::new();
        let mut open = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            match inner.breakers.gate(group.slot, now) {
                Gate::Closed => {}
                Gate::Probe(probe) => probes.push(probe),
                Gate::Open => open.push(g),
            }
        }
        if open.len() == groups.len() {
            return self.fall_back(checks, &prepared, Error::Unavailable);
        }
        let results = self
            .run(&inner.scripts, &prepared, &groups, &open, None, hold)
            .await;
        let settled = self
            .settle(&inner.scripts, &prepared, &groups, results, None, hold)
            .await;
        drop(probes);
        match settled {
            Ok(verdict) => {
                if let (false, Some(cache)) = (verdict.allowed, &inner.deny_cache) {
                    let received = Instant::now();
                    for (p, d) in prepared.iter().zip(&verdict.decisions) {
                        // A concurrency denial's wait is until a lease
                        // ends; a release, on any instance, frees a slot
                        // long before: not cached.
                        if !d.allowed && p.params[0] != script::CONCURRENCY {
                            cache.record(&p.key, p.cost, *d, now, received);
                        }
                    }
                }
                Ok(verdict)
            }
            Err(failed) => {
                let mut verdict = self.fall_back(checks, &prepared, failed.error);
                match &mut verdict {
                    // What the groups that answered decided is known: it
                    // is reported, not an unknown full quota.
                    Ok(v) if v.allowed => {
                        // The verdict is not Redis's: its charges there
                        // cannot be settled by their hold. They stand, as
                        // a reservation never settled does under "charge".
                        if let Some(id) = hold {
                            self.close_later(&prepared, &groups, id);
                        }
                        for &(i, mut d) in &failed.decided {
                            // The verdict has no time of Redis's: a lease
                            // taken there cannot be named by it. The charge
                            // names none, and the request takes a slot at
                            // its first renew; the one taken here is held
                            // by nobody until it ends (a lease at most).
                            if prepared[i].params[0] == script::CONCURRENCY {
                                d.reset_after = Duration::ZERO;
                            }
                            v.decisions[i] = d;
                        }
                        v.undecided
                            .retain(|i| !failed.decided.iter().any(|(j, _)| j == i));
                    }
                    // Refused after all: what the groups that answered
                    // charged goes back.
                    _ if !failed.charged.is_empty() => {
                        let prepared = named_leases(&prepared, &failed.named);
                        self.refund_groups(
                            &inner.scripts,
                            &prepared,
                            &groups,
                            &failed.charged,
                            None,
                            hold,
                        )
                        .await;
                    }
                    _ => {}
                }
                verdict
            }
        }
    }

    /// Each group's script call, all at once, but those of the groups in
    /// `open` (their breaker open), which are [`Error::Unavailable`].
    async fn run(
        &self,
        scripts: &Scripts,
        prepared: &[Prepared],
        groups: &[Group],
        open: &[usize],
        now: Option<u64>,
        hold: Option<&str>,
    ) -> Vec<Result<Reply, Error>> {
        let mode = hold.map_or(Mode::Decide, Mode::Reserve);
        let calls = groups.iter().enumerate().map(|(g, group)| async move {
            if open.contains(&g) {
                return Err(Error::Unavailable);
            }
            self.call(scripts, prepared, group, now, mode).await
        });
        futures_util::future::join_all(calls).await
    }

    /// The request's verdict from its groups' replies; each group's
    /// breaker closes, or opens if its call failed to answer. Any denial
    /// wins: the groups that admitted give their charges back, and a group
    /// that failed cannot turn the denial into an admission. Without a
    /// denial, a failure is the request's, with the groups whose charges
    /// stand.
    async fn settle(
        &self,
        scripts: &Scripts,
        prepared: &[Prepared],
        groups: &[Group],
        results: Vec<Result<Reply, Error>>,
        now: Option<u64>,
        hold: Option<&str>,
    ) -> Result<Verdict, Failed> {
        let inner = &*self.inner;
        let answered_at = Instant::now();
        for (group, result) in groups.iter().zip(&results) {
            match result {
                Ok(_) => inner.breakers.answered(group.slot),
                // Not asked: its breaker is open (only the gate says so).
                Err(Error::Unavailable) => {}
                Err(error) => {
                    bump(&inner.counters.redis_errors);
                    if is_outage(error) {
                        inner.breakers.failed(group.slot, answered_at, error);
                    } else {
                        bump(&inner.counters.data_errors);
                    }
                }
            }
        }
        let denied = results
            .iter()
            .any(|r| matches!(r, Ok(reply) if !reply.allowed));
        let mut decisions: Vec<Option<Decision>> = vec![None; prepared.len()];
        let mut charged = Vec::new();
        let mut first_error = None;
        // The verdict's time: the earliest of the answering nodes' clocks.
        // Each node has its own; a concurrency check's lease is named by
        // its end on its own node's clock (`at + reset_after`), so its
        // decision is told against the verdict's time: its `reset_after`
        // grows by the difference between the clocks (never to 0, which
        // would name no lease).
        let decided_at = results
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|reply| reply.now))
            .min()
            .unwrap_or(0);
        let mut named = Vec::new();
        for (g, (group, result)) in groups.iter().zip(results).enumerate() {
            match result {
                Ok(reply) => {
                    if reply.allowed {
                        charged.push((g, reply.now));
                    }
                    for (&i, d) in group.checks.iter().zip(&reply.decisions) {
                        let mut d = *d;
                        if prepared[i].params[0] == script::CONCURRENCY && d.allowed {
                            let end = reply.now.saturating_add(micros(d.reset_after));
                            named.push((i, end));
                            d.reset_after = Duration::from_micros(end.saturating_sub(decided_at));
                        }
                        decisions[i] = Some(d);
                    }
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        if denied {
            // Given back by name: the leases these checks took.
            let prepared = named_leases(prepared, &named);
            // Their decisions become their state as it now stands.
            for (g, reply) in self
                .refund_groups(scripts, &prepared, groups, &charged, now, hold)
                .await
            {
                for (&i, d) in groups[g].checks.iter().zip(&reply.decisions) {
                    decisions[i] = Some(*d);
                }
            }
        } else if let Some(error) = first_error {
            let decided = decisions
                .iter()
                .enumerate()
                .filter_map(|(i, d)| Some((i, (*d)?)))
                .collect();
            return Err(Failed {
                error,
                charged,
                decided,
                named,
            });
        }
        let (decisions, undecided) = stand_in_for_unknown(decisions, prepared);
        Ok(Verdict {
            allowed: !denied,
            decisions,
            decided_at,
            undecided,
        })
    }

    /// The deny cache forgets the keys of `group`, whose state just moved.
    pub(crate) fn forget_denials(&self, prepared: &[Prepared], group: &Group) {
        if let Some(cache) = &self.inner.deny_cache {
            for &i in &group.checks {
                cache.forget(&prepared[i].key);
            }
        }
    }

    /// A denial from the deny cache, if any check of the request has one.
    /// Only the denying check's decision is known; the others report their
    /// limit with nothing known to be used.
    fn cached_denial(&self, prepared: &[Prepared], now: Instant) -> Option<Verdict> {
        let cache = self.inner.deny_cache.as_ref()?;
        let denied: Vec<Option<Decision>> = prepared
            .iter()
            .map(|p| cache.lookup(&p.key, p.cost, now))
            .collect();
        if denied.iter().all(Option::is_none) {
            return None;
        }
        let (decisions, undecided) = stand_in_for_unknown(denied, prepared);
        Some(Verdict {
            allowed: false,
            decisions,
            decided_at: 0,
            undecided,
        })
    }

    /// Validates the checks and builds their keys.
    fn prepare(&self, checks: &[Check<'_>]) -> Result<Vec<Prepared>, Error> {
        self.prepare_at(checks, None)
    }

    /// [`prepare`](Self::prepare), a calendar window's periods worked out
    /// around `now` (µs; `None`: this machine's clock, which the server's
    /// is within a period of).
    fn prepare_at(&self, checks: &[Check<'_>], now: Option<u64>) -> Result<Vec<Prepared>, Error> {
        let inner = &*self.inner;
        checks
            .iter()
            .enumerate()
            .map(|(index, check)| {
                let rule = inner
                    .rules
                    .get(check.rule.0)
                    .ok_or(spillway::Error::UnknownRule {
                        index,
                        rule: check.rule.0,
                    })?;
                let capacity = rule.algorithm().capacity();
                if check.cost > capacity {
                    return Err(spillway::Error::CostTooLarge {
                        index,
                        source: CostTooLarge {
                            cost: check.cost,
                            capacity,
                        },
                    }
                    .into());
                }
                let mut params = match rule.algorithm() {
                    spillway::algorithm::AnyAlgorithm::FixedWindow(fw)
                        if let Some(calendar) = fw.calendar_of() =>
                    {
                        let now = now.unwrap_or_else(wall_clock_micros);
                        script::calendar_params(capacity, &calendar, now)
                    }
                    _ => inner.params[check.rule.0],
                };
                let overridden = if inner.overrides.book.is_empty() {
                    call::Overridden::default()
                } else {
                    let now = now.unwrap_or_else(wall_clock_micros);
                    self.overridden(rule, check.key, now, &mut params)
                };
                Ok(Prepared {
                    key: script::redis_key(
                        &inner.options.key_prefix,
                        rule.name(),
                        rule.algorithm(),
                        check.key,
                    ),
                    params,
                    overridden,
                    cost: check.cost,
                    lease: 0,
                    capacity,
                    held: true,
                    release_us: match rule.algorithm() {
                        spillway::algorithm::AnyAlgorithm::Concurrency(_) => 0,
                        _ => rule.release_after().map_or(0, |d| {
                            u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
                        }),
                    },
                })
            })
            .collect()
    }

    /// The checks grouped into script calls: all in one on a standalone
    /// server, one per slot on a cluster.
    fn groups(&self, prepared: &[Prepared]) -> Vec<Group> {
        match self.connection {
            Connection::Standalone(_) => vec![Group {
                slot: 0,
                checks: (0..prepared.len()).collect(),
            }],
            Connection::Cluster(_) => {
                let mut groups: Vec<Group> = Vec::new();
                for (i, p) in prepared.iter().enumerate() {
                    let slot = cluster::slot(p.key.as_bytes());
                    match groups.iter_mut().find(|g| g.slot == slot) {
                        Some(group) => group.checks.push(i),
                        None => groups.push(Group {
                            slot,
                            checks: vec![i],
                        }),
                    }
                }
                groups
            }
        }
    }
}

/// Whether the Redis store can run `rule`: its arithmetic exact in Lua, a
/// sliding log's limit within [`MAX_SLIDING_LOG_LIMIT`]. The same check as
/// [`RedisStore::connect`] makes, for a configuration to make first.
pub fn check_rule(rule: &Rule) -> Result<(), Error> {
    script::params(rule.name(), rule.algorithm()).map(|_| ())
}

/// This machine's clock, in µs since the Unix epoch.
pub(crate) fn wall_clock_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A request that Redis could not decide: the error, and the groups
/// (index, time of charge) that answered and charged.
struct Failed {
    error: Error,
    charged: Vec<(usize, u64)>,
    // The leases the concurrency checks of the groups that answered took,
    // by name: a refund gives them back by it.
    named: Vec<(usize, u64)>,
    // The decisions of the checks whose groups answered (all admitting).
    decided: Vec<(usize, Decision)>,
}

/// Whether `error` means Redis did not answer (down, slow, failing over),
/// which opens the breaker; a data error (a key of another type, a corrupt
/// state, an unexpected reply) concerns one request, not the store.
fn is_outage(error: &Error) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    match error {
        Error::Timeout(_) | Error::Unavailable => true,
        Error::Redis(e) => match e.kind() {
            ErrorKind::Server(kind) => {
                cluster::is_changing(kind)
                    // Still redirected after every resend: the cluster
                    // cannot say where the key is.
                    || matches!(kind, ServerErrorKind::Moved | ServerErrorKind::Ask)
            }
            // Codes redis-rs has no kind for. A script running past its
            // time limit holds the whole server (BUSY); a full Redis under
            // noeviction (OOM), one without the replicas it must write to
            // (NOREPLICAS) or one whose last save failed (MISCONF) refuses
            // every write; a password or ACL that no longer lets the store
            // in (NOAUTH, NOPERM) refuses every call. None is an error of
            // one key's data.
            ErrorKind::Extension => matches!(
                e.code(),
                Some("BUSY" | "OOM" | "NOREPLICAS" | "MISCONF" | "NOAUTH" | "NOPERM")
            ),
            ErrorKind::Io
            | ErrorKind::ClusterConnectionNotFound
            | ErrorKind::Parse
            | ErrorKind::AuthenticationFailed => true,
            _ => false,
        },
        Error::Check(_) | Error::Rule { .. } | Error::Reply(_) => false,
    }
}

/// The Redis Cluster slot of a key (CRC16 of its hash tag, mod 16384), as
/// `CLUSTER KEYSLOT` computes it.
pub fn slot(key: &[u8]) -> u16 {
    cluster::slot(key)
}

impl Store for RedisStore {
    type Error = Error;

    fn rules(&self) -> &[Rule] {
        &self.inner.rules
    }

    fn tiers(&self) -> Option<&spillway::store::TierBook> {
        Some(&self.inner.overrides.tiers)
    }

    fn lists(&self) -> Option<&spillway::store::ListBook> {
        Some(&self.inner.overrides.lists)
    }

    fn check(
        &self,
        checks: &[Check<'_>],
    ) -> impl std::future::Future<Output = Result<Verdict, Error>> + Send {
        self.check_with_fallback(checks, None)
    }

    /// Decides as [`check`](Store::check) does, in the same script call
    /// that holds the reservations open: on Redis, a key's reservations
    /// live in its slot, and any instance's call that touches the key once
    /// one's time has passed gives it back. A reservation made by the local
    /// fallback is not held (it lives and dies with this process).
    async fn reserve(&self, id: &str, checks: &[Check<'_>]) -> Result<Verdict, Error> {
        spillway::store::check_settle_id(id)?;
        self.check_with_fallback(checks, Some((id, Hold::ALL)))
            .await
    }

    /// [`reserve`](Store::reserve), holding only what `hold` names, each
    /// for the shorter of `hold.within` and its rule's time (the script is
    /// told each check's; a check not held still gives back its key's
    /// reservations that are due).
    async fn reserve_held(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
    ) -> Result<Verdict, Error> {
        spillway::store::check_settle_id(id)?;
        self.check_with_fallback(checks, Some((id, hold))).await
    }

    /// Gives back the charges with the script's refund mode. A verdict that
    /// did not come from Redis (`decided_at` 0: fail-open, the deny cache)
    /// charged nothing there, so there is nothing to give back; one from the
    /// local fallback is refunded in memory.
    fn refund(
        &self,
        checks: &[Check<'_>],
        charged_at: u64,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        self.give_back(checks, charged_at)
    }

    /// Settles with the script's settle mode, one call per slot, each with
    /// a receipt in its slot that makes the settle apply once
    /// ([`SETTLE_RECEIPT_TTL`](spillway::store::SETTLE_RECEIPT_TTL)). A charge the local fallback made is
    /// settled there; one admitted without a decision (fail-open) charged
    /// nothing, and is not settled.
    fn settle(
        &self,
        id: &str,
        settles: &[Settle<'_>],
    ) -> impl std::future::Future<Output = Result<Settled, Error>> + Send {
        self.settle_charges(id, settles, None, give_back::receipt_ms())
    }

    /// Renews with the script's renew mode, one call per slot; a lease the
    /// local fallback took is renewed there.
    fn renew(
        &self,
        renews: &[Renew<'_>],
    ) -> impl std::future::Future<Output = Result<Vec<Renewed>, Error>> + Send {
        self.renew_leases(renews, None)
    }
}

impl spillway::store::StoreError for Error {
    fn invalid_request(&self) -> Option<&spillway::Error> {
        match self {
            Self::Check(e) => Some(e),
            _ => None,
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("rules", &self.inner.rules)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

/// `prepared`, with the leases of its concurrency checks named (check
/// index, name), for a refund that gives them back by name.
fn named_leases(prepared: &[Prepared], named: &[(usize, u64)]) -> Vec<Prepared> {
    let mut prepared = prepared.to_vec();
    for &(i, end) in named {
        prepared[i].lease = end;
    }
    prepared
}

/// A duration in whole microseconds (saturating).
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::{ErrorKind, RedisError, ServerErrorKind};

    fn server(kind: ServerErrorKind) -> Error {
        Error::Redis(RedisError::from((
            ErrorKind::Server(kind),
            "from the server",
            "3999 127.0.0.1:7001".to_string(),
        )))
    }

    /// An outage (the breaker counts it) is Redis out of reach, refusing
    /// every write, or the cluster changing under the call, a redirect
    /// still given after every resend included; an error of one key's data
    /// or of the request is not.
    #[test]
    fn outages_are_told_from_errors_of_the_data() {
        for kind in [
            ServerErrorKind::Moved,
            ServerErrorKind::Ask,
            ServerErrorKind::TryAgain,
            ServerErrorKind::ClusterDown,
            ServerErrorKind::MasterDown,
            ServerErrorKind::BusyLoading,
            ServerErrorKind::ReadOnly,
        ] {
            assert!(is_outage(&server(kind)), "{kind:?}");
        }
        for kind in [
            ServerErrorKind::ResponseError,
            ServerErrorKind::NoScript,
            ServerErrorKind::CrossSlot,
        ] {
            assert!(!is_outage(&server(kind)), "{kind:?}");
        }
        let io = Error::Redis(RedisError::from(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert!(is_outage(&io));
        let extension =
            |code: &str| Error::Redis(redis::make_extension_error(code.to_string(), None));
        for code in ["BUSY", "OOM", "NOREPLICAS", "MISCONF", "NOAUTH", "NOPERM"] {
            assert!(is_outage(&extension(code)), "{code}");
        }
        assert!(!is_outage(&extension("WRONGTYPE")));
        assert!(is_outage(&Error::Timeout(Duration::from_millis(100))));
        assert!(!is_outage(&Error::Reply("?".into())));
    }
}

// The crate's documentation is its README, so that crates.io and docs.rs
// say the same and the README's example is a doc test.
#![doc = include_str!("../README.md")]

mod cluster;
mod deny_cache;
mod script;

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use deny_cache::DenyCache;
use parking_lot::Mutex;
use spillway::Decision;
use spillway::store::{MemoryOptions, MemoryStore, RuleId};
use tokio::time::Instant;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use spillway::store::{Check, Rule, Store, Verdict};
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

/// What to do when Redis cannot answer (down, or slower than the timeout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnError {
    /// Admit every request: the API stays up, unlimited, until Redis is
    /// back. The default: a rate limiter should not take the API down.
    #[default]
    FailOpen,
    /// Refuse to decide: the store returns [`Error::Unavailable`] or the
    /// Redis error, which the HTTP layer turns into a 503.
    FailClosed,
    /// Decide in memory, each instance enforcing its share of every limit
    /// (limit and burst divided by `instances`), until Redis is back.
    Local {
        /// How many service instances share the limits.
        instances: NonZeroU32,
    },
}

/// How the store talks to Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// The longest a check may wait for Redis (default 50 ms).
    pub timeout: Duration,
    /// Prepended to every key (default `spillway:`).
    pub key_prefix: String,
    /// What to do while Redis cannot answer (default [`OnError::FailOpen`]).
    pub on_error: OnError,
    /// The failure policy of the rules named here (store rule names), in
    /// place of `on_error`: a login limit can fail closed while the
    /// general limits fail open. A request is refused while Redis cannot
    /// answer if any of its rules fails closed; otherwise its `local` rules
    /// are decided in memory and the others admit.
    pub rule_on_error: BTreeMap<String, OnError>,
    /// After a failure, how long to apply `on_error` without asking Redis,
    /// before trying it again (default 250 ms, so Redis is used again well
    /// within a second of coming back).
    pub retry_interval: Duration,
    /// How many denied keys to remember locally (default 100 000; 0 turns
    /// the deny cache off).
    pub deny_cache_entries: usize,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_millis(50),
            key_prefix: "spillway:".to_string(),
            on_error: OnError::FailOpen,
            rule_on_error: BTreeMap::new(),
            retry_interval: Duration::from_millis(250),
            deny_cache_entries: 100_000,
        }
    }
}

/// Counters of what the store did, since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Script calls sent to Redis (a cluster request may need several).
    pub redis_calls: u64,
    /// Calls that failed or timed out.
    pub redis_errors: u64,
    /// Requests admitted without a decision because Redis could not answer.
    pub fail_open: u64,
    /// Requests decided by the in-memory fallback.
    pub local: u64,
    /// Requests denied from the deny cache, without a round trip.
    pub deny_cache_hits: u64,
}

#[derive(Debug, Default)]
struct Counters {
    redis_calls: AtomicU64,
    redis_errors: AtomicU64,
    fail_open: AtomicU64,
    local: AtomicU64,
    deny_cache_hits: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
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
    Standalone(ConnectionManager),
    Cluster(ClusterConnection),
}

/// A [`Store`] on Redis or Redis Cluster.
///
/// On a standalone server, every request costs one script call, whatever
/// the number of rules. On a cluster, the checks are grouped by slot (a
/// script may only touch keys of one slot) and the groups run in parallel;
/// if one group denies while another admitted, the admitted charges are
/// given back by a second call. Between the two calls another request may
/// see those charges and be denied: a window of at most one round trip in
/// which the cluster can be stricter than exact, never looser.
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
    // Set while Redis is considered down: when to try it again.
    down_until: Mutex<Option<Instant>>,
    down: AtomicBool,
    // Shared with the stores `with_rules` makes on the same connection.
    counters: Arc<Counters>,
}

impl Inner {
    /// The store's state for `rules`; the local fallback keeps the counters
    /// of `local_before`'s unchanged rules.
    fn new(
        rules: Vec<Rule>,
        options: RedisOptions,
        local_before: Option<&MemoryStore>,
        counters: Arc<Counters>,
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
            down_until: Mutex::new(None),
            down: AtomicBool::new(false),
            counters,
        })
    }
}

/// The general script and the single-check ones, as Redis runs them
/// (EVALSHA, loaded again on NOSCRIPT by `redis::Script`).
struct Scripts {
    general: redis::Script,
    single: [redis::Script; script::SINGLE_SCRIPTS],
}

impl Scripts {
    fn new(time_override: bool) -> Self {
        Self {
            general: redis::Script::new(&script::source(time_override)),
            single: std::array::from_fn(|family| {
                redis::Script::new(&script::single_source(family, time_override))
            }),
        }
    }
}

/// One check, ready to send.
struct Prepared<'a> {
    key: String,
    params: &'a script::Params,
    cost: u64,
    capacity: u64,
}

/// A decision for a check whose state is unknown (Redis did not answer, or
/// the deny cache answered for another rule): its limit, nothing known used.
fn unknown(capacity: u64) -> Decision {
    Decision {
        allowed: true,
        limit: capacity,
        remaining: capacity,
        reset_after: Duration::ZERO,
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
        let inner = Inner::new(rules, options, None, Arc::default())?;
        let connect_within = timeout.max(Duration::from_secs(1));
        let connection = match topology {
            Topology::Standalone(url) => {
                let client = redis::Client::open(url)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(100));
                let manager = tokio::time::timeout(
                    connect_within,
                    client.get_connection_manager_with_config(config),
                )
                .await
                .map_err(|_| Error::Timeout(connect_within))??;
                Connection::Standalone(manager)
            }
            Topology::Cluster(nodes) => {
                let client = ClusterClientBuilder::new(nodes)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(2)
                    .build()?;
                let connection =
                    tokio::time::timeout(connect_within, client.get_async_connection())
                        .await
                        .map_err(|_| Error::Timeout(connect_within))??;
                Connection::Cluster(connection)
            }
        };
        Ok(Self {
            inner: Arc::new(inner),
            connection,
        })
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
            self.inner.counters.clone(),
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
        let prepared = self.prepare(checks)?;
        self.run(&self.inner.test_scripts, &prepared, Some(now))
            .await
    }

    /// The script call the store makes for `checks` on a standalone server
    /// (its source, keys and arguments), for inspection and benchmarks.
    pub fn script_call(&self, checks: &[Check<'_>]) -> Result<ScriptCall, Error> {
        let prepared = self.prepare(checks)?;
        let group: Vec<usize> = (0..prepared.len()).collect();
        let family = single_family(&prepared, &group, None);
        let mut call = ScriptCall {
            source: match family {
                Some(family) => script::single_source(family, false),
                None => script::source(false),
            },
            keys: Vec::new(),
            args: Vec::new(),
        };
        assemble(&prepared, &group, None, None, family, &mut call);
        Ok(call)
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
        }
    }

    /// Whether the last call to Redis succeeded (or none failed yet).
    pub fn is_healthy(&self) -> bool {
        !self.inner.down.load(Ordering::Relaxed)
    }

    /// The production path: deny cache, then Redis, then the failure policy.
    async fn check_with_fallback(&self, checks: &[Check<'_>]) -> Result<Verdict, Error> {
        let inner = &*self.inner;
        let prepared = self.prepare(checks)?;
        let now = Instant::now();
        if let Some(verdict) = self.cached_denial(&prepared, now) {
            bump(&inner.counters.deny_cache_hits);
            return Ok(verdict);
        }
        if inner.down.load(Ordering::Relaxed) {
            let retry_at = *inner.down_until.lock();
            if retry_at.is_some_and(|at| now < at) {
                return self.fall_back(checks, &prepared, Error::Unavailable);
            }
        }
        match self.run(&inner.scripts, &prepared, None).await {
            Ok(verdict) => {
                if inner.down.swap(false, Ordering::Relaxed) {
                    *inner.down_until.lock() = None;
                }
                if let (false, Some(cache)) = (verdict.allowed, &inner.deny_cache) {
                    let received = Instant::now();
                    for (p, d) in prepared.iter().zip(&verdict.decisions) {
                        if !d.allowed {
                            cache.record(&p.key, p.cost, *d, now, received);
                        }
                    }
                }
                Ok(verdict)
            }
            Err(error) => {
                bump(&inner.counters.redis_errors);
                *inner.down_until.lock() = Some(Instant::now() + inner.options.retry_interval);
                inner.down.store(true, Ordering::Relaxed);
                self.fall_back(checks, &prepared, error)
            }
        }
    }

    /// A denial from the deny cache, if any check of the request has one.
    /// Only the denying check's decision is known; the others report their
    /// limit with nothing known to be used.
    fn cached_denial(&self, prepared: &[Prepared<'_>], now: Instant) -> Option<Verdict> {
        let cache = self.inner.deny_cache.as_ref()?;
        let denied: Vec<Option<Decision>> = prepared
            .iter()
            .map(|p| cache.lookup(&p.key, p.cost, now))
            .collect();
        if denied.iter().all(Option::is_none) {
            return None;
        }
        let decisions = denied
            .into_iter()
            .zip(prepared)
            .map(|(d, p)| d.unwrap_or_else(|| unknown(p.capacity)))
            .collect();
        Some(Verdict {
            allowed: false,
            decisions,
            decided_at: 0,
        })
    }

    /// Applies the failure policy of each check's rule when Redis cannot
    /// answer: refused if any fails closed; otherwise the `local` checks are
    /// decided in memory (all or none, as one request) and the others admit.
    fn fall_back(
        &self,
        checks: &[Check<'_>],
        prepared: &[Prepared<'_>],
        error: Error,
    ) -> Result<Verdict, Error> {
        let inner = &*self.inner;
        let policy = |c: &Check<'_>| inner.on_error.get(c.rule.0).copied().unwrap_or_default();
        if checks.iter().any(|c| policy(c) == OnError::FailClosed) {
            return Err(error);
        }
        let is_local = |c: &Check<'_>| matches!(policy(c), OnError::Local { .. });
        let local_checks: Vec<Check<'_>> = checks.iter().copied().filter(is_local).collect();
        let local = match (&inner.local, local_checks.is_empty()) {
            (Some(local), false) => {
                bump(&inner.counters.local);
                Some(local.check_now(&local_checks)?)
            }
            _ => None,
        };
        if local_checks.len() < checks.len() {
            bump(&inner.counters.fail_open);
        }
        let mut from_local = local.iter().flat_map(|v| v.decisions.iter().copied());
        let decisions = checks
            .iter()
            .zip(prepared)
            .map(|(c, p)| {
                if is_local(c) {
                    from_local.next().unwrap_or_else(|| unknown(p.capacity))
                } else {
                    unknown(p.capacity)
                }
            })
            .collect();
        Ok(Verdict {
            allowed: local.as_ref().is_none_or(|v| v.allowed),
            decisions,
            decided_at: local.as_ref().map_or(0, |v| v.decided_at),
        })
    }

    async fn give_back(&self, checks: &[Check<'_>], charged_at: u64) -> Result<(), Error> {
        if charged_at == 0 {
            return Ok(());
        }
        let prepared = self.prepare(checks)?;
        let groups = self.groups(&prepared);
        let calls = groups.iter().map(|group| {
            self.call(
                &self.inner.scripts,
                &prepared,
                group,
                None,
                Some(charged_at),
            )
        });
        futures_util::future::try_join_all(calls).await?;
        Ok(())
    }

    /// Forgets `key` under `rule`: its state in Redis and its deny-cache
    /// entry. Returns whether Redis held it.
    pub async fn reset(&self, rule: RuleId, key: &str) -> Result<bool, Error> {
        let rule = self
            .inner
            .rules
            .get(rule.0)
            .ok_or(spillway::Error::UnknownRule {
                index: 0,
                rule: rule.0,
            })?;
        let key = script::redis_key(
            &self.inner.options.key_prefix,
            rule.name(),
            rule.algorithm(),
            key,
        );
        if let Some(cache) = &self.inner.deny_cache {
            cache.forget(&key);
        }
        let mut cmd = redis::cmd("DEL");
        cmd.arg(&key);
        let deleted: i64 = self.query(&cmd).await?;
        Ok(deleted > 0)
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, Error> {
        let timeout = self.inner.options.timeout;
        match &self.connection {
            Connection::Standalone(c) => {
                let mut c = c.clone();
                tokio::time::timeout(timeout, cmd.query_async(&mut c)).await
            }
            Connection::Cluster(c) => {
                let mut c = c.clone();
                tokio::time::timeout(timeout, cmd.query_async(&mut c)).await
            }
        }
        .map_err(|_| Error::Timeout(timeout))?
        .map_err(Error::from)
    }

    /// Validates the checks and builds their keys.
    fn prepare<'a>(&'a self, checks: &[Check<'_>]) -> Result<Vec<Prepared<'a>>, Error> {
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
                Ok(Prepared {
                    key: script::redis_key(
                        &inner.options.key_prefix,
                        rule.name(),
                        rule.algorithm(),
                        check.key,
                    ),
                    params: &inner.params[check.rule.0],
                    cost: check.cost,
                    capacity,
                })
            })
            .collect()
    }

    async fn run(
        &self,
        scripts: &Scripts,
        prepared: &[Prepared<'_>],
        now: Option<u64>,
    ) -> Result<Verdict, Error> {
        let groups = self.groups(prepared);
        let calls = groups
            .iter()
            .map(|group| self.call(scripts, prepared, group, now, None));
        let replies = futures_util::future::try_join_all(calls).await?;

        let mut decisions = vec![None; prepared.len()];
        let allowed = replies.iter().all(|r| r.allowed);
        let mut refunds = Vec::new();
        for (group, reply) in groups.iter().zip(&replies) {
            if !allowed && reply.allowed {
                refunds.push(self.call(scripts, prepared, group, now, Some(reply.now)));
            }
            for (&i, d) in group.iter().zip(&reply.decisions) {
                decisions[i] = Some(*d);
            }
        }
        // Give back what the admitting groups took; their decisions become
        // their state as it now stands.
        for refunded in futures_util::future::try_join_all(refunds).await? {
            for (&i, d) in refunded.group.iter().zip(&refunded.decisions) {
                decisions[i] = Some(*d);
            }
        }
        let decisions = decisions
            .into_iter()
            .map(|d| d.ok_or_else(|| Error::Reply("a check got no decision".into())))
            .collect::<Result<_, _>>()?;
        let decided_at = replies.first().map_or(0, |r| r.now);
        Ok(Verdict {
            allowed,
            decisions,
            decided_at,
        })
    }

    /// The checks grouped into script calls: all in one on a standalone
    /// server, one per slot on a cluster.
    fn groups(&self, prepared: &[Prepared<'_>]) -> Vec<Vec<usize>> {
        match self.connection {
            Connection::Standalone(_) => vec![(0..prepared.len()).collect()],
            Connection::Cluster(_) => {
                let mut by_slot: Vec<(u16, Vec<usize>)> = Vec::new();
                for (i, p) in prepared.iter().enumerate() {
                    let slot = cluster::slot(p.key.as_bytes());
                    match by_slot.iter_mut().find(|(s, _)| *s == slot) {
                        Some((_, group)) => group.push(i),
                        None => by_slot.push((slot, vec![i])),
                    }
                }
                by_slot.into_iter().map(|(_, group)| group).collect()
            }
        }
    }

    /// One script call for the checks in `group` (all in one slot): the
    /// single-check script of the check's algorithm when it decides one
    /// check, else the general script.
    async fn call<'g>(
        &self,
        scripts: &Scripts,
        prepared: &[Prepared<'_>],
        group: &'g [usize],
        now: Option<u64>,
        refund_of: Option<u64>,
    ) -> Result<Reply<'g>, Error> {
        let family = single_family(prepared, group, refund_of);
        let mut invocation = match family {
            Some(family) => scripts.single[family].prepare_invoke(),
            None => scripts.general.prepare_invoke(),
        };
        assemble(prepared, group, now, refund_of, family, &mut invocation);
        bump(&self.inner.counters.redis_calls);
        let timeout = self.inner.options.timeout;
        let reply: Vec<i64> = match &self.connection {
            Connection::Standalone(c) => {
                let mut c = c.clone();
                tokio::time::timeout(timeout, invocation.invoke_async(&mut c)).await
            }
            Connection::Cluster(c) => {
                let mut c = c.clone();
                tokio::time::timeout(timeout, invocation.invoke_async(&mut c)).await
            }
        }
        .map_err(|_| Error::Timeout(timeout))??;
        let (allowed, now, decisions) = script::decode(&reply, group.len())?;
        Ok(Reply {
            group,
            allowed,
            now,
            decisions,
        })
    }
}

/// Which single-check script decides `group`: the one of its check's
/// algorithm when it is one check and not a refund; `None` for the general
/// script.
fn single_family(
    prepared: &[Prepared<'_>],
    group: &[usize],
    refund_of: Option<u64>,
) -> Option<usize> {
    match group {
        &[i] if refund_of.is_none() => Some(script::family(prepared[i].params)),
        _ => None,
    }
}

/// Where [`assemble`] puts a script call's keys and arguments: the call
/// itself, or its text for [`RedisStore::script_call`].
trait CallArgs {
    fn key(&mut self, key: &str);
    fn number(&mut self, n: u64);
    fn text(&mut self, s: &str);
}

impl CallArgs for redis::ScriptInvocation<'_> {
    fn key(&mut self, key: &str) {
        redis::ScriptInvocation::key(self, key);
    }
    fn number(&mut self, n: u64) {
        self.arg(n);
    }
    fn text(&mut self, s: &str) {
        self.arg(s);
    }
}

impl CallArgs for ScriptCall {
    fn key(&mut self, key: &str) {
        self.keys.push(key.to_string());
    }
    fn number(&mut self, n: u64) {
        self.args.push(n.to_string());
    }
    fn text(&mut self, s: &str) {
        self.args.push(s.to_string());
    }
}

/// The keys and arguments of the script call for `group`: for a
/// single-check script (`family`), the parameters its algorithm reads, the
/// cost and (only the test build sends one) the time; for the general
/// script, the time or "", the refund's time or "", then each check's
/// algorithm, five parameters and cost.
fn assemble(
    prepared: &[Prepared<'_>],
    group: &[usize],
    now: Option<u64>,
    refund_of: Option<u64>,
    family: Option<usize>,
    out: &mut impl CallArgs,
) {
    if family.is_some() {
        let p = &prepared[group[0]];
        out.key(&p.key);
        script::single_args(p.params)
            .iter()
            .for_each(|&v| out.number(v));
        out.number(p.cost);
        // Only the test build's scripts read it; only it sends one.
        if let Some(t) = now {
            out.number(t);
        }
        return;
    }
    match now {
        Some(t) => out.number(t),
        None => out.text(""),
    }
    match refund_of {
        Some(t) => out.number(t),
        None => out.text(""),
    }
    for &i in group {
        let p = &prepared[i];
        out.key(&p.key);
        p.params.iter().for_each(|&v| out.number(v));
        out.number(p.cost);
    }
}

/// A script call as the store makes it: see [`RedisStore::script_call`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptCall {
    /// The script's Lua source (the store runs it by its SHA1).
    pub source: String,
    /// The keys (`KEYS`).
    pub keys: Vec<String>,
    /// The arguments (`ARGV`).
    pub args: Vec<String>,
}

/// The Redis Cluster slot of a key (CRC16 of its hash tag, mod 16384), as
/// `CLUSTER KEYSLOT` computes it.
pub fn slot(key: &[u8]) -> u16 {
    cluster::slot(key)
}

/// What one script call answered.
struct Reply<'g> {
    group: &'g [usize],
    allowed: bool,
    now: u64,
    decisions: Vec<spillway::Decision>,
}

impl Store for RedisStore {
    type Error = Error;

    fn rules(&self) -> &[Rule] {
        &self.inner.rules
    }

    fn check(
        &self,
        checks: &[Check<'_>],
    ) -> impl std::future::Future<Output = Result<Verdict, Error>> + Send {
        self.check_with_fallback(checks)
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

//! `/metrics`: what the service decided and how its store behaved, in the
//! Prometheus text format (`prometheus-client`).
//!
//! | metric | type | labels | what |
//! | --- | --- | --- | --- |
//! | `spillway_decisions_total` | counter | `rule`, `outcome` | one per rule per decided request; `outcome` is `allowed`, `rejected`, `shadowed`, `degraded`, `error` or `undecided` (admitted by `fail_open`) |
//! | `spillway_store_call_duration_seconds` | histogram | | every store call, memory or Redis |
//! | `spillway_store_errors_total` | counter | `kind` | store calls that returned an error to the service (`timeout`, `redis`, `unavailable`, `reply`, `rule`): requests left undecided |
//! | `spillway_redis_calls_total` | counter | | script calls sent to Redis |
//! | `spillway_redis_errors_total` | counter | | Redis calls that failed or timed out, whatever the failure policy did next |
//! | `spillway_store_fail_open_total` | counter | | requests admitted undecided because Redis could not answer (`on_error = "fail_open"`) |
//! | `spillway_store_local_total` | counter | | requests decided by the in-memory fallback (`on_error = "local"`) |
//! | `spillway_redis_deny_cache_hits_total` | counter | | requests denied from the local deny cache, without a round trip |
//! | `spillway_store_healthy` | gauge | | 1 while the store answers (always 1 in memory) |
//! | `spillway_store_keys` | gauge | `rule` | keys held in memory, per store rule (`rule` or `rule@tier`) |
//! | `spillway_config_reloads_total` | counter | `result` | configuration reloads, `ok` or `error` (refused) |
//! | `spillway_http_requests_in_flight` | gauge | | HTTP requests being served |
//! | `spillway_http_connections` | gauge | | client connections open (`[server] max_connections` at most) |
//! | `spillway_http_connections_refused_total` | counter | | connections refused past `[server] max_connections` (answered 503 and closed) |
//! | `spillway_budget_open` | gauge | `rule` | budget reservations whose response has not ended (docs/budgets.md) |
//! | `spillway_budget_settled_total` | counter | `rule`, `how` | budget reservations closed: `measured`, `left` (the client left mid-response), `cut` (at the budget), `released` (a refused 4xx, a 5xx given back), `kept` (nothing measured: the reservation stands) |
//! | `spillway_budget_overruns_total` | counter | `rule` | responses that cost more than their charges: the rest was charged, in debt if the key had nothing left |
//! | `spillway_budget_exhausted_total` | counter | `rule` | settles that charged more than the reservation and left the key nothing: at its limit, or past it in debt (later requests wait out the exact `Retry-After`) |
//! | `spillway_budget_units_total` | counter | `rule`, `kind` | units `charged` before the settles, and the `actual` cost they were settled at: how far the reservations are from the real costs |
//! | `spillway_budget_given_back_total` | counter | | budget reservations the store gave back because no settle came within the rule's `settle_within` (`on_expiry = "release"`), by this instance's store calls: on Redis, another instance's calls may give back the rest |
//! | `spillway_leases_total` | counter | `rule`, `event` | what became of concurrency leases while their requests ran: `renewed`, `lost`, `retaken`, `released`, `expired` |
//! | `spillway_blocked_total` | counter | `status` | requests a block list entry refused, by the status answered (`403`, `429`): no rule counted them (docs/runtime-limits.md) |
//! | `spillway_state_file_writes_total` | counter | `result` | writes of `[store] state_file`, `ok` or `error` (the last good file stays) |
//! | `spillway_state_file_written_timestamp_seconds` | gauge | | when `[store] state_file` was last written whole (Unix time): what a restart now would lose is what was admitted since |
//!
//! The Redis figures come from the store's own counters. A reload builds a
//! new store, so the old one's counts are kept aside and added in: the
//! counters never go back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use spillway::Decision;
use spillway::store::{RuleId, Store};
use spillway_redis::{Error as StoreError, Stats};
use spillway_tower::{BudgetEvent, LeaseEvent, Observer, RuleOutcome};

use crate::store::{AnyStore, StoreObserver};

/// The `Content-Type` of `/metrics`.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DecisionLabels {
    rule: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RuleLabels {
    rule: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RuleHowLabels {
    rule: String,
    how: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RuleKindLabels {
    rule: String,
    kind: &'static str,
}

/// The budget metrics: reservations open and closed, overruns, units.
#[derive(Debug, Default)]
struct BudgetMetrics {
    open: Family<RuleLabels, Gauge>,
    settled: Family<RuleHowLabels, Counter>,
    overruns: Family<RuleLabels, Counter>,
    exhausted: Family<RuleLabels, Counter>,
    units: Family<RuleKindLabels, Counter>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RuleEventLabels {
    rule: String,
    event: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StatusLabels {
    status: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

const OUTCOMES: [RuleOutcome; 6] = [
    RuleOutcome::Allowed,
    RuleOutcome::Rejected,
    RuleOutcome::Shadowed,
    RuleOutcome::Degraded,
    RuleOutcome::Error,
    RuleOutcome::Undecided,
];

/// The label value of an outcome.
pub fn outcome_name(outcome: RuleOutcome) -> &'static str {
    match outcome {
        RuleOutcome::Allowed => "allowed",
        RuleOutcome::Rejected => "rejected",
        RuleOutcome::Shadowed => "shadowed",
        RuleOutcome::Degraded => "degraded",
        RuleOutcome::Error => "error",
        RuleOutcome::Undecided => "undecided",
    }
}

fn outcome_index(outcome: RuleOutcome) -> usize {
    OUTCOMES
        .iter()
        .position(|o| *o == outcome)
        .expect("every outcome is listed")
}

/// The service's metrics. One per service instance: it is the engine's
/// [`StoreObserver`] and, through [`DecisionObserver`], its layer's
/// [`Observer`].
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    // The decision counters by rule name, so that counting a decision (on
    // every request) looks a name up instead of building a label set.
    by_rule: RwLock<HashMap<Box<str>, [Counter; OUTCOMES.len()]>>,
    store_latency: Histogram,
    store_errors: Family<KindLabels, Counter>,
    reloads: Family<ResultLabels, Counter>,
    in_flight: Gauge,
    connections: Gauge,
    connections_refused: Counter,
    budgets: BudgetMetrics,
    leases: Family<RuleEventLabels, Counter>,
    blocked: Family<StatusLabels, Counter>,
    state_file_writes: Family<ResultLabels, Counter>,
    state_file_written: Gauge,
    // The Redis counters of stores replaced by a reload.
    retired: Mutex<Stats>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics, all zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "spillway_decisions",
            "Rule decisions, by rule and outcome (one per rule that applied to a request)",
            decisions.clone(),
        );
        let store_latency = Histogram::new(exponential_buckets(0.000_025, 2.0, 16));
        registry.register(
            "spillway_store_call_duration_seconds",
            "Time taken by each store call",
            store_latency.clone(),
        );
        let store_errors = Family::<KindLabels, Counter>::default();
        registry.register(
            "spillway_store_errors",
            "Store calls that returned an error, leaving the request undecided",
            store_errors.clone(),
        );
        let reloads = Family::<ResultLabels, Counter>::default();
        registry.register(
            "spillway_config_reloads",
            "Configuration reloads, applied (ok) or refused (error)",
            reloads.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "spillway_http_requests_in_flight",
            "HTTP requests being served",
            in_flight.clone(),
        );
        let connections = Gauge::default();
        registry.register(
            "spillway_http_connections",
            "HTTP client connections open",
            connections.clone(),
        );
        let connections_refused = Counter::default();
        registry.register(
            "spillway_http_connections_refused",
            "HTTP client connections refused past [server] max_connections",
            connections_refused.clone(),
        );
        let budgets = BudgetMetrics::default();
        registry.register(
            "spillway_budget_open",
            "Budget reservations whose response has not ended",
            budgets.open.clone(),
        );
        registry.register(
            "spillway_budget_settled",
            "Budget reservations closed, by how they were settled",
            budgets.settled.clone(),
        );
        registry.register(
            "spillway_budget_overruns",
            "Responses that cost more than their budget charges",
            budgets.overruns.clone(),
        );
        registry.register(
            "spillway_budget_exhausted",
            "Settles whose overrun left the key nothing: at its limit or in debt",
            budgets.exhausted.clone(),
        );
        registry.register(
            "spillway_budget_units",
            "Budget units charged before the settles, and the actual costs settled",
            budgets.units.clone(),
        );
        let leases = Family::<RuleEventLabels, Counter>::default();
        registry.register(
            "spillway_leases",
            "Concurrency leases renewed, lost, retaken, released or expired",
            leases.clone(),
        );
        let blocked = Family::<StatusLabels, Counter>::default();
        registry.register(
            "spillway_blocked",
            "Requests refused by a block list entry, by the status answered",
            blocked.clone(),
        );
        for status in ["403", "429"] {
            drop(blocked.get_or_create(&StatusLabels { status }));
        }
        let state_file_writes = Family::<ResultLabels, Counter>::default();
        registry.register(
            "spillway_state_file_writes",
            "Writes of [store] state_file, ok or error",
            state_file_writes.clone(),
        );
        let state_file_written = Gauge::default();
        registry.register(
            "spillway_state_file_written_timestamp_seconds",
            "When [store] state_file was last written whole, in Unix time",
            state_file_written.clone(),
        );
        // Zeros from the start, so that the series exist before the first
        // error or reload (a rate over a missing series is no rate at all).
        for kind in ["redis", "timeout", "unavailable", "reply", "rule"] {
            drop(store_errors.get_or_create(&KindLabels { kind }));
        }
        for result in ["ok", "error"] {
            drop(reloads.get_or_create(&ResultLabels { result }));
        }
        Self {
            registry,
            decisions,
            by_rule: RwLock::default(),
            store_latency,
            store_errors,
            reloads,
            in_flight,
            connections,
            connections_refused,
            budgets,
            leases,
            blocked,
            state_file_writes,
            state_file_written,
            retired: Mutex::default(),
        }
    }

    /// Counts a request a block list entry refused.
    pub fn blocked(&self, status: http::StatusCode) {
        let status = if status == http::StatusCode::TOO_MANY_REQUESTS {
            "429"
        } else {
            "403"
        };
        self.blocked.get_or_create(&StatusLabels { status }).inc();
    }

    /// Counts what became of a budget rule's reservation.
    pub fn budget(&self, rule: &str, event: BudgetEvent) {
        let b = &self.budgets;
        let labels = RuleLabels {
            rule: rule.to_string(),
        };
        let (how, charged, actual) = match event {
            BudgetEvent::Opened => {
                b.open.get_or_create(&labels).inc();
                return;
            }
            BudgetEvent::Exhausted => {
                b.exhausted.get_or_create(&labels).inc();
                return;
            }
            BudgetEvent::Closed {
                how,
                charged,
                actual,
            } => (how, charged, actual),
        };
        b.open.get_or_create(&labels).dec();
        let how = how.name();
        b.settled
            .get_or_create(&RuleHowLabels {
                rule: rule.to_string(),
                how,
            })
            .inc();
        if actual > charged {
            b.overruns.get_or_create(&labels).inc();
        }
        for (kind, n) in [("charged", charged), ("actual", actual)] {
            b.units
                .get_or_create(&RuleKindLabels {
                    rule: rule.to_string(),
                    kind,
                })
                .inc_by(n);
        }
    }

    /// Counts what became of a concurrency lease.
    pub fn lease(&self, rule: &str, event: LeaseEvent) {
        let event = match event {
            LeaseEvent::Renewed => "renewed",
            LeaseEvent::Lost => "lost",
            LeaseEvent::Retaken => "retaken",
            LeaseEvent::Released => "released",
            LeaseEvent::Expired => "expired",
        };
        self.leases
            .get_or_create(&RuleEventLabels {
                rule: rule.to_string(),
                event,
            })
            .inc();
    }

    /// The gauge of open HTTP connections and the counter of those refused,
    /// for the accept loop to keep.
    pub(crate) fn connection_metrics(&self) -> (Gauge, Counter) {
        (self.connections.clone(), self.connections_refused.clone())
    }

    /// Counts one rule's decision on one request.
    pub fn decision(&self, rule: &str, outcome: RuleOutcome) {
        let i = outcome_index(outcome);
        if let Some(counters) = self
            .by_rule
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(rule)
        {
            counters[i].inc();
            return;
        }
        let counters = OUTCOMES.map(|o| {
            self.decisions
                .get_or_create(&DecisionLabels {
                    rule: rule.to_string(),
                    outcome: outcome_name(o),
                })
                .clone()
        });
        counters[i].inc();
        self.by_rule
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(rule.into())
            .or_insert(counters);
    }

    /// Counts a write of the state file, done or failed.
    pub fn state_file_written(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.state_file_writes
            .get_or_create(&ResultLabels { result })
            .inc();
        if ok {
            let now = spillway::clock::Clock::now(&spillway::clock::SystemClock) / 1_000_000;
            self.state_file_written
                .set(i64::try_from(now).unwrap_or(i64::MAX));
        }
    }

    /// Counts a configuration reload, applied or refused.
    pub fn reload(&self, applied: bool) {
        let result = if applied { "ok" } else { "error" };
        self.reloads.get_or_create(&ResultLabels { result }).inc();
    }

    /// Keeps the Redis counters of an engine that a reload replaced, so that
    /// the totals stay monotonic.
    pub fn retire(&self, old: &AnyStore) {
        if let Some(redis) = old.redis() {
            let s = redis.stats();
            let mut r = self.retired.lock().unwrap_or_else(|e| e.into_inner());
            r.redis_calls += s.redis_calls;
            r.redis_errors += s.redis_errors;
            r.fail_open += s.fail_open;
            r.local += s.local;
            r.deny_cache_hits += s.deny_cache_hits;
            r.refunds += s.refunds;
            r.refund_errors += s.refund_errors;
            r.settles += s.settles;
            r.settle_errors += s.settle_errors;
            r.reservations_given_back += s.reservations_given_back;
            r.data_errors += s.data_errors;
        }
    }

    /// Marks an HTTP request as being served until the guard is dropped.
    pub fn in_flight(self: &Arc<Self>) -> InFlight {
        self.in_flight.inc();
        InFlight(self.clone())
    }

    /// The metrics in the Prometheus text format, with the store's figures
    /// read from `store` now.
    pub fn encode(&self, store: &AnyStore) -> String {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        let retired = *self.retired.lock().unwrap_or_else(|e| e.into_inner());
        let mut now = Registry::default();
        now.register_collector(Box::new(StoreSnapshot::of(store, retired)));
        prometheus_client::encoding::prometheus_text::encode(&mut out, &now)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Counts a request as in flight while it lives.
#[derive(Debug)]
pub struct InFlight(Arc<Metrics>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

impl StoreObserver for Metrics {
    fn store_call(&self, seconds: f64, error: Option<&StoreError>) {
        self.store_latency.observe(seconds);
        let kind = match error {
            None | Some(StoreError::Check(_)) => return,
            Some(StoreError::Redis(_)) => "redis",
            Some(StoreError::Timeout(_)) => "timeout",
            Some(StoreError::Unavailable) => "unavailable",
            Some(StoreError::Reply(_)) => "reply",
            Some(StoreError::Rule { .. }) => "rule",
        };
        self.store_errors.get_or_create(&KindLabels { kind }).inc();
    }
}

/// The [`Observer`] that counts the layer's decisions into [`Metrics`].
#[derive(Debug, Clone)]
pub struct DecisionObserver(pub Arc<Metrics>);

impl Observer for DecisionObserver {
    fn observe(&self, rule: &str, outcome: RuleOutcome, _decision: Option<&Decision>) {
        self.0.decision(rule, outcome);
    }

    fn budget(&self, rule: &str, event: BudgetEvent) {
        self.0.budget(rule, event);
    }

    fn lease(&self, rule: &str, event: LeaseEvent) {
        self.0.lease(rule, event);
    }

    fn blocked(&self, status: http::StatusCode) {
        self.0.blocked(status);
    }
}

/// The store's figures at one scrape.
#[derive(Debug)]
struct StoreSnapshot {
    stats: Stats,
    healthy: bool,
    // On Redis only.
    open_breakers: Option<usize>,
    // (store rule name, keys held), in memory only.
    keys: Vec<(String, usize)>,
}

impl StoreSnapshot {
    fn of(store: &AnyStore, retired: Stats) -> Self {
        let mut stats = retired;
        let mut healthy = true;
        let mut open_breakers = None;
        if let Some(redis) = store.redis() {
            open_breakers = Some(redis.open_breakers());
            let s = redis.stats();
            stats.redis_calls += s.redis_calls;
            stats.redis_errors += s.redis_errors;
            stats.fail_open += s.fail_open;
            stats.local += s.local;
            stats.deny_cache_hits += s.deny_cache_hits;
            stats.refunds += s.refunds;
            stats.refund_errors += s.refund_errors;
            stats.settles += s.settles;
            stats.settle_errors += s.settle_errors;
            stats.reservations_given_back += s.reservations_given_back;
            stats.data_errors += s.data_errors;
            healthy = redis.is_healthy();
        }
        // The memory store's count is shared by the stores reloads make.
        if let Some(memory) = store.memory() {
            stats.reservations_given_back += memory.reservations_released();
        }
        let keys = match store.memory() {
            Some(memory) => store
                .rules()
                .iter()
                .enumerate()
                .map(|(i, rule)| (rule.name().to_string(), memory.len(RuleId(i))))
                .collect(),
            None => Vec::new(),
        };
        Self {
            stats,
            healthy,
            open_breakers,
            keys,
        }
    }
}

impl Collector for StoreSnapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counters = [
            (
                "spillway_redis_calls",
                "Script calls sent to Redis.",
                self.stats.redis_calls,
            ),
            (
                "spillway_redis_errors",
                "Redis calls that failed or timed out.",
                self.stats.redis_errors,
            ),
            (
                "spillway_store_fail_open",
                "Requests admitted undecided because Redis could not answer.",
                self.stats.fail_open,
            ),
            (
                "spillway_store_local",
                "Requests decided by the in-memory fallback while Redis could not answer.",
                self.stats.local,
            ),
            (
                "spillway_redis_deny_cache_hits",
                "Requests denied from the local deny cache, without a round trip.",
                self.stats.deny_cache_hits,
            ),
            (
                "spillway_redis_refunds",
                "Charges given back in Redis (a cluster request another node denied).",
                self.stats.refunds,
            ),
            (
                "spillway_redis_refund_errors",
                "Refunds that failed every attempt: their charges stay until their window frees them.",
                self.stats.refund_errors,
            ),
            (
                "spillway_redis_settles",
                "Settles applied in Redis (an abandoned request's charges given back, a reservation moved to its actual cost).",
                self.stats.settles,
            ),
            (
                "spillway_redis_settle_errors",
                "Settles that failed every attempt: their charges stand as made.",
                self.stats.settle_errors,
            ),
            (
                "spillway_budget_given_back",
                "Budget reservations given back because no settle came in time (on_expiry = \"release\").",
                self.stats.reservations_given_back,
            ),
            (
                "spillway_redis_data_errors",
                "Redis calls that failed on a data error (a key of another type, a corrupt state); the store stays up.",
                self.stats.data_errors,
            ),
        ];
        for (name, help, value) in counters {
            let counter = ConstCounter::new(value);
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        let healthy = ConstGauge::new(i64::from(self.healthy));
        let metric = encoder.encode_descriptor(
            "spillway_store_healthy",
            "1 while the store answers.",
            None,
            healthy.metric_type(),
        )?;
        healthy.encode(metric)?;
        if let Some(open) = self.open_breakers {
            let gauge = ConstGauge::new(i64::try_from(open).unwrap_or(i64::MAX));
            let metric = encoder.encode_descriptor(
                "spillway_redis_open_breakers",
                "Redis breakers open or half open: slots (on a cluster) whose calls failed to answer within the retry interval.",
                None,
                gauge.metric_type(),
            )?;
            gauge.encode(metric)?;
        }
        if !self.keys.is_empty() {
            let mut metric = encoder.encode_descriptor(
                "spillway_store_keys",
                "Keys held in memory, per store rule.",
                None,
                MetricType::Gauge,
            )?;
            for (rule, n) in &self.keys {
                let labels = [("rule", rule.as_str())];
                let family = metric.encode_family(&labels)?;
                ConstGauge::new(*n as i64).encode(family)?;
            }
        }
        Ok(())
    }
}

/// A layer counting the requests in flight (the `in_flight` gauge) for as
/// long as the inner service takes to answer. A plain tower layer rather
/// than `axum::middleware::from_fn`, which clones and boxes the inner service
/// and its future on every request.
#[derive(Debug, Clone)]
pub struct InFlightLayer(pub Arc<Metrics>);

impl<S> tower_layer::Layer<S> for InFlightLayer {
    type Service = CountInFlight<S>;

    fn layer(&self, inner: S) -> CountInFlight<S> {
        CountInFlight {
            inner,
            metrics: self.0.clone(),
        }
    }
}

/// The service of [`InFlightLayer`].
#[derive(Debug, Clone)]
pub struct CountInFlight<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S: tower_service::Service<R>, R> tower_service::Service<R> for CountInFlight<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = CountedFuture<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> CountedFuture<S::Future> {
        CountedFuture {
            _guard: self.metrics.in_flight(),
            inner: self.inner.call(req),
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`CountInFlight`]: the inner future, counted until it
    /// is done or dropped.
    pub struct CountedFuture<F> {
        #[pin]
        inner: F,
        _guard: InFlight,
    }
}

impl<F: std::future::Future> std::future::Future for CountedFuture<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        self.project().inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use spillway_tower::{BudgetEvent, Settled};

    use super::Metrics;

    /// The value of the series `series` in the text of `metrics`.
    fn value(metrics: &Metrics, series: &str) -> Option<f64> {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &metrics.registry)
            .expect("encoded");
        out.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    #[test]
    fn budget_reservations_are_counted_open_and_closed() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.budget("tokens", BudgetEvent::Opened);
        }
        let closed = |how, charged, actual| BudgetEvent::Closed {
            how,
            charged,
            actual,
        };
        m.budget("tokens", closed(Settled::Measured, 100, 250));
        m.budget("tokens", closed(Settled::Kept, 100, 100));
        assert_eq!(
            value(&m, "spillway_budget_open{rule=\"tokens\"}"),
            Some(1.0)
        );
        let settled = |how: &str| {
            value(
                &m,
                &format!("spillway_budget_settled_total{{rule=\"tokens\",how=\"{how}\"}}"),
            )
        };
        assert_eq!(settled("measured"), Some(1.0));
        assert_eq!(settled("kept"), Some(1.0));
        assert_eq!(
            value(&m, "spillway_budget_overruns_total{rule=\"tokens\"}"),
            Some(1.0)
        );
        let units = |kind: &str| {
            value(
                &m,
                &format!("spillway_budget_units_total{{rule=\"tokens\",kind=\"{kind}\"}}"),
            )
        };
        assert_eq!(units("charged"), Some(200.0));
        assert_eq!(units("actual"), Some(350.0));
    }
}

//! `ShouldRateLimit`: Envoy's descriptors mapped onto the configured rules
//! (by their `descriptors` keys, and through the descriptor file's tree),
//! decided in one store call.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use spillway::algorithm::Charged;
use spillway::store::{Check, Settle, Store as _, StoreError as _};
use spillway::{Algorithm as _, Quota};
use spillway_tower::key::key_from_pairs;
use spillway_tower::{
    Asking, BudgetEvent, Charge, Charges, Outcome, OverCapacity, RateLimitFields, Ruling,
    X_SPILLWAY_LIMITED, retry_after_secs,
};
use tonic::{Request, Response, Status};

use super::pb::envoy::config::core::v3::HeaderValue;
use super::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use super::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use super::rls::rate_limit_response::rate_limit::Unit;
use super::rls::rate_limit_response::{Code, DescriptorStatus, RateLimit};
use super::rls::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use super::rls::{RateLimitRequest, RateLimitResponse};
use crate::config::EnvoyLimits;
use crate::config::descriptors::{self, DescriptorTree, Reached, UnitLimit};
use crate::state::{Live, Loaded, OverrideError};

/// The Envoy rate limit service: answers `ShouldRateLimit` with the current
/// engine (a reload takes effect on the next call).
#[derive(Debug, Clone)]
pub struct EnvoyRateLimiter {
    shared: Arc<Live>,
}

impl EnvoyRateLimiter {
    /// The service over `shared`.
    pub fn new(shared: Arc<Live>) -> Self {
        Self { shared }
    }

    /// As a tonic service, to add to a `tonic::transport::Server`: it reads
    /// call messages up to [`EnvoyLimits::max_message_bytes`] of the
    /// current configuration (tonic's default is 4 MiB), so that a call
    /// far over `[envoy] max_descriptors` is refused before it is decoded.
    pub fn into_service(self) -> RateLimitServiceServer<Self> {
        let limit = max_message_bytes(&self.shared);
        RateLimitServiceServer::new(self).max_decoding_message_size(limit)
    }
}

/// When a call reached the server: a request extension set by the gRPC
/// server of [`serve`](super::serve), from which the client's
/// `grpc-timeout` runs (without it, from when the call is decided).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arrived(pub(crate) Instant);

#[tonic::async_trait]
impl RateLimitService for EnvoyRateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let (arrived, deadline, request) = arrival(request);
        let call = request.call();
        let request = &request;
        within_call(&self.shared, arrived, deadline, call, |engine| async move {
            answer(&engine, request).await
        })
        .await
        .map(Response::new)
    }
}

/// When a call arrived (see [`Arrived`]), when its client gives up on it
/// (its `grpc-timeout`), and its message.
pub(super) fn arrival<R>(request: Request<R>) -> (Instant, Option<Instant>, R) {
    let arrived = request
        .extensions()
        .get::<Arrived>()
        .map_or_else(Instant::now, |a| a.0);
    let deadline = grpc_timeout(request.metadata()).map(|t| arrived + t);
    (arrived, deadline, request.into_inner())
}

/// What a call names: its domain and descriptors.
#[derive(Debug, Clone, Copy)]
pub(super) struct Call<'a> {
    pub(super) domain: &'a str,
    pub(super) descriptors: &'a [RateLimitDescriptor],
}

/// A call's message: what it names.
pub(super) trait Names {
    /// Its domain and descriptors.
    fn call(&self) -> Call<'_>;
}

/// The messages that name a domain and descriptors.
macro_rules! names {
    ($($message:ty),*) => {$(
        impl Names for $message {
            fn call(&self) -> Call<'_> {
                Call {
                    domain: &self.domain,
                    descriptors: &self.descriptors,
                }
            }
        }
    )*};
}

names!(
    RateLimitRequest,
    super::pb::kuadrant::service::ratelimit::v1::ReserveRequest,
    super::pb::kuadrant::service::ratelimit::v1::CommitRequest
);

/// The largest call message `shared`'s configuration reads: tonic's default
/// is 4 MiB; this one refuses a call far over `[envoy] max_descriptors`
/// before it is decoded.
pub(super) fn max_message_bytes(shared: &Live) -> usize {
    shared.current().config.envoy_limits.max_message_bytes()
}

/// Decides a call with `decide`, on an engine that counts its limit
/// overrides, held to its bounds (`[envoy] max_descriptors` and
/// `max_entries`) and its deadline.
pub(super) async fn within_call<T, Fut>(
    shared: &Live,
    arrived: Instant,
    deadline: Option<Instant>,
    call: Call<'_>,
    decide: impl FnOnce(Arc<Loaded>) -> Fut,
) -> Result<T, Status>
where
    Fut: Future<Output = Result<T, Status>>,
{
    let engine = shared.current();
    // Before any work: a call too large for its bounds costs no more
    // than reading it.
    within_limits(&engine.config.envoy_limits, call.descriptors)?;
    let decided = async move {
        let mut engine = engine;
        let missing = overrides_missing(&engine, call, arrived)?;
        if !missing.is_empty() {
            engine = shared.with_overrides(&missing).await.map_err(|e| match e {
                OverrideError::TooMany => Status::resource_exhausted(e.to_string()),
                OverrideError::Store(e) => Status::invalid_argument(e.to_string()),
            })?;
        }
        decide(engine).await
    };
    {
        let Some(deadline) = deadline else {
            return decided.await;
        };
        // A call whose client has given up is not decided: nothing is
        // charged for an answer nobody waits for. The deadline is looked at
        // before every step of the decision (biased), so a call first
        // polled after it never reaches the store; one whose client resets
        // the stream is dropped by tonic at its next wait. (A Redis call
        // already sent may still be applied by Redis.)
        let expired = || Status::deadline_exceeded("the call's deadline (grpc-timeout) has passed");
        if Instant::now() >= deadline {
            return Err(expired());
        }
        tokio::select! {
            biased;
            () = tokio::time::sleep_until(deadline) => Err(expired()),
            decided = decided => decided,
        }
    }
}

/// Refuses a call over `[envoy] max_descriptors` or `max_entries`, before
/// anything is looked up or charged.
fn within_limits(limits: &EnvoyLimits, descriptors: &[RateLimitDescriptor]) -> Result<(), Status> {
    let n = descriptors.len();
    if n > limits.max_descriptors.get() {
        return Err(Status::invalid_argument(format!(
            "{n} descriptors in one call; the most is {} (`[envoy] max_descriptors`)",
            limits.max_descriptors
        )));
    }
    let longest = descriptors
        .iter()
        .enumerate()
        .find(|(_, d)| d.entries.len() > limits.max_entries.get());
    if let Some((i, d)) = longest {
        return Err(Status::invalid_argument(format!(
            "descriptor {i} has {} entries; the most is {} (`[envoy] max_entries`)",
            d.entries.len(),
            limits.max_entries
        )));
    }
    Ok(())
}

/// A call's `grpc-timeout` (gRPC over HTTP/2: at most 8 digits and a unit,
/// `H`, `M`, `S`, `m`, `u` or `n`); none when absent or malformed, as tonic
/// takes it.
fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Where a descriptor leads: one of the rules it maps to, or the limit it
/// came with, at a cost.
#[derive(Debug)]
pub(super) struct Mapped {
    pub(super) descriptor: usize,
    source: Source,
    id: spillway::store::RuleId,
    pub(super) cost: u64,
}

/// What a store check counts for.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// A configured rule: its index in the policy.
    Rule(usize),
    /// The descriptor's own limit (Envoy's limit override).
    Override(UnitLimit),
}

impl Mapped {
    /// The configured rule's index in the policy, if it counts for one.
    fn rule(&self) -> Option<usize> {
        match self.source {
            Source::Rule(rule) => Some(rule),
            Source::Override(_) => None,
        }
    }
}

/// A descriptor's limit override as a limit, or (`Err`) the unit of one of
/// 0 requests, which everything is over; a `Status` for a unit we do not
/// know.
fn override_limit(
    limit: &RateLimitOverride,
) -> Result<Result<UnitLimit, descriptors::Unit>, Status> {
    use descriptors::Unit as U;
    // envoy.type.v3.RateLimitUnit's numbers.
    let unit = match limit.unit {
        1 => U::Second,
        2 => U::Minute,
        3 => U::Hour,
        4 => U::Day,
        5 => U::Month,
        6 => U::Year,
        7 => U::Week,
        other => {
            return Err(Status::invalid_argument(format!(
                "a descriptor's limit override needs a unit (second to year), not {other}"
            )));
        }
    };
    Ok(std::num::NonZeroU32::new(limit.requests_per_unit)
        .map(|requests_per_unit| UnitLimit {
            requests_per_unit,
            unit,
        })
        .ok_or(unit))
}

/// The limit overrides of `request` that `engine` does not count yet (a
/// request for another domain has none: its descriptors are not looked at).
/// Those it counts are marked used at `now`, which keeps their slots from
/// going to new overrides (see [`Live::with_overrides`]).
fn overrides_missing(
    engine: &Loaded,
    call: Call<'_>,
    now: Instant,
) -> Result<Vec<UnitLimit>, Status> {
    let mut missing = Vec::new();
    if call.domain != engine.config.envoy_domain {
        return Ok(missing);
    }
    for descriptor in call.descriptors {
        if let Some(limit) = &descriptor.limit
            && let Ok(limit) = override_limit(limit)?
            && engine.use_override(limit, now).is_none()
            && !missing.contains(&limit)
        {
            missing.push(limit);
        }
    }
    Ok(missing)
}

/// Decides on one request: maps its descriptors onto charges, asks the
/// engine, and answers with each descriptor's status and the headers.
async fn answer(engine: &Loaded, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
    let call = request.call();
    if !for_this_domain(engine, call)? {
        return Ok(nothing_limited(call));
    }
    let mut mapping = map_descriptors(engine, call, addend(request), true)?;
    // Envoy AI Gateway's pair of calls, on a rule that says so: the one
    // after the response is charged whatever is left, then only looked at
    // with the rest; the one before it (0 hits) is over the limit when
    // nothing is left.
    // (Nothing is allocated for it unless a rule says so.)
    let envoy_rules = &engine.config.envoy_rules;
    let (after, costs): (Vec<bool>, Vec<u64>) = if envoy_rules.iter().any(|e| e.hits_after_response)
    {
        let of = |m: &Mapped| {
            m.rule()
                .and_then(|r| envoy_rules.get(r))
                .is_some_and(|e| e.hits_after_response)
        };
        mapping.mapped.iter().map(|m| (of(m), m.cost)).unzip()
    } else {
        (Vec::new(), Vec::new())
    };
    if after.contains(&true) {
        let charges = charges_of(engine, call, &mapping)?;
        let reported: Vec<&Charge> = charges
            .iter()
            .zip(&after)
            .filter(|(c, after)| **after && c.cost() > 0)
            .map(|(c, _)| c)
            .collect();
        charge_regardless(engine, &reported).await?;
        for (m, _) in mapping.mapped.iter_mut().zip(&after).filter(|(_, a)| **a) {
            m.cost = 0;
        }
    }
    let charges = charges_of(engine, call, &mapping)?;
    let deciding = engine.layer.engine();
    // As envoyproxy/ratelimit: a descriptor over a limit it can never pass
    // (a cost above the rule's capacity, a limit of 0) is OVER_LIMIT, and
    // then nothing is charged: the others are only looked at.
    let asking = Asking {
        over_capacity: OverCapacity::Deny,
        look_only: mapping.zero_limit.iter().any(Option::is_some),
        hold_every: false,
        hold_at_most: None,
    };
    let ruling = deciding.decide(charges, asking).await;
    match ruling.outcome() {
        Outcome::BadRequest(message) => return Err(Status::invalid_argument(message.clone())),
        // The store's failure policy has already been applied: this is
        // fail-closed (or no policy could answer), so Envoy's own
        // failure_mode_deny decides.
        Outcome::Unavailable(message) => return Err(Status::unavailable(message.clone())),
        _ => {}
    }
    let nothing_left = |i: usize| {
        after.get(i).is_some_and(|&a| a)
            && costs[i] == 0
            && ruling.decision(i).is_some_and(|d| d.remaining == 0)
    };
    let statuses = statuses(engine, &mapping, &ruling, &|i| {
        ruling.denies(i) || nothing_left(i)
    });
    let over = statuses
        .iter()
        .any(|s| s.code == i32::from(Code::OverLimit));

    let (response_headers, request_headers) = headers_of(engine, &ruling, over);
    Ok(RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok }.into(),
        statuses,
        response_headers_to_add: response_headers,
        request_headers_to_add: request_headers,
        ..RateLimitResponse::default()
    })
}

/// The headers Envoy adds to the response (our rate-limit fields, and
/// Retry-After when over the limit) and to the request it lets through
/// (the degrade mark).
pub(super) fn headers_of(
    engine: &Loaded,
    ruling: &Ruling,
    over: bool,
) -> (Vec<HeaderValue>, Vec<HeaderValue>) {
    let deciding = engine.layer.engine();
    // Our headers, as the middleware writes them: every rule that decided,
    // X-RateLimit-* and RateLimit for the most restrictive.
    let mut response_headers = envoy_headers(deciding.fields(ruling));
    let retry = ruling
        .reported()
        .and_then(|shown| ruling.decision(shown)?.retry_after);
    if over && let Some(retry) = retry {
        // As on the middleware's 429.
        response_headers.push(header("retry-after", &retry_after_secs(retry).to_string()));
    }
    // Requests a degrade rule denied go on, marked for the upstream (and the
    // client) like the middleware marks them.
    let mut request_headers = Vec::new();
    if let Outcome::Admitted { limited, .. } = ruling.outcome()
        && !over
        && !limited.is_empty()
    {
        let mut unique: Vec<&str> = Vec::new();
        for name in limited {
            if !unique.contains(&name.as_str()) {
                unique.push(name);
            }
        }
        let value = unique.join(", ");
        request_headers.push(header(X_SPILLWAY_LIMITED.as_str(), &value));
        response_headers.push(header(X_SPILLWAY_LIMITED.as_str(), &value));
    }

    (response_headers, request_headers)
}

/// Whether a well-formed call is for the domain this service answers for;
/// a malformed one (no domain, no descriptors) is an error, as
/// envoyproxy/ratelimit answers.
pub(super) fn for_this_domain(engine: &Loaded, call: Call<'_>) -> Result<bool, Status> {
    if call.domain.is_empty() {
        return Err(Status::invalid_argument(
            "the rate limit domain must not be empty",
        ));
    }
    if call.descriptors.is_empty() {
        return Err(Status::invalid_argument(
            "the descriptor list must not be empty",
        ));
    }
    let ours = call.domain == engine.config.envoy_domain;
    if !ours {
        tracing::debug!(domain = %call.domain, "unknown rate limit domain: nothing is limited");
    }
    Ok(ours)
}

/// The answer to a call for another domain. Like envoyproxy/ratelimit: a
/// domain with no configuration limits nothing (an error would make Envoy
/// apply its failure mode instead).
pub(super) fn nothing_limited(call: Call<'_>) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: Code::Ok.into(),
        statuses: vec![unlimited(); call.descriptors.len()],
        ..RateLimitResponse::default()
    }
}

/// A request's cost: Envoy's unset (0) `hits_addend` means 1.
pub(super) fn addend(request: &RateLimitRequest) -> u64 {
    u64::from(request.hits_addend.max(1))
}

/// The engine's charges of a call's mapping, one per mapped rule or
/// override, in order.
pub(super) fn charges_of(
    engine: &Loaded,
    call: Call<'_>,
    mapping: &Mapping,
) -> Result<Charges, Status> {
    let deciding = engine.layer.engine();
    let keys: Vec<String> = call.descriptors.iter().map(key_of).collect();
    mapping
        .mapped
        .iter()
        .map(|m| match m.source {
            Source::Rule(rule) => {
                Some(deciding.charge(rule, None, keys[m.descriptor].clone(), m.cost))
            }
            Source::Override(_) => deciding.charge_own(m.id, keys[m.descriptor].clone(), m.cost),
        })
        .collect::<Option<Charges>>()
        .ok_or_else(|| Status::internal("a limit override has no store rule"))
}

/// Charges each of `charges` its cost whatever its key has left, past a
/// limit as debt that later requests wait out (at most one quota of it, as
/// a settle's overrun): a settle of a charge of nothing, made at the
/// store's time of a look, so that each key's part is atomic and its time
/// is the store's. What a response cost, known after it: Kuadrant's
/// `Report`, and Envoy AI Gateway's call after the response.
pub(super) async fn charge_regardless(engine: &Loaded, charges: &[&Charge]) -> Result<(), Status> {
    if charges.is_empty() {
        return Ok(());
    }
    let deciding = engine.layer.engine();
    let store = deciding.store();
    let looks: Vec<Check<'_>> = charges
        .iter()
        .map(|c| Check {
            rule: c.rule_id(),
            key: c.key(),
            cost: 0,
        })
        .collect();
    let looked = store.check(&looks).await.map_err(|e| store_status(&e))?;
    if !looked.undecided.is_empty() {
        // Nothing is charged: the report may be sent again.
        return Err(Status::unavailable(
            "the rate limiter cannot reach its store: nothing was charged",
        ));
    }
    let settles: Vec<Settle<'_>> = charges
        .iter()
        .zip(&looked.decisions)
        .map(|(c, d)| Settle {
            rule: c.rule_id(),
            key: c.key(),
            charged: Charged::of(0, looked.decided_at, d),
            actual: c.cost(),
        })
        .collect();
    let settled = store
        .settle_unrepeated(&crate::api::settle::new_id("kp"), &settles)
        .await
        .map_err(|e| store_status(&e))?;
    if let Some(observer) = deciding.observer() {
        for (c, d) in charges.iter().zip(&settled.decisions) {
            if d.remaining == 0 {
                observer.budget(deciding.rule_name(c), BudgetEvent::Exhausted);
            }
        }
    }
    Ok(())
}

/// A store's error as a call's status: a request it can never decide is
/// the caller's error; otherwise it is unavailable.
pub(super) fn store_status(e: &spillway_redis::Error) -> Status {
    match e.invalid_request() {
        Some(invalid) => Status::invalid_argument(invalid.to_string()),
        None => Status::unavailable(format!("the rate limiter cannot reach its store: {e}")),
    }
}

/// A request's descriptors, mapped onto what counts them.
pub(super) struct Mapping {
    /// Every descriptor's rules and overrides, in descriptor order.
    pub(super) mapped: Vec<Mapped>,
    /// The descriptors the file's tree says are `unlimited`.
    unlimited_in_file: Vec<bool>,
    /// The descriptors whose limit override is 0 requests per unit: over
    /// it whatever the state, with the unit of that override.
    pub(super) zero_limit: Vec<Option<descriptors::Unit>>,
}

/// Maps each descriptor onto the rules whose `descriptors` keys it has,
/// and the one the descriptor file's tree leads to, or onto its own limit,
/// at `request_cost`; with `descriptor_costs`, a descriptor's own
/// `hits_addend` wins (Envoy's: present, it may be 0 to only look).
pub(super) fn map_descriptors(
    engine: &Loaded,
    call: Call<'_>,
    request_cost: u64,
    descriptor_costs: bool,
) -> Result<Mapping, Status> {
    let config = &engine.config;
    let policy = &config.policy;
    let tree = config.descriptor_tree.as_ref();
    let n = call.descriptors.len();
    let mut mapping = Mapping {
        mapped: Vec::new(),
        unlimited_in_file: vec![false; n],
        zero_limit: vec![None; n],
    };
    for (d, descriptor) in call.descriptors.iter().enumerate() {
        let cost = match descriptor.hits_addend {
            Some(own) if descriptor_costs => own,
            _ => request_cost,
        };
        if let Some(limit) = &descriptor.limit {
            // As envoyproxy/ratelimit: the descriptor's own limit is its
            // one limit, in place of whatever the configuration says.
            match override_limit(limit)? {
                Ok(limit) => mapping.mapped.push(Mapped {
                    descriptor: d,
                    source: Source::Override(limit),
                    id: engine
                        .override_id(limit)
                        .ok_or_else(|| Status::internal("a limit override has no store rule"))?,
                    cost,
                }),
                Err(unit) => mapping.zero_limit[d] = Some(unit),
            }
            continue;
        }
        let reached = match tree.map(|t| reached(t, descriptor)) {
            Some(Reached::Rule(rule)) => Some(rule),
            Some(Reached::Unlimited) => {
                mapping.unlimited_in_file[d] = true;
                None
            }
            Some(Reached::Nothing) | None => None,
        };
        for rule in rules_for(&config.descriptors, descriptor).chain(reached) {
            mapping.mapped.push(Mapped {
                descriptor: d,
                source: Source::Rule(rule),
                id: policy.rule_id(rule, None),
                cost,
            });
        }
    }
    // As in envoyproxy/ratelimit: a rate limit of the file with `replaces`
    // takes the place of those it names when one request reaches both.
    if let Some(tree) = tree {
        // By rule index: one look per check, not a scan of the replaced.
        let mut replaced = vec![false; policy.rules().len()];
        let mut any = false;
        for rule in mapping.mapped.iter().filter_map(Mapped::rule) {
            for &r in tree.replaced_by(rule) {
                replaced[r] = true;
                any = true;
            }
        }
        if any {
            mapping
                .mapped
                .retain(|m| m.rule().is_none_or(|rule| !replaced[rule]));
        }
    }
    Ok(mapping)
}

/// Each descriptor's status: the most restrictive of its charges, over the
/// limit if one of them is `over`.
pub(super) fn statuses(
    engine: &Loaded,
    mapping: &Mapping,
    ruling: &Ruling,
    over: &dyn Fn(usize) -> bool,
) -> Vec<DescriptorStatus> {
    let deciding = engine.layer.engine();
    let tree = engine.config.descriptor_tree.as_ref();
    let mapped = &mapping.mapped;
    let mut statuses = Vec::with_capacity(mapping.zero_limit.len());
    for (d, &file_says_unlimited) in mapping.unlimited_in_file.iter().enumerate() {
        if let Some(unit) = mapping.zero_limit[d] {
            statuses.push(DescriptorStatus {
                code: Code::OverLimit.into(),
                current_limit: Some(RateLimit {
                    name: format!(
                        "{}0-per-{}",
                        crate::config::descriptors::OVERRIDE_PREFIX,
                        unit.name()
                    ),
                    requests_per_unit: 0,
                    unit: response_unit(unit).unwrap_or(Unit::Unknown).into(),
                }),
                ..DescriptorStatus::default()
            });
            continue;
        }
        // `mapped` is in descriptor order: descriptor d's charges are the
        // run found by bisection, not by a scan of every charge (which made
        // a call of n descriptors cost n²).
        let first = mapped.partition_point(|m| m.descriptor < d);
        let end = first + mapped[first..].partition_point(|m| m.descriptor == d);
        let Some(shown) = ruling.reported_among(first..end) else {
            statuses.push(if file_says_unlimited {
                // As envoyproxy/ratelimit answers for an unlimited one.
                DescriptorStatus {
                    limit_remaining: u32::MAX,
                    ..unlimited()
                }
            } else {
                unlimited()
            });
            continue;
        };
        let decision = ruling.decision(shown).expect("decided");
        let charge = &ruling.charges()[shown];
        let name = deciding.rule_name(charge);
        let algorithm = deciding.store().rules()[charge.rule_id().0].algorithm();
        let quota = algorithm.quota();
        let configured = match mapped[shown].source {
            Source::Rule(rule) => tree.and_then(|t| t.limit_of(rule)),
            Source::Override(limit) => Some(limit),
        };
        statuses.push(DescriptorStatus {
            code: if (first..end).any(over) {
                Code::OverLimit
            } else {
                Code::Ok
            }
            .into(),
            current_limit: Some(
                configured
                    .and_then(|limit| as_configured(name, limit))
                    .or_else(|| calendar_limit(name, algorithm))
                    .unwrap_or_else(|| current_limit(name, quota)),
            ),
            limit_remaining: u32::try_from(decision.remaining).unwrap_or(u32::MAX),
            duration_until_reset: Some(
                prost_types::Duration::try_from(decision.reset_after).unwrap_or_default(),
            ),
        });
    }
    statuses
}

/// The rate-limit fields as Envoy's header list.
fn envoy_headers(fields: RateLimitFields) -> Vec<HeaderValue> {
    fields
        .iter()
        .map(|(name, value)| header(name.as_str(), &String::from_utf8_lossy(value)))
        .collect()
}

/// The status of a descriptor no rule limits.
fn unlimited() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok.into(),
        ..DescriptorStatus::default()
    }
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.to_string(),
        value: value.to_string(),
    }
}

/// The rules a descriptor maps to: those whose `descriptors` list is its
/// entry keys, in order.
fn rules_for<'a>(
    descriptors: &'a [Vec<String>],
    descriptor: &'a RateLimitDescriptor,
) -> impl Iterator<Item = usize> + 'a {
    descriptors.iter().enumerate().filter_map(move |(i, keys)| {
        let matches = !keys.is_empty()
            && keys.len() == descriptor.entries.len()
            && keys
                .iter()
                .zip(&descriptor.entries)
                .all(|(k, e)| *k == e.key);
        matches.then_some(i)
    })
}

/// Where a descriptor's entries lead in the descriptor file's tree.
fn reached(tree: &DescriptorTree, descriptor: &RateLimitDescriptor) -> Reached {
    tree.find(
        descriptor
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str())),
    )
}

/// A rate limit of the descriptor file as it is written there, if the
/// version of Envoy's API this service speaks has its unit (it has no week).
fn as_configured(name: &str, limit: UnitLimit) -> Option<RateLimit> {
    Some(RateLimit {
        name: name.to_string(),
        requests_per_unit: limit.requests_per_unit.get(),
        unit: response_unit(limit.unit)?.into(),
    })
}

/// A unit as the answer's `RateLimit` names it, if it has it (not a week).
fn response_unit(unit: descriptors::Unit) -> Option<Unit> {
    Some(match unit {
        descriptors::Unit::Second => Unit::Second,
        descriptors::Unit::Minute => Unit::Minute,
        descriptors::Unit::Hour => Unit::Hour,
        descriptors::Unit::Day => Unit::Day,
        descriptors::Unit::Month => Unit::Month,
        descriptors::Unit::Year => Unit::Year,
        descriptors::Unit::Week => return None,
    })
}

/// The store key of a descriptor: its entries as `key=value` pairs,
/// escaped and bounded like the middleware's keys.
fn key_of(descriptor: &RateLimitDescriptor) -> String {
    key_from_pairs(
        descriptor
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str())),
    )
}

/// A quota as Envoy's requests per unit: the unit is the smallest of
/// second, minute, hour and day that holds the whole window (a day for
/// longer windows), and the count is the quota's rate over that unit,
/// rounded down but at least 1. A window of exactly one unit keeps its
/// limit: 100 per minute is `100/MINUTE`; 100 per 10s is `600/MINUTE`.
/// A calendar window's limit as Envoy's: per day or per month, as it is
/// counted (a week, which this version of Envoy's API has no unit for,
/// is told as its rate per day, like any other window).
fn calendar_limit(name: &str, algorithm: &spillway::algorithm::AnyAlgorithm) -> Option<RateLimit> {
    use spillway::algorithm::{AnyAlgorithm, Period};
    let AnyAlgorithm::FixedWindow(fw) = algorithm else {
        return None;
    };
    let unit = match fw.calendar_of()?.period() {
        Period::Day => Unit::Day,
        Period::Month => Unit::Month,
        Period::Week => return None,
    };
    Some(RateLimit {
        name: name.to_string(),
        requests_per_unit: algorithm.quota().limit().get(),
        unit: unit.into(),
    })
}

fn current_limit(name: &str, quota: Quota) -> RateLimit {
    const UNITS: [(Unit, u64); 4] = [
        (Unit::Second, 1_000_000),
        (Unit::Minute, 60_000_000),
        (Unit::Hour, 3_600_000_000),
        (Unit::Day, 86_400_000_000),
    ];
    let period = quota.period_micros();
    let (unit, micros) = UNITS
        .into_iter()
        .find(|&(_, micros)| period <= micros)
        .unwrap_or(UNITS[3]);
    let per_unit = u128::from(quota.limit().get()) * u128::from(micros) / u128::from(period.max(1));
    RateLimit {
        name: name.to_string(),
        requests_per_unit: u32::try_from(per_unit).unwrap_or(u32::MAX).max(1),
        unit: unit.into(),
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    fn quota(limit: u32, period: Duration) -> Quota {
        Quota::new(NonZeroU32::new(limit).unwrap(), period).unwrap()
    }

    fn per_unit(limit: u32, period: Duration) -> (u32, Unit) {
        let l = current_limit("r", quota(limit, period));
        (l.requests_per_unit, l.unit())
    }

    #[test]
    fn whole_units_keep_their_limit() {
        assert_eq!(per_unit(5, Duration::from_secs(1)), (5, Unit::Second));
        assert_eq!(per_unit(100, Duration::from_secs(60)), (100, Unit::Minute));
        assert_eq!(per_unit(7, Duration::from_secs(3600)), (7, Unit::Hour));
        assert_eq!(
            per_unit(1000, Duration::from_secs(86_400)),
            (1000, Unit::Day)
        );
    }

    #[test]
    fn other_windows_scale_to_the_unit_that_holds_them() {
        assert_eq!(per_unit(100, Duration::from_secs(10)), (600, Unit::Minute));
        assert_eq!(per_unit(10, Duration::from_millis(500)), (20, Unit::Second));
        assert_eq!(per_unit(60, Duration::from_secs(90)), (2400, Unit::Hour));
        // Longer than a day: per day, never 0.
        assert_eq!(per_unit(1, Duration::from_secs(7 * 86_400)), (1, Unit::Day));
        assert_eq!(
            per_unit(70, Duration::from_secs(7 * 86_400)),
            (10, Unit::Day)
        );
    }

    #[test]
    fn a_descriptor_maps_to_rules_with_the_same_keys_in_order() {
        use super::super::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
        let d = |keys: &[&str]| RateLimitDescriptor {
            entries: keys
                .iter()
                .map(|k| Entry {
                    key: k.to_string(),
                    value: "v".into(),
                })
                .collect(),
            ..RateLimitDescriptor::default()
        };
        let config: Vec<Vec<String>> = vec![
            vec!["remote_address".into()],
            vec![],
            vec!["path".into(), "remote_address".into()],
            vec!["remote_address".into()],
        ];
        let rules = |keys: &[&str]| rules_for(&config, &d(keys)).collect::<Vec<_>>();
        assert_eq!(rules(&["remote_address"]), [0, 3]);
        assert_eq!(rules(&["path", "remote_address"]), [2]);
        assert!(rules(&["remote_address", "path"]).is_empty());
        assert!(rules(&["path"]).is_empty());
        assert!(rules(&[]).is_empty());
    }
}

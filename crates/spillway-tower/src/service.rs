//! [`RateLimit`]: the middleware service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use spillway::Decision;
use spillway::store::{Check, RuleId, Store, StoreError};
use tower_service::Service;

use crate::future::{ResponseBody, ResponseFuture};
use crate::headers::{self, Applied};
use crate::key::Client;
use crate::layer::{Outcome, Shared, outcome_of};
use crate::response;
use crate::rules::{Action, Cost, Policy};

/// The request header (and response header) that marks a request let
/// through by a `degrade` rule that denied it.
pub const X_SPILLWAY_LIMITED: HeaderName = HeaderName::from_static("x-spillway-limited");

/// A request extension set on requests let through by a `degrade` rule that
/// denied them: the handler can serve a cheaper response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limited {
    /// The rules that denied the request.
    pub rules: Vec<String>,
}

/// A request extension, set by a layer in front, giving the request's cost
/// for rules whose cost comes from a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCost(pub u64);

/// Applies the rate limits, then calls the inner service `S`. See
/// [`RateLimitLayer`](crate::RateLimitLayer).
pub struct RateLimit<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S, St> RateLimit<S, St> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<St>>) -> Self {
        Self { inner, shared }
    }
}

impl<S: Clone, St> Clone for RateLimit<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for RateLimit<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Only the inner service's readiness: denials are answered at once
        // in `call`, never by holding requests here.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The clone takes the place of the service that was made ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(handle(self.shared.clone(), inner, req))
    }
}

/// One rule that applies to a request.
struct Planned {
    index: usize,
    id: RuleId,
    key: String,
    cost: u64,
}

/// The rules that apply, with their keys and costs; or a 400's message.
fn plan(policy: &Policy, client: &Client, parts: &Parts) -> Result<Vec<Planned>, String> {
    let tier = policy.tier_of(client);
    let mut planned = Vec::new();
    for (index, rule) in policy.rules.iter().enumerate() {
        if !rule.matches(parts) {
            continue;
        }
        let Some(key) = rule.key_of(client, parts) else {
            continue;
        };
        let cost = match &rule.cost {
            Cost::Fixed(c) => *c,
            Cost::Header { name, default } => match parts.extensions.get::<RequestCost>() {
                Some(RequestCost(c)) => *c,
                None => match parts.headers.get(name).filter(|_| client.peer_trusted) {
                    None => *default,
                    Some(v) => v
                        .to_str()
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                        .ok_or_else(|| {
                            format!("header `{name}` must be a non-negative integer cost")
                        })?,
                },
            },
        };
        planned.push(Planned {
            index,
            id: policy.rule_id(index, tier),
            key,
            cost,
        });
    }
    Ok(planned)
}

async fn handle<S, St, ReqBody, ResBody>(
    shared: Arc<Shared<St>>,
    mut inner: S,
    req: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store + 'static,
{
    let policy = &shared.policy;
    let (mut parts, body) = req.into_parts();
    let client = Client::of(&parts, &policy.clients);
    let planned = match plan(policy, &client, &parts) {
        Ok(p) => p,
        Err(message) => return Ok(response::problem(StatusCode::BAD_REQUEST, &message)),
    };
    if planned.is_empty() {
        let res = inner.call(Request::from_parts(parts, body)).await?;
        return Ok(res.map(ResponseBody::inner));
    }
    let action = |p: &Planned| policy.rules[p.index].action;
    let name = |p: &Planned| policy.rules[p.index].name.as_str();

    // Decide. A denial by a `reject` rule ends it, charging nothing. A denial
    // only by shadow/degrade rules lets the request through: the rules that
    // admitted it must then be charged, so they are asked again without the
    // denying ones (one more round trip, only when a non-rejecting rule is
    // over its limit).
    let mut decisions: Vec<Option<Decision>> = vec![None; planned.len()];
    let mut active: Vec<usize> = (0..planned.len()).collect();
    let mut limited: Vec<usize> = Vec::new();
    let mut rejected_by: Option<usize> = None;
    let mut charged: Option<(Vec<usize>, u64)> = None;
    while !active.is_empty() {
        let checks: Vec<Check<'_>> = active
            .iter()
            .map(|&p| Check {
                rule: planned[p].id,
                key: &planned[p].key,
                cost: planned[p].cost,
            })
            .collect();
        let verdict = match shared.store.check(&checks).await {
            Ok(v) => v,
            Err(e) => return Ok(store_error(&shared, &planned, &e)),
        };
        for (&p, d) in active.iter().zip(&verdict.decisions) {
            decisions[p] = Some(*d);
        }
        if verdict.allowed {
            charged = Some((active.clone(), verdict.decided_at));
            break;
        }
        let denying: Vec<usize> = active
            .iter()
            .zip(&verdict.decisions)
            .filter(|(_, d)| !d.allowed)
            .map(|(&p, _)| p)
            .collect();
        if let Some(&p) = denying
            .iter()
            .find(|&&p| action(&planned[p]) == Action::Reject)
        {
            rejected_by = Some(p);
            break;
        }
        limited.extend(&denying);
        active.retain(|p| !denying.contains(p));
    }

    if let Some(observer) = &shared.observer {
        for (p, plan) in planned.iter().enumerate() {
            let outcome = match decisions[p] {
                Some(d) if !d.allowed => outcome_of(action(plan)),
                Some(_) => Outcome::Allowed,
                None => continue,
            };
            observer.observe(name(plan), outcome, decisions[p].as_ref());
        }
    }

    // Headers describe every rule that decided; X-RateLimit-* and RateLimit
    // the most restrictive: the rejecting rule, else the least remaining.
    let applied: Vec<(usize, Applied<'_>)> = planned
        .iter()
        .enumerate()
        .filter_map(|(p, plan)| {
            let decision = decisions[p]?;
            let algorithm = policy.rules[plan.index].algorithm;
            let quota = spillway::Algorithm::quota(&algorithm);
            let window = quota.period() * u32::try_from(decision.limit).unwrap_or(u32::MAX)
                / quota.limit().get();
            Some((
                p,
                Applied {
                    name: name(plan),
                    decision,
                    window_secs: headers::ceil_secs(window),
                },
            ))
        })
        .collect();
    let restrictive = rejected_by
        .and_then(|r| applied.iter().position(|(p, _)| *p == r))
        .or_else(|| {
            (0..applied.len())
                .min_by_key(|&i| (applied[i].1.decision.remaining, applied[i].1.decision.limit))
        })
        .unwrap_or(0);
    let applied_only: Vec<Applied<'_>> = applied.iter().map(|(_, a)| a.clone()).collect();

    if let Some(p) = rejected_by {
        let decision = decisions[p].expect("the rejecting rule decided");
        let retry = response::retry_secs(decision.retry_after.unwrap_or(Duration::from_secs(1)));
        tracing::debug!(rule = name(&planned[p]), key = %planned[p].key, retry, "rate limited");
        let mut res = response::too_many_requests(policy.body, name(&planned[p]), retry);
        headers::write(
            res.headers_mut(),
            &policy.headers,
            &applied_only,
            restrictive,
        );
        return Ok(res);
    }

    let mut limited_names = Vec::new();
    for &p in &limited {
        match action(&planned[p]) {
            Action::Shadow => {
                tracing::info!(rule = name(&planned[p]), key = %planned[p].key, "shadow rule would have denied");
            }
            _ => limited_names.push(name(&planned[p]).to_string()),
        }
    }
    if !limited_names.is_empty() {
        if let Ok(v) = HeaderValue::try_from(limited_names.join(", ")) {
            parts.headers.insert(X_SPILLWAY_LIMITED, v);
        }
        parts.extensions.insert(Limited {
            rules: limited_names.clone(),
        });
    }

    // Shaping: hold the request until its turn. If the client goes away
    // meanwhile, the charges are given back.
    let delay = decisions
        .iter()
        .flatten()
        .map(|d| d.delay)
        .max()
        .unwrap_or_default();
    if !delay.is_zero()
        && let Some((charged_plan, at)) = &charged
    {
        let guard = RefundOnDrop {
            shared: shared.clone(),
            checks: charged_plan
                .iter()
                .map(|&p| (planned[p].id, planned[p].key.clone(), planned[p].cost))
                .collect(),
            charged_at: *at,
            armed: true,
        };
        tokio::time::sleep(delay).await;
        guard.disarm();
    }

    let mut res = inner
        .call(Request::from_parts(parts, body))
        .await?
        .map(ResponseBody::inner);
    headers::write(
        res.headers_mut(),
        &policy.headers,
        &applied_only,
        restrictive,
    );
    if !limited_names.is_empty()
        && let Ok(v) = HeaderValue::try_from(limited_names.join(", "))
    {
        res.headers_mut().insert(X_SPILLWAY_LIMITED, v);
    }
    Ok(res)
}

/// The answer when the store could not decide: 400 for a request that can
/// never be decided, 503 when the store is unavailable (never a 500).
fn store_error<St: Store, B>(
    shared: &Shared<St>,
    planned: &[Planned],
    error: &St::Error,
) -> Response<ResponseBody<B>> {
    if let Some(observer) = &shared.observer {
        for p in planned {
            observer.observe(&shared.policy.rules[p.index].name, Outcome::Error, None);
        }
    }
    match error.invalid_request() {
        Some(e) => response::problem(
            StatusCode::BAD_REQUEST,
            &request_error(&shared.policy, planned, e),
        ),
        None => {
            tracing::warn!(error = %error, "rate limit store unavailable");
            let mut res = response::problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "The rate limiter cannot reach its store; try again shortly.",
            );
            res.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(1u64));
            res
        }
    }
}

fn request_error(policy: &Policy, planned: &[Planned], e: &spillway::Error) -> String {
    match e {
        spillway::Error::CostTooLarge { index, source } => {
            let rule = planned
                .get(*index)
                .map_or("?", |p| policy.rules[p.index].name.as_str());
            format!(
                "This request costs {} under rule `{rule}`, whose capacity is {}: it can never be admitted.",
                source.cost, source.capacity
            )
        }
        other => other.to_string(),
    }
}

/// Gives a shaped request's charges back if it is dropped while it waits.
struct RefundOnDrop<St: Store + 'static> {
    shared: Arc<Shared<St>>,
    checks: Vec<(RuleId, String, u64)>,
    charged_at: u64,
    armed: bool,
}

impl<St: Store + 'static> RefundOnDrop<St> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<St: Store + 'static> Drop for RefundOnDrop<St> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = self.shared.clone();
        let checks = std::mem::take(&mut self.checks);
        let at = self.charged_at;
        runtime.spawn(async move {
            let checks: Vec<Check<'_>> = checks
                .iter()
                .map(|(rule, key, cost)| Check {
                    rule: *rule,
                    key,
                    cost: *cost,
                })
                .collect();
            if let Err(e) = shared.store.refund(&checks, at).await {
                tracing::warn!(error = %e, "could not give back a dropped request's charge");
            }
        });
    }
}

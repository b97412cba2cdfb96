//! [`RateLimit`]: the middleware service.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use smallvec::SmallVec;
use spillway::Decision;
use spillway::store::{Check, RuleId, Store, StoreError};
use tower_service::Service;

use crate::future::{ResponseBody, ResponseFuture};
use crate::headers::{self, Applied};
use crate::key::Client;
use crate::layer::{Outcome, Shared, outcome_of};
use crate::response;
use crate::rules::{Action, Cost, MissingClientAddr, Policy};

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
        let (mut parts, body) = req.into_parts();
        // The mark is trusted only as this layer (or one in front of it,
        // through the extension, which a client cannot send) sets it: a
        // client's is gone before any rule runs, whether one matches or not.
        parts.headers.remove(X_SPILLWAY_LIMITED);
        match evaluate_now(&self.shared, &parts) {
            Now::Decided(decided) => respond(&self.shared, inner, parts, body, decided),
            // The store has to be waited for.
            Now::Wait(planned) => {
                let shared = self.shared.clone();
                Box::pin(async move {
                    let decided = evaluate_planned(&shared, planned, false).await;
                    respond(&shared, inner, parts, body, decided).await
                })
            }
            Now::NoClientAddr(index) => {
                let res = no_client_addr(&self.shared, index, &parts);
                Box::pin(std::future::ready(Ok(res)))
            }
        }
    }
}

/// A few of something: requests rarely match more than two rules, and
/// these live for one request, so they stay off the heap.
type Small<T> = SmallVec<[T; 2]>;

/// One rule that applies to a request.
struct Planned {
    index: usize,
    // Which of the rule's quotas applies (see `HttpRule::quota_index`).
    quota: usize,
    id: RuleId,
    key: String,
    cost: u64,
}

/// Why a request cannot be planned.
enum Unplanned {
    /// It is malformed: a 400's message.
    BadRequest(String),
    /// Rule `index` counts by the client's address, and the request has
    /// none.
    NoClientAddr(usize),
}

/// The rules that apply, with their keys and costs. With `addr_required`,
/// a rule that counts by the client's address fails the plan when the
/// request has none; without, it does not apply.
fn plan(
    policy: &Policy,
    client: &Client,
    parts: &Parts,
    addr_required: bool,
) -> Result<Small<Planned>, Unplanned> {
    let tier = policy.tier_of(client);
    let mut planned = SmallVec::new();
    for (index, rule) in policy.rules.iter().enumerate() {
        if !rule
            .matches(parts)
            .map_err(|m| Unplanned::BadRequest(m.to_string()))?
        {
            continue;
        }
        let Some(key) = rule.key_of(client, parts) else {
            // `ip` is `None` only when there is no peer address at all.
            if addr_required && client.ip.is_none() && rule.needs_ip() {
                return Err(Unplanned::NoClientAddr(index));
            }
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
                            Unplanned::BadRequest(format!(
                                "header `{name}` must be a non-negative integer cost"
                            ))
                        })?,
                },
            },
        };
        let quota = rule.quota_index(tier);
        planned.push(Planned {
            index,
            quota,
            id: RuleId(rule.first_id + quota),
            key,
            cost,
        });
    }
    Ok(planned)
}

/// The charges of an admitted request, `(rule, key, cost)` each, and the
/// store's time of the decision: what to give back if it is abandoned.
type Charged = (Vec<(RuleId, String, u64)>, u64);

/// What one rule decided about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleDecision {
    /// The rule's name.
    pub rule: String,
    /// The tier whose quota applied, if not the default.
    pub tier: Option<String>,
    /// The key the request was counted under.
    pub key: String,
    /// What the request cost under this rule.
    pub cost: u64,
    /// What the rule does with a denial.
    pub action: Action,
    /// The store's decision.
    pub decision: Decision,
}

/// The verdict on a request, before it is served (or not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No rule applies to the request.
    Unlimited,
    /// Admitted, after `delay` (shaping). `limited` names the `degrade`
    /// rules that denied it, `shadowed` the `shadow` rules that did.
    Admitted {
        /// How long to hold the request before serving it.
        delay: Duration,
        /// The degrade rules that denied it.
        limited: Vec<String>,
        /// The shadow rules that denied it.
        shadowed: Vec<String>,
    },
    /// Denied by a `reject` rule: answer 429.
    Rejected {
        /// The rule.
        rule: String,
        /// The exact time until the same request would be admitted.
        retry_after: Duration,
    },
    /// The request can never be decided (a bad cost header, a cost above a
    /// capacity): answer 400 with this message.
    BadRequest(String),
    /// The store could not decide and its failure policy is to refuse:
    /// answer 503.
    Unavailable(String),
}

/// A request's verdict with every rule's decision and the rate-limit headers
/// that describe it. See [`RateLimitLayer::decide`](crate::RateLimitLayer::decide).
#[derive(Debug, Clone)]
pub struct Decided {
    /// What to do with the request.
    pub verdict: Verdict,
    /// Every rule that decided, in policy order.
    pub rules: Vec<RuleDecision>,
    /// The `X-RateLimit-*` and `RateLimit*` headers (as configured) for the
    /// response.
    pub headers: HeaderMap,
}

/// What [`evaluate`] found: the verdict, and what the headers are made of.
pub(crate) struct Evaluated {
    verdict: Verdict,
    // Filled only when details were asked for (the decision API).
    rules: Vec<RuleDecision>,
    described: Described,
    charged: Option<Charged>,
}

/// What a response's rate-limit headers say: kept this small so that the
/// response future can carry it and write the headers straight into the
/// response.
#[derive(Default)]
pub(crate) struct Described {
    // Each rule that decided: its index in the policy and which of its
    // quotas, its decision, its window in seconds.
    pub(crate) applied: Small<(usize, usize, Decision, u64)>,
    // Which of `applied` X-RateLimit-* and RateLimit describe.
    pub(crate) restrictive: usize,
}

impl Described {
    /// Writes the rate-limit headers into `headers`.
    pub(crate) fn write(&self, policy: &Policy, headers: &mut HeaderMap) {
        if let Some(applied) = self.applied(policy) {
            headers::write(headers, &policy.headers, &applied, self.restrictive);
        }
    }

    /// Appends the rate-limit headers to `out` as header lines.
    pub(crate) fn write_lines(&self, policy: &Policy, out: &mut Vec<u8>) {
        if let Some(applied) = self.applied(policy) {
            headers::write_lines(out, &policy.headers, &applied, self.restrictive);
        }
    }

    /// The rules that applied, as the headers need them; `None` when no
    /// header is to be written.
    fn applied<'p>(&self, policy: &'p Policy) -> Option<Small<Applied<'p>>> {
        let options = &policy.headers;
        if !(options.legacy || options.ietf) || self.applied.is_empty() {
            return None;
        }
        let applied = self
            .applied
            .iter()
            .map(|&(index, quota, decision, window_secs)| Applied {
                name: &policy.rules[index].sf_name,
                decision,
                window_secs,
                presented: policy.rules[index].presented.get(quota),
            })
            .collect();
        Some(applied)
    }
}

/// The decision API: the verdict with every rule's decision and the headers.
pub(crate) async fn decide<St: Store>(shared: &Shared<St>, parts: &Parts) -> Decided {
    let evaluated = evaluate(shared, parts, true).await;
    let mut headers = HeaderMap::new();
    evaluated.described.write(&shared.policy, &mut headers);
    Decided {
        verdict: evaluated.verdict,
        rules: evaluated.rules,
        headers,
    }
}

/// What happens to a request before the store is asked: no rule applies,
/// or the request is malformed (`Done`); or these rules apply (`Ask`); or
/// rule `index` needs the client's address, which the request lacks.
enum Prepared {
    Done(Verdict),
    Ask(Small<Planned>),
    NoClientAddr(usize),
}

/// What [`evaluate_now`] found.
// Lives on the stack for one request and is matched at once, as the
// `Result` it replaced was: boxing the verdict would add an allocation to
// every request.
#[allow(clippy::large_enum_variant)]
enum Now {
    /// The verdict.
    Decided(Evaluated),
    /// The store has to be waited for, with these planned rules.
    Wait(Small<Planned>),
    /// Rule `index` needs the client's address, which the request lacks,
    /// and the policy is to answer an error.
    NoClientAddr(usize),
}

/// An [`Evaluated`] that asked no store.
fn without_store(verdict: Verdict) -> Evaluated {
    Evaluated {
        verdict,
        rules: Vec::new(),
        described: Described::default(),
        charged: None,
    }
}

/// Plans the rules that apply to a request. `serving`: for the middleware,
/// which applies the policy's [`MissingClientAddr`]; the decision API skips
/// rules that need an address the parts do not carry.
fn prepare(policy: &Policy, parts: &Parts, serving: bool) -> Prepared {
    let client = Client::of(parts, &policy.clients);
    let addr_required = serving && policy.missing_client_addr == MissingClientAddr::Error;
    match plan(policy, &client, parts, addr_required) {
        Err(Unplanned::BadRequest(message)) => Prepared::Done(Verdict::BadRequest(message)),
        Err(Unplanned::NoClientAddr(index)) => Prepared::NoClientAddr(index),
        Ok(planned) if planned.is_empty() => Prepared::Done(Verdict::Unlimited),
        Ok(planned) => Prepared::Ask(planned),
    }
}

/// The answer to a request that rule `index` cannot key for lack of the
/// client's address: a 500 saying how to fix it. Logged once per layer,
/// reported to the observer every time.
fn no_client_addr<St, B>(
    shared: &Shared<St>,
    index: usize,
    parts: &Parts,
) -> Response<ResponseBody<B>> {
    let rule = shared.policy.rules[index].name.as_str();
    let detail = response::missing_client_addr_detail(rule);
    if !shared.logged_missing_addr.swap(true, Ordering::Relaxed) {
        tracing::error!(rule, "{detail}");
    }
    if let Some(observer) = &shared.observer {
        observer.observe(rule, Outcome::Error, None);
    }
    if response::is_grpc(&parts.headers) {
        return response::grpc_status(13, &detail);
    }
    response::problem(StatusCode::INTERNAL_SERVER_ERROR, &detail)
}

/// The store checks of the planned rules, and each rule's action.
fn checks_of<'p>(policy: &Policy, planned: &'p [Planned]) -> (Small<Check<'p>>, Small<Action>) {
    planned
        .iter()
        .map(|p| {
            let check = Check {
                rule: p.id,
                key: &p.key,
                cost: p.cost,
            };
            (check, policy.rules[p.index].action)
        })
        .unzip()
}

/// Applies the policy to a request's parts: plans the rules and asks the
/// store (once, or again without the non-rejecting rules that denied).
/// Charges the store as the verdict says; serves nothing. `details` also
/// collects every rule's decision with its key (the decision API wants
/// them; the middleware does not, and skips the copies).
pub(crate) async fn evaluate<St: Store>(
    shared: &Shared<St>,
    parts: &Parts,
    details: bool,
) -> Evaluated {
    match prepare(&shared.policy, parts, false) {
        Prepared::Done(verdict) => without_store(verdict),
        Prepared::Ask(planned) => evaluate_planned(shared, planned, details).await,
        Prepared::NoClientAddr(_) => unreachable!("only the middleware requires an address"),
    }
}

/// [`evaluate`] once the rules are planned.
async fn evaluate_planned<St: Store>(
    shared: &Shared<St>,
    planned: Small<Planned>,
    details: bool,
) -> Evaluated {
    let enforced = {
        let (checks, actions) = checks_of(&shared.policy, &planned);
        crate::enforce::enforce(&shared.store, &checks, &actions).await
    };
    conclude(shared, &planned, enforced, details)
}

/// [`evaluate`] without waiting, on a store that can answer so
/// ([`Store::try_check_now`]); otherwise the planned rules, with nothing
/// asked yet.
fn evaluate_now<St: Store>(shared: &Shared<St>, parts: &Parts) -> Now {
    let planned = match prepare(&shared.policy, parts, true) {
        Prepared::Done(verdict) => return Now::Decided(without_store(verdict)),
        Prepared::Ask(planned) => planned,
        Prepared::NoClientAddr(index) => return Now::NoClientAddr(index),
    };
    let enforced = {
        let (checks, actions) = checks_of(&shared.policy, &planned);
        crate::enforce::enforce_now(&shared.store, &checks, &actions)
    };
    match enforced {
        Some(enforced) => Now::Decided(conclude(shared, &planned, enforced, false)),
        None => Now::Wait(planned),
    }
}

/// The verdict on the planned rules from what the store said.
fn conclude<St: Store>(
    shared: &Shared<St>,
    planned: &[Planned],
    enforced: Result<crate::Enforced, St::Error>,
    details: bool,
) -> Evaluated {
    let policy = &shared.policy;
    let action = |p: &Planned| policy.rules[p.index].action;
    let name = |p: &Planned| policy.rules[p.index].name.as_str();
    let enforced = match enforced {
        Ok(e) => e,
        Err(e) => return without_store(store_error(shared, planned, &e)),
    };
    let decisions = enforced.decisions();
    let rejected_by = enforced.rejected_by();
    let denied_softly = enforced.denied_softly();
    // What to give back if a shaped request is abandoned: only needed when
    // something waits.
    let charged = enforced.charged().and_then(|(charged, at)| {
        charged
            .iter()
            .any(|&p| decisions[p].is_some_and(|d| !d.delay.is_zero()))
            .then(|| {
                let what = charged
                    .iter()
                    .map(|&p| (planned[p].id, planned[p].key.clone(), planned[p].cost))
                    .collect();
                (what, at)
            })
    });

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
    let mut rules = Vec::new();
    let mut applied: Small<(usize, usize, Decision, u64)> = SmallVec::new();
    let mut positions: Small<usize> = SmallVec::new();
    for (p, plan) in planned.iter().enumerate() {
        let Some(decision) = decisions[p] else {
            continue;
        };
        let rule = &policy.rules[plan.index];
        let window_secs = rule.window_secs(plan.quota, decision.limit);
        applied.push((plan.index, plan.quota, decision, window_secs));
        positions.push(p);
        if details {
            let used_tier = plan.quota.checked_sub(1).map(|t| rule.tiers[t].0.clone());
            rules.push(RuleDecision {
                rule: rule.name.clone(),
                tier: used_tier,
                key: plan.key.clone(),
                cost: plan.cost,
                action: rule.action,
                decision,
            });
        }
    }
    let restrictive = rejected_by
        .and_then(|r| positions.iter().position(|&p| p == r))
        .or_else(|| {
            (0..applied.len()).min_by_key(|&i| {
                let d = &applied[i].2;
                (d.remaining, d.limit)
            })
        })
        .unwrap_or(0);

    let verdict = match rejected_by {
        Some(p) => {
            let decision = decisions[p].expect("the rejecting rule decided");
            tracing::debug!(rule = name(&planned[p]), key = %planned[p].key, "rate limited");
            Verdict::Rejected {
                rule: name(&planned[p]).to_string(),
                retry_after: decision.retry_after.unwrap_or(Duration::from_secs(1)),
            }
        }
        None => {
            let mut limited = Vec::new();
            let mut shadowed = Vec::new();
            for &p in denied_softly {
                if action(&planned[p]) == Action::Shadow {
                    tracing::info!(rule = name(&planned[p]), key = %planned[p].key, "shadow rule would have denied");
                    shadowed.push(name(&planned[p]).to_string());
                } else {
                    limited.push(name(&planned[p]).to_string());
                }
            }
            Verdict::Admitted {
                delay: decisions
                    .iter()
                    .flatten()
                    .filter(|d| d.allowed)
                    .map(|d| d.delay)
                    .max()
                    .unwrap_or_default(),
                limited,
                shadowed,
            }
        }
    };
    Evaluated {
        verdict,
        rules,
        described: Described {
            applied,
            restrictive,
        },
        charged,
    }
}

/// Serves a request once its verdict is known: answers at once (a 429, a
/// 400, a 503), or calls the inner service, after the shaping delay if
/// there is one, and adds the rate-limit headers to its response.
fn respond<S, St, ReqBody, ResBody>(
    shared: &Arc<Shared<St>>,
    mut inner: S,
    mut parts: Parts,
    body: ReqBody,
    decided: Evaluated,
) -> ResponseFuture<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    let policy = &shared.policy;
    let answer = |res| -> ResponseFuture<_, S::Error> { Box::pin(std::future::ready(Ok(res))) };
    let grpc = || response::is_grpc(&parts.headers);
    let (delay, limited) = match decided.verdict {
        Verdict::Unlimited => {
            let response = inner.call(Request::from_parts(parts, body));
            return Box::pin(async move { Ok(response.await?.map(ResponseBody::inner)) });
        }
        // gRPC clients get gRPC statuses: INVALID_ARGUMENT, UNAVAILABLE,
        // RESOURCE_EXHAUSTED.
        Verdict::BadRequest(ref message) if grpc() => {
            return answer(response::grpc_status(3, message));
        }
        Verdict::BadRequest(ref message) => {
            return answer(response::problem(StatusCode::BAD_REQUEST, message));
        }
        Verdict::Unavailable(_) if grpc() => {
            return answer(response::grpc_status(
                14,
                "the rate limiter cannot reach its store",
            ));
        }
        Verdict::Unavailable(_) => return answer(response::unavailable()),
        Verdict::Rejected {
            ref rule,
            retry_after,
        } => {
            let retry = response::retry_secs(retry_after);
            let mut res = if grpc() {
                let message = format!("rate limit `{rule}` exceeded: retry in {retry} s");
                let mut res = response::grpc_status(8, &message);
                res.headers_mut()
                    .insert(http::header::RETRY_AFTER, HeaderValue::from(retry));
                res
            } else {
                response::too_many_requests(policy.body, rule, retry)
            };
            decided.described.write(policy, res.headers_mut());
            return answer(res);
        }
        Verdict::Admitted {
            delay, ref limited, ..
        } => (delay, limited.clone()),
    };
    let mut all_limited = parts
        .extensions
        .get::<Limited>()
        .map(|l| l.rules.clone())
        .unwrap_or_default();
    all_limited.extend(limited);
    let limited_header = (!all_limited.is_empty())
        .then(|| HeaderValue::try_from(all_limited.join(", ")).ok())
        .flatten();
    if let Some(v) = &limited_header {
        parts.headers.insert(X_SPILLWAY_LIMITED, v.clone());
        parts.extensions.insert(Limited { rules: all_limited });
    }
    let described = decided.described;
    let owner = Arc::clone(shared);
    let finish = move |res: Response<ResBody>| {
        let mut res = res.map(ResponseBody::inner);
        let headers = res.headers_mut();
        described.write(&owner.policy, headers);
        if let Some(v) = limited_header {
            headers.insert(X_SPILLWAY_LIMITED, v);
        }
        res
    };
    // Shaping: hold the request until its turn. If the client goes away
    // meanwhile, the charges are given back.
    if !delay.is_zero()
        && let Some((checks, charged_at)) = decided.charged
    {
        let guard = RefundOnDrop {
            shared: shared.clone(),
            checks,
            charged_at,
            armed: true,
        };
        return Box::pin(async move {
            tokio::time::sleep(delay).await;
            guard.disarm();
            Ok(finish(inner.call(Request::from_parts(parts, body)).await?))
        });
    }
    let response = inner.call(Request::from_parts(parts, body));
    Box::pin(async move { Ok(finish(response.await?)) })
}

/// The verdict when the store could not decide: a request that can never be
/// decided is the client's error (400); an unavailable store refuses (503).
fn store_error<St: Store>(shared: &Shared<St>, planned: &[Planned], error: &St::Error) -> Verdict {
    if let Some(observer) = &shared.observer {
        for p in planned {
            observer.observe(&shared.policy.rules[p.index].name, Outcome::Error, None);
        }
    }
    match error.invalid_request() {
        Some(e) => Verdict::BadRequest(request_error(&shared.policy, planned, e)),
        None => {
            tracing::warn!(error = %error, "rate limit store unavailable");
            Verdict::Unavailable(error.to_string())
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

//! [`RateLimit`]: the middleware service, an adapter of the
//! [`Engine`]: it plans each request, asks the engine, and serves the
//! ruling (the inner service's response with the rate-limit headers, or an
//! answer of its own).

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use spillway::store::Store;
use tower_service::Service;

use crate::budget::RequestReserve;
use crate::engine::{
    Admission, Asking, Engine, Held, Outcome, RuleOutcome, Ruling, Small, Unplanned,
};
use crate::future::{Finish, ResponseBody, ResponseFuture};
use crate::headers::RateLimitFields;
use crate::metered::{Budgets, Metering, keep_leases};
use crate::response;
use crate::rules::Policy;

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

/// Marks a request that is decided here but served elsewhere, as by a
/// proxy's forward-auth hook (nginx `auth_request`, Traefik `ForwardAuth`):
/// nothing here learns when it ends, so the rules whose charge is held
/// while the request runs (concurrency rules) do not apply to it. Without
/// the mark, such a request would take its slot and give it back as soon
/// as the decision was answered, counting decisions in flight, not
/// requests.
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use spillway::algorithm::Concurrency;
/// use spillway::store::{MemoryOptions, MemoryStore};
/// use spillway::Quota;
/// use spillway_tower::{Engine, HttpRule, MissingClientAddr, NotServed, Policy};
///
/// let one = Quota::new(NonZeroU32::MIN, Duration::from_secs(30)).unwrap();
/// let policy = Policy::new([HttpRule::new("in_flight", Concurrency::new(one))]);
/// let store = MemoryStore::new(policy.store_rules(), MemoryOptions::default());
/// let engine = Engine::new(policy, store).unwrap();
/// let mut parts = axum::http::Request::new(()).into_parts().0;
/// parts.extensions.insert(spillway_tower::ClientAddr("192.0.2.1:5000".parse().unwrap()));
/// assert_eq!(engine.plan(&parts, MissingClientAddr::Error).unwrap().len(), 1);
/// parts.extensions.insert(NotServed);
/// assert!(engine.plan(&parts, MissingClientAddr::Error).unwrap().is_empty());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct NotServed;

/// A request extension, set by a server that writes header lines itself:
/// the rate-limit fields of the response to an admitted request are set
/// aside in the response's extensions (a [`RateLimitFields`]), for the
/// server to write, rather than into its headers, which would be a
/// [`HeaderMap`](http::HeaderMap) made only to be taken apart again. The
/// responses the layer makes itself (a 429, a 503) carry their fields in
/// their headers all the same.
///
/// ```
/// use std::num::NonZeroU32;
/// use spillway::Quota;
/// use spillway::algorithm::TokenBucket;
/// use spillway_tower::{ClientAddr, FieldsAside, HttpRule, Policy, RateLimitFields, RateLimitLayer};
/// use tower::{service_fn, Layer, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let ten = NonZeroU32::new(10).unwrap();
/// let bucket = TokenBucket::new(Quota::per_second(ten), ten);
/// let layer = RateLimitLayer::in_memory(Policy::new([HttpRule::new("api", bucket)]));
/// let service = layer.layer(service_fn(|_req: http::Request<()>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(()))
/// }));
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(ClientAddr("192.0.2.1:5000".parse().unwrap()));
/// req.extensions_mut().insert(FieldsAside);
/// let res = service.oneshot(req).await.unwrap();
/// assert!(res.headers().get("ratelimit").is_none());
/// let fields = res.extensions().get::<RateLimitFields>().unwrap();
/// assert!(fields.iter().any(|(name, _)| name == "ratelimit"));
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct FieldsAside;

/// A request extension, set by a server that can stop: once its watch
/// turns true (the server is stopping), a request still held for its
/// shaping turn is not held any longer. It is answered `503 Service
/// Unavailable` at once, with `Retry-After` the rest of its wait (whole
/// seconds, rounded up: when its turn would have come), it never reaches
/// the inner service, and its charges are given back, so that the client's
/// retry (on another instance, or this one restarted) is charged once.
///
/// Why not admit it early: the queue would reach the service behind as one
/// burst, at the moment a deploy already strains it, which is what shaping
/// exists to prevent. Why not keep it until its turn: a bucket's queue can
/// hold requests for minutes, and a stopping server must end.
///
/// ```
/// use spillway_tower::Draining;
///
/// let (stop, stopping) = tokio::sync::watch::channel(false);
/// let draining = Draining::new(stopping);
/// assert!(!draining.is_stopping());
/// stop.send(true).unwrap();
/// assert!(draining.is_stopping());
/// ```
#[derive(Debug, Clone)]
pub struct Draining(tokio::sync::watch::Receiver<bool>);

impl Draining {
    /// Follows `stopping`: true once the server stops (or its sender is
    /// gone).
    pub fn new(stopping: tokio::sync::watch::Receiver<bool>) -> Self {
        Self(stopping)
    }

    /// Whether the server is stopping.
    pub fn is_stopping(&self) -> bool {
        *self.0.borrow() || self.0.has_changed().is_err()
    }

    /// Returns once the server is stopping.
    async fn stopped(mut self) {
        // An error: the sender is gone, the server with it.
        let _ = self.0.wait_for(|&stop| stop).await;
    }
}

/// A request extension, set by a server, that caps how many of its
/// requests are held for their shaping turn (a leaky bucket in shape mode)
/// at once, all rules, keys and connections together: a bucket's queue
/// bounds what one key holds, not what all keys hold, and each held
/// request keeps a connection (an HTTP/2 stream), a task and its buffers.
/// A request that would be held past the cap is answered `503 Service
/// Unavailable` at once, with `Retry-After` its wait (whole seconds, rounded
/// up: when its turn would have come), never reaches the inner service,
/// and its charges are given back. Clones share the count.
///
/// ```
/// use std::num::NonZeroUsize;
/// use spillway_tower::HoldCap;
///
/// let cap = HoldCap::new(NonZeroUsize::new(2).unwrap());
/// let (a, b) = (cap.try_hold(), cap.clone().try_hold());
/// assert!(a.is_some() && b.is_some());
/// assert_eq!(cap.held(), 2);
/// assert!(cap.try_hold().is_none(), "a third is not held");
/// drop(a);
/// assert!(cap.try_hold().is_some(), "a place came free");
/// ```
#[derive(Debug, Clone)]
pub struct HoldCap(Arc<HoldCount>);

#[derive(Debug)]
struct HoldCount {
    held: AtomicUsize,
    max: usize,
}

impl HoldCap {
    /// At most `max` requests held at once.
    pub fn new(max: NonZeroUsize) -> Self {
        Self(Arc::new(HoldCount {
            held: AtomicUsize::new(0),
            max: max.get(),
        }))
    }

    /// How many requests are held now.
    pub fn held(&self) -> usize {
        self.0.held.load(Ordering::Acquire)
    }

    /// A place for one more held request, given back when dropped; none
    /// past the cap.
    pub fn try_hold(&self) -> Option<HoldPlace> {
        let count = &self.0;
        count
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held < count.max).then_some(held + 1)
            })
            .ok()?;
        Some(HoldPlace(self.0.clone()))
    }
}

/// A held request's place under a [`HoldCap`], given back when dropped.
#[derive(Debug)]
pub struct HoldPlace(Arc<HoldCount>);

impl Drop for HoldPlace {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Applies the rate limits, then calls the inner service `S`. See
/// [`RateLimitLayer`](crate::RateLimitLayer).
pub struct RateLimit<S, St> {
    inner: S,
    engine: Arc<Engine<St>>,
}

impl<S, St> RateLimit<S, St> {
    pub(crate) fn new(inner: S, engine: Arc<Engine<St>>) -> Self {
        Self { inner, engine }
    }
}

impl<S: Clone, St> Clone for RateLimit<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            engine: self.engine.clone(),
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
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Only the inner service's readiness: denials are answered at once
        // in `call`, never by holding requests here.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The clone takes the place of the service that was made ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (mut parts, body) = req.into_parts();
        // The mark is trusted only as this layer (or one in front of it,
        // through the extension, which a client cannot send) sets it: a
        // client's is gone before any rule runs, whether one matches or not.
        parts.headers.remove(X_SPILLWAY_LIMITED);
        let engine = &self.engine;
        let charges = match engine.plan(&parts, engine.policy().missing_client_addr) {
            Ok(charges) => charges,
            Err(unplanned @ (Unplanned::BadRequest(_) | Unplanned::Blocked { .. })) => {
                let served = Served {
                    outcome: unplanned.outcome().expect("a refusal"),
                    fields: RateLimitFields::default(),
                    held: None,
                    violated: Small::new(),
                };
                return respond(engine, inner, parts, body, served);
            }
            Err(Unplanned::NoClientAddr(index)) => {
                return ResponseFuture::ready(no_client_addr(engine, index, &parts));
            }
        };
        match engine.admit_now(charges) {
            // What `respond` does with an admitted request that is not
            // delayed, held or metered.
            Ok(Admission::Admitted(fields)) => {
                let finish = Finish {
                    fields,
                    aside: parts.extensions.get::<FieldsAside>().is_some(),
                    limited: mark_limited(&mut parts, Vec::new()),
                    metering: None,
                };
                ResponseFuture::inner(inner.call(Request::from_parts(parts, body)), finish)
            }
            Ok(Admission::Ruled(ruling)) => serve(engine, inner, parts, body, ruling),
            // The store has to be waited for.
            Err(charges) => {
                let engine = engine.clone();
                ResponseFuture::waits(Box::pin(async move {
                    let ruling = engine.decide(charges, Asking::default()).await;
                    serve(&engine, inner, parts, body, ruling).await
                }))
            }
        }
    }
}

/// The answer to a request that rule `index` cannot key for lack of the
/// client's address: a 500 saying how to fix it. Said once per engine (in
/// the log, or on stderr when the app has no `tracing` subscriber to hear
/// it), reported to the observer every time.
fn no_client_addr<St: Store, B>(
    engine: &Engine<St>,
    index: usize,
    parts: &Parts,
) -> Response<ResponseBody<B>> {
    let rule = engine.policy().rules()[index].name();
    let detail = response::missing_client_addr_detail(rule);
    if !engine.logged_missing_addr.swap(true, Ordering::Relaxed) {
        if nobody_hears_tracing() {
            eprintln!("spillway-tower: error: {detail}");
        } else {
            tracing::error!(rule, "{detail}");
        }
    }
    if let Some(observer) = engine.observer() {
        observer.observe(rule, RuleOutcome::Error, None);
    }
    if response::is_grpc(&parts.headers) {
        return response::grpc_status(13, &detail);
    }
    response::problem(StatusCode::INTERNAL_SERVER_ERROR, &detail)
}

/// Whether no `tracing` subscriber would record an event here: an app that
/// never set one up, where a logged misconfiguration is never seen.
fn nobody_hears_tracing() -> bool {
    tracing::dispatcher::get_default(|d| d.is::<tracing::subscriber::NoSubscriber>())
}

/// What a request is served on: its outcome, and what of its ruling the
/// answer needs.
struct Served<'e> {
    outcome: Outcome,
    // The rate-limit header fields, made when the request was decided.
    fields: RateLimitFields,
    // What a shaped request gives back if it is abandoned.
    held: Option<Held>,
    // The rules that denied the request, in policy order: a quota-exceeded
    // 429's `violated-policies`.
    violated: Small<&'e str>,
}

/// Serves a request on its ruling (see [`respond`]).
// Inlined, as `respond` is: the request's parts and the ruling are a few
// hundred bytes, moved (a memcpy each) at every call.
#[inline(always)]
fn serve<S, St, ReqBody, ResBody>(
    engine: &Arc<Engine<St>>,
    inner: S,
    parts: Parts,
    body: ReqBody,
    ruling: Ruling,
) -> ResponseFuture<S::Future, ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    let fields = engine.fields(&ruling);
    // Every charge that denied the request, not only the one whose wait the
    // 429 gives; looked for only when there is a 429 to write.
    let violated = match ruling.outcome() {
        Outcome::Rejected { .. } => (0..ruling.charges().len())
            .filter(|&i| ruling.denies(i))
            .map(|i| engine.rule_name(&ruling.charges()[i]))
            .collect(),
        _ => Small::new(),
    };
    // What to give back if a shaped request is abandoned, or to settle
    // when a budget's response ends: only needed then.
    let hold = engine.holds(&ruling);
    let (outcome, held) = ruling.into_outcome(hold);
    let served = Served {
        outcome,
        fields,
        held,
        violated,
    };
    respond(engine, inner, parts, body, served)
}

/// Serves a request once its outcome is known: answers at once (a 429, a
/// 400, a 503), or calls the inner service, after the shaping delay if
/// there is one, and adds the rate-limit headers to its response.
#[inline(always)]
fn respond<S, St, ReqBody, ResBody>(
    engine: &Arc<Engine<St>>,
    mut inner: S,
    mut parts: Parts,
    body: ReqBody,
    served: Served<'_>,
) -> ResponseFuture<S::Future, ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    let Served {
        outcome,
        fields,
        held,
        violated,
    } = served;
    let policy = engine.policy();
    let answer = ResponseFuture::ready;
    let grpc = || response::is_grpc(&parts.headers);
    let (delay, limited) = match outcome {
        Outcome::Unlimited => {
            let finish = Finish {
                fields,
                aside: parts.extensions.get::<FieldsAside>().is_some(),
                limited: None,
                metering: None,
            };
            return ResponseFuture::inner(inner.call(Request::from_parts(parts, body)), finish);
        }
        // gRPC clients get gRPC statuses: INVALID_ARGUMENT, UNAVAILABLE,
        // RESOURCE_EXHAUSTED.
        Outcome::BadRequest(ref message) if grpc() => {
            return answer(response::grpc_status(3, message));
        }
        Outcome::BadRequest(ref message) => {
            return answer(response::problem(StatusCode::BAD_REQUEST, message));
        }
        Outcome::Unavailable(_) if grpc() => {
            return answer(response::grpc_status(
                14,
                "the rate limiter cannot reach its store",
            ));
        }
        Outcome::Unavailable(_) => return answer(response::unavailable()),
        // A block list's refusal: PERMISSION_DENIED or RESOURCE_EXHAUSTED
        // to a gRPC client.
        Outcome::Blocked { status, .. } if grpc() => {
            let code = if status == StatusCode::TOO_MANY_REQUESTS {
                8
            } else {
                7
            };
            return answer(response::grpc_status(code, "blocked"));
        }
        Outcome::Blocked { status, .. } => {
            let mut res = response::problem(status, "This client is blocked.");
            if let Some(secs) = outcome.retry_after_secs() {
                res.headers_mut()
                    .insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
            }
            return answer(res);
        }
        Outcome::Rejected {
            ref rule, status, ..
        } => {
            let retry = outcome.retry_after_secs().expect("a rejection");
            let mut res = rejected(policy, rule, &violated, retry, status, grpc());
            fields.write_to(res.headers_mut());
            return answer(res);
        }
        Outcome::Admitted { delay, limited, .. } => (delay, limited),
    };
    let limited_header = mark_limited(&mut parts, limited);
    // Looked for only under a policy with budgets: this is every admitted
    // request's path.
    let prompt = match engine.budgets {
        true => parts
            .extensions
            .get::<RequestReserve>()
            .map_or(0, |h| h.prompt_estimate),
        false => 0,
    };
    // A budget's response is measured, and settled when it ends; a
    // concurrency rule's slot is held until it ends.
    let meter = move |held: Option<Held>, engine: &Arc<Engine<St>>| {
        let held = held.filter(|_| engine.budgets || engine.leases)?;
        let budgets: Arc<dyn Budgets> = engine.clone();
        Metering::new(budgets, held, prompt).map(Box::new)
    };
    let meter_keeping = move |held: Option<Held>, leases, engine: &Arc<Engine<St>>| {
        let budgets: Arc<dyn Budgets> = engine.clone();
        Metering::keeping(budgets, held, prompt, leases).map(Box::new)
    };
    let aside = parts.extensions.get::<FieldsAside>().is_some();
    let finish = move |metering: Option<Box<Metering>>| Finish {
        fields,
        aside,
        limited: limited_header,
        metering,
    };
    // Shaping: hold the request until its turn. If the client goes away
    // meanwhile, or the server stops (see `Draining`), the charges are given
    // back; so they are if the server holds as many as it may (`HoldCap`).
    // The slots of concurrency rules are kept (renewed) from now, through
    // the wait, and released if it is abandoned.
    if !delay.is_zero()
        && let Some(held) = held
    {
        let grpc = response::is_grpc(&parts.headers);
        let (leases, held) = match engine.leases {
            true => {
                let budgets: Arc<dyn Budgets> = engine.clone();
                keep_leases(&budgets, held)
            }
            false => (None, Some(held)),
        };
        let guard = GiveBackOnDrop {
            engine: engine.clone(),
            held,
        };
        let engine = engine.clone();
        let place = match parts.extensions.get::<HoldCap>().map(HoldCap::try_hold) {
            Some(None) => {
                drop((guard, leases));
                let retry = delay.as_micros().div_ceil(1_000_000).max(1) as u64;
                return answer(response::too_many_held(retry, grpc));
            }
            Some(place) => place,
            None => None,
        };
        let draining = parts.extensions.get::<Draining>().cloned();
        return ResponseFuture::waits(Box::pin(async move {
            let turn = tokio::time::Instant::now() + delay;
            if let Some(draining) = draining {
                tokio::select! {
                    () = tokio::time::sleep_until(turn) => {}
                    () = draining.stopped() => {
                        drop((guard, leases));
                        let left = turn.saturating_duration_since(tokio::time::Instant::now());
                        let retry = left.as_micros().div_ceil(1_000_000).max(1) as u64;
                        return Ok(response::stopping(retry, grpc));
                    }
                }
            } else {
                tokio::time::sleep_until(turn).await;
            }
            let metering = meter_keeping(guard.disarm(), leases, &engine);
            unencoded(&mut parts, metering.as_deref());
            drop(place);
            let res = inner.call(Request::from_parts(parts, body)).await?;
            Ok(finish(metering).apply(res))
        }));
    }
    let metering = meter(held, engine);
    unencoded(&mut parts, metering.as_deref());
    ResponseFuture::inner(
        inner.call(Request::from_parts(parts, body)),
        finish(metering),
    )
}

/// Asks for a response whose body a budget rule reads in no content
/// coding: a gzipped body cannot be measured, and a client that could make
/// its responses unmeasurable by sending `Accept-Encoding` would pay only
/// its reservations. A compression layer outside this one still
/// compresses what this one has measured.
fn unencoded(parts: &mut Parts, metering: Option<&Metering>) {
    if metering.is_some_and(Metering::reads_body) {
        parts.headers.remove(http::header::ACCEPT_ENCODING);
    }
}

/// Marks a request a `degrade` rule let through (with those of any layer
/// in front): the [`Limited`] extension and the header, whose value is
/// returned for the response too.
fn mark_limited(parts: &mut Parts, limited: Vec<String>) -> Option<HeaderValue> {
    // Most requests: no rule here let one through limited, and no layer in
    // front did either.
    if limited.is_empty() && parts.extensions.get::<Limited>().is_none() {
        return None;
    }
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
    limited_header
}

/// The answer to a request a rule rejected, retrying in `retry` seconds:
/// a 429 in the policy's body format (naming the `violated` rules when it
/// can), or gRPC's RESOURCE_EXHAUSTED.
fn rejected<B>(
    policy: &Policy,
    rule: &str,
    violated: &[&str],
    retry: u64,
    status: StatusCode,
    grpc: bool,
) -> Response<ResponseBody<B>> {
    if !grpc {
        return response::too_many_requests(policy.body, rule, violated, retry, status);
    }
    let message = format!("rate limit `{rule}` exceeded: retry in {retry} s");
    let mut res = response::grpc_status(8, &message);
    res.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from(retry));
    res
}

/// Gives a shaped request's charges back if it is dropped while it waits.
struct GiveBackOnDrop<St: Store + 'static> {
    engine: Arc<Engine<St>>,
    held: Option<Held>,
}

impl<St: Store + 'static> GiveBackOnDrop<St> {
    /// What it held, no longer given back when dropped.
    fn disarm(mut self) -> Option<Held> {
        self.held.take()
    }
}

impl<St: Store + 'static> Drop for GiveBackOnDrop<St> {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let engine = self.engine.clone();
        runtime.spawn(async move {
            if let Err(e) = held.give_back(&engine).await {
                tracing::warn!(error = %e, "could not give back a dropped request's charge");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::nobody_hears_tracing;

    /// A subscriber that records nothing, but is one.
    struct Listening;

    impl tracing::Subscriber for Listening {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, _: &tracing::Event<'_>) {}
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// The missing-address error goes to stderr in an app without a
    /// subscriber, and to the log in one with a subscriber.
    #[test]
    fn an_app_without_a_subscriber_is_told_on_stderr() {
        assert!(nobody_hears_tracing());
        tracing::subscriber::with_default(Listening, || assert!(!nobody_hears_tracing()));
    }
}

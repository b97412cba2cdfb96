//! What every test module shares: quotas, layers on the in-memory store
//! driven by tokio's (paused) clock, a counting store, an echo app, and
//! request/response helpers.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::routing::{get, post};
use http::request::Builder;
use http::{HeaderName, Response, StatusCode};
use http_body_util::BodyExt;
use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway::clock::Micros;
use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, Settle, Settled, Store, Verdict};
use spillway_tower::{ClientAddr, Limited, Policy, RateLimitLayer, TokioClock, X_SPILLWAY_LIMITED};
use tower::ServiceExt;

pub(crate) fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

/// `n` requests, then nothing for as long as any test runs: a token bucket
/// of `n` refilling `n` per hour (one token every `3600 / n` s, and tests
/// that do not advance time never see a refill).
pub(crate) fn bucket(n: u32) -> TokenBucket {
    TokenBucket::new(Quota::per_hour(nz(n)), nz(n))
}

/// The policy on a fresh in-memory store that follows tokio's clock.
pub(crate) fn memory_layer(policy: Policy) -> RateLimitLayer<MemoryStore<TokioClock>> {
    let store = MemoryStore::with_clock(
        policy.store_rules(),
        MemoryOptions::default(),
        TokioClock::new(),
    );
    RateLimitLayer::new(policy, store).expect("the store was built from the policy")
}

/// `RateLimit-Policy`'s `w`: the seconds a quota of `limit` per `period`
/// takes to refill `capacity`, rounded up.
pub(crate) fn window_secs(quota: Quota, capacity: u64) -> u64 {
    let micros = u128::from(quota.period_micros()) * u128::from(capacity);
    let limit = u128::from(quota.limit().get());
    u64::try_from(micros.div_ceil(limit).div_ceil(1_000_000)).expect("small")
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_micros().div_ceil(1_000_000) as u64
}

/// One `Store::check` call as the counting store saw it: (rule, key, cost)
/// per check.
pub(crate) type Call = Vec<(usize, String, u64)>;

/// The in-memory store, with a record of every `check` call it answered.
/// Instrumentation, not a mock: every decision is the memory store's.
#[derive(Debug)]
pub(crate) struct CountingStore {
    inner: MemoryStore<TokioClock>,
    calls: Mutex<Vec<Call>>,
}

impl CountingStore {
    pub(crate) fn new(rules: Vec<Rule>) -> Self {
        Self {
            inner: MemoryStore::with_clock(rules, MemoryOptions::default(), TokioClock::new()),
            calls: Mutex::new(Vec::new()),
        }
    }

    /// The calls so far, and forgets them.
    pub(crate) fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock().expect("not poisoned"))
    }
}

impl Store for CountingStore {
    type Error = spillway::Error;

    fn rules(&self) -> &[Rule] {
        self.inner.rules()
    }

    async fn check(&self, checks: &[Check<'_>]) -> Result<Verdict, spillway::Error> {
        self.calls.lock().expect("not poisoned").push(
            checks
                .iter()
                .map(|c| (c.rule.0, c.key.to_string(), c.cost))
                .collect(),
        );
        self.inner.check(checks).await
    }

    async fn reserve(&self, id: &str, checks: &[Check<'_>]) -> Result<Verdict, spillway::Error> {
        self.calls.lock().expect("not poisoned").push(
            checks
                .iter()
                .map(|c| (c.rule.0, c.key.to_string(), c.cost))
                .collect(),
        );
        self.inner.reserve(id, checks).await
    }

    async fn reserve_held(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: spillway::store::Hold<'_>,
    ) -> Result<Verdict, spillway::Error> {
        self.calls.lock().expect("not poisoned").push(
            checks
                .iter()
                .map(|c| (c.rule.0, c.key.to_string(), c.cost))
                .collect(),
        );
        self.inner.reserve_held(id, checks, hold).await
    }

    async fn refund(
        &self,
        checks: &[Check<'_>],
        charged_at: Micros,
    ) -> Result<(), spillway::Error> {
        self.inner.refund(checks, charged_at).await
    }

    async fn settle(&self, id: &str, settles: &[Settle<'_>]) -> Result<Settled, spillway::Error> {
        self.inner.settle(id, settles).await
    }

    async fn renew(
        &self,
        renews: &[spillway::store::Renew<'_>],
    ) -> Result<Vec<spillway::algorithm::Renewed>, spillway::Error> {
        self.inner.renew(renews).await
    }
}

/// What the echo handler saw, as its body: `limited=<rules>;header=<value>`
/// (`-` for none).
pub(crate) async fn echo(req: Request) -> String {
    let limited = req
        .extensions()
        .get::<Limited>()
        .map_or("-".to_string(), |l| l.rules.join(","));
    let header = req
        .headers()
        .get(X_SPILLWAY_LIMITED)
        .map_or("-", |v| v.to_str().expect("ascii"));
    format!("limited={limited};header={header}")
}

/// An app that answers every path (routes with templates, and a fallback),
/// behind `layer`.
pub(crate) fn app<L>(layer: L) -> Router
where
    L: tower::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    L::Service:
        tower::Service<Request, Error = std::convert::Infallible> + Clone + Send + Sync + 'static,
    <L::Service as tower::Service<Request>>::Response: axum::response::IntoResponse + 'static,
    <L::Service as tower::Service<Request>>::Future: Send + 'static,
{
    Router::new()
        .route("/users/{id}", get(echo).post(echo))
        .route("/orgs/{org}/users/{id}", get(echo))
        .fallback(echo)
        .layer(layer)
}

/// A socket address for `ip`.
pub(crate) fn sock(ip: &str) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("an IP address"), 40_000)
}

/// A GET of `uri` from the socket peer `ip`.
pub(crate) fn req(uri: &str, ip: &str) -> Builder {
    Request::get(uri).extension(ClientAddr(sock(ip)))
}

/// Sends one request through `app`.
pub(crate) async fn send(app: &Router, builder: Builder) -> Response<Body> {
    let request = builder.body(Body::empty()).expect("a valid request");
    app.clone().oneshot(request).await.expect("infallible")
}

/// Sends requests made by `make` until one is denied (or `max` were
/// admitted) and returns how many were admitted.
pub(crate) async fn admitted(app: &Router, max: usize, make: impl Fn() -> Builder) -> usize {
    for n in 0..max {
        let res = send(app, make()).await;
        match res.status() {
            StatusCode::OK => {}
            StatusCode::TOO_MANY_REQUESTS => return n,
            other => panic!("unexpected status {other}"),
        }
    }
    max
}

/// A header's value as a string.
pub(crate) fn header<B>(res: &Response<B>, name: impl TryInto<HeaderName>) -> Option<String> {
    let name = name.try_into().ok().expect("a header name");
    res.headers()
        .get(name)
        .map(|v| v.to_str().expect("ascii").to_string())
}

/// A header's value as an integer.
pub(crate) fn header_u64<B>(res: &Response<B>, name: &str) -> u64 {
    header(res, name)
        .unwrap_or_else(|| panic!("no `{name}` header"))
        .parse()
        .unwrap_or_else(|_| panic!("`{name}` is not an integer"))
}

/// The whole body as a string.
pub(crate) async fn body_string<B>(res: Response<B>) -> String
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let bytes = res.into_body().collect().await.expect("a body").to_bytes();
    String::from_utf8(bytes.to_vec()).expect("utf-8")
}

/// The whole body as JSON.
pub(crate) async fn body_json<B>(res: Response<B>) -> serde_json::Value
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    serde_json::from_str(&body_string(res).await).expect("a JSON body")
}

/// An app with one route, for tests that do not need the echo handler.
pub(crate) fn hello<L>(layer: L) -> Router
where
    L: tower::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    L::Service:
        tower::Service<Request, Error = std::convert::Infallible> + Clone + Send + Sync + 'static,
    <L::Service as tower::Service<Request>>::Response: axum::response::IntoResponse + 'static,
    <L::Service as tower::Service<Request>>::Future: Send + 'static,
{
    Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/login", post(|| async { "welcome" }))
        .layer(layer)
}

/// The rule names `RateLimit-Policy` lists: the rules that applied.
pub(crate) fn applied_rules<B>(res: &Response<B>) -> Vec<String> {
    let Some(value) = header(res, "ratelimit-policy") else {
        return Vec::new();
    };
    let list: sfv::List = sfv::Parser::new(&value)
        .parse()
        .expect("a structured-field list");
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => item
                .bare_item
                .as_string()
                .expect("a string name")
                .as_str()
                .to_string(),
            sfv::ListEntry::InnerList(_) => panic!("an inner list in {value}"),
        })
        .collect()
}

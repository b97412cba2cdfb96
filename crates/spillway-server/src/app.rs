//! The HTTP API: `POST /v1/check`, `/healthz`, `/readyz`, `/metrics`,
//! `/openapi.json` and the admin API under `/admin`. See `docs/server.md`
//! and `docs/openapi.json`.
//!
//! Every error is an `application/problem+json` answer with its own status
//! (400 for input that can never be decided, 401/404 for the admin API, 503
//! when the store cannot decide); bad input is never a 500.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path, Request, State as Extract};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};
use spillway::store::{Check, RuleId, Store};
use spillway_redis::OnError;
use spillway_tower::problem::{PROBLEM_JSON, Problem};
use spillway_tower::{
    Asking, ClientAddr, Engine as TowerEngine, Outcome, RateLimitFields, Reported, Ruling,
};

use crate::engine::{AnyStore, Engine};
use crate::metrics::InFlightLayer;
use crate::server::State;

/// The OpenAPI 3 description of this API, as served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../docs/openapi.json");

/// The longest key `/v1/check` accepts, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// The largest request body the API reads.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The HTTP API on `state`.
///
/// ```
/// use axum::body::Body;
/// use http::{Request, StatusCode};
/// use spillway_server::config::Config;
/// use spillway_server::{State, app};
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let config = Config::parse(
///     "[[rules]]\nname = \"login\"\nalgorithm = \"sliding_log\"\nlimit = 1\nwindow = \"1m\"\n",
/// )
/// .unwrap();
/// let app = app(State::new(config).await.unwrap());
/// let check = || {
///     Request::post("/v1/check")
///         .body(Body::from(r#"{"rule": "login", "key": "ip=203.0.113.7"}"#))
///         .unwrap()
/// };
/// let first = app.clone().oneshot(check()).await.unwrap();
/// assert_eq!(first.status(), StatusCode::OK);
/// assert_eq!(first.headers()["x-ratelimit-remaining"], "0");
/// // Denied: still a 200, whose body says `"allowed":false,"status":429`.
/// let second = app.oneshot(check()).await.unwrap();
/// assert_eq!(second.status(), StatusCode::OK);
/// # }
/// ```
pub fn app(state: State) -> Router {
    routes(state.clone()).layer(InFlightLayer(state.metrics.clone()))
}

/// The API's routes without the in-flight count (the HTTP/1.1 server of
/// `spillway serve` counts a request from its head on, body included).
pub(crate) fn routes(state: State) -> Router {
    let admin = Router::new()
        .route(
            "/rules/{rule}/keys/{*key}",
            get(admin_key).delete(admin_reset),
        )
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_auth));
    Router::new()
        .route("/v1/check", axum::routing::post(check))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .nest("/admin", admin)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

// ---- answers -----------------------------------------------------------

/// An answer of the API before it is written: by axum (as a [`Response`])
/// or by the HTTP/1.1 server of `spillway serve` (`crate::front`). Its
/// headers are data; each server renders them.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) content_type: &'static str,
    /// The rate-limit fields of a decision.
    pub(crate) fields: RateLimitFields,
    /// Any other header (`Retry-After`, `WWW-Authenticate`).
    pub(crate) other: Option<(HeaderName, HeaderValue)>,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    /// A JSON answer.
    fn json(status: StatusCode, body: &impl Serialize) -> Self {
        let body = serde_json::to_vec(body).unwrap_or_else(|e| {
            // Our own types always serialize; should one not, say so.
            format!("{{\"error\":\"cannot serialize the answer: {e}\"}}").into_bytes()
        });
        Self {
            status,
            content_type: "application/json",
            fields: RateLimitFields::default(),
            other: None,
            body,
        }
    }

    /// An `application/problem+json` answer (RFC 9457).
    pub(crate) fn problem(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            status,
            content_type: PROBLEM_JSON,
            fields: RateLimitFields::default(),
            other: None,
            body: Problem::new(status, &detail.into())
                .into_json()
                .into_bytes(),
        }
    }

    /// The headers besides `Content-Type`, in the order they are sent.
    pub(crate) fn headers(&self) -> impl Iterator<Item = (HeaderName, &[u8])> {
        let other = self.other.iter().map(|(n, v)| (n.clone(), v.as_bytes()));
        self.fields.iter().chain(other)
    }
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        let mut res = (self.status, self.body).into_response();
        let headers = res.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(self.content_type));
        self.fields.write_to(headers);
        if let Some((name, value)) = self.other {
            headers.insert(name, value);
        }
        res
    }
}

/// An `application/problem+json` answer (RFC 9457).
fn problem(status: StatusCode, detail: impl Into<String>) -> Response {
    Answer::problem(status, detail).into_response()
}

fn bad_request(detail: impl Into<String>) -> Answer {
    Answer::problem(StatusCode::BAD_REQUEST, detail)
}

fn unavailable(detail: impl Into<String>) -> Answer {
    let mut answer = Answer::problem(StatusCode::SERVICE_UNAVAILABLE, detail);
    answer.other = Some((RETRY_AFTER, HeaderValue::from(1u64)));
    answer
}

fn json_response(status: StatusCode, body: &impl Serialize) -> Response {
    Answer::json(status, body).into_response()
}

async fn not_found() -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "No such endpoint: see /openapi.json.",
    )
}

/// Durations are reported in whole milliseconds, rounded up: a client that
/// waits that long is never early.
fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

// ---- POST /v1/check ----------------------------------------------------

/// The body of `POST /v1/check`, parsed in one pass: the fields of both
/// forms, told apart afterwards (see [`CheckBody::into_check`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckBody<'a> {
    // Borrowed from the body unless escaped.
    #[serde(default, borrow)]
    rule: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    key: Option<Cow<'a, str>>,
    #[serde(default)]
    cost: Option<serde_json::Number>,
    #[serde(default, borrow)]
    tier: Option<Cow<'a, str>>,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    headers: Option<BTreeMap<String, HeaderValues>>,
    #[serde(default)]
    ip: Option<String>,
}

/// What `POST /v1/check` was asked.
enum CheckKind<'a> {
    /// `{"rule", "key", "cost", "tier"}`: one rule, one key, decided by the
    /// store.
    Rule(RuleCheck<'a>),
    /// `{"method", "path", "host", "headers", "ip"}`: a request, decided as
    /// the middleware would.
    Request(RequestCheck),
}

#[derive(Debug)]
struct RuleCheck<'a> {
    rule: Cow<'a, str>,
    key: Cow<'a, str>,
    cost: Option<serde_json::Number>,
    tier: Option<Cow<'a, str>>,
}

#[derive(Debug)]
struct RequestCheck {
    method: Option<String>,
    path: String,
    host: Option<String>,
    headers: BTreeMap<String, HeaderValues>,
    ip: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum HeaderValues {
    One(String),
    Many(Vec<String>),
}

impl<'a> CheckBody<'a> {
    /// Which form the body is: a rule check has `rule`, a request
    /// description `path` or `method`; a field of the other form is an
    /// error, as is a missing one.
    fn into_check(self) -> Result<CheckKind<'a>, String> {
        let present = |fields: &[(&'static str, bool)]| {
            fields
                .iter()
                .find(|(_, present)| *present)
                .map(|(name, _)| *name)
        };
        if let Some(rule) = self.rule {
            let other = present(&[
                ("method", self.method.is_some()),
                ("path", self.path.is_some()),
                ("host", self.host.is_some()),
                ("headers", self.headers.is_some()),
                ("ip", self.ip.is_some()),
            ]);
            if let Some(field) = other {
                return Err(format!(
                    "Invalid rule check: unknown field `{field}`, expected one of `rule`, `key`, `cost`, `tier`."
                ));
            }
            let key = self.key.ok_or("Invalid rule check: missing field `key`.")?;
            return Ok(CheckKind::Rule(RuleCheck {
                rule,
                key,
                cost: self.cost,
                tier: self.tier,
            }));
        }
        if self.path.is_none() && self.method.is_none() {
            return Err(
                "Expected either {\"rule\", \"key\", \"cost\"} or a request description \
                 {\"method\", \"path\", \"host\", \"headers\", \"ip\"}."
                    .to_string(),
            );
        }
        let other = present(&[
            ("key", self.key.is_some()),
            ("cost", self.cost.is_some()),
            ("tier", self.tier.is_some()),
        ]);
        if let Some(field) = other {
            return Err(format!(
                "Invalid request description: unknown field `{field}`, expected one of `method`, `path`, `host`, `headers`, `ip`."
            ));
        }
        let path = self
            .path
            .ok_or("Invalid request description: missing field `path`.")?;
        Ok(CheckKind::Request(RequestCheck {
            method: self.method,
            path,
            host: self.host,
            headers: self.headers.unwrap_or_default(),
            ip: self.ip,
        }))
    }
}

async fn check(
    Extract(state): Extract<State>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut authorization = headers.get_all(AUTHORIZATION).iter();
    // Two `Authorization` lines are no credentials.
    let authorization = match (authorization.next(), authorization.next()) {
        (Some(one), None) => Some(one.as_bytes()),
        _ => None,
    };
    if let Err(refused) = check_authorized(&state, authorization) {
        return (*refused).into_response();
    }
    match body {
        Ok(body) => check_answer(&state, &body).await.into_response(),
        Err(rejection) => problem(rejection.status(), rejection.body_text()),
    }
}

/// The credentials of an `Authorization: Bearer <token>` value.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, credentials) = value.split_at(space);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| credentials.trim_ascii())
}

/// Whether `POST /v1/check` may be answered for a request whose
/// `Authorization` value is `authorization`: always when no check token is
/// configured, else when it is `Bearer` and one of them. Every token is
/// compared, in time independent of the given one ([`same_secret`]), so
/// the time taken tells neither a token's bytes nor which one matched.
/// `Err` is the 401 to answer. Both servers call this before the body is
/// looked at: the HTTP/1.1 fast path (`crate::front`) and the router.
pub(crate) fn check_authorized(
    state: &State,
    authorization: Option<&[u8]>,
) -> Result<(), Box<Answer>> {
    let engine = state.shared.engine();
    let tokens = &engine.config.server.check_tokens;
    if tokens.is_empty() {
        return Ok(());
    }
    let given = authorization.and_then(bearer);
    let matched = given.is_some_and(|given| {
        tokens
            .iter()
            .fold(false, |any, t| any | same_secret(given, t.as_bytes()))
    });
    if matched {
        return Ok(());
    }
    let mut refused = Answer::problem(
        StatusCode::UNAUTHORIZED,
        "`POST /v1/check` needs `Authorization: Bearer <token>`, one of `[server] check_tokens`.",
    );
    refused.other = Some((
        WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"spillway-check\""),
    ));
    Err(Box::new(refused))
}

/// Whether a request to `POST /v1/check` must say who it is (check tokens
/// are configured): the HTTP/1.1 fast path reads its headers only then.
pub(crate) fn check_needs_token(state: &State) -> bool {
    !state.shared.engine().config.server.check_tokens.is_empty()
}

/// The answer of `POST /v1/check` to `body`, once the request is
/// authorized ([`check_authorized`]).
pub(crate) async fn check_answer(state: &State, body: &[u8]) -> Answer {
    let parsed = serde_json::from_slice::<CheckBody>(body).map_err(|e| {
        if e.is_data() {
            // Valid JSON, not of our shape: say which field.
            if body.trim_ascii_start().first() == Some(&b'{') {
                format!("Invalid check: {e}.")
            } else {
                "The body must be a JSON object.".to_string()
            }
        } else {
            format!("The body is not valid JSON: {e}.")
        }
    });
    let check = match parsed.and_then(CheckBody::into_check) {
        Ok(c) => c,
        Err(message) => return bad_request(message),
    };
    let engine = state.shared.engine();
    match check {
        CheckKind::Rule(c) => check_rule(&engine, c).await,
        CheckKind::Request(c) => check_request(&engine, c).await,
    }
}

/// The store rules of HTTP rule `index`: its default quota, then one per
/// tier, with the tier's name (see `Policy::store_rules`).
fn store_rules_of(engine: &Engine, index: usize) -> Vec<(RuleId, Option<String>)> {
    let policy = engine.layer.policy();
    let name = policy.rules()[index].name();
    let start = policy.rule_id(index, None).0;
    let end = if index + 1 < policy.rules().len() {
        policy.rule_id(index + 1, None).0
    } else {
        // Not the store's count: rules of the Envoy service's limit
        // overrides may follow the policy's.
        policy.store_rules().len()
    };
    let prefix = format!("{name}@");
    (start..end)
        .map(|i| {
            let tier = engine.store().rules()[i]
                .name()
                .strip_prefix(&prefix)
                .map(str::to_string);
            (RuleId(i), tier)
        })
        .collect()
}

fn rule_index(engine: &Engine, rule: &str) -> Option<usize> {
    engine
        .layer
        .policy()
        .rules()
        .iter()
        .position(|r| r.name() == rule)
}

async fn check_rule(engine: &Engine, c: RuleCheck<'_>) -> Answer {
    let engine = engine.layer.engine();
    if !engine.policy().rules().iter().any(|r| r.name() == c.rule) {
        return bad_request(format!("Unknown rule `{}`.", c.rule));
    }
    let cost = match &c.cost {
        None => 1,
        Some(n) => match n.as_u64() {
            Some(cost) => cost,
            None if n.as_i64().is_some() => {
                return bad_request(format!("`cost` must not be negative (got {n})."));
            }
            None => return bad_request(format!("`cost` must be an integer (got {n}).")),
        },
    };
    if c.key.is_empty() {
        return bad_request("`key` must not be empty.");
    }
    if c.key.len() > MAX_KEY_BYTES {
        return bad_request(format!(
            "`key` is {} bytes long; the most is {MAX_KEY_BYTES}.",
            c.key.len()
        ));
    }
    let charge = match engine.charge_named(&c.rule, c.tier.as_deref(), c.key.into_owned(), cost) {
        Ok(charge) => charge,
        Err(message) => return bad_request(message),
    };
    let ruling = engine
        .decide(smallvec::smallvec![charge], Asking::default())
        .await;
    decision_response(engine, &ruling)
}

async fn check_request(engine: &Engine, c: RequestCheck) -> Answer {
    let method = c.method.as_deref().unwrap_or("GET");
    let Ok(method) = Method::from_bytes(method.to_ascii_uppercase().as_bytes()) else {
        return bad_request(format!("`method`: `{method}` is not an HTTP method."));
    };
    if !c.path.starts_with('/') {
        return bad_request(format!("`path` must start with `/` (got `{}`).", c.path));
    }
    let Ok(uri) = http::Uri::try_from(c.path.as_str()) else {
        return bad_request(format!("`path`: `{}` is not a valid path.", c.path));
    };
    let mut headers = HeaderMap::new();
    for (name, values) in &c.headers {
        let Ok(header) = HeaderName::try_from(name.as_str()) else {
            return bad_request(format!("`headers`: `{name}` is not a header name."));
        };
        let values = match values {
            HeaderValues::One(v) => std::slice::from_ref(v),
            HeaderValues::Many(vs) => vs.as_slice(),
        };
        for v in values {
            let Ok(value) = HeaderValue::try_from(v.as_str()) else {
                return bad_request(format!("`headers.{name}`: not a valid header value."));
            };
            headers.append(header.clone(), value);
        }
    }
    if let Some(host) = &c.host {
        let Ok(value) = HeaderValue::try_from(host.as_str()) else {
            return bad_request(format!("`host`: `{host}` is not a valid host."));
        };
        headers.insert(http::header::HOST, value);
    }
    let peer = match &c.ip {
        None => None,
        Some(ip) => match ip
            .parse::<IpAddr>()
            .map(|ip| SocketAddr::new(ip, 0))
            .or_else(|_| ip.parse::<SocketAddr>())
        {
            Ok(addr) => Some(addr),
            Err(_) => return bad_request(format!("`ip`: `{ip}` is not an IP address.")),
        },
    };
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = method;
    parts.uri = uri;
    parts.headers = headers;
    if let Some(addr) = peer {
        parts.extensions.insert(ClientAddr(addr));
    }
    let engine = engine.layer.engine();
    let ruling = engine.decide_parts(&parts).await;
    decision_response(engine, &ruling)
}

/// The answer of `/v1/check` on a ruling: a 400 or a 503 when it could
/// not be decided; otherwise 200 with the outcome, every rule's decision,
/// and the rate-limit fields the middleware would have sent. The JSON (see
/// docs/openapi.json) is written field by field, in the documented order.
fn decision_response(engine: &TowerEngine<AnyStore>, ruling: &Ruling) -> Answer {
    let (allowed, status, denied_by, retry_after, delay, limited, shadowed) = match ruling.outcome()
    {
        Outcome::BadRequest(message) => return bad_request(message.clone()),
        Outcome::Unavailable(_) => {
            return unavailable("The rate limiter cannot reach its store; try again shortly.");
        }
        Outcome::Rejected { rule, retry_after } => (
            false,
            429,
            Some(rule.as_str()),
            Some(ms(*retry_after)),
            0,
            &[][..],
            &[][..],
        ),
        Outcome::Admitted {
            delay,
            limited,
            shadowed,
        } => (
            true,
            200,
            None,
            None,
            ms(*delay),
            limited.as_slice(),
            shadowed.as_slice(),
        ),
        Outcome::Unlimited => (true, 200, None, None, 0, &[][..], &[][..]),
    };
    let json = DecisionJson {
        allowed,
        status,
        denied_by,
        retry_after,
        delay,
        limited,
        shadowed,
    };
    Answer {
        status: StatusCode::OK,
        content_type: "application/json",
        fields: engine.fields(ruling),
        other: None,
        body: json.write(engine.report(ruling)),
    }
}

/// The outcome's part of a 200 answer of `/v1/check`.
struct DecisionJson<'a> {
    allowed: bool,
    status: u64,
    denied_by: Option<&'a str>,
    retry_after: Option<u64>,
    delay: u64,
    limited: &'a [String],
    shadowed: &'a [String],
}

impl DecisionJson<'_> {
    /// The body, with `rules`' decisions.
    fn write<'r>(&self, rules: impl Iterator<Item = Reported<'r>>) -> Vec<u8> {
        let Self {
            allowed,
            status,
            denied_by,
            retry_after,
            delay,
            limited,
            shadowed,
        } = *self;
        let mut out = Json(Vec::with_capacity(512));
        out.raw("{\"allowed\":");
        out.bool(allowed);
        out.raw(",\"status\":");
        out.u64(status);
        out.raw(",\"denied_by\":");
        out.opt_str(denied_by);
        out.raw(",\"retry_after_ms\":");
        out.opt_u64(retry_after);
        out.raw(",\"delay_ms\":");
        out.u64(delay);
        out.raw(",\"limited\":");
        out.strs(limited);
        out.raw(",\"shadowed\":");
        out.strs(shadowed);
        out.raw(",\"rules\":[");
        for (i, r) in rules.enumerate() {
            let d = r.decision;
            out.raw(if i == 0 { "{\"rule\":" } else { ",{\"rule\":" });
            out.str(r.rule);
            out.raw(",\"tier\":");
            out.opt_str(r.tier);
            out.raw(",\"key\":");
            out.str(r.key);
            out.raw(",\"cost\":");
            out.u64(r.cost);
            out.raw(",\"action\":");
            out.str(r.action.name());
            out.raw(",\"allowed\":");
            out.bool(d.allowed);
            out.raw(",\"limit\":");
            out.u64(d.limit);
            out.raw(",\"remaining\":");
            out.u64(d.remaining);
            out.raw(",\"reset_after_ms\":");
            out.u64(ms(d.reset_after));
            out.raw(",\"retry_after_ms\":");
            out.opt_u64(d.retry_after.map(ms));
            out.raw(",\"delay_ms\":");
            out.u64(ms(d.delay));
            out.raw("}");
        }
        out.raw("]}");
        out.0
    }
}

/// JSON written by hand, value by value.
struct Json(Vec<u8>);

impl Json {
    fn raw(&mut self, text: &str) {
        self.0.extend_from_slice(text.as_bytes());
    }

    fn bool(&mut self, b: bool) {
        self.raw(if b { "true" } else { "false" });
    }

    fn u64(&mut self, n: u64) {
        crate::http1::wire::put_u64(&mut self.0, n);
    }

    fn opt_u64(&mut self, n: Option<u64>) {
        match n {
            Some(n) => self.u64(n),
            None => self.raw("null"),
        }
    }

    /// A string, escaped as JSON requires (by serde_json when it needs
    /// escaping at all).
    fn str(&mut self, s: &str) {
        let plain = s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\');
        if plain {
            self.0.push(b'"');
            self.0.extend_from_slice(s.as_bytes());
            self.0.push(b'"');
        } else {
            // Writing into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut self.0, s);
        }
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.raw("null"),
        }
    }

    fn strs(&mut self, all: &[String]) {
        self.raw("[");
        for (i, s) in all.iter().enumerate() {
            if i > 0 {
                self.raw(",");
            }
            self.str(s);
        }
        self.raw("]");
    }
}

// ---- health, metrics, OpenAPI ------------------------------------------

async fn healthz() -> Response {
    json_response(StatusCode::OK, &json!({ "status": "ok" }))
}

/// How long a readiness probe waits for Redis.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

async fn readyz(Extract(state): Extract<State>) -> Response {
    let engine = state.shared.engine();
    let Some(redis) = engine.store().redis() else {
        return json_response(
            StatusCode::OK,
            &json!({ "status": "ready", "store": "memory" }),
        );
    };
    let on_error = engine.config.store.on_error;
    let (healthy, ready) = match on_error {
        // Serving needs Redis: ask it (a cost-0 peek at a key no client
        // uses; it writes nothing).
        OnError::FailClosed => {
            let healthy = match redis.rules().first() {
                None => redis.is_healthy(),
                Some(_) => {
                    let probe = [Check {
                        rule: RuleId(0),
                        key: "\u{0}spillway-readyz",
                        cost: 0,
                    }];
                    matches!(
                        tokio::time::timeout(PROBE_TIMEOUT, redis.check(&probe)).await,
                        Ok(Ok(_))
                    )
                }
            };
            (healthy, healthy)
        }
        // Requests are served without Redis too (admitted, or decided in
        // memory): ready either way.
        OnError::FailOpen | OnError::Local { .. } => (redis.is_healthy(), true),
    };
    let policy = match on_error {
        OnError::FailOpen => "fail_open",
        OnError::FailClosed => "fail_closed",
        OnError::Local { .. } => "local",
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(
        status,
        &json!({
            "status": if ready { "ready" } else { "unavailable" },
            "store": "redis",
            "redis_healthy": healthy,
            "on_error": policy,
        }),
    )
}

async fn metrics(Extract(state): Extract<State>) -> Response {
    let engine = state.shared.engine();
    let body = state.metrics.encode(&engine);
    let mut res = body.into_response();
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
    );
    res
}

async fn openapi() -> Response {
    let mut res = OPENAPI.into_response();
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

// ---- /admin ------------------------------------------------------------

/// Compares two secrets in time independent of where they differ: their
/// SHA-256 digests are compared byte by byte without stopping early.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    let (a, b) = (Sha256::digest(given), Sha256::digest(expected));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

async fn admin_auth(Extract(state): Extract<State>, req: Request, next: Next) -> Response {
    let token = state.shared.engine().config.server.admin_token.clone();
    // Without a token the admin API does not exist.
    let Some(token) = token else {
        return not_found().await;
    };
    let given = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, credentials) = v.trim().split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| credentials.trim())
        });
    match given {
        Some(given) if same_secret(given.as_bytes(), token.as_bytes()) => next.run(req).await,
        _ => {
            let mut res = problem(
                StatusCode::UNAUTHORIZED,
                "The admin API needs `Authorization: Bearer <admin_token>`.",
            );
            res.headers_mut().insert(
                WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"spillway-admin\""),
            );
            res
        }
    }
}

/// What an admin path names: the engine, the rule, the key, and the
/// rule's store rules (with their tiers).
type AdminTarget = (
    std::sync::Arc<Engine>,
    String,
    String,
    Vec<(RuleId, Option<String>)>,
);

/// The target of an admin path. A rule is a configured one or a limit
/// override the Envoy service counts (`envoy-override:5-per-minute`).
fn admin_target(
    state: &State,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<AdminTarget, Box<Response>> {
    let (rule, key) = match path {
        Ok(Path(p)) => p,
        Err(rejection) => {
            return Err(Box::new(problem(rejection.status(), rejection.body_text())));
        }
    };
    let engine = state.shared.engine();
    let targets = match rule_index(&engine, &rule) {
        Some(index) => store_rules_of(&engine, index),
        None => match engine.override_named(&rule) {
            Some(id) => vec![(id, None)],
            None => {
                return Err(Box::new(problem(
                    StatusCode::NOT_FOUND,
                    format!("No rule named `{rule}`."),
                )));
            }
        },
    };
    Ok((engine, rule, key, targets))
}

async fn admin_key(
    Extract(state): Extract<State>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (engine, rule, key, targets) = match admin_target(&state, path) {
        Ok(target) => target,
        Err(response) => return *response,
    };
    let mut quotas = Vec::new();
    for (id, tier) in targets {
        // Cost 0: a peek that charges nothing and leaves no state behind.
        let peek = [Check {
            rule: id,
            key: &key,
            cost: 0,
        }];
        let d = match engine.store().check(&peek).await {
            Ok(verdict) => verdict.decisions[0],
            Err(e) => {
                return unavailable(format!("The store could not answer: {e}.")).into_response();
            }
        };
        quotas.push(json!({
            "store_rule": engine.store().rules()[id.0].name(),
            "tier": tier,
            "limit": d.limit,
            "remaining": d.remaining,
            "reset_after_ms": ms(d.reset_after),
        }));
    }
    json_response(
        StatusCode::OK,
        &json!({ "rule": rule, "key": key, "quotas": quotas }),
    )
}

async fn admin_reset(
    Extract(state): Extract<State>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (engine, rule, key, targets) = match admin_target(&state, path) {
        Ok(target) => target,
        Err(response) => return *response,
    };
    let mut reset = Vec::new();
    let mut held = false;
    for (id, _) in targets {
        let store = engine.store();
        held |= match (store.memory(), store.redis()) {
            (Some(memory), _) => memory.reset(id, &key),
            (None, Some(redis)) => match redis.reset(id, &key).await {
                Ok(held) => held,
                Err(e) => {
                    return unavailable(format!("The store could not reset the key: {e}."))
                        .into_response();
                }
            },
            (None, None) => false,
        };
        reset.push(store.rules()[id.0].name().to_string());
    }
    tracing::info!(rule = %rule, key = %key, held, "admin: key reset");
    json_response(
        StatusCode::OK,
        &json!({ "rule": rule, "key": key, "reset": reset, "held": held }),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use spillway::Decision;
    use spillway_tower::Action;

    use super::*;

    /// The JSON of an outcome, as [`decision_response`] writes it.
    fn decision_json<'r>(
        outcome: &Outcome,
        rules: impl IntoIterator<Item = Reported<'r>>,
    ) -> Vec<u8> {
        let none: &[String] = &[];
        let json = match outcome {
            Outcome::Rejected { rule, retry_after } => DecisionJson {
                allowed: false,
                status: 429,
                denied_by: Some(rule),
                retry_after: Some(ms(*retry_after)),
                delay: 0,
                limited: none,
                shadowed: none,
            },
            Outcome::Admitted {
                delay,
                limited,
                shadowed,
            } => DecisionJson {
                allowed: true,
                status: 200,
                denied_by: None,
                retry_after: None,
                delay: ms(*delay),
                limited,
                shadowed,
            },
            _ => unreachable!("a decided outcome"),
        };
        json.write(rules.into_iter())
    }

    /// The hand-written JSON of a decision reads back as the documented
    /// fields, whatever the strings hold.
    #[test]
    fn a_decision_is_written_as_json_that_reads_back() {
        let decision = Decision {
            allowed: false,
            limit: 10,
            remaining: 0,
            reset_after: Duration::from_micros(1_500),
            retry_after: Some(Duration::from_micros(999)),
            delay: Duration::ZERO,
        };
        let odd = "a \"quoted\" key\\ with\nnewline, tab\t, \u{1} and é ✓";
        let rules = [
            Reported {
                rule: "plain",
                tier: None,
                key: odd,
                cost: 3,
                action: Action::Reject,
                decision: &decision,
            },
            Reported {
                rule: "second",
                tier: Some("pro"),
                key: "k",
                cost: 0,
                action: Action::Shadow,
                decision: &decision,
            },
        ];
        let rejected = Outcome::Rejected {
            rule: "plain".to_string(),
            retry_after: Duration::from_millis(2),
        };
        let body = decision_json(&rejected, rules);
        let body: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
        let rule = |name: &str, tier: Option<&str>, key: &str, cost: u64, action: &str| {
            json!({
                "rule": name, "tier": tier, "key": key, "cost": cost, "action": action,
                "allowed": false, "limit": 10, "remaining": 0, "reset_after_ms": 2,
                "retry_after_ms": 1, "delay_ms": 0,
            })
        };
        let expected = json!({
            "allowed": false, "status": 429, "denied_by": "plain", "retry_after_ms": 2,
            "delay_ms": 0, "limited": [], "shadowed": [],
            "rules": [
                rule("plain", None, odd, 3, "reject"),
                rule("second", Some("pro"), "k", 0, "shadow"),
            ],
        });
        assert_eq!(body, expected);
        let admitted = Outcome::Admitted {
            delay: Duration::from_micros(1),
            limited: vec!["x\"y".to_string(), "z".to_string()],
            shadowed: vec!["w".to_string()],
        };
        let body = decision_json(&admitted, []);
        let body: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
        let expected = json!({
            "allowed": true, "status": 200, "denied_by": null, "retry_after_ms": null,
            "delay_ms": 1, "limited": ["x\"y", "z"], "shadowed": ["w"], "rules": [],
        });
        assert_eq!(body, expected);
    }
}

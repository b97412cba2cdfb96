//! `POST /v1/check`: a rule and a key, or a request described, decided by
//! the engine.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use axum::extract::State as Extract;
use axum::response::{IntoResponse, Response};
use http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use serde::Deserialize;
use spillway_tower::{Asking, ClientAddr, Outcome, Reported, Ruling};

use crate::state::Loaded;
use crate::state::State;

use super::MAX_KEY_BYTES;
use super::admin::same_secret;
use super::answer::{Answer, bad_request, ms, read_body, unavailable};
use super::lease;
use super::settle::{self, SettleKey};

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
    free_form_key: Option<bool>,
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
    free_form_key: bool,
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
                    "Invalid rule check: unknown field `{field}`, expected one of `rule`, `key`, `cost`, `tier`, `free_form_key`."
                ));
            }
            let key = self.key.ok_or("Invalid rule check: missing field `key`.")?;
            return Ok(CheckKind::Rule(RuleCheck {
                rule,
                key,
                cost: self.cost,
                tier: self.tier,
                free_form_key: self.free_form_key.unwrap_or(false),
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
            ("free_form_key", self.free_form_key.is_some()),
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

pub(super) async fn check(
    Extract(state): Extract<State>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    match authorized_body(&state, &headers, body).await {
        Ok(body) => check_answer(&state, &body).await.into_response(),
        Err(refused) => refused,
    }
}

/// The body of a request to `POST /v1/check` or `/v1/settle`, read once
/// its caller is authorized ([`check_authorized`]); `Err` is the 401, or
/// the 413 of a body too large.
pub(super) async fn authorized_body(
    state: &State,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<axum::body::Bytes, Response> {
    let mut authorization = headers.get_all(AUTHORIZATION).iter();
    // Two `Authorization` lines are no credentials.
    let authorization = match (authorization.next(), authorization.next()) {
        (Some(one), None) => Some(one.as_bytes()),
        _ => None,
    };
    check_authorized(state, authorization).map_err(|refused| (*refused).into_response())?;
    read_body(body).await
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
/// looked at: the HTTP/1.1 fast path (`crate::api::site`) and the router.
pub(crate) fn check_authorized(
    state: &State,
    authorization: Option<&[u8]>,
) -> Result<(), Box<Answer>> {
    let engine = state.live.current();
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
    refused.other = Some(Box::new((
        WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"spillway-check\""),
    )));
    Err(Box::new(refused))
}

/// Whether a request to `POST /v1/check` must say who it is (check tokens
/// are configured): the HTTP/1.1 fast path reads its headers only then.
pub(crate) fn check_needs_token(state: &State) -> bool {
    !state.live.current().config.server.check_tokens.is_empty()
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
    let engine = state.live.current();
    let ruling = match check {
        CheckKind::Rule(c) => check_rule(&engine, c).await,
        CheckKind::Request(c) => check_request(&engine, c).await,
    };
    match ruling {
        Ok(ruling) => decision_response(&engine, ruling, &state.settle_key),
        Err(answer) => *answer,
    }
}

/// Whether `key` is one Envoy's descriptors with entry keys `names` build
/// (`remote_address=10.0.0.1`): `name=value` pairs in that order.
fn is_descriptor_key(key: &str, names: &[String]) -> bool {
    let pairs: Vec<&str> = key.split('|').collect();
    !names.is_empty()
        && pairs.len() == names.len()
        && pairs.iter().zip(names).all(|(pair, name)| {
            pair.split_once('=')
                .is_some_and(|(n, v)| n == name.as_str() && !v.contains('='))
        })
}

async fn check_rule(loaded: &Loaded, c: RuleCheck<'_>) -> Result<Ruling, Box<Answer>> {
    let engine = loaded.layer.engine();
    if !engine.policy().rules().iter().any(|r| r.name() == c.rule) {
        return refuse(format!("Unknown rule `{}`.", c.rule));
    }
    let cost = match &c.cost {
        None => 1,
        Some(n) => match n.as_u64() {
            Some(cost) => cost,
            None if n.as_i64().is_some() => {
                return refuse(format!("`cost` must not be negative (got {n})."));
            }
            None => return refuse(format!("`cost` must be an integer (got {n}).")),
        },
    };
    if c.key.is_empty() {
        return refuse("`key` must not be empty.");
    }
    if c.key.len() > MAX_KEY_BYTES {
        return refuse(format!(
            "`key` is {} bytes long; the most is {MAX_KEY_BYTES}.",
            c.key.len()
        ));
    }
    // A key of the rule's Envoy descriptor keys is a key of the rule too.
    let descriptor_keyed = loaded
        .layer
        .policy()
        .rules()
        .iter()
        .position(|r| r.name() == c.rule)
        .and_then(|i| loaded.config.descriptors.get(i))
        .is_some_and(|names| is_descriptor_key(&c.key, names));
    let key = c.key.into_owned();
    let free_form = c.free_form_key || descriptor_keyed;
    let charge = match engine.charge_for_key(&c.rule, c.tier.as_deref(), key, cost, free_form) {
        Ok(charge) => charge,
        Err(message) => return refuse(message),
    };
    Ok(engine.decide(smallvec::smallvec![charge], by_token()).await)
}

async fn check_request(loaded: &Loaded, c: RequestCheck) -> Result<Ruling, Box<Answer>> {
    let method = c.method.as_deref().unwrap_or("GET");
    let Ok(method) = Method::from_bytes(method.to_ascii_uppercase().as_bytes()) else {
        return refuse(format!("`method`: `{method}` is not an HTTP method."));
    };
    if !c.path.starts_with('/') {
        return refuse(format!("`path` must start with `/` (got `{}`).", c.path));
    }
    let Ok(uri) = http::Uri::try_from(c.path.as_str()) else {
        return refuse(format!("`path`: `{}` is not a valid path.", c.path));
    };
    let mut headers = HeaderMap::new();
    for (name, values) in &c.headers {
        let Ok(header) = HeaderName::try_from(name.as_str()) else {
            return refuse(format!("`headers`: `{name}` is not a header name."));
        };
        let values = match values {
            HeaderValues::One(v) => std::slice::from_ref(v),
            HeaderValues::Many(vs) => vs.as_slice(),
        };
        for v in values {
            let Ok(value) = HeaderValue::try_from(v.as_str()) else {
                return refuse(format!("`headers.{name}`: not a valid header value."));
            };
            headers.append(header.clone(), value);
        }
    }
    if let Some(host) = &c.host {
        let Ok(value) = HeaderValue::try_from(host.as_str()) else {
            return refuse(format!("`host`: `{host}` is not a valid host."));
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
            Err(_) => return refuse(format!("`ip`: `{ip}` is not an IP address.")),
        },
    };
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = method;
    parts.uri = uri;
    parts.headers = headers;
    if let Some(addr) = peer {
        parts.extensions.insert(ClientAddr(addr));
    }
    Ok(loaded
        .layer
        .engine()
        .decide_parts_asking(&parts, by_token())
        .await)
}

/// How a check whose reservations are settled by a token is decided: none
/// is held longer than a token can live, so that a settle the token can
/// still send never finds its reservation given back for nothing.
fn by_token() -> Asking {
    Asking {
        hold_at_most: Some(super::settle::longest_hold()),
        ..Asking::default()
    }
}

/// A check refused with a 400 before it reached the engine.
fn refuse(detail: impl Into<String>) -> Result<Ruling, Box<Answer>> {
    Err(Box::new(bad_request(detail)))
}

/// The answer of `/v1/check` on a ruling: a 400 or a 503 when it could
/// not be decided; otherwise 200 with the outcome, every rule's decision,
/// and the rate-limit fields the middleware would have sent. The JSON (see
/// docs/openapi.json) is written field by field, in the documented order.
fn decision_response(loaded: &Loaded, ruling: Ruling, settle_key: &SettleKey) -> Answer {
    let engine = loaded.layer.engine();
    let json = match ruling.outcome() {
        Outcome::BadRequest(message) => return bad_request(message.clone()),
        Outcome::Unavailable(_) => {
            return unavailable("The rate limiter cannot reach its store; try again shortly.");
        }
        decided => DecisionJson::of(decided),
    };
    // The rules the store could not decide, admitted by their failure
    // policy: named, with no decision.
    let charges = ruling.charges();
    let undecided: smallvec::SmallVec<[&str; 2]> = (0..charges.len())
        .filter(|&i| ruling.is_undecided(i))
        .map(|i| engine.rule_name(&charges[i]))
        .collect();
    let mut body = json.write(&undecided, engine.report(&ruling));
    let fields = engine.fields(&ruling);
    // A budget rule's reservation, to be settled by `POST /v1/settle`;
    // a concurrency rule's slot, to be renewed by `POST /v1/renew` and
    // given back by `POST /v1/release`.
    if (engine.has_budgets() || engine.has_leases())
        && let Some(held) = ruling.into_held()
    {
        let tokens = [
            ("settle", settle::issue(loaded, settle_key, &held)),
            ("lease", lease::issue(loaded, settle_key, &held)),
        ];
        for (field, issued) in tokens {
            let Some((token, within)) = issued else {
                continue;
            };
            body.pop();
            let mut out = Json(body);
            out.raw(",\"");
            out.raw(field);
            out.raw("\":{\"token\":");
            out.str(&token);
            out.raw(",\"expires_in_ms\":");
            out.u64(ms(within));
            out.raw("}}");
            body = out.0;
        }
    }
    Answer {
        status: StatusCode::OK,
        content_type: "application/json",
        fields,
        other: None,
        body,
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

impl<'a> DecisionJson<'a> {
    /// The outcome's part of a 200 answer. A bad request and an unavailable
    /// store are answered 400 and 503 instead, never with this.
    fn of(outcome: &'a Outcome) -> Self {
        let (allowed, status, denied_by, retry_after, delay, limited, shadowed) = match outcome {
            Outcome::Rejected {
                rule,
                retry_after,
                status,
            } => (
                false,
                u64::from(status.as_u16()),
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
            // A block list's refusal: no rule denied it.
            Outcome::Blocked {
                status,
                retry_after,
            } => (
                false,
                u64::from(status.as_u16()),
                None,
                retry_after.map(ms),
                0,
                &[][..],
                &[][..],
            ),
            Outcome::Unlimited | Outcome::BadRequest(_) | Outcome::Unavailable(_) => {
                (true, 200, None, None, 0, &[][..], &[][..])
            }
        };
        Self {
            allowed,
            status,
            denied_by,
            retry_after,
            delay,
            limited,
            shadowed,
        }
    }

    /// The body, with the `undecided` rules' names and `rules`' decisions.
    fn write<'r>(&self, undecided: &[&str], rules: impl Iterator<Item = Reported<'r>>) -> Vec<u8> {
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
        out.raw(",\"undecided\":");
        out.strs(undecided);
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
            out.raw(",\"refill_after_ms\":");
            out.u64(ms(d.refill_after));
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
        self.0
            .extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
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

    fn strs(&mut self, all: &[impl AsRef<str>]) {
        self.raw("[");
        for (i, s) in all.iter().enumerate() {
            if i > 0 {
                self.raw(",");
            }
            self.str(s.as_ref());
        }
        self.raw("]");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use spillway::Decision;
    use spillway_tower::Action;

    use serde_json::json;

    use super::*;

    /// The JSON of an outcome, as [`decision_response`] writes it.
    fn decision_json<'r>(
        outcome: &Outcome,
        undecided: &[&str],
        rules: impl IntoIterator<Item = Reported<'r>>,
    ) -> Vec<u8> {
        DecisionJson::of(outcome).write(undecided, rules.into_iter())
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
            refill_after: Duration::from_micros(1_001),
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
            status: http::StatusCode::TOO_MANY_REQUESTS,
        };
        let body = decision_json(&rejected, &[], rules);
        let body: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
        let rule = |name: &str, tier: Option<&str>, key: &str, cost: u64, action: &str| {
            json!({
                "rule": name, "tier": tier, "key": key, "cost": cost, "action": action,
                "allowed": false, "limit": 10, "remaining": 0, "reset_after_ms": 2,
                "refill_after_ms": 2, "retry_after_ms": 1, "delay_ms": 0,
            })
        };
        let expected = json!({
            "allowed": false, "status": 429, "denied_by": "plain", "retry_after_ms": 2,
            "delay_ms": 0, "limited": [], "shadowed": [], "undecided": [],
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
        let body = decision_json(&admitted, &["open\"rule"], []);
        let body: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
        let expected = json!({
            "allowed": true, "status": 200, "denied_by": null, "retry_after_ms": null,
            "delay_ms": 1, "limited": ["x\"y", "z"], "shadowed": ["w"],
            "undecided": ["open\"rule"], "rules": [],
        });
        assert_eq!(body, expected);
    }
}

//! The HTTP API's input: `POST /v1/check` bodies (JSON) and the admin API's
//! paths, through the API's router (`app`): any input is decided (200) or
//! refused with a 4xx problem+json that says what is wrong; never a 5xx,
//! never slower than a bound. The HTTP/1.1 server answers `/v1/check` with
//! the same function (`check_answer`), so these cases cover both.

use std::sync::LazyLock;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use proptest::prelude::*;
use serde_json::{Value, json};
use spillway_conformance::hostile::{config, mutated, within};
use spillway_server::config::Config;
use spillway_server::{State, app};
use tower::ServiceExt;

/// The most one request may take: these take well under a millisecond.
const BOUND: Duration = Duration::from_secs(10);

const CONFIG: &str = r#"
[server]
admin_token = "admin-secret"

[clients]
trusted_proxies = ["10.0.0.0/8"]
tier_header = "x-tier"

[tiers.gold]
api_keys = ["gold-key"]

[[rules]]
name = "once"
algorithm = "sliding_log"
limit = 1
window = "1h"

[[rules]]
name = "per-key"
key = ["api_key"]
fallback = []
algorithm = "token_bucket"
limit = 100
window = "1m"
burst = 10
[rules.tiers.gold]
limit = 1000
burst = 100

[[rules]]
name = "login"
match = { methods = ["POST"], path = "/login/{who}", host = "*.example" }
key = ["ip", "route"]
algorithm = "fixed_window"
limit = 5
window = "1m"
cost = "header:x-cost"
"#;

/// One runtime and one service for every case: each case is sent from a
/// thread of its own (see [`answer`]).
static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
});

static APP: LazyLock<Router> = LazyLock::new(|| app_of(CONFIG));

/// The same API behind check tokens.
static GUARDED: LazyLock<Router> = LazyLock::new(|| {
    app_of(&CONFIG.replace(
        "[server]\n",
        "[server]\ncheck_tokens = [\"new-token\", \"old-token\"]\n",
    ))
});

fn app_of(config: &str) -> Router {
    let config = Config::parse(config).expect("a valid config");
    let state = RUNTIME
        .block_on(State::new(config))
        .expect("the memory store");
    app(state)
}

/// What the API answered to `request`, within [`BOUND`]: its status, and
/// its body as JSON. Fails on a 5xx, on a 4xx that is not problem+json
/// with a detail, and on a 200 that is not a decision.
fn answer(request: Request<Body>) -> (StatusCode, Value) {
    answer_by(&APP, request)
}

/// [`answer`], by `app`.
fn answer_by(app: &'static LazyLock<Router>, request: Request<Body>) -> (StatusCode, Value) {
    let shown = format!("{request:?}");
    let (status, content_type, body) = within(BOUND, move || {
        // Built outside the runtime: the service is built on it.
        let app = LazyLock::force(app).clone();
        RUNTIME.block_on(async move {
            let response = app.oneshot(request).await.expect("infallible");
            let (parts, body) = response.into_parts();
            let body = body.collect().await.expect("a body").to_bytes();
            let content_type = parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .map(|v| v.to_str().unwrap_or("").to_string());
            (parts.status, content_type, body)
        })
    })
    .unwrap_or_else(|e| panic!("{e:?} for {shown}"));
    let text = String::from_utf8_lossy(&body);
    assert!(!status.is_server_error(), "{status} {text} for {shown}");
    let json: Value =
        serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{e}: {text} for {shown}"));
    if status.is_client_error() {
        assert_eq!(
            content_type.as_deref(),
            Some("application/problem+json"),
            "{status} {text} for {shown}"
        );
        let detail = json["detail"].as_str().unwrap_or("");
        assert!(!detail.trim().is_empty(), "{status} {text} for {shown}");
        assert_eq!(json["status"], status.as_u16(), "{text}");
    }
    (status, json)
}

fn check(body: Vec<u8>) -> (StatusCode, Value) {
    let request = Request::post("/v1/check")
        .header("content-type", "application/json")
        .body(Body::from(body))
        .expect("a request");
    let (status, json) = answer(request);
    assert!(
        status == StatusCode::OK || status == StatusCode::BAD_REQUEST,
        "{status} {json}"
    );
    if status == StatusCode::OK {
        assert!(json["allowed"].is_boolean(), "{json}");
    }
    (status, json)
}

/// Valid checks of both forms.
const SEEDS: &[&[u8]] = &[
    br#"{"rule": "once", "key": "ip=k"}"#,
    br#"{"rule": "per-key", "key": "api_key=gold-key", "cost": 3, "tier": "gold"}"#,
    br#"{"rule": "login", "key": "my-key", "free_form_key": true}"#,
    br#"{"method": "post", "path": "/login/ann?x=1", "host": "a.example", "headers": {"x-cost": "2", "x-tier": ["gold"], "x-forwarded-for": "192.0.2.1, 10.0.0.2"}, "ip": "10.0.0.1"}"#,
    br#"{"path": "/", "ip": "[2001:db8::1]:443", "headers": {"authorization": "Bearer gold-key"}}"#,
];

/// JSON's syntax, and values at and past their limits.
const PIECES: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b":",
    b",",
    b"\\",
    b"\\u0000",
    b"\\ud800",
    b"null",
    b"-1",
    b"1e999",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"0.5",
    br#""rule""#,
    br#""key""#,
    br#""cost""#,
    br#""path""#,
    br#""headers""#,
    br#""ip""#,
    "\u{feff}".as_bytes(),
];

/// The fields of both forms, and one that is neither.
const FIELDS: &[&str] = &[
    "rule",
    "key",
    "cost",
    "tier",
    "free_form_key",
    "method",
    "path",
    "host",
    "headers",
    "ip",
    "other",
];

/// A JSON value of any type, strings from anything.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::from),
        proptest::sample::select(
            &[
                "once", "per-key", "login", "gold", "/", "/login/x", "10.0.0.1", "GET"
            ][..]
        )
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map("[a-z-]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// An object of the check's fields (some of them) with values of any type.
fn check_shaped() -> impl Strategy<Value = Value> {
    proptest::collection::btree_map(proptest::sample::select(FIELDS), any_json(), 0..6)
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

proptest! {
    #![proptest_config(config(200))]

    #[test]
    fn any_body_is_decided_or_refused_with_a_reason(
        body in proptest::collection::vec(any::<u8>(), 0..200)
    ) {
        check(body);
    }

    #[test]
    fn any_json_is_decided_or_refused_with_a_reason(value in any_json()) {
        check(value.to_string().into_bytes());
    }

    #[test]
    fn a_check_of_any_shape_is_decided_or_refused_with_a_reason(value in check_shaped()) {
        check(value.to_string().into_bytes());
    }

    #[test]
    fn a_mutated_check_is_decided_or_refused_with_a_reason(body in mutated(SEEDS, PIECES)) {
        check(body);
    }

    #[test]
    fn a_valid_rule_check_is_decided(
        rule in proptest::sample::select(&["once", "per-key", "login"][..]),
        value in "\\PC{1,300}",
        // Up to the smallest capacity (once's 1): a cost above a rule's
        // capacity is refused.
        cost in 0..=1u64,
    ) {
        // A key of the rule's shape, its value escaped as the middleware
        // escapes it.
        let value = value.replace('%', "%25").replace('|', "%7C").replace('=', "%3D");
        let key = match rule {
            "per-key" => format!("api_key={value}"),
            "login" => format!("ip={value}|route=POST /login"),
            _ => format!("ip={value}"),
        };
        let body = json!({"rule": rule, "key": key, "cost": cost}).to_string().into_bytes();
        let (status, json) = check(body);
        // A key over 1024 bytes is the one refusal.
        if key.len() <= 1024 {
            prop_assert_eq!(status, StatusCode::OK, "{}", json);
        } else {
            prop_assert!(json["detail"].as_str().unwrap().contains("`key`"), "{}", json);
        }
    }

    #[test]
    fn a_valid_request_description_is_decided(
        method in "[A-Z]{1,10}",
        path in "/[a-zA-Z0-9/._~%!$&'()*+,;=:@-]{0,60}",
        value in "[ -~]{0,40}",
        ip in any::<std::net::IpAddr>(),
    ) {
        let body = json!({
            "method": method,
            "path": path,
            "headers": {"x-cost": value, "x-forwarded-for": value, "x-tier": value},
            "ip": ip.to_string(),
        });
        let (status, json) = check(body.to_string().into_bytes());
        // A cost header that is not a count is the one refusal (400).
        if status != StatusCode::OK {
            prop_assert!(json["detail"].as_str().unwrap().contains("x-cost"), "{}", json);
        }
    }

    #[test]
    fn any_admin_path_is_answered_or_refused_with_a_reason(
        method in proptest::sample::select(&[Method::GET, Method::DELETE, Method::POST][..]),
        rule in prop_oneof![Just("once".to_string()), "[^/?#]{0,12}"],
        key in proptest::collection::vec(any::<u8>(), 0..40),
        token in prop_oneof![Just("admin-secret".to_string()), ".{0,12}"],
    ) {
        // Any bytes, percent-encoded: the router decodes them.
        let encode = |bytes: &[u8]| {
            bytes.iter().map(|b| format!("%{b:02X}")).collect::<String>()
        };
        let path = format!("/admin/rules/{}/keys/{}", encode(rule.as_bytes()), encode(&key));
        let Ok(request) = Request::builder()
            .method(method)
            .uri(&path)
            .header("authorization", format!("Bearer {token}"))
            .body(Body::empty())
        else {
            return Ok(());
        };
        let (status, json) = answer(request);
        prop_assert!(
            [200, 400, 401, 404, 405].contains(&status.as_u16()),
            "{} {} for {}", status, json, path
        );
        if status == StatusCode::OK {
            prop_assert_eq!(&json["key"], &Value::from(String::from_utf8(key).unwrap()));
        }
    }

    #[test]
    fn any_authorization_is_a_token_or_a_401(
        value in prop_oneof![
            Just("Bearer new-token".to_string()),
            "(?i:bearer)[ \t]{0,3}(new-token|old-token|[ -~]{0,20})[ \t]{0,2}",
            "[ -~\t]{0,40}",
        ],
        twice in any::<bool>(),
    ) {
        let mut request = Request::post("/v1/check")
            .body(Body::from(r#"{"rule": "once", "key": "ip=auth"}"#))
            .expect("a request");
        let Ok(header) = http::HeaderValue::from_str(&value) else {
            return Ok(());
        };
        request.headers_mut().append("authorization", header.clone());
        if twice {
            request.headers_mut().append("authorization", header);
        }
        let (status, json) = answer_by(&GUARDED, request);
        let token = value.trim().split_once(' ').filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim());
        let valid = !twice && matches!(token, Some("new-token" | "old-token"));
        prop_assert_eq!(status, if valid { StatusCode::OK } else { StatusCode::UNAUTHORIZED }, "{}", json);
    }

    #[test]
    fn a_mutated_admin_path_is_answered_or_refused_with_a_reason(
        path in mutated(
            &[b"/admin/rules/once/keys/k", b"/admin/rules/per-key/keys/a%2Fb/c%20d"],
            &[b"/", b"%", b"%2F", b"%FF", b"%00", b"..", b"?", b"#", b"{", b"*", b"%C3%A4"],
        ),
    ) {
        let Ok(request) = Request::get(path.as_slice())
            .header("authorization", "Bearer admin-secret")
            .body(Body::empty())
        else {
            return Ok(());
        };
        answer(request);
    }
}

#[test]
fn the_seeds_are_decided() {
    for seed in SEEDS {
        let (status, json) = check(seed.to_vec());
        assert_eq!(status, StatusCode::OK, "{json}");
    }
}

/// What proptest found, kept with the exact input: a known endpoint asked
/// with a method it does not take was a 405 with an empty body, unlike
/// every other error of the API (problem+json).
#[test]
fn a_method_an_endpoint_does_not_take_is_a_problem_with_allow() {
    let request = |method: &Method, path: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", "Bearer admin-secret")
            .body(Body::empty())
            .expect("a request")
    };
    for (method, path, allow) in [
        (
            Method::POST,
            "/admin/rules/%6F%6E%63%65/keys/%13",
            "GET,HEAD,DELETE",
        ),
        (Method::GET, "/v1/check", "POST"),
        (Method::DELETE, "/healthz", "GET,HEAD"),
    ] {
        // The problem+json (checked by `answer`), then its `Allow`.
        let (status, json) = answer(request(&method, path));
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{json}");
        let sent = request(&method, path);
        let response = within(BOUND, move || {
            let app = APP.clone();
            RUNTIME.block_on(app.oneshot(sent)).expect("infallible")
        })
        .expect("an answer");
        assert_eq!(response.headers()["allow"], allow, "{method} {path}");
    }
}

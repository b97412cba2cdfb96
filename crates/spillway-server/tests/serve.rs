//! `spillway serve` on the in-memory store: the HTTP API through `app()`
//! with `oneshot` for the fine-grained cases, and the real server (`run()`
//! on port 0) for the rest: reload, graceful shutdown, every endpoint.

mod serve_support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use serve_support::{Answer, Service, eventually, metric_value, temp_dir, write_atomically};
use spillway_server::config::Config;
use spillway_server::{ConfigSource, State, app};
use spillway_tower::{ClientAddr, RateLimitLayer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

const CONFIG: &str = r#"
[server]
admin_token = "s3cret"

[clients]
trusted_proxies = ["10.0.0.0/8"]

[tiers.pro]
api_keys = ["pro-key"]

[[rules]]
name = "login"
match = { methods = ["POST"], path = "/login" }
key = ["ip"]
algorithm = "sliding_log"
limit = 3
window = "1h"

[[rules]]
name = "per-key"
match = { path = "/api/**" }
key = ["api_key"]
fallback = []
algorithm = "sliding_log"
limit = 2
window = "1h"
[rules.tiers.pro]
limit = 5

[[rules]]
name = "shadowed"
match = { path = "/shadow" }
algorithm = "sliding_log"
limit = 1
window = "1h"
action = "shadow"

[[rules]]
name = "degraded"
match = { path = "/degrade" }
algorithm = "sliding_log"
limit = 1
window = "1h"
action = "degrade"

[[rules]]
name = "weighted"
match = { path = "/weighted" }
algorithm = "token_bucket"
limit = 10
window = "1h"
cost = "header:x-cost"
"#;

fn config() -> Config {
    Config::parse(CONFIG).expect("the test configuration is valid")
}

async fn state() -> State {
    State::new(config()).await.expect("a memory store")
}

async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut req = Request::builder().method(method).uri(uri);
    // The caller's address, as the server gives it: a trusted proxy's
    // unless the test names another in `x-test-peer`.
    let mut peer: SocketAddr = "10.0.0.1:40000".parse().expect("an address");
    for (name, value) in headers {
        if *name == "x-test-peer" {
            peer = value.parse().expect("a peer address");
            continue;
        }
        req = req.header(*name, *value);
    }
    let mut req = req
        .body(Body::from(body.to_string()))
        .expect("a valid request");
    req.extensions_mut().insert(ClientAddr(peer));
    let res = app.clone().oneshot(req).await.expect("infallible");
    let (parts, body) = res.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("a body").to_bytes(),
    }
}

async fn check(app: &Router, body: Value) -> Answer {
    call(app, Method::POST, "/v1/check", &[], &body.to_string()).await
}

fn header<'a>(a: &'a Answer, name: &str) -> &'a str {
    a.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no {name} header in {:?}", a.headers))
}

#[tokio::test]
async fn a_rule_check_admits_then_denies_with_the_headers() {
    let app = app(state().await);
    for remaining in (0..3).rev() {
        let a = check(&app, json!({"rule": "login", "key": "ip=k1"})).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.content_type(), "application/json");
        let v = a.json();
        assert_eq!(v["allowed"], true);
        assert_eq!(v["status"], 200);
        assert_eq!(v["denied_by"], Value::Null);
        assert_eq!(v["rules"][0]["remaining"], remaining);
        assert_eq!(v["rules"][0]["limit"], 3);
        assert_eq!(v["rules"][0]["key"], "ip=k1");
        assert_eq!(v["rules"][0]["cost"], 1);
        assert_eq!(header(&a, "x-ratelimit-limit"), "3");
        assert_eq!(header(&a, "x-ratelimit-remaining"), remaining.to_string());
        assert_eq!(header(&a, "ratelimit-policy"), "\"login\";q=3;w=3600");
    }
    let a = check(&app, json!({"rule": "login", "key": "ip=k1"})).await;
    assert_eq!(a.status, StatusCode::OK);
    let v = a.json();
    assert_eq!(v["allowed"], false);
    assert_eq!(v["status"], 429);
    assert_eq!(v["denied_by"], "login");
    let retry = v["retry_after_ms"].as_u64().expect("a retry time");
    assert!(retry > 3_590_000 && retry <= 3_600_000, "{retry}");
    assert_eq!(v["rules"][0]["allowed"], false);
    assert_eq!(header(&a, "x-ratelimit-remaining"), "0");
    assert!(header(&a, "ratelimit").starts_with("\"login\";r=0;t="));

    // Another key has its own count; a cost-0 check only peeks.
    let v = check(&app, json!({"rule": "login", "key": "ip=k2", "cost": 0}))
        .await
        .json();
    assert_eq!(
        (v["allowed"].clone(), v["rules"][0]["remaining"].clone()),
        (json!(true), json!(3))
    );
    let v = check(&app, json!({"rule": "login", "key": "ip=k2", "cost": 3}))
        .await
        .json();
    assert_eq!(v["rules"][0]["remaining"], 0);
}

#[tokio::test]
async fn a_rule_check_follows_the_rule_action_and_tier() {
    let app = app(state().await);
    // Shadow: reported, let through, not charged.
    check(&app, json!({"rule": "shadowed", "key": "ip=s"})).await;
    let v = check(&app, json!({"rule": "shadowed", "key": "ip=s"}))
        .await
        .json();
    assert_eq!(
        (v["allowed"].clone(), v["status"].clone()),
        (json!(true), json!(200))
    );
    assert_eq!(v["shadowed"], json!(["shadowed"]));
    assert_eq!(v["rules"][0]["allowed"], false);
    assert_eq!(v["rules"][0]["action"], "shadow");
    // Degrade: let through, marked as limited.
    check(&app, json!({"rule": "degraded", "key": "ip=d"})).await;
    let v = check(&app, json!({"rule": "degraded", "key": "ip=d"}))
        .await
        .json();
    assert_eq!(v["allowed"], true);
    assert_eq!(v["limited"], json!(["degraded"]));

    // The pro tier has its own quota (5) and counters.
    let v = check(
        &app,
        json!({"rule": "per-key", "key": "api_key=c", "tier": "pro"}),
    )
    .await
    .json();
    assert_eq!(v["rules"][0]["tier"], "pro");
    assert_eq!(v["rules"][0]["limit"], 5);
    assert_eq!(v["rules"][0]["remaining"], 4);
    let v = check(&app, json!({"rule": "per-key", "key": "api_key=c"}))
        .await
        .json();
    assert_eq!(v["rules"][0]["tier"], Value::Null);
    assert_eq!(v["rules"][0]["limit"], 2);
    assert_eq!(v["rules"][0]["remaining"], 1);
    // A known tier the rule has no quota for: the rule's default quota.
    let v = check(&app, json!({"rule": "login", "key": "ip=c", "tier": "pro"}))
        .await
        .json();
    assert_eq!(v["rules"][0]["tier"], Value::Null);
    assert_eq!(v["rules"][0]["limit"], 3);
}

/// The two forms of `/v1/check` count a rule and key in one place: the
/// rule form resolves the key's tier as a request with that API key gets
/// it, and a key no request could have is a 400 naming the shape.
#[tokio::test]
async fn a_rule_check_counts_where_the_described_request_counts() {
    let app = app(state().await);
    let described = json!({"path": "/api/x", "headers": {"x-api-key": "pro-key"}});
    let v = check(&app, described.clone()).await.json();
    assert_eq!(
        (&v["rules"][0]["tier"], &v["rules"][0]["remaining"]),
        (&json!("pro"), &json!(4))
    );
    // The same key by name: the pro tier, and the same counter.
    let v = check(&app, json!({"rule": "per-key", "key": "api_key=pro-key"}))
        .await
        .json();
    assert_eq!(v["rules"][0]["tier"], "pro", "{v}");
    assert_eq!(v["rules"][0]["remaining"], 3);
    let v = check(&app, described).await.json();
    assert_eq!(v["rules"][0]["remaining"], 2);
    // A tier the key is not in is refused; its own is taken.
    let a = check(
        &app,
        json!({"rule": "per-key", "key": "api_key=pro-key", "tier": "free"}),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    let v = check(
        &app,
        json!({"rule": "per-key", "key": "api_key=pro-key", "tier": "pro"}),
    )
    .await
    .json();
    assert_eq!(v["rules"][0]["remaining"], 1);
    // Keys no request under the rule could have.
    for key in [
        "pro-key",
        "ip=203.0.113.7",
        "api_key=a|ip=b",
        "api_key=a=b",
        "API_KEY=pro-key",
    ] {
        let a = check(&app, json!({"rule": "per-key", "key": key})).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{key}: {}", a.text());
        let detail = a.json()["detail"].as_str().unwrap_or("").to_string();
        assert!(detail.contains("`api_key=VALUE`"), "{key}: {detail}");
    }
    // The login rule counts by IP: a fallback-less `ip=` key.
    let a = check(&app, json!({"rule": "login", "key": "api_key=pro-key"})).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    // An escaped value, and a key hashed for its length, are shapes too.
    let v = check(&app, json!({"rule": "per-key", "key": "api_key=a%7Cb"}))
        .await
        .json();
    assert_eq!(v["allowed"], true, "{v}");
    let hashed = format!("sha256:{}", "0".repeat(64));
    assert_eq!(
        check(&app, json!({"rule": "per-key", "key": hashed}))
            .await
            .status,
        StatusCode::OK
    );
    // The documented opt-out: any key, counted as given.
    let v = check(
        &app,
        json!({"rule": "per-key", "key": "my-own-key", "free_form_key": true}),
    )
    .await
    .json();
    assert_eq!(
        (&v["allowed"], &v["rules"][0]["key"]),
        (&json!(true), &json!("my-own-key"))
    );
    let a = check(&app, json!({"path": "/", "free_form_key": true})).await;
    assert_eq!(
        a.status,
        StatusCode::BAD_REQUEST,
        "a rule check's field only"
    );
}

#[tokio::test]
async fn a_request_description_is_decided_as_the_middleware_decides() {
    let config = config();
    let state = State::new(config.clone()).await.expect("a store");
    let api = app(state);
    // The same policy, as middleware in front of a handler.
    let middleware: Router = Router::new()
        .fallback(|| async { "served" })
        .layer(RateLimitLayer::in_memory(config.policy.clone()));
    let peer: SocketAddr = "203.0.113.7:5555".parse().expect("an address");
    for _ in 0..5 {
        let mut req = Request::builder()
            .method("POST")
            .uri("/login")
            .body(Body::empty())
            .expect("a request");
        req.extensions_mut().insert(ClientAddr(peer));
        let direct = middleware.clone().oneshot(req).await.expect("infallible");
        let described = check(
            &api,
            json!({"method": "POST", "path": "/login", "ip": "203.0.113.7"}),
        )
        .await;
        assert_eq!(described.status, StatusCode::OK);
        let v = described.json();
        assert_eq!(v["status"], direct.status().as_u16(), "{v}");
        for name in [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "ratelimit-policy",
        ] {
            assert_eq!(
                described.headers.get(name),
                direct.headers().get(name),
                "{name}"
            );
        }
        assert_eq!(v["rules"][0]["key"], "ip=203.0.113.7");
    }

    // Forwarded addresses count only from a trusted proxy.
    let v = check(
        &api,
        json!({"method": "POST", "path": "/login", "ip": "10.1.2.3",
               "headers": {"x-forwarded-for": "198.51.100.9"}}),
    )
    .await
    .json();
    assert_eq!(v["rules"][0]["key"], "ip=198.51.100.9");
    let v = check(
        &api,
        json!({"method": "POST", "path": "/login", "ip": "192.0.2.1",
               "headers": {"x-forwarded-for": ["198.51.100.9", "198.51.100.10"]}}),
    )
    .await
    .json();
    assert_eq!(v["rules"][0]["key"], "ip=192.0.2.1");

    // API keys select the tier; a request no rule matches is unlimited.
    let v = check(
        &api,
        json!({"path": "/api/x", "headers": {"x-api-key": "pro-key"}}),
    )
    .await
    .json();
    assert_eq!(v["rules"][0]["tier"], "pro");
    assert_eq!(v["rules"][0]["limit"], 5);
    let v = check(&api, json!({"method": "GET", "path": "/elsewhere"}))
        .await
        .json();
    assert_eq!(
        v,
        json!({"allowed": true, "status": 200, "denied_by": null,
        "retry_after_ms": null, "delay_ms": 0, "limited": [], "shadowed": [], "undecided": [],
        "rules": []})
    );
}

/// One budget, each endpoint its price (the example of docs/server.md):
/// every request costs 1 of the key's 100, `/reports` 10, a `POST
/// /exports` 20, in one counter per key.
#[tokio::test]
async fn route_costs_charge_one_counter_by_endpoint() {
    let config = Config::parse(
        r#"
[[rules]]
name = "per-api-key"
key = ["api_key"]
algorithm = "fixed_window"
limit = 100
window = "1m"
route_costs = [
  { path = "/reports/**", cost = 10 },
  { methods = ["POST"], path = "/exports", cost = 20 },
]
"#,
    )
    .expect("a valid configuration");
    let api = app_of(config).await;
    let ask = |method: &str, path: &str| json!({"method": method, "path": path, "headers": {"x-api-key": "k1"}});
    let mut left = 100;
    for (method, path, cost) in [
        ("GET", "/items", 1),
        ("GET", "/reports/2026", 10),
        ("GET", "/Reports;x=1/2026", 10),
        ("POST", "/exports", 20),
        ("GET", "/exports", 1),
    ] {
        left -= cost;
        let v = check(&api, ask(method, path)).await.json();
        assert_eq!(v["rules"][0]["cost"], cost, "{method} {path}: {v}");
        assert_eq!(v["rules"][0]["remaining"], left, "{method} {path}: {v}");
    }
}

#[tokio::test]
async fn malformed_input_is_a_400_problem_never_a_500() {
    let app = app(state().await);
    let long = "k".repeat(1025);
    let bad: Vec<(&str, String)> = vec![
        ("not JSON", "{\"rule\": ".into()),
        ("not an object", "[1, 2]".into()),
        ("an empty body", String::new()),
        ("neither form", "{}".into()),
        (
            "unknown rule",
            json!({"rule": "nope", "key": "ip=k"}).to_string(),
        ),
        (
            "negative cost",
            json!({"rule": "login", "key": "ip=k", "cost": -1}).to_string(),
        ),
        (
            "fractional cost",
            json!({"rule": "login", "key": "ip=k", "cost": 1.5}).to_string(),
        ),
        (
            "string cost",
            json!({"rule": "login", "key": "ip=k", "cost": "1"}).to_string(),
        ),
        (
            "cost above capacity",
            json!({"rule": "login", "key": "ip=k", "cost": 4}).to_string(),
        ),
        (
            "key too long",
            json!({"rule": "login", "key": long}).to_string(),
        ),
        ("empty key", json!({"rule": "login", "key": ""}).to_string()),
        ("missing key", json!({"rule": "login"}).to_string()),
        (
            "unknown tier",
            json!({"rule": "login", "key": "ip=k", "tier": "gold"}).to_string(),
        ),
        (
            "unknown field",
            json!({"rule": "login", "key": "ip=k", "colour": 1}).to_string(),
        ),
        (
            "both forms",
            json!({"rule": "login", "key": "ip=k", "path": "/"}).to_string(),
        ),
        (
            "bad method",
            json!({"method": "GE T", "path": "/"}).to_string(),
        ),
        ("relative path", json!({"path": "login"}).to_string()),
        (
            "bad header name",
            json!({"path": "/", "headers": {"bad header": "x"}}).to_string(),
        ),
        (
            "bad header value",
            json!({"path": "/", "headers": {"x": "a\nb"}}).to_string(),
        ),
        (
            "bad ip",
            json!({"path": "/", "ip": "not-an-ip"}).to_string(),
        ),
        ("missing path", json!({"method": "GET"}).to_string()),
        (
            "bad cost header from a trusted proxy",
            json!({"path": "/weighted", "ip": "10.0.0.1", "headers": {"x-cost": "lots"}})
                .to_string(),
        ),
        (
            "cost header above capacity",
            json!({"path": "/weighted", "ip": "10.0.0.1", "headers": {"x-cost": "11"}}).to_string(),
        ),
        // A credential sent twice, two that differ, or one unreadable is
        // refused, never keyed by a guess nor taken for none (the rule has
        // `fallback = []`).
        (
            "two API key lines",
            json!({"path": "/api/x", "headers": {"x-api-key": ["k1", "k2"]}}).to_string(),
        ),
        (
            "two API keys that differ",
            json!({"path": "/api/x", "headers": {"x-api-key": "junk", "authorization": "Bearer k1"}})
                .to_string(),
        ),
        (
            "an unreadable bearer token",
            json!({"path": "/api/x", "headers": {"authorization": "Bearer a b"}}).to_string(),
        ),
    ];
    for (what, body) in bad {
        let a = call(&app, Method::POST, "/v1/check", &[], &body).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{what}: {}", a.text());
        assert_eq!(a.content_type(), "application/problem+json", "{what}");
        let v = a.json();
        assert_eq!(v["status"], 400, "{what}");
        assert!(!v["detail"].as_str().unwrap_or("").is_empty(), "{what}");
    }
    // The boundary: 1024 bytes is accepted.
    let a = check(
        &app,
        json!({"rule": "login", "key": format!("ip={}", "k".repeat(1021))}),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    // Too large a body.
    let huge = format!(
        "{{\"rule\": \"login\", \"key\": \"{}\"}}",
        "k".repeat(70_000)
    );
    let a = call(&app, Method::POST, "/v1/check", &[], &huge).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(a.content_type(), "application/problem+json");
    // Wrong method, unknown path: not 500 either.
    let a = call(&app, Method::GET, "/v1/check", &[], "").await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED);
    let a = call(&app, Method::GET, "/nowhere", &[], "").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    // Garbage of every shape.
    for body in [
        "null",
        "1",
        "\"x\"",
        "{\"rule\": null}",
        "{\"path\": 5}",
        "{\"rule\": \"login\", \"key\": 5}",
        "{\"path\": \"/\", \"headers\": [1]}",
    ] {
        let a = call(&app, Method::POST, "/v1/check", &[], body).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text());
    }
}

#[tokio::test]
async fn health_and_readiness_on_memory() {
    let app = app(state().await);
    let a = call(&app, Method::GET, "/healthz", &[], "").await;
    assert_eq!(
        (a.status, a.json()),
        (StatusCode::OK, json!({"status": "ok"}))
    );
    let a = call(&app, Method::GET, "/readyz", &[], "").await;
    assert_eq!(
        (a.status, a.json()),
        (
            StatusCode::OK,
            json!({"status": "ready", "store": "memory"})
        )
    );
}

#[tokio::test]
async fn metrics_count_decisions_store_latency_and_keys() {
    let app = app(state().await);
    for _ in 0..4 {
        check(&app, json!({"rule": "login", "key": "ip=m"})).await;
    }
    check(
        &app,
        json!({"method": "POST", "path": "/login", "ip": "192.0.2.5"}),
    )
    .await;
    check(
        &app,
        json!({"rule": "per-key", "key": "api_key=m", "tier": "pro"}),
    )
    .await;
    let a = call(&app, Method::GET, "/metrics", &[], "").await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(
        a.content_type().starts_with("text/plain"),
        "{}",
        a.content_type()
    );
    let text = a.text();
    let value = |series: &str| {
        metric_value(&text, series).unwrap_or_else(|| panic!("no {series} in\n{text}"))
    };
    assert_eq!(
        value("spillway_decisions_total{rule=\"login\",outcome=\"allowed\"}"),
        4.0
    );
    assert_eq!(
        value("spillway_decisions_total{rule=\"login\",outcome=\"rejected\"}"),
        1.0
    );
    assert_eq!(
        value("spillway_decisions_total{rule=\"per-key\",outcome=\"allowed\"}"),
        1.0
    );
    assert_eq!(value("spillway_store_call_duration_seconds_count"), 6.0);
    assert_eq!(value("spillway_store_keys{rule=\"login\"}"), 2.0);
    assert_eq!(value("spillway_store_keys{rule=\"per-key@pro\"}"), 1.0);
    assert_eq!(value("spillway_store_keys{rule=\"per-key\"}"), 0.0);
    assert_eq!(value("spillway_store_fail_open_total"), 0.0);
    assert_eq!(value("spillway_store_errors_total{kind=\"timeout\"}"), 0.0);
    assert_eq!(value("spillway_store_healthy"), 1.0);
    assert_eq!(value("spillway_config_reloads_total{result=\"ok\"}"), 0.0);
    // This request itself is in flight.
    assert_eq!(value("spillway_http_requests_in_flight"), 1.0);
}

#[tokio::test]
async fn the_admin_api_needs_the_token() {
    let app = app(state().await);
    let path = "/admin/rules/login/keys/k";
    for headers in [
        vec![],
        vec![("authorization", "Bearer wrong")],
        vec![("authorization", "Bearer s3cre")],
        vec![("authorization", "Basic s3cret")],
        vec![("authorization", "s3cret")],
    ] {
        for method in [Method::GET, Method::DELETE] {
            let a = call(&app, method.clone(), path, &headers, "").await;
            assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{method} {headers:?}");
            assert_eq!(a.content_type(), "application/problem+json");
            assert_eq!(
                header(&a, "www-authenticate"),
                "Bearer realm=\"spillway-admin\""
            );
        }
    }
    let a = call(
        &app,
        Method::GET,
        path,
        &[("authorization", "Bearer s3cret")],
        "",
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    let a = call(
        &app,
        Method::GET,
        path,
        &[("authorization", "bearer s3cret")],
        "",
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);

    // Without a token configured, there is no admin API.
    let mut config = config();
    config.server.admin_token = None;
    let app = app_of(config).await;
    let a = call(
        &app,
        Method::GET,
        path,
        &[("authorization", "Bearer s3cret")],
        "",
    )
    .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
}

async fn app_of(config: Config) -> Router {
    app(State::new(config).await.expect("a store"))
}

#[tokio::test]
async fn the_admin_api_reads_and_resets_a_key_under_every_tier() {
    let app = app(state().await);
    let auth = [("authorization", "Bearer s3cret")];
    check(
        &app,
        json!({"rule": "per-key", "key": "api_key=a/b c", "cost": 2}),
    )
    .await;
    check(
        &app,
        json!({"rule": "per-key", "key": "api_key=a/b c", "tier": "pro", "cost": 3}),
    )
    .await;
    let path = "/admin/rules/per-key/keys/api_key=a/b%20c";
    let a = call(&app, Method::GET, path, &auth, "").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let v = a.json();
    assert_eq!(v["rule"], "per-key");
    assert_eq!(v["key"], "api_key=a/b c");
    let quotas = v["quotas"].as_array().expect("quotas");
    assert_eq!(quotas.len(), 2);
    assert_eq!(quotas[0]["store_rule"], "per-key");
    assert_eq!(quotas[0]["tier"], Value::Null);
    assert_eq!(
        (quotas[0]["limit"].clone(), quotas[0]["remaining"].clone()),
        (json!(2), json!(0))
    );
    assert!(quotas[0]["reset_after_ms"].as_u64().expect("ms") > 3_500_000);
    assert_eq!(quotas[1]["store_rule"], "per-key@pro");
    assert_eq!(quotas[1]["tier"], "pro");
    assert_eq!(quotas[1]["remaining"], 2);
    // Peeking charged nothing (reset_after_ms moves with the real clock, so
    // compare what a charge would change).
    let again = call(&app, Method::GET, path, &auth, "").await.json();
    let counts = |v: &Value| -> Vec<(Value, Value)> {
        v["quotas"]
            .as_array()
            .expect("quotas")
            .iter()
            .map(|q| (q["limit"].clone(), q["remaining"].clone()))
            .collect()
    };
    assert_eq!(counts(&again), counts(&v));

    let a = call(&app, Method::DELETE, path, &auth, "").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.json(),
        json!({"rule": "per-key", "key": "api_key=a/b c", "reset": ["per-key", "per-key@pro"], "held": true})
    );
    let v = call(&app, Method::GET, path, &auth, "").await.json();
    assert_eq!(v["quotas"][0]["remaining"], 2);
    assert_eq!(v["quotas"][1]["remaining"], 5);
    let v = check(
        &app,
        json!({"rule": "per-key", "key": "api_key=a/b c", "cost": 2}),
    )
    .await
    .json();
    assert_eq!(v["allowed"], true);
    // Resetting a key nobody holds; an unknown rule.
    let a = call(
        &app,
        Method::DELETE,
        "/admin/rules/login/keys/nobody",
        &auth,
        "",
    )
    .await;
    assert_eq!(a.json()["held"], false);
    let a = call(&app, Method::GET, "/admin/rules/nope/keys/k", &auth, "").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.content_type(), "application/problem+json");
    // A key that is not UTF-8 once decoded.
    let a = call(&app, Method::GET, "/admin/rules/login/keys/%FF", &auth, "").await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.content_type(), "application/problem+json");
}

/// `GET /admin/rules` lists every rule with its quotas; a rule's keys are
/// listed in pages, each key once under each quota it is held in; a peek
/// says whether the store holds the key.
#[tokio::test]
async fn the_admin_api_lists_the_rules_and_pages_through_the_keys() {
    let app = app(state().await);
    let auth = [("authorization", "Bearer s3cret")];
    let v = call(&app, Method::GET, "/admin/rules", &auth, "")
        .await
        .json();
    assert_eq!(v["store"], "memory");
    let names: Vec<&str> = v["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .map(|r| r["name"].as_str().expect("a name"))
        .collect();
    assert_eq!(&names[..3], ["login", "per-key", "shadowed"]);
    let per_key = &v["rules"][1];
    assert_eq!(per_key["action"], "reject");
    assert_eq!(
        per_key["quotas"],
        json!([
            {"store_rule": "per-key", "tier": null, "algorithm": "sliding_log", "limit": 2,
             "window_ms": 3_600_000, "capacity": 2, "mode": null, "held_keys": 0},
            {"store_rule": "per-key@pro", "tier": "pro", "algorithm": "sliding_log", "limit": 5,
             "window_ms": 3_600_000, "capacity": 5, "mode": null, "held_keys": 0},
        ])
    );

    // 250 keys on the default quota, 3 on the pro tier's.
    let mut expected = std::collections::BTreeSet::new();
    for i in 0..250 {
        let key = format!("api_key=k{i}");
        check(&app, json!({"rule": "per-key", "key": key})).await;
        expected.insert((key, None));
    }
    for key in ["api_key=pro-key"] {
        for _ in 0..3 {
            check(&app, json!({"rule": "per-key", "key": key})).await;
        }
        expected.insert((key.to_string(), Some("pro".to_string())));
    }
    let v = call(&app, Method::GET, "/admin/rules", &auth, "")
        .await
        .json();
    assert_eq!(v["rules"][1]["quotas"][0]["held_keys"], 250);
    assert_eq!(v["rules"][1]["quotas"][1]["held_keys"], 1);

    let mut listed = Vec::new();
    let mut uri = "/admin/rules/per-key/keys?limit=100".to_string();
    let mut pages = 0;
    loop {
        let a = call(&app, Method::GET, &uri, &auth, "").await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        let page = a.json();
        pages += 1;
        assert!(page["keys"].as_array().expect("keys").len() <= 100);
        for k in page["keys"].as_array().expect("keys") {
            listed.push((
                k["key"].as_str().expect("a key").to_string(),
                k["tier"].as_str().map(String::from),
            ));
        }
        match page["next"].as_str() {
            Some(next) => {
                let next: String = next
                    .bytes()
                    .map(|b| match b {
                        b'0'..=b'9' | b'a'..=b'z' | b'A'..=b'Z' | b'.' | b'_' | b'-' => {
                            (b as char).to_string()
                        }
                        _ => format!("%{b:02X}"),
                    })
                    .collect();
                uri = format!("/admin/rules/per-key/keys?limit=100&cursor={next}");
            }
            None => break,
        }
        assert!(pages < 10, "the listing ends");
    }
    // Full pages until the last: 253 keys in three.
    assert_eq!(pages, 3);
    let unique: std::collections::BTreeSet<_> = listed.iter().cloned().collect();
    assert_eq!(unique.len(), listed.len(), "each key once");
    assert_eq!(unique, expected);

    // A peek of a key held, and of one the store does not hold.
    let held = call(
        &app,
        Method::GET,
        "/admin/rules/per-key/keys/api_key=k7",
        &auth,
        "",
    )
    .await
    .json();
    assert_eq!(
        (held["held"].clone(), held["quotas"][0]["held"].clone()),
        (json!(true), json!(true))
    );
    assert_eq!(held["quotas"][1]["held"], false);
    let nobody = call(
        &app,
        Method::GET,
        "/admin/rules/per-key/keys/api_key=nobody",
        &auth,
        "",
    )
    .await
    .json();
    assert_eq!(nobody["held"], false, "{nobody}");
    assert_eq!(nobody["quotas"][0]["remaining"], 2);
}

// ---- the OpenAPI document ---------------------------------------------

fn openapi_file() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("docs/openapi.json"))
        .expect("valid JSON")
}

/// Checks `value` against a JSON schema of the document (the subset it
/// uses: $ref, type, enum, required, properties, additionalProperties,
/// items, oneOf, minimum, minLength, maxLength).
fn conforms(doc: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        let name = reference
            .strip_prefix("#/components/schemas/")
            .ok_or_else(|| format!("{at}: unsupported $ref {reference}"))?;
        return conforms(doc, &doc["components"]["schemas"][name], value, at);
    }
    if let Some(options) = schema.get("oneOf").and_then(Value::as_array) {
        let matching = options
            .iter()
            .filter(|o| conforms(doc, o, value, at).is_ok())
            .count();
        return if matching == 1 {
            Ok(())
        } else {
            Err(format!("{at}: matches {matching} of oneOf"))
        };
    }
    if let Some(types) = schema.get("type") {
        let types: Vec<&str> = match types {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => return Err(format!("{at}: bad type")),
        };
        let ok = types.iter().any(|t| match *t {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            "boolean" => value.is_boolean(),
            "null" => value.is_null(),
            _ => false,
        });
        if !ok {
            return Err(format!("{at}: {value} is not {types:?}"));
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        return Err(format!("{at}: {value} is not one of {allowed:?}"));
    }
    if let (Some(min), Some(n)) = (
        schema.get("minimum").and_then(Value::as_f64),
        value.as_f64(),
    ) && n < min
    {
        return Err(format!("{at}: {n} < {min}"));
    }
    if let Some(s) = value.as_str() {
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && (s.chars().count() as u64) < min
        {
            return Err(format!("{at}: shorter than {min}"));
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && (s.chars().count() as u64) > max
        {
            return Err(format!("{at}: longer than {max}"));
        }
    }
    if let Some(object) = value.as_object() {
        for required in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let name = required.as_str().unwrap_or("");
            if !object.contains_key(name) {
                return Err(format!("{at}: `{name}` is missing"));
            }
        }
        let properties = schema.get("properties").and_then(Value::as_object);
        for (name, v) in object {
            let field = format!("{at}.{name}");
            match properties.and_then(|p| p.get(name)) {
                Some(s) => conforms(doc, s, v, &field)?,
                None => match schema.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        return Err(format!("{field}: not documented"));
                    }
                    Some(s @ Value::Object(_)) => conforms(doc, s, v, &field)?,
                    _ => {}
                },
            }
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        for (i, v) in array.iter().enumerate() {
            conforms(doc, items, v, &format!("{at}[{i}]"))?;
        }
    }
    Ok(())
}

#[tokio::test]
async fn the_served_openapi_document_is_the_file() {
    let app = app(state().await);
    let a = call(&app, Method::GET, "/openapi.json", &[], "").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.content_type(), "application/json");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    assert_eq!(a.body, Bytes::from(std::fs::read(path).expect("the file")));
    assert_eq!(openapi_file()["openapi"], "3.1.0");
}

/// Every documented path and method answers with a documented status, a
/// documented content type and a body that fits the documented schema; the
/// documented examples are accepted; and the documented error statuses
/// happen as described.
#[tokio::test]
async fn every_documented_path_answers_as_documented() {
    let doc = openapi_file();
    let app = app(state().await);
    let auth = [("authorization", "Bearer s3cret")];
    let paths = doc["paths"].as_object().expect("paths");
    let documented: std::collections::BTreeSet<&str> = paths.keys().map(String::as_str).collect();
    let served: std::collections::BTreeSet<&str> = [
        "/v1/check",
        "/v1/settle",
        "/v1/renew",
        "/v1/release",
        "/v1/forward-auth",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
        "/admin/rules",
        "/admin/rules/{rule}/keys",
        "/admin/rules/{rule}/keys/{key}",
        "/admin/overrides",
        "/admin/tiers",
        "/admin/lists",
    ]
    .into();
    assert_eq!(documented, served);
    // What to send to each operation, and the status it must answer.
    /// A request to one operation: "URI\nBODY", headers, expected status.
    type Case = (String, Vec<(&'static str, &'static str)>, u16);
    let mut cases: BTreeMap<(String, String), Vec<Case>> = BTreeMap::new();
    let mut add = |path: &str,
                   method: &str,
                   uri: &str,
                   body: String,
                   headers: Vec<(&'static str, &'static str)>,
                   status: u16| {
        cases
            .entry((path.to_string(), method.to_string()))
            .or_default()
            .push((format!("{uri}\n{body}"), headers, status));
    };
    let examples = doc["paths"]["/v1/check"]["post"]["requestBody"]["content"]["application/json"]
        ["examples"]
        .as_object()
        .expect("examples");
    assert!(examples.len() >= 2);
    for example in examples.values() {
        add(
            "/v1/check",
            "post",
            "/v1/check",
            example["value"].to_string(),
            vec![],
            200,
        );
    }
    for _ in 0..4 {
        add(
            "/v1/check",
            "post",
            "/v1/check",
            json!({"rule": "login", "key": "ip=doc"}).to_string(),
            vec![],
            200,
        );
    }
    add("/v1/check", "post", "/v1/check", "{".into(), vec![], 400);
    add(
        "/v1/check",
        "post",
        "/v1/check",
        "x".repeat(70_000),
        vec![],
        413,
    );
    // A settle whose token was not signed here, and a bad body; the
    // settles that apply are tried in tests/serve_settle.rs.
    let example = &doc["paths"]["/v1/settle"]["post"]["requestBody"]["content"]["application/json"]
        ["examples"]["settle"]["value"];
    add(
        "/v1/settle",
        "post",
        "/v1/settle",
        example.to_string(),
        vec![],
        400,
    );
    add("/v1/settle", "post", "/v1/settle", "{}".into(), vec![], 400);
    // Lease tokens not signed here; the leases that hold are tried in
    // tests/serve_lease.rs.
    for path in ["/v1/renew", "/v1/release"] {
        let example = &doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["examples"]
            ["lease"]["value"];
        add(path, "post", path, example.to_string(), vec![], 400);
        add(path, "post", path, "{}".into(), vec![], 400);
    }
    let hook = "/v1/forward-auth";
    let login = vec![
        ("x-forwarded-method", "POST"),
        ("x-forwarded-uri", "/login"),
        ("x-forwarded-host", "api.example.com"),
        ("x-forwarded-for", "203.0.113.70"),
    ];
    for _ in 0..3 {
        add(hook, "get", hook, String::new(), login.clone(), 200);
    }
    add(hook, "get", hook, String::new(), login.clone(), 429);
    add(hook, "get", hook, String::new(), login[1..].to_vec(), 400);
    let mut stranger = login.clone();
    stranger.push(("x-test-peer", "192.0.2.1:40000"));
    add(hook, "get", hook, String::new(), stranger, 403);
    add("/healthz", "get", "/healthz", String::new(), vec![], 200);
    add("/readyz", "get", "/readyz", String::new(), vec![], 200);
    add("/metrics", "get", "/metrics", String::new(), vec![], 200);
    add(
        "/openapi.json",
        "get",
        "/openapi.json",
        String::new(),
        vec![],
        200,
    );
    let rules = "/admin/rules";
    add(rules, "get", rules, String::new(), auth.to_vec(), 200);
    add(rules, "get", rules, String::new(), vec![], 401);
    let keys = "/admin/rules/{rule}/keys";
    for (uri, status) in [
        ("/admin/rules/login/keys", 200),
        ("/admin/rules/per-key/keys?limit=1", 200),
        ("/admin/rules/login/keys?limit=0", 400),
        ("/admin/rules/login/keys?cursor=x", 400),
        ("/admin/rules/login/keys?page=2", 400),
        ("/admin/rules/nope/keys", 404),
    ] {
        add(keys, "get", uri, String::new(), auth.to_vec(), status);
    }
    add(
        keys,
        "get",
        "/admin/rules/login/keys",
        String::new(),
        vec![],
        401,
    );
    let admin = "/admin/rules/{rule}/keys/{key}";
    for method in ["get", "delete"] {
        add(
            admin,
            method,
            "/admin/rules/login/keys/ip=203.0.113.7",
            String::new(),
            auth.to_vec(),
            200,
        );
        add(
            admin,
            method,
            "/admin/rules/login/keys/ip=203.0.113.7",
            String::new(),
            vec![],
            401,
        );
        add(
            admin,
            method,
            "/admin/rules/nope/keys/k",
            String::new(),
            auth.to_vec(),
            404,
        );
    }
    // Each method's cases stand alone, whatever order they run in.
    let overrides = "/admin/overrides";
    let one = |key: &str| json!({"rule": "per-key", "key": key, "limit": 10}).to_string();
    add(
        overrides,
        "post",
        overrides,
        one("api_key=doc-post"),
        auth.to_vec(),
        201,
    );
    add(
        overrides,
        "post",
        overrides,
        one("api_key=doc-post"),
        auth.to_vec(),
        409,
    );
    add(
        overrides,
        "post",
        overrides,
        one("ip=1.2.3.4"),
        auth.to_vec(),
        400,
    );
    add(overrides, "post", overrides, one("api_key=x"), vec![], 401);
    add(
        overrides,
        "put",
        overrides,
        one("api_key=doc-put"),
        auth.to_vec(),
        201,
    );
    add(
        overrides,
        "put",
        overrides,
        one("api_key=doc-put"),
        auth.to_vec(),
        200,
    );
    add(overrides, "put", overrides, "{}".into(), auth.to_vec(), 400);
    for (uri, status) in [
        ("/admin/overrides", 200),
        ("/admin/overrides?rule=per-key&limit=1", 200),
        ("/admin/overrides?rule=per-key&key=api_key%3Dnone", 404),
        ("/admin/overrides?limit=0", 400),
    ] {
        add(overrides, "get", uri, String::new(), auth.to_vec(), status);
    }
    add(overrides, "get", overrides, String::new(), vec![], 401);
    for (uri, status) in [
        ("/admin/overrides?rule=per-key&key=api_key%3Ddoc-none", 404),
        ("/admin/overrides?rule=nope&key=k", 400),
    ] {
        add(
            overrides,
            "delete",
            uri,
            String::new(),
            auth.to_vec(),
            status,
        );
    }
    add(
        overrides,
        "delete",
        "/admin/overrides?rule=per-key&key=k",
        String::new(),
        vec![],
        401,
    );
    let tiers = "/admin/tiers";
    let put = |key: &str| json!({"api_key": key, "tier": "pro"}).to_string();
    add(tiers, "post", tiers, put("doc-post"), auth.to_vec(), 201);
    add(tiers, "post", tiers, put("doc-post"), auth.to_vec(), 409);
    add(tiers, "post", tiers, put(""), auth.to_vec(), 400);
    add(tiers, "post", tiers, put("x"), vec![], 401);
    add(tiers, "put", tiers, put("doc-put"), auth.to_vec(), 201);
    add(tiers, "put", tiers, put("doc-put"), auth.to_vec(), 200);
    add(tiers, "put", tiers, "{}".into(), auth.to_vec(), 400);
    for (uri, status) in [
        ("/admin/tiers", 200),
        ("/admin/tiers?limit=1", 200),
        ("/admin/tiers?api_key=nobody", 404),
        ("/admin/tiers?limit=0", 400),
    ] {
        add(tiers, "get", uri, String::new(), auth.to_vec(), status);
    }
    add(tiers, "get", tiers, String::new(), vec![], 401);
    let nobody = "/admin/tiers?api_key=nobody";
    add(tiers, "delete", nobody, String::new(), auth.to_vec(), 404);
    add(tiers, "delete", tiers, String::new(), auth.to_vec(), 400);
    add(tiers, "delete", nobody, String::new(), vec![], 401);
    let lists = "/admin/lists";
    let block = |ip: &str| json!({"list": "block", "ip": ip}).to_string();
    add(lists, "post", lists, block("192.0.2.1"), auth.to_vec(), 201);
    add(lists, "post", lists, block("192.0.2.1"), auth.to_vec(), 409);
    add(lists, "post", lists, block("nope"), auth.to_vec(), 400);
    add(lists, "post", lists, block("192.0.2.9"), vec![], 401);
    add(lists, "put", lists, block("192.0.2.2"), auth.to_vec(), 201);
    add(lists, "put", lists, block("192.0.2.2"), auth.to_vec(), 200);
    add(lists, "put", lists, "{}".into(), auth.to_vec(), 400);
    for (uri, status) in [
        ("/admin/lists", 200),
        ("/admin/lists?limit=1", 200),
        ("/admin/lists?api_key=nobody", 404),
        ("/admin/lists?limit=0", 400),
    ] {
        add(lists, "get", uri, String::new(), auth.to_vec(), status);
    }
    add(lists, "get", lists, String::new(), vec![], 401);
    let nobody = "/admin/lists?ip=198.51.100.0%2F24";
    add(lists, "delete", nobody, String::new(), auth.to_vec(), 404);
    add(lists, "delete", lists, String::new(), auth.to_vec(), 400);
    add(lists, "delete", nobody, String::new(), vec![], 401);

    for (path, item) in paths {
        for (method, operation) in item.as_object().expect("a path item") {
            if method == "parameters" {
                continue;
            }
            let tried = cases
                .get(&(path.clone(), method.clone()))
                .unwrap_or_else(|| panic!("no test for {method} {path}"));
            for (request, headers, expected) in tried {
                let (uri, body) = request.split_once('\n').expect("uri and body");
                let m = Method::from_bytes(method.to_uppercase().as_bytes()).expect("a method");
                let a = call(&app, m, uri, headers, body).await;
                assert_eq!(a.status.as_u16(), *expected, "{method} {uri}: {}", a.text());
                let documented = &operation["responses"][expected.to_string()];
                assert!(
                    documented.is_object(),
                    "{method} {path}: {expected} is not documented"
                );
                let Some(content) = documented["content"].as_object() else {
                    // Documented without a body: none is sent, and the
                    // documented headers are.
                    assert!(a.body.is_empty(), "{method} {uri} {expected}: {}", a.text());
                    for name in documented["headers"].as_object().into_iter().flatten() {
                        assert!(
                            a.headers.contains_key(name.0.to_lowercase().as_str()),
                            "{}",
                            name.0
                        );
                    }
                    continue;
                };
                let media = a.content_type().split(';').next().unwrap_or("").to_string();
                let schema = &content.get(&media).unwrap_or_else(|| {
                    panic!("{method} {path} {expected}: {media} not documented")
                })["schema"];
                if media.ends_with("json") {
                    conforms(&doc, schema, &a.json(), "body")
                        .unwrap_or_else(|e| panic!("{method} {uri} {expected}: {e}\n{}", a.text()));
                }
                if let Some(headers) = documented["headers"].as_object()
                    && a.json()["rules"].as_array().is_some_and(|r| !r.is_empty())
                {
                    for name in headers.keys() {
                        assert!(
                            a.headers.contains_key(name.to_lowercase().as_str()),
                            "{name}"
                        );
                    }
                }
            }
        }
    }
    // The request examples fit their own schema.
    for example in examples.values() {
        conforms(&doc, &doc["paths"]["/v1/check"]["post"]["requestBody"]["content"]["application/json"]["schema"], &example["value"], "example")
            .expect("the example fits");
    }
}

// ---- the real server ----------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_answers_on_port_0() {
    let service = Service::start(config(), None).await;
    let http = &service.http;
    let a = http.get("/healthz").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(http.get("/readyz").await.status, StatusCode::OK);
    for _ in 0..3 {
        let a = http
            .check(json!({"method": "POST", "path": "/login", "ip": "198.51.100.1"}))
            .await;
        assert_eq!(a.json()["status"], 200);
    }
    let a = http
        .check(json!({"method": "POST", "path": "/login", "ip": "198.51.100.1"}))
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.json()["status"], 429);
    assert_eq!(a.headers["x-ratelimit-remaining"], "0");
    let a = http
        .check(json!({"rule": "login", "key": "ip=k", "cost": -2}))
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        http.metric("spillway_decisions_total{rule=\"login\",outcome=\"rejected\"}")
            .await,
        Some(1.0)
    );
    let a = http
        .send(
            Method::DELETE,
            "/admin/rules/login/keys/ip=198.51.100.1",
            &[("authorization", "Bearer s3cret")],
            Bytes::new(),
        )
        .await;
    assert_eq!(a.json()["held"], true);
    let a = http
        .check(json!({"method": "POST", "path": "/login", "ip": "198.51.100.1"}))
        .await;
    assert_eq!(a.json()["status"], 200);
    assert_eq!(http.get("/openapi.json").await.status, StatusCode::OK);
}

const RELOAD_V1: &str = r#"
[[rules]]
name = "a"
algorithm = "sliding_log"
limit = 5
window = "1h"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_file_is_reloaded_keeping_counters_and_a_bad_one_is_refused() {
    let dir = temp_dir("reload-memory");
    let path = dir.join("spillway.toml");
    write_atomically(&path, RELOAD_V1);
    let source = ConfigSource::from(path.clone());
    let service = Service::start(source.load().expect("valid"), Some(source)).await;
    let http = service.http.clone();
    for _ in 0..2 {
        assert_eq!(
            http.check(json!({"rule": "a", "key": "ip=k"})).await.json()["allowed"],
            true
        );
    }

    // A new rule `b`; `a` is unchanged and keeps its count.
    let v2 = format!(
        "{RELOAD_V1}\n[[rules]]\nname = \"b\"\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1h\"\n"
    );
    write_atomically(&path, &v2);
    eventually(Duration::from_secs(10), "rule b is served", || {
        let http = http.clone();
        async move { http.check(json!({"rule": "b", "key": "ip=k"})).await.status == StatusCode::OK }
    })
    .await;
    let v = http.check(json!({"rule": "a", "key": "ip=k"})).await.json();
    assert_eq!(v["rules"][0]["remaining"], 2, "the counter survived: {v}");
    assert_eq!(
        http.metric("spillway_config_reloads_total{result=\"ok\"}")
            .await,
        Some(1.0)
    );

    // A bad file is refused; the previous configuration keeps serving.
    write_atomically(&path, &v2.replace("limit = 1\n", "limit = 0\n"));
    eventually(Duration::from_secs(10), "the bad file is refused", || {
        let http = http.clone();
        async move {
            http.metric("spillway_config_reloads_total{result=\"error\"}")
                .await
                == Some(1.0)
        }
    })
    .await;
    let v = http.check(json!({"rule": "a", "key": "ip=k"})).await.json();
    assert_eq!(v["rules"][0]["remaining"], 1);
    assert_eq!(
        http.check(json!({"rule": "b", "key": "ip=k2"}))
            .await
            .status,
        StatusCode::OK
    );

    // Reloading by hand works the same way.
    let mut reloader = spillway_server::reload::Reloader::new(
        service.state.clone(),
        Some(ConfigSource::from(path.clone())),
    )
    .expect("a reloader");
    let err = reloader.reload().await.expect_err("still the bad file");
    let message = err.to_string();
    assert!(
        message.contains("rules[1].limit") && message.contains("line "),
        "{message}"
    );
    write_atomically(&path, RELOAD_V1);
    reloader.reload().await.expect("a good file");
    assert_eq!(
        http.check(json!({"rule": "b", "key": "ip=k"})).await.status,
        StatusCode::BAD_REQUEST
    );
    let v = http.check(json!({"rule": "a", "key": "ip=k"})).await.json();
    assert_eq!(v["rules"][0]["remaining"], 0);
    assert_eq!(v["allowed"], true);
}

/// A reload that changes a rule's limit (not its algorithm or window)
/// keeps every key's count in memory, as it does on Redis: raising a limit
/// mid-window must not hand every client a fresh quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_a_limit_keeps_the_counts() {
    let dir = temp_dir("reload-limit");
    let path = dir.join("spillway.toml");
    write_atomically(&path, RELOAD_V1);
    let source = ConfigSource::from(path.clone());
    let service = Service::start(source.load().expect("valid"), Some(source)).await;
    let http = service.http.clone();
    for _ in 0..4 {
        let v = http.check(json!({"rule": "a", "key": "ip=k"})).await.json();
        assert_eq!(v["allowed"], true, "{v}");
    }
    let mut reloader = spillway_server::reload::Reloader::new(
        service.state.clone(),
        Some(ConfigSource::from(path.clone())),
    )
    .expect("a reloader");
    write_atomically(&path, &RELOAD_V1.replace("limit = 5", "limit = 10"));
    reloader.reload().await.expect("a good file");
    let v = http.check(json!({"rule": "a", "key": "ip=k"})).await.json();
    assert_eq!(v["rules"][0]["limit"], 10, "{v}");
    assert_eq!(v["rules"][0]["remaining"], 5, "4 used before, 1 now: {v}");
    write_atomically(&path, &RELOAD_V1.replace("limit = 5", "limit = 3"));
    reloader.reload().await.expect("a good file");
    let v = http.check(json!({"rule": "a", "key": "ip=k"})).await.json();
    assert_eq!(v["allowed"], false, "5 used of 3: {v}");
    // A new window starts afresh.
    write_atomically(
        &path,
        &RELOAD_V1.replace("window = \"1h\"", "window = \"2h\""),
    );
    reloader.reload().await.expect("a good file");
    let v = http.check(json!({"rule": "a", "key": "ip=k"})).await.json();
    assert_eq!(v["rules"][0]["remaining"], 4, "{v}");
}

/// Sends a request whose body arrives in two parts, and returns the open
/// connection after the first.
async fn start_slow_request(addr: SocketAddr, body: &str) -> (tokio::net::TcpStream, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/check HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let (first, rest) = body.split_at(body.len() / 2);
    stream
        .write_all(format!("{head}{first}").as_bytes())
        .await
        .expect("write");
    (stream, rest.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_request_in_flight_finish() {
    let mut service = Service::start(config(), None).await;
    let http = service.http.clone();
    let body = json!({"rule": "login", "key": "ip=slow"}).to_string();
    let (mut stream, rest) = start_slow_request(service.addr, &body).await;
    // The slow request is being served (its body is awaited) when the
    // in-flight gauge counts it besides the metrics request itself.
    eventually(
        Duration::from_secs(10),
        "the slow request is in flight",
        || {
            let http = http.clone();
            async move { http.metric("spillway_http_requests_in_flight").await == Some(2.0) }
        },
    )
    .await;
    let stopped = service.shutdown();
    // New connections are refused once the listener is closed.
    eventually(Duration::from_secs(10), "the listener is closed", || {
        let addr = service.addr;
        async move { tokio::net::TcpStream::connect(addr).await.is_err() }
    })
    .await;
    assert!(
        !stopped.is_finished(),
        "run() waits for the request in flight"
    );
    stream
        .write_all(rest.as_bytes())
        .await
        .expect("write the rest");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .expect("answered in time")
        .expect("read");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.contains("\"allowed\":true"), "{answer}");
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .expect("run() returns")
        .expect("no panic")
        .expect("no error");
}

/// A calendar day in UTC: a denial waits until the next midnight, to the
/// millisecond, as the wall clock says now.
#[tokio::test]
async fn a_calendar_window_waits_until_the_next_period() {
    let config = Config::parse(
        "[[rules]]\nname = \"daily\"\nalgorithm = \"fixed_window\"\nlimit = 1\n\
         window = \"calendar_day\"\n",
    )
    .expect("valid");
    let app = app_of(config).await;
    let until_midnight = || {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_millis() as u64;
        86_400_000 - now % 86_400_000
    };
    assert_eq!(
        check(&app, json!({"rule": "daily", "key": "ip=a"}))
            .await
            .json()["allowed"],
        true
    );
    let before = until_midnight();
    let v = check(&app, json!({"rule": "daily", "key": "ip=a"}))
        .await
        .json();
    let after = until_midnight();
    assert_eq!(v["allowed"], false);
    let retry = v["rules"][0]["retry_after_ms"].as_u64().expect("a wait");
    // Rounded up to the ms: at most one more than the wall clock's.
    assert!(
        retry <= before + 1 && retry >= after,
        "{retry} not in [{after}, {before}]"
    );
    assert_eq!(v["rules"][0]["reset_after_ms"], retry);
}

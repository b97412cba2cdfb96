//! `/admin/overrides` and `/admin/tiers` on the real server (port 0), in
//! memory and on Redis: an override set through the API holds for
//! `/v1/check` (a rule and key, and a described request, under every
//! tier), a removal keeps the count; an API key put in a tier counts under
//! its quota, ahead of the file's table; bad input is a 400 naming the
//! field, a read-only token reads only, and on Redis what one instance
//! sets holds on two others.

mod serve_support;

use std::time::Duration;

use http::{Method, StatusCode};
use serde_json::{Value, json};
use serve_support::{Answer, Http, Service};
use spillway_conformance::redis_server::RedisServer;
use spillway_server::config::Config;

fn config_text(store: &str) -> String {
    format!(
        r#"
[server]
admin_token = "s3cret-admin-token"
admin_tokens = [
  {{ name = "ops", token = "ops-token-0123456789", access = "read_write" }},
  {{ name = "viewer", token = "viewer-token-0123456789", access = "read_only" }},
]

{store}

[tiers.pro]
api_keys = ["pro-key"]

[[rules]]
name = "per-key"
match = {{ path = "/api/**" }}
key = ["api_key"]
fallback = []
algorithm = "fixed_window"
limit = 3
window = "365d"
[rules.tiers.pro]
limit = 5

[[rules]]
name = "bucket"
match = {{ path = "/bucket/**" }}
key = ["api_key"]
fallback = []
algorithm = "token_bucket"
limit = 10
window = "1h"
"#
    )
}

const OPS: (&str, &str) = ("authorization", "Bearer ops-token-0123456789");
const VIEWER: (&str, &str) = ("authorization", "Bearer viewer-token-0123456789");

async fn send(http: &Http, method: Method, path: &str, auth: (&str, &str), body: Value) -> Answer {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    http.send(
        method,
        path,
        &[auth, ("content-type", "application/json")],
        body,
    )
    .await
}

/// A check of rule `per-key` for API key `key`, as a request to /api/x.
async fn request(http: &Http, key: &str) -> Answer {
    http.check(json!({"method": "GET", "path": "/api/x", "headers": {"x-api-key": key}}))
        .await
}

/// The status a check said (its own answer is 200 either way).
fn said(a: &Answer) -> u64 {
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    a.json()["status"].as_u64().expect("a status")
}

fn rule_of(a: &Answer, rule: &str) -> Value {
    let v = a.json();
    v["rules"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["rule"] == rule).cloned())
        .unwrap_or_else(|| panic!("no rule {rule} in {v}"))
}

/// The walk-through of docs/runtime-limits.md, on one instance.
async fn overrides_through_the_api(http: &Http) {
    // acme uses 2 of its 3.
    for _ in 0..2 {
        assert_eq!(said(&request(http, "acme").await), 200);
    }
    // Raised to 10 for a day: 8 more.
    let a = send(
        http,
        Method::POST,
        "/admin/overrides",
        OPS,
        json!({"rule": "per-key", "key": "api_key=acme", "limit": 10, "ttl": "1d", "reason": "launch week"}),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    let set = a.json();
    assert_eq!(set["limit"], 10);
    assert_eq!(set["set_by"], "ops");
    assert_eq!(set["reason"], "launch week");
    assert!(
        set["until"].as_str().is_some_and(|u| u.ends_with('Z')),
        "{set}"
    );
    let a = request(http, "acme").await;
    assert_eq!(said(&a), 200);
    assert_eq!(rule_of(&a, "per-key")["limit"], 10);
    assert_eq!(rule_of(&a, "per-key")["remaining"], 7);
    // A second POST is a conflict; PUT replaces.
    let again = json!({"rule": "per-key", "key": "api_key=acme", "limit": 4});
    let a = send(http, Method::POST, "/admin/overrides", OPS, again.clone()).await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text());
    let a = send(http, Method::PUT, "/admin/overrides", OPS, again).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    // 3 used of 4.
    let a = request(http, "acme").await;
    assert_eq!(said(&a), 200);
    assert_eq!(rule_of(&a, "per-key")["remaining"], 0);
    assert_eq!(said(&request(http, "acme").await), 429);
    // A pro key too: the override holds under the tier's quota.
    let pro = json!({"rule": "per-key", "key": "api_key=pro-key", "limit": 0});
    let a = send(http, Method::PUT, "/admin/overrides", OPS, pro).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    let a = request(http, "pro-key").await;
    assert_eq!(said(&a), 429, "{}", a.text());
    assert_eq!(rule_of(&a, "per-key")["limit"], 0);
    // A prefix.
    let a = send(
        http,
        Method::PUT,
        "/admin/overrides",
        OPS,
        json!({"rule": "per-key", "prefix": "api_key=trial-", "limit": 1}),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    assert_eq!(said(&request(http, "trial-9").await), 200);
    assert_eq!(said(&request(http, "trial-9").await), 429);
    // Read one, list a page of one, then the next.
    let one = "/admin/overrides?rule=per-key&key=api_key%3Dacme";
    let a = send(http, Method::GET, one, VIEWER, Value::Null).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.json()["limit"], 4);
    let a = send(
        http,
        Method::GET,
        "/admin/overrides?limit=2",
        VIEWER,
        Value::Null,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let page = a.json();
    assert_eq!(page["overrides"].as_array().map(Vec::len), Some(2));
    assert_eq!(page["overrides"][0]["key"], "api_key=acme");
    let next = page["next"].as_str().expect("a next page").to_string();
    let a = send(
        http,
        Method::GET,
        &format!("/admin/overrides?limit=2&cursor={}", urlencode(&next)),
        VIEWER,
        Value::Null,
    )
    .await;
    let page = a.json();
    assert_eq!(page["overrides"][0]["prefix"], "api_key=trial-", "{page}");
    assert_eq!(page["next"], Value::Null);
    // A read-only token cannot change anything.
    let a = send(http, Method::DELETE, one, VIEWER, Value::Null).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.text());
    // Removed: acme is back on 3, with the 4 it used still counted.
    let a = send(http, Method::DELETE, one, OPS, Value::Null).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.json()["removed"]["limit"], 4);
    let a = request(http, "acme").await;
    assert_eq!(said(&a), 429);
    assert_eq!(rule_of(&a, "per-key")["limit"], 3);
    let a = send(http, Method::DELETE, one, OPS, Value::Null).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An API key put in a tier through the API counts under the tier's quota.
async fn tiers_through_the_api(http: &Http) {
    let a = request(http, "gold").await;
    assert_eq!(rule_of(&a, "per-key")["tier"], Value::Null);
    assert_eq!(rule_of(&a, "per-key")["limit"], 3);
    let put = json!({"api_key": "gold", "tier": "pro", "reason": "upgraded"});
    let a = send(http, Method::POST, "/admin/tiers", OPS, put.clone()).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    assert_eq!(a.json()["tier"], "pro");
    assert_eq!(a.json()["set_by"], "ops");
    let a = send(http, Method::POST, "/admin/tiers", OPS, put.clone()).await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text());
    let a = send(http, Method::PUT, "/admin/tiers", OPS, put).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let a = request(http, "gold").await;
    assert_eq!(rule_of(&a, "per-key")["tier"], "pro", "{}", a.text());
    assert_eq!(rule_of(&a, "per-key")["limit"], 5);
    assert_eq!(rule_of(&a, "per-key")["remaining"], 4);
    // So does a rule check of its key, as a request would count.
    let a = http
        .check(json!({"rule": "per-key", "key": "api_key=gold"}))
        .await;
    assert_eq!(rule_of(&a, "per-key")["tier"], "pro", "{}", a.text());
    assert_eq!(rule_of(&a, "per-key")["remaining"], 3);
    // Sent twice, the key cannot be read: refused, not counted under
    // another tier.
    let twice = http
        .send(
            Method::POST,
            "/v1/check",
            &[("content-type", "application/json")],
            json!({"method": "GET", "path": "/api/x", "headers": {"x-api-key": ["gold", "other"]}})
                .to_string(),
        )
        .await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST, "{}", twice.text());
    // Read, listed, removed.
    let a = send(
        http,
        Method::GET,
        "/admin/tiers?api_key=gold",
        VIEWER,
        Value::Null,
    )
    .await;
    assert_eq!(a.json()["reason"], "upgraded", "{}", a.text());
    let a = send(http, Method::GET, "/admin/tiers", VIEWER, Value::Null).await;
    assert_eq!(a.json()["tiers"][0]["api_key"], "gold", "{}", a.text());
    assert_eq!(a.json()["next"], Value::Null);
    let a = send(
        http,
        Method::DELETE,
        "/admin/tiers?api_key=gold",
        VIEWER,
        Value::Null,
    )
    .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    let a = send(
        http,
        Method::DELETE,
        "/admin/tiers?api_key=gold",
        OPS,
        Value::Null,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let a = request(http, "gold").await;
    assert_eq!(rule_of(&a, "per-key")["tier"], Value::Null);
    assert_eq!(rule_of(&a, "per-key")["limit"], 3);
    let a = send(
        http,
        Method::DELETE,
        "/admin/tiers?api_key=gold",
        OPS,
        Value::Null,
    )
    .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    // Bad input names the field.
    for (body, field) in [
        (json!({"api_key": "k", "tier": "gold"}), "`tier`"),
        (json!({"api_key": "", "tier": "pro"}), "`api_key`"),
        (json!({"api_key": "a\u{7}b", "tier": "pro"}), "`api_key`"),
        (json!({"api_key": "k", "tier": "pro", "ttl": "0s"}), "`ttl`"),
        (
            json!({"api_key": "k", "tier": "pro", "plan": "x"}),
            "`plan`",
        ),
    ] {
        let a = send(http, Method::PUT, "/admin/tiers", OPS, body.clone()).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text());
        let detail = a.json()["detail"].as_str().unwrap_or_default().to_string();
        assert!(detail.contains(field), "{body}: {detail}");
    }
}

/// Bad input is a 400 that names the field.
async fn bad_input_names_the_field(http: &Http) {
    for (body, field) in [
        (
            json!({"rule": "nope", "key": "api_key=a", "limit": 1}),
            "`rule`",
        ),
        (
            json!({"rule": "per-key", "key": "ip=1.2.3.4", "limit": 1}),
            "`key`",
        ),
        (json!({"rule": "per-key", "limit": 1}), "`key` or `prefix`"),
        (
            json!({"rule": "per-key", "key": "api_key=a", "prefix": "a", "limit": 1}),
            "`prefix`",
        ),
        (
            json!({"rule": "per-key", "prefix": "", "limit": 1}),
            "`prefix`",
        ),
        (
            json!({"rule": "per-key", "key": format!("api_key={}", "k".repeat(2000)), "limit": 1}),
            "`key`",
        ),
        (
            json!({"rule": "per-key", "key": "api_key=a", "limit": 5_000_000_000u64}),
            "`limit`",
        ),
        (
            json!({"rule": "per-key", "key": "api_key=a", "limit": 5, "burst": 9}),
            "`burst`",
        ),
        (
            json!({"rule": "bucket", "key": "api_key=a", "limit": 5, "delay": 9}),
            "`delay`",
        ),
        (
            json!({"rule": "per-key", "key": "api_key=a", "limit": 5, "until": "yesterday"}),
            "`until`",
        ),
        (
            json!({"rule": "per-key", "key": "api_key=a", "limit": 5, "until": "2001-01-01T00:00:00Z"}),
            "`until`",
        ),
        (
            json!({"rule": "per-key", "key": "api_key=a", "limit": 5, "ttl": "soon"}),
            "`ttl`",
        ),
        (
            json!({"rule": "per-key", "key": "api_key=a", "limit": 5, "window": "1m"}),
            "`window`",
        ),
    ] {
        let a = send(http, Method::PUT, "/admin/overrides", OPS, body.clone()).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text());
        let detail = a.json()["detail"].as_str().unwrap_or_default().to_string();
        assert!(detail.contains(field), "{body}: {detail}");
    }
    let a = send(
        http,
        Method::GET,
        "/admin/overrides?cursor=zzz",
        OPS,
        Value::Null,
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let a = send(
        http,
        Method::GET,
        "/admin/overrides",
        ("authorization", "Bearer nope"),
        Value::Null,
    )
    .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_set_through_the_api_hold_in_memory() {
    let config = Config::parse(&config_text("")).expect("a valid configuration");
    let service = Service::start(config, None).await;
    overrides_through_the_api(&service.http).await;
    bad_input_names_the_field(&service.http).await;
    tiers_through_the_api(&service.http).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_set_on_one_instance_hold_on_the_others_on_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"2s\"\non_error = \"fail_closed\"",
        redis.url()
    );
    let config = Config::parse(&config_text(&store)).expect("a valid configuration");
    let services = [
        Service::start(config.clone(), None).await,
        Service::start(config.clone(), None).await,
        Service::start(config, None).await,
    ];
    overrides_through_the_api(&services[0].http).await;
    bad_input_names_the_field(&services[0].http).await;
    tiers_through_the_api(&services[0].http).await;
    let put = json!({"api_key": "shared", "tier": "pro"});
    let a = send(&services[0].http, Method::PUT, "/admin/tiers", OPS, put).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    // Within a refresh (1 s), the others hold what the first set.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for service in &services[1..] {
        let a = request(&service.http, "pro-key").await;
        assert_eq!(said(&a), 429, "{}", a.text());
        assert_eq!(rule_of(&a, "per-key")["limit"], 0);
    }
    // Now that the rule has keys' own overrides everywhere, a new one
    // holds on every instance at once: the script reads it.
    let late = json!({"rule": "per-key", "key": "api_key=late", "limit": 0});
    let a = send(
        &services[0].http,
        Method::PUT,
        "/admin/overrides",
        OPS,
        late,
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    for service in &services[1..] {
        assert_eq!(said(&request(&service.http, "late").await), 429);
    }
    for service in &services[1..] {
        let a = request(&service.http, "trial-2").await;
        assert_eq!(rule_of(&a, "per-key")["limit"], 1, "{}", a.text());
        let a = request(&service.http, "shared").await;
        assert_eq!(rule_of(&a, "per-key")["tier"], "pro", "{}", a.text());
        // And each lists what the first set.
        let a = send(
            &service.http,
            Method::GET,
            "/admin/overrides",
            VIEWER,
            Value::Null,
        )
        .await;
        assert_eq!(
            a.json()["overrides"].as_array().map(Vec::len),
            Some(3),
            "{}",
            a.text()
        );
    }
    // Set on one and removed at once on another, before it refreshed: the
    // removal says what it removed.
    let quick = json!({"rule": "per-key", "key": "api_key=quick", "limit": 0});
    let a = send(
        &services[0].http,
        Method::PUT,
        "/admin/overrides",
        OPS,
        quick,
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    let one = "/admin/overrides?rule=per-key&key=api_key%3Dquick";
    let a = send(&services[1].http, Method::DELETE, one, OPS, Value::Null).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.json()["removed"]["limit"], 0);
}

/// A configuration of one rule, `per-key`, and `tier` (its tiers' tables).
fn one_rule(store: &str, tier: &str) -> String {
    format!(
        r#"
[server]
admin_tokens = [
  {{ name = "ops", token = "ops-token-0123456789", access = "read_write" }},
]
{store}
[tiers.pro]
api_keys = ["pro-key"]

[[rules]]
name = "per-key"
match = {{ path = "/api/**" }}
key = ["api_key"]
fallback = []
algorithm = "fixed_window"
limit = 3
window = "1h"
{tier}
"#
    )
}

/// A reload that gives the rule a tier: the override holds under the new
/// tier's quota too. A key of a tier the rule has no quota for takes one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_holds_under_a_tier_a_reload_adds() {
    let dir = serve_support::temp_dir("runtime-tier-reload");
    let path = dir.join("spillway.toml");
    serve_support::write_atomically(&path, &one_rule("", ""));
    let source = spillway_server::ConfigSource::from(path.clone());
    let service = Service::start(source.load().expect("valid"), None).await;
    // pro-key is in a tier the rule has no quota for: counted under the
    // default quota, and an override of it is taken.
    let stop = json!({"rule": "per-key", "key": "api_key=pro-key", "limit": 0});
    let a = send(&service.http, Method::PUT, "/admin/overrides", OPS, stop).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    assert_eq!(said(&request(&service.http, "pro-key").await), 429);
    let mut reloader = spillway_server::reload::Reloader::new(service.state.clone(), Some(source))
        .expect("reloads");
    serve_support::write_atomically(&path, &one_rule("", "[rules.tiers.pro]\nlimit = 5\n"));
    reloader.reload().await.expect("reloads");
    let a = request(&service.http, "pro-key").await;
    assert_eq!(rule_of(&a, "per-key")["tier"], "pro", "{}", a.text());
    assert_eq!(said(&a), 429, "{}", a.text());
    assert_eq!(rule_of(&a, "per-key")["limit"], 0);
}

/// An override past its time is gone: a POST sets a new one. One that a
/// tier's quota cannot take on Redis (a sliding log over 10,000) is a 400
/// that changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_override_is_gone_and_a_refused_one_changes_nothing() {
    let config = Config::parse(&one_rule("", "")).expect("valid");
    let service = Service::start(config, None).await;
    let body = json!({"rule": "per-key", "key": "api_key=acme", "limit": 0, "ttl": "1s"});
    let a = send(
        &service.http,
        Method::POST,
        "/admin/overrides",
        OPS,
        body.clone(),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let a = send(&service.http, Method::POST, "/admin/overrides", OPS, body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());

    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"2s\"",
        redis.url()
    );
    let tier = "[rules.tiers.pro]\nalgorithm = \"sliding_log\"\nlimit = 5\n";
    let config = Config::parse(&one_rule(&store, tier)).expect("valid");
    let service = Service::start(config, None).await;
    let big = json!({"rule": "per-key", "prefix": "api_key=", "limit": 20000});
    let a = send(&service.http, Method::PUT, "/admin/overrides", OPS, big).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    assert!(a.text().contains("tier `pro`"), "{}", a.text());
    let a = request(&service.http, "someone").await;
    assert_eq!(rule_of(&a, "per-key")["limit"], 3, "{}", a.text());
    let a = send(
        &service.http,
        Method::GET,
        "/admin/overrides",
        OPS,
        Value::Null,
    )
    .await;
    assert_eq!(a.json()["overrides"], json!([]), "{}", a.text());
}

/// A check of rule `per-key`'s path from `ip` with API key `key`.
async fn from(http: &Http, ip: &str, key: &str) -> Answer {
    http.check(json!({"method": "GET", "path": "/api/x", "ip": ip, "headers": {"x-api-key": key}}))
        .await
}

/// Blocks and allows set through the API: a blocked network refuses an
/// address inside it (counting nothing) and not one outside; an allow lets
/// a key past its rule; bad input names the field.
async fn lists_through_the_api(http: &Http) {
    let block = json!({"list": "block", "ip": "192.0.2.0/24", "reason": "abuse"});
    let a = send(http, Method::POST, "/admin/lists", OPS, block.clone()).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    assert_eq!(a.json()["status"], 403);
    let a = send(http, Method::POST, "/admin/lists", OPS, block).await;
    assert_eq!(a.status, StatusCode::CONFLICT);
    let v6 = json!({"list": "block", "ip": "2001:db8::/32", "status": 429, "ttl": "15m"});
    let a = send(http, Method::PUT, "/admin/lists", OPS, v6).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    for (ip, status) in [
        ("192.0.2.7", 403),
        ("192.0.2.255", 403),
        ("192.0.3.7", 200),
        ("2001:db8:1::5", 429),
        ("2001:db9::5", 200),
    ] {
        let a = from(http, ip, "lister").await;
        assert_eq!(said(&a), status, "{ip}: {}", a.text());
        if status == 429 {
            let retry = a.json()["retry_after_ms"].as_u64().expect("a block's end");
            assert!(retry > 890_000 && retry <= 900_000, "{retry}");
        }
    }
    // Counted as blocked, by status.
    let blocked = |status: &'static str| async move {
        http.metric(&format!("spillway_blocked_total{{status=\"{status}\"}}"))
            .await
    };
    assert_eq!(blocked("403").await, Some(2.0));
    assert_eq!(blocked("429").await, Some(1.0));
    // The blocked ones counted nothing: lister used 2 (of 3) from outside.
    let a = from(http, "192.0.3.8", "lister").await;
    assert_eq!(rule_of(&a, "per-key")["remaining"], 0, "{}", a.text());
    // An allow lets a key past the rule; a rule's key can be blocked.
    let allow = json!({"list": "allow", "api_key": "lister", "rule": "per-key"});
    let a = send(http, Method::PUT, "/admin/lists", OPS, allow).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    let a = from(http, "192.0.3.8", "lister").await;
    assert_eq!(said(&a), 200, "{}", a.text());
    assert_eq!(a.json()["rules"], json!([]), "no rule counted it");
    let by_key =
        json!({"list": "block", "key": "api_key=spammer", "rule": "per-key", "status": 429});
    let a = send(http, Method::PUT, "/admin/lists", OPS, by_key).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    assert_eq!(said(&from(http, "198.51.100.1", "spammer").await), 429);
    // Read, listed a page at a time, removed.
    let one = "/admin/lists?ip=192.0.2.0%2F24";
    let a = send(http, Method::GET, one, VIEWER, Value::Null).await;
    assert_eq!(a.json()["reason"], "abuse", "{}", a.text());
    let a = send(
        http,
        Method::GET,
        "/admin/lists?limit=2",
        VIEWER,
        Value::Null,
    )
    .await;
    let page = a.json();
    assert_eq!(page["entries"].as_array().map(Vec::len), Some(2), "{page}");
    let next = page["next"].as_str().expect("a next page").to_string();
    let a = send(
        http,
        Method::GET,
        &format!("/admin/lists?limit=2&cursor={}", urlencode(&next)),
        VIEWER,
        Value::Null,
    )
    .await;
    assert_eq!(
        a.json()["entries"].as_array().map(Vec::len),
        Some(2),
        "{}",
        a.text()
    );
    assert_eq!(a.json()["next"], Value::Null);
    let a = send(http, Method::DELETE, one, OPS, Value::Null).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(said(&from(http, "192.0.2.7", "other").await), 200);
    // Bad input names the field.
    for (body, field) in [
        (json!({"list": "block", "ip": "192.0.2.0/33"}), "`ip`"),
        (json!({"list": "block", "ip": "not-an-ip"}), "`ip`"),
        (json!({"list": "deny", "ip": "192.0.2.1"}), "`list`"),
        (
            json!({"list": "block", "ip": "192.0.2.1", "status": 500}),
            "`status`",
        ),
        (
            json!({"list": "allow", "ip": "192.0.2.1", "status": 403}),
            "`status`",
        ),
        (json!({"list": "block", "key": "api_key=x"}), "`rule`"),
        (
            json!({"list": "block", "key": "ip=1.2.3.4", "rule": "per-key"}),
            "`key`",
        ),
        (
            json!({"list": "block", "ip": "192.0.2.1", "api_key": "x"}),
            "`ip`",
        ),
        (
            json!({"list": "block", "ip": "192.0.2.1", "rule": "nope"}),
            "`rule`",
        ),
        (json!({"list": "block"}), "`ip`"),
    ] {
        let a = send(http, Method::PUT, "/admin/lists", OPS, body.clone()).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text());
        let detail = a.json()["detail"].as_str().unwrap_or_default().to_string();
        assert!(detail.contains(field), "{body}: {detail}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_set_through_the_api_hold_in_memory() {
    let config = Config::parse(&config_text("")).expect("a valid configuration");
    let service = Service::start(config, None).await;
    lists_through_the_api(&service.http).await;
}

/// On Redis, a block set on one instance holds on two others within the
/// refresh (measured: printed, and bounded at twice the refresh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_set_on_one_instance_holds_on_the_others_within_the_refresh() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"2s\"\non_error = \"fail_closed\"",
        redis.url()
    );
    let config = Config::parse(&config_text(&store)).expect("a valid configuration");
    let services = [
        Service::start(config.clone(), None).await,
        Service::start(config.clone(), None).await,
        Service::start(config, None).await,
    ];
    lists_through_the_api(&services[0].http).await;
    let block = json!({"list": "block", "ip": "203.0.113.0/24"});
    let a = send(&services[0].http, Method::PUT, "/admin/lists", OPS, block).await;
    let set_at = std::time::Instant::now();
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    assert_eq!(
        said(&from(&services[0].http, "203.0.113.9", "k").await),
        403
    );
    for (i, service) in services.iter().enumerate().skip(1) {
        while said(&from(&service.http, "203.0.113.9", "k").await) != 403 {
            assert!(
                set_at.elapsed() < Duration::from_secs(2),
                "instance {i}: not within 2 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!("instance {i} blocks after {:?}", set_at.elapsed());
    }
}

/// A key blocked under all its spellings: removing it through a token's
/// spelling is refused (it would leave the others), naming the key; sent
/// beside another key, it is refused, not let through to a rule that
/// counts by address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_key_has_every_spelling_and_cannot_be_sent_beside_another() {
    let config = Config::parse(&config_text("")).expect("a valid configuration");
    let service = Service::start(config, None).await;
    let http = &service.http;
    let block = json!({"list": "block", "api_key": "a+b/c="});
    let a = send(http, Method::PUT, "/admin/lists", OPS, block).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    let check = |headers: Value| {
        http.check(
            json!({"method": "GET", "path": "/api/x", "ip": "192.0.2.7", "headers": headers}),
        )
    };
    assert_eq!(said(&check(json!({"x-api-key": "a+b/c="})).await), 403);
    let a = send(
        http,
        Method::DELETE,
        "/admin/lists?api_key=a-b_c",
        OPS,
        Value::Null,
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    assert!(a.text().contains("a+b/c="), "{}", a.text());
    let beside = check(json!({"x-api-key": "a+b/c=", "authorization": "Bearer other"})).await;
    assert_eq!(beside.status, StatusCode::BAD_REQUEST, "{}", beside.text());
    let a = send(
        http,
        Method::DELETE,
        "/admin/lists?api_key=a%2Bb%2Fc%3D",
        OPS,
        Value::Null,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(said(&check(json!({"x-api-key": "a+b/c="})).await), 200);
}

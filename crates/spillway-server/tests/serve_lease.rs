//! `POST /v1/check` on a concurrency rule answers a lease token;
//! `POST /v1/renew` keeps the slot, `POST /v1/release` gives it back, once:
//! in memory, and across two instances sharing one redis-server.

mod serve_support;

use http::{Method, StatusCode};
use serde_json::{Value, json};
use serve_support::{Http, Service, remaining};
use spillway_conformance::redis_server::RedisServer;
use spillway_server::config::Config;

const RULES: &str = r#"
[[rules]]
name = "reports"
key = ["api_key"]
algorithm = "concurrency"
limit = 2
lease = "30s"

[[rules]]
name = "requests"
key = ["api_key"]
algorithm = "fixed_window"
limit = 100
window = "1h"
"#;

async fn post(http: &Http, path: &str, body: Value) -> serve_support::Answer {
    http.send(
        Method::POST,
        path,
        &[("content-type", "application/json")],
        body.to_string(),
    )
    .await
}

/// `POST /v1/check` for `api_key=k`.
async fn check(http: &Http) -> serve_support::Answer {
    http.check(json!({"path": "/reports", "method": "POST", "headers": {"x-api-key": "k"}}))
        .await
}

/// The lease token of an admitted check.
async fn take(http: &Http) -> String {
    let a = check(http).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let answer = a.json();
    assert_eq!(answer["allowed"], true, "{answer}");
    assert_eq!(answer["lease"]["expires_in_ms"], 30_000);
    assert_eq!(answer.get("settle"), None, "not a budget");
    answer["lease"]["token"]
        .as_str()
        .expect("a token")
        .to_string()
}

#[tokio::test]
async fn a_slot_is_held_until_released_once_and_renewed_meanwhile() {
    let service = Service::start(Config::parse(RULES).expect("valid"), None).await;
    let http = &service.http;
    let first = take(http).await;
    let second = take(http).await;
    // Both slots are held: a third check is denied, with the lease's end.
    let denied = check(http).await.json();
    assert_eq!(denied["allowed"], false, "{denied}");
    assert_eq!(denied["denied_by"], "reports");
    // With nobody releasing, the first lease ends 30 s after it was taken.
    let retry = denied["retry_after_ms"].as_u64().expect("ms");
    assert!((29_000..=30_000).contains(&retry), "{retry}");
    assert_eq!(denied.get("lease"), None);

    // Renewed: the slot is still held, under a new token.
    let a = post(http, "/v1/renew", json!({"token": first})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let renewed = a.json();
    assert_eq!(renewed["rules"][0]["was_held"], true);
    assert_eq!(renewed["rules"][0]["remaining"], 0);
    let first = renewed["lease"]["token"]
        .as_str()
        .expect("a token")
        .to_string();

    // Released: a slot is free at once, and a release sent again changes
    // nothing.
    let a = post(http, "/v1/release", json!({"token": first})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.json()["applied"], true);
    assert_eq!(remaining(&a.json(), "reports"), 1);
    let again = post(http, "/v1/release", json!({"token": first})).await;
    assert_eq!(again.json()["applied"], false);
    assert_eq!(remaining(&again.json(), "reports"), 1);
    let third = take(http).await;
    assert_eq!(check(http).await.json()["allowed"], false);
    for token in [second, third] {
        let a = post(http, "/v1/release", json!({"token": token})).await;
        assert_eq!(a.json()["applied"], true);
    }
    assert_eq!(remaining(&check(http).await.json(), "reports"), 1);
    let metric =
        |event: &str| format!("spillway_leases_total{{rule=\"reports\",event=\"{event}\"}}");
    assert_eq!(http.metric(&metric("renewed")).await, Some(1.0));
    assert_eq!(http.metric(&metric("released")).await, Some(3.0));
}

#[tokio::test]
async fn a_forged_or_misused_token_is_refused() {
    let service = Service::start(Config::parse(RULES).expect("valid"), None).await;
    let http = &service.http;
    let token = take(http).await;
    // Another kind of token, or a changed one.
    for bad in [
        token.replacen("ls1.", "st1.", 1),
        format!("{token}x"),
        "ls1.e30.AAAA".to_string(),
    ] {
        for path in ["/v1/renew", "/v1/release"] {
            let a = post(http, path, json!({"token": bad})).await;
            assert_eq!(
                a.status,
                StatusCode::BAD_REQUEST,
                "{path} {bad}: {}",
                a.text()
            );
        }
    }
    // A lease token is not a settle token.
    let a = post(http, "/v1/settle", json!({"token": token, "actual": 0})).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    let a = post(http, "/v1/release", json!({"token": token, "extra": 1})).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_slot_taken_on_one_instance_is_released_on_another() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let config = || {
        let text = format!(
            "[server]\nsettle_key = \"0123456789abcdef0123456789abcdef\"\n\
             [store]\nkind = \"redis\"\nurl = \"{}\"\n{RULES}",
            redis.url()
        );
        Config::parse(&text).expect("valid")
    };
    let a = Service::start(config(), None).await;
    let b = Service::start(config(), None).await;
    let first = take(&a.http).await;
    let _second = take(&b.http).await;
    // Full, seen from either instance.
    assert_eq!(check(&a.http).await.json()["allowed"], false);
    assert_eq!(check(&b.http).await.json()["allowed"], false);
    let renewed = post(&b.http, "/v1/renew", json!({"token": first})).await;
    assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.text());
    let first = renewed.json()["lease"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    let released = post(&b.http, "/v1/release", json!({"token": first})).await;
    assert_eq!(released.json()["applied"], true, "{}", released.text());
    // Freed on the instance that took it too, at once.
    let _third = take(&a.http).await;
    let again = post(&a.http, "/v1/release", json!({"token": first})).await;
    assert_eq!(again.json()["applied"], false);
}

#[tokio::test]
async fn a_token_lives_as_long_as_its_lease_and_every_token_of_a_lease_names_one_slot() {
    let rules = RULES.replace("lease = \"30s\"", "lease = \"20m\"");
    let service = Service::start(Config::parse(&rules).expect("valid"), None).await;
    let http = &service.http;
    let a = check(http).await;
    let answer = a.json();
    // Good until the lease ends: 20 minutes, not the 9 a settle token has.
    assert_eq!(answer["lease"]["expires_in_ms"], 1_200_000, "{answer}");
    let first = answer["lease"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    // A renew sent twice, and one with the token the first answered: one
    // slot held all along.
    let mut tokens = vec![first.clone()];
    for token in [&first, &first] {
        let a = post(http, "/v1/renew", json!({"token": token})).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        let renewed = a.json();
        assert_eq!(renewed["rules"][0]["was_held"], true);
        assert_eq!(renewed["rules"][0]["remaining"], 1, "{renewed}");
        assert_eq!(renewed["lease"]["expires_in_ms"], 1_200_000);
        tokens.push(
            renewed["lease"]["token"]
                .as_str()
                .expect("a token")
                .to_string(),
        );
    }
    let a = post(http, "/v1/renew", json!({"token": tokens[2]})).await;
    assert_eq!(a.json()["rules"][0]["remaining"], 1);
    // Released with the newest token: the slot is free, and a release with
    // the first changes nothing more.
    let a = post(http, "/v1/release", json!({"token": tokens[2]})).await;
    assert_eq!(remaining(&a.json(), "reports"), 2);
    let a = post(http, "/v1/release", json!({"token": first})).await;
    assert_eq!(remaining(&a.json(), "reports"), 2);
    // A renew after the release (an older token, a renew that raced it)
    // takes nothing back.
    let a = post(http, "/v1/renew", json!({"token": tokens[1]})).await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text());
    // Both slots free: a check takes one and leaves one.
    assert_eq!(remaining(&check(http).await.json(), "reports"), 1);
}

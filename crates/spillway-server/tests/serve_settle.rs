//! `POST /v1/settle`: a budget rule's reservation made by `POST /v1/check`
//! settled at its actual cost, once, by a token only the server (or an
//! instance with its key) can make: in memory, and across two instances
//! sharing one redis-server.

mod serve_support;

use http::{Method, StatusCode};
use serde_json::{Value, json};
use serve_support::{Http, Service, remaining};
use spillway_conformance::redis_server::RedisServer;
use spillway_server::config::Config;

const RULES: &str = r#"
[[rules]]
name = "tokens"
key = ["api_key"]
algorithm = "token_bucket"
limit = 1000
window = "1h"
cost = "response:usage"
reserve = 300

[[rules]]
name = "requests"
key = ["api_key"]
algorithm = "fixed_window"
limit = 100
window = "1h"
"#;

async fn settle(http: &Http, body: Value) -> serve_support::Answer {
    http.send(
        Method::POST,
        "/v1/settle",
        &[("content-type", "application/json")],
        body.to_string(),
    )
    .await
}

/// `POST /v1/check` for `api_key=k`, described as a request.
async fn check(http: &Http) -> Value {
    let a = http
        .check(json!({"path": "/v1/chat/completions", "method": "POST", "headers": {"x-api-key": "k"}}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    a.json()
}

#[tokio::test]
async fn a_reservation_is_settled_once_by_its_token() {
    let service = Service::start(Config::parse(RULES).expect("valid"), None).await;
    let http = &service.http;
    let answer = check(http).await;
    assert_eq!(remaining(&answer, "tokens"), 700, "300 reserved");
    let token = answer["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    assert_eq!(answer["settle"]["expires_in_ms"], 300_000);

    // The request cost 120: 180 given back, the request rule untouched.
    let a = settle(http, json!({"token": token, "actual": 120})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let settled = a.json();
    assert_eq!(settled["applied"], true);
    assert_eq!(settled["rules"][0]["rule"], "tokens");
    assert_eq!(settled["rules"][0]["remaining"], 880);
    assert_eq!(settled["rules"][0]["key"], "api_key=k");
    // 120 of 1,000 an hour to refill, less the time since the check
    // (docs/server.md shows this answer).
    let reset = settled["rules"][0]["reset_after_ms"].as_u64().expect("ms");
    assert!((430_000..=432_000).contains(&reset), "{reset}");
    assert_eq!(settled["rules"][0]["retry_after_ms"], Value::Null);
    assert_eq!(settled["rules"].as_array().map(Vec::len), Some(1));

    // Sent again (a retry after a lost answer), or with another cost: it
    // changes nothing.
    let a = settle(http, json!({"token": token, "actual": 0})).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.json()["applied"], false);
    assert_eq!(a.json()["rules"][0]["remaining"], 880);

    // Above the reservation: the rest is charged.
    let token = check(http).await["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    let a = settle(http, json!({"token": token, "actual": 500})).await;
    assert_eq!(a.json()["rules"][0]["remaining"], 380);
    let exhausted = "spillway_budget_exhausted_total{rule=\"tokens\"}";
    assert_eq!(
        http.metric(exhausted).await,
        None,
        "380 left: not exhausted"
    );

    // Far above what the key has left: in debt, counted.
    let token = check(http).await["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    let a = settle(http, json!({"token": token, "actual": 1000})).await;
    assert_eq!(a.json()["rules"][0]["remaining"], 0);
    assert_eq!(http.metric(exhausted).await, Some(1.0));

    let metric =
        |how: &str| format!("spillway_budget_settled_total{{rule=\"tokens\",how=\"{how}\"}}");
    assert_eq!(http.metric(&metric("measured")).await, Some(3.0));
}

#[tokio::test]
async fn a_token_not_signed_by_the_server_is_refused() {
    let service = Service::start(Config::parse(RULES).expect("valid"), None).await;
    let http = &service.http;
    let token = check(http).await["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    // The payload changed to a cost of 1000 (all given back), under the
    // server's signature.
    let (payload, signature) = token["st1.".len()..].split_once('.').expect("two parts");
    let forged_payload = {
        use base64::Engine as _;
        let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let mut claims: Value = serde_json::from_slice(&engine.decode(payload).unwrap()).unwrap();
        claims["charges"][0]["cost"] = json!(1000);
        engine.encode(claims.to_string())
    };
    for bad in [
        format!("st1.{forged_payload}.{signature}"),
        "st1.e30.AAAA".to_string(),
        String::new(),
    ] {
        let a = settle(http, json!({"token": bad, "actual": 0})).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
        assert!(a.text().contains("not a settle token"), "{}", a.text());
    }
    // Bad bodies name the field.
    for (body, field) in [
        (
            json!({"token": token, "actual": -1}),
            "`actual` must not be negative",
        ),
        (
            json!({"token": token, "actual": 1.5}),
            "`actual` must be an integer",
        ),
        (json!({"token": token}), "missing field `actual`"),
        (
            json!({"token": token, "actual": 1, "x": 1}),
            "unknown field `x`",
        ),
    ] {
        let a = settle(http, body).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST);
        assert!(a.text().contains(field), "{field}: {}", a.text());
    }
    // A check that charges nothing (a peek) has nothing to settle.
    let peek = http
        .check(json!({"rule": "tokens", "key": "api_key=k", "cost": 0}))
        .await;
    assert_eq!(peek.json().get("settle"), None, "{}", peek.text());

    // Another in-memory store (another instance, or this one restarted)
    // with the same key: the charges are not there, and are not settled
    // against its own keys.
    let shared = "0123456789abcdef0123456789abcdef";
    let keyed =
        || Config::parse(&format!("[server]\nsettle_key = \"{shared}\"\n{RULES}")).expect("valid");
    let first = Service::start(keyed(), None).await;
    let second = Service::start(keyed(), None).await;
    let token = check(&first.http).await["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    let answer = check(&second.http).await;
    assert_eq!(remaining(&answer, "tokens"), 700);
    let a = settle(&second.http, json!({"token": token, "actual": 0})).await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text());
    assert!(a.text().contains("another store"), "{}", a.text());
    assert_eq!(
        remaining(&check(&second.http).await, "tokens"),
        400,
        "nothing given back"
    );
    let a = settle(&first.http, json!({"token": token, "actual": 0})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());

    // A rule without a budget gets no token.
    let plain = Config::parse(
        "[[rules]]\nname = \"r\"\nkey = [\"api_key\"]\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1m\"\n",
    )
    .expect("valid");
    let service = Service::start(plain, None).await;
    assert_eq!(check(&service.http).await.get("settle"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_an_instance_settles_another_ones_token_if_they_share_a_key() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let with_key = |key: Option<&str>| {
        let server = key.map_or(String::new(), |k| {
            format!("[server]\nsettle_key = \"{k}\"\n")
        });
        let text = format!(
            "{server}[store]\nkind = \"redis\"\nurl = \"{}\"\n{RULES}",
            redis.url()
        );
        Config::parse(&text).expect("valid")
    };
    let shared = "0123456789abcdef0123456789abcdef";
    let a = Service::start(with_key(Some(shared)), None).await;
    let b = Service::start(with_key(Some(shared)), None).await;
    let stranger = Service::start(with_key(None), None).await;

    let answer = check(&a.http).await;
    assert_eq!(remaining(&answer, "tokens"), 700);
    let token = answer["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    let refused = settle(&stranger.http, json!({"token": token, "actual": 100})).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    let settled = settle(&b.http, json!({"token": token, "actual": 100})).await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.text());
    assert_eq!(settled.json()["rules"][0]["remaining"], 900);
    // Once: a retry on the first instance changes nothing.
    let again = settle(&a.http, json!({"token": token, "actual": 100})).await;
    assert_eq!(again.json()["applied"], false);
    assert_eq!(again.json()["rules"][0]["remaining"], 900);
}

/// `on_expiry = "release"` on a shared Redis: a reservation whose token is
/// never settled is given back by whichever instance meets its key once
/// `settle_within` has passed, and a settle that comes later (its token
/// still good) charges the whole actual cost, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_reservation_never_settled_is_given_back_and_a_late_settle_charges_in_full() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let text = format!(
        "[server]\nsettle_key = \"0123456789abcdef0123456789abcdef\"\nadmin_token = \"s3cret\"\n\
         [store]\nkind = \"redis\"\nurl = \"{}\"\n\
         [[rules]]\nname = \"tokens\"\nkey = [\"api_key\"]\nalgorithm = \"sliding_log\"\n\
         limit = 1000\nwindow = \"1h\"\ncost = \"response:usage\"\nreserve = 300\n\
         on_expiry = \"release\"\nsettle_within = \"1s\"\n",
        redis.url()
    );
    let a = Service::start(Config::parse(&text).expect("valid"), None).await;
    let b = Service::start(Config::parse(&text).expect("valid"), None).await;
    let peek = async |http: &Http| {
        let a = http
            .send(
                Method::GET,
                "/admin/rules/tokens/keys/api_key=k",
                &[("authorization", "Bearer s3cret")],
                "",
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        a.json()["quotas"][0]["remaining"]
            .as_u64()
            .expect("remaining")
    };

    let reserved_at = std::time::Instant::now();
    let answer = check(&a.http).await;
    assert_eq!(remaining(&answer, "tokens"), 700);
    let token = answer["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    // The instance that reserved says nothing more: the other one, peeking
    // at the key, gives the reservation back once its second has passed.
    let given_back = loop {
        let left = peek(&b.http).await;
        if left == 1000 {
            break reserved_at.elapsed();
        }
        assert_eq!(left, 700);
        assert!(
            reserved_at.elapsed() < std::time::Duration::from_secs(10),
            "not given back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(
        given_back >= std::time::Duration::from_secs(1),
        "{given_back:?}"
    );
    let metric = "spillway_budget_given_back_total";
    assert_eq!(b.http.metric(metric).await, Some(1.0));
    assert_eq!(a.http.metric(metric).await, Some(0.0));

    // The settle comes late: the request cost 100, charged in full, once.
    let late = settle(&a.http, json!({"token": token, "actual": 100})).await;
    assert_eq!(late.status, StatusCode::OK, "{}", late.text());
    assert_eq!(late.json()["applied"], true);
    assert_eq!(late.json()["rules"][0]["remaining"], 900);
    let again = settle(&b.http, json!({"token": token, "actual": 100})).await;
    assert_eq!(again.json()["applied"], false);
    assert_eq!(peek(&a.http).await, 900);

    // Settled in time, a reservation is never given back a second time.
    let token = check(&a.http).await["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    let a2 = settle(&b.http, json!({"token": token, "actual": 50})).await;
    assert_eq!(a2.json()["rules"][0]["remaining"], 850);
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(peek(&a.http).await, 850);
}

/// Under `on_expiry = "release"`, a token outlives its reservation (so a
/// late settle still charges in full), within what a receipt allows; and
/// it is settled by an instance whose rules are numbered otherwise (a
/// reload that added one above, another instance's configuration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_reservations_token_outlives_it_and_finds_its_rule_by_name() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let config = |extra: &str, within: &str| {
        let text = format!(
            "[server]\nsettle_key = \"0123456789abcdef0123456789abcdef\"\n\
             [store]\nkind = \"redis\"\nurl = \"{}\"\n{extra}\
             [[rules]]\nname = \"tokens\"\nkey = [\"api_key\"]\nalgorithm = \"sliding_log\"\n\
             limit = 1000\nwindow = \"1h\"\ncost = \"response:usage\"\nreserve = 300\n\
             on_expiry = \"release\"\nsettle_within = \"{within}\"\n",
            redis.url()
        );
        Config::parse(&text).expect("valid")
    };
    let first = "[[rules]]\nname = \"first\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\n\
                 limit = 10\nwindow = \"1m\"\nmatch = { path = \"/elsewhere\" }\n";
    let a = Service::start(config("", "6m"), None).await;
    let b = Service::start(config(first, "6m"), None).await;
    let answer = check(&a.http).await;
    // 6 minutes and half a minute, past the 5 of `[server] settle_within`.
    assert_eq!(answer["settle"]["expires_in_ms"], 390_000);
    let token = answer["settle"]["token"]
        .as_str()
        .expect("a token")
        .to_string();
    let settled = settle(&b.http, json!({"token": token, "actual": 100})).await;
    assert_eq!(settled.status, StatusCode::OK, "{}", settled.text());
    assert_eq!(settled.json()["rules"][0]["remaining"], 900);
    // At most what a receipt allows (a minute less than its 10).
    let c = Service::start(config("", "20m"), None).await;
    assert_eq!(check(&c.http).await["settle"]["expires_in_ms"], 540_000);
}

/// A request that meets a budget that gives back what is not settled and
/// a rule Kuadrant's `Reserve` also reaches (`descriptors`, `on_expiry =
/// "release"`): only the budget's charge is held. The other rule counts
/// the request as any rule does; nobody settles it, so a hold of it would
/// be given back, and every request served for free.
const BOTH_RELEASE: &str = r#"
[[rules]]
name = "tokens"
key = ["api_key"]
algorithm = "sliding_log"
limit = 1000
window = "1h"
cost = "response:usage"
reserve = 300
on_expiry = "release"
settle_within = "1s"

[[rules]]
name = "requests"
key = ["api_key"]
algorithm = "sliding_log"
limit = 100
window = "1h"
descriptors = ["api_key"]
on_expiry = "release"
settle_within = "1s"
"#;

async fn only_the_budgets_charge_is_held(config: &str) {
    let service = Service::start(Config::parse(config).expect("valid"), None).await;
    let http = &service.http;
    for served in 1..=2 {
        let answer = check(http).await;
        assert_eq!(remaining(&answer, "requests"), 100 - served);
        let token = answer["settle"]["token"].as_str().expect("a token");
        let settled = settle(http, json!({"token": token, "actual": 10})).await;
        assert_eq!(settled.json()["applied"], true);
        // Past both rules' `settle_within`.
        tokio::time::sleep(std::time::Duration::from_millis(1300)).await;
    }
    let answer = check(http).await;
    assert_eq!(remaining(&answer, "requests"), 97);
    assert_eq!(remaining(&answer, "tokens"), 1000 - 20 - 300);
}

#[tokio::test]
async fn a_request_is_held_only_by_the_budget_it_settles() {
    only_the_budgets_charge_is_held(BOTH_RELEASE).await;
}

#[tokio::test]
async fn on_redis_a_request_is_held_only_by_the_budget_it_settles() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let config = format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\n{BOTH_RELEASE}",
        redis.url()
    );
    only_the_budgets_charge_is_held(&config).await;
}

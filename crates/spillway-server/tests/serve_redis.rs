//! `spillway serve` on Redis, end to end on port 0: the API, readiness and
//! the failure policies, metrics, admin, reload, graceful shutdown, and
//! three service instances sharing one redis-server exactly.
//!
//! Each test starts its own redis-server; without one installed they skip
//! loudly (and fail with SPILLWAY_REQUIRE_REDIS=1, as in CI).

mod serve_support;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde_json::json;
use serve_support::{Service, eventually, temp_dir, write_atomically};
use spillway_conformance::redis_server::RedisServer;
use spillway_server::ConfigSource;
use spillway_server::config::Config;

fn config_text(url: &str, on_error: &str, timeout: &str) -> String {
    format!(
        r#"
[server]
admin_token = "s3cret"

[store]
kind = "redis"
url = "{url}"
timeout = "{timeout}"
on_error = "{on_error}"

[tiers.pro]
api_keys = ["pro-key"]

[[rules]]
name = "shared"
key = ["ip"]
algorithm = "sliding_log"
limit = 50
window = "1h"

[[rules]]
name = "per-key"
match = {{ path = "/api/**" }}
key = ["api_key"]
fallback = []
algorithm = "token_bucket"
limit = 2
window = "1h"
[rules.tiers.pro]
limit = 4
"#
    )
}

fn config(url: &str, on_error: &str) -> Config {
    Config::parse(&config_text(url, on_error, "2s")).expect("a valid configuration")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_works_on_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let service = Service::start(config(&redis.url(), "fail_closed"), None).await;
    let http = &service.http;
    let a = http.get("/readyz").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.json(),
        json!({"status": "ready", "store": "redis", "redis_healthy": true, "on_error": "fail_closed"})
    );

    for remaining in [1, 0] {
        let a = http
            .check(json!({"rule": "per-key", "key": "api_key=k"}))
            .await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.json()["rules"][0]["remaining"], remaining);
        assert_eq!(a.headers["x-ratelimit-remaining"], remaining.to_string());
    }
    let v = http
        .check(json!({"rule": "per-key", "key": "api_key=k"}))
        .await
        .json();
    assert_eq!(
        (v["allowed"].clone(), v["status"].clone()),
        (json!(false), json!(429))
    );
    assert!(v["retry_after_ms"].as_u64().expect("a retry time") > 1_000_000);
    // The pro tier, through a request description with its API key.
    let v = http
        .check(json!({"path": "/api/v1", "headers": {"x-api-key": "pro-key"}}))
        .await
        .json();
    assert_eq!(v["rules"][0]["tier"], "pro");
    assert_eq!(v["rules"][0]["remaining"], 3);
    assert_eq!(v["rules"][0]["key"], "api_key=pro-key");
    // Cost above capacity: the client's error, even on Redis.
    let a = http
        .check(json!({"rule": "per-key", "key": "api_key=k", "cost": 5}))
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);

    // Admin: read, reset (every tier), read again.
    let auth = [("authorization", "Bearer s3cret")];
    let admin = |method| {
        http.send(
            method,
            "/admin/rules/per-key/keys/api_key=k",
            &auth,
            Bytes::new(),
        )
    };
    let v = admin(Method::GET).await.json();
    assert_eq!(v["quotas"][0]["remaining"], 0);
    assert_eq!(v["quotas"][1]["store_rule"], "per-key@pro");
    assert_eq!(
        (v["held"].clone(), v["quotas"][1]["held"].clone()),
        (json!(true), json!(false))
    );
    // The listing pages through Redis's SCAN: every key held, with its tier.
    let mut listed = Vec::new();
    let mut uri = "/admin/rules/per-key/keys?limit=1".to_string();
    for _ in 0..100 {
        let page = http
            .send(Method::GET, &uri, &auth, Bytes::new())
            .await
            .json();
        for k in page["keys"].as_array().expect("keys") {
            listed.push((k["key"].clone(), k["tier"].clone()));
        }
        match page["next"].as_str() {
            Some(next) => uri = format!("/admin/rules/per-key/keys?limit=1&cursor={next}"),
            None => break,
        }
    }
    listed.sort_by_key(|k| k.0.to_string());
    listed.dedup();
    assert_eq!(
        listed,
        [
            (json!("api_key=k"), json!(null)),
            (json!("api_key=pro-key"), json!("pro"))
        ]
    );
    let v = admin(Method::DELETE).await.json();
    assert_eq!(v["reset"], json!(["per-key", "per-key@pro"]));
    assert_eq!(v["held"], true);
    let v = admin(Method::GET).await.json();
    assert_eq!(v["quotas"][0]["remaining"], 2);
    // The deny cache forgot it too: admitted at once.
    assert_eq!(
        http.check(json!({"rule": "per-key", "key": "api_key=k"}))
            .await
            .json()["allowed"],
        true
    );

    let calls = http
        .metric("spillway_redis_calls_total")
        .await
        .expect("redis calls");
    assert!(calls >= 4.0, "{calls}");
    assert_eq!(
        http.metric("spillway_decisions_total{rule=\"per-key\",outcome=\"rejected\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(http.metric("spillway_store_healthy").await, Some(1.0));
    assert_eq!(http.metric("spillway_redis_open_breakers").await, Some(0.0));
    assert!(
        http.metric("spillway_store_call_duration_seconds_count")
            .await
            >= Some(5.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_one_redis_admit_exactly_the_limit() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mut services = Vec::new();
    for _ in 0..3 {
        services.push(Service::start(config(&redis.url(), "fail_closed"), None).await);
    }
    // 240 requests for one key (ip=198.51.100.1), 8 at a time per instance,
    // half as rule checks and half as request descriptions: both count
    // under the same key. The limit is 50 an hour.
    let mut tasks = Vec::new();
    for (i, service) in services.iter().enumerate() {
        for worker in 0..8 {
            let http = service.http.clone();
            tasks.push(tokio::spawn(async move {
                let mut statuses = Vec::new();
                for n in 0..10 {
                    let body = if (i + worker + n) % 2 == 0 {
                        json!({"rule": "shared", "key": "ip=198.51.100.1"})
                    } else {
                        json!({"method": "GET", "path": "/", "ip": "198.51.100.1"})
                    };
                    let a = http.check(body).await;
                    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
                    statuses.push(a.json()["status"].as_u64().expect("a status"));
                }
                statuses
            }));
        }
    }
    let mut admitted = 0;
    let mut denied = 0;
    for task in tasks {
        for status in task.await.expect("no panic") {
            match status {
                200 => admitted += 1,
                429 => denied += 1,
                other => panic!("status {other}"),
            }
        }
    }
    assert_eq!((admitted, denied), (50, 190));
    // Every instance sees the same state.
    for service in &services {
        let v = service
            .http
            .check(json!({"rule": "shared", "key": "ip=198.51.100.1", "cost": 0}))
            .await
            .json();
        assert_eq!(v["rules"][0]["remaining"], 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_answers_503_and_is_not_ready_while_redis_is_down() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let service = Service::start(config(&redis.url(), "fail_closed"), None).await;
    let http = &service.http;
    assert_eq!(
        http.check(json!({"rule": "shared", "key": "ip=k"}))
            .await
            .status,
        StatusCode::OK
    );
    redis.kill();
    let a = http.check(json!({"rule": "shared", "key": "ip=k"})).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text());
    assert_eq!(a.content_type(), "application/problem+json");
    assert_eq!(a.headers["retry-after"], "1");
    let a = http.check(json!({"path": "/", "ip": "192.0.2.1"})).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    let a = http.get("/readyz").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(a.json()["redis_healthy"], false);
    assert_eq!(http.get("/healthz").await.status, StatusCode::OK);
    let a = http
        .send(
            Method::DELETE,
            "/admin/rules/shared/keys/ip=k",
            &[("authorization", "Bearer s3cret")],
            Bytes::new(),
        )
        .await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(http.metric("spillway_redis_errors_total").await >= Some(1.0));
    assert!(
        http.metric("spillway_decisions_total{rule=\"shared\",outcome=\"error\"}")
            .await
            >= Some(2.0)
    );
    let errors = {
        let text = http.get("/metrics").await.text();
        text.lines()
            .filter(|l| l.starts_with("spillway_store_errors_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert!(errors >= 2.0, "{errors}");

    redis.restart();
    eventually(Duration::from_secs(20), "ready again", || async move {
        http.get("/readyz").await.status == StatusCode::OK
    })
    .await;
    assert_eq!(
        http.check(json!({"rule": "shared", "key": "ip=k"}))
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_and_local_stay_ready_while_redis_is_down() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    for policy in ["fail_open", "local"] {
        redis.restart();
        let service = Service::start(config(&redis.url(), policy), None).await;
        let http = &service.http;
        redis.kill();
        let a = http.check(json!({"rule": "shared", "key": "ip=k"})).await;
        assert_eq!(a.status, StatusCode::OK, "{policy}: {}", a.text());
        assert_eq!(a.json()["allowed"], true);
        if policy == "fail_open" {
            // Admitted by the policy: no quota is made up for it.
            assert_eq!(a.json()["undecided"], json!(["shared"]), "{}", a.text());
            assert_eq!(a.json()["rules"], json!([]));
            for name in ["x-ratelimit-remaining", "x-ratelimit-limit", "ratelimit"] {
                assert!(!a.headers.contains_key(name), "{name}: {:?}", a.headers);
            }
            assert!(
                http.metric("spillway_decisions_total{rule=\"shared\",outcome=\"undecided\"}")
                    .await
                    >= Some(1.0)
            );
        } else {
            // Decided in memory, on this instance's share: reported.
            assert_eq!(a.json()["undecided"], json!([]));
            assert_eq!(a.json()["rules"][0]["limit"], 50);
        }
        let a = http.get("/readyz").await;
        assert_eq!(a.status, StatusCode::OK, "{policy}");
        assert_eq!(a.json()["redis_healthy"], false, "{policy}");
        assert_eq!(a.json()["on_error"], policy);
        assert_eq!(http.metric("spillway_store_healthy").await, Some(0.0));
        assert_eq!(
            http.metric("spillway_redis_open_breakers").await,
            Some(1.0),
            "one standalone server, one breaker"
        );
        let series = if policy == "fail_open" {
            "spillway_store_fail_open_total"
        } else {
            "spillway_store_local_total"
        };
        assert!(http.metric(series).await >= Some(1.0), "{policy}");
    }
}

/// `[[rules]] on_error`: with Redis down, the rule that fails closed is
/// refused (a request that reaches it too), the store's default (fail
/// open) admits everything else, and a tier of the closed rule fails
/// closed with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rule_fails_by_its_own_policy_while_redis_is_down() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let text = config_text(&redis.url(), "fail_open", "2s").replace(
        "name = \"per-key\"\n",
        "name = \"per-key\"\non_error = \"fail_closed\"\n",
    );
    let config = Config::parse(&text).expect("a valid configuration");
    let service = Service::start(config, None).await;
    let http = &service.http;
    redis.kill();
    for _ in 0..3 {
        let a = http.check(json!({"rule": "shared", "key": "ip=k"})).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        assert_eq!(a.json()["allowed"], true);
    }
    let a = http
        .check(json!({"rule": "per-key", "key": "api_key=k"}))
        .await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text());
    let a = http
        .check(json!({"rule": "per-key", "key": "api_key=k", "tier": "pro"}))
        .await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text());
    // A request both rules apply to is refused; one only `shared` applies
    // to is admitted.
    let both = json!({"path": "/api/x", "ip": "192.0.2.1", "headers": {"x-api-key": "k1"}});
    let a = http.check(both).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text());
    let a = http.check(json!({"path": "/", "ip": "192.0.2.1"})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_on_redis_keeps_counters_and_metrics() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let dir = temp_dir("reload-redis");
    let path = dir.join("spillway.toml");
    let text = config_text(&redis.url(), "fail_closed", "2s");
    write_atomically(&path, &text);
    let source = ConfigSource::from(path.clone());
    let service = Service::start(source.load().expect("valid"), Some(source)).await;
    let http = service.http.clone();
    for _ in 0..3 {
        http.check(json!({"rule": "shared", "key": "ip=k"})).await;
    }
    let calls = http
        .metric("spillway_redis_calls_total")
        .await
        .expect("calls");
    // A new rule; `shared` is unchanged.
    write_atomically(
        &path,
        &format!(
            "{text}\n[[rules]]\nname = \"new\"\nalgorithm = \"sliding_log\"\nlimit = 1\nwindow = \"1h\"\n"
        ),
    );
    eventually(Duration::from_secs(10), "rule `new` is served", || {
        let http = http.clone();
        async move {
            http.check(json!({"rule": "new", "key": "ip=k"}))
                .await
                .status
                == StatusCode::OK
        }
    })
    .await;
    let v = http
        .check(json!({"rule": "shared", "key": "ip=k"}))
        .await
        .json();
    assert_eq!(v["rules"][0]["remaining"], 46);
    // The new store's counts are added to the old one's: never backwards.
    let after = http
        .metric("spillway_redis_calls_total")
        .await
        .expect("calls");
    assert!(after >= calls + 2.0, "{calls} then {after}");
    // A Redis that cannot be reached is refused like any bad configuration.
    write_atomically(&path, &text.replace(&redis.url(), "redis://127.0.0.1:1/"));
    eventually(
        Duration::from_secs(15),
        "the unreachable Redis is refused",
        || {
            let http = http.clone();
            async move {
                http.metric("spillway_config_reloads_total{result=\"error\"}")
                    .await
                    == Some(1.0)
            }
        },
    )
    .await;
    let v = http
        .check(json!({"rule": "shared", "key": "ip=k"}))
        .await
        .json();
    assert_eq!(v["rules"][0]["remaining"], 45);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_request_held_up_by_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let config = Config::parse(&config_text(&redis.url(), "fail_closed", "20s")).expect("valid");
    let mut service = Service::start(config, None).await;
    let http = service.http.clone();
    // Connect (and load the script) first, then stall Redis for 3 s.
    assert_eq!(
        http.check(json!({"rule": "shared", "key": "ip=k"}))
            .await
            .status,
        StatusCode::OK
    );
    let paused = redis.command("CLIENT PAUSE 3000 ALL");
    assert!(paused.starts_with("+OK"), "{paused}");
    let slow = tokio::spawn({
        let http = http.clone();
        async move { http.check(json!({"rule": "shared", "key": "ip=k"})).await }
    });
    eventually(Duration::from_secs(10), "the check waits on Redis", || {
        let http = http.clone();
        async move { http.metric("spillway_http_requests_in_flight").await == Some(2.0) }
    })
    .await;
    let stopped = service.shutdown();
    let answer = tokio::time::timeout(Duration::from_secs(20), slow)
        .await
        .expect("answered once Redis is back")
        .expect("no panic");
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    assert_eq!(answer.json()["rules"][0]["remaining"], 48);
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .expect("run() returns")
        .expect("no panic")
        .expect("no error");
}

//! `spillway proxy --admin-listen` and what the proxy says when its store
//! fails (issue 26, item 1), with the `spillway` binary, a real
//! redis-server that the test kills and restarts, and an upstream on
//! 127.0.0.1 that counts what reaches it.
//!
//! Without redis-server installed the Redis test skips loudly (and fails
//! with SPILLWAY_REQUIRE_REDIS=1, as in CI).

mod process_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use process_support::{Conn, Process, Raw, Upstream, temp_dir};
use spillway_conformance::redis_server::RedisServer;

/// The longest one answer may take.
const WAIT: Duration = Duration::from_secs(5);

/// How soon `/readyz` must see a dead Redis with no traffic: the probe's
/// interval (1 s) and the store's timeout (below, 500 ms), with room for a
/// busy machine.
const NOTICED_WITHIN: Duration = Duration::from_secs(5);

/// One request on a fresh connection, answered within [`WAIT`].
async fn send(addr: SocketAddr, method: &str, path: &str, headers: &str) -> Raw {
    let mut conn = Conn::connect(addr).await;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: app.test\r\n{headers}content-length: 0\r\nconnection: close\r\n\r\n"
    );
    conn.send(request.as_bytes()).await.expect("sent");
    conn.response(WAIT).await.expect("an answer")
}

async fn json(addr: SocketAddr, path: &str) -> (u16, serde_json::Value) {
    let a = send(addr, "GET", path, "").await;
    let v = serde_json::from_slice(&a.body).unwrap_or(serde_json::Value::Null);
    (a.status, v)
}

/// The value of the metric line that starts with `series`, if any.
async fn metric(admin: SocketAddr, series: &str) -> Option<f64> {
    let text = send(admin, "GET", "/metrics", "").await.text();
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Waits until `/readyz` says `redis_healthy` is `healthy`, at most
/// [`NOTICED_WITHIN`], with no other request meanwhile; how long it took.
async fn readyz_says(admin: SocketAddr, healthy: bool) -> Duration {
    let start = Instant::now();
    loop {
        let (_, v) = json(admin, "/readyz").await;
        if v["redis_healthy"] == healthy {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < NOTICED_WITHIN,
            "/readyz still says {v} after {NOTICED_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const RATE_HEADERS: [&str; 5] = [
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "ratelimit",
    "ratelimit-policy",
];

/// The admin listener answers what `spillway serve` answers, off the
/// proxied port, whose every path (`/metrics` too) goes to the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_serves_health_metrics_and_admin_off_the_proxied_port() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("proxy-admin");
    let config = dir.join("spillway.toml");
    std::fs::write(
        &config,
        "[server]\nadmin_token = \"s3cret\"\n\n[[rules]]\nname = \"login\"\n\
         match = { methods = [\"POST\"], path = \"/login\" }\nkey = [\"ip\"]\n\
         algorithm = \"sliding_log\"\nlimit = 2\nwindow = \"1m\"\n",
    )
    .expect("the config");
    let proxy = Process::proxy_with_admin(&upstream, &config, &dir);
    let admin = proxy.admin.expect("an admin address");
    assert_ne!(admin, proxy.addr);

    assert_eq!(send(proxy.addr, "POST", "/login", "").await.status, 200);
    assert_eq!(
        json(admin, "/healthz").await,
        (200, serde_json::json!({"status": "ok"}))
    );
    let (status, ready) = json(admin, "/readyz").await;
    assert_eq!(
        (status, &ready["store"]),
        (200, &serde_json::json!("memory"))
    );
    assert_eq!(
        metric(
            admin,
            "spillway_decisions_total{rule=\"login\",outcome=\"allowed\"}"
        )
        .await,
        Some(1.0)
    );
    // The admin API, behind its token.
    let peek = "/admin/rules/login/keys/ip=127.0.0.1";
    assert_eq!(send(admin, "GET", peek, "").await.status, 401);
    let a = send(admin, "GET", peek, "authorization: Bearer s3cret\r\n").await;
    assert_eq!(a.status, 200, "{}", a.text());
    let v: serde_json::Value = serde_json::from_slice(&a.body).expect("JSON");
    assert_eq!(v["quotas"][0]["remaining"], 1);
    // No decision API here: this is not `spillway serve`.
    assert_eq!(send(admin, "POST", "/v1/check", "").await.status, 404);
    // The proxied port still forwards these paths to the upstream.
    for path in ["/metrics", "/healthz", "/readyz", "/admin/rules"] {
        let a = send(proxy.addr, "GET", path, "").await;
        assert_eq!((a.status, a.text().as_str()), (200, "upstream"), "{path}");
        assert_eq!(upstream.arrived(path), 1, "{path}");
    }
}

/// Redis dies under the proxy (`fail_open`, the default) and comes back:
/// `/readyz` sees it with no traffic, the proxy logs each change once, and
/// the requests the policy admits carry no made-up quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_under_the_proxy_is_seen_logged_once_and_claims_no_quota() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let upstream = Upstream::start().await;
    let dir = temp_dir("proxy-outage");
    let config = dir.join("spillway.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"\n\n\
             [[rules]]\nname = \"login\"\nmatch = {{ methods = [\"POST\"], path = \"/login\" }}\n\
             key = [\"ip\"]\nalgorithm = \"sliding_log\"\nlimit = 2\nwindow = \"1m\"\n\n\
             [[rules]]\nname = \"api\"\nmatch = {{ path = \"/api/**\" }}\nkey = [\"ip\"]\n\
             algorithm = \"fixed_window\"\nlimit = 100\nwindow = \"1h\"\n",
            redis.url()
        ),
    )
    .expect("the config");
    let mut proxy = Process::proxy_with_admin(&upstream, &config, &dir);
    let admin = proxy.admin.expect("an admin address");
    for remaining in ["1", "0"] {
        let a = send(proxy.addr, "POST", "/login", "").await;
        assert_eq!(a.status, 200);
        assert_eq!(a.headers["x-ratelimit-remaining"], remaining);
    }
    assert_eq!(send(proxy.addr, "POST", "/login", "").await.status, 429);
    let a = send(proxy.addr, "GET", "/api/a", "").await;
    assert_eq!(a.headers["x-ratelimit-remaining"], "99");
    assert_eq!(json(admin, "/readyz").await.1["redis_healthy"], true);

    redis.kill();
    // No request: the probe alone finds it.
    let took = readyz_says(admin, false).await;
    println!("a dead Redis seen by /readyz after {took:?}");
    let (status, ready) = json(admin, "/readyz").await;
    assert_eq!(status, 200, "fail_open serves without Redis: ready");
    assert_eq!(ready["on_error"], "fail_open");
    assert_eq!(metric(admin, "spillway_store_healthy").await, Some(0.0));
    proxy.wait_for("Redis does not answer");

    // Admitted by the policy: with no quota claimed for it.
    for _ in 0..5 {
        let a = send(proxy.addr, "GET", "/api/a", "").await;
        assert_eq!(a.status, 200);
        for name in RATE_HEADERS {
            assert!(!a.headers.contains_key(name), "{name}: {:?}", a.headers);
        }
    }
    assert!(
        metric(
            admin,
            "spillway_decisions_total{rule=\"api\",outcome=\"undecided\"}"
        )
        .await
            >= Some(5.0)
    );

    redis.restart();
    let took = readyz_says(admin, true).await;
    println!("Redis back, seen by /readyz after {took:?}");
    proxy.wait_for("Redis answers again:");
    // The restarted server is empty: the key is counted afresh.
    let a = send(proxy.addr, "GET", "/api/a", "").await;
    assert_eq!(a.headers["x-ratelimit-remaining"], "99");

    let log = proxy.log();
    assert_eq!(log.matches("Redis does not answer").count(), 1, "{log}");
    assert_eq!(log.matches("Redis answers again:").count(), 1, "{log}");
}

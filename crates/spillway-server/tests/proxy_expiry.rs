//! A `spillway proxy` killed (SIGKILL) with a budget reservation open: with
//! `on_expiry = "release"`, another instance on the same redis-server
//! gives it back once `settle_within` has passed; with `"charge"` (the
//! default), it stays charged. The `spillway` binary, a real
//! redis-server, and an upstream on 127.0.0.1 that holds the request.
//!
//! Without redis-server installed the test skips loudly (and fails with
//! SPILLWAY_REQUIRE_REDIS=1, as in CI).

mod process_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use process_support::{Conn, Process, Upstream, temp_dir};
use spillway_conformance::redis_server::RedisServer;

/// The longest one answer may take.
const WAIT: Duration = Duration::from_secs(5);

/// What the budget of 127.0.0.1 has left, as the admin API peeks at it.
async fn left(admin: SocketAddr) -> u64 {
    let mut conn = Conn::connect(admin).await;
    let request = "GET /admin/rules/tokens/keys/ip=127.0.0.1 HTTP/1.1\r\nhost: admin\r\n\
                   authorization: Bearer s3cret\r\nconnection: close\r\n\r\n";
    conn.send(request.as_bytes()).await.expect("sent");
    let answer = conn.response(WAIT).await.expect("an answer");
    assert_eq!(answer.status, 200, "{}", answer.text());
    let v: serde_json::Value = serde_json::from_slice(&answer.body).expect("JSON");
    v["quotas"][0]["remaining"].as_u64().expect("remaining")
}

async fn metric(admin: SocketAddr, series: &str) -> Option<f64> {
    let mut conn = Conn::connect(admin).await;
    let request = "GET /metrics HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n";
    conn.send(request.as_bytes()).await.expect("sent");
    let text = conn.response(WAIT).await.expect("an answer").text();
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Starts a proxy, sends it a request the upstream holds (400 reserved),
/// kills the proxy, and starts another on the same store: what the second
/// one sees, and when the request was sent.
async fn killed_with_a_reservation_open(
    on_expiry: &str,
    redis: &RedisServer,
    upstream: &Upstream,
) -> (Process, Instant) {
    let dir = temp_dir(&format!("proxy-expiry-{}", on_expiry.len()));
    let config = dir.join("spillway.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nadmin_token = \"s3cret\"\n\n\
             [store]\nkind = \"redis\"\nurl = \"{}\"\n\n\
             [[rules]]\nname = \"tokens\"\nkey = [\"ip\"]\nalgorithm = \"sliding_log\"\n\
             limit = 1000\nwindow = \"1h\"\ncost = \"response:header:x-usage\"\nreserve = 400\n\
             {on_expiry}",
            redis.url()
        ),
    )
    .expect("the config");
    let mut first = Process::proxy_with_admin(upstream, &config, &dir);
    let addr = first.addr;
    let sent = Instant::now();
    let in_flight = tokio::spawn(async move {
        let mut conn = Conn::connect(addr).await;
        let request = "GET /hold HTTP/1.1\r\nhost: app.test\r\nconnection: close\r\n\r\n";
        conn.send(request.as_bytes()).await.expect("sent");
        // Never answered: its proxy dies first.
        conn.response(Duration::from_secs(30)).await
    });
    let held = upstream.holding() + 1;
    while upstream.holding() < held {
        assert!(
            sent.elapsed() < WAIT,
            "the request never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(left(first.admin.expect("an admin listener")).await, 600);
    first.child.kill().expect("killed");
    first.child.wait().expect("reaped");
    assert!(in_flight.await.expect("joined").is_err(), "no answer came");
    let second = Process::proxy_with_admin(upstream, &config, &dir);
    (second, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_proxys_reservation_is_given_back_with_release_and_kept_with_charge() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let upstream = Upstream::start().await;

    // release: given back by the second proxy, not before two seconds.
    let release = "on_expiry = \"release\"\nsettle_within = \"2s\"\n";
    let (second, sent) = killed_with_a_reservation_open(release, &redis, &upstream).await;
    let admin = second.admin.expect("an admin listener");
    let given_back = loop {
        let left = left(admin).await;
        if left == 1000 {
            break sent.elapsed();
        }
        assert_eq!(left, 600);
        assert!(sent.elapsed() < Duration::from_secs(15), "never given back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("given back {given_back:?} after the request was sent");
    assert!(given_back >= Duration::from_secs(2), "{given_back:?}");
    assert_eq!(
        metric(admin, "spillway_budget_given_back_total").await,
        Some(1.0)
    );
    drop(second);

    // charge (the default): what was reserved is what it costs.
    redis.command("FLUSHALL");
    let (second, sent) = killed_with_a_reservation_open("", &redis, &upstream).await;
    let admin = second.admin.expect("an admin listener");
    while sent.elapsed() < Duration::from_secs(4) {
        assert_eq!(left(admin).await, 600);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        metric(admin, "spillway_budget_given_back_total").await,
        Some(0.0)
    );
    upstream.release();
}

//! Store errors: on a Redis store that fails closed, a dead server gives
//! 503 with `Retry-After` and a problem+json body, never a 500.
//!
//! This runs on a real `redis-server` (skipped, loudly, when it is not
//! installed) and on tokio's real clock: the Redis client's timeouts must
//! not be fast-forwarded. Nothing sleeps.

use std::time::Duration;

use http::StatusCode;
use spillway_conformance::redis_server::RedisServer;
use spillway_redis::{OnError, RedisOptions, RedisStore, Topology};
use spillway_tower::{HttpRule, Policy, RateLimitLayer};

use crate::support::{body_json, bucket, header, header_u64, hello, req, send};

#[tokio::test]
async fn a_dead_redis_under_fail_closed_is_a_503_never_a_500() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let n = 5;
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]);
    let options = RedisOptions {
        on_error: OnError::FailClosed,
        // Generous, so that a loaded machine does not fail the requests
        // made while the server is up.
        timeout: Duration::from_secs(5),
        ..RedisOptions::default()
    };
    let store = RedisStore::connect(
        Topology::Standalone(server.url()),
        policy.store_rules(),
        options,
    )
    .await
    .expect("redis is up");
    let app = hello(RateLimitLayer::new(policy, store).expect("same rules"));

    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::OK, "decided by Redis");
    assert_eq!(header_u64(&res, "x-ratelimit-remaining"), u64::from(n) - 1);

    server.kill();
    // The first request meets the dead connection; the next ones find the
    // store already marked down. All are refused the same way.
    for _ in 0..3 {
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(header_u64(&res, "retry-after") >= 1);
        assert_eq!(
            header(&res, "content-type").as_deref(),
            Some("application/problem+json")
        );
        let body = body_json(res).await;
        assert_eq!(body["status"], 503);
        assert!(
            body["title"].is_string() && body["detail"].is_string(),
            "{body}"
        );
    }
}

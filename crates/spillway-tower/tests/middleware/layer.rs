//! The layer on an axum router and on a plain tower service; clones share
//! one store.

use std::convert::Infallible;

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use spillway::algorithm::FixedWindow;
use spillway::store::{MemoryOptions, MemoryStore, Rule};
use spillway::{Quota, algorithm::TokenBucket};
use spillway_tower::{ClientAddr, HttpRule, Policy, RateLimitLayer, TokioClock};
use tower::{Layer, ServiceExt};

use crate::support::{admitted, body_string, bucket, hello, memory_layer, nz, req, send, sock};

#[tokio::test(start_paused = true)]
async fn limits_an_axum_router() {
    let n = 3;
    let app = hello(memory_layer(Policy::new([HttpRule::new(
        "per-ip",
        bucket(n),
    )])));
    for _ in 0..n {
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(body_string(res).await, "hello", "the handler answered");
    }
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(start_paused = true)]
async fn limits_a_plain_tower_service() {
    let n = 2;
    let layer = memory_layer(Policy::new([HttpRule::new("per-ip", bucket(n))]));
    let service = layer.layer(tower::service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"plain"))))
    }));
    let request = || {
        let mut r = Request::new(Full::new(Bytes::new()));
        r.extensions_mut().insert(ClientAddr(sock("192.0.2.1")));
        r
    };
    for _ in 0..n {
        let res = service
            .clone()
            .oneshot(request())
            .await
            .expect("infallible");
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().contains_key("x-ratelimit-remaining"));
        assert_eq!(body_string(res).await, "plain");
    }
    let res = service
        .clone()
        .oneshot(request())
        .await
        .expect("infallible");
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().contains_key("retry-after"));
}

#[tokio::test(start_paused = true)]
async fn clones_of_the_layer_share_one_store() {
    let n = 4;
    let layer = memory_layer(Policy::new([HttpRule::new("per-ip", bucket(n))]));
    let copy = layer.clone();
    // One allocation behind both: the clone copied a pointer, not the store.
    assert!(std::ptr::eq(layer.store(), copy.store()));
    assert!(std::ptr::eq(layer.policy(), copy.policy()));

    let a = Router::new()
        .route("/a", get(|| async { "a" }))
        .layer(layer);
    let b = Router::new().route("/b", get(|| async { "b" })).layer(copy);
    for _ in 0..n / 2 {
        assert_eq!(
            send(&a, req("/a", "192.0.2.1")).await.status(),
            StatusCode::OK
        );
    }
    // Half the quota is gone on the other app too.
    assert_eq!(
        admitted(&b, 10, || req("/b", "192.0.2.1")).await,
        (n / 2) as usize
    );
    assert_eq!(admitted(&a, 10, || req("/a", "192.0.2.1")).await, 0);
}

#[tokio::test(start_paused = true)]
async fn a_store_built_for_other_rules_is_refused_one_with_more_is_not() {
    let quota = Quota::per_minute(nz(10));
    let policy = Policy::new([HttpRule::new("per-ip", FixedWindow::new(quota))]);

    let renamed = MemoryStore::with_clock(
        vec![Rule::new("other", FixedWindow::new(quota))],
        MemoryOptions::default(),
        TokioClock::new(),
    );
    let err = RateLimitLayer::new(policy.clone(), renamed).expect_err("names differ");
    assert_eq!(err.expected, ["per-ip"]);
    assert_eq!(err.found, ["other"]);

    let other_algorithm = MemoryStore::with_clock(
        vec![Rule::new("per-ip", TokenBucket::new(quota, nz(10)))],
        MemoryOptions::default(),
        TokioClock::new(),
    );
    assert!(RateLimitLayer::new(policy.clone(), other_algorithm).is_err());

    // Missing one of the policy's rules: refused.
    let empty = MemoryStore::with_clock(Vec::new(), MemoryOptions::default(), TokioClock::new());
    assert!(RateLimitLayer::new(policy.clone(), empty).is_err());
    // The policy's rules, then one of the caller's own: accepted.
    let extended = MemoryStore::with_clock(
        vec![
            Rule::new("per-ip", FixedWindow::new(quota)),
            Rule::new("mine", TokenBucket::new(quota, nz(10))),
        ],
        MemoryOptions::default(),
        TokioClock::new(),
    );
    assert!(RateLimitLayer::new(policy, extended).is_ok());
}

//! Denials: 429, `Retry-After` rounded up to whole seconds (never 0), and
//! the body in each configurable shape.

use std::time::Duration;

use http::StatusCode;
use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway_tower::{BodyFormat, HttpRule, Policy};

use crate::support::{
    body_json, body_string, bucket, ceil_secs, header, header_u64, hello, memory_layer, nz, req,
    send,
};

/// A bucket of one token coming back every `interval`.
fn one_every(interval: Duration) -> (TokenBucket, Duration) {
    let millis = u64::try_from(interval.as_millis()).expect("small");
    // `limit` tokens per `limit * interval`: the interval, exactly.
    let quota = Quota::new(nz(10), Duration::from_millis(10 * millis)).expect("a valid quota");
    assert_eq!(quota.period() / quota.limit().get(), interval);
    (TokenBucket::new(quota, nz(1)), interval)
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_rounded_up_to_whole_seconds() {
    let (bucket, interval) = one_every(Duration::from_millis(1500));
    let app = hello(memory_layer(Policy::new([HttpRule::new("slow", bucket)])));
    assert_eq!(
        send(&app, req("/", "192.0.2.1")).await.status(),
        StatusCode::OK
    );

    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    // 1.5 s to wait: 2, never the 1 that would be too early.
    assert_eq!(header_u64(&res, "retry-after"), ceil_secs(interval));
    assert_eq!(header_u64(&res, "retry-after"), 2);
    assert_eq!(body_json(res).await["retry_after"], 2);

    // 0.1 s to go: 1, not 0.
    let step = Duration::from_millis(1400);
    tokio::time::advance(step).await;
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header_u64(&res, "retry-after"), 1);

    // And the wait is exact: at 1.5 s, admitted.
    tokio::time::advance(interval - step - Duration::from_micros(1)).await;
    assert_eq!(
        send(&app, req("/", "192.0.2.1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    tokio::time::advance(Duration::from_micros(1)).await;
    assert_eq!(
        send(&app, req("/", "192.0.2.1")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test(start_paused = true)]
async fn a_wait_under_a_second_is_one_second_never_zero() {
    let (bucket, interval) = one_every(Duration::from_millis(200));
    let app = hello(memory_layer(Policy::new([HttpRule::new("fast", bucket)])));
    assert_eq!(
        send(&app, req("/", "192.0.2.1")).await.status(),
        StatusCode::OK
    );
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header_u64(&res, "retry-after"), ceil_secs(interval));
    assert_eq!(header_u64(&res, "retry-after"), 1);
}

#[tokio::test(start_paused = true)]
async fn the_default_body_is_problem_json() {
    let app = hello(memory_layer(Policy::new([HttpRule::new(
        "per-ip",
        bucket(1),
    )])));
    send(&app, req("/", "192.0.2.1")).await;
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header(&res, "content-type").as_deref(),
        Some("application/problem+json")
    );
    let retry = header_u64(&res, "retry-after");
    let body = body_json(res).await;
    assert!(body["type"].is_string(), "{body}");
    assert_eq!(body["title"], "Too Many Requests");
    assert_eq!(body["status"], 429);
    let detail = body["detail"].as_str().expect("a detail");
    assert!(detail.contains("per-ip"), "{detail}");
    assert_eq!(body["retry_after"], retry);
}

#[tokio::test(start_paused = true)]
async fn other_body_formats() {
    for format in [BodyFormat::Json, BodyFormat::Text, BodyFormat::Empty] {
        let app = hello(memory_layer(
            Policy::new([HttpRule::new("per-ip", bucket(1))]).body(format),
        ));
        send(&app, req("/", "192.0.2.1")).await;
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{format:?}");
        let retry = header_u64(&res, "retry-after");
        assert!(retry >= 1);
        assert!(
            res.headers().contains_key("x-ratelimit-remaining"),
            "{format:?}"
        );
        let content_type = header(&res, "content-type");
        match format {
            BodyFormat::Json => {
                assert_eq!(content_type.as_deref(), Some("application/json"));
                let body = body_json(res).await;
                assert!(
                    body["error"].as_str().is_some_and(|e| e.contains("per-ip")),
                    "{body}"
                );
                assert_eq!(body["retry_after"], retry);
            }
            BodyFormat::Text => {
                assert!(content_type.is_some_and(|c| c.starts_with("text/plain")));
                assert!(body_string(res).await.contains("per-ip"));
            }
            BodyFormat::Empty => {
                assert_eq!(content_type, None);
                assert_eq!(body_string(res).await, "");
            }
            BodyFormat::Problem => unreachable!(),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_full_store_that_denies_new_keys_answers_429_never_a_fresh_quota() {
    use spillway::store::{MemoryOptions, MemoryStore, OnFull};
    use spillway_tower::{RateLimitLayer, TokioClock};

    // A login limit of 1 a minute, in a table of one key that never forgets
    // a used key to make room.
    let login = HttpRule::new("login", TokenBucket::new(Quota::per_minute(nz(1)), nz(1)));
    let policy = Policy::new([login]);
    let options = MemoryOptions {
        max_keys: std::num::NonZeroUsize::new(1).expect("nonzero"),
        on_full: OnFull::DenyNew,
        ..MemoryOptions::default()
    };
    let store = MemoryStore::with_clock(policy.store_rules(), options, TokioClock::new());
    let app = hello(RateLimitLayer::new(policy, store).expect("the policy's rules"));
    assert_eq!(
        send(&app, req("/", "192.0.2.1")).await.status(),
        StatusCode::OK
    );
    // A newcomer finds the table full of a used key: denied, told to come
    // back when that key is idle, and the used key keeps its count.
    let res = send(&app, req("/", "192.0.2.2")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header_u64(&res, "retry-after"), 60);
    assert_eq!(
        send(&app, req("/", "192.0.2.1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(
        send(&app, req("/", "192.0.2.2")).await.status(),
        StatusCode::OK
    );
}

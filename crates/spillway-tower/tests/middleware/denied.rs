//! Denials: 429, `Retry-After` rounded up to whole seconds (never 0), and
//! the body in each configurable shape.

use std::time::Duration;

use http::StatusCode;
use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway_tower::{Action, BodyFormat, HttpRule, Policy};

use crate::support::{
    applied_rules, body_json, body_string, bucket, ceil_secs, header, header_u64, hello,
    memory_layer, nz, req, send,
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
            BodyFormat::Problem | BodyFormat::QuotaExceeded => unreachable!(),
        }
    }
}

/// A token bucket of one token coming back every `60 / per_minute` s.
fn one_token(per_minute: u32) -> TokenBucket {
    TokenBucket::new(Quota::per_minute(nz(per_minute)), nz(1))
}

/// The problem type of draft-ietf-httpapi-ratelimit-headers-11 §5.1: the
/// whole body, its members in name order as serde_json writes them.
#[tokio::test(start_paused = true)]
async fn a_quota_exceeded_body_names_the_violated_policy() {
    let app = hello(memory_layer(
        Policy::new([HttpRule::new("login", one_token(1))]).body(BodyFormat::QuotaExceeded),
    ));
    assert_eq!(
        send(&app, req("/", "192.0.2.1")).await.status(),
        StatusCode::OK
    );
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header(&res, "content-type").as_deref(),
        Some("application/problem+json")
    );
    assert_eq!(header_u64(&res, "retry-after"), 60);
    assert_eq!(
        body_string(res).await,
        concat!(
            r#"{"detail":"Rate limit `login` exceeded: retry in 60 seconds.","retry_after":60,"#,
            r#""status":429,"title":"Quota Exceeded","#,
            r#""type":"https://iana.org/assignments/http-problem-types#quota-exceeded","#,
            r#""violated-policies":["login"]}"#
        )
    );
}

/// Two `reject` rules denying in the same store call are both violated
/// policies, in policy order; the 429 waits for the first. The shadow and
/// degrade rules that denied too did not refuse the request: they are not.
#[tokio::test(start_paused = true)]
async fn every_reject_rule_that_denied_is_a_violated_policy() {
    let policy = Policy::new([
        HttpRule::new("watch", one_token(1)).action(Action::Shadow),
        HttpRule::new("per-ip", one_token(5)),
        HttpRule::new("soft", one_token(1)).action(Action::Degrade),
        HttpRule::new("login", one_token(1)),
    ])
    .body(BodyFormat::QuotaExceeded);
    let app = hello(memory_layer(policy));
    assert_eq!(
        send(&app, req("/", "192.0.2.1")).await.status(),
        StatusCode::OK
    );
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header_u64(&res, "retry-after"), 12);
    assert_eq!(
        applied_rules(&res),
        ["watch", "per-ip", "soft", "login"],
        "every rule that decided is described"
    );
    assert_eq!(
        body_string(res).await,
        concat!(
            r#"{"detail":"Rate limit `per-ip` exceeded: retry in 12 seconds.","retry_after":12,"#,
            r#""status":429,"title":"Quota Exceeded","#,
            r#""type":"https://iana.org/assignments/http-problem-types#quota-exceeded","#,
            r#""violated-policies":["per-ip","login"]}"#
        )
    );
}

/// The names in `violated-policies` are the `RateLimit-Policy` items'
/// names, read back from the structured field: a quote unescaped, a
/// character a header cannot carry made `?` in both.
#[tokio::test(start_paused = true)]
async fn violated_policies_are_the_names_ratelimit_policy_gives() {
    let app = hello(memory_layer(
        Policy::new([HttpRule::new("say \"hi\" \u{e9}t\u{e9}", one_token(1))])
            .body(BodyFormat::QuotaExceeded),
    ));
    send(&app, req("/", "192.0.2.1")).await;
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let names = applied_rules(&res);
    assert_eq!(names, ["say \"hi\" ?t?"]);
    let body = body_json(res).await;
    assert_eq!(
        body["violated-policies"],
        serde_json::json!(names),
        "{body}"
    );
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

/// A block list entry refuses a request at once with its status and the
/// time to its end, counting nothing; an allow lets a client past a rule.
#[tokio::test(start_paused = true)]
async fn a_blocked_client_is_refused_with_the_entrys_status_and_counts_nothing() {
    use spillway::store::{ListEntry, Listed, Store};

    let (bucket, _) = one_every(Duration::from_secs(1));
    let layer = memory_layer(Policy::new([HttpRule::new("one", bucket)]));
    let lists = layer.store().lists().expect("the memory store keeps lists");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_micros() as u64;
    let entry = |allow, status, until| ListEntry {
        allow,
        rule: None,
        status,
        until,
        spec: "{}".into(),
    };
    let net =
        |s: &str, len| Listed::network(s.parse().expect("an address"), len).expect("a network");
    lists.set(
        net("192.0.2.0", 24),
        entry(false, 429, Some(now + 90_000_000)),
    );
    lists.set(net("2001:db8::", 32), entry(false, 403, None));
    lists.set(net("198.51.100.7", 32), entry(true, 403, None));
    let app = hello(layer);
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry = header_u64(&res, "retry-after");
    assert!((89..=90).contains(&retry), "{retry}");
    let res = send(&app, req("/", "2001:db8::1")).await;
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    assert!(
        res.headers().get("retry-after").is_none(),
        "a block without an end"
    );
    // Outside: the bucket's one token, then denied by the rule.
    assert_eq!(
        send(&app, req("/", "192.0.3.1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, req("/", "192.0.3.1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // An allowed client is never counted.
    for _ in 0..3 {
        let res = send(&app, req("/", "198.51.100.7")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("ratelimit").is_none());
    }
}

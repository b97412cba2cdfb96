//! The Envoy rate limit service end to end: the real gRPC server on port 0,
//! called by a tonic client, on the in-memory store (and a killed Redis for
//! the failure test).

mod clock_support;
mod grpc_support;

use std::sync::Arc;
use std::time::Duration;

use grpc_support::{code, descriptor, request};
use spillway_server::config::Config;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use spillway_server::envoy::rls::rate_limit_response::rate_limit::Unit;
use spillway_server::envoy::rls::rate_limit_response::{Code, DescriptorStatus};
use spillway_server::envoy::rls::rate_limit_service_client::RateLimitServiceClient;
use spillway_server::envoy::rls::{RateLimitRequest, RateLimitResponse};
use spillway_server::state::{Live, Loaded};
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// The rate limit domain the tests' configuration answers.
const DOMAIN: &str = "spillway";

/// Rules reachable from Envoy, in the `spillway` domain:
/// - `per-ip`: 3 per minute by `remote_address` (fixed window);
/// - `per-user`: 10 per minute by `user` (token bucket: one back every 6s);
/// - `per-path-ip`: 2 per minute by `path` then `remote_address`;
/// - `soft` (degrade) and `quiet` (shadow): 1 per minute by `client`.
const CONFIG: &str = r#"
[envoy]
domain = "spillway"

[[rules]]
name = "per-ip"
algorithm = "fixed_window"
limit = 3
window = "1m"
descriptors = ["remote_address"]

[[rules]]
name = "per-user"
algorithm = "token_bucket"
limit = 10
window = "1m"
descriptors = ["user"]

[[rules]]
name = "per-path-ip"
algorithm = "sliding_log"
limit = 2
window = "1m"
descriptors = ["path", "remote_address"]

[[rules]]
name = "soft"
algorithm = "fixed_window"
limit = 1
window = "1m"
action = "degrade"
descriptors = ["client"]

[[rules]]
name = "quiet"
algorithm = "fixed_window"
limit = 1
window = "1m"
action = "shadow"
descriptors = ["tenant"]
"#;

/// A running service; stops when dropped.
struct Server {
    client: RateLimitServiceClient<Channel>,
    _stop: oneshot::Sender<()>,
}

async fn start(config: &str) -> Server {
    let config = Config::parse(config).expect("a valid configuration");
    let engine = Loaded::build(config, None, None).await.expect("an engine");
    start_engine(engine).await
}

async fn start_engine(engine: Loaded) -> Server {
    clock_support::clear_of_a_minute_boundary();
    let shared = Arc::new(Live::new(engine));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(spillway_server::envoy::serve(listener, shared, async {
        let _ = stopped.await;
    }));
    let client = grpc_support::connect(addr).await;
    Server {
        client,
        _stop: stop,
    }
}

impl Server {
    async fn ask(&mut self, request: RateLimitRequest) -> RateLimitResponse {
        grpc_support::ask(&mut self.client, request).await
    }

    async fn one(&mut self, entries: &[(&str, &str)]) -> RateLimitResponse {
        self.ask(request(DOMAIN, vec![descriptor(entries)])).await
    }
}

fn until_reset(s: &DescriptorStatus) -> Duration {
    let d = s.duration_until_reset.expect("a duration until reset");
    Duration::new(d.seconds as u64, d.nanos as u32)
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

const IP: &[(&str, &str)] = &[("remote_address", "10.0.0.1")];

#[tokio::test]
async fn ok_until_the_limit_then_over_limit() {
    let mut s = start(CONFIG).await;
    for remaining in [2, 1, 0] {
        let r = s.one(IP).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        let status = &r.statuses[0];
        assert_eq!(code(status.code), Code::Ok);
        assert_eq!(status.limit_remaining, remaining);
        let limit = status.current_limit.as_ref().expect("a limit");
        assert_eq!(limit.name, "per-ip");
        assert_eq!(limit.requests_per_unit, 3);
        assert_eq!(limit.unit(), Unit::Minute);
        let reset = until_reset(status);
        assert!(reset > Duration::ZERO && reset <= Duration::from_secs(60));
    }
    let r = s.one(IP).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(code(r.statuses[0].code), Code::OverLimit);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    // Another address has its own counter.
    let r = s.one(&[("remote_address", "10.0.0.2")]).await;
    assert_eq!(code(r.overall_code), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 2);
}

#[tokio::test]
async fn remaining_and_reset_come_from_the_rules_quota() {
    let mut s = start(CONFIG).await;
    // A token bucket of 10 per minute: one token back every 6 s, so after
    // n tokens are taken the bucket is full again in n * 6 s.
    let user = &[("user", "ann")];
    let r = s.one(user).await;
    let status = &r.statuses[0];
    assert_eq!(status.limit_remaining, 9);
    let reset = until_reset(status);
    assert!(
        reset <= Duration::from_secs(6) && reset > Duration::from_millis(5_500),
        "{reset:?}"
    );
    let limit = status.current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit()), (10, Unit::Minute));

    let r = s.one(user).await;
    let reset = until_reset(&r.statuses[0]);
    assert_eq!(r.statuses[0].limit_remaining, 8);
    assert!(
        reset <= Duration::from_secs(12) && reset > Duration::from_millis(11_500),
        "{reset:?}"
    );
}

#[tokio::test]
async fn hits_addend_is_the_cost() {
    let mut s = start(CONFIG).await;
    let user = descriptor(&[("user", "bob")]);
    // Request level.
    let r = s
        .ask(RateLimitRequest {
            hits_addend: 4,
            ..request(DOMAIN, vec![user.clone()])
        })
        .await;
    assert_eq!(r.statuses[0].limit_remaining, 6);
    // The descriptor's own addend wins over the request's.
    let r = s
        .ask(RateLimitRequest {
            hits_addend: 4,
            ..request(
                DOMAIN,
                vec![RateLimitDescriptor {
                    hits_addend: Some(2),
                    ..user.clone()
                }],
            )
        })
        .await;
    assert_eq!(r.statuses[0].limit_remaining, 4);
    // A descriptor addend of 0 only looks.
    let r = s
        .ask(request(
            DOMAIN,
            vec![RateLimitDescriptor {
                hits_addend: Some(0),
                ..user.clone()
            }],
        ))
        .await;
    assert_eq!(code(r.overall_code), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 4);
    // Over what is left: denied, nothing taken.
    let r = s
        .ask(RateLimitRequest {
            hits_addend: 5,
            ..request(DOMAIN, vec![user.clone()])
        })
        .await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(r.statuses[0].limit_remaining, 4);
    // More than the bucket can ever hold: over limit, not an error.
    let r = s
        .ask(request(
            DOMAIN,
            vec![
                RateLimitDescriptor {
                    hits_addend: Some(11),
                    ..user
                },
                descriptor(IP),
            ],
        ))
        .await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(code(r.statuses[0].code), Code::OverLimit);
    assert_eq!(code(r.statuses[1].code), Code::Ok);
    // ... and the other descriptor was not charged.
    assert_eq!(r.statuses[1].limit_remaining, 3);
    assert_eq!(s.one(IP).await.statuses[0].limit_remaining, 2);
}

#[tokio::test]
async fn one_descriptor_over_denies_the_request_and_charges_no_other() {
    let mut s = start(CONFIG).await;
    let both = || {
        request(
            DOMAIN,
            vec![
                descriptor(&[("path", "/login"), ("remote_address", "10.0.0.9")]),
                descriptor(&[("user", "cy")]),
            ],
        )
    };
    for (path_left, user_left) in [(1, 9), (0, 8)] {
        let r = s.ask(both()).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(r.statuses[0].limit_remaining, path_left);
        assert_eq!(r.statuses[1].limit_remaining, user_left);
    }
    let r = s.ask(both()).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(code(r.statuses[0].code), Code::OverLimit);
    assert_eq!(code(r.statuses[1].code), Code::Ok);
    assert_eq!(r.statuses[1].limit_remaining, 8, "the user was not charged");
    let r = s.one(&[("user", "cy")]).await;
    assert_eq!(r.statuses[0].limit_remaining, 7);
}

#[tokio::test]
async fn descriptors_no_rule_knows_are_ok_and_unlimited() {
    let mut s = start(CONFIG).await;
    let r = s
        .ask(request(
            DOMAIN,
            vec![
                descriptor(&[("generic_key", "anything")]),
                // The keys of a rule, in another order, are another descriptor.
                descriptor(&[("remote_address", "10.0.0.1"), ("path", "/")]),
                descriptor(IP),
            ],
        ))
        .await;
    assert_eq!(code(r.overall_code), Code::Ok);
    for unknown in &r.statuses[..2] {
        assert_eq!(code(unknown.code), Code::Ok);
        assert_eq!(unknown.current_limit, None);
        assert_eq!(unknown.duration_until_reset, None);
    }
    assert_eq!(r.statuses[2].limit_remaining, 2);

    // Nothing known at all: no headers either.
    let r = s.one(&[("generic_key", "x")]).await;
    assert_eq!(code(r.overall_code), Code::Ok);
    assert!(r.response_headers_to_add.is_empty());
}

#[tokio::test]
async fn another_domain_limits_nothing() {
    let mut s = start(CONFIG).await;
    for _ in 0..5 {
        let r = s
            .ask(RateLimitRequest {
                domain: "other".into(),
                ..request(DOMAIN, vec![descriptor(IP), descriptor(&[("x", "y")])])
            })
            .await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(r.statuses.len(), 2);
        assert!(r.statuses.iter().all(|s| s.current_limit.is_none()));
        assert!(r.response_headers_to_add.is_empty());
    }
    // And charged nothing in ours.
    assert_eq!(s.one(IP).await.statuses[0].limit_remaining, 2);
}

#[tokio::test]
async fn malformed_requests_are_invalid_arguments() {
    let mut s = start(CONFIG).await;
    let no_domain = RateLimitRequest {
        domain: String::new(),
        ..request(DOMAIN, vec![descriptor(IP)])
    };
    let e = s.client.should_rate_limit(no_domain).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let e = s
        .client
        .should_rate_limit(request(DOMAIN, vec![]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn response_headers_carry_our_rate_limit_headers() {
    let mut s = start(CONFIG).await;
    let both = || {
        request(
            DOMAIN,
            vec![
                descriptor(IP),
                descriptor(&[("path", "/a"), ("remote_address", "10.0.0.1")]),
            ],
        )
    };
    let r = s.ask(both()).await;
    // The most restrictive descriptor: per-path-ip, 1 left of 2.
    assert_eq!(header(&r, "x-ratelimit-limit"), Some("2"));
    assert_eq!(header(&r, "x-ratelimit-remaining"), Some("1"));
    let reset: u64 = header(&r, "x-ratelimit-reset").unwrap().parse().unwrap();
    assert!(reset > 1_700_000_000, "a unix time by default: {reset}");
    assert_eq!(
        header(&r, "ratelimit-policy"),
        Some("\"per-ip\";q=3;w=60, \"per-path-ip\";q=2;w=60")
    );
    assert_eq!(header(&r, "ratelimit"), Some("\"per-path-ip\";r=1;t=60"));
    assert_eq!(header(&r, "retry-after"), None);

    s.ask(both()).await;
    let r = s.ask(both()).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(header(&r, "x-ratelimit-remaining"), Some("0"));
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((59..=60).contains(&retry), "{retry}");
    // Over the limit, `t` is the Retry-After number: Retry-After must not
    // end before the effective window does
    // (draft-ietf-httpapi-ratelimit-headers-11, §6).
    let expected = format!("\"per-path-ip\";r=0;t={retry}");
    assert_eq!(header(&r, "ratelimit"), Some(expected.as_str()));
}

/// Over the limit of a token bucket, whose Retry-After (one token, 6 s) is
/// far shorter than its time to full (60 s, what `t` used to be), the
/// `RateLimit` item's effective window is the Retry-After
/// (draft-ietf-httpapi-ratelimit-headers-11, §6).
#[tokio::test]
async fn over_the_limit_the_effective_window_is_the_retry_after() {
    let mut s = start(CONFIG).await;
    let user = &[("user", "u1")];
    for _ in 0..10 {
        assert_eq!(code(s.one(user).await.overall_code), Code::Ok);
    }
    let r = s.one(user).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((5..=6).contains(&retry), "one token's interval: {retry}");
    let expected = format!("\"per-user\";r=0;t={retry}");
    assert_eq!(header(&r, "ratelimit"), Some(expected.as_str()));
}

#[tokio::test]
async fn degrade_and_shadow_rules_never_deny() {
    let mut s = start(CONFIG).await;
    let r = s.one(&[("client", "c1")]).await;
    assert_eq!(code(r.overall_code), Code::Ok);
    assert!(r.request_headers_to_add.is_empty());
    // Over the degrade rule, with another descriptor that is under its
    // limit: allowed, marked, and the other one is charged.
    let r = s
        .ask(request(
            DOMAIN,
            vec![descriptor(&[("client", "c1")]), descriptor(IP)],
        ))
        .await;
    assert_eq!(code(r.overall_code), Code::Ok);
    assert_eq!(code(r.statuses[0].code), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert_eq!(r.statuses[1].limit_remaining, 2);
    let mark = r
        .request_headers_to_add
        .iter()
        .find(|h| h.key == "x-spillway-limited")
        .expect("the request is marked");
    assert_eq!(mark.value, "soft");
    assert_eq!(header(&r, "x-spillway-limited"), Some("soft"));

    // Shadow: only reported (in the log).
    s.one(&[("tenant", "t")]).await;
    let r = s.one(&[("tenant", "t")]).await;
    assert_eq!(code(r.overall_code), Code::Ok);
    assert!(r.request_headers_to_add.is_empty());
}

#[tokio::test]
async fn a_fail_closed_store_that_cannot_answer_is_unavailable() {
    let Some(mut redis) = spillway_conformance::redis_server::RedisServer::start() else {
        return;
    };
    let text = format!(
        "{CONFIG}\n[store]\nkind = \"redis\"\nurl = \"{}\"\non_error = \"fail_closed\"\n",
        redis.url()
    );
    let config = Config::parse(&text).expect("a valid configuration");
    let engine = Loaded::build(config, None, None).await.expect("connected");
    let mut s = start_engine(engine).await;
    let r = s.one(IP).await;
    assert_eq!(r.statuses[0].limit_remaining, 2);

    redis.kill();
    let e = s
        .client
        .should_rate_limit(request(DOMAIN, vec![descriptor(IP)]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
}

#[tokio::test]
async fn decisions_over_grpc_are_counted_in_the_metrics() {
    use spillway_server::State;
    clock_support::clear_of_a_minute_boundary();
    let state = State::new(Config::parse(CONFIG).unwrap()).await.unwrap();
    let shared = state.live.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(spillway_server::envoy::serve(listener, shared, async {
        let _ = stopped.await;
    }));
    let mut client = grpc_support::connect(addr).await;
    for _ in 0..4 {
        client
            .should_rate_limit(request(
                DOMAIN,
                vec![descriptor(&[("remote_address", "10.9.9.9")])],
            ))
            .await
            .unwrap();
    }
    let text = state.metrics.encode(state.live.current().store());
    let count = |outcome: &str| -> f64 {
        text.lines()
            .find(|l| {
                l.starts_with("spillway_decisions_total{")
                    && l.contains("rule=\"per-ip\"")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    // per-ip admits 3 a minute.
    assert_eq!((count("allowed"), count("rejected")), (3.0, 1.0), "{text}");
}

/// A calendar month is told to Envoy as a limit per MONTH, and the time
/// left as the time to the first of the next month in the rule's zone.
#[tokio::test]
async fn a_calendar_month_is_a_limit_per_month() {
    let mut s = start(
        "[envoy]\ndomain = \"spillway\"\n[[rules]]\nname = \"plan\"\nalgorithm = \"fixed_window\"\n\
         limit = 1000\nwindow = \"calendar_month\"\ntime_zone = \"Asia/Tokyo\"\ndescriptors = [\"user\"]\n",
    )
    .await;
    let r = s.one(&[("user", "ann")]).await;
    let status = &r.statuses[0];
    let limit = status.current_limit.as_ref().expect("a limit");
    assert_eq!((limit.requests_per_unit, limit.unit()), (1000, Unit::Month));
    assert_eq!(status.limit_remaining, 999);
    // Up to 31 days, and more than 0.
    let left = until_reset(status);
    assert!(
        left > Duration::ZERO && left <= Duration::from_secs(31 * 86_400),
        "{left:?}"
    );
}

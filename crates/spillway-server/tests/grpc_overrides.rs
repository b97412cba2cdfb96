//! The Envoy service's limit override slots (issue 25, finding 10): once
//! `MAX_LIMIT_OVERRIDES` are counted, a new override takes the slot of the
//! least recently used one that no call has brought for longer than its
//! unit, and is refused only while every slot is in use. The busy
//! overrides keep their counts.
//!
//! The service is called as tonic calls it, on tokio's paused clock: the
//! slots' last use is on that clock, so `advance` makes an override idle
//! without a real wait (the store's counts are on the wall clock, which the
//! test keeps clear of a minute's end).

mod clock_support;
mod grpc_support;

use std::sync::Arc;
use std::time::Duration;

use grpc_support::{code, descriptor, request};
use spillway::store::Store as _;
use spillway_server::config::{Config, DEFAULT_MAX_MEMORY};
use spillway_server::envoy::EnvoyRateLimiter;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use spillway_server::envoy::rls::RateLimitResponse;
use spillway_server::envoy::rls::rate_limit_response::Code;
use spillway_server::envoy::rls::rate_limit_service_server::RateLimitService;
use spillway_server::state::{Live, Loaded, MAX_LIMIT_OVERRIDES};

/// One configured rule, by `remote_address`, so that the policy's rules
/// come before the overrides' in the store.
const CONFIG: &str = r#"
[envoy]
domain = "spillway"

[[rules]]
name = "per-ip"
algorithm = "fixed_window"
limit = 3
window = "1m"
descriptors = ["remote_address"]
"#;

// envoy.type.v3.RateLimitUnit
const SECOND: i32 = 1;
const MINUTE: i32 = 2;

/// The service, with the engine it swaps on each new override.
struct Service {
    service: EnvoyRateLimiter,
    shared: Arc<Live>,
}

async fn start() -> Service {
    clock_support::clear_of_a_minute_boundary();
    let config = Config::parse(CONFIG).expect("a valid configuration");
    let shared = Arc::new(Live::new(
        Loaded::build(config, None, None).await.expect("an engine"),
    ));
    Service {
        service: EnvoyRateLimiter::new(shared.clone()),
        shared,
    }
}

/// A descriptor of user `user` that brings `requests_per_unit` per `unit`,
/// charging `cost`.
fn with_limit(user: &str, requests_per_unit: u32, unit: i32, cost: u32) -> RateLimitDescriptor {
    RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit,
            unit,
        }),
        hits_addend: Some(u64::from(cost)),
        ..descriptor(&[("user", user)])
    }
}

impl Service {
    /// Calls the service with one descriptor.
    async fn call(&self, d: RateLimitDescriptor) -> Result<RateLimitResponse, tonic::Status> {
        self.service
            .should_rate_limit(tonic::Request::new(request("spillway", vec![d])))
            .await
            .map(tonic::Response::into_inner)
    }

    /// Charges user `user` once under `per_minute` a minute: what is left.
    async fn charge(&self, user: &str, per_minute: u32) -> u32 {
        let r = self
            .call(with_limit(user, per_minute, MINUTE, 1))
            .await
            .expect("counted");
        assert_eq!(code(r.overall_code), Code::Ok, "{per_minute} a minute");
        r.statuses[0].limit_remaining
    }

    /// What user `user` has left under `per_minute` a minute, by a call
    /// that charges nothing (which is a use of the override all the same).
    async fn left(&self, user: &str, per_minute: u32) -> u32 {
        let r = self
            .call(with_limit(user, per_minute, MINUTE, 0))
            .await
            .expect("counted");
        r.statuses[0].limit_remaining
    }

    /// One request of the configured per-IP rule, for 10.0.0.1.
    async fn per_ip(&self) -> RateLimitResponse {
        self.call(descriptor(&[("remote_address", "10.0.0.1")]))
            .await
            .expect("an answer")
    }

    /// Whether override `name` (`envoy-override:5-per-minute`) is counted.
    fn counts(&self, name: &str) -> bool {
        self.shared.current().override_named(name).is_some()
    }
}

/// The error a call with a new override gets when no slot is free.
async fn refused(s: &Service, d: RateLimitDescriptor) {
    let e = s.call(d).await.expect_err("no slot for it");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
}

/// 63 overrides of `2..=64` a minute and one of a request a second fill the
/// slots; a 65th is refused while every slot has been used within its
/// unit. Once the one-second override has gone unused for longer than a
/// second, a new override takes its slot, and every minute override keeps
/// the count it had.
#[tokio::test(start_paused = true)]
async fn an_idle_slot_goes_to_a_new_override_and_the_busy_keep_their_counts() {
    let s = start().await;
    let n = u32::try_from(MAX_LIMIT_OVERRIDES).unwrap();
    let r = s
        .call(with_limit("ann", 1, SECOND, 1))
        .await
        .expect("counted");
    assert_eq!(code(r.overall_code), Code::Ok);
    for per_minute in 2..=n {
        assert_eq!(s.charge("ann", per_minute).await, per_minute - 1);
    }
    // A second charge on one of them, and the configured rule's count.
    assert_eq!(s.charge("ann", 3).await, 1);
    let r = s.per_ip().await;
    assert_eq!(r.statuses[0].limit_remaining, 2);

    // 65 rules share the default max_memory: the store stays within it,
    // each table made smaller as the next override arrived.
    let bytes = s.shared.current().store().memory().unwrap().memory_bytes();
    assert!(bytes <= DEFAULT_MAX_MEMORY.get(), "{bytes} bytes");

    // Every slot in use: refused, even half a second later.
    refused(&s, with_limit("ann", n + 1, MINUTE, 1)).await;
    tokio::time::advance(Duration::from_millis(500)).await;
    refused(&s, with_limit("ann", n + 1, MINUTE, 1)).await;

    // A second and a half after its last use, the one-second override is
    // idle; the minute ones are not (used 1.5 s ago).
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(s.charge("ann", n + 1).await, n, "counted in the idle slot");
    assert!(s.counts(&format!("envoy-override:{}-per-minute", n + 1)));
    assert!(
        !s.counts("envoy-override:1-per-second"),
        "its slot was given"
    );
    assert_eq!(
        s.shared.current().store().rules().len(),
        1 + MAX_LIMIT_OVERRIDES,
        "still 64 override rules"
    );

    // The busy ones kept their counts (and the configured rule its own).
    for per_minute in 2..=n {
        let spent = if per_minute == 3 { 2 } else { 1 };
        assert_eq!(
            s.left("ann", per_minute).await,
            per_minute - spent,
            "{per_minute} a minute"
        );
    }
    assert_eq!(s.charge("ann", 3).await, 0);
    assert_eq!(
        code(
            s.call(with_limit("ann", 3, MINUTE, 1))
                .await
                .expect("counted")
                .overall_code
        ),
        Code::OverLimit,
        "3 a minute, spent"
    );
    let r = s.per_ip().await;
    assert_eq!(r.statuses[0].limit_remaining, 1, "per-ip kept its count");

    // And again no slot is idle: the one-second override, back, is refused.
    refused(&s, with_limit("ann", 1, SECOND, 1)).await;
}

/// With every slot idle past its unit, a new override takes the least
/// recently used one's, then the next's; a slot used since it went idle is
/// in use again, and a call's own overrides are never the ones it gives
/// away.
#[tokio::test(start_paused = true)]
async fn the_least_recently_used_idle_slot_goes_first() {
    let s = start().await;
    let n = u32::try_from(MAX_LIMIT_OVERRIDES).unwrap();
    // 1..=64 a minute, at 0 s; then 1 and 2 used again, at 10 s and 20 s.
    for per_minute in 1..=n {
        s.charge("bob", per_minute).await;
    }
    tokio::time::advance(Duration::from_secs(10)).await;
    s.left("bob", 2).await;
    tokio::time::advance(Duration::from_secs(10)).await;
    s.left("bob", 1).await;

    // At 70 s, 3..=64 are idle (70 s unused); 1 and 2 are not.
    tokio::time::advance(Duration::from_secs(50)).await;
    // 3..=64 are all as old: one of them goes, not 1 or 2.
    s.charge("bob", 100).await;
    assert!(s.counts("envoy-override:1-per-minute"));
    assert!(s.counts("envoy-override:2-per-minute"));
    let gone: Vec<u32> = (3..=n)
        .filter(|p| !s.counts(&format!("envoy-override:{p}-per-minute")))
        .collect();
    assert_eq!(gone.len(), 1, "{gone:?}");
    // Using the other 61 now leaves 2 (idle since 10 s) the least recently
    // used idle slot at 81 s, then 1 (idle since 20 s).
    for per_minute in (3..=n).filter(|p| !gone.contains(p)) {
        s.left("bob", per_minute).await;
    }
    tokio::time::advance(Duration::from_secs(11)).await;
    // A call bringing 1 a minute beside a new one: 1 is marked used by the
    // call, so 2 goes, then nothing else can.
    let r = s
        .service
        .should_rate_limit(tonic::Request::new(request(
            "spillway",
            vec![
                with_limit("bob", 1, MINUTE, 0),
                with_limit("bob", 101, MINUTE, 1),
            ],
        )))
        .await
        .expect("counted")
        .into_inner();
    assert_eq!(code(r.overall_code), Code::Ok);
    assert_eq!(
        r.statuses[0].limit_remaining, 0,
        "1 a minute kept its count"
    );
    assert_eq!(r.statuses[1].limit_remaining, 100);
    assert!(s.counts("envoy-override:1-per-minute"));
    assert!(!s.counts("envoy-override:2-per-minute"), "the oldest idle");
    refused(&s, with_limit("bob", 102, MINUTE, 1)).await;
}

#[tokio::test]
async fn an_overrides_counts_and_a_tier_added_meanwhile_survive_a_restart_with_a_state_file() {
    // A memory store with `[store] state_file`: the counts of a limit
    // Envoy sent (a store rule made when first met) come back, as do the
    // configured rule's; and a tier the new configuration adds takes the
    // override set at run time on its rule.
    async fn call(service: &EnvoyRateLimiter, d: RateLimitDescriptor) -> RateLimitResponse {
        let request = tonic::Request::new(request("spillway", vec![d]));
        service
            .should_rate_limit(request)
            .await
            .unwrap()
            .into_inner()
    }
    clock_support::clear_of_a_minute_boundary();
    let dir = std::env::temp_dir().join(format!("spillway-grpc-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = |tier: &str| {
        let text = format!(
            "[store]\nstate_file = \"state\"\n{CONFIG}{tier}\
             [[rules]]\nname = \"per-key\"\nalgorithm = \"fixed_window\"\nlimit = 100\n\
             window = \"1h\"\nkey = [\"api_key\"]\nfallback = []\n{}",
            if tier.is_empty() {
                ""
            } else {
                "[rules.tiers.gold]\nlimit = 1000\n"
            }
        );
        Config::parse_in(&text, &dir).expect("a valid configuration")
    };
    let first = spillway_server::State::new(config("")).await.unwrap();
    let snapshots = first.snapshots().expect("a state file");
    let service = EnvoyRateLimiter::new(first.live.clone());
    let remaining = |r: RateLimitResponse| r.statuses[0].limit_remaining;
    for _ in 0..3 {
        call(&service, with_limit("u", 5, MINUTE, 1)).await;
    }
    call(&service, descriptor(&[("remote_address", "10.0.0.1")])).await;
    let store = first.live.current().store().clone();
    let per_key = first.live.current().config.policy.rule_id(1, None);
    store
        .set_override(
            per_key,
            spillway::store::Target::Key("api_key=acme".into()),
            spillway::store::OverrideEntry {
                applied: spillway::store::Override::limit(7),
                spec: "{}".into(),
            },
        )
        .await
        .unwrap();
    snapshots.finish().await;
    drop((service, store, first));

    let tiers = "[tiers.gold]\napi_keys = [\"gold-key\"]\n";
    let second = spillway_server::State::new(config(tiers)).await.unwrap();
    let service = EnvoyRateLimiter::new(second.live.clone());
    assert_eq!(
        remaining(call(&service, with_limit("u", 5, MINUTE, 1)).await),
        1
    );
    assert_eq!(
        remaining(call(&service, descriptor(&[("remote_address", "10.0.0.1")])).await),
        1
    );
    let loaded = second.live.current();
    let gold = loaded.config.policy.rule_id(1, Some("gold"));
    let name = loaded.store().rules()[gold.0].name().to_string();
    let book = loaded.store().overrides().await.unwrap();
    assert!(
        book.get(&name, &spillway::store::Target::Key("api_key=acme".into()))
            .is_some(),
        "the tier added while the process was down has no override"
    );
    drop((service, loaded, second));
    std::fs::remove_dir_all(&dir).unwrap();
}

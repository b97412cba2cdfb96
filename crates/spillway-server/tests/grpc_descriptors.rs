//! envoyproxy/ratelimit's YAML descriptor file (`[envoy] descriptors_file`)
//! as a rule source, end to end: the real service (`run()`, HTTP and gRPC on
//! port 0) called by a tonic client; the configuration errors; reload; the
//! same rules on Redis; `spillway check-config`.

mod clock_support;
mod grpc_support;
mod serve_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use grpc_support::{code, descriptor, request};
use serde_json::json;
use serve_support::{Http, metric_value, temp_dir, write_atomically};
use spillway_server::config::{Config, ConfigError};
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use spillway_server::envoy::rls::rate_limit_response::rate_limit::Unit;
use spillway_server::envoy::rls::rate_limit_response::{Code, DescriptorStatus};
use spillway_server::envoy::rls::rate_limit_service_client::RateLimitServiceClient;
use spillway_server::envoy::rls::{RateLimitRequest, RateLimitResponse};
use spillway_server::reload::Reloader;
use spillway_server::{ConfigSource, State};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// The rate limit domain the tests' configuration answers.
const DOMAIN: &str = "edge";

/// The TOML file: one rule of its own, reached by its `descriptors` keys,
/// and the descriptor file, which also sets the domain.
const TOML: &str = r#"
[envoy]
descriptors_file = "limits.yaml"

[[rules]]
name = "per-user"
algorithm = "token_bucket"
limit = 10
window = "1m"
descriptors = ["user"]
"#;

/// The descriptor file, in the `edge` domain:
/// - `remote_address`: 3 a minute per address (any value);
/// - `path=/login` then `remote_address`: 2 a minute per address;
///   `path=/login` alone has no limit;
/// - `path=/static/...` (a prefix): unlimited;
/// - `tenant=gold`: 5 a minute; any other tenant: 1 a minute each;
/// - `plan=trial`: 1 an hour, in shadow mode;
/// - `health`: unlimited;
/// - `org` then `team=core`: 4 a week, named `core-team`.
const YAML: &str = "\
domain: edge
descriptors:
  - key: remote_address
    rate_limit:
      unit: minute
      requests_per_unit: 3
  - key: path
    value: /login
    descriptors:
      - key: remote_address
        rate_limit: { unit: MINUTE, requests_per_unit: 2 }
  - key: path
    value: /static/*
    rate_limit: { unlimited: true }
  - key: tenant
    value: gold
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: tenant
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: plan
    value: trial
    shadow_mode: true
    detailed_metric: true
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: health
    rate_limit:
      unlimited: true
  - key: org
    descriptors:
      - key: team
        value: core
        rate_limit: { name: core-team, unit: week, requests_per_unit: 4 }
";

/// A running service (HTTP and gRPC); stops when dropped.
struct Server {
    grpc: RateLimitServiceClient<Channel>,
    http: Http,
    state: State,
    _stop: oneshot::Sender<()>,
}

/// Writes `spillway.toml` and `limits.yaml` into a fresh directory.
fn files(name: &str, toml: &str, yaml: &str) -> PathBuf {
    let dir = temp_dir(name);
    write_atomically(&dir.join("spillway.toml"), toml);
    write_atomically(&dir.join("limits.yaml"), yaml);
    dir
}

async fn start(dir: &Path) -> Server {
    let source = ConfigSource::from(dir.join("spillway.toml"));
    let config = source.load().expect("a valid configuration");
    let state = State::new(config).await.expect("the store starts");
    start_with(state, Some(source)).await
}

async fn start_with(state: State, source: Option<ConfigSource>) -> Server {
    clock_support::clear_of_a_minute_boundary();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (http, grpc) = (
        listener.local_addr().unwrap(),
        grpc_listener.local_addr().unwrap(),
    );
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(spillway_server::run(
        listener,
        Some(grpc_listener),
        state.clone(),
        source,
        async {
            let _ = stopped.await;
        },
    ));
    let client = grpc_support::connect(grpc).await;
    Server {
        grpc: client,
        http: Http::new(http),
        state,
        _stop: stop,
    }
}

impl Server {
    async fn ask(&mut self, request: RateLimitRequest) -> RateLimitResponse {
        grpc_support::ask(&mut self.grpc, request).await
    }

    async fn one(&mut self, entries: &[(&str, &str)]) -> RateLimitResponse {
        self.ask(request(DOMAIN, vec![descriptor(entries)])).await
    }

    /// Asks `times` times for one descriptor: how many were OK.
    async fn admitted(&mut self, entries: &[(&str, &str)], times: usize) -> usize {
        let mut ok = 0;
        for _ in 0..times {
            if code(self.one(entries).await.overall_code) == Code::Ok {
                ok += 1;
            }
        }
        ok
    }
}

fn limit(s: &DescriptorStatus) -> (&str, u32, Unit) {
    let l = s.current_limit.as_ref().expect("a current limit");
    (l.name.as_str(), l.requests_per_unit, l.unit())
}

const IP: &[(&str, &str)] = &[("remote_address", "10.0.0.1")];

#[tokio::test]
async fn a_key_without_value_counts_each_value_on_its_own() {
    let dir = files("yaml-any-value", TOML, YAML);
    let mut s = start(&dir).await;
    for remaining in [2, 1, 0] {
        let r = s.one(IP).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(r.statuses[0].limit_remaining, remaining);
        assert_eq!(
            limit(&r.statuses[0]),
            ("remote_address", 3, Unit::Minute),
            "the limit as the file states it"
        );
    }
    let r = s.one(IP).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(code(r.statuses[0].code), Code::OverLimit);
    // Another address: its own counter.
    assert_eq!(s.admitted(&[("remote_address", "10.0.0.2")], 5).await, 3);
}

#[tokio::test]
async fn nested_nodes_apply_the_last_entrys_limit() {
    let dir = files("yaml-nested", TOML, YAML);
    let mut s = start(&dir).await;
    let login = &[("path", "/login"), ("remote_address", "10.0.0.1")];
    let r = s.one(login).await;
    assert_eq!(
        limit(&r.statuses[0]),
        ("path_/login.remote_address", 2, Unit::Minute)
    );
    assert_eq!(s.admitted(login, 4).await, 1, "2 a minute in all");
    // Its own counter, not the one of `remote_address` alone.
    assert_eq!(s.admitted(IP, 5).await, 3);
    // The first level of the walk has no limit of its own...
    for _ in 0..5 {
        let r = s.one(&[("path", "/login")]).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(r.statuses[0].current_limit, None);
    }
    // ... and a value the tree does not know reaches nothing.
    let other = &[("path", "/other"), ("remote_address", "10.0.0.1")];
    assert_eq!(s.admitted(other, 5).await, 5);
    assert_eq!(s.one(other).await.statuses[0].current_limit, None);
    // Nor does a walk longer than the tree.
    let deeper = &[
        ("path", "/login"),
        ("remote_address", "10.0.0.1"),
        ("user", "ann"),
    ];
    assert_eq!(s.admitted(deeper, 5).await, 5);
}

#[tokio::test]
async fn a_value_node_wins_over_the_wildcard_and_prefixes_match() {
    let dir = files("yaml-values", TOML, YAML);
    let mut s = start(&dir).await;
    assert_eq!(s.admitted(&[("tenant", "gold")], 8).await, 5);
    // Any other tenant: 1 a minute each.
    assert_eq!(s.admitted(&[("tenant", "silver")], 3).await, 1);
    assert_eq!(s.admitted(&[("tenant", "bronze")], 3).await, 1);
    let r = s.one(&[("tenant", "silver")]).await;
    assert_eq!(limit(&r.statuses[0]), ("tenant", 1, Unit::Minute));
    // `/static/*`: every path under it is unlimited.
    for path in ["/static/app.js", "/static/"] {
        for _ in 0..5 {
            let r = s.one(&[("path", path)]).await;
            assert_eq!(code(r.overall_code), Code::Ok);
            assert_eq!(r.statuses[0].current_limit, None);
            assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
        }
    }
    // A week is reported per day (the API knows no week): 4 a week is
    // less than 1 a day, so 1.
    let r = s.one(&[("org", "acme"), ("team", "core")]).await;
    assert_eq!(limit(&r.statuses[0]), ("core-team", 1, Unit::Day));
    assert_eq!(r.statuses[0].limit_remaining, 3);
}

#[tokio::test]
async fn unlimited_is_ok_without_counting_and_shadow_mode_never_denies() {
    let dir = files("yaml-unlimited-shadow", TOML, YAML);
    let mut s = start(&dir).await;
    for _ in 0..10 {
        let r = s.one(&[("health", "probe")]).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(r.statuses[0].current_limit, None);
        assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
        assert!(r.response_headers_to_add.is_empty());
    }

    // Shadow mode: counted (remaining 0), but OK; the other descriptor of
    // the same call is charged.
    let trial = &[("plan", "trial")];
    let r = s.one(trial).await;
    assert_eq!(limit(&r.statuses[0]), ("plan_trial", 1, Unit::Hour));
    assert_eq!(r.statuses[0].limit_remaining, 0);
    for charged in 1..=3 {
        let r = s
            .ask(request(DOMAIN, vec![descriptor(trial), descriptor(IP)]))
            .await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(code(r.statuses[0].code), Code::Ok);
        assert_eq!(r.statuses[1].limit_remaining, 3 - charged);
    }
    let metrics = s.state.metrics.encode(s.state.live.current().store());
    assert_eq!(
        metric_value(
            &metrics,
            "spillway_decisions_total{rule=\"plan_trial\",outcome=\"shadowed\"}"
        ),
        Some(3.0),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_files_rules_are_rules_like_the_others() {
    let dir = files("yaml-rules", TOML, YAML);
    let mut s = start(&dir).await;
    // The TOML rule is reached by its keys, in the file's domain.
    let r = s.one(&[("user", "ann")]).await;
    assert_eq!(r.statuses[0].limit_remaining, 9);
    assert_eq!(limit(&r.statuses[0]).0, "per-user");
    // Another domain limits nothing.
    let r = s
        .ask(RateLimitRequest {
            domain: "spillway".into(),
            ..request(DOMAIN, vec![descriptor(IP)])
        })
        .await;
    assert_eq!(r.statuses[0].current_limit, None);

    // `POST /v1/check` by rule name shares Envoy's counter...
    assert_eq!(s.one(IP).await.statuses[0].limit_remaining, 2);
    let v = s
        .http
        .check(json!({"rule": "remote_address", "key": "remote_address=10.0.0.1"}))
        .await
        .json();
    assert_eq!(v["rules"][0]["remaining"], 1, "{v}");
    assert_eq!(s.one(IP).await.statuses[0].limit_remaining, 0);
    // ... but HTTP requests never meet the file's rules: they are Envoy's.
    // (The TOML rule, keyed by IP when a request is HTTP, applies.)
    let v = s
        .http
        .check(json!({"method": "GET", "path": "/login", "ip": "10.0.0.1"}))
        .await
        .json();
    let rules: Vec<&str> = v["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .map(|r| r["rule"].as_str().expect("a name"))
        .collect();
    assert_eq!(rules, ["per-user"], "{v}");
    // /metrics names them.
    let metrics = s.http.get("/metrics").await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "spillway_decisions_total{rule=\"remote_address\",outcome=\"allowed\"}"
        ),
        Some(3.0),
        "{metrics}"
    );
}

#[tokio::test]
async fn replaces_drops_the_named_limit_when_both_are_reached() {
    let yaml = "\
domain: edge
descriptors:
  - key: client
    rate_limit: { name: per-client, unit: minute, requests_per_unit: 1 }
  - key: vip
    rate_limit:
      unit: minute
      requests_per_unit: 3
      replaces:
        - name: per-client
";
    let dir = files("yaml-replaces", TOML, yaml);
    let mut s = start(&dir).await;
    let both = || {
        request(
            DOMAIN,
            vec![
                descriptor(&[("client", "c")]),
                descriptor(&[("vip", "yes")]),
            ],
        )
    };
    for remaining in [2, 1, 0] {
        let r = s.ask(both()).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(r.statuses[0].current_limit, None, "replaced");
        assert_eq!(r.statuses[1].limit_remaining, remaining);
    }
    assert_eq!(code(s.ask(both()).await.overall_code), Code::OverLimit);
    // Alone, `per-client` applies, and was never charged.
    assert_eq!(s.admitted(&[("client", "c")], 3).await, 1);
}

/// A descriptor of these entries that brings its own limit.
fn with_limit(entries: &[(&str, &str)], requests_per_unit: u32, unit: i32) -> RateLimitDescriptor {
    RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit,
            unit,
        }),
        ..descriptor(entries)
    }
}

const MINUTE: i32 = 2; // envoy.type.v3.RateLimitUnit

impl Server {
    /// Asks `times` times for these descriptors: how many were OK.
    async fn admitted_all(&mut self, descriptors: &[RateLimitDescriptor], times: usize) -> usize {
        let mut ok = 0;
        for _ in 0..times {
            let r = self.ask(request(DOMAIN, descriptors.to_vec())).await;
            ok += usize::from(code(r.overall_code) == Code::Ok);
        }
        ok
    }
}

#[tokio::test]
async fn a_limit_override_replaces_the_configured_limit() {
    let dir = files("yaml-override", TOML, YAML);
    let mut s = start(&dir).await;
    // remote_address is 3 a minute in the file; this one says 2.
    let two = with_limit(IP, 2, MINUTE);
    for remaining in [1, 0] {
        let r = s.ask(request(DOMAIN, vec![two.clone()])).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(r.statuses[0].limit_remaining, remaining);
        assert_eq!(
            limit(&r.statuses[0]),
            ("envoy-override:2-per-minute", 2, Unit::Minute)
        );
        let reset = r.statuses[0].duration_until_reset.expect("a reset");
        assert!(
            reset.seconds <= 60 && (reset.seconds, reset.nanos) > (0, 0),
            "{reset:?}"
        );
    }
    let r = s.ask(request(DOMAIN, vec![two.clone()])).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(code(r.statuses[0].code), Code::OverLimit);
    let retry = r
        .response_headers_to_add
        .iter()
        .find(|h| h.key == "retry-after")
        .expect("a Retry-After");
    assert!(
        retry
            .value
            .parse::<u64>()
            .is_ok_and(|s| (1..=60).contains(&s)),
        "{retry:?}"
    );
    // The configured limit of the same descriptor was not charged.
    assert_eq!(s.admitted(IP, 4).await, 3);
    // Another value of the override is counted on its own.
    assert_eq!(s.admitted_all(&[with_limit(IP, 5, MINUTE)], 6).await, 5);
    // A descriptor no rule reaches is limited by its override alone (a
    // minute's, which the start keeps clear of a boundary; a second's
    // window could turn between the three calls).
    let unconfigured = with_limit(&[("anything", "x")], 1, MINUTE);
    assert_eq!(s.admitted_all(&[unconfigured], 3).await, 1);

    let metrics = s.state.metrics.encode(s.state.live.current().store());
    let series = |rule: &str, outcome: &str| {
        metric_value(
            &metrics,
            &format!("spillway_decisions_total{{rule=\"{rule}\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(
        series("envoy-override:2-per-minute", "allowed"),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(
        series("envoy-override:2-per-minute", "rejected"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        series("envoy-override:1-per-minute", "rejected"),
        Some(2.0),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_admin_api_reads_and_resets_an_override() {
    let toml = format!("[server]\nadmin_token = \"t\"\n{TOML}");
    let dir = files("yaml-override-admin", &toml, YAML);
    let mut s = start(&dir).await;
    let auth = [("authorization", "Bearer t")];
    let path = "/admin/rules/envoy-override:2-per-minute/keys/remote_address=10.0.0.1";
    // Not counted yet: no such rule.
    let a = s.http.send(http::Method::GET, path, &auth, "").await;
    assert_eq!(a.status, http::StatusCode::NOT_FOUND, "{}", a.text());

    let two = [with_limit(IP, 2, MINUTE)];
    assert_eq!(s.admitted_all(&two, 3).await, 2);
    let a = s.http.send(http::Method::GET, path, &auth, "").await;
    assert_eq!(a.status, http::StatusCode::OK, "{}", a.text());
    let v = a.json();
    assert_eq!(v["quotas"][0]["store_rule"], "envoy-override:2-per-minute");
    assert_eq!(
        (
            v["quotas"][0]["limit"].as_u64(),
            v["quotas"][0]["remaining"].as_u64()
        ),
        (Some(2), Some(0))
    );

    let a = s.http.send(http::Method::DELETE, path, &auth, "").await;
    assert_eq!(a.status, http::StatusCode::OK, "{}", a.text());
    assert_eq!(a.json()["held"], true);
    assert_eq!(s.admitted_all(&two, 3).await, 2, "counted afresh");

    // The configuration's last rule has its one quota, not the override's
    // store rule, which follows it in the store.
    let last = "/admin/rules/core-team/keys/org=a|team=core";
    let a = s.http.send(http::Method::GET, last, &auth, "").await;
    assert_eq!(a.status, http::StatusCode::OK, "{}", a.text());
    let quotas = a.json()["quotas"].as_array().expect("quotas").clone();
    assert_eq!(quotas.len(), 1, "{quotas:?}");
    assert_eq!(quotas[0]["store_rule"], "core-team");
}

#[tokio::test]
async fn an_override_is_decided_with_the_requests_other_descriptors() {
    let dir = files("yaml-override-atomic", TOML, YAML);
    let mut s = start(&dir).await;
    let both = [with_limit(&[("user", "ann")], 2, MINUTE), descriptor(IP)];
    assert_eq!(s.admitted_all(&both, 2).await, 2);
    // The override is spent: the request is denied, and remote_address
    // (3 a minute, 1 left) is not charged for it.
    let r = s.ask(request(DOMAIN, both.to_vec())).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(code(r.statuses[0].code), Code::OverLimit);
    assert_eq!(code(r.statuses[1].code), Code::Ok);
    assert_eq!(r.statuses[1].limit_remaining, 1);
    assert_eq!(s.admitted(IP, 2).await, 1);
}

#[tokio::test]
async fn a_zero_override_is_over_limit_and_a_bad_unit_is_refused() {
    let dir = files("yaml-override-zero", TOML, YAML);
    let mut s = start(&dir).await;
    let r = s
        .ask(request(
            DOMAIN,
            vec![with_limit(&[("user", "ann")], 0, MINUTE), descriptor(IP)],
        ))
        .await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    assert_eq!(code(r.statuses[0].code), Code::OverLimit);
    assert_eq!(
        limit(&r.statuses[0]),
        ("envoy-override:0-per-minute", 0, Unit::Minute)
    );
    // Nothing charged: remote_address still has all 3.
    assert_eq!(r.statuses[1].limit_remaining, 3);
    assert_eq!(s.admitted(IP, 4).await, 3);

    // WEEK (7) and YEAR (6) are units too.
    for (unit, name) in [
        (7, "envoy-override:1-per-week"),
        (6, "envoy-override:1-per-year"),
    ] {
        let weekly = [with_limit(&[("user", name)], 1, unit)];
        let r = s.ask(request(DOMAIN, weekly.to_vec())).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert_eq!(
            r.statuses[0]
                .current_limit
                .as_ref()
                .map(|l| l.name.as_str()),
            Some(name)
        );
        assert_eq!(s.admitted_all(&weekly, 2).await, 0, "1 a {name}");
    }
    for unit in [0, 8, -1] {
        let e = s
            .grpc
            .should_rate_limit(request(DOMAIN, vec![with_limit(IP, 5, unit)]))
            .await
            .expect_err("no such unit");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("unit"), "{e:?}");
    }
    // Another domain's descriptors are not looked at, overrides included.
    let r = s.ask(request("other", vec![with_limit(IP, 0, 0)])).await;
    assert_eq!(code(r.overall_code), Code::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_overrides_arriving_together_are_all_counted_exactly() {
    let dir = files("yaml-override-race", TOML, YAML);
    let s = start(&dir).await;
    // 16 clients at once, each bringing two overrides no call has brought
    // yet: 4 a minute for everyone, and one of its own (10 + i).
    let mut tasks = Vec::new();
    for i in 0..16u32 {
        let mut grpc = s.grpc.clone();
        tasks.push(tokio::spawn(async move {
            let mut shared_ok = 0;
            for _ in 0..2 {
                let r = grpc_support::ask(
                    &mut grpc,
                    request(DOMAIN, vec![with_limit(&[("user", "all")], 4, MINUTE)]),
                )
                .await;
                shared_ok += usize::from(code(r.overall_code) == Code::Ok);
                let own = grpc_support::ask(
                    &mut grpc,
                    request(
                        DOMAIN,
                        vec![with_limit(&[("user", &i.to_string())], 10 + i, MINUTE)],
                    ),
                )
                .await;
                assert_eq!(code(own.overall_code), Code::Ok);
            }
            shared_ok
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, 4, "4 a minute, shared by all");
    // Every override has its rule, with its own count (2 of 10 + i used).
    let engine = s.state.live.current();
    for i in 0..16u32 {
        let limit = spillway_server::config::descriptors::UnitLimit {
            requests_per_unit: std::num::NonZeroU32::new(10 + i).unwrap(),
            unit: spillway_server::config::descriptors::Unit::Minute,
        };
        assert!(engine.override_id(limit).is_some(), "override {}", 10 + i);
    }
    let mut s = s;
    let r = s
        .ask(request(
            DOMAIN,
            vec![with_limit(&[("user", "3")], 13, MINUTE)],
        ))
        .await;
    assert_eq!(r.statuses[0].limit_remaining, 10);
}

#[tokio::test]
async fn overrides_are_bounded_and_survive_a_reload() {
    let dir = files("yaml-override-bound", TOML, YAML);
    let mut s = start(&dir).await;
    let max = spillway_server::state::MAX_LIMIT_OVERRIDES;
    let n = u32::try_from(max).unwrap();
    for per_unit in 1..=n {
        let r = s
            .ask(request(DOMAIN, vec![with_limit(IP, per_unit, MINUTE)]))
            .await;
        assert_eq!(code(r.overall_code), Code::Ok, "override {per_unit}");
    }
    let e = s
        .grpc
        .should_rate_limit(request(DOMAIN, vec![with_limit(IP, n + 1, MINUTE)]))
        .await
        .expect_err("one too many");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    // Those already counted still are.
    let r = s
        .ask(request(DOMAIN, vec![with_limit(IP, 3, MINUTE)]))
        .await;
    assert_eq!(r.statuses[0].limit_remaining, 1);

    // A reload keeps them, and their counts.
    let mut reloader = Reloader::new(
        s.state.clone(),
        Some(ConfigSource::from(dir.join("spillway.toml"))),
    )
    .expect("a reloader");
    reloader.reload().await.expect("reloaded");
    let r = s
        .ask(request(DOMAIN, vec![with_limit(IP, 3, MINUTE)]))
        .await;
    assert_eq!(code(r.overall_code), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert_eq!(
        code(
            s.ask(request(DOMAIN, vec![with_limit(IP, 3, MINUTE)]))
                .await
                .overall_code
        ),
        Code::OverLimit
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reads_the_descriptor_file_again() {
    let dir = files("yaml-reload", TOML, YAML);
    let mut s = start(&dir).await;
    assert_eq!(s.admitted(IP, 2).await, 2);
    assert_eq!(s.admitted(&[("tenant", "gold")], 1).await, 1);

    // Gold gets 10; remote_address is unchanged.
    let v2 = YAML.replace(
        "value: gold\n    rate_limit: { unit: minute, requests_per_unit: 5 }",
        "value: gold\n    rate_limit: { unit: minute, requests_per_unit: 10 }",
    );
    assert_ne!(v2, YAML);
    write_atomically(&dir.join("limits.yaml"), &v2);
    let mut reloader = Reloader::new(
        s.state.clone(),
        Some(ConfigSource::from(dir.join("spillway.toml"))),
    )
    .expect("a reloader");
    reloader.reload().await.expect("reloaded");
    // The unchanged rule kept its count, and so did the one whose limit
    // changed (same algorithm, same window): its 1 of 5 counts against the
    // new 10, rather than every key starting afresh.
    assert_eq!(s.one(IP).await.statuses[0].limit_remaining, 0);
    let r = s.one(&[("tenant", "gold")]).await;
    assert_eq!(limit(&r.statuses[0]), ("tenant_gold", 10, Unit::Minute));
    assert_eq!(r.statuses[0].limit_remaining, 8);

    // A bad descriptor file is refused; the running rules stay.
    write_atomically(
        &dir.join("limits.yaml"),
        &v2.replace("requests_per_unit: 10", "requests_per_unit: 0"),
    );
    let e = reloader.reload().await.expect_err("refused").to_string();
    assert!(
        e.contains("limits.yaml")
            && e.contains("line 17")
            && e.contains("descriptors[3].rate_limit.requests_per_unit"),
        "{e}"
    );
    // The running rule still counts: a third request leaves 7.
    assert_eq!(
        s.one(&[("tenant", "gold")]).await.statuses[0].limit_remaining,
        7
    );
}

#[tokio::test]
async fn on_redis_too() {
    let Some(redis) = spillway_conformance::redis_server::RedisServer::start() else {
        return;
    };
    let toml = format!(
        "{TOML}\n[store]\nkind = \"redis\"\nurl = \"{}\"\n",
        redis.url()
    );
    let dir = files("yaml-redis", &toml, YAML);
    let mut s = start(&dir).await;
    assert_eq!(s.admitted(&[("tenant", "gold")], 7).await, 5);
    assert_eq!(s.admitted(&[("tenant", "x")], 3).await, 1);
    assert_eq!(s.admitted(&[("health", "x")], 3).await, 3);
    let login = &[("path", "/login"), ("remote_address", "10.0.0.1")];
    assert_eq!(s.admitted(login, 3).await, 2);

    // A limit override on Redis, shared exactly by a second instance.
    let mut other = start(&dir).await;
    let five = [with_limit(&[("user", "ann")], 5, MINUTE)];
    let (a, b) = (
        s.admitted_all(&five, 3).await,
        other.admitted_all(&five, 4).await,
    );
    assert_eq!((a, b), (3, 2));
}

// ---- configuration errors ----------------------------------------------

fn load_error(name: &str, toml: &str, yaml: &str) -> (PathBuf, ConfigError) {
    let dir = files(name, toml, yaml);
    let e = Config::load(&dir.join("spillway.toml")).expect_err("invalid");
    (dir, e.first().clone())
}

#[test]
fn the_domains_must_agree_and_one_suffices() {
    let c = Config::load(&files("yaml-domain", TOML, YAML).join("spillway.toml")).unwrap();
    assert_eq!(c.envoy_domain, "edge");
    let same = TOML.replace("[envoy]\n", "[envoy]\ndomain = \"edge\"\n");
    let c = Config::load(&files("yaml-domain-same", &same, YAML).join("spillway.toml")).unwrap();
    assert_eq!(c.envoy_domain, "edge");
    // 1 rule of the TOML file, 6 rate limits in the YAML one (2 are
    // unlimited).
    assert_eq!(c.policy.rules().len(), 7);

    let other = TOML.replace("[envoy]\n", "[envoy]\ndomain = \"spillway\"\n");
    let (dir, e) = load_error("yaml-domain-other", &other, YAML);
    // An error of the TOML file, not of the descriptor file.
    assert_eq!(e.file, Some(dir.join("spillway.toml")));
    assert_eq!((e.line, e.field.as_str()), (Some(3), "envoy.domain"));
    assert!(e.message.contains("`edge`"), "{e}");
}

#[test]
fn a_rule_name_used_twice_names_both() {
    let toml = TOML.replace("name = \"per-user\"", "name = \"tenant_gold\"");
    let (dir, e) = load_error("yaml-name-clash", &toml, YAML);
    assert_eq!(e.file, Some(dir.join("limits.yaml")));
    assert_eq!((e.line, e.field.as_str()), (Some(15), "descriptors[3].key"));
    assert!(e.message.contains("`rules[0]` (line 6"), "{e}");

    // The name of a tier's quota counts too.
    let toml = format!("{TOML}[rules.tiers.pro]\nlimit = 20\n[tiers.pro]\n");
    let yaml = YAML.replace("name: core-team", "name: per-user@pro");
    let (_, e) = load_error("yaml-name-clash-tier", &toml, &yaml);
    assert_eq!(e.field, "descriptors[7].descriptors[0].rate_limit.name");
    assert!(e.message.contains("`rules[0].tiers.pro`"), "{e}");
}

#[test]
fn bad_descriptor_files_name_the_file_the_field_and_the_line() {
    let cases: &[(&str, &str, &str, usize, &str)] = &[
        (
            "requests_per_unit: 3",
            "requests_per_unit: 0",
            "descriptors[0].rate_limit.requests_per_unit",
            6,
            "between 1",
        ),
        (
            "unit: minute\n      requests_per_unit: 3",
            "unit: fortnight\n      requests_per_unit: 3",
            "descriptors[0].rate_limit.unit",
            5,
            "`fortnight`",
        ),
        (
            "  - key: health\n",
            "  - value: health\n",
            "(file)",
            // The parser points into the node (its `rate_limit`), not at
            // its first line.
            26,
            "missing field `key`",
        ),
        (
            "    shadow_mode: true\n",
            "    shadow: true\n",
            "(file)",
            22,
            "unknown field `shadow`",
        ),
        (
            "  - key: health\n    rate_limit:\n      unlimited: true\n",
            "  - key: health\n    rate_limit:\n      unlimited: true\n      unit: day\n",
            "descriptors[6].rate_limit.unit",
            28,
            "unlimited",
        ),
    ];
    for (i, (from, to, field, line, message)) in cases.iter().enumerate() {
        let yaml = YAML.replacen(from, to, 1);
        assert_ne!(yaml, YAML, "case {i}");
        let (dir, e) = load_error(&format!("yaml-bad-{i}"), TOML, &yaml);
        assert_eq!(e.file, Some(dir.join("limits.yaml")), "case {i}: {e}");
        assert_eq!(e.field, *field, "case {i}: {e}");
        assert_eq!(e.line, Some(*line), "case {i}: {e}");
        assert!(e.message.contains(message), "case {i}: {e}");
    }

    // A file that is not there: the TOML field that names it.
    let dir = temp_dir("yaml-missing");
    write_atomically(&dir.join("spillway.toml"), TOML);
    let e = Config::load(&dir.join("spillway.toml")).expect_err("no file");
    let e = e.first();
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(3), "envoy.descriptors_file")
    );
    assert!(e.message.contains("limits.yaml"), "{e}");
}

#[test]
fn check_config_reports_the_descriptor_file() {
    let run = |dir: &Path| {
        Command::new(env!("CARGO_BIN_EXE_spillway"))
            .args(["check-config", "spillway.toml"])
            .current_dir(dir)
            .env_remove("SPILLWAY_ADMIN_TOKEN")
            .env_remove("SPILLWAY_CHECK_TOKENS")
            .output()
            .expect("the binary runs")
    };
    let out = run(&files("yaml-check", TOML, YAML));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    // 1 rule of the TOML file, 6 rate limits in the YAML one (2 are
    // unlimited).
    assert!(stdout.contains("OK (7 rules)"), "{stdout}");

    let bad = YAML.replace("requests_per_unit: 3", "requests_per_unit: 0");
    let out = run(&files("yaml-check-bad", TOML, &bad));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("limits.yaml: line 6: `descriptors[0].rate_limit.requests_per_unit`"),
        "{stderr}"
    );
}

//! The configuration's unit tests: each section's conversions and errors.

use std::num::NonZeroU32;

use http::HeaderName;
use spillway::store::OnFull;
use spillway_redis::{OnError, Topology};
use spillway_tower::{BodyFormat, Credential, Ipv6Prefix};

use super::*;

#[test]
fn durations() {
    assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
    assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
    assert!(parse_duration("1 minute").is_err());
    assert!(parse_duration("m").is_err());
    assert!(parse_duration("-1s").is_err());
}

fn error(text: &str) -> ConfigError {
    Config::parse(text).expect_err("invalid").first().clone()
}

const RULE: &str =
    "[[rules]]\nname = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 10\nwindow = \"1m\"\n";

#[test]
fn route_costs_are_checked_row_by_row() {
    let table = |rows: &str| format!("{RULE}route_costs = [\n{rows}\n]\n");
    let config = Config::parse(&table(
        "{ path = \"/reports/**\", cost = 10 },\n{ methods = [\"post\"], path = \"/x\", cost = 0 },",
    ))
    .expect("valid");
    let rule = &config.policy.rules()[0];
    assert!(format!("{rule:?}").contains("Routes"), "{rule:?}");
    let e = error(&table("{ path = \"reports\", cost = 10 },"));
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(7), "rules[0].route_costs[0].path")
    );
    let e = error(&table(
        "{ path = \"/a\", cost = 1 },\n{ methods = [\"GE T\"], path = \"/b\", cost = 1 },",
    ));
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(8), "rules[0].route_costs[1].methods")
    );
    let e = error(&table("{ path = \"/a\", costs = 1 },"));
    assert!(e.message.contains("costs"), "{e}");
    let e = error(&format!("{RULE}route_costs = []\n"));
    assert_eq!(e.field, "rules[0].route_costs");
    let e = error(&format!(
        "{RULE}cost = \"header:x-cost\"\n{}",
        "route_costs = [{ path = \"/a\", cost = 2 }]\n"
    ));
    assert_eq!(e.field, "rules[0].cost");
}

#[test]
fn errors_name_the_field_and_the_line() {
    let e = error(&RULE.replace("limit = 10", "limit = 0"));
    assert_eq!((e.line, e.field.as_str()), (Some(4), "rules[0].limit"));
    let e = error(&RULE.replace("\"1m\"", "\"1 minute\""));
    assert_eq!((e.line, e.field.as_str()), (Some(5), "rules[0].window"));
    let e = error(&format!("{RULE}colour = \"red\"\n"));
    assert_eq!(e.line, Some(6));
    assert!(e.message.contains("colour"), "{e}");
    let e = error(&format!("{RULE}[rules.tiers.gold]\nlimit = 5\n"));
    assert_eq!(e.field, "rules[0].tiers.gold");
    assert_eq!(e.line, Some(6));
    let e = error("[store]\nkind = \"redis\"\n");
    assert_eq!(e.field, "store.url");
}

#[test]
fn a_rule_can_have_a_failure_policy_of_its_own() {
    let text = format!(
        "[store]\ninstances = 3\n\n{RULE}on_error = \"local\"\n[rules.tiers.pro]\nlimit = 20\n\n[tiers.pro]\n"
    );
    let c = Config::parse(&text).unwrap();
    assert_eq!(c.store.on_error, OnError::FailOpen);
    let local = OnError::Local {
        instances: NonZeroU32::new(3).unwrap(),
    };
    let name = c.policy.rules()[0].name().to_string();
    assert_eq!(c.store.rule_on_error.get(&name), Some(&local));
    assert_eq!(
        c.store.rule_on_error.get(&format!("{name}@pro")),
        Some(&local)
    );
    assert_eq!(c.store.rule_on_error.len(), 2);
    let e = error(&format!("{RULE}on_error = \"fail-closed\"\n"));
    assert_eq!((e.line, e.field.as_str()), (Some(6), "rules[0].on_error"));
    assert!(
        e.message.contains(
            "expected `fail_open`, `fail_closed` or `local`; did you mean `fail_closed`?"
        ),
        "{e}"
    );
}

#[test]
fn a_rule_redis_cannot_run_is_an_error_at_its_limit() {
    let log = "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:1/\"\n\n\
               [[rules]]\nname = \"logins\"\nalgorithm = \"sliding_log\"\n\
               limit = 20000\nwindow = \"1h\"\n";
    let e = error(log);
    assert_eq!((e.line, e.field.as_str()), (Some(8), "rules[0].limit"));
    assert!(
        e.message.contains("10,000") && e.message.contains("`logins`"),
        "{e}"
    );
    // In memory, the same rule is fine; on Redis, within the bound too.
    assert!(Config::parse(&log.replace("kind = \"redis\"", "kind = \"memory\"")).is_ok());
    assert!(Config::parse(&log.replace("20000", "10000")).is_ok());
    let shared = log
        .replace("20000", "2")
        .replace("url =", "instances = 3\non_error = \"local\"\nurl =");
    let e = error(&shared);
    assert_eq!((e.line, e.field.as_str()), (Some(10), "rules[0].limit"));
    assert!(e.message.contains("cannot be shared by 3"), "{e}");
}

#[test]
fn the_429_body_can_be_the_drafts_quota_exceeded_problem() {
    let body = |text: &str| Config::parse(text).unwrap().policy.body_format();
    assert_eq!(body(RULE), BodyFormat::Problem);
    assert_eq!(
        body("[headers]\nbody = \"quota-exceeded\"\n"),
        BodyFormat::QuotaExceeded
    );
    let e = error("[headers]\nreset = \"delta\"\nbody = \"quota_exceeded\"\n");
    assert_eq!((e.line, e.field.as_str()), (Some(3), "headers.body"));
    assert_eq!(
        e.to_string(),
        "line 3: `headers.body`: `quota_exceeded`: expected `problem`, `quota-exceeded`, `json`, \
         `text` or `empty`; did you mean `quota-exceeded`?"
    );
}

#[test]
fn api_keys_come_from_the_places_the_file_names() {
    let places = |text: &str| {
        Config::parse(text)
            .unwrap()
            .policy
            .client_settings()
            .api_key
            .clone()
    };
    let x_api_key = Credential::Header(HeaderName::from_static("x-api-key"));
    assert_eq!(places(RULE), [x_api_key.clone(), Credential::bearer()]);
    assert_eq!(
        places("[clients]\napi_key = \"bearer\"\n"),
        [Credential::bearer()]
    );
    assert_eq!(
        places("[clients]\napi_key = [\"header:x-api-key\", \"authorization:Token\"]\n"),
        [x_api_key, Credential::Authorization("token".into())]
    );
    assert_eq!(
        places("[clients]\napi_key_header = \"x-key\"\n"),
        [
            Credential::Header(HeaderName::from_static("x-key")),
            Credential::bearer()
        ]
    );
    let e = error("[clients]\n\napi_key = \"cookie\"\n");
    assert_eq!((e.line, e.field.as_str()), (Some(3), "clients.api_key"));
    let e = error("[clients]\napi_key = []\n");
    assert_eq!(e.field, "clients.api_key");
    let e = error("[clients]\napi_key = \"bearer\"\napi_key_header = \"x\"\n");
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(3), "clients.api_key_header")
    );
    let key = "[[rules]]\nname = \"a\"\nkey = [\"bearer\"]\nalgorithm = \"fixed_window\"\nlimit = 10\nwindow = \"1m\"\n";
    assert!(Config::parse(key).is_ok());
}

#[test]
fn the_proxy_section_switches_each_normalization() {
    let c = Config::parse(RULE).unwrap();
    assert_eq!(c.proxy, Normalize::default());
    let text = "[proxy]\nnormalize_path = false\nmerge_slashes = false\nescaped_slashes = \"reject\"\nunderscores_in_headers = true\n";
    let c = Config::parse(text).unwrap();
    assert_eq!(
        c.proxy,
        Normalize {
            path: false,
            merge_slashes: false,
            escaped_slashes: EscapedSlashes::Reject,
            underscores_in_headers: true,
        }
    );
    let e = error("[proxy]\n\nescaped_slashes = \"decode\"\n");
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(3), "proxy.escaped_slashes")
    );
    let exact = Config::parse(&RULE.replace(
        "name = \"a\"",
        "name = \"a\"\nmatch = { path = \"/login\", exact_path = true, method_overrides = false }",
    ));
    assert!(exact.is_ok());
}

#[test]
fn ipv6_clients_are_keyed_by_a_64_unless_configured() {
    let prefix = |text: &str| {
        Config::parse(text)
            .unwrap()
            .policy
            .client_settings()
            .ipv6_prefix
    };
    assert_eq!(prefix(RULE), Ipv6Prefix::new(64).unwrap());
    assert_eq!(
        prefix("[clients]\nipv6_prefix = 56\n"),
        Ipv6Prefix::new(56).unwrap()
    );
    assert_eq!(prefix("[clients]\nipv6_prefix = 128\n"), Ipv6Prefix::FULL);
    for bad in ["0", "129", "-1", "100000"] {
        let e = error(&format!(
            "[clients]\ntrusted_proxies = []\nipv6_prefix = {bad}\n"
        ));
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(3), "clients.ipv6_prefix"),
            "{e}"
        );
        assert!(e.message.contains("between 1 and 128"), "{e}");
    }
}

#[test]
fn a_full_table_evicts_unless_told_to_deny_new_keys() {
    let on_full = |text: &str| Config::parse(text).unwrap().store.on_full;
    assert_eq!(on_full(RULE), OnFull::Evict);
    assert_eq!(on_full("[store]\non_full = \"evict\"\n"), OnFull::Evict);
    assert_eq!(
        on_full("[store]\non_full = \"deny_new\"\n"),
        OnFull::DenyNew
    );
    let e = error("[store]\nmax_keys = 10\non_full = \"refuse\"\n");
    assert_eq!((e.line, e.field.as_str()), (Some(3), "store.on_full"));
    assert!(e.message.contains("deny_new"), "{e}");
}

#[test]
fn max_memory_is_a_size_in_bytes() {
    let max = |text: &str| {
        Config::parse(text)
            .unwrap()
            .store
            .max_memory
            .map(|m| m.get())
    };
    // Bounded by default in memory; a size set wins, larger or smaller.
    assert_eq!(max(RULE), Some(256 << 20));
    assert_eq!(max(RULE), Some(DEFAULT_MAX_MEMORY.get()));
    assert_eq!(max("[store]\nmax_memory = \"2GiB\"\n"), Some(2 << 30));
    assert_eq!(
        max("[store]\nmax_memory = \"none\"\n"),
        None,
        "off, said so"
    );
    assert_eq!(max("[store]\nmax_memory = \"64MiB\"\n"), Some(64 << 20));
    assert_eq!(max("[store]\nmax_memory = \"100 MB\"\n"), Some(100_000_000));
    assert_eq!(max("[store]\nmax_memory = 2097152\n"), Some(2 << 20));
    for (text, says) in [
        ("[store]\n\nmax_memory = \"64 potatoes\"\n", "not a size"),
        ("[store]\n\nmax_memory = \"512KiB\"\n", "at least 1MiB"),
        ("[store]\n\nmax_memory = \"99999999999GiB\"\n", "too large"),
        ("[store]\n\nmax_memory = -5\n", "not a size"),
        ("[store]\n\nmax_memory = 1.5\n", "whole number"),
    ] {
        let e = error(text);
        assert_eq!(e.field.as_str(), "store.max_memory", "{text}: {e}");
        assert_eq!(e.line, Some(3), "{text}: {e}");
        assert!(e.to_string().contains(says), "{text}: {e}");
    }
    let e =
        error("[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nmax_memory = \"64MiB\"\n");
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(4), "store.max_memory"),
        "{e}"
    );
    assert!(e.message.contains("in-memory"), "{e}");
    // With Redis there is nothing in memory to bound.
    assert_eq!(
        max("[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\n"),
        None
    );
}

#[test]
fn the_proxy_section_bounds_what_clients_hold() {
    let c = Config::parse("").unwrap();
    assert_eq!(c.proxy_bounds, ProxyBounds::default());
    let text =
        "[proxy]\nhttp2 = false\nhttp2_max_streams = 8\npool_max_connections = 16\nmax_held = 32\n";
    let c = Config::parse(text).unwrap();
    assert!(!c.proxy_bounds.http2);
    assert_eq!(c.proxy_bounds.http2_max_streams.get(), 8);
    assert_eq!(c.proxy_bounds.pool_max_connections.get(), 16);
    assert_eq!(c.proxy_bounds.max_held.get(), 32);
    let e = error("[proxy]\n\nhttp2_max_streams = 0\n");
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(3), "proxy.http2_max_streams")
    );
    let e = error("[proxy]\npool_max_connections = 2000000\n");
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(2), "proxy.pool_max_connections")
    );
    assert!(e.message.contains("between 1 and 1000000"), "{e}");
    let e = error("[proxy]\nmax_held = 0\n");
    assert_eq!((e.line, e.field.as_str()), (Some(2), "proxy.max_held"));
    let e = error("[proxy]\nhttp2 = \"yes\"\n");
    assert_eq!(e.line, Some(2), "{e}");

    // What a budget rule's body reader may hold.
    let c = Config::parse("[proxy]\nmax_read_body = \"4MiB\"\nmax_read_bodies = 65536\n").unwrap();
    assert_eq!(c.proxy_bounds.max_read_body.get(), 4 << 20);
    assert_eq!(c.proxy_bounds.max_read_bodies.get(), 65_536);
    for (text, line) in [
        ("[proxy]\nmax_read_body = \"2GiB\"\n", 2),
        ("[proxy]\n\nmax_read_body = 10\n", 3),
        ("[proxy]\nmax_read_body = 1.5\n", 2),
        ("[proxy]\nmax_read_body = \"lots\"\n", 2),
    ] {
        let e = error(text);
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(line), "proxy.max_read_body"),
            "{e}"
        );
    }
    let e = error("[proxy]\nmax_read_bodies = -1\n");
    assert_eq!(e.field, "proxy.max_read_bodies");
    assert!(e.message.contains("between 1KiB and 1GiB"), "{e}");
}

#[test]
fn server_and_envoy_bounds_are_validated() {
    let c = Config::parse("").unwrap();
    assert_eq!(c.server.head_timeout, ServerConfig::HEAD_TIMEOUT);
    assert_eq!(c.server.max_connections.get(), 10_000);
    assert_eq!(c.envoy_limits, EnvoyLimits::default());
    let e = error("[server]\nlisten = \"127.0.0.1:1\"\nbody_timeout = \"0s\"\n");
    assert_eq!((e.line, e.field.as_str()), (Some(3), "server.body_timeout"));
    let e = error("[server]\nhead_timeout = \"soon\"\n");
    assert_eq!((e.line, e.field.as_str()), (Some(2), "server.head_timeout"));
    let e = error("[server]\nmax_connections = 0\n");
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(2), "server.max_connections")
    );
    let e = error("[server]\ncheck_tokens = [\"a\", \"\"]\n");
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(2), "server.check_tokens[1]")
    );
    let e = error("[envoy]\nmax_descriptors = 0\n");
    assert_eq!(
        (e.line, e.field.as_str()),
        (Some(2), "envoy.max_descriptors")
    );
    let e = error("[envoy]\nmax_entries = 1001\n");
    assert_eq!((e.line, e.field.as_str()), (Some(2), "envoy.max_entries"));
    let c = Config::parse(
        "[server]\ncheck_tokens = [\"new\", \"old\"]\nwrite_timeout = \"5s\"\n\
         [envoy]\nmax_descriptors = 8\nmax_entries = 4\n",
    )
    .unwrap();
    assert_eq!(c.server.check_tokens, ["new", "old"]);
    assert_eq!(c.server.write_timeout, Duration::from_secs(5));
    assert_eq!(c.envoy_limits.max_descriptors.get(), 8);
    assert_eq!(c.envoy_limits.max_entries.get(), 4);
    assert_eq!(c.envoy_limits.max_message_bytes(), 64 * 1024);
}

#[test]
fn rule_names_of_limit_overrides_are_reserved() {
    let e = error(&RULE.replace("name = \"a\"", "name = \"envoy-override:5-per-minute\""));
    assert_eq!((e.line, e.field.as_str()), (Some(2), "rules[0].name"));
    assert!(e.message.contains("limit overrides"), "{e}");
    // Anything else is a name.
    assert!(Config::parse(&RULE.replace("name = \"a\"", "name = \"envoy-overrides\"")).is_ok());
}

#[test]
fn a_full_configuration() {
    let text = r#"
[server]
listen = "127.0.0.1:9000"
grpc_listen = "127.0.0.1:9001"
admin_token = "secret"

[store]
kind = "redis"
url = ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]
timeout = "20ms"
on_error = "local"
instances = 3

[headers]
reset = "delta"
openai = true

[clients]
trusted_proxies = ["10.0.0.0/8", "127.0.0.1"]
forwarded_header = "forwarded"

[tiers.pro]
api_keys = ["k1"]

[[rules]]
name = "per-key"
match = { methods = ["get", "POST"], path = "/api/**" }
key = ["api_key"]
algorithm = "token_bucket"
limit = 100
window = "1m"
burst = 20
cost = "header:x-cost"
[rules.tiers.pro]
limit = 10000
"#;
    let c = Config::parse(text).unwrap();
    assert_eq!(c.server.listen.port(), 9000);
    assert!(c.policy.header_options().openai);
    assert!(!Config::parse("").unwrap().policy.header_options().openai);
    assert_eq!(c.store.timeout, Duration::from_millis(20));
    assert_eq!(
        c.store.on_error,
        OnError::Local {
            instances: NonZeroU32::new(3).unwrap()
        }
    );
    assert!(matches!(&c.store.kind, StoreKind::Redis(Topology::Cluster(n)) if n.len() == 2));
    let names: Vec<_> = c
        .policy
        .store_rules()
        .iter()
        .map(|r| r.name().to_string())
        .collect();
    assert_eq!(names, ["per-key", "per-key@pro"]);
}

/// A file with a mistake of every kind: each is reported in one run, in the
/// file's order, with its line, its full path and what was probably meant.
#[test]
fn every_mistake_is_reported_at_once_with_its_place() {
    let text = r#"[server]
listen = "127.0.0.1:8080"
head_timeout = 5

[[rules]]
name = "a"
algoritm = "fixed_window"
limit = 10
window = "1m"

[[rules]]
name = "b"
algorithm = "token-bucket"
limit = 10
window = "1m"

[[rules]]
name = "c"
algorithm = "fixed_window"
limit = 10
window = 60

[[rules]]
name = "d"
algorithm = "fixed_window"
limit = 10
window = "0s"
action = "rejct"

[[rules]]
name = "e"
algorithm = "fixed_window"
window = "1m"

[[rules]]
name = "g"
algorithm = "fixed_window"
limit = 10
window = "1m"
[rules.match]
methd = ["GET"]

[[rules]]
name = "f"
algorithm = "fixed_window"
limit = 10
window = "1m"
tiers = { pro = { limit = 100 } }

[serevr]
"#;
    let all = Config::parse(text).expect_err("ten mistakes");
    let found: Vec<(Option<usize>, &str, &str)> = all
        .errors()
        .iter()
        .map(|e| (e.line, e.field.as_str(), e.message.as_str()))
        .collect();
    let expected: &[(usize, &str, &str)] = &[
        (3, "server.head_timeout", "\"5s\" (seconds)"),
        (7, "rules[0].algoritm", "did you mean `algorithm`?"),
        (13, "rules[1].algorithm", "did you mean `token_bucket`?"),
        (
            21,
            "rules[2].window",
            "`60` is a number, and a duration is a string",
        ),
        (27, "rules[3].window", "must be longer than zero"),
        (28, "rules[3].action", "did you mean `reject`?"),
        (30, "rules[4]", "missing field `limit`"),
        (41, "rules[5].match.methd", "did you mean `methods`?"),
        (48, "rules[6].tiers.pro", "unknown tier `pro`"),
        (50, "serevr", "did you mean `server`?"),
    ];
    assert_eq!(found.len(), expected.len(), "{all}");
    for ((line, field, message), (want_line, want_field, want)) in found.iter().zip(expected) {
        assert_eq!((*line, *field), (Some(*want_line), *want_field), "{all}");
        assert!(message.contains(want), "`{message}` lacks `{want}`:\n{all}");
    }
    assert!(!all.to_string().contains("period"), "{all}");
    assert!(
        all.to_string()
            .starts_with("10 errors in the configuration:\nline 3: "),
        "{all}"
    );
}

/// A value of the wrong kind says what the field takes, not which Rust type
/// failed to match.
#[test]
fn values_of_the_wrong_kind_say_what_is_expected() {
    for (text, field, expected) in [
        (
            format!("{RULE}cost = true\n"),
            "rules[0].cost",
            "a cost: an integer",
        ),
        (
            "[store]\nmax_memory = true\n".to_string(),
            "store.max_memory",
            "a size: a number of bytes",
        ),
        (
            "[store]\nkind = \"redis\"\nurl = 6379\n".to_string(),
            "store.url",
            "a redis:// URL",
        ),
        (
            "[clients]\napi_key = 1\n".to_string(),
            "clients.api_key",
            "a string, or a list of strings",
        ),
        (
            "[server]\ndrain_timeout = true\n".to_string(),
            "server.drain_timeout",
            "a duration: a string of a number and a unit",
        ),
        (
            format!("{RULE}[rules.match]\nmethods = [1]\n"),
            "rules[0].match.methods[0]",
            "expected a string",
        ),
    ] {
        let e = error(&text);
        assert_eq!(e.field, field, "{e}");
        assert!(e.message.contains(expected), "{e}");
        assert!(!e.message.contains("untagged"), "{e}");
    }
}

#[test]
fn settle_tokens_are_signed_with_a_long_key_and_expire_before_their_receipts() {
    let c = Config::parse("").unwrap();
    assert_eq!(c.server.settle_key, None);
    assert_eq!(c.server.settle_within, ServerConfig::SETTLE_WITHIN);
    let key = "k".repeat(32);
    let c = Config::parse(&format!(
        "[server]\nsettle_key = \"{key}\"\nsettle_within = \"9m\"\n"
    ))
    .unwrap();
    assert_eq!(c.server.settle_key.as_deref(), Some(key.as_str()));
    assert_eq!(c.server.settle_within.as_secs(), 540);
    let e = error("[server]\n\nsettle_key = \"short\"\n");
    assert_eq!((e.line, e.field.as_str()), (Some(3), "server.settle_key"));
    assert!(e.message.contains("at least 32 bytes"), "{e}");
    for within in ["\"10m\"", "\"500ms\"", "\"soon\""] {
        let e = error(&format!("[server]\nsettle_within = {within}\n"));
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(2), "server.settle_within"),
            "{within}: {e}"
        );
    }
}

const SLOTS: &str = "[[rules]]\nname = \"reports\"\nalgorithm = \"concurrency\"\nlimit = 5\n";

#[test]
fn a_concurrency_rule_takes_slots_and_a_lease() {
    let config = Config::parse(SLOTS).expect("valid");
    let rule = &config.policy.rules()[0];
    let spillway::AnyAlgorithm::Concurrency(cc) = rule.algorithm() else {
        panic!("{rule:?}");
    };
    // 30 s unless set.
    assert_eq!((cc.slots(), cc.lease_micros()), (5, 30_000_000));
    let config = Config::parse(&format!("{SLOTS}lease = \"2m\"\n")).expect("valid");
    let spillway::AnyAlgorithm::Concurrency(cc) = config.policy.rules()[0].algorithm() else {
        panic!("not a concurrency rule");
    };
    assert_eq!(cc.lease_micros(), 120_000_000);
    for (extra, line, field) in [
        ("lease = \"500ms\"", 5, "rules[0].lease"),
        ("lease = \"2h\"", 5, "rules[0].lease"),
        ("window = \"1m\"", 5, "rules[0].window"),
        ("burst = 2", 5, "rules[0].burst"),
        // A client could name a cost of 0 and hold no slot.
        ("cost = \"header:x-slots\"", 5, "rules[0].cost"),
        ("cost = \"response:usage\"", 5, "rules[0].cost"),
        // Envoy never says when a request ends.
        ("descriptors = [\"tenant\"]", 3, "rules[0].descriptors"),
    ] {
        let e = error(&format!("{SLOTS}{extra}\n"));
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(line), field),
            "{extra}: {e}"
        );
    }
    // A whole number of slots per request is fine.
    assert!(Config::parse(&format!("{SLOTS}cost = 2\n")).is_ok());
    let config =
        Config::parse(&format!("{SLOTS}retry_after = \"2s\"\ndeny_status = 503\n")).expect("valid");
    let rule = format!("{:?}", config.policy.rules()[0]);
    assert!(
        rule.contains("retry_hint: Some(2s)") && rule.contains("503"),
        "{rule}"
    );
    for (extra, field) in [
        ("deny_status = 500", "rules[0].deny_status"),
        ("retry_after = \"0s\"", "rules[0].retry_after"),
    ] {
        let e = error(&format!("{SLOTS}{extra}\n"));
        assert_eq!((e.line, e.field.as_str()), (Some(5), field), "{extra}: {e}");
    }
    // A rate rule's wait is exact, and its denial a 429.
    for (extra, field) in [
        ("retry_after = \"1s\"", "rules[0].retry_after"),
        ("deny_status = 503", "rules[0].deny_status"),
    ] {
        let e = error(&format!("{RULE}{extra}\n"));
        assert_eq!((e.line, e.field.as_str()), (Some(6), field), "{extra}: {e}");
    }
}

#[test]
fn a_lease_is_a_concurrency_rules_and_a_window_every_other_rules() {
    let e = error(&format!("{RULE}lease = \"30s\"\n"));
    assert_eq!((e.line, e.field.as_str()), (Some(6), "rules[0].lease"));
    let e = error(&RULE.replace("window = \"1m\"\n", ""));
    assert_eq!((e.line, e.field.as_str()), (Some(3), "rules[0].window"));
    assert!(e.message.contains("required by fixed_window"), "{e}");
}

#[test]
fn a_tier_keeps_a_rule_a_concurrency_rule_or_a_rate_rule() {
    let tiers = "[tiers.gold]\napi_keys = [\"k\"]\n";
    let ok = format!("{tiers}{SLOTS}[rules.tiers.gold]\nlimit = 20\nlease = \"1m\"\n");
    assert!(Config::parse(&ok).is_ok());
    let e = error(&format!(
        "{tiers}{SLOTS}[rules.tiers.gold]\nalgorithm = \"fixed_window\"\nwindow = \"1m\"\n"
    ));
    assert_eq!(e.field, "rules[0].tiers.gold.algorithm");
    let e = error(&format!(
        "{tiers}{RULE}[rules.tiers.gold]\nalgorithm = \"concurrency\"\n"
    ));
    assert_eq!(e.field, "rules[0].tiers.gold.window");
}

#[test]
fn calendar_windows_are_fixed_windows_in_a_time_zone() {
    use spillway::algorithm::{AnyAlgorithm, Period};
    let rule = |extra: &str| {
        format!(
            "[[rules]]\nname = \"plan\"\nalgorithm = \"fixed_window\"\nlimit = 1000\n\
             window = \"calendar_month\"\n{extra}"
        )
    };
    let calendar_of = |text: &str| {
        let config = Config::parse(text).expect("valid");
        match config.policy.store_rules()[0].algorithm() {
            AnyAlgorithm::FixedWindow(fw) => fw.calendar_of(),
            other => panic!("{other:?}"),
        }
    };
    let utc = calendar_of(&rule("")).expect("a calendar");
    // Redis counts them too.
    calendar_of(&format!(
        "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:1\"\n{}",
        rule("")
    ))
    .expect("a calendar on Redis");
    assert_eq!((utc.period(), utc.zone().name()), (Period::Month, "UTC"));
    let paris = calendar_of(&rule("time_zone = \"Europe/Paris\"\n")).expect("a calendar");
    assert_eq!(paris.zone().name(), "Europe/Paris");
    // A tier takes the rule's zone, or its own.
    let tiered = rule(
        "time_zone = \"Asia/Tokyo\"\n[rules.tiers.pro]\nlimit = 9000\nwindow = \"calendar_week\"\n\
         [tiers.pro]\napi_keys = [\"k\"]\n",
    );
    let config = Config::parse(&tiered).expect("valid");
    match config.policy.store_rules()[1].algorithm() {
        AnyAlgorithm::FixedWindow(fw) => {
            let c = fw.calendar_of().expect("a calendar");
            assert_eq!((c.period(), c.zone().name()), (Period::Week, "Asia/Tokyo"));
        }
        other => panic!("{other:?}"),
    }
    for (text, field, says) in [
        (
            rule("time_zone = \"Mars/Olympus\"\n"),
            "rules[0].time_zone",
            "IANA",
        ),
        (
            rule("").replace("fixed_window", "sliding_log"),
            "rules[0].window",
            "fixed window",
        ),
        (
            format!("{RULE}time_zone = \"UTC\"\n"),
            "rules[0].time_zone",
            "calendar window only",
        ),
    ] {
        let e = error(&text);
        assert_eq!(e.field, field, "{text}: {e}");
        assert!(e.message.contains(says), "{text}: {e}");
        assert!(e.line.is_some(), "{text}: {e}");
    }
}

#[test]
fn named_admin_tokens_are_read_or_write_and_each_its_own() {
    let rules =
        "\n[[rules]]\nname = \"r\"\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1m\"\n";
    let config = Config::parse(&format!(
        "[server]\nadmin_tokens = [\n  {{ name = \"ops\", token = \"0123456789abcdef\", access = \"read_write\" }},\n  {{ name = \"ro\", token = \"fedcba9876543210\", access = \"read_only\" }},\n]\n{rules}"
    ))
    .expect("valid");
    let tokens = &config.server.admin_tokens;
    assert_eq!(tokens.len(), 2);
    assert!(tokens[0].write && !tokens[1].write);
    assert_eq!(tokens[1].name, "ro");
    // The secret stays out of what is printed.
    assert!(!format!("{config:?}").contains("fedcba9876543210"));
    for (entry, field, says) in [
        (
            r#"{ name = "ops", token = "short", access = "read_only" }"#,
            "server.admin_tokens[0].token",
            "at least 16",
        ),
        (
            r#"{ name = "ops", token = "0123456789abcdef", access = "all" }"#,
            "server.admin_tokens[0].access",
            "read_only",
        ),
        (
            r#"{ name = "admin", token = "0123456789abcdef", access = "read_only" }"#,
            "server.admin_tokens[0].name",
            "taken",
        ),
        (
            r#"{ name = "two words", token = "0123456789abcdef", access = "read_only" }"#,
            "server.admin_tokens[0].name",
            "printable",
        ),
    ] {
        let e = error(&format!("[server]\nadmin_tokens = [{entry}]\n{rules}"));
        assert_eq!(e.field, field, "{e}");
        assert!(e.message.contains(says), "{e}");
        assert_eq!(e.line, Some(2), "{e}");
    }
    let as_admin = r#"[{ name = "a", token = "0123456789abcdef", access = "read_only" }]"#;
    let e = error(&format!(
        "[server]\nadmin_token = \"0123456789abcdef\"\nadmin_tokens = {as_admin}\n{rules}"
    ));
    assert_eq!(e.field, "server.admin_tokens[0].token", "{e}");
    let twice = r#"[{ name = "a", token = "0123456789abcdef", access = "read_only" }, { name = "b", token = "0123456789abcdef", access = "read_only" }]"#;
    let e = error(&format!("[server]\nadmin_tokens = {twice}\n{rules}"));
    assert_eq!(e.field, "server.admin_tokens[1].token", "{e}");
}

#[test]
fn a_tier_name_with_a_line_break_is_an_error() {
    let text = "[tiers.\"pro\\nplus\"]\napi_keys = [\"k\"]\n\n[[rules]]\nname = \"r\"\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1m\"\n[rules.tiers.\"pro\\nplus\"]\nlimit = 2\n";
    let e = error(text);
    assert!(e.field.starts_with("tiers."), "{e}");
    assert!(e.message.contains("control character"), "{e}");
}

#[test]
fn a_state_file_is_the_memory_stores_and_its_errors_name_the_field() {
    let file = |text: &str| Config::parse(text).unwrap().store.state_file;
    assert_eq!(file(RULE), None);
    let set = file("[store]\nstate_file = \"/var/lib/spillway/state\"\nsnapshot_every = \"30s\"\n")
        .unwrap();
    assert_eq!(set.path.to_str(), Some("/var/lib/spillway/state"));
    assert_eq!(set.every, std::time::Duration::from_secs(30));
    for (text, line, field, says) in [
        (
            "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nstate_file = \"s\"\n",
            4,
            "store.state_file",
            "everything is in Redis already",
        ),
        (
            "[store]\nstate_file = \" \"\n",
            2,
            "store.state_file",
            "is empty",
        ),
        (
            "[store]\nstate_file = \"/var/lib/\"\n",
            2,
            "store.state_file",
            "names a directory",
        ),
        (
            "[store]\nsnapshot_every = \"5s\"\n",
            2,
            "store.snapshot_every",
            "set state_file too",
        ),
        (
            "[store]\nstate_file = \"s\"\nsnapshot_every = \"100ms\"\n",
            3,
            "store.snapshot_every",
            "at least 1s",
        ),
        (
            "[store]\nstate_file = \"s\"\nsnapshot_every = \"often\"\n",
            3,
            "store.snapshot_every",
            "",
        ),
    ] {
        let e = error(text);
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(line), field),
            "{text}: {e}"
        );
        assert!(e.message.contains(says), "{e}");
    }
}

#[test]
fn a_relative_state_file_is_beside_the_configuration_file() {
    let dir = std::path::Path::new("/etc/spillway");
    let config = Config::parse_in("[store]\nstate_file = \"state/counts\"\n", dir).unwrap();
    let file = config.store.state_file.unwrap();
    assert_eq!(
        file.path,
        std::path::Path::new("/etc/spillway/state/counts")
    );
    let config = Config::parse_in("[store]\nstate_file = \"/var/lib/s\"\n", dir).unwrap();
    assert_eq!(
        config.store.state_file.unwrap().path,
        std::path::Path::new("/var/lib/s")
    );
}

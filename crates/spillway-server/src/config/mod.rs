//! The configuration file: TOML, read into raw structs that mirror the file
//! (`read.rs` reads each section and rule on its own), then converted once
//! into validated types. Each section has its own module: its validated
//! types, raw types and conversion (`server.rs`, `store.rs`, `proxy.rs`,
//! `envoy.rs`, `clients.rs`; `rules.rs` and `budget.rs` for the rules).
//! Every error names the file, the line and the field, and one run reports
//! every error it can ([`ConfigErrors`]).
//!
//! `[envoy] descriptors_file` names a second file, in envoyproxy/ratelimit's
//! YAML format, whose rate limits join the rules ([`descriptors`]).

mod budget;
mod clients;
pub mod descriptors;
mod envoy;
mod errors;
mod proxy;
mod read;
mod rules;
mod server;
mod source;
mod store;
#[cfg(test)]
mod tests;

pub use envoy::EnvoyLimits;
pub use errors::{ConfigError, ConfigErrors};
pub use proxy::{EscapedSlashes, Normalize, ProxyBounds};
pub use server::{AdminToken, ServerConfig};
pub use source::{ConfigSource, DEFAULT_CONFIG_PATH, Overrides, SAMPLE_CONFIG, locate_config};
pub use store::{
    DEFAULT_MAX_MEMORY, DEFAULT_SNAPSHOT_EVERY, StateFile, StoreConfig, StoreKind, parse_size,
};

use clients::{RawClients, RawHeaders, convert_clients, convert_headers};
use envoy::{RawEnvoy, convert_envoy, envoy_limits};
use errors::{Gathered, Text};
use proxy::{RawProxy, convert_proxy, convert_proxy_bounds};
use rules::convert_rules;
use server::{RawServer, convert_server};
use store::{RawStore, convert_store, redis_rules, rule_on_error};

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use spillway_tower::Policy;
use toml::Spanned;

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen.
    pub server: ServerConfig,
    /// Where the counters live.
    pub store: StoreConfig,
    /// The HTTP rules, clients, tiers and headers.
    pub policy: Policy,
    /// The rules' Envoy descriptor keys, by rule index (empty: not reachable
    /// from Envoy by keys; a rule of the descriptor file is reached through
    /// [`descriptor_tree`](Self::descriptor_tree) instead).
    pub descriptors: Vec<Vec<String>>,
    /// By rule index, what a rule with `descriptors` says of the calls
    /// Envoy and Kuadrant make (past the end: the defaults).
    pub envoy_rules: Vec<EnvoyRule>,
    /// The Envoy rate limit domain this service answers for.
    pub envoy_domain: String,
    /// The tree of `[envoy] descriptors_file`, if set. Its rate limits are
    /// the last rules of [`policy`](Self::policy).
    pub descriptor_tree: Option<descriptors::DescriptorTree>,
    /// `[proxy]`: how `spillway proxy` normalizes request targets. Read at
    /// start: a reload does not change it.
    pub proxy: Normalize,
    /// `[envoy] max_descriptors` and `max_entries`.
    pub envoy_limits: EnvoyLimits,
    /// `[proxy]`: what `spillway proxy`'s clients may hold at once. Read at
    /// start: a reload does not change it.
    pub proxy_bounds: ProxyBounds,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    headers: RawHeaders,
    #[serde(default)]
    clients: RawClients,
    #[serde(default)]
    tiers: BTreeMap<String, RawTier>,
    #[serde(default)]
    envoy: RawEnvoy,
    #[serde(default)]
    proxy: RawProxy,
    #[serde(default)]
    rules: Vec<Spanned<RawRule>>,
}

/// A setting that takes one value or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string, or a list of strings")]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTier {
    #[serde(default)]
    api_keys: Vec<String>,
}

/// What a rule with `descriptors` says of the calls Envoy and Kuadrant
/// make (docs/envoy.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EnvoyRule {
    /// How long a reservation of Kuadrant's `Reserve` may go uncommitted
    /// before the store gives it back (`on_expiry = "release"`); `None`:
    /// it stays charged.
    pub reserve_released: Option<std::time::Duration>,
    /// `hits_after_response`: Envoy AI Gateway's pair of `ShouldRateLimit`
    /// calls. One of 0 hits, before the request, is over the limit when
    /// the key has nothing left; one of more, after the response, charges
    /// its hits whatever is left, past the limit as debt.
    pub hits_after_response: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Spanned<String>,
    #[serde(rename = "match", default)]
    matcher: RawMatch,
    #[serde(default)]
    key: Option<Vec<Spanned<String>>>,
    #[serde(default)]
    fallback: Option<Vec<Spanned<String>>>,
    algorithm: Spanned<String>,
    limit: Spanned<u64>,
    window: Option<Spanned<RawDuration>>,
    lease: Option<Spanned<RawDuration>>,
    burst: Option<Spanned<u64>>,
    mode: Option<Spanned<String>>,
    delay: Option<Spanned<u64>>,
    time_zone: Option<Spanned<String>>,
    cost: Option<Spanned<RawCost>>,
    route_costs: Option<Spanned<Vec<Spanned<RawRouteCost>>>>,
    reserve: Option<Spanned<budget::RawReserve>>,
    reserve_default: Option<Spanned<u64>>,
    max_reserve: Option<Spanned<u64>>,
    on_overrun: Option<Spanned<String>>,
    release_on_5xx: Option<Spanned<bool>>,
    on_expiry: Option<Spanned<String>>,
    settle_within: Option<Spanned<RawDuration>>,
    hits_after_response: Option<Spanned<bool>>,
    action: Option<Spanned<String>>,
    on_error: Option<Spanned<String>>,
    retry_after: Option<Spanned<RawDuration>>,
    deny_status: Option<Spanned<u64>>,
    #[serde(default)]
    tiers: BTreeMap<Spanned<String>, RawQuota>,
    #[serde(default)]
    descriptors: Vec<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    methods: Option<Vec<Spanned<String>>>,
    path: Option<String>,
    exact_path: Option<bool>,
    method_overrides: Option<bool>,
    host: Option<String>,
}

/// A quota as written: a rule's own (whose `algorithm` and `limit`
/// [`RawRule`] requires, and `window` or `lease` its algorithm) or a tier's override (`[rules.tiers.NAME]`), where
/// every field is optional and falls back to the rule's ([`RawQuota::over`]).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQuota {
    algorithm: Option<Spanned<String>>,
    limit: Option<Spanned<u64>>,
    window: Option<Spanned<RawDuration>>,
    lease: Option<Spanned<RawDuration>>,
    burst: Option<Spanned<u64>>,
    mode: Option<Spanned<String>>,
    delay: Option<Spanned<u64>>,
    time_zone: Option<Spanned<String>>,
}

impl RawQuota {
    /// The rule's own quota.
    fn of(rule: &RawRule) -> Self {
        Self {
            algorithm: Some(rule.algorithm.clone()),
            limit: Some(rule.limit.clone()),
            window: rule.window.clone(),
            lease: rule.lease.clone(),
            burst: rule.burst.clone(),
            mode: rule.mode.clone(),
            delay: rule.delay.clone(),
            time_zone: rule.time_zone.clone(),
        }
    }

    /// This quota merged over `base`: each field set here wins.
    fn over(&self, base: &Self) -> Self {
        fn pick<T: Clone>(over: &Option<T>, base: &Option<T>) -> Option<T> {
            over.as_ref().or(base.as_ref()).cloned()
        }
        Self {
            algorithm: pick(&self.algorithm, &base.algorithm),
            limit: pick(&self.limit, &base.limit),
            window: pick(&self.window, &base.window),
            lease: pick(&self.lease, &base.lease),
            burst: pick(&self.burst, &base.burst),
            mode: pick(&self.mode, &base.mode),
            delay: pick(&self.delay, &base.delay),
            time_zone: pick(&self.time_zone, &base.time_zone),
        }
    }
}

/// A duration as written: a string of a number and a unit (`"1m"`), which
/// [`parse_duration`] reads when it is converted. A bare number is refused
/// as it is read, with the spellings it may have meant.
#[derive(Debug, Clone)]
struct RawDuration(String);

impl<'de> Deserialize<'de> for RawDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = RawDuration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(DURATION)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawDuration, E> {
                Ok(RawDuration(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<RawDuration, E> {
                Err(E::custom(format!(
                    "`{n}` is a number, and a duration is a string with a unit: \
                     \"{n}s\" (seconds), \"{n}m\" (minutes), \"{n}ms\" (milliseconds), ..."
                )))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<RawDuration, E> {
                self.visit_i64(i64::try_from(n).unwrap_or(i64::MAX))
            }
        }
        d.deserialize_any(Text)
    }
}

/// What a duration looks like, for the errors that expect one.
const DURATION: &str = "a duration: a string of a number and a unit, like \"500ms\", \"30s\", \"1m\", \"1h\" or \"1d\"";

/// A rule's `cost`: a number, or where to read it.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a cost: an integer of 0 or more, \"header:NAME\" to read it from a request header, or \"response:usage\" or \"response:header:NAME\" to read it from the response"
)]
enum RawCost {
    Fixed(u64),
    Header(String),
}

/// One row of a rule's `route_costs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRouteCost {
    methods: Option<Vec<Spanned<String>>>,
    path: Spanned<String>,
    cost: u64,
}

// ---- conversion --------------------------------------------------------

/// Parses a duration: an integer and a unit, `ms`, `s`, `m`, `h` or `d`
/// (`500ms`, `1m`, `24h`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{s}` is not a duration like 500ms, 30s, 1m, 1h or 1d"))?;
    let unit_ms: u64 = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "`{s}` is not a duration like 500ms, 30s, 1m, 1h or 1d"
            ));
        }
    };
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("`{s}` is too long"))
}

impl Config {
    /// Reads and validates a configuration file (and the descriptor file
    /// it names, relative to its directory).
    pub fn load(path: &Path) -> Result<Self, ConfigErrors> {
        let text = read_text(path).map_err(|(line, message)| ConfigError {
            file: Some(path.to_path_buf()),
            line,
            field: "(file)".into(),
            message,
        })?;
        Self::parse_in(&text, path.parent().unwrap_or(Path::new(""))).map_err(|e| e.in_file(path))
    }

    /// Parses and validates a configuration; a relative `descriptors_file`
    /// or `state_file` is relative to the working directory.
    pub fn parse(text: &str) -> Result<Self, ConfigErrors> {
        Self::parse_in(text, Path::new(""))
    }

    /// Parses and validates a configuration whose relative paths (the
    /// `descriptors_file`, the `state_file`) are relative to `dir`.
    pub fn parse_in(text: &str, dir: &Path) -> Result<Self, ConfigErrors> {
        let read = read::read(text)?;
        convert(read, &Text(text), dir).map_err(ConfigErrors::new)
    }
}

/// A file's text. `Err` is the line of its first byte that is not UTF-8
/// (when it could be read) and what is wrong.
fn read_text(path: &Path) -> Result<String, (Option<usize>, String)> {
    let bytes = std::fs::read(path).map_err(|e| (None, format!("cannot read: {e}")))?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        let byte = e.as_bytes()[at];
        (
            Some(line),
            format!("byte {byte:#04x} (at offset {at}) is not UTF-8 text"),
        )
    })
}

/// Converts what was read. Each section and each rule is converted on its
/// own, and their errors are gathered with the reading's; what joins them
/// (the descriptor file, the rules on Redis) is checked only once all of
/// them are right.
fn convert(read: read::Read, lines: &Text<'_>, dir: &Path) -> Result<Config, Vec<ConfigError>> {
    let mut errors = Gathered(read.errors);
    let raw = read.raw;
    let server = errors.take(convert_server(&raw.server, lines));
    let envoy_limits = errors.take(envoy_limits(&raw.envoy, lines));
    let store = errors.take(convert_store(&raw.store, dir, lines));
    let rule_on_error = rule_on_error(&raw, &read.rule_index, lines, &mut errors);
    let clients = errors.take(convert_clients(&raw.clients, lines));
    let headers = errors.take(convert_headers(&raw.headers, lines));
    let normalize = errors.take(convert_proxy(&raw.proxy, lines));
    let proxy_bounds = errors.take(convert_proxy_bounds(&raw.proxy, lines));
    let tiers = read.tiers_read.then_some(&raw.tiers);
    // A budget that gives back what is not settled in time does so, by
    // default, once a settle token would have expired.
    let settle_within = server
        .as_ref()
        .map_or(ServerConfig::SETTLE_WITHIN, |s| s.settle_within);
    let (mut rules, mut descriptors, envoy_rules) = convert_rules(
        &raw.rules,
        &read.rule_index,
        tiers,
        settle_within,
        lines,
        &mut errors,
    );
    if !errors.is_empty() {
        return Err(errors.0);
    }
    let (
        Some(server),
        Some(envoy_limits),
        Some(mut store),
        Some(clients),
        Some((headers, body)),
        Some(proxy),
        Some(proxy_bounds),
    ) = (
        server,
        envoy_limits,
        store,
        clients,
        headers,
        normalize,
        proxy_bounds,
    )
    else {
        unreachable!("a section that was not converted left an error");
    };
    store.rule_on_error = rule_on_error;
    let joined = (|| {
        let (envoy_domain, descriptor_tree) =
            convert_envoy(&raw, dir, lines, &mut rules, &mut descriptors)?;
        let mut policy = Policy::new(rules)
            .clients(clients)
            .headers(headers)
            .body(body);
        for (tier, t) in &raw.tiers {
            // A tier's name is written in logs, headers and the shared
            // tables on Redis, each on one line.
            if tier.is_empty() || tier.chars().any(char::is_control) {
                return Err(ConfigError {
                    file: None,
                    line: None,
                    field: format!("tiers.{tier:?}"),
                    message: "a tier's name must not be empty or hold a control character".into(),
                });
            }
            for key in &t.api_keys {
                policy = policy.api_key_tier(key.clone(), tier.clone());
            }
        }
        if matches!(store.kind, StoreKind::Redis(_)) {
            redis_rules(&raw, &policy, &store, lines)?;
        }
        Ok(Config {
            proxy,
            server,
            store,
            policy,
            descriptors,
            envoy_rules,
            envoy_domain: envoy_domain.unwrap_or_else(|| "spillway".to_string()),
            descriptor_tree,
            envoy_limits,
            proxy_bounds,
        })
    })();
    joined.map_err(|e| vec![e])
}

//! The configuration file: TOML, read into raw structs that mirror the file
//! ([`read`] reads each section and rule on its own), then converted once
//! into validated types ([`rules`] converts the rules). Every error names the
//! file, the line and the field, and one run reports every error it can
//! ([`ConfigErrors`]).
//!
//! `[envoy] descriptors_file` names a second file, in envoyproxy/ratelimit's
//! YAML format, whose rate limits join the rules ([`descriptors`]).

mod budget;
pub mod descriptors;
mod errors;
mod read;
mod rules;
mod source;
#[cfg(test)]
mod tests;

pub use errors::{ConfigError, ConfigErrors};
pub use source::{ConfigSource, DEFAULT_CONFIG_PATH, Overrides, SAMPLE_CONFIG, locate_config};

use errors::{Gathered, Text, not_one_of};
use rules::convert_rules;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::Path;
use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;
use spillway::Quota;
use spillway::algorithm::FixedWindow;
use spillway::store::OnFull;
use spillway_redis::{OnError, Topology};
use spillway_tower::{
    Action, BodyFormat, Clients, Credential, ForwardedHeader, HeaderOptions, HttpRule, Ipv6Prefix,
    Policy, ResetFormat,
};
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

/// What to do with `%2F` and `%5C` in a path: whether an encoded slash is
/// a slash is where upstreams differ most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    /// Forward them as they are (the default): the path `/a%2Fb` has one
    /// segment, for the rules as for most upstreams.
    #[default]
    Keep,
    /// Refuse the request with 400.
    Reject,
    /// Decode them to `/` and `\` before the rules run, and forward the
    /// decoded path (then merged and cleaned like the rest).
    Unescape,
}

impl std::str::FromStr for EscapedSlashes {
    type Err = String;

    /// `keep`, `reject` or `unescape`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" => Ok(Self::Keep),
            "reject" => Ok(Self::Reject),
            "unescape" => Ok(Self::Unescape),
            other => Err(not_one_of(other, &["keep", "reject", "unescape"])),
        }
    }
}

/// How the proxy normalizes a request target before the rules run (and
/// forwards it so). The defaults are on, as they should be in front of an
/// upstream whose router is not known.
///
/// ```
/// use spillway_server::config::{EscapedSlashes, Normalize};
///
/// let normalize = Normalize::default();
/// assert!(normalize.path && normalize.merge_slashes);
/// assert_eq!(normalize.escaped_slashes, EscapedSlashes::Keep);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Normalize {
    /// Decode percent-encoded unreserved characters and remove dot
    /// segments (Envoy's `normalize_path`). Default on.
    pub path: bool,
    /// Merge runs of `/` (Envoy's `merge_slashes`). Default on.
    pub merge_slashes: bool,
    /// What to do with `%2F` and `%5C`. Default: keep them.
    pub escaped_slashes: EscapedSlashes,
    /// Pass on request headers whose names hold `_` (nginx's
    /// `underscores_in_headers`). Default off: they are dropped, as nginx
    /// drops them, because CGI and WSGI upstreams read `X_Api_Key` and
    /// `X-Api-Key` as one header (`HTTP_X_API_KEY`), which the rules do not.
    /// When on, those that fold onto a header the proxy writes or reads
    /// (the forwarding headers, the degrade marker) are dropped all the same.
    pub underscores_in_headers: bool,
}

impl Default for Normalize {
    fn default() -> Self {
        Self {
            path: true,
            merge_slashes: true,
            escaped_slashes: EscapedSlashes::Keep,
            underscores_in_headers: false,
        }
    }
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The HTTP API's address.
    pub listen: SocketAddr,
    /// The Envoy rate limit gRPC API's address, if served.
    pub grpc_listen: Option<SocketAddr>,
    /// The admin API's bearer token (the file's, or `SPILLWAY_ADMIN_TOKEN`);
    /// without one the admin API is off.
    pub admin_token: Option<String>,
    /// The bearer tokens `POST /v1/check` accepts (the file's
    /// `check_tokens`, or `SPILLWAY_CHECK_TOKENS`, comma-separated); any
    /// one of them will do, so that a new token can be rolled out before
    /// the old one is removed. Empty: the endpoint is open to anyone who
    /// can reach the address.
    pub check_tokens: Vec<String>,
    /// The longest a client may take to send a whole request head, idle
    /// keep-alive time included, and an HTTP/2 client its connection
    /// preface.
    pub head_timeout: Duration,
    /// The longest a client may take to send a whole request body, from the
    /// end of its head.
    pub body_timeout: Duration,
    /// The longest a response may take to be written: a client that does
    /// not read is closed after it.
    pub write_timeout: Duration,
    /// How long an HTTP/2 connection may stay open with no request on it.
    pub idle_timeout: Duration,
    /// The most client connections open at once; one more is answered 503
    /// and closed at once.
    pub max_connections: NonZeroUsize,
    /// The longest a stopping server waits for its requests in flight
    /// (SIGTERM to exit): past it, the connections still open are closed
    /// and the process exits, so that a stuck client cannot hold it.
    pub drain_timeout: Duration,
    /// The key that signs the settle tokens `POST /v1/check` hands out for
    /// budget rules (the file's `settle_key`, or `SPILLWAY_SETTLE_KEY`):
    /// instances that share it settle each other's tokens. `None`: a key
    /// drawn at start, good for this process only.
    pub settle_key: Option<String>,
    /// How long a settle token is good for (`settle_within`, default 5
    /// minutes, at most 10): a reservation not settled by then stands.
    pub settle_within: Duration,
}

impl ServerConfig {
    /// The default of [`head_timeout`](Self::head_timeout).
    pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
    /// The default of [`body_timeout`](Self::body_timeout).
    pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
    /// The default of [`write_timeout`](Self::write_timeout).
    pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
    /// The default of [`idle_timeout`](Self::idle_timeout).
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// The default of [`max_connections`](Self::max_connections): well
    /// under the 65,536 file descriptors a service is commonly given
    /// (systemd's `LimitNOFILE`), each connection taking one.
    pub const MAX_CONNECTIONS: NonZeroUsize = NonZeroUsize::new(10_000).expect("nonzero");
    /// The default of [`drain_timeout`](Self::drain_timeout): under the
    /// 30 s a supervisor commonly waits before SIGKILL (Kubernetes'
    /// `terminationGracePeriodSeconds`).
    pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(20);
    /// The default of [`settle_within`](Self::settle_within).
    pub const SETTLE_WITHIN: Duration = Duration::from_secs(300);
}

/// `[envoy]`'s bounds on one `ShouldRateLimit` call, refused whole
/// (`INVALID_ARGUMENT`) past them before any work is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyLimits {
    /// The most descriptors in one call (Envoy sends a handful).
    pub max_descriptors: NonZeroUsize,
    /// The most entries in one descriptor.
    pub max_entries: NonZeroUsize,
}

impl EnvoyLimits {
    /// The largest call message read: room for the most descriptors of the
    /// most entries at 256 bytes an entry, and never less than 64 KiB or
    /// more than tonic's default of 4 MiB. The defaults give 256 KiB.
    ///
    /// ```
    /// use spillway_server::config::EnvoyLimits;
    ///
    /// assert_eq!(EnvoyLimits::default().max_message_bytes(), 256 * 1024);
    /// ```
    pub fn max_message_bytes(&self) -> usize {
        self.max_descriptors
            .get()
            .saturating_mul(self.max_entries.get())
            .saturating_mul(256)
            .clamp(64 * 1024, 4 * 1024 * 1024)
    }
}

impl Default for EnvoyLimits {
    fn default() -> Self {
        Self {
            max_descriptors: NonZeroUsize::new(64).expect("nonzero"),
            max_entries: NonZeroUsize::new(16).expect("nonzero"),
        }
    }
}

/// `[proxy]`'s bounds on what clients may hold at once: HTTP/2 clients
/// carry many requests on one connection, each of which needs an upstream
/// connection of its own (the upstream speaks HTTP/1.1), and a shaping
/// bucket holds its requests for their turn.
///
/// ```
/// use spillway_server::config::ProxyBounds;
///
/// let bounds = ProxyBounds::default();
/// assert!(bounds.http2);
/// assert_eq!(bounds.http2_max_streams.get(), 100);
/// assert_eq!(bounds.pool_max_connections.get(), 1_000);
/// assert_eq!(bounds.max_held.get(), 10_000);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyBounds {
    /// Whether HTTP/2 clients (prior knowledge) are served at all. Default
    /// on.
    pub http2: bool,
    /// The most requests one HTTP/2 connection may have open at once (sent
    /// as `SETTINGS_MAX_CONCURRENT_STREAMS`). Default 100.
    pub http2_max_streams: NonZeroU32,
    /// The most upstream connections HTTP/2 clients' requests share, all
    /// clients together. Default 1,000.
    pub pool_max_connections: NonZeroUsize,
    /// The most requests held for their shaping turn (leaky bucket, `mode
    /// = "shape"`) at once, all rules and clients together; one more is
    /// answered 503. Default 10,000.
    pub max_held: NonZeroUsize,
}

impl Default for ProxyBounds {
    fn default() -> Self {
        Self {
            http2: true,
            http2_max_streams: NonZeroU32::new(100).expect("nonzero"),
            pool_max_connections: NonZeroUsize::new(1_000).expect("nonzero"),
            max_held: NonZeroUsize::new(10_000).expect("nonzero"),
        }
    }
}

/// `[store]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// In memory, or Redis.
    pub kind: StoreKind,
    /// The longest a store call may take.
    pub timeout: Duration,
    /// What to do when Redis cannot answer.
    pub on_error: OnError,
    /// The rules with a failure policy of their own (`[[rules]] on_error`),
    /// by store rule name: the rule's, and each of its tiers'
    /// (`rule@tier`).
    pub rule_on_error: BTreeMap<String, OnError>,
    /// The most keys held per rule in memory.
    pub max_keys: NonZeroUsize,
    /// What a full in-memory table does with a new key.
    pub on_full: OnFull,
    /// The most bytes the in-memory store holds, all rules together
    /// (`MemoryOptions::max_memory`): [`DEFAULT_MAX_MEMORY`] unless set;
    /// none with Redis, or when set to `"none"`.
    pub max_memory: Option<NonZeroUsize>,
}

/// `[store] max_memory` when the file does not set it, for the in-memory
/// store: 256 MiB. A flood of distinct keys over every rule then grows the
/// process by at most about 336 MiB (`max_memory` + 25% + 16 MiB, the
/// bound docs/server.md states), where `max_keys` alone let each rule
/// take 50 MB (short keys) to a gigabyte (keys of 1 KiB); at about 100
/// bytes a key it holds some 2.5 million keys in all, `max_keys` for one
/// or two rules.
///
/// ```
/// use spillway_server::config::{Config, DEFAULT_MAX_MEMORY};
///
/// let config = Config::parse("").unwrap();
/// assert_eq!(config.store.max_memory, Some(DEFAULT_MAX_MEMORY));
/// let config = Config::parse("[store]\nmax_memory = \"1GiB\"\n").unwrap();
/// assert_eq!(config.store.max_memory.unwrap().get(), 1 << 30);
/// ```
pub const DEFAULT_MAX_MEMORY: NonZeroUsize = NonZeroUsize::new(256 << 20).expect("nonzero");

/// Where the counters live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreKind {
    /// This process's memory.
    Memory,
    /// Redis or Redis Cluster.
    Redis(Topology),
}

// ---- the file, as written ----------------------------------------------

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

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawProxy {
    http2: Option<bool>,
    http2_max_streams: Option<Spanned<u64>>,
    pool_max_connections: Option<Spanned<u64>>,
    max_held: Option<Spanned<u64>>,
    normalize_path: Option<bool>,
    merge_slashes: Option<bool>,
    escaped_slashes: Option<Spanned<String>>,
    underscores_in_headers: Option<bool>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<Spanned<String>>,
    grpc_listen: Option<Spanned<String>>,
    admin_token: Option<String>,
    check_tokens: Option<Spanned<Vec<String>>>,
    head_timeout: Option<Spanned<RawDuration>>,
    body_timeout: Option<Spanned<RawDuration>>,
    write_timeout: Option<Spanned<RawDuration>>,
    idle_timeout: Option<Spanned<RawDuration>>,
    max_connections: Option<Spanned<u64>>,
    drain_timeout: Option<Spanned<RawDuration>>,
    settle_key: Option<Spanned<String>>,
    settle_within: Option<Spanned<RawDuration>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawStore {
    kind: Option<Spanned<String>>,
    url: Option<Spanned<RawUrl>>,
    timeout: Option<Spanned<RawDuration>>,
    on_error: Option<Spanned<String>>,
    instances: Option<NonZeroU32>,
    max_keys: Option<NonZeroUsize>,
    on_full: Option<Spanned<String>>,
    max_memory: Option<Spanned<RawSize>>,
}

/// A size in bytes: a number, or a string with a unit (`"64MiB"`).
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a size: a number of bytes, or a string like \"64MiB\" or \"none\""
)]
enum RawSize {
    Bytes(i64),
    Fraction(f64),
    Text(String),
}

/// `[store] url`: one Redis, or a cluster's nodes.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a redis:// URL, or a list of them (a cluster's nodes)"
)]
enum RawUrl {
    One(String),
    Cluster(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaders {
    #[serde(default = "yes")]
    legacy: bool,
    #[serde(default = "yes")]
    ietf: bool,
    reset: Option<Spanned<String>>,
    body: Option<Spanned<String>>,
}

impl Default for RawHeaders {
    fn default() -> Self {
        Self {
            legacy: true,
            ietf: true,
            reset: None,
            body: None,
        }
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawClients {
    #[serde(default)]
    trusted_proxies: Vec<Spanned<String>>,
    api_key: Option<Spanned<OneOrMany>>,
    api_key_header: Option<Spanned<String>>,
    user_header: Option<Spanned<String>>,
    tier_header: Option<Spanned<String>>,
    forwarded_header: Option<Spanned<String>>,
    ipv6_prefix: Option<Spanned<i64>>,
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

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawEnvoy {
    domain: Option<Spanned<String>>,
    descriptors_file: Option<Spanned<String>>,
    max_descriptors: Option<Spanned<u64>>,
    max_entries: Option<Spanned<u64>>,
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
    window: Spanned<RawDuration>,
    burst: Option<Spanned<u64>>,
    mode: Option<Spanned<String>>,
    delay: Option<Spanned<u64>>,
    cost: Option<Spanned<RawCost>>,
    route_costs: Option<Spanned<Vec<Spanned<RawRouteCost>>>>,
    reserve: Option<Spanned<budget::RawReserve>>,
    reserve_default: Option<Spanned<u64>>,
    max_reserve: Option<Spanned<u64>>,
    on_overrun: Option<Spanned<String>>,
    release_on_5xx: Option<Spanned<bool>>,
    action: Option<Spanned<String>>,
    on_error: Option<Spanned<String>>,
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

/// A quota as written: a rule's own (whose `algorithm`, `limit` and `window`
/// [`RawRule`] requires) or a tier's override (`[rules.tiers.NAME]`), where
/// every field is optional and falls back to the rule's ([`RawQuota::over`]).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQuota {
    algorithm: Option<Spanned<String>>,
    limit: Option<Spanned<u64>>,
    window: Option<Spanned<RawDuration>>,
    burst: Option<Spanned<u64>>,
    mode: Option<Spanned<String>>,
    delay: Option<Spanned<u64>>,
}

impl RawQuota {
    /// The rule's own quota.
    fn of(rule: &RawRule) -> Self {
        Self {
            algorithm: Some(rule.algorithm.clone()),
            limit: Some(rule.limit.clone()),
            window: Some(rule.window.clone()),
            burst: rule.burst.clone(),
            mode: rule.mode.clone(),
            delay: rule.delay.clone(),
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
            burst: pick(&self.burst, &base.burst),
            mode: pick(&self.mode, &base.mode),
            delay: pick(&self.delay, &base.delay),
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

/// Parses a size in bytes: an integer and an optional unit, `B`, `KiB`,
/// `MiB`, `GiB` (powers of 1024) or `KB`, `MB`, `GB` (powers of 1000), in
/// any case, with or without a space (`64MiB`, `512 MB`, `1048576`).
///
/// ```
/// use spillway_server::config::parse_size;
/// assert_eq!(parse_size("64MiB"), Ok(64 << 20));
/// assert_eq!(parse_size("1 gb"), Ok(1_000_000_000));
/// assert!(parse_size("64 MiB of RAM").is_err());
/// ```
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let bad = || format!("`{s}` is not a size like 64MiB, 512MB or 1GiB");
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let unit: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => return Err(bad()),
    };
    n.checked_mul(unit)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// The least `[store] max_memory`: below it a shard's share could not hold
/// a few long keys.
const MIN_MAX_MEMORY: u64 = 1 << 20;

/// `[store] max_memory`.
fn max_memory_of(
    raw: &RawStore,
    kind: &StoreKind,
    lines: &Text<'_>,
) -> Result<Option<NonZeroUsize>, ConfigError> {
    let Some(v) = &raw.max_memory else {
        return Ok(matches!(kind, StoreKind::Memory).then_some(DEFAULT_MAX_MEMORY));
    };
    let field = "store.max_memory";
    let bytes = match v.get_ref() {
        // Unbounded, as before the default: only `max_keys` bounds the
        // store (for a host that gives the process the memory anyway).
        RawSize::Text(t) if t.trim() == "none" => return Ok(None),
        RawSize::Bytes(n) => u64::try_from(*n)
            .map_err(|_| lines.err(v, field, format!("{n} is not a size: at least 1MiB")))?,
        RawSize::Fraction(x) => {
            return Err(lines.err(
                v,
                field,
                format!("{x} is not a whole number of bytes: write \"64MiB\""),
            ));
        }
        RawSize::Text(t) => parse_size(t).map_err(|m| lines.err(v, field, m))?,
    };
    if bytes < MIN_MAX_MEMORY {
        return Err(lines.err(
            v,
            field,
            format!("{bytes} bytes is too little: at least 1MiB"),
        ));
    }
    if matches!(kind, StoreKind::Redis(_)) {
        return Err(lines.err(
            v,
            field,
            "bounds the in-memory store; with kind = \"redis\" the counters are in Redis",
        ));
    }
    let bytes = usize::try_from(bytes).map_err(|_| lines.err(v, field, "too large"))?;
    Ok(NonZeroUsize::new(bytes))
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
    /// is relative to the working directory.
    pub fn parse(text: &str) -> Result<Self, ConfigErrors> {
        Self::parse_in(text, Path::new(""))
    }

    /// Parses and validates a configuration whose relative paths (the
    /// `descriptors_file`) are relative to `dir`.
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
    let store = errors.take(convert_store(&raw.store, lines));
    let rule_on_error = rule_on_error(&raw, &read.rule_index, lines, &mut errors);
    let clients = errors.take(convert_clients(&raw.clients, lines));
    let headers = errors.take(convert_headers(&raw.headers, lines));
    let normalize = errors.take(convert_proxy(&raw.proxy, lines));
    let proxy_bounds = errors.take(convert_proxy_bounds(&raw.proxy, lines));
    let tiers = read.tiers_read.then_some(&raw.tiers);
    let (mut rules, mut descriptors) =
        convert_rules(&raw.rules, &read.rule_index, tiers, lines, &mut errors);
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
            envoy_domain: envoy_domain.unwrap_or_else(|| "spillway".to_string()),
            descriptor_tree,
            envoy_limits,
            proxy_bounds,
        })
    })();
    joined.map_err(|e| vec![e])
}

/// Each store rule as the Redis store can run it: one it refuses (a limit
/// it cannot decide exactly, or quickly, or share among the instances of a
/// `local` failure policy) is an error at its rule's `limit`.
fn redis_rules(
    raw: &RawConfig,
    policy: &Policy,
    store: &StoreConfig,
    lines: &Text<'_>,
) -> Result<(), ConfigError> {
    for rule in policy.store_rules() {
        let on_error = store
            .rule_on_error
            .get(rule.name())
            .copied()
            .unwrap_or(store.on_error);
        let limit = spillway::Algorithm::quota(rule.algorithm()).limit();
        let message = match (spillway_redis::check_rule(&rule), on_error) {
            (Err(error), _) => format!("on Redis, {error}"),
            (Ok(()), OnError::Local { instances }) if limit < instances => format!(
                "`{}`: a limit of {limit} cannot be shared by {instances} instances \
                 (on_error = \"local\" gives each instance limit / instances); \
                 use fail_closed or fail_open for this rule",
                rule.name()
            ),
            (Ok(()), _) => continue,
        };
        // A tier's store rule is `rule@tier`.
        let base = rule.name().split('@').next().unwrap_or_default();
        let found = raw
            .rules
            .iter()
            .enumerate()
            .find(|(_, r)| r.get_ref().name.get_ref().trim() == base);
        return Err(match found {
            Some((i, r)) => lines.err(&r.get_ref().limit, format!("rules[{i}].limit"), message),
            None => ConfigError {
                file: None,
                line: None,
                field: "rules".into(),
                message,
            },
        });
    }
    Ok(())
}

/// `[server]`.
fn convert_server(raw: &RawServer, lines: &Text<'_>) -> Result<ServerConfig, ConfigError> {
    let addr = |v: &Spanned<String>, field: &str| {
        v.get_ref().parse::<SocketAddr>().map_err(|_| {
            lines.err(
                v,
                field,
                format!("`{}` is not an address like 127.0.0.1:8080", v.get_ref()),
            )
        })
    };
    Ok(ServerConfig {
        listen: match &raw.listen {
            Some(v) => addr(v, "server.listen")?,
            None => "127.0.0.1:8080".parse().expect("a valid address"),
        },
        grpc_listen: raw
            .grpc_listen
            .as_ref()
            .map(|v| addr(v, "server.grpc_listen"))
            .transpose()?,
        admin_token: std::env::var("SPILLWAY_ADMIN_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .or(raw.admin_token.clone())
            .filter(|t| !t.is_empty()),
        check_tokens: check_tokens(raw.check_tokens.as_ref(), lines)?,
        head_timeout: timeout(
            &raw.head_timeout,
            "server.head_timeout",
            ServerConfig::HEAD_TIMEOUT,
            lines,
        )?,
        body_timeout: timeout(
            &raw.body_timeout,
            "server.body_timeout",
            ServerConfig::BODY_TIMEOUT,
            lines,
        )?,
        write_timeout: timeout(
            &raw.write_timeout,
            "server.write_timeout",
            ServerConfig::WRITE_TIMEOUT,
            lines,
        )?,
        idle_timeout: timeout(
            &raw.idle_timeout,
            "server.idle_timeout",
            ServerConfig::IDLE_TIMEOUT,
            lines,
        )?,
        max_connections: match &raw.max_connections {
            None => ServerConfig::MAX_CONNECTIONS,
            Some(n) => usize::try_from(*n.get_ref())
                .ok()
                .and_then(NonZeroUsize::new)
                .filter(|n| n.get() <= 1_000_000)
                .ok_or_else(|| {
                    lines.err(n, "server.max_connections", "must be between 1 and 1000000")
                })?,
        },
        drain_timeout: timeout(
            &raw.drain_timeout,
            "server.drain_timeout",
            ServerConfig::DRAIN_TIMEOUT,
            lines,
        )?,
        settle_key: budget::settle_key(raw.settle_key.as_ref(), lines)?,
        settle_within: budget::settle_within(raw.settle_within.as_ref(), lines)?,
    })
}

/// `[clients]`.
fn convert_clients(raw: &RawClients, lines: &Text<'_>) -> Result<Clients, ConfigError> {
    let header = |v: &Spanned<String>, field: &str| {
        HeaderName::try_from(v.get_ref().as_str())
            .map_err(|_| lines.err(v, field, format!("`{}` is not a header name", v.get_ref())))
    };
    let mut clients = Clients::default();
    for (i, p) in raw.trusted_proxies.iter().enumerate() {
        let s = p.get_ref();
        let net = s
            .parse::<ipnet::IpNet>()
            .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                lines.err(
                    p,
                    format!("clients.trusted_proxies[{i}]"),
                    format!("`{s}` is not an address or CIDR"),
                )
            })?;
        clients.trusted_proxies.push(net);
    }
    match (&raw.api_key, &raw.api_key_header) {
        (Some(_), Some(h)) => {
            return Err(lines.err(
                h,
                "clients.api_key_header",
                "set `clients.api_key` alone: it names every place API keys come from",
            ));
        }
        (Some(places), None) => {
            let names = match places.get_ref() {
                OneOrMany::One(name) => std::slice::from_ref(name),
                OneOrMany::Many(names) => names.as_slice(),
            };
            if names.is_empty() {
                return Err(lines.err(
                    places,
                    "clients.api_key",
                    "name where API keys come from: \"bearer\", \"header:x-api-key\", ...",
                ));
            }
            clients.api_key = names
                .iter()
                .map(|name| Credential::parse(name))
                .collect::<Result<_, _>>()
                .map_err(|m| lines.err(places, "clients.api_key", m))?;
        }
        // The older spelling: this header, or `Authorization: Bearer`.
        (None, Some(h)) => {
            clients.api_key = vec![
                Credential::Header(header(h, "clients.api_key_header")?),
                Credential::bearer(),
            ];
        }
        (None, None) => {}
    }
    clients.user_header = raw
        .user_header
        .as_ref()
        .map(|h| header(h, "clients.user_header"))
        .transpose()?;
    clients.tier_header = raw
        .tier_header
        .as_ref()
        .map(|h| header(h, "clients.tier_header"))
        .transpose()?;
    if let Some(h) = &raw.forwarded_header {
        clients.forwarded_header = match h.get_ref().to_ascii_lowercase().as_str() {
            "x-forwarded-for" => ForwardedHeader::XForwardedFor,
            "forwarded" => ForwardedHeader::Forwarded,
            other => {
                return Err(lines.err(
                    h,
                    "clients.forwarded_header",
                    format!(
                        "{} (the header your proxies write)",
                        not_one_of(other, &["x-forwarded-for", "forwarded"])
                    ),
                ));
            }
        };
    }
    if let Some(p) = &raw.ipv6_prefix {
        clients.ipv6_prefix = u8::try_from(*p.get_ref())
            .ok()
            .and_then(Ipv6Prefix::new)
            .ok_or_else(|| {
                lines.err(
                    p,
                    "clients.ipv6_prefix",
                    format!(
                        "`{}`: must be between 1 and 128 (the bits of an IPv6 client's address its key keeps)",
                        p.get_ref()
                    ),
                )
            })?;
    }
    Ok(clients)
}

/// `[headers]`: which fields, and the 429's body.
fn convert_headers(
    raw: &RawHeaders,
    lines: &Text<'_>,
) -> Result<(HeaderOptions, BodyFormat), ConfigError> {
    let mut headers = HeaderOptions {
        legacy: raw.legacy,
        ietf: raw.ietf,
        reset: ResetFormat::Unix,
    };
    if let Some(r) = &raw.reset {
        headers.reset = match r.get_ref().as_str() {
            "unix" => ResetFormat::Unix,
            "delta" => ResetFormat::Delta,
            other => {
                return Err(lines.err(r, "headers.reset", not_one_of(other, &["unix", "delta"])));
            }
        };
    }
    let body = match &raw.body {
        None => BodyFormat::Problem,
        Some(b) => match b.get_ref().as_str() {
            "problem" => BodyFormat::Problem,
            "quota-exceeded" => BodyFormat::QuotaExceeded,
            "json" => BodyFormat::Json,
            "text" => BodyFormat::Text,
            "empty" => BodyFormat::Empty,
            other => {
                return Err(lines.err(
                    b,
                    "headers.body",
                    not_one_of(
                        other,
                        &["problem", "quota-exceeded", "json", "text", "empty"],
                    ),
                ));
            }
        },
    };
    Ok((headers, body))
}

/// `[envoy]`: the domain, and the descriptor file's rate limits, which
/// join the rules (by name only).
fn convert_envoy(
    raw: &RawConfig,
    dir: &Path,
    lines: &Text<'_>,
    rules: &mut Vec<HttpRule>,
    descriptors: &mut Vec<Vec<String>>,
) -> Result<(Option<String>, Option<descriptors::DescriptorTree>), ConfigError> {
    let envoy_domain = raw.envoy.domain.as_ref().map(|d| d.get_ref().clone());
    Ok(match &raw.envoy.descriptors_file {
        None => (envoy_domain, None),
        Some(path) => {
            let file = descriptor_file(path, dir, raw.envoy.domain.as_ref(), &raw.rules, lines)?;
            for r in &file.rules {
                let quota = Quota::new(r.limit.requests_per_unit, r.limit.unit.duration())
                    .map_err(|e| file_error(&file.path, r, e.to_string()))?;
                let action = if r.shadow {
                    Action::Shadow
                } else {
                    Action::Reject
                };
                // For Envoy's descriptors only, as in envoyproxy/ratelimit:
                // never applied to HTTP requests (the middleware, the proxy,
                // `POST /v1/check` with a request description).
                rules.push(
                    HttpRule::new(r.name.clone(), FixedWindow::new(quota))
                        .action(action)
                        .by_name_only(),
                );
                descriptors.push(Vec::new());
            }
            (Some(file.domain), Some(file.tree))
        }
    })
}

/// `[proxy]`: how the proxy normalizes a request's target.
fn convert_proxy(raw: &RawProxy, lines: &Text<'_>) -> Result<Normalize, ConfigError> {
    let defaults = Normalize::default();
    Ok(Normalize {
        path: raw.normalize_path.unwrap_or(defaults.path),
        merge_slashes: raw.merge_slashes.unwrap_or(defaults.merge_slashes),
        escaped_slashes: match &raw.escaped_slashes {
            Some(v) => v
                .get_ref()
                .parse()
                .map_err(|m| lines.err(v, "proxy.escaped_slashes", m))?,
            None => defaults.escaped_slashes,
        },
        underscores_in_headers: raw
            .underscores_in_headers
            .unwrap_or(defaults.underscores_in_headers),
    })
}

/// `[proxy]`: what the proxy's clients may hold at once.
fn convert_proxy_bounds(raw: &RawProxy, lines: &Text<'_>) -> Result<ProxyBounds, ConfigError> {
    let defaults = ProxyBounds::default();
    // A count of 1 to `max`, or an error naming the field.
    let within = |n: &Spanned<u64>, field: &str, max: u64| {
        Some(*n.get_ref())
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| lines.err(n, field, format!("must be between 1 and {max}")))
    };
    let count = |n: &Option<Spanned<u64>>, field: &str, default: NonZeroUsize| match n {
        None => Ok(default),
        Some(n) => {
            let n = within(n, field, 1_000_000)?;
            Ok(NonZeroUsize::new(n as usize).expect("between 1 and 1,000,000"))
        }
    };
    Ok(ProxyBounds {
        http2: raw.http2.unwrap_or(defaults.http2),
        http2_max_streams: match &raw.http2_max_streams {
            None => defaults.http2_max_streams,
            Some(n) => {
                let n = within(n, "proxy.http2_max_streams", 10_000)?;
                NonZeroU32::new(n as u32).expect("between 1 and 10,000")
            }
        },
        pool_max_connections: count(
            &raw.pool_max_connections,
            "proxy.pool_max_connections",
            defaults.pool_max_connections,
        )?,
        max_held: count(&raw.max_held, "proxy.max_held", defaults.max_held)?,
    })
}

/// The `[server] check_tokens`, or `SPILLWAY_CHECK_TOKENS` (comma-separated)
/// when set, which wins as `SPILLWAY_ADMIN_TOKEN` does. An empty token would
/// let an empty `Authorization: Bearer` through: it is an error in the file,
/// and skipped in the variable (`a,,b`).
fn check_tokens(
    raw: Option<&Spanned<Vec<String>>>,
    lines: &Text<'_>,
) -> Result<Vec<String>, ConfigError> {
    if let Ok(env) = std::env::var("SPILLWAY_CHECK_TOKENS") {
        let tokens: Vec<String> = env
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect();
        if !tokens.is_empty() {
            return Ok(tokens);
        }
    }
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    for (i, token) in raw.get_ref().iter().enumerate() {
        if token.trim().is_empty() {
            return Err(lines.err(
                raw,
                format!("server.check_tokens[{i}]"),
                "must not be empty",
            ));
        }
        if token.trim() != token || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(lines.err(
                raw,
                format!("server.check_tokens[{i}]"),
                "must be printable ASCII without spaces (a bearer token)",
            ));
        }
    }
    Ok(raw.get_ref().clone())
}

/// A `[server]` timeout: longer than zero, at most an hour.
fn timeout(
    raw: &Option<Spanned<RawDuration>>,
    field: &str,
    default: Duration,
    lines: &Text<'_>,
) -> Result<Duration, ConfigError> {
    let Some(t) = raw else {
        return Ok(default);
    };
    let d = parse_duration(&t.get_ref().0).map_err(|m| lines.err(t, field, m))?;
    if d.is_zero() || d > Duration::from_secs(3600) {
        return Err(lines.err(t, field, "must be longer than zero and at most 1h"));
    }
    Ok(d)
}

/// `[envoy] max_descriptors` (1 to 10,000) and `max_entries` (1 to 1,000).
fn envoy_limits(raw: &RawEnvoy, lines: &Text<'_>) -> Result<EnvoyLimits, ConfigError> {
    let bounded = |v: &Option<Spanned<u64>>, field: &str, max: usize, default: NonZeroUsize| {
        let Some(v) = v else {
            return Ok(default);
        };
        usize::try_from(*v.get_ref())
            .ok()
            .and_then(NonZeroUsize::new)
            .filter(|n| n.get() <= max)
            .ok_or_else(|| lines.err(v, field, format!("must be between 1 and {max}")))
    };
    let default = EnvoyLimits::default();
    Ok(EnvoyLimits {
        max_descriptors: bounded(
            &raw.max_descriptors,
            "envoy.max_descriptors",
            10_000,
            default.max_descriptors,
        )?,
        max_entries: bounded(
            &raw.max_entries,
            "envoy.max_entries",
            1_000,
            default.max_entries,
        )?,
    })
}

/// Reads and converts `[envoy] descriptors_file` (named by `path`, relative
/// to `dir`), whose rules will follow the TOML file's `rules`, and checks it
/// against the TOML file: the same domain as `domain` if set, no rule name
/// twice.
fn descriptor_file(
    path: &Spanned<String>,
    dir: &Path,
    domain: Option<&Spanned<String>>,
    rules: &[Spanned<RawRule>],
    lines: &Text<'_>,
) -> Result<descriptors::DescriptorFile, ConfigError> {
    let resolved = descriptors::resolve(path.get_ref(), dir);
    let text = read_text(&resolved).map_err(|(line, message)| match line {
        // Read, but not text: where, in that file.
        Some(line) => ConfigError {
            file: Some(resolved.clone()),
            line: Some(line),
            field: "(file)".into(),
            message,
        },
        None => lines.err(
            path,
            "envoy.descriptors_file",
            format!("`{}`: {message}", resolved.display()),
        ),
    })?;
    let file = descriptors::DescriptorFile::parse(&text, &resolved, rules.len())?;
    if let Some(domain) = domain
        && *domain.get_ref() != file.domain
    {
        return Err(lines.err(
            domain,
            "envoy.domain",
            format!(
                "`{}` is not the domain of `{}` (`{}`{}): set the same, or leave this one out",
                domain.get_ref(),
                resolved.display(),
                file.domain,
                file.domain_line
                    .map(|l| format!(", line {l}"))
                    .unwrap_or_default(),
            ),
        ));
    }
    // Every store rule of the TOML file by name: the rules, and their tiers'
    // quotas (`rule@tier`).
    let mut taken = std::collections::HashMap::new();
    for (i, spanned) in rules.iter().enumerate() {
        let r = spanned.get_ref();
        let name = r.name.get_ref().trim();
        let line = lines.line(r.name.span().start);
        taken.insert(name.to_string(), (format!("rules[{i}]"), line));
        for tier in r.tiers.keys() {
            taken.insert(
                format!("{name}@{}", tier.get_ref()),
                (
                    format!("rules[{i}].tiers.{}", tier.get_ref()),
                    lines.line(tier.span().start),
                ),
            );
        }
    }
    for r in &file.rules {
        if r.name
            .starts_with(crate::config::descriptors::OVERRIDE_PREFIX)
        {
            return Err(file_error(
                &file.path,
                r,
                format!(
                    "`{}`: names starting with `{}` are the Envoy service's, for limit overrides",
                    r.name,
                    crate::config::descriptors::OVERRIDE_PREFIX
                ),
            ));
        }
        if let Some((field, line)) = taken.get(&r.name) {
            return Err(file_error(
                &file.path,
                r,
                format!(
                    "`{}` is also the name of `{field}` (line {line} of the configuration file): rule names must be unique",
                    r.name
                ),
            ));
        }
    }
    Ok(file)
}

/// An error about rule `rule` of the descriptor file `path`.
fn file_error(path: &Path, rule: &descriptors::FileRule, message: String) -> ConfigError {
    ConfigError {
        file: Some(path.to_path_buf()),
        line: rule.line,
        field: rule.field.clone(),
        message,
    }
}

/// `[store] kind` and `url`: in memory, or a Redis server or cluster.
fn store_kind(raw: &RawStore, lines: &Text<'_>) -> Result<StoreKind, ConfigError> {
    Ok(match raw.kind.as_ref().map(|k| (k, k.get_ref().as_str())) {
        None | Some((_, "memory")) => StoreKind::Memory,
        Some((k, "redis")) => {
            let url = raw
                .url
                .as_ref()
                .ok_or_else(|| lines.err(k, "store.url", "is required when kind = \"redis\""))?;
            let check = |u: &str| {
                if u.starts_with("redis://") || u.starts_with("rediss://") {
                    Ok(u.to_string())
                } else {
                    Err(lines.err(url, "store.url", format!("`{u}` is not a redis:// URL")))
                }
            };
            StoreKind::Redis(match url.get_ref() {
                RawUrl::One(u) => Topology::Standalone(check(u)?),
                RawUrl::Cluster(nodes) => {
                    if nodes.is_empty() {
                        return Err(lines.err(url, "store.url", "lists no cluster node"));
                    }
                    Topology::Cluster(nodes.iter().map(|u| check(u)).collect::<Result<_, _>>()?)
                }
            })
        }
        Some((k, other)) => {
            return Err(lines.err(k, "store.kind", not_one_of(other, &["memory", "redis"])));
        }
    })
}

/// `[store]`.
fn convert_store(raw: &RawStore, lines: &Text<'_>) -> Result<StoreConfig, ConfigError> {
    let timeout = match &raw.timeout {
        Some(t) => {
            let d = parse_duration(&t.get_ref().0).map_err(|m| lines.err(t, "store.timeout", m))?;
            if d.is_zero() {
                return Err(lines.err(t, "store.timeout", "must be longer than zero"));
            }
            d
        }
        None => Duration::from_millis(50),
    };
    let on_error = match &raw.on_error {
        None => OnError::FailOpen,
        Some(v) => on_error_of(v, "store.on_error", raw, lines)?,
    };
    let kind = store_kind(raw, lines)?;
    let max_memory = max_memory_of(raw, &kind, lines)?;
    let on_full = match &raw.on_full {
        None => OnFull::Evict,
        Some(v) => match v.get_ref().as_str() {
            "evict" => OnFull::Evict,
            "deny_new" => OnFull::DenyNew,
            other => {
                return Err(lines.err(
                    v,
                    "store.on_full",
                    not_one_of(other, &["evict", "deny_new"]),
                ));
            }
        },
    };
    Ok(StoreConfig {
        kind,
        timeout,
        on_error,
        rule_on_error: BTreeMap::new(),
        on_full,
        max_memory,
        max_keys: raw
            .max_keys
            .unwrap_or(NonZeroUsize::new(1_000_000).expect("nonzero")),
    })
}

/// A failure policy: `fail_open`, `fail_closed`, or `local` (each instance
/// its share of `[store] instances`).
fn on_error_of(
    v: &Spanned<String>,
    field: &str,
    store: &RawStore,
    lines: &Text<'_>,
) -> Result<OnError, ConfigError> {
    Ok(match v.get_ref().as_str() {
        "fail_open" => OnError::FailOpen,
        "fail_closed" => OnError::FailClosed,
        "local" => OnError::Local {
            instances: store.instances.unwrap_or(NonZeroU32::MIN),
        },
        other => {
            return Err(lines.err(
                v,
                field,
                not_one_of(other, &["fail_open", "fail_closed", "local"]),
            ));
        }
    })
}

/// Each rule's own failure policy (`[[rules]] on_error`), for its store
/// rules: its own and its tiers'.
fn rule_on_error(
    raw: &RawConfig,
    rule_index: &[usize],
    lines: &Text<'_>,
    errors: &mut Gathered,
) -> BTreeMap<String, OnError> {
    let mut out = BTreeMap::new();
    for (spanned, i) in raw.rules.iter().zip(rule_index) {
        let r = spanned.get_ref();
        let Some(v) = &r.on_error else {
            continue;
        };
        let field = format!("rules[{i}].on_error");
        let Some(policy) = errors.take(on_error_of(v, &field, &raw.store, lines)) else {
            continue;
        };
        let name = r.name.get_ref().trim();
        out.insert(name.to_string(), policy);
        for tier in r.tiers.keys() {
            out.insert(format!("{name}@{}", tier.get_ref()), policy);
        }
    }
    out
}

//! The configuration file: TOML, parsed into raw structs that mirror the file,
//! then converted once into validated types. Every error names the field and
//! the line.
//!
//! `[envoy] descriptors_file` names a second file, in envoyproxy/ratelimit's
//! YAML format, whose rate limits join the rules ([`descriptors`]).

pub mod descriptors;
mod source;

pub use source::{ConfigSource, DEFAULT_CONFIG_PATH, Overrides, SAMPLE_CONFIG, locate_config};

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method};
use serde::Deserialize;
use spillway::Quota;
use spillway::algorithm::{
    AnyAlgorithm, FixedWindow, LeakyBucket, LeakyMode, SlidingLog, SlidingWindow, TokenBucket,
};
use spillway::store::OnFull;
use spillway_redis::{OnError, Topology};
use spillway_tower::{
    Action, BodyFormat, Clients, Cost, Credential, ForwardedHeader, HeaderOptions, HttpRule,
    Ipv6Prefix, KeyPart, Policy, ResetFormat, RouteCost,
};
use toml::Spanned;

/// A configuration error: where, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file the error is in, when it is not the configuration file
    /// itself: the `[envoy] descriptors_file`. `line` and `field` are then
    /// that file's.
    pub file: Option<PathBuf>,
    /// The 1-based line, when known.
    pub line: Option<usize>,
    /// The field's path, like `rules[2].limit`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}: ", file.display())?;
        }
        match self.line {
            Some(line) => write!(f, "line {line}: `{}`: {}", self.field, self.message),
            None => write!(f, "`{}`: {}", self.field, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

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
            other => Err(format!("`{other}`: expected keep, reject or unescape")),
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
    head_timeout: Option<Spanned<String>>,
    body_timeout: Option<Spanned<String>>,
    write_timeout: Option<Spanned<String>>,
    idle_timeout: Option<Spanned<String>>,
    max_connections: Option<Spanned<u64>>,
    drain_timeout: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawStore {
    kind: Option<Spanned<String>>,
    url: Option<Spanned<RawUrl>>,
    timeout: Option<Spanned<String>>,
    on_error: Option<Spanned<String>>,
    instances: Option<NonZeroU32>,
    max_keys: Option<NonZeroUsize>,
    on_full: Option<Spanned<String>>,
    max_memory: Option<Spanned<RawSize>>,
}

/// A size in bytes: a number, or a string with a unit (`"64MiB"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawSize {
    Bytes(i64),
    Fraction(f64),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
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
#[serde(untagged)]
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
    window: Spanned<String>,
    burst: Option<Spanned<u64>>,
    mode: Option<Spanned<String>>,
    delay: Option<Spanned<u64>>,
    cost: Option<Spanned<RawCost>>,
    route_costs: Option<Spanned<Vec<Spanned<RawRouteCost>>>>,
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
    window: Option<Spanned<String>>,
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

#[derive(Debug, Deserialize)]
#[serde(untagged)]
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

/// Turns byte offsets into line numbers.
struct Text<'a>(&'a str);

impl Text<'_> {
    fn line(&self, offset: usize) -> usize {
        self.0[..offset.min(self.0.len())].matches('\n').count() + 1
    }

    fn err<T>(
        &self,
        at: &Spanned<T>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            file: None,
            line: Some(self.line(at.span().start)),
            field: field.into(),
            message: message.into(),
        }
    }
}

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
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = read_text(path).map_err(|(line, message)| ConfigError {
            file: None,
            line,
            field: path.display().to_string(),
            message,
        })?;
        Self::parse_in(&text, path.parent().unwrap_or(Path::new("")))
    }

    /// Parses and validates a configuration; a relative `descriptors_file`
    /// is relative to the working directory.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        Self::parse_in(text, Path::new(""))
    }

    /// Parses and validates a configuration whose relative paths (the
    /// `descriptors_file`) are relative to `dir`.
    pub fn parse_in(text: &str, dir: &Path) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| Text(text).line(s.start));
            let message = match e.message().trim() {
                // The TOML parser says nothing of a character it refuses
                // outright (a control character, a bare CR).
                "" => unexpected_at(text, e.span().map(|s| s.start)),
                m => m.to_string(),
            };
            ConfigError {
                file: None,
                line,
                field: "(file)".into(),
                message,
            }
        })?;
        convert(raw, &Text(text), dir)
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

/// What the parser stopped at, byte `at` of `text`: the character, or the
/// end of the file.
fn unexpected_at(text: &str, at: Option<usize>) -> String {
    match at
        .and_then(|at| text.get(at..))
        .and_then(|rest| rest.chars().next())
    {
        Some(c) if c.is_control() => format!(
            "unexpected control character U+{:04X} (TOML allows only tab, and newline between lines)",
            u32::from(c)
        ),
        Some(c) => format!("unexpected character `{c}`"),
        None => "unexpected end of file".to_string(),
    }
}

fn convert(raw: RawConfig, lines: &Text<'_>, dir: &Path) -> Result<Config, ConfigError> {
    let server = convert_server(&raw.server, lines)?;
    let envoy_limits = envoy_limits(&raw.envoy, lines)?;
    let mut store = convert_store(&raw.store, lines)?;
    store.rule_on_error = rule_on_error(&raw, lines)?;
    let clients = convert_clients(&raw.clients, lines)?;
    let (headers, body) = convert_headers(&raw.headers, lines)?;
    let (mut rules, mut descriptors) = convert_rules(&raw, lines)?;
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
        proxy: convert_proxy(&raw.proxy, lines)?,
        server,
        store,
        policy,
        descriptors,
        envoy_domain: envoy_domain.unwrap_or_else(|| "spillway".to_string()),
        descriptor_tree,
        envoy_limits,
        proxy_bounds: convert_proxy_bounds(&raw.proxy, lines)?,
    })
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
                    format!("`{other}`: expected \"x-forwarded-for\" or \"forwarded\" (the header your proxies write)"),
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
                return Err(lines.err(
                    r,
                    "headers.reset",
                    format!("`{other}`: expected \"unix\" or \"delta\""),
                ));
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
                    format!("`{other}`: expected problem, quota-exceeded, json, text or empty"),
                ));
            }
        },
    };
    Ok((headers, body))
}

/// `[[rules]]`: each rule, and the Envoy descriptor keys it answers to.
fn convert_rules(
    raw: &RawConfig,
    lines: &Text<'_>,
) -> Result<(Vec<HttpRule>, Vec<Vec<String>>), ConfigError> {
    let mut names = std::collections::HashSet::new();
    let mut rules = Vec::new();
    let mut descriptors = Vec::new();
    for (i, spanned) in raw.rules.iter().enumerate() {
        let r = spanned.get_ref();
        let field = |f: &str| format!("rules[{i}].{f}");
        let name = r.name.get_ref().trim().to_string();
        check_rule_name(&name, r, lines, &field)?;
        if !names.insert(name.clone()) {
            return Err(lines.err(
                &r.name,
                field("name"),
                format!("`{name}` is used by another rule"),
            ));
        }
        let quota = RawQuota::of(r);
        let rule = HttpRule::new(name, algorithm_of(&quota, lines, &field)?);
        let rule = rule_match(rule, r, lines, &field)?;
        let rule = rule_key_cost_action(rule, spanned, lines, &field)?;
        let rule = rule_tiers(rule, r, &raw.tiers, &quota, lines, i)?;
        descriptors.push(r.descriptors.clone());
        rules.push(rule);
    }
    Ok((rules, descriptors))
}

/// A rule's name: not empty, not one the Envoy service makes.
fn check_rule_name(
    name: &str,
    r: &RawRule,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Err(lines.err(&r.name, field("name"), "must not be empty"));
    }
    if name.starts_with(crate::config::descriptors::OVERRIDE_PREFIX) {
        return Err(lines.err(
            &r.name,
            field("name"),
            format!(
                "`{name}`: names starting with `{}` are the Envoy service's, for limit overrides",
                crate::config::descriptors::OVERRIDE_PREFIX
            ),
        ));
    }
    Ok(())
}

/// Methods named in a file (any letter case), each checked.
fn methods(
    methods: &[Spanned<String>],
    lines: &Text<'_>,
    field: &str,
) -> Result<Vec<Method>, ConfigError> {
    methods
        .iter()
        .map(|m| {
            Method::from_bytes(m.get_ref().to_ascii_uppercase().as_bytes())
                .map_err(|_| lines.err(m, field, format!("`{}` is not a method", m.get_ref())))
        })
        .collect()
}

/// A rule's `match`: methods, path, host.
fn rule_match(
    mut rule: HttpRule,
    r: &RawRule,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<HttpRule, ConfigError> {
    if let Some(list) = &r.matcher.methods {
        rule = rule.methods(methods(list, lines, &field("match.methods"))?);
    }
    if let Some(path) = &r.matcher.path {
        rule = rule.path(path.clone());
    }
    if let Some(followed) = r.matcher.method_overrides {
        rule = rule.method_overrides(followed);
    }
    if r.matcher.exact_path == Some(true) {
        rule = rule.exact_path();
    }
    if let Some(host) = &r.matcher.host {
        rule = rule.host(host.clone());
    }
    Ok(rule)
}

/// A rule's `key`, `fallback`, `cost` and `action`.
fn rule_key_cost_action(
    mut rule: HttpRule,
    spanned: &Spanned<RawRule>,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<HttpRule, ConfigError> {
    let r = spanned.get_ref();
    let parts = |list: &Vec<Spanned<String>>, f: &str| -> Result<Vec<KeyPart>, ConfigError> {
        list.iter()
            .map(|p| KeyPart::parse(p.get_ref()).map_err(|m| lines.err(p, field(f), m)))
            .collect()
    };
    if let Some(key) = &r.key {
        if key.is_empty() {
            return Err(lines.err(spanned, field("key"), "must list at least one part"));
        }
        rule = rule.key(parts(key, "key")?);
    }
    if let Some(fallback) = &r.fallback {
        rule = rule.fallback(parts(fallback, "fallback")?);
    }
    if let Some(cost) = &r.cost {
        rule = rule.cost(match cost.get_ref() {
            RawCost::Fixed(n) => Cost::Fixed(*n),
            RawCost::Header(h) => {
                let name = h.strip_prefix("header:").ok_or_else(|| {
                    lines.err(cost, field("cost"), "must be an integer or \"header:NAME\"")
                })?;
                Cost::Header {
                    name: HeaderName::try_from(name).map_err(|_| {
                        lines.err(
                            cost,
                            field("cost"),
                            format!("`{name}` is not a header name"),
                        )
                    })?,
                    default: 1,
                }
            }
        });
    }
    if let Some(table) = &r.route_costs {
        let default = match r.cost.as_ref().map(Spanned::get_ref) {
            None => 1,
            Some(RawCost::Fixed(n)) => *n,
            Some(RawCost::Header(_)) => {
                let cost = r.cost.as_ref().expect("matched");
                return Err(lines.err(
                    cost,
                    field("cost"),
                    "with `route_costs`, `cost` is the cost of a request no route matches: an integer",
                ));
            }
        };
        if table.get_ref().is_empty() {
            return Err(lines.err(table, field("route_costs"), "must list at least one route"));
        }
        let mut routes = Vec::new();
        for (j, row) in table.get_ref().iter().enumerate() {
            let at = |f: &str| field(&format!("route_costs[{j}].{f}"));
            let raw = row.get_ref();
            if !raw.path.get_ref().starts_with('/') {
                return Err(lines.err(&raw.path, at("path"), "must start with `/`"));
            }
            let mut route = RouteCost::new(raw.path.get_ref().clone(), raw.cost);
            if let Some(list) = &raw.methods {
                route = route.methods(methods(list, lines, &at("methods"))?);
            }
            routes.push(route);
        }
        rule = rule.cost(Cost::Routes { routes, default });
    }
    if let Some(a) = &r.action {
        rule = rule.action(match a.get_ref().as_str() {
            "reject" => Action::Reject,
            "shadow" => Action::Shadow,
            "degrade" => Action::Degrade,
            other => {
                return Err(lines.err(
                    a,
                    field("action"),
                    format!("`{other}`: expected reject, shadow or degrade"),
                ));
            }
        });
    }
    Ok(rule)
}

/// A rule's `tiers`: each its own quota, over the rule's.
fn rule_tiers(
    mut rule: HttpRule,
    r: &RawRule,
    declared: &BTreeMap<String, RawTier>,
    quota: &RawQuota,
    lines: &Text<'_>,
    i: usize,
) -> Result<HttpRule, ConfigError> {
    for (tier, over) in &r.tiers {
        if !declared.contains_key(tier.get_ref()) {
            return Err(lines.err(
                tier,
                format!("rules[{i}].tiers.{}", tier.get_ref()),
                format!(
                    "unknown tier `{}`: declare it as [tiers.{}]",
                    tier.get_ref(),
                    tier.get_ref()
                ),
            ));
        }
        let merged = over.over(quota);
        let tier_field = |f: &str| format!("rules[{i}].tiers.{}.{f}", tier.get_ref());
        rule = rule.tier(
            tier.get_ref().clone(),
            algorithm_of(&merged, lines, &tier_field)?,
        );
    }
    Ok(rule)
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
    raw: &Option<Spanned<String>>,
    field: &str,
    default: Duration,
    lines: &Text<'_>,
) -> Result<Duration, ConfigError> {
    let Some(t) = raw else {
        return Ok(default);
    };
    let d = parse_duration(t.get_ref()).map_err(|m| lines.err(t, field, m))?;
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
            return Err(lines.err(
                k,
                "store.kind",
                format!("`{other}`: expected \"memory\" or \"redis\""),
            ));
        }
    })
}

/// `[store]`.
fn convert_store(raw: &RawStore, lines: &Text<'_>) -> Result<StoreConfig, ConfigError> {
    let timeout = match &raw.timeout {
        Some(t) => {
            let d = parse_duration(t.get_ref()).map_err(|m| lines.err(t, "store.timeout", m))?;
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
                    format!("`{other}`: expected \"evict\" or \"deny_new\""),
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
                format!("`{other}`: expected fail_open, fail_closed or local"),
            ));
        }
    })
}

/// Each rule's own failure policy (`[[rules]] on_error`), for its store
/// rules: its own and its tiers'.
fn rule_on_error(
    raw: &RawConfig,
    lines: &Text<'_>,
) -> Result<BTreeMap<String, OnError>, ConfigError> {
    let mut out = BTreeMap::new();
    for (i, spanned) in raw.rules.iter().enumerate() {
        let r = spanned.get_ref();
        let Some(v) = &r.on_error else {
            continue;
        };
        let policy = on_error_of(v, &format!("rules[{i}].on_error"), &raw.store, lines)?;
        let name = r.name.get_ref().trim();
        out.insert(name.to_string(), policy);
        for tier in r.tiers.keys() {
            out.insert(format!("{name}@{}", tier.get_ref()), policy);
        }
    }
    Ok(out)
}

/// A rule's (or a tier's) algorithm on its quota.
fn algorithm_of(
    q: &RawQuota,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<AnyAlgorithm, ConfigError> {
    // Always set: `RawRule` requires them, and a tier's quota falls back to
    // its rule's.
    fn required<T>(v: &Option<Spanned<T>>, field: String) -> Result<&Spanned<T>, ConfigError> {
        v.as_ref().ok_or(ConfigError {
            file: None,
            line: None,
            field,
            message: "is required".into(),
        })
    }
    let algorithm = required(&q.algorithm, field("algorithm"))?;
    let limit_field = required(&q.limit, field("limit"))?;
    let window_field = required(&q.window, field("window"))?;
    let limit = u32::try_from(*limit_field.get_ref())
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(|| {
            lines.err(
                limit_field,
                field("limit"),
                "must be between 1 and 4294967295",
            )
        })?;
    let window = parse_duration(window_field.get_ref())
        .map_err(|m| lines.err(window_field, field("window"), m))?;
    let quota = Quota::new(limit, window)
        .map_err(|e| lines.err(window_field, field("window"), e.to_string()))?;
    let name = algorithm.get_ref().as_str();
    let not_for = |v: &Option<Spanned<u64>>, f: &str| match v {
        Some(v) => Err(lines.err(v, field(f), format!("does not apply to {name}"))),
        None => Ok(()),
    };
    Ok(match name {
        "fixed_window" | "sliding_log" | "sliding_window" => {
            not_for(&q.burst, "burst")?;
            not_for(&q.delay, "delay")?;
            if let Some(m) = &q.mode {
                return Err(lines.err(m, field("mode"), format!("does not apply to {name}")));
            }
            match name {
                "fixed_window" => FixedWindow::new(quota).into(),
                "sliding_log" => SlidingLog::new(quota).into(),
                _ => SlidingWindow::new(quota).into(),
            }
        }
        "token_bucket" => {
            not_for(&q.delay, "delay")?;
            if let Some(m) = &q.mode {
                return Err(lines.err(m, field("mode"), "does not apply to token_bucket"));
            }
            TokenBucket::new(quota, count_of(&q.burst, "burst", limit, lines, field)?).into()
        }
        "leaky_bucket" => leaky_bucket_of(q, quota, limit, lines, field)?.into(),
        other => {
            return Err(lines.err(
                algorithm,
                field("algorithm"),
                format!("`{other}`: expected fixed_window, sliding_log, sliding_window, token_bucket or leaky_bucket"),
            ));
        }
    })
}

/// A leaky bucket's `mode`, `burst` and `delay` (see [`algorithm_of`]).
fn leaky_bucket_of(
    q: &RawQuota,
    quota: Quota,
    limit: NonZeroU32,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<LeakyBucket, ConfigError> {
    let mode = match &q.mode {
        None => LeakyMode::Shape,
        Some(m) => match m.get_ref().as_str() {
            "shape" => LeakyMode::Shape,
            "police" => LeakyMode::Police,
            other => {
                return Err(lines.err(
                    m,
                    field("mode"),
                    format!("`{other}`: expected shape or police"),
                ));
            }
        },
    };
    let capacity = count_of(&q.burst, "burst", limit, lines, field)?;
    let delay = match &q.delay {
        None => 0,
        Some(d) => {
            u32::try_from(*d.get_ref()).map_err(|_| lines.err(d, field("delay"), "is too large"))?
        }
    };
    Ok(LeakyBucket::new(quota, capacity, mode).with_delay(delay))
}

/// A count of 1 or more (`burst`), `default` when absent.
fn count_of(
    v: &Option<Spanned<u64>>,
    name: &str,
    default: NonZeroU32,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<NonZeroU32, ConfigError> {
    match v {
        None => Ok(default),
        Some(v) => u32::try_from(*v.get_ref())
            .ok()
            .and_then(NonZeroU32::new)
            .ok_or_else(|| lines.err(v, field(name), "must be between 1 and 4294967295")),
    }
}

#[cfg(test)]
mod tests {
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
        Config::parse(text).expect_err("invalid")
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
            e.message
                .contains("expected fail_open, fail_closed or local"),
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
            "line 3: `headers.body`: `quota_exceeded`: expected problem, quota-exceeded, json, text or empty"
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
        let e = error(
            "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nmax_memory = \"64MiB\"\n",
        );
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
        let text = "[proxy]\nhttp2 = false\nhttp2_max_streams = 8\npool_max_connections = 16\nmax_held = 32\n";
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
}

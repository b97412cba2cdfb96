//! `[store]`: memory or Redis, its bounds and failure policies.

use std::collections::BTreeMap;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use serde::Deserialize;
use spillway::store::OnFull;
use spillway_redis::{OnError, Topology};
use spillway_tower::Policy;
use toml::Spanned;

use super::errors::{ConfigError, Gathered, Text, not_one_of};
use super::{RawConfig, RawDuration, parse_duration};

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
    /// Where the in-memory store keeps its counters and run-time tables
    /// across restarts (`[store] state_file`), and how often it writes
    /// them; `None`: nowhere (memory only). Read at start only.
    pub state_file: Option<StateFile>,
}

/// `[store] state_file` and `snapshot_every`: the in-memory store's state,
/// written there every `every` and at shutdown, read back at start.
///
/// ```
/// use std::time::Duration;
/// use spillway_server::config::Config;
///
/// let config = Config::parse("[store]\nstate_file = \"/var/lib/spillway/state\"\n").unwrap();
/// let file = config.store.state_file.unwrap();
/// assert_eq!(file.path.to_str(), Some("/var/lib/spillway/state"));
/// assert_eq!(file.every, Duration::from_secs(10));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateFile {
    /// The file (a relative path in the configuration file is from that
    /// file's directory, as `descriptors_file`'s is).
    pub path: std::path::PathBuf,
    /// How often it is written while serving: at most what was admitted
    /// in that time is lost when the process is killed without a chance
    /// to write it (a clean stop writes it last).
    pub every: Duration,
}

/// `[store] snapshot_every` when not set.
pub const DEFAULT_SNAPSHOT_EVERY: Duration = Duration::from_secs(10);

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

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    kind: Option<Spanned<String>>,
    url: Option<Spanned<RawUrl>>,
    timeout: Option<Spanned<RawDuration>>,
    on_error: Option<Spanned<String>>,
    instances: Option<NonZeroU32>,
    max_keys: Option<NonZeroUsize>,
    on_full: Option<Spanned<String>>,
    max_memory: Option<Spanned<RawSize>>,
    state_file: Option<Spanned<String>>,
    snapshot_every: Option<Spanned<RawDuration>>,
}

/// A size in bytes: a number, or a string with a unit (`"64MiB"`).
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a size: a number of bytes, or a string like \"64MiB\" or \"none\""
)]
pub(super) enum RawSize {
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
pub(super) enum RawUrl {
    One(String),
    Cluster(Vec<String>),
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
pub(super) const MIN_MAX_MEMORY: u64 = 1 << 20;

/// `[store] max_memory`.
pub(super) fn max_memory_of(
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

/// Each store rule as the Redis store can run it: one it refuses (a limit
/// it cannot decide exactly, or quickly, or share among the instances of a
/// `local` failure policy) is an error at its rule's `limit`.
pub(super) fn redis_rules(
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

/// `[store] kind` and `url`: in memory, or a Redis server or cluster.
pub(super) fn store_kind(raw: &RawStore, lines: &Text<'_>) -> Result<StoreKind, ConfigError> {
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
pub(super) fn convert_store(
    raw: &RawStore,
    dir: &std::path::Path,
    lines: &Text<'_>,
) -> Result<StoreConfig, ConfigError> {
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
    let state_file = state_file_of(raw, &kind, dir, lines)?;
    Ok(StoreConfig {
        state_file,
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

/// `[store] state_file` and `snapshot_every`.
fn state_file_of(
    raw: &RawStore,
    kind: &StoreKind,
    dir: &std::path::Path,
    lines: &Text<'_>,
) -> Result<Option<StateFile>, ConfigError> {
    let every = match &raw.snapshot_every {
        None => DEFAULT_SNAPSHOT_EVERY,
        Some(v) => {
            let field = "store.snapshot_every";
            let d = parse_duration(&v.get_ref().0).map_err(|m| lines.err(v, field, m))?;
            if d < Duration::from_secs(1) {
                return Err(lines.err(v, field, "must be at least 1s"));
            }
            if raw.state_file.is_none() {
                return Err(lines.err(
                    v,
                    field,
                    "says how often `state_file` is written: set state_file too",
                ));
            }
            d
        }
    };
    let Some(path) = &raw.state_file else {
        return Ok(None);
    };
    let field = "store.state_file";
    if path.get_ref().trim().is_empty() {
        return Err(lines.err(path, field, "is empty: name a file"));
    }
    if path.get_ref().ends_with('/') {
        return Err(lines.err(path, field, "names a directory: name a file in it"));
    }
    if matches!(kind, StoreKind::Redis(_)) {
        return Err(lines.err(
            path,
            field,
            "keeps the in-memory store's state; with kind = \"redis\" everything is in Redis already",
        ));
    }
    Ok(Some(StateFile {
        path: super::descriptors::resolve(path.get_ref(), dir),
        every,
    }))
}

/// A failure policy: `fail_open`, `fail_closed`, or `local` (each instance
/// its share of `[store] instances`).
pub(super) fn on_error_of(
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
pub(super) fn rule_on_error(
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

//! envoyproxy/ratelimit's YAML descriptor files, as a rule source for the
//! Envoy rate limit service (`[envoy] descriptors_file`).
//!
//! A file names a `domain` and a tree of `descriptors`: each node has a
//! `key`, an optional `value`, an optional `rate_limit` and optional nested
//! `descriptors`. A request descriptor's entries walk the tree from its
//! root, one level per entry; the limit that applies is the one on the node
//! the *last* entry reaches. See `docs/envoy.md` for the whole format.
//!
//! The file is parsed into raw structs that mirror it, then converted once:
//! every `rate_limit` becomes a fixed-window rule (so the store, `/metrics`,
//! the admin API and reloads see it like a rule of the TOML file), and the
//! tree keeps only what a lookup needs, [`DescriptorTree`]. Errors name the
//! file, the field (`descriptors[0].descriptors[1].rate_limit.unit`) and
//! the line.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_saphyr::Spanned;

use super::ConfigError;

/// A `rate_limit.unit`: what envoyproxy/ratelimit accepts, in any case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// `second`.
    Second,
    /// `minute`.
    Minute,
    /// `hour`.
    Hour,
    /// `day`.
    Day,
    /// `week`: 7 days.
    Week,
    /// `month`: 30 days, as envoyproxy/ratelimit counts one.
    Month,
    /// `year`: 365 days, as envoyproxy/ratelimit counts one.
    Year,
}

impl Unit {
    const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// Parses a unit's name, ignoring case (`minute`, `MINUTE`).
    ///
    /// ```
    /// use spillway_server::config::descriptors::Unit;
    ///
    /// assert_eq!(Unit::parse("MINUTE"), Some(Unit::Minute));
    /// assert_eq!(Unit::parse("fortnight"), None);
    /// ```
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|u| u.name().eq_ignore_ascii_case(name))
    }

    /// The unit's name, in lower case.
    pub const fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// How long the unit is: the window of the rule it becomes.
    ///
    /// ```
    /// use std::time::Duration;
    /// use spillway_server::config::descriptors::Unit;
    ///
    /// assert_eq!(Unit::Hour.duration(), Duration::from_secs(3600));
    /// assert_eq!(Unit::Month.duration(), Duration::from_secs(30 * 86_400));
    /// ```
    pub const fn duration(self) -> Duration {
        const DAY: u64 = 86_400;
        Duration::from_secs(match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3600,
            Unit::Day => DAY,
            Unit::Week => 7 * DAY,
            Unit::Month => 30 * DAY,
            Unit::Year => 365 * DAY,
        })
    }
}

/// A `rate_limit` as configured: `requests_per_unit` per `unit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UnitLimit {
    /// `requests_per_unit`.
    pub requests_per_unit: NonZeroU32,
    /// `unit`.
    pub unit: Unit,
}

/// A rule a descriptor file defines: one per `rate_limit` that is not
/// `unlimited`, in the file's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRule {
    /// Its `rate_limit.name`, else its path of `key` or `key_value` parts
    /// joined by `.`, as envoyproxy/ratelimit names its statistics
    /// (`database_users`, `database_users.user`).
    pub name: String,
    /// Its limit.
    pub limit: UnitLimit,
    /// `shadow_mode: true`: count and report, never deny.
    pub shadow: bool,
    /// The field its name comes from, `descriptors[0].rate_limit.name` or,
    /// for a name made from the path, `descriptors[0].key`: for errors
    /// that involve it later (a name another rule also has).
    pub field: String,
    /// The line of that field.
    pub line: Option<usize>,
}

/// What a descriptor's entries reach in a [`DescriptorTree`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reached {
    /// No node, or a node without `rate_limit`: nothing limits it.
    Nothing,
    /// A node whose `rate_limit` is `unlimited: true`.
    Unlimited,
    /// A node with a limit: the index of its rule in the policy.
    Rule(usize),
}

/// The descriptor tree of a file, for lookups. Its rules are rules
/// `first_rule..` of the policy, in the order of [`DescriptorFile::rules`].
#[derive(Debug, Clone, Default)]
pub struct DescriptorTree {
    root: Level,
    first_rule: usize,
    // By rule, counted from `first_rule`: its limit as configured, and the
    // rules its `replaces` names.
    limits: Vec<UnitLimit>,
    replaces: Vec<Vec<usize>>,
}

/// One level of the tree: its nodes by key.
#[derive(Debug, Clone, Default)]
struct Level {
    keys: HashMap<String, KeyNodes>,
}

/// The nodes of one level with the same key, in the order a lookup tries
/// them: an exact value, then a `prefix*` value (in file order), then the
/// node without a value, which matches any.
#[derive(Debug, Clone, Default)]
struct KeyNodes {
    exact: HashMap<String, Node>,
    prefixes: Vec<(String, Node)>,
    any: Option<Box<Node>>,
}

#[derive(Debug, Clone, Default)]
struct Node {
    reached: Option<Reached>,
    children: Level,
}

impl Level {
    fn find(&self, key: &str, value: &str) -> Option<&Node> {
        let nodes = self.keys.get(key)?;
        nodes
            .exact
            .get(value)
            .or_else(|| {
                nodes
                    .prefixes
                    .iter()
                    .find(|(prefix, _)| value.starts_with(prefix.as_str()))
                    .map(|(_, node)| node)
            })
            .or(nodes.any.as_deref())
    }

    fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl DescriptorTree {
    /// Where a descriptor's entries lead: the limit of the node its last
    /// entry reaches, walking down one level per entry. At each level an
    /// entry `(key, value)` takes the node with that key and value, else one
    /// whose value is a `prefix*` of it, else the one with that key and no
    /// value. A walk that stops early (no such node, or no level below for
    /// the next entry) reaches nothing.
    ///
    /// ```
    /// use std::path::Path;
    /// use spillway_server::config::descriptors::{DescriptorFile, Reached};
    ///
    /// let yaml = "
    /// domain: shop
    /// descriptors:
    ///   - key: remote_address
    ///     rate_limit: { unit: minute, requests_per_unit: 10 }
    ///     descriptors:
    ///       - key: path
    ///         value: /login
    ///         rate_limit: { unit: minute, requests_per_unit: 2 }
    ///   - key: health
    ///     rate_limit: { unlimited: true }
    /// ";
    /// let file = DescriptorFile::parse(yaml, Path::new("limits.yaml"), 0).unwrap();
    /// let names: Vec<_> = file.rules.iter().map(|r| r.name.as_str()).collect();
    /// assert_eq!(names, ["remote_address", "remote_address.path_/login"]);
    /// let tree = &file.tree;
    /// assert_eq!(tree.find([("remote_address", "10.0.0.1")]), Reached::Rule(0));
    /// assert_eq!(
    ///     tree.find([("remote_address", "10.0.0.1"), ("path", "/login")]),
    ///     Reached::Rule(1)
    /// );
    /// assert_eq!(
    ///     tree.find([("remote_address", "10.0.0.1"), ("path", "/")]),
    ///     Reached::Nothing
    /// );
    /// assert_eq!(tree.find([("health", "x")]), Reached::Unlimited);
    /// ```
    pub fn find<'a>(&self, entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> Reached {
        let mut level = &self.root;
        let mut entries = entries.into_iter().peekable();
        while let Some((key, value)) = entries.next() {
            let Some(node) = level.find(key, value) else {
                break;
            };
            if entries.peek().is_none() {
                return node.reached.unwrap_or(Reached::Nothing);
            }
            if node.children.is_empty() {
                break;
            }
            level = &node.children;
        }
        Reached::Nothing
    }

    /// The limit of policy rule `rule` as the file states it, if the file
    /// defines that rule.
    pub fn limit_of(&self, rule: usize) -> Option<UnitLimit> {
        let i = rule.checked_sub(self.first_rule)?;
        self.limits.get(i).copied()
    }

    /// The policy rules that rule `rule` replaces (its `replaces`): when a
    /// request reaches both, only `rule` is applied.
    pub fn replaced_by(&self, rule: usize) -> &[usize] {
        rule.checked_sub(self.first_rule)
            .and_then(|i| self.replaces.get(i))
            .map_or(&[], Vec::as_slice)
    }

    /// Whether no descriptor can reach anything.
    pub fn is_empty(&self) -> bool {
        self.root.is_empty()
    }
}

/// A descriptor file, converted.
#[derive(Debug, Clone)]
pub struct DescriptorFile {
    /// Its name, as given to [`parse`](Self::parse).
    pub path: PathBuf,
    /// Its `domain`.
    pub domain: String,
    /// The line of `domain`, for an error that involves it.
    pub domain_line: Option<usize>,
    /// The rules it defines, in file order.
    pub rules: Vec<FileRule>,
    /// The tree, whose rules are numbered from the `first_rule` given to
    /// [`parse`](Self::parse).
    pub tree: DescriptorTree,
}

// ---- the file, as written ----------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    domain: Spanned<String>,
    #[serde(default)]
    descriptors: Vec<RawNode>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    key: Spanned<String>,
    #[serde(default)]
    value: Option<Spanned<String>>,
    #[serde(default)]
    rate_limit: Option<Spanned<RawRateLimit>>,
    #[serde(default)]
    descriptors: Vec<RawNode>,
    #[serde(default)]
    shadow_mode: bool,
    // Accepted for compatibility: envoyproxy/ratelimit's per-value
    // statistics. Spillway's metrics are by rule, so it changes nothing.
    #[serde(default, rename = "detailed_metric")]
    _detailed_metric: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    #[serde(default)]
    unit: Option<Spanned<String>>,
    #[serde(default)]
    requests_per_unit: Option<Spanned<RawCount>>,
    #[serde(default)]
    name: Option<Spanned<String>>,
    #[serde(default)]
    unlimited: Option<Spanned<bool>>,
    #[serde(default)]
    replaces: Vec<Spanned<RawReplaces>>,
}

/// A count as written: anything, so that a wrong one is our error, which
/// names the field, rather than the parser's.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawCount {
    Integer(i64),
    Other(serde::de::IgnoredAny),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplaces {
    // The `name` of the rate limit replaced.
    name: String,
}

// ---- conversion --------------------------------------------------------

/// Builds errors about one file.
struct At<'a> {
    file: &'a Path,
}

impl At<'_> {
    fn err<T>(
        &self,
        at: &Spanned<T>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        self.err_at(line_of(at), field, message)
    }

    fn err_at(
        &self,
        line: Option<usize>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            file: Some(self.file.to_path_buf()),
            line,
            field: field.into(),
            message: message.into(),
        }
    }
}

fn line_of<T>(at: &Spanned<T>) -> Option<usize> {
    // Line 0 is the parser's "unknown".
    usize::try_from(at.referenced.line())
        .ok()
        .filter(|&l| l > 0)
}

/// A rule's `replaces`, by name, until every name is known.
struct PendingReplaces {
    rule: usize,
    // `descriptors[0].rate_limit.replaces`.
    field: String,
    names: Vec<(String, Option<usize>)>,
}

/// Converts the nodes of one level.
struct Builder<'a> {
    at: At<'a>,
    rules: Vec<FileRule>,
    replaces: Vec<PendingReplaces>,
}

impl DescriptorFile {
    /// Parses and converts a descriptor file's text; `file` is its name in
    /// errors. Its rules will be rules `first_rule..` of the policy.
    pub fn parse(text: &str, file: &Path, first_rule: usize) -> Result<Self, ConfigError> {
        let at = At { file };
        let raw: RawFile = serde_saphyr::from_str(text).map_err(|e| {
            let e = e.without_snippet();
            let line = e
                .location()
                .and_then(|l| usize::try_from(l.line()).ok())
                .filter(|&l| l > 0);
            at.err_at(line, "(file)", plain_message(e))
        })?;
        let domain = raw.domain.value.trim().to_string();
        if domain.is_empty() {
            return Err(at.err(&raw.domain, "domain", "must not be empty"));
        }
        let mut builder = Builder {
            at,
            rules: Vec::new(),
            replaces: Vec::new(),
        };
        let root = builder.level(&raw.descriptors, "descriptors", "", first_rule)?;

        // Names are known now: resolve `replaces`.
        let mut by_name: HashMap<&str, usize> = HashMap::new();
        for (i, rule) in builder.rules.iter().enumerate() {
            if let Some(other) = by_name.insert(&rule.name, i) {
                let first = &builder.rules[other];
                return Err(builder.at.err_at(
                    rule.line,
                    rule.field.clone(),
                    format!(
                        "`{}` is also the name of the rate limit at `{}`{}: rule names must be unique",
                        rule.name,
                        first.field,
                        first.line.map(|l| format!(" (line {l})")).unwrap_or_default()
                    ),
                ));
            }
        }
        let mut replaces = vec![Vec::new(); builder.rules.len()];
        for pending in &builder.replaces {
            let rule = &builder.rules[pending.rule];
            for (i, (name, line)) in pending.names.iter().enumerate() {
                let field = format!("{}[{i}].name", pending.field);
                let message = if name.is_empty() {
                    "must not be empty".to_string()
                } else if *name == rule.name {
                    "a rate limit cannot replace itself".to_string()
                } else if let Some(&target) = by_name.get(name.as_str()) {
                    replaces[pending.rule].push(first_rule + target);
                    continue;
                } else {
                    format!("no rate limit of this file is named `{name}`")
                };
                return Err(builder.at.err_at(*line, field, message));
            }
        }
        let limits = builder.rules.iter().map(|r| r.limit).collect();
        Ok(Self {
            path: file.to_path_buf(),
            domain,
            domain_line: line_of(&raw.domain),
            rules: builder.rules,
            tree: DescriptorTree {
                root,
                first_rule,
                limits,
                replaces,
            },
        })
    }
}

/// The parser's message without its location (the error carries the line).
fn plain_message(e: &serde_saphyr::Error) -> String {
    let text = e.to_string();
    // The rendering ends with " at line L, column C" when it knows where.
    match text.rfind(" at line ") {
        Some(i) if text[i..].contains("column") => text[..i].to_string(),
        _ => text,
    }
}

impl Builder<'_> {
    /// Converts the nodes at `field` (`descriptors`, or
    /// `descriptors[0].descriptors`), whose parent's name is `parent`.
    fn level(
        &mut self,
        nodes: &[RawNode],
        field: &str,
        parent: &str,
        first_rule: usize,
    ) -> Result<Level, ConfigError> {
        let mut level = Level::default();
        for (i, raw) in nodes.iter().enumerate() {
            let field = format!("{field}[{i}]");
            let key = raw.key.value.as_str();
            if key.is_empty() {
                return Err(self
                    .at
                    .err(&raw.key, format!("{field}.key"), "must not be empty"));
            }
            // An empty value is no value, as in envoyproxy/ratelimit.
            let value = raw
                .value
                .as_ref()
                .map(|v| v.value.as_str())
                .filter(|v| !v.is_empty());
            let part = match value {
                Some(value) => format!("{key}_{value}"),
                None => key.to_string(),
            };
            let path = if parent.is_empty() {
                part.clone()
            } else {
                format!("{parent}.{part}")
            };
            let node = Node {
                reached: self.rate_limit(raw, &field, &path, first_rule)?,
                children: self.level(
                    &raw.descriptors,
                    &format!("{field}.descriptors"),
                    &path,
                    first_rule,
                )?,
            };

            let nodes = level.keys.entry(key.to_string()).or_default();
            let duplicate = match value {
                None => nodes.any.replace(Box::new(node)).is_some(),
                Some(value) => match value.strip_suffix('*') {
                    // A trailing `*` matches every value it is a prefix of.
                    Some(prefix) => {
                        if nodes.prefixes.iter().any(|(p, _)| p == prefix) {
                            true
                        } else {
                            nodes.prefixes.push((prefix.to_string(), node));
                            false
                        }
                    }
                    None => match nodes.exact.entry(value.to_string()) {
                        Entry::Occupied(_) => true,
                        Entry::Vacant(slot) => {
                            slot.insert(node);
                            false
                        }
                    },
                },
            };
            if duplicate {
                let (at, what) = match &raw.value {
                    Some(v) if value.is_some() => (line_of(v), format!("{field}.value")),
                    _ => (line_of(&raw.key), format!("{field}.key")),
                };
                return Err(self.at.err_at(
                    at,
                    what,
                    format!("`{part}` is already defined at this level"),
                ));
            }
        }
        Ok(level)
    }

    /// The node's `rate_limit`, converted: what reaching it means.
    fn rate_limit(
        &mut self,
        raw: &RawNode,
        field: &str,
        path: &str,
        first_rule: usize,
    ) -> Result<Option<Reached>, ConfigError> {
        let Some(spanned) = &raw.rate_limit else {
            return Ok(None);
        };
        let r = &spanned.value;
        let f = |name: &str| format!("{field}.rate_limit.{name}");
        if let Some(name) = &r.name
            && name.value.trim().is_empty()
        {
            return Err(self.at.err(name, f("name"), "must not be empty"));
        }
        if r.unlimited.as_ref().is_some_and(|u| u.value) {
            self.check_unlimited(r, f)?;
            return Ok(Some(Reached::Unlimited));
        }
        let limit = self.unit_limit(spanned, f)?;
        let (name, name_field, line) = match &r.name {
            Some(name) => (name.value.trim().to_string(), f("name"), line_of(name)),
            None => (path.to_string(), format!("{field}.key"), line_of(&raw.key)),
        };
        let index = self.rules.len();
        self.rules.push(FileRule {
            name,
            limit,
            shadow: raw.shadow_mode,
            field: name_field,
            line,
        });
        if !r.replaces.is_empty() {
            self.replaces.push(PendingReplaces {
                rule: index,
                field: f("replaces"),
                names: r
                    .replaces
                    .iter()
                    .map(|s| (s.value.name.trim().to_string(), line_of(s)))
                    .collect(),
            });
        }
        Ok(Some(Reached::Rule(first_rule + index)))
    }

    /// Refuses the fields an unlimited rate limit `r` has no use for; `f`
    /// names a field of `r`.
    fn check_unlimited(
        &self,
        r: &RawRateLimit,
        f: impl Fn(&str) -> String,
    ) -> Result<(), ConfigError> {
        // As envoyproxy/ratelimit: an unlimited rate limit has no unit;
        // a count would be ignored, so it is refused too.
        if let Some(unit) = &r.unit {
            return Err(self
                .at
                .err(unit, f("unit"), "does not apply when unlimited"));
        }
        if let Some(n) = &r.requests_per_unit {
            return Err(self
                .at
                .err(n, f("requests_per_unit"), "does not apply when unlimited"));
        }
        if let Some(first) = r.replaces.first() {
            return Err(self
                .at
                .err(first, f("replaces"), "does not apply when unlimited"));
        }
        Ok(())
    }

    /// The `unit` and `requests_per_unit` of a rate limit that is not
    /// unlimited, both required; `f` names a field of the rate limit.
    fn unit_limit(
        &self,
        spanned: &Spanned<RawRateLimit>,
        f: impl Fn(&str) -> String,
    ) -> Result<UnitLimit, ConfigError> {
        let r = &spanned.value;
        let unit = r.unit.as_ref().ok_or_else(|| {
            self.at
                .err(spanned, f("unit"), "is required (or unlimited: true)")
        })?;
        let unit = Unit::parse(unit.value.trim()).ok_or_else(|| {
            self.at.err(
                unit,
                f("unit"),
                format!(
                    "`{}`: expected second, minute, hour, day, week, month or year",
                    unit.value
                ),
            )
        })?;
        let n = r.requests_per_unit.as_ref().ok_or_else(|| {
            self.at.err(
                spanned,
                f("requests_per_unit"),
                "is required (or unlimited: true)",
            )
        })?;
        let requests_per_unit = match n.value {
            RawCount::Integer(n) => u32::try_from(n).ok().and_then(NonZeroU32::new),
            RawCount::Other(_) => None,
        }
        .ok_or_else(|| {
            self.at.err(
                n,
                f("requests_per_unit"),
                "must be between 1 and 4294967295",
            )
        })?;
        Ok(UnitLimit {
            requests_per_unit,
            unit,
        })
    }
}

/// Resolves a `descriptors_file` path: relative paths are relative to the
/// directory of the configuration file that names them.
pub(crate) fn resolve(path: &str, base: &Path) -> PathBuf {
    let path = Path::new(path);
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    }
}

/// The store rule of a limit Envoy sent with a descriptor: a fixed window
/// of `requests_per_unit` per `unit`, as envoyproxy/ratelimit counts one.
/// Its name (`envoy-override:100-per-minute`) cannot be a configured
/// rule's.
pub fn override_rule(limit: UnitLimit) -> spillway::store::Rule {
    let quota = spillway::Quota::new(limit.requests_per_unit, limit.unit.duration())
        .expect("a unit is a whole number of seconds, at most a year");
    spillway::store::Rule::new(
        override_name(limit),
        spillway::algorithm::FixedWindow::new(quota),
    )
}

/// The name of [`override_rule`]`(limit)`.
pub fn override_name(limit: UnitLimit) -> String {
    format!(
        "{OVERRIDE_PREFIX}{}-per-{}",
        limit.requests_per_unit,
        limit.unit.name()
    )
}

/// The limit of the store rule called `name`, if it is one of
/// [`override_rule`]'s (as a state file lists it).
///
/// ```
/// use std::num::NonZeroU32;
/// use spillway_server::config::descriptors::{Unit, UnitLimit, override_name, parse_override_name};
///
/// let limit = UnitLimit { requests_per_unit: NonZeroU32::new(100).unwrap(), unit: Unit::Minute };
/// assert_eq!(parse_override_name(&override_name(limit)), Some(limit));
/// assert_eq!(parse_override_name("per-ip"), None);
/// assert_eq!(parse_override_name("envoy-override:0-per-minute"), None);
/// ```
pub fn parse_override_name(name: &str) -> Option<UnitLimit> {
    let (n, unit) = name.strip_prefix(OVERRIDE_PREFIX)?.split_once("-per-")?;
    Some(UnitLimit {
        requests_per_unit: n.parse().ok()?,
        unit: Unit::parse(unit)?,
    })
}

/// The prefix of the store rules of limit overrides, which configured rule
/// names may not start with.
pub const OVERRIDE_PREFIX: &str = "envoy-override:";

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<DescriptorFile, ConfigError> {
        DescriptorFile::parse(yaml, Path::new("limits.yaml"), 10)
    }

    fn error(yaml: &str) -> ConfigError {
        parse(yaml).expect_err("invalid")
    }

    const NESTED: &str = "\
domain: shop
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500
  - key: database
    value: default
    rate_limit: { unit: SECOND, requests_per_unit: 500 }
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: { unit: day, requests_per_unit: 5 }
  - key: to_number
    rate_limit: { unit: day, requests_per_unit: 100 }
    descriptors:
      - key: to_number
        value: '555'
        rate_limit: { name: special, unit: Day, requests_per_unit: 1000 }
  - key: path
    value: /api/*
    rate_limit: { unit: minute, requests_per_unit: 7 }
  - key: path
    value: /api/v2*
    rate_limit: { unit: minute, requests_per_unit: 8 }
  - key: path
    value: /api/v2/admin
    rate_limit: { unit: minute, requests_per_unit: 9 }
  - key: free
    rate_limit:
      unlimited: true
";

    #[test]
    fn a_tree_with_values_wildcards_and_depth() {
        let file = parse(NESTED).unwrap();
        assert_eq!(file.domain, "shop");
        assert_eq!(file.domain_line, Some(1));
        let names: Vec<_> = file.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "database_users",
                "database_default",
                "message_type_marketing.to_number",
                "to_number",
                "special",
                "path_/api/*",
                "path_/api/v2*",
                "path_/api/v2/admin",
            ]
        );
        let t = &file.tree;
        let find = |entries: &[(&str, &str)]| t.find(entries.iter().copied());
        assert_eq!(find(&[("database", "users")]), Reached::Rule(10));
        assert_eq!(find(&[("database", "default")]), Reached::Rule(11));
        // No node for this value, and no node without a value.
        assert_eq!(find(&[("database", "other")]), Reached::Nothing);
        // The limit is the last entry's: the first level has none here.
        assert_eq!(find(&[("message_type", "marketing")]), Reached::Nothing);
        assert_eq!(
            find(&[("message_type", "marketing"), ("to_number", "1")]),
            Reached::Rule(12)
        );
        assert_eq!(
            find(&[("message_type", "other"), ("to_number", "1")]),
            Reached::Nothing
        );
        // A key with no value matches any value; a value-specific node
        // below it wins over nothing.
        assert_eq!(find(&[("to_number", "1")]), Reached::Rule(13));
        assert_eq!(
            find(&[("to_number", "1"), ("to_number", "555")]),
            Reached::Rule(14)
        );
        assert_eq!(
            find(&[("to_number", "1"), ("to_number", "556")]),
            Reached::Nothing
        );
        // More entries than levels: nothing.
        assert_eq!(find(&[("database", "users"), ("x", "y")]), Reached::Nothing);
        // Exact, then the first prefix in file order.
        assert_eq!(find(&[("path", "/api/v2/admin")]), Reached::Rule(17));
        assert_eq!(find(&[("path", "/api/v2/users")]), Reached::Rule(15));
        assert_eq!(find(&[("path", "/api/v1")]), Reached::Rule(15));
        assert_eq!(find(&[("path", "/other")]), Reached::Nothing);
        assert_eq!(find(&[("free", "anything")]), Reached::Unlimited);
        assert_eq!(find(&[]), Reached::Nothing);

        assert_eq!(
            t.limit_of(14),
            Some(UnitLimit {
                requests_per_unit: NonZeroU32::new(1000).unwrap(),
                unit: Unit::Day
            })
        );
        assert_eq!(t.limit_of(9), None);
        assert_eq!(t.limit_of(18), None);
    }

    #[test]
    fn the_sample_file_loads() {
        let file = DescriptorFile::parse(
            include_str!("../../config/envoy-ratelimit.yaml"),
            Path::new("config/envoy-ratelimit.yaml"),
            0,
        )
        .unwrap();
        assert_eq!(file.domain, "edge");
        let names: Vec<_> = file.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "remote_address",
                "login-per-ip",
                "tenant_gold",
                "tenant",
                "plan_trial"
            ]
        );
        let t = &file.tree;
        assert_eq!(
            t.find([("path", "/login"), ("remote_address", "10.0.0.1")]),
            Reached::Rule(1)
        );
        assert_eq!(t.find([("path", "/static/a.css")]), Reached::Unlimited);
        assert_eq!(t.find([("tenant", "acme")]), Reached::Rule(3));
    }

    #[test]
    fn shadow_mode_and_replaces() {
        let file = parse(
            "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: true\n    detailed_metric: true\n    rate_limit: { name: a, unit: minute, requests_per_unit: 1 }\n  - key: b\n    rate_limit:\n      name: b\n      unit: hour\n      requests_per_unit: 2\n      replaces:\n        - name: a\n",
        )
        .unwrap();
        assert!(file.rules[0].shadow);
        assert!(!file.rules[1].shadow);
        assert_eq!(file.tree.replaced_by(11), [10]);
        assert!(file.tree.replaced_by(10).is_empty());
    }

    #[test]
    fn numbers_are_values_too() {
        let file = parse(
            "domain: d\ndescriptors:\n  - key: code\n    value: 200\n    rate_limit: { unit: second, requests_per_unit: 1 }\n",
        )
        .unwrap();
        assert_eq!(file.tree.find([("code", "200")]), Reached::Rule(10));
    }

    fn check(e: &ConfigError, line: usize, field: &str, message: &str) {
        assert_eq!(e.file.as_deref(), Some(Path::new("limits.yaml")), "{e}");
        assert_eq!(e.line, Some(line), "{e}");
        assert_eq!(e.field, field, "{e}");
        assert!(e.message.contains(message), "{e}");
    }

    #[test]
    fn errors_name_the_file_the_field_and_the_line() {
        let base = "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: minute\n      requests_per_unit: 5\n";
        parse(base).unwrap();
        let e = error(&base.replace("5\n", "0\n"));
        check(
            &e,
            6,
            "descriptors[0].rate_limit.requests_per_unit",
            "between 1",
        );
        let e = error(&base.replace("minute", "fortnight"));
        check(&e, 5, "descriptors[0].rate_limit.unit", "`fortnight`");
        let e = error(&base.replace("      unit: minute\n", ""));
        check(&e, 5, "descriptors[0].rate_limit.unit", "is required");
        let e = error(&base.replace("      requests_per_unit: 5\n", ""));
        check(
            &e,
            5,
            "descriptors[0].rate_limit.requests_per_unit",
            "is required",
        );
        let e = error(&base.replace("      unit: minute\n", "      unlimited: true\n"));
        check(
            &e,
            6,
            "descriptors[0].rate_limit.requests_per_unit",
            "unlimited",
        );
        let e = error(&format!("{base}      colour: red\n"));
        assert_eq!(e.line, Some(7), "{e}");
        assert!(e.message.contains("colour"), "{e}");
        let e = error(&format!("{base}  - value: x\n"));
        assert_eq!(e.line, Some(7), "{e}");
        assert!(e.message.contains("key"), "{e}");
        let e = error(&base.replace("key: a", "key: ''"));
        check(&e, 3, "descriptors[0].key", "must not be empty");
        let e = error(&base.replace("domain: d", "domain: ''"));
        check(&e, 1, "domain", "must not be empty");
        for bad in ["-5", "1.5", "many", "4294967296"] {
            let e = error(&base.replace("5\n", &format!("{bad}\n")));
            check(
                &e,
                6,
                "descriptors[0].rate_limit.requests_per_unit",
                "between 1",
            );
        }
        let e = error(&format!("{base}  - key: a\n    value: ''\n"));
        check(&e, 7, "descriptors[1].key", "`a` is already defined");
        let e =
            error("domain: d\ndescriptors:\n  - key: a\n    value: x\n  - key: a\n    value: x\n");
        check(&e, 6, "descriptors[1].value", "`a_x` is already defined");
        let e = error(&format!(
            "{base}  - key: b\n    rate_limit: {{ unit: day, requests_per_unit: 1, name: a }}\n"
        ));
        check(
            &e,
            8,
            "descriptors[1].rate_limit.name",
            "`descriptors[0].key` (line 3)",
        );
        let e = error(&format!("{base}      replaces:\n        - name: nobody\n"));
        check(
            &e,
            8,
            "descriptors[0].rate_limit.replaces[0].name",
            "`nobody`",
        );
        let e = error("domain: [a\n");
        assert_eq!(e.field, "(file)");
        assert!(e.line.is_some(), "{e}");
    }
}

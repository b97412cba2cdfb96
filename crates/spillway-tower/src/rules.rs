//! What to limit: [`HttpRule`]s, grouped in a [`Policy`] with the client,
//! tier and header settings.

use std::collections::HashMap;
use std::fmt;

use http::request::Parts;
use http::{HeaderName, Method};
use spillway::AnyAlgorithm;
use spillway::store::{Rule, RuleId};

use crate::headers::{HeaderOptions, Presented};
use crate::key::{self, Clients, Identity, KeyPart};

/// A path or host pattern: `*` matches within one segment, `**` across
/// segments (`/api/**`, `/users/*/posts`, `*.example.com`).
#[derive(Clone, PartialEq, Eq)]
pub struct Glob {
    pattern: String,
    separator: u8,
}

impl Glob {
    /// A path pattern (segments separated by `/`).
    pub fn path(pattern: impl Into<String>) -> Self {
        Self {
            pattern: pattern.into(),
            separator: b'/',
        }
    }

    /// A host pattern (labels separated by `.`), matched case-insensitively.
    pub fn host(pattern: impl Into<String>) -> Self {
        Self {
            pattern: pattern.into().to_ascii_lowercase(),
            separator: b'.',
        }
    }

    /// Whether `path` matches, or (a path pattern only) the same path
    /// spelled as some upstreams also serve it: with a trailing slash, in
    /// other letter case, or with `;parameters` in its segments (`/LOGIN`,
    /// `/login/`, `/login;jsessionid=1` all match `/login`). Matching errs
    /// toward limiting: a rule is not walked around by another spelling.
    pub fn matches_loosely(&self, path: &str) -> bool {
        if self.matches(path) {
            return true;
        }
        if self.separator != b'/' {
            return false;
        }
        let spelled_otherwise = path.bytes().any(|b| b.is_ascii_uppercase() || b == b';')
            || (path.len() > 1 && path.ends_with('/'));
        if !spelled_otherwise {
            return false;
        }
        let mut folded = String::with_capacity(path.len());
        for (i, segment) in path.split('/').enumerate() {
            if i > 0 {
                folded.push('/');
            }
            let segment = segment.split_once(';').map_or(segment, |(s, _)| s);
            folded.push_str(&segment.to_ascii_lowercase());
        }
        if folded.len() > 1 && folded.ends_with('/') {
            folded.pop();
        }
        let pattern = self.pattern.to_ascii_lowercase();
        Self {
            pattern,
            separator: b'/',
        }
        .matches(&folded)
    }

    /// Whether `s` matches.
    pub fn matches(&self, s: &str) -> bool {
        // Hosts compare without case; this runs per request and rule, so
        // only a host with upper case letters is copied.
        let lowered;
        let s = if self.separator == b'.' && s.bytes().any(|b| b.is_ascii_uppercase()) {
            lowered = s.to_ascii_lowercase();
            lowered.as_str()
        } else {
            s
        };
        // `/api/**` also matches `/api` itself.
        if let Some(prefix) = self.pattern.strip_suffix("/**")
            && s == prefix
        {
            return true;
        }
        glob_match(self.pattern.as_bytes(), s.as_bytes(), self.separator)
    }
}

impl fmt::Debug for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.pattern)
    }
}

/// The host a request names, for host rules: the absolute-form target's,
/// else the `Host` header's, without a port and without a trailing dot
/// (`api.example.com.` is `api.example.com`). A `Host` that is not ASCII
/// is an error: it cannot be compared, and letting it pass would let it
/// around every host rule.
fn request_host(parts: &Parts) -> Result<Option<&str>, &'static str> {
    let h = match parts.uri.host() {
        Some(h) => h,
        None => {
            let Some(v) = parts.headers.get(http::header::HOST) else {
                return Ok(None);
            };
            let v = v.to_str().map_err(|_| "the Host header must be ASCII")?;
            // Drop a port, but not the colons of an IPv6 literal.
            match v.rsplit_once(':') {
                Some((h, port))
                    if port.bytes().all(|b| b.is_ascii_digit()) && !h.ends_with(':') =>
                {
                    h
                }
                _ => v,
            }
        }
    };
    Ok(Some(h.strip_suffix('.').unwrap_or(h)))
}

/// Glob matching, never exponential whatever the pattern.
fn glob_match(p: &[u8], s: &[u8], sep: u8) -> bool {
    // Dynamic programming over (pattern position, text position): patterns
    // and paths are short, and this bounds the work at |p| x |s|.
    let (n, m) = (p.len(), s.len());
    let mut row = vec![false; m + 1];
    row[0] = true;
    let mut i = 0;
    while i < n {
        let mut next = vec![false; m + 1];
        if p[i] == b'*' {
            let double = i + 1 < n && p[i + 1] == b'*';
            // `**` crosses separators; `*` does not.
            let mut reach = false;
            for j in 0..=m {
                reach = reach || row[j];
                next[j] = reach;
                if j < m && !double && s[j] == sep {
                    reach = false;
                }
            }
            i += if double { 2 } else { 1 };
        } else {
            for j in 0..m {
                if row[j] && s[j] == p[i] {
                    next[j + 1] = true;
                }
            }
            i += 1;
        }
        row = next;
    }
    row[m]
}

/// What to do with a request a rule denies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Action {
    /// Answer 429 Too Many Requests.
    #[default]
    Reject,
    /// Let it through, but count, log and report it: for safe roll-out.
    Shadow,
    /// Let it through marked as limited ([`Limited`](crate::Limited)
    /// extension and `x-spillway-limited` header), so the application can
    /// serve a cheaper response.
    Degrade,
}

impl Action {
    /// The name used in configuration files.
    pub const fn name(&self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Shadow => "shadow",
            Self::Degrade => "degrade",
        }
    }
}

/// How much a request costs under a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    /// Every request costs this much.
    Fixed(u64),
    /// A [`RequestCost`](crate::RequestCost) extension, or this header when
    /// the peer is a trusted proxy; `default` otherwise. A value that is not
    /// a non-negative integer is a 400.
    Header {
        /// The header.
        name: HeaderName,
        /// The cost when the header is absent or not trusted.
        default: u64,
    },
}

/// One rate limit over HTTP requests.
#[derive(Debug, Clone)]
pub struct HttpRule {
    pub(crate) name: String,
    // The name as a structured-field string, for the IETF headers: made
    // once, written on every response.
    pub(crate) sf_name: String,
    pub(crate) methods: Vec<Method>,
    pub(crate) path: Option<Glob>,
    // True: the path must match as written (see `exact_path`).
    pub(crate) exact_path: bool,
    pub(crate) host: Option<Glob>,
    pub(crate) key: Vec<KeyPart>,
    pub(crate) fallback: Vec<KeyPart>,
    pub(crate) algorithm: AnyAlgorithm,
    pub(crate) tiers: Vec<(String, AnyAlgorithm)>,
    // The header values of each quota: the default's, then each tier's.
    pub(crate) presented: Vec<Presented>,
    // The store rule of the default quota; the tiers' follow it. Set by
    // the policy.
    pub(crate) first_id: usize,
    pub(crate) cost: Cost,
    pub(crate) action: Action,
    // False: no request matches the rule by itself (see `by_name_only`).
    pub(crate) over_http: bool,
}

impl HttpRule {
    /// A rule called `name`, enforcing `algorithm` on every request, keyed
    /// by client IP. Narrow it with the builder methods.
    pub fn new(name: impl Into<String>, algorithm: impl Into<AnyAlgorithm>) -> Self {
        let name = name.into();
        let sf_name = crate::headers::sf_name(&name);
        let algorithm = algorithm.into();
        Self {
            presented: vec![Presented::new(&sf_name, &algorithm)],
            first_id: 0,
            sf_name,
            name,
            methods: Vec::new(),
            path: None,
            exact_path: false,
            host: None,
            key: vec![KeyPart::Ip],
            fallback: vec![KeyPart::Ip],
            algorithm,
            tiers: Vec::new(),
            cost: Cost::Fixed(1),
            action: Action::Reject,
            over_http: true,
        }
    }

    /// Only these methods (default: all).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Only paths matching `pattern` (see [`Glob`]).
    pub fn path(mut self, pattern: impl Into<String>) -> Self {
        self.path = Some(Glob::path(pattern));
        self
    }

    /// The path must match the pattern as written: not with a trailing
    /// slash, in other letter case or with `;parameters` as well (see
    /// [`Glob::matches_loosely`]). For an upstream known to tell those
    /// apart.
    pub fn exact_path(mut self) -> Self {
        self.exact_path = true;
        self
    }

    /// Only this host (a pattern; see [`Glob`]).
    pub fn host(mut self, pattern: impl Into<String>) -> Self {
        self.host = Some(Glob::host(pattern));
        self
    }

    /// Count by these parts (default: the client IP).
    pub fn key(mut self, parts: impl IntoIterator<Item = KeyPart>) -> Self {
        self.key = parts.into_iter().collect();
        self
    }

    /// When a key part is missing (no API key, say), count by these instead
    /// (default: the client IP). Empty: the rule does not apply to such
    /// requests.
    pub fn fallback(mut self, parts: impl IntoIterator<Item = KeyPart>) -> Self {
        self.fallback = parts.into_iter().collect();
        self
    }

    /// A different quota for clients of `tier`.
    pub fn tier(mut self, tier: impl Into<String>, algorithm: impl Into<AnyAlgorithm>) -> Self {
        let algorithm = algorithm.into();
        self.presented
            .push(Presented::new(&self.sf_name, &algorithm));
        self.tiers.push((tier.into(), algorithm));
        self
    }

    /// What each request costs (default: 1).
    pub fn cost(mut self, cost: Cost) -> Self {
        self.cost = cost;
        self
    }

    /// What to do with a denied request (default: reject).
    pub fn action(mut self, action: Action) -> Self {
        self.action = action;
        self
    }

    /// Which of the rule's quotas applies to `tier`: 0 for the default
    /// (also when the rule has no quota for that tier), `i + 1` for
    /// `tiers[i]`.
    pub(crate) fn quota_index(&self, tier: Option<&str>) -> usize {
        tier.and_then(|t| self.tiers.iter().position(|(name, _)| name == t))
            .map_or(0, |p| p + 1)
    }

    /// The algorithm of quota `quota_index` (see [`quota_index`](Self::quota_index)).
    pub(crate) fn algorithm_of(&self, quota_index: usize) -> &AnyAlgorithm {
        quota_index
            .checked_sub(1)
            .and_then(|i| self.tiers.get(i))
            .map_or(&self.algorithm, |(_, a)| a)
    }

    /// The rule matches no HTTP request: the middleware never applies it.
    /// Its counters are still in the policy's store (see
    /// [`Policy::store_rules`]), for callers that pick rules themselves: a
    /// decision API asked for the rule by name, an Envoy rate limit service
    /// mapping descriptors onto rules.
    pub fn by_name_only(mut self) -> Self {
        self.over_http = false;
        self
    }

    /// The tiers the rule has a quota of their own for, in order.
    pub fn tiers(&self) -> impl Iterator<Item = &str> {
        self.tiers.iter().map(|(name, _)| name.as_str())
    }

    /// The time quota `quota_index` takes to refill `limit` from empty, in
    /// whole seconds: the window the headers announce. Made in advance for
    /// the quota's own capacity, which is what decisions report.
    pub(crate) fn window_secs(&self, quota_index: usize, limit: u64) -> u64 {
        match self.presented.get(quota_index) {
            Some(made) if made.limit == limit => made.window_secs,
            _ => crate::headers::window_secs(
                &spillway::Algorithm::quota(self.algorithm_of(quota_index)),
                limit,
            ),
        }
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What is done with a request this rule denies.
    pub fn on_deny(&self) -> Action {
        self.action
    }

    /// Whether the rule applies to a request with these parts; an error
    /// (a 400's message) for a host that cannot be compared.
    pub(crate) fn matches(&self, parts: &Parts) -> Result<bool, &'static str> {
        if !self.over_http {
            return Ok(false);
        }
        if !self.methods.is_empty() && !self.methods.contains(&parts.method) {
            return Ok(false);
        }
        if let Some(path) = &self.path {
            let p = parts.uri.path();
            let hit = if self.exact_path {
                path.matches(p)
            } else {
                path.matches_loosely(p)
            };
            if !hit {
                return Ok(false);
            }
        }
        if let Some(host) = &self.host {
            let Some(h) = request_host(parts)? else {
                return Ok(false);
            };
            if !host.matches(h) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether the rule's key, or the fallback it would use, needs the
    /// client's address.
    pub(crate) fn needs_ip(&self) -> bool {
        self.key.contains(&KeyPart::Ip) || self.fallback.contains(&KeyPart::Ip)
    }

    /// The key this request is counted under, if the rule applies.
    pub(crate) fn key_of(&self, client: &Identity, parts: &Parts) -> Option<String> {
        key::build_key(&self.key, client, parts).or_else(|| {
            if self.fallback.is_empty() {
                None
            } else {
                key::build_key(&self.fallback, client, parts)
            }
        })
    }
}

/// The shape of a 429's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BodyFormat {
    /// `application/problem+json` (RFC 9457): type, title, status, detail,
    /// retry_after, rule.
    #[default]
    Problem,
    /// `application/problem+json` of the problem type that
    /// draft-ietf-httpapi-ratelimit-headers-11 defines (§5.1, "Quota
    /// Exceeded"): type, title, status, detail, retry_after, and
    /// `violated-policies`, the names of the rules that denied the request
    /// as `RateLimit-Policy` lists them, in policy order (never a shadow
    /// or degrade rule). The type's URI is not registered with IANA until
    /// the draft is an RFC.
    QuotaExceeded,
    /// `application/json`: `{"error": ..., "retry_after": ...}`.
    Json,
    /// `text/plain`.
    Text,
    /// No body.
    Empty,
}

/// What the middleware does with a request when a rule that applies counts
/// by the client's address and the request carries none: no axum
/// `ConnectInfo<SocketAddr>` (an app served with `axum::serve(listener,
/// app)` rather than `app.into_make_service_with_connect_info::<SocketAddr>()`)
/// and no [`ClientAddr`](crate::ClientAddr) extension. Either way it logs an
/// error, once per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingClientAddr {
    /// Answer `500 Internal Server Error` with a problem+json body saying
    /// what is missing and how to fix it (a gRPC request gets `INTERNAL`):
    /// a limit that silently applies to nobody (a login limit, say) is
    /// worse than an error the developer sees at once.
    #[default]
    Error,
    /// Skip the rule for that request, as if it did not match: the request
    /// is not limited by it. For setups where some requests really have no
    /// address, and limiting them by other rules is enough.
    SkipRule,
}

/// Everything the middleware needs: the rules and how to identify clients
/// and answer them.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub(crate) rules: Vec<HttpRule>,
    pub(crate) clients: Clients,
    pub(crate) missing_client_addr: MissingClientAddr,
    // API key -> tier name.
    pub(crate) api_key_tiers: HashMap<String, String>,
    pub(crate) headers: HeaderOptions,
    pub(crate) body: BodyFormat,
}

impl Policy {
    /// A policy with these rules and the defaults otherwise.
    pub fn new(rules: impl IntoIterator<Item = HttpRule>) -> Self {
        let mut rules: Vec<HttpRule> = rules.into_iter().collect();
        let mut next = 0;
        for rule in &mut rules {
            rule.first_id = next;
            next += 1 + rule.tiers.len();
        }
        Self {
            rules,
            ..Self::default()
        }
    }

    /// How clients are identified (trusted proxies, API key header...).
    pub fn clients(mut self, clients: Clients) -> Self {
        self.clients = clients;
        self
    }

    /// What to do when a rule counts by the client's address and the
    /// request has none (default: [`MissingClientAddr::Error`]).
    pub fn on_missing_client_addr(mut self, missing: MissingClientAddr) -> Self {
        self.missing_client_addr = missing;
        self
    }

    /// Puts `api_key` in `tier`.
    pub fn api_key_tier(mut self, api_key: impl Into<String>, tier: impl Into<String>) -> Self {
        self.api_key_tiers.insert(api_key.into(), tier.into());
        self
    }

    /// Which headers to send.
    pub fn headers(mut self, headers: HeaderOptions) -> Self {
        self.headers = headers;
        self
    }

    /// The shape of 429 bodies.
    pub fn body(mut self, body: BodyFormat) -> Self {
        self.body = body;
        self
    }

    /// How clients are identified (trusted proxies, headers).
    pub fn client_settings(&self) -> &Clients {
        &self.clients
    }

    /// The store rules this policy needs, in [`RuleId`] order: for each HTTP
    /// rule, its default quota (named after the rule), then one per tier
    /// (named `rule@tier`), each with its own counters.
    pub fn store_rules(&self) -> Vec<Rule> {
        let mut out = Vec::new();
        for rule in &self.rules {
            out.push(Rule::new(rule.name.as_str(), rule.algorithm));
            for (tier, algorithm) in &rule.tiers {
                out.push(Rule::new(format!("{}@{tier}", rule.name), *algorithm));
            }
        }
        out
    }

    /// How many store rules the policy needs: [`store_rules`](Self::store_rules)'s
    /// length.
    pub fn store_rule_count(&self) -> usize {
        self.rules.iter().map(|r| 1 + r.tiers.len()).sum()
    }

    /// The store rule of HTTP rule `index` for `tier` (its default rule
    /// when the rule has no quota for that tier); see
    /// [`store_rules`](Self::store_rules).
    pub fn rule_id(&self, index: usize, tier: Option<&str>) -> RuleId {
        let rule = &self.rules[index];
        RuleId(rule.first_id + rule.quota_index(tier))
    }

    /// The HTTP rules, in order: a rule's index here is its `index` in
    /// [`rule_id`](Self::rule_id).
    pub fn rules(&self) -> &[HttpRule] {
        &self.rules
    }

    /// Which headers to send.
    pub fn header_options(&self) -> &HeaderOptions {
        &self.headers
    }

    /// The shape of 429 bodies.
    pub fn body_format(&self) -> BodyFormat {
        self.body
    }

    /// The client's tier: an extension or trusted header, else the API-key
    /// table.
    pub(crate) fn tier_of<'a>(&'a self, client: &'a Identity) -> Option<&'a str> {
        client.tier.as_deref().or_else(|| {
            client
                .api_key
                .as_ref()
                .and_then(|k| self.api_key_tiers.get(k))
                .map(String::as_str)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        let g = Glob::path("/api/**");
        assert!(g.matches("/api/v1/users/7"));
        assert!(g.matches("/api/"));
        assert!(g.matches("/api"));
        assert!(!g.matches("/apix/1"));
        let g = Glob::path("/users/*/posts");
        assert!(g.matches("/users/7/posts"));
        assert!(!g.matches("/users/7/8/posts"));
        assert!(Glob::path("/login").matches("/login"));
        assert!(!Glob::path("/login").matches("/login/x"));
        assert!(Glob::path("/files/*.json").matches("/files/a.json"));
        assert!(Glob::host("*.Example.com").matches("API.example.com"));
        assert!(!Glob::host("*.example.com").matches("a.b.example.com"));
        assert!(Glob::host("**.example.com").matches("a.b.example.com"));
        // Pathological patterns stay cheap.
        let long = "a".repeat(2000);
        assert!(!Glob::path("*a*a*a*a*a*a*a*b").matches(&long));
    }

    #[test]
    fn a_path_matches_loosely_in_the_spellings_upstreams_also_serve() {
        let login = Glob::path("/login");
        for spelling in [
            "/login/",
            "/LOGIN",
            "/Login/",
            "/login;jsessionid=1",
            "/LOGIN;a=b/",
        ] {
            assert!(login.matches_loosely(spelling), "{spelling}");
            assert!(!login.matches(spelling), "{spelling}");
        }
        assert!(!login.matches_loosely("/login/x"));
        assert!(!login.matches_loosely("/logins"));
        let api = Glob::path("/API/*/users");
        assert!(api.matches_loosely("/api/v1;x=1/Users/"));
        // Hosts are not loosened: they compare without case already.
        assert!(!Glob::host("a.example").matches_loosely("a.example."));
    }

    fn parts(uri: &str, host: &[u8]) -> Parts {
        let mut request = http::Request::get(uri).body(()).unwrap();
        request.headers_mut().insert(
            http::header::HOST,
            http::HeaderValue::from_bytes(host).unwrap(),
        );
        request.into_parts().0
    }

    #[test]
    fn a_rule_matches_other_spellings_unless_it_asks_for_the_exact_path() {
        let algorithm = spillway::algorithm::FixedWindow::new(spillway::Quota::per_minute(
            std::num::NonZeroU32::new(1).unwrap(),
        ));
        let loose = HttpRule::new("login", algorithm).path("/login");
        let exact = HttpRule::new("login", algorithm)
            .path("/login")
            .exact_path();
        assert_eq!(loose.matches(&parts("/Login/", b"h")), Ok(true));
        assert_eq!(exact.matches(&parts("/Login/", b"h")), Ok(false));
        assert_eq!(exact.matches(&parts("/login", b"h")), Ok(true));
    }

    #[test]
    fn a_host_rule_ignores_a_trailing_dot_and_refuses_non_ascii() {
        let algorithm = spillway::algorithm::FixedWindow::new(spillway::Quota::per_minute(
            std::num::NonZeroU32::new(1).unwrap(),
        ));
        let rule = HttpRule::new("api", algorithm).host("api.example.com");
        assert_eq!(rule.matches(&parts("/", b"api.example.com.")), Ok(true));
        assert_eq!(rule.matches(&parts("/", b"API.example.com.:443")), Ok(true));
        assert_eq!(rule.matches(&parts("/", b"other.example")), Ok(false));
        assert!(
            rule.matches(&parts("/", b"api.ex\xc3\xa4mple.com"))
                .is_err()
        );
        let absolute = parts("http://api.example.com./", b"other.example");
        assert_eq!(rule.matches(&absolute), Ok(true));
    }

    #[test]
    fn tiers_get_their_own_store_rules() {
        use spillway::Quota;
        use spillway::algorithm::FixedWindow;
        use std::num::NonZeroU32;
        let q = |n| FixedWindow::new(Quota::per_minute(NonZeroU32::new(n).unwrap()));
        let policy = Policy::new([
            HttpRule::new("a", q(1)).tier("pro", q(2)),
            HttpRule::new("b", q(3)),
        ]);
        let names: Vec<_> = policy
            .store_rules()
            .iter()
            .map(|r| r.name().to_string())
            .collect();
        assert_eq!(names, ["a", "a@pro", "b"]);
        assert_eq!(policy.rule_id(0, Some("pro")), RuleId(1));
        assert_eq!(policy.rule_id(0, Some("unknown")), RuleId(0));
        assert_eq!(policy.rule_id(1, Some("pro")), RuleId(2));
    }
}

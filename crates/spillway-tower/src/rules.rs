//! What to limit: [`HttpRule`]s, grouped in a [`Policy`] with the client,
//! tier and header settings.

use std::collections::HashMap;
use std::fmt;

use http::request::Parts;
use http::{HeaderName, Method};
use spillway::AnyAlgorithm;
use spillway::store::{Rule, RuleId};

use crate::budget::{Reserve, ResponseCost};
use crate::engine::Small;
use crate::headers::{HeaderOptions, Presented};
use crate::host::host_of_authority;
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
        // A Servlet container strips the parameters, then merges the
        // slashes that leaves: `/;x/login` is its `//login`, `/login`.
        let mut folded = String::with_capacity(path.len());
        for segment in path.split('/').skip(1) {
            let segment = segment.split_once(';').map_or(segment, |(s, _)| s);
            if segment.is_empty() {
                continue;
            }
            folded.push('/');
            folded.push_str(&segment.to_ascii_lowercase());
        }
        if folded.is_empty() {
            folded.push('/');
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

/// The host a request names, for host rules: the absolute-form target's
/// authority, else the `Host` header's, without a port and without a
/// trailing dot (`api.example.com.` is `api.example.com`). A host that is
/// not one every router reads alike ([`host_of_authority`]) is an error:
/// `admin.example.com,x` is `admin.example.com` to some, and letting it
/// pass would let it around every host rule.
fn request_host(parts: &Parts) -> Result<Option<&str>, &'static str> {
    let authority = match parts.uri.authority() {
        Some(authority) => authority.as_str().as_bytes(),
        None => match parts.headers.get(http::header::HOST) {
            Some(host) => host.as_bytes(),
            None => return Ok(None),
        },
    };
    match host_of_authority(authority) {
        Some(host) => Ok(Some(host)),
        None => Err("the Host is not a host name, an IP address or a port"),
    }
}

/// A request extension: other paths the application behind may take the
/// request's path for, set by a front end that forwards the path as it
/// came but knows routers read it otherwise (`spillway proxy` sets
/// `/x%2F..%2Flogin`'s `/login`: WSGI servers and Rack decode `%2F`). A path
/// rule that matches the path or any of these applies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OtherPaths(pub Vec<String>);

/// The headers with which frameworks let a request name another method
/// than its own (Express's method-override, Rack, Symfony, Laravel, many
/// API gateways): a rule on a method counts the requests that name it so.
pub const METHOD_OVERRIDES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// A query component as a framework's parser reads it: `%XX` decoded,
/// `+` a space.
fn percent_decoded(bytes: &[u8]) -> Vec<u8> {
    let hex = |b: u8| char::from(b).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(hi), Some(lo)) => {
                    out.push(u8::try_from(hi * 16 + lo).expect("two hex digits"));
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    out
}

/// Whether a host a trusted proxy in front names in `X-Forwarded-Host`
/// matches: many upstreams route by it when they trust that proxy
/// (Express's `req.hostname` takes its first element, others the last), so
/// a host rule counts a request for which any element matches.
/// An element that is not a host is an error, as a `Host` that is not
/// one is: Express cuts `admin.example.com:8o` at the colon.
fn forwarded_host_matches(host: &Glob, parts: &Parts) -> Result<bool, &'static str> {
    let elements = parts
        .headers
        .get_all("x-forwarded-host")
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|element| !element.is_empty());
    let mut matched = false;
    for element in elements {
        let h = host_of_authority(element)
            .ok_or("X-Forwarded-Host is not a host name, an IP address or a port")?;
        matched |= host.matches(h);
    }
    Ok(matched)
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
    /// By route: the cost of the first of `routes` that the request
    /// reaches, `default` when it reaches none. One rule, one counter per
    /// key, and each endpoint its own price inside that budget ("every
    /// request costs 1 of the key's 100 a minute, `/reports` costs 10").
    ///
    /// A route is reached as a rule's `match` is: by the path in any
    /// spelling some upstream serves it (letter case, a trailing slash,
    /// `;parameters`), by the other paths a front end says routers read
    /// ([`OtherPaths`]), by `HEAD` for `GET`, and by a method override. A
    /// request that can be read as several paths pays, of each reading's
    /// first route, the dearest: another spelling never buys a cheaper
    /// route.
    Routes {
        /// The table, in order.
        routes: Vec<RouteCost>,
        /// The cost of a request that reaches no route.
        default: u64,
    },
    /// Known only from the response (a budget): the request reserves an
    /// estimate when it is admitted, and the charge is settled at what its
    /// response cost once it has ended (see [`crate::budget`]).
    Response(Box<ResponseCost>),
}

/// One row of a [`Cost::Routes`] table: requests of these methods (any,
/// when none is given) to paths that match this pattern cost this much.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteCost {
    pub(crate) methods: Vec<Method>,
    pub(crate) path: Glob,
    pub(crate) cost: u64,
}

impl RouteCost {
    /// Requests to paths matching `pattern` (`/reports/**`: see [`Glob`])
    /// cost `cost`, whatever their method.
    pub fn new(pattern: impl Into<String>, cost: u64) -> Self {
        Self {
            methods: Vec::new(),
            path: Glob::path(pattern),
            cost,
        }
    }

    /// Only requests of these methods (and `HEAD` for `GET`).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// The cost.
    pub fn cost(&self) -> u64 {
        self.cost
    }
}

impl Cost {
    /// A request's cost under [`Cost::Routes`]: for each way a router may
    /// read it (its path, or one of [`OtherPaths`]; its method, one a
    /// method override names, or, for a `POST`, any method of the table),
    /// the first route it reaches, or `default`; the dearest of these.
    pub(crate) fn of_routes(routes: &[RouteCost], default: u64, parts: &Parts) -> u64 {
        let mut methods: Small<Method> = smallvec::smallvec![parts.method.clone()];
        methods.extend(
            named_methods(parts).iter().filter_map(|m| {
                Method::from_bytes(m.as_str().to_ascii_uppercase().as_bytes()).ok()
            }),
        );
        if parts.method == Method::POST {
            // Its `_method` may be in its body, unread: any of them.
            methods.extend(routes.iter().flat_map(|r| r.methods.iter().cloned()));
        }
        let first = |path: &str, method: &Method| {
            routes
                .iter()
                .find(|r| r.path.matches_loosely(path) && reaches_methods(&r.methods, method))
                .map_or(default, |r| r.cost)
        };
        let other = parts.extensions.get::<OtherPaths>();
        let paths = std::iter::once(parts.uri.path()).chain(
            other
                .into_iter()
                .flat_map(|o| o.0.iter().map(String::as_str)),
        );
        paths
            .flat_map(|path| methods.iter().map(move |m| (path, m)))
            .map(|(path, m)| first(path, m))
            .max()
            .unwrap_or(default)
    }
}

/// The methods a request names besides its own, by a method override
/// header or a `_method` in its query (a list's every element: frameworks
/// take the first, any may be).
fn named_methods(parts: &Parts) -> Small<Method> {
    let mut out = Small::new();
    let mut named = |value: &[u8]| {
        out.extend(
            value
                .split(|&b| b == b',')
                .filter_map(|name| Method::from_bytes(name.trim_ascii()).ok()),
        );
    };
    for value in METHOD_OVERRIDES
        .iter()
        .flat_map(|h| parts.headers.get_all(h))
    {
        named(value.as_bytes());
    }
    if let Some(query) = parts.uri.query() {
        for (k, v) in query
            .split(['&', ';'])
            .filter_map(|pair| pair.split_once('='))
        {
            if percent_decoded(k.as_bytes()) == b"_method" {
                named(&percent_decoded(v.as_bytes()));
            }
        }
    }
    out
}

/// Whether a request of `method` is one of `methods` (any, when empty), or
/// a `HEAD` for a `GET`, which every framework routes to `GET`'s handler.
fn reaches_methods(methods: &[Method], method: &Method) -> bool {
    methods.is_empty()
        || methods.contains(method)
        || (method == Method::HEAD && methods.contains(&Method::GET))
}

/// Whether a request routed as `method` (named in any letter case) reaches
/// a handler of `methods`: `HEAD` reaches `GET`'s.
fn has_method(methods: &[Method], method: &Method) -> bool {
    let is = |m: &Method| {
        methods
            .iter()
            .any(|r| r.as_str().eq_ignore_ascii_case(m.as_str()))
    };
    is(method) || (method.as_str().eq_ignore_ascii_case("HEAD") && is(&Method::GET))
}

/// Whether a request whose own method is not one of `methods` (nor `HEAD`
/// for `GET`) may be routed as one all the same: by the method a method
/// override names (`X-HTTP-Method-Override`, `X-HTTP-Method`,
/// `X-Method-Override`, `_method` in the query), which Express's
/// method-override, Rack, Symfony and Laravel route by; and, for a `POST`,
/// any method, since its `_method` may be in its body. Matching errs
/// toward limiting: a `POST` that asks to be a `DELETE` counts as one (and
/// as a `POST`).
fn routed_by_an_override(methods: &[Method], parts: &Parts) -> bool {
    if parts.method == Method::POST {
        // Its method may be in its body (`_method=DELETE`: Rack reads a
        // form, or a body with no type, Laravel JSON too), which is not
        // read here: it counts as every method on its path.
        return true;
    }
    named_methods(parts).iter().any(|m| has_method(methods, m))
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
    // False: the upstream honours no method override (see
    // `method_overrides`).
    pub(crate) method_overrides: bool,
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
    // The wait a denial announces at most (see `retry_after_hint`).
    pub(crate) retry_hint: Option<std::time::Duration>,
    // The status a denial is answered with (see `deny_status`).
    pub(crate) deny_status: http::StatusCode,
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
            method_overrides: true,
            host: None,
            key: vec![KeyPart::Ip],
            fallback: vec![KeyPart::Ip],
            algorithm,
            tiers: Vec::new(),
            cost: Cost::Fixed(1),
            action: Action::Reject,
            over_http: true,
            retry_hint: None,
            deny_status: http::StatusCode::TOO_MANY_REQUESTS,
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

    /// Whether the rule also counts requests that may be routed as one of
    /// its methods by a method override (default `true`): one named in
    /// `X-HTTP-Method-Override`, `X-HTTP-Method`, `X-Method-Override` or
    /// `_method` in the query, and any `POST`, whose `_method` may be in its
    /// body. `false` is for an upstream that honours none of them: then a
    /// rule on `GET /login` does not count the login form's `POST`.
    pub fn method_overrides(mut self, followed: bool) -> Self {
        self.method_overrides = followed;
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

    /// The longest wait a denial by this rule announces (`Retry-After`):
    /// for a concurrency rule, whose exact wait (until its oldest lease
    /// ends, were nobody to finish) is an upper bound, while slots come
    /// back whenever requests finish. The wait announced is the shorter of
    /// the two, and never 0.
    pub fn retry_after_hint(mut self, hint: std::time::Duration) -> Self {
        self.retry_hint = Some(hint);
        self
    }

    /// The status a denial by this rule is answered with (default 429): a
    /// concurrency rule guarding an overloaded backend may answer 503, the
    /// status of a server that cannot take the request now.
    pub fn deny_status(mut self, status: http::StatusCode) -> Self {
        self.deny_status = status;
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
            _ => crate::headers::window_secs_of(self.algorithm_of(quota_index), limit),
        }
    }

    /// The default quota's algorithm (a tier may have another).
    pub fn algorithm(&self) -> &AnyAlgorithm {
        &self.algorithm
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What is done with a request this rule denies.
    pub fn on_deny(&self) -> Action {
        self.action
    }

    /// Whether the rule applies to a request with these parts, from a peer
    /// that is a trusted proxy or not; an error (a 400's message) for a
    /// host that cannot be compared.
    pub(crate) fn matches(&self, parts: &Parts, peer_trusted: bool) -> Result<bool, &'static str> {
        if !self.over_http {
            return Ok(false);
        }
        let by_its_method = reaches_methods(&self.methods, &parts.method);
        if let Some(path) = &self.path {
            let hit = |p: &str| {
                if self.exact_path {
                    path.matches(p)
                } else {
                    path.matches_loosely(p)
                }
            };
            let other = parts.extensions.get::<OtherPaths>();
            if !(hit(parts.uri.path()) || other.is_some_and(|o| o.0.iter().any(|p| hit(p)))) {
                return Ok(false);
            }
        }
        if let Some(host) = &self.host {
            let asked = request_host(parts)?.is_some_and(|h| host.matches(h));
            if !(asked || peer_trusted && forwarded_host_matches(host, parts)?) {
                return Ok(false);
            }
        }
        // Last, as the dearest test, on the few requests whose method is
        // not the rule's but whose path and host are.
        Ok(by_its_method || self.routed_by_an_override(parts))
    }

    /// Whether a request whose own method is not one of the rule's may be
    /// routed as one all the same, by a method override (see
    /// [`routed_by_an_override`]). A rule made with
    /// [`method_overrides(false)`](HttpRule::method_overrides) counts only
    /// the request's own method.
    fn routed_by_an_override(&self, parts: &Parts) -> bool {
        self.method_overrides && routed_by_an_override(&self.methods, parts)
    }

    /// Whether the rule's key, or the fallback it would use, needs the
    /// client's address.
    pub(crate) fn needs_ip(&self) -> bool {
        self.key.contains(&KeyPart::Ip) || self.fallback.contains(&KeyPart::Ip)
    }

    /// The key this request is counted under, if the rule applies; an
    /// error (a 400's message) for a key part sent twice or unreadable,
    /// which is never taken for one that is missing.
    pub(crate) fn key_of(
        &self,
        client: &Identity,
        parts: &Parts,
    ) -> Result<Option<key::KeyText>, String> {
        match key::build_key(&self.key, client, parts)? {
            Some(key) => Ok(Some(key)),
            None if self.fallback.is_empty() => Ok(None),
            None => key::build_key(&self.fallback, client, parts),
        }
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

    /// Puts `api_key` in `tier`. A key sent as a token is found in any of
    /// the spellings that key it ([`Credential`](crate::Credential)).
    pub fn api_key_tier(mut self, api_key: impl Into<String>, tier: impl Into<String>) -> Self {
        let tier = tier.into();
        for spelling in key::api_key_spellings(&api_key.into()) {
            self.api_key_tiers.insert(spelling, tier.clone());
        }
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

    /// The request headers the rules read (for keys, tiers, users and
    /// costs), besides the forwarding headers: a front end that passes
    /// headers on must not let another spelling of one reach the upstream
    /// (CGI and WSGI read `X_Api_Key` as `X-Api-Key`).
    pub fn headers_read(&self) -> Vec<HeaderName> {
        let mut names: Vec<HeaderName> = Vec::new();
        let clients = &self.clients;
        for place in &clients.api_key {
            names.push(place.header_name());
        }
        names.extend(clients.user_header.iter().cloned());
        names.extend(clients.tier_header.iter().cloned());
        for rule in &self.rules {
            for part in rule.key.iter().chain(&rule.fallback) {
                match part {
                    KeyPart::Header(name) => names.push(name.clone()),
                    KeyPart::Credential(c) => names.push(c.header_name()),
                    _ => {}
                }
            }
            match &rule.cost {
                Cost::Header { name, .. } => names.push(name.clone()),
                Cost::Response(budget) => {
                    if let Reserve::Header { name, .. } = &budget.reserve {
                        names.push(name.clone());
                    }
                }
                Cost::Fixed(_) | Cost::Routes { .. } => {}
            }
        }
        names.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        names.dedup();
        names
    }

    /// The top-level fields of a request's JSON body that budget rules
    /// reserve by ([`Reserve::Request`]), each once, in rule order: what a
    /// [`ReadRequestLayer`](crate::ReadRequestLayer) in front of the rate
    /// limiter must read. Empty when no rule reserves so.
    pub fn request_fields(&self) -> Vec<String> {
        let mut fields: Vec<String> = Vec::new();
        for rule in &self.rules {
            if let Cost::Response(budget) = &rule.cost
                && let Reserve::Request { field, .. } = &budget.reserve
                && !fields.contains(field)
            {
                fields.push(field.clone());
            }
        }
        fields
    }

    /// Whether a budget rule that reserves what the request's body asks
    /// may apply to a request with these parts: whether a
    /// [`ReadRequestLayer`](crate::ReadRequestLayer) in front should read
    /// its body. Any other request is passed on unread, so that reading
    /// bodies costs nothing to the requests no budget counts. (A host
    /// compared with a forwarded one counts as matching: reading a body too
    /// many is the safe side.)
    pub fn reads_body(&self, parts: &Parts) -> bool {
        self.rules.iter().any(|rule| {
            matches!(&rule.cost, Cost::Response(b) if matches!(b.reserve, Reserve::Request { .. }))
                && rule.matches(parts, true).unwrap_or(true)
        })
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
            // A budget that gives back what is not settled in time has its
            // store hold each reservation open.
            let release = match &rule.cost {
                Cost::Response(budget) => budget.release_after,
                _ => None,
            };
            let store_rule = |name: String, algorithm| {
                let r = Rule::new(name, algorithm);
                match release {
                    Some(within) => r.release_unsettled_after(within),
                    None => r,
                }
            };
            out.push(store_rule(rule.name.clone(), rule.algorithm));
            for (tier, algorithm) in &rule.tiers {
                out.push(store_rule(format!("{}@{tier}", rule.name), *algorithm));
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
    /// table; an error (a 400's message) when the table would be read and
    /// the API key was sent twice or cannot be read: a key in a stricter
    /// tier than the default must not escape it by being sent twice.
    pub(crate) fn tier_of<'a>(
        &'a self,
        client: &'a Identity<'_>,
    ) -> Result<Option<&'a str>, &'a str> {
        if let Some(tier) = client.tier() {
            return Ok(Some(tier));
        }
        if self.api_key_tiers.is_empty() {
            return Ok(None);
        }
        match client.api_key() {
            Ok(key) => Ok(key
                .as_ref()
                .and_then(|k| self.api_key_tiers.get(k))
                .map(String::as_str)),
            Err(e) => Err(e),
        }
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
            // Tomcat strips `;x`, then merges `//`.
            "/;x/login",
            "/;/login;",
            "/login/;x",
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
        assert_eq!(loose.matches(&parts("/Login/", b"h"), false), Ok(true));
        assert_eq!(exact.matches(&parts("/Login/", b"h"), false), Ok(false));
        assert_eq!(exact.matches(&parts("/login", b"h"), false), Ok(true));
    }

    #[test]
    fn a_host_rule_ignores_a_trailing_dot_and_refuses_non_ascii() {
        let algorithm = spillway::algorithm::FixedWindow::new(spillway::Quota::per_minute(
            std::num::NonZeroU32::new(1).unwrap(),
        ));
        let rule = HttpRule::new("api", algorithm).host("api.example.com");
        assert_eq!(
            rule.matches(&parts("/", b"api.example.com."), false),
            Ok(true)
        );
        assert_eq!(
            rule.matches(&parts("/", b"API.example.com.:443"), false),
            Ok(true)
        );
        assert_eq!(
            rule.matches(&parts("/", b"other.example"), false),
            Ok(false)
        );
        assert!(
            rule.matches(&parts("/", b"api.ex\xc3\xa4mple.com"), false)
                .is_err()
        );
        let absolute = parts("http://api.example.com./", b"other.example");
        assert_eq!(rule.matches(&absolute, false), Ok(true));
        // Express with `trust proxy` serves both as api.example.com.
        for folded in [&b"api.example.com,x"[..], b"api.example.com:8o"] {
            assert!(rule.matches(&parts("/", folded), false).is_err());
        }
    }

    #[test]
    fn a_path_rule_counts_the_other_paths_a_front_end_says_routers_read() {
        let algorithm = spillway::algorithm::FixedWindow::new(spillway::Quota::per_minute(
            std::num::NonZeroU32::new(1).unwrap(),
        ));
        let rule = HttpRule::new("login", algorithm).path("/login");
        let mut parts = request(Method::POST, "/x%2F..%2Flogin", &[]);
        assert_eq!(rule.matches(&parts, false), Ok(false));
        parts.extensions.insert(OtherPaths(vec!["/login".into()]));
        assert_eq!(rule.matches(&parts, false), Ok(true));
        parts.extensions.insert(OtherPaths(vec!["/x/login".into()]));
        assert_eq!(rule.matches(&parts, false), Ok(false));
    }

    #[test]
    fn a_host_rule_counts_the_host_a_trusted_proxy_forwards() {
        let algorithm = spillway::algorithm::FixedWindow::new(spillway::Quota::per_minute(
            std::num::NonZeroU32::new(1).unwrap(),
        ));
        let rule = HttpRule::new("api", algorithm).host("api.example.com");
        for forwarded in [
            "api.example.com",
            "API.example.com:443",
            "other.example, api.example.com",
        ] {
            let parts = request(
                Method::GET,
                "/",
                &[
                    ("host", "backend.internal"),
                    ("x-forwarded-host", forwarded),
                ],
            );
            assert_eq!(rule.matches(&parts, true), Ok(true), "{forwarded}");
            // Only a trusted proxy's: the proxy replaces a client's.
            assert_eq!(rule.matches(&parts, false), Ok(false), "{forwarded}");
        }
        // One that is not a host is refused, as a `Host` would be.
        for forwarded in ["api.example.com:8o", "api.example.com,x y"] {
            let parts = request(
                Method::GET,
                "/",
                &[
                    ("host", "backend.internal"),
                    ("x-forwarded-host", forwarded),
                ],
            );
            assert!(rule.matches(&parts, true).is_err(), "{forwarded}");
        }
    }

    fn request(method: Method, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut builder = http::Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    /// The table of the docs' example: reports cost 10, an export 20 (by
    /// `POST` only), everything else 1, and no spelling or method
    /// override buys a cheaper row.
    #[test]
    fn a_route_costs_its_first_row_in_the_dearest_reading() {
        let routes = vec![
            RouteCost::new("/reports/**", 10),
            RouteCost::new("/exports", 20).methods([Method::POST]),
            RouteCost::new("/exports", 2).methods([Method::GET]),
            RouteCost::new("/reports/cheap", 1),
        ];
        let cost = |parts: &Parts| Cost::of_routes(&routes, 1, parts);
        let get = |uri: &str| request(Method::GET, uri, &[]);
        assert_eq!(cost(&get("/items")), 1, "no row: the default");
        assert_eq!(cost(&get("/reports")), 10);
        assert_eq!(cost(&get("/reports/2026/q4")), 10);
        // The first row wins: the later, cheaper one is never reached.
        assert_eq!(cost(&get("/reports/cheap")), 10);
        assert_eq!(cost(&request(Method::POST, "/exports", &[])), 20);
        assert_eq!(cost(&get("/exports")), 2);
        assert_eq!(
            cost(&request(Method::HEAD, "/exports", &[])),
            2,
            "HEAD is GET"
        );
        assert_eq!(cost(&request(Method::DELETE, "/exports", &[])), 1);
        // Other spellings of the same route.
        for uri in ["/REPORTS/x", "/reports;jsessionid=1/x", "/Reports/"] {
            assert_eq!(cost(&get(uri)), 10, "{uri}");
        }
        // A GET that a method override makes a POST pays the POST's row.
        let overridden = request(
            Method::GET,
            "/exports",
            &[("x-http-method-override", "post")],
        );
        assert_eq!(cost(&overridden), 20);
        assert_eq!(cost(&get("/exports?_method=POST")), 20);
        // A path a router reads otherwise pays that path's row.
        let mut parts = get("/x%2F..%2Freports");
        assert_eq!(cost(&parts), 1);
        parts.extensions.insert(OtherPaths(vec!["/reports".into()]));
        assert_eq!(cost(&parts), 10);
    }

    #[test]
    fn a_rule_on_a_method_counts_head_and_method_overrides() {
        let algorithm = spillway::algorithm::FixedWindow::new(spillway::Quota::per_minute(
            std::num::NonZeroU32::new(1).unwrap(),
        ));
        let report = HttpRule::new("report", algorithm)
            .methods([Method::GET])
            .path("/report");
        let report_as = |method: Method, uri: &str, headers: &[(&str, &str)]| {
            report.matches(&request(method, uri, headers), false)
        };
        assert_eq!(report_as(Method::HEAD, "/report", &[]), Ok(true));
        assert_eq!(report_as(Method::PUT, "/report", &[]), Ok(false));
        // An override to HEAD is routed to the GET handler.
        let head = [("x-http-method-override", "HEAD")];
        assert_eq!(report_as(Method::PUT, "/report", &head), Ok(true));
        assert_eq!(
            report_as(Method::PUT, "/report?_method=head", &[]),
            Ok(true)
        );

        let delete = HttpRule::new("delete", algorithm)
            .methods([Method::DELETE])
            .path("/items/*");
        let put = |uri: &str, headers: &[(&str, &str)]| {
            delete.matches(&request(Method::PUT, uri, headers), false)
        };
        for header in [
            "x-http-method-override",
            "x-http-method",
            "x-method-override",
        ] {
            for value in ["delete", " DELETE ", "DELETE, GET", "delete,"] {
                assert_eq!(
                    put("/items/1", &[(header, value)]),
                    Ok(true),
                    "{header}: {value}"
                );
            }
            assert_eq!(put("/items/1", &[(header, "PUT")]), Ok(false), "{header}");
        }
        assert_eq!(put("/items/1?_method=DELETE", &[]), Ok(true));
        assert_eq!(put("/items/1?a=1&%5Fmethod=%64elete", &[]), Ok(true));
        assert_eq!(put("/items/1?_method=PUT", &[]), Ok(false));
        assert_eq!(put("/items/1?x_method=DELETE", &[]), Ok(false));
        assert_eq!(put("/items/1", &[]), Ok(false));
        // The override only adds methods: the path must still match.
        assert_eq!(put("/other?_method=DELETE", &[]), Ok(false));
        // A POST's `_method` may be in its body (a form, a body of no type
        // for Rack, JSON for Laravel), which is not read: a POST counts
        // against the rules on every method of its path.
        for content_type in [
            "application/x-www-form-urlencoded, text/plain",
            "multipart/mixed; boundary=x",
            "application/json",
        ] {
            let post = request(Method::POST, "/items/1", &[("content-type", content_type)]);
            assert_eq!(delete.matches(&post, false), Ok(true), "{content_type}");
        }
        let post = request(Method::POST, "/items/1", &[]);
        assert_eq!(delete.matches(&post, false), Ok(true));
        assert_eq!(
            delete.matches(&request(Method::POST, "/other", &[]), false),
            Ok(false)
        );
        // Unless the upstream honours no override.
        let plain = delete.clone().method_overrides(false);
        assert_eq!(plain.matches(&post, false), Ok(false));
        let overridden = request(Method::PUT, "/items/1", &[("x-http-method", "DELETE")]);
        assert_eq!(plain.matches(&overridden, false), Ok(false));
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

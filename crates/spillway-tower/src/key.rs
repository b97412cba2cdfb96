//! Who is asking: the client's IP (with trusted proxies), API key, user id,
//! route, and the keys built from them.
//!
//! The client IP comes from the socket. `Forwarded` and `X-Forwarded-For` are
//! read only when the socket peer is a trusted proxy, and then the client is
//! the right-most address that is not itself a trusted proxy: every hop to
//! its right was appended by a proxy we trust, every hop to its left could
//! have been written by the client. Anything else would let a client choose
//! its own key.
//!
//! The chain is read hop by hop, as bytes, from the right. A hop that is not
//! an address (`unknown`, an obfuscated `_id`, garbage) stops the walk: the
//! trusted proxy that appended it is telling us it does not know better,
//! and the client is keyed by what it wrote, scoped to that proxy
//! (`ip=10.0.0.2#unknown`): never by the proxy's own address, which would
//! put every client behind it in one bucket.
//!
//! An IPv4-mapped IPv6 address (`::ffff:192.0.2.1`, what a dual-stack `[::]`
//! listener reports for a peer that connected over IPv4) is the IPv4 address
//! everywhere: in the trusted-proxy CIDRs, in forwarded hops and in keys.

use std::cell::OnceCell;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use sha2::{Digest, Sha256};

/// A key's text: held inline, with no allocation, up to 24 bytes (an IPv4
/// address's key, most API keys' and users'), on the heap past that.
pub type KeyText = compact_str::CompactString;

/// The peer's socket address, for servers that are not axum (axum's
/// `ConnectInfo<SocketAddr>` is read too, with the `axum` feature). Insert it
/// as a request extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub SocketAddr);

/// The authenticated user, set as a request extension by an auth layer that
/// runs before the rate limiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserId(pub String);

/// The client's tier, set as a request extension by an auth layer that runs
/// before the rate limiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tier(pub String);

/// One dimension a rule can count by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPart {
    /// The API key, from the places [`Clients::api_key`] names.
    ApiKey,
    /// The client's IP address.
    Ip,
    /// The user id: a [`UserId`] extension, or the configured header when the
    /// peer is a trusted proxy.
    User,
    /// The endpoint: method and route template (axum's `MatchedPath` when
    /// present, else the path).
    Route,
    /// The HTTP method.
    Method,
    /// Any request header, by name. A header sent on two lines is refused
    /// (400): upstreams read the first, the last or both joined.
    Header(HeaderName),
    /// One credential, from one place ([`Credential`]), read as the
    /// upstream that authenticates it reads it.
    Credential(Credential),
}

/// Where a credential comes from: the one place the upstream authenticates
/// it. A key must be the credential the upstream trusts: keyed by a header
/// the upstream ignores, a client would send a fresh junk value beside its
/// real key with every request, and get a fresh quota with each.
///
/// A credential is read strictly: sent twice (two lines, or two places that
/// disagree) or present but unreadable, the request is refused (400), never
/// taken for a request without one, which a rule with `fallback = []` would
/// let past.
///
/// ```
/// use spillway_tower::key::Credential;
///
/// assert_eq!(Credential::parse("bearer"), Ok(Credential::bearer()));
/// assert_eq!(Credential::parse("header:x-api-key").unwrap().name(), "header:x-api-key");
/// assert_eq!(Credential::parse("authorization:Token").unwrap().name(), "authorization:token");
/// assert!(Credential::parse("cookie").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Credential {
    /// `Authorization: <scheme> <token>`, the scheme compared without case
    /// (`bearer`, RFC 6750; `token`, Django REST framework's). Read as
    /// common parsers read it: the scheme and the token separated by
    /// spaces or tabs, any number; the token in the token68 alphabet.
    /// Another scheme is not this credential.
    Authorization(String),
    /// A header whose whole value is the credential (`X-Api-Key`): visible
    /// ASCII, no comma, no space.
    Header(HeaderName),
}

impl Credential {
    /// `Authorization: Bearer`.
    pub fn bearer() -> Self {
        Self::Authorization("bearer".into())
    }

    /// The name used in configuration: `bearer`, `authorization:SCHEME`,
    /// `header:NAME`.
    pub fn name(&self) -> String {
        match self {
            Self::Authorization(scheme) if scheme == "bearer" => "bearer".into(),
            Self::Authorization(scheme) => format!("authorization:{scheme}"),
            Self::Header(h) => format!("header:{h}"),
        }
    }

    /// Parses a configuration name (see [`name`](Self::name)).
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "bearer" {
            return Ok(Self::bearer());
        }
        if let Some(scheme) = s.strip_prefix("authorization:") {
            let token = !scheme.is_empty()
                && scheme
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !token {
                return Err(format!("`{scheme}` is not an authentication scheme"));
            }
            return Ok(Self::Authorization(scheme.to_ascii_lowercase()));
        }
        if let Some(name) = s.strip_prefix("header:") {
            return HeaderName::try_from(name)
                .map(Self::Header)
                .map_err(|_| format!("`{name}` is not a header name"));
        }
        Err(format!(
            "unknown credential `{s}` (expected bearer, authorization:SCHEME or header:NAME)"
        ))
    }

    /// The header it is read from.
    pub fn header_name(&self) -> HeaderName {
        match self {
            Self::Authorization(_) => http::header::AUTHORIZATION,
            Self::Header(name) => name.clone(),
        }
    }

    /// The credential this request carries here: `None` if it carries
    /// none; an error (a 400's message) if it is sent twice or cannot be
    /// read.
    pub(crate) fn read(&self, headers: &HeaderMap) -> Result<Option<String>, String> {
        match self {
            Self::Authorization(scheme) => {
                let Some(value) = one_line(headers, &http::header::AUTHORIZATION)? else {
                    return Ok(None);
                };
                if !value.as_bytes().is_ascii() {
                    // `Bearer\xa0TOKEN` is the token to parsers that split
                    // on any white space (JavaScript's `\s`, Python's
                    // `split()` on Latin-1): unreadable here, not absent.
                    return Err("`Authorization` must be ASCII".into());
                }
                let is_space = |b: &u8| *b == b' ' || *b == b'\t';
                let mut words = value
                    .as_bytes()
                    .split(is_space)
                    .filter(|word| !word.is_empty());
                let Some(sent) = words.next() else {
                    return Ok(None);
                };
                if !sent.eq_ignore_ascii_case(scheme.as_bytes()) {
                    return Ok(None);
                }
                // `Bearer` alone carries no credential: the upstream sees
                // none either.
                let Some(token) = words.next() else {
                    return Ok(None);
                };
                let canonical = canonical_token(token, scheme);
                if words.next().is_some()
                    || !is_token68(token)
                    || !canonical.bytes().any(|b| b.is_ascii_alphanumeric())
                {
                    return Err(format!("`Authorization: {scheme}` must carry one token"));
                }
                Ok(Some(canonical))
            }
            Self::Header(name) => {
                let Some(value) = one_line(headers, name)? else {
                    return Ok(None);
                };
                let value = value.as_bytes().trim_ascii();
                if value.is_empty() {
                    return Ok(None);
                }
                if !value.iter().all(|&b| b.is_ascii_graphic() && b != b',') {
                    return Err(format!(
                        "`{name}` must be one credential: visible ASCII, no comma, no space"
                    ));
                }
                Ok(Some(String::from_utf8_lossy(value).into_owned()))
            }
        }
    }
}

/// The spellings under which a request's API key is found for `api_key`:
/// as a header carries it, and (when they differ) as a bearer token and a
/// Basic credential that decode to the same credential read
/// ([`Credential`]). A table of keys (tiers, lists) holds each key under
/// all of them.
///
/// ```
/// use spillway_tower::key::api_key_spellings;
/// assert_eq!(api_key_spellings("k123"), vec!["k123"]);
/// assert_eq!(api_key_spellings("a+b/c="), vec!["a+b/c=", "a-b_c", "abc"]);
/// ```
pub fn api_key_spellings(api_key: &str) -> Vec<String> {
    let mut out = vec![api_key.to_string()];
    for scheme in ["bearer", "basic"] {
        let spelling = canonical_token(api_key.as_bytes(), scheme);
        if !out.contains(&spelling) {
            out.push(spelling);
        }
    }
    out
}

/// A token as the one credential it decodes to. Tokens are base64 more
/// often than not (Basic credentials, the parts of a JWT), and common
/// decoders skip what is not in the alphabet and the padding (Python's
/// `b64decode`, which PyJWT and Werkzeug use; Node's `Buffer`): `dX.Nlcg==`,
/// `d~XNlcg` and `dXNlcg` are one credential to them, so they are one key
/// here. In a JWT's parts (kept apart) the two base64 alphabets are one
/// (`+` is `-`, `/` is `_`), as PyJWT and Node read them; of a Basic
/// credential only the letters and digits are kept. Two opaque tokens
/// that differ only in these characters share a key: the error is toward
/// limiting.
pub(crate) fn canonical_token(token: &[u8], scheme: &str) -> String {
    let canonical = |part: &[u8]| -> String {
        let kept = part.iter().filter_map(|&b| match b {
            b'+' | b'-' => Some('-'),
            b'/' | b'_' => Some('_'),
            b if b.is_ascii_alphanumeric() => Some(char::from(b)),
            _ => None,
        });
        kept.collect()
    };
    if scheme == "basic" {
        // Python's `b64decode` drops `-` and `_` where Node's `Buffer`
        // reads them as `+` and `/`: only the letters and digits are kept.
        token
            .iter()
            .filter(|b| b.is_ascii_alphanumeric())
            .map(|&b| char::from(b))
            .collect()
    } else {
        let parts: Vec<String> = token.split(|&b| b == b'.').map(canonical).collect();
        parts.join(".")
    }
}

/// The token68 of RFC 9110 section 11.2: `A-Z a-z 0-9 - . _ ~ + /`, then
/// any `=`.
fn is_token68(token: &[u8]) -> bool {
    let body = token
        .iter()
        .rposition(|&b| b != b'=')
        .map_or(&token[..0], |end| &token[..=end]);
    !body.is_empty()
        && body
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

/// The value of header `name` when it comes on one line; `None` when it
/// does not come; an error when it comes on several, which upstreams read
/// differently (the first, the last, or joined).
fn one_line<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
) -> Result<Option<&'a HeaderValue>, String> {
    let mut lines = headers.get_all(name).iter();
    let first = lines.next();
    if lines.next().is_some() {
        return Err(format!("`{name}` is sent more than once"));
    }
    Ok(first)
}

/// The API key: the one value the [`Clients::api_key`] places give. Two
/// places that both carry one must agree.
fn api_key(headers: &HeaderMap, places: &[Credential]) -> Result<Option<String>, String> {
    let mut found: Option<(String, &Credential)> = None;
    for place in places {
        let Some(value) = place.read(headers)? else {
            continue;
        };
        match &found {
            Some((first, at)) if *first != value => {
                return Err(format!(
                    "two API keys that differ, in `{}` and `{}`: send the key in one place",
                    at.name(),
                    place.name()
                ));
            }
            Some(_) => {}
            None => found = Some((value, place)),
        }
    }
    Ok(found.map(|(value, _)| value))
}

impl KeyPart {
    /// The name used in keys and configuration (`api_key`, `ip`, `user`,
    /// `route`, `method`, `header:NAME`, `bearer`, `authorization:SCHEME`).
    pub fn name(&self) -> String {
        match self {
            Self::ApiKey => "api_key".into(),
            Self::Ip => "ip".into(),
            Self::User => "user".into(),
            Self::Route => "route".into(),
            Self::Method => "method".into(),
            Self::Header(h) => format!("header:{h}"),
            Self::Credential(c) => c.name(),
        }
    }

    /// Parses a configuration name (see [`name`](Self::name)).
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "api_key" => Self::ApiKey,
            "ip" => Self::Ip,
            "user" => Self::User,
            "route" => Self::Route,
            "method" => Self::Method,
            "bearer" => Self::Credential(Credential::bearer()),
            _ if s.starts_with("authorization:") => Self::Credential(Credential::parse(s)?),
            _ => match s.strip_prefix("header:") {
                Some(name) => Self::Header(
                    HeaderName::try_from(name)
                        .map_err(|_| format!("`{name}` is not a header name"))?,
                ),
                None => {
                    return Err(format!(
                        "unknown key `{s}` (expected api_key, ip, user, route, method, bearer, authorization:SCHEME or header:NAME)"
                    ));
                }
            },
        })
    }
}

/// How clients are identified.
#[derive(Debug, Clone)]
pub struct Clients {
    /// Peers whose `Forwarded` / `X-Forwarded-For` (and user and tier
    /// headers) are believed.
    pub trusted_proxies: Vec<IpNet>,
    /// Where API keys come from: the places the upstream authenticates
    /// them, usually one (`[Credential::bearer()]`). The default,
    /// `X-Api-Key` and `Authorization: Bearer`, takes either; a request
    /// that carries keys in both that differ is refused (400).
    pub api_key: Vec<Credential>,
    /// A header carrying the user id, set by a trusted auth proxy.
    pub user_header: Option<HeaderName>,
    /// A header carrying the client's tier, set by a trusted auth proxy.
    pub tier_header: Option<HeaderName>,
    /// Which header the trusted proxies write the client's address in. Only
    /// that one is read: if a proxy appends to `X-Forwarded-For`, a
    /// `Forwarded` header can only have come from the client.
    pub forwarded_header: ForwardedHeader,
    /// How much of an IPv6 client's address its key keeps (default: the
    /// /64 network). One host is usually given a whole /64, so keying by
    /// the full address would give one attacker more keys than any table
    /// holds. IPv4 (and IPv4-mapped) clients are keyed by their address.
    pub ipv6_prefix: Ipv6Prefix,
}

/// How many leading bits of an IPv6 client address its key keeps: 1 to 128.
///
/// ```
/// use spillway_tower::key::Ipv6Prefix;
///
/// assert_eq!(Ipv6Prefix::default().bits(), 64);
/// assert_eq!(Ipv6Prefix::new(48).map(Ipv6Prefix::bits), Some(48));
/// assert!(Ipv6Prefix::new(0).is_none());
/// assert!(Ipv6Prefix::new(129).is_none());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv6Prefix(u8);

impl Ipv6Prefix {
    /// The whole address: one key per IPv6 address.
    pub const FULL: Self = Self(128);

    /// A prefix of `bits` bits; `None` unless 1 to 128.
    pub const fn new(bits: u8) -> Option<Self> {
        if matches!(bits, 1..=128) {
            Some(Self(bits))
        } else {
            None
        }
    }

    /// The number of bits kept.
    pub const fn bits(self) -> u8 {
        self.0
    }
}

impl Default for Ipv6Prefix {
    /// 64 bits: the network a single host is usually given.
    fn default() -> Self {
        Self(64)
    }
}

/// The header trusted proxies record the client's address in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For` (nginx, HAProxy, most load balancers).
    #[default]
    XForwardedFor,
    /// `Forwarded` (RFC 7239).
    Forwarded,
}

impl Default for Clients {
    fn default() -> Self {
        Self {
            trusted_proxies: Vec::new(),
            api_key: vec![
                Credential::Header(HeaderName::from_static("x-api-key")),
                Credential::bearer(),
            ],
            user_header: None,
            tier_header: None,
            forwarded_header: ForwardedHeader::XForwardedFor,
            ipv6_prefix: Ipv6Prefix::default(),
        }
    }
}

/// Keys longer than this are replaced by a hash, so that a client cannot make
/// the store hold arbitrarily large keys.
pub const MAX_KEY_LEN: usize = 200;

/// What the rate limiter knows about the client of one request. The
/// address is read at once; the API key, user and tier when first asked
/// for (most policies count by one of them, or none).
#[derive(Debug)]
pub(crate) struct Identity<'a> {
    // `None` only when the request carries no peer address.
    pub ip: Option<ClientIp>,
    // The client's whole address, before an IPv6 one is counted by its
    // network: what the block and allow lists look up. `None` when no
    // address names the client.
    pub addr: Option<IpAddr>,
    // Whether the socket peer is a trusted proxy: its headers are believed.
    pub peer_trusted: bool,
    req: &'a Parts,
    clients: &'a Clients,
    api_key: OnceCell<Result<Option<String>, String>>,
    user: OnceCell<Result<Option<String>, String>>,
    tier: OnceCell<Option<String>>,
}

impl Clients {
    /// Whether `ip` is one of the trusted proxies. An IPv4-mapped IPv6
    /// address is compared as the IPv4 address it maps, against IPv4 CIDRs
    /// and mapped IPv6 ones alike.
    ///
    /// ```
    /// use spillway_tower::Clients;
    ///
    /// let clients = Clients {
    ///     trusted_proxies: vec!["10.0.0.0/8".parse().unwrap()],
    ///     ..Clients::default()
    /// };
    /// assert!(clients.trusts("10.1.2.3".parse().unwrap()));
    /// // The same proxy, as a dual-stack listener reports it.
    /// assert!(clients.trusts("::ffff:10.1.2.3".parse().unwrap()));
    /// assert!(!clients.trusts("192.0.2.1".parse().unwrap()));
    /// ```
    pub fn trusts(&self, ip: IpAddr) -> bool {
        is_trusted(ip.to_canonical(), &self.trusted_proxies)
    }
}

/// Whether `ip`, already canonical (see [`IpAddr::to_canonical`]), is in
/// one of the `trusted` networks.
fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|net| canonical_net(*net).contains(&ip))
}

/// A network of IPv4-mapped IPv6 addresses (`::ffff:10.0.0.0/104`) as the
/// IPv4 network it maps (`10.0.0.0/8`): addresses are compared canonical.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => v6
            .network()
            .to_ipv4_mapped()
            .and_then(|v4| Ipv4Net::new(v4, v6.prefix_len() - 96).ok())
            .map_or(net, IpNet::V4),
        _ => net,
    }
}

fn peer_addr(req: &Parts) -> Option<SocketAddr> {
    if let Some(ClientAddr(addr)) = req.extensions.get::<ClientAddr>() {
        return Some(*addr);
    }
    #[cfg(feature = "axum")]
    if let Some(info) = req
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0);
    }
    None
}

/// Who the client is, as the socket and the trusted proxies tell it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClientIp {
    /// An address, canonical (an IPv4-mapped address is the IPv4 address).
    Addr(IpAddr),
    /// An IPv6 client, by its network ([`Clients::ipv6_prefix`]).
    Net(Ipv6Net),
    /// A forwarded hop that names no address (`unknown`, an obfuscated
    /// identifier, garbage), as the trusted proxy `via` wrote it: `hop` is
    /// its bytes, escaped, or their hash when long.
    Unnamed {
        /// The trusted proxy that wrote the hop: the hop to its right in the
        /// chain, or the socket peer.
        via: IpAddr,
        /// What it wrote.
        hop: String,
    },
}

/// One hop of a forwarded chain.
enum Hop<'a> {
    /// An address, canonical.
    Addr(IpAddr),
    /// Anything else: the hop's bytes, trimmed (a `Forwarded` hop's `for`
    /// value, unquoted, or the whole element when it has not exactly one).
    Bad(&'a [u8]),
}

/// A node: `1.2.3.4`, `1.2.3.4:80`, `[2001:db8::1]`, `[2001:db8::1]:80`;
/// canonical (an IPv4-mapped address is the IPv4 address).
fn parse_node(node: &str) -> Option<IpAddr> {
    let ip: IpAddr = if let Some(rest) = node.strip_prefix('[') {
        rest.split(']').next()?.parse().ok()?
    } else {
        node.parse()
            .ok()
            .or_else(|| node.rsplit_once(':').and_then(|(ip, _)| ip.parse().ok()))?
    };
    Some(ip.to_canonical())
}

/// Optional white space around list elements and parameters.
fn trim(bytes: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = bytes.iter().position(|b| !is_ows(b)).unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !is_ows(b))
        .map_or(start, |e| e + 1);
    &bytes[start..end]
}

/// An `X-Forwarded-For` element: a node, as in `Forwarded`.
fn x_forwarded_for_hop(element: &[u8]) -> Hop<'_> {
    match std::str::from_utf8(element).ok().and_then(parse_node) {
        Some(ip) => Hop::Addr(ip),
        None => Hop::Bad(element),
    }
}

/// A `Forwarded` element (`for=192.0.2.1;proto=https`): its one `for`
/// parameter, unquoted.
fn forwarded_hop(element: &[u8]) -> Hop<'_> {
    let mut found = None;
    for pair in element.split(|&b| b == b';') {
        let pair = trim(pair);
        let Some(eq) = pair.iter().position(|&b| b == b'=') else {
            continue;
        };
        if !trim(&pair[..eq]).eq_ignore_ascii_case(b"for") {
            continue;
        }
        if found.is_some() {
            // Two `for`s: which one the proxy meant is anyone's guess.
            return Hop::Bad(element);
        }
        let value = trim(&pair[eq + 1..]);
        found = Some(match value {
            [b'"', inner @ .., b'"'] => inner,
            _ => value,
        });
    }
    let Some(value) = found else {
        return Hop::Bad(element);
    };
    match std::str::from_utf8(value).ok().and_then(parse_node) {
        Some(ip) => Hop::Addr(ip),
        None => Hop::Bad(value),
    }
}

/// The hops of the forwarded chain, right to left: every line of the
/// header is one part of one chain, in order, so the last line comes
/// first. Read as bytes, one element at a time: whatever a client wrote
/// into one hop (a byte that is not ASCII, a stray quote) spoils that hop
/// only. Elements are split at every comma: no hop a proxy writes holds
/// one, and a comma inside a client's quoted string can only split hops
/// left of the client, which are never read. Empty elements are skipped,
/// as HTTP lists allow.
fn hops_from_the_right(
    headers: &HeaderMap,
    header: ForwardedHeader,
) -> impl Iterator<Item = Hop<'_>> {
    let values = match header {
        ForwardedHeader::XForwardedFor => headers.get_all("x-forwarded-for"),
        ForwardedHeader::Forwarded => headers.get_all(http::header::FORWARDED),
    };
    values.into_iter().rev().flat_map(move |value| {
        value
            .as_bytes()
            .rsplit(|&b| b == b',')
            .map(trim)
            .filter(|element| !element.is_empty())
            .map(move |element| match header {
                ForwardedHeader::XForwardedFor => x_forwarded_for_hop(element),
                ForwardedHeader::Forwarded => forwarded_hop(element),
            })
    })
}

/// A hop longer than this is keyed by its hash.
const MAX_HOP_LEN: usize = 64;

/// A bad hop's bytes as key text: printable ASCII as it is, the key
/// separators and every other byte percent-encoded; a long hop as
/// `sha256:` and its hash.
fn hop_text(bytes: &[u8]) -> String {
    if bytes.len() > MAX_HOP_LEN {
        let mut out = String::from("sha256:");
        for b in Sha256::digest(bytes).iter() {
            let _ = write!(out, "{b:02x}");
        }
        return out;
    }
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        match b {
            b'%' | b'|' | b'=' => {
                let _ = write!(out, "%{b:02X}");
            }
            0x21..=0x7e => out.push(char::from(b)),
            _ => {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
}

/// The client: the peer, or (when the peer is trusted) what the forwarded
/// chain says, walked from the right. Trusted hops are skipped; the first
/// hop that is an untrusted address is the client. A hop that is not an
/// address stops the walk there, and is the client as the proxy that wrote
/// it named it ([`ClientIp::Unnamed`]): the hop to its right is a trusted
/// proxy, which appended it, so it is what that proxy knew of its peer,
/// and everything left of it may be the client's own writing. Falling back
/// to the proxy's address instead would put every client behind that proxy
/// in one bucket, which one client could then exhaust for all of them. A
/// chain of trusted hops only names its left-most hop, a request from one
/// of our own proxies; no chain at all names the peer.
pub(crate) fn client_ip(
    req: &Parts,
    trusted: &[IpNet],
    forwarded: ForwardedHeader,
) -> (Option<ClientIp>, bool) {
    let Some(peer) = peer_addr(req).map(|a| a.ip().to_canonical()) else {
        return (None, false);
    };
    if !is_trusted(peer, trusted) {
        return (Some(ClientIp::Addr(peer)), false);
    }
    // The trusted proxy that wrote the next hop to the left.
    let mut writer = peer;
    for hop in hops_from_the_right(&req.headers, forwarded) {
        match hop {
            Hop::Addr(ip) if is_trusted(ip, trusted) => writer = ip,
            Hop::Addr(ip) => return (Some(ClientIp::Addr(ip)), true),
            Hop::Bad(bytes) => {
                let unnamed = ClientIp::Unnamed {
                    via: writer,
                    hop: hop_text(bytes),
                };
                return (Some(unnamed), true);
            }
        }
    }
    (Some(ClientIp::Addr(writer)), true)
}

/// An IPv6 client address as its network of `prefix` bits.
fn by_prefix(ip: ClientIp, prefix: Ipv6Prefix) -> ClientIp {
    match ip {
        ClientIp::Addr(IpAddr::V6(v6)) if prefix != Ipv6Prefix::FULL => {
            Ipv6Net::new(v6, prefix.bits()).map_or(ip, |net| ClientIp::Net(net.trunc()))
        }
        other => other,
    }
}

impl<'a> Identity<'a> {
    pub(crate) fn of(req: &'a Parts, clients: &'a Clients) -> Self {
        let (ip, peer_trusted) = client_ip(req, &clients.trusted_proxies, clients.forwarded_header);
        let addr = match &ip {
            Some(ClientIp::Addr(a)) => Some(*a),
            _ => None,
        };
        let ip = ip.map(|ip| by_prefix(ip, clients.ipv6_prefix));
        Self {
            ip,
            addr,
            peer_trusted,
            req,
            clients,
            api_key: OnceCell::new(),
            user: OnceCell::new(),
            tier: OnceCell::new(),
        }
    }

    /// The API key; an error (a 400's message) for a key sent twice or
    /// unreadable: it is refused only if a rule that applies counts by it.
    pub(crate) fn api_key(&self) -> &Result<Option<String>, String> {
        self.api_key
            .get_or_init(|| api_key(&self.req.headers, &self.clients.api_key))
    }

    /// The user a trusted layer named (an extension, or a trusted peer's
    /// header); an error as for [`api_key`](Self::api_key).
    pub(crate) fn user(&self) -> &Result<Option<String>, String> {
        self.user
            .get_or_init(|| match self.req.extensions.get::<UserId>() {
                Some(u) => Ok(Some(u.0.clone())),
                None => self.trusted_header(&self.clients.user_header),
            })
    }

    /// The tier a trusted layer named.
    pub(crate) fn tier(&self) -> Option<&str> {
        self.tier
            .get_or_init(|| match self.req.extensions.get::<Tier>() {
                Some(t) => Some(t.0.clone()),
                // Written by a trusted layer: one sent twice is its bug,
                // and the tier falls back to the API key's.
                None => self
                    .trusted_header(&self.clients.tier_header)
                    .ok()
                    .flatten(),
            })
            .as_deref()
    }

    /// Header `name`'s value, believed only from a trusted peer.
    fn trusted_header(&self, name: &Option<HeaderName>) -> Result<Option<String>, String> {
        match name {
            Some(h) if self.peer_trusted => header_str(&self.req.headers, h),
            _ => Ok(None),
        }
    }
}

/// The value of header `name`, trimmed (opaque bytes escaped); `None` if
/// absent or empty; an error if it comes on several lines.
fn header_str(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, String> {
    let Some(v) = one_line(headers, name)? else {
        return Ok(None);
    };
    let s = match v.to_str() {
        Ok(s) => s.trim().to_string(),
        // Opaque bytes: keep them, escaped, rather than drop the key.
        Err(_) => v.as_bytes().iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "%{b:02X}");
            s
        }),
    };
    Ok((!s.is_empty()).then_some(s))
}

/// The route template of a request: axum's `MatchedPath` when present.
pub(crate) fn route(parts: &Parts) -> String {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return matched.as_str().to_string();
    }
    parts.uri.path().to_string()
}

/// Builds a key from `parts`: `name=value` pairs joined by `|`, values
/// escaped so that no value can forge another pair. `None` if a part is
/// missing; an error (a 400's message) if one is sent twice or cannot be
/// read. Long keys are replaced by `sha256:` and a hash.
pub(crate) fn build_key(
    key: &[KeyPart],
    client: &Identity,
    parts: &Parts,
) -> Result<Option<KeyText>, String> {
    // The commonest key of all, written in one piece.
    if let ([KeyPart::Ip], Some(ClientIp::Addr(IpAddr::V4(v4)))) = (key, &client.ip) {
        return Ok(Some(ipv4_key(*v4)));
    }
    // Runs on every request: write straight into one string, held inline
    // (no allocation) while it is short, as an address's key is.
    let mut out = KeyText::const_new("");
    for (i, part) in key.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        match part {
            KeyPart::ApiKey => {
                let Some(key) = client.api_key().clone()? else {
                    return Ok(None);
                };
                push_pair(&mut out, "api_key", &key);
            }
            KeyPart::User => {
                let Some(user) = client.user().clone()? else {
                    return Ok(None);
                };
                push_pair(&mut out, "user", &user);
            }
            KeyPart::Ip => {
                let Some(ip) = client.ip.as_ref() else {
                    return Ok(None);
                };
                out.push_str("ip=");
                match ip {
                    ClientIp::Addr(ip) => push_ip(&mut out, *ip),
                    ClientIp::Net(net) => {
                        let _ = write!(out, "{net}");
                    }
                    // `#` is in no address: the key cannot be one.
                    ClientIp::Unnamed { via, hop } => {
                        push_ip(&mut out, *via);
                        out.push('#');
                        out.push_str(hop);
                    }
                }
            }
            KeyPart::Route => {
                out.push_str("route=");
                push_escaped(&mut out, parts.method.as_str());
                out.push(' ');
                push_escaped(&mut out, &route(parts));
            }
            KeyPart::Method => push_pair(&mut out, "method", parts.method.as_str()),
            KeyPart::Header(name) => {
                let Some(value) = header_str(&parts.headers, name)? else {
                    return Ok(None);
                };
                out.push_str("header:");
                out.push_str(name.as_str());
                out.push('=');
                push_escaped(&mut out, &value);
            }
            KeyPart::Credential(credential) => {
                let Some(value) = credential.read(&parts.headers)? else {
                    return Ok(None);
                };
                out.push_str(&credential.name());
                out.push('=');
                push_escaped(&mut out, &value);
            }
        }
    }
    Ok(Some(bounded(out)))
}

/// Writes an address as its standard text, which has no separator to
/// escape. An IPv4 address (the common case, on every request) is written
/// digit by digit rather than through `fmt`, which costs several times more.
fn push_ip(out: &mut KeyText, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            let mut text = [0u8; 15];
            let len = write_ipv4(&mut text, 0, v4);
            // Digits and dots only.
            out.push_str(std::str::from_utf8(&text[..len]).unwrap_or_default());
        }
        IpAddr::V6(_) => {
            let _ = write!(out, "{ip}");
        }
    }
}

/// The key of an IPv4 client by its address alone, `ip=` and the address:
/// the commonest key, written in one piece into a buffer and copied once
/// (what [`build_key`] writes for it part by part).
fn ipv4_key(v4: std::net::Ipv4Addr) -> KeyText {
    let mut text = [0u8; 18];
    text[..3].copy_from_slice(b"ip=");
    let len = write_ipv4(&mut text, 3, v4);
    // `ip=`, digits and dots only.
    KeyText::new(std::str::from_utf8(&text[..len]).unwrap_or_default())
}

/// Writes `v4`'s standard text into `text` from `at`; returns where it
/// ends. `text` has room for 15 bytes from `at`.
fn write_ipv4(text: &mut [u8], at: usize, v4: std::net::Ipv4Addr) -> usize {
    let mut len = at;
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            text[len] = b'.';
            len += 1;
        }
        let (hundreds, tens, ones) = (octet / 100, octet / 10 % 10, octet % 10);
        if hundreds > 0 {
            text[len] = b'0' + hundreds;
            len += 1;
        }
        if octet >= 10 {
            text[len] = b'0' + tens;
            len += 1;
        }
        text[len] = b'0' + ones;
        len += 1;
    }
    len
}

fn push_pair(out: &mut KeyText, name: &str, value: &str) {
    out.push_str(name);
    out.push('=');
    push_escaped(out, value);
}

/// Builds a key from `name=value` pairs the way the middleware does (joined
/// by `|`, separators in values escaped, long keys hashed), for front ends
/// that are handed the pairs, such as the Envoy rate limit service.
///
/// ```
/// use spillway_tower::key::{MAX_KEY_LEN, key_from_pairs};
///
/// assert_eq!(key_from_pairs([("remote_address", "10.0.0.1")]), "remote_address=10.0.0.1");
/// // A value cannot forge a second pair.
/// assert_eq!(key_from_pairs([("a", "1|b=2")]), "a=1%7Cb%3D2");
/// assert!(key_from_pairs([("a", "x".repeat(1000).as_str())]).len() <= MAX_KEY_LEN);
/// ```
pub fn key_from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = KeyText::default();
    for (i, (name, value)) in pairs.into_iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        push_escaped(&mut out, name);
        out.push('=');
        push_escaped(&mut out, value);
    }
    bounded(out).into()
}

/// The values of a key that `parts` built, unescaped, in order; `None` if
/// the key is not of that shape (`api_key=VALUE|ip=VALUE` for `[api_key,
/// ip]`). A key hashed for its length (`sha256:` and 64 hex digits) has
/// the shape of any parts, and no values to read: `Some` of none.
pub(crate) fn values_of(key: &str, parts: &[KeyPart]) -> Option<Vec<String>> {
    if let Some(hex) = key.strip_prefix("sha256:")
        && hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Some(Vec::new());
    }
    let pairs: Vec<&str> = key.split('|').collect();
    if parts.is_empty() || pairs.len() != parts.len() {
        return None;
    }
    pairs
        .iter()
        .zip(parts)
        .map(|(pair, part)| {
            let (name, value) = pair.split_once('=')?;
            (name == part.name() && !value.contains('=')).then(|| unescaped(value))
        })
        .collect()
}

/// What [`push_escaped`] wrote, read back.
fn unescaped(value: &str) -> String {
    value
        .replace("%7C", "|")
        .replace("%3D", "=")
        .replace("%25", "%")
}

/// How keys of `parts` are written, for a message: `api_key=VALUE|ip=VALUE`.
pub(crate) fn shape_of(parts: &[KeyPart]) -> String {
    parts
        .iter()
        .map(|p| format!("{}=VALUE", p.name()))
        .collect::<Vec<_>>()
        .join("|")
}

/// Appends `value` with the key separators (and `%`) percent-encoded.
fn push_escaped(out: &mut KeyText, value: &str) {
    // Most values have nothing to escape: copy them whole.
    if !value.contains(['%', '|', '=']) {
        out.push_str(value);
        return;
    }
    for ch in value.chars() {
        match ch {
            '%' | '|' | '=' => {
                let _ = write!(out, "%{:02X}", ch as u32);
            }
            _ => out.push(ch),
        }
    }
}

fn bounded(key: KeyText) -> KeyText {
    if key.len() <= MAX_KEY_LEN {
        return key;
    }
    let digest = Sha256::digest(key.as_bytes());
    let mut out = KeyText::const_new("sha256:");
    for b in digest.iter() {
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use http::Request;

    #[test]
    fn addresses_are_written_as_their_standard_text() {
        let mut ips: Vec<IpAddr> = ["::1", "2001:db8::8a2e:370:7334", "::ffff:10.0.0.1"]
            .iter()
            .map(|s| s.parse().expect("an address"))
            .collect();
        // Every octet value in every position, and the extremes.
        for octet in 0..=255u8 {
            ips.push(IpAddr::from([
                octet,
                255 - octet,
                octet / 2,
                octet.wrapping_mul(7),
            ]));
        }
        ips.push(IpAddr::from([0, 0, 0, 0]));
        ips.push(IpAddr::from([255, 255, 255, 255]));
        for ip in ips {
            let mut out = KeyText::default();
            push_ip(&mut out, ip);
            assert_eq!(out, ip.to_string());
            if let IpAddr::V4(v4) = ip {
                assert_eq!(ipv4_key(v4), format!("ip={ip}"));
            }
        }
    }

    fn req(peer: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::builder().uri("/x");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let mut r = b.body(()).unwrap();
        r.extensions_mut().insert(ClientAddr(peer.parse().unwrap()));
        r.into_parts().0
    }

    fn addr(s: &str) -> ClientIp {
        ClientIp::Addr(s.parse().expect("an address"))
    }

    fn unnamed(via: &str, hop: &str) -> ClientIp {
        ClientIp::Unnamed {
            via: via.parse().expect("an address"),
            hop: hop.into(),
        }
    }

    fn trusted() -> Vec<IpNet> {
        vec!["10.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()]
    }

    #[test]
    fn forwarded_headers_from_an_untrusted_peer_are_ignored() {
        let r = req("203.0.113.9:5000", &[("x-forwarded-for", "1.2.3.4")]);
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(addr("203.0.113.9"))
        );
    }

    #[test]
    fn the_right_most_untrusted_hop_is_the_client() {
        // The client wrote "6.6.6.6" itself; 10.1.1.1 is our second proxy.
        let r = req(
            "10.0.0.2:443",
            &[("x-forwarded-for", "6.6.6.6, 198.51.100.7, 10.1.1.1")],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(addr("198.51.100.7"))
        );
        let r = req(
            "10.0.0.2:443",
            &[(
                "forwarded",
                "for=6.6.6.6, for=\"[2001:db8::7]:4711\";proto=https",
            )],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::Forwarded).0,
            Some(addr("2001:db8::7"))
        );
    }

    #[test]
    fn a_malformed_hop_left_of_the_client_is_ignored() {
        // The client wrote garbage; our proxy appended its real address.
        let r = req(
            "10.0.0.2:443",
            &[("x-forwarded-for", "not-an-ip, 198.51.100.7")],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(addr("198.51.100.7"))
        );
        let r = req(
            "10.0.0.2:443",
            &[("forwarded", "for=unknown, for=198.51.100.7")],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::Forwarded).0,
            Some(addr("198.51.100.7"))
        );
    }

    #[test]
    fn only_the_header_the_proxies_write_is_read() {
        // The proxy appends to X-Forwarded-For; the client wrote Forwarded.
        let r = req(
            "10.0.0.2:443",
            &[
                ("forwarded", "for=6.6.6.6"),
                ("x-forwarded-for", "198.51.100.7"),
            ],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(addr("198.51.100.7"))
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::Forwarded).0,
            Some(addr("6.6.6.6"))
        );
    }

    #[test]
    fn ipv4_mapped_addresses_are_their_ipv4_address() {
        let want: IpAddr = "198.51.100.7".parse().unwrap();
        // A trusted proxy seen through a dual-stack listener.
        let r = req(
            "[::ffff:10.0.0.2]:443",
            &[("x-forwarded-for", "198.51.100.7")],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor),
            (Some(ClientIp::Addr(want)), true)
        );
        // A mapped hop, and a mapped client: keyed as IPv4.
        let r = req(
            "10.0.0.2:443",
            &[("x-forwarded-for", "::ffff:198.51.100.7, ::ffff:10.1.1.1")],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(ClientIp::Addr(want))
        );
        let r = req("[::ffff:198.51.100.7]:5000", &[]);
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(ClientIp::Addr(want))
        );
        // A trusted network written as mapped IPv6 trusts the IPv4 peer.
        let mapped: Vec<IpNet> = vec!["::ffff:10.0.0.0/104".parse().unwrap()];
        let r = req("10.0.0.2:443", &[("x-forwarded-for", "198.51.100.7")]);
        assert_eq!(
            client_ip(&r, &mapped, ForwardedHeader::XForwardedFor),
            (Some(ClientIp::Addr(want)), true)
        );
    }

    #[test]
    fn a_bad_hop_a_trusted_proxy_wrote_is_the_client_never_the_proxy() {
        let xff = |r: &Parts| client_ip(r, &trusted(), ForwardedHeader::XForwardedFor).0;
        // The peer appended garbage: that garbage, as the peer wrote it.
        let r = req("10.0.0.2:443", &[("x-forwarded-for", "not-an-ip")]);
        assert_eq!(xff(&r), Some(unnamed("10.0.0.2", "not-an-ip")));
        // Our proxy 10.1.1.1 wrote `unknown`: scoped to it, and the walk
        // does not go on to the client-written 6.6.6.6.
        let r = req(
            "10.0.0.2:443",
            &[("x-forwarded-for", "6.6.6.6, unknown, 10.1.1.1")],
        );
        assert_eq!(xff(&r), Some(unnamed("10.1.1.1", "unknown")));
        // An obfuscated Forwarded node, quoted or not.
        let fwd = |r: &Parts| client_ip(r, &trusted(), ForwardedHeader::Forwarded).0;
        let r = req(
            "10.0.0.2:443",
            &[("forwarded", "for=\"_hidden\";proto=https")],
        );
        assert_eq!(fwd(&r), Some(unnamed("10.0.0.2", "_hidden")));
        // An element without a `for`, or with two, says nothing.
        let r = req("10.0.0.2:443", &[("forwarded", "for=1.1.1.1, proto=https")]);
        assert_eq!(fwd(&r), Some(unnamed("10.0.0.2", "proto%3Dhttps")));
        let r = req("10.0.0.2:443", &[("forwarded", "for=1.1.1.1;for=2.2.2.2")]);
        assert!(matches!(fwd(&r), Some(ClientIp::Unnamed { .. })));
        // A chain of our own proxies names the left-most; no chain, the peer.
        let r = req("10.0.0.2:443", &[("x-forwarded-for", "10.9.9.9, 10.1.1.1")]);
        assert_eq!(xff(&r), Some(addr("10.9.9.9")));
        assert_eq!(xff(&req("10.0.0.2:443", &[])), Some(addr("10.0.0.2")));
    }

    #[test]
    fn one_bad_byte_spoils_one_hop_not_the_line() {
        // A byte that is not ASCII, left of the client: the line was
        // unreadable as a whole, and every client behind the proxy was the
        // proxy. Now only that hop is unreadable, and it is never reached.
        let mut b = Request::builder().uri("/x");
        b = b.header(
            "x-forwarded-for",
            http::HeaderValue::from_bytes(b"caf\xc3\xa9, 198.51.100.7").unwrap(),
        );
        let mut r = b.body(()).unwrap();
        r.extensions_mut()
            .insert(ClientAddr("10.0.0.2:443".parse().unwrap()));
        let (r, ()) = r.into_parts();
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(addr("198.51.100.7"))
        );
        // The same in Forwarded, with a stray quote and garbage.
        let mut b = Request::builder().uri("/x");
        b = b.header(
            "forwarded",
            http::HeaderValue::from_bytes(b"for=\"\xff\xfe, for=[2001:db8::9]:1").unwrap(),
        );
        let mut r = b.body(()).unwrap();
        r.extensions_mut()
            .insert(ClientAddr("10.0.0.2:443".parse().unwrap()));
        let (r, ()) = r.into_parts();
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::Forwarded).0,
            Some(addr("2001:db8::9"))
        );
        // When the bad hop is the one the proxy wrote, its bytes are the key,
        // escaped.
        let r = {
            let mut r = Request::builder()
                .uri("/x")
                .header(
                    "x-forwarded-for",
                    http::HeaderValue::from_bytes(b"1.2.3.4, \xff|x=1").unwrap(),
                )
                .body(())
                .unwrap();
            r.extensions_mut()
                .insert(ClientAddr("10.0.0.2:443".parse().unwrap()));
            r.into_parts().0
        };
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(unnamed("10.0.0.2", "%FF%7Cx%3D1"))
        );
        // A long one, by its hash.
        let long = format!("{}, 10.1.1.1", "z".repeat(5_000));
        let r = req("10.0.0.2:443", &[("x-forwarded-for", &long)]);
        match client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0 {
            Some(ClientIp::Unnamed { via, hop }) => {
                assert_eq!(via, "10.1.1.1".parse::<IpAddr>().unwrap());
                assert!(hop.starts_with("sha256:") && hop.len() == 7 + 64, "{hop}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn several_header_lines_are_one_chain_in_order() {
        // The client sent the first line; our proxies appended lines after it.
        let r = req(
            "10.0.0.2:443",
            &[
                ("x-forwarded-for", "6.6.6.6, garbage"),
                ("x-forwarded-for", "198.51.100.7"),
                ("x-forwarded-for", "10.1.1.1"),
            ],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(addr("198.51.100.7"))
        );
        // Empty elements are skipped, as HTTP lists allow.
        let r = req("10.0.0.2:443", &[("x-forwarded-for", "198.51.100.7,, ,")]);
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(addr("198.51.100.7"))
        );
    }

    /// An IPv4 client's key by its address alone (written in one piece)
    /// is the text the parts' general writing gives it beside another part,
    /// an IPv4-mapped peer's included.
    #[test]
    fn an_ipv4_clients_key_alone_is_written_as_beside_other_parts() {
        for peer in [
            "10.0.3.7:1",
            "[::ffff:192.168.100.255]:1",
            "0.0.0.0:1",
            "255.9.10.99:1",
        ] {
            let parts = req(peer, &[]);
            let clients = Clients::default();
            let client = Identity::of(&parts, &clients);
            let alone = build_key(&[KeyPart::Ip], &client, &parts).unwrap().unwrap();
            let beside = build_key(&[KeyPart::Ip, KeyPart::Method], &client, &parts);
            let beside = beside.unwrap().unwrap();
            assert_eq!(format!("{alone}|method=GET"), beside, "{peer}");
            assert!(alone.starts_with("ip=") && !alone.contains(':'), "{alone}");
        }
    }

    #[test]
    fn ipv6_clients_are_keyed_by_their_prefix() {
        let key = |peer: &str, prefix: u8| {
            let parts = req(peer, &[]);
            let clients = Clients {
                ipv6_prefix: Ipv6Prefix::new(prefix).unwrap(),
                ..Clients::default()
            };
            let client = Identity::of(&parts, &clients);
            build_key(&[KeyPart::Ip], &client, &parts).unwrap().unwrap()
        };
        // Two addresses of one /64: one key by default.
        assert_eq!(key("[2001:db8:1:2::1]:1", 64), "ip=2001:db8:1:2::/64");
        assert_eq!(key("[2001:db8:1:2:ffff::9]:1", 64), "ip=2001:db8:1:2::/64");
        assert_eq!(key("[2001:db8:1:3::1]:1", 64), "ip=2001:db8:1:3::/64");
        assert_eq!(key("[2001:db8:1:2::1]:1", 48), "ip=2001:db8:1::/48");
        assert_eq!(key("[2001:db8:1:2::1]:1", 128), "ip=2001:db8:1:2::1");
        // IPv4, mapped or not, keeps its whole address.
        assert_eq!(key("192.0.2.1:1", 1), "ip=192.0.2.1");
        assert_eq!(key("[::ffff:192.0.2.1]:1", 64), "ip=192.0.2.1");
    }

    #[test]
    fn values_cannot_forge_other_parts_and_long_keys_are_hashed() {
        let parts = req("1.1.1.1:1", &[("x-a", "1|header:x-b=2")]);
        let clients = Clients::default();
        let client = Identity::of(&parts, &clients);
        let key = build_key(
            &[KeyPart::Header(HeaderName::from_static("x-a"))],
            &client,
            &parts,
        );
        assert_eq!(key, Ok(Some("header:x-a=1%7Cheader:x-b%3D2".into())));
        let parts = req("1.1.1.1:1", &[("x-a", &"y".repeat(10_000))]);
        let key = build_key(
            &[KeyPart::Header(HeaderName::from_static("x-a"))],
            &client,
            &parts,
        )
        .unwrap()
        .unwrap();
        assert!(key.starts_with("sha256:") && key.len() == 7 + 64);
    }

    fn api_key_of(
        places: &[Credential],
        headers: &[(&str, &str)],
    ) -> Result<Option<String>, String> {
        api_key(&req("1.1.1.1:1", headers).headers, places)
    }

    #[test]
    fn a_bearer_token_is_read_in_every_spelling_common_parsers_accept() {
        let bearer = [Credential::bearer()];
        for spelling in [
            "Bearer REALKEY123",
            "bearer REALKEY123",
            "BEARER   REALKEY123",
            "Bearer\tREALKEY123",
            "Bearer \t REALKEY123 ",
        ] {
            let key = api_key_of(&bearer, &[("authorization", spelling)]);
            assert_eq!(key, Ok(Some("REALKEY123".into())), "{spelling:?}");
        }
        let token68 = api_key_of(&bearer, &[("authorization", "Bearer a-b._~+/c==")]);
        assert_eq!(token68, Ok(Some("a-b._-_c".into())));
        // Another scheme is not a bearer token.
        assert_eq!(
            api_key_of(&bearer, &[("authorization", "Basic dTpw")]),
            Ok(None)
        );
        assert_eq!(api_key_of(&bearer, &[]), Ok(None));
    }

    #[test]
    fn a_token_is_keyed_as_the_credential_it_decodes_to() {
        // Python's b64decode (PyJWT, Werkzeug) and Node's Buffer skip what
        // is not base64 and the padding: each of these is one credential.
        let basic = [Credential::Authorization("basic".into())];
        for spelling in [
            "dXNlcjpwYXNz",
            "dX.NlcjpwYXNz",
            "d~XNl-cjp_wYXNz",
            "dXNlcjpwYXNz====",
        ] {
            let key = api_key_of(&basic, &[("authorization", &format!("Basic {spelling}"))]);
            assert_eq!(key, Ok(Some("dXNlcjpwYXNz".into())), "{spelling}")
        }
        let bearer = [Credential::bearer()];
        let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln";
        let canonical = api_key_of(&bearer, &[("authorization", &format!("Bearer {jwt}"))]);
        for spelling in [
            format!("{jwt}~~~~"),
            format!("{jwt}=="),
            jwt.replacen("c2", "c~2", 1),
        ] {
            let key = api_key_of(&bearer, &[("authorization", &format!("Bearer {spelling}"))]);
            assert_eq!(key, canonical, "{spelling}");
        }
        // The parts of a JWT stay apart.
        let moved = api_key_of(
            &bearer,
            &[(
                "authorization",
                "Bearer eyJhbGciOiJIUzI1NiJ9eyJzdWIiOiIxIn0.c2ln",
            )],
        );
        assert_ne!(moved, canonical);
    }

    #[test]
    fn a_credential_sent_twice_or_unreadable_is_refused_not_missing() {
        let bearer = [Credential::bearer()];
        // No token at all is no credential: the upstream sees none either.
        assert_eq!(
            api_key_of(&bearer, &[("authorization", "Bearer")]),
            Ok(None)
        );
        assert_eq!(
            api_key_of(&bearer, &[("authorization", "Bearer ")]),
            Ok(None)
        );
        for unreadable in [
            "Bearer\u{a0}REALKEY123",
            "Bearer ~~~",
            "Bearer a b",
            "Bearer a,b",
            "Bearer REAL, Bearer OTHER",
            "Bearer =abc",
            "Bearer a\"b",
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_bytes(unreadable.as_bytes()).unwrap(),
            );
            let key = api_key(&headers, &bearer);
            assert!(key.is_err(), "{unreadable:?}: {key:?}");
        }
        let twice = [("authorization", "Bearer A"), ("authorization", "Bearer B")];
        assert!(api_key_of(&bearer, &twice).is_err());
        let header = [Credential::Header(HeaderName::from_static("x-api-key"))];
        assert!(api_key_of(&header, &[("x-api-key", "a"), ("x-api-key", "a")]).is_err());
        assert!(api_key_of(&header, &[("x-api-key", "REAL, junk")]).is_err());
        assert!(api_key_of(&header, &[("x-api-key", "REAL junk")]).is_err());
        assert_eq!(
            api_key_of(&header, &[("x-api-key", " REAL ")]),
            Ok(Some("REAL".into()))
        );
    }

    #[test]
    fn a_key_is_read_only_where_the_upstream_authenticates_it() {
        // The review's bypass: a junk X-Api-Key beside the real bearer
        // token. Keyed by the bearer token alone, the junk is not read...
        let bearer = [Credential::bearer()];
        let both = [
            ("x-api-key", "junk-1"),
            ("authorization", "Bearer REALKEY123"),
        ];
        assert_eq!(api_key_of(&bearer, &both), Ok(Some("REALKEY123".into())));
        // ... and where either place is taken (the default), two keys that
        // differ are refused.
        let either = Clients::default().api_key;
        assert!(api_key_of(&either, &both).is_err());
        let agree = [
            ("x-api-key", "REALKEY123"),
            ("authorization", "Bearer REALKEY123"),
        ];
        assert_eq!(api_key_of(&either, &agree), Ok(Some("REALKEY123".into())));
        assert_eq!(
            api_key_of(&either, &[("x-api-key", "K")]),
            Ok(Some("K".into()))
        );
    }

    #[test]
    fn a_header_key_sent_twice_is_refused() {
        let parts = req("1.1.1.1:1", &[("x-tenant", "victim"), ("x-tenant", "x")]);
        let clients = Clients::default();
        let client = Identity::of(&parts, &clients);
        let key = build_key(
            &[KeyPart::Header(HeaderName::from_static("x-tenant"))],
            &client,
            &parts,
        );
        assert!(key.is_err(), "{key:?}");
    }
}

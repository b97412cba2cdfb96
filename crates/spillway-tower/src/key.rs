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
//! An IPv4-mapped IPv6 address (`::ffff:192.0.2.1`, what a dual-stack `[::]`
//! listener reports for a peer that connected over IPv4) is the IPv4 address
//! everywhere: in the trusted-proxy CIDRs, in forwarded hops and in keys.

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use http::request::Parts;
use http::{HeaderMap, HeaderName};
use ipnet::{IpNet, Ipv4Net};
use sha2::{Digest, Sha256};

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
    /// The API key: the configured header, or `Authorization: Bearer`.
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
    /// Any request header, by name.
    Header(HeaderName),
}

impl KeyPart {
    /// The name used in keys and configuration (`api_key`, `ip`, `user`,
    /// `route`, `method`, `header:NAME`).
    pub fn name(&self) -> String {
        match self {
            Self::ApiKey => "api_key".into(),
            Self::Ip => "ip".into(),
            Self::User => "user".into(),
            Self::Route => "route".into(),
            Self::Method => "method".into(),
            Self::Header(h) => format!("header:{h}"),
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
            _ => match s.strip_prefix("header:") {
                Some(name) => Self::Header(
                    HeaderName::try_from(name)
                        .map_err(|_| format!("`{name}` is not a header name"))?,
                ),
                None => {
                    return Err(format!(
                        "unknown key `{s}` (expected api_key, ip, user, route, method or header:NAME)"
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
    /// The header carrying the API key (besides `Authorization: Bearer`).
    pub api_key_header: HeaderName,
    /// A header carrying the user id, set by a trusted auth proxy.
    pub user_header: Option<HeaderName>,
    /// A header carrying the client's tier, set by a trusted auth proxy.
    pub tier_header: Option<HeaderName>,
    /// Which header the trusted proxies write the client's address in. Only
    /// that one is read: if a proxy appends to `X-Forwarded-For`, a
    /// `Forwarded` header can only have come from the client.
    pub forwarded_header: ForwardedHeader,
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
            api_key_header: HeaderName::from_static("x-api-key"),
            user_header: None,
            tier_header: None,
            forwarded_header: ForwardedHeader::XForwardedFor,
        }
    }
}

/// Keys longer than this are replaced by a hash, so that a client cannot make
/// the store hold arbitrarily large keys.
pub const MAX_KEY_LEN: usize = 200;

/// What the rate limiter knows about the client of one request.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    pub ip: Option<IpAddr>,
    pub api_key: Option<String>,
    pub user: Option<String>,
    pub tier: Option<String>,
    // Whether the socket peer is a trusted proxy: its headers are believed.
    pub peer_trusted: bool,
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

/// The addresses a `Forwarded` header lists in its `for=` parameters, left to
/// right; `None` for a hop that is not an address (malformed, `unknown`,
/// an obfuscated identifier).
fn forwarded_for(headers: &HeaderMap) -> Vec<Option<IpAddr>> {
    let mut out = Vec::new();
    for value in headers.get_all(http::header::FORWARDED) {
        let Ok(value) = value.to_str() else {
            out.push(None);
            continue;
        };
        for element in value.split(',') {
            for pair in element.split(';') {
                let Some((name, v)) = pair.trim().split_once('=') else {
                    continue;
                };
                if !name.trim().eq_ignore_ascii_case("for") {
                    continue;
                }
                out.push(parse_node(v.trim().trim_matches('"')));
            }
        }
    }
    out
}

/// A `Forwarded` node: `1.2.3.4`, `1.2.3.4:80`, `[2001:db8::1]`, `[2001:db8::1]:80`;
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

/// The hops of `X-Forwarded-For`, left to right; `None` for one that is not
/// an address.
fn x_forwarded_for(headers: &HeaderMap) -> Vec<Option<IpAddr>> {
    let mut out = Vec::new();
    for value in headers.get_all("x-forwarded-for") {
        match value.to_str() {
            Ok(value) => out.extend(value.split(',').map(|part| parse_node(part.trim()))),
            Err(_) => out.push(None),
        }
    }
    out
}

/// The client IP: the peer, or (when the peer is trusted) the right-most
/// forwarded address that is not a trusted proxy.
pub(crate) fn client_ip(
    req: &Parts,
    trusted: &[IpNet],
    forwarded: ForwardedHeader,
) -> (Option<IpAddr>, bool) {
    let Some(peer) = peer_addr(req).map(|a| a.ip().to_canonical()) else {
        return (None, false);
    };
    if !is_trusted(peer, trusted) {
        return (Some(peer), false);
    }
    let headers = &req.headers;
    let chain = match forwarded {
        ForwardedHeader::Forwarded => forwarded_for(headers),
        ForwardedHeader::XForwardedFor => x_forwarded_for(headers),
    };
    // Walk from the right, through our own proxies, to the first hop that is
    // not one: everything left of it was written by the client, so a
    // malformed hop there must not matter. A malformed hop before that (a
    // trusted proxy forwarding `unknown`) leaves the peer as the best we know.
    for hop in chain.into_iter().rev() {
        match hop {
            Some(ip) if is_trusted(ip, trusted) => continue,
            Some(ip) => return (Some(ip), true),
            None => break,
        }
    }
    (Some(peer), true)
}

impl Client {
    pub(crate) fn of(req: &Parts, clients: &Clients) -> Self {
        let (ip, peer_trusted) = client_ip(req, &clients.trusted_proxies, clients.forwarded_header);
        let headers = &req.headers;
        let api_key = header_str(headers, &clients.api_key_header).or_else(|| {
            let auth = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
            let (scheme, token) = auth.trim().split_once(' ')?;
            let token = token.trim();
            (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then(|| token.to_string())
        });
        let trusted_header = |name: &Option<HeaderName>| {
            name.as_ref()
                .filter(|_| peer_trusted)
                .and_then(|h| header_str(headers, h))
        };
        let user = req
            .extensions
            .get::<UserId>()
            .map(|u| u.0.clone())
            .or_else(|| trusted_header(&clients.user_header));
        let tier = req
            .extensions
            .get::<Tier>()
            .map(|t| t.0.clone())
            .or_else(|| trusted_header(&clients.tier_header));
        Self {
            ip,
            api_key,
            user,
            tier,
            peer_trusted,
        }
    }
}

fn header_str(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    let v = headers.get(name)?;
    let s = match v.to_str() {
        Ok(s) => s.trim().to_string(),
        // Opaque bytes: keep them, escaped, rather than drop the key.
        Err(_) => v.as_bytes().iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "%{b:02X}");
            s
        }),
    };
    (!s.is_empty()).then_some(s)
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
/// missing. Long keys are replaced by `sha256:` and a hash.
pub(crate) fn build_key(key: &[KeyPart], client: &Client, parts: &Parts) -> Option<String> {
    // Runs on every request: write straight into one string.
    let mut out = String::with_capacity(48);
    for (i, part) in key.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        match part {
            KeyPart::ApiKey => push_pair(&mut out, "api_key", client.api_key.as_deref()?),
            KeyPart::User => push_pair(&mut out, "user", client.user.as_deref()?),
            KeyPart::Ip => {
                out.push_str("ip=");
                push_ip(&mut out, client.ip?);
            }
            KeyPart::Route => {
                out.push_str("route=");
                push_escaped(&mut out, parts.method.as_str());
                out.push(' ');
                push_escaped(&mut out, &route(parts));
            }
            KeyPart::Method => push_pair(&mut out, "method", parts.method.as_str()),
            KeyPart::Header(name) => {
                let value = header_str(&parts.headers, name)?;
                out.push_str("header:");
                out.push_str(name.as_str());
                out.push('=');
                push_escaped(&mut out, &value);
            }
        }
    }
    Some(bounded(out))
}

/// Writes an address as its standard text, which has no separator to
/// escape. An IPv4 address (the common case, on every request) is written
/// digit by digit rather than through `fmt`, which costs several times more.
fn push_ip(out: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            let mut digits = itoa::Buffer::new();
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                out.push_str(digits.format(octet));
            }
        }
        IpAddr::V6(_) => {
            let _ = write!(out, "{ip}");
        }
    }
}

fn push_pair(out: &mut String, name: &str, value: &str) {
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
    let mut out = String::new();
    for (i, (name, value)) in pairs.into_iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        push_escaped(&mut out, name);
        out.push('=');
        push_escaped(&mut out, value);
    }
    bounded(out)
}

/// Appends `value` with the key separators (and `%`) percent-encoded.
fn push_escaped(out: &mut String, value: &str) {
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

fn bounded(key: String) -> String {
    if key.len() <= MAX_KEY_LEN {
        return key;
    }
    let digest = Sha256::digest(key.as_bytes());
    let mut out = String::from("sha256:");
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
            let mut out = String::new();
            push_ip(&mut out, ip);
            assert_eq!(out, ip.to_string());
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

    fn trusted() -> Vec<IpNet> {
        vec!["10.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()]
    }

    #[test]
    fn forwarded_headers_from_an_untrusted_peer_are_ignored() {
        let r = req("203.0.113.9:5000", &[("x-forwarded-for", "1.2.3.4")]);
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some("203.0.113.9".parse().unwrap())
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
            Some("198.51.100.7".parse().unwrap())
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
            Some("2001:db8::7".parse().unwrap())
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
            Some("198.51.100.7".parse().unwrap())
        );
        let r = req(
            "10.0.0.2:443",
            &[("forwarded", "for=unknown, for=198.51.100.7")],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::Forwarded).0,
            Some("198.51.100.7".parse().unwrap())
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
            Some("198.51.100.7".parse().unwrap())
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::Forwarded).0,
            Some("6.6.6.6".parse().unwrap())
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
            (Some(want), true)
        );
        // A mapped hop, and a mapped client: keyed as IPv4.
        let r = req(
            "10.0.0.2:443",
            &[("x-forwarded-for", "::ffff:198.51.100.7, ::ffff:10.1.1.1")],
        );
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(want)
        );
        let r = req("[::ffff:198.51.100.7]:5000", &[]);
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some(want)
        );
        // A trusted network written as mapped IPv6 trusts the IPv4 peer.
        let mapped: Vec<IpNet> = vec!["::ffff:10.0.0.0/104".parse().unwrap()];
        let r = req("10.0.0.2:443", &[("x-forwarded-for", "198.51.100.7")]);
        assert_eq!(
            client_ip(&r, &mapped, ForwardedHeader::XForwardedFor),
            (Some(want), true)
        );
    }

    #[test]
    fn a_malformed_chain_falls_back_to_the_peer() {
        let r = req("10.0.0.2:443", &[("x-forwarded-for", "not-an-ip")]);
        assert_eq!(
            client_ip(&r, &trusted(), ForwardedHeader::XForwardedFor).0,
            Some("10.0.0.2".parse().unwrap())
        );
    }

    #[test]
    fn values_cannot_forge_other_parts_and_long_keys_are_hashed() {
        let parts = req("1.1.1.1:1", &[("x-a", "1|header:x-b=2")]);
        let client = Client {
            ip: None,
            api_key: None,
            user: None,
            tier: None,
            peer_trusted: false,
        };
        let key = build_key(
            &[KeyPart::Header(HeaderName::from_static("x-a"))],
            &client,
            &parts,
        );
        assert_eq!(key.as_deref(), Some("header:x-a=1%7Cheader:x-b%3D2"));
        let parts = req("1.1.1.1:1", &[("x-a", &"y".repeat(10_000))]);
        let key = build_key(
            &[KeyPart::Header(HeaderName::from_static("x-a"))],
            &client,
            &parts,
        )
        .unwrap();
        assert!(key.starts_with("sha256:") && key.len() == 7 + 64);
    }
}

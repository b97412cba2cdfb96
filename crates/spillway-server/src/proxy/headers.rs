//! What the proxy changes in the headers it passes on: hop-by-hop headers
//! go, the `X-Forwarded-*` headers are written.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

use crate::http1::wire::RawHead;

/// `X-Forwarded-For`: the chain of client addresses, each proxy appending
/// the peer it received the request from.
pub(crate) const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Host`: the `Host` the client asked for.
pub(crate) const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// `X-Forwarded-Proto`: the scheme the client used.
pub(crate) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// The hop-by-hop headers of RFC 9110 section 7.6.1 (and the unofficial
/// `Proxy-Connection`), which describe one connection and must not be
/// passed on. `Expect` goes too: the proxy's server has already answered a
/// `100-continue` by reading the body, and its client does not wait for one.
// Statics, not consts: a const array is made and dropped at every use.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::EXPECT,
];

/// Headers that `Connection` can never remove: the message's framing and
/// target, what the proxy writes itself, and what it trusts from a proxy in
/// front. Removing `Content-Length` by naming it in `Connection` once let
/// a body through as further requests (CL.0 smuggling); removing the
/// forwarding chain or the degrade marker would let a client decide what
/// the upstream believes about it.
static PROTECTED: [HeaderName; 9] = [
    header::HOST,
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::FORWARDED,
    X_FORWARDED_FOR,
    X_FORWARDED_HOST,
    X_FORWARDED_PROTO,
    X_REAL_IP,
    spillway_tower::X_SPILLWAY_LIMITED,
];

/// Removes the hop-by-hop headers, and the headers that `Connection` lists
/// (which are hop-by-hop by the sender's declaration), except the
/// [`PROTECTED`] ones, which `Connection` cannot name away. The framing
/// headers among the hop-by-hop ones (`Transfer-Encoding`) go all the same:
/// the proxy writes the framing of what it forwards itself.
pub(crate) fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names finds which hop-by-hop ones are present
    // (most requests have none), rather than a lookup for each.
    let mut present = 0u32;
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return;
    }
    // Only the names present are removed (each removal is a lookup; a
    // response with `Connection: keep-alive` paid for seven), in the order
    // all were: the listed ones, then the hop-by-hop ones (a removal moves
    // the last header into its place, so the order is what is left's).
    let sent = |token: &[u8]| {
        headers
            .keys()
            .find(|name| token.eq_ignore_ascii_case(name.as_str().as_bytes()))
            .cloned()
    };
    // `keep-alive`, the usual token, names a hop-by-hop header, which goes
    // below anyway: not looked for.
    let listed = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|token| !token.eq_ignore_ascii_case(b"keep-alive"))
        .filter_map(sent)
        .filter(|name| !PROTECTED.contains(name));
    let hop_by_hop = HOP_BY_HOP
        .iter()
        .enumerate()
        .filter(|(i, _)| present & (1 << i) != 0)
        .map(|(_, name)| name.clone());
    let gone: SmallVec<[HeaderName; 4]> = listed.chain(hop_by_hop).collect();
    for name in &gone {
        headers.remove(name);
    }
}

/// Leaves out of a response head kept as it came what
/// [`remove_hop_by_hop`] removes from a header map (the hop-by-hop lines,
/// and those `Connection` lists but the [`PROTECTED`] ones), and its
/// `Content-Length` lines, whose one length, as [`one_content_length`]
/// keeps it, becomes the head's `length`: the proxy writes the framing.
pub(crate) fn keep_end_to_end(raw: &mut RawHead) {
    let mut listed: SmallVec<[Vec<u8>; 2]> = SmallVec::new();
    let mut length = None;
    let mut one = true;
    for (name, value) in raw.lines() {
        if name.eq_ignore_ascii_case(b"connection") {
            let tokens = value.split(|&b| b == b',').map(<[u8]>::trim_ascii);
            for token in tokens {
                let protected = PROTECTED
                    .iter()
                    .any(|p| token.eq_ignore_ascii_case(p.as_str().as_bytes()));
                if !token.is_empty() && !protected {
                    listed.push(token.to_vec());
                }
            }
        } else if name.eq_ignore_ascii_case(b"content-length") {
            for part in value.split(|&b| b == b',') {
                let n = std::str::from_utf8(part.trim_ascii())
                    .ok()
                    .and_then(|p| p.parse::<u64>().ok());
                one &= n.is_some() && (length.is_none() || length == n);
                length = length.or(n);
            }
        }
    }
    raw.retain(|name, _| {
        let hop_by_hop = HOP_BY_HOP
            .iter()
            .any(|h| name.eq_ignore_ascii_case(h.as_str().as_bytes()));
        !hop_by_hop
            && !name.eq_ignore_ascii_case(b"content-length")
            && !listed.iter().any(|t| name.eq_ignore_ascii_case(t))
    });
    raw.length = length.filter(|_| one);
}

/// `X-Real-IP`: the client's address, as nginx's `proxy_set_header
/// X-Real-IP $remote_addr` writes it.
pub(crate) const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// Headers in which a proxy in front tells the upstream who the client is
/// and how it connected. Frameworks believe them (chi's `RealIP` reads
/// `True-Client-IP` and `X-Real-IP` before anything, Rack 3 `Forwarded`,
/// request-ip `X-Client-IP`), so from a client that is not a trusted proxy
/// they are removed: `X-Real-IP` and `Forwarded` are then written by this
/// proxy, with the peer's address.
static CLIENT_CLAIMS: [HeaderName; 16] = [
    X_REAL_IP,
    header::FORWARDED,
    HeaderName::from_static("x-client-ip"),
    HeaderName::from_static("true-client-ip"),
    HeaderName::from_static("cf-connecting-ip"),
    HeaderName::from_static("fastly-client-ip"),
    HeaderName::from_static("x-cluster-client-ip"),
    HeaderName::from_static("x-forwarded"),
    HeaderName::from_static("forwarded-for"),
    HeaderName::from_static("x-forwarded-port"),
    HeaderName::from_static("x-forwarded-prefix"),
    HeaderName::from_static("x-forwarded-server"),
    HeaderName::from_static("x-forwarded-scheme"),
    HeaderName::from_static("x-forwarded-ssl"),
    HeaderName::from_static("x-url-scheme"),
    HeaderName::from_static("front-end-https"),
];

/// Headers that make some upstreams route by another path than the
/// target's (Symfony's and IIS's `X-Original-URL`, `X-Rewrite-URL`): the
/// rules match the target, so the upstream must route by it. Removed from
/// every request.
static ROUTING: [HeaderName; 2] = [
    HeaderName::from_static("x-original-url"),
    HeaderName::from_static("x-rewrite-url"),
];

/// Whether `name`, with `_` read as `-` (as CGI and WSGI read it), is one
/// of the headers the proxy writes, removes or reads for the rules' sake
/// (`read`: those the rules read, see
/// [`Policy::headers_read`](spillway_tower::Policy::headers_read)), or
/// another header of the request (`X_Api_Key` beside `X-Api-Key`: which
/// one WSGI keeps is the server's choice).
fn folds_onto_ours(name: &str, read: &[HeaderName], headers: &HeaderMap) -> bool {
    let folded = name.replace('_', "-");
    let is = |h: &HeaderName| h.as_str() == folded;
    PROTECTED.iter().any(is)
        || CLIENT_CLAIMS.iter().any(is)
        || ROUTING.iter().any(is)
        || spillway_tower::METHOD_OVERRIDES.iter().any(is)
        || read.iter().any(is)
        || headers.contains_key(folded.as_str())
}

/// Removes what a client could use to make the upstream read the request
/// otherwise than the rules do, before the rules run: the routing headers
/// ([`ROUTING`]), and the headers whose names hold `_` (all of them, or
/// with `underscores` only those that fold onto a header of ours or of the
/// request, `read` naming the rules'), which CGI and WSGI upstreams take
/// for the `-` spelling.
pub(crate) fn remove_misleading(
    headers: &mut HeaderMap,
    underscores: bool,
    read: impl FnOnce() -> Vec<HeaderName>,
) {
    let underscored = |name: &HeaderName| name.as_str().contains('_');
    // Most requests have none: one pass over the names first.
    if !headers
        .keys()
        .any(|n| ROUTING.contains(n) || underscored(n))
    {
        return;
    }
    let read = if underscores { read() } else { Vec::new() };
    let names: Vec<HeaderName> = headers
        .keys()
        .filter(|n| {
            ROUTING.contains(n)
                || (underscored(n) && (!underscores || folds_onto_ours(n.as_str(), &read, headers)))
        })
        .cloned()
        .collect();
    for name in names {
        headers.remove(name);
    }
}

/// The first header of a request that another proxy forwards itself (the
/// forward-auth hook) that [`remove_misleading`] would have removed: the
/// hook cannot remove it from what the upstream receives, so the request
/// is refused instead. Routing headers always; a name with `_` only when
/// it folds onto a header that matters (`read`: the rules'), as with
/// `underscores_in_headers` on: the other proxy decides whether the rest
/// pass (nginx drops them all by default).
pub(crate) fn misleading(
    headers: &HeaderMap,
    read: impl FnOnce() -> Vec<HeaderName>,
) -> Option<HeaderName> {
    if let Some(routing) = headers.keys().find(|n| ROUTING.contains(n)) {
        return Some(routing.clone());
    }
    // Most requests have none: the rules' headers are listed only if one is.
    if !headers.keys().any(|n| n.as_str().contains('_')) {
        return None;
    }
    let read = read();
    headers
        .keys()
        .find(|n| n.as_str().contains('_') && folds_onto_ours(n.as_str(), &read, headers))
        .cloned()
}

/// From a client that is not a trusted proxy: removes what it claims about
/// itself ([`CLIENT_CLAIMS`]) and writes `X-Real-IP` and `Forwarded` with
/// the peer's address (`hop`, as [`hop_of`] writes it). From a trusted
/// proxy, they are its own and kept; a `Forwarded` chain it sent gets this
/// hop appended, as `X-Forwarded-For` does.
pub(crate) fn claims_of_the_peer(headers: &mut HeaderMap, hop: &Hop, trusted: bool) {
    if trusted {
        let node = forwarded_node(&hop.address);
        if headers.contains_key(header::FORWARDED) {
            let mut chain = Vec::new();
            for value in headers.get_all(header::FORWARDED) {
                chain.extend_from_slice(value.as_bytes());
                chain.extend_from_slice(b", ");
            }
            chain.extend_from_slice(b"for=");
            chain.extend_from_slice(&node);
            if let Ok(value) = HeaderValue::from_bytes(&chain) {
                headers.insert(header::FORWARDED, value);
            }
        }
        return;
    }
    if headers.keys().any(|name| CLIENT_CLAIMS.contains(name)) {
        for name in &CLIENT_CLAIMS {
            headers.remove(name);
        }
    }
    headers.insert(X_REAL_IP, hop.address.clone());
    headers.insert(header::FORWARDED, hop.forwarded.clone());
}

/// A peer as the forwarding headers name it: made once a connection, not
/// for each of its requests.
#[derive(Debug, Clone)]
pub(crate) struct Hop {
    /// Its address as an `X-Forwarded-For` hop ([`hop_of`]), and as
    /// `X-Real-IP`.
    pub(crate) address: HeaderValue,
    /// `Forwarded: for=<address>;proto=http`.
    forwarded: HeaderValue,
}

impl Hop {
    pub(crate) fn of(peer: IpAddr) -> Self {
        let address = hop_of(peer);
        let forwarded = [&b"for="[..], &forwarded_node(&address), b";proto=http"].concat();
        let forwarded = HeaderValue::from_bytes(&forwarded).expect("an address is a valid value");
        Self { address, forwarded }
    }
}

/// An address as a `Forwarded` node (RFC 7239 section 6): an IPv6 one in
/// brackets and quotes.
fn forwarded_node(hop: &HeaderValue) -> Vec<u8> {
    let address = hop.as_bytes();
    if address.contains(&b':') {
        [&b"\"["[..], address, b"]\""].concat()
    } else {
        address.to_vec()
    }
}

/// Leaves one `Content-Length` line with one number where the upstream's
/// response had the same number in several (`5, 5`, or two lines), which
/// the client's parser might read otherwise; removes it when they differ
/// (the response was framed by the first, or refused, by the client side).
pub(crate) fn one_content_length(headers: &mut HeaderMap) {
    let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
    let Some(first) = values.next() else {
        return;
    };
    if values.next().is_none() && !first.as_bytes().contains(&b',') {
        return;
    }
    let mut length = None;
    let mut one = true;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for part in value.as_bytes().split(|&b| b == b',') {
            let n = std::str::from_utf8(part.trim_ascii())
                .ok()
                .and_then(|p| p.parse::<u64>().ok());
            one &= n.is_some() && (length.is_none() || length == n);
            length = length.or(n);
        }
    }
    headers.remove(header::CONTENT_LENGTH);
    if let (true, Some(n)) = (one, length) {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
}

/// A peer's address as an `X-Forwarded-For` hop.
pub(crate) fn hop_of(peer: IpAddr) -> HeaderValue {
    // An IPv4 client on a dual-stack socket shows as `::ffff:a.b.c.d`; the
    // chain should carry the address the client has.
    let peer = peer.to_canonical().to_string();
    HeaderValue::try_from(peer).expect("an address is a valid header value")
}

/// Appends `hop` (see [`hop_of`]) to `X-Forwarded-For`, after the chain
/// the request came with (all its header lines, in order, joined with
/// `", "`), as one line.
pub(crate) fn append_hop(headers: &mut HeaderMap, hop: &HeaderValue) {
    if !headers.contains_key(&X_FORWARDED_FOR) {
        headers.insert(X_FORWARDED_FOR, hop.clone());
        return;
    }
    let mut chain: Vec<u8> = Vec::new();
    for value in headers.get_all(&X_FORWARDED_FOR) {
        let hops = value.as_bytes().trim_ascii();
        let hops = hops.strip_suffix(b",").unwrap_or(hops).trim_ascii();
        if hops.is_empty() {
            continue;
        }
        if !chain.is_empty() {
            chain.extend_from_slice(b", ");
        }
        chain.extend_from_slice(hops);
    }
    if !chain.is_empty() {
        chain.extend_from_slice(b", ");
    }
    chain.extend_from_slice(hop.as_bytes());
    // The parts were valid header values and the address is ASCII.
    let value = HeaderValue::from_bytes(&chain).expect("a valid header value");
    headers.insert(X_FORWARDED_FOR, value);
}

/// HTTP/2 may split `Cookie` into several fields; HTTP/1.1 allows one, so
/// they are joined with `"; "` (RFC 9113 section 8.2.3).
pub(crate) fn join_cookies(headers: &mut HeaderMap) {
    let mut values = headers.get_all(header::COOKIE).iter();
    let (Some(first), Some(_)) = (values.next(), values.next()) else {
        return;
    };
    let mut joined = first.as_bytes().to_vec();
    for value in headers.get_all(header::COOKIE).iter().skip(1) {
        joined.extend_from_slice(b"; ");
        joined.extend_from_slice(value.as_bytes());
    }
    let value = HeaderValue::from_bytes(&joined).expect("valid header values joined");
    headers.insert(header::COOKIE, value);
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    fn all(headers: &HeaderMap, name: &str) -> Vec<String> {
        headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_lists_are_removed() {
        let mut headers = map(&[
            ("connection", "keep-alive, X-Secret"),
            ("connection", "x-other"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("trailer", "x-checksum"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("expect", "100-continue"),
            ("x-secret", "1"),
            ("x-other", "2"),
            ("x-kept", "3"),
            ("content-length", "4"),
        ]);
        remove_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-kept", "content-length"]);
    }

    /// `Connection: content-length` once dropped the length while the body
    /// was still sent: the upstream read the body as more requests.
    #[test]
    fn connection_cannot_name_away_framing_forwarding_or_the_degrade_marker() {
        let mut headers = map(&[
            (
                "connection",
                "close, Content-Length, host, x-forwarded-for, X-Forwarded-Proto",
            ),
            (
                "connection",
                "x-forwarded-host, forwarded, x-real-ip, x-spillway-limited, x-gone",
            ),
            ("host", "api.example"),
            ("content-length", "4"),
            ("x-forwarded-for", "192.0.2.1"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "api.example"),
            ("forwarded", "for=192.0.2.1"),
            ("x-real-ip", "192.0.2.1"),
            ("x-spillway-limited", "per-ip"),
            ("x-gone", "1"),
        ]);
        remove_hop_by_hop(&mut headers);
        let mut left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(
            left,
            [
                "content-length",
                "forwarded",
                "host",
                "x-forwarded-for",
                "x-forwarded-host",
                "x-forwarded-proto",
                "x-real-ip",
                "x-spillway-limited",
            ]
        );
    }

    /// A response head kept as lines loses exactly what a header map of it
    /// loses (hop-by-hop lines, those `Connection` lists but the protected
    /// ones), and its `Content-Length` lines become the one length the map
    /// keeps.
    #[test]
    fn kept_lines_lose_what_a_header_map_loses() {
        use crate::http1::wire::{parse_response, parse_response_raw};
        let heads = [
            "connection: keep-alive, X-Secret\r\nConnection: x-other\r\nkeep-alive: timeout=5\r\n\
             proxy-connection: keep-alive\r\nTE: trailers\r\ntrailer: x-checksum\r\n\
             transfer-encoding: chunked\r\nupgrade: websocket\r\nexpect: 100-continue\r\n\
             X-Secret: 1\r\nx-other: 2\r\nX-Kept: 3\r\ncontent-length: 4\r\n",
            "connection: close, Content-Length, host, x-forwarded-for, X-Forwarded-Proto\r\n\
             connection: x-forwarded-host, forwarded, x-real-ip, x-spillway-limited, x-gone\r\n\
             host: api.example\r\ncontent-length: 4\r\nx-forwarded-for: 192.0.2.1\r\n\
             x-forwarded-proto: https\r\nx-forwarded-host: api.example\r\n\
             forwarded: for=192.0.2.1\r\nx-real-ip: 192.0.2.1\r\nx-spillway-limited: per-ip\r\n\
             x-gone: 1\r\n",
            "Connection: x-a, not a name, ,x-b\r\nx-a: 1\r\nx-b: 2\r\nX-C: 3\r\nx-c: 4\r\n",
            "Content-Length: 7, 7\r\nContent-Length: 7\r\nDate: today\r\n",
            "Content-Length: 7, 8\r\nServer: x\r\n",
            "Content-Length: seven\r\n",
            "Server: x\r\n",
        ];
        for lines in heads {
            let head = Bytes::from(format!("HTTP/1.1 200 OK\r\n{lines}\r\n"));
            // The answer to a HEAD: its framing is not checked.
            let mut mapped = parse_response(&head, true).expect("a head").parts.headers;
            remove_hop_by_hop(&mut mapped);
            one_content_length(&mut mapped);
            let mut raw = parse_response_raw(&head, true).expect("a head").parts;
            let raw = raw.extensions.get_mut::<RawHead>().expect("lines kept");
            keep_end_to_end(raw);
            let kept: Vec<(String, Vec<u8>)> = raw
                .lines()
                .map(|(n, v)| (String::from_utf8_lossy(n).to_lowercase(), v.to_vec()))
                .collect();
            let left: Vec<(String, Vec<u8>)> = mapped
                .iter()
                .filter(|(n, _)| *n != header::CONTENT_LENGTH)
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect();
            let (mut kept, mut left) = (kept, left);
            kept.sort();
            left.sort();
            assert_eq!(kept, left, "{lines:?}");
            // A lone invalid length stays in the map, and is no length to
            // the server that writes the response.
            let length = mapped
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            assert_eq!(raw.length, length, "{lines:?}");
        }
    }

    #[test]
    fn a_malformed_connection_token_is_skipped() {
        let mut headers = map(&[
            ("connection", "x-a, not a name, ,x-b"),
            ("x-a", "1"),
            ("x-b", "2"),
            ("x-c", "3"),
        ]);
        remove_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-c"]);
    }

    #[test]
    fn underscored_and_routing_headers_are_removed() {
        let sent = [
            ("x_spillway_limited", "login"),
            ("X_Forwarded_For", "6.6.6.6"),
            ("x_api_key", "junk"),
            ("x-original-url", "/admin"),
            ("x-rewrite-url", "/admin"),
            ("x-api-key", "real"),
        ];
        let mut headers = map(&sent);
        remove_misleading(&mut headers, false, Vec::new);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-api-key"]);
        // Kept when asked, but for those that fold onto ours, onto one the
        // rules read, or onto another of the request.
        let mut headers = map(&sent);
        remove_misleading(&mut headers, true, Vec::new);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-api-key"]);
        let mut alone = map(&[("x_api_key", "real"), ("x_tenant", "t")]);
        let read = || vec![HeaderName::from_static("x-api-key")];
        remove_misleading(&mut alone, true, read);
        let left: Vec<&str> = alone.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x_tenant"]);
    }

    #[test]
    fn a_clients_claims_about_itself_are_replaced_by_the_peers_address() {
        let mut headers = map(&[
            ("x-real-ip", "6.6.6.6"),
            ("forwarded", "for=6.6.6.6"),
            ("true-client-ip", "6.6.6.6"),
            ("x-client-ip", "6.6.6.6"),
            ("x-forwarded-port", "443"),
            ("x-kept", "1"),
        ]);
        claims_of_the_peer(
            &mut headers,
            &Hop::of("2001:db8::1".parse().unwrap()),
            false,
        );
        let mut left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["forwarded", "x-kept", "x-real-ip"]);
        assert_eq!(all(&headers, "x-real-ip"), ["2001:db8::1"]);
        assert_eq!(
            all(&headers, "forwarded"),
            ["for=\"[2001:db8::1]\";proto=http"]
        );
    }

    #[test]
    fn a_trusted_proxys_claims_are_kept_and_its_forwarded_chain_extended() {
        let mut headers = map(&[
            ("x-real-ip", "203.0.113.7"),
            ("forwarded", "for=203.0.113.7;proto=https"),
            ("true-client-ip", "203.0.113.7"),
        ]);
        claims_of_the_peer(&mut headers, &Hop::of("10.0.0.2".parse().unwrap()), true);
        assert_eq!(all(&headers, "x-real-ip"), ["203.0.113.7"]);
        assert_eq!(all(&headers, "true-client-ip"), ["203.0.113.7"]);
        assert_eq!(
            all(&headers, "forwarded"),
            ["for=203.0.113.7;proto=https, for=10.0.0.2"]
        );
        // No chain of its own: none is started with the proxy's address.
        let mut none = HeaderMap::new();
        claims_of_the_peer(&mut none, &Hop::of("10.0.0.2".parse().unwrap()), true);
        assert!(none.is_empty());
    }

    #[test]
    fn forwarded_for_starts_a_chain() {
        let mut headers = HeaderMap::new();
        append_hop(&mut headers, &hop_of("192.0.2.1".parse().unwrap()));
        assert_eq!(all(&headers, "x-forwarded-for"), ["192.0.2.1"]);
    }

    #[test]
    fn forwarded_for_appends_to_every_line_of_the_chain_in_order() {
        let mut headers = map(&[
            ("x-forwarded-for", "203.0.113.7, 198.51.100.2"),
            ("x-forwarded-for", " 198.51.100.3 ,"),
            ("x-forwarded-for", ""),
        ]);
        append_hop(&mut headers, &hop_of("2001:db8::1".parse().unwrap()));
        assert_eq!(
            all(&headers, "x-forwarded-for"),
            ["203.0.113.7, 198.51.100.2, 198.51.100.3, 2001:db8::1"]
        );
    }

    #[test]
    fn forwarded_for_keeps_hops_it_cannot_parse() {
        let mut headers = map(&[("x-forwarded-for", "unknown, _hidden")]);
        append_hop(&mut headers, &hop_of("192.0.2.1".parse().unwrap()));
        assert_eq!(
            all(&headers, "x-forwarded-for"),
            ["unknown, _hidden, 192.0.2.1"]
        );
    }

    #[test]
    fn a_mapped_ipv4_peer_is_written_as_ipv4() {
        let mut headers = HeaderMap::new();
        append_hop(&mut headers, &hop_of("::ffff:192.0.2.9".parse().unwrap()));
        assert_eq!(all(&headers, "x-forwarded-for"), ["192.0.2.9"]);
    }

    #[test]
    fn split_cookies_are_joined() {
        let mut headers = map(&[("cookie", "a=1"), ("cookie", "b=2")]);
        join_cookies(&mut headers);
        assert_eq!(all(&headers, "cookie"), ["a=1; b=2"]);
        let mut one = map(&[("cookie", "a=1")]);
        join_cookies(&mut one);
        assert_eq!(all(&one, "cookie"), ["a=1"]);
    }
}

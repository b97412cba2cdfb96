//! What the proxy changes in the headers it passes on: hop-by-hop headers
//! go, the `X-Forwarded-*` headers are written.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

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
const HOP_BY_HOP: [HeaderName; 8] = [
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
const PROTECTED: [HeaderName; 9] = [
    header::HOST,
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::FORWARDED,
    X_FORWARDED_FOR,
    X_FORWARDED_HOST,
    X_FORWARDED_PROTO,
    HeaderName::from_static("x-real-ip"),
    spillway_tower::X_SPILLWAY_LIMITED,
];

/// Removes the hop-by-hop headers, and the headers that `Connection` lists
/// (which are hop-by-hop by the sender's declaration), except the
/// [`PROTECTED`] ones, which `Connection` cannot name away. The framing
/// headers among the hop-by-hop ones (`Transfer-Encoding`) go all the same:
/// the proxy writes the framing of what it forwards itself.
pub(crate) fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // Most requests have none: one pass over the names, rather than a
    // lookup for each hop-by-hop name.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .filter_map(|token| HeaderName::from_bytes(token.trim_ascii()).ok())
        .filter(|name| !PROTECTED.contains(name))
        .collect();
    for name in listed.iter().chain(&HOP_BY_HOP) {
        headers.remove(name);
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

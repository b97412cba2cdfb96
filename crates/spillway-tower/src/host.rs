//! One strict reading of the host a request names, shared by host rules
//! and the proxy.
//!
//! A `Host` value is an authority, `host[:port]` (RFC 9110 section 7.2),
//! and routers read the ones that are not in different ways: Express with
//! `trust proxy` takes `admin.example.com,x` and `admin.example.com:8o`
//! for `admin.example.com` (it cuts at the comma and at the colon), where
//! a rule comparing the whole value would see another host. So only the
//! spellings every router reads alike are accepted: a DNS-style name
//! (letters, digits, `-`, `_`, dots between non-empty labels, one trailing
//! dot), an IPv4 address, or an IPv6 address in brackets, then at most a
//! port of up to 5 digits, at most 65535 (an empty one is no port).
//! Everything else (a comma, `%`, a second colon, a non-numeric port, a
//! zone id, user info) is not a host.

use std::net::Ipv6Addr;

/// The host of an authority (`api.example.com:8080` gives
/// `api.example.com`), without its port and without a trailing dot, or
/// `None` if the authority is not one a router reads alike (see the module
/// docs).
///
/// ```
/// use spillway_tower::host::host_of_authority;
///
/// assert_eq!(host_of_authority(b"api.example.com:8080"), Some("api.example.com"));
/// assert_eq!(host_of_authority(b"API.example.com."), Some("API.example.com"));
/// assert_eq!(host_of_authority(b"[2001:db8::1]:443"), Some("[2001:db8::1]"));
/// // Hosts that routers fold into another one.
/// assert_eq!(host_of_authority(b"admin.example.com,x"), None);
/// assert_eq!(host_of_authority(b"admin.example.com:8o"), None);
/// assert_eq!(host_of_authority(b"user@admin.example.com"), None);
/// ```
pub fn host_of_authority(authority: &[u8]) -> Option<&str> {
    let (host, port) = if authority.first() == Some(&b'[') {
        let close = authority.iter().position(|&b| b == b']')?;
        let literal = std::str::from_utf8(&authority[1..close]).ok()?;
        literal.parse::<Ipv6Addr>().ok()?;
        let rest = &authority[close + 1..];
        let port = match rest {
            [] => None,
            [b':', port @ ..] => Some(port),
            _ => return None,
        };
        (&authority[..=close], port)
    } else {
        match authority.iter().position(|&b| b == b':') {
            Some(colon) => (&authority[..colon], Some(&authority[colon + 1..])),
            None => (authority, None),
        }
    };
    if let Some(port) = port
        && !valid_port(port)
    {
        return None;
    }
    let host = if host.first() == Some(&b'[') {
        host
    } else {
        let name = host.strip_suffix(b".").unwrap_or(host);
        if !valid_name(name) {
            return None;
        }
        name
    };
    // Every byte checked above is ASCII.
    std::str::from_utf8(host).ok()
}

/// Empty (`host:`, which RFC 3986 allows and routers read as `host`), or
/// 1 to 5 digits, at most 65535.
fn valid_port(port: &[u8]) -> bool {
    port.is_empty()
        || matches!(port.len(), 1..=5)
            && port.iter().all(u8::is_ascii_digit)
            && std::str::from_utf8(port)
                .ok()
                .and_then(|p| p.parse::<u16>().ok())
                .is_some()
}

/// Non-empty labels of letters, digits, `-` and `_`, separated by dots;
/// at most 253 bytes, as in DNS. An IPv4 address is such a name too.
fn valid_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split(|&b| b == b'.').all(|label| {
            !label.is_empty()
                && label
                    .iter()
                    .all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spellings_routers_read_alike_are_hosts() {
        for (authority, host) in [
            ("admin.example.com", "admin.example.com"),
            ("admin.example.com.", "admin.example.com"),
            ("admin.example.com:80", "admin.example.com"),
            ("admin.example.com.:8080", "admin.example.com"),
            ("Admin.Example.COM", "Admin.Example.COM"),
            ("localhost:65535", "localhost"),
            ("127.0.0.1:8080", "127.0.0.1"),
            ("my_host.internal", "my_host.internal"),
            ("[::1]", "[::1]"),
            ("[2001:db8::1]:8443", "[2001:db8::1]"),
            ("app:", "app"),
            ("[::1]:", "[::1]"),
        ] {
            assert_eq!(
                host_of_authority(authority.as_bytes()),
                Some(host),
                "{authority}"
            );
        }
    }

    #[test]
    fn spellings_that_routers_fold_or_split_are_not() {
        for authority in [
            "admin.example.com,x",
            "admin.example.com:8o",
            "admin.example.com:65536",
            "admin.example.com:123456",
            "admin.example.com:80:80",
            "admin.example.com..",
            "admin..example.com",
            ".admin.example.com",
            "admin.example.com;x",
            "admin.example.com/x",
            "admin.example.com x",
            "admin.example.com\t",
            "user@admin.example.com",
            "%61dmin.example.com",
            "admin.ex\u{e4}mple.com",
            "[::1",
            "[::1]x",
            "[fe80::1%25eth0]",
            "[v1.x]",
            "::1",
            "",
            ":80",
        ] {
            assert_eq!(
                host_of_authority(authority.as_bytes()),
                None,
                "{authority:?}"
            );
        }
        assert_eq!(host_of_authority(&[b'a'; 254]), None);
    }
}

//! What the rules match is what the upstream receives: the request target
//! and `Host`, normalized before any rule runs, and forwarded so.
//!
//! Two parsers reading one request differently is how a rule is walked
//! around: `/%6cogin`, `/./login` and `//login` are the login to many
//! upstreams, and `GET http://other.example/` names another host than its
//! `Host` header. So the proxy makes one reading, matches the rules on it,
//! and sends that reading on:
//!
//! - percent-encoded unreserved characters (RFC 3986 section 2.3) are
//!   decoded, and the hex digits of the other percent-encodings upper-cased
//!   (section 6.2.2.1); a `%` not followed by two hex digits is refused;
//! - runs of `/` become one (`merge_slashes`);
//! - dot segments are removed (section 5.2.4);
//! - `%2F` and `%5C` (an encoded `/` or `\`) are kept, refused or decoded,
//!   as `escaped_slashes` says;
//! - an absolute-form target's authority becomes the `Host` (RFC 9112
//!   section 3.2.2) and the target goes in origin form;
//! - a `Host` must be one, ASCII, and a valid authority;
//! - a method that is a letter-case variant of a standard one (`post`) is
//!   refused: some upstreams take it for the standard method, the rules
//!   would not.
//!
//! The query is left as it is.

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery};
use http::{Method, Uri, Version};

use super::error::ForwardError;
use crate::config::{EscapedSlashes, Normalize};

/// Normalizes the method, target and `Host` of a request head as the
/// module docs say; an error is a 400.
pub(crate) fn normalize(
    parts: &mut http::request::Parts,
    options: Normalize,
) -> Result<(), ForwardError> {
    check_method(&parts.method)?;
    let authority = host_of(parts)?;
    let path = parts.uri.path();
    let mut target = if path.is_empty() {
        // An absolute-form target without a path.
        b"/".to_vec()
    } else if path == "*" {
        // `OPTIONS *`.
        path.as_bytes().to_vec()
    } else {
        normalize_path(path, options)?
    };
    if parts.uri.authority().is_none() && target == path.as_bytes() {
        return Ok(());
    }
    if let Some(query) = parts.uri.query() {
        target.push(b'?');
        target.extend_from_slice(query.as_bytes());
    }
    let target =
        PathAndQuery::try_from(target).map_err(|_| bad("The request target is invalid."))?;
    parts.uri = Uri::from(target);
    if let Some(authority) = authority {
        let host = HeaderValue::from_str(authority.as_str()).map_err(|_| bad("Invalid Host."))?;
        parts.headers.insert(header::HOST, host);
    }
    Ok(())
}

fn bad(why: &'static str) -> ForwardError {
    ForwardError::BadRequest(why)
}

/// Refuses `post`, `Get` and the like.
fn check_method(method: &Method) -> Result<(), ForwardError> {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    let name = method.as_str();
    let variant = STANDARD
        .iter()
        .any(|s| *s != name && s.eq_ignore_ascii_case(name));
    if variant {
        return Err(bad(
            "A method must be written in upper case, as the standard methods are.",
        ));
    }
    Ok(())
}

/// The authority to send as `Host` instead of the client's: an
/// absolute-form target's (or HTTP/2's `:authority`). Checks the `Host`
/// headers: at most one (exactly one for HTTP/1.1 in origin form), ASCII,
/// a valid authority without credentials.
fn host_of(parts: &http::request::Parts) -> Result<Option<Authority>, ForwardError> {
    let mut hosts = parts.headers.get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(bad("More than one Host."));
    }
    if let Some(host) = host {
        let valid = host.as_bytes().is_ascii()
            && !host.as_bytes().contains(&b'@')
            && Authority::try_from(host.as_bytes()).is_ok();
        if !valid {
            return Err(bad("Invalid Host."));
        }
    }
    match parts.uri.authority() {
        Some(authority) if authority.as_str().contains('@') => {
            Err(bad("Credentials in the request target are not accepted."))
        }
        Some(authority) => Ok(Some(authority.clone())),
        None if host.is_none() && parts.version == Version::HTTP_11 => {
            // RFC 9112 section 3.2: a server must refuse it.
            Err(bad("An HTTP/1.1 request needs a Host."))
        }
        None => Ok(None),
    }
}

/// `path` normalized as `options` say. Works on bytes: a path may hold
/// bytes that are not UTF-8, and they are passed on as they came.
fn normalize_path(path: &str, options: Normalize) -> Result<Vec<u8>, ForwardError> {
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b != b'%' {
            decoded.push(b);
            i += 1;
            continue;
        }
        let hex = |j: usize| bytes.get(j).and_then(|&h| char::from(h).to_digit(16));
        let (Some(hi), Some(lo)) = (hex(i + 1), hex(i + 2)) else {
            return Err(bad("A % in the path is not followed by two hex digits."));
        };
        let c = u8::try_from(hi * 16 + lo).expect("two hex digits make a byte");
        let slash = c == b'/' || c == b'\\';
        if slash && options.escaped_slashes == EscapedSlashes::Reject {
            return Err(bad("An encoded slash in the path is not accepted."));
        }
        let unreserved = c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~');
        if (options.path && unreserved)
            || (slash && options.escaped_slashes == EscapedSlashes::Unescape)
        {
            decoded.push(if slash { b'/' } else { c });
        } else if options.path {
            decoded.extend_from_slice(format!("%{c:02X}").as_bytes());
        } else {
            decoded.extend_from_slice(&bytes[i..i + 3]);
        }
        i += 3;
    }
    if options.merge_slashes {
        decoded.dedup_by(|b, a| *a == b'/' && *b == b'/');
    }
    Ok(if options.path {
        remove_dot_segments(&decoded)
    } else {
        decoded
    })
}

/// RFC 3986 section 5.2.4, on a path that starts with `/`.
fn remove_dot_segments(path: &[u8]) -> Vec<u8> {
    let mut out: Vec<&[u8]> = Vec::new();
    let segments: Vec<&[u8]> = path.split(|&b| b == b'/').skip(1).collect();
    let last = segments.len().saturating_sub(1);
    for (i, &segment) in segments.iter().enumerate() {
        match segment {
            b"." | b".." => {
                if segment == b".." {
                    out.pop();
                }
                // `/a/.` and `/a/b/..` end in a directory: `/a/`.
                if i == last {
                    out.push(b"");
                }
            }
            segment => out.push(segment),
        }
    }
    let mut normalized = Vec::with_capacity(path.len());
    for segment in &out {
        normalized.push(b'/');
        normalized.extend_from_slice(segment);
    }
    if normalized.is_empty() {
        normalized.push(b'/');
    }
    normalized
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(p: &str) -> Result<String, &'static str> {
        path_with(p, Normalize::default())
    }

    fn path_with(p: &str, options: Normalize) -> Result<String, &'static str> {
        let normalized = normalize_path(p, options).map_err(|e| match e {
            ForwardError::BadRequest(why) => why,
            other => panic!("{other}"),
        })?;
        Ok(String::from_utf8(normalized).expect("ASCII in these tests"))
    }

    #[test]
    fn the_spellings_of_the_login_path_are_one_path() {
        for spelling in [
            "/login",
            "//login",
            "/%6cogin",
            "/%6Cogin",
            "/./login",
            "/x/../login",
            "/x/y/../../login",
            "/../login",
            "/%2e/login",
            "/%2E%2E/login",
            "///x//..//login",
        ] {
            assert_eq!(path(spelling).as_deref(), Ok("/login"), "{spelling}");
        }
    }

    #[test]
    fn dot_segments_are_removed_as_rfc_3986_says() {
        // RFC 3986 section 5.2.4's examples, and the directory endings.
        assert_eq!(path("/a/b/c/./../../g").unwrap(), "/a/g");
        assert_eq!(path("/mid/content=5/../6").unwrap(), "/mid/6");
        assert_eq!(path("/a/.").unwrap(), "/a/");
        assert_eq!(path("/a/b/..").unwrap(), "/a/");
        assert_eq!(path("/..").unwrap(), "/");
        assert_eq!(path("/").unwrap(), "/");
        assert_eq!(path("/a/").unwrap(), "/a/");
        assert_eq!(path("/a/..b/.c").unwrap(), "/a/..b/.c");
    }

    #[test]
    fn other_percent_encodings_are_kept_with_upper_case_hex() {
        assert_eq!(path("/a%2fb").unwrap(), "/a%2Fb");
        assert_eq!(path("/caf%c3%a9").unwrap(), "/caf%C3%A9");
        assert_eq!(path("/a%20b").unwrap(), "/a%20b");
        assert_eq!(
            path("/100%"),
            Err("A % in the path is not followed by two hex digits.")
        );
        assert!(path("/%g1").is_err());
        assert!(path("/%1").is_err());
    }

    #[test]
    fn encoded_slashes_are_kept_refused_or_decoded() {
        let with = |escaped_slashes| Normalize {
            escaped_slashes,
            ..Normalize::default()
        };
        assert_eq!(path("/x%2F..%2Flogin").unwrap(), "/x%2F..%2Flogin");
        assert!(path_with("/a%2Fb", with(EscapedSlashes::Reject)).is_err());
        assert!(path_with("/a%5cb", with(EscapedSlashes::Reject)).is_err());
        let unescape = with(EscapedSlashes::Unescape);
        assert_eq!(path_with("/x%2F..%2Flogin", unescape).unwrap(), "/login");
        assert_eq!(path_with("/%5Clogin", unescape).unwrap(), "/login");
    }

    #[test]
    fn each_step_can_be_switched_off() {
        let off = Normalize {
            path: false,
            merge_slashes: false,
            escaped_slashes: EscapedSlashes::Keep,
        };
        assert_eq!(path_with("//x/../%6cogin", off).unwrap(), "//x/../%6cogin");
        let merge_only = Normalize {
            merge_slashes: true,
            ..off
        };
        assert_eq!(path_with("//x//y", merge_only).unwrap(), "/x/y");
    }

    fn head(request: http::Request<()>) -> Result<http::request::Parts, &'static str> {
        let mut parts = request.into_parts().0;
        match normalize(&mut parts, Normalize::default()) {
            Ok(()) => Ok(parts),
            Err(ForwardError::BadRequest(why)) => Err(why),
            Err(other) => panic!("{other}"),
        }
    }

    #[test]
    fn an_absolute_form_targets_authority_becomes_the_host() {
        let parts = head(
            http::Request::get("http://other.example/h/../x?q=1")
                .header("host", "api.example.com")
                .body(())
                .unwrap(),
        )
        .unwrap();
        assert_eq!(parts.uri, "/x?q=1");
        assert_eq!(parts.headers["host"], "other.example");
    }

    #[test]
    fn hosts_must_be_one_ascii_authority() {
        let with_host = |host: &[u8]| {
            http::Request::get("/")
                .header("host", HeaderValue::from_bytes(host).unwrap())
                .body(())
                .unwrap()
        };
        assert!(head(with_host(b"api.example.com.")).is_ok());
        assert!(head(with_host(b"api.example.com:8080")).is_ok());
        assert!(head(with_host(b"[::1]:8080")).is_ok());
        assert_eq!(
            head(with_host(b"api.ex\xc3\xa4mple.com")).unwrap_err(),
            "Invalid Host."
        );
        assert!(head(with_host(b"user@api.example.com")).is_err());
        assert!(head(with_host(b"a b")).is_err());
        let two = http::Request::get("/")
            .header("host", "a.example")
            .header("host", "b.example")
            .body(())
            .unwrap();
        assert_eq!(head(two).unwrap_err(), "More than one Host.");
        let none = http::Request::get("/").body(()).unwrap();
        assert!(head(none).is_err());
        let old = http::Request::get("/")
            .version(Version::HTTP_10)
            .body(())
            .unwrap();
        assert!(head(old).is_ok());
    }

    #[test]
    fn lower_case_standard_methods_are_refused() {
        for method in ["post", "Get", "dElEtE"] {
            let request = http::Request::builder()
                .method(method)
                .uri("/login")
                .header("host", "h")
                .body(())
                .unwrap();
            assert!(head(request).is_err(), "{method}");
        }
        let custom = http::Request::builder()
            .method("PURGE")
            .uri("/")
            .header("host", "h")
            .body(())
            .unwrap();
        assert!(head(custom).is_ok());
    }
}

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
//! - a `Host` must be one, and a host every router reads alike
//!   ([`host_of_authority`]): `admin.example.com,x` and
//!   `admin.example.com:8o` are `admin.example.com` to Express;
//! - a raw `\` in the path is a `/` (WHATWG's URL parser, in Node, reads
//!   it so), and a segment named `.` or `..` before its `;parameters` is a
//!   dot segment (Servlet containers strip the parameters first);
//! - bytes that are not ASCII are percent-encoded, in the path and in the
//!   query: a strict upstream cannot parse them raw; an encoded control
//!   character in the path (`/login%0a`, `%00`) is refused;
//! - a method that is a letter-case variant of a standard one (`post`) is
//!   refused: some upstreams take it for the standard method, the rules
//!   would not.
//!
//! The query is otherwise left as it is.

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery};
use http::{Method, Uri, Version};

use spillway_tower::OtherPaths;
use spillway_tower::host::host_of_authority;

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
    // Most targets are normal already: nothing to decode, merge or
    // resolve, whatever the options (a property test holds this to
    // `normalize_path`), and no other reading.
    if authority.is_none()
        && is_plain(path)
        && parts
            .uri
            .query()
            .is_none_or(|q| q.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Ok(());
    }
    let mut target = if path.is_empty() {
        // An absolute-form target without a path.
        b"/".to_vec()
    } else if path == "*" {
        // `OPTIONS *`.
        path.as_bytes().to_vec()
    } else {
        normalize_path(path, options)?
    };
    let unchanged = target == path.as_bytes();
    other_readings(parts, &target, options);
    let query = parts.uri.query();
    let plain_query = query.is_none_or(|q| q.bytes().all(|b| b.is_ascii_graphic()));
    if parts.uri.authority().is_none() && unchanged && plain_query {
        return Ok(());
    }
    if let Some(query) = query {
        target.push(b'?');
        encode_query(query, &mut target);
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

/// Where `%2F` and `%5C` go on encoded (`escaped_slashes = "keep"`), the
/// path with them read as `/`, for the rules ([`OtherPaths`]): WSGI servers
/// and Rack decode them (Werkzeug serves `/x%2F..%2Flogin` as `/login`,
/// Rack::Protection after decoding both), while Express and Servlet
/// containers do not. A rule counts the request under either reading; the
/// upstream receives the path as it came.
fn other_readings(parts: &mut http::request::Parts, target: &[u8], options: Normalize) {
    if options.escaped_slashes != EscapedSlashes::Keep {
        return;
    }
    if !has_encoded_slash(target) {
        return;
    }
    // The target was normalized once already (ASCII): it parses again.
    let Ok(target) = std::str::from_utf8(target) else {
        return;
    };
    if let Ok(reading) = normalize_path(target, unescaping(options))
        && let Ok(reading) = String::from_utf8(reading)
    {
        parts.extensions.insert(OtherPaths(vec![reading]));
    }
}

/// The other readings of a raw target that reaches the upstream as it
/// came (the forward-auth hook: the proxy in front forwards the client's
/// bytes, not this normalization), for the rules ([`OtherPaths`]), besides
/// the normalized path [`normalize`] gives:
///
/// - with `%2F` and `%5C` decoded before the dot segments are removed
///   (Werkzeug and Rack decode them first: `/x%2F..%2Flogin`, and
///   `/x/..\/x%5C../../login`, whose `..` and `%5C` the normalized
///   reading resolves in another order);
/// - a path that starts with two slashes (or a backslash in their place) as
///   WHATWG's URL parser reads it against a base, as Node's `new URL(path,
///   base)` does: `//x/login` is host `x` and path `/login`.
///
/// Readings that cannot be normalized are left out: the normalized one
/// stands.
pub(crate) fn raw_readings(raw: &str, options: Normalize) -> Vec<String> {
    let mut readings = Vec::new();
    let mut add = |path: &str, options: Normalize| {
        if let Ok(reading) = normalize_path(path, options)
            && let Ok(reading) = String::from_utf8(reading)
            && !readings.contains(&reading)
        {
            readings.push(reading);
        }
    };
    let unescape = unescaping(options);
    let encoded_slash = has_encoded_slash(raw.as_bytes());
    if encoded_slash && options.escaped_slashes == EscapedSlashes::Keep {
        add(raw, unescape);
    }
    // `\` is `/` to WHATWG's parser.
    let slashed = raw.replace('\\', "/");
    if let Some(rest) = slashed.strip_prefix("//") {
        let rest = rest.trim_start_matches('/');
        // The first segment is the authority; the path is what follows.
        let path = rest.find('/').map_or("/", |at| &rest[at..]);
        add(path, options);
        if encoded_slash && options.escaped_slashes == EscapedSlashes::Keep {
            add(path, unescape);
        }
    }
    readings
}

/// Whether a path holds `%2F` or `%5C` (either case of hex digit).
fn has_encoded_slash(path: &[u8]) -> bool {
    path.windows(3).any(|w| {
        w[0] == b'%' && (w[1..].eq_ignore_ascii_case(b"2F") || w[1..].eq_ignore_ascii_case(b"5C"))
    })
}

/// `options` reading `%2F` and `%5C` as `/` and `\`, with the path
/// normalized and slashes merged: how WSGI servers and Rack read a path.
fn unescaping(options: Normalize) -> Normalize {
    Normalize {
        path: true,
        merge_slashes: true,
        escaped_slashes: EscapedSlashes::Unescape,
        ..options
    }
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
    if let Some(host) = host
        && host_of_authority(host.as_bytes()).is_none()
    {
        return Err(bad("Invalid Host."));
    }
    match parts.uri.authority() {
        Some(authority) if authority.as_str().contains('@') => {
            Err(bad("Credentials in the request target are not accepted."))
        }
        Some(authority) if host_of_authority(authority.as_str().as_bytes()).is_none() => {
            Err(bad("Invalid host in the request target."))
        }
        Some(authority) => Ok(Some(authority.clone())),
        None if host.is_none() && parts.version == Version::HTTP_11 => {
            // RFC 9112 section 3.2: a server must refuse it.
            Err(bad("An HTTP/1.1 request needs a Host."))
        }
        None => Ok(None),
    }
}

/// Whether `path` is one that [`normalize_path`] leaves as it is under any
/// options: `/`-led segments of letters, digits, `-`, `_`, `~` and `.`,
/// none empty but the last, none `.` or `..`.
fn is_plain(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    let mut segments = rest.split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        if (segment.is_empty() && !last)
            || segment == "."
            || segment == ".."
            || !segment
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~' | b'.'))
        {
            return false;
        }
    }
    true
}

/// `path` normalized as `options` say. Works on bytes: a path may hold
/// bytes that are not ASCII, and they go on percent-encoded (a strict
/// upstream cannot parse them raw; `/caf\xc3\xa9` and `/caf%c3%a9` are one
/// path to every router that decodes, and now to the rules).
fn normalize_path(path: &str, options: Normalize) -> Result<Vec<u8>, ForwardError> {
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'\\' && options.path {
            // Not a URI character (RFC 3986), and a `/` to WHATWG's URL
            // parser (Node, Deno, Bun) and to some Windows stacks: read as
            // the separator they take it for, or refused with the
            // encoded slashes.
            if options.escaped_slashes == EscapedSlashes::Reject {
                return Err(bad("A backslash in the path is not accepted."));
            }
            decoded.push(b'/');
            i += 1;
            continue;
        }
        if b != b'%' {
            push_uri_byte(&mut decoded, b);
            i += 1;
            continue;
        }
        let hex = |j: usize| bytes.get(j).and_then(|&h| char::from(h).to_digit(16));
        let (Some(hi), Some(lo)) = (hex(i + 1), hex(i + 2)) else {
            return Err(bad("A % in the path is not followed by two hex digits."));
        };
        let c = u8::try_from(hi * 16 + lo).expect("two hex digits make a byte");
        if c.is_ascii_control() {
            // No route holds a control byte, and routers that decode one
            // read it differently: Starlette's `^/login$` matches
            // `/login\n` (Python's `$` matches before a final newline),
            // C routers stop at `%00`.
            return Err(bad(
                "An encoded control character in the path is not accepted.",
            ));
        }
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

/// Appends `b`, percent-encoded if it is not ASCII or is a control byte:
/// what the upstream receives must be a request target it can parse.
fn push_uri_byte(out: &mut Vec<u8>, b: u8) {
    if b.is_ascii_graphic() {
        out.push(b);
    } else {
        out.extend_from_slice(format!("%{b:02X}").as_bytes());
    }
}

/// The query as it came, but for bytes that are not ASCII (or controls),
/// percent-encoded as in the path.
fn encode_query(query: &str, out: &mut Vec<u8>) {
    for &b in query.as_bytes() {
        push_uri_byte(out, b);
    }
}

/// RFC 3986 section 5.2.4, on a path that starts with `/`. A segment is a
/// dot segment by its name, the part before any `;parameters`: Servlet
/// containers (Tomcat, Jetty) strip the parameters first, so `..;x` is
/// `..` to them, and `/x/..;/login` is their `/login`. Its parameters go
/// with it.
fn remove_dot_segments(path: &[u8]) -> Vec<u8> {
    let mut out: Vec<&[u8]> = Vec::new();
    let segments: Vec<&[u8]> = path.split(|&b| b == b'/').skip(1).collect();
    let last = segments.len().saturating_sub(1);
    for (i, &segment) in segments.iter().enumerate() {
        let name = segment.split(|&b| b == b';').next().unwrap_or(segment);
        match name {
            b"." | b".." => {
                if name == b".." {
                    out.pop();
                }
                // `/a/.` and `/a/b/..` end in a directory: `/a/`.
                if i == last {
                    out.push(b"");
                }
            }
            _ => out.push(segment),
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
            // Servlet containers strip `;parameters` before dot segments.
            "/x/..;/login",
            "/x/..;jsessionid=1/login",
            "/.;/login",
            "/%2e%2e;/login",
            "/x/y/..;a/..;b/login",
            // WHATWG's URL parser (Node) reads `\` as `/`.
            "/x/..\\login",
            "/x\\..\\login",
            "\\login",
            "/x/.\\..\\login",
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
    fn encoded_control_characters_are_refused() {
        for sent in [
            "/login%0a",
            "/login%0D%0A",
            "/login%00.json",
            "/a%09b",
            "/a%7Fb",
            "/%1b",
        ] {
            assert_eq!(
                path(sent),
                Err("An encoded control character in the path is not accepted."),
                "{sent}"
            );
        }
        assert_eq!(path("/a%20b").unwrap(), "/a%20b");
    }

    #[test]
    fn parameters_stay_on_segments_that_are_not_dot_segments() {
        assert_eq!(path("/login;jsessionid=1").unwrap(), "/login;jsessionid=1");
        assert_eq!(path("/a;x/b;y").unwrap(), "/a;x/b;y");
        assert_eq!(path("/a/..x;/b").unwrap(), "/a/..x;/b");
        assert_eq!(path("/a/b/..;x").unwrap(), "/a/");
    }

    #[test]
    fn backslashes_are_refused_with_the_encoded_slashes() {
        let reject = Normalize {
            escaped_slashes: EscapedSlashes::Reject,
            ..Normalize::default()
        };
        assert_eq!(
            path_with("/x/..\\login", reject),
            Err("A backslash in the path is not accepted.")
        );
    }

    #[test]
    fn bytes_that_are_not_ascii_are_percent_encoded() {
        let uri = Uri::try_from(&b"/caf\xc3\xa9/x?q=\xc3\xa9&a=1"[..]).expect("hyper takes it");
        let request = http::Request::get(uri)
            .header("host", "h")
            .body(())
            .unwrap();
        let parts = head(request).unwrap();
        assert_eq!(parts.uri, "/caf%C3%A9/x?q=%C3%A9&a=1");
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
    fn a_kept_encoded_slash_is_also_read_as_a_slash_for_the_rules() {
        for (sent, reading) in [
            ("/x%2F..%2Flogin", "/login"),
            ("/%2flogin", "/login"),
            ("/x%5C..%5Clogin", "/login"),
            ("/a%2Fb", "/a/b"),
        ] {
            let request = http::Request::post(sent)
                .header("host", "h")
                .body(())
                .unwrap();
            let parts = head(request).unwrap();
            assert_eq!(
                parts.uri.path(),
                path(sent).unwrap(),
                "forwarded as it came"
            );
            let other = parts
                .extensions
                .get::<OtherPaths>()
                .expect("another reading");
            assert_eq!(other.0, [reading], "{sent}");
        }
        let plain = http::Request::post("/login")
            .header("host", "h")
            .body(())
            .unwrap();
        assert!(
            head(plain)
                .unwrap()
                .extensions
                .get::<OtherPaths>()
                .is_none()
        );
    }

    /// What reaches the upstream as it came has the readings routers make
    /// of it besides the normalized one: `%2F` decoded first (Werkzeug,
    /// Rack), and a leading `//` as WHATWG's parser reads it (Node).
    #[test]
    fn a_raw_target_is_also_read_as_routers_read_it() {
        let readings = |raw| raw_readings(raw, Normalize::default());
        assert!(readings("/login").is_empty());
        assert_eq!(readings("//x/login"), ["/login"]);
        assert_eq!(readings("///x/login"), ["/login"]);
        assert_eq!(readings("/\\x/login"), ["/login"]);
        assert_eq!(readings("//x"), ["/"]);
        assert_eq!(readings("/x%2F..%2Flogin"), ["/login"]);
        // The normalized reading resolves `..` before `%5C`; decoded
        // first, it is the login.
        assert_eq!(
            path("/x/..\\/./x/x%5C../../login").as_deref(),
            Ok("/x/login")
        );
        assert_eq!(readings("/x/..\\/./x/x%5C../../login"), ["/login"]);
        // Refused or decoded slashes leave nothing else to read.
        let reject = Normalize {
            escaped_slashes: EscapedSlashes::Reject,
            ..Normalize::default()
        };
        assert!(raw_readings("/x%2F..%2Flogin", reject).is_empty());
    }

    #[test]
    fn each_step_can_be_switched_off() {
        let off = Normalize {
            path: false,
            merge_slashes: false,
            escaped_slashes: EscapedSlashes::Keep,
            underscores_in_headers: false,
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
        // Express (`trust proxy`) serves these as admin.example.com.
        assert!(head(with_host(b"admin.example.com,x")).is_err());
        assert!(head(with_host(b"admin.example.com:8o")).is_err());
        let absolute = http::Request::get("http://admin.example.com:8o/")
            .body(())
            .unwrap();
        assert!(head(absolute).is_err());
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

    proptest::proptest! {
        /// The shortcut in [`normalize`] skips `normalize_path` only where
        /// it would change nothing, under every option.
        #[test]
        fn a_plain_path_is_left_as_it_is_under_any_options(
            path in "(/[A-Za-z0-9._~%;\\\\-]{0,6}){1,5}/?",
            flags in 0u8..8,
            escaped in 0u8..3,
        ) {
            let options = Normalize {
                path: flags & 1 != 0,
                merge_slashes: flags & 2 != 0,
                underscores_in_headers: flags & 4 != 0,
                escaped_slashes: [EscapedSlashes::Keep, EscapedSlashes::Reject, EscapedSlashes::Unescape]
                    [usize::from(escaped)],
            };
            if is_plain(&path) {
                let normalized = normalize_path(&path, options).map_err(|e| e.to_string());
                proptest::prop_assert_eq!(normalized, Ok(path.clone().into_bytes()));
            }
        }
    }

    #[test]
    fn plain_paths_are_told_apart() {
        for plain in ["/", "/a", "/a/", "/a.b/c-d_e~f", "/.well-known/x", "/a..b"] {
            assert!(is_plain(plain), "{plain}");
        }
        for other in [
            "",
            "a",
            "//",
            "/a//b",
            "/.",
            "/..",
            "/a/./b",
            "/a/../b",
            "/a/.",
            "/a%2F",
            "/a;b",
            "/a\\b",
            "/caf\u{e9}",
        ] {
            assert!(!is_plain(other), "{other}");
        }
    }
}

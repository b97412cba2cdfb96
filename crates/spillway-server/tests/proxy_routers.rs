//! The routing differential harness (issue 25): `spillway proxy` in front
//! of real frameworks' routers, and a corpus of spellings of the limited
//! requests, to show that no spelling a router serves from a limited
//! handler gets past the rules.
//!
//! Each router of `routers/` runs as the upstream, with limited handlers
//! (`POST /login`, `GET /report`, `DELETE /account`, the host
//! `admin.example.com`) and an unlimited one for everything else; the proxy
//! has one rule for each (`key = ["ip"]`, 1 an hour), exhausted at the
//! start. Then, for every case of the corpus (mutations of the limited
//! requests over path, method, host and header spellings):
//!
//! 1. sent to the router directly, what it routes to a limited handler is
//!    counted, and for the classes the router is known to fold that count
//!    must not be zero (the harness cannot pass by testing nothing);
//! 2. sent through the proxy, **no case may reach a limited handler**:
//!    every request a router routes there must have been charged by its
//!    rule (and so answered 429) or refused by the proxy.
//!
//! The same corpus runs through nginx, Caddy, HAProxy and Traefik in front of the
//! forward-auth hook of `spillway serve` (their configurations in
//! `examples/forward-auth/`), with the same rules: there the proxy forwards
//! the client's bytes and the hook decides on its own reading of them, so
//! every reading a router may make must be counted. A proxy that is not
//! installed is skipped like a router (`SPILLWAY_REQUIRE_PROXIES=1`).
//!
//! Classes in `KNOWN_OPEN` are the ones still open on main: their cases
//! are checked and printed, not asserted. Remove a class from that list
//! when its fix lands, and the harness holds it from then on.
//!
//! Requests go as raw bytes over TCP (the corpus holds bytes a client
//! library would refuse to send), each on a connection of its own,
//! one at a time. Which handler served a case comes from the upstream's
//! log (the `X-Case` header); whether the proxy forwarded it at all, from
//! a relay between the proxy and the upstream.
//!
//! CI runs the hand-written shapes and 150 seeded combinations a router;
//! a long form by hand:
//!
//! ```sh
//! SPILLWAY_ROUTER_CASES=5000 cargo test -p spillway-server \
//!     --test proxy_routers -- --nocapture
//! ```
//!
//! `SPILLWAY_ROUTER_SEED` picks another seed. A router that is not
//! installed is skipped with a message, unless `SPILLWAY_REQUIRE_ROUTERS=1`
//! (which `.ci/run` sets after installing them).

mod front_support;
// The wire tests use the rest of it.
#[allow(dead_code)]
mod mangle;
mod routers;
mod serve_support;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use front_support::{Front, FrontProxy, binary_or_skip};
use mangle::Rng;
use routers::{Router, Upstream};
use serve_support::Service;
use spillway_server::config::Config;
use spillway_server::proxy::{ProxyOptions, serve_with};
use spillway_server::state::{Live, Loaded};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Classes of spellings that still reach a limited handler through the
/// proxy on main: checked and printed, not asserted. Add a class here only
/// with the router and an example that reaches it, and remove it when its
/// fix lands: the harness asserts it from then on. Empty since the proxy
/// refuses encoded control characters in paths; before that,
/// `encoded-newline` (`POST /login%0a`, which Starlette's `^/login$` took
/// for `/login\n`) was here, and before 52b1a78 `encoded-slash`,
/// `encoded-backslash` (`/x%2F..%2Flogin` on Sinatra and Flask) and
/// `method-override-body` (`_method=DELETE` in a form body on Express and
/// Sinatra).
const KNOWN_OPEN: &[&str] = &[];

/// The classes each router is known to fold into a limited handler when
/// sent to it directly: each must route at least one case there, or the
/// harness is testing nothing for that router.
fn expected_folds(router: Router) -> &'static [&'static str] {
    match router {
        Router::Tomcat => &[
            "dot-semicolon",
            "path-parameters",
            "dot-segments",
            "encoded-dots",
            "encoded-unreserved",
            "merged-slashes",
            "absolute-form",
            "host-case",
            "head-for-get",
        ],
        Router::Express => &[
            "method-override-header",
            "method-override-query",
            "method-override-body",
            "host-bad-port",
            "letter-case",
            "trailing-slash",
            "absolute-form",
            "head-for-get",
        ],
        Router::PlainNode => &[
            "backslash",
            "dot-segments",
            "encoded-dots",
            "host-case",
            "host-encoded",
            "host-delimiters",
            "host-userinfo",
            "head-for-get",
        ],
        Router::Flask => &[
            "encoded-unreserved",
            "encoded-slash",
            "merged-slashes",
            "lower-case-method",
            "host-case",
            "head-for-get",
        ],
        Router::Starlette => &[
            "encoded-unreserved",
            "encoded-newline",
            "host-case",
            "head-for-get",
        ],
        Router::Sinatra => &[
            "dot-segments",
            "encoded-dots",
            "encoded-slash",
            "encoded-backslash",
            "merged-slashes",
            "path-parameters",
            "method-override-header",
            "method-override-body",
            "underscore-header",
            "head-for-get",
        ],
        Router::Go => &[
            "encoded-unreserved",
            "host-bad-port",
            "host-port",
            "head-for-get",
        ],
    }
}

/// One rule for each limited handler, 1 an hour, keyed by the client's
/// address (the harness's, for every case).
const CONFIG: &str = r#"
[[rules]]
name = "login"
match = { methods = ["POST"], path = "/login" }
key = ["ip"]
algorithm = "fixed_window"
limit = 1
window = "1h"

[[rules]]
name = "report"
match = { methods = ["GET"], path = "/report" }
key = ["ip"]
algorithm = "fixed_window"
limit = 1
window = "1h"

[[rules]]
name = "account"
match = { methods = ["DELETE"], path = "/account" }
key = ["ip"]
algorithm = "fixed_window"
limit = 1
window = "1h"

[[rules]]
name = "admin"
match = { host = "admin.example.com" }
key = ["ip"]
algorithm = "fixed_window"
limit = 1
window = "1h"
"#;

/// The handlers the rules limit.
const LIMITED: &[&str] = &["login", "report", "account", "admin"];

/// The longest one case may take, answer included: a case that passes
/// takes milliseconds; one that hangs is counted as such, not waited for.
const CASE_WAIT: Duration = Duration::from_secs(5);

/// How many seeded combinations a router gets (CI's short form).
const SHORT_FORM: usize = 150;

// ---------------------------------------------------------------------------
// The corpus.

/// The limited request a case is a spelling of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Aim {
    Login,
    Report,
    Account,
    Admin,
}

/// A request, in pieces that the mutations change.
#[derive(Clone, Debug)]
struct Request {
    method: String,
    target: Vec<u8>,
    version: &'static str,
    /// The `Host` lines' values (none, one, or duplicates).
    hosts: Vec<Vec<u8>>,
    /// Other header lines, whole, without their CRLF.
    headers: Vec<String>,
    body: String,
}

impl Request {
    fn new(method: &str, target: &str, host: &str) -> Self {
        Self {
            method: method.into(),
            target: target.as_bytes().to_vec(),
            version: "HTTP/1.1",
            hosts: vec![host.as_bytes().to_vec()],
            headers: Vec::new(),
            body: String::new(),
        }
    }

    fn aimed(aim: Aim) -> Self {
        match aim {
            Aim::Login => Self::new("POST", "/login", "app.example.com"),
            Aim::Report => Self::new("GET", "/report", "app.example.com"),
            Aim::Account => Self::new("DELETE", "/account", "app.example.com"),
            Aim::Admin => Self::new("GET", "/panel", "admin.example.com"),
        }
    }

    fn target(mut self, target: impl Into<Vec<u8>>) -> Self {
        self.target = target.into();
        self
    }

    fn method(mut self, method: &str) -> Self {
        self.method = method.into();
        self
    }

    fn hosts(mut self, hosts: &[&[u8]]) -> Self {
        self.hosts = hosts.iter().map(|h| h.to_vec()).collect();
        self
    }

    fn header(mut self, line: &str) -> Self {
        self.headers.push(line.into());
        self
    }

    fn form(self, body: &str) -> Self {
        self.typed("application/x-www-form-urlencoded", body)
    }

    /// A body of `content_type` (none if empty).
    fn typed(mut self, content_type: &str, body: &str) -> Self {
        if !content_type.is_empty() {
            self.headers.push(format!("Content-Type: {content_type}"));
        }
        self.body = body.into();
        self
    }

    /// The bytes sent, with the case's id in `X-Case` and a framing that
    /// every router reads alike: a length when there is a body or the
    /// method usually has one, and `Connection: close`.
    fn bytes(&self, id: &str) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(self.method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(&self.target);
        out.push(b' ');
        out.extend_from_slice(self.version.as_bytes());
        out.extend_from_slice(b"\r\n");
        for host in &self.hosts {
            out.extend_from_slice(b"Host: ");
            out.extend_from_slice(host);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("X-Case: {id}\r\n").as_bytes());
        for line in &self.headers {
            out.extend_from_slice(line.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        let upper = self.method.to_ascii_uppercase();
        if !self.body.is_empty() || ["POST", "PUT", "PATCH", "DELETE"].contains(&upper.as_str()) {
            out.extend_from_slice(format!("Content-Length: {}\r\n", self.body.len()).as_bytes());
        }
        out.extend_from_slice(b"Connection: close\r\n\r\n");
        out.extend_from_slice(self.body.as_bytes());
        out
    }
}

/// One case: the request and the classes of spelling it mixes.
#[derive(Clone, Debug)]
struct Case {
    classes: Vec<&'static str>,
    request: Request,
    /// Hand-written, or one of the seeded combinations.
    written: bool,
}

fn case(class: &'static str, request: Request) -> Case {
    Case {
        classes: vec![class],
        request,
        written: true,
    }
}

/// `%6c` or `%6C`.
fn pct(byte: u8, upper: bool) -> String {
    if upper {
        format!("%{byte:02X}")
    } else {
        format!("%{byte:02x}")
    }
}

/// The two-byte overlong UTF-8 form of an ASCII byte, percent-encoded
/// (`.` is `%c0%ae`, `/` is `%c0%af`).
fn overlong(byte: u8) -> String {
    format!("%{:02x}%{:02x}", 0xc0 | (byte >> 6), 0x80 | (byte & 0x3f))
}

/// The hand-written spellings of the path `/{name}`, by class.
fn path_shapes(name: &str) -> Vec<(&'static str, Vec<u8>)> {
    let n = name;
    let (first, rest) = (n.as_bytes()[0], &n[1..]);
    let (mid, before, after) = (n.as_bytes()[2], &n[..2], &n[3..]);
    let all_encoded: String = n.bytes().map(|b| pct(b, false)).collect();
    let upper = n.to_ascii_uppercase();
    let capital = format!("{}{rest}", (first as char).to_ascii_uppercase());
    let alternating: String = n
        .chars()
        .enumerate()
        .map(|(i, c)| {
            if i % 2 == 1 {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect();
    let p1 = pct(first, false);
    let p1u = pct(first, true);
    let pm = pct(mid, true);
    let o1 = overlong(first);
    let shapes: Vec<(&'static str, String)> = vec![
        ("merged-slashes", format!("//{n}")),
        ("merged-slashes", format!("///{n}")),
        ("merged-slashes", format!("/x//../{n}")),
        // The WHATWG parser reads `//x/login` as host x, path /login.
        ("merged-slashes", format!("//x/{n}")),
        ("merged-slashes", format!("///x/{n}")),
        ("dot-segments", format!("/./{n}")),
        ("dot-segments", format!("/x/../{n}")),
        ("dot-segments", format!("/x/y/../../{n}")),
        ("dot-segments", format!("/../{n}")),
        ("dot-segments", format!("/{n}/x/..")),
        ("dot-segments", format!("/./././{n}")),
        ("dot-segments", format!("/x/./../{n}")),
        ("encoded-dots", format!("/%2e/{n}")),
        ("encoded-dots", format!("/x/%2e%2e/{n}")),
        ("encoded-dots", format!("/x/.%2e/{n}")),
        ("encoded-dots", format!("/x/%2E%2E/{n}")),
        ("encoded-dots", format!("/x/%2e./{n}")),
        ("encoded-dots", format!("/{n}/x/%2e%2e")),
        ("dot-semicolon", format!("/x/..;/{n}")),
        ("dot-semicolon", format!("/.;/{n}")),
        ("dot-semicolon", format!("/x/..;a=b/{n}")),
        ("dot-semicolon", format!("/..;/{n}")),
        ("dot-semicolon", format!("/x/y/..;/..;/{n}")),
        ("dot-semicolon", format!("/{n}/x/..;")),
        ("path-parameters", format!("/;x/{n}")),
        ("path-parameters", format!("/{n};x")),
        ("path-parameters", format!("/{n};jsessionid=1")),
        ("path-parameters", format!("/;/{n}")),
        ("path-parameters", format!("/x;a/../{n}")),
        ("path-parameters", format!("/;x=y/;z/{n}")),
        ("encoded-semicolon", format!("/{n}%3bx")),
        ("encoded-semicolon", format!("/x/..%3B/{n}")),
        ("encoded-semicolon", format!("/%3Bx/{n}")),
        ("encoded-semicolon", format!("/{n}%3B")),
        ("backslash", format!("/x/..\\{n}")),
        ("backslash", format!("/x\\..\\{n}")),
        ("backslash", format!("/\\{n}")),
        ("backslash", format!("/x\\../{n}")),
        ("backslash", format!("/{n}\\")),
        ("backslash", format!("/\\x/{n}")),
        ("backslash", format!("\\\\x/{n}")),
        ("encoded-slash", format!("/x%2F..%2F{n}")),
        ("encoded-slash", format!("/x/..%2F{n}")),
        ("encoded-slash", format!("/%2F{n}")),
        ("encoded-slash", format!("/x%2f..%2f{n}")),
        ("encoded-slash", format!("/{n}%2F")),
        ("encoded-backslash", format!("/x%5C..%5C{n}")),
        ("encoded-backslash", format!("/x/..%5C{n}")),
        ("encoded-backslash", format!("/%5C{n}")),
        ("encoded-backslash", format!("/x%5c..%5c{n}")),
        ("encoded-unreserved", format!("/{p1}{rest}")),
        ("encoded-unreserved", format!("/{p1u}{rest}")),
        ("encoded-unreserved", format!("/{before}{pm}{after}")),
        ("encoded-unreserved", format!("/{all_encoded}")),
        ("encoded-unreserved", format!("%2F{n}")),
        ("double-encoding", format!("/%25{:02x}{rest}", first)),
        ("double-encoding", format!("/x/%252e%252e/{n}")),
        ("double-encoding", format!("/x%252F..%252F{n}")),
        ("double-encoding", format!("/%25%36%63{rest}")),
        ("overlong-utf8", format!("/x/%c0%ae%c0%ae/{n}")),
        ("overlong-utf8", format!("/x%c0%af..%c0%af{n}")),
        ("overlong-utf8", format!("/{o1}{rest}")),
        ("overlong-utf8", format!("/x/%e0%80%ae%e0%80%ae/{n}")),
        ("non-ascii", format!("/{}{rest}", fullwidth(first))),
        (
            "non-ascii",
            format!("/{}{rest}", encoded_utf8(fullwidth(first))),
        ),
        ("non-ascii", format!("/{n}\u{3002}")),
        ("trailing-slash", format!("/{n}/")),
        ("trailing-slash", format!("/{n}//")),
        ("trailing-dot", format!("/{n}.")),
        ("trailing-dot", format!("/{n}..")),
        ("trailing-dot", format!("/{n}/.")),
        ("trailing-dot", format!("/{n}%2e")),
        ("trailing-semicolon", format!("/{n};")),
        ("trailing-semicolon", format!("/{n}/;")),
        ("trailing-encoded", format!("/{n}%20")),
        ("trailing-encoded", format!("/{n}%00")),
        ("trailing-encoded", format!("/{n}%09")),
        ("trailing-encoded", format!("/{n}%0D")),
        // Python's `$` matches before a final newline: Starlette's route
        // regex `^/login$` matches `/login\n`, which uvicorn decodes from
        // `/login%0a`.
        ("encoded-newline", format!("/{n}%0a")),
        ("encoded-newline", format!("/{n}%0A")),
        ("encoded-newline", format!("/{n}%0d%0a")),
        ("encoded-newline", format!("/{n}%0a?x=1")),
        ("trailing-encoded", format!("/{n}%0b")),
        ("trailing-encoded", format!("/{n}%a0")),
        ("query-and-fragment", format!("/{n}?")),
        ("query-and-fragment", format!("/{n}?a=b")),
        ("query-and-fragment", format!("/{n}?/../x")),
        ("query-and-fragment", format!("/{n}#x")),
        ("query-and-fragment", format!("/{n}%3Fx")),
        ("query-and-fragment", format!("/{n}%23x")),
        ("letter-case", format!("/{upper}")),
        ("letter-case", format!("/{capital}")),
        ("letter-case", format!("/{alternating}")),
        ("letter-case", format!("/{}", n.replace('i', "\u{130}"))),
        ("absolute-form", format!("http://app.example.com/{n}")),
        ("absolute-form", format!("HTTP://APP.EXAMPLE.COM/{n}")),
        ("absolute-form", format!("http://app.example.com:80/{n}")),
        ("absolute-form", format!("http://app.example.com//{n}")),
        ("absolute-form", format!("http://x@app.example.com/{n}")),
        ("absolute-form", format!("http://app.example.com/x/../{n}")),
        ("absolute-form", format!("https://app.example.com/{n}")),
    ];
    let plain = format!("/{n}");
    let mut out: Vec<(&'static str, Vec<u8>)> = shapes
        .into_iter()
        // A spelling that does not apply to this name (no `i` to change).
        .filter(|(_, target)| *target != plain)
        .map(|(class, target)| (class, target.into_bytes()))
        .collect();
    // Raw bytes no client library would send: an overlong dot, a raw NUL
    // and a raw tab ending the path.
    out.push((
        "raw-bytes",
        [b"/x/\xc0\xae\xc0\xae/".as_slice(), n.as_bytes()].concat(),
    ));
    out.push((
        "raw-bytes",
        [b"/".as_slice(), n.as_bytes(), b"\x00"].concat(),
    ));
    out.push(("raw-bytes", [b"/".as_slice(), n.as_bytes(), b"\t"].concat()));
    out.push((
        "raw-bytes",
        [b"/".as_slice(), n.as_bytes(), b"\xff"].concat(),
    ));
    // The WHATWG parser drops tabs and line feeds anywhere in a URL.
    out.push((
        "raw-bytes",
        [
            b"/".as_slice(),
            &n.as_bytes()[..1],
            b"\t",
            &n.as_bytes()[1..],
        ]
        .concat(),
    ));
    out.push(("raw-bytes", [b"/x/.\t./".as_slice(), n.as_bytes()].concat()));
    out
}

/// A character's UTF-8 bytes, percent-encoded.
fn encoded_utf8(c: char) -> String {
    c.to_string().bytes().map(|b| pct(b, false)).collect()
}

/// The full-width form of an ASCII letter (`ｌ` for `l`), which NFKC
/// normalization folds to the letter.
fn fullwidth(letter: u8) -> char {
    char::from_u32(0xff00 + u32::from(letter) - 0x20).expect("a full-width form")
}

/// The hand-written spellings of the host `admin.example.com`, by class.
fn host_shapes() -> Vec<(&'static str, Vec<Vec<u8>>)> {
    let one = |h: &str| vec![h.as_bytes().to_vec()];
    let mut shapes: Vec<(&'static str, Vec<Vec<u8>>)> = [
        ("host-case", "ADMIN.EXAMPLE.COM"),
        ("host-case", "Admin.Example.Com"),
        ("host-trailing-dot", "admin.example.com."),
        ("host-trailing-dot", "admin.example.com.:80"),
        ("host-trailing-dot", "admin.example.com.."),
        ("host-port", "admin.example.com:80"),
        ("host-port", "admin.example.com:8080"),
        ("host-port", "admin.example.com:"),
        ("host-port", "admin.example.com:0080"),
        ("host-bad-port", "admin.example.com:8o"),
        ("host-bad-port", "admin.example.com:x"),
        ("host-bad-port", "admin.example.com:80:80"),
        ("host-bad-port", "admin.example.com:99999"),
        ("host-bad-port", "admin.example.com:-1"),
        ("host-bad-port", "admin.example.com: 80"),
        ("host-comma", "admin.example.com,x"),
        ("host-comma", "admin.example.com, app.example.com"),
        ("host-comma", "app.example.com,admin.example.com"),
        ("host-comma", "admin.example.com,"),
        ("host-whitespace", "admin.example.com\t"),
        ("host-whitespace", "\tadmin.example.com"),
        ("host-whitespace", "admin.example.com x"),
        ("host-whitespace", "admin .example.com"),
        ("host-encoded", "%61dmin.example.com"),
        ("host-encoded", "admin%2eexample.com"),
        ("host-encoded", "admin.example.com%2e"),
        ("host-userinfo", "x@admin.example.com"),
        ("host-userinfo", "app.example.com@admin.example.com"),
        ("host-delimiters", "admin.example.com/x"),
        ("host-delimiters", "admin.example.com?x"),
        ("host-delimiters", "admin.example.com#x"),
        ("host-delimiters", "admin.example.com\\x"),
        ("host-delimiters", "admin.example.com;x"),
        ("host-non-ascii", "admin.example.com\u{3002}"),
        ("host-non-ascii", "\u{ff41}dmin.example.com"),
        ("host-non-ascii", "admin\u{ff0e}example.com"),
    ]
    .into_iter()
    .map(|(class, host)| (class, one(host)))
    .collect();
    shapes.push((
        "host-duplicate",
        vec![b"admin.example.com".to_vec(), b"app.example.com".to_vec()],
    ));
    shapes.push((
        "host-duplicate",
        vec![b"app.example.com".to_vec(), b"admin.example.com".to_vec()],
    ));
    shapes.push((
        "host-duplicate",
        vec![b"admin.example.com".to_vec(), b"admin.example.com".to_vec()],
    ));
    shapes.push(("host-missing", vec![]));
    shapes
}

/// The hand-written corpus: every path shape on each path-limited
/// request, every host shape on the limited host, and the method, header
/// and absolute-form shapes.
fn written() -> Vec<Case> {
    let mut cases = Vec::new();
    for (aim, name) in [
        (Aim::Login, "login"),
        (Aim::Report, "report"),
        (Aim::Account, "account"),
    ] {
        for (class, target) in path_shapes(name) {
            cases.push(case(class, Request::aimed(aim).target(target)));
        }
    }
    for (class, hosts) in host_shapes() {
        let hosts: Vec<&[u8]> = hosts.iter().map(Vec::as_slice).collect();
        cases.push(case(class, Request::aimed(Aim::Admin).hosts(&hosts)));
    }
    let app = Request::aimed(Aim::Admin).hosts(&[b"app.example.com"]);
    for line in [
        "X-Forwarded-Host: admin.example.com",
        "X-Forwarded-Host: app.example.com, admin.example.com",
        "Forwarded: host=admin.example.com",
        "Forwarded: for=1.2.3.4;host=admin.example.com;proto=http",
        "X-Host: admin.example.com",
        "X-Forwarded-Server: admin.example.com",
        "X-Original-Host: admin.example.com",
    ] {
        cases.push(case("forwarded-host", app.clone().header(line)));
    }
    cases.push(case(
        "underscore-header",
        app.clone().header("X_Forwarded_Host: admin.example.com"),
    ));
    for target in [
        "http://admin.example.com/panel",
        "http://ADMIN.example.com/panel",
        "http://admin.example.com.:80/panel",
        "http://admin.example.com:8o/panel",
        "http://admin.example.com,x/panel",
        "http://x@admin.example.com/panel",
    ] {
        cases.push(case("absolute-form-host", app.clone().target(target)));
    }
    for (method, aim) in [
        ("post", Aim::Login),
        ("Post", Aim::Login),
        ("pOST", Aim::Login),
        ("get", Aim::Report),
        ("Get", Aim::Report),
        ("head", Aim::Report),
        ("delete", Aim::Account),
        ("Delete", Aim::Account),
    ] {
        cases.push(case(
            "lower-case-method",
            Request::aimed(aim).method(method),
        ));
    }
    cases.push(case(
        "head-for-get",
        Request::aimed(Aim::Report).method("HEAD"),
    ));
    cases.push(case(
        "head-for-get",
        Request::aimed(Aim::Report)
            .method("HEAD")
            .target("/report/"),
    ));
    let posted = |aim| Request::aimed(aim).method("POST");
    for (class, header) in [
        ("method-override-header", "X-HTTP-Method-Override"),
        ("method-override-header", "X-Method-Override"),
        ("method-override-header", "X-HTTP-Method"),
        ("method-override-header", "x-http-method-override"),
        // CGI, WSGI and Rack fold `_` and `-` in header names together.
        ("underscore-header", "X_HTTP_Method_Override"),
        ("underscore-header", "X_Method_Override"),
        ("underscore-header", "X-HTTP_Method"),
    ] {
        for (aim, method) in [(Aim::Account, "DELETE"), (Aim::Report, "GET")] {
            cases.push(case(
                class,
                posted(aim).header(&format!("{header}: {method}")),
            ));
        }
    }
    cases.push(case(
        "method-override-header",
        posted(Aim::Account).header("X-HTTP-Method-Override: delete"),
    ));
    cases.push(case(
        "method-override-header",
        Request::aimed(Aim::Login)
            .method("GET")
            .header("X-HTTP-Method-Override: POST"),
    ));
    cases.push(case(
        "method-override-header",
        Request::aimed(Aim::Account)
            .method("PUT")
            .header("X-HTTP-Method-Override: DELETE"),
    ));
    for (aim, target) in [
        (Aim::Account, "/account?_method=DELETE"),
        (Aim::Account, "/account?_method=delete"),
        (Aim::Account, "/account?x=1&_method=DELETE"),
        (Aim::Report, "/report?_method=GET"),
    ] {
        cases.push(case("method-override-query", posted(aim).target(target)));
    }
    cases.push(case(
        "method-override-query",
        Request::aimed(Aim::Login)
            .method("GET")
            .target("/login?_method=POST"),
    ));
    for (aim, body) in [
        (Aim::Account, "_method=DELETE"),
        (Aim::Account, "_method=delete"),
        (Aim::Account, "a=b&_method=DELETE"),
        (Aim::Report, "_method=GET"),
    ] {
        cases.push(case("method-override-body", posted(aim).form(body)));
    }
    // Found by a review: Rack reads a body of no type as a form, and cuts
    // the media type at `,` too; method-override takes a list's first
    // element; an override to HEAD reaches the GET handler.
    for (aim, content_type, body) in [
        (Aim::Account, "", "_method=DELETE"),
        (
            Aim::Account,
            "application/x-www-form-urlencoded, text/plain",
            "_method=DELETE",
        ),
        (Aim::Report, "", "_method=HEAD"),
    ] {
        cases.push(case(
            "method-override-body",
            posted(aim).typed(content_type, body),
        ));
    }
    for (aim, value) in [
        (Aim::Account, "DELETE, GET"),
        (Aim::Account, "delete,"),
        (Aim::Report, "HEAD"),
    ] {
        cases.push(case(
            "method-override-header",
            posted(aim).header(&format!("X-HTTP-Method-Override: {value}")),
        ));
    }
    cases.push(case(
        "method-override-query",
        posted(Aim::Report).target("/report?_method=HEAD"),
    ));
    for (method, path, line) in [
        ("POST", "/other", "X-Original-URL: /login"),
        ("POST", "/other", "X-Rewrite-URL: /login"),
        ("GET", "/other", "X-Original-URL: /report"),
        ("GET", "/other", "X-Rewrite-URL: /report"),
        ("DELETE", "/other", "X-Original-URL: /account"),
        ("POST", "/", "X-Original-URL: /login"),
    ] {
        cases.push(case(
            "routing-header",
            Request::new(method, path, "app.example.com").header(line),
        ));
    }
    for aim in [Aim::Login, Aim::Report, Aim::Account, Aim::Admin] {
        let mut request = Request::aimed(aim);
        request.version = "HTTP/1.0";
        cases.push(case("http-1.0", request));
    }
    cases
}

/// A mutation the seeded combinations draw from: its class, and what it
/// does to a request aimed at a limited handler (false if it does not
/// apply to that aim).
type Mutation = (&'static str, fn(&mut Request, Aim, &mut Rng) -> bool);

fn pick<'a, T>(rng: &mut Rng, items: &'a [T]) -> &'a T {
    &items[rng.below(items.len())]
}

/// The target as text, split into an authority prefix (absolute form)
/// and its path, and put back.
fn with_path(request: &mut Request, change: impl FnOnce(&mut String)) {
    let target = String::from_utf8_lossy(&request.target).into_owned();
    let (prefix, mut path) = match target.find("://") {
        Some(at) => {
            let start = target[at + 3..]
                .find('/')
                .map_or(target.len(), |i| at + 3 + i);
            (target[..start].to_owned(), target[start..].to_owned())
        }
        None => (String::new(), target),
    };
    change(&mut path);
    request.target = format!("{prefix}{path}").into_bytes();
}

/// The offsets of the `/` in a path (its start, if it has none left).
fn slashes(path: &str) -> Vec<usize> {
    let found: Vec<usize> = path.match_indices('/').map(|(i, _)| i).collect();
    if found.is_empty() { vec![0] } else { found }
}

/// The offsets of the ASCII letters in a path.
fn letters(path: &str) -> Vec<usize> {
    path.char_indices()
        .filter(|(_, c)| c.is_ascii_alphabetic())
        .map(|(i, _)| i)
        .collect()
}

fn paths(aim: Aim) -> bool {
    aim != Aim::Admin
}

const MUTATIONS: &[Mutation] = &[
    ("merged-slashes", |r, aim, rng| {
        paths(aim) && {
            with_path(r, |p| {
                let at = *pick(rng, &slashes(p));
                p.insert(at, '/');
            });
            true
        }
    }),
    ("dot-segments", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &["/.", "/x/..", "/x/y/../..", "/./x/.."]);
            with_path(r, |p| {
                let at = *pick(rng, &slashes(p));
                p.insert_str(at, piece);
            });
            true
        }
    }),
    ("encoded-dots", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &["/%2e", "/x/%2e%2e", "/x/.%2E", "/x/%2E.", "/%2E"]);
            with_path(r, |p| {
                let at = *pick(rng, &slashes(p));
                p.insert_str(at, piece);
            });
            true
        }
    }),
    ("dot-semicolon", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &["/x/..;", "/.;", "/x/..;a=b", "/x/..;/y/.."]);
            with_path(r, |p| {
                let at = *pick(rng, &slashes(p));
                p.insert_str(at, piece);
            });
            true
        }
    }),
    ("path-parameters", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &[";x", ";jsessionid=1", ";", ";a=b,c"]);
            with_path(r, |p| {
                let mut ends: Vec<usize> = slashes(p).into_iter().skip(1).collect();
                ends.push(p.find('?').unwrap_or(p.len()));
                let at = *pick(rng, &ends);
                p.insert_str(at, piece);
            });
            true
        }
    }),
    ("encoded-semicolon", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &["%3bx", "%3B", "/..%3B", "%3Bx=y"]);
            with_path(r, |p| {
                let at = *pick(rng, &slashes(p));
                p.insert_str(at, piece);
            });
            true
        }
    }),
    ("backslash", |r, aim, rng| {
        paths(aim) && {
            with_path(r, |p| {
                if rng.below(2) == 0 {
                    let at = *pick(rng, &slashes(p));
                    if p.as_bytes().get(at) == Some(&b'/') {
                        p.replace_range(at..=at, "\\");
                    }
                } else {
                    let at = *pick(rng, &slashes(p));
                    p.insert_str(at, pick::<&str>(rng, &["/x\\..", "\\x/..", "/x/..\\"]));
                }
            });
            true
        }
    }),
    ("encoded-slash", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &["/x%2F..", "%2F", "/x%2f..", "/x/..%2F"]);
            with_path(r, |p| {
                let at = *pick(rng, &slashes(p));
                p.insert_str(at, piece);
            });
            true
        }
    }),
    ("encoded-backslash", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &["/x%5C..", "%5C", "/x%5c..", "/x/..%5C"]);
            with_path(r, |p| {
                let at = *pick(rng, &slashes(p));
                p.insert_str(at, piece);
            });
            true
        }
    }),
    ("encoded-unreserved", |r, aim, rng| {
        paths(aim) && {
            with_path(r, |p| {
                let found = letters(p);
                if found.is_empty() {
                    return;
                }
                let at = *pick(rng, &found);
                let encoded = pct(p.as_bytes()[at], rng.below(2) == 0);
                p.replace_range(at..=at, &encoded);
            });
            true
        }
    }),
    ("double-encoding", |r, aim, rng| {
        paths(aim) && {
            with_path(r, |p| {
                let found = letters(p);
                if found.is_empty() {
                    return;
                }
                let at = *pick(rng, &found);
                let encoded = format!("%25{}", &pct(p.as_bytes()[at], rng.below(2) == 0)[1..]);
                p.replace_range(at..=at, &encoded);
            });
            true
        }
    }),
    ("overlong-utf8", |r, aim, rng| {
        paths(aim) && {
            with_path(r, |p| {
                if rng.below(2) == 0 {
                    let found = letters(p);
                    if found.is_empty() {
                        return;
                    }
                    let at = *pick(rng, &found);
                    let encoded = overlong(p.as_bytes()[at]);
                    p.replace_range(at..=at, &encoded);
                } else {
                    let at = *pick(rng, &slashes(p));
                    p.insert_str(
                        at,
                        pick::<&str>(rng, &["/x/%c0%ae%c0%ae", "/x%c0%af..", "/%c0%ae"]),
                    );
                }
            });
            true
        }
    }),
    ("trailing", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(
                rng,
                &[
                    "/", ".", ";", "%20", "%00", "%09", "/.", "?", "#", "//", "%2e", "..",
                ],
            );
            with_path(r, |p| {
                let end = p.find('?').unwrap_or(p.len());
                p.insert_str(end, piece);
            });
            true
        }
    }),
    ("encoded-newline", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &["%0a", "%0A", "%0d%0a"]);
            with_path(r, |p| {
                let end = p.find('?').unwrap_or(p.len());
                p.insert_str(end, piece);
            });
            true
        }
    }),
    ("letter-case", |r, aim, rng| {
        paths(aim) && {
            with_path(r, |p| {
                let found = letters(p);
                for _ in 0..1 + rng.below(3) {
                    if let Some(&at) = found.get(rng.below(found.len().max(1))) {
                        let upper = p.as_bytes()[at].to_ascii_uppercase() as char;
                        p.replace_range(at..=at, &upper.to_string());
                    }
                }
            });
            true
        }
    }),
    ("absolute-form", |r, aim, rng| {
        if r.target.starts_with(b"http") || !r.target.starts_with(b"/") {
            return false;
        }
        let authority = if aim == Aim::Admin {
            *pick(
                rng,
                &[
                    "admin.example.com",
                    "ADMIN.example.com",
                    "admin.example.com:80",
                ],
            )
        } else {
            *pick(
                rng,
                &["app.example.com", "APP.example.com", "app.example.com:80"],
            )
        };
        let scheme = *pick(rng, &["http", "HTTP", "hTTp"]);
        let mut target = format!("{scheme}://{authority}").into_bytes();
        target.extend_from_slice(&r.target);
        r.target = target;
        if aim == Aim::Admin {
            r.hosts = vec![b"app.example.com".to_vec()];
        }
        true
    }),
    ("query-and-fragment", |r, aim, rng| {
        paths(aim) && {
            let piece = *pick(rng, &["?a=b", "?", "#x", "?/../x", "?x#y"]);
            let mut target = r.target.clone();
            target.extend_from_slice(piece.as_bytes());
            r.target = target;
            true
        }
    }),
    ("lower-case-method", |r, _, rng| {
        let lower = r.method.to_ascii_lowercase();
        r.method = match rng.below(3) {
            0 => lower,
            1 => {
                let mut m = lower;
                m[..1].make_ascii_uppercase();
                m
            }
            _ => {
                let mut m = r.method.clone();
                m[..1].make_ascii_lowercase();
                m
            }
        };
        true
    }),
    ("head-for-get", |r, aim, _| {
        aim == Aim::Report && r.method == "GET" && {
            r.method = "HEAD".into();
            true
        }
    }),
    ("method-override-header", |r, aim, rng| {
        let method = match aim {
            Aim::Account => "DELETE",
            Aim::Report => "GET",
            _ => return false,
        };
        if r.method != method {
            return false;
        }
        r.method = "POST".into();
        let header = *pick(
            rng,
            &[
                "X-HTTP-Method-Override",
                "X-Method-Override",
                "X-HTTP-Method",
            ],
        );
        let value = if rng.below(4) == 0 {
            method.to_ascii_lowercase()
        } else {
            method.to_owned()
        };
        r.headers.push(format!("{header}: {value}"));
        true
    }),
    ("method-override-query", |r, aim, _| {
        let method = match aim {
            Aim::Account => "DELETE",
            Aim::Report => "GET",
            _ => return false,
        };
        if r.method != method || r.target.contains(&b'?') || r.target.contains(&b'#') {
            return false;
        }
        r.method = "POST".into();
        r.target
            .extend_from_slice(format!("?_method={method}").as_bytes());
        true
    }),
    ("method-override-body", |r, aim, _| {
        let method = match aim {
            Aim::Account => "DELETE",
            Aim::Report => "GET",
            _ => return false,
        };
        if r.method != method || !r.body.is_empty() {
            return false;
        }
        r.method = "POST".into();
        r.headers
            .push("Content-Type: application/x-www-form-urlencoded".into());
        r.body = format!("_method={method}");
        true
    }),
    ("http-1.0", |r, _, _| {
        r.version = "HTTP/1.0";
        true
    }),
    ("host-case", |r, aim, rng| {
        host(r, aim, |h| {
            let found = letters(h);
            for _ in 0..1 + rng.below(4) {
                let at = *pick(rng, &found);
                let upper = h.as_bytes()[at].to_ascii_uppercase() as char;
                h.replace_range(at..=at, &upper.to_string());
            }
        })
    }),
    ("host-trailing-dot", |r, aim, rng| {
        host(r, aim, |h| {
            let end = h.find(':').unwrap_or(h.len());
            h.insert_str(end, pick::<&str>(rng, &[".", ".."]));
        })
    }),
    ("host-port", |r, aim, rng| {
        host(r, aim, |h| {
            h.push_str(pick::<&str>(rng, &[":80", ":8080", ":", ":0080", ":443"]));
        })
    }),
    ("host-bad-port", |r, aim, rng| {
        host(r, aim, |h| {
            h.push_str(pick::<&str>(
                rng,
                &[":8o", ":x", ":80:80", ":99999", ":-1", ":80x", ": 80"],
            ));
        })
    }),
    ("host-comma", |r, aim, rng| {
        host(r, aim, |h| {
            *h = match rng.below(3) {
                0 => format!("{h},x"),
                1 => format!("{h}, app.example.com"),
                _ => format!("app.example.com,{h}"),
            };
        })
    }),
    ("host-whitespace", |r, aim, rng| {
        host(r, aim, |h| {
            *h = match rng.below(3) {
                0 => format!("{h}\t"),
                1 => format!("\t{h}"),
                _ => format!("{h} x"),
            };
        })
    }),
    ("host-encoded", |r, aim, rng| {
        host(r, aim, |h| {
            let found = letters(h);
            let at = *pick(rng, &found);
            let encoded = pct(h.as_bytes()[at], rng.below(2) == 0);
            h.replace_range(at..=at, &encoded);
        })
    }),
    ("host-duplicate", |r, aim, rng| {
        aim == Aim::Admin && !r.hosts.is_empty() && {
            let extra = pick(rng, &[&b"app.example.com"[..], b"admin.example.com"]).to_vec();
            if rng.below(2) == 0 {
                r.hosts.push(extra);
            } else {
                r.hosts.insert(0, extra);
            }
            true
        }
    }),
];

/// Applies `change` to the (first) `Host` of a request aimed at the
/// limited host.
fn host(request: &mut Request, aim: Aim, change: impl FnOnce(&mut String)) -> bool {
    if aim != Aim::Admin || request.hosts.is_empty() {
        return false;
    }
    let mut text = String::from_utf8_lossy(&request.hosts[0]).into_owned();
    change(&mut text);
    request.hosts[0] = text.into_bytes();
    true
}

/// `count` seeded combinations of one to three mutations.
fn combined(count: usize, seed: u64) -> Vec<Case> {
    let mut rng = Rng(seed);
    let aims = [Aim::Login, Aim::Report, Aim::Account, Aim::Admin];
    let mut cases = Vec::with_capacity(count);
    while cases.len() < count {
        let aim = *pick(&mut rng, &aims);
        let mut request = Request::aimed(aim);
        let mut classes = Vec::new();
        for _ in 0..1 + rng.below(3) {
            let (class, mutate) = *pick(&mut rng, MUTATIONS);
            if mutate(&mut request, aim, &mut rng) && !classes.contains(&class) {
                classes.push(class);
            }
        }
        if !classes.is_empty() {
            cases.push(Case {
                classes,
                request,
                written: false,
            });
        }
    }
    cases
}

fn corpus() -> Vec<Case> {
    let count = std::env::var("SPILLWAY_ROUTER_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(SHORT_FORM);
    let seed = std::env::var("SPILLWAY_ROUTER_SEED")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0x5ca1_ab1e_0025_0025);
    let mut cases = written();
    cases.extend(combined(count, seed));
    cases
}

// ---------------------------------------------------------------------------
// Sending.

/// What a client read for one request: the status, or `None` for no
/// answer (the connection closed first, or `CASE_WAIT` passed).
async fn send(addr: SocketAddr, bytes: &[u8], head: bool) -> Option<u16> {
    let Ok(Ok(mut stream)) = tokio::time::timeout(CASE_WAIT, connect_as_client(addr)).await else {
        return None;
    };
    // The server may refuse and close before reading it all.
    let _ = stream.write_all(bytes).await;
    let read = async {
        let mut got = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return status(&got),
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            if complete(&got, head) {
                return status(&got);
            }
        }
    };
    tokio::time::timeout(CASE_WAIT, read).await.ok().flatten()
}

/// A connection from 127.0.0.2: the client is not the proxy in front of
/// the hook, which calls it from 127.0.0.1, the one address it trusts.
async fn connect_as_client(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind("127.0.0.2:0".parse().expect("an address"))?;
    socket.connect(addr).await
}

fn status(bytes: &[u8]) -> Option<u16> {
    let text = bytes.strip_prefix(b"HTTP/1.")?;
    std::str::from_utf8(text.get(2..5)?).ok()?.parse().ok()
}

/// Whether `bytes` hold a whole final response (the servers close after
/// it anyway; this only saves waiting for the ones that linger).
fn complete(bytes: &[u8], head: bool) -> bool {
    let mut lines = [httparse::EMPTY_HEADER; 64];
    let mut response = httparse::Response::new(&mut lines);
    let Ok(httparse::Status::Complete(len)) = response.parse(bytes) else {
        return false;
    };
    if response.code.is_some_and(|c| c < 200) {
        return false;
    }
    let header = |name: &str| {
        response
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).trim().to_ascii_lowercase())
    };
    if head || matches!(response.code, Some(204 | 304)) {
        return true;
    }
    if let Some(length) = header("content-length").and_then(|l| l.parse::<usize>().ok()) {
        return bytes.len() >= len + length;
    }
    header("transfer-encoding").is_some_and(|t| t.contains("chunked"))
        && bytes.ends_with(b"0\r\n\r\n")
}

/// A relay between the proxy and the upstream that counts the
/// connections the proxy sent bytes on: the proxy connects at a client
/// connection's first forwarded request, so, cases being sent one at a
/// time, a case the count did not grow for was not forwarded.
#[derive(Clone)]
struct Relay {
    addr: SocketAddr,
    forwarded: Arc<AtomicUsize>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("an address");
        let forwarded = Arc::new(AtomicUsize::new(0));
        let counted = forwarded.clone();
        tokio::spawn(async move {
            while let Ok((mut from, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    let mut first = [0u8; 16384];
                    let n = match from.read(&mut first).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    counted.fetch_add(1, Ordering::SeqCst);
                    let Ok(mut to) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    if to.write_all(&first[..n]).await.is_err() {
                        return;
                    }
                    let _ = tokio::io::copy_bidirectional(&mut from, &mut to).await;
                });
            }
        });
        Self { addr, forwarded }
    }

    fn count(&self) -> usize {
        self.forwarded.load(Ordering::SeqCst)
    }
}

/// What the cases are sent through: `spillway proxy`, or a proxy in front
/// of the forward-auth hook of `spillway serve`, from its configuration in
/// `examples/forward-auth/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Through {
    Proxy,
    Hook(Front),
}

impl Through {
    fn name(self) -> String {
        match self {
            Self::Proxy => "spillway proxy".to_string(),
            Self::Hook(front) => format!("{} and the forward-auth hook", front.name()),
        }
    }
}

/// The proxy in front of `upstream`; stopped on drop.
struct Proxy {
    addr: SocketAddr,
    _stop: Option<tokio::sync::oneshot::Sender<()>>,
    _hook: Option<(Service, FrontProxy)>,
}

/// `through` in front of `upstream`; `None` when its proxy is not
/// installed (and not required: see `front_support`).
async fn proxy(through: Through, upstream: SocketAddr) -> Option<Proxy> {
    let Through::Hook(front) = through else {
        return Some(spillway_proxy(upstream).await);
    };
    let binary = binary_or_skip(front)?;
    // The proxy calls the hook from 127.0.0.1; the cases come from
    // 127.0.0.2.
    let config = format!("[clients]\ntrusted_proxies = [\"127.0.0.1/32\"]\n{CONFIG}");
    let config = Config::parse(&config).expect("a valid config");
    let spillway = Service::start(config, None).await;
    let front = FrontProxy::start(front, &binary, spillway.addr, upstream).await;
    Some(Proxy {
        addr: front.addr,
        _stop: None,
        _hook: Some((spillway, front)),
    })
}

/// `spillway proxy`, in this process, in front of `upstream`.
async fn spillway_proxy(upstream: SocketAddr) -> Proxy {
    let config = Config::parse(CONFIG).expect("a valid config");
    let options = ProxyOptions {
        normalize: config.proxy,
        ..ProxyOptions::default()
    };
    let engine = Loaded::build(config, None, None).await.expect("an engine");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    let upstream = format!("http://{upstream}").parse().expect("a URL");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(
        listener,
        upstream,
        Arc::new(Live::new(engine)),
        options,
        async move {
            let _ = stopped.await;
        },
    ));
    Proxy {
        addr,
        _stop: Some(stop),
        _hook: None,
    }
}

// ---------------------------------------------------------------------------
// The check.

/// What one case came to, directly and through the proxy.
#[derive(Default, Clone)]
struct Outcome {
    /// The limited handler the router ran for it when sent directly.
    direct: Option<String>,
    /// The limited handler that ran for it through the proxy.
    proxied: Option<String>,
    /// How the router read it through the proxy (method and path).
    seen: String,
    status: Option<u16>,
    forwarded: bool,
}

/// A request shown as it went on the wire, for the report.
fn shown(bytes: &[u8]) -> String {
    let text: String = bytes.escape_ascii().to_string();
    text.replace("\\r\\n", "\u{21b5} ")
}

/// Whether a case mixes in a class still open (then it is not asserted).
fn known_open(case: &Case) -> bool {
    case.classes.iter().any(|c| KNOWN_OPEN.contains(c))
}

fn limited(handler: &str) -> bool {
    LIMITED.contains(&handler)
}

/// The first limited handler the upstream logged for each case id.
fn limited_by_case(upstream: &Upstream) -> BTreeMap<String, (String, String)> {
    let mut found = BTreeMap::new();
    for served in upstream.served() {
        if limited(&served.handler) {
            found
                .entry(served.case)
                .or_insert((served.handler, format!("{} {}", served.method, served.path)));
        }
    }
    found
}

async fn check(router: Router, through: Through) {
    if let Through::Hook(front) = through
        && binary_or_skip(front).is_none()
    {
        return;
    }
    let Some(mut upstream) = Upstream::start(router) else {
        return;
    };
    let name = &format!("{} through {}", router.name(), through.name());
    let cases = corpus();

    // 1. Each case directly: what the router routes to a limited handler.
    for (i, case) in cases.iter().enumerate() {
        let head = case.request.method.eq_ignore_ascii_case("HEAD");
        send(upstream.addr, &case.request.bytes(&format!("d{i}")), head).await;
    }

    // 2. Through the proxy, with every rule exhausted first: the plain
    // limited requests are admitted once and reach their handler, then
    // are refused.
    let relay = Relay::start(upstream.addr).await;
    let proxy = proxy(through, relay.addr)
        .await
        .expect("the proxy is installed");
    for (round, aim) in [Aim::Login, Aim::Report, Aim::Account, Aim::Admin]
        .into_iter()
        .flat_map(|aim| [(0, aim), (1, aim)])
    {
        let id = format!("x{round}{aim:?}");
        let status = send(proxy.addr, &Request::aimed(aim).bytes(&id), false).await;
        let want = if round == 0 { 200 } else { 429 };
        assert_eq!(
            status,
            Some(want),
            "{name}: the plain {aim:?} request, {} time, through the proxy",
            ["first", "second"][round]
        );
    }
    let exhausted = limited_by_case(&upstream);
    for aim in [Aim::Login, Aim::Report, Aim::Account, Aim::Admin] {
        assert!(
            exhausted.contains_key(&format!("x0{aim:?}")),
            "{name}: the plain {aim:?} request did not reach its limited handler; \
             the router is not set up as the harness expects: {:?}",
            upstream.served()
        );
    }
    let lines_before = upstream.served().len();
    let mut outcomes = vec![Outcome::default(); cases.len()];
    for (i, case) in cases.iter().enumerate() {
        let head = case.request.method.eq_ignore_ascii_case("HEAD");
        let before = relay.count();
        outcomes[i].status = send(proxy.addr, &case.request.bytes(&format!("p{i}")), head).await;
        outcomes[i].forwarded = relay.count() > before;
    }
    // Handlers may still be running for a case whose answer timed out.
    let late = outcomes.iter().any(|o| o.forwarded && o.status.is_none());
    tokio::time::sleep(if late {
        CASE_WAIT
    } else {
        Duration::from_millis(300)
    })
    .await;
    // A router that died on some case would pass every case after it.
    if let Err(why) = upstream.answers("alive") {
        panic!("{name} stopped answering during the run: {why}");
    }
    let served = upstream.served();
    let found = limited_by_case(&upstream);
    for (i, outcome) in outcomes.iter_mut().enumerate() {
        if through != Through::Proxy {
            // A proxy in front of the hook keeps its upstream connections
            // open: the relay's count says nothing, the router's log does.
            let id = format!("p{i}");
            outcome.forwarded = served[lines_before..].iter().any(|s| s.case == id);
        }
        outcome.direct = found.get(&format!("d{i}")).map(|(h, _)| h.clone());
        if let Some((handler, seen)) = found.get(&format!("p{i}")) {
            outcome.proxied = Some(handler.clone());
            outcome.seen = seen.clone();
        }
    }
    // A limited handler that ran in the proxy's phase for no case of it
    // (its X-Case lost on the way) is a case that got through too.
    let known: BTreeSet<String> = (0..cases.len()).map(|i| format!("p{i}")).collect();
    let stray: Vec<_> = served[lines_before..]
        .iter()
        .filter(|s| limited(&s.handler) && !known.contains(&s.case))
        .collect();

    let report = table(router, through, &cases, &outcomes);
    eprintln!("{report}");

    // The router folds what it is known to fold (or the harness tests
    // nothing on it).
    let mut missing = Vec::new();
    for class in expected_folds(router) {
        let folded = cases
            .iter()
            .zip(&outcomes)
            .filter(|(c, o)| c.written && c.classes.contains(class) && o.direct.is_some())
            .count();
        if folded == 0 {
            missing.push(*class);
        }
    }
    // No case reaches a limited handler through the proxy, but for the
    // classes still open.
    let mut failures = String::new();
    let mut open = String::new();
    for (i, (case, outcome)) in cases.iter().zip(&outcomes).enumerate() {
        let Some(handler) = &outcome.proxied else {
            continue;
        };
        let line = format!(
            "  p{i} [{}] {} -> {handler} ({}); answered {:?}\n",
            case.classes.join("+"),
            shown(&case.request.bytes(&format!("p{i}"))),
            outcome.seen,
            outcome.status,
        );
        if known_open(case) {
            open.push_str(&line);
        } else {
            failures.push_str(&line);
        }
    }
    for s in &stray {
        let _ = writeln!(
            failures,
            "  a request with X-Case {:?} ran {} ({} {})",
            s.case, s.handler, s.method, s.path
        );
    }
    if !open.is_empty() {
        eprintln!(
            "{name}: KNOWN_OPEN cases that reached a limited handler through the proxy:\n{open}"
        );
    }
    let held: Vec<&str> = KNOWN_OPEN
        .iter()
        .filter(|class| {
            cases
                .iter()
                .zip(&outcomes)
                .any(|(c, o)| c.classes.contains(class) && o.direct.is_some())
                && !cases
                    .iter()
                    .zip(&outcomes)
                    .any(|(c, o)| c.classes.contains(class) && o.proxied.is_some())
        })
        .copied()
        .collect();
    if !held.is_empty() {
        eprintln!(
            "{name}: KNOWN_OPEN classes that this router folds and that held through the proxy \
             in this run: {held:?} (remove them from KNOWN_OPEN once they hold on every router)"
        );
    }
    assert!(
        missing.is_empty(),
        "{name}: sent directly, no case of {missing:?} reached a limited handler, \
         though the router is known to fold them: the harness would test nothing there"
    );
    assert!(
        failures.is_empty(),
        "{name}: cases reached a limited handler through the proxy after its rule was \
         exhausted (charged by no rule, refused by nothing):\n{failures}"
    );
}

/// The table of one router: by class, how many cases, how many the router
/// routes to a limited handler directly, how many reached one through the
/// proxy (0 but for KNOWN_OPEN), and what the proxy did with the rest.
fn table(router: Router, through: Through, cases: &[Case], outcomes: &[Outcome]) -> String {
    #[derive(Default)]
    struct Row {
        cases: usize,
        direct: usize,
        proxied: usize,
        denied: usize,
        refused: usize,
        forwarded: usize,
        silent: usize,
        /// Reached a limited handler, and none of its classes is open.
        failing: usize,
    }
    let mut rows: BTreeMap<&str, Row> = BTreeMap::new();
    let mut total = Row::default();
    for (case, outcome) in cases.iter().zip(outcomes) {
        // A hand-written case has one class; a combination, several.
        let key = if case.written {
            case.classes[0]
        } else {
            "(seeded combinations)"
        };
        for row in [rows.entry(key).or_default(), &mut total] {
            row.cases += 1;
            row.direct += usize::from(outcome.direct.is_some());
            row.proxied += usize::from(outcome.proxied.is_some());
            row.failing += usize::from(outcome.proxied.is_some() && !known_open(case));
            match (outcome.forwarded, outcome.status) {
                (true, _) => row.forwarded += 1,
                (false, Some(429)) => row.denied += 1,
                (false, Some(_)) => row.refused += 1,
                (false, None) => row.silent += 1,
            }
        }
    }
    let mut out = format!(
        "\n{} (through {}; the limited handlers' rules exhausted first)\n\
         {:<24} {:>6} {:>8} {:>9} {:>6} {:>7} {:>9} {:>9}\n",
        router.name(),
        through.name(),
        "class",
        "cases",
        "directly",
        "via-proxy",
        "429",
        "refused",
        "forwarded",
        "no-answer"
    );
    let mut line = |name: &str, row: &Row| {
        let _ = writeln!(
            out,
            "{:<24} {:>6} {:>8} {:>9} {:>6} {:>7} {:>9} {:>9}{}",
            name,
            row.cases,
            row.direct,
            row.proxied,
            row.denied,
            row.refused,
            row.forwarded,
            row.silent,
            if row.failing > 0 {
                "  FAILS"
            } else if row.proxied > 0 {
                "  KNOWN_OPEN"
            } else {
                ""
            }
        );
    };
    for (name, row) in &rows {
        line(name, row);
    }
    line("total", &total);
    out.push_str(
        "directly: routed to a limited handler with no proxy in front; via-proxy: reached \
         one through the proxy (0 but for KNOWN_OPEN); 429: charged by a rule and denied; \
         refused: another answer of the proxy's own (400, 431, 501), never forwarded; \
         forwarded: reached the upstream, and served by an unlimited handler, refused by the \
         router or (via-proxy) by a limited one; no-answer: closed by the proxy unanswered\n",
    );
    out
}

#[tokio::test]
async fn tomcat_serves_no_limited_request_past_the_proxy() {
    check(Router::Tomcat, Through::Proxy).await;
}

#[tokio::test]
async fn express_serves_no_limited_request_past_the_proxy() {
    check(Router::Express, Through::Proxy).await;
}

#[tokio::test]
async fn node_url_serves_no_limited_request_past_the_proxy() {
    check(Router::PlainNode, Through::Proxy).await;
}

#[tokio::test]
async fn flask_serves_no_limited_request_past_the_proxy() {
    check(Router::Flask, Through::Proxy).await;
}

#[tokio::test]
async fn starlette_serves_no_limited_request_past_the_proxy() {
    check(Router::Starlette, Through::Proxy).await;
}

#[tokio::test]
async fn sinatra_serves_no_limited_request_past_the_proxy() {
    check(Router::Sinatra, Through::Proxy).await;
}

#[tokio::test]
async fn go_serves_no_limited_request_past_the_proxy() {
    check(Router::Go, Through::Proxy).await;
}

/// The corpus through each proxy in front of the forward-auth hook, with
/// each router behind it.
macro_rules! through_hook {
    ($($name:ident: $router:ident, $front:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                check(Router::$router, Through::Hook(Front::$front)).await;
            }
        )*
    };
}

through_hook! {
    tomcat_serves_no_limited_request_past_nginx_and_the_hook: Tomcat, Nginx;
    express_serves_no_limited_request_past_nginx_and_the_hook: Express, Nginx;
    node_url_serves_no_limited_request_past_nginx_and_the_hook: PlainNode, Nginx;
    flask_serves_no_limited_request_past_nginx_and_the_hook: Flask, Nginx;
    starlette_serves_no_limited_request_past_nginx_and_the_hook: Starlette, Nginx;
    sinatra_serves_no_limited_request_past_nginx_and_the_hook: Sinatra, Nginx;
    go_serves_no_limited_request_past_nginx_and_the_hook: Go, Nginx;
    tomcat_serves_no_limited_request_past_caddy_and_the_hook: Tomcat, Caddy;
    express_serves_no_limited_request_past_caddy_and_the_hook: Express, Caddy;
    node_url_serves_no_limited_request_past_caddy_and_the_hook: PlainNode, Caddy;
    flask_serves_no_limited_request_past_caddy_and_the_hook: Flask, Caddy;
    starlette_serves_no_limited_request_past_caddy_and_the_hook: Starlette, Caddy;
    sinatra_serves_no_limited_request_past_caddy_and_the_hook: Sinatra, Caddy;
    go_serves_no_limited_request_past_caddy_and_the_hook: Go, Caddy;
    tomcat_serves_no_limited_request_past_haproxy_and_the_hook: Tomcat, Haproxy;
    express_serves_no_limited_request_past_haproxy_and_the_hook: Express, Haproxy;
    node_url_serves_no_limited_request_past_haproxy_and_the_hook: PlainNode, Haproxy;
    flask_serves_no_limited_request_past_haproxy_and_the_hook: Flask, Haproxy;
    starlette_serves_no_limited_request_past_haproxy_and_the_hook: Starlette, Haproxy;
    sinatra_serves_no_limited_request_past_haproxy_and_the_hook: Sinatra, Haproxy;
    go_serves_no_limited_request_past_haproxy_and_the_hook: Go, Haproxy;
    tomcat_serves_no_limited_request_past_traefik_and_the_hook: Tomcat, Traefik;
    express_serves_no_limited_request_past_traefik_and_the_hook: Express, Traefik;
    node_url_serves_no_limited_request_past_traefik_and_the_hook: PlainNode, Traefik;
    flask_serves_no_limited_request_past_traefik_and_the_hook: Flask, Traefik;
    starlette_serves_no_limited_request_past_traefik_and_the_hook: Starlette, Traefik;
    sinatra_serves_no_limited_request_past_traefik_and_the_hook: Sinatra, Traefik;
    go_serves_no_limited_request_past_traefik_and_the_hook: Go, Traefik;
}

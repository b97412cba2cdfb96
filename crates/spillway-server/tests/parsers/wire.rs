//! HTTP/1.1 bytes on a real socket, into `spillway serve`'s own server
//! (`http1/`) and into `spillway proxy` (hyper, with its own checks):
//! valid requests mutated (and arbitrary bytes) get an answer or a close
//! within a bound, never a 5xx, and a refusal says why in its body; valid
//! requests are answered 200. `tests/mangle` (serve_wire, proxy_wire,
//! proxy_differential) sends pieces of requests in random orders; these
//! cases start from whole valid requests, so they reach the body framing
//! and the handlers too.

use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use proptest::prelude::*;
use spillway_conformance::hostile::{config, mutated, within};
use spillway_server::config::Config;
use spillway_server::proxy::{ProxyOptions, serve_with};
use spillway_server::state::{Live, Loaded};
use spillway_server::{State, run};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The most one connection may take to end: the server's own deadlines
/// are 30 s, but every case here ends as soon as its bytes are read (the
/// client closes its side).
const BOUND: Duration = Duration::from_secs(20);

/// Generous: mutated requests must not run into a denial. The second
/// rule matches by method, path and host, so that mutated targets and
/// hosts reach the rules' matching too.
const CONFIG: &str = r#"
[[rules]]
name = "once"
algorithm = "fixed_window"
limit = 1000000000
window = "1h"

[[rules]]
name = "matched"
match = { methods = ["GET", "POST"], path = "/a/{id}/**", host = "*.test" }
key = ["ip", "route", "header:x-tag"]
fallback = ["ip"]
algorithm = "sliding_window"
limit = 1000000000
window = "1m"
"#;

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
});

/// `spillway serve`'s HTTP API, as `run` starts it.
static SERVE: LazyLock<SocketAddr> = LazyLock::new(|| {
    RUNTIME.block_on(async {
        let config = Config::parse(CONFIG).expect("a valid config");
        let state = State::new(config).await.expect("the memory store");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("an address");
        tokio::spawn(run(listener, None, state, None, std::future::pending()));
        addr
    })
});

/// `spillway proxy` in front of a hyper server that answers 200 to
/// every request it reads.
static PROXY: LazyLock<SocketAddr> = LazyLock::new(|| {
    RUNTIME.block_on(async {
        let upstream = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let upstream_addr = upstream.local_addr().expect("an address");
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = upstream.accept().await else {
                    continue;
                };
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(
                    TokioIo::new(stream),
                    service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                            Bytes::from_static(b"upstream"),
                        )))
                    }),
                ));
            }
        });
        let config = Config::parse(CONFIG).expect("a valid config");
        let engine = Loaded::build(config, None, None).await.expect("an engine");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("an address");
        tokio::spawn(serve_with(
            listener,
            format!("http://{upstream_addr}").parse().expect("a URL"),
            Arc::new(Live::new(engine)),
            ProxyOptions::default(),
            std::future::pending(),
        ));
        addr
    })
});

/// One response read off the wire.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: Vec<u8>,
}

/// Who answers a request head that does not parse: our server, with a
/// problem+json that says why, or hyper (the proxy's front), whose 400
/// has only its status line (hyper has no hook for its body).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusals {
    Explained,
    BareFromHyper,
}

/// Sends `bytes` on a connection of its own, closes the sending side, and
/// reads the responses until the server closes, within [`BOUND`]. Checks
/// that none is a 5xx and that every 4xx says why (but hyper's bare 400).
fn exchange(addr: SocketAddr, bytes: Vec<u8>) -> Vec<Answer> {
    exchange_closing(addr, bytes, true)
}

/// [`exchange`], with the client's sending side closed after `bytes`
/// (`half_close`) or left open (for requests that ask the server to
/// close). hyper, the proxy's front, drops a connection whose client has
/// closed its sending side, request in flight and all (its default).
fn exchange_closing(addr: SocketAddr, bytes: Vec<u8>, half_close: bool) -> Vec<Answer> {
    let refusals = if addr == *PROXY {
        Refusals::BareFromHyper
    } else {
        Refusals::Explained
    };
    let shown = format!("{:?}", String::from_utf8_lossy(&bytes));
    let out = within(BOUND, move || {
        RUNTIME.block_on(async move {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            // The server may answer and close before reading it all.
            let _ = stream.write_all(&bytes).await;
            if half_close {
                let _ = stream.shutdown().await;
            }
            let mut out = Vec::new();
            let _ = stream.read_to_end(&mut out).await;
            out
        })
    })
    .unwrap_or_else(|e| panic!("{e:?} for {shown}"));
    let answers = responses(&out)
        .unwrap_or_else(|e| panic!("{e}: {:?} for {shown}", String::from_utf8_lossy(&out)));
    for a in &answers {
        let body = String::from_utf8_lossy(&a.body);
        assert!(a.status < 500, "{} {body} for {shown}", a.status);
        let bare_from_hyper = refusals == Refusals::BareFromHyper && a.status == 400;
        if a.status >= 400 && !bare_from_hyper {
            assert!(
                !body.trim().is_empty(),
                "{} without a reason for {shown}",
                a.status
            );
        }
    }
    answers
}

/// The responses in `out`, each with a Content-Length body (all our
/// servers' own answers have one; the upstream's too).
fn responses(mut out: &[u8]) -> Result<Vec<Answer>, String> {
    let mut answers = Vec::new();
    while !out.is_empty() {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut response = httparse::Response::new(&mut headers);
        let head = match response.parse(out).map_err(|e| e.to_string())? {
            httparse::Status::Complete(n) => n,
            httparse::Status::Partial => return Err("a cut-short response".into()),
        };
        let status = response.code.ok_or("no status")?;
        let length = response
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .map(|h| String::from_utf8_lossy(h.value).parse::<usize>())
            .transpose()
            .map_err(|e| e.to_string())?;
        // A 100 Continue, a 204 or a 304 has no body.
        let length = length.unwrap_or(0);
        let end = head + length;
        if out.len() < end {
            return Err("a cut-short body".into());
        }
        answers.push(Answer {
            status,
            body: out[head..end].to_vec(),
        });
        out = &out[end..];
    }
    Ok(answers)
}

/// Valid requests, each asking the server to close after it.
const SERVE_SEEDS: &[&[u8]] = &[
    b"POST /v1/check HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\nContent-Length: 28\r\nConnection: close\r\n\r\n{\"rule\":\"once\",\"key\":\"ip=k\"}",
    b"POST /v1/check?x=1 HTTP/1.1\r\nHost: s\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n1c;ext=1\r\n{\"rule\":\"once\",\"key\":\"ip=k\"}\r\n0\r\nX-Trailer: 1\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: s\r\n\r\nGET /metrics HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n",
    b"POST /v1/check HTTP/1.1\r\nHost: s\r\nExpect: 100-continue\r\nContent-Length: 45\r\nConnection: close\r\n\r\n{\"method\":\"GET\",\"path\":\"/a\",\"ip\":\"192.0.2.1\"}",
    b"GET /readyz HTTP/1.0\r\n\r\n",
];

const PROXY_SEEDS: &[&[u8]] = &[
    b"GET /a/b?c=d HTTP/1.1\r\nHost: spillway.test\r\nX-Tag: 1\r\nConnection: close\r\n\r\n",
    b"POST /upload HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: 5\r\n\r\nhelloGET /next HTTP/1.1\r\nHost: spillway.test\r\nConnection: close\r\n\r\n",
    b"PUT /x HTTP/1.1\r\nHost: spillway.test\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"GET http://spillway.test/abs HTTP/1.1\r\nHost: spillway.test\r\nConnection: close\r\n\r\n",
    // Not HEAD: its answer has a Content-Length and no body.
    b"GET /%6cogin/../x HTTP/1.0\r\nHost: spillway.test\r\n\r\n",
];

/// HTTP/1.1's syntax, and framing at and past its limits.
const PIECES: &[&[u8]] = &[
    b"\r\n",
    b"\n",
    b"\r",
    b":",
    b" ",
    b"\t",
    b",",
    b";",
    b"\r\n\r\n",
    b"Content-Length: 5\r\n",
    b"Content-Length: 18446744073709551616\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip\r\n",
    b"Expect: 100-continue\r\n",
    b"Connection: close\r\n",
    b"Host: a\r\n",
    b"0\r\n\r\n",
    b"ffffffffffffffff\r\n",
    b"HTTP/1.1",
    b"HTTP/2.0",
    b"%00",
    b"%",
    b"/..",
    b"\0",
    b"\x7f",
    b"\xff",
    b"\xc3\xa4",
];

proptest! {
    #![proptest_config(config(150))]

    #[test]
    fn serve_answers_mutated_requests_or_closes(bytes in mutated(SERVE_SEEDS, PIECES)) {
        exchange(*SERVE, bytes);
    }

    #[test]
    fn serve_answers_any_bytes_or_closes(
        bytes in proptest::collection::vec(any::<u8>(), 0..200)
    ) {
        exchange(*SERVE, bytes);
    }

    #[test]
    fn the_proxy_answers_mutated_requests_or_closes(bytes in mutated(PROXY_SEEDS, PIECES)) {
        exchange(*PROXY, bytes);
    }

    #[test]
    fn the_proxy_answers_any_bytes_or_closes(
        bytes in proptest::collection::vec(any::<u8>(), 0..200)
    ) {
        exchange(*PROXY, bytes);
    }
}

#[test]
fn the_seeds_are_answered_200() {
    for (addr, seeds, answers) in [
        (*SERVE, SERVE_SEEDS, [1, 1, 2, 2, 1]),
        (*PROXY, PROXY_SEEDS, [1, 2, 1, 1, 1]),
    ] {
        for (seed, n) in seeds.iter().zip(answers) {
            // Every seed asks the server to close after it.
            let got = exchange_closing(addr, seed.to_vec(), false);
            let statuses: Vec<u16> = got.iter().map(|a| a.status).collect();
            // Expect: 100-continue is answered 100 first.
            let want: Vec<u16> = (0..n)
                .map(|i| {
                    if n == 2 && i == 0 && seed.windows(6).any(|w| w == b"Expect") {
                        100
                    } else {
                        200
                    }
                })
                .collect();
            assert_eq!(statuses, want, "{:?}", String::from_utf8_lossy(seed));
        }
    }
}

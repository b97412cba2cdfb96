//! `spillway serve` against hostile clients (issue 15), on the real server
//! at port 0: `POST /v1/check` behind its bearer tokens, and the deadlines
//! and caps that keep slow or idle clients from holding the server. Time is
//! tokio's paused clock wherever a deadline is waited for.

mod serve_support;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use serve_support::Service;
use spillway_server::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest any one step may take: a bug fails the test instead of
/// hanging it.
const WAIT: Duration = Duration::from_secs(5);

/// Two check tokens (a new one rolled out beside the old), three checks
/// per key and hour.
const CONFIG: &str = r#"
[server]
check_tokens = ["new-token", "old-token"]

[[rules]]
name = "three"
algorithm = "sliding_log"
limit = 3
window = "1h"
"#;

async fn start(config: &str) -> Service {
    Service::start(Config::parse(config).expect("a valid config"), None).await
}

/// A check of `key` under rule `three`, with these extra header lines.
fn check(key: &str, headers: &str) -> Vec<u8> {
    let body = format!(r#"{{"rule": "three", "key": "ip={key}"}}"#);
    format!(
        "POST /v1/check HTTP/1.1\r\nHost: s\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Sends `request` on a connection of its own and reads the whole answer
/// (the request asks the server to close).
async fn exchange(service: &Service, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    stream.write_all(request).await.expect("write");
    let mut got = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut got))
        .await
        .expect("answered in time")
        .expect("a read");
    String::from_utf8_lossy(&got).into_owned()
}

/// The body of a raw answer, as JSON.
fn body_of(answer: &str) -> Value {
    let (_, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {answer}"))
}

/// How many checks `key` has left, asked with a token (cost 0 charges
/// nothing).
async fn remaining(service: &Service, key: &str) -> u64 {
    let body = json!({"rule": "three", "key": format!("ip={key}"), "cost": 0}).to_string();
    let answer = service
        .http
        .send(
            Method::POST,
            "/v1/check",
            &[("authorization", "Bearer new-token")],
            body,
        )
        .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    answer.json()["rules"][0]["remaining"]
        .as_u64()
        .expect("remaining")
}

/// Without a token, with a wrong one, another scheme or two `Authorization`
/// lines, a check is refused with a 401 problem and `WWW-Authenticate:
/// Bearer`, and charges nothing; either configured token is accepted, in
/// any case of `Bearer`. On the HTTP/1.1 fast path.
#[tokio::test]
async fn a_check_without_a_valid_token_is_refused_on_http1() {
    let service = start(CONFIG).await;
    let refused = [
        "",
        "Authorization: Bearer wrong\r\n",
        "Authorization: Bearer new-token-and-more\r\n",
        "Authorization: Bearer \r\n",
        "Authorization: Basic bmV3LXRva2Vu\r\n",
        "Authorization: new-token\r\n",
        "Authorization: Bearer wrong\r\nAuthorization: Bearer new-token\r\n",
    ];
    for headers in refused {
        let answer = exchange(
            &service,
            &check("k", &format!("{headers}Connection: close\r\n")),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 401 "), "{headers:?}: {answer}");
        let head = answer.to_ascii_lowercase();
        assert!(
            head.contains("\r\nwww-authenticate: bearer"),
            "{headers:?}: {answer}"
        );
        assert!(
            head.contains("\r\ncontent-type: application/problem+json"),
            "{answer}"
        );
        assert_eq!(body_of(&answer)["status"], 401, "{answer}");
    }
    assert_eq!(remaining(&service, "k").await, 3, "nothing was charged");
    for token in ["Bearer new-token", "bearer old-token", "BEARER  new-token "] {
        let headers = format!("Authorization: {token}\r\nConnection: close\r\n");
        let answer = exchange(&service, &check("k", &headers)).await;
        assert!(answer.starts_with("HTTP/1.1 200 "), "{token}: {answer}");
        assert_eq!(body_of(&answer)["allowed"], true, "{answer}");
    }
    assert_eq!(remaining(&service, "k").await, 0);
}

/// The router's `POST /v1/check` (HTTP/2 here) asks for the same tokens.
#[tokio::test]
async fn a_check_without_a_valid_token_is_refused_on_http2() {
    let service = start(CONFIG).await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let ask = |authorization: Option<&str>| {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{}/v1/check", service.addr));
        if let Some(value) = authorization {
            req = req.header("authorization", value);
        }
        req.body(Full::new(Bytes::from(
            r#"{"rule": "three", "key": "ip=h2"}"#,
        )))
        .expect("a request")
    };
    for (authorization, status) in [
        (None, StatusCode::UNAUTHORIZED),
        (Some("Bearer wrong"), StatusCode::UNAUTHORIZED),
        (Some("Bearer old-token"), StatusCode::OK),
    ] {
        let res = tokio::time::timeout(WAIT, client.request(ask(authorization)))
            .await
            .expect("in time")
            .expect("an HTTP/2 answer");
        assert_eq!(res.version(), http::Version::HTTP_2);
        assert_eq!(res.status(), status, "{authorization:?}");
        if status == StatusCode::UNAUTHORIZED {
            let challenge = res.headers()["www-authenticate"].to_str().expect("text");
            assert!(challenge.starts_with("Bearer"), "{challenge}");
            assert_eq!(
                res.headers()["content-type"],
                "application/problem+json",
                "{authorization:?}"
            );
        }
    }
    assert_eq!(remaining(&service, "h2").await, 2, "one check was charged");
}

/// Without `check_tokens`, `/v1/check` stays open, as before.
#[tokio::test]
async fn without_tokens_a_check_needs_none() {
    let service = start(&CONFIG.replace("check_tokens", "# check_tokens")).await;
    let answer = exchange(&service, &check("open", "Connection: close\r\n")).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
}

// ---- slow and idle clients ------------------------------------------------

/// Three checks per key and hour, the default timeouts.
const OPEN: &str = r#"
[[rules]]
name = "three"
algorithm = "sliding_log"
limit = 3
window = "1h"
"#;

/// Reads until the server closes, within `within` (of tokio's clock): what
/// it sent, and how long it took; `None` if it had not closed by then. A
/// reset counts as a close.
async fn until_closed(stream: &mut TcpStream, within: Duration) -> Option<(String, Duration)> {
    let started = tokio::time::Instant::now();
    let mut got = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let reading = async {
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(within, reading).await.ok()?;
    Some((
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    ))
}

/// A body sent a byte every 20 s (each read in time) must still be whole
/// 30 s after its head: the client gets a 408 problem then, and the
/// connection closes.
#[tokio::test(start_paused = true)]
async fn a_body_sent_a_byte_at_a_time_is_cut_off_at_its_deadline() {
    let service = start(OPEN).await;
    let stream = TcpStream::connect(service.addr).await.expect("connect");
    let (mut read, mut write) = stream.into_split();
    write
        .write_all(b"POST /v1/check HTTP/1.1\r\nHost: s\r\nContent-Length: 100\r\n\r\n{")
        .await
        .expect("write");
    let drip = tokio::spawn(async move {
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_secs(20)).await;
            if write.write_all(b" ").await.is_err() {
                return;
            }
        }
    });
    let started = tokio::time::Instant::now();
    let mut got = String::new();
    let closed =
        tokio::time::timeout(Duration::from_secs(120), read.read_to_string(&mut got)).await;
    let waited = started.elapsed();
    drip.abort();
    assert!(closed.is_ok(), "still open after {waited:?}: {got}");
    assert!(got.starts_with("HTTP/1.1 408 "), "{got}");
    assert!(got.contains("application/problem+json"), "{got}");
    assert!(
        (Duration::from_secs(29)..Duration::from_secs(45)).contains(&waited),
        "closed after {waited:?}"
    );
}

/// The HTTP/2 preface sent a byte every 5 s (each read in time) must still
/// be whole 30 s after the connection opened.
#[tokio::test(start_paused = true)]
async fn a_preface_sent_a_byte_at_a_time_is_cut_off_at_its_deadline() {
    let service = start(OPEN).await;
    let stream = TcpStream::connect(service.addr).await.expect("connect");
    let (mut read, mut write) = stream.into_split();
    let drip = tokio::spawn(async move {
        for byte in b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" {
            if write.write_all(&[*byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        // Then nothing more: hold the connection open.
        tokio::time::sleep(Duration::from_secs(3600)).await;
    });
    let started = tokio::time::Instant::now();
    let mut got = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(300), read.read_to_end(&mut got)).await;
    let waited = started.elapsed();
    drip.abort();
    assert!(closed.is_ok(), "still open after {waited:?}");
    assert!(
        (Duration::from_secs(29)..Duration::from_secs(45)).contains(&waited),
        "closed after {waited:?}"
    );
}

/// On HTTP/2, pings every `write_timeout`: long here, so that the tests
/// of the other HTTP/2 deadlines see those alone. (On paused time a ping's
/// answer can come after the clock has jumped to the ping's timeout.)
const RARE_PINGS: &str = "[server]\nwrite_timeout = \"1h\"\n";

/// An HTTP/2 connection with no request open for 60 s is closed (with a
/// GOAWAY, so that the client knows).
#[tokio::test(start_paused = true)]
async fn an_idle_http2_connection_is_closed() {
    let service = start(&format!("{RARE_PINGS}{OPEN}")).await;
    let stream = TcpStream::connect(service.addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("an HTTP/2 connection");
    let conn = tokio::spawn(conn);
    let req = Request::get(format!("http://{}/healthz", service.addr))
        .body(Full::new(Bytes::new()))
        .expect("a request");
    let res = sender.send_request(req).await.expect("an answer");
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    let idle = tokio::time::Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(300), conn).await;
    let waited = idle.elapsed();
    assert!(closed.is_ok(), "still open after {waited:?}");
    assert!(
        (Duration::from_secs(59)..Duration::from_secs(75)).contains(&waited),
        "closed after {waited:?}"
    );
}

/// A client that sends requests and never reads the answers is closed once
/// a response has waited 30 s to be written, rather than holding its
/// connection (and the answers' memory) for good.
#[tokio::test(start_paused = true)]
async fn a_client_that_does_not_read_is_closed_after_the_write_timeout() {
    let service = start(OPEN).await;
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    // A small window, so that the server's writes block early.
    socket.set_recv_buffer_size(4096).expect("a buffer size");
    let mut stream = socket.connect(service.addr).await.expect("connect");
    const ASKED: usize = 1000;
    let request = b"GET /openapi.json HTTP/1.1\r\nHost: s\r\n\r\n";
    stream
        .write_all(&request.repeat(ASKED))
        .await
        .expect("write");
    // Not reading, for longer than the write timeout.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let (got, _) = until_closed(&mut stream, Duration::from_secs(300))
        .await
        .expect("closed");
    let answered = got.matches("HTTP/1.1 200 OK").count();
    assert!(
        answered < ASKED,
        "every answer was written, the connection held meanwhile"
    );
}

/// With `max_connections = 2` and two open, a third connection is
/// answered 503 (`Connection: close`) and closed at once, and counted; once
/// one closes, connections are served again.
#[tokio::test]
async fn connections_past_the_cap_get_a_503_and_are_counted() {
    let service = start(&format!("[server]\nmax_connections = 2\n{OPEN}")).await;
    let first = TcpStream::connect(service.addr).await.expect("connect");
    let _second = TcpStream::connect(service.addr).await.expect("connect");
    let mut third = TcpStream::connect(service.addr).await.expect("connect");
    let (answer, _) = until_closed(&mut third, WAIT)
        .await
        .expect("closed at once");
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("connection: close\r\n"), "{answer}");
    let (_, body) = answer.split_once("\r\n\r\n").expect("a body");
    let body: Value = serde_json::from_str(body).expect("a problem");
    assert_eq!(body["status"], 503);
    drop(first);
    // The server notices the close, and serves again.
    let metrics = serve_support::eventually_answered(&service.http, "/metrics").await;
    let count = serve_support::metric_value(&metrics, "spillway_http_connections_refused_total");
    assert_eq!(count, Some(1.0), "{metrics}");
    let open = serve_support::metric_value(&metrics, "spillway_http_connections");
    assert_eq!(
        open,
        Some(2.0),
        "the one asking and the one held: {metrics}"
    );
}

/// A request body that never comes.
struct Never;

impl hyper::body::Body for Never {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Pending
    }
}

/// An HTTP/2 request whose body never comes is answered 408 (its stream
/// ended) once the head and body timeouts (60 s) have passed, as on
/// HTTP/1.1.
#[tokio::test(start_paused = true)]
async fn an_http2_request_whose_body_never_comes_gets_a_408() {
    let service = start(&format!("{RARE_PINGS}{OPEN}")).await;
    let stream = TcpStream::connect(service.addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("an HTTP/2 connection");
    tokio::spawn(conn);
    let req = Request::post(format!("http://{}/v1/check", service.addr))
        .body(Never)
        .expect("a request");
    let started = tokio::time::Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(300), sender.send_request(req))
        .await
        .expect("answered in time");
    let waited = started.elapsed();
    // The server answers 408 and resets the stream it no longer reads;
    // hyper's client may report the reset of its upload rather than the
    // answer.
    match res {
        Ok(res) => assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT),
        Err(e) => assert!(format!("{e:?}").contains("stream closed"), "{e:?}"),
    }
    assert!(
        (Duration::from_secs(59)..Duration::from_secs(75)).contains(&waited),
        "answered after {waited:?}"
    );
}

/// An unknown caller is refused before its body is read: on HTTP/2, a
/// check or settle whose body never comes is answered 401 at once, not
/// after the body's deadline. (The HTTP/1.1 server reads a body of at most
/// 64 KiB, within `body_timeout`, before it answers.)
#[tokio::test]
async fn a_caller_without_a_token_is_refused_before_its_body_is_read_on_http2() {
    /// A client that sends its head, then nothing.
    struct Silent;
    impl http_body::Body for Silent {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Pending
        }
    }
    let service = start(CONFIG).await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Silent>();
    for path in ["/v1/check", "/v1/settle"] {
        let req = Request::post(format!("http://{}{path}", service.addr))
            .header("content-type", "application/json")
            .body(Silent)
            .expect("a request");
        let res = tokio::time::timeout(WAIT, client.request(req))
            .await
            .unwrap_or_else(|_| panic!("{path}: no answer before the body came"))
            .expect("an HTTP/2 answer");
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{path}");
    }
}

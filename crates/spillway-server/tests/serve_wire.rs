//! `spillway serve`'s HTTP/1.1 on the wire: raw sockets write the bytes and
//! read what comes back, so these tests see what the server's own HTTP
//! path sends and accepts (keep-alive, pipelining, chunked bodies, `Expect`,
//! HTTP/1.0, refusals), which a hyper client would smooth over. HTTP/2 is
//! checked with hyper's client.

mod mangle;
mod serve_support;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use serve_support::Service;
use spillway_server::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest any one step may take: a bug fails the test instead of
/// hanging it.
const WAIT: Duration = Duration::from_secs(5);

/// One check admitted per key and minute.
const CONFIG: &str = r#"
[[rules]]
name = "once"
algorithm = "sliding_log"
limit = 1
window = "1m"
"#;

async fn start() -> Service {
    Service::start(Config::parse(CONFIG).expect("a valid config"), None).await
}

/// A response as read off the wire.
#[derive(Debug)]
struct Wire {
    status: u16,
    /// Header lines, names lowercased, in order.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Wire {
    fn header(&self, name: &str) -> Option<&str> {
        let mut found = self.headers.iter().filter(|(n, _)| n == name);
        let value = found.next().map(|(_, v)| v.as_str());
        assert!(found.next().is_none(), "one {name} line: {self:?}");
        value
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// Reads one response from `stream` (bytes past it stay in `buf`). A HEAD
/// response (`head_only`) has no body whatever its length says.
async fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>, head_only: bool) -> Wire {
    loop {
        let mut lines = [httparse::EMPTY_HEADER; 32];
        let mut res = httparse::Response::new(&mut lines);
        if let httparse::Status::Complete(head_len) = res.parse(buf).expect("a response head") {
            let status = res.code.expect("a status");
            let headers: Vec<(String, String)> = res
                .headers
                .iter()
                .map(|h| {
                    let value = String::from_utf8_lossy(h.value).into_owned();
                    (h.name.to_ascii_lowercase(), value)
                })
                .collect();
            let length = headers
                .iter()
                .find(|(n, _)| n == "content-length")
                .map(|(_, v)| v.parse::<usize>().expect("a length"));
            assert!(
                !headers.iter().any(|(n, _)| n == "transfer-encoding"),
                "bodies here are whole: {headers:?}"
            );
            let length = if head_only || (100..200).contains(&status) {
                0
            } else {
                length.expect("every response here says its length")
            };
            while buf.len() < head_len + length {
                read_more(stream, buf).await;
            }
            let body = buf[head_len..head_len + length].to_vec();
            buf.drain(..head_len + length);
            return Wire {
                status,
                headers,
                body,
            };
        }
        read_more(stream, buf).await;
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) {
    let mut chunk = [0u8; 4096];
    let n = tokio::time::timeout(WAIT, stream.read(&mut chunk))
        .await
        .expect("the server answers in time")
        .expect("a read");
    assert!(n > 0, "the connection closed early; read so far: {buf:?}");
    buf.extend_from_slice(&chunk[..n]);
}

/// Whether the server closes the connection (nothing more comes).
async fn closes(stream: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    match tokio::time::timeout(WAIT, stream.read_to_end(&mut rest)).await {
        Ok(Ok(_)) => rest.is_empty(),
        Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Err(_) => false,
    }
}

/// `POST {line}` (a target and a version) with `headers` (whole lines), the
/// body's Content-Length, and `body`.
fn post(line: &str, headers: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {line}\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn check(key: &str) -> Vec<u8> {
    let body = format!(r#"{{"rule": "once", "key": "ip={key}"}}"#);
    post(
        "/v1/check HTTP/1.1",
        "Host: spillway.test\r\nContent-Type: application/json\r\n",
        &body,
    )
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let service = start().await;
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    // Three requests in one write: two checks of one key, then a GET the
    // router answers.
    let mut requests = [check("a"), check("a")].concat();
    requests.extend_from_slice(b"GET /healthz HTTP/1.1\r\nHost: spillway.test\r\n\r\n");
    stream.write_all(&requests).await.expect("write");
    let mut buf = Vec::new();
    let first = read_response(&mut stream, &mut buf, false).await;
    let second = read_response(&mut stream, &mut buf, false).await;
    let health = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.json()["allowed"], true, "{first:?}");
    assert_eq!(first.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(second.status, 200);
    assert_eq!(second.json()["allowed"], false, "{second:?}");
    assert_eq!(second.json()["status"], 429);
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["status"], "ok");
    for answer in [&first, &second, &health] {
        let date = answer.header("date").expect("a Date");
        httpdate::parse_http_date(date).expect("an HTTP date");
        assert_eq!(answer.header("connection"), None, "kept open: {answer:?}");
    }
    // Still open for a fourth.
    stream.write_all(&check("b")).await.expect("write");
    let fourth = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(fourth.json()["allowed"], true, "{fourth:?}");
}

#[tokio::test]
async fn a_chunked_check_sent_after_100_continue_is_decided() {
    let service = start().await;
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    let head = "POST /v1/check HTTP/1.1\r\nHost: spillway.test\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n";
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    let go_on = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(go_on.status, 100, "{go_on:?}");
    let body = r#"{"rule": "once", "key": "ip=chunked"}"#;
    let (a, b) = body.split_at(10);
    let chunked = format!(
        "{:x}\r\n{a}\r\n{:x};ext=1\r\n{b}\r\n0\r\nTrailer: t\r\n\r\n",
        a.len(),
        b.len()
    );
    stream.write_all(chunked.as_bytes()).await.expect("write");
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["rules"][0]["key"], "ip=chunked");
    assert_eq!(answer.json()["allowed"], true);
}

#[tokio::test]
async fn a_body_over_the_limit_gets_413_and_the_connection_closes() {
    let service = start().await;
    let limit = spillway_server::api::MAX_BODY_BYTES;
    // Said by its length: refused before it is read.
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    let head = format!(
        "POST /v1/check HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: {}\r\n\r\n",
        limit + 1
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(answer.json()["status"], 413);
    assert_eq!(answer.header("connection"), Some("close"));
    assert!(closes(&mut stream).await);
    // Chunked: refused once it has grown past the limit.
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    let head =
        "POST /v1/check HTTP/1.1\r\nHost: spillway.test\r\nTransfer-Encoding: chunked\r\n\r\n";
    let chunk = vec![b' '; 16 * 1024];
    let mut request = head.as_bytes().to_vec();
    for _ in 0..=limit / chunk.len() {
        request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend_from_slice(&chunk);
        request.extend_from_slice(b"\r\n");
    }
    stream.write_all(&request).await.expect("write");
    let mut buf = Vec::new();
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    // A body at the limit is read (and found not to be JSON).
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    let head = format!(
        "POST /v1/check HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: {limit}\r\n\r\n"
    );
    let mut request = head.into_bytes();
    request.resize(request.len() + limit, b'x');
    stream.write_all(&request).await.expect("write");
    let mut buf = Vec::new();
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.status, 400, "{answer:?}");
    assert!(
        answer.json()["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("The body is not valid JSON")),
        "{answer:?}"
    );
}

#[tokio::test]
async fn heads_that_cannot_be_read_safely_are_refused() {
    let service = start().await;
    let refused: [(&[u8], u16); 4] = [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (
            b"POST /v1/check HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
        ),
        (
            b"POST /v1/check HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
            400,
        ),
        (
            b"POST /v1/check HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n",
            400,
        ),
    ];
    for (request, status) in refused {
        let mut stream = TcpStream::connect(service.addr).await.expect("connect");
        stream.write_all(request).await.expect("write");
        let mut buf = Vec::new();
        let answer = read_response(&mut stream, &mut buf, false).await;
        assert_eq!(answer.status, status, "{request:?}: {answer:?}");
        assert_eq!(answer.json()["status"], status);
        assert!(closes(&mut stream).await, "{request:?}");
    }
    // A head over 64 KiB: 431.
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    let mut request = b"GET /healthz HTTP/1.1\r\nHost: a\r\nX-Big: ".to_vec();
    request.resize(request.len() + 70 * 1024, b'a');
    let _ = stream.write_all(&request).await;
    let mut buf = Vec::new();
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.status, 431, "{answer:?}");
}

#[tokio::test]
async fn http_1_0_closes_unless_the_client_asks_to_keep_it() {
    let service = start().await;
    let body = r#"{"rule": "once", "key": "ip=old"}"#;
    let request = |connection: &str| post("/v1/check HTTP/1.0", connection, body);
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    stream.write_all(&request("")).await.expect("write");
    let mut buf = Vec::new();
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["allowed"], true);
    assert_eq!(answer.header("connection"), Some("close"));
    assert!(closes(&mut stream).await);

    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    let kept = request("Connection: keep-alive\r\n");
    stream.write_all(&kept).await.expect("write");
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.json()["allowed"], false, "the second check of `old`");
    assert_eq!(answer.header("connection"), Some("keep-alive"));
    stream
        .write_all(b"GET /healthz HTTP/1.0\r\n\r\n")
        .await
        .expect("write");
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.status, 200);
}

#[tokio::test]
async fn a_head_request_gets_the_length_without_the_body() {
    let service = start().await;
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    stream
        .write_all(
            b"HEAD /healthz HTTP/1.1\r\nHost: a\r\n\r\nGET /healthz HTTP/1.1\r\nHost: a\r\n\r\n",
        )
        .await
        .expect("write");
    let mut buf = Vec::new();
    let head = read_response(&mut stream, &mut buf, true).await;
    let get = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(head.status, 200);
    assert_eq!(
        head.header("content-length"),
        Some(get.body.len().to_string().as_str()),
        "{head:?}"
    );
    // Had the HEAD response carried a body, the GET's would not parse.
    assert_eq!(get.json()["status"], "ok");
}

#[tokio::test]
async fn the_in_flight_gauge_counts_a_routed_request_once() {
    let service = start().await;
    // The metrics request itself is the one in flight.
    let in_flight = service
        .http
        .metric("spillway_http_requests_in_flight")
        .await;
    assert_eq!(in_flight, Some(1.0));
    // And none once it is answered: a check moves it up and back.
    decides_with_nothing_in_flight(&service, "gauge").await;
}

#[tokio::test]
async fn http2_clients_get_the_same_api() {
    let service = start().await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let ask = |key: &str| {
        Request::builder()
            .method(Method::POST)
            .uri(format!("http://{}/v1/check", service.addr))
            .body(Full::new(Bytes::from(format!(
                r#"{{"rule": "once", "key": "ip={key}"}}"#
            ))))
            .expect("a request")
    };
    for allowed in [true, false] {
        let res = tokio::time::timeout(WAIT, client.request(ask("h2")))
            .await
            .expect("in time")
            .expect("an HTTP/2 answer");
        assert_eq!(res.version(), http::Version::HTTP_2);
        assert_eq!(res.status(), StatusCode::OK);
        let body = res.into_body().collect().await.expect("a body").to_bytes();
        let body: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(body["allowed"], allowed, "{body}");
    }
}

#[tokio::test]
async fn stopping_closes_idle_connections_and_returns() {
    let mut service = start().await;
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    stream.write_all(&check("idle")).await.expect("write");
    let mut buf = Vec::new();
    let answer = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(answer.status, 200);
    // Now idle between requests.
    let stopped = service.shutdown();
    assert!(closes(&mut stream).await, "the idle connection is closed");
    tokio::time::timeout(WAIT, stopped)
        .await
        .expect("run() returns")
        .expect("no panic")
        .expect("no error");
}

/// A client that stops in the middle of a head (told so with a 408), or
/// stays idle between requests, or sends nothing at all, is closed once
/// 30 s have passed since the head was due (tokio's paused time: no test
/// waits 30 s).
#[tokio::test(start_paused = true)]
async fn silent_clients_are_closed_after_30_seconds() {
    let service = start().await;
    let cases: [(&str, &[u8]); 3] = [
        ("silent since it connected", b""),
        ("half a head", b"GET /healthz HTTP/1.1\r\nHost: a\r\n"),
        (
            "idle after a request",
            b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n",
        ),
    ];
    for (what, sent) in cases {
        let mut stream = TcpStream::connect(service.addr).await.expect("connect");
        stream.write_all(sent).await.expect("write");
        let started = tokio::time::Instant::now();
        let mut got = Vec::new();
        // Paused time runs ahead while everything waits: the bound is on
        // the server's clock, not the wall's.
        let read =
            tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut got)).await;
        let waited = started.elapsed();
        assert!(read.is_ok(), "{what}: closed within 60 s");
        assert!(
            waited >= Duration::from_secs(29),
            "{what}: closed after {waited:?}, before the 30 s"
        );
        let answer = String::from_utf8_lossy(&got);
        if sent.ends_with(b"\r\n\r\n") {
            assert!(answer.starts_with("HTTP/1.1 200 OK"), "{what}: {answer}");
            assert!(!answer.contains(" 408 "), "{what}: idle is just closed");
        } else if !sent.is_empty() {
            assert!(answer.starts_with("HTTP/1.1 408 "), "{what}: {answer}");
        }
    }
}

/// A key written with JSON escapes is the same key as written plainly (the
/// body's strings are borrowed when they can be, decoded when escaped).
#[tokio::test]
async fn an_escaped_key_is_the_same_key_as_the_plain_one() {
    let service = start().await;
    // The escaped form, as raw bytes (a JSON library would write é plainly).
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    let escaped = r#"{"rule": "once", "key": "ip=a\"b\u00e9\n"}"#;
    let request = post("/v1/check HTTP/1.1", "Host: a\r\n", escaped);
    stream.write_all(&request).await.expect("write");
    let mut buf = Vec::new();
    let first = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(first.json()["allowed"], true, "{first:?}");
    assert_eq!(first.json()["rules"][0]["key"], "ip=a\"bé\n");
    // The same key, é unescaped (serde_json escapes only the quote and the
    // newline): counted under the same key, so denied.
    let plain = serde_json::json!({"rule": "once", "key": "ip=a\"bé\n"});
    let second = service.http.check(plain).await;
    assert_eq!(second.json()["allowed"], false, "{}", second.text());
    assert_eq!(second.json()["rules"][0]["key"], "ip=a\"bé\n");
}

/// `/v1/check` with a query string is a check; a path that only starts
/// like it is not.
#[tokio::test]
async fn only_the_check_path_is_a_check_query_or_not() {
    let service = start().await;
    let body = r#"{"rule": "once", "key": "ip=q"}"#;
    let request = |target: &str| post(&format!("{target} HTTP/1.1"), "Host: a\r\n", body);
    let mut stream = TcpStream::connect(service.addr).await.expect("connect");
    let mut buf = Vec::new();
    stream
        .write_all(&request("/v1/check?trace=1"))
        .await
        .expect("write");
    let with_query = read_response(&mut stream, &mut buf, false).await;
    assert_eq!(with_query.status, 200, "{with_query:?}");
    assert_eq!(with_query.json()["allowed"], true);
    for other in ["/v1/checker", "/v1/check/more"] {
        stream.write_all(&request(other)).await.expect("write");
        let answer = read_response(&mut stream, &mut buf, false).await;
        assert_eq!(answer.status, 404, "{other}: {answer:?}");
    }
}

#[tokio::test]
async fn mangled_requests_get_4xx_or_an_answer_and_never_hang_or_break_the_server() {
    let service = start().await;
    for seed in [0x5eed_1e55_c0ff_ee00, 7, 0xdead_beef] {
        let (statuses, answered) = mangle::send_mangled(service.addr, seed).await;
        // Not all refused at the first byte: some decided, some routed,
        // some refused for their framing, their size or their JSON.
        assert!(answered > 150, "seed {seed}: {answered} of 300 answered");
        for status in ["200", "400", "404", "405", "413"] {
            assert!(
                statuses.iter().any(|s| s == status),
                "seed {seed}: no {status} among {statuses:?}"
            );
        }
    }
    // The server still serves, and nothing is left in flight.
    decides_with_nothing_in_flight(&service, "after").await;
}

/// A check of `key` is answered, and then the only request in flight is the
/// one that reads the gauge.
async fn decides_with_nothing_in_flight(service: &Service, key: &str) {
    let answer = service
        .http
        .check(serde_json::json!({"rule": "once", "key": format!("ip={key}")}))
        .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        service
            .http
            .metric("spillway_http_requests_in_flight")
            .await,
        Some(1.0),
        "the metrics request alone"
    );
}

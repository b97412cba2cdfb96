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
    let body = format!(r#"{{"rule": "three", "key": "{key}"}}"#);
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
    let body = json!({"rule": "three", "key": key, "cost": 0}).to_string();
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
        req.body(Full::new(Bytes::from(r#"{"rule": "three", "key": "h2"}"#)))
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

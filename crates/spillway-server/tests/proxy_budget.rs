//! Budgets through `spillway proxy`, on real sockets: a token budget in
//! front of an OpenAI-style upstream reserves what the request body asks,
//! forwards the body byte for byte, settles at the response's usage, and
//! cuts a stream at the budget.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use spillway::store::{Check, RuleId, Store};
use spillway_conformance::redis_server::RedisServer;
use spillway_server::config::Config;
use spillway_server::proxy::serve;
use spillway_server::state::{Live, Loaded};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The prompt's tokens the upstream reports, whatever the request.
const PROMPT_TOKENS: u64 = 5;

type Body = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

/// An OpenAI-style upstream: a POST body `{"deltas": N, "stream": bool}`
/// is answered with N content deltas (an event each, then the usage, when
/// streamed) or a JSON completion; every body it received is kept.
async fn upstream(received: Arc<Mutex<Vec<Bytes>>>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let received = received.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let received = received.clone();
                    async move {
                        let body = req.into_body().collect().await?.to_bytes();
                        received.lock().expect("not poisoned").push(body.clone());
                        let asked: serde_json::Value =
                            serde_json::from_slice(&body).unwrap_or_default();
                        let deltas = asked["deltas"].as_u64().unwrap_or(1);
                        Ok::<_, hyper::Error>(completion(deltas, asked["stream"] == true))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn completion(deltas: u64, stream: bool) -> Response<Body> {
    let total = PROMPT_TOKENS + deltas;
    let usage = format!(
        r#"{{"prompt_tokens":{PROMPT_TOKENS},"completion_tokens":{deltas},"total_tokens":{total}}}"#
    );
    if !stream {
        let body = format!(r#"{{"choices":[{{"message":{{"content":"hi"}}}}],"usage":{usage}}}"#);
        return Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)).boxed())
            .expect("a response");
    }
    let mut events: std::collections::VecDeque<Frame<Bytes>> = (0..deltas)
        .map(|i| {
            Frame::data(Bytes::from(format!(
                "data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
            )))
        })
        .collect();
    events.push_back(Frame::data(Bytes::from(format!(
        "data: {{\"choices\":[],\"usage\":{usage}}}\n\ndata: [DONE]\n\n"
    ))));
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Frames(events).boxed())
        .expect("a response")
}

/// A body of the frames given, each its own write.
struct Frames(std::collections::VecDeque<Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.pop_front().map(Ok))
    }
}

const BUDGET: u64 = 100;

fn config(overrun: &str) -> String {
    format!(
        r#"
[[rules]]
name = "tokens"
key = ["ip"]
match = {{ path = "/v1/chat/completions", methods = ["POST"] }}
algorithm = "token_bucket"
limit = {BUDGET}
window = "1h"
cost = "response:usage"
reserve = "request:json:max_tokens"
reserve_default = 10
on_overrun = "{overrun}"
"#
    )
}

struct Running {
    addr: SocketAddr,
    shared: Arc<Live>,
    received: Arc<Mutex<Vec<Bytes>>>,
    _stop: oneshot::Sender<()>,
}

async fn start(config: &str) -> Running {
    let received = Arc::new(Mutex::new(Vec::new()));
    let upstream = upstream(received.clone()).await;
    let config = Config::parse(config).expect("a valid config");
    let shared = Arc::new(Live::new(
        Loaded::build(config, None, None).await.expect("an engine"),
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    let (stop, stopped) = oneshot::channel::<()>();
    let url = format!("http://{upstream}").parse().expect("a URL");
    tokio::spawn(serve(listener, url, shared.clone(), async move {
        let _ = stopped.await;
    }));
    Running {
        addr,
        shared,
        received,
        _stop: stop,
    }
}

impl Running {
    async fn post(&self, body: &str) -> (StatusCode, http::HeaderMap, String) {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let req = Request::post(format!("http://{}/v1/chat/completions", self.addr))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("a request");
        let res = client.request(req).await.expect("a response");
        let (parts, body) = res.into_parts();
        let body = body.collect().await.expect("the body").to_bytes();
        let body = String::from_utf8(body.to_vec()).expect("utf-8");
        (parts.status, parts.headers, body)
    }

    /// What the client's key has left.
    async fn left(&self) -> u64 {
        let engine = self.shared.current();
        let check = [Check {
            rule: RuleId(0),
            key: "ip=127.0.0.1",
            cost: 0,
        }];
        let verdict = engine.store().check(&check).await.expect("a peek");
        verdict.decisions[0].remaining
    }

    /// What the key has left once it is `expected`, or what it has after
    /// two seconds (the settle runs after the response's end has been
    /// sent).
    async fn left_once(&self, expected: u64) -> u64 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            let left = self.left().await;
            if left == expected || tokio::time::Instant::now() > deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The prompt's estimate: a quarter of the bytes of the body's strings,
/// rounded up.
fn estimate(strings: &[&str]) -> u64 {
    (strings.iter().map(|s| s.len() as u64).sum::<u64>()).div_ceil(4)
}

#[tokio::test]
async fn a_request_reserves_what_it_asks_and_pays_its_usage() {
    let proxy = start(&config("finish")).await;
    let body = r#"{"model":"m","max_tokens":20,"messages":[{"role":"user","content":"abcdefgh"}],"deltas":7}"#;
    let (status, headers, answer) = proxy.post(body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let reserved = 20 + estimate(&["m", "user", "abcdefgh"]);
    let remaining: u64 = headers["x-ratelimit-remaining"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("a number");
    assert_eq!(remaining, BUDGET - reserved, "the reservation");
    // The upstream got the body byte for byte.
    assert_eq!(
        proxy.received.lock().expect("not poisoned")[0],
        body.as_bytes()
    );
    let paid = PROMPT_TOKENS + 7;
    assert_eq!(proxy.left_once(BUDGET - paid).await, BUDGET - paid);
}

#[tokio::test]
async fn a_stream_is_cut_at_the_budget_and_the_next_request_denied() {
    let proxy = start(&config("cut")).await;
    let body = r#"{"max_tokens":10,"stream":true,"deltas":500}"#;
    let (status, _, answer) = proxy.post(body).await;
    assert_eq!(status, StatusCode::OK);
    let events: Vec<&str> = answer.split("\n\n").filter(|e| !e.is_empty()).collect();
    let deltas = events.iter().filter(|e| e.contains("\"content\"")).count() as u64;
    // The prompt's estimate is counted with the deltas until the usage
    // comes (it never does: the stream is cut first).
    assert_eq!(deltas + estimate(&[]), BUDGET, "{answer}");
    assert!(
        events[deltas as usize].starts_with("event: error\ndata: "),
        "{answer}"
    );
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    assert_eq!(proxy.left_once(0).await, 0);
    let (status, headers, _) = proxy.post(body).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(headers.contains_key("retry-after"));
}

#[tokio::test]
async fn a_body_that_is_not_json_reserves_the_default_and_reaches_the_upstream_intact() {
    let proxy = start(&config("finish")).await;
    let body = "max_tokens=90&deltas=3";
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::post(format!("http://{}/v1/chat/completions", proxy.addr))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Full::new(Bytes::from(body)))
        .expect("a request");
    let res = client.request(req).await.expect("a response");
    let remaining = res.headers()["x-ratelimit-remaining"]
        .to_str()
        .expect("ascii")
        .to_string();
    assert_eq!(remaining, (BUDGET - 10).to_string(), "reserve_default");
    let _ = res.into_body().collect().await;
    assert_eq!(
        proxy.received.lock().expect("not poisoned")[0],
        body.as_bytes()
    );
}

#[tokio::test]
async fn a_body_json_cannot_read_reserves_the_most_and_reaches_the_upstream_intact() {
    // Python's json reads `NaN`; serde_json does not. What the request
    // asks is unknown: it reserves `max_reserve` (half the budget), not
    // the default.
    let proxy = start(&config("finish")).await;
    let body = r#"{"max_tokens":90,"temperature":NaN,"deltas":3}"#;
    let (_, headers, _) = proxy.post(body).await;
    assert_eq!(headers["x-ratelimit-remaining"], (BUDGET / 2).to_string());
    assert_eq!(
        proxy.received.lock().expect("not poisoned")[0],
        body.as_bytes()
    );
}

#[tokio::test]
async fn a_body_cut_short_never_reaches_the_upstream_whole() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The client declares 1,000 bytes, sends a short JSON body that asks
    // for 90, then half-closes. Replayed with the length of what came, it
    // was a whole request to the upstream, served in full for a default
    // reservation.
    let proxy = start(&config("finish")).await;
    let body = r#"{"max_tokens":90,"deltas":3,"stream":false}"#;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect");
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\
                Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n";
    stream.write_all(head.as_bytes()).await.expect("write");
    stream.write_all(body.as_bytes()).await.expect("write");
    stream.shutdown().await.expect("half-close");
    let mut answer = Vec::new();
    let read = stream.read_to_end(&mut answer);
    let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        proxy.received.lock().expect("not poisoned").is_empty(),
        "the upstream got a whole body"
    );
}

/// The same budget on a real redis-server: the reservation, the settle and
/// the charges a cut stream makes as it goes are script calls.
fn on_redis(config: &str, url: &str) -> String {
    format!(
        "[store]\nkind = \"redis\"\nurl = \"{url}\"\ntimeout = \"2s\"\non_error = \"fail_closed\"\n{config}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_request_pays_its_usage_and_a_stream_is_cut_at_the_budget() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let proxy = start(&on_redis(&config("cut"), &redis.url())).await;
    let body = r#"{"max_tokens":30,"deltas":12}"#;
    let (status, headers, _) = proxy.post(body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        headers["x-ratelimit-remaining"],
        (BUDGET - 30).to_string().as_str()
    );
    let paid = PROMPT_TOKENS + 12;
    assert_eq!(proxy.left_once(BUDGET - paid).await, BUDGET - paid);

    let (status, _, answer) = proxy
        .post(r#"{"max_tokens":10,"stream":true,"deltas":500}"#)
        .await;
    assert_eq!(status, StatusCode::OK);
    let deltas = answer.matches("\"content\"").count() as u64;
    assert_eq!(deltas, BUDGET - paid, "{answer}");
    assert!(answer.contains("event: error\ndata: "), "{answer}");
    assert_eq!(proxy.left_once(0).await, 0);
}

//! SIGTERM under load, to the real `spillway serve` and `spillway proxy`,
//! seen at the TCP level: every request in flight gets a whole answer, no
//! connection is reset, queued (shaped) requests are answered 503 with
//! `Retry-After` at once, and a stuck client holds the exit no longer than
//! `[server] drain_timeout`. See docs/server.md and docs/proxy.md,
//! "Shutdown".

mod process_support;
mod serve_support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use process_support::{Conn, Cut, Process, Upstream, check_request};
use prost::Message;
use serve_support::{Http, eventually, temp_dir, write_atomically};
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use spillway_server::envoy::rls::rate_limit_response::Code;
use spillway_server::envoy::rls::{RateLimitRequest, RateLimitResponse};
use tokio::sync::mpsc;

/// Requests in flight at the signal.
const IN_FLIGHT: usize = 200;
/// Idle kept-alive connections at the signal.
const IDLE: usize = 20;
/// gRPC calls in flight at the signal, over two connections.
const CALLS: usize = 20;

const SERVE_CONFIG: &str = r#"
[envoy]
domain = "spillway"

[[rules]]
name = "a"
algorithm = "sliding_log"
limit = 1000000
window = "1h"
descriptors = ["user"]
"#;

fn serve(dir: &Path, config: &str) -> Process {
    let path = dir.join("spillway.toml");
    write_atomically(&path, config);
    Process::start(
        "serve",
        &[
            "--config",
            "spillway.toml",
            "--listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
        ],
        dir,
    )
}

/// A request body sent as it is given.
struct Trickle(mpsc::Receiver<Bytes>);

impl http_body::Body for Trickle {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// A `ShouldRateLimit` message for `user`, framed as gRPC sends it.
fn grpc_message(user: &str) -> Vec<u8> {
    let request = RateLimitRequest {
        domain: "spillway".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: user.into(),
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    };
    let message = request.encode_to_vec();
    let mut framed = vec![0];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(&message);
    framed
}

type GrpcSender = hyper::client::conn::http2::SendRequest<Trickle>;
type GrpcAnswer = tokio::task::JoinHandle<Result<Code, String>>;

async fn grpc_connection(addr: SocketAddr) -> GrpcSender {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("an HTTP/2 connection");
    tokio::spawn(conn);
    sender
}

/// Starts a call whose message goes only as far as `sent` bytes; the rest
/// is for the returned sender. The answer is the call's overall code, or
/// what went wrong.
fn grpc_call(
    sender: &GrpcSender,
    addr: SocketAddr,
    user: &str,
    sent: usize,
) -> (mpsc::Sender<Bytes>, Bytes, GrpcAnswer) {
    let message = grpc_message(user);
    let sent = sent.min(message.len());
    let (tx, rx) = mpsc::channel(4);
    tx.try_send(Bytes::copy_from_slice(&message[..sent]))
        .expect("room");
    let req = http::Request::post(format!(
        "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(Trickle(rx))
    .expect("a request");
    let mut sender = sender.clone();
    let answer = tokio::spawn(async move {
        let res = sender
            .send_request(req)
            .await
            .map_err(|e| format!("no response: {e}"))?;
        let collected = res
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("a cut body: {e}"))?;
        let status = collected
            .trailers()
            .and_then(|t| t.get("grpc-status"))
            .and_then(|v| v.to_str().ok().map(str::to_owned));
        if status.as_deref() != Some("0") {
            return Err(format!("grpc-status {status:?}"));
        }
        let body = collected.to_bytes();
        let answer = RateLimitResponse::decode(body.get(5..).unwrap_or_default())
            .map_err(|e| format!("not a RateLimitResponse: {e}"))?;
        Ok(Code::try_from(answer.overall_code).unwrap_or(Code::Unknown))
    });
    (tx, Bytes::copy_from_slice(&message[sent..]), answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_serve_answers_every_request_in_flight_and_resets_none() {
    let dir = temp_dir("shutdown-serve");
    let mut server = serve(&dir, SERVE_CONFIG);
    let grpc = server.grpc.expect("a gRPC address");
    let http = Http::new(server.addr);

    // Each connection kept alive by a first request, then the head and
    // half the body of a second: in flight, and known to be so.
    let mut flying = Vec::new();
    for i in 0..IN_FLIGHT {
        let mut conn = Conn::connect(server.addr).await;
        let (whole, head, rest) = check_request("a", &format!("k{i}"));
        conn.send(&whole).await.expect("sent");
        let first = conn
            .response(Duration::from_secs(10))
            .await
            .expect("answered");
        assert_eq!(first.status, 200, "{}", first.text());
        conn.send(&head).await.expect("sent");
        flying.push((conn, rest));
    }
    let mut idle = Vec::new();
    for i in 0..IDLE {
        let mut conn = Conn::connect(server.addr).await;
        conn.send(&check_request("a", &format!("idle{i}")).0)
            .await
            .expect("sent");
        assert_eq!(
            conn.response(Duration::from_secs(10))
                .await
                .expect("answered")
                .status,
            200
        );
        idle.push(conn);
    }
    // gRPC calls with half their message sent; then a whole one on each
    // connection, whose answer shows the server has opened the others
    // (their streams came first on the connection).
    let mut calls = Vec::new();
    let mut senders = Vec::new();
    for c in 0..2 {
        let sender = grpc_connection(grpc).await;
        for i in 0..CALLS / 2 {
            calls.push(grpc_call(&sender, grpc, &format!("g{c}-{i}"), 9));
        }
        let (_, _, probe) = grpc_call(&sender, grpc, "probe", usize::MAX);
        assert_eq!(probe.await.expect("joined"), Ok(Code::Ok));
        senders.push(sender);
    }
    eventually(Duration::from_secs(10), "every request in flight", || {
        let http = http.clone();
        async move {
            // Ours, and the one asking.
            http.metric("spillway_http_requests_in_flight").await == Some((IN_FLIGHT + 1) as f64)
        }
    })
    .await;

    server.signal("TERM");
    server.wait_for("shutting down");
    assert!(server.running(), "still draining");

    // Idle connections are closed, cleanly.
    for (i, conn) in idle.iter_mut().enumerate() {
        assert_eq!(
            conn.closed(Duration::from_secs(5)).await,
            Ok(()),
            "idle {i}"
        );
    }
    // No new connection is accepted.
    eventually(Duration::from_secs(5), "the listener closed", || async {
        tokio::net::TcpStream::connect(server.addr).await.is_err()
    })
    .await;
    assert!(server.running(), "still draining");

    // Every request in flight is answered whole, told the connection
    // closes, and the connection ends cleanly.
    for (conn, rest) in &mut flying {
        conn.send(rest).await.expect("the rest sent");
    }
    for (i, (conn, _)) in flying.iter_mut().enumerate() {
        let answer = conn
            .response(Duration::from_secs(10))
            .await
            .unwrap_or_else(|cut| panic!("request {i}: {cut:?}"));
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert!(
            answer.text().contains("\"allowed\":true"),
            "{}",
            answer.text()
        );
        assert!(answer.closes(), "request {i}: {:?}", answer.headers);
        assert_eq!(
            conn.closed(Duration::from_secs(5)).await,
            Ok(()),
            "request {i}"
        );
    }
    for (i, (tx, rest, answer)) in calls.into_iter().enumerate() {
        tx.send(rest).await.expect("the rest sent");
        drop(tx);
        let code = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .unwrap_or_else(|_| panic!("call {i} unanswered"))
            .expect("joined");
        assert_eq!(code, Ok(Code::Ok), "call {i}");
    }
    let status = server.exited_within(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_client_holds_the_exit_no_longer_than_the_drain_timeout() {
    let dir = temp_dir("shutdown-stuck");
    let config =
        format!("[server]\nbody_timeout = \"60s\"\ndrain_timeout = \"1s\"\n{SERVE_CONFIG}");
    let mut server = serve(&dir, &config);
    let grpc = server.grpc.expect("a gRPC address");
    let http = Http::new(server.addr);
    // Half a request, and half a call, whose rest never comes.
    let mut stuck = Conn::connect(server.addr).await;
    stuck
        .send(&check_request("a", "stuck").1)
        .await
        .expect("sent");
    let sender = grpc_connection(grpc).await;
    let (_keep, _, _answer) = grpc_call(&sender, grpc, "stuck", 9);
    let (_, _, probe) = grpc_call(&sender, grpc, "probe", usize::MAX);
    assert_eq!(probe.await.expect("joined"), Ok(Code::Ok));
    eventually(Duration::from_secs(10), "the request in flight", || {
        let http = http.clone();
        async move { http.metric("spillway_http_requests_in_flight").await == Some(2.0) }
    })
    .await;

    let signalled = Instant::now();
    server.signal("TERM");
    let status = server.exited_within(Duration::from_secs(8)).await;
    let took = signalled.elapsed();
    assert!(status.success(), "{status}");
    assert!(
        took >= Duration::from_secs(1),
        "the drain waited its second: {took:?}"
    );
    let log = server.log();
    assert!(log.contains("the drain took longer than 1s"), "{log}");
    assert!(log.contains("the gRPC drain took longer than 1s"), "{log}");
}

/// Keep-alive clients sending request after request while the signal
/// comes: each request sent before the signal is answered; after it, a
/// request is answered or its connection closed cleanly before any byte of
/// an answer (a client may retry that on another instance); never a reset
/// or a cut answer.
async fn race_sigterm(mut server: Process, request: Vec<u8>) {
    const CLIENTS: usize = 32;
    let addr = server.addr;
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Per request: when its write returned, and how it ended.
    type Record = (Instant, Result<u16, Cut>);
    let records: Arc<Mutex<Vec<Record>>> = Arc::new(Mutex::new(Vec::new()));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (answered, records, request) = (answered.clone(), records.clone(), request.clone());
        clients.push(tokio::spawn(async move {
            'connections: loop {
                let Ok(stream) = tokio::net::TcpStream::connect(addr).await else {
                    return;
                };
                let mut conn = Conn::new(stream);
                loop {
                    let sent = conn.send(&request).await;
                    let written = Instant::now();
                    let ended = match sent {
                        Err(cut) => Err(cut),
                        Ok(()) => conn.response(Duration::from_secs(10)).await.map(|a| {
                            answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            (a.status, a.closes())
                        }),
                    };
                    let again = matches!(ended, Ok((_, false)));
                    records
                        .lock()
                        .expect("records")
                        .push((written, ended.map(|(status, _)| status)));
                    if !again {
                        continue 'connections;
                    }
                }
            }
        }));
    }
    eventually(Duration::from_secs(30), "traffic", || {
        let answered = answered.clone();
        async move { answered.load(std::sync::atomic::Ordering::Relaxed) >= 3000 }
    })
    .await;
    let before_signal = Instant::now();
    server.signal("TERM");
    for client in clients {
        tokio::time::timeout(Duration::from_secs(20), client)
            .await
            .expect("every client ends")
            .expect("joined");
    }
    let status = server.exited_within(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
    let records = records.lock().expect("records");
    let mut closed_after = 0;
    for (written, ended) in records.iter() {
        match ended {
            Ok(200) => {}
            Ok(other) => panic!("a {other} answer"),
            Err(Cut::Closed) if *written > before_signal => closed_after += 1,
            Err(cut) => panic!(
                "a request written {} the signal ended {cut:?}",
                if *written > before_signal {
                    "after"
                } else {
                    "before"
                }
            ),
        }
    }
    eprintln!(
        "{} requests, {closed_after} sent after the signal on a connection it closed",
        records.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_clients_racing_sigterm_to_serve_see_answers_or_a_clean_close() {
    let dir = temp_dir("shutdown-race");
    let server = serve(&dir, SERVE_CONFIG);
    race_sigterm(server, check_request("a", "race").0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_clients_racing_sigterm_to_the_proxy_see_answers_or_a_clean_close() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("shutdown-proxy-race");
    let proxy = proxy(&dir, &upstream);
    race_sigterm(proxy, b"GET /fast HTTP/1.1\r\nhost: app\r\n\r\n".to_vec()).await;
}

fn proxy(dir: &Path, upstream: &Upstream) -> Process {
    write_atomically(&dir.join("spillway.toml"), PROXY_CONFIG);
    let upstream_url = format!("http://{}", upstream.addr);
    Process::start(
        "proxy",
        &[
            "--config",
            "spillway.toml",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream_url,
        ],
        dir,
    )
}

const PROXY_CONFIG: &str = r#"
[[rules]]
name = "shaped"
match = { path = "/shaped" }
algorithm = "leaky_bucket"
mode = "shape"
limit = 1
window = "10s"
burst = 100
"#;

/// Queued (shaped) requests at the signal.
const QUEUED: usize = 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_the_proxy_finishes_requests_in_flight_and_answers_queued_ones_503() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("shutdown-proxy");
    let mut proxy = proxy(&dir, &upstream);
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nhost: app\r\n\r\n").into_bytes();

    let mut idle = Vec::new();
    for _ in 0..IDLE {
        let mut conn = Conn::connect(proxy.addr).await;
        conn.send(&get("/fast")).await.expect("sent");
        assert_eq!(
            conn.response(Duration::from_secs(10))
                .await
                .expect("answered")
                .status,
            200
        );
        idle.push(conn);
    }
    // In flight: held by the upstream.
    let mut flying = Vec::new();
    for _ in 0..IN_FLIGHT {
        let mut conn = Conn::connect(proxy.addr).await;
        conn.send(&get("/hold")).await.expect("sent");
        flying.push(conn);
    }
    eventually(
        Duration::from_secs(10),
        "the upstream holds them all",
        || async { upstream.holding() == IN_FLIGHT },
    )
    .await;
    // Queued: the first shaped request leaves at once, the next ones wait
    // 10 s apiece.
    let mut first = Conn::connect(proxy.addr).await;
    first.send(&get("/shaped")).await.expect("sent");
    assert_eq!(
        first
            .response(Duration::from_secs(10))
            .await
            .expect("answered")
            .status,
        200
    );
    let mut queued = Vec::new();
    for _ in 0..QUEUED {
        let mut conn = Conn::connect(proxy.addr).await;
        conn.send(&get("/shaped")).await.expect("sent");
        queued.push(conn);
    }

    proxy.signal("TERM");
    proxy.wait_for("shutting down");
    let signalled = Instant::now();
    // Each queued request is answered 503 at once, told when its turn would
    // have come, and never reaches the upstream.
    for (i, conn) in queued.iter_mut().enumerate() {
        let answer = conn
            .response(Duration::from_secs(5))
            .await
            .unwrap_or_else(|cut| panic!("queued {i}: {cut:?}"));
        assert_eq!(answer.status, 503, "queued {i}: {}", answer.text());
        let retry: u64 = answer.headers["retry-after"].parse().expect("seconds");
        assert!(
            (1..=10 * QUEUED as u64).contains(&retry),
            "queued {i}: {retry}"
        );
        assert!(answer.closes(), "queued {i}");
        assert_eq!(
            conn.closed(Duration::from_secs(5)).await,
            Ok(()),
            "queued {i}"
        );
    }
    assert!(signalled.elapsed() < Duration::from_secs(5));
    assert_eq!(
        upstream.arrived("/shaped"),
        1,
        "the queue never reached the upstream"
    );
    for (i, conn) in idle.iter_mut().enumerate() {
        assert_eq!(
            conn.closed(Duration::from_secs(5)).await,
            Ok(()),
            "idle {i}"
        );
    }
    assert!(proxy.running(), "still draining");

    upstream.release();
    for (i, conn) in flying.iter_mut().enumerate() {
        let answer = conn
            .response(Duration::from_secs(10))
            .await
            .unwrap_or_else(|cut| panic!("request {i}: {cut:?}"));
        assert_eq!(answer.status, 200, "request {i}");
        assert_eq!(answer.text(), "upstream");
        assert!(answer.closes(), "request {i}: {:?}", answer.headers);
        assert_eq!(
            conn.closed(Duration::from_secs(5)).await,
            Ok(()),
            "request {i}"
        );
    }
    let status = proxy.exited_within(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
}

/// Requests that arrive together with the signal (sent while the process
/// was stopped with SIGSTOP, then SIGTERM and SIGCONT): on kept-alive
/// connections, and on new connections still in the listener's backlog.
/// Each is answered whole, and its connection closed cleanly.
async fn arrive_with_the_signal(mut server: Process, request: &[u8]) {
    const EACH: usize = 20;
    let mut kept = Vec::new();
    for _ in 0..EACH {
        let mut conn = Conn::connect(server.addr).await;
        conn.send(request).await.expect("sent");
        let answer = conn
            .response(Duration::from_secs(10))
            .await
            .expect("answered");
        assert_eq!(answer.status, 200);
        kept.push(conn);
    }
    server.signal("STOP");
    let mut new = Vec::new();
    for _ in 0..EACH {
        // The kernel completes the handshake: the connection waits in the
        // backlog.
        let mut conn = Conn::connect(server.addr).await;
        conn.send(request).await.expect("sent");
        new.push(conn);
    }
    for conn in &mut kept {
        conn.send(request).await.expect("sent");
    }
    server.signal("TERM");
    server.signal("CONT");
    for (what, conns) in [("kept", &mut kept), ("new", &mut new)] {
        for (i, conn) in conns.iter_mut().enumerate() {
            let answer = conn
                .response(Duration::from_secs(10))
                .await
                .unwrap_or_else(|cut| panic!("{what} {i}: {cut:?}"));
            assert_eq!(answer.status, 200, "{what} {i}");
            // Told it closes, or answered before the server knew it stops:
            // either way, the server closes it cleanly next.
            assert_eq!(
                conn.closed(Duration::from_secs(5)).await,
                Ok(()),
                "{what} {i}"
            );
        }
    }
    let status = server.exited_within(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_arrive_with_the_signal_are_answered_by_serve() {
    let dir = temp_dir("shutdown-with-signal");
    let server = serve(&dir, SERVE_CONFIG);
    arrive_with_the_signal(server, &check_request("a", "k").0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_arrive_with_the_signal_are_answered_by_the_proxy() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("shutdown-proxy-with-signal");
    let proxy = proxy(&dir, &upstream);
    arrive_with_the_signal(proxy, b"GET /fast HTTP/1.1\r\nhost: app\r\n\r\n").await;
}

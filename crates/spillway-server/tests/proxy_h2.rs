//! `spillway proxy`'s bounds on HTTP/2 clients (issue 25, findings 4, 5
//! and 10), each tested with the hostile client against a real proxy on
//! port 0 and a raw upstream on 127.0.0.1 that counts the connections it
//! is given and the requests it reads.
//!
//! The clients are the `h2` crate's (which sends what hyper's client never
//! would: a flow-control window that never opens) or frames written by
//! hand (a stream reset in the same write as its HEADERS). The descriptor
//! tests run the `spillway` binary with a lowered open-file limit, as an
//! operator's `ulimit -n` would.

mod clock_support;
mod process_support;

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use http::{Method, Request, StatusCode};
use process_support::{Conn, Process};
use spillway_server::config::Config;
use spillway_server::proxy::{ProxyBounds, ProxyOptions, serve_with};
use spillway_server::state::{Live, Loaded};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The longest any one step may take: a bug fails the test instead of
/// hanging it.
const WAIT: Duration = Duration::from_secs(5);

/// A rule that never denies in these tests.
const GENEROUS: &str = r#"
[[rules]]
name = "generous"
key = ["ip"]
algorithm = "fixed_window"
limit = 100000
window = "1m"
"#;

/// The body `/big` answers with: larger than any window a client opens
/// before it reads.
const BIG: usize = 1024 * 1024;

async fn within<T>(what: &str, step: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, step).await {
        Ok(done) => done,
        Err(_) => panic!("{what}: nothing within {WAIT:?}"),
    }
}

/// Checks `done` every few milliseconds until it holds, for at most
/// [`WAIT`]: the counts below change in other tasks.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    within(what, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

/// What the upstream counts.
#[derive(Debug, Default)]
struct Counts {
    /// Connections accepted, open now, and the most open at once.
    accepted: AtomicUsize,
    open: AtomicUsize,
    peak: AtomicUsize,
    /// Request paths read, in order.
    paths: Mutex<Vec<String>>,
}

/// An open upstream connection, counted until dropped.
struct OpenConn(Arc<Counts>);

impl OpenConn {
    fn new(counts: Arc<Counts>) -> Self {
        counts.accepted.fetch_add(1, Ordering::SeqCst);
        let open = counts.open.fetch_add(1, Ordering::SeqCst) + 1;
        counts.peak.fetch_max(open, Ordering::SeqCst);
        Self(counts)
    }
}

impl Drop for OpenConn {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A raw HTTP/1.1 upstream. `GET`/`POST /hold` is held (its body never
/// read whole) until [`release`](Upstream::release) or until the proxy
/// closes the connection; `/big` is answered with [`BIG`] bytes; `GET
/// /wait` with `ok`, kept alive, once released; anything else with `ok` at
/// once, kept alive.
struct Upstream {
    addr: SocketAddr,
    counts: Arc<Counts>,
    release: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Upstream {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("an address");
        let counts = Arc::new(Counts::default());
        let (release, released) = watch::channel(false);
        let seen = counts.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let open = OpenConn::new(seen.clone());
                tokio::spawn(upstream_connection(stream, open, released.clone()));
            }
        });
        Self {
            addr,
            counts,
            release,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn accepted(&self) -> usize {
        self.counts.accepted.load(Ordering::SeqCst)
    }

    fn open(&self) -> usize {
        self.counts.open.load(Ordering::SeqCst)
    }

    fn peak(&self) -> usize {
        self.counts.peak.load(Ordering::SeqCst)
    }

    /// How many requests for `path` arrived.
    fn arrived(&self, path: &str) -> usize {
        let paths = self.counts.paths.lock().expect("paths");
        paths.iter().filter(|p| *p == path).count()
    }

    /// Answers the held requests, and every later one at once.
    fn release(&self) {
        let _ = self.release.send(true);
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn upstream_connection(
    mut stream: TcpStream,
    open: OpenConn,
    mut released: watch::Receiver<bool>,
) {
    let mut buf = Vec::new();
    let path = loop {
        let Some(path) = read_head(&mut stream, &mut buf).await else {
            return;
        };
        open.0.paths.lock().expect("paths").push(path.clone());
        if path == "/hold" || path == "/big" {
            break path;
        }
        if path == "/wait" && released.wait_for(|&r| r).await.is_err() {
            return;
        }
        // An answer that takes 20 ms.
        if path == "/slow" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        if stream.write_all(ok).await.is_err() {
            return;
        }
    };
    let (mut reading, mut writing) = stream.into_split();
    // What the proxy sends from now on is read and dropped: its end (the
    // proxy closing the connection) ends the connection here.
    let mut closed = std::pin::pin!(async move {
        let mut chunk = [0; 8192];
        while matches!(reading.read(&mut chunk).await, Ok(n) if n > 0) {}
    });
    let answer = if path == "/hold" {
        tokio::select! {
            _ = released.wait_for(|&r| r) => {}
            () = closed.as_mut() => return,
        }
        b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\nheld".to_vec()
    } else {
        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {BIG}\r\n\r\n");
        [head.as_bytes(), &vec![b'x'; BIG]].concat()
    };
    tokio::select! {
        _ = writing.write_all(&answer) => {}
        () = closed.as_mut() => return,
    }
    closed.await;
}

/// Reads a request head off `stream`; its path, or none at the end of the
/// connection.
async fn read_head(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        let mut lines = [httparse::EMPTY_HEADER; 64];
        let mut head = httparse::Request::new(&mut lines);
        if let Ok(httparse::Status::Complete(len)) = head.parse(buf) {
            let path = head.path.unwrap_or_default().to_owned();
            buf.drain(..len);
            return Some(path);
        }
        let mut chunk = [0; 8192];
        match stream.read(&mut chunk).await {
            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    }
}

/// Starts a proxy in front of `upstream` whose pool for HTTP/2 clients has
/// `cap` slots, a request waiting up to `connect_timeout` for one.
async fn start_capped(upstream: &Upstream, cap: usize, connect_timeout: Duration) -> SocketAddr {
    let bounds = ProxyBounds {
        pool_max_connections: NonZeroUsize::new(cap).expect("nonzero"),
        ..ProxyBounds::default()
    };
    let options = ProxyOptions {
        bounds,
        connect_timeout,
        ..ProxyOptions::default()
    };
    start_proxy(upstream, options).await
}

/// Starts a proxy in front of `upstream` with `options`; returns its
/// address.
async fn start_proxy(upstream: &Upstream, options: ProxyOptions) -> SocketAddr {
    start_proxy_with(GENEROUS, &upstream.url(), options).await
}

/// The default options but `bounds`.
fn bounded(bounds: ProxyBounds) -> ProxyOptions {
    ProxyOptions {
        bounds,
        ..ProxyOptions::default()
    }
}

/// [`start_proxy`] with the rules of `config`, in front of the upstream at
/// `url`.
async fn start_proxy_with(config: &str, url: &str, options: ProxyOptions) -> SocketAddr {
    clock_support::clear_of_a_minute_boundary();
    let config = Config::parse(config).expect("a valid config");
    let engine = Loaded::build(config, None, None).await.expect("an engine");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(serve_with(
        listener,
        url.parse().expect("a URL"),
        Arc::new(Live::new(engine)),
        options,
        std::future::pending(),
    ));
    addr
}

/// An HTTP/2 client connection to `addr` made by `builder`; the
/// connection's task ends when the proxy closes it.
async fn h2_client(
    addr: SocketAddr,
    builder: &h2::client::Builder,
) -> (SendRequest<Bytes>, JoinHandle<Result<(), h2::Error>>) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = within("the HTTP/2 handshake", builder.handshake(tcp))
        .await
        .expect("an HTTP/2 connection");
    (client, tokio::spawn(conn))
}

/// A stream's answer, awaited in a task of its own.
type Answer = JoinHandle<Result<http::Response<h2::RecvStream>, h2::Error>>;

/// Opens two `GET /wait` streams on `client` and returns once the upstream
/// holds both: two upstream connections busy.
async fn hold_two(client: &mut SendRequest<Bytes>, upstream: &Upstream) -> [Answer; 2] {
    let waits = [
        open_get(client, "/wait").await,
        open_get(client, "/wait").await,
    ];
    until("both forwarded at once", || upstream.arrived("/wait") == 2).await;
    waits
}

/// Lets the upstream answer what it holds; each of `waits` is answered 200.
async fn release_all(upstream: &Upstream, waits: [Answer; 2]) {
    upstream.release();
    for wait in waits {
        let res = within("an answer", wait).await.expect("its task");
        assert_eq!(res.expect("a response").status(), StatusCode::OK);
    }
}

fn request(method: Method, path: &str) -> Request<()> {
    Request::builder()
        .method(method)
        .uri(format!("http://spillway.test{path}"))
        .body(())
        .expect("a request")
}

/// Opens a `POST /hold` on `client` whose body never ends (one byte sent):
/// the stream, and the upstream connection the proxy gives it, stay busy.
/// Returns the head of the stream's answer, if the proxy gives one; the
/// stream is then done with (the client cancels what is left of it).
async fn open_hold(client: &mut SendRequest<Bytes>) -> JoinHandle<Option<http::response::Parts>> {
    let ready = within("room for a stream", client.clone().ready())
        .await
        .expect("the connection is open");
    *client = ready;
    let (answer, mut body) = client
        .send_request(request(Method::POST, "/hold"), false)
        .expect("a stream");
    body.send_data(Bytes::from_static(b"x"), false)
        .expect("a byte of body");
    tokio::spawn(async move {
        // Kept open with the answer's wait: dropping it would end the body.
        let _body = body;
        answer.await.ok().map(|res| res.into_parts().0)
    })
}

/// Opens a `GET path` on `client`; returns its answer.
async fn open_get(client: &mut SendRequest<Bytes>, path: &str) -> Answer {
    *client = within("room for a stream", client.clone().ready())
        .await
        .expect("the connection is open");
    let (answer, _) = client
        .send_request(request(Method::GET, path), true)
        .expect("a stream");
    tokio::spawn(answer)
}

/// How many of `answers` have come.
fn answered<T>(answers: &[JoinHandle<T>]) -> usize {
    answers.iter().filter(|a| a.is_finished()).count()
}

/// Finding 5: a client that sets its flow-control window to 0, answers
/// pings and never reads held every upstream connection its requests were
/// given, for as long as it liked. Now the connection is closed once a
/// response has waited the write timeout for it, and its upstream
/// connections with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_opens_its_window_loses_its_upstream_connections() {
    let upstream = Upstream::start().await;
    let write_timeout = Duration::from_secs(1);
    let proxy = start_proxy(
        &upstream,
        ProxyOptions {
            write_timeout,
            ..ProxyOptions::default()
        },
    )
    .await;
    let mut builder = h2::client::Builder::new();
    builder.initial_window_size(0);
    let (mut client, conn) = h2_client(proxy, &builder).await;
    let streams = 20;
    let mut answers = Vec::new();
    // Kept: a response dropped would have the client cancel its stream.
    let mut heads = Vec::new();
    for _ in 0..streams {
        client = within("room for a stream", client.ready())
            .await
            .expect("open");
        let (answer, _) = client
            .send_request(request(Method::GET, "/big"), true)
            .expect("a stream");
        answers.push(answer);
    }
    let started = tokio::time::Instant::now();
    // The heads come (HEADERS are not flow controlled); the bodies cannot.
    for answer in answers {
        let res = within("a response head", answer).await.expect("a response");
        assert_eq!(res.status(), StatusCode::OK);
        heads.push(res);
    }
    assert_eq!(upstream.arrived("/big"), streams);
    until("the upstream connections closed", || upstream.open() == 0).await;
    assert!(
        started.elapsed() >= write_timeout / 2,
        "closed before the client had the write timeout to read"
    );
    within("the client connection closed", conn)
        .await
        .expect("its task")
        .ok();
}

/// Finding 4, one connection: each stream with an unfinished body holds an
/// upstream connection, so one client connection must not have more open
/// than `SETTINGS_MAX_CONCURRENT_STREAMS` says (hyper's default was 200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_has_at_most_its_stream_cap_open() {
    let upstream = Upstream::start().await;
    let bounds = ProxyBounds {
        http2_max_streams: NonZeroU32::new(10).expect("nonzero"),
        ..ProxyBounds::default()
    };
    let proxy = start_proxy(&upstream, bounded(bounds)).await;
    let (mut client, _conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    // One exchange first, so the client has the proxy's SETTINGS before it
    // opens the fifteen: one sent before them would be refused past the
    // tenth (REFUSED_STREAM, which h2 does not retry) rather than queued.
    let first = open_get(&mut client, "/").await;
    let first = within("the first answer", first).await.expect("its task");
    assert_eq!(first.expect("an answer").status(), StatusCode::OK);
    let mut held = Vec::new();
    for _ in 0..15 {
        held.push(open_hold(&mut client).await);
    }
    until("ten requests held", || upstream.arrived("/hold") == 10).await;
    // The proxy said so, and the client keeps the other five to itself.
    assert_eq!(client.current_max_send_streams(), 10);
    // Counted while the ten are held: once they are answered, a stream's
    // slot is free the moment its reset is sent, while the upstream socket
    // it had closes a moment later, so the count of sockets open at once
    // may pass ten by one in the handover without an eleventh request
    // being in flight.
    assert_eq!(
        upstream.peak(),
        10,
        "upstream connections for one client connection"
    );
    upstream.release();
    for answer in held {
        let head = within("an answer", answer).await.expect("its task");
        assert_eq!(head.map(|h| h.status), Some(StatusCode::OK));
    }
    assert_eq!(upstream.arrived("/hold"), 15, "the other five were served");
}

/// Finding 4, many connections: the pool opens at most its cap of upstream
/// connections for all HTTP/2 clients together; a request that finds none
/// free within the connect timeout is answered 503 with `Retry-After`,
/// never held; and an HTTP/1.1 client (whose connection has an upstream
/// connection of its own) is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_opens_at_most_its_cap_and_answers_503_past_it() {
    let upstream = Upstream::start().await;
    let cap = 8;
    let proxy = start_capped(&upstream, cap, Duration::from_millis(500)).await;
    let mut answers = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..3 {
        let (mut client, conn) = h2_client(proxy, &h2::client::Builder::new()).await;
        for _ in 0..10 {
            answers.push(open_hold(&mut client).await);
        }
        conns.push((client, conn));
    }
    // The held ones never answer while held: the answered are the refused.
    until("every stream held or refused", || {
        upstream.arrived("/hold") + answered(&answers) >= 30
    })
    .await;
    assert_eq!(upstream.arrived("/hold"), cap);
    assert_eq!(
        upstream.peak(),
        cap,
        "more upstream connections than the cap"
    );
    let refused: Vec<_> = answers.into_iter().filter(|a| a.is_finished()).collect();
    assert_eq!(refused.len(), 30 - cap);
    for answer in refused {
        let res = answer.await.expect("its task").expect("an answer");
        assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers["retry-after"], "1");
    }
    let mut h1 = Conn::connect(proxy).await;
    h1.send(b"GET /other HTTP/1.1\r\nHost: spillway.test\r\n\r\n")
        .await
        .expect("sent");
    let res = h1.response(WAIT).await.expect("an HTTP/1.1 answer");
    assert_eq!(res.status, 200);
    upstream.release();
}

/// An HTTP/2 client's upstream connections, kept idle once its requests
/// are answered, hold slots of the pool: another client that finds none
/// free closes one of them rather than waiting for a slot (and getting 503
/// after the connect timeout), as it would have reused one in a pool all
/// clients shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_clients_idle_upstream_connections_never_keep_another_from_being_served() {
    let upstream = Upstream::start().await;
    let connect_timeout = Duration::from_millis(500);
    let proxy = start_capped(&upstream, 2, connect_timeout).await;
    let (mut first, _first_conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    let waits = hold_two(&mut first, &upstream).await;
    release_all(&upstream, waits).await;
    // The first client's two upstream connections are idle, and hold the
    // pool's two slots.
    let (mut second, _second_conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    let started = tokio::time::Instant::now();
    let answer = open_get(&mut second, "/other").await;
    let res = within("an answer", answer).await.expect("its task");
    assert_eq!(res.expect("a response").status(), StatusCode::OK);
    assert!(
        started.elapsed() < connect_timeout,
        "waited for a slot an idle connection held"
    );
    assert_eq!(upstream.arrived("/other"), 1);
}

/// A HEADERS frame opening stream `id` with `GET /reset` and no body,
/// then a RST_STREAM (CANCEL) for it: what a "rapid reset" client sends.
fn headers_then_reset(id: u32) -> Vec<u8> {
    let authority = b"spillway.test";
    let path = b"/reset";
    // HPACK: :method GET, :scheme http (static table), :path and
    // :authority as literals without indexing.
    let mut block = vec![0x82, 0x86, 0x04, path.len() as u8];
    block.extend_from_slice(path);
    block.extend_from_slice(&[0x01, authority.len() as u8]);
    block.extend_from_slice(authority);
    let mut out = frame(0x1, 0x4 | 0x1, id, &block); // END_HEADERS | END_STREAM
    out.extend(frame(0x3, 0, id, &8u32.to_be_bytes())); // CANCEL
    out
}

/// One HTTP/2 frame.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Reads frames off `stream` until one of `kind` (with `flags` set, if
/// any); returns it (kind, flags), or GOAWAY's, which ends the wait too.
async fn frame_until(stream: &mut (impl AsyncRead + Unpin), kind: u8, flags: u8) -> (u8, u8) {
    loop {
        let mut head = [0; 9];
        stream.read_exact(&mut head).await.expect("a frame");
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0; len];
        stream.read_exact(&mut payload).await.expect("its payload");
        let (got, got_flags) = (head[3], head[4]);
        if (got == kind && got_flags & flags == flags) || got == 0x7 {
            return (got, got_flags);
        }
    }
}

/// Finding 10: streams reset by the client in the same write as their
/// HEADERS were forwarded anyway (hyper calls the service for them), and
/// a client could go on so for ever, with no GOAWAY. Now none is
/// forwarded, and past the premature-reset bound the client is sent
/// GOAWAY. Each stream is sent once the proxy has read the one before (a
/// PING answered in between), so that hyper's own bound on resets of
/// streams it has not taken yet never sees more than one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_reset_with_their_headers_are_not_forwarded_and_the_client_is_sent_goaway() {
    let upstream = Upstream::start().await;
    let proxy = start_proxy(&upstream, ProxyOptions::default()).await;
    let mut tcp = TcpStream::connect(proxy).await.expect("connect");
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    tcp.write_all(&hello).await.expect("the preface");
    within("the proxy's SETTINGS", frame_until(&mut tcp, 0x4, 0)).await;
    tcp.write_all(&frame(0x4, 0x1, 0, &[]))
        .await
        .expect("SETTINGS ACK");
    let streams = 1_000;
    let mut sent = 0;
    let mut goaway = false;
    for i in 0..streams {
        let mut burst = headers_then_reset(2 * i + 1);
        burst.extend(frame(0x6, 0, 0, &[0; 8])); // PING
        if tcp.write_all(&burst).await.is_err() {
            break;
        }
        sent += 1;
        let (kind, _) = within("the PING's answer", frame_until(&mut tcp, 0x6, 0x1)).await;
        if kind == 0x7 {
            goaway = true;
            break;
        }
    }
    assert!(goaway, "{sent} streams reset early, and no GOAWAY");
    assert!(sent <= 110, "GOAWAY only after {sent} streams reset early");
    assert_eq!(
        upstream.arrived("/reset"),
        0,
        "a reset request was forwarded"
    );
    assert_eq!(
        upstream.accepted(),
        0,
        "an upstream connection was opened for a reset request"
    );
}

/// Finding 10, shaping: a shaping bucket holds each request for its turn,
/// and one HTTP/2 connection may have many held at once; the bucket's queue
/// bounds one key's, not all of them. Past `[proxy] max_held`, a request is
/// answered 503 at once, with `Retry-After` its wait, and never forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_held_a_shaped_request_is_answered_503_not_held() {
    let upstream = Upstream::start().await;
    // One request every 10 s, up to 20 queued: the second waits 10 s, the
    // third 20 s, the fourth would wait 30 s.
    let shaped = r#"
[[rules]]
name = "shaped"
key = ["ip"]
algorithm = "leaky_bucket"
mode = "shape"
limit = 1
window = "10s"
burst = 20
"#;
    let bounds = ProxyBounds {
        max_held: NonZeroUsize::new(2).expect("nonzero"),
        ..ProxyBounds::default()
    };
    let options = ProxyOptions {
        bounds,
        ..ProxyOptions::default()
    };
    let proxy = start_proxy_with(shaped, &upstream.url(), options).await;
    let (mut client, _conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    let first = within("the first answer", open_get(&mut client, "/other").await)
        .await
        .expect("its task")
        .expect("an answer");
    assert_eq!(first.status(), StatusCode::OK);
    // Three more at once: they are decided 10, 20 and 30 s from their turn,
    // and whichever tries to hold its place last (not always the one
    // decided last: deciding and holding are two steps, and the streams run
    // on two threads) finds the cap full.
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(open_get(&mut client, "/other").await);
    }
    until("one answered", || answered(&answers) == 1).await;
    let (over, held): (Vec<_>, Vec<_>) = answers.into_iter().partition(|a| a.is_finished());
    let over = over
        .into_iter()
        .next()
        .expect("one")
        .await
        .expect("its task")
        .expect("an answer");
    assert_eq!(over.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Its Retry-After is the wait it was refused.
    let retry = over.headers()["retry-after"].to_str().expect("ASCII");
    assert!(["10", "20", "30"].contains(&retry), "Retry-After: {retry}");
    assert!(held.iter().all(|h| !h.is_finished()), "held for their turn");
    assert_eq!(upstream.arrived("/other"), 1);
}

/// `[proxy] http2 = false`: an HTTP/2 client is not served; HTTP/1.1 is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_can_be_turned_off() {
    let upstream = Upstream::start().await;
    let bounds = ProxyBounds {
        http2: false,
        ..ProxyBounds::default()
    };
    let proxy = start_proxy(&upstream, bounded(bounds)).await;
    let mut tcp = TcpStream::connect(proxy).await.expect("connect");
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("the preface");
    let mut answer = Vec::new();
    within("the refusal", tcp.read_to_end(&mut answer))
        .await
        .ok();
    // Closed, with an HTTP/1.1 error at most: not an HTTP/2 SETTINGS frame.
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 4") || answer.starts_with("HTTP/1.1 5"),
        "{answer}"
    );
    assert_eq!(upstream.accepted(), 0);
    let mut h1 = Conn::connect(proxy).await;
    h1.send(b"GET /other HTTP/1.1\r\nHost: spillway.test\r\n\r\n")
        .await
        .expect("sent");
    assert_eq!(h1.response(WAIT).await.expect("an answer").status, 200);
}

/// The open-file limit the descriptor tests give the binary: 192
/// descriptors of room past the 64 the proxy keeps aside, shared as 72
/// client connections (two descriptors each: its own and its upstream
/// connection's) and 48 pooled upstream connections.
const FILES: u32 = 256;
const CLIENTS_WITHIN: usize = 72;
const POOLED_WITHIN: usize = 48;

/// The binary, proxying to `upstream` with the generous rule, under
/// [`FILES`].
fn start_limited_binary(upstream: &Upstream, dir: &std::path::Path) -> Process {
    let config = dir.join("spillway.toml");
    std::fs::write(&config, GENEROUS).expect("the config");
    let upstream = upstream.url();
    let args = [
        "--upstream",
        upstream.as_str(),
        "--listen",
        "127.0.0.1:0",
        "--config",
        config.to_str().expect("a UTF-8 path"),
        "--connect-timeout",
        "1s",
    ];
    Process::start_with_file_limit("proxy", &args, dir, FILES)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("spillway-h2-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    dir
}

/// Finding 4 under a real file limit: three HTTP/2 connections of 100
/// streams with unfinished bodies took every descriptor (accept failed
/// with `Too many open files`, a new client got no answer). Now the pool
/// stays within its share of the limit, the streams past it are answered
/// 503, and a new client is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_low_file_limit_http2_fan_out_leaves_room_for_new_clients() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("fan-out");
    let mut proxy = start_limited_binary(&upstream, &dir);
    let mut answers = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..3 {
        let (mut client, conn) = h2_client(proxy.addr, &h2::client::Builder::new()).await;
        for _ in 0..100 {
            answers.push(open_hold(&mut client).await);
        }
        conns.push((client, conn));
    }
    until("every stream held or refused", || {
        upstream.arrived("/hold") + answered(&answers) >= 300
    })
    .await;
    assert!(
        upstream.peak() <= POOLED_WITHIN,
        "{} upstream connections open at once, over the {POOLED_WITHIN} the limit leaves",
        upstream.peak()
    );
    let mut h1 = Conn::connect(proxy.addr).await;
    h1.send(b"GET /other HTTP/1.1\r\nHost: spillway.test\r\n\r\n")
        .await
        .expect("sent");
    let res = h1.response(WAIT).await.expect("a new client is answered");
    assert_eq!(res.status, 200);
    for answer in answers.into_iter().filter(|a| a.is_finished()) {
        let res = answer.await.expect("its task").expect("an answer");
        assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let log = proxy.log();
    assert!(!log.contains("Too many open files"), "{log}");
    assert!(proxy.running());
    upstream.release();
}

/// Finding 10, HTTP/1.1 under a real file limit: the cap on connections
/// counted client connections only, so past half the limit the upstream
/// connects failed and clients got 502. Now the connections past what the
/// limit holds with their upstream connections are refused 503 at once,
/// and every one accepted is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_low_file_limit_http1_clients_get_503_at_the_door_never_502() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("http1");
    let proxy = start_limited_binary(&upstream, &dir);
    let clients = 180;
    let mut conns = Vec::new();
    for _ in 0..clients {
        let mut conn = Conn::connect(proxy.addr).await;
        conn.send(b"GET /hold HTTP/1.1\r\nHost: spillway.test\r\n\r\n")
            .await
            .ok();
        conns.push(conn);
    }
    // The refused are answered at once; the rest wait at the upstream.
    let mut refused = 0;
    let mut waiting = Vec::new();
    for mut conn in conns {
        match conn.response(Duration::from_millis(50)).await {
            Ok(res) => {
                assert_eq!(res.status, 503, "{}", res.text());
                refused += 1;
            }
            Err(_) => waiting.push(conn),
        }
    }
    until("the accepted requests forwarded", || {
        upstream.arrived("/hold") == waiting.len()
    })
    .await;
    assert_eq!(waiting.len(), CLIENTS_WITHIN);
    assert_eq!(refused, clients - CLIENTS_WITHIN);
    upstream.release();
    for mut conn in waiting {
        let res = conn.response(WAIT).await.expect("the held answer");
        assert_eq!(res.status, 200, "{}", res.text());
    }
}

/// The pool full of busy connections: another client's request waits for
/// a slot. When the busy requests are answered, their connections go idle
/// (kept by their client, holding the slots) and the waiting request
/// should get one of them (the shared pool handed an idle connection to a
/// request waiting for one); it must not wait out the connect timeout and
/// be answered 503 while idle connections hold every slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_a_slot_is_served_once_a_busy_connection_goes_idle() {
    let upstream = Upstream::start().await;
    let connect_timeout = Duration::from_secs(3);
    let proxy = start_capped(&upstream, 2, connect_timeout).await;
    let (mut first, _first_conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    let waits = hold_two(&mut first, &upstream).await;
    let (mut second, _second_conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    let started = tokio::time::Instant::now();
    let answer = open_get(&mut second, "/other").await;
    // It waits for a slot.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!answer.is_finished());
    release_all(&upstream, waits).await;
    let res = within("an answer", answer).await.expect("its task");
    let status = res.expect("a response").status();
    let waited = started.elapsed();
    assert_eq!(
        status,
        StatusCode::OK,
        "after {waited:?}, with the pool's every slot held by an idle connection"
    );
    assert!(waited < connect_timeout, "waited {waited:?}");
}

/// The same with one client: its third request waits for a slot while
/// its first two are busy; once they are answered, their connections sit
/// idle in its own stack, and the third is answered 503 after the connect
/// timeout rather than sent on one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_clients_waiting_request_is_served_on_its_own_connection_gone_idle() {
    let upstream = Upstream::start().await;
    let connect_timeout = Duration::from_secs(3);
    let proxy = start_capped(&upstream, 2, connect_timeout).await;
    let (mut client, _conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    let waits = hold_two(&mut client, &upstream).await;
    let started = tokio::time::Instant::now();
    let third = open_get(&mut client, "/other").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    release_all(&upstream, waits).await;
    let res = within("an answer", third).await.expect("its task");
    let status = res.expect("a response").status();
    assert_eq!(status, StatusCode::OK, "after {:?}", started.elapsed());
}

/// Eight HTTP/2 clients, one request at a time each, over a pool of four:
/// more clients than slots, as any busy proxy has. Every request should be
/// served (waiting its turn for a slot, as in the shared pool), and never
/// more than four upstream connections be open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_clients_than_slots_are_all_served() {
    let upstream = Upstream::start().await;
    let cap = 4;
    let proxy = start_capped(&upstream, cap, Duration::from_secs(1)).await;
    upstream.release();
    // The proxy's own sockets to the upstream that hold a descriptor
    // (ESTABLISHED or CLOSE_WAIT on its side), sampled: what the pool caps.
    let port = upstream.addr.port();
    let most = Arc::new(AtomicUsize::new(0));
    let sampling = {
        let most = most.clone();
        tokio::spawn(async move {
            loop {
                let n = proxy_sockets_to(port);
                most.fetch_max(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    let mut tasks = Vec::new();
    for _ in 0..8 {
        tasks.push(tokio::spawn(async move {
            let (mut client, _conn) = h2_client(proxy, &h2::client::Builder::new()).await;
            let mut statuses = Vec::new();
            for _ in 0..30 {
                let answer = open_get(&mut client, "/other").await;
                let res = within("an answer", answer).await.expect("its task");
                statuses.push(res.expect("a response").status());
            }
            statuses
        }));
    }
    let mut refused = 0;
    let mut total = 0;
    for task in tasks {
        let statuses = tokio::time::timeout(Duration::from_secs(60), task).await;
        for status in statuses.expect("within a minute").expect("its task") {
            total += 1;
            if status != StatusCode::OK {
                refused += 1;
            }
        }
    }
    sampling.abort();
    let most = most.load(Ordering::SeqCst);
    eprintln!(
        "upstream's count: peak {} accepted {}; the proxy's sockets: at most {most}",
        upstream.peak(),
        upstream.accepted()
    );
    assert!(most <= cap, "{most} proxy sockets to the upstream at once");
    assert_eq!(refused, 0, "{refused} of {total} requests not served");
}

/// An upstream that answers each request with its X-Forwarded-For and
/// Forwarded headers (one line each) as the body, kept alive.
async fn echo_forwarding_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let (len, body) = loop {
                        let mut lines = [httparse::EMPTY_HEADER; 64];
                        let mut head = httparse::Request::new(&mut lines);
                        if let Ok(httparse::Status::Complete(len)) = head.parse(&buf) {
                            let mut body = String::new();
                            for h in head.headers.iter() {
                                let name = h.name.to_ascii_lowercase();
                                if name == "x-forwarded-for" || name == "forwarded" {
                                    body.push_str(&format!(
                                        "{name}: {}\n",
                                        String::from_utf8_lossy(h.value)
                                    ));
                                }
                            }
                            break (len, body);
                        }
                        let mut chunk = [0; 8192];
                        match stream.read(&mut chunk).await {
                            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                            _ => return,
                        }
                    };
                    buf.drain(..len);
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if stream.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// An HTTP/2 client's requests name its peer address in X-Forwarded-For
/// and Forwarded, after the chain it sent, on every request of the
/// connection (kept upstream connections included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_requests_name_their_peer() {
    let upstream_addr = echo_forwarding_upstream().await;
    let url = format!("http://{upstream_addr}");
    let proxy = start_proxy_with(GENEROUS, &url, ProxyOptions::default()).await;
    let (mut client, _conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    for i in 0..3 {
        client = within("room", client.ready()).await.expect("open");
        let req = Request::builder()
            .uri("http://spillway.test/")
            .header("x-forwarded-for", "203.0.113.9")
            .body(())
            .expect("a request");
        let (answer, _) = client.send_request(req, true).expect("a stream");
        let res = within("an answer", answer).await.expect("a response");
        assert_eq!(res.status(), StatusCode::OK);
        let mut body = res.into_body();
        let mut text = Vec::new();
        while let Some(chunk) = within("the body", body.data()).await {
            let chunk = chunk.expect("a chunk");
            let _ = body.flow_control().release_capacity(chunk.len());
            text.extend_from_slice(&chunk);
        }
        let text = String::from_utf8(text).expect("UTF-8");
        eprintln!("request {i}: {text}");
        assert!(
            text.contains("x-forwarded-for: 203.0.113.9, 127.0.0.1"),
            "{text}"
        );
        assert!(
            text.contains("forwarded: for=127.0.0.1;proto=http"),
            "{text}"
        );
    }
}

/// How many TCP sockets (IPv4) connect to `port` from another port and are
/// ESTABLISHED or CLOSE_WAIT: the proxy's, each holding a descriptor.
fn proxy_sockets_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<_> = line.split_whitespace().collect();
            let remote_port = fields[2].rsplit(':').next().unwrap_or("");
            let state = fields[3];
            u16::from_str_radix(remote_port, 16).ok() == Some(port)
                && (state == "01" || state == "08")
        })
        .count()
}

/// One client keeps as many `busy` requests going as the pool has slots,
/// each sent again as soon as it is answered (nothing held at the
/// upstream). Another client's requests should get
/// their turn on the connections as they come free, as they did in the
/// shared pool; they must not be answered 503 because the first client
/// always has its own idle connection back before anyone else can have it.
async fn a_busy_client_does_not_starve_another(busy: &'static str) {
    let upstream = Upstream::start().await;
    let cap = 4;
    let proxy = start_capped(&upstream, cap, Duration::from_secs(1)).await;
    upstream.release();
    let (attacker, _attacker_conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut loops = Vec::new();
    for _ in 0..cap {
        let mut client = attacker.clone();
        let stop = stop.clone();
        loops.push(tokio::spawn(async move {
            let mut sent = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let answer = open_get(&mut client, busy).await;
                let _ = answer.await;
                sent += 1;
            }
            sent
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (mut victim, _victim_conn) = h2_client(proxy, &h2::client::Builder::new()).await;
    let mut statuses = Vec::new();
    let started = tokio::time::Instant::now();
    for _ in 0..5 {
        let answer = open_get(&mut victim, "/victim").await;
        let res = within("an answer", answer).await.expect("its task");
        statuses.push(res.expect("a response").status().as_u16());
    }
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut sent = 0;
    for l in loops {
        sent += l.await.expect("a loop");
    }
    eprintln!("victim: {statuses:?} in {took:?}; the busy client sent {sent} meanwhile");
    assert!(
        statuses.iter().all(|&s| s == 200),
        "victim: {statuses:?} in {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_busy_with_cheap_requests_does_not_starve_another() {
    a_busy_client_does_not_starve_another("/other").await;
}

/// Its requests taking 20 ms at the upstream: its connections are busy
/// nearly all the time, and each would go straight back to it; another
/// client's request waiting for a slot gets the next that frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_busy_with_20ms_requests_does_not_starve_another() {
    a_busy_client_does_not_starve_another("/slow").await;
}

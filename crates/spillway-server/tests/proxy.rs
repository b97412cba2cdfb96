//! `spillway proxy` end to end, on real sockets: a client, the proxy and a
//! small hyper upstream, all on 127.0.0.1 port 0.

mod clock_support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use spillway_server::config::Config;
use spillway_server::proxy::{HostHeader, ProxyOptions, serve, serve_with};
use spillway_server::state::{Live, Loaded};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// What the upstream received.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    uri: String,
    version: Version,
    headers: HeaderMap,
    body: Bytes,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().expect("ASCII"))
    }
}

type UpstreamBody = BoxBody<Bytes, hyper::Error>;

/// A test upstream: records what it receives and answers by path.
/// `/echo` streams the request body back as it arrives; `/slow?ms=N`
/// answers N ms after it has the request; anything else answers 201 with a body naming the
/// request, a header of its own and hop-by-hop headers that the proxy must
/// not pass on.
struct Upstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Upstream {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("an address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let log = log.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(log.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { addr, seen }
    }

    fn url(&self) -> http::Uri {
        format!("http://{}", self.addr).parse().expect("a URL")
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("not poisoned").clone()
    }
}

async fn answer(
    log: Arc<Mutex<Vec<Seen>>>,
    req: Request<Incoming>,
) -> Result<Response<UpstreamBody>, hyper::Error> {
    let (parts, body) = req.into_parts();
    let mut seen = Seen {
        method: parts.method.clone(),
        uri: parts.uri.to_string(),
        version: parts.version,
        headers: parts.headers.clone(),
        body: Bytes::new(),
    };
    if parts.uri.path() == "/echo" {
        log.lock().expect("not poisoned").push(seen);
        let mut res = Response::new(body.boxed());
        res.headers_mut()
            .insert("x-upstream", HeaderValue::from_static("echo"));
        return Ok(res);
    }
    seen.body = body.collect().await?.to_bytes();
    let text = format!("upstream got {} {}", seen.method, seen.uri);
    log.lock().expect("not poisoned").push(seen);
    if parts.uri.path() == "/slow" {
        let ms: u64 = parts
            .uri
            .query()
            .and_then(|q| q.strip_prefix("ms="))
            .and_then(|ms| ms.parse().ok())
            .unwrap_or(1_000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let mut res = Response::new(Full::new(Bytes::from(text)).map_err(|n| match n {}).boxed());
    *res.status_mut() = StatusCode::CREATED;
    let headers = res.headers_mut();
    headers.insert("x-upstream", HeaderValue::from_static("yes"));
    headers.append("set-cookie", HeaderValue::from_static("a=1"));
    headers.append("set-cookie", HeaderValue::from_static("b=2"));
    headers.insert("connection", HeaderValue::from_static("x-hop-response"));
    headers.insert("x-hop-response", HeaderValue::from_static("1"));
    headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
    Ok(res)
}

/// A running proxy: its address, its engine, and the switch that stops it.
struct Proxy {
    addr: SocketAddr,
    shared: Arc<Live>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Proxy {
    async fn start(config: &str, upstream: http::Uri, options: ProxyOptions) -> Self {
        clock_support::clear_of_a_minute_boundary();
        let shared = Arc::new(Live::new(engine(config, None).await));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("an address");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_with(
            listener,
            upstream,
            shared.clone(),
            options,
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            addr,
            shared,
            stop: Some(stop),
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn stop(mut self) -> std::io::Result<()> {
        let _ = self.stop.take().expect("running").send(());
        self.task.await.expect("the proxy task")
    }
}

async fn engine(config: &str, previous: Option<&Loaded>) -> Loaded {
    let config = Config::parse(config).expect("a valid config");
    Loaded::build(config, previous, None)
        .await
        .expect("an engine")
}

/// A rule that never denies in these tests, so the rate-limit headers are
/// on every response.
const GENEROUS: &str = r#"
[[rules]]
name = "generous"
key = ["ip"]
algorithm = "fixed_window"
limit = 1000
window = "1m"
"#;

fn per_ip(limit: u32) -> String {
    format!(
        "[[rules]]\nname = \"per-ip\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\nlimit = {limit}\nwindow = \"1m\"\n"
    )
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Sends `req`, returns the status, headers and whole body.
async fn send(req: Request<Full<Bytes>>) -> (StatusCode, HeaderMap, Bytes) {
    let res = client().request(req).await.expect("a response");
    let (parts, body) = res.into_parts();
    let body = body.collect().await.expect("the body").to_bytes();
    (parts.status, parts.headers, body)
}

async fn get(url: &str) -> (StatusCode, HeaderMap, Bytes) {
    send(Request::get(url).body(Full::default()).expect("a request")).await
}

fn json(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).expect("a JSON body")
}

#[tokio::test]
async fn an_admitted_request_reaches_the_upstream_intact_and_its_response_comes_back() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(GENEROUS, upstream.url(), ProxyOptions::default()).await;

    let req = Request::post(proxy.url("/items/7?colour=blue&size=2"))
        .header("host", "api.example.com")
        .header("x-custom", "kept")
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from_static(b"the payload")))
        .expect("a request");
    let (status, headers, body) = send(req).await;

    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body, "upstream got POST /items/7?colour=blue&size=2");
    assert_eq!(headers["x-upstream"], "yes");
    let cookies: Vec<_> = headers.get_all("set-cookie").iter().collect();
    assert_eq!(cookies, ["a=1", "b=2"], "repeated headers are all kept");
    assert_eq!(
        headers["x-ratelimit-limit"], "1000",
        "the limiter's headers"
    );
    assert_eq!(headers["x-ratelimit-remaining"], "999");
    for hop in ["connection", "keep-alive", "x-hop-response"] {
        assert!(
            !headers.contains_key(hop),
            "the upstream's hop-by-hop header {hop} was passed on"
        );
    }

    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    let seen = &seen[0];
    assert_eq!(seen.method, Method::POST);
    assert_eq!(seen.uri, "/items/7?colour=blue&size=2");
    assert_eq!(seen.body, "the payload");
    assert_eq!(seen.header("x-custom"), Some("kept"));
    assert_eq!(seen.header("content-type"), Some("text/plain"));
    assert_eq!(seen.header("host"), Some("api.example.com"), "Host is kept");
    assert_eq!(seen.header("x-forwarded-host"), Some("api.example.com"));
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    assert_eq!(seen.header("x-forwarded-for"), Some("127.0.0.1"));

    proxy.stop().await.expect("a clean stop");
}

#[tokio::test]
async fn host_can_be_set_to_the_upstreams() {
    let upstream = Upstream::start().await;
    let options = ProxyOptions {
        host: HostHeader::Upstream,
        ..ProxyOptions::default()
    };
    let proxy = Proxy::start(GENEROUS, upstream.url(), options).await;

    let req = Request::get(proxy.url("/"))
        .header("host", "api.example.com")
        .body(Full::default())
        .expect("a request");
    assert_eq!(send(req).await.0, StatusCode::CREATED);

    let seen = &upstream.seen()[0];
    let own = upstream.addr.to_string();
    assert_eq!(seen.header("host"), Some(own.as_str()));
    assert_eq!(seen.header("x-forwarded-host"), Some("api.example.com"));
}

#[tokio::test]
async fn a_denied_request_gets_429_and_never_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(&per_ip(2), upstream.url(), ProxyOptions::default()).await;

    assert_eq!(get(&proxy.url("/a")).await.0, StatusCode::CREATED);
    assert_eq!(get(&proxy.url("/b")).await.0, StatusCode::CREATED);
    let (status, headers, body) = get(&proxy.url("/c")).await;

    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = headers["retry-after"]
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("whole seconds");
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(headers["x-ratelimit-remaining"], "0");
    // The proxy is this response's origin: it dates it.
    let date = headers["date"].to_str().expect("ASCII");
    assert!(httpdate::parse_http_date(date).is_ok(), "Date {date}");
    let problem = json(&body);
    assert_eq!(problem["status"], 429);
    assert_eq!(problem["rule"], "per-ip");

    let paths: Vec<String> = upstream.seen().into_iter().map(|s| s.uri).collect();
    assert_eq!(paths, ["/a", "/b"], "the denied request never reached it");
}

#[tokio::test]
async fn x_forwarded_for_is_appended_to_the_chain_and_not_believed_from_an_untrusted_peer() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(&per_ip(1), upstream.url(), ProxyOptions::default()).await;

    let req = Request::get(proxy.url("/"))
        .header("x-forwarded-for", "203.0.113.7, 198.51.100.2")
        .header("x-forwarded-for", "198.51.100.3")
        .header("x-forwarded-host", "spoofed.example")
        .header("x-forwarded-proto", "https")
        .body(Full::default())
        .expect("a request");
    assert_eq!(send(req).await.0, StatusCode::CREATED);

    let seen = &upstream.seen()[0];
    let chains: Vec<_> = seen.headers.get_all("x-forwarded-for").iter().collect();
    assert_eq!(
        chains,
        ["203.0.113.7, 198.51.100.2, 198.51.100.3, 127.0.0.1"],
        "the existing chain, in order, then the peer"
    );
    let own = proxy.addr.to_string();
    assert_eq!(seen.header("x-forwarded-host"), Some(own.as_str()));
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));

    // The limiter keyed that request by the socket peer, not by the chain
    // (no trusted proxies): another "client" on the same peer is denied.
    let req = Request::get(proxy.url("/"))
        .header("x-forwarded-for", "192.0.2.99")
        .body(Full::default())
        .expect("a request");
    assert_eq!(send(req).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.seen().len(), 1);
}

#[tokio::test]
async fn a_trusted_proxy_in_front_keeps_its_forwarded_scheme_and_host() {
    // A TLS terminator on 127.0.0.1 in front of this proxy.
    let config = format!(
        "[clients]\ntrusted_proxies = [\"127.0.0.1\"]\n{}",
        per_ip(5)
    );
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(&config, upstream.url(), ProxyOptions::default()).await;
    let req = Request::get(proxy.url("/"))
        .header("x-forwarded-for", "198.51.100.7")
        .header("x-forwarded-host", "api.example.com")
        .header("x-forwarded-proto", "https")
        .body(Full::default())
        .expect("a request");
    assert_eq!(send(req).await.0, StatusCode::CREATED);
    let seen = &upstream.seen()[0];
    assert_eq!(seen.header("x-forwarded-proto"), Some("https"));
    assert_eq!(seen.header("x-forwarded-host"), Some("api.example.com"));
    // Without them, this proxy still says what it saw.
    let (status, _, _) = get(&proxy.url("/")).await;
    assert_eq!(status, StatusCode::CREATED);
    let seen = &upstream.seen()[1];
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    let own = proxy.addr.to_string();
    assert_eq!(seen.header("x-forwarded-host"), Some(own.as_str()));
}

#[tokio::test]
async fn hop_by_hop_request_headers_are_removed() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(GENEROUS, upstream.url(), ProxyOptions::default()).await;

    let req = Request::get(proxy.url("/"))
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "for this connection only")
        .header("keep-alive", "timeout=5")
        .header("proxy-connection", "keep-alive")
        .header("te", "trailers")
        .header("trailer", "x-checksum")
        .header("x-end-to-end", "kept")
        .body(Full::default())
        .expect("a request");
    assert_eq!(send(req).await.0, StatusCode::CREATED);

    let seen = &upstream.seen()[0];
    for hop in [
        "x-hop",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "transfer-encoding",
    ] {
        assert_eq!(seen.header(hop), None, "{hop} was passed on");
    }
    // Whatever `Connection` the upstream sees is the proxy's own client's,
    // never the one the client sent.
    assert_ne!(seen.header("connection"), Some("keep-alive, x-hop"));
    assert_eq!(seen.header("x-end-to-end"), Some("kept"));
}

/// A request body fed from a channel, a chunk at a time.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|c| c.map(|c| Ok(Frame::data(c))))
    }
}

#[tokio::test]
async fn a_large_body_streams_both_ways() {
    const CHUNK: usize = 64 * 1024;
    const CHUNKS: usize = 128; // 8 MiB
    let chunk = |i: usize| -> Bytes { (0..CHUNK).map(|j| ((i * 31 + j) % 251) as u8).collect() };

    let upstream = Upstream::start().await;
    let proxy = Proxy::start(GENEROUS, upstream.url(), ProxyOptions::default()).await;
    let client: Client<HttpConnector, ChannelBody> =
        Client::builder(TokioExecutor::new()).build_http();

    let exchange = async {
        let (tx, rx) = mpsc::channel::<Bytes>(2);
        tx.send(chunk(0)).await.expect("sent");
        let req = Request::post(proxy.url("/echo"))
            .body(ChannelBody(rx))
            .expect("a request");
        let res = client.request(req).await.expect("a response head");
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["x-upstream"], "echo");
        let mut body = res.into_body();

        // The first chunk comes back while the request is still open: a
        // proxy that buffered either body would wait here for ever.
        let mut received: Vec<u8> = Vec::with_capacity(CHUNK * CHUNKS);
        while received.len() < CHUNK {
            let frame = body.frame().await.expect("more").expect("a frame");
            received.extend_from_slice(&frame.into_data().expect("data"));
        }

        let sender = tokio::spawn(async move {
            for i in 1..CHUNKS {
                tx.send(chunk(i)).await.expect("sent");
            }
        });
        while let Some(frame) = body.frame().await {
            received.extend_from_slice(&frame.expect("a frame").into_data().expect("data"));
        }
        sender.await.expect("the sender");
        received
    };
    let received = tokio::time::timeout(Duration::from_secs(60), exchange)
        .await
        .expect("the body streamed rather than waiting to be buffered");

    assert_eq!(received.len(), CHUNK * CHUNKS);
    let expected: Vec<u8> = (0..CHUNKS).flat_map(|i| chunk(i).to_vec()).collect();
    assert!(received == expected, "the body came back altered");
    assert_eq!(upstream.seen().len(), 1);
}

#[tokio::test]
async fn an_upstream_that_is_down_gives_502() {
    // A port that was just free: nothing listens there.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let down: http::Uri = format!("http://{}", listener.local_addr().expect("an address"))
        .parse()
        .expect("a URL");
    drop(listener);
    let proxy = Proxy::start(GENEROUS, down, ProxyOptions::default()).await;

    let (status, headers, body) = get(&proxy.url("/anything")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(headers["x-ratelimit-limit"], "1000", "it was still counted");
    let problem = json(&body);
    assert_eq!(problem["status"], 502);
    assert_eq!(problem["title"], "Bad Gateway");
    assert!(
        !problem["detail"]
            .as_str()
            .expect("a detail")
            .contains("127.0.0.1"),
        "upstream details go to the log, not to the client"
    );
}

#[tokio::test]
async fn an_upstream_too_slow_to_answer_gives_504() {
    let upstream = Upstream::start().await;
    let options = ProxyOptions {
        response_timeout: Duration::from_millis(200),
        ..ProxyOptions::default()
    };
    let proxy = Proxy::start(GENEROUS, upstream.url(), options).await;

    let (status, headers, body) = get(&proxy.url("/slow?ms=3000")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(json(&body)["status"], 504);

    // A quick one on the same proxy is fine.
    assert_eq!(get(&proxy.url("/slow?ms=1")).await.0, StatusCode::CREATED);
}

/// A kept connection's response deadline is one timer, moved by every
/// request: requests that together take longer than the timeout are each
/// answered, and a slow one after them gets its own whole timeout, and no
/// more.
#[tokio::test]
async fn each_request_on_a_kept_connection_gets_the_whole_response_timeout() {
    let upstream = Upstream::start().await;
    let options = ProxyOptions {
        response_timeout: Duration::from_secs(1),
        ..ProxyOptions::default()
    };
    let proxy = Proxy::start(GENEROUS, upstream.url(), options).await;
    // One client: its requests, one after the other, share a connection.
    let client = client();
    let get = |path: &str| {
        let req = Request::get(proxy.url(path)).body(Full::default());
        client.request(req.expect("a request"))
    };
    // Five of 300 ms: 1.5 s in all, past the timeout of the first.
    for i in 0..5 {
        let res = get("/slow?ms=300").await.expect("a response");
        assert_eq!(res.status(), StatusCode::CREATED, "request {i}");
        res.into_body().collect().await.expect("the body");
    }
    let started = tokio::time::Instant::now();
    let res = get("/slow?ms=10000").await.expect("a response");
    let waited = started.elapsed();
    assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(5),
        "answered after {waited:?}"
    );
    assert_eq!(upstream.seen().len(), 6);
}

#[tokio::test]
async fn http2_clients_are_served_and_forwarded_as_http1() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(GENEROUS, upstream.url(), ProxyOptions::default()).await;
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();

    let req = Request::put(proxy.url("/h2?x=1"))
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .body(Full::new(Bytes::from_static(b"over h2")))
        .expect("a request");
    let res = client.request(req).await.expect("a response");
    assert_eq!(res.version(), Version::HTTP_2);
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(res.headers()["x-upstream"], "yes");
    let body = res.into_body().collect().await.expect("a body").to_bytes();
    assert_eq!(body, "upstream got PUT /h2?x=1");

    let seen = &upstream.seen()[0];
    assert_eq!(seen.version, Version::HTTP_11);
    assert_eq!(seen.body, "over h2");
    let own = proxy.addr.to_string();
    assert_eq!(seen.header("host"), Some(own.as_str()), "from :authority");
    assert_eq!(seen.header("cookie"), Some("a=1; b=2"));
}

#[tokio::test]
async fn a_reload_applies_to_the_next_request() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(GENEROUS, upstream.url(), ProxyOptions::default()).await;
    for _ in 0..3 {
        assert_eq!(get(&proxy.url("/")).await.0, StatusCode::CREATED);
    }

    let old = proxy.shared.current();
    proxy.shared.replace(engine(&per_ip(1), Some(&old)).await);

    let (status, headers, _) = get(&proxy.url("/")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["x-ratelimit-limit"], "1", "the new rules");
    assert_eq!(get(&proxy.url("/")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.seen().len(), 4);
}

#[tokio::test]
async fn an_upstream_that_is_not_a_plain_http_base_url_is_refused_at_start() {
    let shared = Arc::new(Live::new(engine(GENEROUS, None).await));
    for bad in ["https://example.com", "http://example.com/api", "/relative"] {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let error = serve(
            listener,
            bad.parse().expect("a URI"),
            shared.clone(),
            std::future::pending(),
        )
        .await
        .expect_err("refused");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput, "{bad}");
    }
}

#[tokio::test]
async fn shutdown_lets_the_requests_in_flight_finish() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(GENEROUS, upstream.url(), ProxyOptions::default()).await;
    let url = proxy.url("/slow?ms=500");
    let in_flight = tokio::spawn(async move { get(&url).await });
    // Once the upstream has it, the request is in flight in the proxy.
    while upstream.seen().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let addr = proxy.addr;
    proxy.stop().await.expect("a clean stop");

    let (status, _, body) = in_flight.await.expect("the client");
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body, "upstream got GET /slow?ms=500");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}

#[tokio::test]
async fn requests_without_a_body_stay_without_one() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(GENEROUS, upstream.url(), ProxyOptions::default()).await;
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let req = Request::head(proxy.url("/h"))
        .body(Empty::new())
        .expect("a request");
    let res = client.request(req).await.expect("a response");
    assert_eq!(res.status(), StatusCode::CREATED);
    let seen = &upstream.seen()[0];
    assert_eq!(seen.method, Method::HEAD);
    assert!(seen.body.is_empty());
    assert_eq!(seen.header("transfer-encoding"), None);
}

#[tokio::test]
async fn a_client_that_leaves_while_held_gives_its_turn_back() {
    // One request every 2 s, two in the bucket: the first leaves at once,
    // the second is held for 2 s, a third would be denied.
    const SHAPED: &str = r#"
[[rules]]
name = "shaped"
key = ["ip"]
algorithm = "leaky_bucket"
mode = "shape"
limit = 1
window = "2s"
burst = 2
"#;
    let upstream = Upstream::start().await;
    let proxy = Proxy::start(SHAPED, upstream.url(), ProxyOptions::default()).await;
    assert_eq!(get(&proxy.url("/first")).await.0, StatusCode::CREATED);

    // The second gives up while held: its connection closes, the proxy
    // drops the request and gives its turn back.
    let url = proxy.url("/second");
    let gave_up = tokio::time::timeout(Duration::from_millis(200), async move { get(&url).await });
    assert!(gave_up.await.is_err(), "the second was held");
    tokio::time::sleep(Duration::from_millis(200)).await;

    // So the third is held, not denied, and forwarded on its turn.
    let (status, ..) = get(&proxy.url("/third")).await;
    assert_eq!(status, StatusCode::CREATED);
    let paths: Vec<String> = upstream.seen().into_iter().map(|s| s.uri).collect();
    assert_eq!(paths, ["/first", "/third"]);
}

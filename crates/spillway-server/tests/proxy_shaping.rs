//! The proxy on tokio's paused clock: shaped requests leave exactly on
//! their turn, and a connect timeout is a 504. The proxy service is driven
//! with `oneshot`, and its upstream is a hyper server on an in-memory pipe,
//! so that no real socket makes the paused clock jump.

use std::convert::Infallible;
use std::future::{Pending, Ready};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use spillway_server::config::Config;
use spillway_server::proxy::{Proxy, ProxyOptions};
use spillway_server::state::{Live, Loaded};
use spillway_tower::ClientAddr;
use tokio::io::DuplexStream;
use tokio::time::Instant;
use tower::{Service, ServiceExt};

/// One end of an in-memory connection, as hyper's client wants it.
struct Pipe(TokioIo<DuplexStream>);

impl hyper::rt::Read for Pipe {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for Pipe {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl Connection for Pipe {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// Connects to an in-memory upstream that notes when each request arrives.
#[derive(Clone, Default)]
struct InMemoryUpstream {
    arrivals: Arc<Mutex<Vec<Instant>>>,
}

impl Service<Uri> for InMemoryUpstream {
    type Response = Pipe;
    type Error = io::Error;
    type Future = Ready<io::Result<Pipe>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let arrivals = self.arrivals.clone();
        let service = service_fn(move |_: Request<Incoming>| {
            arrivals.lock().expect("not poisoned").push(Instant::now());
            std::future::ready(Ok::<_, Infallible>(Response::new(Full::new(
                Bytes::from_static(b"served"),
            ))))
        });
        tokio::spawn(
            hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(server), service),
        );
        std::future::ready(Ok(Pipe(TokioIo::new(client))))
    }
}

/// An upstream that never accepts the connection.
#[derive(Clone)]
struct Unanswering;

impl Service<Uri> for Unanswering {
    type Response = Pipe;
    type Error = io::Error;
    type Future = Pending<io::Result<Pipe>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        std::future::pending()
    }
}

async fn shared(config: &str) -> Arc<Live> {
    let config = Config::parse(config).expect("a valid config");
    let engine = Loaded::build(config, None, None).await.expect("an engine");
    Arc::new(Live::new(engine))
}

fn request(peer: &str) -> Request<Full<Bytes>> {
    let mut req = Request::get("/report?page=1")
        .header("host", "api.example.com")
        .body(Full::default())
        .expect("a request");
    let peer: SocketAddr = peer.parse().expect("an address");
    req.extensions_mut().insert(ClientAddr(peer));
    req
}

/// 10 per 10 s: one unit leaves every second; three fit in the bucket.
const SHAPED: &str = r#"
[[rules]]
name = "shaped"
key = ["ip"]
algorithm = "leaky_bucket"
mode = "shape"
limit = 10
window = "10s"
burst = 3
"#;

#[tokio::test(start_paused = true)]
async fn shaped_requests_are_held_for_their_turn_then_forwarded_and_the_rest_denied_at_once() {
    let upstream = InMemoryUpstream::default();
    let proxy = Proxy::with_connector(
        &"http://upstream.test".parse().expect("a URL"),
        shared(SHAPED).await,
        &ProxyOptions::default(),
        upstream.clone(),
    )
    .expect("a valid upstream");
    let interval = Duration::from_secs(1);

    let t0 = Instant::now();
    // The limiter's store runs on the real clock, tokio's timers on the
    // paused one: the delays it hands out are short by the real time that
    // passes between the first and the last decision.
    let real = std::time::Instant::now();
    let requests: Vec<_> = (0..5)
        .map(|_| {
            let proxy = proxy.clone();
            tokio::spawn(async move {
                let res = proxy
                    .oneshot(request("192.0.2.1:40000"))
                    .await
                    .expect("infallible");
                let status = res.status();
                let body = res.into_body().collect().await.expect("a body").to_bytes();
                (status, body, Instant::now() - t0)
            })
        })
        .collect();
    let mut results = Vec::new();
    for r in requests {
        results.push(r.await.expect("the request task"));
    }
    let skew = real.elapsed();

    let mut admitted: Vec<Duration> = results
        .iter()
        .filter(|(status, ..)| *status == StatusCode::OK)
        .map(|(_, body, done)| {
            assert_eq!(body, "served");
            *done
        })
        .collect();
    admitted.sort();
    let denied: Vec<Duration> = results
        .iter()
        .filter(|(status, ..)| *status == StatusCode::TOO_MANY_REQUESTS)
        .map(|(.., done)| *done)
        .collect();
    assert_eq!((admitted.len(), denied.len()), (3, 2), "{results:?}");
    assert!(
        denied.iter().all(|d| *d < Duration::from_millis(1)),
        "over the bucket: denied at once, not held ({denied:?})"
    );

    let mut arrivals: Vec<Duration> = upstream
        .arrivals
        .lock()
        .expect("not poisoned")
        .iter()
        .map(|t| *t - t0)
        .collect();
    arrivals.sort();
    assert_eq!(arrivals.len(), 3, "only the admitted reached the upstream");
    for (k, arrived) in arrivals.iter().enumerate() {
        let turn = interval * k as u32;
        // Tokio's timer rounds up to the millisecond.
        assert!(
            *arrived + skew >= turn && *arrived <= turn + Duration::from_millis(1),
            "request {k} reached the upstream at {arrived:?}, its turn is {turn:?} (skew {skew:?})"
        );
        assert!(
            admitted[k] >= *arrived && admitted[k] <= *arrived + Duration::from_millis(1),
            "request {k}'s response came back at {:?}, right after it was served",
            admitted[k]
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_upstream_that_never_accepts_the_connection_gives_504_after_the_connect_timeout() {
    let options = ProxyOptions {
        connect_timeout: Duration::from_secs(3),
        ..ProxyOptions::default()
    };
    let proxy = Proxy::with_connector(
        &"http://upstream.test".parse().expect("a URL"),
        shared("").await,
        &options,
        Unanswering,
    )
    .expect("a valid upstream");

    let t0 = Instant::now();
    let res = proxy
        .oneshot(request("192.0.2.1:40000"))
        .await
        .expect("infallible");
    assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let waited = Instant::now() - t0;
    assert!(
        waited >= Duration::from_secs(3) && waited <= Duration::from_millis(3_001),
        "gave up after {waited:?}"
    );
    let body = res.into_body().collect().await.expect("a body").to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(problem["status"], 504);
    assert_eq!(problem["title"], "Gateway Timeout");
}

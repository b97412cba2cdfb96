//! The proxy's path for clients it accepts itself: each HTTP/1.1 client
//! connection is served by the proxy's own server while its requests are
//! plain ([`plain`]), then by hyper's HTTP/1.1 server, and forwarded over
//! one upstream connection of its own ([`upstream`](super::upstream)), all
//! driven in the connection's task; each HTTP/2 client connection (prior
//! knowledge) by hyper's HTTP/2 server, its requests over upstream
//! connections of its own, driven in the requests' tasks, within the pool's
//! cap for all HTTP/2 clients ([`Pool`]).
//!
//! hyper parses every request that is not plain; the request reaches the
//! upstream written from the parts the rules decided on, its body decoded
//! and framed again by the proxy (`Content-Length` or chunked, from what
//! hyper parsed), never as the client's bytes. The rate limiter sees each
//! request as the middleware would.
//!
//! A pooled client sends each request to another task and waits for it to
//! answer; on two cores that was most of the proxy's time (see
//! BENCHMARKS.md). Here nothing crosses tasks: an upstream connection is
//! written and read by the task that serves the request.

use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use spillway_tower::{ClientAddr, Draining, HoldCap};
use tokio::net::TcpStream;

use super::deadline::HeadTimer;
use super::forward::{Forward, Sender};
use super::plain;
use super::service::limit;
use super::upstream::{OwnUpstream, Pool};
use super::{Connector, Proxy};
use crate::http1::wire::{MAX_HEAD, MAX_HEADERS};
use crate::http1::{self, Client, Lifetime, Timeouts};

/// What every connection of one relay shares.
pub(crate) struct Relay<C> {
    /// The client connections' deadlines (`head` for heads and the
    /// HTTP/2 preface, `write` for every write, HTTP/2's `idle`).
    pub(crate) timeouts: Timeouts,
    /// The rules, the options, and the forwarding every connection's own
    /// is made from; HTTP/2 clients are served by it whole.
    pub(crate) proxy: Proxy<C>,
    /// The requests held for their shaping turn, all connections together
    /// (`[proxy] max_held`).
    pub(crate) held: HoldCap,
    /// The HTTP/2 clients' upstream connections.
    pub(crate) pool: Arc<Pool>,
}

impl<C: Connector> Relay<C> {
    /// The proxy's forwarding over `own`, one client connection's upstream
    /// connections. In an `Arc`, so that the service is `Unpin` whatever
    /// the connector.
    fn forward_over(&self, own: Arc<OwnUpstream>) -> Arc<Forward<C>> {
        Arc::new(Forward {
            send: Sender::Own(own),
            ..self.proxy.forward.clone()
        })
    }
}

/// What the rate limiter reads of a request's connection: its peer, the
/// server's stop, the cap on requests held for their shaping turn.
pub(crate) fn mark<B>(req: &mut Request<B>, peer: SocketAddr, draining: &Draining, held: &HoldCap) {
    let extensions = req.extensions_mut();
    extensions.insert(ClientAddr(peer));
    extensions.insert(draining.clone());
    extensions.insert(held.clone());
}

/// Serves one client connection until it closes, fails, or the server
/// stops (a request in flight finishes first).
pub(crate) async fn serve<C: Connector>(
    relay: Arc<Relay<C>>,
    stream: TcpStream,
    peer: SocketAddr,
    life: Lifetime,
) {
    let mut client = Client::with_timeouts(stream, peer, life.closing, relay.timeouts);
    let bounds = relay.proxy.options.bounds;
    if !bounds.http2 {
        // An HTTP/2 preface is then a request hyper's HTTP/1.1 server
        // refuses (505).
        return serve_h1(&relay, client).await;
    }
    match client.sniff().await {
        Ok(true) => {
            // The connection's requests go on upstream connections of its
            // own, driven by the requests' tasks: none is handed to a pool's
            // task and back.
            let proxy = &relay.proxy;
            let own = OwnUpstream::shared(
                super::headers::Hop::of(peer.ip()),
                proxy.forward.upstream.clone(),
                &proxy.options,
                &relay.pool,
            );
            let forward = relay.forward_over(own);
            let shared = proxy.shared.clone();
            let draining = Draining::new(client.closing.receiver());
            let held = relay.held.clone();
            let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                mark(&mut req, peer, &draining, &held);
                limit(&shared, Forward::clone(&forward), req)
            });
            let limits = http1::H2Limits {
                max_streams: bounds.http2_max_streams.get(),
            };
            http1::serve_h2(client, service, limits).await;
        }
        Ok(false) => serve_h1(&relay, client).await,
        Err(e) => tracing::debug!(%peer, error = %e, "connection closed with an error"),
    }
}

/// Serves an HTTP/1.1 client, each request through the rate limiter, then
/// to this connection's own upstream connection: its plain requests by the
/// proxy's own server ([`plain`]); from the first other one on, by hyper's.
async fn serve_h1<C: Connector>(relay: &Relay<C>, client: Client) {
    let proxy = &relay.proxy;
    let own = Arc::new(OwnUpstream::new(
        super::headers::Hop::of(client.peer.ip()),
        proxy.forward.upstream.clone(),
        &proxy.options,
    ));
    let forward = relay.forward_over(own.clone());
    match plain::serve(relay, &forward, client).await {
        plain::Left::Closed => {}
        plain::Left::NotPlain(client) => {
            // hyper writes a response's head from its header map.
            own.raw_heads.store(false, Ordering::Relaxed);
            serve_hyper(relay, *client, own, forward).await;
        }
    }
}

/// Serves the rest of an HTTP/1.1 client's requests with hyper, each
/// through the rate limiter, then to `own`, the connection's own upstream.
async fn serve_hyper<C: Connector>(
    relay: &Relay<C>,
    client: Client,
    own: Arc<OwnUpstream>,
    forward: Arc<Forward<C>>,
) {
    let peer = client.peer;
    let (io, mut closing) = client.into_io();
    let proxy = &relay.proxy;
    let shared = proxy.shared.clone();
    let draining = Draining::new(closing.receiver());
    let held = relay.held.clone();
    // Whether a request is being served (from its head to its response's),
    // for what the connection does when the server stops.
    let serving = Arc::new(AtomicBool::new(false));
    let busy = serving.clone();
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        mark(&mut req, peer, &draining, &held);
        WhileServing {
            served: limit(&shared, Forward::clone(&forward), req),
            _serving: Serving::new(&busy),
            draining: draining.clone(),
        }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    // One timer for every request head of the connection.
    http.timer(HeadTimer::default())
        .header_read_timeout(relay.timeouts.head)
        // Heads and small bodies copied into one buffer, one write: cheaper
        // than a vectored write of their pieces (measured).
        .writev(false)
        .max_headers(MAX_HEADERS)
        .max_header_size(MAX_HEAD);
    let io = WriteDeadline::new(io, relay.timeouts.write);
    let mut conn = http.serve_connection(TokioIo::new(io), service);
    let mut stopping = false;
    let served = poll_fn(|cx| {
        if !stopping && closing.poll_wait(cx).is_ready() {
            stopping = true;
            // Between requests, hyper would close at once, even on a
            // request that has arrived unread: it is polled first, so that
            // it reads that request, and answers it before it closes.
            if !serving.load(Ordering::Relaxed) {
                let polled = conn.poll_without_shutdown(cx);
                if polled.is_ready() {
                    return polled;
                }
            }
            // The request in flight is answered (`Connection: close`);
            // then the connection closes.
            Pin::new(&mut conn).graceful_shutdown();
        }
        conn.poll_without_shutdown(cx)
    })
    .await;
    if let Err(e) = served {
        tracing::debug!(%peer, error = %e, "connection closed with an error");
    }
    drop(own);
    let mut io = conn.into_parts().io.into_inner().inner;
    http1::linger(&mut io, &mut closing).await;
}

/// Marks a connection's request as being served while alive.
struct Serving(Arc<AtomicBool>);

impl Serving {
    fn new(flag: &Arc<AtomicBool>) -> Self {
        flag.store(true, Ordering::Relaxed);
        Self(flag.clone())
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

/// A request's answer, marked [`Serving`] until it is ready; made once
/// the server is stopping, it says `Connection: close` (hyper then closes
/// after it), even if hyper was not told to stop before it was ready.
struct WhileServing<F> {
    served: F,
    _serving: Serving,
    draining: Draining,
}

impl<F, B, E> Future for WhileServing<F>
where
    F: Future<Output = Result<Response<B>, E>> + Unpin,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        let mut answered = std::task::ready!(Pin::new(&mut self.served).poll(cx));
        if let Ok(res) = &mut answered
            && self.draining.is_stopping()
        {
            res.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
        Poll::Ready(answered)
    }
}

pin_project_lite::pin_project! {
    /// A connection whose writes fail once one has waited `timeout` for the
    /// peer to read: a client that stops reading its response cannot hold
    /// the connection (and its upstream connection) for ever. The timer
    /// starts only when a write has to wait.
    pub(crate) struct WriteDeadline<T> {
        #[pin]
        inner: T,
        timeout: Duration,
        waiting: Option<Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<T> WriteDeadline<T> {
    pub(crate) fn new(inner: T, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            waiting: None,
        }
    }
}

impl<T> WriteDeadline<T> {
    /// What a write returned: `Pending` starts (or goes on with) the wait,
    /// anything else ends it; past the timeout, an error.
    fn watch<R>(
        waiting: &mut Option<Pin<Box<tokio::time::Sleep>>>,
        timeout: Duration,
        cx: &mut std::task::Context<'_>,
        polled: Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>> {
        if polled.is_ready() {
            *waiting = None;
            return polled;
        }
        let sleep = waiting.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client stopped reading",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: tokio::io::AsyncRead> tokio::io::AsyncRead for WriteDeadline<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.project().inner.poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite> tokio::io::AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.project();
        let polled = this.inner.poll_write(cx, buf);
        Self::watch(this.waiting, *this.timeout, cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.project();
        let polled = this.inner.poll_write_vectored(cx, bufs);
        Self::watch(this.waiting, *this.timeout, cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.project();
        let polled = this.inner.poll_flush(cx);
        Self::watch(this.waiting, *this.timeout, cx, polled)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

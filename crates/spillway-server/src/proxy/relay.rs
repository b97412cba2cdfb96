//! The proxy's HTTP/1.1 path: each client connection is served by hyper's
//! HTTP/1.1 server and forwarded over one upstream connection of its own,
//! made with hyper's HTTP/1.1 client, both driven in the connection's task.
//!
//! hyper parses and writes every byte of framing, both ways: a request
//! body reaches the upstream decoded and framed again by the proxy
//! (`Content-Length` or chunked, from what hyper parsed), never as the
//! client's bytes, so what the rules decided on is what the upstream reads.
//! The rate limiter sees each request as the middleware would. HTTP/2
//! clients (prior knowledge) are served by hyper's HTTP/2 server and the
//! pooled client.
//!
//! A pooled client sends each request to another task and waits for it to
//! answer; on two cores that was most of the proxy's time (see
//! BENCHMARKS.md). Here nothing crosses tasks: the upstream connections'
//! futures are polled by the task that serves the client.

use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use spillway_tower::{ClientAddr, Draining, HoldCap};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower::ServiceExt;

use super::deadline::{ConnDeadline, HeadTimer};
use super::error::ForwardError;
use super::forward::{Forward, Sender, Upstream};
use super::service::limit;
use super::{Connector, Proxy, ProxyBody};
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
            let proxy = relay.proxy.clone();
            let draining = Draining::new(client.closing.receiver());
            let held = relay.held.clone();
            let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                req.extensions_mut().insert(ClientAddr(peer));
                req.extensions_mut().insert(draining.clone());
                req.extensions_mut().insert(held.clone());
                proxy.clone().oneshot(req)
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

/// An upstream connection's future: it reads and writes that connection.
type UpConn = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Serves an HTTP/1.1 client with hyper, each request through the rate
/// limiter, then to this connection's own upstream connection.
async fn serve_h1<C: Connector>(relay: &Relay<C>, client: Client) {
    let peer = client.peer;
    let (io, mut closing) = client.into_io();
    let proxy = &relay.proxy;
    let own = Arc::new(OwnUpstream {
        hop: super::headers::hop_of(peer.ip()),
        kept: Mutex::new(None),
        made: Mutex::new(Vec::new()),
        fresh: AtomicBool::new(false),
        upstream: proxy.forward.upstream.clone(),
        connect_timeout: proxy.options.connect_timeout,
        idle_timeout: proxy.options.pool_idle_timeout,
        response: ConnDeadline::default(),
    });
    // The proxy's forwarding, over this connection's own upstream. In an
    // `Arc`, so that the service is `Unpin` whatever the connector.
    let forward = Arc::new(Forward {
        send: Sender::<C>::Own(own.clone()),
        ..proxy.forward.clone()
    });
    let shared = proxy.shared.clone();
    let draining = Draining::new(closing.receiver());
    let held = relay.held.clone();
    // Whether a request is being served (from its head to its response's),
    // for what the connection does when the server stops.
    let serving = Arc::new(AtomicBool::new(false));
    let busy = serving.clone();
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        req.extensions_mut().insert(ClientAddr(peer));
        req.extensions_mut().insert(draining.clone());
        req.extensions_mut().insert(held.clone());
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
    // The upstream connections this one has made; finished ones go.
    let mut ups: Vec<UpConn> = Vec::new();
    let mut stopping = false;
    let served = poll_fn(|cx| {
        // A flag read at every wake-up: a channel's receive there cost
        // about 2% of a request (callgrind).
        if own.fresh.swap(false, Ordering::Acquire) {
            ups.append(&mut own.made.lock().unwrap_or_else(PoisonError::into_inner));
        }
        ups.retain_mut(|up| up.as_mut().poll(cx).is_pending());
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
    drop(ups);
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

/// One client connection's upstream connection, kept between its requests
/// and made again when the upstream has closed it.
pub(crate) struct OwnUpstream {
    /// The client's address as an `X-Forwarded-For` hop.
    pub(crate) hop: http::HeaderValue,
    /// The connection to send the next request on, and since when it has
    /// been idle.
    kept: Mutex<Option<(SendRequest<ProxyBody>, Instant)>>,
    /// New connections' futures, for the client connection's task to poll
    /// (it is woken when one is added, and `fresh` is set).
    made: Mutex<Vec<UpConn>>,
    fresh: AtomicBool,
    upstream: Arc<Upstream>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// The deadline of the response head in flight (one at a time).
    pub(crate) response: ConnDeadline,
}

impl OwnUpstream {
    /// Sends `req` on the kept connection, or on a new one if there is none
    /// or the kept one was closed before the request went out (then hyper
    /// gives it back whole, body included, and it is sent again).
    pub(crate) async fn send(
        &self,
        mut req: Request<ProxyBody>, // in origin form
    ) -> Result<Response<Incoming>, ForwardError> {
        if let Some(mut sender) = self.take_kept()
            && sender.ready().await.is_ok()
        {
            match sender.try_send_request(req).await {
                Ok(res) => {
                    self.keep(sender);
                    return Ok(res);
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) => {
                        tracing::debug!(error = %e.error(), "a kept upstream connection was closed; sending again on a new one");
                        req = unsent;
                    }
                    None => return Err(ForwardError::Unreachable(Box::new(e.into_error()))),
                },
            }
        }
        let mut sender = self.connect().await?;
        let res = sender
            .send_request(req)
            .await
            .map_err(|e| ForwardError::Unreachable(Box::new(e)))?;
        self.keep(sender);
        Ok(res)
    }

    /// The kept connection, if it is open and has not been idle too long.
    fn take_kept(&self) -> Option<SendRequest<ProxyBody>> {
        let (sender, since) = self
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        (since.elapsed() < self.idle_timeout && !sender.is_closed()).then_some(sender)
    }

    fn keep(&self, sender: SendRequest<ProxyBody>) {
        *self.kept.lock().unwrap_or_else(PoisonError::into_inner) = Some((sender, Instant::now()));
    }

    /// A new connection to the upstream, its future handed to the task.
    async fn connect(&self) -> Result<SendRequest<ProxyBody>, ForwardError> {
        let authority = self.upstream.authority();
        let port = authority.port_u16().unwrap_or(80);
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let timeout = self.connect_timeout;
        let stream = match tokio::time::timeout(timeout, TcpStream::connect((host, port))).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(ForwardError::Unreachable(Box::new(e))),
            Err(_) => return Err(ForwardError::ConnectTimeout(timeout)),
        };
        // Requests are small writes answered at once: no Nagle delay.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .writev(false)
            .max_headers(MAX_HEADERS)
            .max_header_size(MAX_HEAD)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ForwardError::Unreachable(Box::new(e)))?;
        self.made
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Box::pin(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "upstream connection closed with an error");
                }
            }));
        self.fresh.store(true, Ordering::Release);
        // This runs in the client connection's task (its request's
        // future): woken, it polls the new connection before it waits.
        poll_fn(|cx| {
            cx.waker().wake_by_ref();
            Poll::Ready(())
        })
        .await;
        Ok(sender)
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

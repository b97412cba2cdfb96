//! The proxy's HTTP/1.1 path: each client connection relays its requests,
//! one after another, over one upstream connection of its own, in one task.
//!
//! Heads are parsed with `httparse` and written back as bytes; bodies are
//! passed through as they come, framing and all (a chunked body stays
//! chunked, except to an HTTP/1.0 client, which gets the data alone); the
//! rate limiter sees each request as the middleware would (the same
//! [`RateLimit`](spillway_tower::RateLimit) service, around a service that
//! hands the request back to be forwarded). HTTP/2 clients (prior
//! knowledge) are handed to hyper and the pooled client.
//!
//! A pooled client sends each request to another task and waits for it to
//! answer; on two cores that was most of the proxy's time (see
//! BENCHMARKS.md). Here nothing crosses tasks.

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use spillway_tower::{ClientAddr, ResponseBody};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tower::{Layer, ServiceExt};

use super::error::ForwardError;
use super::forward::{TrustedPeer, Upstream, rewrite_head};
use super::wire::{self, Chunked, Framing, MAX_HEAD, RequestHead, WireError};
use super::{Connector, HostHeader, Proxy};
use crate::engine::{Engine, Shared};

/// How long a client may take to send a request head, idle keep-alive
/// time included (hyper's default, which the hyper path used).
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// The most of a denied request's body read and thrown away to keep its
/// connection; past it, the connection is closed instead.
const MAX_DRAIN: u64 = 64 * 1024;
/// How much a body copy reads at a time.
const CHUNK: usize = 16 * 1024;
/// How long, and how much, a closing connection reads and drops (see
/// `Conn::linger`).
const LINGER: Duration = Duration::from_secs(5);
const LINGER_BYTES: usize = 16 * 1024 * 1024;
/// The HTTP/2 connection preface a prior-knowledge client starts with.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What every connection of one relay shares.
pub(crate) struct Relay<C> {
    pub(crate) shared: Arc<Shared>,
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) host: HostHeader,
    pub(crate) connect_timeout: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    /// For HTTP/2 clients.
    pub(crate) proxy: Proxy<C>,
}

/// Ends a connection's task: `closing` turns true when the server stops
/// accepting; `_alive` is dropped when the connection is done, which the
/// server waits for.
pub(crate) struct Lifetime {
    pub(crate) closing: watch::Receiver<bool>,
    pub(crate) _alive: mpsc::Sender<()>,
}

/// Serves one client connection until it closes, fails, or the server
/// stops (a request in flight finishes first).
pub(crate) async fn serve<C: Connector>(
    relay: Arc<Relay<C>>,
    stream: TcpStream,
    peer: SocketAddr,
    life: Lifetime,
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "could not set TCP_NODELAY");
    }
    let mut conn = Conn {
        relay,
        down: stream,
        peer,
        hop: super::headers::hop_of(peer.ip()),
        buf: BytesMut::with_capacity(8 * 1024),
        up: None,
        out: Vec::with_capacity(4 * 1024),
        lines: Vec::with_capacity(1024),
        deadline: Some(Deadline::new(Instant::now() + HEAD_TIMEOUT)),
        started: Instant::now(),
        closing: life.closing,
    };
    match conn.sniff().await {
        Ok(true) => conn.serve_h2().await,
        Ok(false) => conn.run().await,
        Err(e) => tracing::debug!(%peer, error = %e, "connection closed with an error"),
    }
}

/// A connection's one timer, for whatever it waits for now (a request
/// head, a response head). The deadline moves with every request but the
/// timer is reset only when it fires before it: about once per
/// [`HEAD_TIMEOUT`] rather than twice per request.
struct Deadline {
    timer: Pin<Box<tokio::time::Sleep>>,
    at: Instant,
}

impl Deadline {
    fn new(at: Instant) -> Self {
        Self {
            timer: Box::pin(tokio::time::sleep_until(at)),
            at,
        }
    }

    /// Moves the deadline to `at`.
    fn set(&mut self, at: Instant) {
        self.at = at;
        if self.timer.deadline() > at {
            self.timer.as_mut().reset(at);
        }
    }

    /// Returns once the deadline has passed.
    async fn passed(&mut self) {
        loop {
            self.timer.as_mut().await;
            if Instant::now() >= self.at {
                return;
            }
            let at = self.at;
            self.timer.as_mut().reset(at);
        }
    }
}

/// An upstream connection, kept for the client connection's next request.
struct UpConn {
    stream: TcpStream,
    buf: BytesMut,
    /// Whether it has carried a request (a reused connection may have been
    /// closed by the upstream meanwhile).
    used: bool,
}

/// One client connection.
struct Conn<C> {
    relay: Arc<Relay<C>>,
    down: TcpStream,
    peer: SocketAddr,
    /// The peer as an `X-Forwarded-For` hop.
    hop: HeaderValue,
    /// What the client sent and has not been used yet.
    buf: BytesMut,
    up: Option<UpConn>,
    /// What is being written.
    out: Vec<u8>,
    /// When the current wait ends (taken while a response is waited for).
    deadline: Option<Deadline>,
    /// When the last request head started to be read.
    started: Instant,
    /// A response's header lines, while its head is written.
    lines: Vec<u8>,
    closing: watch::Receiver<bool>,
}

/// How an exchange ended, for the connection: go on, or close.
enum Next {
    KeepAlive,
    Close,
}

/// Why a request could not be forwarded, and whether the client has had
/// a response head already (then only closing is left).
enum Failed {
    /// Nothing sent to the client yet: answer with this.
    Answer(ForwardError),
    /// The client got (part of) a response, or is gone: close.
    Close(io::Error),
}

impl Failed {
    /// The same failure once the client has had a response head.
    fn into_close(self) -> io::Error {
        match self {
            Self::Answer(e) => io::Error::other(e.to_string()),
            Self::Close(e) => e,
        }
    }
}

impl From<io::Error> for Failed {
    fn from(e: io::Error) -> Self {
        Self::Close(e)
    }
}

/// A request handed back by the rate limiter to be forwarded: the inner
/// service of the limiter's [`RateLimit`](spillway_tower::RateLimit)
/// returns it as its response's body.
struct Pass(Parts);

/// The inner service: hands the request back.
#[derive(Clone, Copy)]
struct HandBack;

impl tower::Service<Request<()>> for HandBack {
    type Response = Response<Pass>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Pass>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<()>) -> Self::Future {
        std::future::ready(Ok(Response::new(Pass(req.into_parts().0))))
    }
}

/// Whether `peer` is one of the policy's trusted proxies.
pub(crate) fn is_trusted(engine: &Engine, peer: &SocketAddr) -> bool {
    engine
        .layer
        .policy()
        .client_settings()
        .trusted_proxies
        .iter()
        .any(|net| net.contains(&peer.ip()))
}

impl<C: Connector> Conn<C> {
    /// Reads the first bytes: whether the client speaks HTTP/2 (prior
    /// knowledge). What was read stays in `buf` either way.
    async fn sniff(&mut self) -> io::Result<bool> {
        loop {
            let n = self.buf.len().min(H2_PREFACE.len());
            if self.buf[..n] != H2_PREFACE[..n] {
                return Ok(false);
            }
            if n == H2_PREFACE.len() {
                return Ok(true);
            }
            let read = tokio::select! {
                read = tokio::time::timeout(HEAD_TIMEOUT, self.down.read_buf(&mut self.buf)) => read,
                () = closed(&mut self.closing) => return Ok(false),
            };
            match read {
                Ok(Ok(0)) => return Ok(false),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e),
                // Silent since it connected: closed now, not given a second
                // wait for a request head.
                Err(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client sent nothing",
                    ));
                }
            }
        }
    }

    /// Serves an HTTP/2 client with hyper and the pooled client.
    async fn serve_h2(self) {
        let proxy = self.relay.proxy.clone();
        let peer = self.peer;
        let service = hyper::service::service_fn(move |mut req: Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ClientAddr(peer));
            proxy.clone().oneshot(req)
        });
        let io = TokioIo::new(Prefixed {
            prefix: self.buf.freeze(),
            inner: self.down,
        });
        let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        builder.timer(TokioTimer::new());
        let mut conn = pin!(builder.serve_connection(io, service));
        let mut closing = self.closing;
        let result = tokio::select! {
            result = conn.as_mut() => result,
            () = closed(&mut closing) => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = result {
            tracing::debug!(%peer, error = %e, "connection closed with an error");
        }
    }

    /// Relays requests until the connection closes.
    async fn run(mut self) {
        loop {
            match self.one().await {
                Ok(Next::KeepAlive) => {}
                Ok(Next::Close) => break,
                Err(e) => {
                    tracing::debug!(peer = %self.peer, error = %e, "connection closed with an error");
                    break;
                }
            }
        }
        self.linger().await;
    }

    /// Closes the connection without losing the last response: after its
    /// FIN, what the client still sends (the rest of a denied upload, say)
    /// is read and dropped for a while, as a close with unread data would
    /// reset the connection, and the client might lose the response.
    async fn linger(&mut self) {
        if self.down.shutdown().await.is_err() {
            return;
        }
        let (down, buf) = (&mut self.down, &mut self.buf);
        let mut dropped = 0;
        let draining = async {
            while dropped < LINGER_BYTES {
                buf.clear();
                buf.reserve(CHUNK);
                match down.read_buf(buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => dropped += n,
                }
            }
        };
        // A stopping server does not wait for it.
        tokio::select! {
            _ = tokio::time::timeout(LINGER, draining) => {}
            () = closed(&mut self.closing) => {}
        }
    }

    /// Reads, decides and relays one request.
    async fn one(&mut self) -> io::Result<Next> {
        let Some(head_len) = self.read_head().await? else {
            return Ok(Next::Close);
        };
        let head = self.buf.split_to(head_len).freeze();
        let request = match wire::parse_request(&head) {
            Ok(request) => request,
            Err(e) => {
                tracing::debug!(peer = %self.peer, error = %e, "refused a request");
                self.answer_error(e.status(), &e.to_string()).await?;
                return Ok(Next::Close);
            }
        };
        let RequestHead {
            mut parts,
            framing,
            keep_alive,
            expects_continue,
        } = request;
        let client_version = parts.version;
        let method = parts.method.clone();
        let engine = self.relay.shared.engine();
        parts.extensions.insert(ClientAddr(self.peer));
        if is_trusted(&engine, &self.peer) {
            parts.extensions.insert(TrustedPeer);
        }
        let limited = engine.layer.layer(HandBack);
        let Some(Ok(decided)) = self
            .until_decided(limited.oneshot(Request::from_parts(parts, ())))
            .await?
        else {
            // The client left while its request was held.
            return Ok(Next::Close);
        };
        drop(engine);
        let (res, body) = decided.into_parts();
        let pass = match body {
            ResponseBody::Inner { body: Pass(parts) } => parts,
            ResponseBody::Full { data } => {
                // The limiter answered (429, 400, 503): the body, if any,
                // is read and dropped, or the connection closed.
                let drain = keep_alive && !expects_continue && self.can_drain(framing);
                let close = !drain || self.is_closing();
                self.answer(&res.status, &res.headers, data.as_deref(), close)
                    .await?;
                if close || !self.drain(framing).await? {
                    return Ok(Next::Close);
                }
                return Ok(Next::KeepAlive);
            }
        };
        if method == Method::CONNECT {
            let refused = ForwardError::Unsupported(method);
            self.answer_forward_error(refused, &res.headers).await?;
            return Ok(Next::Close);
        }
        let exchange = Exchange {
            framing,
            keep_alive: keep_alive && !self.is_closing(),
            expects_continue,
            client_version,
            method,
        };
        match self.forward(pass, &exchange, &res.headers).await {
            Ok(next) => Ok(next),
            Err(Failed::Answer(error)) => {
                tracing::warn!(upstream = %self.relay.upstream.base(), error = %error, "could not forward a request");
                self.up = None;
                self.answer_forward_error(error, &res.headers).await?;
                Ok(Next::Close)
            }
            Err(Failed::Close(e)) => {
                self.up = None;
                Err(e)
            }
        }
    }

    fn is_closing(&self) -> bool {
        *self.closing.borrow()
    }

    /// Reads until `buf` holds a whole request head; `None` if the client
    /// closed (or the server is stopping) between requests.
    async fn read_head(&mut self) -> io::Result<Option<usize>> {
        self.started = Instant::now();
        if let Some(deadline) = &mut self.deadline {
            deadline.set(self.started + HEAD_TIMEOUT);
        }
        loop {
            // Blank lines before a request are skipped (RFC 9112 section
            // 2.2).
            while self.buf.starts_with(b"\r\n") || self.buf.starts_with(b"\n") {
                let blank = if self.buf[0] == b'\r' { 2 } else { 1 };
                self.buf.advance(blank);
            }
            if let Some(end) = wire::head_end(&self.buf) {
                return Ok(Some(end));
            }
            if self.buf.len() >= MAX_HEAD {
                let e = WireError::TooLarge;
                self.answer_error(e.status(), &e.to_string()).await?;
                return Ok(None);
            }
            let idle = self.buf.is_empty();
            if idle && self.is_closing() {
                return Ok(None);
            }
            self.buf.reserve(4 * 1024);
            let read = tokio::select! {
                biased;
                read = self.down.read_buf(&mut self.buf) => read?,
                () = passed(&mut self.deadline) => return Ok(None),
                () = closed(&mut self.closing), if idle => return Ok(None),
            };
            if read == 0 {
                return Ok(None);
            }
        }
    }

    /// Waits for the rate limiter's answer, noticing a client that leaves
    /// meanwhile (`None`: dropping the future gives a held request's turn
    /// back). What the client sends meanwhile is kept in `buf`.
    async fn until_decided<F: Future>(&mut self, decided: F) -> io::Result<Option<F::Output>> {
        let mut decided = pin!(decided);
        // The common case, answered at once, costs no read.
        if let Some(out) = poll_fn(|cx| Poll::Ready(poll_once(decided.as_mut(), cx))).await {
            return Ok(Some(out));
        }
        loop {
            let room = self.buf.len() < MAX_HEAD;
            if room {
                self.buf.reserve(4 * 1024);
            }
            tokio::select! {
                out = decided.as_mut() => return Ok(Some(out)),
                read = self.down.read_buf(&mut self.buf), if room => match read {
                    Ok(0) | Err(_) => return Ok(None),
                    Ok(_) => {}
                },
            }
        }
    }

    /// Whether a denied request's body is small enough to read and drop.
    fn can_drain(&self, framing: Framing) -> bool {
        match framing {
            Framing::Empty => true,
            Framing::Length(n) => n <= MAX_DRAIN,
            Framing::Chunked => true,
            Framing::Close => false,
        }
    }

    /// Reads a request body the upstream will never see; false if it was
    /// too long or broken (the connection is then closed).
    async fn drain(&mut self, framing: Framing) -> io::Result<bool> {
        let mut dropped = 0u64;
        match framing {
            Framing::Empty => return Ok(true),
            Framing::Length(n) => {
                let mut left = n;
                while left > 0 {
                    if self.buf.is_empty() && !self.fill_down().await? {
                        return Ok(false);
                    }
                    let take = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(self.buf.len());
                    self.buf.advance(take);
                    left -= take as u64;
                }
            }
            Framing::Chunked => {
                let mut chunked = Chunked::default();
                while !chunked.is_done() {
                    if self.buf.is_empty() && !self.fill_down().await? {
                        return Ok(false);
                    }
                    let Ok(used) = chunked.feed(&self.buf, |_| {}) else {
                        return Ok(false);
                    };
                    self.buf.advance(used);
                    dropped += used as u64;
                    if dropped > MAX_DRAIN {
                        return Ok(false);
                    }
                }
            }
            Framing::Close => return Ok(false),
        }
        Ok(true)
    }

    /// Reads more of what the client sends into `buf`; false at its end.
    async fn fill_down(&mut self) -> io::Result<bool> {
        self.buf.reserve(CHUNK);
        let read = tokio::time::timeout(HEAD_TIMEOUT, self.down.read_buf(&mut self.buf))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the client stopped sending"))??;
        Ok(read > 0)
    }

    /// Writes a response the proxy makes itself, with a whole body.
    async fn answer(
        &mut self,
        status: &StatusCode,
        headers: &HeaderMap,
        body: Option<&[u8]>,
        close: bool,
    ) -> io::Result<()> {
        let body = body.unwrap_or_default();
        self.out.clear();
        wire::put_status_line(&mut self.out, *status);
        for (name, value) in headers {
            if name != header::CONTENT_LENGTH && name != header::CONNECTION {
                wire::put_header(&mut self.out, name.as_str().as_bytes(), value.as_bytes());
            }
        }
        self.out.extend_from_slice(b"content-length: ");
        wire::put_u64(&mut self.out, body.len() as u64);
        self.out.extend_from_slice(b"\r\n");
        // The proxy is the origin of this response (RFC 9110 section 6.6.1).
        put_date(&mut self.out);
        if close {
            self.out.extend_from_slice(b"connection: close\r\n");
        }
        self.out.extend_from_slice(b"\r\n");
        self.out.extend_from_slice(body);
        self.down.write_all(&self.out).await
    }

    /// Answers a request that failed before it was forwarded (400, 431),
    /// and closes.
    async fn answer_error(&mut self, status: StatusCode, detail: &str) -> io::Result<()> {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": status.canonical_reason().unwrap_or("Error"),
            "status": status.as_u16(),
            "detail": detail,
        })
        .to_string();
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        self.answer(&status, &headers, Some(body.as_bytes()), true)
            .await
    }

    /// Answers a request that could not be forwarded (502, 504, 501), with
    /// the rate-limit headers it was given, and closes.
    async fn answer_forward_error(
        &mut self,
        error: ForwardError,
        limit_headers: &HeaderMap,
    ) -> io::Result<()> {
        let status = error.status();
        let mut headers = limit_headers.clone();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        let body = error.problem_json();
        self.answer(&status, &headers, Some(body.as_bytes()), true)
            .await
    }

    /// An upstream connection: the kept one if it is still open, else a new
    /// one. `probe`: check that a kept one has not been closed (when the
    /// request cannot be sent again).
    async fn upstream(&mut self, probe: bool, now: Instant) -> Result<UpConn, Failed> {
        if let Some(up) = self.up.take() {
            // Idle since the last response, when this request's head
            // started to be read.
            let fresh = now.duration_since(self.started) < self.relay.idle_timeout;
            if fresh && !(probe && closed_or_unexpected(&up.stream)) {
                return Ok(up);
            }
        }
        let authority = self.relay.upstream.authority();
        let port = authority.port_u16().unwrap_or(80);
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let timeout = self.relay.connect_timeout;
        let stream = match tokio::time::timeout(timeout, TcpStream::connect((host, port))).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(Failed::Answer(ForwardError::Unreachable(Box::new(e)))),
            Err(_) => return Err(Failed::Answer(ForwardError::ConnectTimeout(timeout))),
        };
        // Requests are small writes answered at once: no Nagle delay.
        stream.set_nodelay(true).map_err(Failed::Close)?;
        Ok(UpConn {
            stream,
            buf: BytesMut::with_capacity(8 * 1024),
            used: false,
        })
    }

    /// Forwards an admitted request and relays its response. The request
    /// body goes on streaming while the response comes back (an upstream
    /// may answer, or echo, before it has the whole body).
    async fn forward(
        &mut self,
        mut parts: Parts,
        exchange: &Exchange,
        limit_headers: &HeaderMap,
    ) -> Result<Next, Failed> {
        rewrite_head(
            &self.relay.upstream,
            self.relay.host,
            &mut parts,
            Some(&self.hop),
        );
        let mut head = Vec::with_capacity(512);
        write_request_head(&mut head, &parts, exchange.framing);
        drop(parts);
        if exchange.expects_continue && exchange.framing != Framing::Empty {
            self.down
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await?;
        }
        let mut body = BodyProgress::new(exchange.framing);
        // The body bytes already here go with the head, in one write.
        let buffered = body.buffered(&self.buf).map_err(refused_body)?;
        head.extend_from_slice(&self.buf[..buffered]);
        body.sent(&self.buf[..buffered]).map_err(refused_body)?;
        self.buf.advance(buffered);
        // A request without a body can be sent again on a new connection
        // if a kept one turns out to have been closed.
        let replayable = exchange.framing == Framing::Empty;
        let now = Instant::now();
        let mut up = self.upstream(!replayable, now).await?;
        let timeout = self.relay.response_timeout;
        let mut deadline = self.deadline.take();
        if let Some(deadline) = &mut deadline {
            deadline.set(now + timeout);
        }
        let exchanged = tokio::select! {
            biased;
            exchanged = async {
                let mut first = true;
                loop {
                    let reused = up.used;
                    up.used = true;
                    match self.send_and_read_head(&mut up, &head, &mut body).await {
                        Err(Failed::Answer(e)) if first && reused && replayable => {
                            tracing::debug!(error = %e, "a kept upstream connection was closed; sending again on a new one");
                            up = self.upstream(false, now).await?;
                            first = false;
                        }
                        other => return other,
                    }
                }
            } => exchanged,
            () = passed(&mut deadline) => Err(Failed::Answer(ForwardError::ResponseTimeout(timeout))),
        };
        self.deadline = deadline;
        let head_len = exchanged?;

        let (response, dechunk, keep_client) =
            self.write_response_head(&up.buf[..head_len], exchange, limit_headers)?;
        up.buf.advance(head_len);

        let Self { down, buf, out, .. } = self;
        let UpConn {
            stream,
            buf: up_buf,
            ..
        } = &mut up;
        let (mut down_r, mut down_w) = down.split();
        let (mut up_r, mut up_w) = stream.split();
        let relayed = relay_body(
            response.framing,
            dechunk,
            &mut up_r,
            up_buf,
            &mut down_w,
            out,
        );
        let complete = if body.is_done() {
            relayed.await?
        } else {
            // Both ways at once, until the response is over.
            let mut relayed = pin!(relayed);
            let mut sending = pin!(body.send_rest(&mut down_r, buf, &mut up_w));
            let mut sent = false;
            loop {
                tokio::select! {
                    done = &mut sending, if !sent => {
                        // The client has a response head: no 502 now.
                        done.map_err(Failed::into_close)?;
                        sent = true;
                    }
                    complete = &mut relayed => break complete?,
                }
            }
        };
        // An unfinished request body: the client's connection cannot be
        // read for the next request, nor the upstream's reused.
        let finished = body.is_done();
        if complete && finished && response.keep_alive && up.buf.is_empty() {
            self.up = Some(up);
        }
        if !finished && keep_client {
            // The head said keep-alive; the client learns otherwise by the
            // close.
            return Ok(Next::Close);
        }
        Ok(if keep_client && finished {
            Next::KeepAlive
        } else {
            Next::Close
        })
    }

    /// Sends the head (and what of the body is here) and reads the response
    /// head, sending the body meanwhile; informational responses are
    /// skipped. Returns the response head's length in `up.buf`. A response
    /// that comes before the whole body was sent ends the wait: the rest is
    /// sent while the response is relayed.
    async fn send_and_read_head(
        &mut self,
        up: &mut UpConn,
        head: &[u8],
        body: &mut BodyProgress,
    ) -> Result<usize, Failed> {
        up.buf.clear();
        up.stream.write_all(head).await.map_err(unreachable)?;
        let (mut down_r, _) = self.down.split();
        let (mut up_r, mut up_w) = up.stream.split();
        let mut read_head = pin!(read_response_head(&mut up_r, &mut up.buf));
        if body.is_done() {
            return read_head.await;
        }
        let mut sending = pin!(body.send_rest(&mut down_r, &mut self.buf, &mut up_w));
        tokio::select! {
            biased;
            sent = &mut sending => {
                sent?;
                read_head.await
            }
            head = &mut read_head => head,
        }
    }

    /// Writes the status line and headers of the client's response into
    /// `out`: the upstream's end-to-end headers, the rate-limit headers,
    /// the framing. Returns the parsed head, whether a chunked body is to
    /// be decoded (for an HTTP/1.0 client), and whether the client's
    /// connection is kept.
    fn write_response_head(
        &mut self,
        head: &[u8],
        exchange: &Exchange,
        limit_headers: &HeaderMap,
    ) -> Result<(wire::ResponseHead, bool, bool), Failed> {
        self.lines.clear();
        let lines = &mut self.lines;
        let mut dated = false;
        let response = wire::parse_response(head, &exchange.method, |name, value| {
            dated |= name.eq_ignore_ascii_case("date");
            // The limiter's headers replace the upstream's of the same name
            // (a handful, compared as they are: cheaper than a lookup).
            let replaced = limit_headers
                .keys()
                .any(|ours| ours.as_str().eq_ignore_ascii_case(name));
            if !replaced {
                wire::put_header(lines, name.as_bytes(), value);
            }
        })
        .map_err(|e| unreachable(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        if response.status == StatusCode::SWITCHING_PROTOCOLS {
            // `Upgrade` is never forwarded: an upstream that switches anyway
            // would speak something else on this connection.
            return Err(unreachable(io::Error::new(
                io::ErrorKind::InvalidData,
                "the upstream switched protocols unasked",
            )));
        }
        let http10 = exchange.client_version == Version::HTTP_10;
        let dechunk = http10 && response.framing == Framing::Chunked;
        let keep_client = exchange.keep_alive
            && !dechunk
            && response.framing != Framing::Close
            && !self.is_closing();
        let out = &mut self.out;
        out.clear();
        wire::put_status_line(out, response.status);
        out.extend_from_slice(&self.lines);
        if !dated {
            // A proxy with a clock dates a response that comes without a
            // date (RFC 9110 section 6.6.1).
            put_date(out);
        }
        for (name, value) in limit_headers {
            wire::put_header(out, name.as_str().as_bytes(), value.as_bytes());
        }
        match response.framing {
            Framing::Chunked if !http10 => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
            Framing::Length(n) => {
                out.extend_from_slice(b"content-length: ");
                wire::put_u64(out, n);
                out.extend_from_slice(b"\r\n");
            }
            _ => {}
        }
        if !keep_client {
            out.extend_from_slice(b"connection: close\r\n");
        } else if http10 {
            out.extend_from_slice(b"connection: keep-alive\r\n");
        }
        out.extend_from_slice(b"\r\n");
        Ok((response, dechunk, keep_client))
    }
}

/// Appends a `Date` header line for now.
fn put_date(out: &mut Vec<u8>) {
    let date = httpdate::fmt_http_date(std::time::SystemTime::now());
    wire::put_header(out, b"date", date.as_bytes());
}

/// A forwarding failure before the client got anything: 502.
fn unreachable(e: io::Error) -> Failed {
    Failed::Answer(ForwardError::Unreachable(Box::new(e)))
}

/// A request body whose framing broke: the connection closes.
fn refused_body(e: WireError) -> Failed {
    Failed::Close(io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Reads a response head into `buf`, skipping informational responses
/// (but 101); returns its length.
async fn read_response_head(
    up: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
) -> Result<usize, Failed> {
    loop {
        if let Some(end) = wire::head_end(buf) {
            if informational(&buf[..end]).is_some_and(|s| s != 101) {
                buf.advance(end);
                continue;
            }
            return Ok(end);
        }
        if buf.len() >= MAX_HEAD {
            return Err(unreachable(io::Error::new(
                io::ErrorKind::InvalidData,
                WireError::TooLarge,
            )));
        }
        buf.reserve(4 * 1024);
        if up.read_buf(buf).await.map_err(unreachable)? == 0 {
            return Err(unreachable(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the upstream closed the connection before answering",
            )));
        }
    }
}

/// Relays a response body from the upstream to the client, after the head
/// already in `out`: what is in `up_buf` goes with the head, in one write,
/// the rest as it comes. Returns whether the upstream connection is left
/// at a message boundary (false for a body delimited by its close).
async fn relay_body(
    framing: Framing,
    dechunk: bool,
    up: &mut (impl AsyncRead + Unpin),
    up_buf: &mut BytesMut,
    down: &mut (impl AsyncWrite + Unpin),
    out: &mut Vec<u8>,
) -> Result<bool, Failed> {
    let cut_short = || {
        Failed::Close(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the upstream closed the connection mid-body",
        ))
    };
    match framing {
        Framing::Empty => {
            down.write_all(out).await?;
            Ok(true)
        }
        Framing::Length(n) => {
            let mut left = n;
            loop {
                let take = usize::try_from(left)
                    .unwrap_or(usize::MAX)
                    .min(up_buf.len());
                out.extend_from_slice(&up_buf[..take]);
                up_buf.advance(take);
                left -= take as u64;
                down.write_all(out).await?;
                out.clear();
                if left == 0 {
                    return Ok(true);
                }
                up_buf.reserve(CHUNK);
                if up.read_buf(up_buf).await? == 0 {
                    return Err(cut_short());
                }
            }
        }
        Framing::Chunked => {
            let mut chunked = Chunked::default();
            loop {
                let used = if dechunk {
                    chunked.feed(up_buf, |data| out.extend_from_slice(data))
                } else {
                    chunked.feed(up_buf, |_| {})
                }
                .map_err(|e| Failed::Close(io::Error::new(io::ErrorKind::InvalidData, e)))?;
                if !dechunk {
                    out.extend_from_slice(&up_buf[..used]);
                }
                up_buf.advance(used);
                if !out.is_empty() {
                    down.write_all(out).await?;
                    out.clear();
                }
                if chunked.is_done() {
                    return Ok(true);
                }
                up_buf.reserve(CHUNK);
                if up.read_buf(up_buf).await? == 0 {
                    return Err(cut_short());
                }
            }
        }
        Framing::Close => {
            out.extend_from_slice(up_buf);
            up_buf.clear();
            loop {
                down.write_all(out).await?;
                out.clear();
                up_buf.reserve(CHUNK);
                if up.read_buf(up_buf).await? == 0 {
                    return Ok(false);
                }
                out.extend_from_slice(up_buf);
                up_buf.clear();
            }
        }
    }
}

/// What the relay knows of a request while it forwards it.
struct Exchange {
    framing: Framing,
    /// The client keeps the connection (and the server is not stopping).
    keep_alive: bool,
    expects_continue: bool,
    client_version: Version,
    method: Method,
}

/// How much of a request body has gone to the upstream.
struct BodyProgress {
    framing: Framing,
    left: u64,
    chunked: Chunked,
    done: bool,
}

impl BodyProgress {
    fn new(framing: Framing) -> Self {
        let (left, done) = match framing {
            Framing::Length(n) => (n, false),
            Framing::Chunked => (0, false),
            Framing::Empty | Framing::Close => (0, true),
        };
        Self {
            framing,
            left,
            chunked: Chunked::default(),
            done,
        }
    }

    fn is_done(&self) -> bool {
        self.done
    }

    /// How many bytes at the front of `buf` belong to the body.
    fn buffered(&self, buf: &[u8]) -> Result<usize, WireError> {
        if self.done {
            return Ok(0);
        }
        match self.framing {
            Framing::Length(_) => Ok(usize::try_from(self.left)
                .unwrap_or(usize::MAX)
                .min(buf.len())),
            Framing::Chunked => self.chunked.clone().feed(buf, |_| {}),
            Framing::Empty | Framing::Close => Ok(0),
        }
    }

    /// Counts `sent` (body bytes, as [`buffered`](Self::buffered) found
    /// them) as gone.
    fn sent(&mut self, sent: &[u8]) -> Result<(), WireError> {
        match self.framing {
            Framing::Length(_) => {
                self.left -= sent.len() as u64;
                self.done = self.left == 0;
            }
            Framing::Chunked => {
                self.chunked.feed(sent, |_| {})?;
                self.done = self.chunked.is_done();
            }
            Framing::Empty | Framing::Close => {}
        }
        Ok(())
    }

    /// Copies the rest of the body from the client to the upstream. Can be
    /// dropped and called again: nothing read is lost (each write is one
    /// call, and only what it wrote leaves `buf`).
    async fn send_rest(
        &mut self,
        down: &mut (impl AsyncRead + Unpin),
        buf: &mut BytesMut,
        up: &mut (impl AsyncWrite + Unpin),
    ) -> Result<(), Failed> {
        while !self.done {
            if buf.is_empty() {
                buf.reserve(CHUNK);
                let read = tokio::time::timeout(HEAD_TIMEOUT, down.read_buf(buf))
                    .await
                    .map_err(|_| {
                        io::Error::new(io::ErrorKind::TimedOut, "the client stopped sending")
                    })??;
                if read == 0 {
                    return Err(Failed::Close(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the client closed the connection mid-body",
                    )));
                }
            }
            let ready = self.buffered(buf).map_err(refused_body)?;
            let written = up.write(&buf[..ready]).await.map_err(unreachable)?;
            if written == 0 {
                return Err(unreachable(io::ErrorKind::WriteZero.into()));
            }
            self.sent(&buf[..written]).map_err(refused_body)?;
            buf.advance(written);
        }
        Ok(())
    }
}

/// Writes the request line and headers for the upstream: origin-form, HTTP/1.1.
fn write_request_head(out: &mut Vec<u8>, parts: &Parts, framing: Framing) {
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    out.extend_from_slice(if target.is_empty() {
        b"/"
    } else {
        target.as_bytes()
    });
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        wire::put_header(out, name.as_str().as_bytes(), value.as_bytes());
    }
    if framing == Framing::Chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// A 1xx status in a response head, if it is one.
fn informational(head: &[u8]) -> Option<u16> {
    let code = head.get(9..12)?;
    let code: u16 = std::str::from_utf8(code).ok()?.parse().ok()?;
    (100..200).contains(&code).then_some(code)
}

/// Returns once `deadline` has passed; never without one.
async fn passed(deadline: &mut Option<Deadline>) {
    match deadline {
        Some(deadline) => deadline.passed().await,
        None => std::future::pending().await,
    }
}

/// Returns once the server is stopping.
async fn closed(closing: &mut watch::Receiver<bool>) {
    // An error means the server is gone: stopping too.
    let _ = closing.wait_for(|&c| c).await;
}

/// Polls `fut` once.
fn poll_once<F: Future + ?Sized>(fut: Pin<&mut F>, cx: &mut Context<'_>) -> Option<F::Output> {
    match fut.poll(cx) {
        Poll::Ready(out) => Some(out),
        Poll::Pending => None,
    }
}

/// Whether a kept upstream connection has been closed by the upstream (or
/// sent something unasked): a peek that does not wait. It asks the socket
/// itself (one system call): the runtime may not have seen the close yet.
fn closed_or_unexpected(stream: &TcpStream) -> bool {
    let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    !matches!(
        socket2::SockRef::from(stream).peek(&mut probe),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock
    )
}

/// The client's connection with the bytes already read from it put back
/// in front, for hyper.
struct Prefixed {
    prefix: Bytes,
    inner: TcpStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

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
use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use http::header::{HeaderMap, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode, Version};
use spillway_tower::{ClientAddr, ResponseBody};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};

use super::error::ForwardError;
use super::forward::{TrustedPeer, Upstream, rewrite_head};
use super::{Connector, HostHeader, Proxy};
use crate::engine::{Engine, Shared};
use crate::http1::wire::{self, Chunked, Framing, MAX_HEAD, RequestHead, WireError};
use crate::http1::{self, CHUNK, Client, HEAD_TIMEOUT, Lifetime, Reply, Whole, passed, put_date};

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

/// Serves one client connection until it closes, fails, or the server
/// stops (a request in flight finishes first).
pub(crate) async fn serve<C: Connector>(
    relay: Arc<Relay<C>>,
    stream: TcpStream,
    peer: SocketAddr,
    life: Lifetime,
) {
    let mut conn = Conn {
        relay,
        client: Client::new(stream, peer, life.closing),
        hop: super::headers::hop_of(peer.ip()),
        up: None,
        lines: Vec::with_capacity(1024),
    };
    match conn.client.sniff().await {
        Ok(true) => conn.serve_h2().await,
        Ok(false) => conn.run().await,
        Err(e) => tracing::debug!(%peer, error = %e, "connection closed with an error"),
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
    client: Client,
    /// The peer as an `X-Forwarded-For` hop.
    hop: HeaderValue,
    up: Option<UpConn>,
    /// A response's header lines, while its head is written.
    lines: Vec<u8>,
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
    /// Serves an HTTP/2 client with hyper and the pooled client.
    async fn serve_h2(self) {
        let proxy = self.relay.proxy.clone();
        let peer = self.client.peer;
        let service = hyper::service::service_fn(move |mut req: Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ClientAddr(peer));
            proxy.clone().oneshot(req)
        });
        http1::serve_h2(self.client, service).await;
    }

    /// Relays requests until the connection closes.
    async fn run(mut self) {
        loop {
            match self.one().await {
                Ok(Next::KeepAlive) => {}
                Ok(Next::Close) => break,
                Err(e) => {
                    tracing::debug!(peer = %self.client.peer, error = %e, "connection closed with an error");
                    break;
                }
            }
        }
        self.client.linger().await;
    }

    /// Reads, decides and relays one request.
    async fn one(&mut self) -> io::Result<Next> {
        let Some(head_len) = self.client.read_head().await? else {
            return Ok(Next::Close);
        };
        let head = self.client.buf.split_to(head_len).freeze();
        let request = match wire::parse_request(&head) {
            Ok(request) => request,
            Err(e) => {
                self.client.refuse(&e).await?;
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
        // How the proxy's own answers (429, 502, ...) end.
        let mut reply = Reply {
            keep_alive: false,
            version: client_version,
            head_only: method == Method::HEAD,
        };
        let engine = self.relay.shared.engine();
        parts.extensions.insert(ClientAddr(self.client.peer));
        if is_trusted(&engine, &self.client.peer) {
            parts.extensions.insert(TrustedPeer);
        }
        let limited = engine.layer.layer(HandBack);
        let Some(Ok(decided)) = self
            .client
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
                let drain = keep_alive && !expects_continue && Client::can_drain(framing);
                reply.keep_alive = drain && !self.client.is_closing();
                let body = data.as_deref().unwrap_or_default();
                let answer = Whole::new(res.status, &res.headers, body);
                self.client.respond(&answer, reply).await?;
                if !reply.keep_alive || !self.client.drain(framing).await? {
                    return Ok(Next::Close);
                }
                return Ok(Next::KeepAlive);
            }
        };
        if method == Method::CONNECT {
            let refused = ForwardError::Unsupported(method);
            self.answer_forward_error(refused, &res.headers, reply)
                .await?;
            return Ok(Next::Close);
        }
        let exchange = Exchange {
            framing,
            keep_alive: keep_alive && !self.client.is_closing(),
            expects_continue,
            client_version,
            method,
        };
        match self.forward(pass, &exchange, &res.headers).await {
            Ok(next) => Ok(next),
            Err(Failed::Answer(error)) => {
                tracing::warn!(upstream = %self.relay.upstream.base(), error = %error, "could not forward a request");
                self.up = None;
                self.answer_forward_error(error, &res.headers, reply)
                    .await?;
                Ok(Next::Close)
            }
            Err(Failed::Close(e)) => {
                self.up = None;
                Err(e)
            }
        }
    }

    /// Answers a request that could not be forwarded (502, 504, 501), with
    /// the rate-limit headers it was given, and closes (`reply` says
    /// whether it was HEAD, and its version).
    async fn answer_forward_error(
        &mut self,
        error: ForwardError,
        limit_headers: &HeaderMap,
        reply: Reply,
    ) -> io::Result<()> {
        let body = error.problem_json();
        let answer = Whole {
            content_type: Some("application/problem+json"),
            ..Whole::new(error.status(), limit_headers, body.as_bytes())
        };
        let reply = Reply {
            keep_alive: false,
            ..reply
        };
        self.client.respond(&answer, reply).await
    }

    /// An upstream connection: the kept one if it is still open, else a new
    /// one. `probe`: check that a kept one has not been closed (when the
    /// request cannot be sent again).
    async fn upstream(&mut self, probe: bool, now: Instant) -> Result<UpConn, Failed> {
        if let Some(up) = self.up.take() {
            // Idle since the last response, when this request's head
            // started to be read.
            let fresh = now.duration_since(self.client.started) < self.relay.idle_timeout;
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
            self.client
                .stream
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await?;
        }
        let mut body = BodyProgress::new(exchange.framing);
        // The body bytes already here go with the head, in one write.
        let buffered = body.buffered(&self.client.buf).map_err(refused_body)?;
        head.extend_from_slice(&self.client.buf[..buffered]);
        body.sent(&self.client.buf[..buffered])
            .map_err(refused_body)?;
        self.client.buf.advance(buffered);
        // A request without a body can be sent again on a new connection
        // if a kept one turns out to have been closed.
        let replayable = exchange.framing == Framing::Empty;
        let now = Instant::now();
        let mut up = self.upstream(!replayable, now).await?;
        let timeout = self.relay.response_timeout;
        let mut deadline = self.client.deadline.take();
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
        self.client.deadline = deadline;
        let head_len = exchanged?;

        let (response, dechunk, keep_client) =
            self.write_response_head(&up.buf[..head_len], exchange, limit_headers)?;
        up.buf.advance(head_len);

        let Client {
            stream: down,
            buf,
            out,
            ..
        } = &mut self.client;
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
        let (mut down_r, _) = self.client.stream.split();
        let (mut up_r, mut up_w) = up.stream.split();
        let mut read_head = pin!(read_response_head(&mut up_r, &mut up.buf));
        if body.is_done() {
            return read_head.await;
        }
        let mut sending = pin!(body.send_rest(&mut down_r, &mut self.client.buf, &mut up_w));
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
            && !self.client.is_closing();
        let out = &mut self.client.out;
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

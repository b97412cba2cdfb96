//! HTTP/1.1 on a client connection, as both servers of our own speak it:
//! the proxy's relay (`crate::proxy`) and the API server of `spillway
//! serve` (`crate::front`).
//!
//! [`Client`] is the client's side of a connection: it reads request heads
//! (with one lazy timer per connection), notices an HTTP/2 client, writes
//! the responses the server makes itself, drops request bodies nobody
//! reads, and closes without losing the last response. [`wire`] parses and
//! writes the bytes.

pub(crate) mod wire;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap};
use http::{Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use wire::{MAX_HEAD, WireError};

/// How long a client may take to send a request head, idle keep-alive
/// time included (hyper's default, which the hyper path used).
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// How much a body copy reads at a time.
pub(crate) const CHUNK: usize = 16 * 1024;
/// How long, and how much, a closing connection reads and drops (see
/// [`Client::linger`]).
const LINGER: Duration = Duration::from_secs(5);
const LINGER_BYTES: usize = 16 * 1024 * 1024;
/// The HTTP/2 connection preface a prior-knowledge client starts with.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Ends a connection's task: `closing` turns true when the server stops
/// accepting; `_alive` is dropped when the connection is done, which the
/// server waits for.
pub(crate) struct Lifetime {
    pub(crate) closing: watch::Receiver<bool>,
    pub(crate) _alive: mpsc::Sender<()>,
}

/// Accepts connections until `shutdown` resolves, serving each in a task of
/// its own (`serve`); then waits for the connections to finish (each ends
/// once its request in flight is answered).
pub(crate) async fn serve_connections<F>(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    mut serve: impl FnMut(TcpStream, SocketAddr, Lifetime) -> F,
) where
    F: Future<Output = ()> + Send + 'static,
{
    let (closing, closing_seen) = watch::channel(false);
    let (alive, mut all_done) = mpsc::channel::<()>(1);
    let mut shutdown = std::pin::pin!(shutdown);
    while let Some((stream, peer)) = next_connection(&listener, shutdown.as_mut()).await {
        let life = Lifetime {
            closing: closing_seen.clone(),
            _alive: alive.clone(),
        };
        tokio::spawn(serve(stream, peer, life));
    }
    drop(listener);
    let _ = closing.send(true);
    drop(alive);
    // Every connection holds a sender: this ends when the last one is done.
    let _ = all_done.recv().await;
}

/// The next connection, or `None` once `shutdown` has resolved.
pub(crate) async fn next_connection(
    listener: &TcpListener,
    mut shutdown: Pin<&mut impl Future<Output = ()>>,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => return Some(accepted),
                Err(e) => {
                    // Out of file descriptors and the like: pause rather
                    // than spin; a failed handshake is just skipped.
                    tracing::warn!(error = %e, "could not accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = shutdown.as_mut() => return None,
        }
    }
}

/// A connection's one timer, for whatever it waits for now (a request
/// head, a response head). The deadline moves with every request but the
/// timer is reset only when it fires before it: about once per
/// [`HEAD_TIMEOUT`] rather than twice per request.
pub(crate) struct Deadline {
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
    pub(crate) fn set(&mut self, at: Instant) {
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

/// The client's side of a connection.
pub(crate) struct Client {
    pub(crate) stream: TcpStream,
    pub(crate) peer: SocketAddr,
    /// What the client sent and has not been used yet.
    pub(crate) buf: BytesMut,
    /// What is being written.
    pub(crate) out: Vec<u8>,
    /// When the current wait ends (taken while something else is waited
    /// for with it).
    pub(crate) deadline: Option<Deadline>,
    /// When the last request head started to be read.
    pub(crate) started: Instant,
    pub(crate) closing: Closing,
}

impl Client {
    /// A new connection, with `TCP_NODELAY` set (responses are small writes
    /// the client waits for).
    pub(crate) fn new(stream: TcpStream, peer: SocketAddr, closing: watch::Receiver<bool>) -> Self {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        Self {
            stream,
            peer,
            buf: BytesMut::with_capacity(8 * 1024),
            out: Vec::with_capacity(4 * 1024),
            deadline: Some(Deadline::new(Instant::now() + HEAD_TIMEOUT)),
            started: Instant::now(),
            closing: Closing::new(closing),
        }
    }

    /// Whether the server is stopping.
    pub(crate) fn is_closing(&self) -> bool {
        self.closing.is_closing()
    }

    /// Reads the first bytes: whether the client speaks HTTP/2 (prior
    /// knowledge). What was read stays in `buf` either way.
    pub(crate) async fn sniff(&mut self) -> io::Result<bool> {
        loop {
            let n = self.buf.len().min(H2_PREFACE.len());
            if self.buf[..n] != H2_PREFACE[..n] {
                return Ok(false);
            }
            if n == H2_PREFACE.len() {
                return Ok(true);
            }
            let read = tokio::select! {
                read = tokio::time::timeout(HEAD_TIMEOUT, self.stream.read_buf(&mut self.buf)) => read,
                () = self.closing.wait() => return Ok(false),
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

    /// Reads until `buf` holds a whole request head; `None` if the client
    /// closed (or the server is stopping) between requests, or sent a head
    /// too large (then it has had its 431).
    pub(crate) async fn read_head(&mut self) -> io::Result<Option<usize>> {
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
                self.refuse(&WireError::TooLarge).await?;
                return Ok(None);
            }
            let idle = self.buf.is_empty();
            if idle && self.is_closing() {
                return Ok(None);
            }
            self.buf.reserve(4 * 1024);
            let read = tokio::select! {
                biased;
                read = self.stream.read_buf(&mut self.buf) => read?,
                () = passed(&mut self.deadline) => return Ok(None),
                () = self.closing.wait(), if idle => return Ok(None),
            };
            if read == 0 {
                return Ok(None);
            }
        }
    }

    /// Waits for `decided`, noticing a client that leaves meanwhile (`None`:
    /// dropping the future gives a held request's turn back). What the
    /// client sends meanwhile is kept in `buf`.
    pub(crate) async fn until_decided<F: Future>(
        &mut self,
        decided: F,
    ) -> io::Result<Option<F::Output>> {
        let mut decided = std::pin::pin!(decided);
        // The common case, answered at once, costs no read.
        if let Some(out) =
            std::future::poll_fn(|cx| Poll::Ready(poll_once(decided.as_mut(), cx))).await
        {
            return Ok(Some(out));
        }
        loop {
            let room = self.buf.len() < MAX_HEAD;
            if room {
                self.buf.reserve(4 * 1024);
            }
            tokio::select! {
                out = decided.as_mut() => return Ok(Some(out)),
                read = self.stream.read_buf(&mut self.buf), if room => match read {
                    Ok(0) | Err(_) => return Ok(None),
                    Ok(_) => {}
                },
            }
        }
    }

    /// Reads more of what the client sends into `buf`; false at its end.
    pub(crate) async fn fill(&mut self) -> io::Result<bool> {
        self.buf.reserve(CHUNK);
        let read = tokio::time::timeout(HEAD_TIMEOUT, self.stream.read_buf(&mut self.buf))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the client stopped sending"))??;
        Ok(read > 0)
    }

    /// Writes a response the server makes itself, with a whole body, as
    /// `reply` says (the connection header; no body after a HEAD).
    pub(crate) async fn respond(&mut self, res: &Whole<'_>, reply: Reply) -> io::Result<()> {
        let out = &mut self.out;
        out.clear();
        wire::put_status_line(out, res.status);
        for (name, value) in res.headers {
            let ours = name == header::CONTENT_LENGTH
                || name == header::CONNECTION
                || name == header::TRANSFER_ENCODING
                || name == header::DATE;
            if !ours {
                wire::put_header(out, name.as_str().as_bytes(), value.as_bytes());
            }
        }
        if let Some(content_type) = res.content_type {
            wire::put_header(out, b"content-type", content_type.as_bytes());
        }
        out.extend_from_slice(res.lines);
        out.extend_from_slice(b"content-length: ");
        wire::put_u64(out, res.len as u64);
        out.extend_from_slice(b"\r\n");
        // The server is the response's origin (RFC 9110 section 6.6.1).
        put_date(out);
        if !reply.keep_alive {
            out.extend_from_slice(b"connection: close\r\n");
        } else if reply.version == Version::HTTP_10 {
            out.extend_from_slice(b"connection: keep-alive\r\n");
        }
        out.extend_from_slice(b"\r\n");
        if !reply.head_only {
            out.extend_from_slice(res.body);
        }
        self.stream.write_all(out).await
    }

    /// Answers a request that could not be read (400, 413, 431) with a
    /// problem+json body, and closes.
    pub(crate) async fn answer_error(
        &mut self,
        status: StatusCode,
        detail: &str,
    ) -> io::Result<()> {
        let body = problem_json(status, detail);
        let no_headers = HeaderMap::new();
        let res = Whole {
            content_type: Some("application/problem+json"),
            ..Whole::new(status, &no_headers, body.as_bytes())
        };
        self.respond(&res, Reply::CLOSE).await
    }

    /// Answers a request that could not be read (see [`answer_error`](Self::answer_error))
    /// and says so in the log.
    pub(crate) async fn refuse(&mut self, e: &WireError) -> io::Result<()> {
        tracing::debug!(peer = %self.peer, error = %e, "refused a request");
        self.answer_error(e.status(), &e.to_string()).await
    }

    /// Closes the connection without losing the last response (see
    /// [`linger`]).
    pub(crate) async fn linger(&mut self) {
        linger(&mut self.stream, &mut self.closing).await;
    }

    /// The connection as hyper reads it: the bytes already read from it
    /// put back in front. Also the wait for the server to stop.
    pub(crate) fn into_io(self) -> (Prefixed, Closing) {
        let io = Prefixed {
            prefix: self.buf.freeze(),
            inner: self.stream,
        };
        (io, self.closing)
    }
}

/// Closes `stream` without losing the last response: after its FIN, what
/// the client still sends (the rest of a refused upload, say) is read and
/// dropped for a while, as a close with unread data would reset the
/// connection, and the client might lose the response. A stopping server
/// does not wait for it.
pub(crate) async fn linger(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    closing: &mut Closing,
) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut buf = vec![0; CHUNK];
    let mut dropped = 0;
    let draining = async {
        while dropped < LINGER_BYTES {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => dropped += n,
            }
        }
    };
    tokio::select! {
        _ = tokio::time::timeout(LINGER, draining) => {}
        () = closing.wait() => {}
    }
}

/// Serves an HTTP/2 client (prior knowledge: [`Client::sniff`] said so)
/// with hyper and `service` until it closes, or the server stops (then
/// gracefully: the streams in flight are answered first).
pub(crate) async fn serve_h2<S, B>(client: Client, service: S)
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>>,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let peer = client.peer;
    let (io, mut closing) = client.into_io();
    let io = TokioIo::new(io);
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder.timer(TokioTimer::new());
    let mut conn = std::pin::pin!(builder.serve_connection(io, service));
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = closing.wait() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection closed with an error");
    }
}

/// An RFC 9457 problem body.
pub(crate) fn problem_json(status: StatusCode, detail: &str) -> String {
    serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    })
    .to_string()
}

/// A response the server makes itself, with a whole body.
pub(crate) struct Whole<'a> {
    pub(crate) status: StatusCode,
    /// `Content-Type`, when `headers` do not have it.
    pub(crate) content_type: Option<&'static str>,
    /// Its headers; any framing, connection or `Date` header among them is
    /// replaced by the server's own.
    pub(crate) headers: &'a HeaderMap,
    /// More headers, as lines written already (`name: value` and CRLF).
    pub(crate) lines: &'a [u8],
    pub(crate) body: &'a [u8],
    /// The length `Content-Length` says: the body's, but for a HEAD
    /// request, whose body is dropped, the GET's.
    pub(crate) len: usize,
}

impl<'a> Whole<'a> {
    /// A response of `status` with `headers` and `body`.
    pub(crate) fn new(status: StatusCode, headers: &'a HeaderMap, body: &'a [u8]) -> Self {
        Self {
            status,
            content_type: None,
            headers,
            lines: &[],
            body,
            len: body.len(),
        }
    }
}

/// What the framing of a response depends on besides itself: the request
/// it answers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reply {
    /// The connection stays open after the response.
    pub(crate) keep_alive: bool,
    /// The request's version: an HTTP/1.0 client kept is told so.
    pub(crate) version: Version,
    /// The request was HEAD: the response has no body.
    pub(crate) head_only: bool,
}

impl Reply {
    /// The last response of a connection, to a request that could not be
    /// read.
    pub(crate) const CLOSE: Self = Self {
        keep_alive: false,
        version: Version::HTTP_11,
        head_only: false,
    };
}

/// Appends a `Date` header line for now.
pub(crate) fn put_date(out: &mut Vec<u8>) {
    put_date_at(out, std::time::SystemTime::now());
}

/// Appends a `Date` header line for `now`. The date is formatted once a
/// second per thread (an HTTP date has one-second resolution).
fn put_date_at(out: &mut Vec<u8>, now: std::time::SystemTime) {
    thread_local! {
        static DATE: std::cell::RefCell<(u64, String)> =
            const { std::cell::RefCell::new((u64::MAX, String::new())) };
    }
    let second = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, date)| {
        if *at != second {
            *at = second;
            *date = httpdate::fmt_http_date(now);
        }
        wire::put_header(out, b"date", date.as_bytes());
    });
}

/// Returns once `deadline` has passed; never without one.
pub(crate) async fn passed(deadline: &mut Option<Deadline>) {
    match deadline {
        Some(deadline) => deadline.passed().await,
        None => std::future::pending().await,
    }
}

/// Whether the server is stopping, and a wait for it that a connection
/// keeps for its whole life: it is registered once, not at every request
/// head it waits for.
pub(crate) struct Closing {
    closing: watch::Receiver<bool>,
    wait: Pin<Box<dyn Future<Output = ()> + Send>>,
    closed: bool,
}

impl Closing {
    fn new(closing: watch::Receiver<bool>) -> Self {
        let mut seen = closing.clone();
        Self {
            closing,
            wait: Box::pin(async move {
                // An error means the server is gone: stopping too.
                let _ = seen.wait_for(|&c| c).await;
            }),
            closed: false,
        }
    }

    /// Whether the server is stopping.
    pub(crate) fn is_closing(&self) -> bool {
        self.closed || *self.closing.borrow()
    }

    /// Polls for the server stopping (as [`wait`](Self::wait)).
    pub(crate) fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.closed {
            std::task::ready!(self.wait.as_mut().poll(cx));
            self.closed = true;
        }
        Poll::Ready(())
    }

    /// Returns once the server is stopping. Cancel-safe, and can be called
    /// again after it returned.
    pub(crate) async fn wait(&mut self) {
        if !self.closed {
            self.wait.as_mut().await;
            self.closed = true;
        }
    }
}

/// Polls `fut` once.
fn poll_once<F: Future + ?Sized>(fut: Pin<&mut F>, cx: &mut Context<'_>) -> Option<F::Output> {
    match fut.poll(cx) {
        Poll::Ready(out) => Some(out),
        Poll::Pending => None,
    }
}

/// The client's connection with the bytes already read from it put back
/// in front, for hyper.
pub(crate) struct Prefixed {
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use super::*;

    fn date_at(now: SystemTime) -> String {
        let mut out = Vec::new();
        put_date_at(&mut out, now);
        String::from_utf8(out).expect("text")
    }

    /// The cached date is the time's, to the second: it changes when the
    /// second does, not within one.
    #[test]
    fn the_date_follows_the_clock_second_by_second() {
        let t = UNIX_EPOCH + Duration::from_secs(1_796_000_000);
        assert_eq!(date_at(t), "date: Mon, 30 Nov 2026 00:53:20 GMT\r\n");
        assert_eq!(date_at(t + Duration::from_millis(999)), date_at(t));
        assert_eq!(
            date_at(t + Duration::from_secs(1)),
            "date: Mon, 30 Nov 2026 00:53:21 GMT\r\n"
        );
        // Back to an earlier second: written again, not kept.
        assert_eq!(date_at(t), "date: Mon, 30 Nov 2026 00:53:20 GMT\r\n");
    }
}

//! HTTP/1.1 on a client connection, our own: the server of `spillway
//! serve`'s API ([`serve`], for any [`serve::Site`]) and what the proxy's
//! relay (`crate::proxy`, on hyper) shares with it: the accept loop with its
//! cap, the client's deadlines, lingering close. The rest of the service
//! never touches bytes: it hands this module routers and answers.
//!
//! [`Client`] is the client's side of a connection: it reads request heads
//! (with one lazy timer per connection), notices an HTTP/2 client, writes
//! the responses the server makes itself, drops request bodies nobody
//! reads, and closes without losing the last response. [`wire`] parses and
//! writes the bytes.

mod h2;
pub(crate) mod serve;
pub(crate) mod wire;

pub(crate) use h2::{H2Limits, serve_h2};
pub(crate) use serve::within_file_limit;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName};
use http::{StatusCode, Version};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use spillway_tower::problem::{PROBLEM_JSON, Problem};
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
/// How long a stopping server lingers (see [`linger`]): a request that
/// crossed its FIN arrives within a round trip; a client that takes longer
/// to close is not waited for.
const STOP_LINGER: Duration = Duration::from_secs(1);
/// How long a stopping server waits for its requests in flight unless told
/// otherwise ([`Accepting::drain_timeout`]).
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(20);
/// The HTTP/2 connection preface a prior-knowledge client starts with.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Ends a connection's task: `closing` turns true when the server stops
/// accepting; `_alive` is dropped when the connection is done, which the
/// server waits for, and `_slot` gives its place back under the cap on
/// connections.
pub(crate) struct Lifetime {
    pub(crate) closing: watch::Receiver<bool>,
    pub(crate) _alive: mpsc::Sender<()>,
    pub(crate) _slot: Slot,
}

/// The most connections a server holds at once unless told otherwise
/// ([`Accepting`]).
pub(crate) const MAX_CONNECTIONS: usize = 10_000;

/// What the accept loop holds a server to.
#[derive(Debug, Clone)]
pub(crate) struct Accepting {
    /// The most client connections open at once: one more is answered 503
    /// and closed at once, so that idle connections cannot take every file
    /// descriptor the process has.
    pub(crate) max_connections: usize,
    /// The connections open, and those refused past the cap, for
    /// `/metrics`.
    pub(crate) open: Option<Gauge>,
    pub(crate) refused: Option<Counter>,
    /// The longest the server waits, once stopping, for its connections to
    /// finish; then the ones still open are closed.
    pub(crate) drain_timeout: Duration,
}

impl Default for Accepting {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            open: None,
            refused: None,
            drain_timeout: DRAIN_TIMEOUT,
        }
    }
}

/// A connection's place under [`Accepting::max_connections`], given back
/// when dropped.
pub(crate) struct Slot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    open: Option<Gauge>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(open) = &self.open {
            open.dec();
        }
    }
}

/// What a connection past the cap is told before it is closed: made once,
/// so that refusing costs one write.
static REFUSED: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let status = StatusCode::SERVICE_UNAVAILABLE;
    let body = Problem::new(status, "Too many connections; try again.").into_json();
    let mut out = Vec::with_capacity(160 + body.len());
    wire::put_status_line(&mut out, status);
    wire::put_header(&mut out, b"content-type", PROBLEM_JSON.as_bytes());
    wire::put_header(&mut out, b"retry-after", b"1");
    wire::put_header(&mut out, b"connection", b"close");
    out.extend_from_slice(b"content-length: ");
    wire::put_u64(&mut out, body.len() as u64);
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(body.as_bytes());
    out
});

/// Accepts connections until `shutdown` resolves, serving each in a task of
/// its own (`serve`), at most `accepting.max_connections` at once; then
/// accepts the connections already waiting in the listener's backlog (the
/// kernel would reset them), closes the listener and waits for the
/// connections to finish (each ends once its request in flight is
/// answered), at most `accepting.drain_timeout`: the ones still open then
/// are closed.
pub(crate) async fn serve_connections_with<F>(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    accepting: Accepting,
    mut serve: impl FnMut(TcpStream, SocketAddr, Lifetime) -> F,
) where
    F: Future<Output = ()> + Send + 'static,
{
    let (closing, closing_seen) = watch::channel(false);
    let (alive, mut all_done) = mpsc::channel::<()>(1);
    // Turned true when the drain has taken too long: every connection's
    // task then ends at once.
    let (abort, aborted) = watch::channel(false);
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(accepting.max_connections));
    let mut shutdown = std::pin::pin!(shutdown);
    let mut start = |stream: TcpStream, peer: SocketAddr| {
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            // Accepted, told and closed at once: no task, no wait. The
            // client has sent nothing yet (or its bytes are dropped), so
            // the one write does not block the loop.
            tracing::debug!(%peer, "too many connections: refused");
            if let Some(refused) = &accepting.refused {
                refused.inc();
            }
            let _ = stream.try_write(&REFUSED);
            return;
        };
        if let Some(open) = &accepting.open {
            open.inc();
        }
        let life = Lifetime {
            closing: closing_seen.clone(),
            _alive: alive.clone(),
            _slot: Slot {
                _permit: permit,
                open: accepting.open.clone(),
            },
        };
        let served = serve(stream, peer, life);
        let mut aborted = aborted.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = served => {}
                _ = aborted.wait_for(|&abort| abort) => {}
            }
        });
    };
    while let Some((stream, peer)) = next_connection(&listener, shutdown.as_mut()).await {
        start(stream, peer);
    }
    let _ = closing.send(true);
    // Connections the kernel completed before the listener closes would be
    // reset with it: they are served (told to close after one request).
    // The listener closes as soon as they are taken, before they are
    // started: one completed in between would be reset.
    let waiting = backlog(&listener);
    drop(listener);
    for (stream, peer) in waiting {
        start(stream, peer);
    }
    drop(alive);
    // Every connection holds a sender: this ends when the last one is done.
    let drain = accepting.drain_timeout;
    if tokio::time::timeout(drain, all_done.recv()).await.is_err() {
        let open = accepting.max_connections - slots.available_permits();
        tracing::warn!(
            open,
            "the drain took longer than {drain:?}: closing the connections still open"
        );
        let _ = abort.send(true);
        let _ = all_done.recv().await;
    }
}

/// The connections waiting in `listener`'s backlog, accepted without
/// waiting (past tokio's readiness, which may not have seen them yet).
fn backlog(listener: &TcpListener) -> Vec<(TcpStream, SocketAddr)> {
    let socket = socket2::SockRef::from(listener);
    let mut waiting = Vec::new();
    while let Ok((conn, peer)) = socket.accept() {
        let Some(peer) = peer.as_socket() else {
            continue;
        };
        let stream = std::net::TcpStream::from(conn);
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        if let Ok(stream) = TcpStream::from_std(stream) {
            waiting.push((stream, peer));
        }
    }
    waiting
}

/// Whether `stream` has bytes waiting to be read (a syscall, not tokio's
/// readiness, which may lag behind): a stopping server answers a request
/// that has arrived rather than closing on it.
pub(crate) fn has_arrived(stream: &TcpStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    matches!(socket2::SockRef::from(stream).peek(&mut byte), Ok(n) if n > 0)
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
    pub(crate) fn new(at: Instant) -> Self {
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
        std::future::poll_fn(|cx| self.poll_passed(cx)).await;
    }

    /// Ready once the deadline has passed; when the timer fires before it
    /// (the deadline moved on), the timer is reset to it.
    pub(crate) fn poll_passed(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        loop {
            std::task::ready!(self.timer.as_mut().poll(cx));
            if Instant::now() >= self.at {
                return std::task::Poll::Ready(());
            }
            let at = self.at;
            self.timer.as_mut().reset(at);
        }
    }
}

/// How long a client may take, per connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// A whole request head, idle time before it included; and the HTTP/2
    /// preface, from the connection on.
    pub(crate) head: Duration,
    /// A whole request body, from the end of its head, when
    /// [`Client::body_started`] is called; else each read of it takes at
    /// most `head` (the proxy streams bodies of any length).
    pub(crate) body: Duration,
    /// Writing one response (or the whole of an HTTP/2 connection's pings
    /// unanswered): a client that does not read is closed after it.
    pub(crate) write: Duration,
    /// An HTTP/2 connection with no request open.
    pub(crate) idle: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            head: HEAD_TIMEOUT,
            body: HEAD_TIMEOUT,
            write: Duration::from_secs(30),
            idle: Duration::from_secs(60),
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
    pub(crate) timeouts: Timeouts,
    /// When the body being read must have arrived whole, if it must.
    body_due: Option<Instant>,
    /// The bytes [`read_head`](Self::read_head) has looked through for a
    /// head's end, for the tests.
    #[cfg(test)]
    scanned: usize,
}

impl Client {
    /// A new connection, with `TCP_NODELAY` set (responses are small writes
    /// the client waits for), held to `timeouts`.
    pub(crate) fn with_timeouts(
        stream: TcpStream,
        peer: SocketAddr,
        closing: watch::Receiver<bool>,
        timeouts: Timeouts,
    ) -> Self {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        Self {
            stream,
            peer,
            buf: BytesMut::with_capacity(8 * 1024),
            out: Vec::with_capacity(4 * 1024),
            deadline: Some(Deadline::new(Instant::now() + timeouts.head)),
            started: Instant::now(),
            closing: Closing::new(closing),
            timeouts,
            body_due: None,
            #[cfg(test)]
            scanned: 0,
        }
    }

    /// From now on, until [`body_done`](Self::body_done), what
    /// [`fill`](Self::fill) reads must all have arrived within
    /// [`Timeouts::body`]: a client sending a byte now and then cannot hold
    /// the connection.
    pub(crate) fn body_started(&mut self) {
        self.body_due = Some(Instant::now() + self.timeouts.body);
    }

    /// Ends [`body_started`](Self::body_started).
    pub(crate) fn body_done(&mut self) {
        self.body_due = None;
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
            // Stopping: what has arrived is read (a request is answered);
            // nothing, and the connection is done.
            let stop_when_closing = !self.is_closing();
            if !stop_when_closing && !has_arrived(&self.stream) {
                return Ok(false);
            }
            // The connection's deadline, set when it was accepted: the
            // preface is due whole within the head timeout, however it is
            // dripped.
            let read = tokio::select! {
                read = self.stream.read_buf(&mut self.buf) => read,
                () = passed(&mut self.deadline) => {
                    // Closed now, not given a second wait for a request
                    // head.
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client sent no request in time",
                    ));
                }
                // Looked at again above: a request may have come with it.
                () = self.closing.wait(), if stop_when_closing => continue,
            };
            match read {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads until `buf` holds a whole request head; `None` if the client
    /// closed (or the server is stopping) between requests, or sent a head
    /// too large (then it has had its 431).
    pub(crate) async fn read_head(&mut self) -> io::Result<Option<usize>> {
        self.started = Instant::now();
        if let Some(deadline) = &mut self.deadline {
            deadline.set(self.started + self.timeouts.head);
        }
        // Where the head's end may still be: what was looked through
        // before is not again, or a head dripped a byte at a time would
        // cost the square of its length.
        let mut from = 0;
        loop {
            // Blank lines before a request are skipped (RFC 9112 section
            // 2.2).
            while self.buf.starts_with(b"\r\n") || self.buf.starts_with(b"\n") {
                let blank = if self.buf[0] == b'\r' { 2 } else { 1 };
                self.buf.advance(blank);
                from = 0;
            }
            #[cfg(test)]
            {
                self.scanned += self.buf.len() - from;
            }
            if let Some(end) = wire::head_end(&self.buf[from..]) {
                // A read may take the buffer past the limit: the head's
                // end is held to it, not the buffer before the read.
                if from + end > MAX_HEAD {
                    self.refuse(&WireError::TooLarge).await?;
                    return Ok(None);
                }
                return Ok(Some(from + end));
            }
            if self.buf.len() >= MAX_HEAD {
                self.refuse(&WireError::TooLarge).await?;
                return Ok(None);
            }
            // The last bytes may begin the blank line.
            from = self.buf.len().saturating_sub(2);
            let idle = self.buf.is_empty();
            // Stopping: a request that has arrived is answered (and the
            // connection closed after it); none, and the connection closes.
            if idle && self.is_closing() && !has_arrived(&self.stream) {
                return Ok(None);
            }
            let stop_when_idle = idle && !self.is_closing();
            self.buf.reserve(4 * 1024);
            let read = tokio::select! {
                biased;
                read = self.stream.read_buf(&mut self.buf) => read?,
                () = passed(&mut self.deadline) => {
                    if !idle {
                        // Half a head: the client is told why, as hyper
                        // tells it (an idle one is just closed).
                        let detail = format!(
                            "The request head did not arrive within {:?}.",
                            self.timeouts.head
                        );
                        self.answer_error(StatusCode::REQUEST_TIMEOUT, &detail).await?;
                    }
                    return Ok(None);
                }
                // Looked at again above: a request may have come with it.
                () = self.closing.wait(), if stop_when_idle => continue,
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
    /// A body started with [`body_started`](Self::body_started) must be
    /// whole by its deadline; otherwise each read gets [`Timeouts::head`].
    /// Either way a late client is an [`io::ErrorKind::TimedOut`] error.
    pub(crate) async fn fill(&mut self) -> io::Result<bool> {
        self.buf.reserve(CHUNK);
        let due = self
            .body_due
            .unwrap_or_else(|| Instant::now() + self.timeouts.head);
        let read = tokio::time::timeout_at(due, self.stream.read_buf(&mut self.buf))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the client stopped sending"))??;
        Ok(read > 0)
    }

    /// Writes `bytes` to the client within [`Timeouts::write`]: one that
    /// does not read is a [`io::ErrorKind::TimedOut`] error, and closed.
    pub(crate) async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        write_within(&mut self.stream, bytes, self.timeouts.write).await
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
        for (name, value) in res.more {
            wire::put_header(out, name.as_str().as_bytes(), value);
        }
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
        write_within(&mut self.stream, out, self.timeouts.write).await
    }

    /// Answers a request that could not be read (400, 413, 431) with a
    /// problem+json body, and closes.
    pub(crate) async fn answer_error(
        &mut self,
        status: StatusCode,
        detail: &str,
    ) -> io::Result<()> {
        let body = Problem::new(status, detail).into_json();
        let no_headers = HeaderMap::new();
        let res = Whole {
            content_type: Some(PROBLEM_JSON),
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
/// the client still sends (the rest of a refused upload, say, or a request
/// that crossed the FIN of a stopping server) is read and dropped until the
/// client closes too, for a while, as a close with unread data would reset
/// the connection, and the client might lose the response (or see a reset
/// where it should see the end of the connection). A stopping server waits
/// [`STOP_LINGER`] at most.
pub(crate) async fn linger(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    closing: &mut Closing,
) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut buf = vec![0; CHUNK];
    let mut dropped = 0;
    let mut draining = std::pin::pin!(async {
        while dropped < LINGER_BYTES {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => dropped += n,
            }
        }
    });
    let stop_linger = async {
        closing.wait().await;
        tokio::time::sleep(STOP_LINGER).await;
    };
    tokio::select! {
        _ = tokio::time::timeout(LINGER, draining.as_mut()) => {}
        () = stop_linger => {}
    }
}

/// Writes `bytes` to `stream` within `timeout`.
async fn write_within(stream: &mut TcpStream, bytes: &[u8], timeout: Duration) -> io::Result<()> {
    tokio::time::timeout(timeout, stream.write_all(bytes))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the client does not read"))?
}

/// A response the server makes itself, with a whole body.
pub(crate) struct Whole<'a> {
    pub(crate) status: StatusCode,
    /// `Content-Type`, when `headers` do not have it.
    pub(crate) content_type: Option<&'static str>,
    /// Its headers; any framing, connection or `Date` header among them is
    /// replaced by the server's own.
    pub(crate) headers: &'a HeaderMap,
    /// More headers, written after `headers` as they are.
    pub(crate) more: &'a [(HeaderName, &'a [u8])],
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
            more: &[],
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
    // `wait` has been polled and is registered with the task's waker.
    waiting: bool,
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
            waiting: false,
        }
    }

    /// Whether the server is stopping.
    pub(crate) fn is_closing(&self) -> bool {
        self.closed || *self.closing.borrow()
    }

    /// The signal itself, for what waits on it elsewhere (a shaped
    /// request's turn).
    pub(crate) fn receiver(&self) -> watch::Receiver<bool> {
        self.closing.clone()
    }

    /// Polls for the server stopping (as [`wait`](Self::wait)), from the
    /// one task that keeps this connection: once its wait is registered,
    /// it is polled again only when the signal has been sent since (an
    /// atomic load, where a poll of the wait locks its list of waiters: at
    /// every wake-up of a proxied connection, about 1% of a request).
    pub(crate) fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.closed {
            return Poll::Ready(());
        }
        // An error: the sender is gone, which the wait sees too.
        if self.waiting && !self.closing.has_changed().unwrap_or(true) {
            return Poll::Pending;
        }
        match self.wait.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.closed = true;
                Poll::Ready(())
            }
            Poll::Pending => {
                self.waiting = true;
                Poll::Pending
            }
        }
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

    /// A connection's wait for the server to stop, polled again and again
    /// as a busy connection's task is (then only when the signal changed),
    /// ends when the signal is sent and when its sender is gone.
    #[tokio::test]
    async fn the_closing_wait_ends_on_the_signal_and_on_a_dropped_sender() {
        for drop_sender in [false, true] {
            let (stop, stopping) = watch::channel(false);
            let mut closing = Closing::new(stopping);
            let (polled, mut polls) = watch::channel(0u32);
            let waiting = tokio::spawn(async move {
                let mut n = 0;
                std::future::poll_fn(|cx| {
                    n += 1;
                    polled.send_replace(n);
                    // Woken again, ten times, by something else.
                    if n <= 10 {
                        cx.waker().wake_by_ref();
                    }
                    closing.poll_wait(cx)
                })
                .await;
            });
            polls.wait_for(|&n| n > 10).await.expect("polled");
            if drop_sender {
                drop(stop);
            } else {
                stop.send(true).expect("sent");
            }
            tokio::time::timeout(Duration::from_secs(10), waiting)
                .await
                .expect("the wait ended")
                .expect("no panic");
        }
    }

    /// A head dripped in many small reads is looked through once for its
    /// end, not again from its start at every read (which would cost the
    /// square of its length: 4 s of CPU for a 68 KB head of short lines).
    #[tokio::test]
    async fn a_dripped_head_is_scanned_once() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bound");
        let addr = listener.local_addr().expect("an address");
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        for _ in 0..2_000 {
            head.extend_from_slice(b"X:a\n");
        }
        head.extend_from_slice(b"\r\n");
        let sent = head.clone();
        let sender = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.expect("connected");
            stream.set_nodelay(true).expect("nodelay");
            for piece in sent.chunks(40) {
                stream.write_all(piece).await.expect("written");
                // Time for the server to read each piece on its own.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            stream
        });
        let (stream, peer) = listener.accept().await.expect("accepted");
        let (_stop, closing) = watch::channel(false);
        let mut client = Client::with_timeouts(stream, peer, closing, Timeouts::default());
        let end = client.read_head().await.expect("read").expect("a head");
        assert_eq!(end, head.len());
        // Each read's bytes looked at, and the two before them: linear.
        assert!(
            client.scanned <= 3 * head.len(),
            "{} bytes scanned for a head of {}",
            client.scanned,
            head.len()
        );
        drop(sender.await.expect("sent"));
    }

    /// The answer to a connection past the cap is a whole response: its
    /// length is its body's.
    #[test]
    fn the_refusal_past_the_cap_is_a_whole_response() {
        let mut lines = [httparse::EMPTY_HEADER; 8];
        let mut res = httparse::Response::new(&mut lines);
        let head = match res.parse(&REFUSED) {
            Ok(httparse::Status::Complete(n)) => n,
            other => panic!("not a response head: {other:?}"),
        };
        assert_eq!(res.code, Some(503));
        let length = res
            .headers
            .iter()
            .find(|h| h.name == "content-length")
            .map(|h| {
                std::str::from_utf8(h.value)
                    .expect("digits")
                    .parse::<usize>()
                    .expect("a length")
            });
        assert_eq!(length, Some(REFUSED.len() - head));
        let body: serde_json::Value = serde_json::from_slice(&REFUSED[head..]).expect("JSON");
        assert_eq!(body["status"], 503);
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

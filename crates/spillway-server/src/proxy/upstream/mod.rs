//! A client connection's own upstream connection, spoken to in HTTP/1.1 by
//! the proxy itself rather than through hyper's client (issue 31: hyper's
//! client dispatch, its channel to the connection's future and its body
//! channel were over a quarter of a proxied request's instructions).
//!
//! What goes out is written from the request's parts, after the rules ran
//! on them, exactly as hyper's client writes them: the request line in
//! origin form, each header line from the checked `HeaderMap`, the body
//! framed by the proxy (`Content-Length`, or chunked) from what was parsed.
//! No byte of the client's framing is passed on.
//!
//! What comes back is parsed with `httparse` ([`parse_response`]), and
//! its framing refused where RFC 9112 section 6.3 makes it ambiguous (`502`).
//! The response body is read from the connection by the body itself, in the
//! client connection's task; when it ends, the connection is kept for the
//! next request if both sides keep it alive and nothing else arrived after
//! the body. One connection serves one client connection only, so an
//! upstream that frames a response wrongly can only confuse that client's
//! own later responses, never another client's.

use std::future::poll_fn;
use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use http::header;
use http::{Method, Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::deadline::ConnDeadline;
use super::error::{BoxError, ForwardError};
use super::forward::Upstream;
use super::headers::Hop;
use super::{ProxyBody, ProxyOptions};
use crate::http1::wire::{
    BodyEnd, Chunked, MAX_HEAD, head_end, parse_response, parse_response_raw,
};

mod body;
mod pool;

use body::{BodyWriter, Left, SendFailed, UpstreamBody, poll_read_into};
use pool::Member;
pub(crate) use pool::Pool;

/// How much the connection reads at a time.
const READ_AT_ONCE: usize = 16 * 1024;

/// One client connection's upstream connections, kept between its
/// requests and made again when the upstream has closed them: one for an
/// HTTP/1.1 client (a request at a time), as many as it has requests open
/// for an HTTP/2 client, within the pool's cap for all HTTP/2 clients
/// together.
pub(crate) struct OwnUpstream {
    /// The client as the forwarding headers name it.
    pub(crate) hop: Hop,
    /// The connections to send the next requests on, the last idle the
    /// shortest, each with the time it has been idle since.
    kept: Mutex<Vec<(UpConn, Instant)>>,
    upstream: Arc<Upstream>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// For an HTTP/2 client: the pool's slots, one held by each upstream
    /// connection while it is open (`[proxy] pool_max_connections`), and
    /// its place among the pool's users.
    slots: Option<Member>,
    /// For an HTTP/1.1 client: the deadline of the response head in flight
    /// (one at a time).
    pub(crate) response: ConnDeadline,
    /// Response heads are kept as they came ([`parse_response_raw`]), for
    /// a server that writes them so and a policy that reads no response
    /// header; set for each request by the server that forwards it.
    pub(crate) raw_heads: AtomicBool,
}

/// An open connection to the upstream and what has been read from it and
/// not yet used.
struct UpConn {
    stream: TcpStream,
    read: BytesMut,
    /// The request head being written (kept: one allocation a connection).
    out: Vec<u8>,
    /// The pool's slot it holds, for an HTTP/2 client's.
    _slot: Option<OwnedSemaphorePermit>,
}

/// Why an exchange failed, and whether the request may go again on a new
/// connection.
struct Failed {
    error: ForwardError,
    /// Nothing of a response came back on a kept connection, and the
    /// request can be written again whole.
    again: bool,
}

impl Failed {
    fn of(error: ForwardError) -> Self {
        Self {
            error,
            again: false,
        }
    }
}

fn broken(e: impl Into<BoxError>) -> ForwardError {
    ForwardError::Unreachable(e.into())
}

impl OwnUpstream {
    /// An HTTP/1.1 client's: one request at a time.
    pub(crate) fn new(hop: Hop, upstream: Arc<Upstream>, options: &ProxyOptions) -> Self {
        Self {
            hop,
            kept: Mutex::new(Vec::with_capacity(1)),
            upstream,
            connect_timeout: options.connect_timeout,
            idle_timeout: options.pool_idle_timeout,
            slots: None,
            response: ConnDeadline::default(),
            raw_heads: AtomicBool::new(false),
        }
    }

    /// An HTTP/2 client's: its requests at once, each connection holding
    /// one of `pool`'s slots while it is open.
    pub(crate) fn shared(
        hop: Hop,
        upstream: Arc<Upstream>,
        options: &ProxyOptions,
        pool: &Arc<Pool>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| {
            let mut own = Self::new(hop, upstream, options);
            own.slots = Some(Member {
                pool: pool.clone(),
                id: pool.next.fetch_add(1, Ordering::Relaxed),
                me: me.clone(),
            });
            own
        })
    }

    /// Whether requests go at once (HTTP/2), each then with a timer of its
    /// own rather than [`response`](Self::response).
    pub(crate) fn is_shared(&self) -> bool {
        self.slots.is_some()
    }

    /// Sends `req` (in origin form, its framing headers the proxy's own) on
    /// the kept connection, or on a new one if there is none or the kept
    /// one was closed; a request without a body whose kept connection
    /// turns out closed before any answer goes again once on a new one,
    /// if its method is idempotent.
    pub(crate) async fn send(
        self: &Arc<Self>,
        req: Request<ProxyBody>,
    ) -> Result<Response<ProxyBody>, ForwardError> {
        let (parts, body) = req.into_parts();
        let to_head = parts.method == Method::HEAD;
        let chunked = parts.headers.contains_key(header::TRANSFER_ENCODING);
        let length = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let resendable = body.is_end_stream() && parts.method.is_idempotent();
        let mut body = Some(body);
        if let Some(conn) = self.take_kept() {
            match self
                .exchange(conn, &parts, &mut body, chunked, length, to_head)
                .await
            {
                Ok(res) => return Ok(res),
                Err(Failed { again: true, error }) if resendable => {
                    tracing::debug!(%error, "a kept upstream connection was closed; sending again on a new one");
                }
                Err(failed) => return Err(failed.error),
            }
        }
        let conn = self.connect().await?;
        self.exchange(conn, &parts, &mut body, chunked, length, to_head)
            .await
            .map_err(|failed| failed.error)
    }

    /// Writes the request on `conn` and reads the response head.
    async fn exchange(
        self: &Arc<Self>,
        mut conn: UpConn,
        parts: &http::request::Parts,
        body: &mut Option<ProxyBody>,
        chunked: bool,
        length: Option<u64>,
        to_head: bool,
    ) -> Result<Response<ProxyBody>, Failed> {
        let bodiless = body.as_ref().is_none_or(Body::is_end_stream);
        conn.out.clear();
        encode_head(parts, &mut conn.out);
        if let Err(e) = conn.stream.write_all(&conn.out).await {
            return Err(Failed {
                error: broken(e),
                again: bodiless,
            });
        }
        let mut writer = match body.take() {
            Some(body) if !bodiless => Some(BodyWriter::new(body, chunked, length)),
            _ => None,
        };
        // Whether the upload was cut short by the upstream.
        let mut cut = false;
        let mut answered = false;
        loop {
            let end = match conn.read_head(&mut writer, &mut cut).await {
                Ok(end) => end,
                Err(e) => {
                    return Err(Failed {
                        error: e,
                        again: bodiless && !answered && conn.read.is_empty(),
                    });
                }
            };
            answered = true;
            let raw = conn.read.split_to(end).freeze();
            let parsed = match self.raw_heads.load(Ordering::Relaxed) {
                true => parse_response_raw(&raw, to_head),
                false => parse_response(&raw, to_head),
            };
            let parsed = parsed.map_err(|e| Failed::of(broken(e)))?;
            // Interim responses (100 Continue, 103 Early Hints) are not
            // passed on: hyper's server answers the client's `Expect`
            // itself. 101 is the caller's to refuse.
            if parsed.parts.status.is_informational()
                && parsed.parts.status != http::StatusCode::SWITCHING_PROTOCOLS
            {
                continue;
            }
            // After a 101 the upstream would speak something else.
            let keep = !cut
                && parsed.keep_alive
                && parsed.parts.status != http::StatusCode::SWITCHING_PROTOCOLS;
            let res_body = UpstreamBody {
                writer: writer.take(),
                left: match parsed.body {
                    BodyEnd::Empty => Left::Done,
                    BodyEnd::Length(n) => Left::Length(n),
                    BodyEnd::Chunked => Left::Chunked(Chunked::default()),
                    BodyEnd::Close => Left::Close,
                },
                conn: Some(conn),
                own: self.clone(),
                keep,
            };
            let mut res_body = res_body;
            if matches!(res_body.left, Left::Done) {
                res_body.finish();
            }
            return Ok(Response::from_parts(parsed.parts, res_body.boxed_unsync()));
        }
    }

    /// A kept connection that has not been idle too long and on which
    /// nothing (an end, stray bytes) has arrived since its last response;
    /// the others are closed.
    fn take_kept(&self) -> Option<UpConn> {
        loop {
            let (conn, since) = {
                let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
                let taken = kept.pop()?;
                if let Some(member) = &self.slots {
                    member.pool.took(member.id, kept.len());
                }
                taken
            };
            if since.elapsed() < self.idle_timeout && Self::quiet(&conn) {
                return Some(conn);
            }
        }
    }

    /// Whether nothing has arrived on an idle connection.
    fn quiet(conn: &UpConn) -> bool {
        // Readiness is cleared by the short read that ended the last
        // response: set again, something came (usually the upstream's FIN).
        let waker = std::task::Waker::noop();
        let ready = conn
            .stream
            .poll_read_ready(&mut Context::from_waker(waker))
            .is_ready();
        if ready {
            let mut probe = [0u8; 1];
            return matches!(
                conn.stream.try_read(&mut probe),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock
            );
        }
        true
    }

    fn keep(&self, conn: UpConn) {
        if let Some(member) = &self.slots
            && member.pool.is_waited_for()
        {
            // Closed: its slot goes to a request waiting for one.
            drop(conn);
            return;
        }
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        // The last kept is taken first: those left under it (an HTTP/2
        // client's, after more requests at once than now) are closed once
        // idle too long, not kept until the client leaves.
        let stale = kept
            .iter()
            .take_while(|(_, since)| since.elapsed() >= self.idle_timeout)
            .count();
        kept.drain(..stale);
        kept.push((conn, Instant::now()));
        if let Some(member) = &self.slots {
            member.pool.kept(member, stale, kept.len());
        }
    }

    /// A new connection to the upstream (for an HTTP/2 client, once one of
    /// the pool's slots is free: `503` if none is within the connect
    /// timeout).
    async fn connect(&self) -> Result<UpConn, ForwardError> {
        let slot = match &self.slots {
            None => None,
            Some(member) => Some(member.pool.slot(self.connect_timeout).await?),
        };
        let authority = self.upstream.authority();
        let port = authority.port_u16().unwrap_or(80);
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let timeout = self.connect_timeout;
        let stream = match tokio::time::timeout(timeout, TcpStream::connect((host, port))).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(broken(e)),
            Err(_) => return Err(ForwardError::ConnectTimeout(timeout)),
        };
        // Requests are small writes answered at once: no Nagle delay.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        Ok(UpConn {
            stream,
            read: BytesMut::new(),
            out: Vec::with_capacity(512),
            _slot: slot,
        })
    }
}

impl Drop for OwnUpstream {
    fn drop(&mut self) {
        if let Some(member) = &self.slots {
            let kept = self.kept.get_mut().unwrap_or_else(PoisonError::into_inner);
            member.pool.left(member.id, kept.len());
        }
    }
}

/// Writes a request head for the upstream: the request line in origin
/// form, then every header line as the `HeaderMap` holds it (names
/// lowercase, values as checked when they were made).
fn encode_head(parts: &http::request::Parts, out: &mut Vec<u8>) {
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        crate::http1::wire::put_header(out, name.as_str().as_bytes(), value.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

impl UpConn {
    /// Reads until a whole response head is buffered (its end's index),
    /// writing the request body meanwhile, if one is still going out: once
    /// it is all written, `writer` is emptied; if the upstream stopped
    /// taking it, `writer` is emptied and `cut` set.
    async fn read_head(
        &mut self,
        writer: &mut Option<BodyWriter>,
        cut: &mut bool,
    ) -> Result<usize, ForwardError> {
        let mut from = 0;
        poll_fn(|cx| {
            loop {
                if let Some(w) = writer.as_mut() {
                    match w.poll_send(&self.stream, cx) {
                        Poll::Ready(Ok(())) => *writer = None,
                        Poll::Ready(Err(SendFailed::Client(e))) => {
                            return Poll::Ready(Err(ForwardError::Unreachable(e)));
                        }
                        // The upstream may have answered before it closed.
                        Poll::Ready(Err(SendFailed::Upstream(e))) => {
                            tracing::debug!(error = %e, "the upstream stopped taking the request body");
                            *writer = None;
                            *cut = true;
                        }
                        Poll::Pending => {}
                    }
                }
                if let Some(end) = head_end(&self.read[from..]) {
                    // A read may take the buffer past the limit: the head's
                    // end is held to it, not the buffer before the read.
                    if from + end > MAX_HEAD {
                        return Poll::Ready(Err(broken("the upstream's response head is too large")));
                    }
                    return Poll::Ready(Ok(from + end));
                }
                // The last bytes may begin the blank line.
                from = self.read.len().saturating_sub(2);
                if self.read.len() >= MAX_HEAD {
                    return Poll::Ready(Err(broken("the upstream's response head is too large")));
                }
                self.read.reserve(READ_AT_ONCE);
                match std::task::ready!(poll_read_into(&mut self.stream, &mut self.read, cx)) {
                    Ok(0) => {
                        return Poll::Ready(Err(broken(
                            "the upstream closed the connection before a response",
                        )));
                    }
                    Ok(_) => {}
                    Err(e) => return Poll::Ready(Err(broken(e))),
                }
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An open connection to a listener of the test's (its accepted end is
    /// kept open by `ends`).
    pub(super) async fn conn(
        listener: &tokio::net::TcpListener,
        ends: &mut Vec<TcpStream>,
    ) -> UpConn {
        let addr = listener.local_addr().unwrap();
        let (stream, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        ends.push(accepted.unwrap().0);
        UpConn {
            stream: stream.unwrap(),
            read: BytesMut::new(),
            out: Vec::new(),
            _slot: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn kept_connections_idle_past_the_timeout_are_closed_when_another_is_kept() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = Upstream::parse(&"http://127.0.0.1:9".parse().unwrap()).unwrap();
        let options = ProxyOptions {
            pool_idle_timeout: Duration::from_secs(90),
            ..ProxyOptions::default()
        };
        let pool = Pool::new(Arc::new(tokio::sync::Semaphore::new(10)));
        let own = OwnUpstream::shared(
            Hop::of("10.0.0.1".parse().unwrap()),
            Arc::new(upstream),
            &options,
            &pool,
        );
        let mut ends = Vec::new();
        let port = |c: &UpConn| c.stream.local_addr().unwrap().port();
        let (a, b, c) = (
            conn(&listener, &mut ends).await,
            conn(&listener, &mut ends).await,
            conn(&listener, &mut ends).await,
        );
        let (pa, pb, pc) = (port(&a), port(&b), port(&c));
        own.keep(a);
        tokio::time::advance(Duration::from_secs(60)).await;
        own.keep(b);
        tokio::time::advance(Duration::from_secs(40)).await;
        // `a` has been idle 100 s, `b` 40 s.
        own.keep(c);
        let kept: Vec<u16> = own
            .kept
            .lock()
            .unwrap()
            .iter()
            .map(|(c, _)| port(c))
            .collect();
        assert_eq!(kept, [pb, pc]);
        assert_ne!(pa, pb);
        assert_eq!(pool.idle.load(Ordering::Acquire), 2);
        // The last kept is taken first; the one past the timeout is not
        // taken at all.
        assert_eq!(own.take_kept().map(|c| port(&c)), Some(pc));
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(own.take_kept().is_none(), "`b`, idle 100 s, was taken");
        assert_eq!(pool.idle.load(Ordering::Acquire), 0);
    }
}

//! The HTTP/1.1 server of `spillway serve`: one task per connection,
//! requests read and answered in that task, for any [`Site`].
//!
//! The site says which requests it answers straight from their body
//! ([`Site::answers_fast`]: no router, no response object, the answer's
//! bytes written in one go); every other request is read whole and handed
//! to the site's axum [`Router`], whose answer is written back. HTTP/2
//! clients (prior knowledge) are served by hyper with the site's other
//! router. This module knows nothing of rules: what a site answers is its
//! own ([`Answered`]).
//!
//! Under the bench's load, hyper and axum took about half the server's
//! user-space time for a check (see BENCHMARKS.md, "Why `/v1/check` has an
//! HTTP/1.1 server of its own").

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::response::IntoResponse;
use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderName, Method, Request, StatusCode};
use http_body_util::BodyExt;
use smallvec::SmallVec;
use spillway_tower::problem::{PROBLEM_JSON, Problem};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use super::wire::{self, Chunked, Framing};
use super::{Accepting, Client, Lifetime, Reply, Timeouts, Whole};

/// What the server serves.
pub(crate) trait Site: Send + Sync + 'static {
    /// What a fast answer is.
    type Fast: Answered + Send;
    /// What counts a request as in flight while it lives.
    type InFlight: Send;

    /// Whether a request of `method` to `target` (the request line's
    /// bytes) is answered by [`answer_fast`](Self::answer_fast).
    fn answers_fast(&self, method: &Method, target: &[u8]) -> bool;
    /// Whether [`answer_fast`](Self::answer_fast) needs the request's
    /// `Authorization` value (the headers are read only then).
    fn fast_needs_authorization(&self) -> bool;
    /// The answer to a fast request, from its one `Authorization` value
    /// (none when it has none or several) and its whole body.
    fn answer_fast(
        &self,
        authorization: Option<&[u8]>,
        body: Bytes,
    ) -> impl Future<Output = Self::Fast> + Send;
    /// The router for every other HTTP/1.1 request.
    fn routes(&self) -> Router;
    /// The router for HTTP/2 clients, which counts its requests in flight
    /// itself.
    fn app(&self) -> Router;
    /// Counts an HTTP/1.1 request in flight, from its head on.
    fn in_flight(&self) -> Self::InFlight;
}

/// An answer the site made, as the server writes it.
pub(crate) trait Answered {
    /// The status.
    fn status(&self) -> StatusCode;
    /// `Content-Type`.
    fn content_type(&self) -> &'static str;
    /// Every other header, in order.
    fn headers(&self) -> impl Iterator<Item = (HeaderName, &[u8])>;
    /// The body.
    fn body(&self) -> &[u8];
}

/// How the server treats its clients.
#[derive(Debug)]
pub(crate) struct Settings {
    /// The deadlines of a request's head, body and response.
    pub(crate) timeouts: Timeouts,
    /// The accept loop's cap and its gauges.
    pub(crate) accepting: Accepting,
    /// The largest request body read; larger ones are answered 413.
    pub(crate) max_body: usize,
}

/// What every connection shares.
struct Front<S> {
    site: S,
    app: Router,
    routes: Router,
    timeouts: Timeouts,
    max_body: usize,
}

/// Serves `site` on `listener` until `shutdown` resolves; then stops
/// accepting and returns once every connection's request in flight has
/// been answered (idle connections are closed).
pub(crate) async fn serve<S: Site>(
    listener: TcpListener,
    site: S,
    settings: Settings,
    shutdown: impl Future<Output = ()>,
) {
    let front = Arc::new(Front {
        app: site.app(),
        routes: site.routes(),
        site,
        timeouts: settings.timeouts,
        max_body: settings.max_body,
    });
    super::serve_connections_with(
        listener,
        shutdown,
        settings.accepting,
        |stream, peer, life| serve_connection(front.clone(), stream, peer, life),
    )
    .await;
}

/// The file descriptors kept aside from client connections: listeners,
/// Redis connections, the configuration file, logs.
const RESERVED_FILES: usize = 64;

/// `max_connections`, lowered (with a warning) to what the process may
/// open: past its open-file limit, `accept` fails and connections wait in
/// the backlog, unanswered, where under the cap they get a clean 503.
pub(crate) fn within_file_limit(max_connections: usize) -> usize {
    let Some(limit) = open_file_limit() else {
        return max_connections;
    };
    let room = limit.saturating_sub(RESERVED_FILES).max(1);
    if max_connections > room {
        tracing::warn!(
            max_connections,
            open_file_limit = limit,
            "`[server] max_connections` is over what the process may open: {room} are served; raise `ulimit -n` (systemd: LimitNOFILE) or lower max_connections"
        );
        return room;
    }
    max_connections
}

/// A proxy's `max_connections` and `pooled` (the pool's cap on upstream
/// connections), lowered (with a warning) to what the process may open:
/// each HTTP/1.1 client connection may hold an upstream connection of its
/// own, so it counts twice, and every pooled connection once (see
/// [`share_files`]).
pub(crate) fn proxy_within_file_limit(max_connections: usize, pooled: usize) -> (usize, usize) {
    let Some(limit) = open_file_limit() else {
        return (max_connections, pooled);
    };
    let room = limit.saturating_sub(RESERVED_FILES).max(1);
    let (clients, within) = share_files(room, max_connections, pooled);
    if (clients, within) != (max_connections, pooled) {
        tracing::warn!(
            max_connections,
            pool_max_connections = pooled,
            open_file_limit = limit,
            "the proxy's connections, each client's and the upstream's, are over what the process may open: {clients} client connections and {within} pooled upstream connections are served; raise `ulimit -n` (systemd: LimitNOFILE) or lower `[server] max_connections` and `[proxy] pool_max_connections`"
        );
    }
    (clients, within)
}

/// How `room` file descriptors are shared by `clients` client connections
/// of a proxy, two descriptors each (the client's and its own upstream
/// connection), and `pooled` upstream connections: as asked if they fit;
/// else the pool keeps at most a quarter of the room, the client
/// connections get what they can of the rest, and the pool what is left.
fn share_files(room: usize, clients: usize, pooled: usize) -> (usize, usize) {
    if clients.saturating_mul(2).saturating_add(pooled) <= room {
        return (clients, pooled);
    }
    let pool_share = pooled.min(room / 4);
    let clients = clients.min((room - pool_share) / 2).max(1);
    let pooled = pooled.min(room.saturating_sub(clients * 2)).max(1);
    (clients, pooled)
}

/// The process's soft limit on open files (Linux: `/proc/self/limits`).
fn open_file_limit() -> Option<usize> {
    soft_file_limit(&std::fs::read_to_string("/proc/self/limits").ok()?)
}

/// The soft limit of the `Max open files` line of a `/proc/PID/limits`;
/// none when `unlimited` or missing.
fn soft_file_limit(limits: &str) -> Option<usize> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

async fn serve_connection<S: Site>(
    front: Arc<Front<S>>,
    stream: TcpStream,
    peer: SocketAddr,
    life: Lifetime,
) {
    let mut client = Client::with_timeouts(stream, peer, life.closing, front.timeouts);
    match client.sniff().await {
        Ok(true) => {
            let app = front.app.clone();
            // Each request whole within the head and body timeouts, as on
            // HTTP/1.1: a stream whose body trickles is answered 408.
            let within = front.timeouts.head + front.timeouts.body;
            let service = hyper::service::service_fn(move |mut req: Request<_>| {
                req.extensions_mut()
                    .insert(spillway_tower::ClientAddr(peer));
                let answered = app.clone().oneshot(req);
                async move {
                    match tokio::time::timeout(within, answered).await {
                        Ok(answered) => answered,
                        Err(_) => Ok(timed_out().into_response()),
                    }
                }
            });
            super::serve_h2(client, service, super::H2Limits::default()).await;
        }
        Ok(false) => {
            let mut conn = Conn { front, client };
            loop {
                match conn.one().await {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "connection closed with an error");
                        break;
                    }
                }
            }
            conn.client.linger().await;
        }
        Err(e) => tracing::debug!(%peer, error = %e, "connection closed with an error"),
    }
}

/// The answer to an HTTP/2 request that did not arrive in time.
fn timed_out() -> (
    StatusCode,
    [(http::header::HeaderName, &'static str); 1],
    String,
) {
    let status = StatusCode::REQUEST_TIMEOUT;
    let body = Problem::new(status, "The request did not arrive in time.").into_json();
    (status, [(http::header::CONTENT_TYPE, PROBLEM_JSON)], body)
}

/// The value of a request head's one `Authorization` line; none when it
/// has none or several (two lines are no credentials).
fn authorization(head: &[u8]) -> Option<&[u8]> {
    let mut lines = [httparse::EMPTY_HEADER; wire::MAX_HEADERS];
    let mut req = httparse::Request::new(&mut lines);
    // Parsed already by `parse_request_line`: an error is not expected,
    // and leaves the request without credentials.
    req.parse(head).ok()?;
    let mut found = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("authorization"));
    match (found.next(), found.next()) {
        (Some(one), None) => Some(one.value),
        _ => None,
    }
}

/// One client connection.
struct Conn<S> {
    front: Arc<Front<S>>,
    client: Client,
}

impl<S: Site> Conn<S> {
    /// Reads and answers one request; false when the connection is to be
    /// closed.
    async fn one(&mut self) -> io::Result<bool> {
        let Some(head_len) = self.client.read_head().await? else {
            return Ok(false);
        };
        let head = self.client.buf.split_to(head_len).freeze();
        // The line alone first: a fast answer needs none of the headers.
        let line = match wire::parse_request_line(&head) {
            Ok(line) => line,
            Err(e) => return self.client.refuse(&e).await.map(|()| false),
        };
        // In flight from its head on, as in hyper and axum.
        let _in_flight = self.front.site.in_flight();
        let Some(body) = self.read_body(line.framing, line.expects_continue).await? else {
            return Ok(false);
        };
        let mut reply = Reply {
            keep_alive: line.keep_alive,
            version: line.version,
            head_only: line.method == Method::HEAD,
        };
        let site = &self.front.site;
        if site.answers_fast(&line.method, &line.target) {
            // The headers are read only when they are needed.
            let authorization = if site.fast_needs_authorization() {
                authorization(&head)
            } else {
                None
            };
            let answering = self
                .client
                .until_decided(site.answer_fast(authorization, body));
            let Some(answer) = answering.await? else {
                // The client left while its answer was waited for.
                return Ok(false);
            };
            let more: SmallVec<[(HeaderName, &[u8]); 8]> = answer.headers().collect();
            let no_headers = http::HeaderMap::new();
            let res = Whole {
                content_type: Some(answer.content_type()),
                more: &more,
                ..Whole::new(answer.status(), &no_headers, answer.body())
            };
            // Whether the server is stopping is asked once the answer is
            // ready: one that stopped meanwhile says it closes.
            reply.keep_alive &= !self.client.is_closing();
            self.client.respond(&res, reply).await?;
            return Ok(reply.keep_alive);
        }
        let parts = match wire::parse_request(&head) {
            Ok(parts) => parts,
            Err(e) => return self.client.refuse(&e).await.map(|()| false),
        };
        let mut request = Request::from_parts(parts, axum::body::Body::from(body));
        // The forward-auth hook believes only trusted proxies.
        request
            .extensions_mut()
            .insert(spillway_tower::ClientAddr(self.client.peer));
        let routed = self.front.routes.clone().oneshot(request);
        let Some(Ok(response)) = self.client.until_decided(routed).await? else {
            return Ok(false);
        };
        let (response, body) = response.into_parts();
        let body = match body.collect().await {
            Ok(body) => body.to_bytes(),
            Err(e) => {
                tracing::warn!(error = %e, "a response body failed");
                return Ok(false);
            }
        };
        let mut res = Whole::new(response.status, &response.headers, &body);
        if reply.head_only {
            // A HEAD response keeps the length its GET would have (axum
            // says it, then drops the body).
            let declared = response.headers.get(http::header::CONTENT_LENGTH);
            if let Some(len) = declared.and_then(|v| v.to_str().ok()?.parse().ok()) {
                res.len = len;
            }
        }
        reply.keep_alive &= !self.client.is_closing();
        self.client.respond(&res, reply).await?;
        Ok(reply.keep_alive)
    }

    /// Reads a request's whole body; `None` if it could not be (too large,
    /// broken, cut short), the client having had its answer if it can use
    /// one.
    async fn read_body(
        &mut self,
        framing: Framing,
        expects_continue: bool,
    ) -> io::Result<Option<Bytes>> {
        let too_large = match framing {
            Framing::Empty => return Ok(Some(Bytes::new())),
            Framing::Length(n) => n > self.front.max_body as u64,
            Framing::Chunked => false,
        };
        if too_large {
            self.refuse_too_large().await?;
            return Ok(None);
        }
        if expects_continue {
            self.client.write(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
        }
        self.client.body_started();
        let body = match self.read_whole_body(framing).await {
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                let detail = format!(
                    "The request body did not arrive within {:?}.",
                    self.client.timeouts.body
                );
                self.client
                    .answer_error(StatusCode::REQUEST_TIMEOUT, &detail)
                    .await?;
                Ok(None)
            }
            body => body,
        };
        self.client.body_done();
        body
    }

    /// [`read_body`](Self::read_body) once the body is to be read.
    async fn read_whole_body(&mut self, framing: Framing) -> io::Result<Option<Bytes>> {
        if let Framing::Length(n) = framing {
            // At most the largest body, which fits a usize.
            let n = n as usize;
            while self.client.buf.len() < n {
                if !self.client.fill().await? {
                    return Ok(None);
                }
            }
            return Ok(Some(self.client.buf.split_to(n).freeze()));
        }
        let mut chunked = Chunked::default();
        let mut body = BytesMut::new();
        loop {
            let used = match chunked.feed(&self.client.buf, |data| body.extend_from_slice(data)) {
                Ok(used) => used,
                Err(e) => {
                    self.client.answer_error(e.status(), &e.to_string()).await?;
                    return Ok(None);
                }
            };
            self.client.buf.advance(used);
            if body.len() > self.front.max_body {
                self.refuse_too_large().await?;
                return Ok(None);
            }
            if chunked.is_done() {
                return Ok(Some(body.freeze()));
            }
            if !self.client.fill().await? {
                return Ok(None);
            }
        }
    }

    /// Answers a body over the site's largest with a 413 (as axum's body
    /// limit words it), and closes.
    async fn refuse_too_large(&mut self) -> io::Result<()> {
        self.client
            .answer_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Failed to buffer the body: length limit exceeded",
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proxy's client connections count twice (each may hold an
    /// upstream connection of its own), its pooled connections once, and
    /// together they fit the room.
    #[test]
    fn a_proxy_shares_the_file_limit_between_clients_and_the_pool() {
        assert_eq!(share_files(100_000, 10_000, 1_000), (10_000, 1_000));
        // `ulimit -n 1024`: 960 descriptors of room.
        assert_eq!(share_files(960, 10_000, 1_000), (360, 240));
        assert_eq!(share_files(960, 960, 1_000), (360, 240));
        // Few clients: the pool gets the rest.
        assert_eq!(share_files(960, 100, 1_000), (100, 760));
        // A small pool keeps what it asked for.
        assert_eq!(share_files(960, 10_000, 10), (475, 10));
        for room in [1, 2, 3, 7, 960, 65_472] {
            for (clients, pooled) in [(1, 1), (10_000, 1_000), (5, 100_000)] {
                let (c, p) = share_files(room, clients, pooled);
                assert!(c >= 1 && p >= 1 && c <= clients && p <= pooled);
                assert!(
                    c * 2 + p <= room.max(3),
                    "{room} {clients} {pooled}: {c} {p}"
                );
            }
        }
    }

    #[test]
    fn the_open_file_limit_is_the_soft_one() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             63429                63429                processes \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(soft_file_limit(limits), Some(1024));
        let unlimited = limits.replace("1024 ", "unlimited ");
        assert_eq!(soft_file_limit(&unlimited), None);
        assert_eq!(soft_file_limit(""), None);
    }
}

//! The HTTP server of `spillway serve`: HTTP/1.1 of our own, one task per
//! connection, requests read and answered in that task.
//!
//! `POST /v1/check` is answered straight from its body
//! ([`check_answer`]): no router, no response object, the answer's bytes
//! written in one go. Every other request is read whole and handed to the
//! axum [`Router`] of [`app`], whose answer is written back. HTTP/2
//! clients (prior knowledge) are served by hyper with the same router.
//!
//! Under the bench's load, hyper and axum took about half the server's
//! user-space time for a check (see BENCHMARKS.md).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::response::IntoResponse;
use bytes::{Buf, Bytes, BytesMut};
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use crate::api::{
    Answer, MAX_BODY_BYTES, app, check_answer, check_authorized, check_needs_token, routes,
};
use crate::http1::wire::{self, Chunked, Framing};
use crate::http1::{self, Accepting, Client, Lifetime, Reply, Timeouts, Whole};
use crate::state::State;

/// What every connection shares.
struct Front {
    state: State,
    /// The API for HTTP/2 clients.
    app: Router,
    /// The same without the in-flight count, which is kept here.
    routes: Router,
    /// `[server]`'s, as the service started (a reload does not change
    /// them).
    timeouts: Timeouts,
}

/// Serves the HTTP API on `listener` until `shutdown` resolves; then stops
/// accepting and returns once every connection's request in flight has
/// been answered (idle connections are closed).
pub(crate) async fn serve(
    listener: TcpListener,
    state: State,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let server = state.live.current().config.server.clone();
    let timeouts = Timeouts {
        head: server.head_timeout,
        body: server.body_timeout,
        write: server.write_timeout,
        idle: server.idle_timeout,
    };
    let (open, refused) = state.metrics.connection_metrics();
    let accepting = Accepting {
        max_connections: within_file_limit(server.max_connections.get()),
        open: Some(open),
        refused: Some(refused),
    };
    let front = Arc::new(Front {
        app: app(state.clone()),
        routes: routes(state.clone()),
        state,
        timeouts,
    });
    http1::serve_connections_with(listener, shutdown, accepting, |stream, peer, life| {
        serve_connection(front.clone(), stream, peer, life)
    })
    .await;
    Ok(())
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

async fn serve_connection(front: Arc<Front>, stream: TcpStream, peer: SocketAddr, life: Lifetime) {
    let mut client = Client::with_timeouts(stream, peer, life.closing, front.timeouts);
    match client.sniff().await {
        Ok(true) => {
            let app = front.app.clone();
            // Each request whole within the head and body timeouts, as on
            // HTTP/1.1: a stream whose body trickles is answered 408.
            let within = front.timeouts.head + front.timeouts.body;
            let service = hyper::service::service_fn(move |req| {
                let answered = app.clone().oneshot(req);
                async move {
                    match tokio::time::timeout(within, answered).await {
                        Ok(answered) => answered,
                        Err(_) => Ok(Answer::problem(
                            StatusCode::REQUEST_TIMEOUT,
                            "The request did not arrive in time.",
                        )
                        .into_response()),
                    }
                }
            });
            http1::serve_h2(client, service).await;
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

/// Whether a request target is `/v1/check` (origin form, with or without
/// a query); any other form goes through the router.
fn is_check(target: &[u8]) -> bool {
    target
        .strip_prefix(b"/v1/check")
        .is_some_and(|rest| rest.is_empty() || rest[0] == b'?')
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
struct Conn {
    front: Arc<Front>,
    client: Client,
}

impl Conn {
    /// Reads and answers one request; false when the connection is to be
    /// closed.
    async fn one(&mut self) -> io::Result<bool> {
        let Some(head_len) = self.client.read_head().await? else {
            return Ok(false);
        };
        let head = self.client.buf.split_to(head_len).freeze();
        // The line alone first: a check needs none of the headers.
        let line = match wire::parse_request_line(&head) {
            Ok(line) => line,
            Err(e) => return self.client.refuse(&e).await.map(|()| false),
        };
        // In flight from its head on, as in hyper and axum.
        let _in_flight = self.front.state.metrics.in_flight();
        let Some(body) = self.read_body(line.framing, line.expects_continue).await? else {
            return Ok(false);
        };
        let reply = Reply {
            keep_alive: line.keep_alive && !self.client.is_closing(),
            version: line.version,
            head_only: line.method == Method::HEAD,
        };
        if line.method == Method::POST && is_check(&line.target) {
            let state = &self.front.state;
            // The headers are read only when a token is needed.
            let authorization = if check_needs_token(state) {
                authorization(&head)
            } else {
                None
            };
            let answer = match check_authorized(state, authorization) {
                Ok(()) => {
                    let decided = self.client.until_decided(check_answer(state, &body));
                    let Some(answer) = decided.await? else {
                        // The client left while its check was waited for.
                        return Ok(false);
                    };
                    answer
                }
                Err(refused) => *refused,
            };
            let no_headers = http::HeaderMap::new();
            let more: smallvec::SmallVec<[_; 8]> = answer.headers().collect();
            let res = Whole {
                content_type: Some(answer.content_type),
                more: &more,
                ..Whole::new(answer.status, &no_headers, &answer.body)
            };
            self.client.respond(&res, reply).await?;
            return Ok(reply.keep_alive);
        }
        let parts = match wire::parse_request(&head) {
            Ok(parts) => parts,
            Err(e) => return self.client.refuse(&e).await.map(|()| false),
        };
        let request = Request::from_parts(parts, axum::body::Body::from(body));
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
            Framing::Length(n) => n > MAX_BODY_BYTES as u64,
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
            // At most MAX_BODY_BYTES: fits a usize.
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
            if body.len() > MAX_BODY_BYTES {
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

    /// Answers a body over [`MAX_BODY_BYTES`] with a 413 (as axum's body
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

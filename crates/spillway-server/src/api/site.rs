//! The API as the HTTP/1.1 server's [`Site`]: `POST /v1/check` is answered
//! straight from its body ([`check_answer`]), everything else by the
//! router. The admin listener of `spillway proxy` is a site too, of the
//! router only.

use std::io;

use axum::{Extension, Router};
use bytes::Bytes;
use http::{HeaderName, Method, StatusCode};
use spillway_tower::Draining;
use tokio::net::TcpListener;

use super::answer::Answer;
use super::check::{check_answer, check_authorized, check_needs_token};
use super::{MAX_BODY_BYTES, admin_routes, app, routes};
use crate::http1::serve::{Answered, Settings, Site};
use crate::http1::{self, Accepting, Timeouts};
use crate::metrics::InFlight;
use crate::state::State;

/// Serves the HTTP API on `listener` until `shutdown` resolves; then stops
/// accepting and returns once every connection's request in flight has
/// been answered (idle connections are closed).
pub(crate) async fn serve(
    listener: TcpListener,
    state: State,
    draining: Draining,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let settings = settings(&state);
    http1::serve::serve(listener, Api { state, draining }, settings, shutdown).await;
    Ok(())
}

/// Serves the admin listener's routes ([`admin_routes`]) on `listener`,
/// as [`serve`] serves the API, until `shutdown` resolves.
pub(crate) async fn serve_admin(
    listener: TcpListener,
    state: State,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let settings = settings(&state);
    http1::serve::serve(listener, AdminSite { state }, settings, shutdown).await;
    Ok(())
}

/// The server's settings, from the configuration's `[server]`.
fn settings(state: &State) -> Settings {
    let server = state.live.current().config.server.clone();
    let timeouts = Timeouts {
        head: server.head_timeout,
        body: server.body_timeout,
        write: server.write_timeout,
        idle: server.idle_timeout,
    };
    let (open, refused) = state.metrics.connection_metrics();
    let accepting = Accepting {
        max_connections: http1::within_file_limit(server.max_connections.get()),
        open: Some(open),
        refused: Some(refused),
        drain_timeout: server.drain_timeout,
    };
    Settings {
        timeouts,
        accepting,
        max_body: MAX_BODY_BYTES,
    }
}

/// The API on the state it serves.
struct Api {
    state: State,
    // Turns true when the server stops: the forward-auth hook then answers
    // the requests it holds for their shaping turn at once (503).
    draining: Draining,
}

impl Site for Api {
    type Fast = Answer;
    type InFlight = InFlight;

    fn answers_fast(&self, method: &Method, target: &[u8]) -> bool {
        method == Method::POST && is_check(target)
    }

    fn fast_needs_authorization(&self) -> bool {
        check_needs_token(&self.state)
    }

    fn answer_fast(
        &self,
        authorization: Option<&[u8]>,
        body: Bytes,
    ) -> impl Future<Output = Answer> + Send {
        let authorized = check_authorized(&self.state, authorization);
        async move {
            match authorized {
                Ok(()) => check_answer(&self.state, &body).await,
                Err(refused) => *refused,
            }
        }
    }

    fn routes(&self) -> Router {
        routes(self.state.clone()).layer(Extension(self.draining.clone()))
    }

    fn app(&self) -> Router {
        app(self.state.clone()).layer(Extension(self.draining.clone()))
    }

    fn in_flight(&self) -> InFlight {
        self.state.metrics.in_flight()
    }
}

/// The admin listener: the router for every request.
struct AdminSite {
    state: State,
}

impl Site for AdminSite {
    type Fast = Answer;
    type InFlight = ();

    fn answers_fast(&self, _: &Method, _: &[u8]) -> bool {
        false
    }

    fn fast_needs_authorization(&self) -> bool {
        false
    }

    fn answer_fast(&self, _: Option<&[u8]>, _: Bytes) -> impl Future<Output = Answer> + Send {
        // Never asked: no request is answered fast.
        std::future::ready(Answer::problem(StatusCode::NOT_FOUND, "Not found."))
    }

    fn routes(&self) -> Router {
        admin_routes(self.state.clone())
    }

    fn app(&self) -> Router {
        admin_routes(self.state.clone())
    }

    // Admin requests are not the traffic `spillway_in_flight` counts.
    fn in_flight(&self) {}
}

/// Whether a request target is `/v1/check` (origin form, with or without
/// a query); any other form goes through the router.
fn is_check(target: &[u8]) -> bool {
    target
        .strip_prefix(b"/v1/check")
        .is_some_and(|rest| rest.is_empty() || rest[0] == b'?')
}

impl Answered for Answer {
    fn status(&self) -> StatusCode {
        self.status
    }

    fn content_type(&self) -> &'static str {
        self.content_type
    }

    fn headers(&self) -> impl Iterator<Item = (HeaderName, &[u8])> {
        Answer::headers(self)
    }

    fn body(&self) -> &[u8] {
        &self.body
    }
}

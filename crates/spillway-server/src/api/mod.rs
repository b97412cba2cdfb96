//! The HTTP API: `POST /v1/check`, `/healthz`, `/readyz`, `/metrics`,
//! `/openapi.json` and the admin API under `/admin`. See `docs/server.md`
//! and `docs/openapi.json`.
//!
//! Every error is an `application/problem+json` answer with its own status
//! (400 for input that can never be decided, 401/404 for the admin API, 503
//! when the store cannot decide); bad input is never a 500. Each endpoint
//! is an adapter: it reads its input, asks the engine (or the store, for
//! the admin API's inspection) and renders an `Answer`.

mod admin;
mod answer;
mod changes;
mod check;
mod forward_auth;
mod health;
mod lease;
mod lists;
mod overrides;
pub(crate) mod settle;
mod site;
mod tiers;

pub(crate) use settle::SettleKey;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::get;

use crate::metrics::InFlightLayer;
use crate::state::State;

pub(crate) use site::serve;

/// Serves `/healthz`, `/readyz`, `/metrics`, `/openapi.json` and the admin
/// API on `listener` (the routes of [`app()`] but `POST /v1/check`), with
/// the HTTP server and limits of `spillway serve`, until `shutdown`
/// resolves: `spillway proxy --admin-listen`, whose proxied port forwards
/// every path to the upstream.
pub async fn serve_admin(
    listener: tokio::net::TcpListener,
    state: State,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    tracing::info!("admin listener on http://{}", listener.local_addr()?);
    site::serve_admin(listener, state, shutdown).await
}

/// The OpenAPI 3 description of this API, as served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../docs/openapi.json");

/// The longest key `/v1/check` accepts, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// The largest request body the API reads.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The HTTP API on `state`.
///
/// ```
/// use axum::body::Body;
/// use http::{Request, StatusCode};
/// use spillway_server::config::Config;
/// use spillway_server::{State, app};
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let config = Config::parse(
///     "[[rules]]\nname = \"login\"\nalgorithm = \"sliding_log\"\nlimit = 1\nwindow = \"1m\"\n",
/// )
/// .unwrap();
/// let app = app(State::new(config).await.unwrap());
/// let check = || {
///     Request::post("/v1/check")
///         .body(Body::from(r#"{"rule": "login", "key": "ip=203.0.113.7"}"#))
///         .unwrap()
/// };
/// let first = app.clone().oneshot(check()).await.unwrap();
/// assert_eq!(first.status(), StatusCode::OK);
/// assert_eq!(first.headers()["x-ratelimit-remaining"], "0");
/// // Denied: still a 200, whose body says `"allowed":false,"status":429`.
/// let second = app.oneshot(check()).await.unwrap();
/// assert_eq!(second.status(), StatusCode::OK);
/// # }
/// ```
pub fn app(state: State) -> Router {
    routes(state.clone()).layer(InFlightLayer(state.metrics.clone()))
}

/// The API's routes without the in-flight count (the HTTP/1.1 server of
/// `spillway serve` counts a request from its head on, body included).
pub(crate) fn routes(state: State) -> Router {
    router(state, true)
}

/// The admin listener's routes: [`routes`] without `POST /v1/check`.
pub(crate) fn admin_routes(state: State) -> Router {
    router(state, false)
}

fn router(state: State, with_check: bool) -> Router {
    let admin = Router::new()
        .route("/rules", get(admin::rules))
        .route("/rules/{rule}/keys", get(admin::keys))
        .route(
            "/lists",
            get(lists::read)
                .post(lists::create)
                .put(lists::replace)
                .delete(lists::remove),
        )
        .route(
            "/tiers",
            get(tiers::read)
                .post(tiers::create)
                .put(tiers::replace)
                .delete(tiers::remove),
        )
        .route(
            "/overrides",
            get(overrides::read)
                .post(overrides::create)
                .put(overrides::replace)
                .delete(overrides::remove),
        )
        .route(
            "/rules/{rule}/keys/{*key}",
            get(admin::key).delete(admin::reset),
        )
        .method_not_allowed_fallback(answer::method_not_allowed)
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            admin::authorize,
        ));
    let router = if with_check {
        Router::new()
            .route("/v1/check", axum::routing::post(check::check))
            .route("/v1/settle", axum::routing::post(settle::settle))
            .route("/v1/renew", axum::routing::post(lease::renew))
            .route("/v1/release", axum::routing::post(lease::release))
            .route(
                "/v1/forward-auth",
                axum::routing::any(forward_auth::forward_auth),
            )
    } else {
        Router::new()
    };
    router
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .route("/openapi.json", get(health::openapi))
        .method_not_allowed_fallback(answer::method_not_allowed)
        .nest("/admin", admin)
        .fallback(answer::not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

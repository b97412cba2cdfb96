//! `/healthz`, `/readyz`, `/metrics` and `/openapi.json`.

use axum::extract::State as Extract;
use axum::response::{IntoResponse, Response};
use http::header::CONTENT_TYPE;
use http::{HeaderValue, StatusCode};
use serde_json::json;
use spillway_redis::OnError;

use crate::state::State;

use super::OPENAPI;
use super::answer::json_response;

pub(super) async fn healthz() -> Response {
    json_response(StatusCode::OK, &json!({ "status": "ok" }))
}

/// Ready unless the store is Redis, its policy is `fail_closed` and it does
/// not answer. Whether Redis answers is its breakers' state, which traffic
/// and the store probe (`crate::probe`, every second) keep fresh: this
/// endpoint asks Redis nothing itself, so a flood of it costs Redis
/// nothing.
pub(super) async fn readyz(Extract(state): Extract<State>) -> Response {
    let engine = state.live.current();
    let Some(redis) = engine.store().redis() else {
        return json_response(
            StatusCode::OK,
            &json!({ "status": "ready", "store": "memory" }),
        );
    };
    let on_error = engine.config.store.on_error;
    let healthy = redis.is_healthy();
    // Requests are served without Redis too (admitted, or decided in
    // memory) unless its policy is to refuse them.
    let ready = healthy || on_error != OnError::FailClosed;
    let policy = match on_error {
        OnError::FailOpen => "fail_open",
        OnError::FailClosed => "fail_closed",
        OnError::Local { .. } => "local",
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(
        status,
        &json!({
            "status": if ready { "ready" } else { "unavailable" },
            "store": "redis",
            "redis_healthy": healthy,
            "on_error": policy,
        }),
    )
}

pub(super) async fn metrics(Extract(state): Extract<State>) -> Response {
    let engine = state.live.current();
    let body = state.metrics.encode(engine.store());
    let mut res = body.into_response();
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
    );
    res
}

pub(super) async fn openapi() -> Response {
    let mut res = OPENAPI.into_response();
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

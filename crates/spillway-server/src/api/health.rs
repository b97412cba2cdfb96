//! `/healthz`, `/readyz`, `/metrics` and `/openapi.json`.

use std::time::Duration;

use axum::extract::State as Extract;
use axum::response::{IntoResponse, Response};
use http::header::CONTENT_TYPE;
use http::{HeaderValue, StatusCode};
use serde_json::json;
use spillway::store::{Check, RuleId, Store};
use spillway_redis::OnError;

use crate::state::State;

use super::OPENAPI;
use super::answer::json_response;

pub(super) async fn healthz() -> Response {
    json_response(StatusCode::OK, &json!({ "status": "ok" }))
}

/// How long a readiness probe waits for Redis.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

pub(super) async fn readyz(Extract(state): Extract<State>) -> Response {
    let engine = state.live.current();
    let Some(redis) = engine.store().redis() else {
        return json_response(
            StatusCode::OK,
            &json!({ "status": "ready", "store": "memory" }),
        );
    };
    let on_error = engine.config.store.on_error;
    let (healthy, ready) = match on_error {
        // Serving needs Redis: ask it (a cost-0 peek at a key no client
        // uses; it writes nothing).
        OnError::FailClosed => {
            let healthy = match redis.rules().first() {
                None => redis.is_healthy(),
                Some(_) => {
                    let probe = [Check {
                        rule: RuleId(0),
                        key: "\u{0}spillway-readyz",
                        cost: 0,
                    }];
                    matches!(
                        tokio::time::timeout(PROBE_TIMEOUT, redis.check(&probe)).await,
                        Ok(Ok(_))
                    )
                }
            };
            (healthy, healthy)
        }
        // Requests are served without Redis too (admitted, or decided in
        // memory): ready either way.
        OnError::FailOpen | OnError::Local { .. } => (redis.is_healthy(), true),
    };
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

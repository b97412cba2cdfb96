//! [`Answer`]: what an endpoint answers, before a server writes it.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, HeaderValue, StatusCode};
use serde::Serialize;
use spillway_tower::RateLimitFields;
use spillway_tower::problem::{PROBLEM_JSON, Problem};

/// An answer of the API before it is written: by axum (as a [`Response`])
/// or by the HTTP/1.1 server of `spillway serve` (`crate::http1::serve`). Its
/// headers are data; each server renders them.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) content_type: &'static str,
    /// The rate-limit fields of a decision.
    pub(crate) fields: RateLimitFields,
    /// Any other header (`Retry-After`, `WWW-Authenticate`): rare, so boxed
    /// to keep the answer small (it is moved through every layer of the
    /// server).
    pub(crate) other: Option<Box<(HeaderName, HeaderValue)>>,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    /// A JSON answer.
    pub(crate) fn json(status: StatusCode, body: &impl Serialize) -> Self {
        let body = serde_json::to_vec(body).unwrap_or_else(|e| {
            // Our own types always serialize; should one not, say so.
            format!("{{\"error\":\"cannot serialize the answer: {e}\"}}").into_bytes()
        });
        Self {
            status,
            content_type: "application/json",
            fields: RateLimitFields::default(),
            other: None,
            body,
        }
    }

    /// An `application/problem+json` answer (RFC 9457).
    pub(crate) fn problem(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            status,
            content_type: PROBLEM_JSON,
            fields: RateLimitFields::default(),
            other: None,
            body: Problem::new(status, &detail.into())
                .into_json()
                .into_bytes(),
        }
    }

    /// The headers besides `Content-Type`, in the order they are sent.
    pub(crate) fn headers(&self) -> impl Iterator<Item = (HeaderName, &[u8])> {
        let other = self.other.iter().map(|h| (h.0.clone(), h.1.as_bytes()));
        self.fields.iter().chain(other)
    }
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        let mut res = (self.status, self.body).into_response();
        let headers = res.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(self.content_type));
        self.fields.write_to(headers);
        if let Some(header) = self.other {
            let (name, value) = *header;
            headers.insert(name, value);
        }
        res
    }
}

/// An `application/problem+json` answer (RFC 9457).
pub(super) fn problem(status: StatusCode, detail: impl Into<String>) -> Response {
    Answer::problem(status, detail).into_response()
}

/// A request body read whole, up to [`MAX_BODY_BYTES`](super::MAX_BODY_BYTES)
/// (413 past it). Read only once the caller is authorized: an unknown
/// caller gets its 401 without the server reading a byte of its body.
pub(super) async fn read_body(body: axum::body::Body) -> Result<axum::body::Bytes, Response> {
    axum::body::to_bytes(body, super::MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            let inner = e.into_inner();
            if inner.is::<http_body_util::LengthLimitError>() {
                problem(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("The body is larger than {} bytes.", super::MAX_BODY_BYTES),
                )
            } else {
                problem(
                    StatusCode::BAD_REQUEST,
                    format!("The body could not be read: {inner}."),
                )
            }
        })
}

pub(super) fn bad_request(detail: impl Into<String>) -> Answer {
    Answer::problem(StatusCode::BAD_REQUEST, detail)
}

pub(super) fn unavailable(detail: impl Into<String>) -> Answer {
    let mut answer = Answer::problem(StatusCode::SERVICE_UNAVAILABLE, detail);
    answer.other = Some(Box::new((RETRY_AFTER, HeaderValue::from(1u64))));
    answer
}

pub(super) fn json_response(status: StatusCode, body: &impl Serialize) -> Response {
    Answer::json(status, body).into_response()
}

pub(super) async fn not_found() -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "No such endpoint: see /openapi.json.",
    )
}

/// A known endpoint asked with a method it does not take: a 405 like any
/// other error, problem+json (the router adds `Allow`).
pub(super) async fn method_not_allowed() -> Response {
    problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "This endpoint does not take this method: see the `Allow` header and /openapi.json.",
    )
}

/// Durations are reported in whole milliseconds, rounded up: a client that
/// waits that long is never early.
pub(super) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

//! The responses the rate limiter writes itself.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;

use crate::future::ResponseBody;
use crate::headers::printable_name;
use crate::problem::{PROBLEM_JSON, Problem};
use crate::rules::BodyFormat;

/// The problem type of draft-ietf-httpapi-ratelimit-headers-11, §5.1.
const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// A 429 for a request denied by `rule`, retrying in `retry_secs`;
/// `violated` names every rule that denied it (`rule` first), in policy
/// order.
pub(crate) fn too_many_requests<B>(
    format: BodyFormat,
    rule: &str,
    violated: &[&str],
    retry_secs: u64,
    status: StatusCode,
) -> Response<ResponseBody<B>> {
    let detail = format!(
        "Rate limit `{rule}` exceeded: retry in {retry_secs} second{}.",
        if retry_secs == 1 { "" } else { "s" }
    );
    let (content_type, body): (&str, Bytes) = match format {
        BodyFormat::Problem => (
            PROBLEM_JSON,
            Problem::new(status, &detail)
                .member("retry_after", retry_secs)
                .member("rule", rule)
                .into_json()
                .into(),
        ),
        // The names the client reads in `RateLimit-Policy` (§5.1: "the
        // names of policies where the quota was exceeded"); `rule` is
        // dropped, `retry_after` kept for clients of `Problem`.
        BodyFormat::QuotaExceeded => (
            PROBLEM_JSON,
            Problem::new(status, &detail)
                .kind(QUOTA_EXCEEDED, "Quota Exceeded")
                .member("retry_after", retry_secs)
                .member(
                    "violated-policies",
                    violated
                        .iter()
                        .map(|name| printable_name(name))
                        .collect::<Vec<_>>(),
                )
                .into_json()
                .into(),
        ),
        BodyFormat::Json => (
            "application/json",
            json!({ "error": detail, "retry_after": retry_secs, "rule": rule })
                .to_string()
                .into(),
        ),
        BodyFormat::Text => ("text/plain; charset=utf-8", format!("{detail}\n").into()),
        BodyFormat::Empty => ("", Bytes::new()),
    };
    let mut res = Response::new(ResponseBody::full(body));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_secs));
    if !content_type.is_empty() {
        res.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    res
}

/// A problem+json response for errors that are not denials.
pub(crate) fn problem<B>(status: StatusCode, detail: &str) -> Response<ResponseBody<B>> {
    let body = Problem::new(status, detail).into_json();
    let mut res = Response::new(ResponseBody::full(body));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    res
}

/// A 503 for a store that cannot decide, with `Retry-After: 1`.
pub(crate) fn unavailable<B>() -> Response<ResponseBody<B>> {
    let mut res = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "The rate limiter cannot reach its store; try again shortly.",
    );
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(1u64));
    res
}

/// A 503 for a shaped request its server cannot hold (see
/// [`HoldCap`](crate::HoldCap)), retrying in `retry_secs` (when its turn
/// would have come); for a gRPC request, `UNAVAILABLE` with the same
/// `Retry-After`.
pub(crate) fn too_many_held<B>(retry_secs: u64, grpc: bool) -> Response<ResponseBody<B>> {
    let mut res = if grpc {
        grpc_status(
            14,
            "too many requests are waiting for their turn; try again",
        )
    } else {
        problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "Too many requests are waiting for their turn; try again.",
        )
    };
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_secs));
    res
}

/// A 503 for a shaped request whose server stopped before its turn,
/// retrying in `retry_secs` (when its turn would have come); for a gRPC
/// request, `UNAVAILABLE` with the same `Retry-After`.
pub(crate) fn stopping<B>(retry_secs: u64, grpc: bool) -> Response<ResponseBody<B>> {
    let mut res = if grpc {
        grpc_status(14, "the server is stopping; try again")
    } else {
        problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "The server is stopping before this request's turn; try again.",
        )
    };
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_secs));
    res
}

/// What a 500 for a request without the client's address says: what is
/// missing, and how to fix it.
pub(crate) fn missing_client_addr_detail(rule: &str) -> String {
    format!(
        "The rate limiter cannot see the client's address, which rule `{rule}` counts by: the request has no \
         axum ConnectInfo<SocketAddr> and no spillway_tower::ClientAddr extension. Serve the app with \
         `axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())`, or insert a \
         ClientAddr extension in a layer in front of the rate limiter."
    )
}

/// Whether a request is gRPC: its answers must be gRPC statuses, not HTTP
/// error pages a gRPC client cannot read.
pub(crate) fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// A gRPC "trailers-only" answer: HTTP 200 with `grpc-status` and
/// `grpc-message` in the headers and no body. Rate limiting is
/// `RESOURCE_EXHAUSTED` (8).
pub(crate) fn grpc_status<B>(code: u8, message: &str) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::full(Bytes::new()));
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    // grpc-message is percent-encoded: keep printable ASCII but `%`.
    let encoded: String = message
        .bytes()
        .map(|b| {
            if (0x20..0x7f).contains(&b) && b != b'%' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    if let Ok(v) = HeaderValue::try_from(encoded) {
        headers.insert("grpc-message", v);
    }
    res
}

//! `/v1/forward-auth`: the hook that nginx (`auth_request`), Caddy
//! (`forward_auth`), Traefik (`ForwardAuth`) and HAProxy (a Lua action) call
//! before they forward a request themselves. See `docs/integrations.md`.
//!
//! The proxy describes the original request in headers: its method in
//! `X-Forwarded-Method`, its target in `X-Forwarded-Uri`, its host in
//! `X-Forwarded-Host`, the client's address in `X-Forwarded-For`; the other
//! headers of the call are the original request's (each of these proxies
//! copies them). That request is read as `spillway proxy` reads one (the
//! same normalization, the same refusals), then decided by the middleware
//! around a service that only says yes, so that every rule, action, header
//! field and shaping delay is the middleware's own:
//!
//! - admitted: `200` with the rate-limit header fields for the proxy to copy
//!   onto its response (and `X-Spillway-Limited` when a `degrade` rule
//!   denied it, for the upstream);
//! - denied: `429` with `Retry-After`, the fields and the problem body, which
//!   Caddy, Traefik and HAProxy hand to the client as they are;
//! - a request the proxy would refuse, or a description that is missing or
//!   malformed: `400` naming the header; the store unreachable under
//!   `fail_closed`: `503`;
//! - concurrency rules do not apply: the proxy never says when the request
//!   ends, so no slot could be held for it (see `NotServed`);
//! - shaped (a leaky bucket in `shape` mode): the answer is held for the
//!   delay, and the proxy, waiting for it, holds the request: the hook
//!   shapes as the proxy does. A proxy that gives up waiting (its timeout to
//!   the hook) takes the charge back with it.
//!
//! The description is believed only from `[clients] trusted_proxies`: any
//! other caller gets `403`, and nothing is charged. nginx passes a
//! sub-request's status through only when it is 2xx, 401 or 403 (anything
//! else becomes a 500), so `?deny_status=403` turns every answer that is not
//! 2xx into a 403 that carries the real status in `X-Spillway-Status`, for
//! the nginx snippet to answer with.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::{Request, State as Extract};
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, Version};
use http_body_util::Empty;
use spillway_tower::ClientAddr;
use tower::{Layer, ServiceExt};

use super::answer::problem;
use crate::proxy::sanitize_hooked;
use crate::state::State;

/// The original request's method.
pub(crate) const X_FORWARDED_METHOD: HeaderName = HeaderName::from_static("x-forwarded-method");
/// The original request's target, as the client sent it.
pub(crate) const X_FORWARDED_URI: HeaderName = HeaderName::from_static("x-forwarded-uri");
/// The original request's host.
pub(crate) const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// With `?deny_status=`, the status the hook would have answered.
pub(crate) const X_SPILLWAY_STATUS: HeaderName = HeaderName::from_static("x-spillway-status");

/// Answers the hook: the decision on the request the proxy describes.
pub(super) async fn forward_auth(Extract(state): Extract<State>, req: Request) -> Response {
    let deny_status = match deny_status(req.uri().query()) {
        Ok(status) => status,
        Err(detail) => return problem(StatusCode::BAD_REQUEST, detail),
    };
    let mut res = decide(&state, req).await;
    if let Some(status) = deny_status
        && !res.status().is_success()
    {
        let real = HeaderValue::from(res.status().as_u16());
        res.headers_mut().insert(X_SPILLWAY_STATUS, real);
        *res.status_mut() = status;
    }
    res
}

/// `?deny_status=401` or `403`: what every answer that is not 2xx becomes.
fn deny_status(query: Option<&str>) -> Result<Option<StatusCode>, String> {
    let mut status = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("deny_status", "401")) => status = Some(StatusCode::UNAUTHORIZED),
            Some(("deny_status", "403")) => status = Some(StatusCode::FORBIDDEN),
            Some(("deny_status", other)) => {
                return Err(format!(
                    "`deny_status` must be 401 or 403, the statuses nginx's auth_request passes on (got `{other}`)."
                ));
            }
            _ => {
                return Err(format!(
                    "Unknown query parameter `{pair}`: the hook takes only `deny_status`."
                ));
            }
        }
    }
    Ok(status)
}

/// The decision on the described request, as the middleware answers it.
async fn decide(state: &State, req: Request) -> Response {
    let (mut parts, _) = req.into_parts();
    let loaded = state.live.current();
    let policy = loaded.layer.policy();
    let peer = parts
        .extensions
        .get::<ClientAddr>()
        .map(|ClientAddr(p)| p.ip());
    match peer {
        Some(ip) if policy.client_settings().trusts(ip) => {}
        Some(ip) => {
            return problem(
                StatusCode::FORBIDDEN,
                format!(
                    "{ip} is not one of `[clients] trusted_proxies`: only a trusted proxy may describe a request to /v1/forward-auth."
                ),
            );
        }
        None => {
            return problem(
                StatusCode::FORBIDDEN,
                "The caller's address is unknown: only a trusted proxy may describe a request to /v1/forward-auth.",
            );
        }
    }
    if let Err(detail) = described(&mut parts) {
        return problem(StatusCode::BAD_REQUEST, detail);
    }
    if let Err(detail) = sanitize_hooked(&mut parts, loaded.config.proxy, policy) {
        // The detail speaks of the request (its Host, its target): say
        // where they came from.
        return problem(
            StatusCode::BAD_REQUEST,
            format!(
                "The request described by X-Forwarded-Method, X-Forwarded-Uri and X-Forwarded-Host is refused: {detail}"
            ),
        );
    }
    parts.extensions.insert(state.held.clone());
    // The request is served by the proxy, which never says when it ends:
    // a concurrency rule cannot hold a slot for it here, and does not
    // apply (rather than count hook calls in flight).
    parts.extensions.insert(spillway_tower::NotServed);
    let limited = loaded.layer.layer(tower::service_fn(admit));
    match limited.oneshot(Request::from_parts(parts, ())).await {
        Ok(res) => res.map(Body::new),
        Err(never) => match never {},
    }
}

/// The inner service: the request may pass.
async fn admit(_: http::Request<()>) -> Result<http::Response<Empty<Bytes>>, Infallible> {
    Ok(http::Response::new(Empty::new()))
}

/// Makes `parts` the original request the `X-Forwarded-*` headers
/// describe: its method, target and `Host` (the headers that described
/// them go). `Err` names the header that is missing, repeated or
/// malformed.
fn described(parts: &mut http::request::Parts) -> Result<(), String> {
    let headers = &mut parts.headers;
    let method = one(
        headers,
        &X_FORWARDED_METHOD,
        "X-Forwarded-Method",
        "the original request's method",
    )?;
    let method = Method::from_bytes(method.as_bytes())
        .map_err(|_| "`X-Forwarded-Method` is not an HTTP method.".to_string())?;
    let target = one(
        headers,
        &X_FORWARDED_URI,
        "X-Forwarded-Uri",
        "the original request's target",
    )?;
    let uri = Uri::try_from(target.as_bytes())
        .ok()
        .filter(|uri| {
            // Origin form (`/path?query`) or absolute form (`http://host/path`).
            uri.path().starts_with('/') || (uri.scheme().is_some() && uri.authority().is_some())
        })
        .ok_or("`X-Forwarded-Uri` is not a request target (`/path?query`).")?;
    let host = one(
        headers,
        &X_FORWARDED_HOST,
        "X-Forwarded-Host",
        "the original request's host",
    )?;
    headers.remove(X_FORWARDED_METHOD);
    headers.remove(X_FORWARDED_URI);
    headers.remove(X_FORWARDED_HOST);
    headers.insert(http::header::HOST, host);
    parts.method = method;
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    Ok(())
}

/// The one value of `name` (`shown` in messages): a request described
/// twice is described by nobody it can trust (a proxy that appends rather
/// than replaces, after a client's own).
fn one(
    headers: &HeaderMap,
    name: &HeaderName,
    shown: &str,
    what: &str,
) -> Result<HeaderValue, String> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(value), None) => Ok(value.clone()),
        (None, _) => Err(format!(
            "`{shown}` is missing: the proxy must send {what} (see docs/integrations.md)."
        )),
        (Some(_), Some(_)) => Err(format!(
            "`{shown}` is sent more than once: the proxy must replace the client's, not add to it."
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deny_status_is_401_or_403() {
        assert_eq!(deny_status(None), Ok(None));
        assert_eq!(deny_status(Some("")), Ok(None));
        assert_eq!(
            deny_status(Some("deny_status=403")),
            Ok(Some(StatusCode::FORBIDDEN))
        );
        assert_eq!(
            deny_status(Some("deny_status=401")),
            Ok(Some(StatusCode::UNAUTHORIZED))
        );
        assert!(
            deny_status(Some("deny_status=429"))
                .unwrap_err()
                .contains("401 or 403")
        );
        assert!(
            deny_status(Some("status=403"))
                .unwrap_err()
                .contains("`status=403`")
        );
    }
}

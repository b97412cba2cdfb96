//! What the admin API's run-time tables (`/admin/overrides`,
//! `/admin/tiers`) share: times, refusals, what is kept of who made a
//! change.

use std::time::Duration;

use axum::extract::Query;
use axum::extract::rejection::QueryRejection;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::json;

use super::admin::Caller;
use super::answer::{problem, read_body, unavailable};

/// The most entries one page of a listing holds.
pub(super) const MAX_PAGE: usize = 1000;

/// The longest `reason`.
const MAX_REASON: usize = 500;

/// The longest an entry may last from now.
const LONGEST_TTL: Duration = Duration::from_secs(10 * 366 * 86_400);

/// An answer that is not the one asked for: an error's response.
pub(super) type Refused = Box<Response>;

pub(super) fn bad(detail: impl Into<String>) -> Refused {
    Box::new(problem(StatusCode::BAD_REQUEST, detail))
}

pub(super) fn store_failed(e: impl std::fmt::Display) -> Refused {
    Box::new(unavailable(format!("The store could not answer: {e}.")).into_response())
}

/// The wall clock, in µs since the Unix epoch.
pub(super) fn wall_micros() -> u64 {
    spillway::clock::Clock::now(&spillway::clock::SystemClock)
}

/// `micros` since the Unix epoch as RFC 3339, UTC.
pub(super) fn rfc3339(micros: u64) -> String {
    let secs = i64::try_from(micros / 1_000_000).unwrap_or(i64::MAX);
    let nanos = u32::try_from(micros % 1_000_000 * 1000).unwrap_or(0);
    chrono::DateTime::from_timestamp(secs, nanos).map_or_else(
        || micros.to_string(),
        |t| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
    )
}

/// When an entry ends (µs), from its body's `until` (RFC 3339) or `ttl`
/// (a duration from `now`); `None`: until removed.
pub(super) fn until_of(
    until: Option<&str>,
    ttl: Option<&str>,
    now: u64,
) -> Result<Option<u64>, Refused> {
    match (until, ttl) {
        (Some(_), Some(_)) => Err(bad(
            "`until` and `ttl`: say when it ends one way, not both.",
        )),
        (Some(until), None) => {
            let t = chrono::DateTime::parse_from_rfc3339(until).map_err(|e| {
                bad(format!(
                    "`until` must be a time like 2026-12-31T23:59:59Z (RFC 3339): {e}."
                ))
            })?;
            let micros = u64::try_from(t.timestamp_micros()).unwrap_or(0);
            if micros <= now {
                return Err(bad(format!("`until` ({until}) has passed.")));
            }
            if Duration::from_micros(micros - now) > LONGEST_TTL {
                return Err(bad("`until` is more than ten years away."));
            }
            Ok(Some(micros))
        }
        (None, Some(ttl)) => {
            let d = crate::config::parse_duration(ttl).map_err(|m| bad(format!("`ttl`: {m}.")))?;
            if d.is_zero() || d > LONGEST_TTL {
                return Err(bad("`ttl` must be longer than zero and at most ten years."));
            }
            Ok(Some(now.saturating_add(
                u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            )))
        }
        (None, None) => Ok(None),
    }
}

/// What is kept of a change beside its entry: why, who, when (JSON).
pub(super) fn spec_of(
    reason: Option<&str>,
    caller: &Caller,
    now: u64,
) -> Result<std::sync::Arc<str>, Refused> {
    if reason.is_some_and(|r| r.chars().count() > MAX_REASON) {
        return Err(bad(format!(
            "`reason` is longer than {MAX_REASON} characters."
        )));
    }
    let spec = json!({
        "reason": reason,
        "set_by": &*caller.name,
        "set_at": rfc3339(now),
    });
    Ok(spec.to_string().into())
}

/// What a write may do: `POST` sets only what does not exist yet, `PUT`
/// sets or replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Write {
    Create,
    Replace,
}

impl Write {
    /// The status of a write that found `before` in force: 409 for a
    /// `POST` over one; 200 when it replaced one, 201 when it set one.
    pub(super) fn status(self, before: bool) -> Result<StatusCode, Refused> {
        match (self, before) {
            (Self::Create, true) => Err(Box::new(problem(
                StatusCode::CONFLICT,
                "One exists for this: PUT replaces it.",
            ))),
            (_, true) => Ok(StatusCode::OK),
            (_, false) => Ok(StatusCode::CREATED),
        }
    }
}

/// The answer of `handle` to a request's body, read whole (413 past the
/// limit).
pub(super) async fn on_body<Fut>(
    req: axum::extract::Request,
    handle: impl FnOnce(axum::body::Bytes) -> Fut,
) -> Response
where
    Fut: Future<Output = Result<Response, Refused>>,
{
    match read_body(req.into_body()).await {
        Ok(body) => handle(body).await.unwrap_or_else(|r| *r),
        Err(response) => response,
    }
}

/// The answer of `handle` to a request's query (400 when it is not one
/// the endpoint takes).
pub(super) async fn on_query<Q, Fut>(
    query: Result<Query<Q>, QueryRejection>,
    handle: impl FnOnce(Q) -> Fut,
) -> Response
where
    Fut: Future<Output = Result<Response, Refused>>,
{
    match query {
        Ok(Query(q)) => handle(q).await.unwrap_or_else(|r| *r),
        Err(rejection) => problem(StatusCode::BAD_REQUEST, rejection.body_text()),
    }
}

/// An entry stored under another spelling of an API key (as a bearer token
/// or a Basic credential read it): its spec names the key it was set for.
pub(super) fn alias_of(spec: &str) -> Option<String> {
    let spec: serde_json::Value = serde_json::from_str(spec).ok()?;
    spec.get("alias_of")?.as_str().map(str::to_string)
}

/// Refuses a change made through another spelling of a key: it would
/// change one spelling and leave the others.
pub(super) fn not_an_alias(spec: Option<&str>) -> Result<(), Refused> {
    match spec.and_then(alias_of) {
        Some(key) => Err(bad(format!(
            "`api_key`: this is how a token spells `{key}`, set as such: name `{key}`."
        ))),
        None => Ok(()),
    }
}

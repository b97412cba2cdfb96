//! The rate-limit headers: `X-RateLimit-*` and the IETF draft fields
//! `RateLimit-Policy` and `RateLimit`, serialized as structured fields
//! (RFC 9651) with the `sfv` crate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};
use sfv::{KeyRef, ListSerializer, StringRef};
use spillway::Decision;

use crate::rules::{HeaderOptions, ResetFormat};

/// `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Whole seconds, rounded up: a client that waits this long is never early.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// One rule's part in the headers.
#[derive(Debug, Clone)]
pub(crate) struct Applied<'a> {
    pub name: &'a str,
    pub decision: Decision,
    // The policy's window in seconds: the time the quota takes to refill.
    pub window_secs: u64,
}

/// Structured-field names must be strings of printable ASCII; rule names
/// are, but keep the header valid whatever they are.
fn sf_string(name: &str) -> String {
    name.chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
        .collect()
}

/// Writes the headers for the rules that applied; `restrictive` is the one
/// `X-RateLimit-*` and `RateLimit` describe.
pub(crate) fn write(
    headers: &mut HeaderMap,
    options: &HeaderOptions,
    applied: &[Applied<'_>],
    restrictive: usize,
) {
    let Some(main) = applied.get(restrictive) else {
        return;
    };
    let d = &main.decision;
    if options.legacy {
        headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(d.limit));
        headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(d.remaining));
        let reset = match options.reset {
            ResetFormat::Delta => ceil_secs(d.reset_after),
            ResetFormat::Unix => {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                ceil_secs(now + d.reset_after)
            }
        };
        headers.insert(X_RATELIMIT_RESET, HeaderValue::from(reset));
    }
    if options.ietf {
        let mut policy = ListSerializer::new();
        for a in applied {
            let name = sf_string(a.name);
            let Ok(name) = StringRef::from_str(&name) else {
                continue;
            };
            policy
                .bare_item(name)
                .parameter(key("q"), sf_int(a.decision.limit))
                .parameter(key("w"), sf_int(a.window_secs));
        }
        if let Some(v) = policy.finish().and_then(|s| HeaderValue::try_from(s).ok()) {
            headers.insert(RATELIMIT_POLICY, v);
        }
        let name = sf_string(main.name);
        if let Ok(name) = StringRef::from_str(&name) {
            let mut current = ListSerializer::new();
            current
                .bare_item(name)
                .parameter(key("r"), sf_int(d.remaining))
                .parameter(key("t"), sf_int(ceil_secs(d.reset_after)));
            if let Some(v) = current.finish().and_then(|s| HeaderValue::try_from(s).ok()) {
                headers.insert(RATELIMIT, v);
            }
        }
    }
}

/// The rate-limit headers for decisions taken outside the middleware (the
/// Envoy rate limit service): one `(rule name, decision, window)` per rule
/// that decided, where the window is the time the rule's quota takes to
/// refill; `restrictive` indexes the one `X-RateLimit-*` and `RateLimit`
/// describe. The same values the middleware writes.
///
/// ```
/// use std::time::Duration;
/// use spillway::Decision;
/// use spillway_tower::HeaderOptions;
/// use spillway_tower::headers::{RATELIMIT, X_RATELIMIT_REMAINING, rate_limit_headers};
///
/// let decision = Decision {
///     allowed: true,
///     limit: 10,
///     remaining: 7,
///     reset_after: Duration::from_secs(30),
///     retry_after: None,
///     delay: Duration::ZERO,
/// };
/// let map = rate_limit_headers(
///     &HeaderOptions::default(),
///     &[("per-ip", decision, Duration::from_secs(60))],
///     0,
/// );
/// assert_eq!(map[X_RATELIMIT_REMAINING], "7");
/// assert_eq!(map[RATELIMIT], "\"per-ip\";r=7;t=30");
/// ```
pub fn rate_limit_headers(
    options: &HeaderOptions,
    decided: &[(&str, Decision, Duration)],
    restrictive: usize,
) -> HeaderMap {
    let applied: Vec<Applied<'_>> = decided
        .iter()
        .map(|(name, decision, window)| Applied {
            name,
            decision: *decision,
            window_secs: ceil_secs(*window),
        })
        .collect();
    let mut map = HeaderMap::new();
    write(&mut map, options, &applied, restrictive);
    map
}

fn key(k: &'static str) -> &'static KeyRef {
    KeyRef::constant(k)
}

/// Structured-field integers have at most 15 digits.
fn sf_int(v: u64) -> sfv::Integer {
    let v = i64::try_from(v.min(999_999_999_999_999)).unwrap_or(0);
    sfv::Integer::try_from(v).unwrap_or(sfv::integer(0))
}

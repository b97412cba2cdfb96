//! `application/problem+json` bodies (RFC 9457): the one builder every
//! answer Spillway writes itself uses, the middleware's 429 and errors as
//! the service's.

use http::StatusCode;
use serde_json::{Map, Value};

/// The media type of a problem body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// A problem body: `type`, `title`, `status` and `detail`, and any
/// extension members (written in name order).
///
/// ```
/// use http::StatusCode;
/// use spillway_tower::problem::Problem;
///
/// let body = Problem::new(StatusCode::BAD_REQUEST, "`key` must not be empty.").into_json();
/// assert_eq!(
///     body,
///     r#"{"detail":"`key` must not be empty.","status":400,"title":"Bad Request","type":"about:blank"}"#
/// );
/// ```
#[derive(Debug, Clone)]
pub struct Problem {
    members: Map<String, Value>,
}

impl Problem {
    /// A problem of type `about:blank`: the status's reason is its title.
    pub fn new(status: StatusCode, detail: &str) -> Self {
        let mut members = Map::new();
        members.insert("type".into(), "about:blank".into());
        members.insert(
            "title".into(),
            status.canonical_reason().unwrap_or("Error").into(),
        );
        members.insert("status".into(), status.as_u16().into());
        members.insert("detail".into(), detail.into());
        Self { members }
    }

    /// The problem's type (a URI) and title, in place of `about:blank`'s.
    pub fn kind(mut self, uri: &str, title: &str) -> Self {
        self.members.insert("type".into(), uri.into());
        self.members.insert("title".into(), title.into());
        self
    }

    /// Adds an extension member.
    pub fn member(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.members.insert(name.into(), value.into());
        self
    }

    /// The body.
    pub fn into_json(self) -> String {
        Value::Object(self.members).to_string()
    }
}

//! The proxy's errors: a bad upstream address at start, and the reasons a
//! request could not be forwarded, each answered with one status.

use std::error::Error as StdError;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

use super::ProxyBody;

/// A boxed error, as hyper and tower pass them.
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// The upstream URL cannot be proxied to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid upstream `{uri}`: {reason}")]
pub struct InvalidUpstream {
    /// The URL as given.
    pub uri: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Why a request could not be forwarded. Each maps to one status, answered
/// with a problem+json body that names no upstream detail (those go to the
/// log).
///
/// ```
/// use std::time::Duration;
/// use http::StatusCode;
/// use spillway_server::proxy::ForwardError;
///
/// let timeout = ForwardError::ConnectTimeout(Duration::from_secs(5));
/// assert_eq!(timeout.status(), StatusCode::GATEWAY_TIMEOUT);
/// let res = timeout.into_response();
/// assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
/// assert_eq!(res.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The upstream refused the connection, reset it, or sent something
    /// that is not HTTP: `502 Bad Gateway`.
    #[error("upstream request failed: {}", chain(.0.as_ref()))]
    Unreachable(BoxError),
    /// No connection to the upstream within the connect timeout:
    /// `504 Gateway Timeout`.
    #[error("no connection to the upstream within {0:?}")]
    ConnectTimeout(Duration),
    /// No response head from the upstream within the response timeout:
    /// `504 Gateway Timeout`.
    #[error("no response from the upstream within {0:?}")]
    ResponseTimeout(Duration),
    /// Every upstream connection the pool may open is in use, and none
    /// came free within the wait: `503 Service Unavailable`, with
    /// `Retry-After: 1`.
    #[error("no upstream connection free within {0:?}")]
    Busy(Duration),
    /// A method the proxy does not forward (`CONNECT`: it does not open
    /// tunnels): `501 Not Implemented`.
    #[error("method {0} is not forwarded")]
    Unsupported(http::Method),
    /// A request the proxy will not forward as it came (a framing it
    /// cannot pass on unambiguously, a body that broke while it was read):
    /// `400 Bad Request`.
    #[error("bad request: {0}")]
    BadRequest(&'static str),
}

impl ForwardError {
    /// Classifies the HTTP client's error: a connect timeout or no free
    /// connection (which the connectors report as [`ConnectTimedOut`] or
    /// [`NoSlot`] somewhere in the chain of sources) or anything else.
    pub(crate) fn from_client(error: hyper_util::client::legacy::Error) -> Self {
        let mut source: Option<&(dyn StdError + 'static)> = Some(&error);
        while let Some(e) = source {
            if let Some(t) = e.downcast_ref::<ConnectTimedOut>() {
                return Self::ConnectTimeout(t.0);
            }
            if let Some(busy) = e.downcast_ref::<NoSlot>() {
                return Self::Busy(busy.0);
            }
            source = e.source();
        }
        Self::Unreachable(Box::new(error))
    }

    /// The status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unreachable(_) => StatusCode::BAD_GATEWAY,
            Self::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::ConnectTimeout(_) | Self::ResponseTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::Unsupported(_) => StatusCode::NOT_IMPLEMENTED,
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
        }
    }

    /// The response: the status and a problem+json body (RFC 9457).
    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.status();
        let body = self.problem_json();
        let mut res = Response::new(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed_unsync(),
        );
        *res.status_mut() = status;
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Self::Busy(_) = self {
            // A connection comes free as soon as a request ends.
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Self::ResponseTimeout(_) | Self::Unreachable(_) = self {
            // The request may have reached the upstream, which may have
            // worked on it: a budget must not give its reservation back.
            res.extensions_mut()
                .insert(spillway_tower::budget::Unanswered);
        }
        res
    }

    /// The problem+json body (RFC 9457) of the response.
    pub(crate) fn problem_json(&self) -> String {
        let status = self.status();
        let detail = match self {
            Self::Unreachable(_) => "The upstream service could not be reached.".to_string(),
            Self::ConnectTimeout(_) => {
                "The upstream service did not accept a connection in time.".to_string()
            }
            Self::ResponseTimeout(_) => "The upstream service did not answer in time.".to_string(),
            Self::Busy(_) => {
                "Every connection to the upstream service is in use; try again.".to_string()
            }
            Self::Unsupported(method) => format!("This proxy does not forward {method} requests."),
            Self::BadRequest(why) => (*why).to_string(),
        };
        spillway_tower::problem::Problem::new(status, &detail).into_json()
    }
}

/// An error and its sources, `": "`-separated: hyper's errors say little at
/// the top (`client error (Connect)`) and the cause below.
fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}

/// The connector's error when the connect timeout passes; found again in
/// the client's error to answer 504 rather than 502.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("connecting took longer than {0:?}")]
pub(crate) struct ConnectTimedOut(pub(crate) Duration);

/// The capped connector's error when no connection came free within the
/// wait; found again in the client's error to answer 503.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("no upstream connection came free within {0:?}")]
pub(crate) struct NoSlot(pub(crate) Duration);

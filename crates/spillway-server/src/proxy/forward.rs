//! [`Forward`]: the innermost service, which rewrites a request for the
//! upstream, sends it with the pooled client and passes the response back.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, Uri, Version};
use http_body::Body;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use spillway_tower::ClientAddr;
use tower::Service;

use super::connect::TimeoutConnector;
use super::error::{BoxError, ForwardError, InvalidUpstream};
use super::headers::{self, X_FORWARDED_HOST, X_FORWARDED_PROTO};
use super::{Connector, HostHeader, ProxyBody};

/// Marks a request whose peer is a trusted proxy (set by the proxy service
/// from the policy's `trusted_proxies`): its forwarded scheme and host are
/// kept.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TrustedPeer;

/// Where requests go: the upstream's scheme and authority.
#[derive(Debug)]
pub(crate) struct Upstream {
    scheme: Scheme,
    authority: Authority,
    // The `Host` for `HostHeader::Upstream`, and for requests without one.
    host: HeaderValue,
}

impl Upstream {
    /// Checks that `uri` is a base URL this proxy can forward to:
    /// `http://host[:port]`, optionally with a `/`.
    pub(crate) fn parse(uri: &Uri) -> Result<Self, InvalidUpstream> {
        let invalid = |reason| InvalidUpstream {
            uri: uri.to_string(),
            reason,
        };
        let scheme = match uri.scheme() {
            Some(s) if *s == Scheme::HTTP => Scheme::HTTP,
            Some(s) if *s == Scheme::HTTPS => {
                return Err(invalid(
                    "https upstreams are not supported: the proxy speaks plain HTTP to its upstream",
                ));
            }
            _ => return Err(invalid("expected a URL like http://127.0.0.1:9000")),
        };
        let Some(authority) = uri.authority().cloned() else {
            return Err(invalid("expected a URL like http://127.0.0.1:9000"));
        };
        if authority.as_str().contains('@') {
            return Err(invalid("credentials in the upstream URL are not supported"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(invalid(
                "a path or query in the upstream URL is not supported: requests keep their own",
            ));
        }
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|_| invalid("the host is not a valid Host header"))?;
        Ok(Self {
            scheme,
            authority,
            host,
        })
    }

    /// The upstream's URI for a request to `uri`: the upstream's scheme and
    /// authority, the request's path and query.
    fn uri_for(&self, uri: &Uri) -> Uri {
        let path = uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
            .expect("a valid scheme, authority and path make a valid URI")
    }

    /// `host:port` (the port may be implied), to connect to.
    pub(crate) fn authority(&self) -> &Authority {
        &self.authority
    }

    /// `http://host:port`, for logs.
    pub(crate) fn base(&self) -> String {
        format!("{}://{}", self.scheme, self.authority)
    }
}

/// Sends requests to the upstream. Always ready: the client queues
/// requests on its pool itself.
pub(crate) struct Forward<C> {
    pub(crate) client: Client<TimeoutConnector<C>, ProxyBody>,
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) response_timeout: Duration,
    pub(crate) host: HostHeader,
}

impl<C: Clone> Clone for Forward<C> {
    fn clone(&self) -> Self {
        Self {
            client: self.client.clone(),
            upstream: self.upstream.clone(),
            response_timeout: self.response_timeout,
            host: self.host,
        }
    }
}

impl<C, B> Service<Request<B>> for Forward<C>
where
    C: Connector,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        if parts.method == Method::CONNECT {
            let refused = ForwardError::Unsupported(parts.method).into_response();
            return Box::pin(async move { Ok(refused) });
        }

        let hop = parts
            .extensions
            .get::<ClientAddr>()
            .map(|ClientAddr(peer)| headers::hop_of(peer.ip()));
        rewrite_head(&self.upstream, self.host, &mut parts, hop.as_ref());
        parts.uri = self.upstream.uri_for(&parts.uri);
        // The client speaks HTTP/1.1 to the upstream, whatever the client
        // spoke to the proxy.
        parts.version = Version::HTTP_11;

        let req = Request::from_parts(parts, body.map_err(Into::into).boxed_unsync());
        let sending = self.client.request(req);
        let timeout = self.response_timeout;
        let upstream = self.upstream.clone();
        Box::pin(async move {
            let error = match tokio::time::timeout(timeout, sending).await {
                Ok(Ok(res)) => {
                    let (mut parts, body) = res.into_parts();
                    headers::remove_hop_by_hop(&mut parts.headers);
                    parts.version = Version::default();
                    let body = body.map_err(BoxError::from).boxed_unsync();
                    return Ok(Response::from_parts(parts, body));
                }
                Ok(Err(e)) => ForwardError::from_client(e),
                Err(_) => ForwardError::ResponseTimeout(timeout),
            };
            tracing::warn!(upstream = %upstream.base(), error = %error, "could not forward a request");
            Ok(error.into_response())
        })
    }
}

/// Rewrites a request's head for the upstream (all but its URI and
/// version): hop-by-hop headers go, `X-Forwarded-For` gets the peer's
/// `hop` (see [`headers::hop_of`]), `X-Forwarded-Proto` and
/// `X-Forwarded-Host` are set unless a trusted proxy in front set them, and
/// `Host` is as `host` says.
pub(crate) fn rewrite_head(
    upstream: &Upstream,
    host: HostHeader,
    parts: &mut http::request::Parts,
    hop: Option<&HeaderValue>,
) {
    // The host the client asked for, before anything changes it: the
    // `Host` header (HTTP/1.1) or the URI's authority (HTTP/2).
    let asked_host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    headers::remove_hop_by_hop(&mut parts.headers);
    if parts.version == Version::HTTP_2 {
        headers::join_cookies(&mut parts.headers);
    }
    if let Some(hop) = hop {
        headers::append_hop(&mut parts.headers, hop);
    }
    // A trusted proxy in front said what the client used; otherwise this
    // proxy listens on plain HTTP, so that is what the client used.
    let trusted = parts.extensions.get::<TrustedPeer>().is_some();
    if !(trusted && parts.headers.contains_key(&X_FORWARDED_PROTO)) {
        parts
            .headers
            .insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    if !(trusted && parts.headers.contains_key(&X_FORWARDED_HOST)) {
        match &asked_host {
            Some(host) => parts.headers.insert(X_FORWARDED_HOST, host.clone()),
            None => parts.headers.remove(X_FORWARDED_HOST),
        };
    }
    let host = match (host, asked_host) {
        (HostHeader::Keep, Some(asked)) => asked,
        (HostHeader::Keep, None) | (HostHeader::Upstream, _) => upstream.host.clone(),
    };
    parts.headers.insert(header::HOST, host);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Upstream, &'static str> {
        Upstream::parse(&s.parse().unwrap()).map_err(|e| e.reason)
    }

    #[test]
    fn an_upstream_is_an_http_base_url() {
        let up = parse("http://127.0.0.1:9000").unwrap();
        assert_eq!(up.base(), "http://127.0.0.1:9000");
        assert_eq!(up.host, "127.0.0.1:9000");
        assert!(parse("http://backend/").is_ok());
        assert!(parse("https://backend").unwrap_err().contains("https"));
        assert!(parse("127.0.0.1:9000").is_err());
        assert!(parse("/path").is_err());
        assert!(parse("http://backend/api").unwrap_err().contains("path"));
        assert!(parse("http://backend/?a=1").unwrap_err().contains("query"));
        assert!(
            parse("http://user:pw@backend")
                .unwrap_err()
                .contains("credentials")
        );
    }

    #[test]
    fn the_request_keeps_its_path_and_query() {
        let up = parse("http://10.0.0.1:9000").unwrap();
        let uri = |s: &str| up.uri_for(&s.parse().unwrap()).to_string();
        assert_eq!(uri("/a/b?c=1&d"), "http://10.0.0.1:9000/a/b?c=1&d");
        assert_eq!(uri("http://other.example/x?y"), "http://10.0.0.1:9000/x?y");
        assert_eq!(uri("other.example:443"), "http://10.0.0.1:9000/");
    }
}

//! [`Forward`]: the innermost service, which rewrites a request for the
//! upstream, sends it (on the client connection's own upstream connections,
//! or with the pooled client) and passes the response back.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use spillway_tower::{ClientAddr, OtherPaths};
use tower::Service;

use super::connect::{Capped, TimeoutConnector};
use super::error::{BoxError, ForwardError, InvalidUpstream};
use super::headers::{self, X_FORWARDED_HOST, X_FORWARDED_PROTO};
use super::target;
use super::upstream::OwnUpstream;
use super::{Connector, HostHeader, ProxyBody};
use crate::config::Normalize;
use crate::http1::wire::RawHead;

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
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(origin_form(uri))
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

/// How the framing of a request's body was given, found before the rules
/// ran (the framing headers are then removed: the proxy writes its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framed {
    /// `Transfer-Encoding: chunked` (HTTP/1.1).
    Chunked,
    /// A `Content-Length`.
    Length,
    /// Neither: in HTTP/1.1 no body; in HTTP/2 the stream's DATA frames.
    Unframed,
}

/// Makes a request head what both the rules and the upstream will see,
/// before any rule runs: the target is normalized (see
/// [`target`](super::target)), hop-by-hop headers go (and those `Connection`
/// names, but never the framing or forwarding ones), the degrade marker a
/// client may have sent goes, and the framing is checked. A
/// `Transfer-Encoding` other than a lone `chunked` is refused: the proxy
/// forwards bodies decoded and framed again, and a body coded otherwise
/// (`gzip, chunked`) would reach the upstream as something else.
pub(crate) fn sanitize(
    parts: &mut http::request::Parts,
    normalize: Normalize,
    policy: &spillway_tower::Policy,
) -> Result<(), ForwardError> {
    target::normalize(parts, normalize)?;
    let mut codings = parts.headers.get_all(header::TRANSFER_ENCODING).iter();
    let framed = match (codings.next(), codings.next()) {
        (None, _) => {
            if parts.headers.contains_key(header::CONTENT_LENGTH) {
                Framed::Length
            } else {
                Framed::Unframed
            }
        }
        (Some(coding), None)
            if coding
                .as_bytes()
                .trim_ascii()
                .eq_ignore_ascii_case(b"chunked") =>
        {
            Framed::Chunked
        }
        _ => {
            return Err(ForwardError::BadRequest(
                "A Transfer-Encoding other than chunked is not accepted.",
            ));
        }
    };
    // Without one, a request has no body (HTTP/1.1) or the stream's (HTTP/2):
    // most requests need no extension, whose first costs an allocation.
    if framed != Framed::Unframed {
        parts.extensions.insert(framed);
    }
    headers::remove_hop_by_hop(&mut parts.headers);
    headers::remove_misleading(&mut parts.headers, normalize.underscores_in_headers, || {
        policy.headers_read()
    });
    parts.headers.remove(spillway_tower::X_SPILLWAY_LIMITED);
    Ok(())
}

/// Makes the head of a request that another proxy forwards itself (the
/// forward-auth hook of `spillway serve`) what the rules decide on. The
/// target and `Host` are normalized as [`sanitize`] does: the rules match
/// the normalized reading, while the other proxy forwards the target as it
/// came, and normalization only folds spellings onto the path routers take
/// them for. What [`sanitize`] would remove from what the upstream receives
/// (a routing header, a header whose `_` folds onto one the rules read) the
/// hook cannot remove, so the request is refused instead. The hook's own
/// hop-by-hop and framing headers go: they describe its connection, not the
/// client's. `Err` is a 400's detail.
pub(crate) fn sanitize_hooked(
    parts: &mut http::request::Parts,
    normalize: Normalize,
    policy: &spillway_tower::Policy,
) -> Result<(), String> {
    let raw = parts.uri.path().to_owned();
    target::normalize(parts, normalize).map_err(|e| match e {
        ForwardError::BadRequest(why) => why.to_string(),
        other => other.to_string(),
    })?;
    // The upstream receives the raw target, which some routers read
    // otherwise than the normalized one: the rules count every reading.
    let readings = target::raw_readings(&raw, normalize);
    let normalized = parts.uri.path();
    let readings: Vec<String> = readings.into_iter().filter(|r| r != normalized).collect();
    if !readings.is_empty() {
        let mut other = parts.extensions.remove::<OtherPaths>().unwrap_or_default();
        for reading in readings {
            if !other.0.contains(&reading) {
                other.0.push(reading);
            }
        }
        parts.extensions.insert(other);
    }
    if let Some(name) = headers::misleading(&parts.headers, || policy.headers_read()) {
        return Err(format!(
            "The forwarded request carries `{name}`, which some upstreams read instead of \
             what the rules match; have the proxy drop it (see docs/integrations.md)."
        ));
    }
    headers::remove_hop_by_hop(&mut parts.headers);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(spillway_tower::X_SPILLWAY_LIMITED);
    Ok(())
}

/// A request target's path and query (`/` if it has none).
fn origin_form(uri: &Uri) -> PathAndQuery {
    uri.path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"))
}

/// Sends requests to the upstream. Always ready: the pooled client queues
/// requests on its pool itself, a connection's own upstream connections
/// take them as they come.
pub(crate) struct Forward<C> {
    pub(crate) send: Sender<C>,
    /// How request targets are normalized (by [`sanitize`], before the
    /// rules run).
    pub(crate) normalize: Normalize,
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) response_timeout: Duration,
    pub(crate) host: HostHeader,
}

/// How a [`Forward`] reaches the upstream.
pub(crate) enum Sender<C> {
    /// hyper-util's pooled client (a proxy made with a custom connector,
    /// or used as a tower service); in an `Arc`, as a `Forward` is cloned
    /// for every request.
    Pooled(Arc<Client<Capped<TimeoutConnector<C>>, ProxyBody>>),
    /// One client connection's own upstream connections (see
    /// [`relay`](super::relay)).
    Own(Arc<OwnUpstream>),
}

impl<C: Clone> Clone for Sender<C> {
    fn clone(&self) -> Self {
        match self {
            Self::Pooled(client) => Self::Pooled(client.clone()),
            Self::Own(own) => Self::Own(own.clone()),
        }
    }
}

impl<C: Clone> Clone for Forward<C> {
    fn clone(&self) -> Self {
        Self {
            send: self.send.clone(),
            normalize: self.normalize,
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

        // A connection's own upstream serves one peer: its hop is written
        // once, not for every request.
        let hop = match &self.send {
            Sender::Own(own) => Some(own.hop.clone()),
            Sender::Pooled(_) => parts
                .extensions
                .get::<ClientAddr>()
                .map(|ClientAddr(peer)| headers::Hop::of(peer.ip())),
        };
        rewrite_head(&self.upstream, self.host, &mut parts, hop.as_ref());
        frame(&mut parts, &body);
        parts.uri = match &self.send {
            Sender::Pooled(_) => self.upstream.uri_for(&parts.uri),
            // On a connection of its own, a request goes in origin form.
            Sender::Own(_) => Uri::from(origin_form(&parts.uri)),
        };
        // The client speaks HTTP/1.1 to the upstream, whatever the client
        // spoke to the proxy.
        parts.version = Version::HTTP_11;

        // A body that is over cannot break: no watch (and a body of no
        // size, whose box allocates nothing).
        let (body, failed) = if body.is_end_stream() {
            let none = Empty::new().map_err(|never| match never {});
            (none.boxed_unsync(), None)
        } else {
            let failed = Arc::new(AtomicBool::new(false));
            let body = Watched {
                inner: body,
                failed: failed.clone(),
            };
            (body.boxed_unsync(), Some(failed))
        };
        let req = Request::from_parts(parts, body);
        let send = self.send.clone();
        let timeout = self.response_timeout;
        let upstream = self.upstream.clone();
        Box::pin(async move {
            let answered = match send {
                Sender::Pooled(client) => {
                    let sending = client.request(req);
                    let answered = tokio::time::timeout(timeout, sending).await.ok();
                    answered.map(|res| {
                        res.map(|res| res.map(|body| body.map_err(BoxError::from).boxed_unsync()))
                            .map_err(ForwardError::from_client)
                    })
                }
                // HTTP/2: requests at once, a timer each.
                Sender::Own(own) if own.is_shared() => {
                    tokio::time::timeout(timeout, own.send(req)).await.ok()
                }
                // HTTP/1.1: the connection's one timer, moved to this
                // request's time.
                Sender::Own(own) => {
                    let at = tokio::time::Instant::now() + timeout;
                    own.response.within(at, own.send(req)).await
                }
            };
            let error = match answered {
                Some(Ok(res)) if res.status() == StatusCode::SWITCHING_PROTOCOLS => {
                    // `Upgrade` is never forwarded: an upstream that switches
                    // anyway would speak something else on this connection.
                    ForwardError::Unreachable("the upstream switched protocols unasked".into())
                }
                Some(Ok(res)) => {
                    let (mut parts, body) = res.into_parts();
                    headers::remove_hop_by_hop(&mut parts.headers);
                    headers::one_content_length(&mut parts.headers);
                    if let Some(raw) = parts.extensions.get_mut::<RawHead>() {
                        headers::keep_end_to_end(raw);
                    }
                    parts.version = Version::default();
                    return Ok(Response::from_parts(parts, body));
                }
                // The client's body broke (bad chunk, cut short): the
                // client's fault, not the upstream's.
                Some(Err(_)) if failed.is_some_and(|f| f.load(Ordering::Relaxed)) => {
                    ForwardError::BadRequest("The request body could not be read.")
                }
                Some(Err(e)) => e,
                None => ForwardError::ResponseTimeout(timeout),
            };
            tracing::warn!(upstream = %upstream.base(), error = %error, "could not forward a request");
            Ok(error.into_response())
        })
    }
}

/// Writes the framing of the request the upstream gets: the proxy's own,
/// from what it parsed ([`Framed`], and the body's known length), never the
/// client's framing headers, which are removed.
fn frame<B: Body>(parts: &mut http::request::Parts, body: &B) {
    let framed = parts
        .extensions
        .get::<Framed>()
        .copied()
        .unwrap_or(Framed::Unframed);
    let headers = &mut parts.headers;
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::TRANSFER_ENCODING);
    let length = body.size_hint().exact();
    match (framed, length) {
        (Framed::Chunked, _) => {
            headers.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
        (Framed::Length, Some(n)) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        (_, Some(0)) | (Framed::Unframed, _) if body.is_end_stream() => {}
        (_, Some(n)) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        (_, None) => {
            headers.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
    }
}

pin_project_lite::pin_project! {
    /// A request body that records whether it failed, to tell a client's
    /// broken body (400) from an upstream's failure (502).
    struct Watched<B> {
        #[pin]
        inner: B,
        failed: Arc<AtomicBool>,
    }
}

impl<B> Body for Watched<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => {
                this.failed.store(true, Ordering::Relaxed);
                Poll::Ready(Some(Err(e.into())))
            }
            other => other.map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Rewrites a request's head for the upstream (all but its URI, version
/// and framing), after the rules ran on the [`sanitize`]d head:
/// `X-Forwarded-For` gets the peer's `hop` (see [`headers::Hop`]),
/// `X-Forwarded-Proto` and `X-Forwarded-Host` are set unless a trusted
/// proxy in front set them, and `Host` is as `host` says.
pub(crate) fn rewrite_head(
    upstream: &Upstream,
    host: HostHeader,
    parts: &mut http::request::Parts,
    hop: Option<&headers::Hop>,
) {
    // The host the client asked for, before anything changes it: the
    // `Host` header (HTTP/1.1) or the URI's authority (HTTP/2).
    let asked_host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    if parts.version == Version::HTTP_2 {
        headers::join_cookies(&mut parts.headers);
    }
    let trusted = parts.extensions.get::<TrustedPeer>().is_some();
    if let Some(hop) = hop {
        headers::append_hop(&mut parts.headers, &hop.address);
        headers::claims_of_the_peer(&mut parts.headers, hop, trusted);
    }
    // A trusted proxy in front said what the client used; otherwise this
    // proxy listens on plain HTTP, so that is what the client used.
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

//! `spillway proxy`: a reverse proxy that applies the rules in front of any
//! HTTP service.
//!
//! Each request goes through the **current** engine's
//! [`RateLimitLayer`](spillway_tower::RateLimitLayer) (so a reload applies to
//! the next request, and a request in flight finishes on the engine it
//! started with), wrapped around a service that forwards it to the upstream:
//!
//! - denied requests are answered `429` by the layer and never reach the
//!   upstream; shaped requests (leaky bucket, `mode = "shape"`) are held for
//!   their delay, then forwarded;
//! - the client is keyed by its socket peer ([`ClientAddr`](spillway_tower::ClientAddr));
//!   the layer believes `X-Forwarded-For` only from `trusted_proxies`;
//! - bodies stream both ways, never buffered; hop-by-hop headers are
//!   dropped, `X-Forwarded-For` gets the peer appended, `X-Forwarded-Proto`
//!   and `X-Forwarded-Host` are set, `Host` is kept (see [`HostHeader`]);
//! - an upstream that cannot be reached gives `502`, one that is too slow
//!   `504`, both with a problem+json body.
//!
//! The guide is `docs/proxy.md`.
//!
//! ```no_run
//! use std::sync::Arc;
//! use spillway_server::config::Config;
//! use spillway_server::state::{Loaded, Live};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let config = Config::parse(r#"
//!     [[rules]]
//!     name = "per-ip"
//!     key = ["ip"]
//!     algorithm = "token_bucket"
//!     limit = 100
//!     window = "1m"
//! "#)?;
//! let shared = Arc::new(Live::new(Loaded::build(config, None, None).await?));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let upstream = "http://127.0.0.1:9000".parse()?;
//! spillway_server::proxy::serve(listener, upstream, shared, async {
//!     tokio::signal::ctrl_c().await.ok();
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```

mod connect;
mod deadline;
mod error;
mod forward;
mod headers;
mod plain;
mod relay;
mod service;
mod target;
mod upstream;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Uri;
use http_body_util::combinators::UnsyncBoxBody;
use hyper_util::client::legacy::connect::Connection;
use tower::Service;

use crate::state::Live;

pub use crate::config::{EscapedSlashes, Normalize, ProxyBounds};
pub use error::{BoxError, ForwardError, InvalidUpstream};
pub(crate) use forward::sanitize_hooked;
pub use service::{Proxy, ProxyResponse};

/// The body of the forwarding service's responses: the upstream's body,
/// streamed, or the proxy's own error body.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// What to send as `Host` to the upstream.
///
/// ```
/// use spillway_server::proxy::HostHeader;
///
/// assert_eq!(HostHeader::default(), HostHeader::Keep);
/// assert_eq!("upstream".parse(), Ok(HostHeader::Upstream));
/// assert!("origin".parse::<HostHeader>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostHeader {
    /// The `Host` the client sent (the default): virtual hosts, absolute
    /// links and cookies in the upstream keep working as if it were reached
    /// directly. `X-Forwarded-Host` carries it too.
    #[default]
    Keep,
    /// The upstream's own `host:port`, for upstreams that only answer to
    /// their own name. The client's is in `X-Forwarded-Host`.
    Upstream,
}

impl FromStr for HostHeader {
    type Err = String;

    /// `keep` or `upstream`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" => Ok(Self::Keep),
            "upstream" => Ok(Self::Upstream),
            other => Err(format!("`{other}`: expected keep or upstream")),
        }
    }
}

/// How the proxy talks to its upstream.
///
/// ```
/// use std::time::Duration;
/// use spillway_server::proxy::{HostHeader, ProxyOptions};
///
/// // An upstream that may take five minutes to start answering.
/// let options = ProxyOptions {
///     response_timeout: Duration::from_secs(300),
///     ..ProxyOptions::default()
/// };
/// assert_eq!(options.connect_timeout, Duration::from_secs(5));
/// assert_eq!(options.host, HostHeader::Keep);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyOptions {
    /// The longest to wait for a connection to the upstream (name
    /// resolution included); past it the request gets `504`. Default 5 s.
    pub connect_timeout: Duration,
    /// The longest from forwarding a request (its body included) to the
    /// upstream's response head; past it the request gets `504`. The
    /// response body then streams for as long as it takes. Default 60 s.
    pub response_timeout: Duration,
    /// What `Host` the upstream sees. Default: the client's.
    pub host: HostHeader,
    /// How long an idle pooled connection to the upstream is kept. Default
    /// 90 s.
    pub pool_idle_timeout: Duration,
    /// How request targets are normalized before the rules run (and
    /// forwarded so). Default: all on, encoded slashes kept.
    pub normalize: Normalize,
    /// The longest a write to a client may wait for it to read; past it
    /// the connection is closed (and its upstream connection with it).
    /// Default 30 s, `[server] write_timeout` in the binary.
    pub write_timeout: Duration,
    /// The longest a client may take to send a whole request head (idle
    /// keep-alive time included), or the HTTP/2 preface. Default 30 s,
    /// `[server] head_timeout` in the binary.
    pub head_timeout: Duration,
    /// How long an HTTP/2 client connection with no request open is kept.
    /// Default 60 s, `[server] idle_timeout` in the binary.
    pub idle_timeout: Duration,
    /// The most client connections open at once; one more is answered 503
    /// and closed. Default 10,000, `[server] max_connections` in the
    /// binary (lowered to what the process may open).
    pub max_connections: usize,
    /// The longest a stopping proxy waits for its requests in flight; past
    /// it, the connections still open are closed. Requests held for their
    /// shaping turn are not waited for: they are answered 503 at once (see
    /// `docs/proxy.md`). Default 20 s, `[server] drain_timeout` in the
    /// binary.
    pub drain_timeout: Duration,
    /// What clients may hold at once: whether HTTP/2 clients are served,
    /// how many requests one connection may have open, how many upstream
    /// connections HTTP/2 clients hold at once (and the pool of a proxy
    /// made [`with_connector`](Proxy::with_connector), which serves every
    /// request): a request that finds none free within `connect_timeout`
    /// is answered 503; and how many requests are held for their shaping turn (past it,
    /// 503). `[proxy]` in the binary; see `docs/proxy.md`.
    pub bounds: ProxyBounds,
}

impl Default for ProxyOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(60),
            host: HostHeader::Keep,
            pool_idle_timeout: Duration::from_secs(90),
            normalize: Normalize::default(),
            write_timeout: Duration::from_secs(30),
            head_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 10_000,
            drain_timeout: crate::http1::DRAIN_TIMEOUT,
            bounds: ProxyBounds::default(),
        }
    }
}

/// A way to open connections to the upstream: hyper-util's `HttpConnector`
/// (TCP) in the binary, or any tower service from a `Uri` to a hyper
/// connection (tests use an in-memory one). Implemented for every such
/// service.
pub trait Connector:
    Service<
        Uri,
        Response: hyper::rt::Read + hyper::rt::Write + Connection + Unpin + Send + 'static,
        Error: Into<BoxError>,
        Future: Send + 'static,
    > + Clone
    + Send
    + Sync
    + 'static
{
}

impl<C> Connector for C where
    C: Service<
            Uri,
            Response: hyper::rt::Read + hyper::rt::Write + Connection + Unpin + Send + 'static,
            Error: Into<BoxError>,
            Future: Send + 'static,
        > + Clone
        + Send
        + Sync
        + 'static
{
}

/// Proxies requests from `listener` to `upstream` (an `http://host:port`
/// base URL), applying the rules of `shared`'s current engine, until
/// `shutdown` resolves; then stops accepting and returns once the requests
/// in flight have finished. Uses the default [`ProxyOptions`].
///
/// An upstream URL that cannot be proxied to is an `InvalidInput` error,
/// returned before anything is accepted.
pub async fn serve(
    listener: tokio::net::TcpListener,
    upstream: Uri,
    shared: Arc<Live>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(
        listener,
        upstream,
        shared,
        ProxyOptions::default(),
        shutdown,
    )
    .await
}

/// [`serve`] with `options`.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    upstream: Uri,
    shared: Arc<Live>,
    options: ProxyOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let proxy = Proxy::new(&upstream, shared, &options)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    tracing::info!(
        listen = %listener.local_addr()?,
        upstream = %upstream,
        "proxying"
    );
    proxy.run(listener, shutdown).await
}

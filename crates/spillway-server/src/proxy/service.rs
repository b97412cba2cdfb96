//! [`Proxy`]: the rate limiter around the forwarding service, and the server
//! loop that feeds it connections.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::Body;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use spillway_tower::{ClientAddr, Draining, HoldCap, ResponseBody};
use tokio::net::TcpListener;
use tower::{Layer, Service, ServiceExt};

use super::connect::{Capped, TimeoutConnector};
use super::error::{BoxError, InvalidUpstream};
use super::forward::{Forward, Sender, TrustedPeer, Upstream, sanitize};
use super::relay::{self, Relay};
use super::{Connector, ProxyBody, ProxyOptions};
use crate::http1::{self, next_connection};
use crate::state::{Live, Loaded};

/// A response of the [`Proxy`]: the upstream's (with the rate-limit
/// headers added), or one the rate limiter or the proxy wrote.
pub type ProxyResponse = Response<ResponseBody<ProxyBody>>;

/// The proxy as a tower service: each request goes through the current
/// engine's rate limiter, then to the upstream. Never fails: every error is
/// a response. Cheap to clone. Requests should carry the peer as a
/// [`ClientAddr`] extension ([`run`](Proxy::run) inserts it): without it
/// the limiter has no IP to key by and `X-Forwarded-For` gets no hop.
pub struct Proxy<C = HttpConnector> {
    pub(crate) shared: Arc<Live>,
    pub(crate) forward: Forward<C>,
    pub(crate) options: ProxyOptions,
    // Made by `new`: HTTP/1 clients are served by the relay, which opens
    // its own TCP connections (a custom connector keeps hyper's path).
    tcp: bool,
    /// The pool's connections open or free to open (see [`Capped`]); the
    /// relay lowers it to fit the process's file limit.
    pub(crate) pool_slots: Arc<tokio::sync::Semaphore>,
}

impl Proxy<HttpConnector> {
    /// A proxy to `upstream` (`http://host:port`) over TCP.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use spillway_server::config::Config;
    /// use spillway_server::state::{Loaded, Live};
    /// use spillway_server::proxy::{Proxy, ProxyOptions};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let engine = Loaded::build(Config::parse("").unwrap(), None, None).await.unwrap();
    /// let shared = Arc::new(Live::new(engine));
    /// let options = ProxyOptions::default();
    ///
    /// let upstream = "http://127.0.0.1:9000".parse().unwrap();
    /// assert!(Proxy::new(&upstream, shared.clone(), &options).is_ok());
    ///
    /// let tls = "https://127.0.0.1:9443".parse().unwrap();
    /// let refused = Proxy::new(&tls, shared, &options).unwrap_err();
    /// assert!(refused.reason.contains("https"));
    /// # }
    /// ```
    pub fn new(
        upstream: &Uri,
        shared: Arc<Live>,
        options: &ProxyOptions,
    ) -> Result<Self, InvalidUpstream> {
        let mut tcp = HttpConnector::new();
        // Requests are small writes answered at once: no Nagle delay.
        tcp.set_nodelay(true);
        let mut proxy = Self::with_connector(upstream, shared, options, tcp)?;
        proxy.tcp = true;
        Ok(proxy)
    }
}

impl<C: Connector> Proxy<C> {
    /// A proxy to `upstream` whose connections are opened by `connector`
    /// (with `options.connect_timeout` around it).
    pub fn with_connector(
        upstream: &Uri,
        shared: Arc<Live>,
        options: &ProxyOptions,
        connector: C,
    ) -> Result<Self, InvalidUpstream> {
        let upstream = Upstream::parse(upstream)?;
        let pool_slots = Arc::new(tokio::sync::Semaphore::new(
            options.bounds.pool_max_connections.get(),
        ));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(options.pool_idle_timeout)
            .build(Capped {
                inner: TimeoutConnector {
                    inner: connector,
                    timeout: options.connect_timeout,
                },
                slots: pool_slots.clone(),
                wait: options.connect_timeout,
            });
        Ok(Self {
            shared,
            forward: Forward {
                send: Sender::Pooled(Arc::new(client)),
                normalize: options.normalize,
                upstream: Arc::new(upstream),
                response_timeout: options.response_timeout,
                host: options.host,
            },
            options: options.clone(),
            tcp: false,
            pool_slots,
        })
    }

    /// Serves HTTP/1.1 and HTTP/2 (cleartext, prior knowledge) on
    /// `listener` until `shutdown` resolves; then stops accepting, and
    /// returns once the connections' requests in flight have finished (idle
    /// connections are closed at once).
    ///
    /// A proxy made by [`new`](Proxy::new) forwards each client
    /// connection's requests over upstream connections of its own, spoken
    /// to by its own HTTP/1.1 client (the relay); one made
    /// [`with_connector`](Proxy::with_connector) serves every request with
    /// hyper and its pooled client.
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        if self.tcp {
            return self.run_relay(listener, shutdown).await;
        }
        let mut http = auto::Builder::new(TokioExecutor::new());
        if !self.options.bounds.http2 {
            http = http.http1_only();
        }
        // With a timer, an HTTP/1.1 client gets 30 s (hyper's default) to
        // send each request head: a slow or idle client cannot hold a
        // connection for ever.
        http.http1().timer(TokioTimer::new());
        // Here HTTP/2 has hyper's stream cap only: the bounds on stalled
        // responses and premature resets are the relay's (`Proxy::new`).
        http.http2()
            .max_concurrent_streams(self.options.bounds.http2_max_streams.get());
        let graceful = GracefulShutdown::new();
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let draining = Draining::new(stopping);
        let held = HoldCap::new(self.options.bounds.max_held);
        let mut shutdown = pin!(shutdown);
        while let Some((stream, peer)) = next_connection(&listener, shutdown.as_mut()).await {
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(error = %e, "could not set TCP_NODELAY");
            }
            let proxy = self.clone();
            let (draining, held) = (draining.clone(), held.clone());
            let service = service_fn(move |mut req: Request<Incoming>| {
                req.extensions_mut().insert(ClientAddr(peer));
                req.extensions_mut().insert(draining.clone());
                req.extensions_mut().insert(held.clone());
                proxy.clone().oneshot(req)
            });
            let connection = graceful.watch(
                http.serve_connection(TokioIo::new(stream), service)
                    .into_owned(),
            );
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(%peer, error = %e, "connection closed with an error");
                }
            });
        }
        drop(listener);
        let _ = stop.send(true);
        let drain = self.options.drain_timeout;
        if tokio::time::timeout(drain, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!(
                "the drain took longer than {drain:?}: closing the connections still open"
            );
        }
        Ok(())
    }

    /// [`run`](Proxy::run) with the relay.
    async fn run_relay(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        // Each HTTP/1.1 client connection may hold an upstream connection
        // of its own, and HTTP/2 clients' requests share the pool's: all of
        // them count against the process's open-file limit.
        let pooled = self.options.bounds.pool_max_connections.get();
        let (max_connections, within) =
            http1::serve::proxy_within_file_limit(self.options.max_connections, pooled);
        self.pool_slots.forget_permits(pooled - within);
        let accepting = http1::Accepting {
            max_connections,
            drain_timeout: self.options.drain_timeout,
            ..http1::Accepting::default()
        };
        let relay = Arc::new(Relay {
            timeouts: http1::Timeouts {
                head: self.options.head_timeout,
                write: self.options.write_timeout,
                idle: self.options.idle_timeout,
                ..http1::Timeouts::default()
            },
            held: HoldCap::new(self.options.bounds.max_held),
            pool: super::upstream::Pool::new(self.pool_slots.clone()),
            proxy: self,
        });
        http1::serve_connections_with(listener, shutdown, accepting, |stream, peer, life| {
            relay::serve(relay.clone(), stream, peer, life)
        })
        .await;
        Ok(())
    }
}

impl<C: Clone> Clone for Proxy<C> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            forward: self.forward.clone(),
            options: self.options.clone(),
            tcp: self.tcp,
            pool_slots: self.pool_slots.clone(),
        }
    }
}

impl<C> fmt::Debug for Proxy<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("upstream", &self.forward.upstream.base())
            .field("response_timeout", &self.forward.response_timeout)
            .field("host", &self.forward.host)
            .finish_non_exhaustive()
    }
}

impl<C, B> Service<Request<B>> for Proxy<C>
where
    C: Connector,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send,
{
    type Response = ProxyResponse;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<ProxyResponse, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        limit(&self.shared, self.forward.clone(), req)
    }
}

/// A request through the current engine's rate limiter, then to `forward`
/// if admitted. The request head is [`sanitize`]d first, so that the rules
/// decide on what the upstream will receive.
pub(crate) fn limit<C, B>(
    shared: &Live,
    forward: Forward<C>,
    req: Request<B>,
) -> Pin<Box<dyn Future<Output = Result<ProxyResponse, Infallible>> + Send>>
where
    C: Connector,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send,
{
    // The engine is read per request, so a reload applies to the next
    // one; the layer keeps its own store alive for this one.
    limit_on(&shared.current(), forward, req)
}

/// [`limit`] on `engine`, which the caller has read.
pub(crate) fn limit_on<C, B>(
    engine: &Loaded,
    forward: Forward<C>,
    req: Request<B>,
) -> Pin<Box<dyn Future<Output = Result<ProxyResponse, Infallible>> + Send>>
where
    C: Connector,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send,
{
    let (mut parts, body) = req.into_parts();
    if let Err(refused) = sanitize(&mut parts, forward.normalize, engine.layer.policy()) {
        let res = refused
            .into_response()
            .map(|body| ResponseBody::Inner { body });
        return Box::pin(std::future::ready(Ok(res)));
    }
    // A trusted proxy in front knows the scheme and host the client
    // used: its X-Forwarded-Proto / -Host are kept.
    let trusted = parts
        .extensions
        .get::<ClientAddr>()
        .is_some_and(|ClientAddr(peer)| engine.layer.policy().client_settings().trusts(peer.ip()));
    if trusted {
        parts.extensions.insert(TrustedPeer);
    }
    let limited = engine.layer.layer(forward);
    let read = engine
        .read_request
        .as_ref()
        .filter(|_| engine.layer.policy().reads_body(&parts));
    let req = Request::from_parts(parts, body);
    match read {
        None => Box::pin(limited.oneshot(req)),
        // A budget rule reserves what the body asks: read it first.
        Some(read) => Box::pin(read.layer(limited).oneshot(req)),
    }
}

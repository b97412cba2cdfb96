//! The Envoy rate limit service (`envoy.service.ratelimit.v3`) on gRPC.
//!
//! [`serve`] answers `RateLimitService/ShouldRateLimit` with the running
//! [`Loaded`](crate::state::Loaded), so that Envoy, Istio and other
//! Envoy-based gateways can use Spillway as their global rate limit service.
//! [`EnvoyRateLimiter`] is the service itself, for a tonic server of your own.
//!
#![doc = include_str!("../../docs/envoy.md")]

mod kuadrant;
mod service;

use std::sync::Arc;

use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::state::Live;

pub use kuadrant::KuadrantRateLimiter;
pub use service::EnvoyRateLimiter;

/// The code generated from `proto/` (Envoy's published API, the subset we
/// use): messages, the server trait and a client, nested by protobuf package.
///
/// The generated items are documented by the comments in the .proto files
/// where they have one; `missing_docs` is allowed because prost adds items
/// (enum helpers, oneof modules) that no .proto comment can reach, and
/// clippy's style lints do not apply to code we do not write.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/envoy.rs"));
}

/// `envoy.service.ratelimit.v3`: the request, the response, the server
/// trait and the client.
pub use pb::envoy::service::ratelimit::v3 as rls;

/// Serves `ShouldRateLimit` on `listener` until `shutdown` resolves; calls
/// in flight then finish before it returns, for at most `[server]
/// drain_timeout` (the calls still open then are dropped with their
/// connections). Each call is held to `[envoy] max_descriptors` and
/// `max_entries` (and a message size to match) and to its `grpc-timeout`,
/// counted from its arrival: see `docs/envoy.md`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Live>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let drain = shared.current().config.server.drain_timeout;
    let (stopped, stopping) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown.await;
        let _ = stopped.send(());
    };
    let served = serve_until(listener, shared, shutdown);
    tokio::pin!(served);
    tokio::select! {
        result = served.as_mut() => return result,
        _ = stopping => {}
    }
    match tokio::time::timeout(drain, served).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(
                "the gRPC drain took longer than {drain:?}: closing the calls still open"
            );
            Ok(())
        }
    }
}

/// [`serve`] without the bound on its drain.
async fn serve_until(
    listener: tokio::net::TcpListener,
    shared: Arc<Live>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    // Every call is stamped as it arrives: its grpc-timeout runs from then,
    // its body's transfer included.
    let stamp = tower::util::MapRequestLayer::new(|mut req: http::Request<_>| {
        req.extensions_mut()
            .insert(service::Arrived(tokio::time::Instant::now()));
        req
    });
    Server::builder()
        .layer(stamp)
        .add_service(EnvoyRateLimiter::new(shared.clone()).into_service())
        .add_service(KuadrantRateLimiter::new(shared).into_service())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(std::io::Error::other)
}

//! The middleware in front of a tonic service: `RateLimitLayer` works as a
//! tonic server layer. A denied gRPC call gets the gRPC status
//! `RESOURCE_EXHAUSTED`, with the rate-limit headers and `retry-after` as
//! metadata.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::FixedWindow;
use spillway_server::config::Config;
use spillway_server::envoy::EnvoyRateLimiter;
use spillway_server::envoy::rls::RateLimitRequest;
use spillway_server::envoy::rls::rate_limit_service_client::RateLimitServiceClient;
use spillway_server::state::{Live, Loaded};
use spillway_tower::{HttpRule, KeyPart, Policy, RateLimitLayer};
use tokio::sync::oneshot;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};

#[tokio::test]
async fn a_tonic_service_behind_the_layer_is_limited() {
    // Any gRPC service will do: the Envoy rate limit service, empty config.
    let engine = Loaded::build(Config::parse("").unwrap(), None, None)
        .await
        .unwrap();
    let service = EnvoyRateLimiter::new(Arc::new(Live::new(engine))).into_service();

    // Two calls a minute per gRPC method (tonic gives no socket address to
    // the layer, so key by the route).
    let two =
        FixedWindow::new(Quota::new(NonZeroU32::new(2).unwrap(), Duration::from_secs(60)).unwrap());
    let rule = HttpRule::new("per-method", two).key([KeyPart::Route]);
    let layer = RateLimitLayer::in_memory(Policy::new([rule]));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(service)
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                stopped.await.ok();
            }),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = RateLimitServiceClient::new(channel);
    let call = || RateLimitRequest {
        domain: "other".into(),
        descriptors: vec![Default::default()],
        hits_addend: 0,
    };
    for _ in 0..2 {
        let ok = client.should_rate_limit(call()).await.expect("admitted");
        assert_eq!(ok.metadata().get("x-ratelimit-limit").unwrap(), "2");
    }
    let denied = client.should_rate_limit(call()).await.expect_err("denied");
    assert_eq!(denied.code(), tonic::Code::ResourceExhausted, "{denied:?}");
    assert!(denied.message().contains("per-method"), "{denied:?}");
    assert_eq!(denied.metadata().get("x-ratelimit-remaining").unwrap(), "0");
    assert!(denied.metadata().get("retry-after").is_some());
    stop.send(()).ok();
}

//! What the Envoy rate limit service's tests share: a tonic client, and
//! descriptors and requests built from `(key, value)` pairs.

#![allow(dead_code)] // Each test file uses its own part.

use std::net::SocketAddr;

use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use spillway_server::envoy::rls::rate_limit_response::Code;
use spillway_server::envoy::rls::rate_limit_service_client::RateLimitServiceClient;
use spillway_server::envoy::rls::{RateLimitRequest, RateLimitResponse};
use tonic::transport::{Channel, Endpoint};

/// A client of the service listening on `addr`.
pub async fn connect(addr: SocketAddr) -> RateLimitServiceClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .expect("a valid address")
        .connect()
        .await
        .expect("the server accepts connections");
    RateLimitServiceClient::new(channel)
}

/// A descriptor of these entries, in order.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

/// A request in `domain` for these descriptors, with `hits_addend` unset.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

/// A status code as the enum.
pub fn code(c: i32) -> Code {
    Code::try_from(c).expect("a known code")
}

/// Asks the service, which must answer.
pub async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
) -> RateLimitResponse {
    client
        .should_rate_limit(request)
        .await
        .expect("an answer")
        .into_inner()
}

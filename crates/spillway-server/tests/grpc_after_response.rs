//! Envoy AI Gateway's pattern on `ShouldRateLimit`, with Envoy's messages:
//! a call of 0 hits before the request (may it go on?), and one after the
//! stream with the response's tokens as the descriptor's `hits_addend`
//! (`apply_on_stream_done`). A rule with `hits_after_response = true`
//! charges the second whatever is left; a rule without it denies it and
//! charges nothing, so the response that crosses the budget is never paid.

mod grpc_support;

use std::sync::Arc;

use grpc_support::{code, descriptor, request};
use spillway_server::config::Config;
use spillway_server::envoy::rls::RateLimitResponse;
use spillway_server::envoy::rls::rate_limit_response::Code;
use spillway_server::envoy::rls::rate_limit_service_client::RateLimitServiceClient;
use spillway_server::state::{Live, Loaded};
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// Two token budgets of 1,000 an hour, on sliding logs (no window edge
/// for a test to cross): `after` takes the pattern, `plain` does not.
const CONFIG: &str = r#"
[envoy]
domain = "ai"

[[rules]]
name = "after"
algorithm = "sliding_log"
limit = 1000
window = "1h"
descriptors = ["user"]
hits_after_response = true

[[rules]]
name = "plain"
algorithm = "sliding_log"
limit = 1000
window = "1h"
descriptors = ["tenant"]
"#;

struct Server {
    client: RateLimitServiceClient<Channel>,
    _stop: oneshot::Sender<()>,
}

async fn start() -> Server {
    let config = Config::parse(CONFIG).expect("a valid configuration");
    let engine = Loaded::build(config, None, None).await.expect("an engine");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(spillway_server::envoy::serve(
        listener,
        Arc::new(Live::new(engine)),
        async {
            let _ = stopped.await;
        },
    ));
    Server {
        client: grpc_support::connect(addr).await,
        _stop: stop,
    }
}

impl Server {
    /// A call for `entries` whose descriptor says `hits` (Envoy's
    /// `RateLimit.hits_addend`, as Envoy Gateway's `cost` sets it).
    async fn call(&mut self, entries: &[(&str, &str)], hits: u64) -> RateLimitResponse {
        let mut d = descriptor(entries);
        d.hits_addend = Some(hits);
        grpc_support::ask(&mut self.client, request("ai", vec![d])).await
    }

    /// Before the request: its code, and what is left.
    async fn before(&mut self, entries: &[(&str, &str)]) -> (Code, u32) {
        let r = self.call(entries, 0).await;
        (code(r.overall_code), r.statuses[0].limit_remaining)
    }
}

const USER: &[(&str, &str)] = &[("user", "ann")];
const TENANT: &[(&str, &str)] = &[("tenant", "acme")];

#[tokio::test]
async fn the_response_that_crosses_the_budget_is_charged_and_the_next_request_waits() {
    let mut s = start().await;
    assert_eq!(s.before(USER).await, (Code::Ok, 1000));
    let after = s.call(USER, 600).await;
    assert_eq!(code(after.overall_code), Code::Ok);
    assert_eq!(s.before(USER).await, (Code::Ok, 400));
    // A stream of 700 tokens when 400 are left: all 700 charged.
    let after = s.call(USER, 700).await;
    assert_eq!(code(after.overall_code), Code::Ok, "it was served already");
    // 1,300 in the hour: the next request is over the limit.
    let (c, left) = s.before(USER).await;
    assert_eq!((c, left), (Code::OverLimit, 0));
    // Even a response bigger than the whole budget is charged (its debt
    // bounded at one quota, as a settle's).
    let after = s.call(USER, 5_000).await;
    assert_eq!(code(after.overall_code), Code::Ok);
    assert_eq!(s.before(USER).await.0, Code::OverLimit);
}

#[tokio::test]
async fn without_it_the_response_that_crosses_the_budget_is_never_paid() {
    let mut s = start().await;
    assert_eq!(s.call(TENANT, 600).await.statuses[0].limit_remaining, 400);
    // 700 when 400 are left: denied, and so charged nothing.
    let after = s.call(TENANT, 700).await;
    assert_eq!(code(after.overall_code), Code::OverLimit);
    // A cost of 0 only looks: the next request goes on, and so on for ever.
    assert_eq!(s.before(TENANT).await, (Code::Ok, 400));
}

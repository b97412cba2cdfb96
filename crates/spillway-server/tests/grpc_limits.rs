//! The Envoy rate limit service against calls that would cost it more than
//! they are worth (issue 15): too many descriptors or entries, too large a
//! message, a deadline that has passed. Each is refused before anything is
//! charged; a call at the bounds is decided as any other.

mod clock_support;
mod grpc_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use grpc_support::{code, descriptor, request};
use spillway_redis::Error as StoreError;
use spillway_server::config::Config;
use spillway_server::envoy::EnvoyRateLimiter;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use spillway_server::envoy::rls::RateLimitRequest;
use spillway_server::envoy::rls::rate_limit_response::Code;
use spillway_server::envoy::rls::rate_limit_service_client::RateLimitServiceClient;
use spillway_server::envoy::rls::rate_limit_service_server::RateLimitService;
use spillway_server::state::{Live, Loaded};
use spillway_server::store::StoreObserver;
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// Three per minute by `remote_address`, with the default bounds (64
/// descriptors of at most 16 entries).
const CONFIG: &str = r#"
[envoy]
domain = "spillway"

[[rules]]
name = "per-ip"
algorithm = "fixed_window"
limit = 3
window = "1m"
descriptors = ["remote_address"]
"#;

/// A running service on port 0; stops when dropped.
struct Server {
    client: RateLimitServiceClient<Channel>,
    shared: Arc<Live>,
    _stop: oneshot::Sender<()>,
}

async fn start(config: &str) -> Server {
    clock_support::clear_of_a_minute_boundary();
    let config = Config::parse(config).expect("a valid configuration");
    let shared = Arc::new(Live::new(
        Loaded::build(config, None, None).await.expect("an engine"),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(spillway_server::envoy::serve(
        listener,
        shared.clone(),
        async {
            let _ = stopped.await;
        },
    ));
    Server {
        client: grpc_support::connect(addr).await,
        shared,
        _stop: stop,
    }
}

fn ip(i: usize) -> String {
    format!("10.0.{}.{}", i / 256, i % 256)
}

/// `n` descriptors, one per address.
fn ips(n: usize) -> Vec<RateLimitDescriptor> {
    (0..n)
        .map(|i| descriptor(&[("remote_address", &ip(i))]))
        .collect()
}

/// What address `i` has left under `per-ip`, by a call that charges
/// nothing (`hits_addend` 0 on the descriptor).
async fn remaining(server: &mut Server, i: usize) -> u32 {
    let mut d = descriptor(&[("remote_address", &ip(i))]);
    d.hits_addend = Some(0);
    let r = server
        .client
        .should_rate_limit(request("spillway", vec![d]))
        .await
        .expect("an answer")
        .into_inner();
    r.statuses[0].limit_remaining
}

/// A descriptor with `n` entries (no rule has those keys).
fn long_descriptor(n: usize) -> RateLimitDescriptor {
    let entries: Vec<(String, String)> = (0..n).map(|i| (format!("k{i}"), "v".into())).collect();
    let pairs: Vec<(&str, &str)> = entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    descriptor(&pairs)
}

/// 65 descriptors, or a descriptor of 17 entries, is an `INVALID_ARGUMENT`
/// naming the bound; nothing is charged, not even for the descriptors
/// within bounds, and no limit override is counted for one of them.
#[tokio::test]
async fn a_call_over_the_bounds_is_refused_and_charges_nothing() {
    let mut server = start(CONFIG).await;
    let mut too_many = ips(65);
    too_many[1].limit = Some(RateLimitOverride {
        requests_per_unit: 7,
        unit: 2,
    });
    let mut too_long = ips(2);
    too_long.push(long_descriptor(17));
    for (what, descriptors, bound) in [
        ("65 descriptors", too_many, "max_descriptors"),
        ("17 entries", too_long, "max_entries"),
    ] {
        let status = server
            .client
            .should_rate_limit(request("spillway", descriptors))
            .await
            .expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{what}");
        assert!(status.message().contains(bound), "{what}: {status:?}");
    }
    assert_eq!(remaining(&mut server, 0).await, 3, "nothing charged");
    let engine = server.shared.current();
    assert!(
        engine
            .override_named("envoy-override:7-per-minute")
            .is_none(),
        "no override was counted for a refused call"
    );
}

/// 64 descriptors, one of 16 entries, are decided one by one as usual.
#[tokio::test]
async fn a_call_at_the_bounds_is_decided() {
    let mut server = start(CONFIG).await;
    let mut descriptors = ips(63);
    descriptors.push(long_descriptor(16));
    // Address 0 twice: charged twice.
    descriptors[62] = descriptor(&[("remote_address", &ip(0))]);
    let r = server
        .client
        .should_rate_limit(request("spillway", descriptors))
        .await
        .expect("an answer")
        .into_inner();
    assert_eq!(code(r.overall_code), Code::Ok);
    assert_eq!(r.statuses.len(), 64);
    assert_eq!(r.statuses[1].limit_remaining, 2);
    // Each descriptor sees the key as its own check left it.
    assert_eq!(r.statuses[0].limit_remaining, 2);
    assert_eq!(r.statuses[62].limit_remaining, 1);
    assert!(r.statuses[63].current_limit.is_none(), "no rule: unlimited");
    assert_eq!(remaining(&mut server, 0).await, 1);
    assert_eq!(remaining(&mut server, 61).await, 2);
}

/// A message over the size the bounds call for (256 KiB by default) is
/// refused before it is decoded, whatever it holds.
#[tokio::test]
async fn a_message_over_its_size_is_refused_unread() {
    let mut server = start(CONFIG).await;
    let big = "x".repeat(300 * 1024);
    let mut descriptors = ips(2);
    descriptors.push(descriptor(&[("path", &big)]));
    let status = server
        .client
        .should_rate_limit(request("spillway", descriptors))
        .await
        .expect_err("refused");
    assert_ne!(status.code(), tonic::Code::Ok);
    assert!(
        status.message().contains("message length too large"),
        "{status:?}"
    );
    assert_eq!(remaining(&mut server, 0).await, 3, "nothing charged");
    assert_eq!(remaining(&mut server, 1).await, 3, "nothing charged");
}

/// Counts store calls.
#[derive(Default)]
struct Calls(AtomicUsize);

impl StoreObserver for Calls {
    fn store_call(&self, _seconds: f64, _error: Option<&StoreError>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// A call's store work grows with its descriptors, no faster: 4 times the
/// descriptors is one store call all the same (not one per descriptor),
/// and 4 times the keys. (The time it takes is measured by
/// `the_time_a_call_takes_by_its_descriptors`, by hand.)
#[tokio::test]
async fn a_call_costs_one_store_call_whatever_its_descriptors() {
    let config = CONFIG.replace("[envoy]\n", "[envoy]\nmax_descriptors = 256\n");
    let calls = Arc::new(Calls::default());
    let config = Config::parse(&config).expect("a valid configuration");
    let observer: Arc<dyn StoreObserver> = calls.clone();
    let engine = Loaded::build(config, None, Some(observer))
        .await
        .expect("an engine");
    let shared = Arc::new(Live::new(engine));
    let service = EnvoyRateLimiter::new(shared.clone());
    let mut keys_before = 0;
    for n in [64, 256] {
        let before = calls.0.load(Ordering::Relaxed);
        // Fresh addresses for each size.
        let offset = keys_before;
        let descriptors = (offset..offset + n)
            .map(|i| descriptor(&[("remote_address", &ip(i))]))
            .collect();
        let r = service
            .should_rate_limit(tonic::Request::new(request("spillway", descriptors)))
            .await
            .expect("an answer")
            .into_inner();
        assert_eq!(r.statuses.len(), n);
        assert_eq!(calls.0.load(Ordering::Relaxed) - before, 1, "{n}: one call");
        let engine = shared.current();
        let memory = engine.store().memory().expect("in memory");
        let keys = memory.len(spillway::store::RuleId(0));
        assert_eq!(keys - keys_before, n, "{n}: one key per descriptor");
        keys_before = keys;
    }
}

/// A call with `grpc-timeout` `timeout`.
fn with_timeout(call: RateLimitRequest, timeout: &str) -> tonic::Request<RateLimitRequest> {
    let mut request = tonic::Request::new(call);
    request
        .metadata_mut()
        .insert("grpc-timeout", timeout.parse().expect("a metadata value"));
    request
}

/// A call whose deadline has passed when it is decided is answered
/// `DEADLINE_EXCEEDED` and charges nothing; one within it is decided.
#[tokio::test(start_paused = true)]
async fn a_call_past_its_deadline_is_not_charged() {
    clock_support::clear_of_a_minute_boundary();
    let config = Config::parse(CONFIG).expect("a valid configuration");
    let shared = Arc::new(Live::new(
        Loaded::build(config, None, None).await.expect("an engine"),
    ));
    let service = EnvoyRateLimiter::new(shared.clone());
    let call = || request("spillway", ips(1));
    let status = service
        .should_rate_limit(with_timeout(call(), "0n"))
        .await
        .expect_err("too late");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    let r = service
        .should_rate_limit(with_timeout(call(), "1S"))
        .await
        .expect("in time")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 2, "only this call charged");

    // A call that has to wait (here for a new limit override, while a
    // reload holds the engine) is abandoned at its deadline, and charges
    // nothing when the wait ends.
    let reload = shared.changing().await;
    let mut waiting = call();
    waiting.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 5,
        unit: 2,
    });
    let service2 = service.clone();
    let pending = tokio::spawn(async move {
        service2
            .should_rate_limit(with_timeout(waiting, "50m"))
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let status = tokio::time::timeout(Duration::from_secs(1), pending)
        .await
        .expect("abandoned at its deadline")
        .expect("no panic")
        .expect_err("too late");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    drop(reload);
    let engine = shared.current();
    assert!(
        engine
            .override_named("envoy-override:5-per-minute")
            .is_none()
    );
    let r = service
        .should_rate_limit(tonic::Request::new(call()))
        .await
        .expect("an answer")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 1, "two calls charged in all");
}

/// The time one call takes by its number of descriptors, in memory: run
/// by hand (`cargo test --release -p spillway-server --test grpc_limits --
/// --ignored --nocapture`) to see that it grows in proportion.
#[tokio::test]
#[ignore = "a measurement, not a test"]
async fn the_time_a_call_takes_by_its_descriptors() {
    let config = CONFIG.replace("[envoy]\n", "[envoy]\nmax_descriptors = 10000\n");
    for n in [1000, 2000, 4000, 8000] {
        let config = Config::parse(&config).expect("a valid configuration");
        let engine = Loaded::build(config, None, None).await.expect("an engine");
        let service = EnvoyRateLimiter::new(Arc::new(Live::new(engine)));
        let mut best = Duration::MAX;
        for _ in 0..5 {
            let call = tonic::Request::new(request("spillway", ips(n)));
            let started = std::time::Instant::now();
            service.should_rate_limit(call).await.expect("an answer");
            best = best.min(started.elapsed());
        }
        println!("{n} descriptors: {best:?} (best of 5)");
    }
}

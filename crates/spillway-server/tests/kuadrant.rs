//! Kuadrant limitador's rate limit service (`kuadrant.service.ratelimit.v1`)
//! end to end: the real gRPC server, called with a tonic client built from
//! its proto, on the in-memory store and on a real redis-server shared by
//! two instances.

mod grpc_support;

use std::sync::Arc;
use std::time::Duration;

use grpc_support::{code, descriptor, request};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_server::config::Config;
use spillway_server::envoy::pb::kuadrant::service::ratelimit::v1::rate_limit_service_client::RateLimitServiceClient;
use spillway_server::envoy::pb::kuadrant::service::ratelimit::v1::{CommitRequest, ReserveRequest};
use spillway_server::envoy::rls::RateLimitRequest;
use spillway_server::envoy::rls::rate_limit_response::Code;
use spillway_server::state::{Live, Loaded};
use tokio::sync::oneshot;
use tonic::transport::{Channel, Endpoint};

const DOMAIN: &str = "llm";

/// Token budgets on sliding logs of an hour (on a real clock, no window
/// edge for a test to cross): `kept` keeps a reservation nobody commits,
/// `released` gives it back after 2 minutes (or the call's shorter ttl).
const RULES: &str = r#"
[envoy]
domain = "llm"

[[rules]]
name = "kept"
algorithm = "sliding_log"
limit = 1000
window = "1h"
descriptors = ["user"]

[[rules]]
name = "released"
algorithm = "sliding_log"
limit = 1000
window = "1h"
descriptors = ["tenant"]
on_expiry = "release"
settle_within = "2m"
"#;

const USER: &[(&str, &str)] = &[("user", "ann")];
const TENANT: &[(&str, &str)] = &[("tenant", "acme")];

/// A running service; stops when dropped.
struct Server {
    client: RateLimitServiceClient<Channel>,
    _stop: oneshot::Sender<()>,
}

async fn start(config: &str) -> Server {
    let config = Config::parse(config).expect("a valid configuration");
    let engine = Loaded::build(config, None, None).await.expect("an engine");
    let shared = Arc::new(Live::new(engine));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(spillway_server::envoy::serve(listener, shared, async {
        let _ = stopped.await;
    }));
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("the server accepts connections");
    Server {
        client: RateLimitServiceClient::new(channel),
        _stop: stop,
    }
}

fn ttl(d: Duration) -> Option<prost_types::Duration> {
    Some(prost_types::Duration::try_from(d).unwrap())
}

impl Server {
    /// `Reserve`: the code, and the reservation id.
    async fn reserve(
        &mut self,
        entries: &[(&str, &str)],
        amount: u64,
        ttl: Option<prost_types::Duration>,
    ) -> (Code, String) {
        let r = self
            .client
            .reserve(ReserveRequest {
                domain: DOMAIN.into(),
                descriptors: vec![descriptor(entries)],
                amount,
                ttl,
            })
            .await
            .expect("an answer")
            .into_inner();
        (code(r.code), r.reservation_id)
    }

    /// `Commit`: whether it settled the reservation.
    async fn commit(&mut self, entries: &[(&str, &str)], id: &str, actual: u64) -> bool {
        self.try_commit(entries, id, actual)
            .await
            .expect("an answer")
    }

    async fn try_commit(
        &mut self,
        entries: &[(&str, &str)],
        id: &str,
        actual: u64,
    ) -> Result<bool, tonic::Status> {
        self.client
            .commit(CommitRequest {
                domain: DOMAIN.into(),
                descriptors: vec![descriptor(entries)],
                reservation_id: id.into(),
                actual_amount: actual,
            })
            .await
            .map(|r| r.into_inner().reservation_released)
    }

    /// `CheckRateLimit` of `hits`: the code and what is left.
    async fn look(&mut self, entries: &[(&str, &str)], hits: u32) -> (Code, u32) {
        let r = self
            .client
            .check_rate_limit(RateLimitRequest {
                hits_addend: hits,
                ..request(DOMAIN, vec![descriptor(entries)])
            })
            .await
            .expect("an answer")
            .into_inner();
        (code(r.overall_code), r.statuses[0].limit_remaining)
    }

    async fn left(&mut self, entries: &[(&str, &str)]) -> u32 {
        self.look(entries, 1).await.1
    }

    async fn report(&mut self, entries: &[(&str, &str)], hits: u32) {
        let r = self
            .client
            .report(RateLimitRequest {
                hits_addend: hits,
                ..request(DOMAIN, vec![descriptor(entries)])
            })
            .await
            .expect("an answer")
            .into_inner();
        assert_eq!(code(r.overall_code), Code::Ok);
    }
}

#[tokio::test]
async fn a_reservation_is_committed_at_what_the_request_cost_once() {
    let mut s = start(RULES).await;
    let (c, id) = s.reserve(USER, 300, None).await;
    assert_eq!(c, Code::Ok);
    assert!(id.starts_with("kr1."), "{id}");
    assert_eq!(s.left(USER).await, 700);
    assert!(s.commit(USER, &id, 120).await);
    assert_eq!(s.left(USER).await, 880);
    // Sent again (a retry after a lost answer): nothing changes.
    assert!(!s.commit(USER, &id, 120).await);
    assert!(!s.commit(USER, &id, 900).await);
    assert_eq!(s.left(USER).await, 880);
    // More than reserved: the rest is charged.
    let (_, id) = s.reserve(USER, 100, None).await;
    assert!(s.commit(USER, &id, 400).await);
    assert_eq!(s.left(USER).await, 480);
}

#[tokio::test]
async fn a_reservation_that_does_not_fit_is_over_limit_and_charges_nothing() {
    let mut s = start(RULES).await;
    let (c, id) = s.reserve(USER, 800, None).await;
    assert_eq!(c, Code::Ok);
    let (c, none) = s.reserve(USER, 300, None).await;
    assert_eq!(c, Code::OverLimit);
    assert!(none.is_empty());
    // Above the capacity: over the limit, not an error.
    let (c, _) = s.reserve(USER, 5_000, None).await;
    assert_eq!(c, Code::OverLimit);
    assert_eq!(s.left(USER).await, 200);
    assert!(s.commit(USER, &id, 800).await);
    assert_eq!(s.left(USER).await, 200);
}

#[tokio::test]
async fn check_only_looks_and_report_charges_past_the_limit() {
    let mut s = start(RULES).await;
    assert_eq!(s.look(USER, 1).await, (Code::Ok, 1000));
    assert_eq!(s.look(USER, 1000).await, (Code::Ok, 1000));
    assert_eq!(s.look(USER, 1001).await.0, Code::OverLimit);
    // What a response cost, known after it: charged whatever is left.
    s.report(USER, 900).await;
    assert_eq!(s.look(USER, 100).await, (Code::Ok, 100));
    assert_eq!(s.look(USER, 101).await.0, Code::OverLimit);
    s.report(USER, 500).await;
    // In debt: nothing fits, not even a reservation of 1.
    assert_eq!(s.look(USER, 1).await, (Code::OverLimit, 0));
    assert_eq!(s.reserve(USER, 1, None).await.0, Code::OverLimit);
    // A Commit with no reservation id is a report.
    assert!(!s.commit(TENANT, "", 250).await);
    assert_eq!(s.left(TENANT).await, 750);
}

/// What `ShouldRateLimit` cannot do for an after-the-response cost, and
/// `Report` does: the response that crosses the budget is charged.
#[tokio::test]
async fn a_report_over_what_is_left_is_charged_where_a_check_would_charge_nothing() {
    let mut s = start(RULES).await;
    s.report(USER, 950).await;
    s.report(USER, 200).await;
    assert_eq!(s.look(USER, 1).await, (Code::OverLimit, 0));
    // Debt of 150: 1,150 charged in the hour.
    let (c, _) = s.reserve(USER, 1, None).await;
    assert_eq!(c, Code::OverLimit);
}

#[tokio::test]
async fn a_reservation_nobody_commits_is_given_back_at_its_ttl_where_its_rule_releases() {
    let mut s = start(RULES).await;
    let short = Duration::from_millis(300);
    let (_, late) = s.reserve(TENANT, 400, ttl(short)).await;
    // No ttl: held for the rule's 2 minutes.
    let (_, held) = s.reserve(TENANT, 100, None).await;
    let (_, kept) = s.reserve(USER, 400, ttl(short)).await;
    assert_eq!(s.left(TENANT).await, 500);
    tokio::time::sleep(short + Duration::from_millis(700)).await;
    assert_eq!(
        s.left(TENANT).await,
        900,
        "the 400 is back; the 100 is held"
    );
    // `kept` keeps what nobody commits, whatever the ttl.
    assert_eq!(s.left(USER).await, 600);
    // A Commit after the give-back charges what the request cost, once.
    assert!(s.commit(TENANT, &late, 250).await);
    assert_eq!(s.left(TENANT).await, 650);
    assert!(!s.commit(TENANT, &late, 250).await);
    assert!(s.commit(TENANT, &held, 0).await);
    assert!(s.commit(USER, &kept, 0).await);
    assert_eq!(s.left(TENANT).await, 750);
    assert_eq!(s.left(USER).await, 1000);
}

#[tokio::test]
async fn a_reservation_id_not_made_here_is_refused() {
    let mut s = start(RULES).await;
    let (_, id) = s.reserve(USER, 300, None).await;
    // Another process's (its key drawn at start), and one altered.
    let mut other = start(RULES).await;
    let (_, foreign) = other.reserve(USER, 1, None).await;
    let mut altered = id.clone().into_bytes();
    let at = "kr1.".len() + 5;
    altered[at] = if altered[at] == b'A' { b'B' } else { b'A' };
    for bad in [
        foreign,
        String::from_utf8(altered).unwrap(),
        "kr1.e30.AAAA".into(),
    ] {
        let e = s.try_commit(USER, &bad, 0).await.expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}");
        assert!(e.message().contains("not a reservation"), "{}", e.message());
    }
    assert_eq!(s.left(USER).await, 700);
    // Negative ttls, the least of which prost cannot negate.
    for (seconds, nanos) in [(-1, 0), (i64::MIN, 0), (0, -1), (1, -1)] {
        let e = s
            .client
            .reserve(ReserveRequest {
                domain: DOMAIN.into(),
                descriptors: vec![descriptor(USER)],
                amount: 1,
                ttl: Some(prost_types::Duration { seconds, nanos }),
            })
            .await
            .expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{seconds} {nanos}");
    }
    // The longest is a ttl like any other.
    let ttl = prost_types::Duration {
        seconds: i64::MAX,
        nanos: 999_999_999,
    };
    let r = s
        .client
        .reserve(ReserveRequest {
            domain: DOMAIN.into(),
            descriptors: vec![descriptor(USER)],
            amount: 1,
            ttl: Some(ttl),
        })
        .await
        .expect("an answer")
        .into_inner();
    assert_eq!(code(r.code), Code::Ok);
}

#[tokio::test]
async fn another_domain_limits_nothing_and_holds_nothing() {
    let mut s = start(RULES).await;
    let r = s
        .client
        .reserve(ReserveRequest {
            domain: "other".into(),
            descriptors: vec![descriptor(USER)],
            amount: 500,
            ttl: None,
        })
        .await
        .expect("an answer")
        .into_inner();
    assert_eq!(code(r.code), Code::Ok);
    assert!(r.reservation_id.is_empty());
    assert_eq!(s.left(USER).await, 1000);
}

/// Two instances on one redis-server with one `settle_key`: a reservation
/// made on one is committed on the other, and one nobody commits is given
/// back at its ttl by the other's first look at the key.
#[tokio::test]
async fn on_redis_another_instance_commits_a_reservation_or_gives_it_back() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let config = format!(
        "[server]\nsettle_key = \"{}\"\n[store]\nkind = \"redis\"\nurl = \"{}\"\n{RULES}",
        "k".repeat(32),
        redis.url()
    );
    let mut a = start(&config).await;
    let mut b = start(&config).await;
    let (_, id) = a.reserve(TENANT, 300, None).await;
    assert_eq!(b.left(TENANT).await, 700);
    assert!(b.commit(TENANT, &id, 50).await);
    assert!(!a.commit(TENANT, &id, 50).await);
    assert_eq!(a.left(TENANT).await, 950);

    let short = Duration::from_millis(300);
    let (_, late) = a.reserve(TENANT, 500, ttl(short)).await;
    assert_eq!(b.left(TENANT).await, 450);
    tokio::time::sleep(short + Duration::from_millis(700)).await;
    assert_eq!(b.left(TENANT).await, 950);
    assert!(b.commit(TENANT, &late, 100).await);
    assert_eq!(a.left(TENANT).await, 850);
    // Reports from both count in one place.
    a.report(USER, 600).await;
    b.report(USER, 600).await;
    assert_eq!(a.look(USER, 1).await, (Code::OverLimit, 0));
    // Nobody sends a report's id again: its receipt lives as long as the
    // store's own retries (seconds), not a settle's 10 minutes.
    let longest = redis.command(
        "EVAL \"local m = -1 for _, k in ipairs(redis.call('KEYS', '*:settle:kp-*')) do \
         m = math.max(m, redis.call('PTTL', k)) end return m\" 0",
    );
    let ms: i64 = longest
        .trim_start_matches(':')
        .trim()
        .parse()
        .expect(&longest);
    assert!((1..=20_000).contains(&ms), "{longest}");
}

/// A budget of 10,000 an hour for the concurrent tests (a sliding log on
/// Redis takes no more), which 200 reservations of at most 20 and costs of
/// at most 29 cannot overrun.
const BIG: &str = r#"
[envoy]
domain = "llm"

[[rules]]
name = "big"
algorithm = "sliding_log"
limit = 10000
window = "1h"
descriptors = ["tenant"]
on_expiry = "release"
settle_within = "2m"
"#;

/// A debug build answering 200 calls at once may take longer than the
/// default 50 ms store timeout: a call that times out must fail, not be let
/// in by the failure policy (which would hold nothing to commit).
const PATIENT: &str = "timeout = \"5s\"\non_error = \"fail_closed\"\n";

/// 200 requests at once through 4 instances sharing `store`: each reserves
/// up to 20 and commits up to 29 (some twice, on another instance):
/// what is charged in the end is the sum of what they cost, exactly.
async fn concurrent_commits_charge_exactly_what_the_requests_cost(store: &str) {
    let config = format!(
        "[server]\nsettle_key = \"{}\"\n{store}{BIG}",
        "k".repeat(32)
    );
    let mut instances = Vec::new();
    for _ in 0..4 {
        instances.push(start(&config).await);
    }
    let clients: Vec<_> = instances.iter().map(|s| s.client.clone()).collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut tasks = Vec::new();
    let mut total = 0;
    for i in 0..200usize {
        let amount = next() % 20 + 1;
        let actual = next() % 30;
        total += actual;
        let mut here = clients[i % 4].clone();
        let mut there = clients[(i + 1) % 4].clone();
        tasks.push(tokio::spawn(async move {
            let reserved = here
                .reserve(ReserveRequest {
                    domain: DOMAIN.into(),
                    descriptors: vec![descriptor(TENANT)],
                    amount,
                    ttl: None,
                })
                .await
                .expect("an answer")
                .into_inner();
            assert_eq!(code(reserved.code), Code::Ok);
            let commit = CommitRequest {
                domain: DOMAIN.into(),
                descriptors: vec![descriptor(TENANT)],
                reservation_id: reserved.reservation_id,
                actual_amount: actual,
            };
            let first = here.commit(commit.clone()).await.expect("an answer");
            assert!(first.into_inner().reservation_released);
            if i % 2 == 0 {
                let again = there.commit(commit).await.expect("an answer");
                assert!(!again.into_inner().reservation_released);
            }
        }));
    }
    for t in tasks {
        t.await.expect("no panic");
    }
    let left = instances[3].left(TENANT).await;
    assert_eq!(u64::from(left), 10_000 - total);
}

#[tokio::test]
async fn in_memory_concurrent_commits_charge_exactly_what_the_requests_cost() {
    // One instance in memory: the four clients share it.
    let mut s = start(BIG).await;
    let client = s.client.clone();
    let mut total = 0;
    let mut tasks = Vec::new();
    for i in 0..200u64 {
        let (amount, actual) = (i % 20 + 1, (i * 7919) % 30);
        total += actual;
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let r = c
                .reserve(ReserveRequest {
                    domain: DOMAIN.into(),
                    descriptors: vec![descriptor(TENANT)],
                    amount,
                    ttl: None,
                })
                .await
                .unwrap()
                .into_inner();
            let commit = CommitRequest {
                domain: DOMAIN.into(),
                descriptors: vec![],
                reservation_id: r.reservation_id,
                actual_amount: actual,
            };
            assert!(
                c.commit(commit.clone())
                    .await
                    .unwrap()
                    .into_inner()
                    .reservation_released
            );
            assert!(
                !c.commit(commit)
                    .await
                    .unwrap()
                    .into_inner()
                    .reservation_released
            );
        }));
    }
    for t in tasks {
        t.await.expect("no panic");
    }
    assert_eq!(u64::from(s.left(TENANT).await), 10_000 - total);
}

#[tokio::test]
async fn on_redis_concurrent_commits_charge_exactly_what_the_requests_cost() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\n{PATIENT}",
        redis.url()
    );
    concurrent_commits_charge_exactly_what_the_requests_cost(&store).await;
}

#[tokio::test]
async fn on_a_redis_cluster_concurrent_commits_charge_exactly_what_the_requests_cost() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let urls: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let store = format!(
        "[store]\nkind = \"redis\"\nurl = [{}]\n{PATIENT}",
        urls.join(", ")
    );
    concurrent_commits_charge_exactly_what_the_requests_cost(&store).await;
}

//! In-flight limits: a concurrency rule's slot is taken when the request is
//! admitted, renewed while its response runs, and given back as soon as
//! the response body has ended or been dropped (the client left), or the
//! response future was dropped before there was a response.

use std::future::Future as _;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Extension;
use axum::routing::get;
use bytes::Bytes;
use http::{Response, StatusCode};
use http_body::Frame;
use spillway::Quota;
use spillway::algorithm::Concurrency;
use spillway::store::MemoryStore;
use spillway_tower::{HttpRule, LeaseEvent, Observer, Policy, RateLimitLayer, TokioClock};
use tokio::sync::oneshot;
use tower::ServiceExt;

use crate::support::{body_string, header, header_u64, memory_layer, req};

const CLIENT: &str = "192.0.2.9";

/// A body that sends one frame, "done", once its gate opens, then ends.
struct Gated(Option<oneshot::Receiver<()>>);

impl http_body::Body for Gated {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let Some(gate) = self.0.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(gate).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(_) => {
                self.0 = None;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"done")))))
            }
        }
    }
}

/// The gate of one request's response body, handed to the handler in the
/// request's extensions.
#[derive(Clone)]
struct Gate(Arc<Mutex<Option<oneshot::Receiver<()>>>>);

/// `/slow` answers at once with a body that ends when its gate opens;
/// `/hang` never answers; `/fast` answers at once.
fn upstream() -> Router {
    Router::new()
        .route(
            "/slow",
            get(|Extension(gate): Extension<Gate>| async move {
                let gate = gate.0.lock().expect("not poisoned").take();
                Response::new(Body::new(Gated(gate)))
            }),
        )
        .route("/hang", get(std::future::pending::<&'static str>))
        .route("/fast", get(|| async { "fast" }))
}

fn in_flight(slots: u32, lease: Duration) -> HttpRule {
    let quota = Quota::new(NonZeroU32::new(slots).expect("nonzero"), lease).expect("valid");
    HttpRule::new("in_flight", Concurrency::new(quota))
}

fn app(rule: HttpRule) -> (Router, RateLimitLayer<MemoryStore<TokioClock>>) {
    let layer = memory_layer(Policy::new([rule]));
    (upstream().layer(layer.clone()), layer)
}

/// Sends a request to `/slow`: its response, whose body ends when the
/// returned sender is used (or dropped).
async fn slow(app: &Router) -> (Response<Body>, oneshot::Sender<()>) {
    let (open, gate) = oneshot::channel();
    let request = req("/slow", CLIENT)
        .extension(Gate(Arc::new(Mutex::new(Some(gate)))))
        .body(Body::empty())
        .expect("a request");
    let res = app.clone().oneshot(request).await.expect("infallible");
    (res.map(Body::new), open)
}

async fn fast(app: &Router) -> Response<Body> {
    let request = req("/fast", CLIENT).body(Body::empty()).expect("a request");
    let res = app.clone().oneshot(request).await.expect("infallible");
    res.map(Body::new)
}

/// Lets the runtime's other tasks (the lease keepers) run.
async fn settle_tasks() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_slot_is_held_until_the_response_body_ends_then_given_back_at_once() {
    let (app, _layer) = app(in_flight(1, Duration::from_secs(30)));
    let (first, open) = slow(&app).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(
        header(&first, "ratelimit-policy").as_deref(),
        Some("\"in_flight\";q=1;qu=\"concurrent-requests\"")
    );
    assert_eq!(header_u64(&first, "x-ratelimit-remaining"), 0);
    // The head has gone out, the body has not ended: the slot is held.
    let denied = fast(&app).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // With nobody releasing, the lease ends in 30 s: never 0.
    assert_eq!(header_u64(&denied, "retry-after"), 30);
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(fast(&app).await.status(), StatusCode::TOO_MANY_REQUESTS);
    open.send(()).expect("the body waits");
    assert_eq!(body_string(first).await, "done");
    settle_tasks().await;
    // Given back at once, long before the lease's end.
    let second = fast(&app).await;
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(body_string(second).await, "fast");
    settle_tasks().await;
    assert_eq!(fast(&app).await.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_mid_response_gives_its_slot_back() {
    let (app, _layer) = app(in_flight(1, Duration::from_secs(30)));
    let (first, _open) = slow(&app).await;
    assert_eq!(fast(&app).await.status(), StatusCode::TOO_MANY_REQUESTS);
    // The client goes away: its response body is dropped unread.
    drop(first);
    settle_tasks().await;
    assert_eq!(fast(&app).await.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_before_its_response_gives_its_slot_back() {
    let (app, _layer) = app(in_flight(1, Duration::from_secs(30)));
    let request = req("/hang", CLIENT).body(Body::empty()).expect("a request");
    let call = app.clone().oneshot(request);
    // The upstream never answers; the client gives up after a second.
    assert!(
        tokio::time::timeout(Duration::from_secs(1), call)
            .await
            .is_err()
    );
    settle_tasks().await;
    assert_eq!(fast(&app).await.status(), StatusCode::OK);
}

/// Records lease events, shared with the test.
#[derive(Default, Clone)]
struct Leases(Arc<Mutex<Vec<LeaseEvent>>>);

impl Observer for Leases {
    fn observe(&self, _: &str, _: spillway_tower::RuleOutcome, _: Option<&spillway::Decision>) {}

    fn lease(&self, _: &str, event: LeaseEvent) {
        self.0.lock().expect("not poisoned").push(event);
    }
}

#[tokio::test(start_paused = true)]
async fn a_lease_renewed_through_a_long_response_is_never_taken_over() {
    // Leases of 3 s, renewed every second, through a 90 s response.
    let leases = Leases::default();
    let layer =
        memory_layer(Policy::new([in_flight(1, Duration::from_secs(3))])).observer(leases.clone());
    let app = upstream().layer(layer);
    let (first, open) = slow(&app).await;
    for _ in 0..180 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(fast(&app).await.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    let renewed = leases.0.lock().expect("not poisoned").clone();
    assert!(renewed.len() >= 89, "{} renews in 90 s", renewed.len());
    assert!(
        renewed.iter().all(|e| *e == LeaseEvent::Renewed),
        "{renewed:?}"
    );
    open.send(()).expect("the body waits");
    assert_eq!(body_string(first).await, "done");
    settle_tasks().await;
    assert_eq!(
        leases.0.lock().expect("not poisoned").last(),
        Some(&LeaseEvent::Released)
    );
    assert_eq!(fast(&app).await.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_lease_not_renewed_ends_by_itself_and_not_before() {
    // The keeper runs on the runtime: a response held where no keeper
    // runs is what a crashed process leaves. Here the slot is taken by a
    // request whose lease nobody keeps (the store is charged directly).
    let (app, layer) = app(in_flight(1, Duration::from_secs(30)));
    let key = format!("ip={CLIENT}");
    let check = [spillway::store::Check {
        rule: spillway::store::RuleId(0),
        key: &key,
        cost: 1,
    }];
    assert!(layer.store().check_now(&check).expect("fits").allowed);
    tokio::time::advance(Duration::from_micros(29_999_999)).await;
    assert_eq!(fast(&app).await.status(), StatusCode::TOO_MANY_REQUESTS);
    tokio::time::advance(Duration::from_micros(1)).await;
    assert_eq!(fast(&app).await.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_denial_may_answer_503_with_a_shorter_wait_than_the_lease() {
    let rule = in_flight(1, Duration::from_secs(30))
        .retry_after_hint(Duration::from_millis(1_500))
        .deny_status(StatusCode::SERVICE_UNAVAILABLE);
    let (app, _layer) = app(rule);
    let (_first, _open) = slow(&app).await;
    let denied = fast(&app).await;
    assert_eq!(denied.status(), StatusCode::SERVICE_UNAVAILABLE);
    // 1.5 s, rounded up: shorter than the lease's 30 s.
    assert_eq!(header_u64(&denied, "retry-after"), 2);
    assert!(body_string(denied).await.contains("\"status\":503"));
}

/// On Redis, a request under a concurrency rule costs two store calls, its
/// acquire and its release; under a rate rule, one.
#[tokio::test]
async fn on_redis_an_acquire_and_its_release_are_two_store_calls() {
    use spillway_conformance::redis_server::RedisServer;
    use spillway_redis::{RedisOptions, RedisStore, Topology};
    let Some(server) = RedisServer::start() else {
        return;
    };
    let per_minute = Quota::per_minute(NonZeroU32::new(1_000).expect("nonzero"));
    for (rule, calls) in [
        (in_flight(10, Duration::from_secs(30)), 2),
        (
            HttpRule::new("rate", spillway::algorithm::FixedWindow::new(per_minute)),
            1,
        ),
    ] {
        let policy = Policy::new([rule]);
        let options = RedisOptions {
            timeout: Duration::from_secs(5),
            ..RedisOptions::default()
        };
        let store = RedisStore::connect(
            Topology::Standalone(server.url()),
            policy.store_rules(),
            options,
        )
        .await
        .expect("redis is up");
        let layer = RateLimitLayer::new(policy, store).expect("same rules");
        let app = upstream().layer(layer.clone());
        for _ in 0..3 {
            let before = layer.store().stats().redis_calls;
            let res = fast(&app).await;
            assert_eq!(res.status(), StatusCode::OK);
            assert_eq!(body_string(res).await, "fast");
            // The release is the keeper's: let it run.
            for _ in 0..100 {
                if layer.store().stats().redis_calls - before >= calls {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert_eq!(layer.store().stats().redis_calls - before, calls);
        }
    }
}

/// A concurrency rule beside a shaping bucket of one request per 10 s: the
/// second request waits 10 s for its turn.
fn shaped_in_flight(leases: &Leases) -> Router {
    let quota = Quota::new(NonZeroU32::MIN, Duration::from_secs(10)).expect("valid");
    let shaped = HttpRule::new(
        "shaped",
        spillway::algorithm::LeakyBucket::shape(quota, NonZeroU32::new(3).expect("nonzero")),
    );
    let policy = Policy::new([in_flight(1, Duration::from_secs(3)), shaped]);
    upstream().layer(memory_layer(policy).observer(leases.clone()))
}

#[tokio::test(start_paused = true)]
async fn a_request_waiting_for_its_shaped_turn_keeps_its_slot_renewed() {
    let leases = Leases::default();
    let app = shaped_in_flight(&leases);
    assert_eq!(fast(&app).await.status(), StatusCode::OK);
    settle_tasks().await;
    leases.0.lock().expect("not poisoned").clear();
    // Its turn is 10 s away, its lease 3 s: it is renewed while it waits,
    // and never has to take its slot afresh.
    let started = tokio::time::Instant::now();
    let (res, open) = slow(&app).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_secs(10));
    let waited = leases.0.lock().expect("not poisoned").clone();
    assert!(waited.len() >= 8, "{} renews in a 10 s wait", waited.len());
    assert!(
        waited.iter().all(|e| *e == LeaseEvent::Renewed),
        "{waited:?}"
    );
    open.send(()).expect("the body waits");
    assert_eq!(body_string(res).await, "done");
    settle_tasks().await;
    assert_eq!(
        leases.0.lock().expect("not poisoned").last(),
        Some(&LeaseEvent::Released)
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_that_leaves_while_waiting_for_its_turn_gives_its_slot_back() {
    let leases = Leases::default();
    let app = shaped_in_flight(&leases);
    assert_eq!(fast(&app).await.status(), StatusCode::OK);
    settle_tasks().await;
    leases.0.lock().expect("not poisoned").clear();
    let request = req("/fast", CLIENT).body(Body::empty()).expect("a request");
    let call = app.clone().oneshot(request);
    assert!(
        tokio::time::timeout(Duration::from_secs(5), call)
            .await
            .is_err()
    );
    settle_tasks().await;
    let events = leases.0.lock().expect("not poisoned").clone();
    assert_eq!(events.last(), Some(&LeaseEvent::Released), "{events:?}");
    assert!(!events.contains(&LeaseEvent::Retaken), "{events:?}");
}

//! Leaky bucket in shape mode: requests are held for their delay on tokio's
//! timer, denied at once when the queue is full, and a request dropped
//! while it waits gives its slot back.

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Response, StatusCode};
use spillway::Quota;
use spillway::algorithm::LeakyBucket;
use spillway_tower::{HttpRule, Policy};
use tokio::time::Instant;
use tower::ServiceExt;

use crate::support::{header_u64, memory_layer, nz, req};

type Pending = Pin<Box<dyn Future<Output = Response<Body>> + Send>>;

/// A request in flight, polled by hand.
fn start(app: &Router) -> Pending {
    let request = req("/", "192.0.2.1")
        .body(Body::empty())
        .expect("a request");
    let app = app.clone();
    Box::pin(async move { app.oneshot(request).await.expect("infallible") })
}

/// Polls once, without waiting.
fn poll(fut: &mut Pending) -> Poll<Response<Body>> {
    fut.as_mut().poll(&mut Context::from_waker(Waker::noop()))
}

fn ready(fut: &mut Pending) -> Response<Body> {
    match poll(fut) {
        Poll::Ready(res) => res,
        Poll::Pending => panic!("still held"),
    }
}

/// A shaping bucket of `rate` per second holding at most `queue` units,
/// behind an app that records when its handler ran.
fn shaped(rate: u32, queue: NonZeroU32) -> (Router, Arc<Mutex<Vec<Instant>>>, Duration) {
    let quota = Quota::per_second(nz(rate));
    let interval = quota.period() / quota.limit().get();
    let policy = Policy::new([HttpRule::new("shaped", LeakyBucket::shape(quota, queue))]);
    let served = Arc::new(Mutex::new(Vec::new()));
    let log = served.clone();
    let app = Router::new()
        .route(
            "/",
            get(move || {
                let log = log.clone();
                async move {
                    log.lock().expect("not poisoned").push(Instant::now());
                    "shaped"
                }
            }),
        )
        .layer(memory_layer(policy));
    (app, served, interval)
}

#[tokio::test(start_paused = true)]
async fn a_shaped_request_is_held_for_exactly_its_delay() {
    let queue = 3;
    let (app, served, interval) = shaped(10, nz(queue));
    let t0 = Instant::now();

    // The first leaves at once; each next one interval after the previous.
    let mut first = start(&app);
    assert_eq!(ready(&mut first).status(), StatusCode::OK);
    let mut held: Vec<Pending> = (1..queue).map(|_| start(&app)).collect();
    for fut in &mut held {
        assert!(poll(fut).is_pending(), "decided, and held");
    }
    for (i, fut) in held.iter_mut().enumerate() {
        let delay = interval * (i as u32 + 1);
        tokio::time::advance(t0 + delay - Duration::from_millis(1) - Instant::now()).await;
        assert!(
            poll(fut).is_pending(),
            "request {} left before its delay {delay:?}",
            i + 2
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            ready(fut).status(),
            StatusCode::OK,
            "request {} after {delay:?}",
            i + 2
        );
    }
    let times: Vec<Duration> = served
        .lock()
        .expect("not poisoned")
        .iter()
        .map(|t| *t - t0)
        .collect();
    let expected: Vec<Duration> = (0..queue).map(|i| interval * i).collect();
    assert_eq!(
        times, expected,
        "the handler ran exactly one interval apart"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_that_would_wait_beyond_the_queue_is_denied_at_once() {
    let queue = 3;
    let (app, served, interval) = shaped(10, nz(queue));
    let mut accepted: Vec<Pending> = (0..queue).map(|_| start(&app)).collect();
    for fut in &mut accepted {
        let _ = poll(fut);
    }
    // The queue is full: the next one is not held but answered now, told
    // to come back when one unit has drained.
    let mut over = start(&app);
    let res = ready(&mut over);
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header_u64(&res, "retry-after"),
        interval.as_micros().div_ceil(1_000_000) as u64
    );
    assert_eq!(
        served.lock().expect("not poisoned").len(),
        1,
        "only the first was served so far"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_queued_gives_its_slot_back() {
    let queue = 3;
    let (app, served, interval) = shaped(10, nz(queue));
    let t0 = Instant::now();
    let mut accepted: Vec<Pending> = (0..queue).map(|_| start(&app)).collect();
    for fut in &mut accepted {
        let _ = poll(fut);
    }
    // The last in the queue leaves (its client hung up).
    let last = accepted.pop().expect("queued");
    drop(last);
    // Let the refund the drop spawned run.
    tokio::task::yield_now().await;

    // Its slot is free again: a new request is queued where it was,
    // instead of being denied.
    let mut next = start(&app);
    assert!(
        poll(&mut next).is_pending(),
        "admitted and held, not denied"
    );
    let slot = interval * (queue - 1);
    tokio::time::advance(slot - Duration::from_millis(1)).await;
    assert!(poll(&mut next).is_pending());
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(ready(&mut next).status(), StatusCode::OK);
    assert_eq!(Instant::now() - t0, slot);
    assert!(
        served
            .lock()
            .expect("not poisoned")
            .iter()
            .all(|t| *t - t0 <= slot)
    );
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_is_answered_503_when_the_server_stops_and_gives_its_slot_back() {
    let queue = 3;
    let (app, served, interval) = shaped(10, nz(queue));
    let t0 = Instant::now();
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let draining = spillway_tower::Draining::new(stopping);
    let start_draining = |app: &Router| -> Pending {
        let mut request = req("/", "192.0.2.1")
            .body(Body::empty())
            .expect("a request");
        request.extensions_mut().insert(draining.clone());
        let app = app.clone();
        Box::pin(async move { app.oneshot(request).await.expect("infallible") })
    };
    let mut first = start_draining(&app);
    assert_eq!(ready(&mut first).status(), StatusCode::OK);
    let mut held: Vec<Pending> = (1..queue).map(|_| start_draining(&app)).collect();
    for fut in &mut held {
        assert!(poll(fut).is_pending(), "decided, and held");
    }
    // A little of the first wait passes; then the server stops.
    tokio::time::advance(interval / 4).await;
    stop.send(true).expect("a receiver");
    for (i, fut) in held.iter_mut().enumerate() {
        let res = ready(fut);
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        // The rest of its wait, rounded up to a whole second.
        let left = interval * (i as u32 + 1) - interval / 4;
        assert_eq!(
            header_u64(&res, "retry-after"),
            left.as_micros().div_ceil(1_000_000).max(1) as u64
        );
    }
    drop(held);
    tokio::task::yield_now().await;
    assert_eq!(
        served.lock().expect("not poisoned").len(),
        1,
        "the queued requests never reached the service"
    );
    // Their slots were given back: the next two take the turns they had
    // (one and two intervals after the first), not later ones.
    let mut again: Vec<Pending> = (1..queue).map(|_| start(&app)).collect();
    for fut in &mut again {
        assert!(poll(fut).is_pending(), "queued again, not denied");
    }
    for (i, fut) in again.iter_mut().enumerate() {
        let turn = t0 + interval * (i as u32 + 1);
        tokio::time::advance(turn - Instant::now()).await;
        assert_eq!(ready(fut).status(), StatusCode::OK, "the turn {}", i + 1);
    }
}

/// A server's [`HoldCap`](spillway_tower::HoldCap) bounds the requests
/// held for their turn, all keys together: past it, one more is answered
/// 503 at once, with `Retry-After` its wait, never reaches the service, and
/// its charge is given back (the next request takes the turn it had).
#[tokio::test(start_paused = true)]
async fn past_the_servers_hold_cap_a_request_is_answered_503_and_gives_its_slot_back() {
    let (app, served, interval) = shaped(10, nz(5));
    let t0 = Instant::now();
    let cap = spillway_tower::HoldCap::new(std::num::NonZeroUsize::new(2).expect("nonzero"));
    let start_capped = |app: &Router| -> Pending {
        let mut request = req("/", "192.0.2.1")
            .body(Body::empty())
            .expect("a request");
        request.extensions_mut().insert(cap.clone());
        let app = app.clone();
        Box::pin(async move { app.oneshot(request).await.expect("infallible") })
    };
    // The first is not held; the next two are, up to the cap.
    let mut first = start_capped(&app);
    assert_eq!(ready(&mut first).status(), StatusCode::OK);
    let mut held: Vec<Pending> = (0..2).map(|_| start_capped(&app)).collect();
    for fut in &mut held {
        assert!(poll(fut).is_pending(), "decided, and held");
    }
    assert_eq!(cap.held(), 2);
    // The queue has room for a fourth, the server not.
    let mut over = start_capped(&app);
    let res = ready(&mut over);
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let wait = interval * 3;
    assert_eq!(
        header_u64(&res, "retry-after"),
        wait.as_micros().div_ceil(1_000_000).max(1) as u64
    );
    tokio::task::yield_now().await;
    // Its charge given back, a request without the cap takes its turn.
    let mut next = start(&app);
    assert!(poll(&mut next).is_pending(), "queued, not denied");
    for (i, fut) in held.iter_mut().chain([&mut next]).enumerate() {
        let turn = t0 + interval * (i as u32 + 1);
        tokio::time::advance(turn - Instant::now()).await;
        assert_eq!(ready(fut).status(), StatusCode::OK, "the turn {}", i + 1);
    }
    assert_eq!(cap.held(), 0, "every place given back");
    assert_eq!(served.lock().expect("not poisoned").len(), 4);
}

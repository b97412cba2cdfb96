//! Budgets: a rule whose cost is read from the response reserves when the
//! request is admitted, and is settled at what the response cost once it
//! has ended, been left, or been cut at the budget.

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::routing::get;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use spillway::Quota;
use spillway::algorithm::{FixedWindow, SlidingLog, TokenBucket};
use spillway::store::{Check, MemoryStore, RuleId};
use spillway_tower::budget::{Overrun, RequestReserve, Reserve, ResponseCost, Unanswered};
use spillway_tower::usage::UsageField;
use spillway_tower::{
    BudgetEvent, Cost, HttpRule, Observer, Policy, RateLimitLayer, Settled, TokioClock,
};
use tower::ServiceExt;

use crate::support::{CountingStore, body_string, header_u64, memory_layer, req};

const CLIENT: &str = "192.0.2.7";

/// A body of frames given in advance.
struct Frames(VecDeque<Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }
}

fn frames(chunks: impl IntoIterator<Item = String>, trailers: Option<HeaderMap>) -> Body {
    let mut all: VecDeque<Frame<Bytes>> =
        chunks.into_iter().map(|c| Frame::data(c.into())).collect();
    if let Some(t) = trailers {
        all.push_back(Frame::trailers(t));
    }
    Body::new(Frames(all))
}

/// An OpenAI-style stream of `n` content deltas, one event per chunk,
/// then (when given) the usage, then `[DONE]`.
fn stream(n: u64, usage: Option<u64>) -> Response<Body> {
    let mut chunks: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
            )
        })
        .collect();
    if let Some(total) = usage {
        chunks.push(format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":0,\"completion_tokens\":{total},\"total_tokens\":{total}}}}}\n\n"
        ));
    }
    chunks.push("data: [DONE]\n\n".to_string());
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(frames(chunks, None))
        .expect("a response")
}

/// The upstream: each route answers with what its path says.
fn upstream() -> Router {
    Router::new()
        .route(
            "/json/{n}",
            get(|Path(n): Path<u64>| async move {
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Body::from(format!(
                        r#"{{"id":"c1","choices":[{{"message":{{"content":"usage"}}}}],"usage":{{"total_tokens":{n}}}}}"#
                    )))
                    .expect("a response")
            }),
        )
        .route(
            "/sse/{n}",
            get(|Path(n): Path<u64>| async move { stream(n, Some(n)) }),
        )
        .route(
            "/deltas/{n}",
            get(|Path(n): Path<u64>| async move { stream(n, None) }),
        )
        .route(
            "/header/{n}",
            get(|Path(n): Path<u64>| async move {
                Response::builder()
                    .header("x-usage", n)
                    .body(Body::from("ok"))
                    .expect("a response")
            }),
        )
        .route(
            "/trailer/{n}",
            get(|Path(n): Path<u64>| async move {
                let mut trailers = HeaderMap::new();
                trailers.insert("x-usage", n.into());
                Response::new(frames(["ok".to_string()], Some(trailers)))
            }),
        )
        .route(
            "/status/{code}",
            get(|Path(code): Path<u16>| async move {
                Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(r#"{"error":{"message":"no"}}"#))
                    .expect("a response")
            }),
        )
        .route("/text", get(|| async { "no usage here" }))
        .route(
            "/reported/{n}/{total}",
            get(|Path((n, total)): Path<(u64, u64)>| async move {
                let delta = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
                let usage = format!(
                    "data: {{\"choices\":[],\"usage\":{{\"total_tokens\":{total}}}}}\n\n"
                );
                let chunks = (0..n).map(|_| delta.to_string()).chain([usage]);
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(frames(chunks, None))
                    .expect("a response")
            }),
        )
        .route(
            "/cr/{n}",
            get(|Path(n): Path<u64>| async move {
                // Every event ended by a lone CR: the last one's end shows
                // only at the end of the stream.
                let delta = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\r";
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(frames((0..n).map(|_| delta.to_string()), None))
                    .expect("a response")
            }),
        )
        .route(
            "/unanswered",
            get(|| async {
                let mut res = Response::new(Body::from("upstream timed out"));
                *res.status_mut() = StatusCode::GATEWAY_TIMEOUT;
                res.extensions_mut().insert(Unanswered);
                res
            }),
        )
        .route(
            "/failed-after/{n}",
            get(|Path(n): Path<u64>| async move {
                Response::builder()
                    .status(500)
                    .header("content-type", "application/json")
                    .body(Body::from(format!(r#"{{"usage":{{"total_tokens":{n}}}}}"#)))
                    .expect("a response")
            }),
        )
        .route(
            "/trailed",
            get(|| async {
                let mut trailers = HeaderMap::new();
                trailers.insert("x-usage", 1.into());
                let mut res = Response::new(frames(
                    [
                        "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n".to_string(),
                        "data: {\"choices\":[".to_string(),
                    ],
                    Some(trailers),
                ));
                res.headers_mut().insert("content-type", "text/event-stream".parse().expect("a value"));
                res
            }),
        )
        .route(
            "/coded/{n}",
            get(|Path(n): Path<u64>, headers: HeaderMap| async move {
                // Compressed when the client accepts it, as a compression
                // layer inside the limiter would.
                if headers.contains_key("accept-encoding") {
                    return Response::builder()
                        .header("content-type", "application/json")
                        .header("content-encoding", "gzip")
                        .body(Body::from(vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0]))
                        .expect("a response");
                }
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Body::from(format!(r#"{{"usage":{{"total_tokens":{n}}}}}"#)))
                    .expect("a response")
            }),
        )
}

const LIMIT: u32 = 1_000;

fn budget_rule(cost: ResponseCost) -> HttpRule {
    let quota = Quota::per_hour(NonZeroU32::new(LIMIT).expect("nonzero"));
    HttpRule::new("tokens", FixedWindow::new(quota)).cost(Cost::Response(Box::new(cost)))
}

fn app(cost: ResponseCost) -> (Router, RateLimitLayer<MemoryStore<TokioClock>>) {
    let layer = memory_layer(Policy::new([budget_rule(cost)]));
    (upstream().layer(layer.clone()), layer)
}

/// What the client's key has left, once every settle spawned so far has
/// run (the settles are the runtime's tasks: yielding lets them).
async fn left(layer: &RateLimitLayer<MemoryStore<TokioClock>>) -> u64 {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    let key = format!("ip={CLIENT}");
    let check = [Check {
        rule: RuleId(0),
        key: &key,
        cost: 0,
    }];
    layer.store().check_now(&check).expect("a peek").decisions[0].remaining
}

fn reserving(n: u64) -> ResponseCost {
    ResponseCost::usage(UsageField::Total).reserve(Reserve::Fixed(n))
}

fn by_header(n: u64) -> ResponseCost {
    ResponseCost::header(HeaderName::from_static("x-usage")).reserve(Reserve::Fixed(n))
}

async fn get_through(app: &Router, uri: &str) -> Response<Body> {
    let request = req(uri, CLIENT).body(Body::empty()).expect("a request");
    let res = app.clone().oneshot(request).await.expect("infallible");
    res.map(Body::new)
}

#[tokio::test(start_paused = true)]
async fn a_json_response_is_settled_at_its_usage() {
    let (app, layer) = app(reserving(300));
    let res = get_through(&app, "/json/120").await;
    assert_eq!(res.status(), StatusCode::OK);
    // The headers tell the state after the reservation.
    assert_eq!(
        header_u64(&res, "x-ratelimit-remaining"),
        u64::from(LIMIT) - 300
    );
    assert!(body_string(res).await.contains("\"total_tokens\":120"));
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 120);
}

#[tokio::test(start_paused = true)]
async fn a_stream_is_settled_at_its_last_usage() {
    let (app, layer) = app(reserving(300));
    let res = get_through(&app, "/sse/40").await;
    let body = body_string(res).await;
    assert_eq!(
        body.matches("\"content\"").count(),
        40,
        "every event passed"
    );
    assert!(body.ends_with("data: [DONE]\n\n"));
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 40);
}

#[tokio::test(start_paused = true)]
async fn a_stream_without_usage_pays_a_unit_per_delta() {
    let (app, layer) = app(reserving(300));
    let body = body_string(get_through(&app, "/deltas/25").await).await;
    assert!(body.ends_with("data: [DONE]\n\n"));
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 25);
}

#[tokio::test(start_paused = true)]
async fn a_cost_in_a_header_or_a_trailer_is_read() {
    let (app, layer) = app(by_header(100));
    body_string(get_through(&app, "/header/42").await).await;
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 42);
    body_string(get_through(&app, "/trailer/7").await).await;
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 49);
}

#[tokio::test(start_paused = true)]
async fn what_cannot_be_measured_keeps_its_reservation_unless_refused() {
    let (app, layer) = app(reserving(300));
    body_string(get_through(&app, "/text").await).await;
    assert_eq!(
        left(&layer).await,
        u64::from(LIMIT) - 300,
        "a 200 with no usage"
    );
    // The upstream refused the request: it cost nothing.
    body_string(get_through(&app, "/status/400").await).await;
    assert_eq!(
        left(&layer).await,
        u64::from(LIMIT) - 300,
        "a 4xx costs nothing"
    );
    // A 5xx is measured as any other, unless the rule gives it back.
    body_string(get_through(&app, "/status/502").await).await;
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 600);
    let (app, layer) = self::app(reserving(300).release_on_5xx(true));
    body_string(get_through(&app, "/status/502").await).await;
    assert_eq!(left(&layer).await, u64::from(LIMIT));
}

#[tokio::test(start_paused = true)]
async fn an_overrun_is_debt_that_later_requests_wait_out() {
    let (app, layer) = app(reserving(300));
    body_string(get_through(&app, "/json/1500").await).await;
    assert_eq!(left(&layer).await, 0);
    let res = get_through(&app, "/json/1").await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    // A fixed window of an hour: the debt is the window's, and it ends
    // with it.
    assert!(header_u64(&res, "retry-after") > 0);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_mid_stream_pays_what_it_was_sent() {
    let (app, layer) = app(reserving(300));
    let res = get_through(&app, "/deltas/50").await;
    let mut body = res.into_body();
    for _ in 0..3 {
        let frame = body.frame().await.expect("a frame").expect("no error");
        assert!(frame.is_data());
    }
    drop(body);
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 3);
}

#[tokio::test(start_paused = true)]
async fn a_response_dropped_before_its_head_keeps_its_reservation() {
    let (app, layer) = app(reserving(300));
    let request = req("/json/5", CLIENT)
        .body(Body::empty())
        .expect("a request");
    let fut = app.clone().oneshot(request);
    drop(fut);
    assert_eq!(left(&layer).await, u64::from(LIMIT));
    // Polled up to the head, then dropped with its body unread: nothing
    // measured, the reservation stands.
    let res = get_through(&app, "/json/5").await;
    drop(res);
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 300);
}

#[tokio::test(start_paused = true)]
async fn a_cut_stream_ends_at_the_budget_between_two_events() {
    let limit = 10;
    let quota = Quota::per_hour(NonZeroU32::new(limit).expect("nonzero"));
    let cost = reserving(2).on_overrun(Overrun::Cut);
    let rule =
        HttpRule::new("tokens", FixedWindow::new(quota)).cost(Cost::Response(Box::new(cost)));
    let layer = memory_layer(Policy::new([rule]));
    let app = upstream().layer(layer.clone());
    let body = body_string(get_through(&app, "/deltas/30").await).await;
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    let deltas = events.iter().filter(|e| e.contains("\"content\"")).count();
    assert_eq!(
        deltas, limit as usize,
        "the client gets the budget, not more"
    );
    // Then the cut event, well formed, and the end.
    let cut = events[deltas];
    assert!(cut.starts_with("event: error\ndata: {"), "{cut}");
    assert!(cut.contains("budget"), "{cut}");
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    assert_eq!(events.len(), deltas + 2);
    assert_eq!(left(&layer).await, 0);
    // The key is spent: the next request is denied.
    let res = get_through(&app, "/deltas/1").await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(start_paused = true)]
async fn two_cut_streams_of_one_key_share_its_budget() {
    let limit = 30;
    let quota = Quota::per_hour(NonZeroU32::new(limit).expect("nonzero"));
    let cost = reserving(4).on_overrun(Overrun::Cut);
    let rule =
        HttpRule::new("tokens", FixedWindow::new(quota)).cost(Cost::Response(Box::new(cost)));
    let layer = memory_layer(Policy::new([rule]));
    let app = upstream().layer(layer.clone());
    // Both admitted, then read in turns, a frame at a time.
    let mut a = get_through(&app, "/deltas/40").await.into_body();
    let mut b = get_through(&app, "/deltas/40").await.into_body();
    let (mut got_a, mut got_b) = (String::new(), String::new());
    let (mut a_done, mut b_done) = (false, false);
    while !(a_done && b_done) {
        for (body, got, done) in [
            (&mut a, &mut got_a, &mut a_done),
            (&mut b, &mut got_b, &mut b_done),
        ] {
            if *done {
                continue;
            }
            match body.frame().await {
                Some(frame) => {
                    if let Ok(data) = frame.expect("no error").into_data() {
                        got.push_str(std::str::from_utf8(&data).expect("utf-8"));
                    }
                }
                None => *done = true,
            }
        }
    }
    let sent = got_a.matches("\"content\"").count() + got_b.matches("\"content\"").count();
    assert_eq!(
        sent, limit as usize,
        "together, the budget: {got_a}\n{got_b}"
    );
    assert!(got_a.contains("event: error") && got_b.contains("event: error"));
    assert_eq!(left(&layer).await, 0);
}

#[tokio::test(start_paused = true)]
async fn accepting_a_compressed_body_does_not_make_a_response_unmeasurable() {
    let (app, layer) = app(reserving(300));
    let request = req("/coded/40", CLIENT)
        .header("accept-encoding", "gzip, br")
        .body(Body::empty())
        .expect("a request");
    let res = app.clone().oneshot(request).await.expect("infallible");
    assert!(!res.headers().contains_key("content-encoding"));
    body_string(res).await;
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 40);
}

/// Every budget event an observer hears, as (rule, event).
#[derive(Clone, Default)]
struct Heard(std::sync::Arc<std::sync::Mutex<Vec<(String, BudgetEvent)>>>);

impl Observer for Heard {
    fn observe(&self, _: &str, _: spillway_tower::RuleOutcome, _: Option<&spillway::Decision>) {}

    fn budget(&self, rule: &str, event: BudgetEvent) {
        self.0
            .lock()
            .expect("not poisoned")
            .push((rule.to_string(), event));
    }
}

#[tokio::test(start_paused = true)]
async fn the_observer_hears_each_reservation_open_and_close_once() {
    let heard = Heard::default();
    let layer = memory_layer(Policy::new([budget_rule(reserving(100))])).observer(heard.clone());
    let app = upstream().layer(layer.clone());
    let closed = |how, charged, actual| BudgetEvent::Closed {
        how,
        charged,
        actual,
    };
    let cases = [
        ("/json/120", closed(Settled::Measured, 100, 120)),
        ("/status/429", closed(Settled::Released, 100, 0)),
        ("/json/450", closed(Settled::Measured, 100, 450)),
        ("/text", closed(Settled::Kept, 100, 100)),
    ];
    for (uri, expected) in cases {
        body_string(get_through(&app, uri).await).await;
        left(&layer).await;
        let events = std::mem::take(&mut *heard.0.lock().expect("not poisoned"));
        let events: Vec<BudgetEvent> = events
            .into_iter()
            .map(|(rule, e)| {
                assert_eq!(rule, "tokens");
                e
            })
            .collect();
        assert_eq!(events, [BudgetEvent::Opened, expected], "{uri}");
    }
    // Left mid-stream: closed once, at what was sent.
    let mut body = get_through(&app, "/deltas/9").await.into_body();
    body.frame().await.expect("a frame").expect("no error");
    drop(body);
    left(&layer).await;
    let events: Vec<BudgetEvent> = heard
        .0
        .lock()
        .expect("not poisoned")
        .iter()
        .map(|(_, e)| *e)
        .collect();
    assert_eq!(events, [BudgetEvent::Opened, closed(Settled::Left, 100, 1)]);
}

fn cut_rule(limit: u32, cost: ResponseCost) -> (Router, RateLimitLayer<MemoryStore<TokioClock>>) {
    let quota = Quota::per_hour(NonZeroU32::new(limit).expect("nonzero"));
    let rule = HttpRule::new("tokens", FixedWindow::new(quota))
        .cost(Cost::Response(Box::new(cost.on_overrun(Overrun::Cut))));
    let layer = memory_layer(Policy::new([rule]));
    (upstream().layer(layer.clone()), layer)
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_before_its_first_event_still_pays_its_prompt() {
    let (app, layer) = cut_rule(100, reserving(10));
    let request = req("/deltas/30", CLIENT)
        .extension(RequestReserve {
            prompt_estimate: 500,
            ..RequestReserve::default()
        })
        .body(Body::empty())
        .expect("a request");
    let res = app.clone().oneshot(request).await.expect("infallible");
    let body = body_string(res).await;
    assert!(!body.contains("\"content\""), "{body}");
    assert!(body.starts_with("event: error"), "{body}");
    assert_eq!(left(&layer).await, 0, "the prompt is charged, as debt");
}

#[tokio::test(start_paused = true)]
async fn a_stream_whose_usage_event_is_cut_pays_the_usage() {
    let (app, layer) = cut_rule(100, reserving(10));
    let body = body_string(get_through(&app, "/reported/5/500").await).await;
    assert_eq!(body.matches("\"content\"").count(), 5);
    assert!(body.contains("event: error"), "{body}");
    assert_eq!(
        left(&layer).await,
        0,
        "the usage reported, not the 5 deltas"
    );
}

#[tokio::test(start_paused = true)]
async fn a_5xx_is_given_back_only_if_the_upstream_answered_it_and_measured_nothing() {
    let (app, layer) = app(reserving(300).release_on_5xx(true));
    body_string(get_through(&app, "/unanswered").await).await;
    assert_eq!(
        left(&layer).await,
        u64::from(LIMIT) - 300,
        "its answer never came"
    );
    body_string(get_through(&app, "/failed-after/40").await).await;
    assert_eq!(
        left(&layer).await,
        u64::from(LIMIT) - 340,
        "measured: charged"
    );
}

#[tokio::test(start_paused = true)]
async fn a_long_stream_on_a_small_reservation_costs_few_store_calls() {
    let quota = Quota::per_hour(NonZeroU32::new(100_000).expect("nonzero"));
    let cost = reserving(1).on_overrun(Overrun::Cut);
    let policy = Policy::new([
        HttpRule::new("tokens", FixedWindow::new(quota)).cost(Cost::Response(Box::new(cost)))
    ]);
    let store = CountingStore::new(policy.store_rules());
    let layer = RateLimitLayer::new(policy, store).expect("the store fits");
    let app = upstream().layer(layer.clone());
    let body = body_string(get_through(&app, "/deltas/2000").await).await;
    assert_eq!(body.matches("\"content\"").count(), 2000);
    let calls = layer.store().take_calls().len();
    assert!(calls <= 4, "{calls} store calls");
}

#[tokio::test(start_paused = true)]
async fn a_cut_stream_sends_its_trailers_last() {
    let (app, _layer) = cut_rule(100, reserving(10));
    let mut body = get_through(&app, "/trailed").await.into_body();
    let mut kinds = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("no error");
        kinds.push(if frame.is_trailers() {
            "trailers"
        } else {
            "data"
        });
    }
    assert_eq!(kinds.last(), Some(&"trailers"), "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| **k == "trailers").count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_last_event_ended_by_a_lone_cr_is_cut_too() {
    let (app, layer) = cut_rule(10, reserving(2));
    let body = body_string(get_through(&app, "/cr/11").await).await;
    assert_eq!(body.matches("\"content\"").count(), 10, "{body:?}");
    assert!(body.contains("event: error"), "{body:?}");
    assert_eq!(left(&layer).await, 0);
}

/// `app` on a sliding log of an hour: no window edge for a test that moves
/// the clock to cross, wherever the clock starts.
fn log_app(cost: ResponseCost) -> (Router, RateLimitLayer<MemoryStore<TokioClock>>) {
    let quota = Quota::per_hour(NonZeroU32::new(LIMIT).expect("nonzero"));
    let rule = HttpRule::new("tokens", SlidingLog::new(quota)).cost(Cost::Response(Box::new(cost)));
    let layer = memory_layer(Policy::new([rule]));
    (upstream().layer(layer.clone()), layer)
}

/// `on_expiry = "release"`: a reservation comes back by itself only when
/// no settle closed it in time; one settled (at its usage, or kept at its
/// reservation) never comes back a second time, and a response that
/// outlives its time is charged in full when it ends.
#[tokio::test(start_paused = true)]
async fn a_released_reservation_comes_back_only_when_nothing_settled_it() {
    let within = std::time::Duration::from_secs(60);
    let limit = u64::from(LIMIT);
    let (app, layer) = log_app(reserving(300).release_unsettled_after(within));
    body_string(get_through(&app, "/json/120").await).await;
    // Nothing measured: the reservation stands, and is closed as it is.
    body_string(get_through(&app, "/text").await).await;
    assert_eq!(left(&layer).await, limit - 420);
    tokio::time::advance(within * 2).await;
    assert_eq!(left(&layer).await, limit - 420, "settled ones stay settled");
    assert_eq!(layer.store().reservations_released(), 0);

    // A stream still running when its time comes.
    let mut body = get_through(&app, "/deltas/50").await.into_body();
    for _ in 0..2 {
        assert!(
            body.frame()
                .await
                .expect("a frame")
                .expect("no error")
                .is_data()
        );
    }
    assert_eq!(left(&layer).await, limit - 720);
    tokio::time::advance(within).await;
    assert_eq!(left(&layer).await, limit - 420, "given back at its time");
    assert_eq!(layer.store().reservations_released(), 1);
    while let Some(frame) = body.frame().await {
        frame.expect("no error");
    }
    assert_eq!(left(&layer).await, limit - 470, "then charged in full");
}

/// A caller whose settle can come no later than a time shorter than the
/// rule's (a `POST /v1/check` token's life, a Kuadrant `Reserve`'s ttl)
/// has its reservation held no longer: a settle it can still send finds
/// it, and one it cannot send does not leave it given back for nothing.
#[tokio::test(start_paused = true)]
async fn a_reservation_is_held_no_longer_than_its_caller_asks() {
    let within = std::time::Duration::from_secs(3600);
    let (_, layer) = log_app(reserving(300).release_unsettled_after(within));
    let engine = layer.engine();
    let at_most = std::time::Duration::from_secs(5);
    let asking = spillway_tower::Asking {
        hold_at_most: Some(at_most),
        ..spillway_tower::Asking::default()
    };
    let charge = engine.charge(0, None, format!("ip={CLIENT}"), 300);
    let ruling = engine.decide(smallvec::smallvec![charge], asking).await;
    let held = ruling.into_held().expect("charged");
    assert!(held.charges()[0].1.held);
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 300);
    tokio::time::advance(at_most).await;
    assert_eq!(
        left(&layer).await,
        u64::from(LIMIT),
        "given back at 5 s, not 1 h"
    );
}

/// Without `on_expiry = "release"`, a reservation never settled (its
/// settle lost with the instance) stays charged however long it is left.
#[tokio::test(start_paused = true)]
async fn without_release_an_open_reservation_stays_charged() {
    let (app, layer) = log_app(reserving(300));
    let mut body = get_through(&app, "/deltas/50").await.into_body();
    assert!(
        body.frame()
            .await
            .expect("a frame")
            .expect("no error")
            .is_data()
    );
    tokio::time::advance(std::time::Duration::from_secs(600)).await;
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 300);
    std::mem::forget(body);
    assert_eq!(left(&layer).await, u64::from(LIMIT) - 300);
}

/// A settle whose overrun leaves the key nothing is told once, after its
/// close; one the key could pay is not.
#[tokio::test(start_paused = true)]
async fn the_observer_hears_an_overrun_that_exhausts_the_key() {
    let heard = Heard::default();
    let layer = memory_layer(Policy::new([budget_rule(reserving(100))])).observer(heard.clone());
    let app = upstream().layer(layer.clone());
    let events = |uri: &'static str| {
        let app = app.clone();
        let (layer, heard) = (layer.clone(), heard.clone());
        async move {
            body_string(get_through(&app, uri).await).await;
            left(&layer).await;
            let taken = std::mem::take(&mut *heard.0.lock().expect("not poisoned"));
            taken.into_iter().map(|(_, e)| e).collect::<Vec<_>>()
        }
    };
    let closed = |charged, actual| BudgetEvent::Closed {
        how: Settled::Measured,
        charged,
        actual,
    };
    assert_eq!(
        events("/json/600").await,
        [BudgetEvent::Opened, closed(100, 600)]
    );
    // 600 + 700 > 1,000: in debt.
    assert_eq!(
        events("/json/700").await,
        [
            BudgetEvent::Opened,
            closed(100, 700),
            BudgetEvent::Exhausted
        ]
    );
}

/// `[headers] openai`: the family LLM client libraries read, of the
/// request's budget rule, beside the usual fields; none on a response no
/// budget rule applied to. (A token bucket and a sliding log: no window
/// edge for the clock to cross.)
#[tokio::test(start_paused = true)]
async fn the_openai_token_fields_describe_the_budget() {
    let nz = |n| NonZeroU32::new(n).expect("nonzero");
    let per_ip = HttpRule::new("requests", SlidingLog::new(Quota::per_hour(nz(50))));
    // 1,000 an hour: a token is 3.6 s.
    let bucket = TokenBucket::new(Quota::per_hour(nz(LIMIT)), nz(LIMIT));
    let budget = HttpRule::new("tokens", bucket)
        .cost(Cost::Response(Box::new(reserving(300))))
        .path("/json/**");
    let policy = Policy::new([per_ip, budget]).headers(spillway_tower::HeaderOptions {
        openai: true,
        ..spillway_tower::HeaderOptions::default()
    });
    let layer = memory_layer(policy);
    let app = upstream().layer(layer.clone());
    let res = get_through(&app, "/json/120").await;
    assert_eq!(
        header_u64(&res, "x-ratelimit-limit-tokens"),
        u64::from(LIMIT)
    );
    assert_eq!(
        header_u64(&res, "x-ratelimit-remaining-tokens"),
        u64::from(LIMIT) - 300
    );
    // 300 tokens to refill: 1,080 s.
    assert_eq!(res.headers()["x-ratelimit-reset-tokens"], "18m0s");
    // The usual fields report the rule with the least left, as ever.
    assert_eq!(header_u64(&res, "x-ratelimit-remaining"), 49);
    body_string(res).await;
    // Settled at 120 (432 s to refill), 10 s on, 300 more (1,080 s): 1,502 s.
    tokio::time::advance(std::time::Duration::from_secs(10)).await;
    let res = get_through(&app, "/json/1").await;
    assert_eq!(res.headers()["x-ratelimit-reset-tokens"], "25m2s");
    body_string(res).await;
    let res = get_through(&app, "/text").await;
    assert!(res.headers().get("x-ratelimit-limit-tokens").is_none());
    assert_eq!(header_u64(&res, "x-ratelimit-remaining"), 47);
}

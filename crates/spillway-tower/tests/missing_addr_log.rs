//! A request without the client's address is logged as an error once per
//! layer, not once per request.
//!
//! Alone in its test binary: tracing caches, per call site, whether anyone
//! listens, and another test hitting the same call site on another thread
//! at the same time could leave this one's subscriber unasked.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway_tower::{HttpRule, Policy, RateLimitLayer};
use tower::ServiceExt;

/// Counts the error events logged while it is the default subscriber.
struct CountErrors(Arc<AtomicUsize>);

impl tracing::Subscriber for CountErrors {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn app() -> Router {
    let n = NonZeroU32::new(5).expect("nonzero");
    let login = HttpRule::new("login", TokenBucket::new(Quota::per_hour(n), n));
    Router::new()
        .route("/login", get(|| async { "welcome" }))
        .layer(RateLimitLayer::in_memory(Policy::new([login])))
}

async fn send_without_addr(app: &Router) -> StatusCode {
    let req = Request::get("/login")
        .body(Body::empty())
        .expect("a request");
    app.clone().oneshot(req).await.expect("infallible").status()
}

#[tokio::test(flavor = "current_thread")]
async fn the_missing_address_is_logged_once_per_layer() {
    let errors = Arc::new(AtomicUsize::new(0));
    let _guard = tracing::subscriber::set_default(CountErrors(errors.clone()));
    let app = app();
    for _ in 0..5 {
        assert_eq!(
            send_without_addr(&app).await,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
    assert_eq!(errors.load(Ordering::Relaxed), 1);
    // Another layer logs its own.
    send_without_addr(&self::app()).await;
    assert_eq!(errors.load(Ordering::Relaxed), 2);
}

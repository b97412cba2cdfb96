//! Requests without the client's address: an app served without
//! `ConnectInfo` must not silently go unlimited.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use spillway_tower::{HttpRule, KeyPart, MissingClientAddr, Policy};
use tower::ServiceExt;

use crate::support::{body_json, bucket, header, memory_layer};

/// An app with `policy` whose handler counts its calls.
fn counting_app(policy: Policy) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let app = Router::new()
        .route(
            "/login",
            get(move || {
                counter.fetch_add(1, Ordering::Relaxed);
                async { "welcome" }
            }),
        )
        .layer(memory_layer(policy));
    (app, calls)
}

/// A request as `axum::serve(listener, app)` hands it over: no
/// `ConnectInfo`, no `ClientAddr`.
async fn send_without_addr(app: &Router) -> http::Response<Body> {
    let req = Request::get("/login")
        .body(Body::empty())
        .expect("a request");
    app.clone().oneshot(req).await.expect("infallible")
}

#[tokio::test(start_paused = true)]
async fn without_the_peer_address_an_ip_rule_answers_500_not_unlimited() {
    let (app, calls) = counting_app(Policy::new([HttpRule::new("login", bucket(5))]));
    for _ in 0..3 {
        let res = send_without_addr(&app).await;
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            header(&res, "content-type").as_deref(),
            Some("application/problem+json")
        );
        let body = body_json(res).await;
        let detail = body["detail"].as_str().expect("a detail");
        assert!(detail.contains("`login`"), "{detail}");
        assert!(detail.contains("ConnectInfo"), "{detail}");
        assert!(
            detail.contains("into_make_service_with_connect_info::<SocketAddr>()"),
            "{detail}"
        );
    }
    assert_eq!(
        calls.load(Ordering::Relaxed),
        0,
        "the handler ran unlimited"
    );
}

#[tokio::test]
async fn an_app_served_without_connect_info_gets_the_error() {
    // The mistake as it is made: plain `axum::serve(listener, app)`.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (app, calls) = counting_app(Policy::new([HttpRule::new("login", bucket(5))]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(b"GET /login HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    assert!(
        response.starts_with("HTTP/1.1 500"),
        "{}",
        response.lines().next().unwrap_or_default()
    );
    assert!(response.contains("into_make_service_with_connect_info"));
    assert_eq!(calls.load(Ordering::Relaxed), 0);
    server.abort();
}

#[tokio::test(start_paused = true)]
async fn skipping_the_rule_is_an_explicit_choice() {
    let policy = Policy::new([HttpRule::new("login", bucket(1))])
        .on_missing_client_addr(MissingClientAddr::SkipRule);
    let (app, calls) = counting_app(policy);
    for _ in 0..3 {
        assert_eq!(send_without_addr(&app).await.status(), StatusCode::OK);
    }
    assert_eq!(calls.load(Ordering::Relaxed), 3);
}

#[tokio::test(start_paused = true)]
async fn a_rule_whose_key_needs_no_address_still_applies() {
    let per_key = HttpRule::new("per-key", bucket(1))
        .key([KeyPart::ApiKey])
        .fallback([]);
    let (app, _) = counting_app(Policy::new([per_key]));
    let send = |key: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::get("/login")
                .header("x-api-key", key)
                .body(Body::empty())
                .expect("a request");
            app.oneshot(req).await.expect("infallible").status()
        }
    };
    assert_eq!(send("k").await, StatusCode::OK);
    assert_eq!(send("k").await, StatusCode::TOO_MANY_REQUESTS);
    // Without an API key the rule does not apply, as configured; it never
    // needed the address.
    assert_eq!(send_without_addr(&app).await.status(), StatusCode::OK);
}

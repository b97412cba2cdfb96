//! An axum app with three rate limits: per client IP on everything, per API
//! key (with a free and a pro tier) on `/api/**`, and a strict limit on
//! login attempts. `/api/report` degrades instead of rejecting: over the
//! limit it serves a cached summary.
//!
//! Run with: `cargo run -p example-axum-app` then, in another shell,
//! `for i in $(seq 6); do curl -si -X POST localhost:3000/login | head -1; done`
//! (the sixth attempt within a minute gets `429 Too Many Requests`), or
//! `curl -si -H 'x-api-key: free-key' localhost:3000/api/hello`.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use axum::Router;
use axum::extract::Extension;
use axum::routing::{get, post};
use spillway::Quota;
use spillway::algorithm::{SlidingLog, SlidingWindow, TokenBucket};
use spillway_tower::{Action, HttpRule, KeyPart, Limited, Policy, RateLimitLayer};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

fn policy() -> Policy {
    let minute = Duration::from_secs(60);
    let per_ip = HttpRule::new(
        "per-ip",
        TokenBucket::new(Quota::per_second(nz(20)), nz(40)),
    );
    let per_key = HttpRule::new("per-key", SlidingWindow::new(Quota::per_minute(nz(100))))
        .path("/api/**")
        .key([KeyPart::ApiKey])
        .tier("pro", SlidingWindow::new(Quota::per_minute(nz(10_000))));
    let reports = HttpRule::new(
        "reports",
        SlidingWindow::new(Quota::new(nz(2), minute).expect("a valid window")),
    )
    .path("/api/report")
    .key([KeyPart::ApiKey])
    .action(Action::Degrade);
    // The sliding log: exact in any minute, and its memory is bounded by the
    // limit, so small limits such as logins are what it suits (docs/algorithms.md).
    let login = HttpRule::new("login", SlidingLog::new(Quota::per_minute(nz(5))))
        .methods([axum::http::Method::POST])
        .path("/login");
    Policy::new([per_ip, per_key, reports, login])
        .api_key_tier("free-key", "free")
        .api_key_tier("pro-key", "pro")
}

async fn report(limited: Option<Extension<Limited>>) -> &'static str {
    match limited {
        Some(_) => "cached summary (you are over the report limit)\n",
        None => "fresh, expensive report\n",
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route("/api/hello", get(|| async { "hello, API client\n" }))
        .route("/api/report", get(report))
        .route("/login", post(|| async { "login attempt recorded\n" }))
        .layer(RateLimitLayer::in_memory(policy()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        tokio::signal::ctrl_c().await.ok();
    })
    .await
}

//! An axum hello-world with the rate limiter (in-memory store, a rule that
//! never denies) against the same app without it, measured with `wrk` on
//! loopback in the same run, rounds alternating.
//!
//! Run with: `cargo bench -p spillway-tower --bench http`
//! (needs `wrk` on PATH: Debian package `wrk`). `SPILLWAY_BENCH_SECONDS`
//! sets each wrk run's length (default 10), `SPILLWAY_BENCH_ROUNDS` the
//! number of rounds (default 3).

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::process::Command;

use axum::Router;
use axum::routing::get;
use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway_tower::{HttpRule, Policy, RateLimitLayer};

fn hello() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

fn limited() -> Router {
    let never = NonZeroU32::new(1_000_000_000).expect("nonzero");
    let rule = HttpRule::new("per-ip", TokenBucket::new(Quota::per_second(never), never));
    hello().layer(RateLimitLayer::in_memory(Policy::new([rule])))
}

/// Serves `app` on a free loopback port, in the background.
fn serve(runtime: &tokio::runtime::Runtime, app: Router) -> SocketAddr {
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("an address");
        tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .ok();
        });
        addr
    })
}

/// wrk's requests per second against `addr`.
fn wrk(addr: SocketAddr, seconds: u64) -> f64 {
    let out = Command::new("wrk")
        .args([
            "-t1",
            "-c50",
            &format!("-d{seconds}s"),
            &format!("http://{addr}/"),
        ])
        .output()
        .expect("wrk runs (install the Debian package wrk)");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no rate in wrk's output: {text}"))
}

fn main() {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let seconds = env("SPILLWAY_BENCH_SECONDS", 10);
    let rounds = env("SPILLWAY_BENCH_ROUNDS", 3);
    // One worker: the server gets one core, wrk the other.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let bare = serve(&runtime, hello());
    let with = serve(&runtime, limited());
    // Warm up both.
    wrk(bare, 1);
    wrk(with, 1);
    let (mut bare_rates, mut with_rates) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        bare_rates.push(wrk(bare, seconds));
        with_rates.push(wrk(with, seconds));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (b, w) = (median(&mut bare_rates), median(&mut with_rates));
    println!("axum hello world, wrk -t1 -c50, {rounds} rounds of {seconds}s, medians:");
    println!("  without the layer: {b:>10.0} req/s  {bare_rates:.0?}");
    println!("  with the layer:    {w:>10.0} req/s  {with_rates:.0?}");
    println!("  ratio: {:.3}", w / b);
}

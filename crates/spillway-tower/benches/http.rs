//! An axum hello-world with the rate limiter (in-memory store, a rule that
//! never denies) against the same app without it, measured with `wrk` on
//! loopback in the same run, rounds alternating; and, as a control, the
//! bare app answering with five headers as long as the layer's.
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
use http::HeaderValue;
use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway_tower::headers::{
    RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
use spillway_tower::{HttpRule, Policy, RateLimitLayer};

fn hello() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

/// The control: the bare app answering with the five headers the layer
/// writes (the same names and lengths), made once: what inserting,
/// encoding, sending and parsing them costs, without the rate limiter.
fn with_static_headers() -> Router {
    let headers = [
        (X_RATELIMIT_LIMIT, "1000000000"),
        (X_RATELIMIT_REMAINING, "999999999"),
        (X_RATELIMIT_RESET, "1796000000"),
        (RATELIMIT_POLICY, "\"per-ip\";q=1000000000;w=1"),
        (RATELIMIT, "\"per-ip\";r=999999999;t=1"),
    ]
    .map(|(name, value)| (name, HeaderValue::from_static(value)));
    Router::new().route("/", get(move || async move { (headers, "hello") }))
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
    let control = serve(&runtime, with_static_headers());
    // Warm up all three.
    for addr in [bare, with, control] {
        wrk(addr, 1);
    }
    let (mut bare_rates, mut with_rates, mut control_rates) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        bare_rates.push(wrk(bare, seconds));
        with_rates.push(wrk(with, seconds));
        control_rates.push(wrk(control, seconds));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (b, w) = (median(&mut bare_rates), median(&mut with_rates));
    let c = median(&mut control_rates);
    println!("axum hello world, wrk -t1 -c50, {rounds} rounds of {seconds}s, medians:");
    println!("  without the layer:          {b:>10.0} req/s  {bare_rates:.0?}");
    println!("  with the layer:             {w:>10.0} req/s  {with_rates:.0?}");
    println!("  without, 5 static headers:  {c:>10.0} req/s  {control_rates:.0?}");
    println!("  ratio, layer / bare:           {:.3}", w / b);
    println!("  ratio, static headers / bare:  {:.3}", c / b);
    println!("  ratio, layer / static headers: {:.3}", w / c);
}

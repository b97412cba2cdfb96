//! An axum hello-world with the rate limiter (in-memory store, a rule that
//! never denies) against the same app without it and behind the peer,
//! `tower_governor` (a per-peer-IP limit that never denies), measured with
//! `wrk` on loopback in the same run, rounds alternating; and, as a
//! control, the bare app answering with five headers as long as the
//! layer's.
//!
//! Run with: `cargo bench -p spillway-tower --bench http`
//! (needs `wrk` on PATH: Debian package `wrk`). `SPILLWAY_BENCH_SECONDS`
//! sets each wrk run's length (default 10), `SPILLWAY_BENCH_ROUNDS` the
//! number of rounds (default 3).

mod common;

use std::net::SocketAddr;
use std::process::Command;

use axum::Router;
use axum::routing::get;
use common::{governed, hello, limited};
use http::HeaderValue;
use spillway_tower::HeaderOptions;
use spillway_tower::headers::{
    RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};

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

/// CPU seconds used so far by this process (the servers: user, then
/// system) and by its waited-for children (the wrk runs), from
/// /proc/self/stat (ticks of 1/100 s, `getconf CLK_TCK` on Linux).
fn cpu_seconds() -> (f64, f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name, which is in parentheses.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let field = |n: usize| -> f64 {
        rest.split_whitespace()
            .nth(n)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime, stime, cutime, cstime are fields 14 to 17; `rest` starts at 3.
    (
        field(11) / 100.0,
        field(12) / 100.0,
        (field(13) + field(14)) / 100.0,
    )
}

/// One wrk run: requests per second, and the server's CPU time (all, and
/// its user-space part) and wrk's per request in microseconds.
struct Run {
    rate: f64,
    server_us: f64,
    user_us: f64,
    wrk_us: f64,
}

/// Runs wrk against `addr` for `seconds`.
fn wrk(addr: SocketAddr, seconds: u64) -> Run {
    let (user0, system0, wrk0) = cpu_seconds();
    let out = Command::new("wrk")
        .args([
            "-t1",
            "-c50",
            &format!("-d{seconds}s"),
            &format!("http://{addr}/"),
        ])
        .output()
        .expect("wrk runs (install the Debian package wrk)");
    let (user1, system1, wrk1) = cpu_seconds();
    let text = String::from_utf8_lossy(&out.stdout);
    let rate: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no rate in wrk's output: {text}"));
    let requests = rate * seconds as f64;
    Run {
        rate,
        server_us: (user1 + system1 - user0 - system0) * 1e6 / requests,
        user_us: (user1 - user0) * 1e6 / requests,
        wrk_us: (wrk1 - wrk0) * 1e6 / requests,
    }
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
    let no_headers = HeaderOptions {
        legacy: false,
        ietf: false,
        ..HeaderOptions::default()
    };
    let apps = [
        ("without the layer", serve(&runtime, hello())),
        (
            "layer, both families",
            serve(&runtime, limited(HeaderOptions::default())),
        ),
        ("layer, no headers", serve(&runtime, limited(no_headers))),
        ("tower_governor", serve(&runtime, governed(false))),
        ("tower_governor, headers", serve(&runtime, governed(true))),
        (
            "without, 5 static headers",
            serve(&runtime, with_static_headers()),
        ),
    ];
    // Warm up each.
    for (_, addr) in apps {
        wrk(addr, 1);
    }
    let mut runs: [Vec<Run>; 6] = Default::default();
    // Each round starts with the next app: none always runs first (or
    // after the same one).
    for round in 0..rounds as usize {
        for k in 0..apps.len() {
            let i = (round + k) % apps.len();
            runs[i].push(wrk(apps[i].1, seconds));
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("axum hello world, wrk -t1 -c50, {rounds} rounds of {seconds}s, medians:");
    let mut rates = [0.0; 6];
    let mut cpu = [0.0; 6];
    for (i, (name, _)) in apps.iter().enumerate() {
        let all: Vec<f64> = runs[i].iter().map(|r| r.rate).collect();
        rates[i] = median(all.clone());
        cpu[i] = median(runs[i].iter().map(|r| r.server_us).collect());
        let user_us = median(runs[i].iter().map(|r| r.user_us).collect());
        let wrk_us = median(runs[i].iter().map(|r| r.wrk_us).collect());
        println!(
            "  {name:<26} {:>9.0} req/s {all:.0?}; CPU per request: server {:.2} us (user {user_us:.2}), wrk {wrk_us:.2} us",
            rates[i], cpu[i]
        );
    }
    let ratios = [
        ("layer (both) / bare", 1, 0),
        ("layer (no headers) / bare", 2, 0),
        ("tower_governor / bare", 3, 0),
        ("layer (no headers) / tower_governor", 2, 3),
        ("layer (both) / tower_governor (headers)", 1, 4),
        ("static headers / bare", 5, 0),
    ];
    println!("  ratios: throughput, and server CPU a request (the second's / the first's):");
    for (name, a, b) in ratios {
        println!(
            "  {name:<40} {:.3}  {:.3}",
            rates[a] / rates[b],
            cpu[b] / cpu[a]
        );
    }
}

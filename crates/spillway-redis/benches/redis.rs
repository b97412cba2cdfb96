//! Decisions per second from one process against a real redis-server, next
//! to `redis-benchmark` running the same script with the same arguments at
//! the same concurrency, in the same run; and the deny-cache path.
//!
//! Run with: `cargo bench -p spillway-redis --bench redis`
//! (needs `redis-server` and `redis-benchmark` on PATH; starts its own server
//! on a free loopback port). `SPILLWAY_BENCH_REQUESTS` sets the requests per
//! measurement (default 200 000).
//!
//! With `SPILLWAY_BENCH_RLFLEX` set to a `node_modules` directory holding
//! rate-limiter-flexible and ioredis (`npm install --prefix
//! target/bench-tools/rlflex rate-limiter-flexible ioredis`), it also runs
//! `benches/rlflex.js` against the same redis-server, alternating with our
//! `fixed_window` for three rounds (`SPILLWAY_BENCH_ROUNDS`), and reports
//! the medians of both rates and the Redis
//! server's own time per script call; then an estimate of Redis's ceiling
//! (redis-benchmark keeping it busy) for our fixed window and for
//! `benches/floor.lua`, the two commands (`TIME`, `INCRBY`) that any fixed
//! window reading the server's clock must at least run.

use std::num::NonZeroU32;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spillway::Quota;
use spillway::algorithm::{
    AnyAlgorithm, FixedWindow, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket,
};
use spillway::store::{Check, Rule, RuleId, Store};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_redis::{RedisOptions, RedisStore, Topology};

const CONCURRENCY: usize = 50;
// Distinct keys, as redis-benchmark's -r: spread like real clients.
const KEYSPACE: u64 = 100_000;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("nonzero")
}

/// redis-benchmark's requests per second for EVALSHA of our script.
/// redis-benchmark's rate for `EVALSHA sha 1 key args...`, with `pipeline`
/// commands in flight per connection (1: none, as our callers; more:
/// enough to keep Redis itself busy, which estimates the script's ceiling).
fn redis_benchmark(
    port: u16,
    requests: usize,
    pipeline: usize,
    sha: &str,
    key: &str,
    args: &[String],
) -> f64 {
    let mut cmd = Command::new("redis-benchmark");
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", &CONCURRENCY.to_string(), "-n", &requests.to_string()])
        .args(["-P", &pipeline.to_string()])
        .args([
            "-r",
            &KEYSPACE.to_string(),
            "--csv",
            "EVALSHA",
            sha,
            "1",
            key,
        ]);
    for a in args {
        // redis-benchmark takes an empty argument as "".
        cmd.arg(if a.is_empty() { "" } else { a });
    }
    let out = cmd.output().expect("redis-benchmark runs");
    let text = String::from_utf8_lossy(&out.stdout);
    // CSV: "test","rps",...
    text.lines()
        .filter_map(|l| l.split(',').nth(1))
        .filter_map(|v| v.trim_matches('"').parse::<f64>().ok())
        .next()
        .unwrap_or_else(|| panic!("no rate in redis-benchmark's output: {text}"))
}

/// Our decisions per second: `CONCURRENCY` tasks sharing one store.
async fn ours(store: Arc<RedisStore>, requests: usize, hot_key: Option<&str>) -> f64 {
    let per_task = requests / CONCURRENCY;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..CONCURRENCY {
        let store = store.clone();
        let hot = hot_key.map(str::to_string);
        tasks.spawn(async move {
            let mut x = (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for _ in 0..per_task {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let key = hot.clone().unwrap_or_else(|| format!("k{}", x % KEYSPACE));
                let checks = [Check {
                    rule: RuleId(0),
                    key: &key,
                    cost: 1,
                }];
                store.check(&checks).await.expect("a decision");
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    (per_task * CONCURRENCY) as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let Some(server) = RedisServer::start() else {
        eprintln!("redis-server is missing: nothing measured");
        return;
    };
    let requests: usize = std::env::var("SPILLWAY_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    // A quota that never denies during the run: both sides do the full
    // admit-and-write path.
    let big = Quota::new(nz(1_000_000), Duration::from_secs(3600)).expect("valid");
    let algorithms: [(&str, AnyAlgorithm); 6] = [
        ("token_bucket", TokenBucket::new(big, nz(1_000_000)).into()),
        (
            "leaky_bucket (police)",
            LeakyBucket::police(big, nz(1_000_000)).into(),
        ),
        ("fixed_window", FixedWindow::new(big).into()),
        ("sliding_window", SlidingWindow::new(big).into()),
        (
            "sliding_log",
            SlidingLog::new(Quota::new(nz(10_000), Duration::from_secs(3600)).expect("valid"))
                .into(),
        ),
        (
            "leaky_bucket (shape)",
            LeakyBucket::shape(big, nz(1_000_000)).into(),
        ),
    ];
    println!(
        "{CONCURRENCY} concurrent callers, {requests} requests each side, keys spread over {KEYSPACE}"
    );
    println!(
        "{:<24} {:>14} {:>18} {:>7}",
        "algorithm", "spillway /s", "redis-benchmark /s", "ratio"
    );
    for (name, algorithm) in algorithms {
        let store = runtime
            .block_on(RedisStore::connect(
                Topology::Standalone(server.url()),
                vec![Rule::new(name, algorithm)],
                RedisOptions {
                    timeout: Duration::from_secs(5),
                    deny_cache_entries: 0,
                    ..RedisOptions::default()
                },
            ))
            .expect("connects");
        let (sha, key, args) = spread_call(&server, &store);
        let theirs = redis_benchmark(server.port(), requests, 1, &sha, &key, &args);
        let store = Arc::new(store);
        // Warm up the connection and the script cache.
        runtime.block_on(ours(store.clone(), CONCURRENCY * 100, None));
        let mine = runtime.block_on(ours(store.clone(), requests, None));
        println!(
            "{name:<24} {mine:>14.0} {theirs:>18.0} {:>7.2}",
            mine / theirs
        );
    }

    on_a_cluster(&runtime, requests);

    if let Ok(modules) = std::env::var("SPILLWAY_BENCH_RLFLEX") {
        against_rlflex(&runtime, &server, requests, &modules);
    }

    // The deny-cache path: one key, over its limit, hammered by every caller.
    let tiny = Quota::new(nz(1), Duration::from_secs(3600)).expect("valid");
    let rules = vec![Rule::new("denied", FixedWindow::new(tiny))];
    let with_cache = Arc::new(
        runtime
            .block_on(RedisStore::connect(
                Topology::Standalone(server.url()),
                rules.clone(),
                RedisOptions::default(),
            ))
            .expect("connects"),
    );
    let without_cache = Arc::new(
        runtime
            .block_on(RedisStore::connect(
                Topology::Standalone(server.url()),
                rules,
                RedisOptions {
                    deny_cache_entries: 0,
                    ..RedisOptions::default()
                },
            ))
            .expect("connects"),
    );
    runtime.block_on(ours(with_cache.clone(), CONCURRENCY * 10, Some("attacker")));
    let cached = runtime.block_on(ours(with_cache, requests, Some("attacker")));
    let redis_path = runtime.block_on(ours(without_cache, requests, Some("attacker")));
    println!(
        "deny cache: {cached:.0} denials/s locally vs {redis_path:.0}/s through Redis: {:.1}x",
        cached / redis_path
    );
}

/// A store of one fixed window of 1,000,000 an hour (no check is denied)
/// on `topology`, without the deny cache: every check is a script call.
fn fixed_window_store(runtime: &tokio::runtime::Runtime, topology: Topology) -> Arc<RedisStore> {
    let big = Quota::new(nz(1_000_000), Duration::from_secs(3600)).expect("valid");
    Arc::new(
        runtime
            .block_on(RedisStore::connect(
                topology,
                vec![Rule::new("fixed_window", FixedWindow::new(big))],
                RedisOptions {
                    timeout: Duration::from_secs(5),
                    deny_cache_entries: 0,
                    ..RedisOptions::default()
                },
            ))
            .expect("connects"),
    )
}

/// The fixed window on a 3-master cluster (each check a script call on its
/// key's master, keys spread over every master): three rounds and their
/// median. No peer runs here: it is the figure to compare between builds
/// of the store (its cluster routing), on the same machine.
fn on_a_cluster(runtime: &tokio::runtime::Runtime, requests: usize) {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let store = fixed_window_store(runtime, Topology::Cluster(cluster.urls()));
    runtime.block_on(ours(store.clone(), CONCURRENCY * 100, None));
    let mut rates: Vec<f64> = (0..3)
        .map(|_| runtime.block_on(ours(store.clone(), requests, None)))
        .collect();
    let rounds = rates
        .iter()
        .map(|r| format!("{r:.0}"))
        .collect::<Vec<_>>()
        .join(", ");
    rates.sort_by(f64::total_cmp);
    println!(
        "fixed_window on a 3-master cluster: {:.0} decisions/s (median; rounds {rounds})",
        rates[1]
    );
}

/// The store's script call for one check of its first rule, as
/// redis-benchmark sends it: the same script (loaded now; its SHA1), the
/// same arguments, and the same key layout spread over the same number of
/// keys (`__rand_int__`).
fn spread_call(server: &RedisServer, store: &RedisStore) -> (String, String, Vec<String>) {
    let call = store
        .script_call(&[Check {
            rule: RuleId(0),
            key: "k",
            cost: 1,
        }])
        .expect("valid");
    let sha = load_script(server.port(), &call.source);
    (
        sha,
        call.keys[0].replace(":k}", ":k__rand_int__}"),
        call.args,
    )
}

/// Loads `source` into the server on `port`; its SHA1.
fn load_script(port: u16, source: &str) -> String {
    let load = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "SCRIPT", "LOAD", source])
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&load.stdout).trim().to_string()
}

/// The Redis server's own time per EVALSHA since the last `CONFIG
/// RESETSTAT`, in microseconds.
fn evalsha_usec(server: &RedisServer) -> f64 {
    server
        .command("INFO commandstats")
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split("usec_per_call=").nth(1))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

/// Our fixed window against rate-limiter-flexible's `RateLimiterRedis` (a
/// fixed window too) on the same redis-server, rounds alternating.
fn against_rlflex(
    runtime: &tokio::runtime::Runtime,
    server: &RedisServer,
    requests: usize,
    modules: &str,
) {
    let store = fixed_window_store(runtime, Topology::Standalone(server.url()));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/rlflex.js");
    let rlflex = || -> f64 {
        let out = Command::new("node")
            .arg(script)
            .env("NODE_PATH", modules)
            .env("SPILLWAY_REDIS_PORT", server.port().to_string())
            .env("SPILLWAY_BENCH_REQUESTS", requests.to_string())
            .output()
            .expect("node runs");
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .find(|w| w[1] == "decisions/s,")
            .and_then(|w| w[0].parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "no rate from rlflex.js: {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
    };
    runtime.block_on(ours(store.clone(), CONCURRENCY * 100, None));
    let (mut mine, mut theirs) = (Vec::new(), Vec::new());
    let (mut mine_usec, mut theirs_usec) = (Vec::new(), Vec::new());
    println!("fixed_window against rate-limiter-flexible, same redis-server, alternating:");
    let rounds: usize = std::env::var("SPILLWAY_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    for round in 1..=rounds {
        server.command("CONFIG RESETSTAT");
        let m = runtime.block_on(ours(store.clone(), requests, None));
        let m_usec = evalsha_usec(server);
        server.command("CONFIG RESETSTAT");
        let t = rlflex();
        let t_usec = evalsha_usec(server);
        println!(
            "  round {round}: spillway {m:>8.0}/s ({m_usec:.2} µs in Redis per call), \
             rate-limiter-flexible {t:>8.0}/s ({t_usec:.2} µs)"
        );
        mine.push(m);
        theirs.push(t);
        mine_usec.push(m_usec);
        theirs_usec.push(t_usec);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (m, t) = (median(&mut mine), median(&mut theirs));
    let (m_usec, t_usec) = (median(&mut mine_usec), median(&mut theirs_usec));
    println!(
        "  medians: spillway {m:.0}/s ({m_usec:.2} µs), \
         rate-limiter-flexible {t:.0}/s ({t_usec:.2} µs): {:.2}x",
        m / t
    );
    ceilings(server, &store, 1.3 * t);
}

/// About what Redis itself can run, whatever the client: redis-benchmark
/// with 16 calls in flight per connection keeps the server busy, so its
/// rate estimates the server's ceiling for a script (from below: the
/// benchmark shares the machine's cores with the server). Measured for our
/// fixed window and for `benches/floor.lua` (its two unavoidable commands
/// alone; see there), against `target`, the rate a goal asks for.
fn ceilings(server: &RedisServer, store: &RedisStore, target: f64) {
    const PIPELINE: usize = 16;
    let requests = 1_000_000;
    let (sha, key, args) = spread_call(server, store);
    let floor_sha = load_script(server.port(), include_str!("floor.lua"));
    let floor_args: Vec<String> = ["1000000", "3600000000", "1"].map(String::from).into();
    println!("Redis's ceiling ({PIPELINE} calls in flight per connection, {requests} calls):");
    for round in 1..=2 {
        server.command("CONFIG RESETSTAT");
        let ours = redis_benchmark(server.port(), requests, PIPELINE, &sha, &key, &args);
        let ours_usec = evalsha_usec(server);
        server.command("CONFIG RESETSTAT");
        let floor = redis_benchmark(
            server.port(),
            requests,
            PIPELINE,
            &floor_sha,
            "floor:k__rand_int__",
            &floor_args,
        );
        let floor_usec = evalsha_usec(server);
        println!(
            "  round {round}: our fixed window {ours:>8.0}/s ({ours_usec:.2} µs per call), \
             the floor script {floor:>8.0}/s ({floor_usec:.2} µs); \
             1.3x rate-limiter-flexible is {target:.0}/s"
        );
    }
}

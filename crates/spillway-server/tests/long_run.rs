//! Long runs (#17 item 4): `spillway serve` and `spillway proxy` (with an
//! upstream on loopback) under a steady load, sampled at a steady interval:
//! resident memory, open file descriptors, p50 and p99 latency, and (for
//! `serve`) the store's key count from `/metrics`. Then the bounds are
//! asserted: no failed request, RSS growth from the second quarter to the
//! last below a bound, p99 below a bound, the key count never above the
//! keys in use, and the file descriptors back to where they started.
//!
//! In CI it runs 60 s, sampling every 5 s. `scripts/long-run.sh` runs the
//! same test for 30 minutes (release build, a sample a minute); the
//! environment sets it: `SPILLWAY_LONG_RUN_SECS`, `SPILLWAY_LONG_RUN_SAMPLE_SECS`,
//! `SPILLWAY_LONG_RUN_RATE` (requests per second per process),
//! `SPILLWAY_LONG_RUN_RSS_MIB` and `SPILLWAY_LONG_RUN_P99_MS` (the bounds:
//! 4 MiB and 200 ms by default, for a debug build on two shared cores).

mod process_support;
mod serve_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use process_support::load::{self, Load, quantile_ms};
use process_support::{Conn, Process, Raw, Upstream, check_request};
use serve_support::{metric_value, temp_dir, write_atomically};

/// Distinct keys the load uses: the store's key count may not exceed it.
const KEYS: u64 = 1000;

/// How long, how fast, and the bounds.
struct Settings {
    duration: Duration,
    sample: Duration,
    rate: u32,
    rss_growth_mib: f64,
    p99_ms: f64,
}

fn env_or(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: not a number: {v}"))
        })
        .unwrap_or(default)
}

impl Settings {
    fn from_env() -> Self {
        Self {
            duration: Duration::from_secs_f64(env_or("SPILLWAY_LONG_RUN_SECS", 60.0)),
            sample: Duration::from_secs_f64(env_or("SPILLWAY_LONG_RUN_SAMPLE_SECS", 5.0)),
            rate: env_or("SPILLWAY_LONG_RUN_RATE", 300.0) as u32,
            rss_growth_mib: env_or("SPILLWAY_LONG_RUN_RSS_MIB", 4.0),
            // A debug build on two shared cores (CI); scripts/long-run.sh
            // sets 25 ms for its release build.
            p99_ms: env_or("SPILLWAY_LONG_RUN_P99_MS", 200.0),
        }
    }
}

/// One sample.
#[derive(Debug, Clone)]
struct Sample {
    at: Duration,
    rss_kib: u64,
    fds: usize,
    p50_ms: f64,
    p99_ms: f64,
    keys: Option<u64>,
    answered: u64,
}

fn rss_kib(pid: u32) -> u64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process's status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's fds")
        .count()
}

/// `series` in `GET /metrics`, on a connection of its own that the server
/// closes (so that it holds no descriptor after).
async fn metric(process: &Process, series: &str) -> Option<u64> {
    let mut conn = Conn::connect(process.addr).await;
    conn.send(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .ok()?;
    let answer = conn.response(Duration::from_secs(10)).await.ok()?;
    metric_value(&answer.text(), series).map(|v| v as u64)
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0), |(s, n), v| (s + v, n + 1));
    sum / f64::from(n.max(1))
}

/// Runs `load` on `process` as `settings` say, and checks the bounds.
async fn long_run(name: &str, process: Process, load: Load, keys_series: Option<&str>) {
    let settings = Settings::from_env();
    let pid = process.child.id();
    // The fewest descriptors over half a second before the load: a reading
    // taken at once can count a socket the readiness check left, not yet
    // closed on a busy machine (then the run "ended" with one fewer).
    let mut baseline_fds = fds(pid);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        baseline_fds = baseline_fds.min(fds(pid));
    }
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let (seen, workers) = load::start(process.addr, load, stopping);
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut all = Vec::new();
    let mut next = started + settings.sample;
    while next <= started + settings.duration {
        tokio::time::sleep_until(next.into()).await;
        next += settings.sample;
        let latencies = seen.take();
        let keys = match keys_series {
            Some(series) => metric(&process, series).await,
            None => None,
        };
        let sample = Sample {
            at: started.elapsed(),
            rss_kib: rss_kib(pid),
            fds: fds(pid),
            p50_ms: quantile_ms(&latencies, 0.5),
            p99_ms: quantile_ms(&latencies, 0.99),
            keys,
            answered: latencies.len() as u64,
        };
        eprintln!(
            "{name}: {:>6.0}s rss {:>8.1} MiB fds {:>4} p50 {:>7.3} ms p99 {:>7.3} ms keys {:>5} answered {:>6}",
            sample.at.as_secs_f64(),
            sample.rss_kib as f64 / 1024.0,
            sample.fds,
            sample.p50_ms,
            sample.p99_ms,
            sample.keys.map_or("-".into(), |k| k.to_string()),
            sample.answered,
        );
        all.push(latencies);
        samples.push(sample);
    }
    let _ = stop.send(true);
    for worker in workers {
        worker.await.expect("a load worker");
    }
    // The load's connections closed: the descriptors come back.
    let back = Instant::now() + Duration::from_secs(10);
    let mut final_fds = fds(pid);
    while final_fds > baseline_fds && Instant::now() < back {
        tokio::time::sleep(Duration::from_millis(50)).await;
        final_fds = fds(pid);
    }

    let n = samples.len();
    assert!(n >= 4, "at least four samples: {n}");
    let quarter = |q: usize| &samples[q * n / 4..(q + 1) * n / 4];
    let rss_mib = |s: &[Sample]| mean(s.iter().map(|s| s.rss_kib as f64 / 1024.0));
    let growth = rss_mib(quarter(3)) - rss_mib(quarter(1));
    let mut after_first: Vec<u32> = all[n / 4..].concat();
    after_first.sort_unstable();
    let p50 = quantile_ms(&after_first, 0.5);
    let p99 = quantile_ms(&after_first, 0.99);
    let p99_q2 = mean(quarter(1).iter().map(|s| s.p99_ms));
    let p99_q4 = mean(quarter(3).iter().map(|s| s.p99_ms));
    let max_fds = samples.iter().map(|s| s.fds).max().unwrap_or(0);
    let max_keys = samples.iter().filter_map(|s| s.keys).max();
    let ok = seen.ok.load(std::sync::atomic::Ordering::Relaxed);
    let errors = seen.errors.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "{name}: {:.0} s at {} req/s: {ok} answered, {errors} failed; RSS {:.1} -> {:.1} MiB (second to last quarter: {growth:+.2} MiB, bound {} MiB); \
         p50 {p50:.3} ms, p99 {p99:.3} ms (bound {} ms; the quarters' p99 {p99_q2:.3} -> {p99_q4:.3} ms); \
         fds {baseline_fds} at the start, {max_fds} at most, {final_fds} after; keys at most {}",
        settings.duration.as_secs_f64(),
        settings.rate,
        rss_mib(quarter(0)),
        rss_mib(quarter(3)),
        settings.rss_growth_mib,
        settings.p99_ms,
        max_keys.map_or("-".into(), |k| k.to_string()),
    );
    assert_eq!(
        errors,
        0,
        "{name}: failed requests, the first: {:?}",
        seen.first_error.lock().expect("first error")
    );
    assert!(
        growth < settings.rss_growth_mib,
        "{name}: RSS grew {growth:.2} MiB from the second quarter to the last"
    );
    assert!(p99 < settings.p99_ms, "{name}: p99 {p99:.3} ms");
    assert!(
        final_fds <= baseline_fds,
        "{name}: descriptors left open: {final_fds} after, {baseline_fds} before"
    );
    if let Some(max) = max_keys {
        assert!(max <= KEYS, "{name}: {max} keys held, {KEYS} in use");
    }
    eprintln!("{name}: no upward trend beyond the bounds");
    drop(process);
}

fn answered_200(answer: &Raw) -> bool {
    answer.status == 200
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_holds_steady_under_a_steady_load() {
    let dir = temp_dir("long-run-serve");
    write_atomically(
        &dir.join("spillway.toml"),
        "[[rules]]\nname = \"steady\"\nalgorithm = \"token_bucket\"\nlimit = 100\nwindow = \"1s\"\n",
    );
    let process = Process::start(
        "serve",
        &["--config", "spillway.toml", "--listen", "127.0.0.1:0"],
        &dir,
    );
    let requests: Vec<Vec<u8>> = (0..KEYS)
        .map(|k| check_request("steady", &format!("k{k}")).0)
        .collect();
    let requests = Arc::new(requests);
    let load = Load {
        rate: Settings::from_env().rate,
        connections: 8,
        per_connection: 200,
        request: Arc::new(move |n| requests[(n % KEYS) as usize].clone()),
        expect: Arc::new(|a: &Raw| answered_200(a) && a.text().contains("\"allowed\":true")),
    };
    long_run(
        "serve",
        process,
        load,
        Some(r#"spillway_store_keys{rule="steady"}"#),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_holds_steady_under_a_steady_load() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("long-run-proxy");
    write_atomically(
        &dir.join("spillway.toml"),
        "[[rules]]\nname = \"steady\"\nkey = [\"header:x-client\"]\nalgorithm = \"token_bucket\"\nlimit = 100\nwindow = \"1s\"\n",
    );
    let upstream_url = format!("http://{}", upstream.addr);
    let process = Process::start(
        "proxy",
        &[
            "--config",
            "spillway.toml",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream_url,
        ],
        &dir,
    );
    let load = Load {
        rate: Settings::from_env().rate,
        connections: 8,
        per_connection: 200,
        request: Arc::new(|n| {
            format!(
                "GET /item/{} HTTP/1.1\r\nhost: app\r\nx-client: c{}\r\n\r\n",
                n % 97,
                n % KEYS
            )
            .into_bytes()
        }),
        expect: Arc::new(|a: &Raw| answered_200(a) && a.body == b"upstream"),
    };
    long_run("proxy", process, load, None).await;
}

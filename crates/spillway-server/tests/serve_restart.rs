//! `[store] state_file`: a `spillway serve` on the in-memory store,
//! stopped and started again, keeps every key's count and the tables set
//! at run time. Stopped by SIGTERM it loses nothing; killed outright
//! (SIGKILL) it loses at most what it admitted after its last write. A
//! state file that is damaged, foreign or in use by another process stops
//! it from starting, saying which.

mod process_support;
mod serve_support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use process_support::{Conn, Process, Upstream, temp_dir};
use serde_json::{Value, json};
use serve_support::Http;

const TOKEN: &str = "a-long-enough-admin-token";

/// Four rules of four algorithms, an hour long each, a token to change
/// the tables, and the state file written every second.
fn config() -> String {
    format!(
        r#"
[server]
admin_token = "{TOKEN}"

[store]
state_file = "spillway.state"
snapshot_every = "1s"

[tiers.gold]
api_keys = ["k-gold"]

[[rules]]
name = "window"
algorithm = "fixed_window"
limit = 1000
window = "1h"
key = ["api_key"]
fallback = []
[rules.tiers.gold]
limit = 5000

[[rules]]
name = "log"
algorithm = "sliding_log"
limit = 500
window = "1h"
key = ["ip"]

[[rules]]
name = "sliding"
algorithm = "sliding_window"
limit = 1000
window = "1h"
key = ["ip"]

[[rules]]
name = "bucket"
algorithm = "token_bucket"
limit = 3600
window = "1h"
burst = 1000
key = ["ip"]
"#
    )
}

fn serve(dir: &Path) -> Process {
    Process::start(
        "serve",
        &["--config", "spillway.toml", "--listen", "127.0.0.1:0"],
        dir,
    )
}

/// Stops `server` with SIGTERM: it exits 0.
async fn stop(server: &mut Process) {
    server.signal("TERM");
    let status = server.exited_within(Duration::from_secs(20)).await;
    assert!(status.success(), "{status}: {}", server.log());
}

/// Charges `key` of `rule` `cost`; its remaining after.
async fn charge(http: &Http, rule: &str, key: &str, cost: u64) -> u64 {
    let answer = http
        .check(json!({"rule": rule, "key": key, "cost": cost}))
        .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    let v = answer.json();
    v["rules"][0]["remaining"]
        .as_u64()
        .unwrap_or_else(|| panic!("{v}"))
}

async fn admin(http: &Http, method: Method, path: &str, body: Value) -> Value {
    let auth = format!("Bearer {TOKEN}");
    let answer = http
        .send(
            method,
            path,
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            body.to_string(),
        )
        .await;
    assert!(answer.status.is_success(), "{path}: {}", answer.text());
    answer.json()
}

/// What each of 10 clients has used of each rule: client `i` used
/// `3 * i + 1` of each.
async fn use_some(http: &Http) -> Vec<(String, String, u64)> {
    let mut seen = Vec::new();
    for i in 0..10u64 {
        for (rule, key) in [
            ("window", format!("api_key=client-{i}")),
            ("log", format!("ip=192.0.2.{i}")),
            ("sliding", format!("ip=192.0.2.{i}")),
            ("bucket", format!("ip=192.0.2.{i}")),
        ] {
            // In several requests, as clients send them.
            let mut remaining = 0;
            for cost in [1, 3 * i] {
                if cost > 0 {
                    remaining = charge(http, rule, &key, cost).await;
                }
            }
            seen.push((rule.to_string(), key, remaining));
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_then_start_keeps_every_count_and_the_run_time_tables() {
    let dir = temp_dir("restart-term");
    std::fs::write(dir.join("spillway.toml"), config()).unwrap();
    // Logged before it listens.
    let mut server = serve(&dir);
    assert!(
        server.log().contains("no state file yet"),
        "{}",
        server.log()
    );
    let http = Http::new(server.addr);
    let before = use_some(&http).await;
    admin(
        &http,
        Method::PUT,
        "/admin/overrides",
        json!({"rule": "window", "key": "api_key=client-9", "limit": 2000, "ttl": "1d"}),
    )
    .await;
    admin(
        &http,
        Method::PUT,
        "/admin/tiers",
        json!({"api_key": "k-new", "tier": "gold"}),
    )
    .await;
    admin(
        &http,
        Method::PUT,
        "/admin/lists",
        json!({"list": "block", "ip": "198.51.100.0/24", "status": 403}),
    )
    .await;
    let stopped_at = Instant::now();
    stop(&mut server).await;
    assert!(
        server.log().contains("state file written at shutdown"),
        "{}",
        server.log()
    );

    let mut server = serve(&dir);
    let log = server.log();
    assert!(
        log.contains("state file read") && log.contains("keys=40 "),
        "{log}"
    );
    let http = Http::new(server.addr);
    let elapsed = stopped_at.elapsed().as_secs() + 1;
    for (rule, key, remaining) in before {
        let now = charge(&http, &rule, &key, 1).await;
        let expected = if key == "api_key=client-9" {
            // Under the override: 1000 more than before.
            remaining + 1000 - 1
        } else {
            remaining - 1
        };
        if rule == "bucket" {
            // A bucket refills (one a second) while the process is down.
            assert!(
                expected <= now && now <= expected + elapsed,
                "{rule} {key}: {now}, {expected}"
            );
        } else {
            assert_eq!(now, expected, "{rule} {key}");
        }
    }
    // The tier and the block came back too.
    let tiered = http
        .check(json!({"path": "/x", "ip": "192.0.2.200", "headers": {"x-api-key": "k-new"}}))
        .await
        .json();
    let window = tiered["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == "window")
        .cloned()
        .unwrap_or_else(|| panic!("{tiered}"));
    assert_eq!(
        (window["tier"].as_str(), window["limit"].as_u64()),
        (Some("gold"), Some(5000))
    );
    let blocked = http
        .check(json!({"path": "/x", "ip": "198.51.100.9", "headers": {"x-api-key": "k-a"}}))
        .await
        .json();
    assert_eq!(
        (blocked["allowed"].as_bool(), blocked["status"].as_u64()),
        (Some(false), Some(403)),
        "{blocked}"
    );
    let listed = admin(&http, Method::GET, "/admin/overrides?limit=10", Value::Null).await;
    assert_eq!(
        listed["overrides"][0]["key"], "api_key=client-9",
        "{listed}"
    );
    stop(&mut server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_loses_at_most_what_was_admitted_since_the_last_write() {
    let dir = temp_dir("restart-kill");
    std::fs::write(dir.join("spillway.toml"), config()).unwrap();
    let mut server = serve(&dir);
    let http = Http::new(server.addr);
    let writes = || {
        let http = http.clone();
        async move {
            http.metric("spillway_state_file_writes_total{result=\"ok\"}")
                .await
                .unwrap_or(0.0)
        }
    };
    // 40 admitted, then two writes: the second began after all 40.
    for _ in 0..40 {
        charge(&http, "log", "ip=203.0.113.1", 1).await;
    }
    let written = writes().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while writes().await < written + 2.0 {
        assert!(Instant::now() < deadline, "no write within 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The gauge says when the last whole file was written: just now.
    let written_at = http
        .metric("spillway_state_file_written_timestamp_seconds")
        .await
        .expect("the gauge");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        (now - 5.0..=now + 1.0).contains(&written_at),
        "{written_at} vs {now}"
    );
    // 25 more, and killed at once: no chance to write them.
    for _ in 0..25 {
        charge(&http, "log", "ip=203.0.113.1", 1).await;
    }
    server.signal("KILL");
    let _ = server.exited_within(Duration::from_secs(10)).await;

    let server = serve(&dir);
    let http = Http::new(server.addr);
    let used = 500 - charge(&http, "log", "ip=203.0.113.1", 0).await;
    assert!((40..=65).contains(&used), "{used}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_keeps_its_counts_across_a_restart_too() {
    let dir = temp_dir("restart-proxy");
    std::fs::write(
        dir.join("spillway.toml"),
        "[store]\nstate_file = \"proxy.state\"\n\n[[rules]]\nname = \"per-ip\"\n\
         algorithm = \"fixed_window\"\nlimit = 10\nwindow = \"1h\"\nkey = [\"ip\"]\n",
    )
    .unwrap();
    let upstream = Upstream::start().await;
    let url = format!("http://{}", upstream.addr);
    let args = [
        "--upstream",
        url.as_str(),
        "--listen",
        "127.0.0.1:0",
        "--config",
        "spillway.toml",
    ];
    /// One request through the proxy: its status.
    async fn get(proxy: &Process) -> u16 {
        let mut conn = Conn::connect(proxy.addr).await;
        conn.send(b"GET /x HTTP/1.1\r\nhost: app.test\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        conn.response(Duration::from_secs(5)).await.unwrap().status
    }
    let mut proxy = Process::start("proxy", &args, &dir);
    for _ in 0..7 {
        assert_eq!(get(&proxy).await, 200);
    }
    stop(&mut proxy).await;
    let proxy = Process::start("proxy", &args, &dir);
    assert!(proxy.log().contains("keys=1 "), "{}", proxy.log());
    // 3 left of 10, not a fresh 10.
    for _ in 0..3 {
        assert_eq!(get(&proxy).await, 200);
    }
    assert_eq!(get(&proxy).await, 429);
}

/// Runs `spillway serve` in `dir`, expecting it not to start: its stderr.
fn refused(dir: &Path) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args([
            "serve",
            "--config",
            "spillway.toml",
            "--listen",
            "127.0.0.1:0",
        ])
        .current_dir(dir)
        .env_remove("SPILLWAY_ADMIN_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("it started, or hung, on a state file it should refuse");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_foreign_or_shared_state_file_stops_the_start_and_says_why() {
    let dir = temp_dir("restart-refused");
    std::fs::write(dir.join("spillway.toml"), config()).unwrap();
    let mut server = serve(&dir);
    let http = Http::new(server.addr);
    use_some(&http).await;
    // A second process on the same file is refused while the first runs.
    let e = refused(&dir);
    assert!(
        e.contains("another process holds spillway.state.lock"),
        "{e}"
    );
    stop(&mut server).await;
    let path = dir.join("spillway.state");
    let good = std::fs::read(&path).unwrap();

    let mut damaged = good.clone();
    let middle = damaged.len() / 2;
    damaged[middle] ^= 0x10;
    std::fs::write(&path, &damaged).unwrap();
    let e = refused(&dir);
    assert!(
        e.contains("[store] state_file spillway.state: damaged at byte")
            && e.contains("move it aside to start with no counts"),
        "{e}"
    );
    std::fs::write(&path, &good[..good.len() - 3]).unwrap();
    let e = refused(&dir);
    assert!(e.contains("cut short"), "{e}");
    std::fs::write(&path, "[[rules]]\nname = \"a\"\n").unwrap();
    let e = refused(&dir);
    assert!(e.contains("not a Spillway state file"), "{e}");

    // The good file starts it again.
    std::fs::write(&path, &good).unwrap();
    let server = serve(&dir);
    assert!(server.log().contains("state file read"), "{}", server.log());
}

//! The `spillway` binary as a user runs it: `check-config`, `serve` with
//! (almost) no flags, SIGHUP reload, SIGTERM graceful shutdown, `--redis`.

mod serve_support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use serde_json::json;
use serve_support::{Http, eventually, temp_dir, write_atomically};
use spillway_conformance::redis_server::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn spillway(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(args)
        .current_dir(dir)
        .env_remove("SPILLWAY_ADMIN_TOKEN")
        .env_remove("SPILLWAY_CHECK_TOKENS")
        .output()
        .expect("the binary runs")
}

#[test]
fn check_config_accepts_the_sample_and_names_the_field_and_line_of_an_error() {
    let root = repo_root();
    let out = spillway(&["check-config", "config/spillway.toml"], &root);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("OK (3 rules)"), "{stdout}");

    let dir = temp_dir("check-config");
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[[rules]]\nname = \"a\"\nalgorithm = \"sliding_log\"\nlimit = 0\nwindow = \"1m\"\n",
    )
    .expect("write");
    let out = spillway(&["check-config", bad.to_str().expect("utf-8")], &dir);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("line 4") && stderr.contains("rules[0].limit"),
        "{stderr}"
    );
    let out = spillway(&["check-config", "missing.toml"], &dir);
    assert!(!out.status.success());
    // `serve` refuses it the same way, without starting.
    let out = spillway(
        &["serve", "--config", "bad.toml", "--listen", "127.0.0.1:0"],
        &dir,
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("line 4") && stderr.contains("rules[0].limit"),
        "{stderr}"
    );
}

/// A `spillway serve` process, killed on drop if still running.
struct Server {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
    lines: mpsc::Receiver<String>,
}

impl Server {
    fn start(args: &[&str], dir: &Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_spillway"))
            .arg("serve")
            .args(args)
            .current_dir(dir)
            .env_remove("SPILLWAY_ADMIN_TOKEN")
            .env_remove("SPILLWAY_CHECK_TOKENS")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, lines) = mpsc::channel();
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                kept.lock().expect("log").push_str(&format!("{line}\n"));
                let _ = tx.send(line);
            }
        });
        let mut server = Self {
            child,
            addr: "0.0.0.0:0".parse().expect("an address"),
            log,
            lines,
        };
        let line = server.wait_for("listening on http://");
        let addr = line
            .split("listening on http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .expect("an address");
        server.addr = addr.parse().expect("a socket address");
        server
    }

    /// Waits (up to 20 s) for a log line containing `text`.
    fn wait_for(&mut self, text: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(text) => return line,
                Ok(_) => {}
                Err(_) => panic!(
                    "no log line with {text:?}; the log:\n{}",
                    self.log.lock().expect("log")
                ),
            }
        }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_starts_on_the_sample_config_and_answers_at_once() {
    // In the repository: config/spillway.toml. Elsewhere: the same sample,
    // built in.
    let elsewhere = temp_dir("serve-elsewhere");
    for (dir, expected) in [
        (repo_root(), "configuration: config/spillway.toml"),
        (elsewhere, "configuration: the built-in sample"),
    ] {
        let server = Server::start(&["--listen", "127.0.0.1:0"], &dir);
        // Logged before "listening on".
        let log = server.log.lock().expect("log").clone();
        assert!(log.contains(expected), "{log}");
        let http = Http::new(server.addr);
        let login = json!({"method": "POST", "path": "/login", "ip": "203.0.113.7"});
        for _ in 0..5 {
            let a = http.check(login.clone()).await;
            assert_eq!(a.status, StatusCode::OK);
            assert_eq!(a.json()["status"], 200, "{}", a.text());
        }
        let a = http.check(login).await;
        assert_eq!(a.json()["status"], 429);
        assert_eq!(a.json()["denied_by"], "login");
        assert_eq!(http.get("/readyz").await.json()["store"], "memory");
        // No admin token in the sample: no admin API.
        assert_eq!(
            http.get("/admin/rules/login/keys/x").await.status,
            StatusCode::NOT_FOUND
        );
    }
}

const V1: &str = r#"
[[rules]]
name = "a"
algorithm = "sliding_log"
limit = 5
window = "1h"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_a_bad_config_is_refused_and_sigterm_drains() {
    let dir = temp_dir("serve-sighup");
    let path = dir.join("spillway.toml");
    write_atomically(&path, V1);
    let mut server = Server::start(
        &["--config", "spillway.toml", "--listen", "127.0.0.1:0"],
        &dir,
    );
    let http = Http::new(server.addr);
    let reloads = |result: &'static str| {
        let http = http.clone();
        async move {
            http.metric(&format!(
                "spillway_config_reloads_total{{result=\"{result}\"}}"
            ))
            .await
        }
    };
    assert_eq!(
        http.check(json!({"rule": "a", "key": "ip=k"})).await.status,
        StatusCode::OK
    );

    // SIGHUP reloads, even an unchanged file.
    server.signal("HUP");
    server.wait_for("SIGHUP: reloading");
    eventually(Duration::from_secs(10), "a reload", || {
        let reloads = &reloads;
        async move { reloads("ok").await == Some(1.0) }
    })
    .await;
    let v = http.check(json!({"rule": "a", "key": "ip=k"})).await.json();
    assert_eq!(v["rules"][0]["remaining"], 3, "the counter survived: {v}");

    // A bad file is refused with a log line naming field and line.
    write_atomically(&path, &V1.replace("limit = 5", "limit = 0"));
    let line = server.wait_for("configuration refused");
    assert!(
        line.contains("line 5") && line.contains("rules[0].limit"),
        "{line}"
    );
    assert_eq!(
        http.check(json!({"rule": "a", "key": "ip=k"})).await.json()["rules"][0]["remaining"],
        2
    );

    // SIGTERM: the request in flight (its body half sent) is answered, then
    // the process exits 0.
    let body = json!({"rule": "a", "key": "ip=k"}).to_string();
    let mut stream = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let (first, rest) = body.split_at(body.len() / 2);
    stream
        .write_all(
            format!(
                "POST /v1/check HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{first}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .expect("write");
    eventually(Duration::from_secs(10), "the request is in flight", || {
        let http = http.clone();
        async move { http.metric("spillway_http_requests_in_flight").await == Some(2.0) }
    })
    .await;
    server.signal("TERM");
    server.wait_for("shutting down");
    assert!(
        server.child.try_wait().expect("status").is_none(),
        "still draining"
    );
    stream
        .write_all(rest.as_bytes())
        .await
        .expect("write the rest");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .expect("answered")
        .expect("read");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.contains("\"remaining\":1"), "{answer}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = server.child.try_wait().expect("status") {
            break status;
        }
        assert!(Instant::now() < deadline, "the process did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_redis_flag_uses_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let dir = temp_dir("serve-redis-flag");
    let server = Server::start(&["--listen", "127.0.0.1:0", "--redis", &redis.url()], &dir);
    let http = Http::new(server.addr);
    let a = http.get("/readyz").await;
    assert_eq!(a.json()["store"], "redis");
    let a = http.check(json!({"rule": "login", "key": "ip=k"})).await;
    assert_eq!(a.json()["rules"][0]["remaining"], 4);
    // The count is in Redis.
    let keys = redis.command("DBSIZE");
    assert!(keys.starts_with(":1"), "{keys}");
    drop(server);
    let out = spillway(&["serve", "--redis", "http://nope"], &dir);
    assert!(!out.status.success());
}

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
        "[[rules]]\nname = \"a\"\nalgorithm = \"sliding_log\"\nlimit = 0\nwindow = \"1m\"\n\
         [[rules]]\nname = \"b\"\nalgorithm = \"sliding_log\"\nlimit = 1\nwindw = \"1m\"\n",
    )
    .expect("write");
    let out = spillway(&["check-config", bad.to_str().expect("utf-8")], &dir);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Both mistakes, each on its own line with the file, line and field.
    let shown = bad.display();
    assert!(
        stderr.contains("2 errors in the configuration:"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{shown}: line 4: `rules[0].limit`")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{shown}: line 10: `rules[1].windw`"))
            && stderr.contains("did you mean `window`?"),
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

/// Each flag `spillway COMMAND --help` lists, with its default where it
/// states a literal one (`5s`, not "the file's server.listen").
fn flags_of(command: &str) -> std::collections::BTreeMap<String, Option<String>> {
    let out = spillway(&[command, "--help"], &repo_root());
    assert!(out.status.success(), "{command} --help");
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut flags = std::collections::BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    let mut close = |current: Option<(String, String)>| {
        if let Some((flag, text)) = current {
            let default = text
                .rsplit_once("[default: ")
                .and_then(|(_, rest)| rest.split_once(']'))
                .map(|(d, _)| d.to_string())
                .filter(|d| !d.contains(' ') && d != "none");
            flags.insert(flag, default);
        }
    };
    for line in help.lines() {
        let line = line.trim_start();
        let line = line.strip_prefix("-h, ").unwrap_or(line);
        if let Some(rest) = line.strip_prefix("--") {
            close(current.take());
            let name = rest.split_whitespace().next().expect("a flag name");
            current = Some((format!("--{name}"), line.to_string()));
        } else if let Some((_, text)) = current.as_mut() {
            text.push(' ');
            text.push_str(line);
        }
    }
    close(current);
    flags.remove("--help");
    flags
}

/// The `--flags` named in `text`; on a `cargo run ... -- COMMAND` line,
/// only those after the command (cargo's own are not the command's).
fn flags_in(text: &str) -> std::collections::BTreeSet<String> {
    let mut flags = std::collections::BTreeSet::new();
    for line in text.lines() {
        let line = line.rsplit_once(" -- ").map_or(line, |(_, after)| after);
        for (at, _) in line.match_indices("--") {
            let before = line[..at].chars().last();
            if before.is_some_and(|c| !(c.is_whitespace() || "`[(".contains(c))) {
                continue;
            }
            let name: String = line[at + 2..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
                .collect();
            if name.starts_with(|c: char| c.is_ascii_lowercase()) {
                flags.insert(format!("--{name}"));
            }
        }
    }
    flags
}

/// docs/proxy.md's flag table, docs/server.md's `serve` line and the
/// simulator's flags in docs/algorithms.md are the commands' own: the same
/// flags, and the defaults `--help` states.
#[test]
fn the_docs_name_the_flags_and_defaults_the_commands_have() {
    let read = |doc: &str| {
        std::fs::read_to_string(repo_root().join(doc)).unwrap_or_else(|e| panic!("{doc}: {e}"))
    };
    let keys = |m: &std::collections::BTreeMap<String, Option<String>>| {
        m.keys().cloned().collect::<std::collections::BTreeSet<_>>()
    };

    // The proxy: one row per flag, its default in the second column.
    let proxy = flags_of("proxy");
    let rows: Vec<(String, String)> = read("docs/proxy.md")
        .lines()
        .filter_map(|l| l.strip_prefix("| `--"))
        .map(|l| {
            let mut cells = l.split(" | ");
            let flag = cells.next().expect("a flag");
            let flag = format!("--{}", flag.split([' ', '`']).next().expect("a name"));
            (flag, cells.next().unwrap_or_default().to_string())
        })
        .collect();
    let documented: std::collections::BTreeSet<_> = rows.iter().map(|(f, _)| f.clone()).collect();
    assert_eq!(documented, keys(&proxy), "docs/proxy.md's flag table");
    for (flag, default) in &rows {
        if let Some(Some(stated)) = proxy.get(flag) {
            assert!(
                default.contains(&format!("`{stated}`")),
                "docs/proxy.md: {flag} defaults to `{stated}`, the table says {default}"
            );
        }
    }

    // `serve`: its synopsis line.
    let server = read("docs/server.md");
    let line = server
        .lines()
        .find(|l| l.starts_with("| `spillway serve "))
        .expect("the serve line");
    assert_eq!(flags_in(line), keys(&flags_of("serve")), "{line}");

    // `simulate`: every flag the guide names exists, and the defaults it
    // quotes are the command's.
    let simulate = flags_of("simulate");
    let algorithms = read("docs/algorithms.md");
    for flag in flags_in(&algorithms).into_iter().filter(|f| f != "--help") {
        assert!(
            simulate.contains_key(&flag),
            "docs/algorithms.md names {flag}"
        );
    }
    let quoted = algorithms
        .split_once("the defaults `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map(|(defaults, _)| defaults)
        .expect("the defaults the guide quotes");
    let words: Vec<&str> = quoted.split_whitespace().collect();
    assert!(!words.is_empty());
    for pair in words.chunks(2) {
        let [flag, value] = pair else {
            panic!("`{quoted}`: a flag without a value")
        };
        assert_eq!(
            simulate.get(*flag),
            Some(&Some(value.to_string())),
            "docs/algorithms.md quotes {flag} {value}"
        );
    }
}

/// README.md's answers are the service's: each `curl ... /v1/check -d BODY`
/// of "Try it", sent to `serve` on the sample, answers what the README
/// shows, to within the milliseconds that pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_answers_are_the_services() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    // Each shell block that checks, with how many times it sends, and the
    // last line of the text block after it.
    let mut examples = Vec::new();
    let mut rest = readme.as_str();
    while let Some((_, after)) = rest.split_once("```sh\n") {
        let (block, after) = after.split_once("```").expect("a closed block");
        rest = after;
        let Some((_, body)) = block.split_once("localhost:8080/v1/check -d '") else {
            continue;
        };
        let body = body.split_once('\'').expect("a quoted body").0;
        let times = if block.starts_with("for i in 1 2 3 4 5;") {
            5
        } else {
            1
        };
        let shown = after
            .trim_start()
            .strip_prefix("```text\n")
            .and_then(|t| t.split_once("```"))
            .map(|(t, _)| t.trim_end().lines().last().unwrap_or_default().to_string());
        if let Some(shown) = shown {
            examples.push((body.to_string(), times, shown));
        }
    }
    assert!(examples.len() >= 2, "README's examples: {examples:?}");

    let server = Server::start(&["--listen", "127.0.0.1:0"], &repo_root());
    let http = Http::new(server.addr);
    // The milliseconds that pass between the README's run and this one.
    fn timeless(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map.iter_mut() {
                    if k.ends_with("_after_ms") && v.is_u64() {
                        let ms = v.as_u64().expect("a number");
                        *v = json!(format!("about {}s", ms.div_ceil(1000)));
                    } else {
                        timeless(v);
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(timeless),
            _ => {}
        }
    }
    for (body, times, shown) in examples {
        let body: serde_json::Value = serde_json::from_str(&body).expect("a JSON body");
        let mut answer = None;
        for _ in 0..times {
            answer = Some(http.check(body.clone()).await.json());
        }
        let mut answer = answer.expect("an answer");
        let mut shown: serde_json::Value = serde_json::from_str(&shown).expect("a JSON answer");
        timeless(&mut answer);
        timeless(&mut shown);
        assert_eq!(answer, shown, "README's answer to {body}");
    }
}

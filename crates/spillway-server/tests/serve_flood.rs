//! A key flood through a real `spillway serve` process: 200,000 distinct
//! keys on `POST /v1/check` over loopback, against `[store] max_memory =
//! "16MiB"`, while an abuser sits at its limit and regular users keep
//! spending. The server's resident set (read from /proc) grows by at most
//! the bound stated in docs/server.md, the abuser is denied on every try,
//! and every regular user's count is exactly what it spent.
//!
//! `SPILLWAY_FLOOD_KEYS` sets the number of flood keys (200,000 by
//! default); `scripts/flood.sh` runs it with more, in release.

mod serve_support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use serve_support::temp_dir;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader as AsyncBufReader};
use tokio::net::TcpStream;

const MAX_MEMORY: usize = 16 << 20;

/// What the server's resident set may grow by during the flood:
/// `max_memory`, a quarter more for the allocator's overhead on long keys
/// and freed pages not yet returned, and 16 MiB for the connections'
/// buffers and the runtime.
const RSS_BOUND: usize = MAX_MEMORY + MAX_MEMORY / 4 + (16 << 20);

const CONFIG: &str = r#"
[store]
max_memory = "16MiB"

[[rules]]
name = "per-ip"
key = ["ip"]
algorithm = "token_bucket"
limit = 100
window = "1d"
burst = 100
"#;

/// A `spillway serve` process on port 0, killed on drop.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start() -> Self {
        let dir = temp_dir("serve-flood");
        std::fs::write(dir.join("spillway.toml"), CONFIG).expect("the config is written");
        let mut child = Command::new(env!("CARGO_BIN_EXE_spillway"))
            .args([
                "serve",
                "--config",
                "spillway.toml",
                "--listen",
                "127.0.0.1:0",
            ])
            .current_dir(&dir)
            .env_remove("SPILLWAY_ADMIN_TOKEN")
            .env_remove("SPILLWAY_CHECK_TOKENS")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_owned();
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the server says where it listens");
        Self {
            child,
            addr: addr.parse().expect("a socket address"),
        }
    }

    /// The process's resident set, in bytes.
    fn rss(&self) -> usize {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the server's status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
            .expect("VmRSS")
            * 1024
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One keep-alive connection that sends `POST /v1/check` and reads the
/// answer's JSON.
struct Conn {
    stream: AsyncBufReader<TcpStream>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.expect("the server accepts");
        stream.set_nodelay(true).expect("nodelay");
        Self {
            stream: AsyncBufReader::new(stream),
        }
    }

    /// Checks `cost` of `key` under `per-ip`: the answer's `status` (200
    /// or 429) and `remaining`.
    async fn check(&mut self, key: &str, cost: u64) -> (u64, u64) {
        let body = json!({"rule": "per-ip", "key": format!("ip={key}"), "cost": cost}).to_string();
        let request = format!(
            "POST /v1/check HTTP/1.1\r\nhost: flood\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let deadline = Duration::from_secs(30);
        tokio::time::timeout(deadline, async {
            self.stream
                .get_mut()
                .write_all(request.as_bytes())
                .await
                .expect("the request is sent");
            let mut length = 0;
            let mut line = String::new();
            loop {
                line.clear();
                self.stream.read_line(&mut line).await.expect("a head line");
                assert!(!line.is_empty(), "the server closed the connection");
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    length = v.trim().parse().expect("a length");
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0; length];
            self.stream.read_exact(&mut body).await.expect("the body");
            let v: Value = serde_json::from_slice(&body).expect("JSON");
            let status = v["status"].as_u64().expect("a status");
            let remaining = v["rules"][0]["remaining"].as_u64().unwrap_or(u64::MAX);
            (status, remaining)
        })
        .await
        .expect("an answer within 30 s")
    }
}

/// The `i`th flood key: an address from a scrambled counter, every fourth
/// with a long text the store keeps on the heap.
fn flood_key(i: u64) -> String {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let [a, b, c, d, ..] = (z ^ (z >> 31)).to_le_bytes();
    let mut key = format!("{a}.{b}.{c}.{d}:{i}");
    if i.is_multiple_of(4) {
        key.push_str("|Mozilla/5.0 (X11; Linux x86_64) flood");
    }
    key
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_through_serve_stays_bounded_and_spares_used_keys() {
    let keys: u64 = std::env::var("SPILLWAY_FLOOD_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let server = Server::start();
    let mut control = Conn::open(server.addr).await;
    // The abuser takes its whole quota; each of 100 regular users 10.
    assert_eq!(control.check("mallory", 100).await.0, 200);
    assert_eq!(control.check("mallory", 1).await.0, 429);
    let mut spent = vec![10u64; 100];
    for u in 0..100 {
        assert_eq!(control.check(&format!("user-{u}"), 10).await.0, 200);
    }
    let rss_before = server.rss();
    let started = Instant::now();
    // Four connections flood, each its own share of the keys; between
    // batches the control connection has the abuser try again and a user
    // spend one more.
    let connections = 4u64;
    let batch = 1_000u64;
    let mut peak = 0;
    let mut abuser_admitted = 0;
    let mut next = 0u64;
    let mut flooders = Vec::new();
    for _ in 0..connections {
        flooders.push(Conn::open(server.addr).await);
    }
    while next < keys {
        let end = (next + batch * connections).min(keys);
        let tasks: Vec<_> = flooders
            .drain(..)
            .enumerate()
            .map(|(c, mut conn)| {
                tokio::spawn(async move {
                    let mut i = next + c as u64;
                    while i < end {
                        conn.check(&flood_key(i), 1).await;
                        i += connections;
                    }
                    conn
                })
            })
            .collect();
        for t in tasks {
            flooders.push(t.await.expect("a flooder"));
        }
        next = end;
        abuser_admitted += u64::from(control.check("mallory", 1).await.0 == 200);
        let u = (next / (batch * connections)) as usize % spent.len();
        let (status, _) = control.check(&format!("user-{u}"), 1).await;
        assert_eq!(status, 200, "user-{u} was denied");
        spent[u] += 1;
        peak = peak.max(server.rss().saturating_sub(rss_before));
    }
    let took = started.elapsed();
    eprintln!(
        "{keys} keys through serve in {took:.1?} ({:.0}/s): RSS +{:.1} MiB (bound {:.1} MiB)",
        keys as f64 / took.as_secs_f64(),
        peak as f64 / f64::from(1 << 20),
        RSS_BOUND as f64 / f64::from(1 << 20),
    );
    assert_eq!(abuser_admitted, 0, "the abuser was handed a fresh quota");
    assert_eq!(control.check("mallory", 0).await.1, 0);
    // A token comes back every 864 s: none has during the test.
    assert!(took < Duration::from_secs(800));
    for (u, spent) in spent.iter().enumerate() {
        let (_, remaining) = control.check(&format!("user-{u}"), 0).await;
        assert_eq!(remaining, 100 - spent, "user-{u}");
    }
    assert!(
        peak <= RSS_BOUND,
        "RSS grew by {peak} bytes, over {RSS_BOUND}"
    );
}

//! Real `redis-server` processes for tests: standalone or a 3-master
//! cluster, on free loopback ports, stopped when dropped.
//!
//! When `redis-server` is not installed, [`RedisServer::start`] says so
//! loudly on stderr and returns `None`, so the test can skip; with
//! `SPILLWAY_REQUIRE_REDIS=1` (as CI sets) it panics instead.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` this process started. Killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    cluster: bool,
}

fn redis_missing(what: &str) -> bool {
    let found = Command::new(what)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        return false;
    }
    if std::env::var("SPILLWAY_REQUIRE_REDIS").as_deref() == Ok("1") {
        panic!("SPILLWAY_REQUIRE_REDIS=1 but `{what}` is not on PATH");
    }
    eprintln!(
        "\n*** SKIPPING REDIS TEST: `{what}` is not on PATH (install the Debian package redis-server; \
         set SPILLWAY_REQUIRE_REDIS=1 to make this an error) ***\n"
    );
    true
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Sends one inline command and returns the raw reply.
fn command(port: u16, cmd: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(format!("{cmd}\r\n").as_bytes())?;
    let mut buf = [0u8; 8192];
    let n = stream.read(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

impl RedisServer {
    /// Starts a standalone server, or returns `None` (after a loud message)
    /// when redis-server is missing and Redis is not required.
    pub fn start() -> Option<Self> {
        if redis_missing("redis-server") {
            return None;
        }
        Some(Self::spawn(free_port(), false))
    }

    fn spawn(port: u16, cluster: bool) -> Self {
        let dir =
            std::env::temp_dir().join(format!("spillway-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let mut server = Self {
            port,
            dir,
            child: None,
            cluster,
        };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
            // Tests use DEBUG SLEEP to stall the server.
            .args(["--enable-debug-command", "local"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ]);
            cmd.args(["--cluster-node-timeout", "2000"]);
        }
        self.child = Some(cmd.spawn().expect("redis-server starts"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if command(self.port, "PING").is_ok_and(|r| r.starts_with("+PONG")) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING within 10 s",
            self.port
        );
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (SIGKILL: no chance to say goodbye), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().ok();
            child.wait().ok();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// Sends one inline command (for example `SCRIPT FLUSH`) and returns the
    /// raw RESP reply.
    pub fn command(&self, cmd: &str) -> String {
        command(self.port, cmd).unwrap_or_else(|e| format!("-ERR {e}"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// A 3-master Redis Cluster on free loopback ports, joined with
/// `redis-cli --cluster create`. Its servers are killed on drop.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts and joins 3 masters, or `None` as for [`RedisServer::start`].
    pub fn start() -> Option<Self> {
        if redis_missing("redis-server") || redis_missing("redis-cli") {
            return None;
        }
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::spawn(free_port(), true))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli runs");
        assert!(status.success(), "redis-cli --cluster create failed");
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if nodes
                .iter()
                .all(|n| n.command("CLUSTER INFO").contains("cluster_state:ok"))
            {
                return Some(Self { nodes });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the cluster did not reach cluster_state:ok within 20 s");
    }

    /// `redis://127.0.0.1:PORT/` for every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}

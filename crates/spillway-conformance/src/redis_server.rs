//! Real `redis-server` processes for tests: standalone, a 3-master
//! cluster, or 3 masters with a replica each, on free loopback ports,
//! stopped when dropped.
//!
//! When `redis-server` is not installed, [`RedisServer::start`] says so
//! loudly on stderr and returns `None`, so the test can skip; with
//! `SPILLWAY_REQUIRE_REDIS=1` (as CI sets) it panics instead.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A `redis-server` this process started. Killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    cluster: bool,
    // More `redis-server` arguments (a cluster's announced port, its node
    // timeout), given on every launch, restarts included.
    extra: Vec<String>,
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
    free_ports(1)[0]
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
        Self::spawn_with(port, cluster, Vec::new())
    }

    fn spawn_with(port: u16, cluster: bool, extra: Vec<String>) -> Self {
        let dir =
            std::env::temp_dir().join(format!("spillway-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let mut server = Self {
            port,
            dir,
            child: None,
            cluster,
            extra,
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
            // Its warnings, for a failure to show (see `log_tail`).
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
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
        // Later arguments win: a cluster's own node timeout replaces 2000.
        cmd.args(&self.extra);
        self.child = Some(cmd.spawn().expect("redis-server starts"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if command(self.port, "PING").is_ok_and(|r| r.starts_with("+PONG")) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING within 10 s; its log ends: {}",
            self.port,
            self.log_tail()
        );
    }

    /// The last lines of the server's log (warnings and worse).
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
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

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether it runs (it has not been killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Stops the process with SIGSTOP: it keeps its connections open and
    /// answers nothing, as a hung server does (a refusal would be quicker
    /// to notice). [`resume`](Self::resume) lets it go on.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Lets a [`pause`](Self::pause)d process go on (SIGCONT).
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, name: &str) {
        let pid = self.pid().expect("the server runs");
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(pid.to_string())
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{name} {pid} failed");
    }

    /// Sends one inline command (for example `SCRIPT FLUSH`) and returns the
    /// raw RESP reply.
    pub fn command(&self, cmd: &str) -> String {
        command(self.port, cmd).unwrap_or_else(|e| format!("-ERR {e}"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A paused process dies of SIGKILL all the same.
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

    /// Starts 3 masters with a replica each (6 nodes) on `ports` (from
    /// [`free_ports`]), joins them, and waits until every replica has
    /// copied its master; or `None` as for [`RedisServer::start`].
    ///
    /// `announced`, when given, holds the port each node tells clients and
    /// the other nodes to use for it (`cluster-announce-port`; its bus
    /// port stays its own port + 10000): for example a proxy in front of
    /// it. Those ports must accept connections before this is called, since
    /// replicas reach their masters there. `node_timeout_ms` is
    /// `cluster-node-timeout`: how long a master may be unreachable before
    /// its replica takes over. Slots whose master is down do not stop the
    /// others (`cluster-require-full-coverage no`).
    pub fn start_with_replicas(
        ports: &[u16],
        announced: Option<&[u16]>,
        node_timeout_ms: u32,
    ) -> Option<Self> {
        assert_eq!(ports.len(), 6, "3 masters and 3 replicas");
        if let Some(a) = announced {
            assert_eq!(a.len(), ports.len(), "one announced port per node");
        }
        if redis_missing("redis-server") || redis_missing("redis-cli") {
            return None;
        }
        let nodes: Vec<RedisServer> = ports
            .iter()
            .enumerate()
            .map(|(i, &port)| {
                let mut extra = vec![
                    "--cluster-node-timeout".to_string(),
                    node_timeout_ms.to_string(),
                    "--cluster-require-full-coverage".to_string(),
                    "no".to_string(),
                ];
                if let Some(announced) = announced {
                    extra.extend([
                        "--cluster-announce-ip".to_string(),
                        "127.0.0.1".to_string(),
                        "--cluster-announce-port".to_string(),
                        announced[i].to_string(),
                        "--cluster-announce-bus-port".to_string(),
                        (u32::from(port) + u32::from(BUS_OFFSET)).to_string(),
                    ]);
                }
                RedisServer::spawn_with(port, true, extra)
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli runs");
        assert!(status.success(), "redis-cli --cluster create failed");
        let cluster = Self { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let ok = cluster.nodes.iter().all(|n| {
                let info = n.command("CLUSTER INFO");
                let replication = n.command("INFO replication");
                info.contains("cluster_state:ok")
                    && info.contains("cluster_known_nodes:6")
                    && (replication.contains("role:master")
                        || replication.contains("master_link_status:up"))
            });
            if ok && cluster.masters().len() == 3 {
                return Some(cluster);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // What each node says, for the next one who reads this failure.
        let states: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| {
                let info = n.command("CLUSTER INFO");
                let replication = n.command("INFO replication");
                let pick = |text: &str, field: &str| {
                    text.lines()
                        .find(|l| l.starts_with(field))
                        .unwrap_or(field)
                        .trim()
                        .to_string()
                };
                format!(
                    ":{} {} {} {} {} (log: {})",
                    n.port,
                    pick(&info, "cluster_state"),
                    pick(&info, "cluster_known_nodes"),
                    pick(&replication, "role"),
                    pick(&replication, "master_link_status"),
                    n.log_tail(),
                )
            })
            .collect();
        panic!(
            "the replicated cluster was not ready within 30 s ({} masters): {}",
            cluster.masters().len(),
            states.join("; ")
        );
    }

    /// `redis://127.0.0.1:PORT/` for every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The nodes, to kill, pause or restart one.
    pub fn nodes_mut(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }

    /// The indexes (in [`nodes`](Self::nodes)) of the running nodes that
    /// say they are masters (`ROLE`).
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i].is_running() && self.nodes[i].command("ROLE").contains("master")
            })
            .collect()
    }

    /// The index of the running master that holds `key`'s slot: the one
    /// that answers `EXISTS key` rather than redirecting it.
    pub fn master_of(&self, key: &str) -> Option<usize> {
        self.masters().into_iter().find(|&i| {
            // A master answers a key it does not own with a redirection.
            let reply = self.nodes[i].command(&format!("EXISTS {key}"));
            reply.starts_with(':')
        })
    }
}

/// `n` free loopback ports, distinct, each with its cluster bus port (its
/// port + 10000) free too, and both below the kernel's ephemeral range.
///
/// Below that range, because a port found by binding port 0 and then let go
/// can be taken by anything else that binds port 0 or connects out before
/// redis-server binds it (a proxy, a client's socket, another test): the
/// server then fails to start, or a node of a cluster cannot bind its bus.
/// Nothing takes a port there without asking for it by number. No port is
/// handed out twice in one process, so a server restarted on its port keeps
/// it.
pub fn free_ports(n: usize) -> Vec<u16> {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    const LOWEST: u16 = 10240;
    let highest = ephemeral_start().saturating_sub(BUS_OFFSET);
    assert!(
        highest > LOWEST,
        "no room below the ephemeral ports for a server and its bus port"
    );
    let span = highest - LOWEST;
    // Where to start looking: another process doing the same seldom starts
    // at the same place.
    let seed = std::process::id()
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let mut ports = Vec::with_capacity(n);
    // Held until all are found, so that no other process takes them in
    // the meantime either.
    let mut held = Vec::with_capacity(2 * n);
    for i in 0..u32::from(span) {
        if ports.len() == n {
            break;
        }
        let offset = u16::try_from((seed.wrapping_add(i)) % u32::from(span)).unwrap_or(0);
        let port = LOWEST + offset;
        if given.contains(&port) {
            continue;
        }
        let (Ok(server), Ok(bus)) = (
            TcpListener::bind(("127.0.0.1", port)),
            TcpListener::bind(("127.0.0.1", port + BUS_OFFSET)),
        ) else {
            continue;
        };
        held.extend([server, bus]);
        given.insert(port);
        ports.push(port);
    }
    assert_eq!(
        ports.len(),
        n,
        "{n} free loopback ports below the ephemeral range"
    );
    ports
}

/// How far above a cluster node's port its bus port is.
const BUS_OFFSET: u16 = 10000;

/// The first port of the kernel's ephemeral range (Linux's default, 32768,
/// where it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

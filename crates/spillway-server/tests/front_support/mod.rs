//! What the tests of the forward-auth hook behind real proxies share:
//! which proxies there are, where their binaries are (a test is skipped,
//! loudly, when one is missing, unless `SPILLWAY_REQUIRE_PROXIES=1`), and
//! the proxy process, started from its checked-in configuration in
//! `examples/forward-auth/` with the addresses swapped for free ports,
//! killed on drop.

#![allow(dead_code)] // Each test file uses its own part.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The addresses the checked-in configurations use, swapped for free ones.
pub const SPILLWAY_ADDR: &str = "127.0.0.1:8080";
pub const UPSTREAM_ADDR: &str = "127.0.0.1:9000";
pub const LISTEN_ADDR: &str = "127.0.0.1:8000";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    Nginx,
    Caddy,
    Haproxy,
    Traefik,
}

impl Front {
    pub fn name(self) -> &'static str {
        match self {
            Self::Nginx => "nginx",
            Self::Caddy => "caddy",
            Self::Haproxy => "haproxy",
            Self::Traefik => "traefik",
        }
    }

    /// The binary, if installed.
    pub fn binary(self) -> Option<PathBuf> {
        let names: &[&str] = match self {
            Self::Nginx => &["nginx", "/usr/sbin/nginx"],
            Self::Caddy => &["caddy"],
            Self::Haproxy => &["haproxy", "/usr/sbin/haproxy"],
            Self::Traefik => &["traefik"],
        };
        names.iter().find_map(|name| find_binary(name))
    }

    /// Whether the proxy copies the hook's fields onto admitted responses:
    /// Traefik's `ForwardAuth` cannot.
    pub fn copies_fields(self) -> bool {
        self != Self::Traefik
    }
}

fn find_binary(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        let path = PathBuf::from(name);
        return path.exists().then_some(path);
    }
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .ok()?;
    let path = String::from_utf8(out.stdout).ok()?;
    let path = path.trim();
    (out.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
}

/// The binary of `front`, or `None` (the test is skipped, loudly) when it
/// is not installed and not required.
pub fn binary_or_skip(front: Front) -> Option<PathBuf> {
    if let Some(binary) = front.binary() {
        return Some(binary);
    }
    if std::env::var("SPILLWAY_REQUIRE_PROXIES").as_deref() == Ok("1") {
        panic!(
            "{} is not installed and SPILLWAY_REQUIRE_PROXIES=1",
            front.name()
        );
    }
    eprintln!(
        "SKIPPED: {} is not installed (`bash .ci/run` installs it)",
        front.name()
    );
    None
}

pub fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/forward-auth")
}

/// A free port on 127.0.0.1 (free when asked: the proxy binds it next).
pub fn free_addr() -> SocketAddr {
    let listener = StdListener::bind("127.0.0.1:0").expect("a port");
    listener.local_addr().expect("an address")
}

/// A proxy process from its example configuration, killed on drop.
pub struct FrontProxy {
    child: Child,
    pub addr: SocketAddr,
    log: PathBuf,
    _dir: PathBuf,
}

impl FrontProxy {
    pub async fn start(
        front: Front,
        binary: &Path,
        spillway: SocketAddr,
        upstream: SocketAddr,
    ) -> Self {
        let addr = free_addr();
        let dir = temp_dir(&format!("forward-auth-{}-{}", front.name(), addr.port()));
        let render = |file: &str| {
            let text = std::fs::read_to_string(examples().join(file))
                .unwrap_or_else(|e| panic!("examples/forward-auth/{file}: {e}"));
            let text = text
                .replace(SPILLWAY_ADDR, &spillway.to_string())
                .replace(UPSTREAM_ADDR, &upstream.to_string())
                .replace(LISTEN_ADDR, &addr.to_string())
                .replace("http://:8000", &format!("http://:{}", addr.port()));
            std::fs::write(dir.join(file), text).expect("the configuration is written");
        };
        let mut command = Command::new(binary);
        match front {
            Front::Nginx => {
                render("nginx.conf");
                std::fs::create_dir_all(dir.join("tmp")).expect("nginx's temp dir");
                command
                    .arg("-p")
                    .arg(&dir)
                    .arg("-c")
                    .arg(dir.join("nginx.conf"))
                    // One process: killing a master leaves its workers
                    // running, listening, after the test.
                    .args(["-g", "daemon off; master_process off;"]);
            }
            Front::Caddy => {
                render("Caddyfile");
                // Caddy keeps its state under these: here, not in $HOME.
                command
                    .env("XDG_DATA_HOME", &dir)
                    .env("XDG_CONFIG_HOME", &dir)
                    .args(["run", "--adapter", "caddyfile", "--config"])
                    .arg(dir.join("Caddyfile"));
            }
            Front::Haproxy => {
                render("haproxy.cfg");
                render("spillway.lua");
                // `-db`: in the foreground; the Lua file is found from here.
                command.args(["-db", "-f"]).arg(dir.join("haproxy.cfg"));
            }
            Front::Traefik => {
                render("traefik.yml");
                render("traefik-dynamic.yml");
                command.arg(format!(
                    "--configFile={}",
                    dir.join("traefik.yml").display()
                ));
            }
        }
        let log = dir.join("proxy.log");
        let out = std::fs::File::create(&log).expect("a log file");
        let child = command
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("the log"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("{} starts: {e}", front.name()));
        let mut proxy = Self {
            child,
            addr,
            log,
            _dir: dir,
        };
        proxy.wait_listening(front).await;
        proxy
    }

    async fn wait_listening(&mut self, front: Front) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("{} exited ({status}):\n{}", front.name(), self.log());
            }
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() && self.routes(front).await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not listen on {} within 20 s:\n{}",
                front.name(),
                self.addr,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the proxy routes requests yet: Traefik listens before its
    /// file provider has loaded the routers, and answers 404 until then.
    async fn routes(&self, front: Front) -> bool {
        if front != Front::Traefik {
            return true;
        }
        let Ok(mut stream) = TcpStream::connect(self.addr).await else {
            return false;
        };
        let probe = b"GET / HTTP/1.1\r\nHost: probe.example\r\nConnection: close\r\n\r\n";
        if stream.write_all(probe).await.is_err() {
            return false;
        }
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer));
        if !matches!(read.await, Ok(Ok(_))) {
            return false;
        }
        answer.starts_with(b"HTTP/1.1 ") && !answer.starts_with(b"HTTP/1.1 404")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for FrontProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh directory for one proxy's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}

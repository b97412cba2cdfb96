//! The real routers of `proxy_routers.rs`, each run as a child process on
//! a free loopback port: how each is built and started, and the guard
//! that ends it (by its PID, when dropped, so that a failing test leaves
//! no Tomcat running).
//!
//! Every upstream routes `POST /login`, `GET /report` (so `HEAD` too),
//! `DELETE /account` and any request to the host `admin.example.com` to a
//! limited handler, everything else to `other`, and appends a line
//! `case<TAB>handler<TAB>method<TAB>path` to its log for each request a
//! handler ran for (the case is the request's `X-Case` header). What the
//! framework made of a request is read from that log, not from the answer,
//! which the proxy may have replaced.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The longest an upstream may take to start (Tomcat's JVM on two busy
/// cores is the slow one: about a second alone).
const START: Duration = Duration::from_secs(60);

/// Where the upstreams' sources are.
fn here() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/routers")
}

/// Tomcat's installation: Debian's `tomcat10`, or `CATALINA_HOME`.
fn catalina_home() -> PathBuf {
    std::env::var_os("CATALINA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/share/tomcat10"))
}

/// The routers the harness knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Router {
    /// Tomcat 10.1 (Debian's `tomcat10`): servlets, Host containers.
    Tomcat,
    /// Express 4 (npm), `trust proxy` on, method-override.
    Express,
    /// Node's `http` routing on `new URL(req.url, base).pathname`.
    PlainNode,
    /// Flask 3 and Werkzeug's router and server, `host_matching`.
    Flask,
    /// Starlette (FastAPI's router) on uvicorn (PyPI), `Host` routes.
    Starlette,
    /// Sinatra 3 on Rack 2.2 and WEBrick (Debian).
    Sinatra,
    /// Go's `net/http` server and `ServeMux` (Debian's golang-go).
    Go,
}

impl Router {
    pub fn name(self) -> &'static str {
        match self {
            Router::Tomcat => "tomcat",
            Router::Express => "express",
            Router::PlainNode => "node-url",
            Router::Flask => "flask",
            Router::Starlette => "starlette",
            Router::Sinatra => "sinatra",
            Router::Go => "go",
        }
    }
}

/// A temporary directory of one upstream, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(router: Router) -> Self {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let path = std::env::temp_dir().join(format!(
            "spillway-routers-{}-{}-{stamp}",
            router.name(),
            std::process::id()
        ));
        std::fs::create_dir_all(&path).expect("a temporary directory");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running upstream, killed (by its PID) and waited for when dropped.
pub struct Upstream {
    pub addr: SocketAddr,
    child: Child,
    // Closing it tells the scripts to exit; the kill makes sure.
    stdin: Option<ChildStdin>,
    log: PathBuf,
    stderr: PathBuf,
    // Dropped last: the log and the build live in it.
    _dir: TempDir,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One line of an upstream's log: a handler ran for a request.
#[derive(Clone, Debug)]
pub struct Served {
    pub case: String,
    pub handler: String,
    pub method: String,
    pub path: String,
}

impl Upstream {
    /// Starts `router`, or says why it cannot: then the caller skips it,
    /// loudly, unless `SPILLWAY_REQUIRE_ROUTERS=1` (which `.ci/run` sets
    /// after installing them all), when it fails.
    pub fn start(router: Router) -> Option<Self> {
        match Self::try_start(router) {
            Ok(upstream) => Some(upstream),
            Err(why) => {
                assert!(
                    std::env::var("SPILLWAY_REQUIRE_ROUTERS").as_deref() != Ok("1"),
                    "SPILLWAY_REQUIRE_ROUTERS=1 but {} cannot run: {why}",
                    router.name()
                );
                eprintln!(
                    "SKIPPED: the routing harness has no {} upstream: {why}",
                    router.name()
                );
                None
            }
        }
    }

    fn try_start(router: Router) -> Result<Self, String> {
        let dir = TempDir::new(router);
        let log = dir.0.join("served.log");
        std::fs::write(&log, b"").map_err(|e| format!("the log: {e}"))?;
        let log_arg = log.to_str().expect("a UTF-8 temporary path").to_owned();
        let stderr = dir.0.join("stderr.log");
        let (command, port) = match router {
            Router::Tomcat => tomcat(&dir.0, &log_arg)?,
            Router::Express => {
                let modules = here().join("node_modules/express");
                if !modules.exists() {
                    return Err(format!(
                        "{} is missing: run `npm ci` in {}",
                        modules.display(),
                        here().display()
                    ));
                }
                probe("node", &["--version"])?;
                (node("express_app.js", &log_arg), None)
            }
            Router::PlainNode => {
                probe("node", &["--version"])?;
                (node("plain_node.js", &log_arg), None)
            }
            Router::Flask => {
                probe("python3", &["-c", "import flask"])?;
                let mut command = Command::new("python3");
                command.arg(here().join("flask_app.py")).arg(&log_arg);
                (command, None)
            }
            Router::Starlette => {
                probe("python3", &["-c", "import starlette, uvicorn"])?;
                let mut command = Command::new("python3");
                command.arg(here().join("starlette_app.py")).arg(&log_arg);
                (command, None)
            }
            Router::Sinatra => {
                probe("ruby", &["-e", "require 'sinatra/base'; require 'webrick'"])?;
                let mut command = Command::new("ruby");
                command.arg(here().join("sinatra_app.rb")).arg(&log_arg);
                (command, None)
            }
            Router::Go => {
                let binary = dir.0.join("upstream");
                // The standard library only: no module is ever fetched.
                let mut go = Command::new("go");
                if std::env::var_os("HOME").is_none() && std::env::var_os("GOCACHE").is_none() {
                    // Go keeps its build cache under $HOME.
                    go.env("GOCACHE", dir.0.join("gocache"));
                }
                let built = go
                    .arg("build")
                    .arg("-o")
                    .arg(&binary)
                    .arg(here().join("go/main.go"))
                    .env("GOFLAGS", "-mod=mod")
                    .env("GOPROXY", "off")
                    .env("GOTOOLCHAIN", "local")
                    .env("GO111MODULE", "on")
                    .output()
                    .map_err(|e| format!("go: {e}"))?;
                if !built.status.success() {
                    return Err(format!(
                        "go build failed: {}",
                        String::from_utf8_lossy(&built.stderr)
                    ));
                }
                let mut command = Command::new(binary);
                command.arg(&log_arg);
                (command, None)
            }
        };
        Self::spawn(command, port, dir, log, stderr)
    }

    fn spawn(
        mut command: Command,
        port: Option<u16>,
        dir: TempDir,
        log: PathBuf,
        stderr: PathBuf,
    ) -> Result<Self, String> {
        let err = std::fs::File::create(&stderr).map_err(|e| format!("{e}"))?;
        let mut child = command
            .current_dir(&dir.0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start: {e}"))?;
        let stdout = child.stdout.take().expect("piped");
        let stdin = child.stdin.take();
        let mut upstream = Self {
            addr: SocketAddr::from(([127, 0, 0, 1], port.unwrap_or(0))),
            child,
            stdin,
            log,
            stderr,
            _dir: dir,
        };
        // The scripts say their port on their first line; Tomcat was given
        // one.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(first)) = lines.next() {
                let _ = tx.send(first);
            }
            // Drain the rest, so that a chatty upstream never blocks.
            for _ in lines.map_while(Result::ok) {}
        });
        if port.is_none() {
            let first = rx
                .recv_timeout(START)
                .map_err(|_| format!("said no port: {}", upstream.stderr_tail()))?;
            let found: serde_json::Value =
                serde_json::from_str(&first).map_err(|e| format!("{first:?}: {e}"))?;
            let port = found["port"].as_u64().ok_or("no port")? as u16;
            upstream.addr.set_port(port);
        }
        upstream.answers("probe")?;
        Ok(upstream)
    }

    /// Waits until a plain request (`X-Case: id`) is routed and logged:
    /// the upstream is up, or (later) still up.
    pub fn answers(&mut self, id: &str) -> Result<(), String> {
        let deadline = Instant::now() + START;
        let probe = format!(
            "GET /probe HTTP/1.1\r\nHost: app.example.com\r\nX-Case: {id}\r\nConnection: close\r\n\r\n"
        );
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("exited ({status}): {}", self.stderr_tail()));
            }
            if let Ok(mut stream) = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)) {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = stream.write_all(probe.as_bytes());
                let mut answer = Vec::new();
                let _ = stream.read_to_end(&mut answer);
                if self.served().iter().any(|s| s.case == id) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "not ready within {START:?}: {}",
                    self.stderr_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Every line of the log so far.
    pub fn served(&self) -> Vec<Served> {
        let text = std::fs::read(&self.log).unwrap_or_default();
        String::from_utf8_lossy(&text)
            .lines()
            .filter_map(|line| {
                let mut parts = line.splitn(4, '\t');
                Some(Served {
                    case: parts.next()?.to_owned(),
                    handler: parts.next()?.to_owned(),
                    method: parts.next()?.to_owned(),
                    path: parts.next().unwrap_or_default().to_owned(),
                })
            })
            .collect()
    }
}

/// Fails with a reason unless `program args` runs and succeeds.
fn probe(program: &str, args: &[&str]) -> Result<(), String> {
    match Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("`{program} {}` failed ({status})", args.join(" "))),
        Err(e) => Err(format!("{program}: {e}")),
    }
}

fn node(script: &str, log: &str) -> Command {
    let mut command = Command::new("node");
    command.arg(here().join(script)).arg(log);
    command
}

/// Tomcat with a CATALINA_BASE of its own in `base`: the servlets compiled
/// there by `javac`, two webapps (every host, and admin.example.com), the
/// connector on a free port. Started as `java ... Bootstrap start`, not
/// through catalina.sh, so that the child's PID is the JVM's.
fn tomcat(base: &Path, log: &str) -> Result<(Command, Option<u16>), String> {
    let home = catalina_home();
    let api = home.join("lib/servlet-api.jar");
    if !api.exists() {
        return Err(format!(
            "{} is missing (apt-get install tomcat10, or set CATALINA_HOME)",
            api.display()
        ));
    }
    probe("javac", &["-version"])?;
    let sources = here().join("tomcat");
    let classes = base.join("classes");
    let compiled = Command::new("javac")
        .arg("-d")
        .arg(&classes)
        .arg("-cp")
        .arg(&api)
        .arg(sources.join("Routes.java"))
        .output()
        .map_err(|e| format!("javac: {e}"))?;
    if !compiled.status.success() {
        return Err(format!(
            "javac failed: {}",
            String::from_utf8_lossy(&compiled.stderr)
        ));
    }
    for (webapp, descriptor) in [("app", "app.xml"), ("admin", "admin.xml")] {
        let root = base.join("webapps").join(webapp).join("ROOT/WEB-INF");
        std::fs::create_dir_all(root.join("classes/routes")).map_err(|e| e.to_string())?;
        std::fs::copy(sources.join(descriptor), root.join("web.xml")).map_err(|e| e.to_string())?;
        for class in std::fs::read_dir(classes.join("routes")).map_err(|e| e.to_string())? {
            let class = class.map_err(|e| e.to_string())?.path();
            let to = root
                .join("classes/routes")
                .join(class.file_name().expect("a name"));
            std::fs::copy(&class, to).map_err(|e| e.to_string())?;
        }
    }
    for dir in ["conf", "logs", "temp", "work"] {
        std::fs::create_dir_all(base.join(dir)).map_err(|e| e.to_string())?;
    }
    // A free port, closed again for Tomcat to take: a race with other
    // processes of this machine that is lost rarely, and then loudly.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let server = std::fs::read_to_string(sources.join("server.xml"))
        .map_err(|e| e.to_string())?
        .replace("@PORT@", &port.to_string())
        .replace("@BASE@", base.to_str().expect("a UTF-8 path"));
    std::fs::write(base.join("conf/server.xml"), server).map_err(|e| e.to_string())?;
    // The default servlets' descriptor, as shipped (Debian keeps it in
    // etc/); Tomcat starts without one too, with a warning.
    for shipped in [home.join("etc/web.xml"), home.join("conf/web.xml")] {
        if shipped.exists() {
            std::fs::copy(&shipped, base.join("conf/web.xml")).map_err(|e| e.to_string())?;
            break;
        }
    }
    let bin = home.join("bin");
    let mut command = Command::new("java");
    command
        .args(["-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"])
        .arg(format!("-Drouters.log={log}"))
        .arg(format!("-Dcatalina.base={}", base.display()))
        .arg(format!("-Dcatalina.home={}", home.display()))
        .arg(format!("-Djava.io.tmpdir={}", base.join("temp").display()))
        .arg("-cp")
        .arg(format!(
            "{}:{}",
            bin.join("bootstrap.jar").display(),
            bin.join("tomcat-juli.jar").display()
        ))
        .args(["org.apache.catalina.startup.Bootstrap", "start"]);
    Ok((command, Some(port)))
}

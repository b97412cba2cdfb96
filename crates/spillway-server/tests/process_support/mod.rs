//! What the tests of the `spillway` binary under load share: the process
//! (started, signalled, waited for, killed on drop), a client that reads
//! answers byte by byte so that a reset or a cut answer is seen as such,
//! and an upstream for `spillway proxy` that holds requests until told.

#![allow(dead_code)] // Each test file uses its own part.

pub mod load;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A fresh directory of its own for a test, `name` and the test process's
/// id under the system's temp directory.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("spillway-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temp dir");
    dir
}

/// A `spillway` process, killed on drop if still running.
pub struct Process {
    pub child: Child,
    /// The HTTP address it serves (the API's, or the proxy's).
    pub addr: SocketAddr,
    /// The gRPC address, when it serves one.
    pub grpc: Option<SocketAddr>,
    /// The admin listener's address (`proxy --admin-listen`), when it has one.
    pub admin: Option<SocketAddr>,
    log: Arc<Mutex<String>>,
    lines: mpsc::Receiver<String>,
}

impl Process {
    /// Starts `spillway <command> <args>` in `dir` and waits until it
    /// listens.
    pub fn start(command: &str, args: &[&str], dir: &Path) -> Self {
        let mut binary = Command::new(env!("CARGO_BIN_EXE_spillway"));
        binary.arg(command).args(args);
        Self::spawn(binary, command, args, dir)
    }

    /// `spillway proxy` in front of `upstream` with `config`, its admin
    /// listener on a port of its own.
    pub fn proxy_with_admin(upstream: &Upstream, config: &Path, dir: &Path) -> Self {
        let upstream_url = format!("http://{}", upstream.addr);
        Self::start(
            "proxy",
            &[
                "--upstream",
                &upstream_url,
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--config",
                config.to_str().expect("a UTF-8 path"),
            ],
            dir,
        )
    }

    /// [`start`](Self::start) with the process's open-file limit lowered
    /// to `files` (by the shell's `ulimit -n`, so that this process keeps
    /// its own).
    pub fn start_with_file_limit(command: &str, args: &[&str], dir: &Path, files: u32) -> Self {
        let mut shell = Command::new("sh");
        shell
            .arg("-c")
            .arg(format!("ulimit -n {files} && exec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_spillway"))
            .arg(command)
            .args(args);
        Self::spawn(shell, command, args, dir)
    }

    /// Starts `command` (the binary's `command`, with `args`) in `dir`
    /// and waits until it listens.
    fn spawn(mut command_line: Command, command: &str, args: &[&str], dir: &Path) -> Self {
        let mut child = command_line
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
        let mut process = Self {
            child,
            addr: "0.0.0.0:0".parse().expect("an address"),
            grpc: None,
            admin: None,
            log,
            lines,
        };
        let (marker, end) = match command {
            "proxy" => ("proxying listen=", " "),
            _ => ("listening on http://", " "),
        };
        let grpc_marker = "Envoy rate limit service (gRPC) on ";
        let wants_grpc = args.contains(&"--grpc-listen");
        let admin_marker = "admin listener on http://";
        let wants_admin = args.contains(&"--admin-listen");
        loop {
            let line = process.next_line();
            if let Some(rest) = line.split(grpc_marker).nth(1) {
                process.grpc = Some(rest.trim().parse().expect("a gRPC address"));
            }
            if let Some(rest) = line.split(admin_marker).nth(1) {
                process.admin = Some(rest.trim().parse().expect("an admin address"));
            }
            if let Some(rest) = line.split(marker).nth(1) {
                let addr = rest.split(end).next().expect("an address");
                process.addr = addr.parse().expect("a socket address");
            }
            if process.addr.port() != 0
                && (!wants_grpc || process.grpc.is_some())
                && (!wants_admin || process.admin.is_some())
            {
                return process;
            }
        }
    }

    fn next_line(&mut self) -> String {
        match self.lines.recv_timeout(Duration::from_secs(20)) {
            Ok(line) => line,
            Err(_) => panic!("the process said nothing; its log:\n{}", self.log()),
        }
    }

    /// The log so far.
    pub fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    /// Waits (up to 20 s) for a log line containing `text`.
    pub fn wait_for(&mut self, text: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(text) => return line,
                Ok(_) => {}
                Err(_) => panic!("no log line with {text:?}; the log:\n{}", self.log()),
            }
        }
    }

    /// Sends the signal `name` (`TERM`, `HUP`) to the process.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("a status").is_none()
    }

    /// Its exit status, waited for at most `within`.
    pub async fn exited_within(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("a status") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the process did not exit within {within:?}; its log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response read whole off the wire.
#[derive(Debug)]
pub struct Raw {
    pub status: u16,
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
}

impl Raw {
    /// Whether the server said it closes the connection after it.
    pub fn closes(&self) -> bool {
        self.headers
            .get("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// How a wait for an answer ended, when not with one.
#[derive(Debug, PartialEq, Eq)]
pub enum Cut {
    /// The connection was reset (ECONNRESET, EPIPE).
    Reset,
    /// The server closed it cleanly before sending a byte of an answer.
    Closed,
    /// It closed it part way through an answer.
    Partial(usize),
    /// Something that is not an HTTP/1.1 response.
    Malformed(String),
    /// No answer in time.
    TimedOut,
}

/// An HTTP/1.1 connection spoken by hand.
pub struct Conn {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> Self {
        Self::new(TcpStream::connect(addr).await.expect("connect"))
    }

    pub fn new(stream: TcpStream) -> Self {
        let _ = stream.set_nodelay(true);
        Self {
            stream,
            buf: Vec::new(),
        }
    }

    /// Writes `bytes`; a reset is `Err(Cut::Reset)`.
    pub async fn send(&mut self, bytes: &[u8]) -> Result<(), Cut> {
        self.stream.write_all(bytes).await.map_err(|_| Cut::Reset)
    }

    /// Reads one response, with a `Content-Length` body, within `within`.
    pub async fn response(&mut self, within: Duration) -> Result<Raw, Cut> {
        tokio::time::timeout(within, self.read_response())
            .await
            .unwrap_or(Err(Cut::TimedOut))
    }

    async fn read_response(&mut self) -> Result<Raw, Cut> {
        loop {
            let mut lines = [httparse::EMPTY_HEADER; 32];
            let mut res = httparse::Response::new(&mut lines);
            match res.parse(&self.buf) {
                Ok(httparse::Status::Complete(head)) => {
                    let headers: HashMap<String, String> = res
                        .headers
                        .iter()
                        .map(|h| {
                            (
                                h.name.to_ascii_lowercase(),
                                String::from_utf8_lossy(h.value).into_owned(),
                            )
                        })
                        .collect();
                    let status = res.code.unwrap_or(0);
                    let Some(length) = headers
                        .get("content-length")
                        .and_then(|v| v.parse::<usize>().ok())
                    else {
                        return Err(Cut::Malformed(format!(
                            "no content-length: {}",
                            String::from_utf8_lossy(&self.buf)
                        )));
                    };
                    while self.buf.len() < head + length {
                        self.fill().await?;
                    }
                    let body = self.buf[head..head + length].to_vec();
                    self.buf.drain(..head + length);
                    return Ok(Raw {
                        status,
                        headers,
                        body,
                    });
                }
                Ok(httparse::Status::Partial) => self.fill().await?,
                Err(e) => return Err(Cut::Malformed(e.to_string())),
            }
        }
    }

    async fn fill(&mut self) -> Result<(), Cut> {
        let mut chunk = [0; 8192];
        match self.stream.read(&mut chunk).await {
            Ok(0) if self.buf.is_empty() => Err(Cut::Closed),
            Ok(0) => Err(Cut::Partial(self.buf.len())),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(())
            }
            Err(_) => Err(Cut::Reset),
        }
    }

    /// Waits (within `within`) for the server to close the connection:
    /// `Ok` for a clean close with nothing more sent, else how it ended.
    pub async fn closed(&mut self, within: Duration) -> Result<(), Cut> {
        match tokio::time::timeout(within, self.fill()).await {
            Err(_) => Err(Cut::TimedOut),
            Ok(Err(Cut::Closed)) => Ok(()),
            Ok(Err(cut)) => Err(cut),
            Ok(Ok(())) => Err(Cut::Malformed(format!(
                "bytes after the last answer: {}",
                String::from_utf8_lossy(&self.buf)
            ))),
        }
    }
}

/// A `POST /v1/check` request for `rule` and `key`, whole, and split in two
/// (its head and half its body; the rest).
pub fn check_request(rule: &str, key: &str) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let body = format!(r#"{{"rule":"{rule}","key":"ip={key}"}}"#);
    let head = format!(
        "POST /v1/check HTTP/1.1\r\nhost: spillway\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let whole = format!("{head}{body}").into_bytes();
    let (first, rest) = body.split_at(body.len() / 2);
    (
        whole,
        format!("{head}{first}").into_bytes(),
        rest.as_bytes().to_vec(),
    )
}

/// An upstream for `spillway proxy`, on 127.0.0.1: `GET /hold` waits until
/// [`release`](Upstream::release), any other path is answered at once; each
/// path's arrivals are counted.
pub struct Upstream {
    pub addr: SocketAddr,
    arrivals: Arc<Mutex<HashMap<String, usize>>>,
    held: Arc<AtomicUsize>,
    release: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("an address");
        let arrivals = Arc::new(Mutex::new(HashMap::new()));
        let held = Arc::new(AtomicUsize::new(0));
        let (release, released) = watch::channel(false);
        let (counts, holding) = (arrivals.clone(), held.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (counts, holding, released) =
                    (counts.clone(), holding.clone(), released.clone());
                let service = hyper::service::service_fn(move |req: http::Request<_>| {
                    let path = req.uri().path().to_owned();
                    *counts
                        .lock()
                        .expect("counts")
                        .entry(path.clone())
                        .or_insert(0) += 1;
                    let (holding, mut released) = (holding.clone(), released.clone());
                    async move {
                        drop(req);
                        if path == "/hold" {
                            holding.fetch_add(1, Ordering::SeqCst);
                            let _ = released.wait_for(|&r| r).await;
                        }
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from_static(b"upstream")),
                        ))
                    }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
                );
            }
        });
        Self {
            addr,
            arrivals,
            held,
            release,
            task,
        }
    }

    /// How many requests for `path` arrived.
    pub fn arrived(&self, path: &str) -> usize {
        *self
            .arrivals
            .lock()
            .expect("counts")
            .get(path)
            .unwrap_or(&0)
    }

    /// How many `/hold` requests are being held.
    pub fn holding(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Answers the held requests, and every later one at once.
    pub fn release(&self) {
        let _ = self.release.send(true);
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

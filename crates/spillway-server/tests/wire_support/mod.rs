//! What the raw-wire proxy tests share (`proxy_wire.rs`, `proxy_upstream.rs`):
//! clients and upstreams that are raw TCP sockets writing and reading the
//! bytes themselves, heads parsed with httparse, and a proxy started on a
//! free port.

#![allow(dead_code)]

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use spillway_server::config::Config;
use spillway_server::proxy::{ProxyOptions, serve_with};
use spillway_server::state::{Live, Loaded};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::clock_support;

/// The longest any one step may take: a bug fails the test instead of
/// hanging it.
pub const WAIT: Duration = Duration::from_secs(5);

/// Between the pieces of a request sent in pieces, so that the proxy reads
/// them apart. No outcome depends on it.
pub const PAUSE: Duration = Duration::from_millis(20);

/// A rule that never denies in these tests.
pub const GENEROUS: &str = r#"
[[rules]]
name = "generous"
key = ["ip"]
algorithm = "fixed_window"
limit = 1000
window = "1m"
"#;

pub async fn within<T>(what: &str, step: impl Future<Output = T>) -> T {
    wait_up_to(Some(WAIT), what, step).await
}

pub async fn wait_up_to<T>(
    limit: Option<Duration>,
    what: &str,
    step: impl Future<Output = T>,
) -> T {
    match limit {
        Some(limit) => match tokio::time::timeout(limit, step).await {
            Ok(done) => done,
            Err(_) => panic!("{what}: nothing within {limit:?}"),
        },
        None => step.await,
    }
}

/// Starts a proxy with `config` in front of `upstream`; returns its address.
pub async fn start_proxy(config: &str, upstream: SocketAddr) -> SocketAddr {
    start_proxy_until(config, upstream, std::future::pending())
        .await
        .0
}

/// [`start_proxy`], stopping when `stop` is ready; returns its address and
/// its task.
pub async fn start_proxy_until(
    config: &str,
    upstream: SocketAddr,
    stop: impl Future<Output = ()> + Send + 'static,
) -> (SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>) {
    spawn_proxy(config, upstream, ProxyOptions::default(), stop).await
}

async fn spawn_proxy(
    config: &str,
    upstream: SocketAddr,
    options: ProxyOptions,
    stop: impl Future<Output = ()> + Send + 'static,
) -> (SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>) {
    clock_support::clear_of_a_minute_boundary();
    let config = Config::parse(config).expect("a valid config");
    let engine = Loaded::build(config, None, None).await.expect("an engine");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    let upstream = format!("http://{upstream}").parse().expect("a URL");
    let server = tokio::spawn(serve_with(
        listener,
        upstream,
        Arc::new(Live::new(engine)),
        options,
        stop,
    ));
    (addr, server)
}

pub fn get(target: &str) -> Vec<u8> {
    format!("GET {target} HTTP/1.1\r\nHost: spillway.test\r\n\r\n").into_bytes()
}

pub fn post(target: &str, body: &[u8]) -> Vec<u8> {
    let head = format!(
        "POST {target} HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    [head.as_bytes(), body].concat()
}

/// `len` bytes that are not all alike, so a lost or moved piece shows.
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

/// A message's header lines, in order, names lowercased.
#[derive(Debug, Clone, Default)]
pub struct Headers(pub Vec<(String, String)>);

impl Headers {
    pub fn parse(lines: &[httparse::Header<'_>]) -> Self {
        let lines = lines.iter().map(|line| {
            let value = String::from_utf8_lossy(line.value).into_owned();
            (line.name.to_ascii_lowercase(), value)
        });
        Self(lines.collect())
    }

    /// The value of each `name` line, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        let lines = self.0.iter().filter(|(n, _)| n == name);
        lines.map(|(_, value)| value.as_str()).collect()
    }

    /// The elements of a list header, however the sender split it across
    /// lines: two lines `a` and `b` are the same list as one `a, b`.
    pub fn list(&self, name: &str) -> Vec<&str> {
        let elements = self.all(name).into_iter().flat_map(|v| v.split(','));
        elements.map(str::trim).filter(|e| !e.is_empty()).collect()
    }

    /// How these headers delimit the body that follows (RFC 9112 section
    /// 6.3); None if they do not. An ambiguous message fails the test: the
    /// proxy must never send one.
    pub fn framing(&self) -> Option<Framing> {
        let codings = self.list("transfer-encoding");
        let lengths = self.list("content-length");
        match (codings.as_slice(), lengths.as_slice()) {
            ([], []) => None,
            ([], [length, others @ ..]) if others.iter().all(|o| o == length) => {
                let length = length.parse().expect("a numeric Content-Length");
                Some(Framing::Length(length))
            }
            ([.., last], []) if last.eq_ignore_ascii_case("chunked") => Some(Framing::Chunked),
            _ => panic!(
                "ambiguous framing: Transfer-Encoding {codings:?}, Content-Length {lengths:?}"
            ),
        }
    }
}

/// How a body was delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body, whatever the headers say: a response to HEAD, a 1xx, 204
    /// or 304.
    None,
    Length(usize),
    Chunked,
    /// By the end of the connection.
    Close,
}

/// A request as the raw upstream read it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub target: String,
    pub headers: Headers,
    pub body: Vec<u8>,
}

/// A response as a raw client read it.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Headers,
    pub body: Vec<u8>,
    pub framing: Framing,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub type Parsed<T> = Result<Option<(usize, T)>, httparse::Error>;

pub fn request_head(buf: &[u8]) -> Parsed<Request> {
    let mut lines = [httparse::EMPTY_HEADER; 64];
    let mut head = httparse::Request::new(&mut lines);
    let httparse::Status::Complete(len) = head.parse(buf)? else {
        return Ok(None);
    };
    let request = Request {
        method: head.method.unwrap_or_default().to_owned(),
        target: head.path.unwrap_or_default().to_owned(),
        headers: Headers::parse(head.headers),
        body: Vec::new(),
    };
    Ok(Some((len, request)))
}

pub fn response_head(buf: &[u8]) -> Parsed<Response> {
    let mut lines = [httparse::EMPTY_HEADER; 64];
    let mut head = httparse::Response::new(&mut lines);
    let httparse::Status::Complete(len) = head.parse(buf)? else {
        return Ok(None);
    };
    let response = Response {
        status: head.code.unwrap_or_default(),
        headers: Headers::parse(head.headers),
        body: Vec::new(),
        framing: Framing::None,
    };
    Ok(Some((len, response)))
}

/// Whether an I/O error just means that the peer has gone.
pub fn ended(e: &io::Error) -> bool {
    use io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    matches!(e.kind(), BrokenPipe | ConnectionAborted | ConnectionReset)
}

/// One end of an HTTP/1.1 connection, read and written as bytes. What was
/// read past the current message stays in `buf` for the next one.
pub struct Wire {
    pub stream: TcpStream,
    pub buf: Vec<u8>,
    /// How long one read or write may wait: bounded for the tests' clients;
    /// not for the raw upstream, whose pooled connections idle between
    /// requests for as long as the proxy likes.
    pub patience: Option<Duration>,
}

impl Wire {
    pub async fn connect(addr: SocketAddr) -> Self {
        let stream = within("connecting", TcpStream::connect(addr))
            .await
            .expect("connected");
        // Each write its own segment: pieces sent apart arrive apart.
        stream.set_nodelay(true).expect("TCP_NODELAY");
        Self {
            stream,
            buf: Vec::new(),
            patience: Some(WAIT),
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        wait_up_to(self.patience, "writing", self.stream.write_all(bytes)).await
    }

    /// Sends `pieces`, one write each, a pause apart.
    pub async fn send_in_pieces(&mut self, pieces: &[&[u8]]) {
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(PAUSE).await;
            }
            self.send(piece).await.expect("sent");
        }
    }

    /// Reads more bytes; false once the connection has ended.
    pub async fn fill(&mut self) -> bool {
        self.buf.reserve(64 * 1024);
        let reading = self.stream.read_buf(&mut self.buf);
        match wait_up_to(self.patience, "waiting for bytes or the end", reading).await {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) if ended(&e) => false,
            Err(e) => panic!("reading: {e}"),
        }
    }

    /// Whether the peer ends the connection now (within [`WAIT`]), with
    /// nothing more to read.
    pub async fn closes(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let mut byte = [0; 1];
        match tokio::time::timeout(WAIT, self.stream.read(&mut byte)).await {
            Ok(Ok(0)) => true,
            Ok(Err(e)) if ended(&e) => true,
            Ok(Err(e)) => panic!("reading: {e}"),
            Ok(Ok(_)) | Err(_) => false,
        }
    }

    /// Reads until `parse` finds a whole head, and takes it; None if the
    /// connection ends before a head starts.
    pub async fn head<T>(&mut self, parse: fn(&[u8]) -> Parsed<T>) -> Option<T> {
        loop {
            match parse(&self.buf) {
                Ok(Some((len, head))) => {
                    self.buf.drain(..len);
                    return Some(head);
                }
                Ok(None) => {}
                Err(e) => panic!("not a head ({e}): {:?}", String::from_utf8_lossy(&self.buf)),
            }
            if !self.fill().await {
                let rest = String::from_utf8_lossy(&self.buf);
                assert!(
                    rest.is_empty(),
                    "the connection ended inside a head: {rest:?}"
                );
                return None;
            }
        }
    }

    /// The next `n` bytes.
    pub async fn take(&mut self, n: usize) -> Vec<u8> {
        while self.buf.len() < n {
            let had = self.buf.len();
            assert!(
                self.fill().await,
                "the connection ended {had} bytes into {n}"
            );
        }
        self.buf.drain(..n).collect()
    }

    /// The next line, without its CRLF.
    pub async fn line(&mut self) -> String {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = self.take(end + 2).await;
                return String::from_utf8_lossy(&line[..end]).into_owned();
            }
            assert!(self.fill().await, "the connection ended inside a line");
        }
    }

    /// A chunked body, decoded (RFC 9112 section 7.1); trailers are dropped.
    pub async fn chunked(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line = self.line().await;
            let size = line.split(';').next().unwrap_or_default().trim_end();
            let size = usize::from_str_radix(size, 16)
                .unwrap_or_else(|_| panic!("not a chunk size line: {line:?}"));
            if size == 0 {
                break;
            }
            body.extend(self.take(size).await);
            assert_eq!(self.line().await, "", "chunk data not followed by CRLF");
        }
        // Trailer fields, up to a blank line.
        while !self.line().await.is_empty() {}
        body
    }

    pub async fn body(&mut self, framing: Framing) -> Vec<u8> {
        match framing {
            Framing::None => Vec::new(),
            Framing::Length(n) => self.take(n).await,
            Framing::Chunked => self.chunked().await,
            Framing::Close => {
                while self.fill().await {}
                std::mem::take(&mut self.buf)
            }
        }
    }

    /// The next request; None if the connection ends before one starts.
    pub async fn request(&mut self) -> Option<Request> {
        let mut request = self.head(request_head).await?;
        let framing = request.headers.framing().unwrap_or(Framing::Length(0));
        request.body = self.body(framing).await;
        Some(request)
    }

    /// The next response, to a `method` request; None if the connection
    /// ends before one starts. A 1xx is a response of its own here.
    pub async fn response(&mut self, method: &str) -> Option<Response> {
        let mut response = self.head(response_head).await?;
        let bodiless = matches!(response.status, 100..200 | 204 | 304);
        response.framing = if bodiless || method == "HEAD" {
            Framing::None
        } else {
            response.headers.framing().unwrap_or(Framing::Close)
        };
        response.body = self.body(response.framing).await;
        Some(response)
    }

    /// Sends `request` and reads its response; None if the connection turns
    /// out to be closed, on writing or before a response starts.
    pub async fn try_exchange(&mut self, request: &[u8]) -> Option<Response> {
        if let Err(e) = self.send(request).await {
            assert!(ended(&e), "writing: {e}");
            return None;
        }
        let method = request.split(|&b| b == b' ').next().unwrap_or_default();
        self.response(&String::from_utf8_lossy(method)).await
    }

    pub async fn exchange(&mut self, request: &[u8]) -> Response {
        let response = self.try_exchange(request).await;
        response.expect("a response, not a closed connection")
    }
}

/// What the raw upstream received, and on which of its connections
/// (numbered from 0, as accepted).
#[derive(Debug, Clone)]
pub struct Seen {
    pub connection: usize,
    pub request: Request,
}

/// The raw upstream's answer to a request: exactly these bytes, then
/// whether to close the connection.
pub struct Reply {
    pub bytes: Vec<u8>,
    pub close: bool,
}

/// `200 OK` naming the request, with a Content-Length, kept alive.
pub fn echo(request: &Request) -> Reply {
    let body = format!("upstream got {} {}", request.method, request.target);
    let bytes = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    Reply {
        bytes: bytes.into_bytes(),
        close: false,
    }
}

/// An upstream that reads requests and writes its replies as bytes.
pub struct RawUpstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// The number of each connection as it ends.
    pub ended: mpsc::UnboundedReceiver<usize>,
}

impl RawUpstream {
    pub async fn start(reply: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> Self {
        Self::start_delayed(reply, |_| Duration::ZERO).await
    }

    /// [`start`](Self::start), each reply written after `delay` of its
    /// request.
    pub async fn start_delayed(
        reply: impl Fn(&Request) -> Reply + Send + Sync + 'static,
        delay: impl Fn(&Request) -> Duration + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("an address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (ending, ended) = mpsc::unbounded_channel();
        let (log, reply, delay) = (seen.clone(), Arc::new(reply), Arc::new(delay));
        tokio::spawn(async move {
            for connection in 0.. {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (log, reply, ending) = (log.clone(), reply.clone(), ending.clone());
                let delay = delay.clone();
                tokio::spawn(async move {
                    let mut wire = Wire {
                        stream,
                        buf: Vec::new(),
                        patience: None,
                    };
                    while let Some(request) = wire.request().await {
                        let Reply { bytes, close } = reply(&request);
                        let wait = delay(&request);
                        if !wait.is_zero() {
                            tokio::time::sleep(wait).await;
                        }
                        let seen = Seen {
                            connection,
                            request,
                        };
                        log.lock().expect("not poisoned").push(seen);
                        if wire.send(&bytes).await.is_err() || close {
                            break;
                        }
                    }
                    drop(wire);
                    let _ = ending.send(connection);
                });
            }
        });
        Self { addr, seen, ended }
    }

    pub async fn echo() -> Self {
        Self::start(echo).await
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("not poisoned").clone()
    }

    pub fn targets(&self) -> Vec<String> {
        self.seen().into_iter().map(|s| s.request.target).collect()
    }

    /// Waits for one of its connections to end; returns its number.
    pub async fn ended(&mut self) -> usize {
        let ended = within("an upstream connection ending", self.ended.recv()).await;
        ended.expect("the upstream running")
    }
}

/// After an exchange that leaves the connection in doubt (a body the proxy
/// may not have read, a request it refused), either the connection is
/// closed or the next request gets its own response.
pub async fn assert_closed_or_the_next_request_answered(client: &mut Wire) {
    if let Some(next) = client.try_exchange(&get("/next")).await {
        assert_eq!(
            (next.status, next.text()),
            (200, "upstream got GET /next".into())
        );
    }
}

/// [`start_proxy`] with `options`.
pub async fn start_proxy_with(
    config: &str,
    upstream: SocketAddr,
    options: ProxyOptions,
) -> SocketAddr {
    spawn_proxy(config, upstream, options, std::future::pending())
        .await
        .0
}

/// An upstream whose every connection is handed to `serve`, numbered.
pub async fn scripted_upstream<F, Fut>(serve: F) -> SocketAddr
where
    F: Fn(usize, Wire) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move {
        for n in 0.. {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            stream.set_nodelay(true).expect("nodelay");
            tokio::spawn(serve(
                n,
                Wire {
                    stream,
                    buf: Vec::new(),
                    patience: None,
                },
            ));
        }
    });
    addr
}

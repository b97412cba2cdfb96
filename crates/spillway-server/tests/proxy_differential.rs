//! The proxy's differential harness: hostile bytes sent through `spillway
//! proxy` to a strict upstream that parses with an independent HTTP/1.1
//! implementation (Python's h11), and what each side made of them compared.
//!
//! For every case, on a proxy of its own:
//! 1. the upstream never parses a request the rules did not decide on (no
//!    smuggling): the requests it read are at most the ones the proxy
//!    admitted;
//! 2. the client gets the upstream's answers to exactly those requests, in
//!    order (no response desync), less any at the end of a connection that
//!    closed;
//! 3. the upstream never meets bytes it cannot parse, but for a body that
//!    the client cut short (the proxy then stops forwarding it).
//!
//! The corpus holds the review's findings and the classic shapes (CL.TE,
//! TE.CL, TE.TE, CL.0, obs-fold, bare CR and LF, duplicate and comma-joined
//! lengths, chunk extensions and trailers, pipelined requests behind a
//! denied one), then mangled requests from fixed seeds. CI runs it as is;
//! `SPILLWAY_DIFFERENTIAL_CASES=100000 cargo test -p spillway-server --test
//! proxy_differential -- --nocapture` runs that many mangled cases by hand.
//!
//! Needs `python3` with `h11` (`python3 -m pip install h11`); without it
//! the test is skipped with a message, unless `SPILLWAY_REQUIRE_H11=1`
//! (which `.ci/run` sets).

// The wire tests use the rest of it.
#[allow(dead_code)]
mod mangle;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use spillway::Decision;
use spillway_server::config::Config;
use spillway_server::proxy::{ProxyOptions, serve_with};
use spillway_server::state::{Live, Loaded};
use spillway_tower::{Observer, RuleOutcome};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The longest a case may take to end, or the upstream to see the end:
/// generous, as the whole suite shares two cores in CI; a case that passes
/// takes milliseconds.
const WAIT: Duration = Duration::from_secs(20);

/// Every request counted under one rule; the 21st on a proxy is denied, so
/// that pipelined requests behind a denied one are tried too.
const CONFIG: &str = r#"
[[rules]]
name = "all"
key = ["ip"]
algorithm = "fixed_window"
limit = 20
window = "1h"
"#;

/// The strict upstream: a Python process running h11, and what it logged.
struct Strict {
    child: Child,
    // Closing it ends the process.
    stdin: Option<ChildStdin>,
    port: u16,
    log: Arc<Mutex<Vec<Value>>>,
}

impl Strict {
    /// Starts it, or says why it cannot (then the test is skipped, unless
    /// CI requires it).
    fn start() -> Option<Self> {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/differential/h11_upstream.py"
        );
        let spawned = Command::new("python3")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn();
        let skip = |why: String| {
            assert!(
                std::env::var("SPILLWAY_REQUIRE_H11").as_deref() != Ok("1"),
                "SPILLWAY_REQUIRE_H11=1 but {why}"
            );
            eprintln!("SKIPPED: the differential harness needs python3 with h11: {why}");
            None
        };
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => return skip(format!("python3: {e}")),
        };
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        let Some(Ok(first)) = lines.next() else {
            let _ = child.wait();
            return skip("the upstream did not start (is h11 installed?)".into());
        };
        let port = serde_json::from_str::<Value>(&first).expect("JSON")["port"]
            .as_u64()
            .expect("a port") as u16;
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let entry = serde_json::from_str(&line).expect("a JSON log line");
                sink.lock().expect("not poisoned").push(entry);
            }
        });
        let stdin = child.stdin.take();
        Some(Self {
            child,
            stdin,
            port,
            log,
        })
    }

    fn len(&self) -> usize {
        self.log.lock().expect("not poisoned").len()
    }

    /// Waits until every connection opened since entry `from` has closed,
    /// at least `connections` of them (its log lines come on their own
    /// time); returns those entries.
    async fn settled_since(&self, from: usize, connections: usize) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let entries: Vec<Value> = self.log.lock().expect("not poisoned")[from..].to_vec();
            let count = |event: &str| entries.iter().filter(|e| e["event"] == event).count();
            if count("open") == count("closed") && count("open") >= connections {
                return entries;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "an upstream connection still open after {WAIT:?}: {entries:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Strict {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Counts the requests the rules admitted.
#[derive(Default, Clone)]
struct Admitted(Arc<AtomicUsize>);

impl Observer for Admitted {
    fn observe(&self, _rule: &str, outcome: RuleOutcome, _: Option<&Decision>) {
        if outcome == RuleOutcome::Allowed {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A proxy of one case, stopped when dropped (long runs start thousands).
struct Running {
    addr: std::net::SocketAddr,
    admitted: Admitted,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Starts a proxy of its own in front of the strict upstream.
async fn proxy(upstream: u16) -> Running {
    let admitted = Admitted::default();
    let config = Config::parse(CONFIG).expect("a valid config");
    let engine = Loaded::build(config, None, None).await.expect("an engine");
    let engine = engine.observed(admitted.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    let upstream = format!("http://127.0.0.1:{upstream}")
        .parse()
        .expect("a URL");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(
        listener,
        upstream,
        Arc::new(Live::new(engine)),
        ProxyOptions::default(),
        async move {
            let _ = stopped.await;
        },
    ));
    Running {
        addr,
        admitted,
        _stop: stop,
    }
}

/// The upstream's answers among the responses a client read: each one's
/// JSON (the request as the upstream parsed it), in order.
fn echoes(mut bytes: &[u8]) -> Vec<Value> {
    let mut found = Vec::new();
    loop {
        let mut lines = [httparse::EMPTY_HEADER; 64];
        let mut head = httparse::Response::new(&mut lines);
        let Ok(httparse::Status::Complete(len)) = head.parse(bytes) else {
            return found;
        };
        let status = head.code.unwrap_or_default();
        let length = head
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .and_then(|h| std::str::from_utf8(h.value).ok()?.parse::<usize>().ok());
        let chunked = head
            .headers
            .iter()
            .any(|h| h.name.eq_ignore_ascii_case("transfer-encoding"));
        assert!(!chunked, "the proxy's answers here all have a length");
        bytes = &bytes[len..];
        if (100..200).contains(&status) {
            continue;
        }
        // An answer to HEAD says a length and has no body: the next
        // response follows at once.
        let length = if bytes.starts_with(b"HTTP/1.") {
            0
        } else {
            length.unwrap_or(0)
        };
        if bytes.len() < length {
            // Cut short by the connection's end.
            return found;
        }
        let body = &bytes[..length];
        bytes = &bytes[length..];
        if status == 200 && !body.is_empty() {
            let mut echo: Value = serde_json::from_slice(body).expect("the upstream's JSON");
            echo.as_object_mut().expect("an object").remove("event");
            found.push(echo);
        }
    }
}

/// Sends one case through a proxy of its own and checks the three
/// properties of the module docs.
async fn check(upstream: &Strict, case: &[u8]) {
    let shown = String::from_utf8_lossy(case);
    let running = proxy(upstream.port).await;
    let (addr, admitted) = (running.addr, running.admitted.clone());
    let from = upstream.len();
    let mut client = TcpStream::connect(addr).await.expect("connect");
    // The proxy may refuse and close before reading it all.
    let _ = client.write_all(case).await;
    let _ = client.shutdown().await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(WAIT, client.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "no end within {WAIT:?} for {shown:?}");
    drop(client);
    let admitted = admitted.0.load(Ordering::Relaxed);
    // A request the rules admitted went to the upstream on a connection
    // (or failed to connect, which these tests' upstream never refuses).
    let entries = upstream
        .settled_since(from, usize::from(admitted > 0))
        .await;
    let parsed: Vec<Value> = entries
        .iter()
        .filter(|e| e["event"] == "request")
        .map(|e| {
            let mut e = e.clone();
            e.as_object_mut().expect("an object").remove("event");
            e
        })
        .collect();
    assert!(
        parsed.len() <= admitted,
        "smuggled: the upstream read {} requests, the rules admitted {admitted}, for {shown:?}: {parsed:?}",
        parsed.len()
    );
    let answers = echoes(&got);
    assert!(
        answers.len() <= parsed.len() && answers == parsed[..answers.len()],
        "desync for {shown:?}: the client got {answers:?}, the upstream read {parsed:?}"
    );
    for e in entries.iter().filter(|e| e["event"] == "error") {
        let error = e["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("complete message body"),
            "the upstream could not parse what the proxy sent for {shown:?}: {error}"
        );
    }
}

/// The review's findings and the classic smuggling shapes.
fn corpus() -> Vec<Vec<u8>> {
    let smuggled =
        "POST /login HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 6.6.6.6\r\nContent-Length: 0\r\n\r\n";
    let three = smuggled.repeat(3);
    let n = three.len();
    let get = "GET /next HTTP/1.1\r\nHost: h\r\n\r\n";
    let mut cases: Vec<String> = vec![
        // CL.0: Content-Length named in Connection.
        format!(
            "POST /login HTTP/1.1\r\nHost: h\r\nConnection: content-length\r\nContent-Length: {n}\r\n\r\n{three}"
        ),
        format!(
            "POST /login HTTP/1.1\r\nHost: h\r\nConnection: close, Content-Length\r\nContent-Length: {n}\r\n\r\n{three}"
        ),
        format!(
            "POST /login HTTP/1.0\r\nHost: h\r\nConnection: keep-alive, content-length\r\nContent-Length: {n}\r\n\r\n{three}"
        ),
        format!(
            "POST /login HTTP/1.1\r\nHost: h\r\nConnection: transfer-encoding\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        // CL.TE and TE.CL.
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n5c\r\n{smuggled}\r\n0\r\n\r\n"
        ),
        // TE.TE: obfuscated codings.
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: xchunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding:\tchunked\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: \"chunked\"\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: CHUNKED\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        // obs-fold, bare CR, bare LF.
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n chunked\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        format!("POST / HTTP/1.1\r\nHost: h\r\nX-A: 1\r Content-Length: 5\r\n\r\nhello{smuggled}"),
        format!("POST / HTTP/1.1\nHost: h\nContent-Length: 5\n\nhello{smuggled}"),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n{smuggled}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\n0\r\n\r\n{smuggled}"
        ),
        // Duplicate and comma-joined lengths.
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello{smuggled}"
        ),
        format!("POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 5\r\n\r\nhello{smuggled}"),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 0\r\n\r\nhello{smuggled}"
        ),
        format!("POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 0\r\n\r\nhello{smuggled}"),
        format!("POST / HTTP/1.1\r\nHost: h\r\nContent-Length: +5\r\n\r\nhello{smuggled}"),
        format!("POST / HTTP/1.1\r\nHost: h\r\nContent-Length:  5 \r\n\r\nhello{smuggled}"),
        // Chunk extensions and trailers.
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5;a=\"b\r\n0\r\n\r\n\"\r\nhello\r\n0\r\n\r\n{get}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5;ext\r\nhello\r\n0\r\nX-T: 1\r\n\r\n{get}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nContent-Length: 50\r\n\r\n{get}"
        ),
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n{get}"
        ),
        // Pipelined requests, the last ones behind denied ones.
        get.repeat(25),
        format!("{}{smuggled}", get.repeat(20)),
        // Expect: 100-continue and upgrades.
        format!(
            "POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello{get}"
        ),
        format!(
            "GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n{get}"
        ),
        // Targets and hosts.
        format!("GET http://other.example/x HTTP/1.1\r\nHost: h\r\n\r\n{get}"),
        format!("GET //login/../x HTTP/1.1\r\nHost: h\r\n\r\n{get}"),
        format!("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n{get}"),
        format!("GET / HTTP/1.1\r\n\r\n{get}"),
        format!("GET / HTTP/1.0\r\n\r\n{get}"),
    ];
    cases.push(format!(
        "GET / HTTP/1.1\r\nHost: h\r\nX-Bad: a\x00b\r\n\r\n{get}"
    ));
    let mut bytes: Vec<Vec<u8>> = cases.into_iter().map(String::into_bytes).collect();
    bytes.push(
        [
            &b"GET / HTTP/1.1\r\nHost: h\xc3\xa4\r\n\r\n"[..],
            get.as_bytes(),
        ]
        .concat(),
    );
    bytes
}

#[tokio::test]
async fn the_upstream_reads_only_what_the_proxy_decided_on() {
    let Some(upstream) = Strict::start() else {
        return;
    };
    for case in corpus() {
        check(&upstream, &case).await;
    }
    let cases = std::env::var("SPILLWAY_DIFFERENTIAL_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(150);
    let mut rng = mangle::Rng(0x0d1f_fe7e_4e5a_11ed);
    for _ in 0..cases {
        check(&upstream, &mutated(&mut rng)).await;
    }
    let _ = std::io::stderr().flush();
}

/// A mangled request (see `mangle`), and sometimes two of them pipelined
/// behind a real one.
fn mutated(rng: &mut mangle::Rng) -> Vec<u8> {
    let mut bytes = mangle::mangled(rng);
    if rng.below(3) == 0 {
        let mut first = b"GET /first HTTP/1.1\r\nHost: h\r\n\r\n".to_vec();
        first.append(&mut bytes);
        bytes = first;
        bytes.extend(mangle::mangled(rng));
    }
    bytes
}

//! Mangled HTTP/1.1 requests for the servers' wire tests: pieces of real
//! requests in random order, some bytes overwritten, from a fixed seed so
//! that a failing case comes back the same on every run.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest a connection may take to end.
const WAIT: Duration = Duration::from_secs(5);

/// A small deterministic generator (xorshift64*), so that a failing case
/// comes back the same on every run.
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (x >> 33) as usize % n
    }
}

/// Bytes that are HTTP some of the time: pieces of real requests in any
/// order, some bytes overwritten.
pub fn mangled(rng: &mut Rng) -> Vec<u8> {
    // Request lines, then headers, then anything.
    const LINES: usize = 5;
    const HEADERS: usize = 9;
    const PIECES: &[&[u8]] = &[
        b"POST /v1/check HTTP/1.1\r\n",
        b"GET /healthz HTTP/1.1\r\n",
        b"HEAD /metrics HTTP/1.0\r\n",
        b"GET /admin/rules/once/keys/k HTTP/1.1\r\n",
        b"PUT /v1/check HTTP/1.1\r\n",
        b"Host: spillway.test\r\n",
        b"Content-Type: application/json\r\n",
        b"Content-Length: 30\r\n",
        b"Content-Length: 100000000\r\n",
        b"Content-Length: 99999999999999999999\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: gzip, chunked\r\n",
        b"Expect: 100-continue\r\n",
        b"Connection: close\r\n",
        b"\r\n",
        b"\n",
        b"1e\r\n{\"rule\":\"once\",\"key\":\"k\"}\r\n0\r\n\r\n",
        b"{\"rule\":\"once\",\"key\":\"k\"}",
        b"{\"rule\":\"once\",\"cost\":-1}",
        b"ffffffffffffffffff\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b": no name\r\n",
        b"X-Bad: \x7f\x00\r\n",
        b"\xff\xfe\x00",
    ];
    let mut out = Vec::new();
    // Two times in three, a request line, headers and a blank line first.
    if rng.below(3) > 0 {
        out.extend_from_slice(PIECES[rng.below(LINES)]);
        for _ in 0..rng.below(4) {
            out.extend_from_slice(PIECES[LINES + rng.below(HEADERS)]);
        }
        out.extend_from_slice(b"\r\n");
    }
    for _ in 0..1 + rng.below(8) {
        out.extend_from_slice(PIECES[rng.below(PIECES.len())]);
    }
    for _ in 0..rng.below(3) {
        let at = rng.below(out.len());
        out[at] = rng.below(256) as u8;
    }
    out
}

/// What 300 mangled requests, each on a connection of its own, got: the
/// status of every response read back, and how many connections had one.
/// Fails if a connection does not end within 5 s or an answer is a server
/// error (5xx).
pub async fn send_mangled(addr: SocketAddr, seed: u64) -> (Vec<String>, usize) {
    let mut rng = Rng(seed);
    let mut statuses = Vec::new();
    let mut answered = 0;
    for case in 0..300 {
        let bytes = mangled(&mut rng);
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        // The server may refuse and close before reading it all.
        let _ = stream.write_all(&bytes).await;
        let _ = stream.shutdown().await;
        let mut out = Vec::new();
        let read = tokio::time::timeout(WAIT, stream.read_to_end(&mut out)).await;
        let shown = String::from_utf8_lossy(&bytes);
        assert!(
            read.is_ok(),
            "case {case}: no end within {WAIT:?} for {shown:?}"
        );
        let text = String::from_utf8_lossy(&out);
        assert!(
            !text.contains("HTTP/1.1 5") && !text.contains("HTTP/1.0 5"),
            "case {case}: {shown:?} got a server error: {text:?}"
        );
        answered += usize::from(text.starts_with("HTTP/1.1 "));
        for line in text.split("\r\n") {
            if let Some(status) = line.strip_prefix("HTTP/1.1 ").and_then(|t| t.get(..3)) {
                statuses.push(status.to_string());
            }
        }
    }
    (statuses, answered)
}

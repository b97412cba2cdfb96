//! The proxy's own server for plain HTTP/1.1 requests: those with no body,
//! no `Expect`, no `Upgrade`, not `CONNECT` ([`wire::parse_plain_request`]),
//! most of an API's traffic. Each is read, ruled on and forwarded, and its
//! response written, in the connection's task, without hyper's dispatch.
//!
//! The first request of a connection that is not plain (a body, anything
//! unusual, a head that does not parse) ends this server's part: the
//! connection goes to hyper's HTTP/1.1 server for the rest of its life,
//! that request's bytes put back in front, so hyper reads it from its first
//! byte as it reads every request of such a connection. What this server
//! forwards is only what it and hyper read alike; everything else hyper
//! reads as before.
//!
//! hyper's dispatch and its response encoding were about a quarter of a
//! proxied request's instructions (see BENCHMARKS.md).

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Extensions, Method, Request, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Empty};
use spillway_tower::{Draining, FieldsAside, RateLimitFields};
use tokio::io::AsyncWriteExt;

use super::Connector;
use super::forward::{Forward, Sender};
use super::relay::{Relay, WriteDeadline, mark};
use super::service::{ProxyResponse, limit_on};
use crate::http1::wire::{self, Plain, RawHead};
use crate::http1::{Client, put_date};

/// How a connection left this server.
pub(crate) enum Left {
    /// It is closed.
    Closed,
    /// Its next request is not plain: hyper serves the rest, from the
    /// bytes in `buf` on.
    NotPlain(Box<Client>),
}

/// Serves `client`'s plain requests, through the rules to `forward`, until
/// it closes or sends one that is not.
pub(crate) async fn serve<C: Connector>(
    relay: &Relay<C>,
    forward: &Arc<Forward<C>>,
    mut client: Client,
) -> Left {
    // What the rules read of the connection, made once: each request gets
    // a copy, one allocation of the right size where four inserts grow it.
    let mut marks = Request::new(());
    mark(
        &mut marks,
        client.peer,
        &Draining::new(client.closing.receiver()),
        &relay.held,
    );
    // The rate-limit fields are written here as lines, not put in a map.
    marks.extensions_mut().insert(FieldsAside);
    let marks = marks.into_parts().0.extensions;
    loop {
        let head_len = match client.read_head().await {
            Ok(Some(len)) => len,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(peer = %client.peer, error = %e, "connection closed with an error");
                break;
            }
        };
        let head = client.buf.split_to(head_len).freeze();
        let Some(plain) = wire::parse_plain_request(&head) else {
            put_back(&mut client.buf, &head);
            return Left::NotPlain(Box::new(client));
        };
        match one(relay, forward, &mut client, plain, &marks).await {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                tracing::debug!(peer = %client.peer, error = %e, "connection closed with an error");
                break;
            }
        }
    }
    client.linger().await;
    Left::Closed
}

/// Puts `head` back in front of what follows it in `buf`.
fn put_back(buf: &mut BytesMut, head: &Bytes) {
    let mut whole = BytesMut::with_capacity(head.len() + buf.len());
    whole.extend_from_slice(head);
    whole.extend_from_slice(buf);
    *buf = whole;
}

/// Rules on and forwards one plain request, and writes its response;
/// false when the connection is to be closed after it.
async fn one<C: Connector>(
    relay: &Relay<C>,
    forward: &Arc<Forward<C>>,
    client: &mut Client,
    plain: Plain,
    marks: &Extensions,
) -> io::Result<bool> {
    let Plain { parts, keep_alive } = plain;
    let head_only = parts.method == Method::HEAD;
    let mut req = Request::from_parts(parts, Empty::<Bytes>::new());
    *req.extensions_mut() = marks.clone();
    let engine = relay.proxy.shared.current();
    // The upstream's response head is written as it came, unless a rule
    // reads the response (a budget measures it, a concurrency rule holds
    // its slot until it ends): then the rules get it as a header map.
    let reads = engine.layer.engine();
    let raw = !(reads.has_budgets() || reads.has_leases());
    if let Sender::Own(own) = &forward.send {
        own.raw_heads.store(raw, Ordering::Relaxed);
    }
    let answering = limit_on(&engine, Forward::clone(forward), req);
    drop(engine);
    let Some(Ok(res)) = client.until_decided(answering).await? else {
        // The client left while its answer was waited for.
        return Ok(false);
    };
    // Whether the server is stopping is asked once the answer is ready:
    // one that stopped meanwhile says it closes.
    let keep_alive = keep_alive && !client.is_closing();
    respond(client, res, head_only, keep_alive).await?;
    Ok(keep_alive)
}

/// How a response's body is framed for the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// None is sent: the answer to a HEAD, a 1xx, 204 or 304.
    None,
    /// Exactly this many bytes.
    Length(u64),
    Chunked,
}

/// Writes `res` to the client: its status line and headers, the framing
/// and connection headers the proxy's own, its body streamed. The body's
/// frames ready at once go out with the head, in one write.
async fn respond(
    client: &mut Client,
    res: ProxyResponse,
    head_only: bool,
    keep_alive: bool,
) -> io::Result<()> {
    let (parts, mut body) = res.into_parts();
    let status = parts.status;
    let out = &mut client.out;
    out.clear();
    wire::put_status_line(out, status);
    let mut date = false;
    let mut declared = None;
    let fields = parts.extensions.get::<RateLimitFields>();
    if let Some(raw) = parts.extensions.get::<RawHead>() {
        // The upstream's lines as it sent them (what the proxy does not pass
        // on already left out), but those the rules wrote again.
        let written = |name: &[u8]| {
            let field = fields.is_some_and(|fields| {
                is_rate_limit_name(name)
                    && fields
                        .iter()
                        .any(|(field, _)| name.eq_ignore_ascii_case(field.as_str().as_bytes()))
            });
            // Empty but for a response a `degrade` rule marked.
            field
                || (!parts.headers.is_empty()
                    && std::str::from_utf8(name).is_ok_and(|n| parts.headers.contains_key(n)))
        };
        for (name, value) in raw.lines() {
            if !written(name) {
                date |= name.eq_ignore_ascii_case(b"date");
                wire::put_header(out, name, value);
            }
        }
        declared = raw.length;
    }
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH {
            // One value: the forwarding made it so.
            declared = declared.or_else(|| length(value));
        } else if name != header::TRANSFER_ENCODING && name != header::CONNECTION {
            date |= name == header::DATE;
            wire::put_header(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    if let Some(fields) = fields {
        for (name, value) in fields.iter() {
            wire::put_header(out, name.as_str().as_bytes(), value);
        }
    }
    let no_body = status.is_informational() || status == StatusCode::NO_CONTENT;
    let framing = if no_body {
        Framing::None
    } else if head_only || status == StatusCode::NOT_MODIFIED {
        // The length its GET would have, as the upstream said it.
        if let Some(n) = declared {
            put_length(out, n);
        }
        Framing::None
    } else if let Some(n) = declared.or_else(|| body.size_hint().exact()) {
        put_length(out, n);
        Framing::Length(n)
    } else {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        Framing::Chunked
    };
    // The server is the response's origin if the upstream did not say when
    // (RFC 9110 section 6.6.1).
    if !date {
        put_date(out);
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    let mut stream = WriteDeadline::new(&mut client.stream, client.timeouts.write);
    if framing == Framing::None {
        return stream.write_all(out).await;
    }
    let mut sent = 0u64;
    let mut ended = false;
    loop {
        // What the body has ready now joins what is to be written.
        while !ended && out.len() < crate::http1::CHUNK {
            match poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await {
                Poll::Ready(Some(frame)) => {
                    let frame = frame.map_err(io::Error::other)?;
                    put_data(out, framing, &mut sent, frame.into_data().ok())?;
                }
                Poll::Ready(None) => ended = true,
                Poll::Pending => break,
            }
        }
        if ended {
            finish(out, framing, sent)?;
        }
        if !out.is_empty() {
            stream.write_all(out).await?;
            out.clear();
        }
        if ended {
            return Ok(());
        }
        match body.frame().await {
            Some(frame) => {
                let frame = frame.map_err(io::Error::other)?;
                put_data(out, framing, &mut sent, frame.into_data().ok())?;
            }
            None => ended = true,
        }
    }
}

/// Whether `name` may be one of the rate-limit fields' (`X-RateLimit-*`,
/// `RateLimit`, `RateLimit-Policy`): a cheap test before the exact one.
fn is_rate_limit_name(name: &[u8]) -> bool {
    let rest = match name {
        [b'x' | b'X', b'-', rest @ ..] => rest,
        rest => rest,
    };
    rest.len() >= 9 && rest[..9].eq_ignore_ascii_case(b"ratelimit")
}

/// A `Content-Length` value.
fn length(value: &HeaderValue) -> Option<u64> {
    std::str::from_utf8(value.as_bytes()).ok()?.parse().ok()
}

fn put_length(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(b"content-length: ");
    wire::put_u64(out, n);
    out.extend_from_slice(b"\r\n");
}

/// Appends a body's data, framed; `sent` counts the body's bytes. More
/// than the declared length is an error (the connection closes, as the
/// client cannot be told otherwise). A frame that is not data (trailers)
/// is dropped, as hyper drops them for a client that did not ask.
fn put_data(
    out: &mut Vec<u8>,
    framing: Framing,
    sent: &mut u64,
    data: Option<Bytes>,
) -> io::Result<()> {
    let Some(data) = data.filter(|d| !d.is_empty()) else {
        return Ok(());
    };
    *sent += data.len() as u64;
    match framing {
        Framing::Length(n) if *sent > n => Err(io::Error::other(
            "the response body is longer than its Content-Length",
        )),
        Framing::Chunked => {
            put_hex(out, data.len());
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(&data);
            out.extend_from_slice(b"\r\n");
            Ok(())
        }
        _ => {
            out.extend_from_slice(&data);
            Ok(())
        }
    }
}

/// Appends a chunk's size, in hexadecimal.
fn put_hex(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 16];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// Appends the end of a body: the last chunk, or nothing; a body shorter
/// than its declared length is an error (the connection closes: the client
/// sees it cut short).
fn finish(out: &mut Vec<u8>, framing: Framing, sent: u64) -> io::Result<()> {
    match framing {
        Framing::Chunked => out.extend_from_slice(b"0\r\n\r\n"),
        Framing::Length(n) if sent < n => {
            return Err(io::Error::other(
                "the response body is shorter than its Content-Length",
            ));
        }
        _ => {}
    }
    Ok(())
}

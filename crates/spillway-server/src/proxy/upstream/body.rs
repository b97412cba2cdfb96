//! A request body written to the upstream ([`BodyWriter`]), and a response
//! body read from it ([`UpstreamBody`]).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::{OwnUpstream, READ_AT_ONCE, UpConn};
use crate::http1::wire::Chunked;
use crate::proxy::ProxyBody;
use crate::proxy::error::BoxError;

/// Why a request body could not be written.
pub(super) enum SendFailed {
    /// The client's body broke, or did not match its length.
    Client(BoxError),
    /// The upstream connection failed.
    Upstream(io::Error),
}

/// Writes a request body on the upstream connection, as the client sends
/// it: each chunk framed if the body is chunked, or checked against its
/// `Content-Length` (a body that yields more or less is an error, never
/// written as it is). Polled by the exchange until the response head, then
/// by the response body if the upload is still going (an upstream may
/// answer before the upload ends, and may echo it as it comes).
pub(super) struct BodyWriter {
    body: ProxyBody,
    /// What is to be written before the next frame is taken: a chunk's
    /// size line, its data, its CRLF.
    pending: [Bytes; 3],
    chunked: bool,
    length: Option<u64>,
    sent: u64,
    ended: bool,
}

impl BodyWriter {
    pub(super) fn new(body: ProxyBody, chunked: bool, length: Option<u64>) -> Self {
        Self {
            body,
            pending: Default::default(),
            chunked,
            length,
            sent: 0,
            ended: false,
        }
    }

    /// Writes what it can: ready once the body and its end are written.
    pub(super) fn poll_send(
        &mut self,
        stream: &TcpStream,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), SendFailed>> {
        loop {
            while self.pending.iter().any(|b| !b.is_empty()) {
                std::task::ready!(stream.poll_write_ready(cx)).map_err(SendFailed::Upstream)?;
                let slices = self.pending.each_ref().map(|b| io::IoSlice::new(b));
                match stream.try_write_vectored(&slices) {
                    Ok(mut n) => {
                        for b in &mut self.pending {
                            let take = n.min(b.len());
                            b.advance(take);
                            n -= take;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Poll::Ready(Err(SendFailed::Upstream(e))),
                }
            }
            if self.ended {
                return Poll::Ready(Ok(()));
            }
            let frame = match std::task::ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                None => {
                    self.ended = true;
                    if self.chunked {
                        self.pending[0] = Bytes::from_static(b"0\r\n\r\n");
                    } else if self.length.is_some_and(|n| self.sent != n) {
                        return Poll::Ready(Err(SendFailed::Client(
                            "the request body is shorter than its length".into(),
                        )));
                    }
                    continue;
                }
                Some(Err(e)) => return Poll::Ready(Err(SendFailed::Client(e))),
                Some(Ok(frame)) => frame,
            };
            // Trailers are not passed on (nor were they announced).
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if data.is_empty() {
                continue;
            }
            self.sent += data.len() as u64;
            if self.chunked {
                self.pending = [
                    Bytes::from(format!("{:x}\r\n", data.len())),
                    data,
                    Bytes::from_static(b"\r\n"),
                ];
            } else if self.length.is_some_and(|n| self.sent > n) {
                return Poll::Ready(Err(SendFailed::Client(
                    "the request body is longer than its length".into(),
                )));
            } else {
                self.pending[1] = data;
            }
        }
    }
}

/// What is left of a response body.
pub(super) enum Left {
    Length(u64),
    Chunked(Chunked),
    Close,
    Done,
}

/// A response body read from the upstream connection, which it holds
/// until the body has ended; then the connection goes back to its
/// [`OwnUpstream`] if it can serve another request, or is closed.
pub(super) struct UpstreamBody {
    pub(super) conn: Option<UpConn>,
    /// The request body, if it is still going out.
    pub(super) writer: Option<BodyWriter>,
    pub(super) left: Left,
    pub(super) own: Arc<OwnUpstream>,
    pub(super) keep: bool,
}

impl UpstreamBody {
    /// The body has ended: the connection is kept, or closed.
    pub(super) fn finish(&mut self) {
        self.left = Left::Done;
        // An upload still going is cut: the connection cannot be reused.
        let uploading = self.writer.take().is_some();
        if let Some(conn) = self.conn.take()
            && self.keep
            && !uploading
            && conn.read.is_empty()
        {
            self.own.keep(conn);
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let (Some(w), Some(conn)) = (this.writer.as_mut(), this.conn.as_ref()) {
            match w.poll_send(&conn.stream, cx) {
                Poll::Ready(Ok(())) => this.writer = None,
                Poll::Ready(Err(SendFailed::Client(e))) => {
                    this.writer = None;
                    this.conn = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Err(SendFailed::Upstream(e))) => {
                    tracing::debug!(error = %e, "the upstream stopped taking the request body");
                    this.writer = None;
                    this.keep = false;
                }
                Poll::Pending => {}
            }
        }
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            if !conn.read.is_empty() {
                let data = match &mut this.left {
                    Left::Length(n) => {
                        let take = conn
                            .read
                            .len()
                            .min(usize::try_from(*n).unwrap_or(usize::MAX));
                        *n -= take as u64;
                        let data = conn.read.split_to(take).freeze();
                        if *n == 0 {
                            this.finish();
                        }
                        data
                    }
                    Left::Chunked(chunks) => {
                        let mut data = BytesMut::new();
                        let fed = chunks.feed(&conn.read, |d| data.extend_from_slice(d));
                        let used = match fed {
                            Ok(used) => used,
                            Err(e) => {
                                this.conn = None;
                                return Poll::Ready(Some(Err(e.into())));
                            }
                        };
                        conn.read.advance(used);
                        if chunks.is_done() {
                            this.finish();
                        }
                        data.freeze()
                    }
                    Left::Close => conn.read.split().freeze(),
                    Left::Done => return Poll::Ready(None),
                };
                if !data.is_empty() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                continue;
            }
            conn.read.reserve(READ_AT_ONCE);
            let read = std::task::ready!(poll_read_into(&mut conn.stream, &mut conn.read, cx));
            match read {
                Ok(0) if matches!(this.left, Left::Close) => {
                    this.left = Left::Done;
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(
                        "the upstream closed the connection before the end of the body".into(),
                    )));
                }
                Ok(_) => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.left, Left::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.left {
            Left::Length(n) => SizeHint::with_exact(n),
            Left::Done => SizeHint::with_exact(0),
            Left::Chunked(_) | Left::Close => SizeHint::default(),
        }
    }
}

/// Reads what the stream has into `buf`'s spare capacity (one read: the
/// future is made for one poll, and a read that waits has taken nothing).
pub(super) fn poll_read_into(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    std::pin::pin!(stream.read_buf(buf)).poll(cx)
}

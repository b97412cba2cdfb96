//! HTTP/2 on a client connection (prior knowledge: [`Client::sniff`] said
//! so), served by hyper, with the bounds hyper leaves to its user.
//!
//! One HTTP/2 connection carries many requests at once, and the proxy gives
//! each an upstream connection of its own (the upstream speaks HTTP/1.1):
//! what a connection may hold is bounded per stream, not only per
//! connection.
//!
//! - At most [`H2Limits::max_streams`] requests open at once
//!   (`SETTINGS_MAX_CONCURRENT_STREAMS`).
//! - A response whose client does not take it: once hyper holds a piece of
//!   a response body it cannot send (the client has not opened its flow
//!   control window) for the write timeout, the connection is closed, as an
//!   HTTP/1.1 connection whose client stops reading is, and every upstream
//!   connection its requests held with it. hyper would wait for the window
//!   for ever: its keep-alive pings see a client that answers them.
//! - Premature resets (Envoy's and nginx's defence against "rapid reset",
//!   CVE-2023-44487): a client that cancels more streams before their
//!   answer than it may have open at once, and more than half of all it
//!   opened, is sent GOAWAY and closed. A request the client reset before
//!   it was forwarded is not forwarded: its first poll yields once, so that
//!   hyper looks at the stream's reset before any work is done.
//! - A connection with no request open for the idle timeout is closed, and
//!   one that does not answer a ping within the write timeout.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::Client;

/// What one HTTP/2 connection may hold besides its deadlines
/// ([`Timeouts`](super::Timeouts)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct H2Limits {
    /// The most requests open at once on the connection.
    pub(crate) max_streams: u32,
}

impl Default for H2Limits {
    fn default() -> Self {
        Self { max_streams: 100 }
    }
}

/// Streams reset by the client before hyper took them that a connection
/// may have at once (h2's `max_pending_accept_reset_streams`; hyper's
/// default, said here as it is part of the bound).
const PENDING_ACCEPT_RESETS: usize = 20;

/// Serves an HTTP/2 client with hyper and `service` until it closes, breaks
/// a bound (see the module's documentation), or the server stops (then
/// gracefully: the streams in flight are answered first).
pub(crate) async fn serve_h2<S, B>(client: Client, service: S, limits: H2Limits)
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>>,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let peer = client.peer;
    let timeouts = client.timeouts;
    let (io, mut closing) = client.into_io();
    let io = TokioIo::new(io);
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    // A client that does not answer a ping within the write timeout (gone,
    // or not reading) is closed.
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(timeouts.write))
        .keep_alive_timeout(timeouts.write)
        .max_concurrent_streams(limits.max_streams)
        .max_pending_accept_reset_streams(PENDING_ACCEPT_RESETS)
        // Streams hyper itself resets for the client's errors: no more
        // than it may have open.
        .max_local_error_reset_streams(limits.max_streams as usize);
    let streams = Arc::new(Streams::new(limits.max_streams as usize));
    let service = Counted {
        inner: service,
        streams: streams.clone(),
    };
    let mut conn = std::pin::pin!(builder.serve_connection(io, service));
    // Once GOAWAY is sent for too many resets, the client has this long to
    // finish its streams.
    let mut cut_off: Option<Pin<Box<tokio::time::Sleep>>> = None;
    let mut graceful = false;
    let result = loop {
        tokio::select! {
            result = conn.as_mut() => break result,
            () = closing.wait(), if !graceful => {
                conn.as_mut().graceful_shutdown();
                graceful = true;
            }
            () = streams.idle_for(timeouts.idle), if !graceful => {
                tracing::debug!(%peer, "idle HTTP/2 connection closed");
                conn.as_mut().graceful_shutdown();
                graceful = true;
            }
            () = streams.flooded.notified(), if cut_off.is_none() => {
                // At debug, as every client's misbehaviour: a warning each
                // would let clients fill the log.
                tracing::debug!(%peer, "an HTTP/2 client reset most of its requests before their answer: GOAWAY");
                conn.as_mut().graceful_shutdown();
                graceful = true;
                cut_off = Some(Box::pin(tokio::time::sleep(timeouts.write)));
            }
            () = async { cut_off.as_mut().expect("set").await }, if cut_off.is_some() => return,
            () = streams.stalled_for(timeouts.write) => {
                tracing::debug!(%peer, "an HTTP/2 client did not take a response within the write timeout: closed");
                return;
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection closed with an error");
    }
}

/// What one HTTP/2 connection's requests are doing: how many are open and
/// since when none has been (hyper closes a connection that stops
/// answering pings, not one that answers them and sends nothing else), how
/// many the client reset before their answer, and which response bodies
/// wait for the client.
struct Streams {
    open: AtomicUsize,
    idle_since: Mutex<Instant>,
    /// Every request the connection has opened, and those the client reset
    /// (or left) before their answer.
    opened: AtomicUsize,
    reset: AtomicUsize,
    /// The most early resets tolerated however many streams were opened.
    max_resets: usize,
    /// Told once the resets are past the bound.
    flooded: Notify,
    /// The response bodies hyper holds a piece of and cannot send (it has
    /// not asked for the next), each since when, by body.
    waiting: Mutex<HashMap<u64, Instant>>,
    /// Told when a body starts waiting while none was.
    started_waiting: Notify,
    next_body: AtomicU64,
}

impl Streams {
    fn new(max_resets: usize) -> Self {
        Self {
            open: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            opened: AtomicUsize::new(0),
            reset: AtomicUsize::new(0),
            max_resets,
            flooded: Notify::new(),
            waiting: Mutex::new(HashMap::new()),
            started_waiting: Notify::new(),
            next_body: AtomicU64::new(0),
        }
    }

    /// Returns once no request has been open for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let since = *self
                .idle_since
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if self.open.load(Ordering::Acquire) > 0 {
                // Looked at again one period on: a request ending
                // meanwhile moves `idle_since`.
                tokio::time::sleep(idle).await;
            } else if Instant::now() >= since + idle {
                return;
            } else {
                tokio::time::sleep_until(since + idle).await;
            }
        }
    }

    /// A request ended before its answer: the client reset it (or the
    /// connection closed). Past the bound, [`flooded`](Self::flooded) is
    /// told.
    fn reset_early(&self) {
        let reset = self.reset.fetch_add(1, Ordering::AcqRel) + 1;
        let opened = self.opened.load(Ordering::Acquire);
        if reset >= self.max_resets && reset * 2 > opened {
            self.flooded.notify_one();
        }
    }

    /// Returns once a response body has waited `timeout` for the client.
    async fn stalled_for(&self, timeout: Duration) {
        loop {
            let oldest = {
                let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
                waiting.values().min().copied()
            };
            match oldest {
                // Told when one starts; a start since the look above left
                // its notice stored.
                None => self.started_waiting.notified().await,
                Some(since) if Instant::now() >= since + timeout => return,
                // A body that waits later has a later deadline.
                Some(since) => tokio::time::sleep_until(since + timeout).await,
            }
        }
    }

    /// Body `id` was asked for its next piece: it no longer waits.
    fn asked(&self, id: u64) {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.remove(&id);
    }

    /// Body `id` handed hyper a piece: it waits until asked again.
    fn handed(&self, id: u64) {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        if waiting.is_empty() {
            self.started_waiting.notify_one();
        }
        waiting.insert(id, Instant::now());
    }
}

/// Counts one request of [`Streams`] while it is open; dropped unanswered,
/// it counts a reset.
struct Open {
    streams: Arc<Streams>,
    answered: bool,
}

impl Open {
    fn new(streams: Arc<Streams>) -> Self {
        streams.open.fetch_add(1, Ordering::AcqRel);
        streams.opened.fetch_add(1, Ordering::AcqRel);
        Self {
            streams,
            answered: false,
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        *self
            .streams
            .idle_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        self.streams.open.fetch_sub(1, Ordering::AcqRel);
        if !self.answered {
            self.streams.reset_early();
        }
    }
}

/// An HTTP/2 service whose requests are counted in [`Streams`] until
/// answered, and whose response bodies are watched there.
struct Counted<S> {
    inner: S,
    streams: Arc<Streams>,
}

impl<S, B> hyper::service::Service<Request<Incoming>> for Counted<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>>,
{
    type Response = Response<Watched<B>>;
    type Error = S::Error;
    type Future = Answering<S::Future>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let open = Open::new(self.streams.clone());
        Answering {
            answered: self.inner.call(req),
            open: Some(open),
            looked: false,
        }
    }
}

pin_project_lite::pin_project! {
    /// A request of [`Counted`] being answered: open until done or dropped.
    struct Answering<F> {
        #[pin]
        answered: F,
        open: Option<Open>,
        // Whether hyper has had a chance to see a reset before the first
        // poll of `answered`.
        looked: bool,
    }
}

impl<F, B, E> Future for Answering<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<Watched<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if !*this.looked {
            // hyper calls the service as it accepts a stream, even one the
            // client has reset already (its HEADERS and RST_STREAM read
            // together), and looks for a reset only when the answer is
            // pending: pending once, before any work, a reset request is
            // dropped unforwarded and uncharged.
            *this.looked = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let answered = std::task::ready!(this.answered.poll(cx));
        let mut open = this.open.take().expect("polled after completion");
        open.answered = true;
        let streams = open.streams.clone();
        drop(open);
        Poll::Ready(answered.map(|res| {
            res.map(|body| Watched {
                inner: body,
                id: streams.next_body.fetch_add(1, Ordering::Relaxed),
                streams,
            })
        }))
    }
}

pin_project_lite::pin_project! {
    /// A response body whose waits for the client are known to its
    /// connection's [`Streams`]: from each piece handed to hyper until
    /// hyper asks for the next (it asks once it could send the last).
    struct Watched<B> {
        #[pin]
        inner: B,
        id: u64,
        streams: Arc<Streams>,
    }

    impl<B> PinnedDrop for Watched<B> {
        fn drop(this: Pin<&mut Self>) {
            this.streams.asked(this.id);
        }
    }
}

impl<B: Body> Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        this.streams.asked(*this.id);
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && frame.is_data()
        {
            this.streams.handed(*this.id);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body waits from the piece it handed hyper until hyper asks for
    /// the next; the connection is stalled once one has waited the whole
    /// timeout, not before, and a body asked again starts over.
    #[tokio::test(start_paused = true)]
    async fn a_body_stalls_after_the_whole_timeout_of_waiting() {
        let streams = Streams::new(100);
        let timeout = Duration::from_secs(30);
        let t0 = Instant::now();
        streams.handed(1);
        tokio::time::advance(Duration::from_secs(20)).await;
        // Asked again and handed another piece: the wait starts over.
        streams.asked(1);
        streams.handed(1);
        let t1 = Instant::now();
        tokio::time::advance(Duration::from_secs(10)).await;
        streams.handed(2);
        streams.stalled_for(timeout).await;
        assert_eq!(Instant::now(), t1 + timeout);
        assert!(Instant::now() > t0 + timeout);
    }

    /// No body waiting: never stalled, however long.
    #[tokio::test(start_paused = true)]
    async fn a_connection_whose_bodies_are_taken_never_stalls() {
        let streams = Streams::new(100);
        streams.handed(1);
        streams.asked(1);
        let stalled = tokio::time::timeout(
            Duration::from_secs(3600),
            streams.stalled_for(Duration::from_secs(30)),
        );
        assert!(stalled.await.is_err());
    }

    /// Resets before the answer are tolerated up to the bound, and past it
    /// only while they are more than half of the streams.
    #[tokio::test]
    async fn resets_past_the_bound_and_half_the_streams_flood() {
        let streams = Streams::new(3);
        let opened = |n| streams.opened.fetch_add(n, Ordering::AcqRel);
        let flooded = || {
            let notified = streams.flooded.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable()
        };
        opened(10);
        streams.reset_early();
        streams.reset_early();
        assert!(!flooded(), "two resets, under the bound");
        streams.reset_early();
        assert!(!flooded(), "three of ten: not half");
        for _ in 0..3 {
            streams.reset_early();
        }
        assert!(flooded(), "six of ten");
    }
}

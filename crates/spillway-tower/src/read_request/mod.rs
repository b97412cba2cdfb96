//! [`ReadRequestLayer`]: reads what a JSON request asks for (`max_tokens`
//! and the like, and a rough estimate of its prompt) before the rate
//! limiter decides, and tells it in a [`RequestReserve`] extension; then
//! hands the inner service a body ([`ReadBody`]) that replays every byte
//! read, so the upstream receives exactly what the client sent.
//!
//! What is read, and what is not:
//!
//! - a body with no `Content-Type` (Python's FastAPI parses such a body as
//!   JSON) or with one that is `application/json` or `application/*+json`
//!   (case-insensitive, parameters ignored; if several are sent, any).
//!   Any other body is passed on untouched, without a copy or an
//!   extension, and a rule reserves its default: an upstream that parses
//!   a body of another type as JSON should get a header reservation.
//! - at most `max_body` bytes, copied into one buffer as they come (a
//!   body in one frame is not copied), and, all the bodies of the layer
//!   together, at most `max_buffered` bytes until they have been sent on. A longer body, declared or not, is
//!   [unreadable](RequestReserve::unreadable), as is one that is not JSON
//!   `serde_json` accepts: what it asks is unknown, so it reserves the
//!   most a request may, and a client gains nothing by writing a body one
//!   parser reads and another does not.
//! - the numbers and keys as the laxest common upstream reads them:
//!   UTF-16 and UTF-32 bodies (Python), `"8000"`, `8000.0` and `true`
//!   (pydantic's lax mode), a key in another case (Go). Of a field sent
//!   more than once, the largest.
//! - JSON whose top level is not an object asks nothing: the request
//!   reserves its rule's default (the upstream refuses it).
//!
//! A request extension [`RequestReserve`] that was there before is always
//! removed: only this layer says what a body asks.
//!
//! Two cases are settled otherwise:
//!
//! - a body that has not arrived (up to `max_body`, or its end) within
//!   `read_timeout` is answered `408 Request Timeout` (a problem+json body;
//!   `Connection: close` under HTTP/1, whose connection holds the rest of
//!   the unread body), and the inner service is not called. That is why
//!   the inner service's response body must be buildable from bytes
//!   (`ResBody: From<Bytes>`: axum's `Body`, `http_body_util::Full`, and
//!   [`ResponseBody`](crate::ResponseBody) are). An error type would have pushed the answer to
//!   every caller, when a slow client is an answer, not a failure.
//! - a body that fails while it is read is not answered here: the inner
//!   service gets the bytes read, then the same error, where it came, as
//!   it would have without this layer (a proxy's upstream sees the same
//!   broken body, of the length the client declared, never a whole body of
//!   the bytes that came). The request is unreadable: what it asked is
//!   unknown.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::budget::RequestReserve;
use crate::future::BoxFuture;
use crate::problem::{PROBLEM_JSON, Problem};

/// Reads the JSON body of each request for the numbers a budget rule
/// reserves ([`Reserve::Request`](crate::budget::Reserve::Request)), and
/// sets [`RequestReserve`]. Cheap to clone: everything is behind one `Arc`.
/// See the [module](self) for what is read and when.
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use spillway_tower::budget::RequestReserve;
/// use spillway_tower::{ReadBody, ReadRequestLayer};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let inner = service_fn(|req: Request<ReadBody<Full<Bytes>>>| async move {
///     // Tell the caller what the rate limiter would have read.
///     let mut res = Response::new(Full::new(Bytes::new()));
///     if let Some(reserve) = req.extensions().get::<RequestReserve>() {
///         res.extensions_mut().insert(reserve.clone());
///     }
///     Ok::<_, Infallible>(res)
/// });
/// let service = ReadRequestLayer::new(["max_tokens"]).layer(inner);
///
/// let body = r#"{"max_tokens": 800, "messages": [{"role": "user", "content": "Hi there"}]}"#;
/// let req = Request::post("/v1/chat/completions")
///     .header("content-type", "application/json")
///     .body(Full::new(Bytes::from(body)))
///     .unwrap();
/// let res = service.oneshot(req).await.unwrap();
/// let reserve = res.extensions().get::<RequestReserve>().unwrap();
/// assert_eq!(reserve.asked("max_tokens"), Some(800));
/// // "user" and "Hi there": 12 bytes of string values, about 3 tokens.
/// assert_eq!(reserve.prompt_estimate, 3);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ReadRequestLayer {
    config: Arc<Config>,
}

#[derive(Debug, Clone)]
struct Config {
    /// The top-level fields to report, each once, in the order given.
    fields: Vec<String>,
    max_body: usize,
    read_timeout: Duration,
    /// The bytes all the bodies being read or replayed may hold at once.
    max_buffered: usize,
    /// The bytes they hold now, shared by every service of this layer.
    buffered: Arc<AtomicUsize>,
}

impl Config {
    /// Takes `n` bytes of the shared allowance, if they fit.
    fn hold(&self, held: &mut Held, n: usize) -> bool {
        let fits = self
            .buffered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                now.checked_add(n)
                    .filter(|&after| after <= self.max_buffered)
            })
            .is_ok();
        if fits {
            held.bytes += n;
        }
        fits
    }
}

/// Bytes of the shared allowance a body holds, given back when it is
/// dropped (its replay sent, or the request abandoned).
#[derive(Debug)]
struct Held {
    buffered: Arc<AtomicUsize>,
    bytes: usize,
}

impl Held {
    /// Gives back what is held past `bytes` (a buffer smaller than was
    /// allowed for).
    fn shrink_to(&mut self, bytes: usize) {
        if self.bytes > bytes {
            self.buffered
                .fetch_sub(self.bytes - bytes, Ordering::AcqRel);
            self.bytes = bytes;
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.buffered.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl ReadRequestLayer {
    /// Reads the top-level `fields` (such as `max_tokens`) of JSON bodies
    /// of up to 1 MiB, which must arrive within 30 seconds.
    pub fn new(fields: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let mut unique: Vec<String> = Vec::new();
        for field in fields {
            let field = field.into();
            // A field named twice would be reported twice.
            if !unique.contains(&field) {
                unique.push(field);
            }
        }
        Self {
            config: Arc::new(Config {
                fields: unique,
                max_body: 1 << 20,
                read_timeout: Duration::from_secs(30),
                max_buffered: 256 << 20,
                buffered: Arc::new(AtomicUsize::new(0)),
            }),
        }
    }

    /// The most bytes all the bodies this layer reads may hold at once
    /// (default 256 MiB), so that many clients sending large bodies slowly
    /// cannot make it hold `max_body` each. A body that does not fit is not
    /// read further: it is [unreadable](RequestReserve::unreadable), and
    /// reserves the most.
    pub fn max_buffered(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.config).max_buffered = bytes;
        self
    }

    /// Counts the bytes this layer's bodies hold in the same allowance as
    /// `other`'s (whose bodies may still be held: a layer replaced on a
    /// configuration reload), so that two layers do not hold twice
    /// `max_buffered`.
    ///
    /// ```
    /// use spillway_tower::ReadRequestLayer;
    ///
    /// let old = ReadRequestLayer::new(["max_tokens"]);
    /// let new = ReadRequestLayer::new(["max_tokens", "n"]).sharing_buffers_with(&old);
    /// # let _ = new;
    /// ```
    pub fn sharing_buffers_with(mut self, other: &ReadRequestLayer) -> Self {
        Arc::make_mut(&mut self.config).buffered = other.config.buffered.clone();
        self
    }

    /// The most bytes of a body that are read (default 1 MiB): a longer
    /// body, declared or not, gets no [`RequestReserve`].
    pub fn max_body(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.config).max_body = bytes;
        self
    }

    /// How long the read of a body (up to `max_body`, or its end) may take
    /// in all (default 30 s) before the request is answered `408 Request
    /// Timeout`.
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        Arc::make_mut(&mut self.config).read_timeout = timeout;
        self
    }
}

impl<S> Layer<S> for ReadRequestLayer {
    type Service = ReadRequest<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReadRequest {
            inner,
            config: self.config.clone(),
        }
    }
}

/// Reads what a JSON request asks for, then calls the inner service `S`
/// with a [`ReadBody`]. See [`ReadRequestLayer`]. A body too slow to
/// arrive is answered `408 Request Timeout`, without calling `S`.
///
/// ```
/// use std::convert::Infallible;
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use spillway_tower::{ReadBody, ReadRequestLayer};
/// use tower::{Layer, ServiceExt, service_fn};
/// # use std::{pin::Pin, task::{Context, Poll}};
/// # /// A client that sends its head, then nothing.
/// # struct Silent;
/// # impl http_body::Body for Silent {
/// #     type Data = Bytes;
/// #     type Error = Infallible;
/// #     fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>)
/// #         -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> { Poll::Pending }
/// # }
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let inner = service_fn(|_: Request<ReadBody<Silent>>| async {
///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("never called"))))
/// });
/// let service = ReadRequestLayer::new(["max_tokens"])
///     .read_timeout(Duration::from_secs(5))
///     .layer(inner);
/// let req = Request::post("/").header("content-type", "application/json").body(Silent).unwrap();
/// let res = service.oneshot(req).await.unwrap();
/// assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
/// assert_eq!(res.headers()["content-type"], "application/problem+json");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ReadRequest<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> ReadRequest<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for ReadRequest<S>
where
    S: Service<Request<ReadBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Send,
    ResBody: From<Bytes> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        // Whoever set it before (a layer in front, a client of an
        // in-process service), the budget must not believe it.
        parts.extensions.remove::<RequestReserve>();
        let config = &self.config;
        // An empty body has nothing to ask, nor to wait for.
        if !may_be_json(&parts.headers) || body.is_end_stream() {
            let req = Request::from_parts(parts, ReadBody::untouched(body));
            return Box::pin(self.inner.call(req));
        }
        if declared_too_big(&parts.headers, &body, config.max_body) || other_charset(&parts.headers)
        {
            parts.extensions.insert(RequestReserve::unreadable());
            let req = Request::from_parts(parts, ReadBody::untouched(body));
            return Box::pin(self.inner.call(req));
        }
        // The read is awaited before the call: the clone takes the place of
        // the service that was made ready, which goes into the future.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = config.clone();
        Box::pin(async move {
            let read = read_prefix(Box::pin(body), &config);
            let Ok(prefix) = tokio::time::timeout(config.read_timeout, read).await else {
                return Ok(request_timeout(parts.version, config.read_timeout));
            };
            if let Some(reserve) = prefix.reserve(&config.fields) {
                parts.extensions.insert(reserve);
            }
            inner
                .call(Request::from_parts(parts, prefix.into_body()))
                .await
        })
    }
}

/// Whether an upstream may read the body as JSON: it has no
/// `Content-Type` or an empty one (FastAPI reads the body as JSON then), or
/// one of its `Content-Type`s is JSON (which one the upstream believes is
/// anyone's guess).
fn may_be_json(headers: &HeaderMap) -> bool {
    let mut values = headers.get_all(CONTENT_TYPE).iter().peekable();
    values.peek().is_none()
        || headers
            .get_all(CONTENT_TYPE)
            .iter()
            .any(|v| v.is_empty() || is_json(v))
}

/// The media type's essence and parameters of a `Content-Type`, read as
/// Python's `email` package reads it for FastAPI: the bytes as Latin-1,
/// and Python's whitespace (NBSP, NEL and the separators `\x1c`-`\x1f`
/// included) trimmed.
fn media_type(value: &HeaderValue) -> (String, impl Iterator<Item = (String, String)>) {
    let text: String = value.as_bytes().iter().map(|&b| char::from(b)).collect();
    let space = |c: char| c.is_whitespace() || ('\x1c'..='\x1f').contains(&c);
    let mut parts = text
        .split(';')
        .map(|p| p.trim_matches(space).to_string())
        .collect::<Vec<_>>()
        .into_iter();
    let essence = parts.next().unwrap_or_default().to_ascii_lowercase();
    let params = parts.filter_map(move |p| {
        let (name, value) = p.split_once('=')?;
        let value = value.trim_matches(space).trim_matches('"').to_string();
        Some((name.trim_matches(space).to_ascii_lowercase(), value))
    });
    (essence, params)
}

/// Whether a `Content-Type` is JSON: `application/json`, or any
/// `application/*+json` (FastAPI takes `application/+json` too).
fn is_json(value: &HeaderValue) -> bool {
    let (essence, _) = media_type(value);
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind == "application" && (subtype == "json" || subtype.ends_with("+json"))
}

/// Whether a `Content-Type` names a charset other than UTF-8: Express's
/// body parser decodes the body by it (UTF-7 and UTF-16 spell
/// `max_tokens` where this reader does not see it), Python ignores it.
fn other_charset(headers: &HeaderMap) -> bool {
    headers.get_all(CONTENT_TYPE).iter().any(|value| {
        let (_, mut params) = media_type(value);
        params.any(|(name, charset)| {
            name == "charset" && !matches!(charset.to_ascii_lowercase().as_str(), "utf-8" | "utf8")
        })
    })
}

/// Whether the body says it is longer than `max`: its `Content-Length`, or
/// its size hint (a body made in process may have no header).
fn declared_too_big(headers: &HeaderMap, body: &impl Body, max: usize) -> bool {
    let max = max as u64;
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok());
    declared.is_some_and(|n| n > max) || body.size_hint().lower() > max
}

/// The answer to a body that did not arrive within `timeout`.
fn request_timeout<ResBody: From<Bytes>>(version: Version, timeout: Duration) -> Response<ResBody> {
    let detail = format!("The request body did not arrive within {timeout:?}.");
    let body = Problem::new(StatusCode::REQUEST_TIMEOUT, &detail).into_json();
    let mut res = Response::new(ResBody::from(Bytes::from(body)));
    *res.status_mut() = StatusCode::REQUEST_TIMEOUT;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    // The rest of the body is still on the connection, unread. HTTP/2
    // resets the stream instead, and forbids the header.
    if version == Version::HTTP_10 || version == Version::HTTP_11 {
        res.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    res
}

/// What was read of a body before the inner service is called.
struct Prefix<B: Body> {
    /// The data read, in one piece: the body's only frame, or a copy of
    /// its frames. Never more than `max` bytes.
    data: Bytes,
    /// The frame that took the body past `max`, or past what the layer may
    /// hold, kept whole: its bytes exist already.
    over: Option<Bytes>,
    /// A frame that is not data (the trailers), which ends the body.
    last: Option<Frame<Bytes>>,
    then: Then<B>,
    /// The share of the layer's allowance `data` holds.
    held: Held,
}

/// What follows the frames read, in the body the inner service gets.
enum Then<B: Body> {
    /// The rest of the original body, boxed to be moved after it was
    /// polled (only a body that is read pays for the box).
    Body(Pin<Box<B>>),
    /// The error the body failed with while it was read, and what the body
    /// said was left of it then: the replay keeps the length the client
    /// declared, so that the upstream sees a body cut short, never a whole
    /// one of the bytes that came.
    Error(B::Error, SizeHint),
    /// Nothing: the body had ended.
    End,
}

/// Reads `body` until its data ends, passes `max_body` bytes or what the
/// layer may still hold, or it fails. What it holds is at most `max_body`
/// bytes of data, in a buffer grown as the data comes (never sized by what
/// the client declares), and the one frame that did not fit; the layer's
/// allowance is charged for the buffer's capacity, not only its bytes.
async fn read_prefix<B: Body<Data = Bytes>>(mut body: Pin<Box<B>>, config: &Config) -> Prefix<B> {
    let max = config.max_body;
    let mut held = Held {
        buffered: config.buffered.clone(),
        bytes: 0,
    };
    // A body in one frame is kept as it came; a second frame starts the
    // copy.
    let mut first = Bytes::new();
    let mut copy: Vec<u8> = Vec::new();
    let (over, last, then) = loop {
        match body.frame().await {
            None => break (None, None, Then::End),
            Some(Err(error)) => {
                let rest = body.size_hint();
                break (None, None, Then::Error(error, rest));
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let len = first.len() + copy.len();
                    let needed = len.saturating_add(data.len());
                    if needed > max {
                        break (Some(data), None, Then::Body(body));
                    }
                    if len == 0 {
                        if !config.hold(&mut held, data.len()) {
                            break (Some(data), None, Then::Body(body));
                        }
                        first = data;
                        continue;
                    }
                    if needed > copy.capacity() {
                        // Doubling, within `max`; the first frame's charge
                        // moves to the copy.
                        let capacity = needed.max(copy.capacity() * 2).min(max);
                        let had = copy.capacity() + first.len();
                        if capacity > had && !config.hold(&mut held, capacity - had) {
                            break (Some(data), None, Then::Body(body));
                        }
                        let mut grown = Vec::with_capacity(capacity);
                        grown.extend_from_slice(&first);
                        grown.extend_from_slice(&copy);
                        first = Bytes::new();
                        copy = grown;
                        held.shrink_to(copy.capacity());
                    }
                    copy.extend_from_slice(&data);
                }
                // Trailers are a body's last frame: the end is known, and
                // the size hint exact.
                Err(frame) => break (None, Some(frame), Then::End),
            },
        }
    };
    Prefix {
        data: if copy.is_empty() {
            first
        } else {
            Bytes::from(copy)
        },
        over,
        last,
        then,
        held,
    }
}

impl<B: Body<Data = Bytes>> Prefix<B> {
    /// What the body asks, if it was read whole (nothing if it failed:
    /// the upstream gets the same error).
    fn reserve(&self, fields: &[String]) -> Option<RequestReserve> {
        match &self.then {
            // What it asked is unknown (and the upstream gets the same
            // error, the same length declared).
            Then::Error(..) | Then::Body(_) => return Some(RequestReserve::unreadable()),
            Then::End => {}
        }
        match parse::read(&self.data, fields) {
            parse::Read::Object {
                asked,
                string_bytes,
            } => Some(RequestReserve {
                asked: fields
                    .iter()
                    .zip(asked)
                    .filter_map(|(field, n)| Some((field.clone(), n?)))
                    .collect(),
                prompt_estimate: string_bytes.div_ceil(4),
                unreadable: false,
            }),
            parse::Read::NotObject => Some(RequestReserve::default()),
            parse::Read::Unreadable => Some(RequestReserve::unreadable()),
        }
    }

    fn into_body(self) -> ReadBody<B> {
        let pending = (self.data.len() + self.over.as_ref().map_or(0, Bytes::len)) as u64;
        let frames: VecDeque<_> = Some(self.data)
            .filter(|data| !data.is_empty())
            .into_iter()
            .chain(self.over)
            .map(Frame::data)
            .chain(self.last)
            .collect();
        ReadBody {
            kind: Kind::Replay {
                frames,
                pending,
                then: self.then,
                _held: self.held,
            },
        }
    }
}

pin_project! {
    /// The body [`ReadRequest`]'s inner service gets: the frames read of
    /// the request's body (a JSON body read whole comes as one frame, a
    /// longer one as it came), then the rest of the original body, its
    /// trailers, or the error it failed with, byte for byte what the client
    /// sent. A body that was not read is the original, not copied. Its size
    /// hint is exact when the original's was or the body was read to its
    /// end.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body::Body;
    /// use http_body_util::{BodyExt, Full};
    /// use spillway_tower::{ReadBody, ReadRequestLayer};
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let echo = service_fn(|req: Request<ReadBody<Full<Bytes>>>| async move {
    ///     assert_eq!(req.body().size_hint().exact(), Some(16));
    ///     let bytes = req.into_body().collect().await.unwrap().to_bytes();
    ///     Ok::<_, Infallible>(Response::new(Full::new(bytes)))
    /// });
    /// let service = ReadRequestLayer::new(["max_tokens"]).layer(echo);
    /// let req = Request::post("/")
    ///     .header("content-type", "application/json")
    ///     .body(Full::new(Bytes::from_static(br#"{"max_tokens":7}"#)))
    ///     .unwrap();
    /// let res = service.oneshot(req).await.unwrap();
    /// let echoed = res.into_body().collect().await.unwrap().to_bytes();
    /// assert_eq!(echoed, &br#"{"max_tokens":7}"#[..]);
    /// # }
    /// ```
    pub struct ReadBody<B: Body> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B: Body> {
        Untouched { #[pin] body: B },
        Replay {
            frames: VecDeque<Frame<Bytes>>,
            // The data bytes still in `frames`, for the size hint.
            pending: u64,
            then: Then<B>,
            // Given back when the body is dropped.
            _held: Held,
        },
    }
}

impl<B: Body> ReadBody<B> {
    fn untouched(body: B) -> Self {
        Self {
            kind: Kind::Untouched { body },
        }
    }
}

impl<B: Body> fmt::Debug for ReadBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("ReadBody");
        match &self.kind {
            Kind::Untouched { .. } => debug.field("read", &false),
            Kind::Replay { pending, .. } => debug.field("read", &true).field("pending", pending),
        };
        debug.finish_non_exhaustive()
    }
}

impl<B: Body<Data = Bytes>> Body for ReadBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Untouched { body } => body.poll_frame(cx),
            KindProj::Replay {
                frames,
                pending,
                then,
                ..
            } => {
                if let Some(frame) = frames.pop_front() {
                    if let Some(data) = frame.data_ref() {
                        *pending -= data.len() as u64;
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                match std::mem::replace(then, Then::End) {
                    Then::Body(mut body) => {
                        let poll = body.as_mut().poll_frame(cx);
                        *then = Then::Body(body);
                        poll
                    }
                    Then::Error(error, _) => Poll::Ready(Some(Err(error))),
                    Then::End => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Untouched { body } => body.is_end_stream(),
            Kind::Replay { frames, then, .. } => {
                frames.is_empty()
                    && match then {
                        Then::Body(body) => body.is_end_stream(),
                        Then::Error(..) => false,
                        Then::End => true,
                    }
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Untouched { body } => body.size_hint(),
            Kind::Replay { pending, then, .. } => match then {
                Then::Body(body) => {
                    let rest = body.size_hint();
                    let mut hint = SizeHint::new();
                    hint.set_lower(rest.lower().saturating_add(*pending));
                    if let Some(upper) = rest.upper() {
                        hint.set_upper(upper.saturating_add(*pending));
                    }
                    hint
                }
                Then::Error(_, rest) => {
                    let mut hint = SizeHint::new();
                    hint.set_lower(rest.lower().saturating_add(*pending));
                    if let Some(upper) = rest.upper() {
                        hint.set_upper(upper.saturating_add(*pending));
                    }
                    hint
                }
                Then::End => SizeHint::with_exact(*pending),
            },
        }
    }
}

mod parse;

#[cfg(test)]
mod tests;

//! The tests of [`ReadRequest`](super::ReadRequest).
use std::convert::Infallible;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::Full;
use tokio::sync::mpsc;
use tower::{ServiceExt, service_fn};

use serde_json::Value;

use super::*;
use crate::future::ResponseBody;

/// What the inner service saw, returned in its response's extensions.
#[derive(Debug, Clone, Default)]
struct Seen {
    reserve: Option<RequestReserve>,
    hint: (u64, Option<u64>),
    bytes: Vec<u8>,
    frames: Vec<Bytes>,
    trailers: Option<HeaderMap>,
    error: Option<String>,
    ended: bool,
}

/// A body fed by a channel: frames as the test sends them, a failure,
/// or a client that stops sending while the sender is kept.
struct Chan(mpsc::UnboundedReceiver<Result<Frame<Bytes>, Broken>>);

#[derive(Debug)]
struct Broken;

impl fmt::Display for Broken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("connection reset")
    }
}

impl std::error::Error for Broken {}

impl Body for Chan {
    type Data = Bytes;
    type Error = Broken;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Broken>>> {
        self.0.poll_recv(cx)
    }
}

type Sender = mpsc::UnboundedSender<Result<Frame<Bytes>, Broken>>;

fn open() -> (Sender, Chan) {
    let (tx, rx) = mpsc::unbounded_channel();
    (tx, Chan(rx))
}

/// A body of these chunks, then `end` (trailers or an error) if any.
fn chunks(parts: &[&[u8]], end: Option<Result<Frame<Bytes>, Broken>>) -> Chan {
    let (tx, body) = open();
    for part in parts {
        tx.send(Ok(Frame::data(Bytes::copy_from_slice(part))))
            .unwrap();
    }
    if let Some(end) = end {
        tx.send(end).unwrap();
    }
    body
}

fn trailers() -> HeaderMap {
    let mut map = HeaderMap::new();
    map.insert("x-checksum", HeaderValue::from_static("abc"));
    map
}

fn json<B>(body: B) -> Request<B> {
    with_type("application/json", body)
}

fn with_type<B>(content_type: &str, body: B) -> Request<B> {
    Request::post("/v1/chat/completions")
        .header(CONTENT_TYPE, content_type)
        .body(body)
        .unwrap()
}

async fn record<B>(req: Request<ReadBody<B>>) -> Result<Response<Full<Bytes>>, Infallible>
where
    B: Body<Data = Bytes>,
    B::Error: fmt::Display,
{
    let (parts, body) = req.into_parts();
    let hint = body.size_hint();
    let mut seen = Seen {
        reserve: parts.extensions.get().cloned(),
        hint: (hint.lower(), hint.upper()),
        ..Seen::default()
    };
    let mut body = pin!(body);
    while let Some(frame) = body.frame().await {
        match frame.map(Frame::into_data) {
            Ok(Ok(data)) => {
                seen.bytes.extend_from_slice(&data);
                seen.frames.push(data);
            }
            Ok(Err(frame)) => seen.trailers = frame.into_trailers().ok(),
            Err(error) => {
                seen.error = Some(error.to_string());
                break;
            }
        }
    }
    seen.ended = body.is_end_stream();
    let mut res = Response::new(Full::default());
    res.extensions_mut().insert(seen);
    Ok(res)
}

/// `req` through a layer reading `max_tokens` of bodies up to `max`.
async fn send<B>(max: usize, req: Request<B>) -> Seen
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: fmt::Display + Send,
{
    let service = ReadRequestLayer::new(["max_tokens", "n"])
        .max_body(max)
        .layer(service_fn(record::<B>));
    let res = service.oneshot(req).await.unwrap();
    res.extensions().get::<Seen>().cloned().unwrap()
}

fn reserve(asked: &[(&str, u64)], prompt_estimate: u64) -> Option<RequestReserve> {
    let asked = asked.iter().map(|(f, n)| (f.to_string(), *n)).collect();
    Some(RequestReserve {
        asked,
        prompt_estimate,
        unreadable: false,
    })
}

/// The layer's settings for bodies of up to `max` bytes.
fn limits(max: usize) -> Arc<Config> {
    ReadRequestLayer::new(["max_tokens"]).max_body(max).config
}

fn unreadable() -> Option<RequestReserve> {
    Some(RequestReserve::unreadable())
}

#[tokio::test]
async fn reads_the_fields_and_estimates_the_prompt() {
    let body = r#"{"model":"m","max_tokens":800,"messages":[{"role":"user","content":"héllo"}]}"#;
    let seen = send(1024, json(Full::new(Bytes::from(body)))).await;
    // "m", "user", "héllo": 1 + 4 + 6 bytes, rounded up to 3 tokens.
    assert_eq!(seen.reserve, reserve(&[("max_tokens", 800)], 3));
    assert_eq!(seen.bytes, body.as_bytes());
    let len = body.len() as u64;
    assert_eq!(seen.hint, (len, Some(len)), "exact once read");
    assert!(seen.ended);

    // Keys are not counted, nor are numbers; `n` and `max_tokens` as
    // given, in the layer's order.
    let body = r#"{"n":2,"a_very_long_key_indeed":"abcd","max_tokens":0}"#;
    let seen = send(1024, json(Full::new(Bytes::from(body)))).await;
    assert_eq!(seen.reserve, reserve(&[("max_tokens", 0), ("n", 2)], 1));
}

#[tokio::test]
async fn of_duplicate_keys_the_largest_counts() {
    // The upstream takes one of them (Python, JavaScript and Go the last),
    // never more than the largest.
    for body in [
        r#"{"max_tokens":1,"max_tokens":5000}"#,
        r#"{"max_tokens":5000,"max_tokens":1}"#,
        r#"{"max_tokens":5000,"MAX_TOKENS":1}"#,
    ] {
        let seen = send(1024, json(Full::new(Bytes::from(body)))).await;
        assert_eq!(seen.reserve, reserve(&[("max_tokens", 5000)], 0), "{body}");
    }
}

#[tokio::test]
async fn numbers_are_read_as_lax_validators_read_them() {
    for (value, asked) in [
        ("-1", None),
        ("1.5", None),
        ("8e2", Some(800)),
        ("800.0", Some(800)),
        ("-0", Some(0)),
        (r#""800""#, Some(800)),
        ("true", Some(1)),
        ("null", None),
        ("[800]", None),
        ("18446744073709551616", Some(u64::MAX)),
    ] {
        let body = format!(r#"{{"max_tokens":{value}}}"#);
        let seen = send(1024, json(Full::new(Bytes::from(body)))).await;
        let estimate = u64::from(value == r#""800""#);
        let asked: Vec<_> = asked.map(|n| ("max_tokens", n)).into_iter().collect();
        assert_eq!(seen.reserve, reserve(&asked, estimate), "{value}");
    }
    let body = r#"{"options":{"max_tokens":5},"messages":[{"max_tokens":6}]}"#;
    let seen = send(1024, json(Full::new(Bytes::from(body)))).await;
    assert_eq!(seen.reserve, reserve(&[], 0), "nested fields are not taken");
}

#[tokio::test]
async fn other_bodies_go_on_unchanged_without_a_reserve() {
    let object = br#"{"max_tokens":800}"#;
    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/grpc",
    ] {
        let req = with_type(content_type, Full::new(Bytes::from_static(object)));
        let seen = send(1024, req).await;
        assert_eq!(seen.reserve, None, "{content_type}");
        assert_eq!(seen.bytes, object);
    }
    // JSON that is not an object asks nothing; JSON the parser refuses,
    // whatever the upstream's makes of it, reserves the most.
    for (body, expected) in [
        (&br#"[{"max_tokens":800}]"#[..], reserve(&[], 0)),
        (br#""max_tokens""#, reserve(&[], 0)),
        (br#"{"max_tokens":800"#, unreadable()),
        (br#"{"max_tokens":800,"t":NaN}"#, unreadable()),
        (b"{\"max_tokens\":800,\"p\":\"\xff\"}", unreadable()),
    ] {
        let seen = send(1024, json(Full::new(Bytes::from_static(body)))).await;
        assert_eq!(seen.reserve, expected, "{body:?}");
        assert_eq!(seen.bytes, body);
    }
    // An empty body is not waited for, nor read.
    let seen = send(1024, json(Full::new(Bytes::new()))).await;
    assert_eq!(seen.reserve, None);
}

#[test]
fn json_media_types_as_fastapi_reads_them() {
    let is = |value: &[u8]| is_json(&HeaderValue::from_bytes(value).unwrap());
    assert!(is(b"application/json"));
    assert!(is(b"Application/JSON; charset=utf-8"));
    assert!(is(b"application/vnd.api+json"));
    assert!(is(b"application/merge-patch+JSON ; q=1"));
    // Python's `email` reads these as JSON too: `+json` alone, Latin-1
    // bytes and whitespace (NBSP) around the type.
    assert!(is(b"application/+json"));
    assert!(is(b"application/json\xa0"));
    assert!(is(b"application/json; x=\xe9"));
    assert!(!is(b"application/jsonl"));
    assert!(!is(b"application/x-ndjson"));
    assert!(!is(b"text/json"));
    assert!(!is(b"json"));
    assert!(
        may_be_json(&HeaderMap::new()),
        "no type: FastAPI reads JSON"
    );
}

#[tokio::test]
async fn a_body_in_another_charset_reserves_the_most_unread() {
    // Express decodes the body by its charset: in UTF-7 this body asks
    // 100,000, where a UTF-8 reader sees 1.
    let body = r#"{"max_tokens":1,"x":"+ACI-,+ACI-max_tokens+ACI-:100000,+ACI-y+ACI-:+ACI-"}"#;
    for charset in ["utf-7", "UTF-16", "\"latin1\""] {
        let content_type = format!("application/json; charset={charset}");
        let seen = send(1024, with_type(&content_type, Full::new(Bytes::from(body)))).await;
        assert_eq!(seen.reserve, unreadable(), "{charset}");
        assert_eq!(seen.bytes, body.as_bytes());
    }
    for charset in ["utf-8", "UTF8", "\"utf-8\""] {
        let content_type = format!("application/json; charset={charset}");
        let seen = send(1024, with_type(&content_type, Full::new(Bytes::from(body)))).await;
        assert_eq!(seen.reserve, reserve(&[("max_tokens", 1)], 13), "{charset}");
    }
}

#[tokio::test]
async fn a_body_without_a_type_or_with_a_json_one_among_several_is_read() {
    // Nor with an empty one.
    let object = br#"{"max_tokens":800}"#;
    let req = with_type("", Full::new(Bytes::from_static(object)));
    assert_eq!(
        send(1024, req).await.reserve,
        reserve(&[("max_tokens", 800)], 0)
    );
    // FastAPI reads a body without a Content-Type as JSON.
    let object = br#"{"max_tokens":800}"#;
    let req = Request::new(Full::new(Bytes::from_static(object)));
    assert_eq!(
        send(1024, req).await.reserve,
        reserve(&[("max_tokens", 800)], 0)
    );
    let mut req = with_type("text/plain", Full::new(Bytes::from_static(object)));
    req.headers_mut()
        .append(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    assert_eq!(
        send(1024, req).await.reserve,
        reserve(&[("max_tokens", 800)], 0)
    );
}

#[tokio::test]
async fn a_body_declared_too_big_is_not_read_nor_copied() {
    let data = Bytes::from(format!(r#"{{"max_tokens":800,"p":"{}"}}"#, "x".repeat(100)));
    let len = data.len();
    let mut req = json(chunks(&[&data[..10], &data[10..]], None));
    req.headers_mut().insert(CONTENT_LENGTH, len.into());
    let seen = send(len - 1, req).await;
    assert_eq!(seen.reserve, unreadable(), "what it asks is unknown");
    assert_eq!(seen.bytes, data);
    assert_eq!(seen.hint, (0, None), "the original body's hint");

    // A body whose size hint says it is too big; the inner service
    // gets its very bytes.
    let seen = send(len - 1, json(Full::new(data.clone()))).await;
    assert_eq!(seen.reserve, unreadable());
    assert_eq!(seen.frames[0].as_ptr(), data.as_ptr(), "not copied");
    assert_eq!(
        send(len, json(Full::new(data))).await.hint,
        (len as u64, Some(len as u64))
    );
}

#[tokio::test]
async fn a_body_too_big_is_replayed_whole() {
    // "é" is split across two frames; the body passes `max` in the
    // third frame, and goes on after.
    let data = r#"{"max_tokens":800,"p":"héllo wörld"}"#.as_bytes();
    let split = data.iter().position(|&b| b == 0xc3).unwrap() + 1;
    let parts = [&data[..split], &data[split..26], &data[26..30], &data[30..]];
    let end = Some(Ok(Frame::trailers(trailers())));
    let seen = send(27, json(chunks(&parts, end))).await;
    assert_eq!(seen.reserve, unreadable());
    assert_eq!(seen.bytes, data, "byte for byte");
    // The two frames read in one, the one that passed `max`, the rest.
    let frames: Vec<usize> = seen.frames.iter().map(Bytes::len).collect();
    assert_eq!(frames, [26, 4, data.len() - 30]);
    assert_eq!(seen.hint, (30, None), "what was read, then unknown");
    assert_eq!(seen.trailers, Some(trailers()));
}

#[tokio::test]
async fn a_body_in_frames_is_read_and_replayed_with_its_trailers() {
    let data = r#"{"max_tokens":800,"p":"héllo wörld"}"#.as_bytes();
    let split = data.iter().position(|&b| b == 0xc3).unwrap() + 1;
    let parts = [&data[..split], &data[split..26], &data[26..]];
    let end = Some(Ok(Frame::trailers(trailers())));
    let seen = send(data.len(), json(chunks(&parts, end))).await;
    // "héllo wörld": 13 bytes.
    assert_eq!(seen.reserve, reserve(&[("max_tokens", 800)], 4));
    assert_eq!(seen.bytes, data);
    assert_eq!(seen.trailers, Some(trailers()));
    let len = data.len() as u64;
    assert_eq!(seen.hint, (len, Some(len)), "exact: the trailers end it");
    assert!(seen.ended);
}

#[tokio::test]
async fn a_broken_body_fails_where_it_did() {
    let data = br#"{"max_tokens":800,"p":"#;
    let seen = send(
        1024,
        json(chunks(&[&data[..5], &data[5..]], Some(Err(Broken)))),
    )
    .await;
    assert_eq!(seen.reserve, unreadable(), "what it asked is unknown");
    assert_eq!(seen.bytes, data, "the bytes before the error");
    assert_eq!(seen.error.as_deref(), Some("connection reset"));
    assert_eq!(seen.hint, (data.len() as u64, None), "not a whole body");

    // A body that declared 1,000 bytes and broke after 23: the replay says
    // 1,000 still, so that a proxy frames it so and the upstream sees it
    // cut short, not a whole request of 23 bytes.
    struct Declared(Chan);
    impl Body for Declared {
        type Data = Bytes;
        type Error = Broken;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Broken>>> {
            Pin::new(&mut self.0).poll_frame(cx)
        }
        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(1_000 - data_len())
        }
    }
    fn data_len() -> u64 {
        br#"{"max_tokens":800,"p":"#.len() as u64
    }
    let body = Declared(chunks(&[&data[..]], Some(Err(Broken))));
    let seen = send(1024, json(body)).await;
    assert_eq!(seen.hint, (1_000, Some(1_000)));
    assert_eq!(seen.reserve, unreadable());
}

#[tokio::test]
async fn a_reserve_set_before_is_removed() {
    let forged = || RequestReserve {
        asked: vec![("max_tokens".into(), 1)],
        prompt_estimate: 0,
        unreadable: false,
    };
    let mut req = with_type("text/plain", Full::new(Bytes::from("hello")));
    req.extensions_mut().insert(forged());
    assert_eq!(send(1024, req).await.reserve, None);

    let mut req = json(Full::new(Bytes::from(r#"{"n":"1"}"#)));
    req.extensions_mut().insert(forged());
    let seen = send(1024, req).await;
    assert_eq!(seen.reserve, reserve(&[("n", 1)], 1), "the layer's own");

    let mut req = json(Full::new(Bytes::from(r#"{"max_tokens":900}"#)));
    req.extensions_mut().insert(forged());
    assert_eq!(
        send(1024, req).await.reserve,
        reserve(&[("max_tokens", 900)], 0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_too_slow_is_answered_408_without_the_inner_service() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let inner = service_fn(move |_: Request<ReadBody<Chan>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        // The body the proxy's responses have.
        async { Ok::<_, Infallible>(Response::new(ResponseBody::inner(Full::default()))) }
    });
    let service = ReadRequestLayer::new(["max_tokens"])
        .read_timeout(Duration::from_secs(10))
        .layer(inner);

    // The client sends a frame every 6 s: each in time, all too late.
    let (tx, body) = open();
    tokio::spawn(async move {
        for part in [&b"{\"max_tokens\""[..], b":800", b"}"] {
            tx.send(Ok(Frame::data(Bytes::from_static(part)))).ok();
            tokio::time::sleep(Duration::from_secs(6)).await;
        }
    });
    let start = tokio::time::Instant::now();
    let res = service.clone().oneshot(json(body)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(10));
    assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
    assert_eq!(res.headers()[CONNECTION], "close");
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["status"], 408);
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    // A body that is not read is not timed; one read in time goes on.
    let (_stalled, body) = open();
    let res = service.clone().oneshot(with_type("text/plain", body)).await;
    assert_eq!(res.unwrap().status(), StatusCode::OK);
    let (tx, body) = open();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(9)).await;
        tx.send(Ok(Frame::data(Bytes::from_static(b"{}")))).ok();
    });
    let res = service.oneshot(json(body)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_replay_reports_its_size_and_end() {
    let data = Bytes::from_static(br#"{"max_tokens":3}"#);
    let (tx, body) = open();
    tx.send(Ok(Frame::data(data.clone()))).unwrap();
    drop(tx);
    let prefix = read_prefix(Box::pin(body), &limits(1024)).await;
    assert!(prefix.reserve(&[]).is_some());
    let mut body = pin!(prefix.into_body());
    assert_eq!(body.size_hint().exact(), Some(data.len() as u64));
    assert!(!body.is_end_stream());
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), data);
    assert_eq!(body.size_hint().exact(), Some(0));
    assert!(body.is_end_stream());
    assert!(body.frame().await.is_none());
}

#[tokio::test]
async fn a_body_in_many_small_frames_is_held_in_one_buffer() {
    // One byte a frame: each frame held as it came would cost its own
    // allocation, many times the byte.
    let data = format!(r#"{{"max_tokens":800,"p":"{}"}}"#, "x".repeat(10_000));
    let (tx, body) = open();
    for byte in data.as_bytes() {
        tx.send(Ok(Frame::data(Bytes::copy_from_slice(&[*byte]))))
            .unwrap();
    }
    drop(tx);
    let prefix = read_prefix(Box::pin(body), &limits(data.len())).await;
    assert_eq!(prefix.data, data.as_bytes());
    assert!(prefix.over.is_none() && prefix.last.is_none());
    let bytes: Vec<&[u8]> = data.as_bytes().chunks(1).collect();
    let seen = send(data.len(), json(chunks(&bytes, None))).await;
    assert_eq!(seen.frames.len(), 1, "replayed as one frame");
    assert_eq!(seen.reserve, reserve(&[("max_tokens", 800)], 2_500));

    // Past `max`, the read stops at the frame that passed it.
    let (tx, body) = open();
    for byte in data.as_bytes() {
        tx.send(Ok(Frame::data(Bytes::copy_from_slice(&[*byte]))))
            .unwrap();
    }
    let prefix = read_prefix(Box::pin(body), &limits(100)).await;
    assert_eq!(prefix.data.len(), 100);
    assert_eq!(prefix.over.as_deref(), Some(&data.as_bytes()[100..101]));
    assert!(matches!(prefix.then, Then::Body(_)));
    drop(tx);
}

#[tokio::test]
async fn bodies_read_at_once_share_one_allowance_given_back_when_sent() {
    // Room for 100 bytes in all: a first body of 60, in frames of 10, is
    // read whole into a buffer of 80 (grown by doubling: the allowance
    // counts what is allocated), a second one is not (unreadable: it
    // reserves the most), until the first has been sent on.
    let config = ReadRequestLayer::new(["max_tokens"])
        .max_buffered(100)
        .config;
    let body = |n: usize| {
        let data = format!(r#"{{"max_tokens":5,"p":"{}"}}"#, "x".repeat(n - 23));
        assert_eq!(data.len(), n);
        let parts: Vec<&[u8]> = data.as_bytes().chunks(10).collect();
        chunks(&parts, None)
    };
    let first = read_prefix(Box::pin(body(60)), &config).await;
    assert_eq!(
        first.reserve(&config.fields),
        reserve(&[("max_tokens", 5)], 10)
    );
    assert_eq!(config.buffered.load(Ordering::Acquire), 80);
    let second = read_prefix(Box::pin(body(60)), &config).await;
    assert_eq!(second.reserve(&config.fields), unreadable());
    // 10, then a buffer of 20: 100 in all; 40 would not fit.
    assert_eq!(second.data.len(), 20, "read until the allowance ran out");
    // The second body is replayed whole all the same.
    let mut replay = Box::pin(second.into_body());
    let mut bytes = Vec::new();
    while let Some(frame) = replay.frame().await {
        bytes.extend_from_slice(&frame.unwrap().into_data().unwrap());
    }
    assert_eq!(bytes.len(), 60);
    drop(replay);
    assert_eq!(
        config.buffered.load(Ordering::Acquire),
        80,
        "the first still holds"
    );

    let mut sent = Box::pin(first.into_body());
    while sent.frame().await.is_some() {}
    drop(sent);
    assert_eq!(config.buffered.load(Ordering::Acquire), 0);
    let third = read_prefix(Box::pin(body(60)), &config).await;
    assert_eq!(
        third.reserve(&config.fields),
        reserve(&[("max_tokens", 5)], 10)
    );
}

#[tokio::test]
async fn a_layer_that_replaces_another_shares_its_allowance() {
    let old = ReadRequestLayer::new(["max_tokens"]).max_buffered(100);
    let new = ReadRequestLayer::new(["max_tokens"])
        .max_buffered(100)
        .sharing_buffers_with(&old);
    let body = |n: usize| Full::new(Bytes::from(vec![b' '; n]));
    // A body still held by the old layer's service...
    let held = read_prefix(Box::pin(body(90)), &old.config).await;
    assert_eq!(old.config.buffered.load(Ordering::Acquire), 90);
    // ...leaves the new one room for 10 bytes, not 100.
    let next = read_prefix(Box::pin(body(20)), &new.config).await;
    assert_eq!(next.reserve(&new.config.fields), unreadable());
    drop((held, next));
    assert_eq!(new.config.buffered.load(Ordering::Acquire), 0);
}

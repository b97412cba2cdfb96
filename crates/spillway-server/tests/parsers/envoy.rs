//! The Envoy rate limit service's input: any `RateLimitRequest` (domains,
//! descriptors, entries, limit overrides, hits addends) through the service
//! itself, and raw bytes through its gRPC endpoint. Every call is answered
//! within a bound, with a status for each descriptor or a gRPC error that
//! says what is wrong (`INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED`); never
//! `UNKNOWN`, and `INTERNAL` only where the gRPC spec has the library say
//! it: a message that does not decode ("Error parsing request proto").

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use proptest::prelude::*;
use prost::Message;
use spillway_conformance::hostile::{apply, config, mutation, within};
use spillway_server::config::Config;
use spillway_server::envoy::EnvoyRateLimiter;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use spillway_server::envoy::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use spillway_server::envoy::rls::RateLimitRequest;
use spillway_server::envoy::rls::rate_limit_service_server::RateLimitService;
use spillway_server::state::{Live, Loaded};
use tonic::Code;

/// The most one call may take: these take well under a millisecond.
const BOUND: Duration = Duration::from_secs(10);

/// Rules by descriptor keys, and the sample descriptor file's tree
/// (domain `edge`).
const CONFIG: &str = r#"
[envoy]
descriptors_file = "envoy-ratelimit.yaml"
max_descriptors = 8
max_entries = 4

[[rules]]
name = "per-client"
algorithm = "token_bucket"
limit = 5
window = "1s"
burst = 5
descriptors = ["client"]

[[rules]]
name = "per-tenant-path"
algorithm = "sliding_window"
limit = 100
window = "1m"
action = "shadow"
descriptors = ["tenant", "path"]
"#;

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
});

static LIVE: LazyLock<Arc<Live>> = LazyLock::new(|| {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let config = Config::parse_in(CONFIG, &dir).expect("a valid config");
    let engine = RUNTIME
        .block_on(Loaded::build(config, None, None))
        .expect("an engine");
    Arc::new(Live::new(engine))
});

/// The gRPC server on the same engine.
static SERVER: LazyLock<SocketAddr> = LazyLock::new(|| {
    let live = LIVE.clone();
    RUNTIME.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = listener.local_addr().expect("an address");
        tokio::spawn(spillway_server::envoy::serve(
            listener,
            live,
            std::future::pending(),
        ));
        addr
    })
});

/// Whether a gRPC error is one a hostile call may get, with a message.
/// `INTERNAL` is tonic's for a body it cannot read as one message (a bad
/// compression flag or none expected, a cut-short frame, no message, a message that does
/// not decode), as the gRPC spec has the library answer "Error parsing
/// request proto"; the service itself never answers it to these calls.
/// `OUT_OF_RANGE` is tonic's for a frame over the size the service reads.
fn is_a_clear_refusal(code: Code, message: &str) -> bool {
    const TONICS: &[&str] = &[
        "failed to decode",
        "protocol error: ",
        "Unexpected EOF decoding stream",
        "Missing request message",
    ];
    !message.trim().is_empty()
        && match code {
            Code::InvalidArgument | Code::ResourceExhausted => true,
            Code::Internal => TONICS.iter().any(|t| message.contains(t)),
            // tonic's for a frame longer than the service reads
            // (`EnvoyLimits::max_message_bytes`).
            Code::OutOfRange => message.contains("message length too large"),
            _ => false,
        }
}

/// A grpc-message's text: it is percent-encoded on the wire.
fn decoded(message: &str) -> String {
    let bytes = message.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Asks the service `request`, within [`BOUND`]; checks the answer.
fn ask(request: RateLimitRequest) -> Result<usize, (Code, String)> {
    let shown = format!("{request:?}");
    let descriptors = request.descriptors.len();
    let service = EnvoyRateLimiter::new(LIVE.clone());
    let answer = within(BOUND, move || {
        RUNTIME.block_on(async move {
            service
                .should_rate_limit(tonic::Request::new(request))
                .await
                .map(|r| r.into_inner().statuses.len())
                .map_err(|s| (s.code(), s.message().to_string()))
        })
    })
    .unwrap_or_else(|e| panic!("{e:?} for {shown}"));
    match &answer {
        Ok(statuses) => assert_eq!(*statuses, descriptors, "for {shown}"),
        Err((code, message)) => assert!(
            is_a_clear_refusal(*code, message),
            "{code:?} {message:?} for {shown}"
        ),
    }
    answer
}

/// A string: a key or value the configuration knows, or anything.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::sample::select(
            &[
                "client",
                "tenant",
                "path",
                "gold",
                "remote_address",
                "/login",
                "/static/x",
                "plan",
                "trial",
                "edge",
                ""
            ][..]
        )
        .prop_map(str::to_string),
        "\\PC{0,12}",
        ".{0,300}",
    ]
}

fn descriptor() -> impl Strategy<Value = RateLimitDescriptor> {
    let entry = (text(), text()).prop_map(|(key, value)| Entry { key, value });
    let limit = (any::<u32>(), prop_oneof![0..=8i32, any::<i32>()]).prop_map(
        |(requests_per_unit, unit)| RateLimitOverride {
            requests_per_unit,
            unit,
        },
    );
    (
        proptest::collection::vec(entry, 0..6),
        proptest::option::weighted(0.2, limit),
        proptest::option::of(prop_oneof![0..3u64, any::<u64>()]),
    )
        .prop_map(|(entries, limit, hits_addend)| RateLimitDescriptor {
            entries,
            limit,
            hits_addend,
        })
}

fn request() -> impl Strategy<Value = RateLimitRequest> {
    (
        prop_oneof![4 => Just("edge".to_string()), 1 => text()],
        proptest::collection::vec(descriptor(), 0..10),
        prop_oneof![0..3u32, any::<u32>()],
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain,
            descriptors,
            hits_addend,
        })
}

/// Valid requests, encoded.
static SEEDS: LazyLock<Vec<&'static [u8]>> = LazyLock::new(|| {
    let entries = |pairs: &[(&str, &str)]| RateLimitDescriptor {
        entries: pairs
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    };
    let requests = [
        RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![entries(&[("client", "a")])],
            hits_addend: 1,
        },
        RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![
                entries(&[("path", "/login"), ("remote_address", "10.0.0.1")]),
                RateLimitDescriptor {
                    limit: Some(RateLimitOverride {
                        requests_per_unit: 7,
                        unit: 2,
                    }),
                    hits_addend: Some(2),
                    ..entries(&[("tenant", "gold"), ("path", "/x")])
                },
            ],
            hits_addend: 0,
        },
    ];
    requests
        .iter()
        .map(|r| &*Vec::leak(r.encode_to_vec()))
        .collect()
});

/// What the gRPC endpoint answered to `body` (sent as the request's
/// body, framing and all): its grpc-status and grpc-message.
fn post(body: Vec<u8>) -> (Code, String) {
    post_with(body, None)
}

/// [`post`], with a `grpc-timeout` of this value if given.
fn post_with(body: Vec<u8>, timeout: Option<http::HeaderValue>) -> (Code, String) {
    let addr = *SERVER;
    let shown = format!("{body:?}");
    within(BOUND, move || {
        RUNTIME.block_on(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let (mut sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                    .await
                    .expect("an HTTP/2 connection");
            tokio::spawn(connection);
            let request = http::Request::post(format!(
                "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
            ))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Full::new(Bytes::from(body)))
            .expect("a request");
            let mut request = request;
            if let Some(timeout) = timeout {
                request.headers_mut().insert("grpc-timeout", timeout);
            }
            let response = sender.send_request(request).await.expect("a response");
            let (parts, body) = response.into_parts();
            assert_eq!(parts.status, 200, "gRPC answers errors in grpc-status");
            let collected = body.collect().await.expect("a whole body");
            // Trailers, or the headers of a trailers-only answer.
            let trailers = collected.trailers().cloned().unwrap_or_default();
            let field = |name: &str| {
                trailers
                    .get(name)
                    .or_else(|| parts.headers.get(name))
                    .map(|v| v.to_str().unwrap_or("").to_string())
            };
            let code = field("grpc-status").expect("a grpc-status");
            let code = Code::from_i32(code.parse().expect("a number"));
            (code, decoded(&field("grpc-message").unwrap_or_default()))
        })
    })
    .unwrap_or_else(|e| panic!("{e:?} for {shown}"))
}

/// `message` in gRPC's framing: not compressed, its length, itself.
fn framed(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

fn posted(body: Vec<u8>) {
    let (code, message) = post(body);
    assert!(
        code == Code::Ok || is_a_clear_refusal(code, &message),
        "{code:?} {message:?}"
    );
}

/// Protobuf's wire syntax: tags of every type, varints at their limits.
const PIECES: &[&[u8]] = &[
    b"\x0a",
    b"\x12",
    b"\x18",
    b"\x08",
    b"\x10",
    b"\x1a",
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
    b"\xff\xff\xff\xff\x0f",
    b"\x80",
    b"\x00",
    b"\x7f",
    b"\x0a\xff\xff\xff\xff\x0f",
    b"\x12\x00",
];

proptest! {
    #![proptest_config(config(150))]

    #[test]
    fn any_request_is_answered_or_refused_with_a_reason(request in request()) {
        let _ = ask(request);
    }

    #[test]
    fn a_request_within_bounds_in_the_domain_is_answered(
        descriptors in proptest::collection::vec(descriptor(), 1..8),
    ) {
        // Within max_entries, with every override's unit known and no
        // cost over a capacity: nothing to refuse.
        let descriptors: Vec<_> = descriptors
            .into_iter()
            .map(|mut d| {
                d.entries.truncate(4);
                d.limit = None;
                d.hits_addend = d.hits_addend.map(|h| h % 3);
                d
            })
            .collect();
        let answer = ask(RateLimitRequest { domain: "edge".into(), descriptors, hits_addend: 1 });
        prop_assert!(answer.is_ok(), "{:?}", answer);
    }

    #[test]
    fn any_bytes_at_the_endpoint_get_a_grpc_status(
        body in proptest::collection::vec(any::<u8>(), 0..100)
    ) {
        posted(body);
    }

    #[test]
    fn any_message_at_the_endpoint_gets_a_grpc_status(
        message in proptest::collection::vec(any::<u8>(), 0..100)
    ) {
        posted(framed(&message));
    }

    #[test]
    fn a_mutated_message_gets_a_grpc_status(
        seed in 0..2usize,
        mutations in proptest::collection::vec(
            mutation(PIECES), 1..5),
        framing in prop_oneof![4 => Just(None), 1 => proptest::collection::vec(any::<u8>(), 5)
            .prop_map(Some)],
    ) {
        let message = apply(SEEDS[seed], &mutations);
        let mut body = framed(&message);
        if let Some(prefix) = framing {
            // A wrong compression flag or length.
            body[..5].copy_from_slice(&prefix);
        }
        posted(body);
    }
}

proptest! {
    #![proptest_config(config(100))]

    /// `grpc-timeout` is read by the service itself (its deadline).
    #[test]
    fn any_grpc_timeout_is_a_deadline_or_none(
        value in prop_oneof![
            "[0-9]{1,10}[HMSmun]",
            "[ -~]{0,12}",
        ],
    ) {
        let Ok(value) = http::HeaderValue::from_str(&value) else {
            return Ok(());
        };
        let (code, message) = post_with(framed(SEEDS[0]), Some(value));
        // A short deadline passes before the call is decided: our
        // DEADLINE_EXCEEDED, or tonic's own CANCELLED "Timeout expired".
        prop_assert!(
            code == Code::Ok
                || code == Code::DeadlineExceeded
                || (code == Code::Cancelled && message.contains("Timeout expired")),
            "{:?} {}", code, message
        );
    }
}

#[test]
fn the_seeds_are_answered() {
    for seed in SEEDS.iter() {
        let (code, message) = post(framed(seed));
        assert_eq!(code, Code::Ok, "{message}");
    }
}

/// What the long run found, kept with its shape: a frame whose length is
/// over the size the service reads is refused at once (tonic's
/// OUT_OF_RANGE, with the length), not read.
#[test]
fn a_frame_longer_than_the_limit_is_refused_unread() {
    let mut body = vec![0];
    body.extend_from_slice(&3_449_121_716u32.to_be_bytes());
    body.extend_from_slice(b"\x0a\x04edge");
    let (code, message) = post(body);
    assert_eq!(code, Code::OutOfRange, "{message}");
    assert!(message.contains("3449121716"), "{message}");
}

//! `/v1/forward-auth`, the hook nginx, Caddy, Traefik and HAProxy call:
//! driven with `oneshot` on `app(state)`, the caller's address given as the
//! server gives it. The real proxies in front of it are in
//! `forward_auth_proxies.rs`.

mod serve_support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use spillway_server::config::Config;
use spillway_server::{State, app};
use spillway_tower::ClientAddr;
use tower::ServiceExt;

/// The proxy at 127.0.0.1 is trusted; clients are elsewhere.
const CONFIG: &str = r#"
[clients]
trusted_proxies = ["127.0.0.1/32"]

[[rules]]
name = "login"
match = { methods = ["POST"], path = "/login" }
key = ["ip"]
algorithm = "sliding_log"
limit = 2
window = "1h"

[[rules]]
name = "shaped"
match = { path = "/shaped" }
key = ["ip"]
algorithm = "leaky_bucket"
mode = "shape"
limit = 10
window = "10s"
burst = 3
"#;

const PROXY: &str = "127.0.0.1:50000";

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII"))
            .unwrap_or_else(|| panic!("no `{name}` in {:?}", self.headers))
    }

    fn detail(&self) -> String {
        let problem: Value = serde_json::from_slice(&self.body).expect("a problem+json body");
        problem["detail"].as_str().expect("a detail").to_string()
    }
}

async fn app_of(config: &str) -> Router {
    let config = Config::parse(config).expect("a valid config");
    app(State::new(config).await.expect("a store"))
}

/// A hook call from `caller` with `headers` (the description and the
/// original request's headers).
async fn call(app: &Router, caller: &str, uri: &str, headers: &[(&str, &str)]) -> Answer {
    let mut req = Request::get(uri);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let mut req = req.body(Body::empty()).expect("a request");
    let caller: SocketAddr = caller.parse().expect("an address");
    req.extensions_mut().insert(ClientAddr(caller));
    let res = app.clone().oneshot(req).await.expect("infallible");
    let status = res.status();
    let headers = res.headers().clone();
    let body = res.into_body().collect().await.expect("a body").to_bytes();
    Answer {
        status,
        headers,
        body: body.to_vec(),
    }
}

/// The login of client `client`, described by the proxy, with `target`.
async fn login(app: &Router, client: &str, target: &str) -> Answer {
    call(
        app,
        PROXY,
        "/v1/forward-auth",
        &[
            ("x-forwarded-method", "POST"),
            ("x-forwarded-uri", target),
            ("x-forwarded-host", "api.example.com"),
            ("x-forwarded-for", client),
        ],
    )
    .await
}

#[tokio::test]
async fn admitted_requests_get_the_fields_and_denied_ones_a_429_with_retry_after() {
    let app = app_of(CONFIG).await;
    let first = login(&app, "203.0.113.7", "/login").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.header("x-ratelimit-limit"), "2");
    assert_eq!(first.header("x-ratelimit-remaining"), "1");
    assert_eq!(first.header("ratelimit-policy"), "\"login\";q=2;w=3600");
    assert!(first.body.is_empty());

    assert_eq!(
        login(&app, "203.0.113.7", "/login").await.status,
        StatusCode::OK
    );
    let denied = login(&app, "203.0.113.7", "/login").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = denied.header("retry-after").parse().expect("seconds");
    assert!((3590..=3600).contains(&retry), "{retry}");
    assert_eq!(denied.header("x-ratelimit-remaining"), "0");
    assert!(denied.header("ratelimit").starts_with("\"login\";r=0;t="));
    assert_eq!(denied.header("content-type"), "application/problem+json");
    assert!(denied.detail().contains("login"), "{}", denied.detail());

    // Another client, by the address the proxy appended, is counted apart.
    let other = login(&app, "198.51.100.1, 203.0.113.9", "/login").await;
    assert_eq!(other.status, StatusCode::OK);
    assert_eq!(other.header("x-ratelimit-remaining"), "1");
    // A request no rule matches passes with no fields.
    let page = call(
        &app,
        PROXY,
        "/v1/forward-auth",
        &[
            ("x-forwarded-method", "GET"),
            ("x-forwarded-uri", "/"),
            ("x-forwarded-host", "api.example.com"),
            ("x-forwarded-for", "203.0.113.7"),
        ],
    )
    .await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.headers.get("x-ratelimit-limit").is_none());
}

#[tokio::test]
async fn only_a_trusted_proxy_may_describe_a_request_and_nothing_is_charged_otherwise() {
    let app = app_of(CONFIG).await;
    for _ in 0..3 {
        let refused = call(
            &app,
            "192.0.2.10:40000",
            "/v1/forward-auth",
            &[
                ("x-forwarded-method", "POST"),
                ("x-forwarded-uri", "/login"),
                ("x-forwarded-host", "api.example.com"),
                ("x-forwarded-for", "203.0.113.7"),
            ],
        )
        .await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN);
        assert!(
            refused.detail().contains("192.0.2.10"),
            "{}",
            refused.detail()
        );
        assert!(refused.detail().contains("trusted_proxies"));
    }
    // The client the untrusted caller named still has its whole quota.
    let first = login(&app, "203.0.113.7", "/login").await;
    assert_eq!(first.header("x-ratelimit-remaining"), "1");
}

#[tokio::test]
async fn a_missing_repeated_or_malformed_description_is_a_400_naming_the_header() {
    let app = app_of(CONFIG).await;
    let full = [
        ("x-forwarded-method", "POST"),
        ("x-forwarded-uri", "/login"),
        ("x-forwarded-host", "api.example.com"),
    ];
    for missing in 0..full.len() {
        let headers: Vec<_> = (0..full.len())
            .filter(|&i| i != missing)
            .map(|i| full[i])
            .collect();
        let refused = call(&app, PROXY, "/v1/forward-auth", &headers).await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        let named = ["X-Forwarded-Method", "X-Forwarded-Uri", "X-Forwarded-Host"][missing];
        assert!(
            refused.detail().contains(&format!("`{named}` is missing")),
            "{}",
            refused.detail()
        );
    }
    let mut twice = full.to_vec();
    twice.push(("x-forwarded-uri", "/"));
    let refused = call(&app, PROXY, "/v1/forward-auth", &twice).await;
    assert!(
        refused
            .detail()
            .contains("`X-Forwarded-Uri` is sent more than once")
    );

    let bad = [
        ("x-forwarded-method", "PO ST", "X-Forwarded-Method"),
        ("x-forwarded-uri", "login", "X-Forwarded-Uri"),
        ("x-forwarded-host", "api.example.com,evil", "Invalid Host"),
        ("x-forwarded-uri", "/log%zzin", "%"),
    ];
    for (name, value, named) in bad {
        let mut headers: Vec<_> = full.iter().filter(|(n, _)| *n != name).copied().collect();
        headers.push((name, value));
        let refused = call(&app, PROXY, "/v1/forward-auth", &headers).await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{name}: {value}");
        assert!(refused.detail().contains(named), "{}", refused.detail());
    }
    // None of them was charged.
    assert_eq!(
        login(&app, "127.0.0.1", "/login")
            .await
            .header("x-ratelimit-remaining"),
        "1"
    );
}

/// Spellings of the login that routers serve from the login handler are
/// the login to the hook too; and a header some upstreams route by is
/// refused, since the hook cannot remove it from what they receive.
#[tokio::test]
async fn other_spellings_of_a_limited_request_are_counted_by_its_rule() {
    let app = app_of(CONFIG).await;
    let spellings = [
        "//login",
        "/%6cogin",
        "/x/../login",
        "/x/..;/login",
        "/login;jsessionid=1",
        "/LOGIN",
        "/login/",
        "/\\login",
        "/api\\..\\login",
        "http://api.example.com/login",
        // Read by Node's URL parser as host `x`, path `/login`: the upstream
        // receives it as it came, not merged.
        "//x/login",
        "/\\x/login",
        // `/login` to Werkzeug and Rack, which decode `%2F` first.
        "/x%2F..%2Flogin",
    ];
    for (i, target) in spellings.iter().enumerate() {
        let client = format!("203.0.113.{}", i + 1);
        assert_eq!(login(&app, &client, "/login").await.status, StatusCode::OK);
        assert_eq!(login(&app, &client, "/login").await.status, StatusCode::OK);
        let spelled = login(&app, &client, target).await;
        assert_eq!(
            spelled.status,
            StatusCode::TOO_MANY_REQUESTS,
            "`{target}` got past the login rule"
        );
    }
    // A lower-case method is refused, as the proxy refuses it.
    let lower = call(
        &app,
        PROXY,
        "/v1/forward-auth",
        &[
            ("x-forwarded-method", "post"),
            ("x-forwarded-uri", "/login"),
            ("x-forwarded-host", "api.example.com"),
        ],
    )
    .await;
    assert_eq!(lower.status, StatusCode::BAD_REQUEST);

    for header in ["x-original-url", "x-rewrite-url"] {
        let routed = call(
            &app,
            PROXY,
            "/v1/forward-auth",
            &[
                ("x-forwarded-method", "POST"),
                ("x-forwarded-uri", "/public"),
                ("x-forwarded-host", "api.example.com"),
                (header, "/login"),
            ],
        )
        .await;
        assert_eq!(routed.status, StatusCode::BAD_REQUEST, "{header}");
        assert!(routed.detail().contains(header), "{}", routed.detail());
    }
}

#[tokio::test]
async fn deny_status_turns_what_is_not_2xx_into_that_status_with_the_real_one_in_a_header() {
    let app = app_of(CONFIG).await;
    let nginx = "/v1/forward-auth?deny_status=403";
    let describe = |target| {
        [
            ("x-forwarded-method", "POST"),
            ("x-forwarded-uri", target),
            ("x-forwarded-host", "api.example.com"),
            ("x-forwarded-for", "203.0.113.7"),
        ]
    };
    for _ in 0..2 {
        let admitted = call(&app, PROXY, nginx, &describe("/login")).await;
        assert_eq!(admitted.status, StatusCode::OK);
        assert!(admitted.headers.get("x-spillway-status").is_none());
    }
    let denied = call(&app, PROXY, nginx, &describe("/login")).await;
    assert_eq!(denied.status, StatusCode::FORBIDDEN);
    assert_eq!(denied.header("x-spillway-status"), "429");
    assert!(
        denied
            .header("retry-after")
            .parse::<u64>()
            .expect("seconds")
            > 0
    );
    assert!(denied.headers.contains_key("ratelimit"));

    let bad = call(&app, PROXY, nginx, &describe("/log%zzin")).await;
    assert_eq!(bad.status, StatusCode::FORBIDDEN);
    assert_eq!(bad.header("x-spillway-status"), "400");

    let unknown = call(
        &app,
        PROXY,
        "/v1/forward-auth?deny_status=500",
        &describe("/"),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST);
}

/// A hook cannot hold the request, but it can hold its answer, and the
/// proxy waits for it: a shaped request's answer comes on its turn; past
/// the bucket, the answer is a 429 at once.
#[tokio::test(start_paused = true)]
async fn a_shaped_request_is_answered_on_its_turn() {
    let app = app_of(CONFIG).await;
    let t0 = tokio::time::Instant::now();
    // The store runs on the real clock, tokio's timers on the paused one:
    // a turn may come early by the real time between the decisions.
    let real = std::time::Instant::now();
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                let res = call(
                    &app,
                    PROXY,
                    "/v1/forward-auth",
                    &[
                        ("x-forwarded-method", "GET"),
                        ("x-forwarded-uri", "/shaped"),
                        ("x-forwarded-host", "api.example.com"),
                        ("x-forwarded-for", "203.0.113.7"),
                    ],
                )
                .await;
                (res.status, tokio::time::Instant::now() - t0)
            })
        })
        .collect();
    let mut answered = Vec::new();
    for c in calls {
        answered.push(c.await.expect("the call"));
    }
    let skew = real.elapsed();
    let mut admitted: Vec<Duration> = answered
        .iter()
        .filter(|(s, _)| *s == StatusCode::OK)
        .map(|(_, t)| *t)
        .collect();
    admitted.sort();
    let denied: Vec<Duration> = answered
        .iter()
        .filter(|(s, _)| *s == StatusCode::TOO_MANY_REQUESTS)
        .map(|(_, t)| *t)
        .collect();
    assert_eq!((admitted.len(), denied.len()), (3, 2), "{answered:?}");
    assert!(denied.iter().all(|t| *t < Duration::from_millis(1)));
    for (k, at) in admitted.iter().enumerate() {
        let turn = Duration::from_secs(k as u64);
        assert!(
            *at + skew >= turn && *at <= turn + Duration::from_millis(1),
            "answer {k} at {at:?}, its turn is {turn:?}"
        );
    }
}

/// A stopping server does not keep the answers it holds for their shaping
/// turn: they are answered 503 at once, with the wait left as Retry-After,
/// as `spillway proxy` answers the requests it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_server_answers_the_shaped_requests_it_holds_with_503() {
    // One every 10 s, three in the queue: the second waits 10 s.
    let config = Config::parse(
        r#"
[clients]
trusted_proxies = ["127.0.0.1/32"]

[[rules]]
name = "slow"
key = ["ip"]
algorithm = "leaky_bucket"
mode = "shape"
limit = 1
window = "10s"
burst = 3
"#,
    )
    .expect("a valid config");
    let mut service = serve_support::Service::start(config, None).await;
    let described = [
        ("x-forwarded-method", "GET"),
        ("x-forwarded-uri", "/"),
        ("x-forwarded-host", "api.example.com"),
        ("x-forwarded-for", "203.0.113.7"),
    ];
    let http = service.http.clone();
    let first = http
        .send(http::Method::GET, "/v1/forward-auth", &described, "")
        .await;
    assert_eq!(first.status, StatusCode::OK);
    let held = tokio::spawn(async move {
        http.send(http::Method::GET, "/v1/forward-auth", &described, "")
            .await
    });
    let state = service.state.clone();
    serve_support::eventually(Duration::from_secs(5), "the second is held", || {
        let held = state.held.held();
        async move { held == 1 }
    })
    .await;
    let stopped = service.shutdown();
    let answer = tokio::time::timeout(Duration::from_secs(5), held)
        .await
        .expect("answered at once, not on its turn")
        .expect("the request");
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    let retry: u64 = answer.headers["retry-after"]
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("seconds");
    assert!((1..=10).contains(&retry), "{retry}");
    assert_eq!(state.held.held(), 0);
    stopped.await.expect("run ends").expect("cleanly");
}

/// The answers the hook holds for their shaping turn are bounded, all keys
/// together, by `[proxy] max_held`: past it, a shaped request is answered
/// 503 at once with its wait as Retry-After, and charged nothing.
#[tokio::test(start_paused = true)]
async fn the_answers_held_for_their_turn_are_bounded_by_max_held() {
    let config = Config::parse(
        r#"
[clients]
trusted_proxies = ["127.0.0.1/32"]

[proxy]
max_held = 1

[[rules]]
name = "slow"
key = ["ip"]
algorithm = "leaky_bucket"
mode = "shape"
limit = 1
window = "10s"
burst = 3
"#,
    )
    .expect("a valid config");
    let state = State::new(config).await.expect("a store");
    let app = app(state.clone());
    let describe = [
        ("x-forwarded-method", "GET"),
        ("x-forwarded-uri", "/"),
        ("x-forwarded-host", "api.example.com"),
        ("x-forwarded-for", "203.0.113.7"),
    ];
    assert_eq!(
        call(&app, PROXY, "/v1/forward-auth", &describe)
            .await
            .status,
        StatusCode::OK
    );
    let held = {
        let app = app.clone();
        tokio::spawn(async move { call(&app, PROXY, "/v1/forward-auth", &describe).await })
    };
    // The held call reaches its wait within a few polls (no time passes).
    for _ in 0..1_000 {
        if state.held.held() == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(state.held.held(), 1, "the second call holds a place");
    let refused = call(&app, PROXY, "/v1/forward-auth", &describe).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    let retry: u64 = refused.header("retry-after").parse().expect("seconds");
    assert!((10..=20).contains(&retry), "{retry}");
    assert_eq!(held.await.expect("the held call").status, StatusCode::OK);
    assert_eq!(state.held.held(), 0);
}

/// A header whose `_` makes it, to a CGI or WSGI upstream, the header a
/// rule keys by cannot be removed by the hook from what the upstream
/// receives: the request is refused.
#[tokio::test]
async fn an_underscored_spelling_of_a_header_the_rules_read_is_refused() {
    let app = app_of(
        r#"
[clients]
trusted_proxies = ["127.0.0.1/32"]
api_key = "header:x-api-key"

[[rules]]
name = "per-key"
key = ["api_key"]
algorithm = "sliding_log"
limit = 5
window = "1h"
"#,
    )
    .await;
    let described = [
        ("x-forwarded-method", "GET"),
        ("x-forwarded-uri", "/"),
        ("x-forwarded-host", "api.example.com"),
        ("x-api-key", "mine"),
    ];
    let mut spoofed = described.to_vec();
    spoofed.push(("x_api_key", "someone-else"));
    let refused = call(&app, PROXY, "/v1/forward-auth", &spoofed).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert!(
        refused.detail().contains("x_api_key"),
        "{}",
        refused.detail()
    );
    // An underscored header that folds onto nothing is the other proxy's
    // business (nginx drops them all by default).
    let mut harmless = described.to_vec();
    harmless.push(("x_trace", "1"));
    assert_eq!(
        call(&app, PROXY, "/v1/forward-auth", &harmless)
            .await
            .status,
        StatusCode::OK
    );
}

/// A concurrency rule does not apply at the hook: the proxy never says when
/// the request ends, so no slot could be held for it. Before, the hook took
/// a slot and held it while a shaped answer waited for its turn: a second
/// caller was refused for a request that was not in flight anywhere.
#[tokio::test]
async fn a_concurrency_rule_does_not_apply_at_the_hook() {
    const IN_FLIGHT: &str = r#"
[clients]
trusted_proxies = ["127.0.0.1/32"]

[[rules]]
name = "in_flight"
match = { path = "/report" }
key = ["ip"]
algorithm = "concurrency"
limit = 1

[[rules]]
name = "shaped"
match = { path = "/report" }
key = ["ip"]
algorithm = "leaky_bucket"
mode = "shape"
limit = 10
window = "1s"
burst = 3
"#;
    let app = app_of(IN_FLIGHT).await;
    let calls: Vec<_> = (0..3)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                call(
                    &app,
                    PROXY,
                    "/v1/forward-auth",
                    &[
                        ("x-forwarded-method", "GET"),
                        ("x-forwarded-uri", "/report"),
                        ("x-forwarded-host", "api.example.com"),
                        ("x-forwarded-for", "203.0.113.7"),
                    ],
                )
                .await
            })
        })
        .collect();
    for c in calls {
        let answer = c.await.expect("the call");
        assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.headers);
        let policy = answer.header("ratelimit-policy");
        assert!(policy.contains("\"shaped\""), "{policy}");
        assert!(!policy.contains("in_flight"), "{policy}");
    }
}

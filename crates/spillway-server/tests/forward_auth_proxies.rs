//! The forward-auth hook behind the real proxies: nginx (`auth_request`),
//! Caddy (`forward_auth`), HAProxy (a Lua action) and Traefik
//! (`ForwardAuth`), each run from its checked-in configuration in
//! `examples/forward-auth/` (the addresses swapped for free ports), in front
//! of a counting upstream, with `spillway serve` as the hook.
//!
//! What a client sees is asserted at the client: the rate-limit fields on
//! admitted responses, the 429 with `Retry-After`, the IETF fields and a
//! problem body on the denied request, which never reaches the upstream;
//! a client's own `X-Forwarded-*` headers change nothing; a shaping rule's
//! requests are forwarded on their turns, the hook holding its answers; and
//! two proxies, each with its own Spillway, share one limit on one Redis.
//!
//! Clients connect from 127.0.0.2 and 127.0.0.3; the proxies call the hook
//! from 127.0.0.1, the one address Spillway trusts. A proxy that is not
//! installed is skipped with a message, unless `SPILLWAY_REQUIRE_PROXIES=1`
//! (which `.ci/run` sets after installing them).

mod front_support;
mod process_support;
mod serve_support;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use bytes::Bytes;
use front_support::{Front, FrontProxy, binary_or_skip, examples};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use process_support::Upstream;
use serve_support::Service;
use spillway_conformance::redis_server::RedisServer;
use spillway_server::config::Config;

/// A client connecting from `from`.
struct Clients {
    client: Client<HttpConnector, Full<Bytes>>,
}

#[derive(Debug)]
struct Seen {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Seen {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII"))
            .unwrap_or_else(|| panic!("no `{name}` in {self:?}"))
    }
}

impl Clients {
    fn from(ip: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_local_address(Some(ip.parse::<IpAddr>().expect("an address")));
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    async fn send(
        &self,
        proxy: SocketAddr,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Seen {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("http://{proxy}{path}"))
            .header("host", "api.example.com");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::default()).expect("a request");
        let res = tokio::time::timeout(Duration::from_secs(30), self.client.request(req))
            .await
            .expect("an answer within 30 s")
            .expect("an answer");
        let status = res.status();
        let headers = res.headers().clone();
        let body = res.into_body().collect().await.expect("a body").to_bytes();
        Seen {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    async fn login(&self, proxy: SocketAddr, headers: &[(&str, &str)]) -> Seen {
        self.send(proxy, Method::POST, "/login", headers).await
    }
}

fn example_config(redis: Option<&str>) -> Config {
    let mut text = std::fs::read_to_string(examples().join("spillway.toml"))
        .expect("examples/forward-auth/spillway.toml");
    if let Some(url) = redis {
        text = text.replace(
            "[clients]",
            &format!("[store]\nkind = \"redis\"\nurl = \"{url}\"\n\n[clients]"),
        );
    }
    Config::parse(&text).expect("the example configuration is valid")
}

/// `front` in front of a counting upstream, with one Spillway on the
/// example configuration as its hook; `None` when `front` is skipped.
struct Rig {
    upstream: Upstream,
    proxy: FrontProxy,
    _spillway: Service,
}

impl Rig {
    async fn start(front: Front) -> Option<Self> {
        let binary = binary_or_skip(front)?;
        let upstream = Upstream::start().await;
        let spillway = Service::start(example_config(None), None).await;
        let proxy = FrontProxy::start(front, &binary, spillway.addr, upstream.addr).await;
        Some(Self {
            upstream,
            proxy,
            _spillway: spillway,
        })
    }
}

/// The login limit (3 a minute by IP) through `front`, as a client sees it.
async fn limits_through(front: Front) {
    let Some(rig) = Rig::start(front).await else {
        return;
    };
    let (upstream, proxy) = (&rig.upstream, &rig.proxy);
    let name = front.name();
    let client = Clients::from("127.0.0.2");

    for left in (0..3).rev() {
        let admitted = client.login(proxy.addr, &[]).await;
        assert_eq!(
            admitted.status,
            StatusCode::OK,
            "{name}: {admitted:?}\n{}",
            proxy.log()
        );
        assert_eq!(admitted.body, "upstream", "{name}");
        if front.copies_fields() {
            assert_eq!(admitted.header("x-ratelimit-limit"), "3", "{name}");
            assert_eq!(
                admitted.header("x-ratelimit-remaining"),
                left.to_string(),
                "{name}"
            );
            assert!(
                admitted
                    .header("ratelimit-policy")
                    .starts_with("\"login\";q=3;w=60"),
                "{name}: {admitted:?}"
            );
            assert!(
                admitted
                    .header("ratelimit")
                    .starts_with(&format!("\"login\";r={left};t=")),
                "{name}: {admitted:?}"
            );
        }
    }
    assert_eq!(upstream.arrived("/login"), 3, "{name}");

    let denied = client.login(proxy.addr, &[]).await;
    assert_eq!(
        denied.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{name}: {denied:?}"
    );
    let retry: u64 = denied.header("retry-after").parse().expect("whole seconds");
    assert!((1..=60).contains(&retry), "{name}: Retry-After {retry}");
    assert_eq!(denied.header("x-ratelimit-remaining"), "0", "{name}");
    assert!(
        denied
            .header("ratelimit-policy")
            .starts_with("\"login\";q=3;w=60"),
        "{name}: {denied:?}"
    );
    assert!(
        denied.header("ratelimit").starts_with("\"login\";r=0;t="),
        "{name}"
    );
    assert!(
        denied
            .header("content-type")
            .starts_with("application/problem+json"),
        "{name}: {denied:?}"
    );
    let problem: serde_json::Value =
        serde_json::from_str(&denied.body).unwrap_or_else(|e| panic!("{name}: {e}: {denied:?}"));
    assert_eq!(problem["status"], 429, "{name}");
    assert_eq!(
        upstream.arrived("/login"),
        3,
        "{name}: a denied request reached the upstream"
    );

    // What a client says of itself changes nothing: not its address, not
    // the request the hook is told about.
    let spoofed = client
        .login(
            proxy.addr,
            &[
                ("x-forwarded-for", "198.51.100.77"),
                ("x-real-ip", "198.51.100.77"),
                ("x-forwarded-method", "GET"),
                ("x-forwarded-uri", "/public"),
                ("x-forwarded-host", "other.example.com"),
            ],
        )
        .await;
    assert_eq!(
        spoofed.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{name}: a client's own forwarding headers got it past the limit: {spoofed:?}"
    );
    assert_eq!(upstream.arrived("/login"), 3, "{name}");

    // Another client has its own count.
    let other = Clients::from("127.0.0.3").login(proxy.addr, &[]).await;
    assert_eq!(other.status, StatusCode::OK, "{name}: {other:?}");
    assert_eq!(upstream.arrived("/login"), 4, "{name}");
}

/// A shaping rule through `front`: the hook answers each request on its
/// turn, so the proxy forwards them at the rule's rate; past the queue, a
/// 429 at once. Only lower bounds on time are asserted: a slow machine
/// makes turns late, never early.
async fn shapes_through(front: Front) {
    let Some(rig) = Rig::start(front).await else {
        return;
    };
    let (upstream, proxy) = (&rig.upstream, &rig.proxy);
    let name = front.name();
    let client = std::sync::Arc::new(Clients::from("127.0.0.2"));
    let addr = proxy.addr;
    let t0 = Instant::now();
    let sent: Vec<_> = (0..4)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                let seen = client
                    .send(addr, Method::GET, "/exports/report.csv", &[])
                    .await;
                (seen.status, t0.elapsed())
            })
        })
        .collect();
    let mut answered = Vec::new();
    for s in sent {
        answered.push(s.await.expect("the request"));
    }
    let mut admitted: Vec<Duration> = answered
        .iter()
        .filter(|(s, _)| *s == StatusCode::OK)
        .map(|(_, t)| *t)
        .collect();
    admitted.sort();
    let denied = answered
        .iter()
        .filter(|(s, _)| *s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((admitted.len(), denied), (3, 1), "{name}: {answered:?}");
    for (k, at) in admitted.iter().enumerate() {
        let turn = Duration::from_millis(500) * k as u32;
        assert!(
            *at + Duration::from_millis(5) >= turn,
            "{name}: request {k} was answered at {at:?}, before its turn at {turn:?}"
        );
    }
    assert_eq!(upstream.arrived("/exports/report.csv"), 3, "{name}");
}

/// Two proxies, each with its own Spillway, on one Redis: one limit.
async fn shares_one_limit_through(front: Front) {
    let Some(binary) = binary_or_skip(front) else {
        return;
    };
    let Some(redis) = RedisServer::start() else {
        if std::env::var("SPILLWAY_REQUIRE_REDIS").as_deref() == Ok("1") {
            panic!("redis-server is not installed and SPILLWAY_REQUIRE_REDIS=1");
        }
        eprintln!("SKIPPED: redis-server is not installed");
        return;
    };
    let upstream = Upstream::start().await;
    let (a, b) = (
        Service::start(example_config(Some(&redis.url())), None).await,
        Service::start(example_config(Some(&redis.url())), None).await,
    );
    let one = FrontProxy::start(front, &binary, a.addr, upstream.addr).await;
    let two = FrontProxy::start(front, &binary, b.addr, upstream.addr).await;
    let name = front.name();
    let client = Clients::from("127.0.0.2");
    for proxy in [one.addr, two.addr, one.addr] {
        let admitted = client.login(proxy, &[]).await;
        assert_eq!(admitted.status, StatusCode::OK, "{name}: {admitted:?}");
    }
    for proxy in [two.addr, one.addr] {
        let denied = client.login(proxy, &[]).await;
        assert_eq!(
            denied.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{name}: the fourth login, through either proxy: {denied:?}"
        );
    }
    assert_eq!(upstream.arrived("/login"), 3, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_auth_request_limits_and_answers_429() {
    limits_through(Front::Nginx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_instances_on_one_redis_share_the_limit() {
    shares_one_limit_through(Front::Nginx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caddy_forward_auth_limits_and_answers_429() {
    limits_through(Front::Caddy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caddy_instances_on_one_redis_share_the_limit() {
    shares_one_limit_through(Front::Caddy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_lua_action_limits_and_answers_429() {
    limits_through(Front::Haproxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_instances_on_one_redis_share_the_limit() {
    shares_one_limit_through(Front::Haproxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traefik_forward_auth_limits_and_answers_429() {
    limits_through(Front::Traefik).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traefik_instances_on_one_redis_share_the_limit() {
    shares_one_limit_through(Front::Traefik).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_holds_a_shaped_request_until_its_turn() {
    shapes_through(Front::Nginx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caddy_holds_a_shaped_request_until_its_turn() {
    shapes_through(Front::Caddy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_holds_a_shaped_request_until_its_turn() {
    shapes_through(Front::Haproxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traefik_holds_a_shaped_request_until_its_turn() {
    shapes_through(Front::Traefik).await;
}

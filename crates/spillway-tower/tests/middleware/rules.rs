//! Rules: which requests they match (method, path glob, host), quotas per
//! tier, costs, and every matching rule decided in one store call.

use http::{HeaderName, Method, StatusCode};
use spillway_tower::{Clients, Cost, HttpRule, KeyPart, Policy, RateLimitLayer, RequestCost, Tier};

use crate::support::{
    CountingStore, admitted, app, applied_rules, body_json, bucket, header, header_u64,
    memory_layer, req, send,
};

#[tokio::test(start_paused = true)]
async fn a_rule_matches_only_its_methods() {
    let n = 1;
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "logins",
        bucket(n),
    )
    .methods([Method::POST])
    .path("/login")])));
    let post = |path: &'static str| move || req(path, "192.0.2.1").method(Method::POST);

    assert_eq!(admitted(&app, 5, || req("/login", "192.0.2.1")).await, 5);
    let res = send(&app, req("/login", "192.0.2.1")).await;
    assert!(applied_rules(&res).is_empty(), "a GET is not limited");
    assert_eq!(admitted(&app, 5, post("/login")).await, n as usize);
    assert_eq!(admitted(&app, 5, post("/logout")).await, 5);
}

#[tokio::test(start_paused = true)]
async fn path_globs_star_within_a_segment_double_star_across() {
    let app = app(memory_layer(Policy::new([
        HttpRule::new("items", bucket(100)).path("/api/*/items"),
        HttpRule::new("files", bucket(100)).path("/files/**"),
        HttpRule::new("json", bucket(100)).path("/data/*.json"),
    ])));
    let cases: [(&str, &[&str]); 10] = [
        ("/api/v1/items", &["items"]),
        ("/api/v2/items", &["items"]),
        ("/api/v1/x/items", &[]),
        ("/api/items", &[]),
        ("/files", &["files"]),
        ("/files/a", &["files"]),
        ("/files/a/b/c.txt", &["files"]),
        ("/filesystem", &[]),
        ("/data/report.json", &["json"]),
        ("/data/2024/report.json", &[]),
    ];
    for (path, expected) in cases {
        let res = send(&app, req(path, "192.0.2.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(applied_rules(&res), expected, "{path}");
    }
}

#[tokio::test(start_paused = true)]
async fn host_patterns_match_the_host_header_or_the_uri() {
    let app = app(memory_layer(Policy::new([
        HttpRule::new("api-host", bucket(100)).host("*.example.com"),
        HttpRule::new("any-depth", bucket(100)).host("**.example.org"),
    ])));
    let cases: [(&str, &[&str]); 6] = [
        ("api.example.com", &["api-host"]),
        ("API.Example.COM:8443", &["api-host"]),
        ("example.com", &[]),
        ("a.b.example.com", &[]),
        ("a.b.example.org", &["any-depth"]),
        ("api.example.net", &[]),
    ];
    for (host, expected) in cases {
        let res = send(&app, req("/", "192.0.2.1").header("host", host)).await;
        assert_eq!(applied_rules(&res), expected, "{host}");
    }
    // An absolute URI carries the host itself.
    let res = send(&app, req("http://www.example.com/x", "192.0.2.1")).await;
    assert_eq!(applied_rules(&res), ["api-host"]);
}

#[tokio::test(start_paused = true)]
async fn tiers_get_their_own_quota() {
    let (free, pro) = (2, 5);
    let policy = Policy::new([HttpRule::new("per-key", bucket(free))
        .key([KeyPart::ApiKey])
        .tier("pro", bucket(pro))])
    .api_key_tier("k-pro", "pro")
    .clients(Clients {
        trusted_proxies: vec!["10.0.0.0/8".parse().expect("a CIDR")],
        tier_header: Some(HeaderName::from_static("x-tier")),
        ..Clients::default()
    });
    let app = app(memory_layer(policy));
    let keyed =
        |peer: &'static str, key: &'static str| move || req("/", peer).header("x-api-key", key);
    let limit_of = |res: &http::Response<_>| header_u64(res, "x-ratelimit-limit");

    // From the API-key table.
    assert_eq!(
        limit_of(&send(&app, keyed("192.0.2.1", "k-pro")()).await),
        u64::from(pro)
    );
    assert_eq!(
        admitted(&app, 10, keyed("192.0.2.1", "k-pro")).await,
        pro as usize - 1
    );
    // An unknown key gets the default quota.
    assert_eq!(
        limit_of(&send(&app, keyed("192.0.2.1", "k-free")()).await),
        u64::from(free)
    );
    assert_eq!(
        admitted(&app, 10, keyed("192.0.2.1", "k-free")).await,
        free as usize - 1
    );
    // From a Tier extension set by an auth layer.
    let ext = || keyed("192.0.2.1", "k-ext")().extension(Tier("pro".into()));
    assert_eq!(admitted(&app, 10, ext).await, pro as usize);
    // From the tier header, only when a trusted proxy sent it.
    let trusted = || keyed("10.0.0.2", "k-hdr")().header("x-tier", "pro");
    assert_eq!(admitted(&app, 10, trusted).await, pro as usize);
    let untrusted = || keyed("192.0.2.1", "k-spoof")().header("x-tier", "pro");
    assert_eq!(admitted(&app, 10, untrusted).await, free as usize);
    // A tier the rule has no quota for is the default tier.
    let other = || keyed("192.0.2.1", "k-ent")().extension(Tier("enterprise".into()));
    assert_eq!(admitted(&app, 10, other).await, free as usize);
}

#[tokio::test(start_paused = true)]
async fn a_fixed_cost_per_rule() {
    let (capacity, cost) = (10, 3);
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "expensive",
        bucket(capacity),
    )
    .cost(Cost::Fixed(cost))])));
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(
        header_u64(&res, "x-ratelimit-remaining"),
        u64::from(capacity) - cost
    );
    let total = 1 + admitted(&app, 10, || req("/", "192.0.2.1")).await;
    assert_eq!(total as u64, u64::from(capacity) / cost);
}

#[tokio::test(start_paused = true)]
async fn a_cost_from_a_trusted_header_or_the_request_cost_extension() {
    let capacity = 10u64;
    let policy =
        Policy::new([
            HttpRule::new("weighted", bucket(capacity as u32)).cost(Cost::Header {
                name: HeaderName::from_static("x-cost"),
                default: 1,
            }),
        ])
        .clients(Clients {
            trusted_proxies: vec!["10.0.0.0/8".parse().expect("a CIDR")],
            ..Clients::default()
        });
    let app = app(memory_layer(policy));
    let remaining = |res: &http::Response<_>| header_u64(res, "x-ratelimit-remaining");

    let res = send(&app, req("/", "10.0.0.2").header("x-cost", "4")).await;
    assert_eq!(remaining(&res), capacity - 4);
    // An untrusted client cannot set its own cost: the default applies.
    let res = send(&app, req("/", "192.0.2.1").header("x-cost", "0")).await;
    assert_eq!(remaining(&res), capacity - 1);
    // The extension, from any peer, wins over the header.
    let res = send(
        &app,
        req("/", "192.0.2.2")
            .header("x-cost", "1")
            .extension(RequestCost(5)),
    )
    .await;
    assert_eq!(remaining(&res), capacity - 5);

    // A trusted header that is not a cost is the client's error.
    for bad in ["abc", "-1", "1.5", ""] {
        let res = send(&app, req("/", "10.0.0.3").header("x-cost", bad)).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(
            header(&res, "content-type").as_deref(),
            Some("application/problem+json")
        );
        let body = body_json(res).await;
        assert_eq!(body["status"], 400);
        assert!(
            body["detail"]
                .as_str()
                .expect("a detail")
                .contains("x-cost")
        );
    }
    // Nothing was charged for them.
    let res = send(&app, req("/", "10.0.0.3")).await;
    assert_eq!(remaining(&res), capacity - 1);
    // The same header from an untrusted peer is not read at all.
    let res = send(&app, req("/", "192.0.2.3").header("x-cost", "abc")).await;
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_cost_above_the_capacity_is_a_400_and_charges_nothing() {
    let capacity = 10u64;
    let policy = Policy::new([
        HttpRule::new("per-ip", bucket(capacity as u32)),
        HttpRule::new("too-big", bucket(capacity as u32))
            .path("/big")
            .cost(Cost::Fixed(capacity + 1)),
    ]);
    let app = app(memory_layer(policy));

    let res = send(
        &app,
        req("/", "192.0.2.1").extension(RequestCost(capacity + 1)),
    )
    .await;
    // The extension only applies to header-cost rules; per-ip charges 1.
    assert_eq!(res.status(), StatusCode::OK);
    let res = send(&app, req("/big", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        header(&res, "content-type").as_deref(),
        Some("application/problem+json")
    );
    let body = body_json(res).await;
    assert_eq!(body["status"], 400);
    assert!(
        body["detail"]
            .as_str()
            .expect("a detail")
            .contains("too-big")
    );
    // per-ip was not charged for the 400: one request so far, and this one.
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(header_u64(&res, "x-ratelimit-remaining"), capacity - 2);
}

#[tokio::test(start_paused = true)]
async fn a_header_cost_above_the_capacity_is_a_400() {
    let capacity = 4u64;
    let policy =
        Policy::new([
            HttpRule::new("weighted", bucket(capacity as u32)).cost(Cost::Header {
                name: HeaderName::from_static("x-cost"),
                default: 1,
            }),
        ]);
    let app = app(memory_layer(policy));
    let res = send(
        &app,
        req("/", "192.0.2.1").extension(RequestCost(capacity + 1)),
    )
    .await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(body_json(res).await["status"], 400);
    let res = send(&app, req("/", "192.0.2.1").extension(RequestCost(capacity))).await;
    assert_eq!(res.status(), StatusCode::OK, "the full capacity fits");
    assert_eq!(header_u64(&res, "x-ratelimit-remaining"), 0);
}

#[tokio::test(start_paused = true)]
async fn all_matching_rules_are_checked_in_one_store_call() {
    let (a, b, c) = (10u32, 5u32, 3u32);
    let policy = Policy::new([
        HttpRule::new("a", bucket(a)),
        HttpRule::new("b", bucket(b)).key([KeyPart::ApiKey]),
        HttpRule::new("c", bucket(c)).path("/users/*"),
        HttpRule::new("d", bucket(1)).path("/nowhere"),
    ]);
    let store = CountingStore::new(policy.store_rules());
    let layer = RateLimitLayer::new(policy, store).expect("same rules");
    let app = app(layer.clone());
    let user = || req("/users/1", "192.0.2.1").header("x-api-key", "k1");

    for _ in 0..c {
        assert_eq!(send(&app, user()).await.status(), StatusCode::OK);
        let calls = layer.store().take_calls();
        assert_eq!(calls.len(), 1, "one call per request");
        let rules: Vec<usize> = calls[0].iter().map(|(rule, _, _)| *rule).collect();
        assert_eq!(rules, [0, 1, 2], "every matching rule, and only those");
    }
    // c denies: still one call, and a and b are not charged for it.
    assert_eq!(
        send(&app, user()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(layer.store().take_calls().len(), 1);
    let res = send(&app, req("/", "192.0.2.1").header("x-api-key", "k1")).await;
    assert_eq!(layer.store().take_calls()[0].len(), 2);
    // The most restrictive of a and b is b: c requests and this one.
    assert_eq!(header_u64(&res, "x-ratelimit-limit"), u64::from(b));
    assert_eq!(
        header_u64(&res, "x-ratelimit-remaining"),
        u64::from(b - c - 1)
    );
}

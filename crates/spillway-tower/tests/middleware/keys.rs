//! Keys: API key, client IP (and when forwarded headers are believed), user
//! id, route template, headers, composites, fallbacks and long keys.

use std::convert::Infallible;

use bytes::Bytes;
use http::{HeaderName, Method, Request, Response, StatusCode};
use http_body_util::Full;
use spillway_tower::key::MAX_KEY_LEN;
use spillway_tower::{
    ClientAddr, Clients, Credential, ForwardedHeader, HttpRule, Ipv6Prefix, KeyPart, Policy,
    RateLimitLayer, UserId,
};
use tower::{Layer, ServiceExt};

use crate::support::{CountingStore, admitted, app, bucket, header, memory_layer, req, send, sock};

fn trusting_10_8() -> Clients {
    Clients {
        trusted_proxies: vec!["10.0.0.0/8".parse().expect("a CIDR")],
        ..Clients::default()
    }
}

#[tokio::test(start_paused = true)]
async fn api_key_from_the_configured_header_or_a_bearer_token() {
    let n = 2;
    let policy = Policy::new([HttpRule::new("per-key", bucket(n)).key([KeyPart::ApiKey])]).clients(
        Clients {
            api_key: vec![
                Credential::Header(HeaderName::from_static("x-key")),
                Credential::bearer(),
            ],
            ..Clients::default()
        },
    );
    let app = app(memory_layer(policy));
    let with = |ip: &'static str, name: &'static str, value: &'static str| {
        move || req("/", ip).header(name, value)
    };

    assert_eq!(
        admitted(&app, 10, with("192.0.2.1", "x-key", "alpha")).await,
        n as usize
    );
    // The same key as a bearer token, from another address: the same bucket.
    let res = send(&app, with("192.0.2.2", "authorization", "Bearer alpha")()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    // Another key has its own.
    assert_eq!(
        admitted(&app, 10, with("192.0.2.1", "authorization", "bearer beta")).await,
        n as usize
    );
    // Basic credentials are not an API key: the client falls back to its IP.
    let res = send(&app, with("192.0.2.1", "authorization", "Basic alpha")()).await;
    assert_eq!(res.status(), StatusCode::OK);
}

/// The review's bypass: a rule keyed by the API key read a junk
/// `X-Api-Key` sent beside the real `Authorization: Bearer`, so each
/// request had a fresh key while the upstream authenticated the real one.
/// Keyed by the one place the upstream reads, the junk changes nothing; a
/// key sent twice, or present but unreadable, is a 400, even for a rule
/// that skips requests without one (`fallback = []`).
#[tokio::test(start_paused = true)]
async fn the_key_is_the_credential_the_upstream_reads_and_is_never_guessed() {
    let n = 2;
    let rule = HttpRule::new("per-key", bucket(n))
        .key([KeyPart::ApiKey])
        .fallback([]);
    let policy = Policy::new([rule]).clients(Clients {
        api_key: vec![Credential::bearer()],
        ..Clients::default()
    });
    let app = app(memory_layer(policy));
    let junk = std::cell::Cell::new(0);
    let with_junk = || {
        junk.set(junk.get() + 1);
        req("/", "192.0.2.1")
            .header("x-api-key", format!("junk-{}", junk.get()))
            .header("authorization", "Bearer\tREALKEY123")
    };
    assert_eq!(admitted(&app, 5, with_junk).await, n as usize);
    for refused in [
        vec![("authorization", "Bearer A"), ("authorization", "Bearer B")],
        vec![("authorization", "Bearer REALKEY123 junk")],
    ] {
        let mut request = req("/", "192.0.2.1");
        for (name, value) in &refused {
            request = request.header(*name, *value);
        }
        let res = send(&app, request).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{refused:?}");
    }
    // Without any bearer token the rule does not apply (fallback = []),
    // and `Bearer` alone carries none.
    let res = send(&app, req("/", "192.0.2.1").header("x-api-key", "k")).await;
    assert_eq!(res.status(), StatusCode::OK);
    let res = send(
        &app,
        req("/", "192.0.2.1").header("authorization", "Bearer"),
    )
    .await;
    assert_eq!(res.status(), StatusCode::OK);
}

/// A key put in a stricter tier than the default cannot escape it by
/// being sent twice (Go's `Header.Get` authenticates the first line): a
/// rule with tiers refuses the request rather than apply the default.
#[tokio::test(start_paused = true)]
async fn a_tiered_key_sent_twice_is_refused_not_given_the_default_tier() {
    let rule = HttpRule::new("per-ip", bucket(100))
        .key([KeyPart::Ip])
        .tier("suspended", bucket(1));
    let policy = Policy::new([rule]).api_key_tier("k-bad", "suspended");
    let app = app(memory_layer(policy));
    let once = || req("/", "192.0.2.1").header("x-api-key", "k-bad");
    assert_eq!(admitted(&app, 5, once).await, 1);
    let twice = req("/", "192.0.2.2")
        .header("x-api-key", "k-bad")
        .header("x-api-key", "k-other");
    let res = send(&app, twice).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test(start_paused = true)]
async fn client_ip_comes_from_the_socket() {
    let n = 3;
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "per-ip",
        bucket(n),
    )])));
    assert_eq!(
        admitted(&app, 10, || req("/", "192.0.2.1")).await,
        n as usize
    );
    assert_eq!(
        admitted(&app, 10, || req("/", "192.0.2.2")).await,
        n as usize
    );
    assert_eq!(
        admitted(&app, 10, || req("/", "2001:db8::1")).await,
        n as usize
    );
}

#[tokio::test(start_paused = true)]
async fn an_ipv6_client_rotating_addresses_in_its_64_is_one_client() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let n = 3;
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "per-ip",
        bucket(n),
    )])));
    // One host owns 2001:db8:1:2::/64, 2^64 addresses: a new one for
    // every request is still one client.
    let i = AtomicU32::new(1);
    let rotating = || {
        let i = i.fetch_add(1, Ordering::Relaxed);
        req("/", &format!("2001:db8:1:2:{i:x}::{i:x}"))
    };
    assert_eq!(admitted(&app, 20, rotating).await, n as usize);
    // Behind a trusted proxy too.
    let via_proxy = || {
        let i = i.fetch_add(1, Ordering::Relaxed);
        req("/", "10.0.0.2").header("x-forwarded-for", format!("2001:db8:1:2::{i:x}"))
    };
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]).clients(trusting_10_8());
    let proxied = app_with(policy);
    assert_eq!(admitted(&proxied, 20, via_proxy).await, n as usize);
    // The next /64 is another client; with the whole address kept, each
    // address is.
    assert_eq!(
        admitted(&app, 20, || req("/", "2001:db8:1:3::1")).await,
        n as usize
    );
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]).clients(Clients {
        ipv6_prefix: Ipv6Prefix::FULL,
        ..Clients::default()
    });
    let full = app_with(policy);
    assert_eq!(
        admitted(&full, 20, || req("/", "2001:db8:1:2::1")).await,
        n as usize
    );
    assert_eq!(
        admitted(&full, 20, || req("/", "2001:db8:1:2::2")).await,
        n as usize
    );
}

fn app_with(policy: Policy) -> axum::Router {
    app(memory_layer(policy))
}

#[tokio::test(start_paused = true)]
async fn forwarded_headers_from_an_untrusted_peer_are_ignored() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let n = 3;
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]).clients(trusting_10_8());
    let app = app(memory_layer(policy));

    // A client that makes up a new X-Forwarded-For (or Forwarded) for every
    // request is still one client: the socket's.
    let i = AtomicU32::new(0);
    let rotating_xff = || {
        let i = i.fetch_add(1, Ordering::Relaxed);
        req("/", "203.0.113.9").header("x-forwarded-for", format!("198.51.100.{i}"))
    };
    assert_eq!(admitted(&app, 20, rotating_xff).await, n as usize);
    let rotating_forwarded = || {
        let i = i.fetch_add(1, Ordering::Relaxed);
        req("/", "203.0.113.9").header("forwarded", format!("for=198.51.100.{i}"))
    };
    assert_eq!(admitted(&app, 20, rotating_forwarded).await, 0);
    // And the addresses it named were never charged.
    assert_eq!(
        admitted(&app, 20, || req("/", "198.51.100.0")).await,
        n as usize
    );
}

#[tokio::test(start_paused = true)]
async fn behind_a_trusted_proxy_the_right_most_untrusted_hop_is_the_client() {
    let n = 2;
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]).clients(trusting_10_8());
    let app = app(memory_layer(policy));
    let via = |peer: &'static str, xff: &'static str| {
        move || req("/", peer).header("x-forwarded-for", xff)
    };

    // 198.51.100.7 reached our proxy 10.1.1.1, which passed it to 10.0.0.2;
    // "6.6.6.6" was written by the client itself.
    assert_eq!(
        admitted(&app, 10, via("10.0.0.2", "6.6.6.6, 198.51.100.7, 10.1.1.1")).await,
        n as usize
    );
    // The same client through another proxy, with another made-up hop.
    assert_eq!(
        send(&app, via("10.0.0.3", "7.7.7.7, 198.51.100.7")())
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // The same address connecting directly.
    assert_eq!(
        send(&app, req("/", "198.51.100.7")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // A malformed hop written by the client, left of the real address,
    // changes nothing: the right-most untrusted hop is still well-formed
    // (and the proxy, whose own bucket is still full, is not the client).
    let res = send(&app, via("10.0.0.2", "not-an-ip, 198.51.100.7")()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    // Neither the made-up hop nor the proxies were charged.
    assert_eq!(admitted(&app, 10, || req("/", "6.6.6.6")).await, n as usize);
    assert_eq!(
        admitted(&app, 10, || req("/", "10.0.0.2")).await,
        n as usize
    );
    assert_eq!(
        admitted(&app, 10, || req("/", "10.1.1.1")).await,
        n as usize
    );

    // Forwarded (RFC 7239), with an IPv6 node and port, from proxies that
    // write that header.
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]).clients(Clients {
        forwarded_header: ForwardedHeader::Forwarded,
        ..trusting_10_8()
    });
    let app = crate::support::app(memory_layer(policy));
    let forwarded = || {
        req("/", "10.0.0.2").header(
            "forwarded",
            r#"for=192.0.2.60;proto=https, for="[2001:db8::7]:4711""#,
        )
    };
    assert_eq!(admitted(&app, 10, forwarded).await, n as usize);
    assert_eq!(
        send(&app, req("/", "2001:db8::7")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(start_paused = true)]
async fn a_trusted_proxy_on_a_dual_stack_listener_is_trusted() {
    // Behind `[::]`, the proxy 10.0.0.2 connecting over IPv4 is the peer
    // `::ffff:10.0.0.2`. It is still trusted: each client behind it has its
    // own bucket, and none is the proxy's.
    let n = 2;
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]).clients(trusting_10_8());
    let app = app(memory_layer(policy));
    let via =
        |xff: &'static str| move || req("/", "::ffff:10.0.0.2").header("x-forwarded-for", xff);
    assert_eq!(admitted(&app, 10, via("198.51.100.7")).await, n as usize);
    assert_eq!(admitted(&app, 10, via("198.51.100.8")).await, n as usize);
    // A mapped client is the IPv4 client, however it is written.
    assert_eq!(admitted(&app, 10, via("::ffff:198.51.100.7")).await, 0);
    assert_eq!(
        admitted(&app, 10, || req("/", "::ffff:198.51.100.8")).await,
        0
    );
    assert_eq!(
        admitted(&app, 10, || req("/", "10.0.0.2")).await,
        n as usize
    );
}

#[tokio::test(start_paused = true)]
async fn a_bad_byte_in_a_forwarded_chain_does_not_share_a_bucket_with_other_clients() {
    use http::HeaderValue;
    let n = 2;
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]).clients(trusting_10_8());
    let app = app(memory_layer(policy));
    // Each client wrote something unreadable itself; our proxy appended its
    // real address. Once, the whole line was unreadable and every such
    // client was the proxy: one of them exhausted the bucket of all.
    let via = |xff: &'static [u8]| {
        move || {
            req("/", "10.0.0.2").header(
                "x-forwarded-for",
                HeaderValue::from_bytes(xff).expect("a value"),
            )
        }
    };
    assert_eq!(
        admitted(&app, 10, via(b"caf\xc3\xa9, 198.51.100.7")).await,
        n as usize
    );
    assert_eq!(
        admitted(&app, 10, via(b"\xff, 198.51.100.8")).await,
        n as usize
    );
    // Each was counted as itself.
    assert_eq!(admitted(&app, 10, || req("/", "198.51.100.7")).await, 0);
    // What a proxy writes when it does not know the client is that proxy's
    // word, counted apart from its other clients and from other proxies.
    let unknown = |proxy: &'static str| {
        move || req("/", "10.0.0.2").header("x-forwarded-for", format!("unknown, {proxy}"))
    };
    assert_eq!(admitted(&app, 10, unknown("10.1.1.1")).await, n as usize);
    assert_eq!(admitted(&app, 10, unknown("10.1.1.2")).await, n as usize);
    assert_eq!(admitted(&app, 10, via(b"198.51.100.9")).await, n as usize);
    // And none of it was charged to the proxy's own address.
    assert_eq!(
        admitted(&app, 10, || req("/", "10.0.0.2")).await,
        n as usize
    );
}

#[tokio::test(start_paused = true)]
async fn a_forwarded_header_the_proxies_do_not_write_is_ignored() {
    // The proxies append to X-Forwarded-For; a client that adds its own
    // Forwarded header to pick a fresh key each time is still limited.
    let n = 2;
    let policy = Policy::new([HttpRule::new("per-ip", bucket(n))]).clients(trusting_10_8());
    let app = app(memory_layer(policy));
    let mut admitted_count = 0;
    for i in 0..10 {
        let res = send(
            &app,
            req("/", "10.0.0.2")
                .header("forwarded", format!("for=203.0.113.{i}"))
                .header("x-forwarded-for", "198.51.100.7"),
        )
        .await;
        admitted_count += usize::from(res.status() == StatusCode::OK);
    }
    assert_eq!(admitted_count, n as usize);
}

#[tokio::test(start_paused = true)]
async fn user_id_from_the_extension_or_a_trusted_header() {
    let n = 2;
    let policy =
        Policy::new([HttpRule::new("per-user", bucket(n)).key([KeyPart::User])]).clients(Clients {
            user_header: Some(HeaderName::from_static("x-user")),
            ..trusting_10_8()
        });
    let app = app(memory_layer(policy));
    let named =
        |peer: &'static str, user: &'static str| move || req("/", peer).header("x-user", user);

    assert_eq!(
        admitted(&app, 10, named("10.0.0.2", "alice")).await,
        n as usize
    );
    // The extension an auth layer sets names the same user, whatever the peer.
    let res = send(
        &app,
        req("/", "192.0.2.7").extension(UserId("alice".into())),
    )
    .await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    // Another user has their own bucket.
    assert_eq!(
        admitted(&app, 10, named("10.0.0.2", "bob")).await,
        n as usize
    );
    // From an untrusted peer the header is not believed: the client is
    // counted by its IP (the default fallback), however it names itself.
    assert_eq!(
        admitted(&app, 10, named("192.0.2.8", "carol")).await,
        n as usize
    );
    assert_eq!(
        send(&app, named("192.0.2.8", "dave")()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // ... and a user it names is not charged.
    assert_eq!(
        admitted(&app, 10, named("10.0.0.2", "carol")).await,
        n as usize
    );
}

#[tokio::test(start_paused = true)]
async fn route_is_the_method_and_the_matched_template() {
    let n = 2;
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "per-route",
        bucket(n),
    )
    .key([KeyPart::Route])])));

    // Two ids, two clients: one route.
    assert_eq!(
        send(&app, req("/users/1", "192.0.2.1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, req("/users/2", "192.0.2.2")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, req("/users/3", "192.0.2.3")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another method or another template is another endpoint.
    let post = || req("/users/1", "192.0.2.1").method(Method::POST);
    assert_eq!(admitted(&app, 10, post).await, n as usize);
    assert_eq!(
        admitted(&app, 10, || req("/orgs/1/users/1", "192.0.2.1")).await,
        n as usize
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_matched_path_the_route_is_the_path() {
    let n = 1;
    let layer = memory_layer(Policy::new([
        HttpRule::new("per-route", bucket(n)).key([KeyPart::Route])
    ]));
    let service = layer.layer(tower::service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let status = |path: &str| {
        let mut r = Request::get(path)
            .body(Full::new(Bytes::new()))
            .expect("a request");
        r.extensions_mut().insert(ClientAddr(sock("192.0.2.1")));
        let service = service.clone();
        async move { service.oneshot(r).await.expect("infallible").status() }
    };
    assert_eq!(status("/users/1").await, StatusCode::OK);
    assert_eq!(status("/users/1").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status("/users/2").await, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn any_header_can_be_a_key() {
    let n = 2;
    let tenant = HeaderName::from_static("x-tenant");
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "per-tenant",
        bucket(n),
    )
    .key([KeyPart::Header(tenant)])])));
    let of = |peer: &'static str, t: &'static str| move || req("/", peer).header("x-tenant", t);

    assert_eq!(
        send(&app, of("192.0.2.1", "acme")()).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, of("192.0.2.2", "acme")()).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, of("192.0.2.3", "acme")()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        admitted(&app, 10, of("192.0.2.1", "globex")).await,
        n as usize
    );
    // No header: the client's IP.
    assert_eq!(
        admitted(&app, 10, || req("/", "192.0.2.1")).await,
        n as usize
    );
}

#[tokio::test(start_paused = true)]
async fn composite_keys_count_each_combination() {
    let n = 1;
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "per-key-route",
        bucket(n),
    )
    .key([KeyPart::ApiKey, KeyPart::Route])])));
    let call = |path: &'static str, key: &'static str| {
        move || req(path, "192.0.2.1").header("x-api-key", key)
    };

    assert_eq!(admitted(&app, 10, call("/users/1", "k1")).await, n as usize);
    // Same key, same template: the same combination.
    assert_eq!(
        send(&app, call("/users/2", "k1")()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another key on the route, or the key on another route.
    assert_eq!(
        send(&app, call("/users/1", "k2")()).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, call("/orgs/1/users/1", "k1")()).await.status(),
        StatusCode::OK
    );
}

#[tokio::test(start_paused = true)]
async fn a_missing_api_key_falls_back_to_the_ip_never_to_a_shared_key() {
    let n = 2;
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "per-key",
        bucket(n),
    )
    .key([KeyPart::ApiKey])])));
    // Two clients without a key do not share a bucket.
    assert_eq!(
        admitted(&app, 10, || req("/", "192.0.2.1")).await,
        n as usize
    );
    assert_eq!(
        admitted(&app, 10, || req("/", "192.0.2.2")).await,
        n as usize
    );
    // A client with a key is counted by the key, not its IP.
    let keyed = || req("/", "192.0.2.1").header("x-api-key", "k1");
    assert_eq!(admitted(&app, 10, keyed).await, n as usize);
}

#[tokio::test(start_paused = true)]
async fn an_empty_fallback_means_the_rule_does_not_apply() {
    let n = 1;
    let app = app(memory_layer(Policy::new([HttpRule::new(
        "per-key",
        bucket(n),
    )
    .key([KeyPart::ApiKey])
    .fallback([])])));
    let max = 5;
    assert_eq!(admitted(&app, max, || req("/", "192.0.2.1")).await, max);
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(header(&res, "x-ratelimit-limit"), None, "no rule applied");
    let keyed = || req("/", "192.0.2.1").header("x-api-key", "k1");
    assert_eq!(admitted(&app, max, keyed).await, n as usize);
}

#[tokio::test(start_paused = true)]
async fn very_long_keys_are_hashed_and_still_limited() {
    let n = 1;
    let policy = Policy::new([HttpRule::new("per-key", bucket(n)).key([KeyPart::ApiKey])]);
    let store = CountingStore::new(policy.store_rules());
    let layer = RateLimitLayer::new(policy, store).expect("same rules");
    let app = app(layer.clone());

    // Two keys that differ only after the first 10 000 bytes.
    let long = "k".repeat(10_000);
    let (one, two) = (format!("{long}1"), format!("{long}2"));
    let with = |key: &str| {
        let key = key.to_string();
        move || req("/", "192.0.2.1").header("x-api-key", key.clone())
    };
    assert_eq!(admitted(&app, 10, with(&one)).await, n as usize);
    assert_eq!(admitted(&app, 10, with(&two)).await, n as usize);

    let keys: Vec<String> = layer
        .store()
        .take_calls()
        .into_iter()
        .flatten()
        .map(|(_, key, _)| key)
        .collect();
    assert_eq!(keys.len(), 2 * (n as usize + 1));
    assert!(
        keys.iter().all(|k| k.len() <= MAX_KEY_LEN),
        "bounded: {keys:?}"
    );
    assert_ne!(keys[0], keys[keys.len() - 1], "distinct keys stay distinct");
}

/// A key put in a stricter tier at run time (the store's tier
/// book) cannot escape it by being sent twice or in two places, nor can
/// one the tier table names; and a rule that counts by the key refuses a
/// key sent twice even where nothing has tiers.
#[tokio::test(start_paused = true)]
async fn a_runtime_tiered_key_sent_twice_or_in_two_places_is_refused() {
    use spillway::store::{Store, TierEntry};
    let rule = HttpRule::new("per-ip", bucket(100))
        .key([KeyPart::Ip])
        .tier("suspended", bucket(1));
    let layer = memory_layer(Policy::new([rule]));
    layer.store().tiers().unwrap().set(
        "k-bad",
        TierEntry {
            tier: "suspended".into(),
            until: None,
            spec: "{}".into(),
        },
    );
    let svc = app(layer);
    let once = || req("/", "192.0.2.1").header("x-api-key", "k-bad");
    assert_eq!(admitted(&svc, 5, once).await, 1, "control: the tier holds");
    for (what, extra) in [
        ("twice", ("x-api-key", "k-bad")),
        ("beside another", ("x-api-key", "k-other")),
        ("and a bearer", ("authorization", "Bearer k-other")),
    ] {
        let res = send(
            &svc,
            req("/", "192.0.2.9")
                .header("x-api-key", "k-bad")
                .header(extra.0, extra.1),
        )
        .await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{what}");
    }
    // Two keys sent to a layer with only `rule`.
    let two_keys = |rule: HttpRule| async move {
        let svc = app(memory_layer(Policy::new([rule])));
        let two = req("/", "192.0.2.9")
            .header("x-api-key", "a")
            .header("x-api-key", "b");
        send(&svc, two).await.status()
    };
    // No tiers anywhere, a rule keyed by the API key: refused too.
    let by_key = HttpRule::new("per-key", bucket(100)).key([KeyPart::ApiKey]);
    assert_eq!(
        two_keys(by_key).await,
        StatusCode::BAD_REQUEST,
        "keyed by the API key"
    );
    // Neither tiers nor a rule by key nor lists: the key is not read.
    let by_ip = HttpRule::new("per-ip", bucket(100));
    assert_eq!(
        two_keys(by_ip).await,
        StatusCode::OK,
        "nothing reads the key"
    );
}

//! Block and allow lists in the middleware: the ways a client might try
//! past an entry (its key sent twice, another spelling, leaving out what
//! a rule counts by, an IPv6 host inside a counted network).

use http::StatusCode;
use spillway::store::{ListEntry, Listed, Store};
use spillway_tower::key::Credential;
use spillway_tower::{Clients, HttpRule, KeyPart, Policy};

use crate::support::{bucket, hello, memory_layer, req, send};

fn block(rule: Option<&str>) -> ListEntry {
    ListEntry {
        allow: false,
        rule: rule.map(Into::into),
        status: 403,
        until: None,
        spec: "{}".into(),
    }
}
fn allow() -> ListEntry {
    ListEntry {
        allow: true,
        rule: None,
        status: 403,
        until: None,
        spec: "{}".into(),
    }
}
fn net(s: &str, len: u8) -> Listed {
    Listed::network(s.parse().unwrap(), len).unwrap()
}

/// A blocked API key sent twice, or beside another key, cannot be read as
/// one key: refused (400) while the lists name API keys, even where no
/// rule counts by the API key.
#[tokio::test(start_paused = true)]
async fn a_blocked_api_key_sent_twice_is_refused() {
    let layer = memory_layer(Policy::new([HttpRule::new("per-ip", bucket(100))]));
    let lists = layer.store().lists().unwrap();
    lists.set(Listed::ApiKey("bad".into()), block(None));
    let app = hello(layer);
    let once = send(&app, req("/", "192.0.2.1").header("x-api-key", "bad")).await;
    assert_eq!(once.status(), StatusCode::FORBIDDEN, "control");
    let twice = send(
        &app,
        req("/", "192.0.2.1")
            .header("x-api-key", "bad")
            .header("x-api-key", "bad"),
    )
    .await;
    let beside = send(
        &app,
        req("/", "192.0.2.1")
            .header("x-api-key", "bad")
            .header("authorization", "Bearer other"),
    )
    .await;
    let two_words = send(
        &app,
        req("/", "192.0.2.1").header("authorization", "Bearer bad x"),
    )
    .await;
    assert_eq!(
        (twice.status(), beside.status(), two_words.status()),
        (
            StatusCode::BAD_REQUEST,
            StatusCode::BAD_REQUEST,
            StatusCode::BAD_REQUEST
        ),
        "the blocked key reached the upstream"
    );
}

/// With the default `ipv6_prefix` (64) a client is counted by its /64,
/// but looked up in the lists by its own address: a /128 block of a host
/// holds for it, and an allow of another host of its /64 does not.
#[tokio::test(start_paused = true)]
async fn an_ipv6_host_is_looked_up_by_its_address_not_its_counted_network() {
    let layer = memory_layer(Policy::new([HttpRule::new("per-ip", bucket(1))]));
    let lists = layer.store().lists().unwrap();
    lists.set(net("2001:db8:1::7", 128), block(None));
    lists.set(net("2001:db8:2::", 128), allow());
    let app = hello(layer);
    let blocked_host = send(&app, req("/", "2001:db8:1::7")).await.status();
    // Another host of the allowed address's /64: should be counted (1 a
    // bucket), so its second request is a 429.
    send(&app, req("/", "2001:db8:2::beef")).await;
    let other_host = send(&app, req("/", "2001:db8:2::beef")).await.status();
    assert_eq!(
        (blocked_host, other_host),
        (StatusCode::FORBIDDEN, StatusCode::TOO_MANY_REQUESTS)
    );
}

/// A block of an address for one rule holds when the request leaves out
/// the part the rule counts by (here the API key; the rule has no
/// fallback): the rule matched the path and the client is the blocked one.
#[tokio::test(start_paused = true)]
async fn a_rules_address_block_holds_without_what_the_rule_counts_by() {
    let rule = HttpRule::new("per-key", bucket(100))
        .key([KeyPart::ApiKey])
        .fallback([]);
    let layer = memory_layer(Policy::new([rule]));
    let lists = layer.store().lists().unwrap();
    lists.set(net("192.0.2.0", 24), block(Some("per-key")));
    let app = hello(layer);
    let with_key = send(&app, req("/", "192.0.2.1").header("x-api-key", "k"))
        .await
        .status();
    let without = send(&app, req("/", "192.0.2.1")).await.status();
    assert_eq!(
        (with_key, without),
        (StatusCode::FORBIDDEN, StatusCode::FORBIDDEN)
    );
}

/// A key with `+ / =` blocked under its spellings is found when it comes
/// in `Authorization: Basic` (whose canonical form keeps letters and
/// digits only).
#[tokio::test(start_paused = true)]
async fn a_blocked_key_is_found_in_a_basic_credential() {
    let clients = Clients {
        api_key: vec![Credential::parse("authorization:basic").unwrap()],
        ..Clients::default()
    };
    let policy = Policy::new([HttpRule::new("per-ip", bucket(100))]).clients(clients);
    let layer = memory_layer(policy);
    let lists = layer.store().lists().unwrap();
    for spelling in spillway_tower::key::api_key_spellings("dXNlcjpw+/8=") {
        lists.set(Listed::ApiKey(spelling.into()), block(None));
    }
    let app = hello(layer);
    let res = send(
        &app,
        req("/", "192.0.2.1").header("authorization", "Basic dXNlcjpw+/8="),
    )
    .await;
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
}

/// A rule's key longer than 200 bytes is kept as its hash: a key named
/// before the hash is refused (it could never match).
#[tokio::test(start_paused = true)]
async fn a_key_longer_than_requests_keys_is_refused() {
    let rule = HttpRule::new("per-key", bucket(100)).key([KeyPart::ApiKey]);
    let layer = memory_layer(Policy::new([rule]));
    let long = "k".repeat(250);
    let refused = layer
        .engine()
        .key_error("per-key", &format!("api_key={long}"));
    assert!(refused.is_some_and(|m| m.contains("sha256")));
}

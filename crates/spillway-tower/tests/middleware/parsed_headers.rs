//! The request headers the engine reads for keys and costs are untrusted
//! bytes (issue 17, item 8): `X-Forwarded-For`, `Forwarded`, the API key
//! header, `Authorization: Bearer`, the tier and user headers, any header
//! a key names, and a cost header. Over arbitrary values, and chains
//! mutated from valid ones, `Engine::plan` never panics and answers within
//! a bound; a key never exceeds `MAX_KEY_LEN` nor holds more pairs than
//! its parts; an untrusted peer's forwarded headers never change its key;
//! a valid chain names its right-most untrusted address; a cost header
//! that is not a count, and a key part sent twice or unreadable, is a 400
//! that names it.

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::LazyLock;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Request};
use proptest::prelude::*;
use spillway::Quota;
use spillway::algorithm::TokenBucket;
use spillway::clock::FakeClock;
use spillway::store::{MemoryOptions, MemoryStore};
use spillway_conformance::hostile::{apply, config, mutation, within};
use spillway_tower::engine::Unplanned;
use spillway_tower::key::MAX_KEY_LEN;
use spillway_tower::{
    ClientAddr, Clients, Cost, Engine, ForwardedHeader, HttpRule, KeyPart, MissingClientAddr,
    Policy,
};

/// The most one plan may take: well under a millisecond.
const BOUND: Duration = Duration::from_secs(10);

/// The headers these rules read.
const NAMES: &[&str] = &[
    "x-forwarded-for",
    "forwarded",
    "x-api-key",
    "authorization",
    "x-tier",
    "x-user",
    "x-tenant",
    "x-cost",
];

/// One engine per header the proxies write, built once: a memory store
/// takes a while to build.
static ENGINES: LazyLock<[Engine<MemoryStore<FakeClock>>; 2]> = LazyLock::new(|| {
    [
        engine(ForwardedHeader::XForwardedFor),
        engine(ForwardedHeader::Forwarded),
    ]
});

fn engine(forwarded: ForwardedHeader) -> Engine<MemoryStore<FakeClock>> {
    let bucket = || {
        TokenBucket::new(
            Quota::per_minute(NonZeroU32::new(1000).expect("nonzero")),
            NonZeroU32::new(1000).expect("nonzero"),
        )
    };
    let policy = Policy::new([
        HttpRule::new("by-ip", bucket()).key([KeyPart::Ip]),
        HttpRule::new("by-everything", bucket())
            .key([
                KeyPart::Ip,
                KeyPart::ApiKey,
                KeyPart::User,
                KeyPart::Header(HeaderName::from_static("x-tenant")),
            ])
            .cost(Cost::Header {
                name: HeaderName::from_static("x-cost"),
                default: 1,
            }),
    ])
    .clients(Clients {
        trusted_proxies: vec!["10.0.0.0/8".parse().expect("a CIDR")],
        forwarded_header: forwarded,
        user_header: Some(HeaderName::from_static("x-user")),
        tier_header: Some(HeaderName::from_static("x-tier")),
        ..Clients::default()
    });
    let store = MemoryStore::with_clock(
        policy.store_rules(),
        MemoryOptions::default(),
        FakeClock::new(0),
    );
    Engine::new(policy, store).expect("the policy's rules")
}

/// The keys (or the refusal) `Engine::plan` makes of a request from `peer`
/// with `headers`, within [`BOUND`], checked: every key bounded, with no
/// more `|`-separated pairs than its parts unless hashed.
fn plan(
    forwarded: ForwardedHeader,
    peer: SocketAddr,
    headers: Vec<(&'static str, HeaderValue)>,
) -> Result<Vec<String>, String> {
    let shown = format!("{peer} {headers:?}");
    within(BOUND, move || {
        let engine = &ENGINES[usize::from(forwarded == ForwardedHeader::Forwarded)];
        let mut request = Request::get("/").body(()).expect("a request");
        request.extensions_mut().insert(ClientAddr(peer));
        for (name, value) in headers {
            request.headers_mut().append(name, value);
        }
        let (parts, ()) = request.into_parts();
        match engine.plan(&parts, MissingClientAddr::Error) {
            Ok(charges) => Ok(charges.iter().map(|c| c.key().to_string()).collect()),
            Err(Unplanned::BadRequest(message)) => Err(message),
            Err(other) => panic!("{other:?}"),
        }
    })
    .unwrap_or_else(|e| panic!("{e:?} for {shown}"))
    .inspect(|keys: &Vec<String>| {
        for key in keys {
            assert!(key.len() <= MAX_KEY_LEN, "{key} for {shown}");
            if !key.starts_with("sha256:") {
                assert!(key.split('|').count() <= 4, "{key} for {shown}");
            }
        }
    })
}

/// A header value of any bytes a header may hold (no controls but tab).
fn value() -> impl Strategy<Value = HeaderValue> {
    proptest::collection::vec(
        prop_oneof![
            any::<u8>(),
            proptest::sample::select(&b",;=\" :[]%|#.0123456789abcdef"[..]),
        ],
        0..120,
    )
    .prop_map(|mut bytes| {
        // The bytes a header value cannot hold (controls but tab) as `~`.
        for b in &mut bytes {
            if (*b < 0x20 && *b != b'\t') || *b == 0x7f {
                *b = b'~';
            }
        }
        HeaderValue::from_bytes(&bytes).expect("a header value")
    })
}

fn headers() -> impl Strategy<Value = Vec<(&'static str, HeaderValue)>> {
    proptest::collection::vec((proptest::sample::select(NAMES), value()), 0..8)
}

fn forwarded_header() -> impl Strategy<Value = ForwardedHeader> {
    prop_oneof![
        Just(ForwardedHeader::XForwardedFor),
        Just(ForwardedHeader::Forwarded)
    ]
}

fn trusted_peer() -> impl Strategy<Value = SocketAddr> {
    (any::<[u8; 3]>(), any::<u16>())
        .prop_map(|([a, b, c], port)| SocketAddr::from(([10, a, b, c], port)))
}

fn untrusted_peer() -> impl Strategy<Value = SocketAddr> {
    (any::<IpAddr>(), any::<u16>())
        .prop_filter(
            "not in 10/8",
            |(ip, _)| !matches!(ip.to_canonical(), IpAddr::V4(v4) if v4.octets()[0] == 10),
        )
        .prop_map(|(ip, port)| SocketAddr::new(ip, port))
}

/// A valid chain of hops, in either header's syntax.
fn chain(forwarded: ForwardedHeader, hops: &[IpAddr]) -> String {
    hops.iter()
        .map(|ip| match (forwarded, ip) {
            (ForwardedHeader::XForwardedFor, ip) => ip.to_string(),
            (ForwardedHeader::Forwarded, IpAddr::V4(v4)) => format!("for={v4};proto=https"),
            (ForwardedHeader::Forwarded, IpAddr::V6(v6)) => format!("for=\"[{v6}]:443\""),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn header_of(forwarded: ForwardedHeader) -> &'static str {
    match forwarded {
        ForwardedHeader::XForwardedFor => "x-forwarded-for",
        ForwardedHeader::Forwarded => "forwarded",
    }
}

proptest! {
    #![proptest_config(config(300))]

    #[test]
    fn any_headers_from_a_trusted_proxy_give_bounded_keys(
        forwarded in forwarded_header(),
        peer in trusted_peer(),
        headers in headers(),
    ) {
        // Only a cost that is not a count, or a key part sent twice or
        // unreadable, is refused, and the refusal names it.
        if let Err(message) = plan(forwarded, peer, headers) {
            let named = ["x-cost", "x-api-key", "authorization", "x-user", "x-tenant", "api key"]
                .iter()
                .any(|name| message.to_ascii_lowercase().contains(name));
            prop_assert!(named, "{}", message);
        }
    }

    #[test]
    fn an_untrusted_peer_is_keyed_by_its_address_whatever_it_sends(
        forwarded in forwarded_header(),
        peer in untrusted_peer(),
        headers in headers(),
    ) {
        let alone = plan(forwarded, peer, Vec::new()).expect("no headers, no refusal");
        // Headers nobody trusts change nothing: a refusal is for the cost
        // or a credential, never another key.
        if let Ok(keys) = plan(forwarded, peer, headers) {
            prop_assert_eq!(&keys[0], &alone[0]);
        }
    }

    #[test]
    fn a_valid_chain_names_its_right_most_untrusted_hop(
        forwarded in forwarded_header(),
        peer in trusted_peer(),
        client in untrusted_peer(),
        left in proptest::collection::vec(any::<IpAddr>(), 0..3),
        proxies in proptest::collection::vec(trusted_peer(), 0..3),
    ) {
        let mut hops = left;
        hops.push(client.ip());
        hops.extend(proxies.iter().map(SocketAddr::ip));
        let value = HeaderValue::from_str(&chain(forwarded, &hops)).expect("a value");
        let keys = plan(forwarded, peer, vec![(header_of(forwarded), value)]).expect("a plan");
        let ip = client.ip().to_canonical();
        let expected = match ip {
            IpAddr::V4(_) => format!("ip={ip}"),
            // IPv6 clients are keyed by their /64.
            IpAddr::V6(v6) => format!(
                "ip={}",
                ipnet::Ipv6Net::new(v6, 64).expect("a prefix").trunc()
            ),
        };
        prop_assert_eq!(&keys[0], &expected);
    }

    #[test]
    fn a_mutated_chain_gives_bounded_keys(
        forwarded in forwarded_header(),
        peer in trusted_peer(),
        client in untrusted_peer(),
        mutations in proptest::collection::vec(
            mutation(&[b",", b";", b"=", b"\"", b"[", b"]", b":", b" ", b"for=", b"unknown", b"_hidden"]),
            1..5,
        ),
    ) {
        let valid = chain(forwarded, &[client.ip(), "10.1.2.3".parse().expect("an address")]);
        let bytes = apply(valid.as_bytes(), &mutations);
        let Ok(value) = HeaderValue::from_bytes(&bytes) else {
            return Ok(());
        };
        plan(forwarded, peer, vec![(header_of(forwarded), value)]).expect("no cost header");
    }
}

//! The layer's own cost per request, in process: an axum hello-world called
//! through `oneshot` (no sockets, no HTTP parsing), without the layer, with
//! it and no headers, and with it and both header families. The difference
//! between the first and the last is what the middleware adds to a request;
//! the `http` bench measures the same over loopback with wrk. Last, the same
//! with a concurrency rule instead of the token bucket: its slot taken when
//! the request is admitted and given back (by the request's lease keeper, a
//! task of the same runtime) when the response is dropped.
//!
//! The peer, measured in the same run: the same app behind
//! `tower_governor` (a per-peer-IP limit that never denies), without
//! headers and with its `use_headers` (two headers on an admitted answer).
//!
//! Run with: `cargo bench -p spillway-tower --bench layer`

mod common;

use std::net::SocketAddr;
use std::num::NonZeroU32;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use common::{governed, hello, limited};
use criterion::Criterion;
use http::Request;
use spillway::Quota;
use spillway::algorithm::{Concurrency, TokenBucket};
use spillway_tower::{HeaderOptions, HttpRule, Policy, RateLimitLayer};
use tower::ServiceExt;

/// [`limited`] with 10,000 overrides of other keys of its rule and 10,000
/// block list entries of other addresses and API keys: what a request of
/// a client none of them names pays for them.
fn limited_with_tables(headers: HeaderOptions, overrides: bool, entries: bool) -> Router {
    use spillway::store::{ListEntry, Listed, Override, OverrideEntry, RuleId, Store, Target};
    let never = NonZeroU32::new(1_000_000_000).expect("nonzero");
    let rule = HttpRule::new("per-ip", TokenBucket::new(Quota::per_second(never), never));
    let layer = RateLimitLayer::in_memory(Policy::new([rule]).headers(headers));
    let store = layer.store();
    let block = ListEntry {
        allow: false,
        rule: None,
        status: 403,
        until: None,
        spec: "{}".into(),
    };
    for i in 0..10_000u32 {
        let other = format!("ip=172.16.{}.{}", i >> 8, i & 0xff);
        let entry = OverrideEntry {
            applied: Override::limit(5),
            spec: "{}".into(),
        };
        if overrides {
            store
                .set_override(RuleId(0), Target::Key(other.into()), entry)
                .expect("fits");
        }
        let lists = store.lists().expect("kept");
        if !entries {
            continue;
        }
        if i % 2 == 0 {
            let addr = std::net::IpAddr::from([192, 168, (i >> 8) as u8, i as u8]);
            lists.set(
                Listed::network(addr, 32).expect("an address"),
                block.clone(),
            );
        } else {
            lists.set(Listed::ApiKey(format!("key-{i}").into()), block.clone());
        }
    }
    hello().layer(layer)
}

/// A concurrency rule that never denies: a million slots per key.
fn in_flight() -> Router {
    let slots = NonZeroU32::new(1_000_000).expect("nonzero");
    let quota = Quota::new(slots, std::time::Duration::from_secs(30)).expect("valid");
    let rule = HttpRule::new("in-flight", Concurrency::new(quota));
    hello().layer(RateLimitLayer::in_memory(Policy::new([rule])))
}

/// Makes an app to measure, when its bench runs.
type MakeApp = Box<dyn Fn() -> Router>;

fn request(i: u32) -> Request<Body> {
    let ip = [10, 0, (i >> 8) as u8, i as u8];
    let mut req = Request::get("/").body(Body::empty()).expect("a request");
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 40_000))));
    req
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let no_headers = HeaderOptions {
        legacy: false,
        ietf: false,
        ..HeaderOptions::default()
    };
    // Each app is made only when its bench runs (a filter skips the
    // others' set-up, the tables' 10,000 entries among them).
    let legacy_only = HeaderOptions {
        ietf: false,
        ..HeaderOptions::default()
    };
    let both = HeaderOptions::default();
    let apps: [(&str, MakeApp); 10] = [
        ("without the layer", Box::new(hello)),
        ("tower_governor, no headers", Box::new(|| governed(false))),
        (
            "tower_governor, its two headers",
            Box::new(|| governed(true)),
        ),
        ("layer, no headers", Box::new(move || limited(no_headers))),
        (
            "layer, X-RateLimit-* only",
            Box::new(move || limited(legacy_only)),
        ),
        (
            "layer, both header families",
            Box::new(move || limited(both)),
        ),
        (
            "layer, both header families, 10,000 overrides and 10,000 list entries",
            Box::new(move || limited_with_tables(both, true, true)),
        ),
        (
            "layer, both header families, 10,000 overrides",
            Box::new(move || limited_with_tables(both, true, false)),
        ),
        (
            "layer, both header families, 10,000 list entries",
            Box::new(move || limited_with_tables(both, false, true)),
        ),
        (
            "layer, a concurrency rule, both families",
            Box::new(in_flight),
        ),
    ];
    let mut group = c.benchmark_group("request");
    for (name, make) in apps {
        let mut i = 0u32;
        group.bench_function(name, |b| {
            let app = make();
            b.iter(|| {
                i = (i + 1) % 1000;
                let response = runtime
                    .block_on(app.clone().oneshot(request(i)))
                    .expect("infallible");
                assert!(response.status().is_success());
                response
            })
        });
    }
    group.finish();
}

// What `criterion_group!` and `criterion_main!` expand to, written out so
// that no public item needs docs.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}

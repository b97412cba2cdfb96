//! Rate-limit headers on every response: `X-RateLimit-*` (reset as unix or
//! delta seconds) and the IETF structured fields, parsed back with `sfv`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{Response, StatusCode};
use spillway::Quota;
use spillway::algorithm::{FixedWindow, TokenBucket};
use spillway_tower::{Cost, HeaderOptions, HttpRule, KeyPart, Policy, ResetFormat, Tier};

use crate::support::{
    bucket, ceil_secs, header, header_u64, hello, memory_layer, nz, req, send, window_secs,
};

/// One member of a `RateLimit-Policy` or `RateLimit` list: the rule's
/// name and its integer parameters, in order.
type Member = (String, Vec<(String, i64)>);

/// Parses a header as an RFC 9651 List of Items whose bare item is a String
/// and whose parameters are all Integers.
fn members<B>(res: &Response<B>, name: &str) -> Vec<Member> {
    let value = header(res, name).unwrap_or_else(|| panic!("no `{name}` header"));
    let list: sfv::List = sfv::Parser::new(&value)
        .parse()
        .unwrap_or_else(|e| panic!("`{name}: {value}` is not a structured-field list: {e}"));
    list.into_iter()
        .map(|entry| {
            let sfv::ListEntry::Item(item) = entry else {
                panic!("`{name}: {value}` holds an inner list");
            };
            let rule = item
                .bare_item
                .as_string()
                .expect("the name is a String")
                .as_str()
                .to_string();
            let params = item
                .params
                .iter()
                .map(|(k, v)| {
                    let v = v
                        .as_integer()
                        .unwrap_or_else(|| panic!("`{k}` in `{value}` is not an Integer"));
                    (k.as_str().to_string(), i64::from(v))
                })
                .collect();
            (rule, params)
        })
        .collect()
}

fn member(rule: &str, params: [(&str, u64); 2]) -> Member {
    (
        rule.to_string(),
        params
            .iter()
            .map(|(k, v)| (k.to_string(), i64::try_from(*v).expect("small")))
            .collect(),
    )
}

#[tokio::test(start_paused = true)]
async fn legacy_headers_with_the_reset_in_delta_seconds() {
    let burst = 3u32;
    let quota = Quota::per_minute(nz(60));
    let interval = quota.period() / quota.limit().get();
    let policy = Policy::new([HttpRule::new("per-ip", TokenBucket::new(quota, nz(burst)))])
        .headers(HeaderOptions {
            reset: ResetFormat::Delta,
            ..HeaderOptions::default()
        });
    let app = hello(memory_layer(policy));

    for used in 1..=burst {
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header_u64(&res, "x-ratelimit-limit"), u64::from(burst));
        assert_eq!(
            header_u64(&res, "x-ratelimit-remaining"),
            u64::from(burst - used)
        );
        // The bucket is full again once every used token has come back.
        assert_eq!(
            header_u64(&res, "x-ratelimit-reset"),
            ceil_secs(interval * used)
        );
    }
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header_u64(&res, "x-ratelimit-limit"), u64::from(burst));
    assert_eq!(header_u64(&res, "x-ratelimit-remaining"), 0);
    assert_eq!(
        header_u64(&res, "x-ratelimit-reset"),
        ceil_secs(interval * burst)
    );

    // One token back: admitted, with nothing to spare.
    tokio::time::advance(interval).await;
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header_u64(&res, "x-ratelimit-remaining"), 0);
    assert_eq!(
        header_u64(&res, "x-ratelimit-reset"),
        ceil_secs(interval * burst)
    );
}

#[tokio::test(start_paused = true)]
async fn legacy_reset_in_unix_seconds_by_default() {
    let quota = Quota::per_minute(nz(6));
    let interval = quota.period() / quota.limit().get();
    let app = hello(memory_layer(Policy::new([HttpRule::new(
        "per-ip",
        TokenBucket::new(quota, nz(1)),
    )])));
    let unix = |t: SystemTime| t.duration_since(UNIX_EPOCH).expect("after 1970");

    for expected in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let before = unix(SystemTime::now());
        let res = send(&app, req("/", "192.0.2.1")).await;
        let after = unix(SystemTime::now());
        assert_eq!(res.status(), expected);
        // The one token comes back one interval after the first request.
        let reset = header_u64(&res, "x-ratelimit-reset");
        assert!(
            (ceil_secs(before + interval)..=ceil_secs(after + interval)).contains(&reset),
            "reset {reset} is not now + {interval:?} in unix seconds (now = {before:?})"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn ietf_fields_parse_as_structured_fields() {
    let minute = Quota::per_minute(nz(100));
    let (burst_quota, burst) = (Quota::per_minute(nz(60)), 3u32);
    let interval = burst_quota.period() / burst_quota.limit().get();
    let policy = Policy::new([
        HttpRule::new("per-minute", FixedWindow::new(minute)),
        HttpRule::new("burst", TokenBucket::new(burst_quota, nz(burst))),
    ]);
    let app = hello(memory_layer(policy));
    let expected_policy = vec![
        member("per-minute", [("q", 100), ("w", window_secs(minute, 100))]),
        member(
            "burst",
            [
                ("q", u64::from(burst)),
                ("w", window_secs(burst_quota, u64::from(burst))),
            ],
        ),
    ];
    assert_eq!(
        expected_policy[0].1[1].1, 60,
        "a fixed window's w is its period"
    );

    for used in 1..=burst {
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(
            members(&res, "ratelimit-policy"),
            expected_policy,
            "every rule that applied"
        );
        // `RateLimit` and `X-RateLimit-*` describe the most restrictive
        // rule: the burst, though it is listed second.
        // `t` is the time until more than `r` is available: the next
        // token, one interval away however many were taken at once.
        let remaining = u64::from(burst - used);
        let next = ceil_secs(interval);
        assert_eq!(
            members(&res, "ratelimit"),
            [member("burst", [("r", remaining), ("t", next)])]
        );
        assert_eq!(header_u64(&res, "x-ratelimit-limit"), u64::from(burst));
        assert_eq!(header_u64(&res, "x-ratelimit-remaining"), remaining);
    }
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(members(&res, "ratelimit-policy"), expected_policy);
    // Denied, `t` is the Retry-After number (one token's interval), not
    // the time to full: Retry-After must not end before the effective
    // window does (draft-ietf-httpapi-ratelimit-headers-11, §6).
    let retry = ceil_secs(interval);
    assert_eq!(
        members(&res, "ratelimit"),
        [member("burst", [("r", 0), ("t", retry)])]
    );
    assert_eq!(header_u64(&res, "x-ratelimit-limit"), u64::from(burst));
    assert_eq!(header_u64(&res, "x-ratelimit-remaining"), 0);
}

/// On a 429, `RateLimit`'s effective window ends when `Retry-After` does
/// (draft-ietf-httpapi-ratelimit-headers-11, §6), for a token bucket
/// whose Retry-After (one token's interval) is far shorter than its time
/// to full, which `t` used to be.
#[tokio::test(start_paused = true)]
async fn a_denials_effective_window_is_its_retry_after() {
    let (quota, burst) = (Quota::per_minute(nz(10)), 10u32);
    let interval = quota.period() / quota.limit().get();
    let app = hello(memory_layer(Policy::new([HttpRule::new(
        "per-ip",
        TokenBucket::new(quota, nz(burst)),
    )])));
    for _ in 0..burst {
        let res = send(&app, req("/", "192.0.2.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry = header_u64(&res, "retry-after");
    assert_eq!(retry, ceil_secs(interval));
    assert!(
        retry < ceil_secs(interval * burst),
        "the two used to differ"
    );
    assert_eq!(
        members(&res, "ratelimit"),
        [member("per-ip", [("r", 0), ("t", retry)])]
    );
    // Part of the way there: both count down together, rounded up.
    tokio::time::advance(interval / 4).await;
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry = header_u64(&res, "retry-after");
    assert_eq!(retry, ceil_secs(interval - interval / 4));
    assert_eq!(
        members(&res, "ratelimit"),
        [member("per-ip", [("r", 0), ("t", retry)])]
    );
    // Admitted again, `t` is the time until the next token (draft -11:
    // until additional quota is available), not until the bucket is full.
    tokio::time::advance(interval - interval / 4).await;
    let res = send(&app, req("/", "192.0.2.1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        members(&res, "ratelimit"),
        [member("per-ip", [("r", 0), ("t", ceil_secs(interval))])]
    );
    assert!(ceil_secs(interval) < ceil_secs(interval * burst));
}

#[tokio::test(start_paused = true)]
async fn the_most_restrictive_rule_is_the_least_remaining_or_the_denying_one() {
    // "small" is listed first and has less room until "large", at 33 a
    // request, runs low; then "large" denies.
    let (small, large, cost) = (5u64, 100u64, 33u64);
    let policy = Policy::new([
        HttpRule::new("small", bucket(small as u32)),
        HttpRule::new("large", bucket(large as u32)).cost(Cost::Fixed(cost)),
    ]);
    let app = hello(memory_layer(policy));
    let mut described = Vec::new();
    for k in 1u64.. {
        let res = send(&app, req("/", "192.0.2.1")).await;
        let Some(large_left) = large.checked_sub(k * cost) else {
            // Denied by "large", which the headers describe, though "small"
            // has less left: the denying rule is the one to wait for.
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(header_u64(&res, "x-ratelimit-limit"), large);
            assert_eq!(
                header_u64(&res, "x-ratelimit-remaining"),
                large - (k - 1) * cost
            );
            assert_eq!(members(&res, "ratelimit")[0].0, "large");
            assert_eq!(members(&res, "ratelimit-policy").len(), 2);
            break;
        };
        let small_left = small - k;
        assert_eq!(res.status(), StatusCode::OK);
        let (name, limit, left) = if large_left < small_left {
            ("large", large, large_left)
        } else {
            ("small", small, small_left)
        };
        assert_eq!(header_u64(&res, "x-ratelimit-limit"), limit, "request {k}");
        assert_eq!(
            header_u64(&res, "x-ratelimit-remaining"),
            left,
            "request {k}"
        );
        assert_eq!(members(&res, "ratelimit")[0].0, name, "request {k}");
        assert_eq!(members(&res, "ratelimit-policy").len(), 2);
        described.push(name);
    }
    assert!(
        described.contains(&"small") && described.contains(&"large"),
        "{described:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_tier_reports_its_own_quota_and_window() {
    let pro = Quota::per_minute(nz(5));
    let policy = Policy::new([HttpRule::new("per-key", bucket(2))
        .key([KeyPart::ApiKey])
        .tier("pro", FixedWindow::new(pro))]);
    let app = hello(memory_layer(policy));
    let res = send(
        &app,
        req("/", "192.0.2.1")
            .header("x-api-key", "k")
            .extension(Tier("pro".into())),
    )
    .await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        members(&res, "ratelimit-policy"),
        [member("per-key", [("q", 5), ("w", window_secs(pro, 5))])]
    );
    assert_eq!(header_u64(&res, "x-ratelimit-limit"), 5);
}

#[tokio::test(start_paused = true)]
async fn header_families_can_be_turned_off() {
    let legacy = [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ];
    let ietf = ["ratelimit-policy", "ratelimit"];
    for (options, want_legacy, want_ietf) in [
        (
            HeaderOptions {
                legacy: false,
                ..HeaderOptions::default()
            },
            false,
            true,
        ),
        (
            HeaderOptions {
                ietf: false,
                ..HeaderOptions::default()
            },
            true,
            false,
        ),
        (
            HeaderOptions {
                legacy: false,
                ietf: false,
                reset: ResetFormat::Delta,
                openai: false,
            },
            false,
            false,
        ),
        (HeaderOptions::default(), true, true),
    ] {
        let app = hello(memory_layer(
            Policy::new([HttpRule::new("per-ip", bucket(1))]).headers(options),
        ));
        for status in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
            let res = send(&app, req("/", "192.0.2.1")).await;
            assert_eq!(res.status(), status);
            for name in legacy {
                assert_eq!(
                    res.headers().contains_key(name),
                    want_legacy,
                    "{name} with {options:?}"
                );
            }
            for name in ietf {
                assert_eq!(
                    res.headers().contains_key(name),
                    want_ietf,
                    "{name} with {options:?}"
                );
            }
            // A denial always says when to come back.
            assert_eq!(
                res.headers().contains_key("retry-after"),
                status == StatusCode::TOO_MANY_REQUESTS
            );
        }
    }
}

/// A sanity check of the helpers: the window of a token bucket is the time
/// it takes to refill its burst.
#[test]
fn window_of_a_bucket_is_its_refill_time() {
    assert_eq!(window_secs(Quota::per_minute(nz(60)), 3), 3);
    assert_eq!(window_secs(Quota::per_hour(nz(7)), 7), 3600);
    assert_eq!(ceil_secs(Duration::from_millis(1500)), 2);
}

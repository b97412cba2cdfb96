//! The Redis store on a real redis-server: script loading, TTLs, the
//! server's clock, failure policies, the deny cache, exactness across
//! instances, and Redis Cluster.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use spillway::Quota;
use spillway::algorithm::{AnyAlgorithm, FixedWindow, SlidingLog, SlidingWindow, TokenBucket};
use spillway::store::{Check, Rule, RuleId, Store};
use spillway_conformance::redis_server::{RedisCluster, RedisServer, free_ports};
use spillway_redis::{Error, OnError, RedisOptions, RedisStore, Topology};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

fn per(limit: u32, window: Duration) -> Quota {
    Quota::new(nz(limit), window).unwrap()
}

async fn store(server: &RedisServer, rules: Vec<Rule>, options: RedisOptions) -> RedisStore {
    RedisStore::connect(Topology::Standalone(server.url()), rules, options)
        .await
        .expect("connects")
}

/// A store of `rules` on `cluster`, given its masters' addresses.
async fn cluster_store(
    cluster: &RedisCluster,
    rules: Vec<Rule>,
    options: RedisOptions,
) -> RedisStore {
    RedisStore::connect(Topology::Cluster(cluster.urls()), rules, options)
        .await
        .expect("connects")
}

fn one(key: &str) -> [Check<'_>; 1] {
    [Check {
        rule: RuleId(0),
        key,
        cost: 1,
    }]
}

fn evalsha_calls(server: &RedisServer) -> u64 {
    command_calls(server, "evalsha")
}

/// How many times the server ran `command` (scripts' commands included).
fn command_calls(server: &RedisServer, command: &str) -> u64 {
    let info = server.command("INFO commandstats");
    let prefix = format!("cmdstat_{command}:");
    info.lines()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn reloads_the_script_after_script_flush() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rules = vec![Rule::new(
        "r",
        FixedWindow::new(per(5, Duration::from_secs(60))),
    )];
    let s = store(&server, rules, RedisOptions::default()).await;
    assert_eq!(s.check(&one("k")).await.unwrap().decisions[0].remaining, 4);
    assert!(server.command("SCRIPT FLUSH").starts_with("+OK"));
    // NOSCRIPT is answered by loading the script again, invisibly.
    assert_eq!(s.check(&one("k")).await.unwrap().decisions[0].remaining, 3);
    assert_eq!(s.stats().redis_errors, 0);
}

#[tokio::test]
async fn a_request_of_one_check_runs_its_algorithms_own_script() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let minute = Duration::from_secs(60);
    let rules = vec![
        Rule::new("fw", FixedWindow::new(per(5, minute))),
        Rule::new("tb", TokenBucket::new(per(5, minute), nz(5))),
    ];
    let s = store(&server, rules, RedisOptions::default()).await;
    let both = [
        Check {
            rule: RuleId(0),
            key: "k",
            cost: 1,
        },
        Check {
            rule: RuleId(1),
            key: "k",
            cost: 1,
        },
    ];
    let single = s.script_call(&one("k")).unwrap();
    let general = s.script_call(&both).unwrap();
    // The fixed window's own script: no other algorithm, two parameters.
    assert!(single.source.contains("redis.call('INCRBY', key, ARGV[3])"));
    assert!(!single.source.contains("local function bucket("));
    assert_eq!(single.args, ["5", "60000000", "1"]);
    assert!(general.source.contains("local function bucket("));
    let loaded = |source: &str| {
        let sha = redis::Script::new(source).get_hash().to_string();
        server
            .command(&format!("SCRIPT EXISTS {sha}"))
            .contains(":1")
    };
    assert!(server.command("SCRIPT FLUSH").starts_with("+OK"));
    assert!(s.check(&one("k")).await.unwrap().allowed);
    assert!(loaded(&single.source), "one check ran another script");
    assert!(!loaded(&general.source), "one check ran the general script");
    assert!(s.check(&both).await.unwrap().allowed);
    assert!(
        loaded(&general.source),
        "two checks did not run the general script"
    );
}

#[tokio::test]
async fn every_key_gets_a_ttl_that_ends_when_its_state_is_fresh_again() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let minute = Duration::from_secs(60);
    let rules = vec![
        Rule::new("fw", FixedWindow::new(per(5, minute))),
        Rule::new("sw", SlidingWindow::new(per(5, minute))),
        Rule::new("log", SlidingLog::new(per(5, minute))),
        Rule::new(
            "tb",
            TokenBucket::new(per(1, Duration::from_secs(10)), nz(3)),
        ),
    ];
    let s = store(&server, rules, RedisOptions::default()).await;
    let checks: Vec<Check<'_>> = (0..4)
        .map(|r| Check {
            rule: RuleId(r),
            key: "ttl",
            cost: 1,
        })
        .collect();
    assert!(s.check(&checks).await.unwrap().allowed);
    let pttl = |key: &str| -> i64 {
        let reply = server.command(&format!("PTTL {key}"));
        reply.trim().trim_start_matches(':').parse().unwrap()
    };
    // The same expiries whether the general script wrote the state (the
    // request above, four checks) or each algorithm's own script (a request
    // of one check each, on key "one").
    for r in 0..4 {
        let one = [Check {
            rule: RuleId(r),
            key: "one",
            cost: 1,
        }];
        assert!(s.check(&one).await.unwrap().allowed);
    }
    for key in ["ttl", "one"] {
        // Fixed window: until the end of the current minute.
        let fw = pttl(&format!("spillway:{{fw:{key}}}:fwi:60000000"));
        assert!(fw > 0 && fw <= 60_000, "fixed window PTTL {fw} ({key})");
        // Sliding window: the count weighs on the next window too.
        let sw = pttl(&format!("spillway:{{sw:{key}}}:sw:60000000"));
        assert!(
            sw > 60_000 && sw <= 120_000,
            "sliding window PTTL {sw} ({key})"
        );
        // Sliding log: one window after the entry.
        let log = pttl(&format!("spillway:{{log:{key}}}:sl"));
        assert!(
            log > 59_000 && log <= 60_000,
            "sliding log PTTL {log} ({key})"
        );
        // Token bucket: one token back takes 10 s.
        let tb = pttl(&format!("spillway:{{tb:{key}}}:tb"));
        assert!(tb > 9_000 && tb <= 10_000, "token bucket PTTL {tb} ({key})");
    }
}

#[tokio::test]
async fn decisions_use_the_servers_clock() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let window = Duration::from_secs(1);
    let rules = vec![Rule::new("fw", FixedWindow::new(per(5, window)))];
    let s = store(&server, rules, RedisOptions::default()).await;
    s.check(&one("clock")).await.unwrap();
    // The stored window is the server's TIME divided by the window: its
    // tag (the integer's bits above the count's 33) is that index mod
    // 2^20 - 1, plus one.
    let time = server.command("TIME");
    let secs: u64 = time.lines().nth(2).unwrap().trim().parse().unwrap();
    let stored = server.command("GET spillway:{fw:clock}:fwi:1000000");
    let value: u64 = stored.lines().nth(1).unwrap().trim().parse().unwrap();
    assert_eq!(value & ((1 << 33) - 1), 1, "one charge counted in {value}");
    let tag = value >> 33;
    assert!(
        (secs % 1_048_575 + 1).abs_diff(tag) <= 1,
        "server second {secs}, window tag {tag}"
    );
}

#[tokio::test]
async fn a_lone_fixed_window_check_adds_its_cost_in_one_command() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rules = vec![Rule::new(
        "fw",
        FixedWindow::new(per(3, Duration::from_secs(3600))),
    )];
    let s = store(
        &server,
        rules,
        RedisOptions {
            deny_cache_entries: 0,
            ..RedisOptions::default()
        },
    )
    .await;
    let key = "spillway:{fw:k}:fwi:3600000000";
    // Each check adds its cost first; the window's first also writes the
    // tag and the expiry with one SET.
    let remaining: Vec<u64> = {
        let mut r = Vec::new();
        for _ in 0..3 {
            r.push(s.check(&one("k")).await.unwrap().decisions[0].remaining);
        }
        r
    };
    assert_eq!(remaining, [2, 1, 0]);
    assert_eq!(command_calls(&server, "incrby"), 3);
    assert_eq!(command_calls(&server, "set"), 1);
    assert_eq!(command_calls(&server, "decrby"), 0);
    // A denial takes its cost back within the same script.
    let denied = s.check(&one("k")).await.unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.decisions[0].remaining, 0);
    assert_eq!(command_calls(&server, "decrby"), 1);
    let value: u64 = server
        .command(&format!("GET {key}"))
        .lines()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(value & ((1 << 33) - 1), 3, "the count in {value}");
    let ttl: i64 = server.command(&format!("PTTL {key}"))[1..]
        .trim()
        .parse()
        .unwrap();
    assert!(
        ttl > 0 && ttl <= 3_600_000,
        "expires at the window's end: {ttl} ms"
    );

    // Tags run 1..=2^20 - 1 in a circle. One ahead of this window's is a
    // window the server's clock was set back from: it goes on counting
    // there, as the in-memory store does.
    let tags = 1_048_575;
    let tag = value >> 33;
    let next = tag % tags + 1;
    server.command(&format!("SET {key} {} PX 60000", (next << 33) | 3));
    assert!(!s.check(&one("k")).await.unwrap().allowed);
    // The window before's count no longer counts: the window starts afresh.
    let before = if tag == 1 { tags } else { tag - 1 };
    server.command(&format!("SET {key} {} PX 60000", (before << 33) | 3));
    let fresh = s.check(&one("k")).await.unwrap();
    assert!(fresh.allowed);
    assert_eq!(fresh.decisions[0].remaining, 2);

    // A request of two checks (the general script) reads and writes the
    // same integer as the lone check's script.
    let two = [
        Check {
            rule: RuleId(0),
            key: "k",
            cost: 1,
        },
        Check {
            rule: RuleId(0),
            key: "other",
            cost: 1,
        },
    ];
    let both = s.check(&two).await.unwrap();
    assert!(both.allowed);
    assert_eq!(both.decisions[0].remaining, 1);
    assert_eq!(s.check(&one("k")).await.unwrap().decisions[0].remaining, 0);
    assert!(!s.check(&two).await.unwrap().allowed);
    assert_eq!(
        s.check(&one("other")).await.unwrap().decisions[0].remaining,
        1
    );
}

#[tokio::test]
async fn the_deny_cache_answers_without_a_round_trip() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rules = vec![Rule::new(
        "r",
        FixedWindow::new(per(2, Duration::from_secs(3600))),
    )];
    let s = store(&server, rules, RedisOptions::default()).await;
    for _ in 0..3 {
        s.check(&one("hammer")).await.unwrap();
    }
    let before = evalsha_calls(&server);
    let calls_before = s.stats().redis_calls;
    for _ in 0..1000 {
        let v = s.check(&one("hammer")).await.unwrap();
        assert!(!v.allowed);
        let retry = v.decisions[0].retry_after.unwrap();
        assert!(retry > Duration::ZERO && retry <= Duration::from_secs(3600));
    }
    assert_eq!(
        evalsha_calls(&server),
        before,
        "no script call reached Redis"
    );
    assert_eq!(s.stats().redis_calls, calls_before);
    assert_eq!(s.stats().deny_cache_hits, 1000);
    // Another key still goes to Redis; a reset clears the cache.
    assert!(s.check(&one("other")).await.unwrap().allowed);
    assert!(s.reset(RuleId(0), "hammer").await.unwrap());
    assert!(s.check(&one("hammer")).await.unwrap().allowed);
}

/// Polls `f` every 10 ms until it returns true or `within` passes.
async fn eventually(within: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

async fn outage(policy: OnError) -> (RedisServer, RedisStore) {
    let server = RedisServer::start().expect("checked by the caller");
    let rules = vec![Rule::new(
        "r",
        FixedWindow::new(per(4, Duration::from_secs(3600))),
    )];
    let options = RedisOptions {
        on_error: policy,
        deny_cache_entries: 0,
        ..RedisOptions::default()
    };
    let s = store(&server, rules, options).await;
    assert!(s.check(&one("k")).await.unwrap().allowed);
    (server, s)
}

#[tokio::test]
async fn fail_open_admits_while_redis_is_down_and_recovers_within_a_second() {
    if RedisServer::start().is_none() {
        return;
    }
    let (mut server, s) = outage(OnError::FailOpen).await;
    assert!(s.check(&one("k")).await.unwrap().undecided.is_empty());
    server.kill();
    for _ in 0..10 {
        let verdict = s.check(&one("k")).await.unwrap();
        assert!(verdict.allowed);
        // Admitted by the policy, not decided: no quota to report.
        assert_eq!(verdict.undecided, [0]);
        assert_eq!(verdict.most_restrictive(), None);
    }
    assert!(s.stats().fail_open >= 10);
    assert!(!s.is_healthy());
    server.restart();
    let back = Instant::now();
    // The restarted server is empty: the first answer from Redis has 3 left.
    assert!(
        eventually(Duration::from_secs(1), async || {
            s.check(&one("k")).await.unwrap().decisions[0].remaining == 3
        })
        .await,
        "Redis was not used again within a second of coming back"
    );
    assert!(back.elapsed() < Duration::from_secs(1));
    assert!(s.is_healthy());
}

#[tokio::test]
async fn fail_closed_refuses_while_redis_is_down() {
    if RedisServer::start().is_none() {
        return;
    }
    let (mut server, s) = outage(OnError::FailClosed).await;
    server.kill();
    let err = s.check(&one("k")).await.unwrap_err();
    assert!(!matches!(err, Error::Check(_)), "{err}");
    // Within the retry interval Redis is not even tried.
    let calls = s.stats().redis_calls;
    assert!(matches!(s.check(&one("k")).await, Err(Error::Unavailable)));
    assert_eq!(s.stats().redis_calls, calls);
    server.restart();
    assert!(
        eventually(Duration::from_secs(1), async || s
            .check(&one("k"))
            .await
            .is_ok())
        .await
    );
}

#[tokio::test]
async fn local_fallback_enforces_each_instances_share() {
    if RedisServer::start().is_none() {
        return;
    }
    let (mut server, s) = outage(OnError::Local { instances: nz(2) }).await;
    server.kill();
    // limit 4 shared by 2 instances: 2 each while Redis is down.
    let admitted = {
        let mut n = 0;
        for _ in 0..5 {
            n += usize::from(s.check(&one("k")).await.unwrap().allowed);
        }
        n
    };
    assert_eq!(admitted, 2);
    assert_eq!(s.stats().local, 5);
}

/// Each rule's own failure policy while Redis is down: `login` fails
/// closed (its requests are refused), `search` decides locally (2 of its
/// 4, the instance's share), `general` fails open; a request is refused if
/// any of its rules fails closed.
#[tokio::test]
async fn each_rule_fails_by_its_own_policy() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let hour = Duration::from_secs(3600);
    let rules = vec![
        Rule::new("general", FixedWindow::new(per(1, hour))),
        Rule::new("login", FixedWindow::new(per(4, hour))),
        Rule::new("search", FixedWindow::new(per(4, hour))),
    ];
    let options = RedisOptions {
        on_error: OnError::FailOpen,
        rule_on_error: [
            ("login".to_string(), OnError::FailClosed),
            ("search".to_string(), OnError::Local { instances: nz(2) }),
        ]
        .into(),
        deny_cache_entries: 0,
        ..RedisOptions::default()
    };
    let s = store(&server, rules, options).await;
    let check = |rules: &[usize]| -> Vec<Check<'static>> {
        rules
            .iter()
            .map(|&r| Check {
                rule: RuleId(r),
                key: "k",
                cost: 1,
            })
            .collect()
    };
    // Redis up: general's one is used.
    assert!(s.check(&check(&[0])).await.unwrap().allowed);
    assert!(!s.check(&check(&[0])).await.unwrap().allowed);
    server.kill();
    // Down: general admits (fail open) whatever Redis said before.
    for _ in 0..3 {
        assert!(s.check(&check(&[0])).await.unwrap().allowed);
    }
    // login refuses, even beside a rule that would admit.
    assert!(s.check(&check(&[1])).await.is_err());
    assert!(s.check(&check(&[0, 1])).await.is_err());
    // search decides in memory: 2 of 4 for this instance, with general
    // admitting beside it, undecided.
    let admitted = {
        let mut n = 0;
        for _ in 0..4 {
            let verdict = s.check(&check(&[0, 2])).await.unwrap();
            assert_eq!(verdict.undecided, [0], "search is decided, in memory");
            n += usize::from(verdict.allowed);
        }
        n
    };
    assert_eq!(admitted, 2);
    let stats = s.stats();
    assert_eq!(stats.local, 4);
    assert!(stats.fail_open >= 7, "{stats:?}");
}

/// 4 stores (4 service instances, 4 connections), 200 tasks each, one key.
async fn admitted_by_four_instances(
    server: &RedisServer,
    algorithm: AnyAlgorithm,
    key: &str,
) -> usize {
    let mut stores = Vec::new();
    for _ in 0..4 {
        let options = RedisOptions {
            timeout: Duration::from_secs(10),
            ..RedisOptions::default()
        };
        stores.push(store(server, vec![Rule::new("exact", algorithm)], options).await);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for s in &stores {
        for _ in 0..200 {
            let s = s.clone();
            let key = key.to_string();
            tasks.spawn(async move {
                let mut admitted = 0;
                for _ in 0..2 {
                    let checks = [Check {
                        rule: RuleId(0),
                        key: &key,
                        cost: 1,
                    }];
                    admitted += usize::from(s.check(&checks).await.expect("no error").allowed);
                    assert_eq!(
                        s.stats().redis_errors,
                        0,
                        "a decision came from the failure policy"
                    );
                }
                admitted
            });
        }
    }
    let mut total = 0;
    while let Some(n) = tasks.join_next().await {
        total += n.unwrap();
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_admit_exactly_the_limit() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let hour = Duration::from_secs(3600);
    for (name, algorithm) in [
        (
            "fixed",
            AnyAlgorithm::from(FixedWindow::new(per(1000, hour))),
        ),
        ("log", AnyAlgorithm::from(SlidingLog::new(per(1000, hour)))),
    ] {
        for round in 0..3 {
            let admitted =
                admitted_by_four_instances(&server, algorithm, &format!("{name}-{round}")).await;
            assert_eq!(admitted, 1000, "{name}, round {round}");
        }
    }
    // Token bucket: at most burst + rate x elapsed.
    let start = Instant::now();
    let tb = TokenBucket::new(per(100, Duration::from_secs(1)), nz(500));
    let admitted = admitted_by_four_instances(&server, tb.into(), "bucket").await;
    let elapsed = start.elapsed().as_secs_f64();
    let bound = 500.0 + 100.0 * elapsed;
    assert!(
        admitted >= 500 && (admitted as f64) <= bound,
        "{admitted} > {bound}"
    );
}

#[tokio::test]
async fn cluster_gives_back_the_charge_of_a_denied_request() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    // Our slot function agrees with the servers'.
    for key in ["foo", "spillway:{a:b}", "x{tag}y", "{}z", "{{a}}"] {
        let reply = cluster.nodes()[0].command(&format!("CLUSTER KEYSLOT {key}"));
        let theirs: u16 = reply.trim().trim_start_matches(':').parse().unwrap();
        assert_eq!(spillway_redis::slot(key.as_bytes()), theirs, "{key}");
    }
    let hour = Duration::from_secs(3600);
    let rules = vec![
        Rule::new("wide", FixedWindow::new(per(10, hour))),
        Rule::new("narrow", FixedWindow::new(per(1, hour))),
    ];
    let s = cluster_store(&cluster, rules, RedisOptions::default()).await;
    // Find two keys on different slots so the request needs two calls.
    let (a, b) = ("user-1", "ip-2");
    let request = [
        Check {
            rule: RuleId(0),
            key: a,
            cost: 1,
        },
        Check {
            rule: RuleId(1),
            key: b,
            cost: 1,
        },
    ];
    assert!(s.check(&request).await.unwrap().allowed);
    let calls = s.stats().redis_calls;
    let denied = s.check(&request).await.unwrap();
    assert!(!denied.allowed);
    // Two calls, then one refund call for the admitting slot.
    assert_eq!(s.stats().redis_calls - calls, 3);
    // The wide rule was given its unit back: 9 left, as after the first request.
    assert_eq!(denied.decisions[0].remaining, 9);
    let peek = [Check {
        rule: RuleId(0),
        key: a,
        cost: 0,
    }];
    assert_eq!(s.check(&peek).await.unwrap().decisions[0].remaining, 9);
}

#[tokio::test]
async fn all_rules_of_a_request_cost_one_round_trip() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let hour = Duration::from_secs(3600);
    let rules = vec![
        Rule::new("a", FixedWindow::new(per(10, hour))),
        Rule::new("b", SlidingLog::new(per(10, hour))),
        Rule::new("c", TokenBucket::new(per(10, hour), nz(10))),
    ];
    let s = store(&server, rules, RedisOptions::default()).await;
    let request: Vec<Check<'_>> = (0..3)
        .map(|r| Check {
            rule: RuleId(r),
            key: "same-client",
            cost: 2,
        })
        .collect();
    s.check(&request).await.unwrap();
    let before = evalsha_calls(&server);
    for _ in 0..3 {
        assert!(s.check(&request).await.unwrap().allowed);
    }
    assert_eq!(evalsha_calls(&server) - before, 3);
    // The fifth request would take each rule to 10: still fits; the sixth not,
    // and it charges none of them.
    assert!(s.check(&request).await.unwrap().allowed);
    let denied = s.check(&request).await.unwrap();
    assert!(!denied.allowed);
    assert!(denied.decisions.iter().all(|d| !d.allowed));
}

#[tokio::test]
async fn a_stalled_server_costs_at_most_the_timeout() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rules = vec![Rule::new(
        "r",
        FixedWindow::new(per(5, Duration::from_secs(60))),
    )];
    let options = RedisOptions {
        timeout: Duration::from_millis(50),
        ..RedisOptions::default()
    };
    let s = store(&server, rules, options).await;
    s.check(&one("k")).await.unwrap();
    // DEBUG SLEEP blocks the server for a second; the reply to it comes late,
    // so send it from a thread and check while the server sleeps.
    let port = server.port();
    let sleeper = std::thread::spawn(move || {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        std::io::Write::write_all(&mut stream, b"DEBUG SLEEP 1\r\n").unwrap();
        let mut buf = [0u8; 16];
        std::io::Read::read(&mut stream, &mut buf).ok();
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let verdict = s.check(&one("k")).await.unwrap();
    let waited = started.elapsed();
    // Fail open, after the 50 ms timeout rather than the server's second.
    assert!(verdict.allowed);
    assert_eq!(s.stats().fail_open, 1);
    assert!(waited < Duration::from_millis(400), "waited {waited:?}");
    sleeper.join().unwrap();
}

#[tokio::test]
async fn refund_gives_back_an_admitted_charge() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let hour = Duration::from_secs(3600);
    let rules = vec![
        Rule::new("fw", FixedWindow::new(per(5, hour))),
        Rule::new("tb", TokenBucket::new(per(1, hour), nz(5))),
        Rule::new("log", SlidingLog::new(per(5, hour))),
    ];
    let s = store(&server, rules, RedisOptions::default()).await;
    let request: Vec<Check<'_>> = (0..3)
        .map(|r| Check {
            rule: RuleId(r),
            key: "shaped",
            cost: 2,
        })
        .collect();
    let verdict = s.check(&request).await.unwrap();
    assert!(verdict.allowed);
    assert!(
        verdict.decided_at > 1_500_000_000_000_000,
        "the server's clock, in µs"
    );
    s.refund(&request, verdict.decided_at).await.unwrap();
    let peek: Vec<Check<'_>> = request.iter().map(|c| Check { cost: 0, ..*c }).collect();
    let after = s.check(&peek).await.unwrap();
    for d in &after.decisions {
        assert_eq!(d.remaining, 5, "{d:?}");
    }
}

/// The node id and port of the cluster node that owns `slot`.
fn owner_of(cluster: &RedisCluster, slot: u16) -> (String, u16) {
    // Every node knows the whole map; ask the first.
    if let Some(node) = cluster.nodes().first() {
        let nodes = node.command("CLUSTER NODES");
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if fields.len() < 9 || !fields[2].contains("master") {
                continue;
            }
            let owns = fields[8..].iter().any(|range| {
                let mut ends = range.trim().split('-');
                let lo: u16 = ends.next().and_then(|v| v.parse().ok()).unwrap_or(u16::MAX);
                let hi: u16 = ends.next().and_then(|v| v.parse().ok()).unwrap_or(lo);
                (lo..=hi).contains(&slot)
            });
            if owns {
                let port: u16 = fields[1]
                    .split('@')
                    .next()
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|p| p.parse().ok())
                    .unwrap();
                return (fields[0].to_string(), port);
            }
        }
    }
    panic!("no node owns slot {slot}");
}

#[tokio::test]
async fn cluster_follows_ask_and_moved_while_a_slot_migrates() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let hour = Duration::from_secs(3600);
    let rules = vec![Rule::new("mig", FixedWindow::new(per(10, hour)))];
    let s = cluster_store(&cluster, rules, RedisOptions::default()).await;
    let redis_key = "spillway:{mig:client}:fwi:3600000000";
    let slot = spillway_redis::slot(redis_key.as_bytes());
    for _ in 0..3 {
        assert!(s.check(&one("client")).await.unwrap().allowed);
    }
    let (source_id, source_port) = owner_of(&cluster, slot);
    let source = cluster
        .nodes()
        .iter()
        .find(|n| n.port() == source_port)
        .unwrap();
    let target = cluster
        .nodes()
        .iter()
        .find(|n| n.port() != source_port)
        .unwrap();
    let target_id = target
        .command("CLUSTER MYID")
        .lines()
        .nth(1)
        .unwrap()
        .trim()
        .to_string();

    // Mid-migration: the key has moved, the slot not yet: the source answers
    // ASK, and the client must follow it with ASKING.
    assert!(
        target
            .command(&format!("CLUSTER SETSLOT {slot} IMPORTING {source_id}"))
            .starts_with("+OK")
    );
    assert!(
        source
            .command(&format!("CLUSTER SETSLOT {slot} MIGRATING {target_id}"))
            .starts_with("+OK")
    );
    let migrated = source.command(&format!(
        "MIGRATE 127.0.0.1 {} \"\" 0 5000 KEYS {redis_key}",
        target.port()
    ));
    assert!(migrated.starts_with("+OK"), "{migrated}");
    let d = s.check(&one("client")).await.unwrap();
    assert!(d.allowed);
    assert_eq!(d.decisions[0].remaining, 6, "the state moved with the key");

    // The slot now belongs to the target: the source answers MOVED.
    for node in cluster.nodes() {
        node.command(&format!("CLUSTER SETSLOT {slot} NODE {target_id}"));
    }
    let d = s.check(&one("client")).await.unwrap();
    assert_eq!(d.decisions[0].remaining, 5);
    assert_eq!(s.stats().redis_errors, 0);
}

/// One master stalls (CLIENT PAUSE: commands held, not refused) while the
/// slot map changes (a slot moves between the two other masters): the
/// calls to the other masters are still answered by Redis, in time.
/// redis-rs's cluster client holds every request while it rebuilds its
/// slot map after a MOVED, and rebuilding pings every node, the stalled
/// one too: before the store routed its own calls, the checks here waited
/// past the timeout and failed open.
#[tokio::test]
async fn a_stalled_master_holds_no_call_to_the_others_while_a_slot_moves() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let hour = Duration::from_secs(3600);
    let rules = vec![Rule::new("r", FixedWindow::new(per(1000, hour)))];
    let timeout = Duration::from_millis(200);
    let options = RedisOptions {
        timeout,
        deny_cache_entries: 0,
        ..RedisOptions::default()
    };
    let s = cluster_store(&cluster, rules, options).await;
    let slot_of = |key: &str| spillway_redis::slot(format!("r:{key}").as_bytes());
    let port_of = |key: &str| owner_of(&cluster, slot_of(key)).1;
    let node = |port: u16| cluster.nodes().iter().find(|n| n.port() == port).unwrap();
    // A key on each master (stalled, second, third), and one more on the
    // second master, in a slot of its own, that moves to the third. The
    // stalled master is slot 0's, the first in CLUSTER SLOTS' answer.
    let first = owner_of(&cluster, 0).1;
    let mut keys: Vec<String> = vec![
        (0..)
            .map(|i| format!("s{i}"))
            .find(|k| port_of(k) == first)
            .unwrap(),
    ];
    for i in 0.. {
        let key = format!("k{i}");
        if keys.iter().all(|k| port_of(k) != port_of(&key)) {
            keys.push(key);
        }
        if keys.len() == 3 {
            break;
        }
    }
    let moving = (0..)
        .map(|i| format!("m{i}"))
        .find(|m| port_of(m) == port_of(&keys[1]) && slot_of(m) != slot_of(&keys[1]))
        .unwrap();
    for key in &keys {
        assert!(s.check(&one(key)).await.unwrap().allowed);
    }
    let (stalled, second, third) = (
        node(port_of(&keys[0])),
        node(port_of(&keys[1])),
        node(port_of(&keys[2])),
    );
    let third_id = third
        .command("CLUSTER MYID")
        .lines()
        .nth(1)
        .unwrap()
        .trim()
        .to_string();
    assert!(stalled.command("CLIENT PAUSE 3000 ALL").starts_with("+OK"));
    for n in [third, second] {
        let reply = n.command(&format!(
            "CLUSTER SETSLOT {} NODE {third_id}",
            slot_of(&moving)
        ));
        assert!(reply.starts_with("+OK"), "{reply}");
    }
    let before = s.stats();
    // The moved key: a MOVED from the second master, followed to the third.
    let d = s.check(&one(&moving)).await.unwrap();
    assert_eq!(d.decisions[0].remaining, 999, "decided by Redis");
    // Then the healthy masters' keys, for a second: each decided by Redis.
    for round in 0..25 {
        for (key, remaining) in [(&keys[1], 998 - round), (&keys[2], 998 - round)] {
            let sent = Instant::now();
            let d = s.check(&one(key)).await.unwrap();
            assert!(
                sent.elapsed() < timeout,
                "round {round}: {:?}",
                sent.elapsed()
            );
            assert_eq!(d.decisions[0].remaining, remaining, "round {round}");
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let after = s.stats();
    assert_eq!(after.fail_open, before.fail_open);
    assert_eq!(after.redis_errors, before.redis_errors);
    stalled.command("CLIENT UNPAUSE");
}

/// A master that hangs (SIGSTOP: it neither answers nor refuses) is
/// failed over by the cluster to its replica. The store's calls to it only
/// time out, and no node redirects them: a timeout must send the store for
/// a new slot map, or it waits on the hung master for good.
#[tokio::test]
async fn a_hung_master_is_left_for_its_promoted_replica() {
    let Some(cluster) = RedisCluster::start_with_replicas(&free_ports(6), None, 1000) else {
        return;
    };
    let hour = Duration::from_secs(3600);
    let rules = vec![Rule::new("r", FixedWindow::new(per(1000, hour)))];
    let options = RedisOptions {
        timeout: Duration::from_millis(100),
        deny_cache_entries: 0,
        ..RedisOptions::default()
    };
    let s = cluster_store(&cluster, rules, options).await;
    assert_eq!(
        s.check(&one("k")).await.unwrap().decisions[0].remaining,
        999
    );
    let master = cluster
        .master_of("spillway:{r:k}:fwi:3600000000")
        .expect("a master holds the key");
    // The replica has copied the charge before its master hangs.
    let acked = cluster.nodes()[master].command("WAIT 1 5000");
    assert!(acked.starts_with(":1"), "{acked}");
    let master_port = format!("master_port:{}", cluster.nodes()[master].port());
    let replica = (0..cluster.nodes().len())
        .find(|&i| {
            cluster.nodes()[i]
                .command("INFO replication")
                .contains(&master_port)
        })
        .expect("the master has a replica");
    cluster.nodes()[master].pause();
    let paused = Instant::now();
    let mut promoted: Option<Instant> = None;
    // Decided by Redis again (fail_open's answers know of no charge),
    // soon after the replica took over.
    loop {
        let d = s.check(&one("k")).await.unwrap();
        if d.decisions[0].remaining < 999 {
            break;
        }
        if promoted.is_none() && cluster.nodes()[replica].command("ROLE").contains("master") {
            promoted = Some(Instant::now());
        }
        let since = promoted.map_or(Duration::ZERO, |p| p.elapsed());
        assert!(
            since < Duration::from_secs(2) && paused.elapsed() < Duration::from_secs(20),
            "not decided by Redis {since:?} after the replica took over, {:?} after \
             the master hung",
            paused.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "decided by the promoted replica {:?} after the master hung, {:?} after it took over",
        paused.elapsed(),
        promoted.map(|p| p.elapsed())
    );
}

#[tokio::test]
async fn windows_of_a_million_a_day_count_exactly() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    // limit x window is 8.64e16 µs, past 2^53: only the sliding window's
    // weighting needs that product exact, so the fixed window is accepted.
    // The sliding log's limit is bounded by its walk instead (10,000).
    let day = Duration::from_secs(86_400);
    let rules = vec![
        Rule::new("fw", FixedWindow::new(per(1_000_000, day))),
        Rule::new("log", SlidingLog::new(per(1_000_000, day))),
    ];
    let refused = RedisStore::connect(
        Topology::Standalone(server.url()),
        rules.clone(),
        RedisOptions::default(),
    )
    .await
    .expect_err("a sliding log of a million is refused");
    assert!(refused.to_string().contains("`log`"), "{refused}");
    let rules = vec![rules[0].clone()];
    let s = store(&server, rules, RedisOptions::default()).await;
    for rule in [RuleId(0)] {
        let check = |cost| {
            [Check {
                rule,
                key: "client",
                cost,
            }]
        };
        let first = s.check(&check(999_998)).await.expect("decides");
        assert!(first.allowed);
        assert_eq!(first.decisions[0].remaining, 2);
        for left in [1, 0] {
            let next = s.check(&check(1)).await.expect("decides");
            assert!(next.allowed);
            assert_eq!(next.decisions[0].remaining, left);
        }
        let over = s.check(&check(1)).await.expect("decides");
        assert!(!over.allowed, "{rule:?}: the million and first is denied");
        assert!(over.decisions[0].retry_after.is_some_and(|r| r <= day));
    }
    let refused = RedisStore::connect(
        Topology::Standalone(server.url()),
        vec![Rule::new("sw", SlidingWindow::new(per(1_000_000, day)))],
        RedisOptions::default(),
    )
    .await
    .expect_err("a sliding window this large is refused");
    assert!(refused.to_string().contains("sw"), "{refused}");
}

#[tokio::test]
async fn a_reload_that_changes_a_window_starts_it_afresh() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    // The same rule and key, before and after a reload that takes the
    // window from a millisecond to an hour. The windows' state counts
    // windows by number: read under the new length, the old number would
    // put the window's end past 2^53 µs. The new length is a new counter.
    let ms = Duration::from_millis(1);
    let hour = Duration::from_secs(3600);
    for (name, before, after) in [
        (
            "fw",
            AnyAlgorithm::from(FixedWindow::new(per(2, ms))),
            AnyAlgorithm::from(FixedWindow::new(per(2, hour))),
        ),
        (
            "sw",
            SlidingWindow::new(per(2, ms)).into(),
            SlidingWindow::new(per(2, hour)).into(),
        ),
    ] {
        let old = store(
            &server,
            vec![Rule::new(name, before)],
            RedisOptions::default(),
        )
        .await;
        assert!(old.check(&one("k")).await.expect("decides").allowed);
        let new = store(
            &server,
            vec![Rule::new(name, after)],
            RedisOptions::default(),
        )
        .await;
        for remaining in [1, 0] {
            let d = new.check(&one("k")).await.expect("decides");
            assert!(d.allowed, "{name}");
            assert_eq!(d.decisions[0].remaining, remaining, "{name}");
            assert!(d.decisions[0].reset_after <= 2 * hour, "{name}");
        }
        assert!(
            !new.check(&one("k")).await.expect("decides").allowed,
            "{name}"
        );
    }
}

/// How many clients the server has connected.
fn connected_clients(server: &RedisServer) -> u64 {
    let info = server.command("INFO clients");
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("INFO clients has connected_clients")
}

#[tokio::test]
async fn with_rules_adds_a_rule_on_the_same_connection_and_keeps_counts() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let minute = Duration::from_secs(60);
    let a = Rule::new("a", FixedWindow::new(per(3, minute)));
    let s = store(&server, vec![a.clone()], RedisOptions::default()).await;
    assert!(s.check(&one("k")).await.unwrap().allowed);
    let clients = connected_clients(&server);

    let b = Rule::new("b", SlidingWindow::new(per(2, minute)));
    let wider = s.with_rules(vec![a, b]).expect("the quotas fit");
    assert_eq!(wider.rules().len(), 2);
    // "a" kept its count (2 of 3 left before this one).
    let d = wider.check(&one("k")).await.unwrap();
    assert_eq!(d.decisions[0].remaining, 1);
    // "b" is counted on its own, exactly.
    let b_check = [Check {
        rule: RuleId(1),
        key: "k",
        cost: 1,
    }];
    let admitted: Vec<bool> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.push(wider.check(&b_check).await.unwrap().allowed);
        }
        out
    };
    assert_eq!(admitted, [true, true, false]);
    // No new connection; the statistics are the first store's too.
    assert_eq!(connected_clients(&server), clients);
    assert_eq!(s.stats().redis_calls, wider.stats().redis_calls);
    assert_eq!(wider.stats().redis_calls, 5);
    // The old store still works, on the same counts: the third of 3, then
    // a denial.
    assert!(s.check(&one("k")).await.unwrap().allowed);
    assert!(!wider.check(&one("k")).await.unwrap().allowed);
}

/// As the in-memory store does on a reload: a rule whose limit changes
/// keeps every key's count, raised or lowered, under each window algorithm
/// (its keys are the rule's name and the key, whatever the limit).
#[tokio::test]
async fn a_changed_limit_keeps_every_keys_count() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let minute = Duration::from_secs(60);
    let windows: [fn(Quota) -> AnyAlgorithm; 3] = [
        |q| FixedWindow::new(q).into(),
        |q| SlidingWindow::new(q).into(),
        |q| SlidingLog::new(q).into(),
    ];
    for (i, make) in windows.into_iter().enumerate() {
        let key = format!("k{i}");
        let charge = |cost| {
            [Check {
                rule: RuleId(0),
                key: &key,
                cost,
            }]
        };
        let five = store(
            &server,
            vec![Rule::new("r", make(per(5, minute)))],
            RedisOptions::default(),
        )
        .await;
        assert!(five.check(&charge(4)).await.unwrap().allowed);
        let ten = store(
            &server,
            vec![Rule::new("r", make(per(10, minute)))],
            RedisOptions::default(),
        )
        .await;
        let peek = ten.check(&charge(0)).await.unwrap().decisions[0];
        assert_eq!(peek.remaining, 6, "{}", make(per(1, minute)).name());
        assert!(ten.check(&charge(6)).await.unwrap().allowed);
        let three = store(
            &server,
            vec![Rule::new("r", make(per(3, minute)))],
            RedisOptions::default(),
        )
        .await;
        let denied = three.check(&charge(1)).await.unwrap();
        assert!(!denied.allowed, "10 used of 3");
        assert_eq!(denied.decisions[0].remaining, 0);
    }
}

/// How many fields the hash at `key` holds (a sliding log's entries, plus
/// its three header fields).
fn hash_len(server: &RedisServer, key: &str) -> u64 {
    let reply = server.command(&format!("HLEN {key}"));
    reply.trim().trim_start_matches(':').parse().unwrap()
}

/// A denial and a peek save the entries they dropped: the next check does
/// not walk them again (before, only an admitted charge deleted them, so an
/// attacker kept denied made every check rescan the whole expired log).
#[tokio::test]
async fn a_sliding_logs_denials_and_peeks_delete_what_expired() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let second = Duration::from_secs(1);
    let rules = vec![Rule::new("log", SlidingLog::new(per(10, second)))];
    let s = store(&server, rules, RedisOptions::default()).await;
    let key = "spillway:{log:k}:sl";
    let at = |cost| {
        [Check {
            rule: RuleId(0),
            key: "k",
            cost,
        }]
    };
    let t0 = 1_700_000_000_000_000u64;
    // Ten entries, 1 ms apart: the log is full.
    for i in 0..10 {
        assert!(s.check_at(&at(1), t0 + i * 1000).await.unwrap().allowed);
    }
    assert_eq!(hash_len(&server, key), 3 + 10);
    // Four have left the window; a cost of 5 does not fit in the 4 free.
    let denied = s.check_at(&at(5), t0 + 1_003_500).await.unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.decisions[0].remaining, 4);
    assert_eq!(hash_len(&server, key), 3 + 6, "the denial deleted the four");
    // A peek deletes what expired since.
    let peek = s.check_at(&at(0), t0 + 1_005_500).await.unwrap();
    assert_eq!(peek.decisions[0].remaining, 6);
    assert_eq!(hash_len(&server, key), 3 + 4, "the peek deleted two more");
    // The general script (two checks, one denying) saves them too.
    let two = [
        Check {
            rule: RuleId(0),
            key: "k",
            cost: 1,
        },
        Check {
            rule: RuleId(0),
            key: "other",
            cost: 11,
        },
    ];
    assert!(s.check_at(&two, t0 + 1_007_500).await.is_err(), "11 > 10");
    let two = [two[0], Check { cost: 10, ..two[1] }];
    let a = s.check_at(&two, t0 + 1_007_500).await.unwrap();
    assert!(a.allowed);
    let b = s.check_at(&two, t0 + 1_008_500).await.unwrap();
    assert!(!b.allowed, "`other` is full");
    // Entries 6 and 7 left at the admission, 8 at the denial: 9 and the
    // one charged at 1.0075 s are left.
    assert_eq!(hash_len(&server, key), 3 + 2, "the denial deleted entry 8");
}

/// Redis Cluster: one node that does not answer cannot turn another node's
/// denial into an admission (before, its error reached the failure policy,
/// and fail_open admitted a request that the limit denied).
#[tokio::test]
async fn a_denial_wins_over_a_node_that_does_not_answer() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let (s, wide, narrow) = two_node_store(&cluster).await;
    let request = [
        Check {
            rule: RuleId(0),
            key: &wide,
            cost: 1,
        },
        Check {
            rule: RuleId(1),
            key: &narrow,
            cost: 1,
        },
    ];
    assert!(s.check(&request).await.unwrap().allowed);
    // The node of `wide` stops answering for a second.
    pause_owner(&cluster, "wide", &wide);
    let denied = s.check(&request).await.expect("a denial, not an error");
    assert!(!denied.allowed, "narrow is at its limit");
    assert!(!denied.decisions[1].allowed);
    // Now `wide`'s breaker is open: its node is not asked, `narrow`'s is,
    // and its denial still wins.
    assert_eq!(s.open_breakers(), 1);
    let calls = s.stats().redis_calls;
    let denied = s.check(&request).await.expect("a denial, not an error");
    assert!(!denied.allowed, "narrow is still at its limit");
    assert_eq!(
        s.stats().redis_calls,
        calls + 1,
        "only narrow's node was asked"
    );
    assert_eq!(s.stats().fail_open, 0);
}

/// The breakers are per slot: while one node does not answer, the keys of
/// the others are still decided by Redis (before, one failure marked the
/// whole store down, and fail_open admitted every key).
#[tokio::test]
async fn one_silent_node_leaves_the_others_keys_exact() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let (s, wide, narrow) = two_node_store(&cluster).await;
    let on = |rule, key| {
        [Check {
            rule: RuleId(rule),
            key,
            cost: 1,
        }]
    };
    assert!(s.check(&on(1, &narrow)).await.unwrap().allowed);
    assert!(!s.check(&on(1, &narrow)).await.unwrap().allowed);
    pause_owner(&cluster, "wide", &wide);
    // The silent node's key fails open after the timeout...
    assert!(s.check(&on(0, &wide)).await.unwrap().allowed);
    assert_eq!(s.stats().fail_open, 1);
    assert!(!s.is_healthy());
    assert_eq!(s.open_breakers(), 1);
    // ... and the other node's key is still denied by Redis.
    let calls = s.stats().redis_calls;
    assert!(!s.check(&on(1, &narrow)).await.unwrap().allowed);
    assert_eq!(s.stats().redis_calls, calls + 1);
    assert_eq!(s.stats().fail_open, 1);
}

/// A store on `cluster` with rules `wide` (10 an hour) and `narrow` (1 an
/// hour), and a key for each whose slots two different nodes own.
async fn two_node_store(cluster: &RedisCluster) -> (RedisStore, String, String) {
    let hour = Duration::from_secs(3600);
    let rules = vec![
        Rule::new("wide", FixedWindow::new(per(10, hour))),
        Rule::new("narrow", FixedWindow::new(per(1, hour))),
    ];
    let options = RedisOptions {
        deny_cache_entries: 0,
        ..RedisOptions::default()
    };
    let s = cluster_store(cluster, rules, options).await;
    let owner = |rule: &str, key: &str| {
        owner_of(
            cluster,
            spillway_redis::slot(format!("{rule}:{key}").as_bytes()),
        )
        .1
    };
    let wide = "user-1".to_string();
    let narrow = (0..)
        .map(|i| format!("ip-{i}"))
        .find(|k| owner("narrow", k) != owner("wide", &wide))
        .unwrap();
    (s, wide, narrow)
}

/// Makes the node that owns `rule`'s `key` hold every command for a
/// second (CLIENT PAUSE): a hang, not a refusal.
fn pause_owner(cluster: &RedisCluster, rule: &str, key: &str) {
    let port = owner_of(
        cluster,
        spillway_redis::slot(format!("{rule}:{key}").as_bytes()),
    )
    .1;
    let node = cluster.nodes().iter().find(|n| n.port() == port).unwrap();
    assert!(node.command("CLIENT PAUSE 1000 ALL").starts_with("+OK"));
}

/// One rule, `r`: a fixed window of `limit` an hour.
fn hourly(limit: u32) -> Vec<Rule> {
    vec![Rule::new(
        "r",
        FixedWindow::new(per(limit, Duration::from_secs(3600))),
    )]
}

/// No deny cache (every check reaches Redis), and a breaker that lets a
/// probe through every 50 ms: a test of recovery waits little.
fn quick_retries() -> RedisOptions {
    RedisOptions {
        deny_cache_entries: 0,
        retry_interval: Duration::from_millis(50),
        ..RedisOptions::default()
    }
}

/// A data error (here a key of another type) fails its own request by the
/// policy and leaves the store up: the other keys are still decided by
/// Redis (before, it marked the whole store down for the retry interval).
#[tokio::test]
async fn a_data_error_fails_one_request_not_the_store() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rules = hourly(1);
    let options = RedisOptions {
        deny_cache_entries: 0,
        ..RedisOptions::default()
    };
    let s = store(&server, rules, options).await;
    assert!(s.check(&one("full")).await.unwrap().allowed);
    assert!(!s.check(&one("full")).await.unwrap().allowed);
    let reply = server.command("RPUSH spillway:{r:broken}:fwi:3600000000 x");
    assert!(reply.starts_with(':'), "{reply}");
    // fail_open, the default: the broken key's request is admitted.
    assert!(s.check(&one("broken")).await.unwrap().allowed);
    assert_eq!(s.stats().data_errors, 1);
    assert!(s.is_healthy());
    let calls = s.stats().redis_calls;
    assert!(!s.check(&one("full")).await.unwrap().allowed);
    assert_eq!(s.stats().redis_calls, calls + 1, "Redis decided it");
}

/// A Redis that refuses every write (short of the replicas it must write
/// to, or full under `noeviction`) is an outage: the breaker opens, the
/// failure policy answers, and Redis decides again once it takes writes.
/// Before, its refusals (NOREPLICAS, OOM) were counted as errors of one
/// key's data: the breaker stayed closed and the store said it was healthy.
#[tokio::test]
async fn a_redis_that_refuses_writes_is_an_outage() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rules = hourly(100);
    let options = quick_retries();
    let s = store(&server, rules, options).await;
    let mut remaining = s.check(&one("k")).await.unwrap().decisions[0].remaining;
    assert_eq!(remaining, 99);
    for (refuse, accept) in [
        (
            "CONFIG SET min-replicas-to-write 1",
            "CONFIG SET min-replicas-to-write 0",
        ),
        ("CONFIG SET maxmemory 1", "CONFIG SET maxmemory 0"),
    ] {
        assert!(server.command(refuse).starts_with("+OK"), "{refuse}");
        let before = s.stats();
        // fail_open, the default: admitted, undecided.
        assert!(s.check(&one("k")).await.unwrap().allowed);
        let after = s.stats();
        assert_eq!(after.redis_errors, before.redis_errors + 1, "{refuse}");
        assert_eq!(after.data_errors, before.data_errors, "{refuse}");
        assert!(!s.is_healthy(), "{refuse}: the breaker is open");
        assert!(server.command(accept).starts_with("+OK"), "{accept}");
        let decided = eventually(Duration::from_secs(5), async || {
            s.check(&one("k")).await.unwrap().decisions[0].remaining == remaining - 1
        })
        .await;
        assert!(decided && s.is_healthy(), "{accept}: Redis decides again");
        remaining -= 1;
    }
}

/// A connection whose set-up was refused is made again. Here the store's
/// ACL user gets a new password (a rotation half rolled out) and its
/// connection is cut: every reconnection is refused, and once the old
/// password is back, Redis decides again. Before, the connection manager
/// kept the refused set-up and gave its error to every later call, for as
/// long as the process ran.
#[tokio::test]
async fn a_refused_connection_is_made_again() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let user = "ACL SETUSER limiter on >first ~* &* +@all";
    assert!(server.command(user).starts_with("+OK"));
    let url = format!("redis://limiter:first@127.0.0.1:{}", server.port());
    let rules = hourly(100);
    let options = quick_retries();
    let s = RedisStore::connect(Topology::Standalone(url), rules, options)
        .await
        .expect("connects");
    assert_eq!(s.check(&one("k")).await.unwrap().decisions[0].remaining, 99);
    let rotated = server.command("ACL SETUSER limiter resetpass >second");
    assert!(rotated.starts_with("+OK"), "{rotated}");
    let cut = server.command("CLIENT KILL USER limiter");
    assert!(cut.starts_with(":1"), "{cut}");
    // Refused: answered by fail_open, for more than a few retry intervals.
    let refused = eventually(Duration::from_secs(5), async || {
        s.check(&one("k")).await.unwrap();
        s.stats().redis_errors >= 3
    })
    .await;
    assert!(refused && !s.is_healthy());
    assert!(
        server
            .command("ACL SETUSER limiter >first")
            .starts_with("+OK")
    );
    let decided = eventually(Duration::from_secs(5), async || {
        s.check(&one("k")).await.unwrap().decisions[0].remaining == 98
    })
    .await;
    assert!(decided, "Redis decides again");
    assert!(s.is_healthy());
}

/// A URL that asks for RESP3 is refused with a clear error: over RESP3 a
/// refused set-up cannot be told from a server's answer to a call.
#[tokio::test]
async fn a_url_asking_for_resp3_is_refused() {
    for topology in [
        Topology::Standalone("redis://127.0.0.1:1/?protocol=resp3".into()),
        Topology::Cluster(vec!["redis://127.0.0.1:1/?protocol=resp3".into()]),
    ] {
        let rules = vec![Rule::new(
            "r",
            FixedWindow::new(per(1, Duration::from_secs(1))),
        )];
        let error = RedisStore::connect(topology, rules, RedisOptions::default())
            .await
            .expect_err("refused");
        assert!(error.to_string().contains("RESP2"), "{error}");
    }
}

/// The local fallback's charges are given back to the fallback, not to
/// Redis, which never saw them; a cost above an instance's share is
/// denied, not a bad request; and a limit below the instance count cannot
/// be shared.
#[tokio::test]
async fn the_local_fallback_refunds_its_own_charges() {
    if RedisServer::start().is_none() {
        return;
    }
    let (mut server, s) = outage(OnError::Local { instances: nz(2) }).await;
    server.kill();
    let first = s.check(&one("k")).await.unwrap();
    assert!(first.allowed);
    assert!(s.check(&one("k")).await.unwrap().allowed);
    assert!(!s.check(&one("k")).await.unwrap().allowed, "2 of 4 each");
    s.refund(&one("k"), first.decided_at).await.unwrap();
    assert!(
        s.check(&one("k")).await.unwrap().allowed,
        "given back locally"
    );
    let three = [Check {
        rule: RuleId(0),
        key: "j",
        cost: 3,
    }];
    let beyond = s.check(&three).await.expect("a denial, not an error");
    assert!(!beyond.allowed);
    assert_eq!(beyond.decisions[0].limit, 2);
    assert!(beyond.decisions[0].retry_after.is_some());

    let refused = RedisStore::connect(
        Topology::Standalone(server.url()),
        vec![Rule::new(
            "few",
            FixedWindow::new(per(2, Duration::from_secs(60))),
        )],
        RedisOptions {
            on_error: OnError::Local { instances: nz(3) },
            ..RedisOptions::default()
        },
    )
    .await
    .expect_err("2 cannot be shared by 3");
    assert!(refused.to_string().contains("few"), "{refused}");
}

/// A sliding log's refund of a charge that already left the window gives
/// nothing back (before, it took the cost from the next entry, another
/// request's charge, handing that request's unit out again).
#[tokio::test]
async fn a_refund_after_the_charge_expired_takes_nothing_from_newer_ones() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let window = Duration::from_millis(300);
    let rules = vec![Rule::new("log", SlidingLog::new(per(2, window)))];
    let options = RedisOptions {
        deny_cache_entries: 0,
        ..RedisOptions::default()
    };
    let s = store(&server, rules, options).await;
    let first = s.check(&one("k")).await.unwrap();
    assert!(first.allowed);
    // Redis's clock is this machine's: past the window, the first charge
    // has left it, whatever the load.
    tokio::time::sleep(window + Duration::from_millis(50)).await;
    assert!(s.check(&one("k")).await.unwrap().allowed);
    s.refund(&one("k"), first.decided_at).await.unwrap();
    let peek = [Check {
        rule: RuleId(0),
        key: "k",
        cost: 0,
    }];
    let left = s.check(&peek).await.unwrap().decisions[0].remaining;
    assert_eq!(left, 1, "the second charge still counts");
}

/// A refund sent twice with one receipt gives back once: the store can
/// send a refund again after a lost answer without handing out the cost
/// twice.
#[tokio::test]
async fn a_refund_sent_again_with_its_receipt_gives_back_once() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rules = vec![Rule::new(
        "r",
        FixedWindow::new(per(10, Duration::from_secs(3600))),
    )];
    let s = store(&server, rules, RedisOptions::default()).await;
    let both = [
        Check {
            rule: RuleId(0),
            key: "a",
            cost: 1,
        },
        Check {
            rule: RuleId(0),
            key: "b",
            cost: 1,
        },
    ];
    s.check(&both).await.unwrap();
    let second = s.check(&both).await.unwrap();
    assert_eq!(second.decisions[0].remaining, 8);
    // The general script's refund of the second charge, as the store sends
    // it: the time of the charge second, the receipt key last.
    let call = s.script_call(&both).unwrap();
    let script = redis::Script::new(&call.source);
    let mut connection = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let receipt = format!("{}:refund:test", call.keys[0]);
    for _ in 0..2 {
        let mut refund = script.prepare_invoke();
        refund.key(&call.keys).key(&receipt);
        refund.arg("").arg(second.decided_at).arg(&call.args[2..]);
        let _: Vec<i64> = refund.invoke_async(&mut connection).await.unwrap();
    }
    let peek = [Check { cost: 0, ..both[0] }, Check { cost: 0, ..both[1] }];
    let after = s.check(&peek).await.unwrap();
    assert_eq!(
        after.decisions[0].remaining, 9,
        "given back once, not twice"
    );
    assert_eq!(after.decisions[1].remaining, 9);
}

/// While one node does not answer, an admitted request reports what the
/// nodes that answered decided, not an unknown full quota.
#[tokio::test]
async fn an_admission_reports_what_the_answering_node_decided() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let (s, wide, narrow) = two_node_store(&cluster).await;
    let request = [
        Check {
            rule: RuleId(0),
            key: &wide,
            cost: 1,
        },
        Check {
            rule: RuleId(1),
            key: &narrow,
            cost: 1,
        },
    ];
    // The general script loaded first: on NOSCRIPT the client loads it on
    // every master, the paused one too, which would hold both calls.
    let peek = [
        Check {
            cost: 0,
            ..request[0]
        },
        Check {
            cost: 0,
            ..request[1]
        },
    ];
    assert!(s.check(&peek).await.unwrap().allowed);
    pause_owner(&cluster, "wide", &wide);
    let admitted = s.check(&request).await.expect("fail_open admits");
    assert!(admitted.allowed);
    assert_eq!(admitted.decisions[0].remaining, 10, "wide: unknown");
    assert_eq!(
        admitted.decisions[1].remaining, 0,
        "narrow: Redis charged it"
    );
}

/// Every key of `rule` that `s.keys` lists, page by page, until its cursor
/// ends: each key once per page it is on.
async fn list_all(s: &RedisStore, rule: RuleId, count: usize) -> Vec<String> {
    let mut all = Vec::new();
    let mut cursor = spillway_redis::KeyCursor::default();
    for _ in 0..10_000 {
        let (page, next) = s.keys(rule, cursor, count).await.expect("a page");
        all.extend(page);
        match next {
            // The cursor goes through its text form, as the admin API's.
            Some(next) => cursor = next.to_string().parse().expect("a cursor"),
            None => return all,
        }
    }
    panic!("the listing never ended");
}

/// The keys a rule holds are listed, unescaped, on one server and across
/// a cluster's masters; another rule's keys, and the same rule's under
/// another window, are not.
#[tokio::test]
async fn the_keys_a_rule_holds_are_listed_on_a_server_and_a_cluster() {
    let hour = Duration::from_secs(3600);
    let rules = || {
        vec![
            Rule::new("listed", FixedWindow::new(per(10, hour))),
            Rule::new("other", FixedWindow::new(per(10, hour))),
        ]
    };
    // Keys with the characters the Redis key escapes, and a glob's.
    let mut keys: Vec<String> = (0..300)
        .map(|i| format!("ip=10.0.{}.{}", i / 256, i % 256))
        .collect();
    keys.extend(["a:b", "{tag}", "100%", "x*y?[z]"].map(String::from));
    let check = |s: &RedisStore, rule: usize, key: &str| {
        let s = s.clone();
        let key = key.to_string();
        async move {
            let c = [Check {
                rule: RuleId(rule),
                key: &key,
                cost: 1,
            }];
            s.check(&c).await.expect("a decision");
        }
    };
    let mut expected = keys.clone();
    expected.sort();

    let Some(server) = RedisServer::start() else {
        return;
    };
    let s = store(&server, rules(), RedisOptions::default()).await;
    for key in &keys {
        check(&s, 0, key).await;
    }
    check(&s, 1, "ip=9.9.9.9").await;
    for count in [7, 1000] {
        let mut listed = list_all(&s, RuleId(0), count).await;
        listed.sort();
        listed.dedup();
        assert_eq!(listed, expected, "pages of {count}");
    }
    // The same rule under another window keeps other keys: not listed.
    let moved = RedisStore::connect(
        Topology::Standalone(server.url()),
        vec![Rule::new("listed", FixedWindow::new(per(10, hour * 2)))],
        RedisOptions::default(),
    )
    .await
    .expect("connects");
    assert!(list_all(&moved, RuleId(0), 100).await.is_empty());
    assert!(s.holds(RuleId(0), "a:b").await.expect("an answer"));
    assert!(!s.holds(RuleId(0), "nobody").await.expect("an answer"));
    assert!("1-x".parse::<spillway_redis::KeyCursor>().is_err());

    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let s = cluster_store(&cluster, rules(), RedisOptions::default()).await;
    for key in &keys {
        check(&s, 0, key).await;
    }
    check(&s, 1, "ip=9.9.9.9").await;
    let mut listed = list_all(&s, RuleId(0), 50).await;
    listed.sort();
    listed.dedup();
    assert_eq!(listed, expected, "across the masters");
}

//! Concurrency leases on a real redis-server: a renew whose answer was lost
//! and is sent again holds one slot, not two; a key's leases are one sorted
//! set whose every operation costs the same few commands however many
//! leases it holds.

use std::num::NonZeroU32;
use std::time::Duration;

use spillway::Quota;
use spillway::algorithm::{Charged, Concurrency};
use spillway::store::{Check, Renew, Rule, RuleId, Settle, Store};
use spillway_conformance::redis_server::RedisServer;
use spillway_redis::{RedisOptions, RedisStore, Topology};

const KEY: &str = "spillway:{r:k}:ls";

async fn store(server: &RedisServer, slots: u32, options: RedisOptions) -> RedisStore {
    let quota = Quota::new(NonZeroU32::new(slots).unwrap(), Duration::from_secs(30)).unwrap();
    let rules = vec![Rule::new("r", Concurrency::new(quota))];
    RedisStore::connect(Topology::Standalone(server.url()), rules, options)
        .await
        .expect("connects")
}

fn take() -> [Check<'static>; 1] {
    [Check {
        rule: RuleId(0),
        key: "k",
        cost: 1,
    }]
}

/// Takes a slot and answers the charge that names its lease.
async fn lease(store: &RedisStore) -> Charged {
    let verdict = store.check(&take()).await.expect("answers");
    assert!(verdict.allowed);
    Charged::of(1, verdict.decided_at, &verdict.decisions[0])
}

fn renew(charged: Charged) -> [Renew<'static>; 1] {
    [Renew {
        rule: RuleId(0),
        key: "k",
        charged,
    }]
}

/// The members of the key's set and their scores (the time each slot's
/// lease ends, in µs), from the raw RESP reply (of a few members: the
/// reply is read in one piece).
fn members(server: &RedisServer) -> Vec<(String, u64)> {
    let reply = server.command(&format!("ZRANGE {KEY} 0 -1 WITHSCORES"));
    let items: Vec<&str> = reply
        .split("\r\n")
        .filter(|l| !l.is_empty() && !l.starts_with('*') && !l.starts_with('$'))
        .collect();
    items
        .chunks_exact(2)
        .map(|p| (p[0].to_string(), p[1].parse().expect("a score")))
        .collect()
}

/// Every command the server has run, scripts' own included.
fn commands_run(server: &RedisServer) -> u64 {
    server
        .command("INFO commandstats")
        .lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[tokio::test]
async fn a_renew_whose_answer_was_lost_and_is_sent_again_holds_one_slot() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let options = RedisOptions {
        timeout: Duration::from_millis(100),
        ..RedisOptions::default()
    };
    let s = store(&server, 2, options).await;
    let charged = lease(&s).await;
    // A first renew loads the script the renews run.
    assert!(s.renew(&renew(charged)).await.expect("answers")[0].was_held);
    let taken = members(&server);
    assert_eq!(taken.len(), 1);
    // Redis hangs while the next renew is on its way: the call times out,
    // and Redis runs it once it goes on.
    tokio::time::sleep(Duration::from_millis(20)).await;
    server.pause();
    let lost = s.renew(&renew(charged)).await;
    server.resume();
    assert!(lost.is_err(), "{lost:?}");
    let mut ran = false;
    for _ in 0..100 {
        let now = members(&server);
        if now.len() == 1 && now[0].1 > taken[0].1 {
            ran = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ran, "the renew Redis received ran: {:?}", members(&server));
    // The renewer sends it again: the same lease, held, one slot of two.
    let again = s.renew(&renew(charged)).await.expect("answers");
    assert!(again[0].was_held && again[0].decision.allowed);
    assert_eq!(again[0].decision.remaining, 1);
    assert_eq!(members(&server).len(), 1);
    // And its release frees it.
    let release = [Settle {
        rule: RuleId(0),
        key: "k",
        charged,
        actual: 0,
    }];
    s.settle("release-1", &release).await.expect("answers");
    assert!(members(&server).is_empty());
}

#[tokio::test]
async fn a_busy_keys_leases_cost_the_same_few_commands_as_an_idle_keys() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let s = store(&server, 5_000, RedisOptions::default()).await;
    // The cost of a take, a renew and a release on a key with one lease...
    let cost_of = async |s: &RedisStore| {
        let before = commands_run(&server);
        let charged = lease(s).await;
        let taken = commands_run(&server) - before;
        let before = commands_run(&server);
        assert!(s.renew(&renew(charged)).await.expect("answers")[0].was_held);
        let renewed = commands_run(&server) - before;
        let before = commands_run(&server);
        let release = [Settle {
            rule: RuleId(0),
            key: "k",
            charged,
            actual: 0,
        }];
        s.settle(&format!("release-{}", charged.at), &release)
            .await
            .expect("answers");
        let released = commands_run(&server) - before;
        (taken, renewed, released)
    };
    let idle = cost_of(&s).await;
    assert!(idle.0 <= 16 && idle.1 <= 16 && idle.2 <= 16, "{idle:?}");
    // ...and on a key with 3,000 more held: a renew and a release from the
    // middle of the set (the old log walked to them from its newest end),
    // and a take, renew and release of a new one.
    let mut held = Vec::new();
    for _ in 0..3_000 {
        held.push(lease(&s).await);
    }
    let before = commands_run(&server);
    assert!(s.renew(&renew(held[100])).await.expect("answers")[0].was_held);
    let renewed = commands_run(&server) - before;
    let before = commands_run(&server);
    let release = [Settle {
        rule: RuleId(0),
        key: "k",
        charged: held[1_500],
        actual: 0,
    }];
    s.settle("middle", &release).await.expect("answers");
    let released = commands_run(&server) - before;
    let busy = cost_of(&s).await;
    for n in [renewed, released, busy.0, busy.1, busy.2] {
        assert!(
            n <= 16,
            "{n} commands: renew {renewed}, release {released}, {busy:?}"
        );
    }
    assert_eq!(server.command(&format!("ZCARD {KEY}")).trim(), ":2999");
}

//! In-flight limits across instances (issue 29, item 4): `spillway proxy`
//! processes on one real redis-server, in front of an upstream on
//! 127.0.0.1 that counts the requests inside it at every instant.
//!
//! Without redis-server installed these tests skip loudly (and fail with
//! SPILLWAY_REQUIRE_REDIS=1, as in CI).

mod process_support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use process_support::{Conn, Process, Raw, temp_dir};
use spillway_conformance::redis_server::RedisServer;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The longest one answer may take.
const WAIT: Duration = Duration::from_secs(10);

/// An upstream that counts the requests inside it: `GET /work/N` stays N
/// ms, `GET /hold` until [`release`](Counting::release), any other path
/// answers at once.
struct Counting {
    addr: SocketAddr,
    inside: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    /// How many `/hold` requests arrived, in all.
    holds: Arc<AtomicUsize>,
    release: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Counting {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("an address");
        let (inside, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let holds = Arc::new(AtomicUsize::new(0));
        let (release, released) = watch::channel(false);
        let (now, peak, arrived) = (inside.clone(), most.clone(), holds.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (now, peak, released) = (now.clone(), peak.clone(), released.clone());
                let arrived = arrived.clone();
                let service = hyper::service::service_fn(move |req: http::Request<_>| {
                    let path = req.uri().path().to_owned();
                    if path == "/hold" {
                        arrived.fetch_add(1, Ordering::SeqCst);
                    }
                    let (now, peak, mut released) = (now.clone(), peak.clone(), released.clone());
                    async move {
                        drop(req);
                        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(n, Ordering::SeqCst);
                        if let Some(ms) = path.strip_prefix("/work/") {
                            let ms = ms.parse().unwrap_or(10);
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                        } else if path == "/hold" {
                            let _ = released.wait_for(|&r| r).await;
                        }
                        now.fetch_sub(1, Ordering::SeqCst);
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from_static(b"upstream")),
                        ))
                    }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
                );
            }
        });
        Self {
            addr,
            inside,
            most,
            holds,
            release,
            task,
        }
    }

    fn inside(&self) -> usize {
        self.inside.load(Ordering::SeqCst)
    }

    fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }

    fn holds(&self) -> usize {
        self.holds.load(Ordering::SeqCst)
    }

    fn release(&self) {
        let _ = self.release.send(true);
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A config of one concurrency rule of `slots` slots on `redis`, keyed by
/// client IP (every client here is 127.0.0.1: one key), written in `dir`.
fn config(dir: &Path, redis: &RedisServer, slots: u32, lease: &str) -> PathBuf {
    config_with(dir, redis, slots, lease, "timeout = \"2s\"")
}

/// [`config`] with `store` as the `[store]` table's other lines.
fn config_with(dir: &Path, redis: &RedisServer, slots: u32, lease: &str, store: &str) -> PathBuf {
    let path = dir.join("spillway.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nkind = \"redis\"\nurl = \"{}\"\n{store}\n\n\
             [[rules]]\nname = \"in_flight\"\nkey = [\"ip\"]\n\
             algorithm = \"concurrency\"\nlimit = {slots}\nlease = \"{lease}\"\n",
            redis.url()
        ),
    )
    .expect("the config");
    path
}

fn proxy(upstream: &Counting, config: &Path, dir: &Path) -> Process {
    let upstream_url = format!("http://{}", upstream.addr);
    Process::start(
        "proxy",
        &[
            "--upstream",
            &upstream_url,
            "--listen",
            "127.0.0.1:0",
            "--config",
            config.to_str().expect("a UTF-8 path"),
        ],
        dir,
    )
}

fn request(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nhost: app.test\r\nconnection: close\r\n\r\n")
}

/// One request on a fresh connection, answered within [`WAIT`].
async fn send(addr: SocketAddr, path: &str) -> Raw {
    let mut conn = Conn::connect(addr).await;
    conn.send(request(path).as_bytes()).await.expect("sent");
    conn.response(WAIT).await.expect("an answer")
}

/// A request sent and left open (its answer not read): the connection.
async fn open(addr: SocketAddr, path: &str) -> Conn {
    let mut conn = Conn::connect(addr).await;
    conn.send(request(path).as_bytes()).await.expect("sent");
    conn
}

/// A `/hold` request that is let in (and held): sent again while it is
/// denied, for at most `within`.
async fn admitted_and_held(addr: SocketAddr, within: Duration) -> Conn {
    let start = Instant::now();
    loop {
        let mut conn = open(addr, "/hold").await;
        match conn.response(Duration::from_millis(300)).await {
            Err(process_support::Cut::TimedOut) => return conn,
            Ok(a) => assert_eq!(a.status, 429, "{}", a.text()),
            Err(e) => panic!("{e:?}"),
        }
        assert!(start.elapsed() < within, "still denied after {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the upstream holds `n` requests, at most [`WAIT`].
async fn until_inside(upstream: &Counting, n: usize) {
    let start = Instant::now();
    while upstream.inside() != n {
        assert!(
            start.elapsed() < WAIT,
            "{} inside, not {n}",
            upstream.inside()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// 4 proxies on one Redis, 200 clients, 10 slots on one key: the upstream
/// never has more than 10 requests inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_never_let_more_than_the_limit_in() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let upstream = Counting::start().await;
    let dir = temp_dir("concurrency-four");
    let config = config(&dir, &redis, 10, "30s");
    let proxies: Vec<Process> = (0..4).map(|_| proxy(&upstream, &config, &dir)).collect();
    let addrs: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    let clients: Vec<_> = (0..200)
        .map(|c| {
            let addrs = addrs.clone();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for r in 0..5 {
                    // 5 to 45 ms inside the upstream.
                    let ms = 5 + (c * 7 + r * 13) % 41;
                    let a = send(addrs[(c + r) % 4], &format!("/work/{ms}")).await;
                    statuses.push(a.status);
                }
                statuses
            })
        })
        .collect();
    let mut ok = 0;
    let mut denied = 0;
    for client in clients {
        for status in client.await.expect("the client ran") {
            match status {
                200 => ok += 1,
                429 => denied += 1,
                other => panic!("status {other}"),
            }
        }
    }
    println!(
        "{ok} served, {denied} denied, at most {} inside",
        upstream.most()
    );
    assert!(upstream.most() <= 10, "{} inside at once", upstream.most());
    assert!(ok >= 10 && denied > 0, "{ok} served, {denied} denied");
    // Every slot came back: the next 10 go in together.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut held = Vec::new();
    for i in 0..10 {
        held.push(open(addrs[i % 4], "/hold").await);
    }
    until_inside(&upstream, 10).await;
    assert_eq!(send(addrs[0], "/now").await.status, 429);
    upstream.release();
    drop(held);
}

/// An instance killed (SIGKILL) while holding every slot: they come back
/// when their leases end, within a lease of the kill, and not before the
/// last renew's lease has run out. A client that leaves gives its slot
/// back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instances_slots_come_back_when_their_leases_end_and_not_before() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let upstream = Counting::start().await;
    let dir = temp_dir("concurrency-kill");
    // Leases of 3 s, renewed every second.
    let config = config(&dir, &redis, 10, "3s");
    let mut doomed = proxy(&upstream, &config, &dir);
    let survivor = proxy(&upstream, &config, &dir);

    // A client that leaves: its slot comes back at once, long before its
    // lease would end (the limit is 10, so fill the other 9 first).
    let mut held = Vec::new();
    for _ in 0..9 {
        held.push(open(doomed.addr, "/hold").await);
    }
    let leaving = open(doomed.addr, "/hold").await;
    while upstream.holds() < 10 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(send(survivor.addr, "/now").await.status, 429);
    drop(leaving);
    let left = Instant::now();
    held.push(admitted_and_held(doomed.addr, Duration::from_secs(1)).await);
    println!(
        "the slot of a client that left came back after {:?}",
        left.elapsed()
    );
    assert_eq!(send(survivor.addr, "/now").await.status, 429);

    // Held through several renews, then the instance dies.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert_eq!(send(survivor.addr, "/now").await.status, 429, "renewed");
    doomed.child.kill().expect("SIGKILL");
    let killed = Instant::now();
    doomed.child.wait().expect("dead");
    let freed = loop {
        let a = send(survivor.addr, "/now").await;
        if a.status == 200 {
            break killed.elapsed();
        }
        assert_eq!(a.status, 429);
        assert!(killed.elapsed() < Duration::from_secs(6), "never freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("the dead instance's slots came back {freed:?} after the kill");
    // A lease is renewed every third of it, and at most half of it after
    // the last renew (the renewer looks every third, half a look early),
    // so the leases end 1.5 to 3 s after the kill: not before (1.2 s
    // leaves room for a slow renew), and within a lease.
    assert!(
        freed >= Duration::from_millis(1_200),
        "freed {freed:?} after the kill"
    );
    assert!(
        freed <= Duration::from_millis(3_500),
        "freed {freed:?} after the kill"
    );
    upstream.release();
    drop(held);
}

/// A lease held far longer than its time, renewed while the response
/// runs, is never taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_lease_is_never_taken_over_on_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let upstream = Counting::start().await;
    let dir = temp_dir("concurrency-renew");
    let config = config(&dir, &redis, 1, "1s");
    let a = proxy(&upstream, &config, &dir);
    let b = proxy(&upstream, &config, &dir);
    let held = open(a.addr, "/hold").await;
    until_inside(&upstream, 1).await;
    // Six lease times, probed from the other instance.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(6) {
        assert_eq!(send(b.addr, "/now").await.status, 429, "taken over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    upstream.release();
    let mut held = held;
    let answer = held.response(WAIT).await.expect("an answer");
    assert_eq!(answer.status, 200);
    drop(held);
    let start = Instant::now();
    while send(b.addr, "/now").await.status != 200 {
        assert!(start.elapsed() < Duration::from_millis(500), "not released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Redis paused (SIGSTOP) for longer than a lease, under each failure
/// policy. What happens, as docs/distributed.md states it:
/// - the request in flight runs on; its renews fail meanwhile, and once
///   Redis answers again its lease (ended there) is taken afresh, the slot
///   being free: later requests are denied again;
/// - a request that arrives during the pause gets the policy's answer:
///   fail_closed 503; fail_open admitted, uncounted (it holds no slot);
///   local decided by the instance's own memory, where it holds a slot of
///   its own (`limit / instances`) until it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_longer_than_a_lease_under_each_failure_policy() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    for (policy, during) in [("fail_closed", 503), ("fail_open", 200), ("local", 200)] {
        let upstream = Counting::start().await;
        let dir = temp_dir(&format!("concurrency-pause-{policy}"));
        let store = format!("timeout = \"300ms\"\non_error = \"{policy}\"");
        let config = config_with(&dir, &redis, 1, "1s", &store);
        let proxy = proxy(&upstream, &config, &dir);
        let mut held = admitted_and_held(proxy.addr, WAIT).await;
        assert_eq!(send(proxy.addr, "/now").await.status, 429, "{policy}");
        redis.pause();
        let paused = Instant::now();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            send(proxy.addr, "/now").await.status,
            during,
            "{policy}: during"
        );
        // Locally, one slot: held by a second request, the next is denied.
        let local = match policy {
            "local" => {
                let second = admitted_and_held(proxy.addr, WAIT).await;
                assert_eq!(send(proxy.addr, "/now").await.status, 429, "local: held");
                Some(second)
            }
            _ => None,
        };
        // Two and a half leases.
        tokio::time::sleep(Duration::from_millis(2_500).saturating_sub(paused.elapsed())).await;
        redis.resume();
        // The renewer tries again every third of the lease: the held
        // request's lease is taken afresh, and the next request is denied.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(
            send(proxy.addr, "/now").await.status,
            429,
            "{policy}: retaken"
        );
        upstream.release();
        assert_eq!(held.response(WAIT).await.expect("an answer").status, 200);
        drop(held);
        if let Some(mut second) = local {
            assert_eq!(second.response(WAIT).await.expect("an answer").status, 200);
        }
        let start = Instant::now();
        while send(proxy.addr, "/now").await.status != 200 {
            assert!(
                start.elapsed() < Duration::from_secs(1),
                "{policy}: not released"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A request let in while Redis was away (fail_open, no slot taken) takes a
/// slot at the first renew once Redis answers, if one is free: from then
/// on it counts, and the next request is denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_let_in_while_redis_was_away_takes_a_slot_once_it_is_back() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let upstream = Counting::start().await;
    let dir = temp_dir("concurrency-fail-open");
    let store = "timeout = \"300ms\"\non_error = \"fail_open\"";
    let config = config_with(&dir, &redis, 1, "1s", store);
    let proxy = proxy(&upstream, &config, &dir);
    // Warm: the connection to Redis is up.
    assert_eq!(send(proxy.addr, "/now").await.status, 200);
    redis.pause();
    let mut held = open(proxy.addr, "/hold").await;
    let start = Instant::now();
    while upstream.holds() < 1 {
        assert!(start.elapsed() < WAIT, "not let in");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    redis.resume();
    // The call that timed out during the pause is still in Redis's socket:
    // Redis runs it once resumed, and its charge, held by nobody, ends
    // with its lease (1 s). Past that, only the request let in holds the
    // slot, taken at a renew (the renewer looks every third of a second).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    for _ in 0..3 {
        assert_eq!(send(proxy.addr, "/now").await.status, 429, "not counted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    upstream.release();
    assert_eq!(held.response(WAIT).await.expect("an answer").status, 200);
    drop(held);
    let start = Instant::now();
    while send(proxy.addr, "/now").await.status != 200 {
        assert!(start.elapsed() < Duration::from_secs(1), "not released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

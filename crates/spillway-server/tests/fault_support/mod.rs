//! The fault harness: `spillway serve` instances (the real binary) on a
//! redis-server or a Redis Cluster with replicas, every instance reaching
//! Redis through a fault-injecting proxy, clients at a known rate on a few
//! keys of three rules (one per failure policy), and a fault injected in
//! the middle of the run. Each answer is counted in its rule's fixed
//! window (windows of one second, aligned to the Unix epoch), so that
//! "admitted over the limit" is exact; [`Report`] holds the figures per
//! rule and checks them against what each policy promises.
//!
//! The run's shape comes from the environment, so that `scripts/faults.sh`
//! can run it longer and wider than CI does: `SPILLWAY_FAULT_SECONDS` (how
//! long a fault lasts, default 2), `SPILLWAY_FAULT_INSTANCES` (default 2),
//! `SPILLWAY_FAULT_KEYS` (keys per rule, default 2),
//! `SPILLWAY_FAULT_CLIENTS` (clients per key, default 2),
//! `SPILLWAY_FAULT_RATE` (requests per second per client, default 25) and
//! `SPILLWAY_FAULT_LIMIT` (each rule's limit per window, default 20).

#![allow(dead_code)]

pub mod instances;
pub mod load;
pub mod proxy;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use instances::Instance;
use load::{Generator, Load, Outcome, Probe, Record, Source, Target};
use proxy::{Fault, FaultProxy};
use spillway_conformance::redis_server::{RedisCluster, RedisServer, free_ports};

/// The store timeout of every run.
pub const STORE_TIMEOUT: Duration = Duration::from_millis(100);
/// An answer later than the store timeout by more than this is slow. It
/// leaves room for the instance's own work and for a busy test machine.
pub const SLOW_MARGIN: Duration = Duration::from_millis(200);
/// A control probe (`/healthz`) slower than this means the machine or the
/// instance itself lagged, by half the store timeout: enough, with a
/// store call's own time, to time it out with Redis healthy. Windows with such a lag are not
/// held to exactness (they are counted in `lagged_windows`).
pub const LAG: Duration = Duration::from_millis(50);
/// How long a store failure keeps the store from asking Redis (the Redis
/// store's `retry_interval`): a lag this long before a window can still
/// send its first answers to the failure policy.
pub const RETRY_INTERVAL: Duration = Duration::from_millis(250);
/// The length of every rule's fixed window.
pub const WINDOW: Duration = Duration::from_secs(1);
/// How long a cluster node may be unreachable before its replica takes
/// over (`cluster-node-timeout`).
pub const NODE_TIMEOUT_MS: u32 = 1000;

/// The rules' failure policies, one rule each, and a fourth: a request
/// that two `fail_open` rules match, `pair-a` (the limit) and `pair-b`
/// (a limit it never reaches), keyed alike but in different slots. Its
/// figures count `pair-a`'s decisions: when `pair-b`'s node cannot answer,
/// `pair-a`'s denial must still win.
pub const POLICIES: [&str; 4] = ["fail_closed", "local", "fail_open", "fail_open"];
/// The names of the four groups' rules (the pair's by its first rule).
pub const RULES: [&str; 4] = ["closed", "local", "open", "pair-a"];
/// The header the pair's rules are keyed by.
const PAIR_HEADER: &str = "x-pair";

/// Runs one scenario at a time: they measure time, and two at once on a
/// small machine would measure each other.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a valid number")),
        Err(_) => default,
    }
}

/// The shape of a run.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// `spillway serve` processes.
    pub instances: usize,
    /// Keys per rule.
    pub keys: usize,
    /// The offered load.
    pub load: Load,
    /// Each rule's limit per window.
    pub limit: u64,
    /// Load before the fault.
    pub before: Duration,
    /// How long the fault lasts (an instant fault, such as a master
    /// killed, ends where it starts).
    pub fault: Duration,
    /// Load after the fault, at the least (the scenario's recovery bound
    /// and 3 s of exact decisions, if longer).
    pub after: Duration,
}

impl Plan {
    /// The plan from the environment (see the module's documentation).
    pub fn from_env() -> Self {
        let fault = Duration::from_secs_f64(env_or("SPILLWAY_FAULT_SECONDS", 2.0));
        let plan = Self {
            instances: env_or("SPILLWAY_FAULT_INSTANCES", 2),
            keys: env_or("SPILLWAY_FAULT_KEYS", 2),
            load: Load {
                clients_per_target: env_or("SPILLWAY_FAULT_CLIENTS", 2),
                rate: env_or("SPILLWAY_FAULT_RATE", 25.0),
                in_flight: 64,
            },
            limit: env_or("SPILLWAY_FAULT_LIMIT", 20),
            before: Duration::from_secs(3).max(fault),
            fault,
            after: Duration::from_secs(5).max(fault),
        };
        assert!(
            plan.instances >= 2 && plan.limit >= plan.instances as u64,
            "the harness tells local decisions by their limit (an instance's share, \
             below the limit): SPILLWAY_FAULT_INSTANCES must be 2 or more, and \
             SPILLWAY_FAULT_LIMIT at least as many"
        );
        plan
    }

    /// A local decision's limit: one instance's share.
    pub fn share(&self) -> u64 {
        (self.limit / self.instances as u64).max(1)
    }
}

/// Where the counters are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// One redis-server.
    Standalone,
    /// 3 masters and 3 replicas, each node behind a proxy of its own that
    /// it announces.
    Cluster,
}

/// What goes wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Injected {
    /// The redis-server is killed (SIGKILL) and started again, empty, on
    /// the same port at the fault's end.
    KillRestart,
    /// The redis-server is stopped (SIGSTOP) and let go on (SIGCONT).
    Pause,
    /// A fault of the proxy (or proxies) between the instances and Redis.
    Proxy(Fault),
    /// Every open connection to Redis reset at this interval, new ones
    /// carried: scripts in flight lose their replies.
    ResetEvery(Duration),
    /// The master holding the first key of the first rule is killed; its
    /// replica takes over. An instant fault.
    KillMaster,
    /// Only the proxy of the master holding the first key of the first
    /// rule stalls.
    StallOneMaster,
}

/// One scenario.
#[derive(Clone, Copy, Debug)]
pub struct Scenario {
    /// Its name in the figures.
    pub name: &'static str,
    /// On what.
    pub topology: Topology,
    /// The fault.
    pub injected: Injected,
    /// The longest the return to exact decisions may take, after the
    /// fault ends.
    pub recovery_bound: Duration,
}

/// The figures of one rule in one run.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    /// The rule's name (its policy's: `closed`, `local`, `open`).
    pub rule: String,
    /// Its failure policy.
    pub policy: &'static str,
    /// Requests sent.
    pub offered: u64,
    /// Admitted, whoever decided.
    pub admitted: u64,
    /// Over the limit: the sum over keys and windows of what was admitted
    /// beyond the limit.
    pub over_limit: u64,
    /// The same, counting only Redis's admissions.
    pub redis_over: u64,
    /// The same, counting each instance's local admissions against its
    /// share.
    pub local_over: u64,
    /// Under the limit in windows that only Redis decided: admissions
    /// lost (a charge counted twice, or a count kept after a denial).
    pub redis_under: u64,
    /// Charges Redis made that no answer reported: the highest count an
    /// admission reported in a window, less the admissions by Redis
    /// answered in it (a script that ran after its caller gave up on it, or
    /// ran twice).
    pub phantom: u64,
    /// Answers that Redis did not decide (undecided, local, 503, none).
    pub not_redis: u64,
    /// Over twice the limit: the sum over keys and windows of what was
    /// admitted beyond twice the limit (`local`'s bound: the limit from
    /// Redis and the instances' shares from the fallback).
    pub over_twice: u64,
    /// Admitted undecided (fail_open).
    pub open_admitted: u64,
    /// Decided in memory (local).
    pub local_answers: u64,
    /// 503 answers.
    pub unavailable: u64,
    /// Other answers of 500 or more.
    pub other_5xx: u64,
    /// Answers of another status, 200s that fit no source, no answers.
    pub broken: u64,
    /// Answers later than the store timeout plus [`SLOW_MARGIN`] plus the
    /// control probes' 99th percentile, beyond the lag of the instance's
    /// probes at the same time.
    pub slow: u64,
    /// Answers that late, explained by the lag of the probes.
    pub slow_lagged: u64,
    /// Windows not held to exactness because a probe lagged in them.
    pub lagged_windows: u64,
    /// Windows (of every key) that the load covered whole.
    pub full_windows: u64,
    /// Windows during the fault (or its recovery bound) that were not
    /// exact, lagged ones left out.
    pub fault_inexact: u64,
    /// Latencies.
    pub p50: Duration,
    /// Latencies.
    pub p99: Duration,
    /// Latencies.
    pub max: Duration,
    /// From the fault's end to the end of the last window that was not
    /// exact (`Some(ZERO)` if none was after it); `None` if the run ended
    /// on one.
    pub recovery: Option<Duration>,
    /// Full windows away from the fault (before it, or later than its end
    /// plus the recovery bound) that were not exact.
    pub healthy_inexact: u64,
    /// Of the windows that began after the fault began, those over the
    /// limit (`local`'s counts must survive Redis's return).
    pub over_after_fault_began: u64,
    /// Up to three examples of what went wrong, for the report.
    pub examples: Vec<String>,
}

/// The result of a run.
#[derive(Debug)]
pub struct Report {
    /// The scenario.
    pub scenario: Scenario,
    /// Its plan.
    pub plan: Plan,
    /// One per group of [`RULES`], in its order.
    pub rules: Vec<Figures>,
    /// Per target key, its figures (rule, key, figures), for scenarios
    /// that look at some keys only.
    pub keys: Vec<(String, String, Figures)>,
    /// Ticks the generator could not send (too many requests waiting).
    pub shed: u64,
    /// The control probes' latencies: median, 99th percentile, highest.
    pub probe_latency: (Duration, Duration, Duration),
    /// When the fault began and ended, from the start of the load.
    pub fault_at: (Duration, Duration),
    /// For the cluster's stalled or killed master: the keys on it.
    pub faulty_keys: Vec<String>,
}

/// The rules of every run: three fixed windows, one per policy.
fn config_text(urls: &[String], plan: &Plan) -> String {
    let url = match urls {
        [one] => format!("{one:?}"),
        many => format!(
            "[{}]",
            many.iter()
                .map(|u| format!("{u:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut text = format!(
        "[store]\nkind = \"redis\"\nurl = {url}\ntimeout = \"{}ms\"\n\
         on_error = \"fail_open\"\ninstances = {}\n",
        STORE_TIMEOUT.as_millis(),
        plan.instances
    );
    for (name, policy) in RULES.iter().zip(POLICIES).take(3) {
        // Keyed by IP, which the pair's requests do not give: those rules
        // do not apply to them.
        let _ = write!(
            text,
            "\n[[rules]]\nname = \"{name}\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\n\
             limit = {}\nwindow = \"{}ms\"\non_error = \"{policy}\"\n",
            plan.limit,
            WINDOW.as_millis()
        );
    }
    for (name, limit) in [("pair-a", plan.limit), ("pair-b", plan.limit * 1000)] {
        let _ = write!(
            text,
            "\n[[rules]]\nname = \"{name}\"\nmatch = {{ path = \"/pair\" }}\n\
             key = [\"header:{PAIR_HEADER}\"]\nfallback = []\nalgorithm = \"fixed_window\"\n\
             limit = {limit}\nwindow = \"{}ms\"\non_error = \"fail_open\"\n",
            WINDOW.as_millis()
        );
    }
    text
}

/// The key the pair's rules build from a request whose header is `value`.
fn pair_key(value: &str) -> String {
    format!("header:{PAIR_HEADER}={value}")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("faults-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}

/// The Redis side of a run.
enum Backend {
    Standalone {
        redis: RedisServer,
        proxy: FaultProxy,
    },
    Cluster {
        cluster: RedisCluster,
        proxies: Vec<FaultProxy>,
    },
}

impl Backend {
    async fn start(topology: Topology) -> Option<Self> {
        match topology {
            Topology::Standalone => {
                let redis = RedisServer::start()?;
                let proxy = FaultProxy::start(0, redis.port()).await;
                Some(Self::Standalone { redis, proxy })
            }
            Topology::Cluster => {
                let ports = free_ports(6);
                let mut proxies = Vec::new();
                for &port in &ports {
                    proxies.push(FaultProxy::start(0, port).await);
                }
                let announced: Vec<u16> = proxies.iter().map(FaultProxy::port).collect();
                // Blocking (it polls the nodes), while the proxies run here.
                let cluster = tokio::task::spawn_blocking(move || {
                    RedisCluster::start_with_replicas(&ports, Some(&announced), NODE_TIMEOUT_MS)
                })
                .await
                .expect("the cluster starts")?;
                Some(Self::Cluster { cluster, proxies })
            }
        }
    }

    fn urls(&self) -> Vec<String> {
        match self {
            Self::Standalone { proxy, .. } => {
                vec![format!("redis://127.0.0.1:{}/", proxy.port())]
            }
            Self::Cluster { proxies, .. } => proxies
                .iter()
                .map(|p| format!("redis://127.0.0.1:{}/", p.port()))
                .collect(),
        }
    }
}

/// The Redis hash tag of a rule's key (which slot, so which master, holds
/// it), escaped as the store escapes names and keys.
fn hash_tag(rule: &str, key: &str) -> String {
    let escape = |s: &str| {
        s.replace('%', "%25")
            .replace(':', "%3A")
            .replace('{', "%7B")
            .replace('}', "%7D")
    };
    format!("{{{}:{}}}", escape(rule), escape(key))
}

/// The full Redis key of a rule's fixed-window state.
fn redis_key(rule: &str, key: &str) -> String {
    format!(
        "spillway:{}:fwi:{}",
        hash_tag(rule, key),
        WINDOW.as_micros()
    )
}

/// Values of the pair's header whose `pair-a` key is held by another
/// master than `faulty`, and `pair-b` key by `faulty` (any values on a
/// standalone server).
fn pair_values(cluster: Option<&RedisCluster>, faulty: Option<usize>, n: usize) -> Vec<String> {
    let candidates = (0..10_000).map(|i| format!("p{i}"));
    match (cluster, faulty) {
        (Some(cluster), Some(faulty)) => candidates
            .filter(|v| {
                let a = cluster.master_of(&hash_tag("pair-a", &pair_key(v)));
                let b = cluster.master_of(&hash_tag("pair-b", &pair_key(v)));
                a.is_some() && a != Some(faulty) && b == Some(faulty)
            })
            .take(n)
            .collect(),
        _ => candidates.take(n).collect(),
    }
}

/// Runs `scenario` and measures it; `None` if Redis is not installed (and
/// not required).
pub fn run(scenario: Scenario) -> Option<Report> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let plan = Plan::from_env();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    // A run the machine's own lag spoiled measured nothing: once more.
    let report = runtime.block_on(run_async(scenario, plan))?;
    if !report.too_busy() {
        return Some(report);
    }
    println!(
        "FAULT {}: the machine lagged too much; measuring again",
        scenario.name
    );
    runtime.block_on(run_async(scenario, plan))
}

/// Runs `scenario` and holds its report to `check` (which panics on a
/// failure). A failure in a run where the machine lagged in some window is
/// measured once more, and the second run must pass: on a busy machine a
/// stall of a redis-server or a fault proxy, which no probe of the
/// instances sees, can time a store call out; a real fault of the store
/// fails both runs.
pub fn run_checked(scenario: Scenario, check: impl Fn(&Report)) {
    let Some(report) = run(scenario) else { return };
    let lagged = report.rules.iter().any(|f| f.lagged_windows > 0);
    let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&report)));
    match checked {
        Ok(()) => {}
        Err(failure) if !lagged => std::panic::resume_unwind(failure),
        Err(_) => {
            println!(
                "FAULT {}: failed in a run where the machine lagged; measuring again",
                scenario.name
            );
            if let Some(report) = run(scenario) {
                check(&report);
            }
        }
    }
}

async fn run_async(scenario: Scenario, plan: Plan) -> Option<Report> {
    let mut backend = Backend::start(scenario.topology).await?;
    let dir = temp_dir(scenario.name);
    let config = dir.join("spillway.toml");
    std::fs::write(&config, config_text(&backend.urls(), &plan)).expect("write the config");
    let started = {
        let config = config.clone();
        let n = plan.instances;
        tokio::task::spawn_blocking(move || (0..n).map(|_| Instance::start(&config)).collect())
    };
    let instances: Vec<Instance> = started.await.expect("the instances start");
    let addrs: Vec<_> = instances.iter().map(|i| i.addr).collect();

    // The master of the first key: the one the cluster's faults hit.
    let faulty = match &backend {
        Backend::Cluster { cluster, .. } => Some(
            cluster
                .master_of(&hash_tag(RULES[0], "k0"))
                .expect("a master holds the key"),
        ),
        Backend::Standalone { .. } => None,
    };
    let cluster = match &backend {
        Backend::Cluster { cluster, .. } => Some(cluster),
        Backend::Standalone { .. } => None,
    };
    let mut targets = Vec::new();
    for (rule, name) in RULES.iter().enumerate().take(3) {
        for k in 0..plan.keys {
            let key = format!("k{k}");
            targets.push(Target {
                rule,
                rule_name: name.to_string(),
                // Keys of the harness's own, counted as given (the opt-out of
                // the rule's key shape), so that their slots are known.
                body: serde_json::json!({"rule": name, "key": key, "free_form_key": true})
                    .to_string(),
                key,
                limit: plan.limit,
                share: plan.share(),
                window_ms: WINDOW.as_millis() as u64,
            });
        }
    }
    for value in pair_values(cluster, faulty, plan.keys) {
        targets.push(Target {
            rule: 3,
            rule_name: RULES[3].to_string(),
            key: pair_key(&value),
            body: serde_json::json!({"path": "/pair", "headers": {PAIR_HEADER: value}}).to_string(),
            limit: plan.limit,
            share: plan.share(),
            window_ms: WINDOW.as_millis() as u64,
        });
    }
    let faulty_keys = match (cluster, faulty) {
        (Some(cluster), Some(master)) => {
            let pair = targets.iter().find(|t| t.rule == 3).expect("a pair key");
            // The keys are named as the harness thinks: one request, and
            // its state is where it was looked for.
            verify_pair_key(addrs[0], &pair.body, &pair.key, cluster).await;
            targets
                .iter()
                .filter(|t| cluster.master_of(&hash_tag(&t.rule_name, &t.key)) == Some(master))
                .map(|t| format!("{}:{}", t.rule_name, t.key))
                .collect()
        }
        _ => Vec::new(),
    };

    let generator = Generator::start(&addrs, &targets, plan.load);
    tokio::time::sleep(plan.before).await;
    let fault_start = generator.elapsed();
    let fault_end = inject(&mut backend, scenario.injected, plan.fault, &generator).await;
    let fault_at = (fault_start, fault_end);
    let after = plan
        .after
        .max(scenario.recovery_bound + Duration::from_secs(3));
    tokio::time::sleep(after).await;
    let load_end = generator.elapsed();
    let start_unix_ms = generator.start_unix_ms();
    let (records, mut probes, shed) = generator.stop().await;
    probes.sort_by_key(|p| p.sent);
    let mut probe_latencies: Vec<Duration> = probes.iter().map(|p| p.latency).collect();
    probe_latencies.sort();
    let probe_latency = (
        percentile(&probe_latencies, 0.5),
        percentile(&probe_latencies, 0.99),
        probe_latencies.last().copied().unwrap_or_default(),
    );
    drop(instances);
    drop(backend);
    let _ = std::fs::remove_dir_all(&dir);

    let windows = Windows {
        start_unix_ms,
        load_end,
        fault_at,
        recovery_bound: scenario.recovery_bound,
        probes,
        probe_p99: probe_latency.1,
    };
    let rules = (0..RULES.len())
        .map(|rule| {
            let mine: Vec<&Record> = records
                .iter()
                .filter(|r| targets[r.target].rule == rule)
                .collect();
            let mut f = figures(&mine, &targets, &windows, &plan);
            f.rule = RULES[rule].to_string();
            f.policy = POLICIES[rule];
            f
        })
        .collect();
    let keys = targets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mine: Vec<&Record> = records.iter().filter(|r| r.target == i).collect();
            let mut f = figures(&mine, &targets, &windows, &plan);
            f.rule = t.rule_name.clone();
            f.policy = POLICIES[t.rule];
            (t.rule_name.clone(), t.key.clone(), f)
        })
        .collect();
    let report = Report {
        scenario,
        plan,
        rules,
        keys,
        shed,
        probe_latency,
        fault_at,
        faulty_keys,
    };
    report.print();
    Some(report)
}

/// Sends the pair's request and checks that both rules' states are on the
/// masters the harness chose them for. A request that Redis did not
/// decide (its first call timed out on a loaded machine, and `fail_open`
/// answered) leaves no state: it is sent again, a few times at most.
async fn verify_pair_key(
    addr: std::net::SocketAddr,
    body: &str,
    key: &str,
    cluster: &RedisCluster,
) {
    let mut missing = Vec::new();
    for _attempt in 0..5 {
        let answer = check_once(addr, body).await;
        assert!(answer.contains(&format!("\"key\":\"{key}\"")), "{answer}");
        missing.clear();
        for rule in ["pair-a", "pair-b"] {
            let name = redis_key(rule, key);
            let master = cluster
                .master_of(&hash_tag(rule, key))
                .expect("a master holds it");
            let found = tokio::task::block_in_place(|| {
                cluster.nodes()[master].command(&format!("EXISTS {name}"))
            });
            if !found.starts_with(":1") {
                missing.push(format!("{name} is not on node {master} ({})", found.trim()));
            }
        }
        if missing.is_empty() {
            return;
        }
        // A script that timed out may still land: give it a moment.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "{}: the harness names keys unlike the store",
        missing.join("; ")
    );
}

/// One `POST /v1/check` of `body` on its own connection: the whole answer.
async fn check_once(addr: std::net::SocketAddr, body: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("an instance");
    let request = format!(
        "POST /v1/check HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes())
        .await
        .expect("write");
    let mut answer = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut stream, &mut answer)
        .await
        .expect("read");
    answer
}

/// Injects the fault, waits for its length, ends it; returns when it ended.
async fn inject(
    backend: &mut Backend,
    injected: Injected,
    length: Duration,
    generator: &Generator,
) -> Duration {
    match (backend, injected) {
        (Backend::Standalone { redis, .. }, Injected::KillRestart) => {
            redis.kill();
            tokio::time::sleep(length).await;
            // It waits for PING: the fault ends when Redis answers again.
            tokio::task::block_in_place(|| redis.restart());
        }
        (Backend::Standalone { redis, .. }, Injected::Pause) => {
            redis.pause();
            tokio::time::sleep(length).await;
            redis.resume();
        }
        (Backend::Standalone { proxy, .. }, Injected::Proxy(fault)) => {
            proxy.set(fault);
            tokio::time::sleep(length).await;
            proxy.set(Fault::None);
        }
        (Backend::Cluster { proxies, .. }, Injected::Proxy(fault)) => {
            for p in proxies.iter() {
                p.set(fault);
            }
            tokio::time::sleep(length).await;
            for p in proxies.iter() {
                p.set(Fault::None);
            }
        }
        (backend, Injected::ResetEvery(interval)) => {
            let proxies: Vec<&FaultProxy> = match backend {
                Backend::Standalone { proxy, .. } => vec![proxy],
                Backend::Cluster { proxies, .. } => proxies.iter().collect(),
            };
            let end = tokio::time::Instant::now() + length;
            while tokio::time::Instant::now() < end {
                for p in &proxies {
                    p.reset_now();
                }
                tokio::time::sleep(interval).await;
            }
        }
        (Backend::Cluster { cluster, .. }, Injected::KillMaster) => {
            let master =
                tokio::task::block_in_place(|| cluster.master_of(&hash_tag("closed", "k0")))
                    .expect("a master holds the key");
            cluster.nodes_mut()[master].kill();
        }
        (Backend::Cluster { cluster, proxies }, Injected::StallOneMaster) => {
            let master =
                tokio::task::block_in_place(|| cluster.master_of(&hash_tag("closed", "k0")))
                    .expect("a master holds the key");
            proxies[master].set(Fault::Stall);
            tokio::time::sleep(length).await;
            proxies[master].set(Fault::None);
        }
        (_, injected) => panic!("{injected:?} does not apply to this topology"),
    }
    generator.elapsed()
}

/// What the windows of a run are measured against.
struct Windows {
    start_unix_ms: f64,
    load_end: Duration,
    fault_at: (Duration, Duration),
    recovery_bound: Duration,
    // Sorted by when they were sent.
    probes: Vec<Probe>,
    // The probes' 99th percentile: how much the machine lags at any time.
    probe_p99: Duration,
}

impl Windows {
    /// The slowest probe (of `instance`, or of any) whose time overlaps
    /// `from..to` (ms from the start).
    fn lag(&self, instance: Option<usize>, from: f64, to: f64) -> Duration {
        // No probe takes longer than 10 s: start looking 10 s earlier.
        let first = self
            .probes
            .partition_point(|p| ms(p.sent) < from - 10_000.0);
        self.probes[first..]
            .iter()
            .take_while(|p| ms(p.sent) <= to)
            .filter(|p| instance.is_none_or(|i| p.instance == i))
            .filter(|p| ms(p.sent + p.latency) >= from)
            .map(|p| p.latency)
            .max()
            .unwrap_or_default()
    }

    /// A window's start and end, from the start of the load (ms; the
    /// first window may start before it).
    fn span(&self, window: i64, window_ms: u64) -> (f64, f64) {
        let start = (window as f64) * window_ms as f64 - self.start_unix_ms;
        (start, start + window_ms as f64)
    }

    /// Whether the load covered the whole window.
    fn full(&self, (start, end): (f64, f64)) -> bool {
        start >= 0.0 && end <= ms(self.load_end)
    }

    /// Whether it is clear of the fault: over before it began, or begun
    /// after its end plus the recovery bound.
    fn healthy(&self, (start, end): (f64, f64)) -> bool {
        end <= ms(self.fault_at.0) || start >= ms(self.fault_at.1 + self.recovery_bound)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One key's counts in one window.
#[derive(Default)]
struct Cell {
    answers: u64,
    admitted: u64,
    redis_admitted: u64,
    highest_count: u64,
    local_admitted: HashMap<usize, u64>,
    not_redis: u64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn figures(records: &[&Record], targets: &[Target], windows: &Windows, plan: &Plan) -> Figures {
    let mut f = Figures {
        offered: records.len() as u64,
        ..Figures::default()
    };
    let example = |f: &mut Figures, what: String| {
        if f.examples.len() < 3 {
            f.examples.push(what);
        }
    };
    let mut cells: BTreeMap<(i64, usize), Cell> = BTreeMap::new();
    let window_ms = WINDOW.as_millis() as u64;
    // Lags add up along a request's way (the client, the instance, Redis,
    // the proxy), while a probe sees one at a time: the machine's usual
    // lag is allowed on top of the one seen at the time.
    let slow = STORE_TIMEOUT + SLOW_MARGIN + windows.probe_p99;
    let mut latencies: Vec<Duration> = Vec::with_capacity(records.len());
    for r in records {
        latencies.push(r.latency);
        if r.latency > slow {
            let lag = windows.lag(Some(r.instance), ms(r.sent), ms(r.sent + r.latency));
            if r.latency.saturating_sub(lag) > slow {
                f.slow += 1;
                example(
                    &mut f,
                    format!(
                        "slow: {:?} at {:?} (probe lag {lag:?}; {:?})",
                        r.latency, r.sent, r.outcome
                    ),
                );
            } else {
                f.slow_lagged += 1;
            }
        }
        // Answers that are no decision count in the window they were sent in.
        let sent_window = ((windows.start_unix_ms + ms(r.sent)) / window_ms as f64).floor() as i64;
        match &r.outcome {
            Outcome::Decided {
                source,
                allowed,
                window,
                count,
            } => {
                let cell = cells.entry((*window, r.target)).or_default();
                cell.highest_count = cell.highest_count.max(count.unwrap_or(0));
                cell.answers += 1;
                if *source != Source::Redis {
                    cell.not_redis += 1;
                }
                if *source == Source::Local {
                    f.local_answers += 1;
                }
                if *allowed {
                    f.admitted += 1;
                    cell.admitted += 1;
                    match source {
                        Source::Redis => cell.redis_admitted += 1,
                        Source::Local => *cell.local_admitted.entry(r.instance).or_default() += 1,
                        Source::FailOpen => f.open_admitted += 1,
                    }
                }
            }
            Outcome::Status(status) => {
                let cell = cells.entry((sent_window, r.target)).or_default();
                cell.answers += 1;
                cell.not_redis += 1;
                if *status == 503 {
                    f.unavailable += 1;
                } else if *status >= 500 {
                    f.other_5xx += 1;
                    example(&mut f, format!("status {status} at {:?}", r.sent));
                } else {
                    f.broken += 1;
                    example(&mut f, format!("status {status} at {:?}", r.sent));
                }
            }
            Outcome::Odd(body) | Outcome::Failed(body) => {
                let cell = cells.entry((sent_window, r.target)).or_default();
                cell.answers += 1;
                cell.not_redis += 1;
                f.broken += 1;
                example(&mut f, format!("{:?} at {:?}: {body}", r.outcome, r.sent));
            }
        }
    }
    latencies.sort();
    f.p50 = percentile(&latencies, 0.50);
    f.p99 = percentile(&latencies, 0.99);
    f.max = latencies.last().copied().unwrap_or_default();

    let fault_start = ms(windows.fault_at.0);
    let fault_end = ms(windows.fault_at.1);
    let mut last_inexact: Option<f64> = None;
    let mut ended_inexact = false;
    let last_full_end = cells
        .keys()
        .map(|(w, _)| windows.span(*w, window_ms))
        .filter(|s| windows.full(*s))
        .map(|(_, end)| end)
        .fold(f64::MIN, f64::max);
    for ((w, target), cell) in &cells {
        let limit = targets[*target].limit;
        let span = windows.span(*w, window_ms);
        f.over_limit += cell.admitted.saturating_sub(limit);
        f.over_twice += cell.admitted.saturating_sub(2 * limit);
        f.not_redis += cell.not_redis;
        f.redis_over += cell.redis_admitted.saturating_sub(limit);
        // Windows begun before the load may hold the harness's own checks
        // (the cluster's key placement is verified with one request).
        if span.0 >= 0.0 {
            f.phantom += cell.highest_count.saturating_sub(cell.redis_admitted);
        }
        for n in cell.local_admitted.values() {
            f.local_over += n.saturating_sub(plan.share());
        }
        if span.0 >= fault_start && cell.admitted > limit {
            f.over_after_fault_began += cell.admitted - limit;
        }
        if !windows.full(span) {
            continue;
        }
        f.full_windows += 1;
        let expected = limit.min(cell.answers);
        if cell.not_redis == 0 && cell.admitted < expected {
            f.redis_under += expected - cell.admitted;
        }
        let exact = cell.not_redis == 0 && cell.admitted == expected;
        if !exact && windows.lag(None, span.0 - ms(RETRY_INTERVAL), span.1) > LAG {
            f.lagged_windows += 1;
            continue;
        }
        if !exact {
            if windows.healthy(span) {
                f.healthy_inexact += 1;
                example(
                    &mut f,
                    format!(
                        "window {:.0}..{:.0} ms of {}:{}: {} answers, {} admitted, {} not by Redis",
                        span.0,
                        span.1,
                        targets[*target].rule_name,
                        targets[*target].key,
                        cell.answers,
                        cell.admitted,
                        cell.not_redis
                    ),
                );
            }
            if !windows.healthy(span) {
                f.fault_inexact += 1;
            }
            if span.1 > fault_start {
                last_inexact = Some(last_inexact.map_or(span.1, |l: f64| l.max(span.1)));
            }
            if span.1 >= last_full_end {
                ended_inexact = true;
            }
        }
    }
    f.recovery = if ended_inexact {
        None
    } else {
        Some(Duration::from_secs_f64(
            (last_inexact.unwrap_or(fault_end) - fault_end).max(0.0) / 1000.0,
        ))
    };
    f
}

impl Figures {
    /// One line of figures.
    pub fn line(&self) -> String {
        format!(
            "rule={:<6} policy={:<11} offered={:>6} admitted={:>6} over_limit={:>5} \
             (redis {}, local {}) under={} phantom={} fail_open={} local={} 503={} other_5xx={} \
             broken={} slow={} (lagged {}) windows={} (inexact in fault {}, lagged {}) p50={:.1}ms p99={:.1}ms max={:.1}ms recovery={}",
            self.rule,
            self.policy,
            self.offered,
            self.admitted,
            self.over_limit,
            self.redis_over,
            self.local_over,
            self.redis_under,
            self.phantom,
            self.open_admitted,
            self.local_answers,
            self.unavailable,
            self.other_5xx,
            self.broken,
            self.slow,
            self.slow_lagged,
            self.full_windows,
            self.fault_inexact,
            self.lagged_windows,
            ms(self.p50),
            ms(self.p99),
            ms(self.max),
            self.recovery
                .map_or("never".to_string(), |d| format!("{}ms", d.as_millis())),
        )
    }
}

impl Report {
    /// Prints one line per rule, starting `FAULT`, for `scripts/faults.sh`.
    pub fn print(&self) {
        let p = &self.plan;
        // Its own line, after libtest's "test NAME ... ".
        println!();
        println!(
            "FAULT {} on {:?}: {} instances, {} keys per rule, {} clients per key at {}/s, \
             limit {} per {} ms; fault at {:.2}s..{:.2}s; shed {}; probes p50 {:.1}ms \
             p99 {:.1}ms max {:.1}ms",
            self.scenario.name,
            self.scenario.topology,
            p.instances,
            p.keys,
            p.load.clients_per_target,
            p.load.rate,
            p.limit,
            WINDOW.as_millis(),
            self.fault_at.0.as_secs_f64(),
            self.fault_at.1.as_secs_f64(),
            self.shed,
            ms(self.probe_latency.0),
            ms(self.probe_latency.1),
            ms(self.probe_latency.2),
        );
        for f in &self.rules {
            println!("FAULT {} {}", self.scenario.name, f.line());
        }
        if !self.faulty_keys.is_empty() {
            println!(
                "FAULT {} keys on the faulty master: {}",
                self.scenario.name,
                self.faulty_keys.join(", ")
            );
        }
    }

    /// Whether the machine lagged in a third of some rule's windows (which
    /// are then not held to exactness): too busy to measure.
    pub fn too_busy(&self) -> bool {
        self.rules
            .iter()
            .any(|f| f.lagged_windows * 3 > f.full_windows)
    }

    /// The figures of the rule of `policy`.
    pub fn rule(&self, policy: &str) -> &Figures {
        self.rules
            .iter()
            .find(|f| f.policy == policy)
            .expect("a rule per policy")
    }

    /// What each policy promises, and what holds for every rule, checked
    /// for every rule: the list of what failed, each with its figures.
    /// `redis_may_lose` when Redis itself may lose charges (a replica
    /// promoted before it had them).
    pub fn violations(&self, redis_may_lose: bool) -> Vec<String> {
        let mut out = Vec::new();
        for f in &self.rules {
            let mut fail = |what: &str| {
                out.push(format!(
                    "{}: {what}\n    {}\n    {}",
                    self.scenario.name,
                    f.line(),
                    f.examples.join("\n    ")
                ));
            };
            if f.lagged_windows * 3 > f.full_windows {
                fail("the machine was too busy to measure (twice): a third of the windows lagged");
            }
            if f.broken > 0 {
                fail("every request is answered, with a status the service documents");
            }
            if f.slow > 0 {
                fail("no answer is slower than the store timeout plus the margin");
            }
            if f.phantom > f.not_redis {
                fail(
                    "a script is never sent twice: Redis charges no more requests than it \
                     answered, and those whose answer it did not give",
                );
            }
            if f.redis_over > 0 && !redis_may_lose {
                fail("Redis never admits over the limit in a window");
            }
            if f.healthy_inexact > 0 {
                fail("away from the fault, every window is decided by Redis, exactly");
            }
            match f.recovery {
                Some(d) if d <= self.scenario.recovery_bound => {}
                _ => fail("decisions are exact again within the recovery bound"),
            }
            match f.policy {
                "fail_closed" => {
                    if f.open_admitted > 0 || f.local_answers > 0 {
                        fail("fail_closed admits nothing Redis did not decide");
                    }
                    if f.over_limit > 0 && !redis_may_lose {
                        fail("fail_closed never admits over the limit");
                    }
                    if f.other_5xx > 0 {
                        fail("fail_closed answers 503, no other 5xx");
                    }
                }
                "local" => {
                    if f.open_admitted > 0 {
                        fail("local admits nothing undecided");
                    }
                    if f.local_over > 0 {
                        fail("local admits at most limit/instances per instance per window");
                    }
                    if f.over_twice > 0 && !redis_may_lose {
                        fail(
                            "local admits at most twice the limit in a window (Redis's \
                             limit and the instances' shares)",
                        );
                    }
                    if f.unavailable + f.other_5xx > 0 {
                        fail("local answers no 5xx");
                    }
                }
                _ => {
                    if f.local_answers > 0 {
                        fail("fail_open decides nothing locally");
                    }
                    if f.unavailable + f.other_5xx > 0 {
                        fail("fail_open answers no 5xx");
                    }
                }
            }
        }
        out
    }

    /// Panics with every violation, if any.
    pub fn assert_holds(&self, redis_may_lose: bool) {
        let v = self.violations(redis_may_lose);
        assert!(v.is_empty(), "{}", v.join("\n"));
    }
}

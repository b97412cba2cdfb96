//! The load generator: clients at a fixed rate each (open loop: a slow
//! answer does not slow the offered load), spread over the instances, each
//! answer recorded with where its decision came from and which window of
//! its rule it counts in.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::sync::{Mutex, Semaphore, watch};
use tokio::task::JoinHandle;

/// The longest the generator waits for one answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// One rule and key that clients check (`POST /v1/check` with a rule and a
/// key), and what its answers mean.
#[derive(Clone, Debug)]
pub struct Target {
    /// The rule's index in the run's rules.
    pub rule: usize,
    /// The rule's name (for a pair, the first rule's: its decision is
    /// the one counted).
    pub rule_name: String,
    /// The key, as the store names it (for a pair, the key both rules
    /// build from the request).
    pub key: String,
    /// The body of its `POST /v1/check`: a rule check, or a request
    /// description that several rules match.
    pub body: String,
    /// The rule's limit per window.
    pub limit: u64,
    /// Each instance's share of it while deciding locally.
    pub share: u64,
    /// The rule's fixed window, in ms (aligned to the Unix epoch).
    pub window_ms: u64,
}

/// Who decided an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Redis (or the deny cache, which repeats Redis's denial).
    Redis,
    /// Nobody: admitted undecided by `fail_open`.
    FailOpen,
    /// The instance's in-memory fallback (`local`), with its share.
    Local,
}

/// What one request got.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A decision (HTTP 200), counted in `window` (the window's index:
    /// its start over the window length).
    Decided {
        /// Who decided.
        source: Source,
        /// Admitted or denied.
        allowed: bool,
        /// The window it counts in.
        window: i64,
        /// For an admission by Redis: the window's count after it (its
        /// limit minus what remains), so that charges Redis made but
        /// answered nobody for show as gaps.
        count: Option<u64>,
    },
    /// Another HTTP status (503 from `fail_closed`, or anything else).
    Status(u16),
    /// A 200 whose numbers fit no source (a harness or service bug).
    Odd(String),
    /// No answer: a connection error, or none within 10 s.
    Failed(String),
}

/// One request and its answer.
#[derive(Clone, Debug)]
pub struct Record {
    /// Its target's index.
    pub target: usize,
    /// The instance asked.
    pub instance: usize,
    /// When it was sent, from the start of the run.
    pub sent: Duration,
    /// How long its answer took.
    pub latency: Duration,
    /// What it got.
    pub outcome: Outcome,
}

/// One control probe: `GET /healthz`, which touches no store, so its
/// latency is the instance's and the machine's own lag.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    /// The instance asked.
    pub instance: usize,
    /// When it was sent, from the start of the run.
    pub sent: Duration,
    /// How long its answer took (10 s if none came).
    pub latency: Duration,
}

/// How often each instance is probed.
const PROBE_EVERY: Duration = Duration::from_millis(20);

/// The offered load.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    /// Clients per target.
    pub clients_per_target: usize,
    /// Requests per second, per client.
    pub rate: f64,
    /// The most requests one client has waiting for an answer; a tick with
    /// none left is counted as shed (not sent).
    pub in_flight: usize,
}

/// Clients running.
#[derive(Debug)]
pub struct Generator {
    start: Instant,
    start_unix_ms: f64,
    stop: watch::Sender<bool>,
    clients: Vec<JoinHandle<()>>,
    records: Arc<Mutex<Vec<Record>>>,
    probes: Arc<Mutex<Vec<Probe>>>,
    shed: Arc<AtomicU64>,
}

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
        * 1000.0
}

/// Everything one request needs.
#[derive(Clone)]
struct Client1 {
    http: Client<HttpConnector, Full<Bytes>>,
    instances: Arc<Vec<SocketAddr>>,
    targets: Arc<Vec<Target>>,
    records: Arc<Mutex<Vec<Record>>>,
    start: Instant,
}

impl Generator {
    /// Starts `load.clients_per_target` clients per target, each sending to
    /// the instances in turn.
    pub fn start(instances: &[SocketAddr], targets: &[Target], load: Load) -> Self {
        let start = Instant::now();
        let start_unix_ms = unix_ms();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let shared = Client1 {
            http: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(load.in_flight * 64)
                .build(connector),
            instances: Arc::new(instances.to_vec()),
            targets: Arc::new(targets.to_vec()),
            records: Arc::default(),
            start,
        };
        let (stop, stopped) = watch::channel(false);
        let shed = Arc::new(AtomicU64::new(0));
        let probes: Arc<Mutex<Vec<Probe>>> = Arc::default();
        let mut clients = Vec::new();
        for instance in 0..instances.len() {
            let shared = shared.clone();
            let probes = probes.clone();
            let mut stopped = stopped.clone();
            clients.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(PROBE_EVERY);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stopped.wait_for(|s| *s) => break,
                    }
                    let probe = shared.probe(instance).await;
                    probes.lock().await.push(probe);
                }
            }));
        }
        let period = Duration::from_secs_f64(1.0 / load.rate);
        let total = targets.len() * load.clients_per_target;
        for c in 0..total {
            let target = c % targets.len();
            let shared = shared.clone();
            let mut stopped = stopped.clone();
            let shed = shed.clone();
            // Spread over one period, so the clients do not tick together.
            let first = tokio::time::Instant::now() + period.mul_f64(c as f64 / total as f64);
            clients.push(tokio::spawn(async move {
                let permits = Arc::new(Semaphore::new(load.in_flight));
                let mut tick = tokio::time::interval_at(first, period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let mut n = c;
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stopped.wait_for(|s| *s) => break,
                    }
                    let Ok(permit) = permits.clone().try_acquire_owned() else {
                        shed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let instance = n % shared.instances.len();
                    n += 1;
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        shared.one(target, instance).await;
                        drop(permit);
                    });
                }
                // Every request of this client answered (or failed).
                let all = u32::try_from(load.in_flight).expect("a small number");
                let _ = permits.acquire_many(all).await;
            }));
        }
        Self {
            start,
            start_unix_ms,
            stop,
            clients,
            records: shared.records,
            probes,
            shed,
        }
    }

    /// Time since the start.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// The Unix time of the start, in ms.
    pub fn start_unix_ms(&self) -> f64 {
        self.start_unix_ms
    }

    /// Stops sending, waits for every answer, and returns the records,
    /// the probes and the number of ticks shed.
    pub async fn stop(self) -> (Vec<Record>, Vec<Probe>, u64) {
        self.stop.send_replace(true);
        for client in self.clients {
            client.await.expect("a client ran");
        }
        let records = std::mem::take(&mut *self.records.lock().await);
        let probes = std::mem::take(&mut *self.probes.lock().await);
        (records, probes, self.shed.load(Ordering::Relaxed))
    }
}

impl Client1 {
    async fn probe(&self, instance: usize) -> Probe {
        let uri = format!("http://{}/healthz", self.instances[instance]);
        let sent = Instant::now();
        let answered = tokio::time::timeout(ANSWER_WITHIN, async {
            let req = Request::get(uri)
                .body(Full::new(Bytes::new()))
                .expect("a valid request");
            let res = self.http.request(req).await.ok()?;
            res.into_body().collect().await.ok()
        })
        .await;
        let latency = match answered {
            Ok(Some(_)) => sent.elapsed(),
            _ => ANSWER_WITHIN,
        };
        Probe {
            instance,
            sent: sent - self.start,
            latency,
        }
    }

    async fn one(&self, target: usize, instance: usize) {
        let t = &self.targets[target];
        let body = t.body.clone();
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{}/v1/check", self.instances[instance]))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("a valid request");
        let sent = Instant::now();
        let answer = tokio::time::timeout(ANSWER_WITHIN, async {
            let res = self.http.request(req).await.map_err(|e| e.to_string())?;
            let status = res.status().as_u16();
            let body = res
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>((status, body))
        })
        .await;
        let latency = sent.elapsed();
        let received_unix_ms = unix_ms();
        let outcome = match answer {
            Err(_) => Outcome::Failed("no answer within 10 s".into()),
            Ok(Err(e)) => Outcome::Failed(e),
            Ok(Ok((200, body))) => classify(t, &body, received_unix_ms),
            Ok(Ok((status, _))) => Outcome::Status(status),
        };
        self.records.lock().await.push(Record {
            target,
            instance,
            sent: sent - self.start,
            latency,
            outcome,
        });
    }
}

/// Reads a decision: who took it (by the numbers it reports) and which
/// window it counts in (its end is the answer's arrival plus its
/// `reset_after`, to within the answer's latency).
fn classify(t: &Target, body: &[u8], received_unix_ms: f64) -> Outcome {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Outcome::Odd(String::from_utf8_lossy(body).into_owned());
    };
    // A rule the store could not decide is listed as undecided, with no
    // quota (its failure policy, fail_open here, admitted the request).
    let undecided = v["undecided"]
        .as_array()
        .is_some_and(|names| names.iter().any(|n| n.as_str() == Some(&t.rule_name)));
    if undecided {
        let Some(allowed) = v["allowed"].as_bool() else {
            return Outcome::Odd(v.to_string());
        };
        return Outcome::Decided {
            source: Source::FailOpen,
            allowed,
            window: (received_unix_ms / t.window_ms as f64).floor() as i64,
            count: None,
        };
    }
    // The target's rule answers first (the rules are reported in the
    // configuration's order).
    let rule = &v["rules"][0];
    if rule["rule"].as_str() != Some(t.rule_name.as_str()) {
        return Outcome::Odd(v.to_string());
    }
    let (Some(allowed), Some(limit), Some(remaining), Some(reset)) = (
        v["allowed"].as_bool(),
        rule["limit"].as_u64(),
        rule["remaining"].as_u64(),
        rule["reset_after_ms"].as_u64(),
    ) else {
        return Outcome::Odd(v.to_string());
    };
    let w = t.window_ms as f64;
    let by_reset = ((received_unix_ms + reset as f64) / w).round() as i64 - 1;
    let source = if limit == t.limit {
        Source::Redis
    } else if limit == t.share {
        Source::Local
    } else {
        return Outcome::Odd(v.to_string());
    };
    Outcome::Decided {
        source,
        allowed,
        window: by_reset,
        count: (source == Source::Redis && allowed).then(|| limit - remaining.min(limit)),
    }
}

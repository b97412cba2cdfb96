//! A load generator: a steady request rate over kept-alive HTTP/1.1
//! connections (each one closed and made again after a number of
//! requests, so that a leak per connection shows), every answer read whole
//! and its latency recorded.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{Conn, Raw};

/// What to send, how fast.
#[derive(Clone)]
pub struct Load {
    /// Requests per second, over all connections.
    pub rate: u32,
    /// Connections open at once.
    pub connections: usize,
    /// Requests on a connection before it is closed and made again.
    pub per_connection: u64,
    /// The `n`-th request's bytes.
    pub request: Arc<dyn Fn(u64) -> Vec<u8> + Send + Sync>,
    /// Whether an answer is the expected one.
    pub expect: Arc<dyn Fn(&Raw) -> bool + Send + Sync>,
}

/// What the load saw so far.
#[derive(Default)]
pub struct Seen {
    /// Latencies (µs) since the last [`take`](Seen::take).
    latencies: Mutex<Vec<u32>>,
    /// Answers as expected.
    pub ok: AtomicU64,
    /// Anything else: another answer, a reset, a cut or late one.
    pub errors: AtomicU64,
    /// The first of those, described.
    pub first_error: Mutex<Option<String>>,
}

impl Seen {
    /// The latencies recorded since the last call, sorted.
    pub fn take(&self) -> Vec<u32> {
        let mut taken = std::mem::take(&mut *self.latencies.lock().expect("latencies"));
        taken.sort_unstable();
        taken
    }

    fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.first_error
            .lock()
            .expect("first error")
            .get_or_insert(what);
    }
}

/// The `q`-quantile (0 to 1) of sorted `values`, in milliseconds.
pub fn quantile_ms(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    f64::from(sorted[i]) / 1000.0
}

/// Starts `load` against `addr` until `stop` turns true.
pub fn start(
    addr: SocketAddr,
    load: Load,
    stop: watch::Receiver<bool>,
) -> (Arc<Seen>, Vec<JoinHandle<()>>) {
    let seen = Arc::new(Seen::default());
    let counter = Arc::new(AtomicU64::new(0));
    let period = Duration::from_secs_f64(load.connections as f64 / f64::from(load.rate.max(1)));
    let workers = (0..load.connections)
        .map(|w| {
            let (load, seen, counter, mut stop) =
                (load.clone(), seen.clone(), counter.clone(), stop.clone());
            tokio::spawn(async move {
                // Spread over the period, so that the rate is steady.
                tokio::time::sleep(period * w as u32 / load.connections as u32).await;
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                'connections: while !*stop.borrow() {
                    let mut conn = match tokio::net::TcpStream::connect(addr).await {
                        Ok(stream) => Conn::new(stream),
                        Err(e) => {
                            seen.error(format!("connect: {e}"));
                            tokio::time::sleep(period).await;
                            continue;
                        }
                    };
                    for _ in 0..load.per_connection {
                        tokio::select! {
                            _ = tick.tick() => {}
                            _ = stop.wait_for(|&s| s) => return,
                        }
                        let n = counter.fetch_add(1, Ordering::Relaxed);
                        let started = Instant::now();
                        let answered = match conn.send(&(load.request)(n)).await {
                            Ok(()) => conn.response(Duration::from_secs(10)).await,
                            Err(cut) => Err(cut),
                        };
                        match answered {
                            Ok(answer) if (load.expect)(&answer) => {
                                let took = started.elapsed().as_micros().min(u128::from(u32::MAX));
                                seen.latencies.lock().expect("latencies").push(took as u32);
                                seen.ok.fetch_add(1, Ordering::Relaxed);
                                if answer.closes() {
                                    continue 'connections;
                                }
                            }
                            Ok(answer) => {
                                seen.error(format!("{} {}", answer.status, answer.text()));
                                continue 'connections;
                            }
                            Err(cut) => {
                                seen.error(format!("{cut:?}"));
                                continue 'connections;
                            }
                        }
                    }
                }
            })
        })
        .collect();
    (seen, workers)
}

//! In-flight slots: the leases a request admitted under concurrency rules
//! holds while it is served.
//!
//! The slot is taken when the request is admitted (the rule's charge). From
//! then on a keeper task holds it: it renews the lease every third of the
//! lease time while the request runs (a stream, a long poll), and gives the
//! slot back (a settle at 0, [`Store::settle`]) as soon as the response has
//! ended or been left: the guard the response body carries is dropped then,
//! whatever happened (the body ended, failed, or was dropped because the
//! client went away), so a release is not a best effort. A release the
//! store does not answer is sent again, under the same settle id, until the
//! lease would have ended by itself; a process that dies holding slots
//! holds them until their leases end, and no longer.

use std::sync::Arc;
use std::time::Duration;

use spillway::algorithm::Charged;
use spillway::store::{Renew, Settle, Store};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::engine::{Charge, Engine, LeaseEvent, settle_id};

/// How long a keeper waits before it sends a failed release again.
const RELEASE_RETRY: Duration = Duration::from_millis(500);

/// One slot a request holds.
#[derive(Debug)]
pub(crate) struct Kept {
    pub(crate) charge: Charge,
    /// The lease as it now stands: taken (or last renewed) at `charged.at`.
    pub(crate) charged: Charged,
    /// How long the rule's leases last.
    pub(crate) lease: Duration,
    /// When the lease ends by itself, on this process's clock: the last
    /// time the store said it was held, plus the lease. `None` while it is
    /// not held (lost, or admitted without the store's decision).
    pub(crate) ends: Option<Instant>,
}

/// The guard of a request's leases: while it lives, they are renewed;
/// dropped, they are released.
#[derive(Debug)]
pub(crate) struct Leases {
    // Dropped, it tells the keeper the request is over.
    _over: oneshot::Sender<()>,
}

impl Leases {
    /// Keeps `leases` on `engine` until the guard is dropped. `None` (and
    /// the leases end by themselves) when there is no runtime to keep them
    /// on, which a service under hyper or axum always has.
    pub(crate) fn keep<St: Store + 'static>(
        engine: Arc<Engine<St>>,
        leases: Vec<Kept>,
    ) -> Option<Self> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no runtime to keep in-flight leases on: they end by themselves");
            return None;
        };
        let (over, done) = oneshot::channel();
        runtime.spawn(keeper(engine, leases, done));
        Some(Self { _over: over })
    }
}

/// Renews `leases` until `done` fires (its sender is dropped), then
/// releases them.
async fn keeper<St: Store>(
    engine: Arc<Engine<St>>,
    mut leases: Vec<Kept>,
    mut done: oneshot::Receiver<()>,
) {
    let every = leases
        .iter()
        .map(|k| k.lease / 3)
        .min()
        .unwrap_or(Duration::from_secs(10))
        .max(Duration::from_millis(1));
    let mut next = Instant::now() + every;
    loop {
        tokio::select! {
            biased;
            _ = &mut done => break,
            () = tokio::time::sleep_until(next) => {}
        }
        // Once sent, a renew is seen through even if the request ends
        // meanwhile: its answer says where the lease now is, which the
        // release must name.
        let wait = renew(&engine, &mut leases).await;
        next = Instant::now() + wait.unwrap_or(every.min(RELEASE_RETRY));
    }
    release(&engine, &leases).await;
}

/// Renews every lease once: `Some` of the time to the next renew when the
/// store answered, `None` when it did not (try again soon).
async fn renew<St: Store>(engine: &Engine<St>, leases: &mut [Kept]) -> Option<Duration> {
    let renews: Vec<Renew<'_>> = leases
        .iter()
        .map(|k| Renew {
            rule: k.charge.rule_id(),
            key: k.charge.key(),
            charged: k.charged,
        })
        .collect();
    let asked = Instant::now();
    let renewed = match engine.store().renew(&renews).await {
        Ok(renewed) => renewed,
        Err(e) => {
            tracing::warn!(error = %e, "could not renew an in-flight lease: trying again");
            return None;
        }
    };
    drop(renews);
    let mut every = Duration::MAX;
    for (k, r) in leases.iter_mut().zip(renewed) {
        let event = match (r.was_held, r.decision.allowed) {
            (true, _) => LeaseEvent::Renewed,
            (false, true) => LeaseEvent::Retaken,
            (false, false) => LeaseEvent::Lost,
        };
        if r.decision.allowed {
            k.charged = Charged::of(k.charged.cost, r.at, &r.decision);
            k.ends = Some(asked + k.lease);
        } else {
            k.ends = None;
        }
        every = every.min(k.lease / 3);
        if let Some(observer) = engine.observer() {
            observer.lease(engine.rule_name(&k.charge), event);
        }
    }
    Some(every)
}

/// Gives back every lease still held, sending the release again while the
/// store does not answer, until the leases would have ended by themselves.
async fn release<St: Store>(engine: &Engine<St>, leases: &[Kept]) {
    let held: Vec<&Kept> = leases.iter().filter(|k| k.ends.is_some()).collect();
    if held.is_empty() {
        return;
    }
    let settles: Vec<Settle<'_>> = held
        .iter()
        .map(|k| Settle {
            rule: k.charge.rule_id(),
            key: k.charge.key(),
            charged: k.charged,
            actual: 0,
        })
        .collect();
    let last_end = held.iter().filter_map(|k| k.ends).max();
    // One id for every send: the store applies it once.
    let id = settle_id();
    let event = loop {
        match engine.store().settle(&id, &settles).await {
            Ok(_) => break LeaseEvent::Released,
            Err(e) if last_end.is_some_and(|end| Instant::now() + RELEASE_RETRY < end) => {
                tracing::warn!(error = %e, "could not release an in-flight lease: trying again");
                tokio::time::sleep(RELEASE_RETRY).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not release an in-flight lease: it ends by itself");
                break LeaseEvent::Expired;
            }
        }
    };
    if let Some(observer) = engine.observer() {
        for k in held {
            observer.lease(engine.rule_name(&k.charge), event);
        }
    }
}

//! In-flight slots: the leases a request admitted under concurrency rules
//! holds while it is served.
//!
//! The slot is taken when the request is admitted (the rule's charge). The
//! request's guard ([`Leases`]), which its response carries, enters it in
//! the engine's [`LeaseBook`]. One renewer task per engine goes through the
//! book every third of the shortest lease and renews, in one store call,
//! every lease due (a stream, a long poll: a request that has run a third
//! of its lease). When the response has ended or been left (the body ended,
//! failed or was dropped because the client went away, or the response
//! future was dropped before a response), the guard is dropped and gives
//! the slot back (a settle at 0, [`Store::settle`]): at once where the
//! store answers without waiting (in memory), else from a task that sends
//! the release again, under the same settle id, until the lease would have
//! ended by itself. A process that dies holding slots holds them until
//! their leases end, and no longer.
//!
//! Most requests end long before a third of their lease: they cost the
//! book an insert and a removal, and no task, timer or store call but the
//! release.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use spillway::algorithm::Charged;
use spillway::store::{Renew, Settle, Store};
use tokio::time::Instant;

use crate::engine::{Charge, Engine, LeaseEvent, settle_id};

/// The most requests whose leases one renew call carries.
const RENEW_BATCH: usize = 64;

/// How long a release task waits before it sends a failed release again.
const RELEASE_RETRY: Duration = Duration::from_millis(500);

/// How many shards the book's map has: requests on many threads enter and
/// leave it at once.
const SHARDS: usize = 16;

/// One slot a request holds.
#[derive(Debug)]
pub(crate) struct Kept {
    pub(crate) charge: Charge,
    /// The charge that names the lease (its name never changes; a charge
    /// that names none, `reset_after` 0, is given one by its first renew).
    pub(crate) charged: Charged,
    /// How long the rule's leases last.
    pub(crate) lease: Duration,
    /// When the lease ends by itself, on this process's clock: the last
    /// time the store said it was held, plus the lease. `None` while it is
    /// not held (lost).
    pub(crate) ends: Option<Instant>,
}

/// The book's entries by id, in one shard.
type Shard = HashMap<u64, Arc<Entry>>;

/// An entry due for a renew, with a copy of its leases as they stand.
type Due = (Arc<Entry>, Vec<(Charge, Charged)>);

/// A request's leases while it is served.
#[derive(Debug)]
struct Entry {
    state: Mutex<EntryState>,
}

#[derive(Debug)]
struct EntryState {
    leases: Vec<Kept>,
    /// When the leases are next due for a renew.
    renew_at: Instant,
    /// Every third of the shortest of its leases.
    every: Duration,
    /// A renew of them is under way: the renewer releases them once it is
    /// answered if the request has ended meanwhile.
    renewing: bool,
    /// The request has ended.
    ended: bool,
}

/// The leases of an engine's requests in flight, which its renewer task
/// renews when they are due.
#[derive(Debug)]
pub(crate) struct LeaseBook {
    shards: Box<[Mutex<Shard>]>,
    next: AtomicU64,
    /// How often the renewer looks: a third of the shortest lease.
    tick: Duration,
    /// Whether the renewer task has been started.
    renewing: AtomicBool,
}

impl LeaseBook {
    /// A book whose renewer looks every third of `shortest`.
    pub(crate) fn new(shortest: Duration) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            next: AtomicU64::new(0),
            tick: (shortest / 3).max(Duration::from_millis(1)),
            renewing: AtomicBool::new(false),
        }
    }

    fn shard(&self, id: u64) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[id as usize % SHARDS]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Every entry due at `now`, marked as being renewed, with a copy of
    /// what to renew.
    fn due(&self, now: Instant) -> Vec<Due> {
        let mut due = Vec::new();
        for shard in self.shards.iter() {
            let entries: Vec<Arc<Entry>> = shard
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .cloned()
                .collect();
            for entry in entries {
                let mut st = entry.state.lock().unwrap_or_else(|p| p.into_inner());
                // Half a tick early rather than up to a tick late: a lease
                // is renewed at most half its time after its last renew.
                if st.ended || st.renewing || st.renew_at > now + self.tick / 2 {
                    continue;
                }
                st.renewing = true;
                let leases = st
                    .leases
                    .iter()
                    .map(|k| (k.charge.clone(), k.charged))
                    .collect();
                drop(st);
                due.push((entry, leases));
            }
        }
        due
    }
}

/// The engine, without its store's type, as a request's guard needs it.
pub(crate) trait Keeper: Send + Sync + 'static {
    /// The engine's book.
    fn book(&self) -> &LeaseBook;
    /// Gives `leases` back: at once if the store answers without waiting,
    /// else from a task.
    fn release(self: Arc<Self>, leases: Vec<Kept>);
    /// Starts the renewer task if it is not running.
    fn start_renewer(self: Arc<Self>);
}

impl<St: Store + 'static> Keeper for Engine<St> {
    fn book(&self) -> &LeaseBook {
        self.lease_book()
    }

    fn release(self: Arc<Self>, leases: Vec<Kept>) {
        let held: Vec<Kept> = leases.into_iter().filter(|k| k.ends.is_some()).collect();
        if held.is_empty() {
            return;
        }
        let settles = settles_of(&held);
        if let Some(result) = self.store().try_settle_once_now(&settles) {
            let event = match result {
                Ok(_) => LeaseEvent::Released,
                Err(e) => {
                    tracing::warn!(error = %e, "could not release an in-flight lease: it ends by itself");
                    LeaseEvent::Expired
                }
            };
            observe(&self, &held, event);
            return;
        }
        drop(settles);
        let id = settle_id();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move { release(&self, id, held).await })),
            Err(_) => {
                tracing::warn!("no runtime to release an in-flight lease on: it ends by itself")
            }
        }
    }

    fn start_renewer(self: Arc<Self>) {
        if self.book().renewing.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(renewer(Arc::downgrade(&self)))),
            Err(_) => {
                self.book().renewing.store(false, Ordering::Release);
                tracing::warn!("no runtime to renew in-flight leases on: they end by themselves");
            }
        }
    }
}

/// The guard of a request's leases: while it lives, they are renewed when
/// due; dropped, they are released.
pub(crate) struct Leases {
    keeper: Arc<dyn Keeper>,
    entry: Arc<Entry>,
    id: u64,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Leases {
    /// Enters `leases` in `keeper`'s book until the guard is dropped.
    pub(crate) fn keep(keeper: Arc<dyn Keeper>, leases: Vec<Kept>) -> Self {
        let every = leases
            .iter()
            .map(|k| k.lease / 3)
            .min()
            .unwrap_or(Duration::from_secs(10));
        let entry = Arc::new(Entry {
            state: Mutex::new(EntryState {
                leases,
                renew_at: Instant::now() + every,
                every,
                renewing: false,
                ended: false,
            }),
        });
        let book = keeper.book();
        let id = book.next.fetch_add(1, Ordering::Relaxed);
        book.shard(id).insert(id, entry.clone());
        if !book.renewing.load(Ordering::Acquire) {
            keeper.clone().start_renewer();
        }
        Self { keeper, entry, id }
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        self.keeper.book().shard(self.id).remove(&self.id);
        let mut st = self.entry.state.lock().unwrap_or_else(|p| p.into_inner());
        st.ended = true;
        // A renew under way releases them once answered: it knows where
        // the leases then are.
        if st.renewing {
            return;
        }
        let leases = std::mem::take(&mut st.leases);
        drop(st);
        self.keeper.clone().release(leases);
    }
}

/// The settles that give `leases` back.
fn settles_of(leases: &[Kept]) -> Vec<Settle<'_>> {
    leases
        .iter()
        .map(|k| Settle {
            rule: k.charge.rule_id(),
            key: k.charge.key(),
            charged: k.charged,
            actual: 0,
        })
        .collect()
}

fn observe<St: Store>(engine: &Engine<St>, leases: &[Kept], event: LeaseEvent) {
    if let Some(observer) = engine.observer() {
        for k in leases {
            observer.lease(engine.rule_name(&k.charge), event);
        }
    }
}

/// Renews the leases due, every tick, while the engine lives.
async fn renewer<St: Store + 'static>(engine: Weak<Engine<St>>) {
    let Some(tick) = engine.upgrade().map(|e| e.lease_book().tick) else {
        return;
    };
    // Stopped (the engine gone, or the runtime it ran on shut down), it
    // lets the next request start another.
    struct Stopped<St: Store + 'static>(Weak<Engine<St>>);
    impl<St: Store + 'static> Drop for Stopped<St> {
        fn drop(&mut self) {
            if let Some(engine) = self.0.upgrade() {
                engine.lease_book().renewing.store(false, Ordering::Release);
            }
        }
    }
    let _stopped = Stopped(engine.clone());
    loop {
        tokio::time::sleep(tick).await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        // At most RENEW_BATCH requests' leases a store call: one call holds
        // Redis for its whole length, and a call that times out is sent
        // again, so a smaller one costs less either way.
        let mut due = engine.lease_book().due(Instant::now());
        while !due.is_empty() {
            let rest = due.split_off(due.len().min(RENEW_BATCH));
            renew(&engine, due).await;
            due = rest;
        }
    }
}

/// Renews the leases of `due` in one store call; each entry then goes on,
/// or is released if its request ended meanwhile. A failed call leaves
/// them due: the next tick tries again.
async fn renew<St: Store + 'static>(engine: &Arc<Engine<St>>, due: Vec<Due>) {
    let renews: Vec<Renew<'_>> = due
        .iter()
        .flat_map(|(_, leases)| leases)
        .map(|(charge, charged)| Renew {
            rule: charge.rule_id(),
            key: charge.key(),
            charged: *charged,
        })
        .collect();
    let asked = Instant::now();
    let renewed = match engine.store().renew(&renews).await {
        Ok(renewed) => Some(renewed),
        Err(e) => {
            tracing::warn!(error = %e, "could not renew in-flight leases: trying again");
            None
        }
    };
    drop(renews);
    let mut answers = renewed.into_iter().flatten();
    for (entry, _) in due {
        let mut st = entry.state.lock().unwrap_or_else(|p| p.into_inner());
        st.renewing = false;
        let every = st.every;
        let mut answered = false;
        for k in &mut st.leases {
            let Some(r) = answers.next() else {
                break;
            };
            answered = true;
            let event = match (r.was_held, r.decision.allowed) {
                (true, _) => LeaseEvent::Renewed,
                (false, true) => LeaseEvent::Retaken,
                (false, false) => LeaseEvent::Lost,
            };
            if let Some(observer) = engine.observer() {
                observer.lease(engine.rule_name(&k.charge), event);
            }
            if r.decision.allowed {
                k.charged = r.names(k.charged);
                k.ends = Some(asked + k.lease);
            } else {
                k.ends = None;
            }
        }
        if answered {
            st.renew_at = asked + every;
        }
        let ended = st.ended.then(|| std::mem::take(&mut st.leases));
        drop(st);
        if let Some(leases) = ended {
            Keeper::release(engine.clone(), leases);
        }
    }
}

/// Gives back `held`, sending the release again while the store does not
/// answer, until the leases would have ended by themselves.
async fn release<St: Store>(engine: &Engine<St>, id: String, held: Vec<Kept>) {
    let settles = settles_of(&held);
    let last_end = held.iter().filter_map(|k| k.ends).max();
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
    observe(engine, &held, event);
}

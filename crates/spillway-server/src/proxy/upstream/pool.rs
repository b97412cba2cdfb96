//! The upstream connections of the HTTP/2 clients, all together (see
//! [`Pool`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::OwnUpstream;
use crate::proxy::error::ForwardError;

/// The upstream connections of the HTTP/2 clients, all together: at most
/// as many open at once as the pool has slots (`[proxy]
/// pool_max_connections`), idle ones included, each client's kept between
/// its requests. Kept connections never keep a request from being served,
/// as they did not in a pool all clients shared: a request that finds no
/// slot free closes some client's idle connection, and while a request
/// waits for a slot, a connection whose request ends is closed rather than
/// kept, its slot going to the request.
pub(crate) struct Pool {
    pub(super) slots: Arc<Semaphore>,
    /// The clients that keep idle connections now, by number: at most one
    /// a slot, so a request short of one finds an idle connection without
    /// looking at every client.
    pub(super) holders: Mutex<HashMap<u64, Weak<OwnUpstream>>>,
    pub(super) next: AtomicU64,
    /// How many connections the clients keep idle.
    pub(super) idle: AtomicUsize,
    /// How many requests wait for a slot.
    waiting: AtomicUsize,
}

/// A client's place in the [`Pool`]: the pool, its number, and itself (to
/// be found by a request short of a slot while it keeps idle connections).
pub(crate) struct Member {
    pub(super) pool: Arc<Pool>,
    pub(super) id: u64,
    pub(super) me: Weak<OwnUpstream>,
}

impl Pool {
    pub(crate) fn new(slots: Arc<Semaphore>) -> Arc<Self> {
        Arc::new(Self {
            slots,
            holders: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            idle: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
        })
    }

    /// A slot for a new connection: a free one, or one an idle connection
    /// gives up, or one that frees within `wait` (else `503`).
    pub(super) async fn slot(&self, wait: Duration) -> Result<OwnedSemaphorePermit, ForwardError> {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Ok(slot);
        }
        // Counted before the look for an idle connection: one kept after it
        // is closed for this request.
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let _waits = Waits(&self.waiting);
        self.close_an_idle_connection();
        match tokio::time::timeout(wait, self.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => Ok(slot),
            Ok(Err(_)) | Err(_) => Err(ForwardError::Busy(wait)),
        }
    }

    /// Whether a request waits for a slot: a connection whose request ended
    /// is then closed, not kept.
    pub(super) fn is_waited_for(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }

    /// `member` kept a connection (and closed `stale` ones), and now keeps
    /// `now`. Called with its kept connections locked.
    pub(super) fn kept(&self, member: &Member, stale: usize, now: usize) {
        self.idle.fetch_add(1, Ordering::AcqRel);
        self.idle.fetch_sub(stale, Ordering::AcqRel);
        if now == 1 {
            self.holders
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(member.id, member.me.clone());
        }
    }

    /// Client `id` took a kept connection and keeps `left`. Called with its
    /// kept connections locked.
    pub(super) fn took(&self, id: u64, left: usize) {
        self.idle.fetch_sub(1, Ordering::AcqRel);
        if left == 0 {
            self.holders
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&id);
        }
    }

    /// Client `id` is gone, and the `kept` connections it kept with it.
    pub(super) fn left(&self, id: u64, kept: usize) {
        self.idle.fetch_sub(kept, Ordering::AcqRel);
        self.holders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }

    /// Closes an idle connection, the oldest of some client that keeps any.
    fn close_an_idle_connection(&self) {
        // A few tries: a client found may be going, or have just taken its
        // last one.
        for _ in 0..4 {
            if self.idle.load(Ordering::Acquire) == 0 {
                return;
            }
            // Out of the lock first: a client dropped here may be the last
            // of it, whose drop takes the lock.
            let found = self
                .holders
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .next()
                .map(|(id, holder)| (*id, holder.clone()));
            let Some((id, holder)) = found else {
                return;
            };
            let Some(own) = holder.upgrade() else {
                self.holders
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&id);
                continue;
            };
            let mut kept = own.kept.lock().unwrap_or_else(PoisonError::into_inner);
            if kept.is_empty() {
                continue;
            }
            drop(kept.remove(0));
            self.took(id, kept.len());
            return;
        }
    }
}

/// A request counted among those waiting for a slot while it lives.
struct Waits<'a>(&'a AtomicUsize);

impl Drop for Waits<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::conn;
    use super::*;
    use crate::proxy::ProxyOptions;
    use crate::proxy::forward::Upstream;
    use crate::proxy::headers::Hop;

    #[tokio::test]
    async fn a_client_short_of_a_slot_closes_an_idle_connection_of_another() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = Arc::new(Upstream::parse(&"http://127.0.0.1:9".parse().unwrap()).unwrap());
        let options = ProxyOptions::default();
        let slots = Arc::new(Semaphore::new(2));
        let pool = Pool::new(slots.clone());
        let first = OwnUpstream::shared(
            Hop::of("10.0.0.1".parse().unwrap()),
            upstream.clone(),
            &options,
            &pool,
        );
        let second = OwnUpstream::shared(
            Hop::of("10.0.0.2".parse().unwrap()),
            upstream,
            &options,
            &pool,
        );
        let mut ends = Vec::new();
        for own in [&first, &second] {
            let mut c = conn(&listener, &mut ends).await;
            c._slot = Some(pool.slot(Duration::ZERO).await.unwrap());
            own.keep(c);
        }
        assert_eq!(slots.available_permits(), 0);
        // A third client's slot comes from an idle connection of one of
        // them (`first` is now that one).
        let slot = pool.slot(Duration::ZERO).await.expect("a slot");
        let left = |own: &OwnUpstream| own.kept.lock().unwrap().len();
        assert_eq!(
            left(&first) + left(&second),
            1,
            "one idle connection closed"
        );
        let (first, second) = if left(&first) == 0 {
            (first, second)
        } else {
            (second, first)
        };
        assert_eq!(left(&first), 0);
        assert_eq!(pool.idle.load(Ordering::Acquire), 1);
        drop(slot);
        // A client gone leaves the holders, and its idle connections the
        // count.
        assert_eq!(pool.holders.lock().unwrap().len(), 1);
        drop(second);
        assert_eq!(pool.idle.load(Ordering::Acquire), 0);
        assert!(pool.holders.lock().unwrap().is_empty());
        assert_eq!(slots.available_permits(), 2);
    }
}

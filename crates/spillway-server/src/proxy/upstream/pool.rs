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
/// pool_max_connections`), each client's kept between its requests. A
/// client that finds no slot free closes another client's idle connection
/// first: kept connections never keep a request from being served, as
/// they did not in a pool all clients shared.
pub(crate) struct Pool {
    pub(super) slots: Arc<Semaphore>,
    /// The clients that may keep idle connections, by number.
    pub(super) users: Mutex<HashMap<u64, Weak<OwnUpstream>>>,
    pub(super) next: AtomicU64,
    /// How many connections the clients keep idle: none, and a client short
    /// of a slot looks at no other.
    pub(super) idle: AtomicUsize,
}

impl Pool {
    pub(crate) fn new(slots: Arc<Semaphore>) -> Arc<Self> {
        Arc::new(Self {
            slots,
            users: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            idle: AtomicUsize::new(0),
        })
    }

    /// A slot for a new connection: a free one, or one an idle connection
    /// gives up, or one that frees within `wait` (else `503`).
    pub(super) async fn slot(&self, wait: Duration) -> Result<OwnedSemaphorePermit, ForwardError> {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Ok(slot);
        }
        self.close_an_idle_connection();
        match tokio::time::timeout(wait, self.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => Ok(slot),
            Ok(Err(_)) | Err(_) => Err(ForwardError::Busy(wait)),
        }
    }

    /// Closes the connection idle the longest among the clients' kept ones.
    fn close_an_idle_connection(&self) {
        if self.idle.load(Ordering::Acquire) == 0 {
            return;
        }
        // The clients are taken out of the lock first: one dropped here may
        // be the last of it, whose drop takes the lock.
        let users: Vec<Arc<OwnUpstream>> = self
            .users
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        let oldest = users
            .iter()
            .filter_map(|own| {
                let kept = own.kept.lock().unwrap_or_else(PoisonError::into_inner);
                kept.first().map(|(_, since)| (*since, own))
            })
            .min_by_key(|(since, _)| *since);
        if let Some((_, own)) = oldest {
            let mut kept = own.kept.lock().unwrap_or_else(PoisonError::into_inner);
            if !kept.is_empty() {
                drop(kept.remove(0));
                self.idle.fetch_sub(1, Ordering::AcqRel);
            }
        }
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
    async fn a_client_short_of_a_slot_closes_the_connection_idle_the_longest() {
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
        // A third client's slot comes from the oldest idle connection: the
        // first client's.
        let slot = pool.slot(Duration::ZERO).await.expect("a slot");
        assert!(first.kept.lock().unwrap().is_empty());
        assert_eq!(second.kept.lock().unwrap().len(), 1);
        assert_eq!(pool.idle.load(Ordering::Acquire), 1);
        drop(slot);
        // A client gone leaves the registry, and its idle connections the count.
        drop(second);
        assert_eq!(pool.idle.load(Ordering::Acquire), 0);
        assert_eq!(pool.users.lock().unwrap().len(), 1);
        assert_eq!(slots.available_permits(), 2);
    }
}

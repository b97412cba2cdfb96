//! The deadlines of one client connection of the proxy's HTTP/1.1 path:
//! its next request head (hyper's `header_read_timeout`) and its
//! upstream's response head (`[proxy] response_timeout`). Each is kept by
//! one timer for the connection's life ([`Deadline`]), moved with every
//! request and reset only when it fires before the deadline, rather than a
//! timer made, registered in tokio's wheel and taken out of it for every
//! request (issue 31: the wheel was about 2.5% of the proxy's time).
//!
//! Each deadline is waited on by one future at a time: hyper reads one
//! request head at a time, and an HTTP/1.1 connection serves one request
//! at a time. Both are polled by the connection's task.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use crate::http1::Deadline;

/// One deadline of a connection, shared by the futures that wait on it in
/// turn.
#[derive(Clone, Default)]
pub(crate) struct ConnDeadline(Arc<Mutex<Option<Deadline>>>);

impl ConnDeadline {
    /// Ready once `at` has passed.
    fn poll_passed(&self, at: Instant, cx: &mut Context<'_>) -> Poll<()> {
        let mut kept = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let deadline = kept.get_or_insert_with(|| Deadline::new(at));
        deadline.set(at);
        deadline.poll_passed(cx)
    }

    /// `future`'s output, or `None` if `at` passes first.
    pub(crate) async fn within<F: Future>(&self, at: Instant, future: F) -> Option<F::Output> {
        let mut future = std::pin::pin!(future);
        poll_fn(|cx| {
            if let Poll::Ready(out) = future.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            self.poll_passed(at, cx).map(|()| None)
        })
        .await
    }
}

/// hyper's timer for one connection's request heads: each head's sleep
/// waits on the connection's one [`ConnDeadline`].
#[derive(Clone, Default)]
pub(crate) struct HeadTimer(ConnDeadline);

impl hyper::rt::Timer for HeadTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until((Instant::now() + duration).into_std())
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(HeadSleep {
            deadline: self.0.clone(),
            at: Instant::from_std(deadline),
        })
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: std::time::Instant) {
        match sleep.as_mut().downcast_mut_pin::<HeadSleep>() {
            Some(sleep) => sleep.get_mut().at = Instant::from_std(new_deadline),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }

    // tokio's clock, which tests pause and advance.
    fn now(&self) -> std::time::Instant {
        Instant::now().into_std()
    }
}

/// One request head's wait.
struct HeadSleep {
    deadline: ConnDeadline,
    at: Instant,
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.deadline.poll_passed(self.at, cx)
    }
}

impl hyper::rt::Sleep for HeadSleep {}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer;

    /// A deadline moved on by every request fires at the last one, not at
    /// the first, and a wait that outlives it ends then.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_is_the_last_one_set() {
        let deadline = ConnDeadline::default();
        let start = Instant::now();
        // Ten requests a second apart, each answered at once.
        for i in 0..10 {
            let at = Instant::now() + Duration::from_secs(5);
            assert_eq!(deadline.within(at, async { i }).await, Some(i));
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        // The eleventh never is: it ends at its own deadline, 5 s on.
        let at = Instant::now() + Duration::from_secs(5);
        let never = deadline.within(at, std::future::pending::<()>()).await;
        assert_eq!(never, None);
        assert_eq!(Instant::now() - start, Duration::from_secs(15));
    }

    /// A deadline moved earlier than the timer's is kept too.
    #[tokio::test(start_paused = true)]
    async fn a_deadline_moved_earlier_is_kept() {
        let deadline = ConnDeadline::default();
        let start = Instant::now();
        let late = start + Duration::from_secs(60);
        assert_eq!(deadline.within(late, async { 1 }).await, Some(1));
        let soon = start + Duration::from_secs(2);
        assert_eq!(
            deadline.within(soon, std::future::pending::<()>()).await,
            None
        );
        assert_eq!(Instant::now() - start, Duration::from_secs(2));
    }

    /// hyper's sleeps, made and reset by the timer, end at their deadline.
    #[tokio::test(start_paused = true)]
    async fn the_head_timer_sleeps_until_its_deadline() {
        let timer = HeadTimer::default();
        let start = Instant::now();
        let mut sleep = timer.sleep(Duration::from_secs(30));
        timer.reset(&mut sleep, timer.now() + Duration::from_secs(3));
        sleep.as_mut().await;
        assert_eq!(Instant::now() - start, Duration::from_secs(3));
        // A second head, after the first was read, waits its own time.
        let mut sleep = timer.sleep(Duration::from_secs(7));
        sleep.as_mut().await;
        assert_eq!(Instant::now() - start, Duration::from_secs(10));
    }
}

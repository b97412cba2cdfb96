//! How the in-memory store holds one key's state so that threads deciding
//! on the same key at once need not take its shard's lock exclusively.
//!
//! A check of a key the table already holds takes the shard's lock
//! exclusively if it is free, and decides on the state with plain loads and
//! stores ([`SharedState::decide_mut`]): one atomic operation fewer than
//! the shared path, for the common case of nobody else on the shard. If the
//! lock is taken, the check takes it shared, finds the key, and decides on
//! its state in place ([`SharedState::decide`]). Every other thread checking a key of the same
//! shard, the same key included, goes on at the same time: they meet only on
//! the one word they both change. Everything that changes the table itself
//! (a new key, an idle key forgotten, a sweep, an eviction, a request of
//! several rules decided atomically) takes the shard's lock exclusively and
//! reaches the state without any atomic operation
//! ([`SharedState::with_mut`]).
//!
//! The states of the token bucket, the leaky bucket, the fixed window and
//! the sliding window are two or three integers, held as that many atomic
//! words. An ordinary check changes one of them: a bucket's time (in whole
//! microseconds, when a unit of cost is a whole number of them), a window's
//! count. The other words (a bucket's fraction of a microsecond, a window's
//! index, the previous window's count) change only when a window rolls over
//! or the clock goes back, and then the decision goes to the exclusive
//! path. So under the shared lock the other words are constant, and a
//! compare-and-swap of the changing one, retried while another thread moved
//! it (the transition is pure, so running it again is harmless), makes each
//! decision exactly the one a single thread would have made: the same
//! read-modify-write traffic as governor's, with no lock of our own to
//! hold. Buckets whose unit is a fraction of a microsecond (3 a second) move
//! their fraction on nearly every check and are never tried in place
//! ([`SharedState::decides_in_place`]).
//!
//! The sliding log is a list that no fixed set of words holds. Its checks
//! take the shard's lock exclusively, as before.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::algorithm::concurrency::{Lease, LeaseState};
use crate::algorithm::fixed_window::FixedWindowState;
use crate::algorithm::sliding_log::{LogEntry, SlidingLogState};
use crate::algorithm::sliding_window::SlidingWindowState;
use crate::algorithm::token_bucket::TokenBucketState;
use crate::algorithm::{Algorithm, AnyAlgorithm, AnyState};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;

/// How the in-memory store keeps a state of this type in its table, so that
/// concurrent checks of one key can decide on it without the shard's
/// exclusive lock. Implemented for the state of every algorithm of this
/// crate and for [`AnyState`].
///
/// An [`Algorithm`] of your own can use [`RateLimiter`](super::RateLimiter)
/// once its state implements this trait; the simplest implementation holds
/// the state as it is and answers `None` to [`decide`](Self::decide), so
/// that every check takes the shard's lock exclusively:
///
/// ```
/// use spillway::{Algorithm, CostTooLarge, Decision};
/// use spillway::clock::Micros;
/// use spillway::store::SharedState;
///
/// #[derive(Debug, Clone, Default)]
/// struct Seen(Vec<u64>);
///
/// impl SharedState for Seen {
///     type Cell = Seen;
///     fn into_cell(self) -> Seen { self }
///     fn with_mut<R>(cell: &mut Seen, f: impl FnOnce(&mut Seen) -> R) -> R { f(cell) }
///     fn decide<A: Algorithm<State = Seen>>(_: &Seen, _: &A, _: u64, _: Micros)
///         -> Option<Result<Decision, CostTooLarge>> { None }
/// }
/// let mut cell = Seen::default().into_cell();
/// Seen::with_mut(&mut cell, |s| s.0.push(7));
/// assert_eq!(cell.0, [7]);
/// ```
pub trait SharedState: Sized {
    /// The state as the table holds it.
    type Cell: Send + Sync + fmt::Debug;

    /// The cell holding `self`.
    fn into_cell(self) -> Self::Cell;

    /// Runs `f` on the state, with the only access to the cell there is (the
    /// shard is locked exclusively).
    fn with_mut<R>(cell: &mut Self::Cell, f: impl FnOnce(&mut Self) -> R) -> R;

    /// Decides on a request of `cost` at `now` in place, atomically with
    /// respect to every other `decide` of the same cell, while others may
    /// hold a shared reference to it (the shard is locked shared, so only
    /// other `decide`s can touch the cell). `None`, having changed nothing,
    /// when the exclusive path must decide instead: the cell cannot decide
    /// in place, the decision would change more of the state than an
    /// ordinary check does (a window rolling over), or a check that charged
    /// nothing leaves the state idle (so that the key can go).
    fn decide<A: Algorithm<State = Self>>(
        cell: &Self::Cell,
        alg: &A,
        cost: u64,
        now: Micros,
    ) -> Option<Result<Decision, CostTooLarge>>;

    /// [`decide`](Self::decide) with the only access to the cell there is
    /// (the shard is locked exclusively), so with plain loads and stores
    /// rather than atomic operations; `None` in the same cases, having
    /// changed nothing. By default, `decide` itself.
    fn decide_mut<A: Algorithm<State = Self>>(
        cell: &mut Self::Cell,
        alg: &A,
        cost: u64,
        now: Micros,
    ) -> Option<Result<Decision, CostTooLarge>> {
        Self::decide(cell, alg, cost, now)
    }

    /// Whether [`decide`](Self::decide) can decide `alg`'s ordinary checks
    /// at all, asked once when a store is built: a store does not try it
    /// for an algorithm where it would hand nearly every check to the
    /// exclusive path anyway.
    fn decides_in_place<A: Algorithm<State = Self>>(alg: &A) -> bool {
        let _ = alg;
        true
    }

    /// The bytes the state owns on the heap, beyond the cell itself (a
    /// sliding log's buffer), as [`MemoryOptions::max_memory`](super::MemoryOptions::max_memory)
    /// counts them. None by default.
    fn heap_bytes(cell: &Self::Cell) -> usize {
        let _ = cell;
        0
    }

    /// The most that one check can add to [`heap_bytes`](Self::heap_bytes)
    /// (a log whose buffer is full doubles it). None by default.
    fn heap_growth(cell: &Self::Cell) -> usize {
        let _ = cell;
        0
    }
}

/// One check on a state, for [`SharedState::decide`]: `None` if it leaves
/// the state idle without charging it, for the exclusive path to forget it.
#[inline(always)]
fn settle<A: Algorithm>(
    alg: &A,
    state: &mut A::State,
    cost: u64,
    now: Micros,
) -> Option<Result<Decision, CostTooLarge>> {
    match alg.check(state, cost, now) {
        Ok(decision) => {
            let charged = decision.allowed && cost > 0;
            (charged || alg.idle_at(state) > now).then_some(Ok(decision))
        }
        Err(e) => Some(Err(e)),
    }
}

/// `N` words of state, of which one, the `HOT`th, is the one an ordinary
/// check changes (a bucket's time, a window's count).
pub struct Words<const N: usize, const HOT: usize>([AtomicU64; N]);

impl<const N: usize, const HOT: usize> Words<N, HOT> {
    #[inline(always)]
    fn new(words: [u64; N]) -> Self {
        Self(words.map(AtomicU64::new))
    }

    #[inline(always)]
    fn get_mut(&mut self) -> [u64; N] {
        std::array::from_fn(|i| *self.0[i].get_mut())
    }

    #[inline(always)]
    fn set_mut(&mut self, words: [u64; N]) {
        for (cell, w) in self.0.iter_mut().zip(words) {
            *cell.get_mut() = w;
        }
    }

    /// Applies `f` by compare-and-swap of the hot word, retrying (`f` is a
    /// pure transition, so running it again is harmless) while another
    /// thread changed it in between. The other words change only under the
    /// shard's exclusive lock, so while the caller holds it shared they are
    /// the same at every read: a transition that would change one of them
    /// is given up (`None`), for the exclusive path.
    #[inline(always)]
    fn update<R>(&self, mut f: impl FnMut(&mut [u64; N]) -> Option<R>) -> Option<R> {
        let mut seen: [u64; N] = std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed));
        seen[HOT] = self.0[HOT].load(Ordering::Acquire);
        loop {
            let mut words = seen;
            let out = f(&mut words)?;
            if (0..N).any(|i| i != HOT && words[i] != seen[i]) {
                return None;
            }
            if words[HOT] == seen[HOT] {
                // Nothing to write (a denial, a peek): the words read are
                // one state, since only the hot one can have moved.
                return Some(out);
            }
            match self.0[HOT].compare_exchange_weak(
                seen[HOT],
                words[HOT],
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(out),
                Err(now) => seen[HOT] = now,
            }
        }
    }

    /// [`SharedState::decide_mut`] for a state of these words: as
    /// [`decide`](Self::decide), without atomic operations.
    #[inline(always)]
    fn decide_mut<S: AsWords<N>, A: Algorithm<State = S>>(
        &mut self,
        alg: &A,
        cost: u64,
        now: Micros,
    ) -> Option<Result<Decision, CostTooLarge>> {
        let mut state = S::from_words(self.get_mut());
        let out = settle(alg, &mut state, cost, now)?;
        self.set_mut(state.to_words());
        Some(out)
    }

    /// [`SharedState::decide`] for a state of these words.
    #[inline(always)]
    fn decide<S: AsWords<N>, A: Algorithm<State = S>>(
        &self,
        alg: &A,
        cost: u64,
        now: Micros,
    ) -> Option<Result<Decision, CostTooLarge>> {
        self.update(|words| {
            let mut state = S::from_words(*words);
            let out = settle(alg, &mut state, cost, now)?;
            *words = state.to_words();
            Some(out)
        })
    }
}

impl<const N: usize, const HOT: usize> fmt::Debug for Words<N, HOT> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let words: [u64; N] = std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed));
        f.debug_tuple("Words").field(&words).finish()
    }
}

/// The conversions of a state of `N` integers to its words.
trait AsWords<const N: usize>: Sized {
    fn to_words(&self) -> [u64; N];
    fn from_words(words: [u64; N]) -> Self;
}

impl AsWords<2> for TokenBucketState {
    #[inline(always)]
    fn to_words(&self) -> [u64; 2] {
        [self.micros, self.frac]
    }
    #[inline(always)]
    fn from_words([micros, frac]: [u64; 2]) -> Self {
        Self { micros, frac }
    }
}

impl AsWords<2> for FixedWindowState {
    #[inline(always)]
    fn to_words(&self) -> [u64; 2] {
        [self.window, self.count]
    }
    #[inline(always)]
    fn from_words([window, count]: [u64; 2]) -> Self {
        Self { window, count }
    }
}

impl AsWords<3> for SlidingWindowState {
    #[inline(always)]
    fn to_words(&self) -> [u64; 3] {
        [self.window, self.prev, self.curr]
    }
    #[inline(always)]
    fn from_words([window, prev, curr]: [u64; 3]) -> Self {
        Self { window, prev, curr }
    }
}

/// A bucket's time in whole microseconds changes; its fraction stays.
type BucketWords = Words<2, 0>;
/// A fixed window's count changes; its window stays.
type FixedWindowWords = Words<2, 1>;
/// A sliding window's current count changes; its window and the previous
/// count stay.
type SlidingWindowWords = Words<3, 2>;

macro_rules! shared_in_words {
    ($state:ty, $words:ty, |$alg:ident| $in_place:expr) => {
        impl SharedState for $state {
            type Cell = $words;

            #[inline(always)]
            fn into_cell(self) -> $words {
                <$words>::new(self.to_words())
            }

            #[inline(always)]
            fn with_mut<R>(cell: &mut $words, f: impl FnOnce(&mut Self) -> R) -> R {
                let mut state = Self::from_words(cell.get_mut());
                let out = f(&mut state);
                cell.set_mut(state.to_words());
                out
            }

            #[inline(always)]
            fn decide<A: Algorithm<State = Self>>(
                cell: &$words,
                alg: &A,
                cost: u64,
                now: Micros,
            ) -> Option<Result<Decision, CostTooLarge>> {
                cell.decide(alg, cost, now)
            }

            #[inline(always)]
            fn decide_mut<A: Algorithm<State = Self>>(
                cell: &mut $words,
                alg: &A,
                cost: u64,
                now: Micros,
            ) -> Option<Result<Decision, CostTooLarge>> {
                cell.decide_mut(alg, cost, now)
            }

            fn decides_in_place<A: Algorithm<State = Self>>($alg: &A) -> bool {
                $in_place
            }
        }
    };
}

shared_in_words!(TokenBucketState, BucketWords, |alg| whole_units(alg));
shared_in_words!(FixedWindowState, FixedWindowWords, |_alg| true);
shared_in_words!(SlidingWindowState, SlidingWindowWords, |_alg| true);

/// A bucket whose unit of cost is a whole number of microseconds keeps no
/// fraction, so a check changes only its time: it decides in place. Other
/// rates (3 per second) move the fraction on nearly every check.
fn whole_units<A: Algorithm>(alg: &A) -> bool {
    alg.quota().emission_interval().per == 1
}

/// `SharedState` for a state kept in a `VecDeque` of `$entry`: changed
/// only under the shard's exclusive lock, its buffer counted in the
/// store's memory. One more entry adds nothing while the buffer has room;
/// when it is full, `VecDeque` doubles it (and allocates 4 entries at
/// first).
macro_rules! on_the_heap {
    ($state:ty, $entry:ty, |$s:ident| ($len:expr, $capacity:expr)) => {
        impl SharedState for $state {
            type Cell = $state;

            fn into_cell(self) -> Self {
                self
            }

            #[inline(always)]
            fn with_mut<R>(cell: &mut Self, f: impl FnOnce(&mut Self) -> R) -> R {
                f(cell)
            }

            fn decide<A: Algorithm<State = Self>>(
                _: &Self,
                _: &A,
                _: u64,
                _: Micros,
            ) -> Option<Result<Decision, CostTooLarge>> {
                None
            }

            fn decides_in_place<A: Algorithm<State = Self>>(_: &A) -> bool {
                false
            }

            fn heap_bytes($s: &Self) -> usize {
                $capacity * std::mem::size_of::<$entry>()
            }

            fn heap_growth($s: &Self) -> usize {
                if $len < $capacity {
                    0
                } else {
                    $capacity.max(4) * std::mem::size_of::<$entry>()
                }
            }
        }
    };
}

on_the_heap!(SlidingLogState, LogEntry, |s| (
    s.entries.len(),
    s.entries.capacity()
));
on_the_heap!(LeaseState, Lease, |s| (s.leases().len(), s.capacity()));

/// [`AnyState`] as the memory store's tables hold it: the words of the
/// algorithm's state, or a sliding log.
#[derive(Debug)]
pub enum AnyCell {
    /// A key never seen.
    Fresh,
    /// A fixed window's count.
    FixedWindow(FixedWindowWords),
    /// A sliding window's counts.
    SlidingWindow(SlidingWindowWords),
    /// A bucket's timestamp.
    Bucket(BucketWords),
    /// A sliding log, changed only under the shard's exclusive lock.
    SlidingLog(SlidingLogState),
    /// A concurrency rule's leases, changed only under the shard's
    /// exclusive lock.
    Leases(LeaseState),
}

impl SharedState for AnyState {
    type Cell = AnyCell;

    fn into_cell(self) -> AnyCell {
        match self {
            AnyState::Fresh => AnyCell::Fresh,
            AnyState::FixedWindow(s) => AnyCell::FixedWindow(s.into_cell()),
            AnyState::SlidingWindow(s) => AnyCell::SlidingWindow(s.into_cell()),
            AnyState::Bucket(s) => AnyCell::Bucket(s.into_cell()),
            AnyState::SlidingLog(s) => AnyCell::SlidingLog(s),
            AnyState::Leases(s) => AnyCell::Leases(s),
        }
    }

    fn with_mut<R>(cell: &mut AnyCell, f: impl FnOnce(&mut Self) -> R) -> R {
        // The words are read into the state and written back; a log is
        // moved out and back in, not copied. Only a state whose kind the
        // algorithm changed makes a new cell.
        macro_rules! words {
            ($w:expr, $variant:ident) => {{
                let mut state = AnyState::$variant(AsWords::from_words($w.get_mut()));
                let out = f(&mut state);
                match state {
                    AnyState::$variant(s) => $w.set_mut(s.to_words()),
                    other => *cell = other.into_cell(),
                }
                out
            }};
        }
        match cell {
            AnyCell::Bucket(w) => words!(w, Bucket),
            AnyCell::FixedWindow(w) => words!(w, FixedWindow),
            AnyCell::SlidingWindow(w) => words!(w, SlidingWindow),
            AnyCell::SlidingLog(log) => {
                let mut state = AnyState::SlidingLog(std::mem::take(log));
                let out = f(&mut state);
                *cell = state.into_cell();
                out
            }
            AnyCell::Leases(leases) => {
                let mut state = AnyState::Leases(std::mem::take(leases));
                let out = f(&mut state);
                *cell = state.into_cell();
                out
            }
            AnyCell::Fresh => {
                let mut state = AnyState::Fresh;
                let out = f(&mut state);
                *cell = state.into_cell();
                out
            }
        }
    }

    #[inline(always)]
    fn decide<A: Algorithm<State = Self>>(
        cell: &AnyCell,
        alg: &A,
        cost: u64,
        now: Micros,
    ) -> Option<Result<Decision, CostTooLarge>> {
        // The algorithm behind `AnyState` is `AnyAlgorithm` (the test is on
        // types, decided when this is compiled): each of its algorithms
        // decides on its own state's words, and a state of another kind
        // (which the algorithm would start afresh) goes to the exclusive
        // path.
        let any = (alg as &dyn Any).downcast_ref::<AnyAlgorithm>()?;
        match (any, cell) {
            (AnyAlgorithm::TokenBucket(a), AnyCell::Bucket(w)) => w.decide(a, cost, now),
            (AnyAlgorithm::LeakyBucket(a), AnyCell::Bucket(w)) => w.decide(a, cost, now),
            (AnyAlgorithm::FixedWindow(a), AnyCell::FixedWindow(w)) => w.decide(a, cost, now),
            (AnyAlgorithm::SlidingWindow(a), AnyCell::SlidingWindow(w)) => w.decide(a, cost, now),
            _ => None,
        }
    }

    #[inline(always)]
    fn decide_mut<A: Algorithm<State = Self>>(
        cell: &mut AnyCell,
        alg: &A,
        cost: u64,
        now: Micros,
    ) -> Option<Result<Decision, CostTooLarge>> {
        let any = (alg as &dyn Any).downcast_ref::<AnyAlgorithm>()?;
        match (any, cell) {
            (AnyAlgorithm::TokenBucket(a), AnyCell::Bucket(w)) => w.decide_mut(a, cost, now),
            (AnyAlgorithm::LeakyBucket(a), AnyCell::Bucket(w)) => w.decide_mut(a, cost, now),
            (AnyAlgorithm::FixedWindow(a), AnyCell::FixedWindow(w)) => w.decide_mut(a, cost, now),
            (AnyAlgorithm::SlidingWindow(a), AnyCell::SlidingWindow(w)) => {
                w.decide_mut(a, cost, now)
            }
            _ => None,
        }
    }

    fn decides_in_place<A: Algorithm<State = Self>>(alg: &A) -> bool {
        match (alg as &dyn Any).downcast_ref::<AnyAlgorithm>() {
            Some(AnyAlgorithm::TokenBucket(a)) => whole_units(a),
            Some(AnyAlgorithm::LeakyBucket(a)) => whole_units(a),
            Some(AnyAlgorithm::FixedWindow(_) | AnyAlgorithm::SlidingWindow(_)) => true,
            Some(AnyAlgorithm::SlidingLog(_) | AnyAlgorithm::Concurrency(_)) | None => false,
        }
    }

    fn heap_bytes(cell: &AnyCell) -> usize {
        match cell {
            AnyCell::SlidingLog(log) => SlidingLogState::heap_bytes(log),
            AnyCell::Leases(leases) => LeaseState::heap_bytes(leases),
            _ => 0,
        }
    }

    fn heap_growth(cell: &AnyCell) -> usize {
        match cell {
            AnyCell::SlidingLog(log) => SlidingLogState::heap_growth(log),
            AnyCell::Leases(leases) => LeaseState::heap_growth(leases),
            // A key made fresh again may start a log or a lease.
            AnyCell::Fresh => 4 * std::mem::size_of::<LogEntry>().max(std::mem::size_of::<Lease>()),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;
    use crate::algorithm::{FixedWindow, SlidingLog, TokenBucket};
    use std::num::NonZeroU32;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("nonzero")
    }

    #[test]
    fn a_check_that_rolls_the_window_over_goes_to_the_exclusive_path() {
        let fw = FixedWindow::new(Quota::per_second(nz(5)));
        let mut state = FixedWindowState::default();
        fw.check(&mut state, 2, 1_000_000).expect("fits");
        let cell = state.into_cell();
        // In the same window: decided in place, the count moves.
        let d = FixedWindowState::decide(&cell, &fw, 1, 1_500_000).expect("in place");
        assert_eq!(d.expect("fits").remaining, 2);
        // In the next: the window word would change, so nothing does.
        assert_eq!(FixedWindowState::decide(&cell, &fw, 1, 2_000_000), None);
        let mut cell = cell;
        let held = FixedWindowState::with_mut(&mut cell, |s| *s);
        assert_eq!((held.window, held.count), (1, 3));
    }

    #[test]
    fn a_check_that_leaves_the_key_idle_goes_to_the_exclusive_path() {
        // Nothing charged and the bucket full again: the key is to be
        // forgotten, which only the exclusive path can do.
        let tb = TokenBucket::new(Quota::per_second(nz(10)), nz(10));
        let mut state = TokenBucketState::default();
        tb.check(&mut state, 1, 0).expect("fits");
        let cell = state.into_cell();
        assert!(TokenBucketState::decide(&cell, &tb, 0, 50_000).is_some());
        assert_eq!(TokenBucketState::decide(&cell, &tb, 0, 100_000), None);
        // A cost that can never fit is an error, decided in place.
        let too_much = TokenBucketState::decide(&cell, &tb, 11, 50_000).expect("in place");
        assert!(too_much.is_err());
    }

    #[test]
    fn which_algorithms_decide_in_place() {
        let q = Quota::per_second(nz(10));
        let any = |a: AnyAlgorithm| AnyState::decides_in_place(&a);
        assert!(any(TokenBucket::new(q, nz(10)).into()));
        assert!(any(FixedWindow::new(q).into()));
        assert!(!any(SlidingLog::new(q).into()));
        // 3 a second: a unit is 333 333 1/3 µs, a fraction on every check.
        let thirds = TokenBucket::new(Quota::per_second(nz(3)), nz(3));
        assert!(!any(thirds.into()));
        assert!(!TokenBucketState::decides_in_place(&thirds));
    }

    #[test]
    fn deciding_with_the_only_access_matches_deciding_shared() {
        // The same checks on two copies of a state: one by compare-and-swap,
        // one with plain stores; every answer and the end state agree.
        let tb = AnyAlgorithm::from(TokenBucket::new(Quota::per_second(nz(10)), nz(10)));
        let mut state = AnyState::Fresh;
        tb.check(&mut state, 1, 0).expect("fits");
        let shared = state.clone().into_cell();
        let mut only = state.into_cell();
        for (cost, now) in [
            (3, 1_000),
            (9, 2_000),
            (0, 3_000),
            (2, 150_000),
            (0, 2_000_000),
        ] {
            assert_eq!(
                AnyState::decide(&shared, &tb, cost, now),
                AnyState::decide_mut(&mut only, &tb, cost, now),
                "cost {cost} at {now}"
            );
        }
        assert_eq!(format!("{shared:?}"), format!("{only:?}"));
    }

    #[test]
    fn a_state_of_another_kind_goes_to_the_exclusive_path() {
        let fw = AnyAlgorithm::from(FixedWindow::new(Quota::per_second(nz(5))));
        let cell = AnyState::Bucket(TokenBucketState::default()).into_cell();
        assert_eq!(AnyState::decide(&cell, &fw, 1, 0), None);
    }
}

//! The in-memory store: [`RateLimiter`] for one rule and any key type,
//! [`MemoryStore`] for several rules over string keys.

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use compact_str::CompactString;

mod state_file;

pub use state_file::{
    Restored, STATE_FORMAT, Saved, StateFileError, read_state_file, state_file_rules,
};

use super::cell::SharedState;
use super::holds::{Holds, Release};
use super::overrides::{Override, OverrideBook, OverrideEntry, OverrideFilter, Target, stopped};
use super::receipts::Receipts;
use super::table::{ShardGuard, Table};
use super::{
    Check, Hold, KeyRef, Renew, Rule, SETTLE_RECEIPT_TTL, Settle, Settled, Store, Verdict,
};
use crate::algorithm::{Algorithm, AnyAlgorithm, AnyState, Charged, Renewed};
use crate::clock::{Clock, Micros, MonotonicClock};
use crate::decision::Decision;
use crate::error::{CostTooLarge, Error};

/// What a full table does when a key it does not hold is charged: the
/// choice between letting every new key in and never handing a used key a
/// fresh quota.
///
/// Either way the key to make room with is chosen the same way: of keys
/// sampled at random across the table, the one closest to fresh (the most
/// remaining, then the soonest idle).
///
/// ```
/// use std::num::{NonZeroU32, NonZeroUsize};
/// use spillway::algorithm::FixedWindow;
/// use spillway::clock::FakeClock;
/// use spillway::store::{MemoryOptions, OnFull, RateLimiter};
/// use spillway::Quota;
///
/// let options = MemoryOptions {
///     max_keys: NonZeroUsize::new(1).unwrap(),
///     on_full: OnFull::DenyNew,
///     ..MemoryOptions::default()
/// };
/// let login = FixedWindow::new(Quota::per_minute(NonZeroU32::new(1).unwrap()));
/// let limiter: RateLimiter<_, String, _> = RateLimiter::with_options(login, FakeClock::new(0), options);
/// assert!(limiter.check("mallory", 1).unwrap().allowed);
/// assert!(!limiter.check("mallory", 1).unwrap().allowed);
/// // The table is full of a used key: a new one is denied, not let in by
/// // forgetting mallory's count, and told when to come back.
/// let newcomer = limiter.check("eve", 1).unwrap();
/// assert!(!newcomer.allowed);
/// assert_eq!(newcomer.retry_after.unwrap().as_secs(), 60);
/// assert!(!limiter.check("mallory", 1).unwrap().allowed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnFull {
    /// Forget the candidate, whatever it holds: a new key always gets in.
    /// A heavy key is forgotten (and starts over with a full quota) only
    /// when every sampled key is at least as heavy, so a flood of light
    /// keys mostly evicts its own kind; but an attacker who fills the table
    /// with used keys of their own can, by flooding it, get some of their
    /// keys forgotten. The default: it never turns a client away for lack
    /// of room, which `DenyNew` does to every new client for as long as
    /// anyone can keep the table full.
    #[default]
    Evict,
    /// Forget the candidate only if it is idle or has more remaining than
    /// the new key has left after its request; otherwise deny the new key
    /// (a denial, not an error: fail-open never admits it), with
    /// `retry_after` until the soonest sampled key is idle. No key is ever
    /// handed a fresh quota for lack of room; new keys wait while the table
    /// is full of used ones. For rules guarding against brute force (login
    /// attempts), where forgetting a count is the attack. The `retry_after`
    /// is an estimate, not exact as an algorithm's is: room depends on
    /// other keys.
    DenyNew,
}

/// How the in-memory store sizes itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryOptions {
    /// The most keys held per rule. Past it, a new key makes room as
    /// [`on_full`](Self::on_full) says (see the module docs of the store).
    /// The bound is kept per shard, so eviction may begin a little before
    /// the total reaches it.
    pub max_keys: NonZeroUsize,
    /// How many independently locked shards. More shards, less contention.
    pub shards: NonZeroUsize,
    /// How often each shard sweeps out keys whose state is back to fresh.
    pub sweep_interval: Duration,
    /// What a full table does with a new key.
    pub on_full: OnFull,
    /// The most bytes the store holds, all its rules together, if set.
    ///
    /// What counts: every rule's hash table as allocated (its slots, each a
    /// key of up to 24 bytes held inline and the algorithm's state, and a
    /// control byte per slot), the text of keys longer than 24 bytes (their
    /// capacity), and the buffers of sliding logs (16 bytes an entry). Not
    /// counted: the allocator's own overhead per allocation, and a fixed
    /// few kilobytes per rule (the shards' locks); with
    /// [`RateLimiter`], keys that own memory themselves (a `String`'s text)
    /// beyond their slot; and the reservations held open for rules that
    /// give back what is not settled in time
    /// ([`Rule::release_unsettled_after`]), which have a bound of their own
    /// ([`MAX_OPEN_HOLDS`](super::MAX_OPEN_HOLDS), about 100 bytes each
    /// plus a long key's text).
    ///
    /// Each rule gets an even share, and each shard of its table a share of
    /// that: a shard's table may grow to three quarters of its share, and
    /// what keys and logs own on the heap fills the rest. A new key, or a
    /// check that would grow a log's buffer, that does not fit makes room
    /// as [`on_full`](Self::on_full) says (evicting the keys closest to
    /// fresh), and is denied when none can go. `max_keys` still bounds the
    /// keys. [`MemoryStore::reconfigure`] divides the bytes again among the
    /// new rules: a kept rule whose share shrank has its table rebuilt
    /// smaller at once if its keys fit, and otherwise evicts down to it,
    /// rebuilding its table, as new keys arrive.
    ///
    /// ```
    /// use std::num::{NonZeroU32, NonZeroUsize};
    /// use spillway::algorithm::FixedWindow;
    /// use spillway::clock::FakeClock;
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId};
    /// use spillway::Quota;
    ///
    /// let options = MemoryOptions {
    ///     max_memory: NonZeroUsize::new(1 << 20),
    ///     ..MemoryOptions::default()
    /// };
    /// let rule = Rule::new("per-ip", FixedWindow::new(Quota::per_minute(NonZeroU32::new(5).unwrap())));
    /// let store = MemoryStore::with_clock(vec![rule], options, FakeClock::new(0));
    /// for i in 0..20_000 {
    ///     let key = format!("a key long enough to live on the heap: {i}");
    ///     store.check_now(&[Check { rule: RuleId(0), key: &key, cost: 1 }]).unwrap();
    /// }
    /// assert!(store.memory_bytes() <= 1 << 20);
    /// assert!(store.len(RuleId(0)) < 20_000);
    /// ```
    pub max_memory: Option<NonZeroUsize>,
}

impl Default for MemoryOptions {
    /// One million keys per rule, 64 shards, a sweep per second, and new
    /// keys evict ([`OnFull::Evict`]).
    fn default() -> Self {
        Self {
            max_keys: NonZeroUsize::new(1_000_000).expect("nonzero"),
            shards: NonZeroUsize::new(64).expect("nonzero"),
            sweep_interval: Duration::from_secs(1),
            on_full: OnFull::Evict,
            max_memory: None,
        }
    }
}

impl MemoryOptions {
    /// A table for one of `rules` rules sharing `max_memory`, whose keys
    /// own `key_heap` bytes on the heap.
    pub(super) fn table<K: Hash + Eq, S: SharedState>(
        &self,
        rules: usize,
        key_heap: fn(&K) -> usize,
    ) -> Table<K, S> {
        let sweep = u64::try_from(self.sweep_interval.as_micros()).unwrap_or(u64::MAX);
        Table::new(
            self.max_keys.get(),
            self.shards.get(),
            sweep.max(1),
            self.on_full,
            self.share(rules),
            key_heap,
        )
    }

    /// One of `rules` rules' share of `max_memory`.
    fn share(&self, rules: usize) -> Option<usize> {
        self.max_memory.map(|m| m.get() / rules.max(1))
    }
}

/// The heap bytes of a key of the memory store: none when it is held inline.
fn compact_heap(key: &CompactString) -> usize {
    if key.is_heap_allocated() {
        key.capacity()
    } else {
        0
    }
}

/// A key type whose heap bytes a [`RateLimiter`] does not know.
fn unknown_heap<K>(_: &K) -> usize {
    0
}

/// One algorithm applied to keys of any type, in memory.
///
/// Sharded: two threads contend only when their keys share a shard. Keys
/// whose state is back to fresh are forgotten automatically, and at most
/// [`MemoryOptions::max_keys`] are held. Share it between threads with an
/// `Arc`.
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use spillway::algorithm::FixedWindow;
/// use spillway::clock::FakeClock;
/// use spillway::store::RateLimiter;
/// use spillway::Quota;
///
/// let clock = FakeClock::new(0);
/// let per_ip: RateLimiter<_, String, _> = RateLimiter::with_clock(FixedWindow::new(Quota::per_minute(NonZeroU32::new(1).unwrap())), clock.clone());
/// assert!(per_ip.check("10.0.0.1", 1).unwrap().allowed);
/// assert!(!per_ip.check("10.0.0.1", 1).unwrap().allowed);
/// assert!(per_ip.check("10.0.0.2", 1).unwrap().allowed);
/// assert_eq!(per_ip.len(), 2);
/// clock.advance(Duration::from_secs(60));
/// assert!(per_ip.check("10.0.0.1", 1).unwrap().allowed);
/// ```
pub struct RateLimiter<A: Algorithm, K = String, C = MonotonicClock>
where
    A::State: SharedState,
{
    algorithm: A,
    // Whether checks of a held key are decided in place, under the shard's
    // shared lock (`SharedState::decides_in_place`).
    in_place: bool,
    table: Table<K, A::State>,
    clock: C,
}

impl<A: Algorithm, K: Hash + Eq> RateLimiter<A, K, MonotonicClock>
where
    A::State: SharedState,
{
    /// A limiter on the monotonic clock with the default options.
    pub fn new(algorithm: A) -> Self {
        Self::with_clock(algorithm, MonotonicClock::new())
    }
}

impl<A: Algorithm, K: Hash + Eq, C: Clock> RateLimiter<A, K, C>
where
    A::State: SharedState,
{
    /// A limiter on `clock` with the default options.
    pub fn with_clock(algorithm: A, clock: C) -> Self {
        Self::with_options(algorithm, clock, MemoryOptions::default())
    }

    /// A limiter on `clock` with `options`.
    pub fn with_options(algorithm: A, clock: C, options: MemoryOptions) -> Self {
        Self {
            in_place: A::State::decides_in_place(&algorithm),
            algorithm,
            table: options.table(1, unknown_heap),
            clock,
        }
    }

    /// Decides on a request of `cost` for `key`, now.
    pub fn check<Q>(&self, key: &Q, cost: u64) -> Result<Decision, CostTooLarge>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
    {
        self.check_at(key, cost, self.clock.now())
    }

    /// Decides on a request of `cost` for `key` at `now`.
    pub fn check_at<Q>(&self, key: &Q, cost: u64, now: Micros) -> Result<Decision, CostTooLarge>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
    {
        let hash = self.table.hash(key);
        let alg = &self.algorithm;
        self.table.check(alg, self.in_place, key, hash, cost, now)
    }

    /// Forgets `key`, as if it had never been seen. Returns whether it was held.
    pub fn reset<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.table.hash(key);
        self.table.lock(self.table.shard_of(hash)).remove(key, hash)
    }

    /// The algorithm.
    pub fn algorithm(&self) -> &A {
        &self.algorithm
    }

    /// How many keys are held.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// No key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the hash tables occupy (keys and states stored inline; not what
    /// they own on the heap, such as a `String`'s text or a sliding log).
    pub fn table_bytes(&self) -> usize {
        self.table.allocation_size()
    }

    /// The bytes [`MemoryOptions::max_memory`] counts: the table, and with
    /// `max_memory` set, the states' heap bytes (a sliding log's buffer).
    pub fn memory_bytes(&self) -> usize {
        self.table.memory_bytes()
    }
}

impl<A: Algorithm, K, C: fmt::Debug> fmt::Debug for RateLimiter<A, K, C>
where
    A::State: SharedState,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimiter")
            .field("algorithm", &self.algorithm)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

/// Several rules over string keys, in memory: the default [`Store`].
///
/// A request that matches several rules is decided atomically: the shards
/// of all its keys are locked (always in the same order, so two requests
/// can never deadlock), every rule decides, and if any denies, the charges
/// already taken are given back before the locks are released. No other
/// request can see the intermediate state. There is no global lock.
///
/// ```
/// use std::num::NonZeroU32;
/// use spillway::algorithm::{FixedWindow, TokenBucket};
/// use spillway::clock::FakeClock;
/// use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId};
/// use spillway::Quota;
///
/// let nz = |n| NonZeroU32::new(n).unwrap();
/// let store = MemoryStore::with_clock(
///     vec![
///         Rule::new("per-ip", TokenBucket::new(Quota::per_second(nz(10)), nz(10))),
///         Rule::new("per-key", FixedWindow::new(Quota::per_minute(nz(1)))),
///     ],
///     MemoryOptions::default(),
///     FakeClock::new(0),
/// );
/// let request = [
///     Check { rule: RuleId(0), key: "10.0.0.1", cost: 1 },
///     Check { rule: RuleId(1), key: "key-a", cost: 1 },
/// ];
/// assert!(store.check_now(&request).unwrap().allowed);
/// let second = store.check_now(&request).unwrap();
/// assert!(!second.allowed);
/// // per-ip would have admitted it, and was not charged for it: 9 left, as before.
/// assert!(second.decisions[0].allowed);
/// assert_eq!(second.decisions[0].remaining, 9);
/// ```
pub struct MemoryStore<C = MonotonicClock> {
    rules: Vec<Rule>,
    // Per rule: whether checks of a held key are decided in place.
    in_place: Vec<bool>,
    // Shared with the stores `reconfigure` makes, so counters survive a
    // configuration reload.
    tables: Vec<Arc<Table<CompactString, AnyState>>>,
    // Per rule, which keys may have an override, by their table's hash:
    // kept with the table.
    filters: Vec<Arc<OverrideFilter>>,
    // Shared with the stores `reconfigure` makes, as the counters are.
    receipts: Arc<Receipts>,
    // The reservations open under rules that release them, shared as the
    // receipts are.
    holds: Arc<Holds>,
    // The quotas changed at run time, by rule name: shared as the counters
    // are, and applied to a reloaded rule as long as they fit it.
    overrides: Arc<OverrideBook>,
    // The API keys put in a tier at run time, shared likewise.
    tiers: Arc<super::TierBook>,
    // The block and allow lists set at run time, shared likewise.
    lists: Arc<super::ListBook>,
    options: MemoryOptions,
    clock: C,
}

impl MemoryStore<MonotonicClock> {
    /// A store for `rules` on the monotonic clock.
    pub fn new(rules: Vec<Rule>, options: MemoryOptions) -> Self {
        Self::with_clock(rules, options, MonotonicClock::new())
    }
}

impl<C: Clock> MemoryStore<C> {
    /// A store for `rules` on `clock`.
    pub fn with_clock(rules: Vec<Rule>, options: MemoryOptions, clock: C) -> Self {
        let n = rules.len();
        let tables: Vec<Arc<Table<CompactString, AnyState>>> = rules
            .iter()
            .map(|_| Arc::new(options.table(n, compact_heap)))
            .collect();
        let overrides = Arc::new(OverrideBook::new());
        let filters = rules
            .iter()
            .zip(&tables)
            .map(|(rule, table)| {
                let filter = Arc::new(OverrideFilter::new(table.hasher()));
                overrides.register(rule.name(), &filter);
                filter
            })
            .collect();
        Self {
            in_place: in_place(&rules),
            filters,
            rules,
            tables,
            receipts: Arc::new(Receipts::new(
                u64::try_from(SETTLE_RECEIPT_TTL.as_micros()).unwrap_or(u64::MAX),
            )),
            holds: Arc::new(Holds::new()),
            overrides,
            tiers: Arc::default(),
            lists: Arc::default(),
            options,
            clock,
        }
    }

    /// A store for `rules` that keeps this one's counters for every rule
    /// whose name is unchanged and whose algorithm reads their state the
    /// same way (a configuration reload): a changed limit or burst keeps
    /// every key's count ([`AnyAlgorithm::keeps_state_of`](crate::algorithm::AnyAlgorithm::keeps_state_of)),
    /// as the Redis store, whose keys are the rule's, does. Rules that are
    /// new, or whose algorithm or window changed, start empty. Both stores
    /// share the kept counters.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::FixedWindow;
    /// use spillway::clock::FakeClock;
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId};
    /// use spillway::Quota;
    ///
    /// let rule = |name: &str, n| Rule::new(name, FixedWindow::new(Quota::per_minute(NonZeroU32::new(n).unwrap())));
    /// let old = MemoryStore::with_clock(vec![rule("a", 5)], MemoryOptions::default(), FakeClock::new(0));
    /// old.check_now(&[Check { rule: RuleId(0), key: "k", cost: 2 }]).unwrap();
    /// // "a" moves to index 1 and keeps its count; "b" is new.
    /// let new = old.reconfigure(vec![rule("b", 5), rule("a", 5)]);
    /// let peek = new.check_now(&[Check { rule: RuleId(1), key: "k", cost: 0 }]).unwrap();
    /// assert_eq!(peek.decisions[0].remaining, 3);
    /// ```
    pub fn reconfigure(&self, rules: Vec<Rule>) -> Self
    where
        C: Clone,
    {
        let (tables, filters) = rules
            .iter()
            .map(|rule| {
                // The same rule, else one of the same name whose keys'
                // state means the same (only its limit or burst changed).
                let same = self.rules.iter().position(|old| old == rule);
                let kept = same.or_else(|| {
                    self.rules.iter().position(|old| {
                        old.name() == rule.name()
                            && rule.algorithm().keeps_state_of(old.algorithm())
                    })
                });
                kept.map_or_else(
                    || {
                        // A new table hashes its own way: the rule's
                        // overrides are marked again, and those set from
                        // now on, on any store sharing the book.
                        let table = Arc::new(self.options.table(rules.len(), compact_heap));
                        let filter = Arc::new(OverrideFilter::new(table.hasher()));
                        self.overrides.register(rule.name(), &filter);
                        (table, filter)
                    },
                    |i| {
                        // Its share of the bytes as the rules now divide them.
                        self.tables[i].set_budget(self.options.share(rules.len()));
                        (self.tables[i].clone(), self.filters[i].clone())
                    },
                )
            })
            .unzip();
        Self {
            in_place: in_place(&rules),
            rules,
            tables,
            filters,
            receipts: self.receipts.clone(),
            holds: self.holds.clone(),
            overrides: self.overrides.clone(),
            tiers: self.tiers.clone(),
            lists: self.lists.clone(),
            options: self.options,
            clock: self.clock.clone(),
        }
    }

    /// Decides on one request now (see [`check_at`](Self::check_at)).
    pub fn check_now(&self, checks: &[Check<'_>]) -> Result<Verdict, Error> {
        self.check_at(checks, self.clock.now())
    }

    /// Decides on one request at `now`: every check at once, none charged if
    /// any denies.
    pub fn check_at(&self, checks: &[Check<'_>], now: Micros) -> Result<Verdict, Error> {
        if self.holds.due_by(now) {
            self.give_back_due(now);
        }
        if let [check] = checks {
            // One rule: the common case, without the batch's bookkeeping.
            let rule = self.rules.get(check.rule.0).ok_or(Error::UnknownRule {
                index: 0,
                rule: check.rule.0,
            })?;
            let table = &self.tables[check.rule.0];
            let hash = table.hash(check.key);
            // A cost the rule can never take is an error under any
            // override, as on the batch's path and on Redis.
            let capacity = rule.algorithm().capacity();
            if check.cost > capacity {
                return Err(Error::CostTooLarge {
                    index: 0,
                    source: CostTooLarge {
                        cost: check.cost,
                        capacity,
                    },
                });
            }
            let over = self
                .override_of(check.rule.0, check.key, hash, now)
                .map(|o| Applied::of(Some(o), rule.algorithm(), check.cost, now));
            let algorithm = match &over {
                None => rule.algorithm(),
                Some(Applied {
                    stopped: Some(decision),
                    ..
                }) => {
                    return Ok(Verdict {
                        allowed: decision.allowed,
                        decisions: smallvec::smallvec![*decision],
                        decided_at: now,
                        undecided: Vec::new(),
                    });
                }
                Some(applied) => &applied.algorithm,
            };
            let in_place = self.in_place[check.rule.0];
            let decision = table
                .check(algorithm, in_place, check.key, hash, check.cost, now)
                .map_err(|source| Error::CostTooLarge { index: 0, source })?;
            return Ok(Verdict {
                allowed: decision.allowed,
                decisions: smallvec::smallvec![decision],
                decided_at: now,
                undecided: Vec::new(),
            });
        }

        let applied = self.validate(checks, now)?;
        // Lock every shard involved, in (rule, shard) order.
        let located: Vec<(usize, usize, u64)> = checks
            .iter()
            .map(|c| {
                let table = &self.tables[c.rule.0];
                let hash = table.hash(c.key);
                (c.rule.0, table.shard_of(hash), hash)
            })
            .collect();
        let mut order: Vec<(usize, usize)> = located.iter().map(|&(r, s, _)| (r, s)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<ShardGuard<'_, CompactString, AnyState>> = order
            .iter()
            .map(|&(rule, shard)| self.tables[rule].lock(shard))
            .collect();
        let guard_of = |rule: usize, shard: usize| {
            order
                .binary_search(&(rule, shard))
                .expect("every shard in the request was locked")
        };

        let mut decisions = crate::store::Decisions::with_capacity(checks.len());
        // How to take back each charge, should a later rule deny the
        // request. Each algorithm undoes its own charge exactly, whatever the
        // clock did (after a clock set back a refund at `now` may not find
        // it), and cheaply: no sliding log is copied.
        let mut charged = Vec::with_capacity(checks.len());
        for (i, (check, &(rule, shard, hash))) in checks.iter().zip(&located).enumerate() {
            // An override that stops it denies it, counting nothing.
            if let Some(stopped) = applied[i].stopped {
                decisions.push(stopped);
                continue;
            }
            let (decision, undo) = guards[guard_of(rule, shard)]
                .check_undoable(&applied[i].algorithm, check.key, hash, check.cost, now)
                .map_err(|source| Error::CostTooLarge { index: i, source })?;
            charged.extend(undo.map(|undo| (i, undo)));
            decisions.push(decision);
        }
        let allowed = decisions.iter().all(|d| d.allowed);
        if !allowed {
            // Take every charge back, newest first (so a key checked twice
            // ends with its state from before the request), then report the
            // admitting rules' state as it stands.
            for (i, undo) in charged.into_iter().rev() {
                let (check, &(rule, shard, hash)) = (&checks[i], &located[i]);
                let algorithm = &applied[i].algorithm;
                guards[guard_of(rule, shard)].undo(algorithm, check.key, hash, undo, now);
            }
            for (i, (check, &(rule, shard, hash))) in checks.iter().zip(&located).enumerate() {
                if decisions[i].allowed && applied[i].stopped.is_none() {
                    decisions[i] = guards[guard_of(rule, shard)]
                        .check(&applied[i].algorithm, check.key, hash, 0, now)
                        .map_err(|source| Error::CostTooLarge { index: i, source })?;
                }
            }
        }
        Ok(Verdict {
            allowed,
            decisions,
            decided_at: now,
            undecided: Vec::new(),
        })
    }

    /// Decides on one request now, holding the charges of releasing rules
    /// open under `id` (see [`Store::reserve`]).
    pub fn reserve_now(&self, id: &str, checks: &[Check<'_>]) -> Result<Verdict, Error> {
        self.reserve_at(id, checks, self.clock.now())
    }

    /// Decides on one request now, holding the charges `hold` names open
    /// under `id` (see [`Store::reserve_held`]).
    pub fn reserve_held_now(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
    ) -> Result<Verdict, Error> {
        self.reserve_held_at(id, checks, hold, self.clock.now())
    }

    /// Decides on one request at `now`, holding the charges of releasing
    /// rules open under `id` (see [`Store::reserve`]).
    pub fn reserve_at(
        &self,
        id: &str,
        checks: &[Check<'_>],
        now: Micros,
    ) -> Result<Verdict, Error> {
        self.reserve_held_at(id, checks, Hold::ALL, now)
    }

    /// Decides on one request at `now`, holding the charges `hold` names
    /// open under `id` (see [`Store::reserve_held`]).
    pub fn reserve_held_at(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
        now: Micros,
    ) -> Result<Verdict, Error> {
        super::check_settle_id(id)?;
        let applied = self.validate(checks, now)?;
        if let Some(denied) = self.holds_full(checks, hold, now)? {
            return Ok(denied);
        }
        let verdict = self.check_at(checks, now)?;
        if !verdict.allowed {
            return Ok(verdict);
        }
        let fingerprint = self.holds.fingerprint(id);
        let mut full = Vec::new();
        let mut book = self.holds.lock();
        for (i, (check, decision)) in checks.iter().zip(&verdict.decisions).enumerate() {
            let rule = &self.rules[check.rule.0];
            let Some(rule_within) = releases(rule).filter(|_| hold.holds(i)) else {
                continue;
            };
            let within = rule_within.min(hold.within);
            if check.cost == 0 {
                continue;
            }
            let charged = Charged::of(check.cost, now, decision).held_open();
            let until = now.saturating_add(u64::try_from(within.as_micros()).unwrap_or(u64::MAX));
            let name = (rule.name_arc(), CompactString::new(check.key));
            let target = (self.tables[check.rule.0].clone(), applied[i].algorithm);
            book.open(name, fingerprint, target, charged, until, &mut full);
        }
        self.release(&full, now);
        drop(book);
        Ok(verdict)
    }

    /// The denial of a reservation that a full key (or a full book) cannot
    /// hold: each key's state as it stands, the full one's denied until
    /// its first reservation's time. (A reservation made meanwhile by
    /// another thread may pass the bound: the book then gives its oldest
    /// back at once.)
    fn holds_full(
        &self,
        checks: &[Check<'_>],
        hold: Hold<'_>,
        now: Micros,
    ) -> Result<Option<Verdict>, Error> {
        let full = {
            let book = self.holds.lock();
            checks.iter().enumerate().find_map(|(i, check)| {
                let rule = self.rules.get(check.rule.0)?;
                releases(rule).filter(|_| hold.holds(i))?;
                let name = (rule.name_arc(), CompactString::new(check.key));
                let until = book.full_until(&name).filter(|_| check.cost > 0)?;
                Some((i, until))
            })
        };
        let Some((i, until)) = full else {
            return Ok(None);
        };
        let peeks: Vec<Check<'_>> = checks.iter().map(|c| Check { cost: 0, ..*c }).collect();
        let mut verdict = self.check_at(&peeks, now)?;
        verdict.allowed = false;
        let d = &mut verdict.decisions[i];
        d.allowed = false;
        d.retry_after = Some(Duration::from_micros(until.saturating_sub(now).max(1)));
        Ok(Some(verdict))
    }

    /// How many reservations this store (and those `reconfigure` made from
    /// it) has given back because no settle named them in time.
    pub fn reservations_released(&self) -> u64 {
        self.holds.released()
    }

    /// Gives back every reservation whose time has passed at `now`.
    fn give_back_due(&self, now: Micros) {
        let mut due = Vec::new();
        let mut book = self.holds.lock();
        book.due(now, &mut due);
        self.release(&due, now);
        drop(book);
    }

    /// Settles each reservation at 0 as of its charge, in the table it was
    /// charged to, whichever store (before or after a reload) meets it (the
    /// book is held).
    fn release(&self, released: &[Release], now: Micros) {
        for ((_, key), (table, algorithm), charged) in released {
            let hash = table.hash(key);
            table
                .lock(table.shard_of(hash))
                .settle(algorithm, key, hash, *charged, 0, now);
        }
    }

    /// Gives back the charges of an admitted request (see [`Store::refund`]).
    pub fn refund_at(&self, checks: &[Check<'_>], charged_at: Micros) -> Result<(), Error> {
        let applied = self.validate(checks, charged_at)?;
        for (check, applied) in checks.iter().zip(applied).rev() {
            if check.cost == 0 {
                continue;
            }
            let table = &self.tables[check.rule.0];
            let hash = table.hash(check.key);
            table.lock(table.shard_of(hash)).refund(
                &applied.algorithm,
                check.key,
                hash,
                check.cost,
                charged_at,
            );
        }
        Ok(())
    }

    /// Settles an admitted request's charges now (see [`Store::settle`]).
    pub fn settle_now(&self, id: &str, settles: &[Settle<'_>]) -> Result<Settled, Error> {
        self.settle_at(id, settles, self.clock.now())
    }

    /// Renews leases of concurrency rules now (see [`Store::renew`]).
    pub fn renew_now(&self, renews: &[Renew<'_>]) -> Result<Vec<Renewed>, Error> {
        self.renew_at(renews, self.clock.now())
    }

    /// Renews leases of concurrency rules at `now` (see [`Store::renew`]).
    pub fn renew_at(&self, renews: &[Renew<'_>], now: Micros) -> Result<Vec<Renewed>, Error> {
        let checks: Vec<Check<'_>> = renews.iter().map(|r| r.check()).collect();
        let algorithms: Vec<AnyAlgorithm> = self
            .validate(&checks, now)?
            .into_iter()
            .map(|a| a.algorithm)
            .collect();
        if let Some(index) = algorithms
            .iter()
            .position(|a| !matches!(a, AnyAlgorithm::Concurrency(_)))
        {
            let rule = renews[index].rule.0;
            return Err(Error::NotALease { index, rule });
        }
        let renewed = renews.iter().zip(&algorithms).map(|(renew, algorithm)| {
            let table = &self.tables[renew.rule.0];
            let hash = table.hash(renew.key);
            let mut shard = table.lock(table.shard_of(hash));
            let cost = renew.charged.cost;
            let (decision, held) = shard
                .check_with(algorithm, renew.key, hash, cost, now, |state| {
                    let renewed = algorithm
                        .renew(state, renew.charged, now)
                        .expect("a concurrency rule")?;
                    Ok((renewed.decision, Some((renewed.was_held, renewed.at))))
                })
                .expect("the cost was validated");
            let (was_held, at) = held.unwrap_or((false, now));
            Renewed {
                was_held,
                decision,
                at,
            }
        });
        Ok(renewed.collect())
    }

    /// Settles an admitted request's charges at `now`, once per `id` within
    /// [`SETTLE_RECEIPT_TTL`]. The store remembers at most about a million
    /// settle ids at once, the oldest forgotten first.
    pub fn settle_at(
        &self,
        id: &str,
        settles: &[Settle<'_>],
        now: Micros,
    ) -> Result<Settled, Error> {
        super::check_settle_id(id)?;
        self.settle_with(Some(id), settles, now)
    }

    /// Settles now, with no receipt: for a caller in this process that
    /// holds the only copy of the settle and makes it once (a release of
    /// an in-flight slot when its response ends), so that it need not fill
    /// the receipts a settle sent over a network needs.
    pub fn settle_once_now(&self, settles: &[Settle<'_>]) -> Result<Settled, Error> {
        self.settle_with(None, settles, self.clock.now())
    }

    /// Settles at `now`, once per `receipt` if there is one.
    fn settle_with(
        &self,
        receipt: Option<&str>,
        settles: &[Settle<'_>],
        now: Micros,
    ) -> Result<Settled, Error> {
        let checks: Vec<Check<'_>> = settles.iter().map(|s| s.check()).collect();
        let algorithms: Vec<AnyAlgorithm> = self
            .validate(&checks, now)?
            .into_iter()
            .map(|a| a.algorithm)
            .collect();
        if receipt.is_none() && settles.iter().any(|s| s.charged.held) {
            // A reservation is closed by its id.
            return Err(Error::SettleId { len: 0 });
        }
        // Reservations due are given back first.
        if self.holds.due_by(now) {
            self.give_back_due(now);
        }
        let applied = receipt.is_none_or(|id| self.receipts.first(id, now));
        // The reservations closed here: each found open is settled as any
        // charge; one found given back already (not settled in time)
        // charges its whole actual cost. Only a settle of held charges
        // takes the book.
        let closed: Option<Vec<Settle<'_>>> = (applied && settles.iter().any(|s| s.charged.held))
            .then(|| {
                let fingerprint = receipt.map(|id| self.holds.fingerprint(id));
                let mut book = self.holds.lock();
                settles
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let mut s = *s;
                        if s.charged.held {
                            let name = (self.rules[s.rule.0].name_arc(), CompactString::new(s.key));
                            if !fingerprint.is_some_and(|id| book.close(&name, id)) {
                                s.charged = algorithms[i].given_back(s.charged);
                            }
                        }
                        s
                    })
                    .collect()
            });
        let settles = closed.as_deref().unwrap_or(settles);
        let located = settles.iter().zip(&algorithms).map(|(settle, algorithm)| {
            let table = &self.tables[settle.rule.0];
            let hash = table.hash(settle.key);
            (settle, *algorithm, table.lock(table.shard_of(hash)), hash)
        });
        if applied {
            for (settle, algorithm, mut shard, hash) in located.clone() {
                let Settle {
                    key,
                    charged,
                    actual,
                    ..
                } = *settle;
                shard.settle(&algorithm, key, hash, charged, actual, now);
            }
        }
        // Each key's state once every part is settled (a key may be in
        // more than one).
        let decisions = located
            .map(|(settle, algorithm, mut shard, hash)| {
                shard
                    .check(&algorithm, settle.key, hash, 0, now)
                    .expect("a check of cost 0 always fits")
            })
            .collect();
        Ok(Settled { applied, decisions })
    }

    /// Forgets `key` under `rule`. Returns whether it was held.
    pub fn reset(&self, rule: super::RuleId, key: &str) -> bool {
        self.tables.get(rule.0).is_some_and(|table| {
            // Its reservations go too: given back later, they would take
            // from what is counted after the reset.
            let name = (self.rules[rule.0].name_arc(), CompactString::new(key));
            self.holds.lock().forget(&name);
            let hash = table.hash(key);
            table.lock(table.shard_of(hash)).remove(key, hash)
        })
    }

    /// Whether `rule` holds `key` in a state that is not idle: whether it
    /// has used any of its quota that has not come back yet.
    pub fn holds(&self, rule: super::RuleId, key: &str) -> bool {
        let (Some(table), Some(r)) = (self.tables.get(rule.0), self.rules.get(rule.0)) else {
            return false;
        };
        let hash = table.hash(key);
        table
            .lock(table.shard_of(hash))
            .holds(r.algorithm(), key, hash, self.clock.now())
    }

    /// Up to `limit` of the keys `rule` holds (idle ones left out), listed
    /// from just after `after`, the last key of the page before; and whether
    /// more may follow. The order is the store's own (it is not sorted): a
    /// key held from the first page to the last is listed exactly once, one
    /// added or forgotten meanwhile may or may not be. A listing that spans
    /// a restart, or a reload that starts the rule afresh, starts over.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::FixedWindow;
    /// use spillway::clock::FakeClock;
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId};
    /// use spillway::Quota;
    ///
    /// let rule = Rule::new("a", FixedWindow::new(Quota::per_minute(NonZeroU32::new(5).unwrap())));
    /// let store = MemoryStore::with_clock(vec![rule], MemoryOptions::default(), FakeClock::new(0));
    /// for key in ["k1", "k2", "k3"] {
    ///     store.check_now(&[Check { rule: RuleId(0), key, cost: 1 }]).unwrap();
    /// }
    /// let (first, more) = store.keys(RuleId(0), None, 2);
    /// assert!(more);
    /// let (rest, more) = store.keys(RuleId(0), first.last().map(String::as_str), 2);
    /// assert!(!more);
    /// let mut all = [first, rest].concat();
    /// all.sort();
    /// assert_eq!(all, ["k1", "k2", "k3"]);
    /// ```
    pub fn keys(
        &self,
        rule: super::RuleId,
        after: Option<&str>,
        limit: usize,
    ) -> (Vec<String>, bool) {
        let (Some(table), Some(r)) = (self.tables.get(rule.0), self.rules.get(rule.0)) else {
            return (Vec::new(), false);
        };
        let (keys, more) = table.keys_after(r.algorithm(), self.clock.now(), after, limit);
        (keys.into_iter().map(String::from).collect(), more)
    }

    /// How many keys `rule` holds.
    pub fn len(&self, rule: super::RuleId) -> usize {
        self.tables.get(rule.0).map_or(0, |t| t.len())
    }

    /// The most keys `rule` can hold: [`MemoryOptions::max_keys`], or fewer
    /// where [`MemoryOptions::max_memory`] leaves room for fewer (counting
    /// keys of up to 24 bytes).
    pub fn capacity(&self, rule: super::RuleId) -> usize {
        self.tables.get(rule.0).map_or(0, |t| t.capacity())
    }

    /// The bytes [`MemoryOptions::max_memory`] counts, every rule together:
    /// the tables as allocated, and, with `max_memory` set, the text of
    /// long keys and the sliding logs' buffers.
    pub fn memory_bytes(&self) -> usize {
        self.tables.iter().map(|t| t.memory_bytes()).sum()
    }

    /// Checks every rule id and cost before anything is charged, and finds
    /// each check's quota at `now`: its rule's, or an override's.
    fn validate(&self, checks: &[Check<'_>], now: Micros) -> Result<Vec<Applied>, Error> {
        checks
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let rule = self.rules.get(c.rule.0).ok_or(Error::UnknownRule {
                    index,
                    rule: c.rule.0,
                })?;
                let algorithm = rule.algorithm();
                let capacity = algorithm.capacity();
                if c.cost > capacity {
                    return Err(Error::CostTooLarge {
                        index,
                        source: CostTooLarge {
                            cost: c.cost,
                            capacity,
                        },
                    });
                }
                let over = if self.overrides.is_empty() {
                    None
                } else {
                    let hash = self.tables[c.rule.0].hash(c.key);
                    self.override_of(c.rule.0, c.key, hash, now)
                };
                Ok(Applied::of(over, algorithm, c.cost, now))
            })
            .collect()
    }

    /// The quotas changed at run time, by rule name. Set them with
    /// [`set_override`](Self::set_override), which checks that they fit.
    pub fn overrides(&self) -> &OverrideBook {
        &self.overrides
    }

    /// Sets the override of `target` under store rule `rule` (replacing
    /// any): from the next check on, its keys are decided under it,
    /// counting on the state they have. Returns the one it replaced; an
    /// error for a rule the store does not have or an override that does
    /// not apply to it (a burst or delay its algorithm does not take:
    /// [`Override::applied_to`](super::Override::applied_to)).
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::FixedWindow;
    /// use spillway::clock::FakeClock;
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Override, OverrideEntry, Rule, RuleId, Target};
    /// use spillway::Quota;
    ///
    /// let per_hour = |n| FixedWindow::new(Quota::per_hour(NonZeroU32::new(n).unwrap()));
    /// let store = MemoryStore::with_clock(vec![Rule::new("api", per_hour(2))], MemoryOptions::default(), FakeClock::new(0));
    /// let acme = [Check { rule: RuleId(0), key: "acme", cost: 1 }];
    /// store.check_now(&acme).unwrap();
    /// store.check_now(&acme).unwrap();
    /// assert!(!store.check_now(&acme).unwrap().allowed);
    /// let raised = OverrideEntry { applied: Override::limit(5), spec: "{}".into() };
    /// store.set_override(RuleId(0), Target::Key("acme".into()), raised).unwrap();
    /// // The two it used still count: three more.
    /// assert_eq!(store.check_now(&acme).unwrap().decisions[0].remaining, 2);
    /// store.remove_override(RuleId(0), &Target::Key("acme".into()));
    /// assert!(!store.check_now(&acme).unwrap().allowed);
    /// ```
    pub fn set_override(
        &self,
        rule: super::RuleId,
        target: Target,
        entry: OverrideEntry,
    ) -> Result<Option<OverrideEntry>, Error> {
        let r = self.rules.get(rule.0).ok_or(Error::UnknownRule {
            index: 0,
            rule: rule.0,
        })?;
        entry
            .applied
            .applied_to(r.algorithm())
            .map_err(|reason| Error::Override {
                rule: r.name().to_string(),
                reason,
            })?;
        let now = self.clock.now();
        // What has passed its time goes when something is set.
        self.overrides.purge(now);
        Ok(self.overrides.set(r.name(), target, entry))
    }

    /// The override in force for `key` (of `hash` in its rule's table)
    /// under rule `rule` at `now`.
    #[inline]
    fn override_of(&self, rule: usize, key: &str, hash: u64, now: Micros) -> Option<Override> {
        if !self.filters[rule].may_hold(hash) {
            return None;
        }
        self.overrides.find(self.rules[rule].name(), key, now)
    }

    /// Removes the override of `target` under store rule `rule`; returns
    /// it. The keys it held keep their count under the rule's quota.
    pub fn remove_override(&self, rule: super::RuleId, target: &Target) -> Option<OverrideEntry> {
        let r = self.rules.get(rule.0)?;
        self.overrides.remove(r.name(), target)
    }
}

/// A check's quota: its rule's or an override's, and the decision of an
/// override that stops it (a limit of 0, a cost over its capacity).
#[derive(Debug, Clone, Copy)]
struct Applied {
    algorithm: AnyAlgorithm,
    stopped: Option<Decision>,
}

impl Applied {
    /// A check of `cost` at `now` under `rule`, with the override in force
    /// for its key, if any.
    fn of(over: Option<Override>, rule: &AnyAlgorithm, cost: u64, now: Micros) -> Self {
        let Some(o) = over else {
            return Self {
                algorithm: *rule,
                stopped: None,
            };
        };
        match o.applied_to(rule) {
            Ok(Some(algorithm)) => Self {
                algorithm,
                stopped: stopped(algorithm.capacity(), o.ends_at(), cost, now),
            },
            Ok(None) => Self {
                algorithm: *rule,
                stopped: stopped(0, o.ends_at(), cost, now),
            },
            // Set for the rule before a reload gave it an algorithm that
            // takes none of it: not in force.
            Err(_) => Self {
                algorithm: *rule,
                stopped: None,
            },
        }
    }
}

/// How long `rule` holds a reservation open before it gives it back, if
/// it does (a concurrency rule's leases end by themselves).
pub(super) fn releases(rule: &Rule) -> Option<Duration> {
    match rule.algorithm() {
        AnyAlgorithm::Concurrency(_) => None,
        _ => rule.release_after(),
    }
}

/// For each rule, whether its checks are decided in place.
fn in_place(rules: &[Rule]) -> Vec<bool> {
    rules
        .iter()
        .map(|r| AnyState::decides_in_place(r.algorithm()))
        .collect()
}

impl<C: Clock> Store for MemoryStore<C> {
    type Error = Error;

    fn rules(&self) -> &[Rule] {
        &self.rules
    }

    fn tiers(&self) -> Option<&super::TierBook> {
        Some(&self.tiers)
    }

    fn lists(&self) -> Option<&super::ListBook> {
        Some(&self.lists)
    }

    fn check(
        &self,
        checks: &[Check<'_>],
    ) -> impl std::future::Future<Output = Result<Verdict, Error>> + Send {
        std::future::ready(self.check_now(checks))
    }

    fn refund(
        &self,
        checks: &[Check<'_>],
        charged_at: Micros,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        std::future::ready(self.refund_at(checks, charged_at))
    }

    fn settle(
        &self,
        id: &str,
        settles: &[Settle<'_>],
    ) -> impl std::future::Future<Output = Result<Settled, Error>> + Send {
        std::future::ready(self.settle_now(id, settles))
    }

    fn renew(
        &self,
        renews: &[Renew<'_>],
    ) -> impl std::future::Future<Output = Result<Vec<Renewed>, Error>> + Send {
        std::future::ready(self.renew_now(renews))
    }

    fn reserve(
        &self,
        id: &str,
        checks: &[Check<'_>],
    ) -> impl std::future::Future<Output = Result<Verdict, Error>> + Send {
        std::future::ready(self.reserve_now(id, checks))
    }

    fn reserve_held(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
    ) -> impl std::future::Future<Output = Result<Verdict, Error>> + Send {
        std::future::ready(self.reserve_held_now(id, checks, hold))
    }

    fn try_check_now(&self, checks: &[Check<'_>]) -> Option<Result<Verdict, Error>> {
        Some(self.check_now(checks))
    }

    fn try_reserve_now(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
    ) -> Option<Result<Verdict, Error>> {
        Some(self.reserve_held_now(id, checks, hold))
    }

    fn try_settle_once_now(&self, settles: &[Settle<'_>]) -> Option<Result<Settled, Error>> {
        Some(self.settle_once_now(settles))
    }
}

impl<C: fmt::Debug> fmt::Debug for MemoryStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("rules", &self.rules)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

//! The in-memory store's storage: a sharded hash table with a hard bound on
//! its size and automatic forgetting of idle keys.
//!
//! Each shard is a `hashbrown` table behind its own reader-writer lock
//! (padded to a cache line so two cores never contend on a neighbour's
//! lock). A key's shard is chosen by bits of its hash that the table itself
//! does not use, so both levels spread evenly.
//!
//! A check of a key the shard holds takes the lock shared and decides on
//! the key's state in place (see `cell.rs`): checks of one hot key from
//! every core go on together. Whatever changes the table (a key arriving
//! or forgotten, a sweep, an eviction, a request of several rules) takes
//! the lock exclusively.
//!
//! Forgetting and eviction:
//! - a key whose state is back to fresh (`idle_at <= now`) is dropped when it
//!   is next touched, and every shard sweeps out its idle keys at most once
//!   per sweep interval. Dropping an idle key is invisible: its state decides
//!   exactly like a fresh one.
//! - each shard holds at most its share of `max_keys`. When a new key arrives
//!   at a full shard, keys at random positions of the shard's table are
//!   sampled (a per-shard PRNG over bucket indices, seeded per process, so a
//!   client can neither predict nor steer which keys are looked at), and the
//!   one closest to fresh is the candidate: the most `remaining` on a peek,
//!   then the earliest `idle_at`. Forgetting it grants the least.
//! - what then happens is [`OnFull`]'s: `Evict` forgets the candidate
//!   whatever it holds, so new keys always get in; `DenyNew` forgets it only
//!   if it is idle or has more remaining than the newcomer would have after
//!   its request (forgetting it hands back less than the newcomer gets
//!   anyway), and otherwise denies the newcomer, with a `retry_after` until
//!   the soonest sampled key is idle. Under `DenyNew` no key is ever
//!   forgotten while it is at least as used as a fresh key: no abuser gets a
//!   fresh quota by flooding the table, at the price of new keys being turned
//!   away while the table is full of busy ones.
//!
//! A flood of one-request keys under `Evict` mostly evicts its own kind:
//! a heavy key is forgotten only when every sampled key is at least as heavy,
//! which, with keys sampled at random, takes a table that is mostly heavy.

use std::borrow::Borrow;
use std::cmp::Reverse;
use std::hash::{BuildHasher, Hash};

use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::{RwLock, RwLockWriteGuard};

use crate::algorithm::{Algorithm, Charged};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::error::CostTooLarge;

use super::KeyRef;
use super::cell::SharedState;
use super::memory::OnFull;

/// How many keys a full shard looks at to choose one to evict.
const EVICTION_SAMPLE: usize = 8;

/// How many random buckets a full shard probes for its sample at most. A
/// table at its bound is at least about 40% full (and 3/4 for large shards,
/// see `dense_shard_count`), so this almost always finds the whole sample.
const MAX_PROBES: usize = 8 * EVICTION_SAMPLE;

/// The smallest share of `max_keys` a shard gets before we use fewer shards.
const MIN_KEYS_PER_SHARD: usize = 64;

/// The smallest share of a byte budget a shard gets before we use fewer
/// shards: room for a few hundred keys and their long texts.
const MIN_BYTES_PER_SHARD: usize = 64 * 1024;

/// How many keys an insertion may evict to bring its shard back within its
/// bounds (after a budget was lowered, or for a long key's bytes).
const MAX_EVICTIONS: usize = 16;

pub(crate) type Hasher = foldhash::fast::RandomState;

// Padded so that two cores never contend on a neighbouring shard's lock.
type LockedShard<K, S> = CachePadded<RwLock<Shard<K, S>>>;

pub(crate) struct Table<K, S: SharedState> {
    shards: Box<[LockedShard<K, S>]>,
    hasher: Hasher,
    sweep_interval: Micros,
    on_full: OnFull,
    // The bytes a key owns on the heap, beyond its slot.
    key_heap: fn(&K) -> usize,
    // Whether there is a byte budget, so that heap bytes are counted.
    metered: bool,
    max_keys: usize,
}

pub(crate) struct Shard<K, S: SharedState> {
    entries: HashTable<(K, S::Cell)>,
    // This shard's share of `max_keys` (or fewer, for the byte budget): the
    // hard bound on its keys.
    cap: usize,
    // The heap bytes its keys and states own, counted when metered.
    heap: usize,
    // What the byte budget leaves for them (`usize::MAX` without one).
    heap_budget: usize,
    // The bytes the table may take (`usize::MAX` without a budget): a
    // table larger than that (its budget was cut by a reload that added
    // rules) is rebuilt smaller once its keys fit.
    table_limit: usize,
    next_sweep: Micros,
    // The state of the PRNG that picks the eviction sample.
    rng: u64,
}

/// What a byte budget allows one shard: at most `cap` keys, whose table at
/// its largest takes at most three quarters of the shard's bytes, and the
/// rest for what keys and states own on the heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ShardBudget {
    cap: usize,
    heap: usize,
    table: usize,
}

/// The bytes a table sized for `keys` entries of `E` allocates.
fn table_bytes<E>(keys: usize) -> usize {
    HashTable::<E>::with_capacity(keys).allocation_size()
}

/// The budget of a shard of `bytes` bytes that may hold up to `keys` keys.
fn shard_budget<E>(keys: usize, bytes: usize) -> ShardBudget {
    let slots = bytes / 4 * 3;
    // The most keys whose table fits in `slots` (a table's size only
    // grows with the keys it is sized for).
    let (mut lo, mut hi) = (0usize, keys);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if table_bytes::<E>(mid) <= slots {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    // Room to spare under the table's fill limit: evictions leave
    // tombstones that use it up, and the table is rebuilt when it is gone
    // (so once per sixteenth of the keys at most, not on every key).
    let cap = (lo - lo / 16).max(1);
    let table = table_bytes::<E>(cap);
    ShardBudget {
        cap,
        heap: bytes.saturating_sub(table),
        table,
    }
}

/// How many shards share `bytes`, starting from `shards`: as many more as
/// it takes for each shard's table, whose slots grow in powers of two, to
/// fill the three quarters of its share it may use (with shares just
/// under a doubling, the tables would stop at half that). Fewer when the
/// shares would drop under [`MIN_BYTES_PER_SHARD`].
fn dense_budget_shards<E>(bytes: usize, shards: usize) -> usize {
    let n = shards.min((bytes / MIN_BYTES_PER_SHARD).max(1));
    let slots = bytes / n / 4 * 3;
    // The largest table a shard's share holds, then as many shards of it
    // as the bytes allow.
    let mut keys = 1usize;
    while table_bytes::<E>(keys * 2) <= slots {
        keys *= 2;
    }
    let table = table_bytes::<E>(keys).max(1);
    (bytes / 4 * 3 / table).clamp(n, 2 * n)
}

/// How many of a table's slots hashbrown fills before it grows.
fn full_capacity(buckets: usize) -> usize {
    if buckets < 8 {
        buckets.saturating_sub(1)
    } else {
        buckets / 8 * 7
    }
}

/// splitmix64: cheap, and every output bit depends on every state bit.
fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// At least `shards` shards, as many more as it takes for a full shard's
/// table to be full too, but never to the last slot: a `hashbrown` table
/// of 2^k slots holds at most 7/8 of them before it doubles, so a share of
/// `max_keys` just above that would leave a full store's tables half
/// empty, and a share of exactly that would leave no room for the
/// tombstones evictions leave: the table would be rebuilt on nearly every
/// new key (measured: 3 million keys through 64 shards of 14,336 took
/// 205 s, against 3 s with 14,000). A store at its bound, the memory an
/// operator provisions for, is then dense, with a 32nd of its slots to
/// spare.
fn dense_shard_count(max_keys: usize, shards: usize) -> usize {
    let share = max_keys.div_ceil(shards);
    // The table a full shard needs, and how full it would be.
    let buckets = (share * 8).div_ceil(7).next_power_of_two();
    let holds = full_capacity(buckets);
    if share >= 4096 && share * 4 < holds * 3 {
        // Under 3/4 full (large stores: small ones are not worth more
        // shards): use shards of the half-size table's capacity.
        return max_keys.div_ceil(roomy(holds / 2)).max(shards);
    }
    if share > roomy(holds) {
        return max_keys.div_ceil(roomy(holds)).max(shards);
    }
    shards
}

/// Of a table that holds `holds` keys, how many a shard may keep: a 32nd
/// less, the room evictions' tombstones use up before a rebuild.
fn roomy(holds: usize) -> usize {
    holds - holds / 32
}

impl<K: Hash + Eq, S: SharedState> Table<K, S> {
    /// A table of at most `max_keys` keys in about `shards` shards and, if
    /// `max_bytes` is given, at most that many bytes (see
    /// `MemoryOptions::max_memory` for what counts). `key_heap` tells what
    /// a key owns on the heap.
    pub(crate) fn new(
        max_keys: usize,
        shards: usize,
        sweep_interval: Micros,
        on_full: OnFull,
        max_bytes: Option<usize>,
        key_heap: fn(&K) -> usize,
    ) -> Self {
        let max_keys = max_keys.max(1);
        let mut n = dense_shard_count(
            max_keys,
            shards.clamp(1, (max_keys / MIN_KEYS_PER_SHARD).max(1)),
        );
        if let Some(bytes) = max_bytes {
            n = dense_budget_shards::<(K, S::Cell)>(bytes, n);
        }
        let hasher = Hasher::default();
        let shards = (0..n)
            .map(|i| {
                CachePadded::new(RwLock::new(Shard {
                    entries: HashTable::new(),
                    cap: 0,
                    heap: 0,
                    heap_budget: usize::MAX,
                    table_limit: usize::MAX,
                    next_sweep: 0,
                    // Seeded from the hasher's per-process random keys.
                    rng: hasher.hash_one(i),
                }))
            })
            .collect();
        let table = Self {
            shards,
            hasher,
            sweep_interval,
            on_full,
            key_heap,
            metered: max_bytes.is_some(),
            max_keys,
        };
        table.set_budget(max_bytes);
        if max_bytes.is_some() {
            // Within a byte budget the tables are made at their full size
            // at once: growing by doubling would leave each smaller table
            // behind in the allocator (about as much again, measured),
            // and a table's untouched pages take no memory until keys fill
            // them.
            for shard in table.shards.iter() {
                let mut shard = shard.write();
                shard.entries = HashTable::with_capacity(shard.cap);
            }
        }
        table
    }

    /// Gives every shard its share of `max_keys` and of `max_bytes` (a
    /// reload that changes how many rules share the store's bytes). A
    /// shard now over its share evicts down to it as keys arrive.
    pub(crate) fn set_budget(&self, max_bytes: Option<usize>) {
        let n = self.shards.len();
        let max_keys = self.max_keys;
        // Shares differ by at most one key and one byte: one budget search.
        // The shards themselves (their locks, padded) come off the top.
        let fixed = std::mem::size_of_val(&*self.shards);
        let budget = max_bytes.map(|b| {
            shard_budget::<(K, S::Cell)>(max_keys.div_ceil(n), b.saturating_sub(fixed) / n)
        });
        for (i, shard) in self.shards.iter().enumerate() {
            let mut shard = shard.write();
            let keys = max_keys / n + usize::from(i < max_keys % n);
            match budget {
                Some(b) => {
                    shard.cap = keys.min(b.cap);
                    shard.heap_budget = b.heap;
                    shard.table_limit = b.table;
                    // A table now over its smaller share is made smaller
                    // at once if its keys fit, rather than when its next
                    // new key arrives: a rule that gets none (a limit
                    // override used once) would otherwise keep its old
                    // size, and rules added one by one would take the
                    // store past `max_bytes` (64 added: 2.8 times it).
                    let cap = shard.cap;
                    let entries = &mut shard.entries;
                    if entries.allocation_size() > b.table && entries.len() <= cap {
                        let mut fresh = HashTable::with_capacity(cap);
                        for e in entries.drain() {
                            let h = self.hasher.hash_one(&e.0);
                            fresh.insert_unique(h, e, |e| self.hasher.hash_one(&e.0));
                        }
                        *entries = fresh;
                    }
                }
                None => {
                    shard.cap = keys;
                    shard.heap_budget = usize::MAX;
                    shard.table_limit = usize::MAX;
                }
            }
        }
    }

    /// The hasher its keys are placed by.
    pub(crate) fn hasher(&self) -> Hasher {
        self.hasher
    }

    /// How many shards.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    pub(crate) fn hash<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard for `hash`, from bits hashbrown does not look at (it uses
    /// the low bits for the slot and the top 7 for its tags).
    pub(crate) fn shard_of(&self, hash: u64) -> usize {
        let bits = (hash >> 24) & 0xFFFF_FFFF;
        ((bits * self.shards.len() as u64) >> 32) as usize
    }

    /// Locks `shard` exclusively.
    pub(crate) fn lock(&self, shard: usize) -> ShardGuard<'_, K, S> {
        ShardGuard {
            shard: self.shards[shard].write(),
            table: self,
        }
    }

    /// Decides on `key`: in place under the shard's shared lock if the
    /// shard holds it (threads on one hot key go on together), else under
    /// the exclusive lock. `in_place` says whether the algorithm's checks
    /// can be decided in place at all ([`SharedState::decides_in_place`]).
    pub(crate) fn check<A, Q>(
        &self,
        alg: &A,
        in_place: bool,
        key: &Q,
        hash: u64,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge>
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
        S: Default,
    {
        let shard = self.shard_of(hash);
        if in_place {
            // Uncontended, the exclusive lock decides with plain loads and
            // stores: one atomic operation fewer than the shared lock and a
            // compare-and-swap. Contended, threads go on together shared.
            if let Some(mut locked) = self.shards[shard].try_write() {
                if now < locked.next_sweep
                    && let Some((_, cell)) = locked.entries.find_mut(hash, |e| e.0.borrow() == key)
                    && let Some(decided) = S::decide_mut(cell, alg, cost, now)
                {
                    return decided;
                }
                let mut guard = ShardGuard {
                    shard: locked,
                    table: self,
                };
                return guard.check(alg, key, hash, cost, now);
            }
            if let Some(decided) = self.check_shared(shard, alg, key, hash, cost, now) {
                return decided;
            }
        }
        self.lock(shard).check(alg, key, hash, cost, now)
    }

    /// Decides on `key` under its shard's shared lock, if the shard holds it
    /// and the decision changes nothing but its state. `None`, having
    /// changed nothing, when the exclusive path must decide: the key is not
    /// held, the shard is due for a sweep, the state cannot be updated in
    /// place, or a check that charged nothing leaves the key idle (so that
    /// it goes).
    pub(crate) fn check_shared<A, Q>(
        &self,
        shard: usize,
        alg: &A,
        key: &Q,
        hash: u64,
        cost: u64,
        now: Micros,
    ) -> Option<Result<Decision, CostTooLarge>>
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let shard = self.shards[shard].read();
        if now >= shard.next_sweep {
            return None;
        }
        let (_, cell) = shard.entries.find(hash, |e| e.0.borrow() == key)?;
        S::decide(cell, alg, cost, now)
    }

    /// Keys held now.
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().entries.len()).sum()
    }

    /// The bytes `MemoryOptions::max_memory` counts: every shard's table as
    /// allocated, and, when metered, what keys and states own on the heap.
    pub(crate) fn memory_bytes(&self) -> usize {
        let heap: usize = self.shards.iter().map(|s| s.read().heap).sum();
        self.allocation_size() + heap
    }

    /// The most keys this table holds (its shards' bounds together).
    pub(crate) fn capacity(&self) -> usize {
        self.shards.iter().map(|s| s.read().cap).sum()
    }

    /// Bytes allocated by the shards' tables (not counting memory a key or
    /// a state owns on the heap).
    pub(crate) fn allocation_size(&self) -> usize {
        let tables: usize = self
            .shards
            .iter()
            .map(|s| s.read().entries.allocation_size())
            .sum();
        tables + std::mem::size_of_val(&*self.shards)
    }
}

impl<K: Hash + Eq + Ord + Clone + Borrow<str>, S: Default + SharedState> Table<K, S> {
    /// Up to `limit` of the keys `alg` does not find idle at `now`, in the
    /// listing's order (by shard, then by key), from just after `after` (the
    /// last key of the page before, held or not); and whether more may
    /// follow. A key held from the first page to the last is listed once;
    /// one added or dropped meanwhile may or may not be.
    pub(crate) fn keys_after<A: Algorithm<State = S>>(
        &self,
        alg: &A,
        now: Micros,
        after: Option<&str>,
        limit: usize,
    ) -> (Vec<K>, bool) {
        let first = after.map_or(0, |a| self.shard_of(self.hash(a)));
        let mut page = Vec::new();
        for i in first..self.shards.len() {
            let mut keys = self.lock(i).live_keys(alg, now);
            keys.sort_unstable();
            let skip = match after {
                Some(a) if i == first => keys.partition_point(|k| k.borrow() <= a),
                _ => 0,
            };
            for key in keys.drain(skip..) {
                if page.len() == limit {
                    return (page, true);
                }
                page.push(key);
            }
        }
        (page, false)
    }
}

/// A locked shard, with what it needs to rehash and sweep.
pub(crate) struct ShardGuard<'a, K, S: SharedState> {
    shard: RwLockWriteGuard<'a, Shard<K, S>>,
    table: &'a Table<K, S>,
}

impl<K: Hash + Eq, S: Default + SharedState> ShardGuard<'_, K, S> {
    /// Decides on `key` (whose hash is `hash`), inserting it if the request
    /// is admitted and leaves state behind.
    pub(crate) fn check<A, Q>(
        &mut self,
        alg: &A,
        key: &Q,
        hash: u64,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostTooLarge>
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
    {
        let (decision, ()) = self.check_with(alg, key, hash, cost, now, |state| {
            alg.check(state, cost, now).map(|d| (d, ()))
        })?;
        Ok(decision)
    }

    /// [`check`](Self::check), also returning how to [`undo`](Self::undo)
    /// the charge if there was one.
    pub(crate) fn check_undoable<A, Q>(
        &mut self,
        alg: &A,
        key: &Q,
        hash: u64,
        cost: u64,
        now: Micros,
    ) -> Result<(Decision, Option<A::Undo>), CostTooLarge>
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
    {
        self.check_with(alg, key, hash, cost, now, |state| {
            alg.check_undoable(state, cost, now)
        })
    }

    /// Settles a charge on `key` at its `actual` cost (see
    /// [`Algorithm::settle`]). A key
    /// the table no longer holds has nothing to give back; an overrun on it
    /// starts a new state, let in as a new key is (under
    /// [`OnFull::DenyNew`], a full table of heavier keys turns it away).
    pub(crate) fn settle<A, Q>(
        &mut self,
        alg: &A,
        key: &Q,
        hash: u64,
        charged: Charged,
        actual: u64,
        now: Micros,
    ) where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
    {
        // The overrun, as the cost that may grow a log and keeps the key.
        let overrun = actual.saturating_sub(charged.cost);
        let settled = self.check_with(alg, key, hash, overrun, now, |state| {
            alg.settle(state, charged, actual, now);
            alg.check(state, 0, now).map(|d| (d, ()))
        });
        settled.expect("a check of cost 0 always fits");
    }

    /// The lookup, insertion and forgetting around one decision, which
    /// `decide` makes (a request of `cost` at `now`) on the key's state.
    /// Always inlined, so that `check`, the hot path, compiles to exactly
    /// the code it would be written out by hand.
    #[inline(always)]
    pub(crate) fn check_with<A, Q, R: Default>(
        &mut self,
        alg: &A,
        key: &Q,
        hash: u64,
        cost: u64,
        now: Micros,
        decide: impl FnOnce(&mut S) -> Result<(Decision, R), CostTooLarge>,
    ) -> Result<(Decision, R), CostTooLarge>
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
    {
        if now >= self.shard.next_sweep {
            self.sweep(alg, now);
        }
        let metered = self.table.metered;
        if metered && let Err(denied) = self.make_heap_room(alg, key, hash, cost, now) {
            return Ok((denied, R::default()));
        }
        let key_heap = self.table.key_heap;
        let hasher = &self.table.hasher;
        let shard = &mut *self.shard;
        if let Some(entry) = shard.entries.find_mut(hash, |e| e.0.borrow() == key) {
            let before = if metered { S::heap_bytes(&entry.1) } else { 0 };
            let (decided, idle_at) = S::with_mut(&mut entry.1, |s| (decide(s), alg.idle_at(s)));
            if metered {
                shard.heap = shard.heap + S::heap_bytes(&entry.1) - before;
            }
            let (decision, out) = decided?;
            // A charged state is never idle; anything else may now be, and
            // then it goes (a second lookup, off the common path).
            let charged = decision.allowed && cost > 0;
            if !charged
                && idle_at <= now
                && let Ok(entry) = shard.entries.find_entry(hash, |e| e.0.borrow() == key)
            {
                let ((k, cell), _) = entry.remove();
                if metered {
                    shard.heap -= key_heap(&k) + S::heap_bytes(&cell);
                }
            }
            return Ok((decision, out));
        }
        let mut state = S::default();
        let (decision, out) = decide(&mut state)?;
        if alg.idle_at(&state) > now {
            let owned = key.to_key();
            let cell = state.into_cell();
            let needs = if metered {
                key_heap(&owned) + S::heap_bytes(&cell)
            } else {
                0
            };
            if let Err(denied) = self.make_room_for(alg, now, &decision, needs) {
                // Nothing was stored, so nothing was charged.
                return Ok((denied, R::default()));
            }
            let shard = &mut *self.shard;
            // Evictions leave tombstones that use up the table's room.
            // Once the table has the slots its bound needs, rebuild it at
            // that size rather than let it double for a key that fits.
            let entries = &mut shard.entries;
            let tombstoned = entries.capacity() <= entries.len()
                && full_capacity(entries.num_buckets()) >= shard.cap;
            // A table left larger than its budget (a reload cut it) is made
            // smaller as soon as its keys fit.
            if tombstoned || entries.allocation_size() > shard.table_limit {
                let mut fresh = HashTable::with_capacity(shard.cap);
                for e in entries.drain() {
                    let h = hasher.hash_one(&e.0);
                    fresh.insert_unique(h, e, |e| hasher.hash_one(&e.0));
                }
                *entries = fresh;
            }
            shard.heap += needs;
            shard
                .entries
                .insert_unique(hash, (owned, cell), |e| hasher.hash_one(&e.0));
        }
        Ok((decision, out))
    }

    /// With a byte budget: makes sure that the check about to run on `key`
    /// cannot take its shard's heap past its share (a held log whose buffer
    /// would double), evicting other keys as [`make_room`](Self::make_room)
    /// chooses them; a denial, deciding nothing, when they cannot go.
    fn make_heap_room<A, Q>(
        &mut self,
        alg: &A,
        key: &Q,
        hash: u64,
        cost: u64,
        now: Micros,
    ) -> Result<(), Decision>
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if cost == 0 {
            return Ok(());
        }
        let shard = &mut *self.shard;
        let Some(entry) = shard.entries.find_mut(hash, |e| e.0.borrow() == key) else {
            return Ok(());
        };
        let growth = S::heap_growth(&entry.1);
        if growth == 0 || shard.heap.saturating_add(growth) <= shard.heap_budget {
            return Ok(());
        }
        // What the key would be told, were it denied for lack of room.
        let peek = S::with_mut(&mut entry.1, |s| alg.check(s, 0, now));
        let limit = peek.map_or(alg.capacity(), |d| d.limit);
        let me = Decision {
            allowed: true,
            limit,
            remaining: 0,
            reset_after: std::time::Duration::ZERO,
            refill_after: std::time::Duration::ZERO,
            retry_after: None,
            delay: std::time::Duration::ZERO,
        };
        for _ in 0..MAX_EVICTIONS {
            if self.shard.heap.saturating_add(growth) <= self.shard.heap_budget {
                return Ok(());
            }
            self.make_room(alg, now, &me, true, Some(hash))?;
        }
        if self.shard.heap.saturating_add(growth) <= self.shard.heap_budget {
            Ok(())
        } else {
            Err(self.no_room(&me, now))
        }
    }

    /// Makes room for a new key whose first request decided `newcomer` and
    /// that owns `needs` bytes on the heap: a slot under the shard's bound
    /// on keys, and, with a byte budget, the bytes under its heap share.
    fn make_room_for<A: Algorithm<State = S>>(
        &mut self,
        alg: &A,
        now: Micros,
        newcomer: &Decision,
        needs: usize,
    ) -> Result<(), Decision> {
        // As many as it takes: more than one only after a reload cut the
        // shard's bound, and then the shard comes back within it at once.
        let over = self.shard.entries.len().saturating_sub(self.shard.cap);
        for _ in 0..over + MAX_EVICTIONS {
            if self.shard.entries.len() < self.shard.cap {
                break;
            }
            self.make_room(alg, now, newcomer, false, None)?;
        }
        for _ in 0..MAX_EVICTIONS {
            if self.shard.heap.saturating_add(needs) <= self.shard.heap_budget {
                break;
            }
            self.make_room(alg, now, newcomer, true, None)?;
        }
        let shard = &self.shard;
        if shard.entries.len() < shard.cap && shard.heap.saturating_add(needs) <= shard.heap_budget
        {
            Ok(())
        } else {
            Err(self.no_room(newcomer, now))
        }
    }

    /// The denial of a key that found no room.
    fn no_room(&self, newcomer: &Decision, now: Micros) -> Decision {
        let _ = now;
        // Room depends on other keys: ask again in a second.
        let wait = std::time::Duration::from_secs(1);
        Decision {
            allowed: false,
            limit: newcomer.limit,
            remaining: 0,
            reset_after: wait,
            refill_after: wait,
            retry_after: Some(wait),
            delay: std::time::Duration::ZERO,
        }
    }

    /// Takes back a charge of `key` that [`check_undoable`](Self::check_undoable)
    /// made at `now`, in this request, and forgets the key if that leaves
    /// it idle (as a check that charges nothing does).
    pub(crate) fn undo<A, Q>(&mut self, alg: &A, key: &Q, hash: u64, undo: A::Undo, now: Micros)
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
    {
        let (hasher, key_heap, metered) =
            (&self.table.hasher, self.table.key_heap, self.table.metered);
        let shard = &mut *self.shard;
        match shard.entries.find_entry(hash, |e| e.0.borrow() == key) {
            Ok(mut entry) => {
                let cell = &mut entry.get_mut().1;
                let before = if metered { S::heap_bytes(cell) } else { 0 };
                let idle_at = S::with_mut(cell, |s| {
                    alg.undo(s, undo);
                    alg.idle_at(s)
                });
                if metered {
                    shard.heap = shard.heap + S::heap_bytes(cell) - before;
                }
                if idle_at <= now {
                    let ((k, cell), _) = entry.remove();
                    if metered {
                        shard.heap -= key_heap(&k) + S::heap_bytes(&cell);
                    }
                }
            }
            // A later check of the same request evicted the key. An undo
            // that holds the whole state before the charge puts it back, so
            // the denied request leaves no trace; one that holds only the
            // charge (a sliding log) leaves the key forgotten. (The key was
            // in the table before this request, so its bytes fit.)
            Err(absent) => {
                let mut state = S::default();
                alg.undo(&mut state, undo);
                if alg.idle_at(&state) > now {
                    let (owned, cell) = (key.to_key(), state.into_cell());
                    if metered {
                        shard.heap += key_heap(&owned) + S::heap_bytes(&cell);
                    }
                    absent
                        .into_table()
                        .insert_unique(hash, (owned, cell), |e| hasher.hash_one(&e.0));
                }
            }
        }
    }

    /// Gives back a charge made at `charged_at`.
    pub(crate) fn refund<A, Q>(
        &mut self,
        alg: &A,
        key: &Q,
        hash: u64,
        cost: u64,
        charged_at: Micros,
    ) where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (key_heap, metered) = (self.table.key_heap, self.table.metered);
        let shard = &mut *self.shard;
        if let Ok(mut entry) = shard.entries.find_entry(hash, |e| e.0.borrow() == key) {
            let cell = &mut entry.get_mut().1;
            let before = if metered { S::heap_bytes(cell) } else { 0 };
            let idle_at = S::with_mut(cell, |s| {
                alg.refund(s, cost, charged_at);
                alg.idle_at(s)
            });
            if metered {
                shard.heap = shard.heap + S::heap_bytes(cell) - before;
            }
            if idle_at <= charged_at {
                let ((k, cell), _) = entry.remove();
                if metered {
                    shard.heap -= key_heap(&k) + S::heap_bytes(&cell);
                }
            }
        }
    }

    /// Forgets `key`. Returns whether it was held.
    pub(crate) fn remove<Q>(&mut self, key: &Q, hash: u64) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (key_heap, metered) = (self.table.key_heap, self.table.metered);
        let shard = &mut *self.shard;
        match shard.entries.find_entry(hash, |e| e.0.borrow() == key) {
            Ok(entry) => {
                let ((k, cell), _) = entry.remove();
                if metered {
                    shard.heap -= key_heap(&k) + S::heap_bytes(&cell);
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Whether this shard holds `key` (whose hash is `hash`) in a state
    /// `alg` does not find idle at `now`.
    pub(crate) fn holds<A, Q>(&mut self, alg: &A, key: &Q, hash: u64, now: Micros) -> bool
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        self.shard
            .entries
            .find_mut(hash, |e| e.0.borrow() == key)
            .is_some_and(|e| S::with_mut(&mut e.1, |s| alg.idle_at(s)) > now)
    }

    /// The keys of this shard that `alg` does not find idle at `now`.
    fn live_keys<A: Algorithm<State = S>>(&mut self, alg: &A, now: Micros) -> Vec<K>
    where
        K: Clone,
    {
        self.shard
            .entries
            .iter_mut()
            .filter_map(|e| (S::with_mut(&mut e.1, |s| alg.idle_at(s)) > now).then(|| e.0.clone()))
            .collect()
    }

    /// A copy of every key's state that `alg` does not find idle at `now`.
    pub(crate) fn live_states<A: Algorithm<State = S>>(
        &mut self,
        alg: &A,
        now: Micros,
    ) -> Vec<(K, S)>
    where
        K: Clone,
        S: Clone,
    {
        self.shard
            .entries
            .iter_mut()
            .filter_map(|e| {
                let state = S::with_mut(&mut e.1, |s| (alg.idle_at(s) > now).then(|| s.clone()));
                Some((e.0.clone(), state?))
            })
            .collect()
    }

    /// Puts `state` (read back from a file) in place of `key`'s, as a check
    /// that charges nothing would keep it: not when it is idle at `now`,
    /// nor when the shard has no room (as for a new key's check). Returns
    /// whether the key is held.
    pub(crate) fn restore<A, Q>(
        &mut self,
        alg: &A,
        key: &Q,
        hash: u64,
        state: S,
        now: Micros,
    ) -> bool
    where
        A: Algorithm<State = S>,
        K: Borrow<Q>,
        Q: Hash + Eq + KeyRef<K> + ?Sized,
    {
        let mut state = Some(state);
        let checked = self.check_with(alg, key, hash, 0, now, |s| {
            *s = state.take().unwrap_or_default();
            alg.check(s, 0, now).map(|d| (d, ()))
        });
        checked.is_ok()
            && self
                .shard
                .entries
                .find(hash, |e| e.0.borrow() == key)
                .is_some()
    }

    /// Drops every idle key, and gives memory back when most are gone.
    fn sweep<A: Algorithm<State = S>>(&mut self, alg: &A, now: Micros) {
        let (key_heap, metered) = (self.table.key_heap, self.table.metered);
        let shard = &mut *self.shard;
        shard.next_sweep = now.saturating_add(self.table.sweep_interval);
        let heap = &mut shard.heap;
        shard.entries.retain(|e| {
            let keep = S::with_mut(&mut e.1, |s| alg.idle_at(s)) > now;
            if !keep && metered {
                *heap -= key_heap(&e.0) + S::heap_bytes(&e.1);
            }
            keep
        });
        let len = shard.entries.len();
        // Within a byte budget a table keeps its size (made at once, and
        // counted as allocated); otherwise memory goes back when most keys
        // are gone.
        if !metered && len * 4 < shard.entries.capacity() {
            let hasher = &self.table.hasher;
            shard.entries.shrink_to(len * 2, |e| hasher.hash_one(&e.0));
        }
    }

    /// Makes room for one key whose first request decided `newcomer`: of
    /// a sample of keys at random positions, the one closest to fresh (the
    /// most `remaining` on a peek, then the earliest `idle_at`) goes, so
    /// that forgetting it grants the least. Under [`OnFull::DenyNew`] it
    /// goes only if it is idle or has more remaining than the newcomer has
    /// left; otherwise the newcomer is denied: the denial is the error.
    /// With `heap_only` the sample is of keys that own heap bytes (room for
    /// bytes rather than a slot), and a key whose hash is `spare` is never
    /// taken (the one that needs the room).
    fn make_room<A: Algorithm<State = S>>(
        &mut self,
        alg: &A,
        now: Micros,
        newcomer: &Decision,
        heap_only: bool,
        spare: Option<u64>,
    ) -> Result<(), Decision> {
        let deny_new = self.table.on_full == OnFull::DenyNew;
        let (hasher, key_heap) = (&self.table.hasher, self.table.key_heap);
        let shard = &mut *self.shard;
        let entries = &mut shard.entries;
        let buckets = entries.num_buckets() as u64;
        // Keys that own heap bytes may be rare: look harder for them.
        let probes = if heap_only {
            4 * MAX_PROBES
        } else {
            MAX_PROBES
        };
        let eligible = |e: &(K, S::Cell)| {
            (!heap_only || key_heap(&e.0) + S::heap_bytes(&e.1) > 0)
                && spare.is_none_or(|h| hasher.hash_one(&e.0) != h)
        };
        let mut sample = [0usize; EVICTION_SAMPLE];
        let mut sampled = 0;
        for _ in 0..probes {
            if sampled == EVICTION_SAMPLE || buckets == 0 {
                break;
            }
            let index = (next_random(&mut shard.rng) % buckets) as usize;
            if entries.get_bucket(index).is_some_and(eligible) {
                sample[sampled] = index;
                sampled += 1;
            }
        }
        if sampled == 0 {
            // A table this sparse is tiny: look at its first keys.
            let first = entries
                .iter_buckets()
                .filter(|&i| entries.get_bucket(i).is_some_and(eligible));
            for index in first.take(EVICTION_SAMPLE).collect::<Vec<_>>() {
                sample[sampled] = index;
                sampled += 1;
            }
        }
        // The candidate, as (remaining, idle_at, bucket), and the soonest any
        // sampled key is idle.
        let mut best: Option<(u64, Micros, usize)> = None;
        let mut soonest_idle = Micros::MAX;
        for &index in &sample[..sampled] {
            let Some(entry) = entries.get_bucket_mut(index) else {
                continue;
            };
            // A peek changes nothing but may drop expired log entries.
            let (remaining, idle_at) = S::with_mut(&mut entry.1, |s| {
                let remaining = alg.check(s, 0, now).map_or(0, |d| d.remaining);
                (remaining, alg.idle_at(s))
            });
            soonest_idle = soonest_idle.min(idle_at);
            let key = (remaining, Reverse(idle_at));
            let fresher = |(r, i, _): (u64, Micros, usize)| key > (r, Reverse(i));
            if best.is_none_or(fresher) {
                best = Some((remaining, idle_at, index));
            }
        }
        let Some((remaining, idle_at, index)) = best else {
            return Err(self.no_room(newcomer, now));
        };
        if deny_new && idle_at > now && remaining <= newcomer.remaining {
            // Every sampled key is at least as used as the newcomer would be:
            // forgetting one would hand it a fresh quota.
            let wait = std::time::Duration::from_micros(soonest_idle.saturating_sub(now).max(1));
            return Err(Decision {
                allowed: false,
                limit: newcomer.limit,
                remaining: 0,
                reset_after: wait,
                refill_after: wait,
                retry_after: Some(wait),
                delay: std::time::Duration::ZERO,
            });
        }
        if let Ok(entry) = entries.get_bucket_entry(index) {
            let ((k, cell), _) = entry.remove();
            if self.table.metered {
                shard.heap -= key_heap(&k) + S::heap_bytes(&cell);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_store_fills_its_tables() {
        // 1M over 64 shards would be 15 625 a shard: just past 7/8 of
        // 16 384, doubling every table. 73 shards of at most 13 699 fit,
        // with a 32nd of the room to spare.
        assert_eq!(dense_shard_count(1_000_000, 64), 73);
        assert!(1_000_000usize.div_ceil(73) <= roomy(16_384 * 7 / 8));
        // Exactly full tables would have no room for tombstones.
        assert_eq!(dense_shard_count(64 * 14_336, 64), 67);
        assert_eq!(dense_shard_count(64 * 13_000, 64), 64);
        assert_eq!(dense_shard_count(100, 1), 1);
        assert_eq!(dense_shard_count(127, 1), 1);
        let table: Table<u64, crate::algorithm::fixed_window::FixedWindowState> =
            Table::new(1_000_000, 64, 1, OnFull::Evict, None, |_| 0);
        assert_eq!(table.shards.len(), 73);
    }

    #[test]
    fn a_store_at_its_bound_stays_dense_through_evictions() {
        use crate::Quota;
        use crate::algorithm::TokenBucket;
        use crate::algorithm::token_bucket::TokenBucketState as Tat;
        use std::num::NonZeroU32;

        let big = NonZeroU32::new(1_000_000).expect("nonzero");
        let alg = TokenBucket::new(Quota::per_second(big), big);
        let table: Table<u64, Tat> = Table::new(300_000, 64, u64::MAX, OnFull::Evict, None, |_| 0);
        // A third more keys than the bound: every shard fills, then evicts
        // (leaving tombstones) for every further key.
        let mut x = 1u64;
        for _ in 0..400_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let h = table.hash(&x);
            table
                .lock(table.shard_of(h))
                .check(&alg, &x, h, 10, 1_000)
                .expect("fits");
        }
        let held = table.len();
        assert!(held <= 300_000 && held > 290_000, "{held}");
        // 24-byte entries and a control byte, 7/8 full less a 32nd:
        // under 30 bytes a key.
        let per_key = table.allocation_size() as f64 / held as f64;
        assert!(per_key < 30.0, "{per_key:.1} bytes a key");
    }

    #[test]
    fn undo_puts_back_a_key_evicted_later_in_the_same_request() {
        use crate::Quota;
        use crate::algorithm::FixedWindow;
        use crate::algorithm::fixed_window::FixedWindowState;
        use std::num::NonZeroU32;

        let alg = FixedWindow::new(Quota::per_second(NonZeroU32::new(5).expect("nonzero")));
        // One key at most: charging a second evicts the first.
        let table: Table<u64, FixedWindowState> =
            Table::new(1, 1, u64::MAX, OnFull::Evict, None, |_| 0);
        let (h1, h2) = (table.hash(&1), table.hash(&2));
        let mut shard = table.lock(0);
        shard.check(&alg, &1, h1, 2, 0).expect("fits");
        let (_, first) = shard.check_undoable(&alg, &1, h1, 1, 0).expect("fits");
        let (_, second) = shard.check_undoable(&alg, &2, h2, 1, 0).expect("fits");
        assert_eq!(table_len(&shard), 1, "key 1 was evicted for key 2");
        shard.undo(&alg, &2, h2, second.expect("charged"), 0);
        shard.undo(&alg, &1, h1, first.expect("charged"), 0);
        // Key 2 is forgotten again, key 1 is back as it was.
        assert_eq!(table_len(&shard), 1);
        assert_eq!(shard.check(&alg, &1, h1, 0, 0).expect("fits").remaining, 3);
    }

    #[test]
    fn the_eviction_sample_is_spread_across_the_table() {
        use crate::Quota;
        use crate::algorithm::FixedWindow;
        use crate::algorithm::fixed_window::FixedWindowState;
        use std::num::NonZeroU32;

        let alg = FixedWindow::new(Quota::per_second(NonZeroU32::new(100).expect("nonzero")));
        // One shard of 100 keys, each charged once.
        let table: Table<u64, FixedWindowState> =
            Table::new(100, 1, u64::MAX, OnFull::Evict, None, |_| 0);
        let mut shard = table.lock(0);
        for key in 0..100u64 {
            let h = table.hash(&key);
            shard.check(&alg, &key, h, 1, 0).expect("fits");
        }
        // The keys the table lists first are exhausted: a "sample" of the
        // first entries would find only them, and forget one.
        let first: Vec<u64> = shard
            .shard
            .entries
            .iter()
            .take(EVICTION_SAMPLE)
            .map(|e| e.0)
            .collect();
        for key in &first {
            let h = table.hash(key);
            assert!(shard.check(&alg, key, h, 99, 0).expect("fits").allowed);
        }
        // Ten new keys: each evicts a light key of a sample taken across the
        // table (8 draws all among the 8 heavy keys of 100: about 1e-9).
        for key in 1_000..1_010u64 {
            let h = table.hash(&key);
            assert!(shard.check(&alg, &key, h, 1, 0).expect("fits").allowed);
        }
        assert_eq!(table_len(&shard), 100);
        for key in &first {
            let h = table.hash(key);
            let peek = shard.check(&alg, key, h, 0, 0).expect("fits");
            assert_eq!(peek.remaining, 0, "heavy key {key} was forgotten");
        }
    }

    fn table_len<K, S: SharedState>(shard: &ShardGuard<'_, K, S>) -> usize {
        shard.shard.entries.len()
    }
}

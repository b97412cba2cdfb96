//! The memory store's open reservations: the charges
//! [`Store::reserve`](super::Store::reserve) made under rules that give
//! back what is not settled in time
//! ([`Rule::release_unsettled_after`](super::Rule::release_unsettled_after)),
//! each until its settle closes it or its time passes.
//!
//! One book for the store, behind one lock: only reservations and their
//! settles take it (a request with an upstream call behind it), and a check
//! of a releasing rule only once the earliest reservation's time has
//! passed ([`Holds::due_by`]). A reservation is named by its rule, its key
//! and a 64-bit fingerprint of its settle id under a key drawn when the
//! store is built, as receipts are.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use compact_str::CompactString;

use super::MAX_HOLDS_PER_KEY;
use super::table::Table;
use crate::algorithm::{AnyAlgorithm, AnyState, Charged};
use crate::clock::Micros;

/// The most reservations the memory store holds open, all keys together
/// (about 25 MiB): one more is denied until one is settled or given back
/// (past it by a race of two threads, the oldest is given back at once).
pub const MAX_OPEN_HOLDS: usize = 1 << 18;

/// A rule (by name: a reload may renumber the rules) and a key.
pub(super) type KeyName = (Arc<str>, CompactString);

/// Where a reservation was charged: its rule's table and algorithm then.
/// A store made by a reload that no longer has the rule, or has it anew
/// in another table, gives it back there all the same.
pub(super) type Target = (Arc<Table<CompactString, AnyState>>, AnyAlgorithm);

/// A reservation to give back: its rule and key, where it was charged,
/// and the charge.
pub(super) type Release = (KeyName, Target, Charged);

struct Open {
    id: u64,
    seq: u64,
    until: Micros,
    target: Target,
    charged: Charged,
}

#[derive(Default)]
pub(super) struct Book {
    keys: HashMap<KeyName, Vec<Open>>,
    /// Every open reservation by (its time, the order it was made in).
    queue: BTreeMap<(Micros, u64), KeyName>,
    seq: u64,
}

/// The open reservations of a memory store.
pub(super) struct Holds {
    hasher: RandomState,
    book: Mutex<Book>,
    /// The earliest time of an open reservation (`u64::MAX` with none),
    /// set under the lock once the reservations due by then are given
    /// back.
    next: AtomicU64,
    /// How many reservations were given back unsettled.
    released: AtomicU64,
}

impl Holds {
    pub(super) fn new() -> Self {
        Self {
            hasher: RandomState::new(),
            book: Mutex::default(),
            next: AtomicU64::new(u64::MAX),
            released: AtomicU64::new(0),
        }
    }

    /// The fingerprint of settle id `id`.
    pub(super) fn fingerprint(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    /// Whether some reservation's time has passed at `now`: only then must
    /// a caller take the book ([`lock`](Self::lock)) and give them back.
    pub(super) fn due_by(&self, now: Micros) -> bool {
        now >= self.next.load(Ordering::Acquire)
    }

    /// How many reservations have been given back unsettled so far.
    pub(super) fn released(&self) -> u64 {
        self.released.load(Ordering::Relaxed)
    }

    /// The book, held while what it says is given back: a check that finds
    /// a reservation due waits for the caller that gives it back.
    pub(super) fn lock(&self) -> Locked<'_> {
        Locked {
            holds: self,
            book: self.book.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }
}

/// The book, locked.
pub(super) struct Locked<'a> {
    holds: &'a Holds,
    book: MutexGuard<'a, Book>,
}

impl Locked<'_> {
    /// Takes out every reservation due at `now`, to give back.
    pub(super) fn due(&mut self, now: Micros, out: &mut Vec<Release>) {
        while let Some(entry) = self.book.queue.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((_, seq), name) = entry.remove_entry();
            self.take(name, |o| o.seq == seq, out);
        }
    }

    /// Opens reservation `id` (a fingerprint) of `charged` on `name` until
    /// `until`; the key's oldest, or the book's, is taken out to give back
    /// if either is full.
    pub(super) fn open(
        &mut self,
        name: KeyName,
        id: u64,
        target: Target,
        charged: Charged,
        until: Micros,
        out: &mut Vec<Release>,
    ) {
        let book = &mut *self.book;
        book.seq += 1;
        let seq = book.seq;
        book.queue.insert((until, seq), name.clone());
        let held = book.keys.entry(name.clone()).or_default();
        held.push(Open {
            id,
            seq,
            until,
            target,
            charged,
        });
        if held.len() > MAX_HOLDS_PER_KEY {
            let oldest = held.iter().min_by_key(|o| (o.until, o.seq)).map(|o| o.seq);
            self.take(name, |o| Some(o.seq) == oldest, out);
        }
        if self.book.queue.len() > MAX_OPEN_HOLDS
            && let Some(((_, seq), name)) = self.book.queue.pop_first()
        {
            self.take(name, |o| o.seq == seq, out);
        }
    }

    /// When one more reservation of `name` can be held, if not now: its
    /// key, or the book, is full until its first one is settled or given
    /// back (`Some` of that time).
    pub(super) fn full_until(&self, name: &KeyName) -> Option<Micros> {
        if let Some(held) = self.book.keys.get(name)
            && held.len() >= MAX_HOLDS_PER_KEY
        {
            return held.iter().map(|o| o.until).min();
        }
        if self.book.queue.len() >= MAX_OPEN_HOLDS {
            return self.book.queue.first_key_value().map(|(k, _)| k.0);
        }
        None
    }

    /// Closes reservation `id` of `name`: whether it was open.
    pub(super) fn close(&mut self, name: &KeyName, id: u64) -> bool {
        let Some(held) = self.book.keys.get_mut(name) else {
            return false;
        };
        let Some(i) = held.iter().position(|o| o.id == id) else {
            return false;
        };
        let open = held.swap_remove(i);
        if held.is_empty() {
            self.book.keys.remove(name);
        }
        self.book.queue.remove(&(open.until, open.seq));
        true
    }

    /// Every open reservation: its rule and key, the meaning of the state
    /// it was charged to, its time and its charge (for a state file).
    pub(super) fn open_holds(&self) -> Vec<(KeyName, String, Micros, Charged)> {
        self.book
            .keys
            .iter()
            .flat_map(|(name, held)| {
                held.iter().map(|o| {
                    let meaning = o.target.1.state_meaning();
                    (name.clone(), meaning, o.until, o.charged)
                })
            })
            .collect()
    }

    /// Forgets every reservation of `name` without giving it back (the key
    /// was reset: its counts are gone).
    pub(super) fn forget(&mut self, name: &KeyName) {
        if let Some(held) = self.book.keys.remove(name) {
            for open in held {
                self.book.queue.remove(&(open.until, open.seq));
            }
        }
    }

    /// Takes out the reservation of `name` that `which` picks (its queue
    /// entry already gone, or removed here), to give back.
    fn take(&mut self, name: KeyName, which: impl Fn(&Open) -> bool, out: &mut Vec<Release>) {
        let Some(held) = self.book.keys.get_mut(&name) else {
            return;
        };
        let Some(i) = held.iter().position(which) else {
            return;
        };
        let open = held.swap_remove(i);
        if held.is_empty() {
            self.book.keys.remove(&name);
        }
        self.book.queue.remove(&(open.until, open.seq));
        self.holds.released.fetch_add(1, Ordering::Relaxed);
        out.push((name, open.target, open.charged));
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // What is given back has been (the caller holds the book until
        // then): checks may skip the book until the next one is due.
        let next = self
            .book
            .queue
            .first_key_value()
            .map_or(u64::MAX, |(k, _)| k.0);
        self.holds.next.store(next, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charged(cost: u64, at: Micros) -> Charged {
        Charged {
            cost,
            at,
            reset_after: 0,
            held: true,
        }
    }

    fn name(key: &str) -> KeyName {
        (Arc::from("r"), CompactString::new(key))
    }

    fn target() -> Target {
        let rule = super::super::Rule::new(
            "r",
            crate::algorithm::FixedWindow::new(crate::Quota::per_second(std::num::NonZeroU32::MIN)),
        );
        let options = super::super::MemoryOptions::default();
        (Arc::new(options.table(1, |_| 0)), *rule.algorithm())
    }

    #[test]
    fn a_reservation_is_due_once_its_time_has_passed_unless_closed() {
        let holds = Holds::new();
        let mut out = Vec::new();
        {
            let mut book = holds.lock();
            book.open(name("a"), 1, target(), charged(5, 0), 100, &mut out);
            book.open(name("a"), 2, target(), charged(6, 10), 110, &mut out);
            book.open(name("b"), 1, target(), charged(7, 20), 120, &mut out);
        }
        assert!(out.is_empty());
        assert!(!holds.due_by(99));
        assert!(holds.due_by(100));
        let mut book = holds.lock();
        assert!(book.close(&name("a"), 2));
        assert!(!book.close(&name("a"), 2));
        book.due(200, &mut out);
        drop(book);
        let costs: Vec<u64> = out.iter().map(|(_, _, c)| c.cost).collect();
        assert_eq!(costs, [5, 7]);
        assert_eq!(holds.released(), 2);
        assert!(!holds.due_by(u64::MAX - 1));
    }

    #[test]
    fn a_full_key_gives_back_its_oldest_at_once() {
        let holds = Holds::new();
        let mut out = Vec::new();
        let mut book = holds.lock();
        for i in 0..=MAX_HOLDS_PER_KEY as u64 {
            book.open(name("a"), i, target(), charged(1, i), 1_000 + i, &mut out);
        }
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].2.at, 0);
        assert!(!book.close(&name("a"), 0));
        assert!(book.close(&name("a"), 1));
    }
}

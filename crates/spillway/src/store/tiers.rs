//! API keys put in a tier at run time: the tier a request's API key counts
//! under, ahead of the configuration's table, shared through the store (on
//! Redis by every instance; in memory by this process).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwap;

use crate::clock::Micros;

/// One API key's tier, as it was set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierEntry {
    /// The tier's name.
    pub tier: Arc<str>,
    /// Until when it holds (µs on the store's clock, since the Unix epoch
    /// for every clock but a test's); `None`: until removed.
    pub until: Option<Micros>,
    /// The caller's own description of it, returned as given (the admin
    /// API keeps who set it, when and why, as JSON).
    pub spec: Arc<str>,
}

impl TierEntry {
    /// Whether it holds at `now`.
    pub fn in_force_at(&self, now: Micros) -> bool {
        self.until.is_none_or(|until| now < until)
    }
}

/// The API keys put in a tier at run time.
///
/// Read on every request that carries an API key while it holds any, and
/// written by an operator now and then: reads take a snapshot without a
/// lock (a write copies the table), and an empty book answers from one
/// atomic load.
///
/// ```
/// use spillway::store::{TierBook, TierEntry};
///
/// let book = TierBook::new();
/// assert_eq!(book.tier_of("k-123", 0), None);
/// book.set("k-123", TierEntry { tier: "pro".into(), until: Some(100), spec: "{}".into() });
/// assert_eq!(book.tier_of("k-123", 99).as_deref(), Some("pro"));
/// assert_eq!(book.tier_of("k-123", 100), None);
/// ```
#[derive(Debug, Default)]
pub struct TierBook {
    count: AtomicUsize,
    keys: ArcSwap<HashMap<Box<str>, TierEntry>>,
    // Writers one at a time, so that the count is the table's.
    writing: parking_lot::Mutex<()>,
}

impl TierBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether it holds no key at all (one atomic load).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// How many keys it holds (those past their time included).
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// The tier `api_key` is in at `now`, if it was put in one.
    pub fn tier_of(&self, api_key: &str, now: Micros) -> Option<Arc<str>> {
        if self.is_empty() {
            return None;
        }
        let keys = self.keys.load();
        let entry = keys.get(api_key)?;
        entry.in_force_at(now).then(|| entry.tier.clone())
    }

    /// `api_key`'s entry, in force or not.
    pub fn get(&self, api_key: &str) -> Option<TierEntry> {
        self.keys.load().get(api_key).cloned()
    }

    /// Puts `api_key` in a tier, replacing any; returns the entry it
    /// replaced.
    pub fn set(&self, api_key: &str, entry: TierEntry) -> Option<TierEntry> {
        self.write(|keys| keys.insert(api_key.into(), entry))
    }

    /// Changes the table by `change`, one writer at a time.
    fn write<T>(&self, change: impl FnOnce(&mut HashMap<Box<str>, TierEntry>) -> T) -> T {
        let _one = self.writing.lock();
        let mut keys = HashMap::clone(&self.keys.load());
        let out = change(&mut keys);
        let n = keys.len();
        self.keys.store(Arc::new(keys));
        self.count.store(n, Ordering::Release);
        out
    }

    /// Takes `api_key` out of its tier; returns its entry.
    pub fn remove(&self, api_key: &str) -> Option<TierEntry> {
        self.write(|keys| keys.remove(api_key))
    }

    /// Every key in force at `now`, by key.
    pub fn list(&self, now: Micros) -> Vec<(String, TierEntry)> {
        let mut all: Vec<(String, TierEntry)> = self
            .keys
            .load()
            .iter()
            .filter(|(_, e)| e.in_force_at(now))
            .map(|(k, e)| (k.to_string(), e.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Replaces the whole book with `entries` (a refresh from a shared
    /// copy).
    pub fn replace(&self, entries: impl IntoIterator<Item = (String, TierEntry)>) {
        let fresh: HashMap<Box<str>, TierEntry> = entries
            .into_iter()
            .map(|(k, e)| (k.into_boxed_str(), e))
            .collect();
        self.write(|keys| *keys = fresh);
    }

    /// Drops every entry whose time has passed at `now`.
    pub fn purge(&self, now: Micros) {
        if self.keys.load().values().all(|e| e.in_force_at(now)) {
            return;
        }
        self.write(|keys| keys.retain(|_, e| e.in_force_at(now)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(tier: &str) -> TierEntry {
        TierEntry {
            tier: tier.into(),
            until: None,
            spec: "{}".into(),
        }
    }

    #[test]
    fn a_key_is_in_the_tier_it_was_last_put_in_until_removed() {
        let book = TierBook::new();
        assert!(book.is_empty());
        assert_eq!(book.set("a", entry("pro")), None);
        assert_eq!(
            book.set("a", entry("free")).map(|e| e.tier),
            Some("pro".into())
        );
        book.set("b", entry("pro"));
        assert_eq!(book.len(), 2);
        assert_eq!(book.tier_of("a", 0).as_deref(), Some("free"));
        assert_eq!(book.tier_of("c", 0), None);
        assert_eq!(book.remove("a").map(|e| e.tier), Some("free".into()));
        assert_eq!(book.tier_of("a", 0), None);
        let listed: Vec<String> = book.list(0).into_iter().map(|(k, _)| k).collect();
        assert_eq!(listed, vec!["b"]);
        book.replace(vec![("z".to_string(), entry("x"))]);
        assert_eq!(book.tier_of("b", 0), None);
        assert_eq!(book.tier_of("z", 0).as_deref(), Some("x"));
    }

    #[test]
    fn an_entry_past_its_time_holds_no_more_and_is_purged() {
        let book = TierBook::new();
        book.set(
            "a",
            TierEntry {
                until: Some(10),
                ..entry("pro")
            },
        );
        assert!(book.list(10).is_empty());
        book.purge(9);
        assert_eq!(book.len(), 1);
        book.purge(10);
        assert!(book.is_empty());
    }

    #[test]
    fn writes_from_threads_are_all_kept() {
        let book = Arc::new(TierBook::new());
        std::thread::scope(|s| {
            for t in 0..4 {
                let book = book.clone();
                s.spawn(move || {
                    for i in 0..250 {
                        book.set(&format!("{t}-{i}"), entry("pro"));
                    }
                });
            }
        });
        assert_eq!(book.len(), 1000);
        assert_eq!(book.list(0).len(), 1000);
    }
}

//! Quotas changed at run time: another quota for one key of a rule, or for
//! every key that starts with a prefix, until a time or until removed.
//!
//! An [`Override`] replaces its rule's quota for the keys it names, in the
//! same store call as the rest of a request: the in-memory store looks it
//! up in its [`OverrideBook`]; the Redis store reads a key's own override
//! inside its script, from the key's slot, and a prefix's from the book it
//! keeps fresh. An override counts on the key's own state, so setting,
//! changing or removing one keeps what the key has used, as a limit changed
//! in the configuration does: that is why an override changes a limit, a
//! burst or a delay, never the window. A limit of 0 denies every request of
//! its keys without counting anything: an emergency brake.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use compact_str::CompactString;
use parking_lot::{Mutex, RwLock};

use std::num::NonZeroU32;

use crate::Quota;
use crate::algorithm::{
    Algorithm, AnyAlgorithm, Concurrency, LeakyBucket, LeakyMode, SlidingLog, SlidingWindow,
    TokenBucket,
};
use crate::clock::Micros;
use crate::decision::Decision;
use crate::store::table::Hasher;

/// Another quota for the keys an override names: another limit (0 stops
/// them), and for a bucket another burst or delay, over its rule's window.
///
/// An override keeps its rule's algorithm and window (and calendar, mode
/// and lease), so that a key's count means the same under both and is
/// kept when an override is set, changed or removed; it changes only what
/// a limit changed in the configuration file may change without starting
/// the key afresh.
///
/// ```
/// use std::num::NonZeroU32;
/// use spillway::algorithm::{Algorithm, FixedWindow, TokenBucket};
/// use spillway::store::Override;
/// use spillway::Quota;
///
/// let nz = |n| NonZeroU32::new(n).unwrap();
/// let rule = FixedWindow::new(Quota::per_hour(nz(1_000))).into();
/// let raised = Override::limit(50_000).applied_to(&rule).unwrap().unwrap();
/// assert_eq!(raised.capacity(), 50_000);
/// assert_eq!(raised.quota().period(), std::time::Duration::from_secs(3600));
/// // A limit of 0: no algorithm, every request stopped.
/// assert_eq!(Override::limit(0).applied_to(&rule), Ok(None));
/// // A burst is a bucket's.
/// assert!(Override::limit(5).with_burst(nz(10)).applied_to(&rule).is_err());
/// let bucket = TokenBucket::new(Quota::per_minute(nz(100)), nz(10)).into();
/// let o = Override::limit(1_000).with_burst(nz(50)).applied_to(&bucket).unwrap().unwrap();
/// assert_eq!(o.capacity(), 50);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Override {
    limit: u32,
    burst: Option<NonZeroU32>,
    delay: Option<u32>,
    until: Option<Micros>,
}

impl Override {
    /// A limit of `limit` per the rule's window (0: every request that
    /// costs anything is stopped, and nothing is counted), until removed.
    /// A bucket's burst is then the limit, as in the configuration file.
    pub const fn limit(limit: u32) -> Self {
        Self {
            limit,
            burst: None,
            delay: None,
            until: None,
        }
    }

    /// The same override with a bucket's burst (its capacity).
    pub const fn with_burst(self, burst: NonZeroU32) -> Self {
        Self {
            burst: Some(burst),
            ..self
        }
    }

    /// The same override with a shaping leaky bucket's `delay` (how many
    /// requests pass undelayed).
    pub const fn with_delay(self, delay: u32) -> Self {
        Self {
            delay: Some(delay),
            ..self
        }
    }

    /// The same override, in force until `until` (µs on the store's clock,
    /// which for every clock but a test's is since the Unix epoch).
    pub const fn until(self, until: Micros) -> Self {
        Self {
            until: Some(until),
            ..self
        }
    }

    /// Its limit (0 stops every request).
    pub const fn limit_of(&self) -> u32 {
        self.limit
    }

    /// Its burst, if it sets one.
    pub const fn burst(&self) -> Option<NonZeroU32> {
        self.burst
    }

    /// Its delay, if it sets one.
    pub const fn delay(&self) -> Option<u32> {
        self.delay
    }

    /// Until when it is in force; `None`: until removed.
    pub const fn ends_at(&self) -> Option<Micros> {
        self.until
    }

    /// Whether it is in force at `now`.
    pub fn in_force_at(&self, now: Micros) -> bool {
        self.until.is_none_or(|until| now < until)
    }

    /// The quota it makes of `rule`'s: `None` for a limit of 0; an error
    /// (naming the field) for a burst or delay `rule`'s algorithm does not
    /// take.
    pub fn applied_to(&self, rule: &AnyAlgorithm) -> Result<Option<AnyAlgorithm>, String> {
        let not_for = |field: &str| {
            format!(
                "`{field}` does not apply to {}{}",
                rule.name(),
                match rule {
                    AnyAlgorithm::LeakyBucket(_) => " in police mode",
                    _ => "",
                }
            )
        };
        let bucket = matches!(
            rule,
            AnyAlgorithm::TokenBucket(_) | AnyAlgorithm::LeakyBucket(_)
        );
        if self.burst.is_some() && !bucket {
            return Err(not_for("burst"));
        }
        let shapes = matches!(rule, AnyAlgorithm::LeakyBucket(b) if b.mode() == LeakyMode::Shape);
        if self.delay.is_some() && !shapes {
            return Err(not_for("delay"));
        }
        let Some(limit) = NonZeroU32::new(self.limit) else {
            return Ok(None);
        };
        let quota =
            Quota::new(limit, rule.quota().period()).expect("the rule's period is a valid one");
        let burst = self.burst.unwrap_or(limit);
        let algorithm: AnyAlgorithm = match rule {
            AnyAlgorithm::FixedWindow(a) => a.with_limit(limit).into(),
            AnyAlgorithm::SlidingLog(_) => SlidingLog::new(quota).into(),
            AnyAlgorithm::SlidingWindow(_) => SlidingWindow::new(quota).into(),
            AnyAlgorithm::Concurrency(_) => Concurrency::new(quota).into(),
            AnyAlgorithm::TokenBucket(_) => TokenBucket::new(quota, burst).into(),
            AnyAlgorithm::LeakyBucket(a) => LeakyBucket::new(quota, burst, a.mode())
                .with_delay(self.delay.unwrap_or(0))
                .into(),
        };
        debug_assert!(algorithm.keeps_state_of(rule));
        Ok(Some(algorithm))
    }
}

/// The decision of a request of `cost` that a quota of `capacity` (0: an
/// override's limit of 0) stops, in force until `until`, at `now`; `None`
/// when it does not stop it. A stopped request is denied until the
/// override ends (no retry time when it has no end: nothing will be
/// admitted until someone lifts it), counting nothing; a look (cost 0) at
/// a limit of 0 is admitted, with nothing remaining.
pub(crate) fn stopped(
    capacity: u64,
    until: Option<Micros>,
    cost: u64,
    now: Micros,
) -> Option<Decision> {
    if cost <= capacity && (cost > 0 || capacity > 0) {
        return None;
    }
    let left = until.map(|until| Duration::from_micros(until.saturating_sub(now)));
    Some(Decision {
        allowed: cost == 0,
        limit: capacity,
        remaining: 0,
        reset_after: left.unwrap_or_default(),
        refill_after: left.unwrap_or_default(),
        retry_after: if cost == 0 { None } else { left },
        delay: Duration::ZERO,
    })
}

/// Whom an override is for: one key of its rule, or every key that starts
/// with a prefix (a key's own override wins over any prefix's, and a
/// longer prefix over a shorter one).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Exactly this key.
    Key(CompactString),
    /// Every key that starts with this (not empty).
    Prefix(CompactString),
}

impl Target {
    /// The key or prefix.
    pub fn text(&self) -> &str {
        match self {
            Self::Key(k) | Self::Prefix(k) => k,
        }
    }
}

/// An override as it was set: the override, and what the caller wants
/// back when it lists them (the admin API keeps the fields it was given,
/// who set it and when, as JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverrideEntry {
    /// The override.
    pub applied: Override,
    /// The caller's own description of it, returned as given.
    pub spec: Arc<str>,
}

/// Every override of a store's rules, by rule name: what the in-memory
/// store applies, and the Redis store's copy of what it shares through
/// Redis. Reads take a shared lock; a book with no override answers from
/// one atomic load, so that a store without any pays nothing for them.
#[derive(Debug, Default)]
pub struct OverrideBook {
    // How many overrides the book holds, expired ones included.
    count: AtomicUsize,
    rules: RwLock<HashMap<Box<str>, RuleOverrides>>,
    // The in-memory stores' filters of each rule (one per table: a reload
    // that rebuilds a rule's table adds one), marked under `rules`' write
    // lock as each override is set, so that no filter misses one set
    // while it was being made.
    filters: Mutex<HashMap<Box<str>, Vec<Weak<OverrideFilter>>>>,
}

#[derive(Debug, Default)]
struct RuleOverrides {
    keys: HashMap<CompactString, OverrideEntry>,
    // By length, so that a key is looked up once per length some prefix
    // has (few), longest first.
    prefixes: BTreeMap<usize, HashMap<CompactString, OverrideEntry>>,
}

impl RuleOverrides {
    fn len(&self) -> usize {
        self.keys.len() + self.prefixes.values().map(HashMap::len).sum::<usize>()
    }

    fn find_prefix(&self, key: &str, now: Micros) -> Option<Override> {
        self.prefixes
            .range(..=key.len())
            .rev()
            .filter(|(len, _)| key.is_char_boundary(**len))
            .find_map(|(len, map)| {
                map.get(&key[..*len])
                    .map(|e| e.applied)
                    .filter(|o| o.in_force_at(now))
            })
    }
}

impl OverrideBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether it holds no override at all (one atomic load).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// How many overrides it holds (those past their time included, until
    /// [`purge`](Self::purge) drops them).
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// The override in force for `key` under the rule called `rule` at
    /// `now`: the key's own, else the longest prefix's.
    pub fn find(&self, rule: &str, key: &str, now: Micros) -> Option<Override> {
        if self.is_empty() {
            return None;
        }
        let rules = self.rules.read();
        let of_rule = rules.get(rule)?;
        of_rule
            .keys
            .get(key)
            .map(|e| e.applied)
            .filter(|o| o.in_force_at(now))
            .or_else(|| of_rule.find_prefix(key, now))
    }

    /// The override in force for `key` under `rule` by prefix only (a
    /// store that reads keys' own overrides elsewhere).
    pub fn find_prefix(&self, rule: &str, key: &str, now: Micros) -> Option<Override> {
        if self.is_empty() {
            return None;
        }
        self.rules.read().get(rule)?.find_prefix(key, now)
    }

    /// Whether the rule called `rule` has any key's own override (in force
    /// or not).
    pub fn has_keys(&self, rule: &str) -> bool {
        !self.is_empty()
            && self
                .rules
                .read()
                .get(rule)
                .is_some_and(|r| !r.keys.is_empty())
    }

    /// Marks `filter` with every override of the rule called `rule`, and
    /// with every one set from now on (as long as it lives).
    pub(crate) fn register(&self, rule: &str, filter: &Arc<OverrideFilter>) {
        // Held shared: a `set` waits until the filter is listed.
        let rules = self.rules.read();
        if let Some(of_rule) = rules.get(rule) {
            of_rule.keys.keys().for_each(|k| filter.mark_key(k));
            if !of_rule.prefixes.is_empty() {
                filter.mark_prefixes();
            }
        }
        let mut filters = self.filters.lock();
        let of_rule = filters.entry(rule.into()).or_default();
        of_rule.retain(|f| f.strong_count() > 0);
        of_rule.push(Arc::downgrade(filter));
    }

    /// Marks `target` in the filters of the rule called `rule` (`rules`'
    /// write lock is held).
    fn mark(&self, rule: &str, target: &Target) {
        let filters = self.filters.lock();
        for filter in filters.get(rule).into_iter().flatten() {
            if let Some(filter) = filter.upgrade() {
                match target {
                    Target::Key(key) => filter.mark_key(key),
                    Target::Prefix(_) => filter.mark_prefixes(),
                }
            }
        }
    }

    /// Sets `target`'s override under the rule called `rule`, replacing
    /// any; returns the one it replaced.
    pub fn set(&self, rule: &str, target: Target, entry: OverrideEntry) -> Option<OverrideEntry> {
        let mut rules = self.rules.write();
        self.mark(rule, &target);
        let of_rule = rules.entry(rule.into()).or_default();
        let old = match target {
            Target::Key(key) => of_rule.keys.insert(key, entry),
            Target::Prefix(prefix) => of_rule
                .prefixes
                .entry(prefix.len())
                .or_default()
                .insert(prefix, entry),
        };
        if old.is_none() {
            self.count.fetch_add(1, Ordering::AcqRel);
        }
        old
    }

    /// Removes `target`'s override under the rule called `rule`; returns
    /// it.
    pub fn remove(&self, rule: &str, target: &Target) -> Option<OverrideEntry> {
        let mut rules = self.rules.write();
        let of_rule = rules.get_mut(rule)?;
        let old = match target {
            Target::Key(key) => of_rule.keys.remove(key.as_str()),
            Target::Prefix(prefix) => {
                let by_len = of_rule.prefixes.get_mut(&prefix.len())?;
                let old = by_len.remove(prefix.as_str());
                if by_len.is_empty() {
                    of_rule.prefixes.remove(&prefix.len());
                }
                old
            }
        };
        if old.is_some() {
            self.count.fetch_sub(1, Ordering::AcqRel);
            if of_rule.len() == 0 {
                rules.remove(rule);
            }
        }
        old
    }

    /// `target`'s override under the rule called `rule`, in force or not.
    pub fn get(&self, rule: &str, target: &Target) -> Option<OverrideEntry> {
        let rules = self.rules.read();
        let of_rule = rules.get(rule)?;
        match target {
            Target::Key(key) => of_rule.keys.get(key.as_str()).cloned(),
            Target::Prefix(prefix) => of_rule
                .prefixes
                .get(&prefix.len())?
                .get(prefix.as_str())
                .cloned(),
        }
    }

    /// Every override of the rule called `rule`, in force at `now`, in
    /// order (keys before prefixes, each by its text).
    pub fn list(&self, rule: &str, now: Micros) -> Vec<(Target, OverrideEntry)> {
        let rules = self.rules.read();
        let Some(of_rule) = rules.get(rule) else {
            return Vec::new();
        };
        let keys = of_rule
            .keys
            .iter()
            .map(|(k, e)| (Target::Key(k.clone()), e.clone()));
        let prefixes = of_rule
            .prefixes
            .values()
            .flatten()
            .map(|(p, e)| (Target::Prefix(p.clone()), e.clone()));
        let mut all: Vec<_> = keys
            .chain(prefixes)
            .filter(|(_, e)| e.applied.in_force_at(now))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The names of the rules that have overrides.
    pub fn rules(&self) -> Vec<String> {
        self.rules.read().keys().map(|r| r.to_string()).collect()
    }

    /// Drops every override whose time has passed at `now`.
    pub fn purge(&self, now: Micros) {
        let mut rules = self.rules.write();
        let mut dropped = 0;
        for of_rule in rules.values_mut() {
            let before = of_rule.len();
            of_rule.keys.retain(|_, e| e.applied.in_force_at(now));
            for map in of_rule.prefixes.values_mut() {
                map.retain(|_, e| e.applied.in_force_at(now));
            }
            of_rule.prefixes.retain(|_, map| !map.is_empty());
            dropped += before - of_rule.len();
        }
        rules.retain(|_, r| r.len() > 0);
        self.count.fetch_sub(dropped, Ordering::AcqRel);
    }

    /// Replaces the whole book with `entries` (a refresh from a shared
    /// copy).
    pub fn replace(&self, entries: impl IntoIterator<Item = (String, Target, OverrideEntry)>) {
        let mut fresh: HashMap<Box<str>, RuleOverrides> = HashMap::new();
        let mut count = 0;
        let mut rules = self.rules.write();
        for (rule, target, entry) in entries {
            self.mark(&rule, &target);
            let of_rule = fresh.entry(rule.into()).or_default();
            let old = match target {
                Target::Key(key) => of_rule.keys.insert(key, entry),
                Target::Prefix(p) => of_rule
                    .prefixes
                    .entry(p.len())
                    .or_default()
                    .insert(p, entry),
            };
            if old.is_none() {
                count += 1;
            }
        }
        *rules = fresh;
        self.count.store(count, Ordering::Release);
    }
}

/// Which keys of one rule may have an override, by the hash the rule's
/// table gives them: what lets a check of a key with none skip the book
/// (one load while the rule has none; one bit's load after). Bits are set,
/// never cleared: a removed override leaves a bit that sends its key to
/// the book, which finds nothing.
#[derive(Debug)]
pub(crate) struct OverrideFilter {
    // The hasher of the rule's table, whose hashes the checks ask about.
    hasher: Hasher,
    // 2^20 bits once the rule has a key's own override: with 10,000 keys,
    // about 1 key in 100 without one is sent to the book.
    bits: std::sync::OnceLock<Box<[AtomicU64]>>,
    prefixes: std::sync::atomic::AtomicBool,
}

const FILTER_WORDS: usize = 1 << 14;

impl OverrideFilter {
    /// An empty filter for a table hashing with `hasher`.
    pub(crate) fn new(hasher: Hasher) -> Self {
        Self {
            hasher,
            bits: std::sync::OnceLock::new(),
            prefixes: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Marks `key` as having an override of its own.
    fn mark_key(&self, key: &str) {
        self.mark(std::hash::BuildHasher::hash_one(&self.hasher, key));
    }

    /// Whether a key of `hash` may have an override (its own or a
    /// prefix's).
    #[inline]
    pub(crate) fn may_hold(&self, hash: u64) -> bool {
        if self.prefixes.load(Ordering::Acquire) {
            return true;
        }
        let Some(bits) = self.bits.get() else {
            return false;
        };
        // The top bits: the table's slots and shards use the others.
        let bit = (hash >> 44) as usize;
        bits[bit / 64 % FILTER_WORDS].load(Ordering::Acquire) & (1 << (bit % 64)) != 0
    }

    /// Marks a key of `hash` as having an override of its own.
    fn mark(&self, hash: u64) {
        let bits = self
            .bits
            .get_or_init(|| (0..FILTER_WORDS).map(|_| AtomicU64::new(0)).collect());
        let bit = (hash >> 44) as usize;
        bits[bit / 64 % FILTER_WORDS].fetch_or(1 << (bit % 64), Ordering::Release);
    }

    /// Marks the rule as having prefixes' overrides: every key is looked
    /// up.
    fn mark_prefixes(&self) {
        self.prefixes.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::FixedWindow;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    fn entry(o: Override) -> OverrideEntry {
        OverrideEntry {
            applied: o,
            spec: "{}".into(),
        }
    }

    #[test]
    fn a_keys_own_override_wins_then_the_longest_prefix() {
        let book = OverrideBook::new();
        assert!(book.is_empty());
        assert_eq!(book.find("r", "acme-1", 0), None);
        let key = |s: &str| Target::Key(s.into());
        let prefix = |s: &str| Target::Prefix(s.into());
        book.set("r", prefix("ac"), entry(Override::limit(10)));
        book.set("r", prefix("acme-"), entry(Override::limit(20)));
        book.set("r", key("acme-1"), entry(Override::limit(0)));
        assert_eq!(book.len(), 3);
        assert_eq!(book.find("r", "acme-1", 0), Some(Override::limit(0)));
        assert_eq!(book.find("r", "acme-2", 0), Some(Override::limit(20)));
        assert_eq!(book.find("r", "acorn", 0), Some(Override::limit(10)));
        assert_eq!(book.find("r", "a", 0), None);
        assert_eq!(book.find("other", "acme-1", 0), None);
        assert_eq!(
            book.find_prefix("r", "acme-1", 0),
            Some(Override::limit(20))
        );
        assert!(book.has_keys("r") && !book.has_keys("other"));
        // A key cut inside a character is not under a prefix.
        book.set("r", prefix("\u{e9}"), entry(Override::limit(0)));
        assert_eq!(book.find("r", "\u{e9}x", 0), Some(Override::limit(0)));
        assert_eq!(book.find("r", "\u{e8}", 0), None);
        assert!(book.remove("r", &key("acme-1")).is_some());
        assert!(book.remove("r", &key("acme-1")).is_none());
        assert_eq!(book.find("r", "acme-1", 0), Some(Override::limit(20)));
        assert_eq!(book.len(), 3);
        let listed: Vec<Target> = book.list("r", 0).into_iter().map(|(t, _)| t).collect();
        assert_eq!(
            listed,
            vec![prefix("ac"), prefix("acme-"), prefix("\u{e9}")]
        );
    }

    #[test]
    fn an_override_past_its_time_is_not_in_force_and_is_purged() {
        let book = OverrideBook::new();
        let brake = Override::limit(0).until(100);
        book.set("r", Target::Key("k".into()), entry(brake));
        assert_eq!(book.find("r", "k", 99), Some(brake));
        assert_eq!(book.find("r", "k", 100), None);
        assert!(book.list("r", 100).is_empty());
        book.purge(100);
        assert!(book.is_empty());
        assert!(book.rules().is_empty());
    }

    #[test]
    fn a_limit_of_zero_stops_what_costs_and_says_until_when() {
        let stop = stopped(0, Some(5_000_000), 1, 1_000_000).unwrap();
        assert!(!stop.allowed);
        assert_eq!(stop.retry_after, Some(Duration::from_secs(4)));
        assert_eq!(stopped(0, None, 1, 0).unwrap().retry_after, None);
        assert!(stopped(0, None, 0, 0).unwrap().allowed);
        assert_eq!(stopped(10, None, 10, 0), None);
        assert_eq!(stopped(10, None, 0, 0), None);
        assert!(!stopped(10, None, 11, 0).unwrap().allowed);
    }

    #[test]
    fn an_override_keeps_its_rules_window_kind_and_mode() {
        let period = Duration::from_secs(60);
        let q = |n| Quota::new(nz(n), period).unwrap();
        let rules: Vec<AnyAlgorithm> = vec![
            FixedWindow::new(q(100)).into(),
            SlidingLog::new(q(100)).into(),
            SlidingWindow::new(q(100)).into(),
            Concurrency::new(q(100)).into(),
            TokenBucket::new(q(100), nz(10)).into(),
            LeakyBucket::shape(q(100), nz(10)).with_delay(3).into(),
            LeakyBucket::police(q(100), nz(10)).into(),
        ];
        for rule in &rules {
            let o = Override::limit(7).applied_to(rule).unwrap().unwrap();
            assert!(o.keeps_state_of(rule), "{rule:?}");
            assert_eq!(o.quota().period(), period);
            assert_eq!(o.quota().limit().get(), 7);
            assert_eq!(Override::limit(0).applied_to(rule), Ok(None));
        }
        let burst = Override::limit(7).with_burst(nz(30));
        assert_eq!(burst.applied_to(&rules[4]).unwrap().unwrap().capacity(), 30);
        let e = burst.applied_to(&rules[0]).unwrap_err();
        assert!(e.contains("`burst`") && e.contains("fixed_window"), "{e}");
        let delay = Override::limit(7).with_delay(2);
        let shaped = delay.applied_to(&rules[5]).unwrap().unwrap();
        assert!(matches!(shaped, AnyAlgorithm::LeakyBucket(b) if b.undelayed() == 2));
        let e = delay.applied_to(&rules[6]).unwrap_err();
        assert!(e.contains("police"), "{e}");
    }

    #[test]
    fn a_replaced_book_holds_the_new_entries_only() {
        let book = OverrideBook::new();
        book.set("a", Target::Key("x".into()), entry(Override::limit(0)));
        book.replace(vec![
            (
                "b".into(),
                Target::Prefix("p".into()),
                entry(Override::limit(0)),
            ),
            (
                "b".into(),
                Target::Key("k".into()),
                entry(Override::limit(0)),
            ),
        ]);
        assert_eq!(book.len(), 2);
        assert_eq!(book.find("a", "x", 0), None);
        assert!(book.find("b", "pq", 0).is_some());
    }
}

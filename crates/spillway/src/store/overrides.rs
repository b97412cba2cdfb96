//! Quotas changed at run time: another quota for one key of a rule, or for
//! every key that starts with a prefix, until a time or until removed.
//!
//! An [`Override`] replaces its rule's quota for the keys it names, in the
//! same store call as the rest of a request: the in-memory store looks it
//! up in its [`OverrideBook`]; the Redis store reads a key's own override
//! inside its script, from the key's slot, and a prefix's from the book it
//! keeps fresh. An override counts on the key's own state, so setting,
//! changing or removing one keeps what the key has used, as a limit changed
//! in the configuration does: that is why an override must read its
//! rule's state the same way ([`Override::fits`]: same algorithm, same
//! window). A limit of 0 ([`Override::zero`]) denies every request of its
//! keys without counting anything: an emergency brake.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use compact_str::CompactString;
use parking_lot::RwLock;

use crate::algorithm::{Algorithm, AnyAlgorithm};
use crate::clock::Micros;
use crate::decision::Decision;

/// Another quota for the keys an override names.
///
/// ```
/// use std::num::NonZeroU32;
/// use spillway::algorithm::FixedWindow;
/// use spillway::store::Override;
/// use spillway::Quota;
///
/// let rule = FixedWindow::new(Quota::per_hour(NonZeroU32::new(1_000).unwrap()));
/// let raised = Override::quota(FixedWindow::new(Quota::per_hour(NonZeroU32::new(50_000).unwrap())).into());
/// assert!(raised.fits(&rule.into()).is_ok());
/// // Another window would count the key afresh: not an override.
/// let per_minute = Override::quota(FixedWindow::new(Quota::per_minute(NonZeroU32::new(50_000).unwrap())).into());
/// assert!(per_minute.fits(&rule.into()).is_err());
/// assert_eq!(Override::zero().capacity(), 0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Override {
    // `None`: a limit of 0.
    algorithm: Option<AnyAlgorithm>,
    until: Option<Micros>,
}

impl Override {
    /// `algorithm` instead of the rule's, until removed.
    pub const fn quota(algorithm: AnyAlgorithm) -> Self {
        Self {
            algorithm: Some(algorithm),
            until: None,
        }
    }

    /// A limit of 0, until removed: every request that costs anything is
    /// denied, and nothing is counted.
    pub const fn zero() -> Self {
        Self {
            algorithm: None,
            until: None,
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

    /// The quota instead of the rule's; `None` for a limit of 0.
    pub const fn algorithm(&self) -> Option<&AnyAlgorithm> {
        self.algorithm.as_ref()
    }

    /// Until when it is in force; `None`: until removed.
    pub const fn ends_at(&self) -> Option<Micros> {
        self.until
    }

    /// The most one request may cost under it (0 for a limit of 0).
    pub fn capacity(&self) -> u64 {
        self.algorithm.map_or(0, |a| a.capacity())
    }

    /// Whether it is in force at `now`.
    pub fn in_force_at(&self, now: Micros) -> bool {
        self.until.is_none_or(|until| now < until)
    }

    /// Whether it can stand for `rule`'s quota: a limit of 0 always can;
    /// another quota must read the key's state as the rule does (the same
    /// algorithm and window, the same calendar), so that the key's count
    /// means the same under both and is kept across the change. The
    /// message says why not.
    pub fn fits(&self, rule: &AnyAlgorithm) -> Result<(), String> {
        match &self.algorithm {
            None => Ok(()),
            Some(a) if a.keeps_state_of(rule) => Ok(()),
            Some(a) if a.name() != rule.name() => Err(format!(
                "an override keeps its rule's algorithm ({}), not {}",
                rule.name(),
                a.name()
            )),
            Some(_) => Err(
                "an override keeps its rule's window (a count under another window's length \
                 or calendar means nothing): change the limit, burst or delay"
                    .to_string(),
            ),
        }
    }

    /// The decision of a request of `cost` that it stops (a limit of 0, or
    /// a cost over its capacity) at `now`, or `None` when it does not stop
    /// it. A stopped request is denied until the override ends (no retry
    /// time when it has no end: the limit is 0 until someone lifts it); a
    /// look (cost 0) is admitted, with nothing remaining.
    pub fn stops(&self, cost: u64, now: Micros) -> Option<Decision> {
        if cost > 0 && cost <= self.capacity() {
            return None;
        }
        if cost == 0 && self.algorithm.is_some() {
            return None;
        }
        let left = self
            .until
            .map(|until| Duration::from_micros(until.saturating_sub(now)));
        Some(Decision {
            allowed: cost == 0,
            limit: self.capacity(),
            remaining: 0,
            reset_after: left.unwrap_or_default(),
            refill_after: left.unwrap_or_default(),
            retry_after: if cost == 0 { None } else { left },
            delay: Duration::ZERO,
        })
    }
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

    /// Sets `target`'s override under the rule called `rule`, replacing
    /// any; returns the one it replaced.
    pub fn set(&self, rule: &str, target: Target, entry: OverrideEntry) -> Option<OverrideEntry> {
        let mut rules = self.rules.write();
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
        for (rule, target, entry) in entries {
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
        let mut rules = self.rules.write();
        *rules = fresh;
        self.count.store(count, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::Quota;
    use crate::algorithm::{FixedWindow, TokenBucket};

    fn per_hour(n: u32) -> AnyAlgorithm {
        FixedWindow::new(Quota::per_hour(NonZeroU32::new(n).unwrap())).into()
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
        book.set("r", prefix("ac"), entry(Override::quota(per_hour(10))));
        book.set("r", prefix("acme-"), entry(Override::quota(per_hour(20))));
        book.set("r", key("acme-1"), entry(Override::zero()));
        assert_eq!(book.len(), 3);
        assert_eq!(book.find("r", "acme-1", 0), Some(Override::zero()));
        assert_eq!(book.find("r", "acme-2", 0).unwrap().capacity(), 20);
        assert_eq!(book.find("r", "acorn", 0).unwrap().capacity(), 10);
        assert_eq!(book.find("r", "a", 0), None);
        assert_eq!(book.find("other", "acme-1", 0), None);
        assert_eq!(book.find_prefix("r", "acme-1", 0).unwrap().capacity(), 20);
        assert!(book.has_keys("r") && !book.has_keys("other"));
        // A key shorter than a prefix, or cut inside a character, is not under it.
        book.set("r", prefix("é"), entry(Override::zero()));
        assert_eq!(book.find("r", "\u{e9}x", 0), Some(Override::zero()));
        assert_eq!(book.find("r", "\u{e8}", 0), None);
        assert!(book.remove("r", &key("acme-1")).is_some());
        assert!(book.remove("r", &key("acme-1")).is_none());
        assert_eq!(book.find("r", "acme-1", 0).unwrap().capacity(), 20);
        assert_eq!(book.len(), 3);
        let listed: Vec<Target> = book.list("r", 0).into_iter().map(|(t, _)| t).collect();
        assert_eq!(listed, vec![prefix("ac"), prefix("acme-"), prefix("é")]);
    }

    #[test]
    fn an_override_past_its_time_is_not_in_force_and_is_purged() {
        let book = OverrideBook::new();
        book.set(
            "r",
            Target::Key("k".into()),
            entry(Override::zero().until(100)),
        );
        assert_eq!(book.find("r", "k", 99), Some(Override::zero().until(100)));
        assert_eq!(book.find("r", "k", 100), None);
        assert!(book.list("r", 100).is_empty());
        book.purge(100);
        assert!(book.is_empty());
        assert!(book.rules().is_empty());
    }

    #[test]
    fn a_limit_of_zero_stops_what_costs_and_says_until_when() {
        let stopped = Override::zero()
            .until(5_000_000)
            .stops(1, 1_000_000)
            .unwrap();
        assert!(!stopped.allowed);
        assert_eq!(stopped.retry_after, Some(Duration::from_secs(4)));
        assert_eq!(Override::zero().stops(1, 0).unwrap().retry_after, None);
        assert!(Override::zero().stops(0, 0).unwrap().allowed);
        let ten = Override::quota(per_hour(10));
        assert_eq!(ten.stops(10, 0), None);
        assert_eq!(ten.stops(0, 0), None);
        assert!(!ten.stops(11, 0).unwrap().allowed);
    }

    #[test]
    fn an_override_must_read_the_rules_state_as_it_does() {
        let rule = per_hour(100);
        assert!(Override::zero().fits(&rule).is_ok());
        assert!(Override::quota(per_hour(5)).fits(&rule).is_ok());
        let bucket = TokenBucket::new(
            Quota::per_hour(NonZeroU32::new(100).unwrap()),
            NonZeroU32::new(10).unwrap(),
        );
        let e = Override::quota(bucket.into()).fits(&rule).unwrap_err();
        assert!(e.contains("fixed_window"), "{e}");
        let minute = FixedWindow::new(Quota::per_minute(NonZeroU32::new(5).unwrap()));
        let e = Override::quota(minute.into()).fits(&rule).unwrap_err();
        assert!(e.contains("window"), "{e}");
    }

    #[test]
    fn a_replaced_book_holds_the_new_entries_only() {
        let book = OverrideBook::new();
        book.set("a", Target::Key("x".into()), entry(Override::zero()));
        book.replace(vec![
            (
                "b".into(),
                Target::Prefix("p".into()),
                entry(Override::zero()),
            ),
            ("b".into(), Target::Key("k".into()), entry(Override::zero())),
        ]);
        assert_eq!(book.len(), 2);
        assert_eq!(book.find("a", "x", 0), None);
        assert!(book.find("b", "pq", 0).is_some());
    }
}

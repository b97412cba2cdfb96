//! Block and allow lists set at run time: requests of an address (or a
//! network), an API key, or one rule's key, blocked at once or let past a
//! rule, shared through the store and read on each request from a local
//! copy (no round trip).

use std::collections::BTreeMap;

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwap;

// Read on every request while any entry exists: a fast hash, not SipHash
// (the keys are an operator's, not a client's).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

use crate::clock::Micros;

/// What a list entry names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Listed {
    /// A client address, or a network: the address with the bits past
    /// `len` cleared (an IPv4-mapped IPv6 address is its IPv4 one).
    Ip {
        /// The network's first address.
        addr: IpAddr,
        /// How many leading bits name it (32 or 128 for one address).
        len: u8,
    },
    /// A request's API key, as the request carries it.
    ApiKey(Box<str>),
    /// One key of the rule the entry is for, as the rule builds it.
    Key(Box<str>),
}

impl Listed {
    /// The network of `addr` with `len` leading bits, its other bits
    /// cleared; `None` for a length past the address's.
    ///
    /// ```
    /// use spillway::store::Listed;
    /// let net = Listed::network("10.1.2.3".parse().unwrap(), 8).unwrap();
    /// assert_eq!(net, Listed::Ip { addr: "10.0.0.0".parse().unwrap(), len: 8 });
    /// assert!(Listed::network("10.1.2.3".parse().unwrap(), 33).is_none());
    /// ```
    pub fn network(addr: IpAddr, len: u8) -> Option<Self> {
        let addr = plain(addr);
        let bits = match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        (len <= bits).then(|| Self::Ip {
            addr: masked(addr, len),
            len,
        })
    }
}

/// An IPv4-mapped IPv6 address as its IPv4 address; any other as it is.
fn plain(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    }
}

fn masked(addr: IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let keep = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            IpAddr::V4((u32::from(a) & keep).into())
        }
        IpAddr::V6(a) => {
            let keep = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            IpAddr::V6((u128::from(a) & keep).into())
        }
    }
}

/// One entry: a block or an allow, of every rule or of one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    /// An allow (its requests skip the rule, or every rule) rather than a
    /// block (its requests are refused at once, counting nothing).
    pub allow: bool,
    /// The rule it is for; `None`: every rule. A [`Listed::Key`] is
    /// always one rule's.
    pub rule: Option<Arc<str>>,
    /// A block's status: 403 or 429.
    pub status: u16,
    /// Until when it holds (µs since the Unix epoch); `None`: until
    /// removed.
    pub until: Option<Micros>,
    /// The caller's own description, returned as given.
    pub spec: Arc<str>,
}

impl ListEntry {
    /// Whether it holds at `now`.
    pub fn in_force_at(&self, now: Micros) -> bool {
        self.until.is_none_or(|until| now < until)
    }
}

/// The entries of every rule, or of one.
#[derive(Debug, Default, Clone)]
struct RuleLists {
    ips: HashMap<(IpAddr, u8), ListEntry>,
    api_keys: HashMap<Box<str>, ListEntry>,
    keys: HashMap<Box<str>, ListEntry>,
    // The networks' lengths, each family's, with how many entries have
    // each: an address is looked up once per length some entry has.
    v4_lengths: BTreeMap<u8, usize>,
    v6_lengths: BTreeMap<u8, usize>,
}

impl RuleLists {
    fn len(&self) -> usize {
        self.ips.len() + self.api_keys.len() + self.keys.len()
    }

    fn insert(&mut self, listed: Listed, entry: ListEntry) -> Option<ListEntry> {
        match listed {
            Listed::Ip { addr, len } => {
                let old = self.ips.insert((addr, len), entry);
                if old.is_none() {
                    *self.lengths(addr).entry(len).or_default() += 1;
                }
                old
            }
            Listed::ApiKey(k) => self.api_keys.insert(k, entry),
            Listed::Key(k) => self.keys.insert(k, entry),
        }
    }

    fn remove(&mut self, listed: &Listed) -> Option<ListEntry> {
        match listed {
            Listed::Ip { addr, len } => {
                let old = self.ips.remove(&(*addr, *len))?;
                let lengths = self.lengths(*addr);
                if let Some(n) = lengths.get_mut(len) {
                    *n -= 1;
                    if *n == 0 {
                        lengths.remove(len);
                    }
                }
                Some(old)
            }
            Listed::ApiKey(k) => self.api_keys.remove(k),
            Listed::Key(k) => self.keys.remove(k),
        }
    }

    fn get(&self, listed: &Listed) -> Option<&ListEntry> {
        match listed {
            Listed::Ip { addr, len } => self.ips.get(&(*addr, *len)),
            Listed::ApiKey(k) => self.api_keys.get(k),
            Listed::Key(k) => self.keys.get(k),
        }
    }

    fn lengths(&mut self, addr: IpAddr) -> &mut BTreeMap<u8, usize> {
        if addr.is_ipv6() {
            &mut self.v6_lengths
        } else {
            &mut self.v4_lengths
        }
    }

    /// The entries of `ip` (each network it is in) and `api_key`.
    fn of_client<'a>(
        &'a self,
        ip: Option<IpAddr>,
        api_key: Option<&str>,
        mut found: impl FnMut(&'a ListEntry),
    ) {
        if let Some(ip) = ip {
            let lengths = if ip.is_ipv6() {
                &self.v6_lengths
            } else {
                &self.v4_lengths
            };
            for &len in lengths.keys().rev() {
                if let Some(e) = self.ips.get(&(masked(ip, len), len)) {
                    found(e);
                }
            }
        }
        if let Some(e) = api_key.and_then(|k| self.api_keys.get(k)) {
            found(e);
        }
    }

    fn entries(&self) -> impl Iterator<Item = (Listed, &ListEntry)> {
        let ips = self
            .ips
            .iter()
            .map(|(&(addr, len), e)| (Listed::Ip { addr, len }, e));
        let api_keys = self
            .api_keys
            .iter()
            .map(|(k, e)| (Listed::ApiKey(k.clone()), e));
        let keys = self.keys.iter().map(|(k, e)| (Listed::Key(k.clone()), e));
        ips.chain(api_keys).chain(keys)
    }
}

/// The lists, as one snapshot: every rule's entries, then each rule's.
#[derive(Debug, Default, Clone)]
struct Lists {
    every: RuleLists,
    rules: HashMap<Arc<str>, RuleLists>,
}

impl Lists {
    fn of(&mut self, rule: Option<&Arc<str>>) -> &mut RuleLists {
        match rule {
            None => &mut self.every,
            Some(r) => self.rules.entry(r.clone()).or_default(),
        }
    }

    fn len(&self) -> usize {
        self.every.len() + self.rules.values().map(RuleLists::len).sum::<usize>()
    }
}

/// What the lists say of a request, for one rule or for all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Listing {
    /// Nothing listed: decide it as usual.
    #[default]
    Unlisted,
    /// Let it past the rule (or every rule).
    Allowed,
    /// Refuse it at once with `status`, counting nothing, until `until`
    /// (`None`: until removed).
    Blocked {
        /// 403 or 429.
        status: u16,
        /// When the block ends.
        until: Option<Micros>,
    },
}

/// The block and allow lists set at run time.
///
/// Read on every request while any entry exists, written by an operator
/// now and then: reads take a snapshot without a lock; an empty book
/// answers from one atomic load. A block wins over an allow; an entry of
/// one rule, or of one rule's key, holds for that rule only.
///
/// ```
/// use spillway::store::{ListBook, ListEntry, Listed, Listing};
///
/// let book = ListBook::new();
/// let block = ListEntry { allow: false, rule: None, status: 403, until: None, spec: "{}".into() };
/// book.set(Listed::network("2001:db8::".parse().unwrap(), 32).unwrap(), block);
/// let inside = "2001:db8::7".parse().ok();
/// let outside = "2001:db9::7".parse().ok();
/// assert_eq!(book.verdict(None, inside, None, None, 0), Listing::Blocked { status: 403, until: None });
/// assert_eq!(book.verdict(None, outside, None, None, 0), Listing::Unlisted);
/// ```
#[derive(Debug, Default)]
pub struct ListBook {
    count: AtomicUsize,
    lists: ArcSwap<Lists>,
    writing: parking_lot::Mutex<()>,
}

impl ListBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether it holds no entry (one atomic load).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// How many entries it holds (those past their time included).
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// The lists as they stand, to look a request up in several times
    /// (every rule's entries, then each rule's) for one load; `None` while
    /// they hold no entry.
    #[inline]
    pub fn snapshot(&self) -> Option<ListSnapshot> {
        if self.is_empty() {
            return None;
        }
        Some(ListSnapshot(self.lists.load()))
    }

    /// What the lists say of a request from `ip` with `api_key` for
    /// `rule` (`None`: the entries of every rule only), whose key under
    /// that rule is `key`, at `now`: a block of any of them wins over an
    /// allow.
    pub fn verdict(
        &self,
        rule: Option<&str>,
        ip: Option<IpAddr>,
        api_key: Option<&str>,
        key: Option<&str>,
        now: Micros,
    ) -> Listing {
        if self.is_empty() {
            return Listing::Unlisted;
        }
        let lists = self.lists.load();
        let ip = ip.map(plain);
        let mut verdict = Verdict::default();
        lists
            .every
            .of_client(ip, api_key, |e| verdict.consider(e, now));
        if let Some(of_rule) = rule.and_then(|r| lists.rules.get(r)) {
            of_rule.of_client(ip, api_key, |e| verdict.consider(e, now));
            if let Some(e) = key.and_then(|k| of_rule.keys.get(k)) {
                verdict.consider(e, now);
            }
        }
        verdict.0
    }

    /// The entry of `listed` for `rule`, in force or not.
    pub fn get(&self, listed: &Listed, rule: Option<&str>) -> Option<ListEntry> {
        let lists = self.lists.load();
        let of_rule = match rule {
            None => &lists.every,
            Some(r) => lists.rules.get(r)?,
        };
        of_rule.get(listed).cloned()
    }

    /// Sets the entry of `listed` (for its rule), replacing any; returns
    /// the one it replaced.
    pub fn set(&self, listed: Listed, entry: ListEntry) -> Option<ListEntry> {
        self.write(|lists| {
            let rule = entry.rule.clone();
            lists.of(rule.as_ref()).insert(listed, entry)
        })
    }

    /// Removes the entry of `listed` for `rule`; returns it.
    pub fn remove(&self, listed: &Listed, rule: Option<&str>) -> Option<ListEntry> {
        self.write(|lists| {
            let of_rule = match rule {
                None => &mut lists.every,
                Some(r) => lists.rules.get_mut(r)?,
            };
            let old = of_rule.remove(listed);
            if let Some(r) = rule
                && lists.rules.get(r).is_some_and(|l| l.len() == 0)
            {
                lists.rules.remove(r);
            }
            old
        })
    }

    /// Every entry in force at `now`, in order of what it names, then rule.
    pub fn list(&self, now: Micros) -> Vec<(Listed, ListEntry)> {
        let lists = self.lists.load();
        let mut all: Vec<(Listed, ListEntry)> = std::iter::once(&lists.every)
            .chain(lists.rules.values())
            .flat_map(RuleLists::entries)
            .filter(|(_, e)| e.in_force_at(now))
            .map(|(l, e)| (l, e.clone()))
            .collect();
        all.sort_by(|a, b| (&a.0, &a.1.rule).cmp(&(&b.0, &b.1.rule)));
        all
    }

    /// Drops every entry whose time has passed at `now`.
    pub fn purge(&self, now: Micros) {
        if self.list(0).len() == self.list(now).len() {
            return;
        }
        let kept = self.list(now);
        self.replace(kept);
    }

    /// Replaces every entry with `entries` (a refresh from a shared copy).
    pub fn replace(&self, entries: impl IntoIterator<Item = (Listed, ListEntry)>) {
        let mut fresh = Lists::default();
        for (listed, entry) in entries {
            let rule = entry.rule.clone();
            fresh.of(rule.as_ref()).insert(listed, entry);
        }
        self.write(|lists| *lists = fresh);
    }

    fn write<T>(&self, change: impl FnOnce(&mut Lists) -> T) -> T {
        let _one = self.writing.lock();
        let mut lists = Lists::clone(&self.lists.load());
        let out = change(&mut lists);
        let n = lists.len();
        self.lists.store(Arc::new(lists));
        self.count.store(n, Ordering::Release);
        out
    }
}

/// The lists at one moment ([`ListBook::snapshot`]).
#[derive(Debug)]
pub struct ListSnapshot(arc_swap::Guard<Arc<Lists>>);

impl ListSnapshot {
    /// What the entries of every rule say of a request from `ip` with
    /// `api_key`; `now` is read only when an entry names the request (a
    /// request no entry names reads no clock).
    pub fn every_rule(
        &self,
        ip: Option<IpAddr>,
        api_key: Option<&str>,
        now: &dyn Fn() -> Micros,
    ) -> Listing {
        let mut verdict = Verdict::default();
        self.0
            .every
            .of_client(ip.map(plain), api_key, |e| verdict.consider(e, now()));
        verdict.0
    }

    /// What the entries of `rule` alone say of a request from `ip` with
    /// `api_key`, whose key under that rule is `key` (if it has one; `now` as for
    /// [`every_rule`](Self::every_rule)).
    pub fn of_rule(
        &self,
        rule: &str,
        ip: Option<IpAddr>,
        api_key: Option<&str>,
        key: Option<&str>,
        now: &dyn Fn() -> Micros,
    ) -> Listing {
        let Some(of_rule) = self.0.rules.get(rule) else {
            return Listing::Unlisted;
        };
        let mut verdict = Verdict::default();
        of_rule.of_client(ip.map(plain), api_key, |e| verdict.consider(e, now()));
        if let Some(e) = key.and_then(|k| of_rule.keys.get(k)) {
            verdict.consider(e, now());
        }
        verdict.0
    }

    /// Whether some rule has entries of its own.
    pub fn has_rules(&self) -> bool {
        !self.0.rules.is_empty()
    }

    /// Whether any entry names an API key.
    pub fn has_api_keys(&self) -> bool {
        !self.0.every.api_keys.is_empty() || self.0.rules.values().any(|r| !r.api_keys.is_empty())
    }
}

/// A verdict being made: a block wins over an allow.
#[derive(Debug, Default)]
struct Verdict(Listing);

impl Verdict {
    fn consider(&mut self, e: &ListEntry, now: Micros) {
        if !e.in_force_at(now) {
            return;
        }
        if !e.allow {
            if !matches!(self.0, Listing::Blocked { .. }) {
                self.0 = Listing::Blocked {
                    status: e.status,
                    until: e.until,
                };
            }
        } else if self.0 == Listing::Unlisted {
            self.0 = Listing::Allowed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(allow: bool, rule: Option<&str>) -> ListEntry {
        ListEntry {
            allow,
            rule: rule.map(Arc::from),
            status: 429,
            until: None,
            spec: "{}".into(),
        }
    }

    fn net(s: &str, len: u8) -> Listed {
        Listed::network(s.parse().unwrap(), len).unwrap()
    }

    fn ip(s: &str) -> Option<IpAddr> {
        s.parse().ok()
    }

    const BLOCKED: Listing = Listing::Blocked {
        status: 429,
        until: None,
    };

    #[test]
    fn an_address_inside_a_blocked_network_is_blocked_and_one_outside_is_not() {
        let book = ListBook::new();
        book.set(net("192.0.2.0", 24), entry(false, None));
        book.set(net("2001:db8::", 32), entry(false, None));
        for (addr, blocked) in [
            ("192.0.2.0", true),
            ("192.0.2.255", true),
            ("192.0.3.0", false),
            ("192.0.1.255", false),
            ("::ffff:192.0.2.9", true),
            ("2001:db8:ffff::1", true),
            ("2001:db9::1", false),
        ] {
            let v = book.verdict(None, ip(addr), None, None, 0);
            assert_eq!(v == BLOCKED, blocked, "{addr}: {v:?}");
        }
    }

    #[test]
    fn a_block_wins_and_a_rules_entry_holds_for_that_rule_only() {
        let book = ListBook::new();
        book.set(net("10.0.0.0", 8), entry(true, None));
        book.set(net("10.1.0.0", 16), entry(false, Some("login")));
        book.set(Listed::ApiKey("k".into()), entry(true, Some("api")));
        book.set(Listed::Key("ip=10.2.0.1".into()), entry(false, Some("api")));
        let v = |rule, addr, key| book.verdict(rule, ip(addr), Some("k"), key, 0);
        assert_eq!(v(None, "10.1.2.3", None), Listing::Allowed);
        assert_eq!(v(Some("login"), "10.1.2.3", None), BLOCKED);
        assert_eq!(v(Some("other"), "10.1.2.3", None), Listing::Allowed);
        assert_eq!(v(Some("api"), "11.0.0.1", None), Listing::Allowed);
        assert_eq!(v(Some("api"), "10.2.0.1", Some("ip=10.2.0.1")), BLOCKED);
        assert_eq!(v(Some("api"), "11.0.0.1", Some("ip=10.2.0.1")), BLOCKED);
        assert_eq!(
            book.verdict(Some("x"), ip("11.0.0.1"), None, None, 0),
            Listing::Unlisted
        );
    }

    #[test]
    fn an_entry_past_its_time_holds_no_more_and_removal_forgets_its_length() {
        let book = ListBook::new();
        let mut e = entry(false, None);
        e.until = Some(10);
        book.set(net("192.0.2.1", 32), e);
        assert_ne!(
            book.verdict(None, ip("192.0.2.1"), None, None, 9),
            Listing::Unlisted
        );
        assert_eq!(
            book.verdict(None, ip("192.0.2.1"), None, None, 10),
            Listing::Unlisted
        );
        assert!(book.list(10).is_empty());
        assert!(book.remove(&net("192.0.2.1", 32), None).is_some());
        assert!(book.is_empty());
        assert!(book.lists.load().every.v4_lengths.is_empty());
        assert_eq!(
            Listed::network("10.0.0.1".parse().unwrap(), 0),
            Some(net("0.0.0.0", 0))
        );
    }
}

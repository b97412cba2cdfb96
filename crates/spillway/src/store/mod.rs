//! Where the state lives: the [`Store`] trait and the in-memory store.
//!
//! A store holds a fixed list of [`Rule`]s and answers one question: *apply
//! these rules to these keys, atomically*. A request that matches several
//! rules is decided in one call: if any rule denies it, no rule is charged
//! for it. The in-memory store ([`MemoryStore`], and [`RateLimiter`] for one
//! rule with any key type) implements it here; the Redis store lives in the
//! `spillway-redis` crate and passes the same conformance suite.
//!
//! The in-memory store holds at most [`MemoryOptions::max_keys`] keys per
//! rule, whatever the traffic: a flood of distinct keys cannot exhaust the
//! process. Idle keys (whose state is back to fresh) are forgotten, which
//! changes no decision. When a table is full, a new key needs room: of keys
//! sampled at random across the table, the one closest to fresh (the most
//! remaining, then the soonest idle) is the one to forget. What each
//! [`OnFull`] policy guarantees:
//! - [`OnFull::Evict`] (the default): a new key always gets in. The key
//!   forgotten is never heavier than the lightest of its sample, so a flood
//!   of light keys mostly evicts its own kind; but a key forgotten while used
//!   starts over with a full quota.
//! - [`OnFull::DenyNew`]: a key is forgotten only if it is idle or has more
//!   remaining than the new key has after its request; otherwise the new key
//!   is denied (a denial with a `retry_after`, not an error). No used key is
//!   ever handed a fresh quota, and new keys are turned away while the table
//!   is full of used ones.
//!
//! [`MemoryOptions::max_memory`] bounds the whole store in bytes as well:
//! the tables, the text of keys too long to be held inline, and the
//! sliding logs' buffers (see its docs for exactly what counts).
//!
//! Checks of one key from many threads do not queue on a lock: a key the
//! table holds is decided in place ([`SharedState`]), with plain loads and
//! stores when its shard's lock is free to take exclusively, else by
//! compare-and-swap of the one word of its state an ordinary check
//! changes, under the shard's shared lock. The decisions are exactly those of one thread at a
//! time; what changes more than that word (a window rolling over, a key
//! forgotten, a sliding log) takes the shard's lock exclusively.

mod cell;
mod holds;
mod lists;
mod memory;
mod overrides;
mod receipts;
mod table;
mod tiers;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use cell::{AnyCell, SharedState, Words};
pub use holds::MAX_OPEN_HOLDS;
pub use lists::{ListBook, ListEntry, ListSnapshot, Listed, Listing};
pub use memory::{
    MemoryOptions, MemoryStore, OnFull, RateLimiter, Restored, STATE_FORMAT, Saved, StateFileError,
    read_state_file, state_file_rules,
};
pub use overrides::{Override, OverrideBook, OverrideEntry, Target};
pub use tiers::{TierBook, TierEntry};

use crate::algorithm::{AnyAlgorithm, Charged, Renewed};
use crate::clock::Micros;
use crate::decision::Decision;

/// A borrowed form of a key from which the store makes its owned copy when
/// the key is first seen: `&str` for `String` or `Box<str>` keys, `&T` for
/// any `Clone` key such as `u64`.
pub trait KeyRef<K> {
    /// The owned key.
    fn to_key(&self) -> K;
}

impl<T: Clone> KeyRef<T> for T {
    fn to_key(&self) -> T {
        self.clone()
    }
}

impl KeyRef<String> for str {
    fn to_key(&self) -> String {
        self.to_owned()
    }
}

impl KeyRef<Box<str>> for str {
    fn to_key(&self) -> Box<str> {
        self.into()
    }
}

/// Keys of up to 24 bytes are kept inline, in the table's own entry: no
/// allocation when a key arrives or goes, and no second memory access to
/// compare it. What the memory store keeps its keys in.
impl KeyRef<compact_str::CompactString> for str {
    fn to_key(&self) -> compact_str::CompactString {
        compact_str::CompactString::new(self)
    }
}

impl KeyRef<Vec<u8>> for [u8] {
    fn to_key(&self) -> Vec<u8> {
        self.to_vec()
    }
}

/// A named limit: what to count with.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    name: Arc<str>,
    algorithm: AnyAlgorithm,
    release_after: Option<Duration>,
}

impl Rule {
    /// A rule called `name` enforcing `algorithm`.
    pub fn new(name: impl Into<Arc<str>>, algorithm: impl Into<AnyAlgorithm>) -> Self {
        Self {
            name: name.into(),
            algorithm: algorithm.into(),
            release_after: None,
        }
    }

    /// The same rule, whose reservations ([`Store::reserve`]) the store
    /// gives back by itself when no settle has named them within `within`
    /// of their charge: each is settled at 0 as of its charge's time, by
    /// whichever call meets its key first once that time has passed (on
    /// Redis, any instance's). A settle that comes later finds it given
    /// back and charges the whole actual cost, so what a request costs in
    /// the end is the same either way. Without it (the default), a
    /// reservation never settled stays charged. Not for a concurrency
    /// rule, whose leases end by themselves. `within` is from the charge:
    /// make it longer than any response takes (at 0, a reservation is
    /// given back by the next call that meets its key).
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use spillway::algorithm::{Charged, FixedWindow};
    /// use spillway::clock::FakeClock;
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId};
    /// use spillway::Quota;
    ///
    /// let quota = Quota::per_hour(NonZeroU32::new(100).unwrap());
    /// let rule = Rule::new("tokens", FixedWindow::new(quota)).release_unsettled_after(Duration::from_secs(60));
    /// let clock = FakeClock::new(0);
    /// let store = MemoryStore::with_clock(vec![rule], MemoryOptions::default(), clock.clone());
    /// let check = [Check { rule: RuleId(0), key: "ann", cost: 40 }];
    /// store.reserve_now("req-1", &check).unwrap();
    /// // Its instance died: nobody settles it. A minute on, it is given back.
    /// clock.advance(Duration::from_secs(60));
    /// let peek = store.check_now(&[Check { cost: 0, ..check[0] }]).unwrap();
    /// assert_eq!(peek.decisions[0].remaining, 100);
    /// ```
    pub fn release_unsettled_after(self, within: Duration) -> Self {
        Self {
            release_after: Some(within),
            ..self
        }
    }

    /// How long a reservation of this rule may go unsettled before the
    /// store gives it back ([`release_unsettled_after`](Self::release_unsettled_after)).
    pub fn release_after(&self) -> Option<Duration> {
        self.release_after
    }

    /// The rule's name (it also namespaces its keys).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The algorithm and its quota.
    pub fn algorithm(&self) -> &AnyAlgorithm {
        &self.algorithm
    }

    /// The rule's name, shared.
    pub(crate) fn name_arc(&self) -> Arc<str> {
        self.name.clone()
    }
}

/// A rule's position in the list a store was built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleId(pub usize);

/// One (rule, key, cost) of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check<'a> {
    /// Which rule.
    pub rule: RuleId,
    /// The key it counts by (an API key, an IP, a combination...).
    pub key: &'a str,
    /// How much the request costs under this rule; 0 only peeks.
    pub cost: u64,
}

/// A verdict's decisions, one per check: held inline for a request of one
/// check (the commonest), so that deciding it allocates nothing.
pub type Decisions = smallvec::SmallVec<[Decision; 1]>;

/// The answer for a whole request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Every rule admitted the request, and each has been charged.
    pub allowed: bool,
    /// One decision per check, in the order given. When the request is
    /// denied, the rules that would have admitted it were not charged: their
    /// decision is `allowed` and reports their state as it stands.
    pub decisions: Decisions,
    /// The store's time of the decision (µs): what a later
    /// [`Store::refund`] of these charges must say.
    pub decided_at: Micros,
    /// The checks the store could not decide, by index into `decisions`,
    /// in order: a store that can fail (Redis) admitted them by their
    /// rule's failure policy, and their decision is a stand-in (allowed,
    /// nothing known of their state) that reports no quota. Empty when the
    /// store decided every check, as the in-memory store always does.
    pub undecided: Vec<usize>,
}

impl Verdict {
    /// Whether the store decided check `i` (see [`Verdict::undecided`]).
    pub fn is_decided(&self, i: usize) -> bool {
        !self.undecided.contains(&i)
    }

    /// The index of the decision to report in headers: the first denial if
    /// the request was denied, else the decided rule with the least
    /// remaining; `None` when no check was decided.
    pub fn most_restrictive(&self) -> Option<usize> {
        if self.allowed {
            (0..self.decisions.len())
                .filter(|&i| self.is_decided(i))
                .min_by_key(|&i| self.decisions[i].remaining)
        } else {
            self.decisions.iter().position(|d| !d.allowed)
        }
    }
}

/// One rule's part in settling an admitted request: the charge it made and
/// what the request turned out to cost (see [`Store::settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settle<'a> {
    /// Which rule.
    pub rule: RuleId,
    /// The key it counted by.
    pub key: &'a str,
    /// The charge as admitted: its cost, the verdict's
    /// [`decided_at`](Verdict::decided_at), and the decision's `reset_after`
    /// ([`Charged::of`]).
    pub charged: Charged,
    /// What the request actually cost.
    pub actual: u64,
}

impl<'a> Settle<'a> {
    /// The charge as a check of its cost: what a store validates (the
    /// rule, the cost within its capacity) before it settles.
    pub fn check(&self) -> Check<'a> {
        Check {
            rule: self.rule,
            key: self.key,
            cost: self.charged.cost,
        }
    }
}

/// What a [`Store::settle`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// Whether this call moved any state: `false` when every part of it had
    /// been settled before under the same id.
    pub applied: bool,
    /// Each key's state as it now stands (what a cost-0 check reports),
    /// one per settle, in order.
    pub decisions: Vec<Decision>,
}

/// A lease to renew: a concurrency rule's charge, as admitted or as last
/// renewed (see [`Store::renew`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renew<'a> {
    /// Which rule (a concurrency rule).
    pub rule: RuleId,
    /// The key it counted by.
    pub key: &'a str,
    /// The lease, named by the charge that took it ([`Charged::of`] the
    /// verdict's [`decided_at`](Verdict::decided_at) and decision), however
    /// often it was renewed since.
    pub charged: Charged,
}

impl<'a> Renew<'a> {
    /// The lease as a check of its slots: what a store validates before it
    /// renews.
    pub fn check(&self) -> Check<'a> {
        Check {
            rule: self.rule,
            key: self.key,
            cost: self.charged.cost,
        }
    }
}

/// Which charges of a reservation ([`Store::reserve_held`]) the store
/// holds open, and for how long at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold<'a> {
    /// Per check, in order: whether its charge is held (`None`: every
    /// check's whose rule releases what is not settled in time).
    pub only: Option<&'a [bool]>,
    /// The longest a held charge stays open: the shorter of this and its
    /// rule's time.
    pub within: Duration,
}

impl Hold<'_> {
    /// Every charge of a rule that releases, for its rule's time.
    pub const ALL: Hold<'static> = Hold {
        only: None,
        within: Duration::MAX,
    };

    /// Whether check `i`'s charge is held (if its rule releases).
    pub fn holds(&self, i: usize) -> bool {
        self.only
            .is_none_or(|only| only.get(i).copied().unwrap_or(false))
    }
}

/// The longest settle id, in bytes.
pub const MAX_SETTLE_ID: usize = 128;

/// Fails a settle id (or a reservation's, which is its settle's) that is
/// empty or longer than [`MAX_SETTLE_ID`]: what every store checks first.
pub fn check_settle_id(id: &str) -> Result<(), crate::Error> {
    if id.is_empty() || id.len() > MAX_SETTLE_ID {
        return Err(crate::Error::SettleId { len: id.len() });
    }
    Ok(())
}

/// The most reservations one key holds open ([`Store::reserve`]) under a
/// rule that releases them: one more is denied until one is settled or
/// given back.
pub const MAX_HOLDS_PER_KEY: usize = 1_000;

/// How long a store remembers a settle id: the same settle sent again
/// within this time changes nothing. Long enough for every retry a store or
/// a client makes; not for ever, or the receipts would fill the store.
pub const SETTLE_RECEIPT_TTL: Duration = Duration::from_secs(600);

/// A backend that applies rules to keys, atomically per request.
pub trait Store: Send + Sync {
    /// What can go wrong besides a denial (a bad request, an unreachable
    /// server).
    type Error: StoreError;

    /// The rules, indexed by [`RuleId`].
    fn rules(&self) -> &[Rule];

    /// The API keys put in a tier at run time, if the store keeps any
    /// (the in-memory store and the Redis store do): a front end reads a
    /// request's tier there ahead of its configuration's table.
    fn tiers(&self) -> Option<&TierBook> {
        None
    }

    /// The block and allow lists set at run time, if the store keeps any
    /// (the in-memory store and the Redis store do): a front end reads
    /// each request's entries there.
    fn lists(&self) -> Option<&ListBook> {
        None
    }

    /// Decides on one request: all its checks at once. If any check denies,
    /// none is charged. A check whose cost exceeds its rule's capacity fails
    /// the whole request with an error, charging nothing.
    fn check(
        &self,
        checks: &[Check<'_>],
    ) -> impl Future<Output = Result<Verdict, Self::Error>> + Send;

    /// Gives back the charges of an admitted request that will not be served
    /// after all (a shaped request whose client left while it waited).
    /// `charged_at` is the verdict's [`decided_at`](Verdict::decided_at).
    fn refund(
        &self,
        checks: &[Check<'_>],
        charged_at: Micros,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Settles an admitted request's charges at their actual costs (a
    /// reservation made when the request was admitted, settled when its
    /// response has ended): each rule gives back the difference or charges
    /// the rest, past its quota as debt, as of the charge's time
    /// ([`Algorithm::settle`](crate::Algorithm::settle)). Each key's part
    /// is atomic. `id` names the settle: the same id sent again within
    /// [`SETTLE_RECEIPT_TTL`] changes nothing (a retry after a lost answer
    /// cannot settle twice), so it must be unique to the request. An id
    /// longer than [`MAX_SETTLE_ID`], an unknown rule or a charge above its
    /// rule's capacity fails the whole settle, changing nothing.
    ///
    /// A part whose charge is [held](crate::algorithm::Charged::held) (a
    /// reservation of [`reserve`](Store::reserve) under `id`) closes it. If
    /// the store gave it back already, because no settle came within its
    /// rule's time, the part charges its whole actual cost as of the
    /// charge, so the request costs what it cost either way.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::{Charged, FixedWindow};
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId, Settle, Store};
    /// use spillway::Quota;
    ///
    /// let quota = Quota::per_minute(NonZeroU32::new(100).unwrap());
    /// let store = MemoryStore::new(vec![Rule::new("tokens", FixedWindow::new(quota))], MemoryOptions::default());
    /// // 50 reserved when the request is admitted...
    /// let verdict = store.check_now(&[Check { rule: RuleId(0), key: "ann", cost: 50 }]).unwrap();
    /// let charged = Charged::of(50, verdict.decided_at, &verdict.decisions[0]);
    /// // ...and the response cost 20: 30 come back, once.
    /// let settle = [Settle { rule: RuleId(0), key: "ann", charged, actual: 20 }];
    /// let settled = store.settle_now("req-1", &settle).unwrap();
    /// assert!(settled.applied);
    /// assert_eq!(settled.decisions[0].remaining, 80);
    /// let again = store.settle_now("req-1", &settle).unwrap();
    /// assert!(!again.applied);
    /// assert_eq!(again.decisions[0].remaining, 80);
    /// ```
    fn settle(
        &self,
        id: &str,
        settles: &[Settle<'_>],
    ) -> impl Future<Output = Result<Settled, Self::Error>> + Send;

    /// [`check`](Store::check), where each charge of a rule that
    /// [releases](Rule::release_unsettled_after) what is not settled in
    /// time is a reservation held open under `id`: the id of the settle
    /// that will close it (see [`settle`](Store::settle), and
    /// [`Charged::held`](crate::algorithm::Charged::held)). If no settle
    /// of `id` names it within the rule's time, the store gives it back by
    /// itself. The charges of other rules are made as `check` makes them.
    /// A key holds at most [`MAX_HOLDS_PER_KEY`] reservations open: one
    /// more is denied (a denial, with `retry_after` until the first of
    /// them is given back) until one is settled.
    fn reserve(
        &self,
        id: &str,
        checks: &[Check<'_>],
    ) -> impl Future<Output = Result<Verdict, Self::Error>> + Send {
        self.reserve_held(id, checks, Hold::ALL)
    }

    /// [`reserve`](Store::reserve), holding open only the charges `hold`
    /// names, each for at most `hold.within` (the shorter of it and its
    /// rule's time): for a caller that settles only some of a request's
    /// charges (a budget's, not another rule's that the request also
    /// met), or that says how long it will take (Kuadrant's `Reserve` and
    /// its `ttl`). The other charges are made as `check` makes them; a
    /// rule that does not release what is not settled holds nothing,
    /// whatever `hold` says.
    fn reserve_held(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
    ) -> impl Future<Output = Result<Verdict, Self::Error>> + Send;

    /// Renews leases of concurrency rules (a request still in flight): each
    /// lease still held runs again from now, for its rule's lease time,
    /// whatever else is in flight; one that has ended is taken afresh, under
    /// the same name, when its slots fit
    /// ([`Concurrency::renew`](crate::algorithm::Concurrency::renew)). A
    /// lease keeps its name: the charge that took it names it in every renew
    /// and in its release, and a renew sent again (after a lost answer) does
    /// what one does. One answer per renew, in order; each is atomic on its
    /// own. A rule
    /// that is not a concurrency rule, or a lease above its capacity, fails
    /// the whole call, changing nothing. Releasing a lease is a
    /// [`settle`](Store::settle) at cost 0.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use spillway::algorithm::{Charged, Concurrency};
    /// use spillway::clock::FakeClock;
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Renew, Rule, RuleId, Settle};
    /// use spillway::Quota;
    ///
    /// let one = Quota::new(NonZeroU32::new(1).unwrap(), Duration::from_secs(30)).unwrap();
    /// let clock = FakeClock::new(0);
    /// let store = MemoryStore::with_clock(vec![Rule::new("reports", Concurrency::new(one))], MemoryOptions::default(), clock.clone());
    /// let check = [Check { rule: RuleId(0), key: "ann", cost: 1 }];
    /// let taken = store.check_now(&check).unwrap();
    /// let charged = Charged::of(1, taken.decided_at, &taken.decisions[0]);
    /// // 25 s on, still running: renewed, so held until 55 s.
    /// clock.advance(std::time::Duration::from_secs(25));
    /// let renewed = store.renew_now(&[Renew { rule: RuleId(0), key: "ann", charged }]).unwrap();
    /// assert!(renewed[0].was_held);
    /// clock.advance(std::time::Duration::from_secs(10));
    /// assert!(!store.check_now(&check).unwrap().allowed);
    /// // Served: released, once.
    /// store.settle_now("req-1", &[Settle { rule: RuleId(0), key: "ann", charged, actual: 0 }]).unwrap();
    /// assert!(store.check_now(&check).unwrap().allowed);
    /// ```
    fn renew(
        &self,
        renews: &[Renew<'_>],
    ) -> impl Future<Output = Result<Vec<Renewed>, Self::Error>> + Send;

    /// [`check`](Store::check) without waiting, for a store that never has
    /// to (the in-memory one): callers on a hot path can then skip building
    /// a future. A store that can answer this way returns `Some` on every
    /// call; one that has to wait (a network store) returns `None` on every
    /// call, having charged nothing. The default is `None`.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::FixedWindow;
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId, Store};
    /// use spillway::Quota;
    ///
    /// let quota = Quota::per_minute(NonZeroU32::new(1).unwrap());
    /// let store = MemoryStore::new(vec![Rule::new("login", FixedWindow::new(quota))], MemoryOptions::default());
    /// let check = [Check { rule: RuleId(0), key: "ann", cost: 1 }];
    /// let first = store.try_check_now(&check).expect("memory answers at once").unwrap();
    /// assert!(first.allowed);
    /// assert!(!store.try_check_now(&check).unwrap().unwrap().allowed);
    /// ```
    fn try_check_now(&self, checks: &[Check<'_>]) -> Option<Result<Verdict, Self::Error>> {
        let _ = checks;
        None
    }

    /// [`reserve`](Store::reserve) without waiting, as
    /// [`try_check_now`](Store::try_check_now) is `check` without waiting.
    fn try_reserve_now(
        &self,
        id: &str,
        checks: &[Check<'_>],
        hold: Hold<'_>,
    ) -> Option<Result<Verdict, Self::Error>> {
        let _ = (id, checks, hold);
        None
    }

    /// [`settle`](Store::settle) without waiting and without a receipt,
    /// for a caller in this process that makes the settle once (it cannot
    /// be sent again after a lost answer: there is no answer to lose):
    /// `Some` on every call from a store that never waits, `None` (having
    /// settled nothing) from one that must. The default is `None`.
    fn try_settle_once_now(&self, settles: &[Settle<'_>]) -> Option<Result<Settled, Self::Error>> {
        let _ = settles;
        None
    }
}

/// What a store's error means for the request that met it.
pub trait StoreError: std::error::Error + Send + Sync + 'static {
    /// The request itself is invalid (a cost above the capacity, an unknown
    /// rule): it would fail on any store, so it is the client's error. `None`
    /// means the store could not decide (unreachable, timed out).
    fn invalid_request(&self) -> Option<&crate::Error>;
}

impl StoreError for crate::Error {
    fn invalid_request(&self) -> Option<&crate::Error> {
        Some(self)
    }
}

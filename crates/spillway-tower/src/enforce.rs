//! One request's checks against a store, with the rules' actions applied:
//! the loop the middleware and the Envoy rate limit service share.

use smallvec::SmallVec;
use spillway::Decision;
use spillway::store::{Check, Store, Verdict};

use crate::rules::Action;

type Small<T> = SmallVec<[T; 2]>;

/// How a request's checks came out (see [`enforce`]).
#[derive(Debug, Clone)]
pub struct Enforced {
    decisions: Small<Option<Decision>>,
    rejected_by: Option<usize>,
    denied_softly: Small<usize>,
    charged: Option<(Small<usize>, u64)>,
}

impl Enforced {
    /// Check `i`'s decision: the last the store gave for it.
    pub fn decision(&self, i: usize) -> Option<Decision> {
        self.decisions.get(i).copied().flatten()
    }

    /// Every check's decision, in order.
    pub fn decisions(&self) -> &[Option<Decision>] {
        &self.decisions
    }

    /// The first check whose `reject` rule denied: the request is refused
    /// and nothing was charged.
    pub fn rejected_by(&self) -> Option<usize> {
        self.rejected_by
    }

    /// The checks whose `shadow` or `degrade` rules denied: the request
    /// goes through, and they were not charged.
    pub fn denied_softly(&self) -> &[usize] {
        &self.denied_softly
    }

    /// When the request goes through: the checks that were charged, and the
    /// store's time of the charge (what a refund must say).
    pub fn charged(&self) -> Option<(&[usize], u64)> {
        self.charged.as_ref().map(|(c, at)| (c.as_slice(), *at))
    }
}

/// The loop of [`enforce`], one store answer at a time, so that the same
/// steps serve a store that must be waited for and one that answers at once.
struct Enforcing<'a, 'k> {
    checks: &'a [Check<'k>],
    actions: &'a [Action],
    out: Enforced,
    // The checks still to be asked, by index; empty once decided.
    active: Small<usize>,
}

impl<'a, 'k> Enforcing<'a, 'k> {
    fn new(checks: &'a [Check<'k>], actions: &'a [Action]) -> Self {
        Self {
            checks,
            actions,
            out: Enforced {
                decisions: smallvec::smallvec![None; checks.len()],
                rejected_by: None,
                denied_softly: SmallVec::new(),
                charged: None,
            },
            active: (0..checks.len()).collect(),
        }
    }

    /// The checks to ask the store next; `None` once decided.
    fn ask(&self) -> Option<Small<Check<'k>>> {
        (!self.active.is_empty()).then(|| self.active.iter().map(|&i| self.checks[i]).collect())
    }

    /// Takes the store's verdict on what [`ask`](Self::ask) gave.
    fn answer(&mut self, verdict: &Verdict) {
        for (&i, d) in self.active.iter().zip(&verdict.decisions) {
            self.out.decisions[i] = Some(*d);
        }
        if verdict.allowed {
            let charged = std::mem::take(&mut self.active);
            self.out.charged = Some((charged, verdict.decided_at));
            return;
        }
        let denying: Small<usize> = self
            .active
            .iter()
            .zip(&verdict.decisions)
            .filter(|(_, d)| !d.allowed)
            .map(|(&i, _)| i)
            .collect();
        if let Some(&i) = denying.iter().find(|&&i| self.actions[i] == Action::Reject) {
            self.out.rejected_by = Some(i);
            self.active.clear();
            return;
        }
        self.out.denied_softly.extend_from_slice(&denying);
        // The verdict's decisions are the active checks', in order: one
        // pass, not a search of the denying for each check (which made a
        // request of n checks cost n² here).
        let mut decided = verdict.decisions.iter();
        self.active
            .retain(|_| decided.next().is_some_and(|d| d.allowed));
    }
}

/// Decides on one request: `checks[i]` under a rule whose action is
/// `actions[i]`. All checks go to the store in one call. A denial by a
/// `reject` rule ends it, charging nothing. A denial only by `shadow` or
/// `degrade` rules lets the request through, so the rules that admitted it
/// must be charged: they are asked again without the denying ones (one more
/// round trip, only when a non-rejecting rule is over its limit).
pub async fn enforce<St: Store>(
    store: &St,
    checks: &[Check<'_>],
    actions: &[Action],
) -> Result<Enforced, St::Error> {
    let mut enforcing = Enforcing::new(checks, actions);
    while let Some(asked) = enforcing.ask() {
        let verdict = store.check(&asked).await?;
        enforcing.answer(&verdict);
    }
    Ok(enforcing.out)
}

/// [`enforce`] on a store that answers without waiting
/// ([`Store::try_check_now`]); `None`, having charged nothing, on a store
/// that has to be waited for.
pub fn enforce_now<St: Store>(
    store: &St,
    checks: &[Check<'_>],
    actions: &[Action],
) -> Option<Result<Enforced, St::Error>> {
    let mut enforcing = Enforcing::new(checks, actions);
    while let Some(asked) = enforcing.ask() {
        match store.try_check_now(&asked)? {
            Ok(verdict) => enforcing.answer(&verdict),
            Err(e) => return Some(Err(e)),
        }
    }
    Some(Ok(enforcing.out))
}

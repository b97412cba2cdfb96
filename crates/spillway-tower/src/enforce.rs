//! One request's checks against a store, with the rules' actions applied:
//! the loop the middleware and the Envoy rate limit service share.

use smallvec::SmallVec;
use spillway::Decision;
use spillway::store::{Check, Store};

use crate::rules::Action;

type Small<T> = SmallVec<[T; 4]>;

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
    let mut out = Enforced {
        decisions: smallvec::smallvec![None; checks.len()],
        rejected_by: None,
        denied_softly: SmallVec::new(),
        charged: None,
    };
    let mut active: Small<usize> = (0..checks.len()).collect();
    while !active.is_empty() {
        let asked: Small<Check<'_>> = active.iter().map(|&i| checks[i]).collect();
        let verdict = store.check(&asked).await?;
        for (&i, d) in active.iter().zip(&verdict.decisions) {
            out.decisions[i] = Some(*d);
        }
        if verdict.allowed {
            out.charged = Some((active, verdict.decided_at));
            break;
        }
        let denying: Small<usize> = active
            .iter()
            .zip(&verdict.decisions)
            .filter(|(_, d)| !d.allowed)
            .map(|(&i, _)| i)
            .collect();
        if let Some(&i) = denying.iter().find(|&&i| actions[i] == Action::Reject) {
            out.rejected_by = Some(i);
            break;
        }
        out.denied_softly.extend_from_slice(&denying);
        active.retain(|i| !denying.contains(i));
    }
    Ok(out)
}

//! The failure policy, rule by rule, while Redis cannot answer.

use spillway::store::{Check, Store, Verdict};
use spillway::{Algorithm, Decision};

use crate::call::Prepared;
use crate::{Error, OnError, RedisStore, bump, unknown};

/// Set in the `decided_at` of a verdict the local fallback decided, so that
/// its refund goes to the fallback: Redis never saw those charges. (Times
/// in µs since 1970 stay far below it.)
pub(crate) const LOCAL: u64 = 1 << 63;

impl RedisStore {
    fn policy(&self, check: &Check<'_>) -> OnError {
        self.inner
            .on_error
            .get(check.rule.0)
            .copied()
            .unwrap_or_default()
    }

    pub(crate) fn is_local(&self, check: &Check<'_>) -> bool {
        matches!(self.policy(check), OnError::Local { .. })
    }

    /// Applies the failure policy of each check's rule when Redis cannot
    /// answer: refused if any fails closed; otherwise the `local` checks are
    /// decided in memory (all or none, as one request) and the others admit.
    /// A cost above an instance's share of a `local` rule can never fit
    /// while Redis is away: denied, to be tried again after the retry
    /// interval.
    pub(crate) fn fall_back(
        &self,
        checks: &[Check<'_>],
        prepared: &[Prepared],
        error: Error,
    ) -> Result<Verdict, Error> {
        let inner = &*self.inner;
        if checks.iter().any(|c| self.policy(c) == OnError::FailClosed) {
            return Err(error);
        }
        let local_checks: Vec<Check<'_>> = checks
            .iter()
            .copied()
            .filter(|c| self.is_local(c))
            .collect();
        let local = match (&inner.local, local_checks.is_empty()) {
            (Some(local), false) => {
                bump(&inner.counters.local);
                if let Some(verdict) = self.beyond_share(local, checks, prepared) {
                    return Ok(verdict);
                }
                if let Some(verdict) = self.stopped_locally(checks, prepared) {
                    return Ok(verdict);
                }
                Some(local.check_now(&local_checks)?)
            }
            _ => None,
        };
        if local_checks.len() < checks.len() {
            bump(&inner.counters.fail_open);
        }
        let mut from_local = local.iter().flat_map(|v| v.decisions.iter().copied());
        let mut undecided = Vec::new();
        let decisions = checks
            .iter()
            .zip(prepared)
            .enumerate()
            .map(|(i, (c, p))| {
                let decided = if self.is_local(c) {
                    from_local.next()
                } else {
                    None
                };
                decided.unwrap_or_else(|| {
                    undecided.push(i);
                    unknown(p.capacity)
                })
            })
            .collect();
        Ok(Verdict {
            allowed: local.as_ref().is_none_or(|v| v.allowed),
            decisions,
            decided_at: local
                .as_ref()
                .filter(|v| v.allowed)
                .map_or(0, |v| v.decided_at | LOCAL),
            undecided,
        })
    }

    /// A denial if a `local` check costs more than its share's capacity.
    /// A `local` check whose key this instance knows a limit of 0 for (its
    /// copy of the overrides): the stop holds while Redis is away too,
    /// denied until the override ends; the other checks undecided.
    fn stopped_locally(&self, checks: &[Check<'_>], prepared: &[Prepared]) -> Option<Verdict> {
        let book = &self.inner.overrides.book;
        if book.is_empty() {
            return None;
        }
        let now = crate::wall_clock_micros();
        let (over, until) = checks.iter().enumerate().find_map(|(i, c)| {
            let rule = self.inner.rules.get(c.rule.0)?;
            let o = book.find(rule.name(), c.key, now)?;
            (self.is_local(c) && c.cost > 0 && o.limit_of() == 0).then_some((i, o.ends_at()))
        })?;
        let left = until.map(|u| std::time::Duration::from_micros(u.saturating_sub(now)));
        let stop = Decision {
            allowed: false,
            limit: 0,
            remaining: 0,
            reset_after: left.unwrap_or_default(),
            refill_after: left.unwrap_or_default(),
            retry_after: left,
            delay: std::time::Duration::ZERO,
        };
        Some(denied_by_one(prepared, over, stop))
    }

    fn beyond_share(
        &self,
        local: &spillway::store::MemoryStore,
        checks: &[Check<'_>],
        prepared: &[Prepared],
    ) -> Option<Verdict> {
        let share = |c: &Check<'_>| local.rules()[c.rule.0].algorithm().capacity();
        let over = checks
            .iter()
            .position(|c| self.is_local(c) && c.cost > share(c))?;
        let retry_after = self.inner.options.retry_interval;
        let denial = Decision {
            allowed: false,
            limit: share(&checks[over]),
            remaining: 0,
            reset_after: retry_after,
            refill_after: retry_after,
            retry_after: Some(retry_after),
            delay: std::time::Duration::ZERO,
        };
        Some(denied_by_one(prepared, over, denial))
    }

    /// Gives back, in the local fallback, what it charged at `charged_at`.
    pub(crate) fn give_back_locally(
        &self,
        checks: &[Check<'_>],
        charged_at: u64,
    ) -> Result<(), Error> {
        let Some(local) = &self.inner.local else {
            return Ok(());
        };
        let local_checks: Vec<Check<'_>> = checks
            .iter()
            .copied()
            .filter(|c| self.is_local(c))
            .collect();
        local.refund_at(&local_checks, charged_at)?;
        Ok(())
    }
}

/// A request denied by check `over` alone (its `denial`), decided while
/// Redis is away: the other checks undecided, with stand-ins.
fn denied_by_one(prepared: &[Prepared], over: usize, denial: Decision) -> Verdict {
    let decisions = prepared
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if i == over {
                denial
            } else {
                unknown(p.capacity)
            }
        })
        .collect();
    Verdict {
        allowed: false,
        decisions,
        decided_at: 0,
        undecided: (0..prepared.len()).filter(|&i| i != over).collect(),
    }
}

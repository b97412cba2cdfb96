//! Renewing concurrency leases: the script's renew mode, one call per
//! slot; a lease the local fallback took is renewed there.

use spillway::algorithm::{AnyAlgorithm, Renewed};
use spillway::store::{Check, Renew};

use crate::call::{Mode, Prepared};
use crate::{Error, RedisStore, fallback};

impl RedisStore {
    /// Renews each lease where it was taken: in the local fallback if it
    /// took it (under a rule that falls back locally), else in Redis. A
    /// request admitted without a lease (fail-open: a charge with no
    /// decision) takes one if it fits, and one taken by a fallback this
    /// rule no longer has is not found, so it is taken afresh if it fits: a
    /// request let in while Redis was away counts from its first renew once
    /// Redis is back. A renew sent again after a lost answer does what one
    /// does. A call that fails fails the renew; the lease, untouched, ends
    /// at its time.
    pub(crate) async fn renew_leases(
        &self,
        renews: &[Renew<'_>],
        now: Option<u64>,
    ) -> Result<Vec<Renewed>, Error> {
        let checks: Vec<Check<'_>> = renews.iter().map(|r| r.check()).collect();
        let prepared = self.prepare_at(&checks, now)?;
        if let Some(index) = renews.iter().position(|r| {
            !matches!(
                self.inner.rules[r.rule.0].algorithm(),
                AnyAlgorithm::Concurrency(_)
            )
        }) {
            let rule = renews[index].rule.0;
            return Err(spillway::Error::NotALease { index, rule }.into());
        }
        let mut renewed: Vec<Option<Renewed>> = vec![None; renews.len()];
        let is_local =
            |i: usize| renews[i].charged.at & fallback::LOCAL != 0 && self.is_local(&checks[i]);
        let local: Vec<usize> = (0..renews.len()).filter(|&i| is_local(i)).collect();
        if let (false, Some(store)) = (local.is_empty(), &self.inner.local) {
            let local_renews: Vec<Renew<'_>> = local
                .iter()
                .map(|&i| {
                    let mut renew = renews[i];
                    renew.charged.at &= !fallback::LOCAL;
                    renew
                })
                .collect();
            for (&i, mut r) in local.iter().zip(store.renew_now(&local_renews)?) {
                r.at |= fallback::LOCAL;
                renewed[i] = Some(r);
            }
        }
        let remote: Vec<usize> = (0..renews.len()).filter(|&i| !is_local(i)).collect();
        if !remote.is_empty() {
            let remote_prepared: Vec<Prepared> =
                remote.iter().map(|&i| prepared[i].clone()).collect();
            // Each lease by its name, read off the decision that took it.
            let ids: Vec<Option<u64>> = remote
                .iter()
                .map(|&i| {
                    let mut charged = renews[i].charged;
                    charged.at &= !fallback::LOCAL;
                    match self.inner.rules[renews[i].rule.0].algorithm() {
                        AnyAlgorithm::Concurrency(c) => c.lease_id(&charged),
                        _ => None,
                    }
                })
                .collect();
            let scripts = match now {
                #[cfg(feature = "test-time")]
                Some(_) => &self.inner.test_scripts,
                _ => &self.inner.scripts,
            };
            let groups = self.groups(&remote_prepared);
            let calls = groups
                .iter()
                .map(|group| self.call(scripts, &remote_prepared, group, now, Mode::Renew(&ids)));
            let replies = futures_util::future::join_all(calls).await;
            for (group, reply) in groups.iter().zip(replies) {
                let reply = reply?;
                self.forget_denials(&remote_prepared, group);
                for ((&j, &decision), &(was_held, at)) in group
                    .checks
                    .iter()
                    .zip(&reply.decisions)
                    .zip(&reply.renewed)
                {
                    renewed[remote[j]] = Some(Renewed {
                        was_held,
                        decision,
                        at,
                    });
                }
            }
        }
        Ok(renewed
            .into_iter()
            .map(|r| r.expect("every renew answered"))
            .collect())
    }
}

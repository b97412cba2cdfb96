//! Charges moved after their decision: refunds (another node of the cluster
//! denied the request, or its caller gave it back) and settles (an admitted
//! charge moved to its actual cost), each under a receipt that makes it
//! count once, and sent again in the background when Redis did not answer.

use std::sync::atomic::Ordering;
use std::time::Duration;

use spillway::Decision;
use spillway::store::{Check, SETTLE_RECEIPT_TTL, Settle, Settled};

use crate::call::{Group, Mode, Prepared, Refund, Reply, SettleCall, SettlePart};
use crate::{Error, RedisStore, Scripts, bump, fallback, is_outage, script, stand_in_for_unknown};

/// A refund or settle to send again (see `RedisStore::send_later`).
pub(crate) enum Later {
    Refund {
        charged_at: u64,
        held: Option<String>,
    },
    Settle {
        parts: Vec<SettlePart>,
        id: String,
        receipt_ms: u64,
    },
}

/// A settle receipt's life, in ms.
pub(crate) fn receipt_ms() -> u64 {
    u64::try_from(SETTLE_RECEIPT_TTL.as_millis()).unwrap_or(u64::MAX)
}

impl RedisStore {
    /// Gives back what the groups in `charged` (group, time of the charge)
    /// took, each refund with a receipt so that a second delivery gives
    /// nothing back. Returns the groups refunded, with their state as it
    /// now stands; a refund that failed to answer is sent again in the
    /// background (on the service's clock only: `now` is `None`).
    pub(crate) async fn refund_groups(
        &self,
        scripts: &Scripts,
        prepared: &[Prepared],
        groups: &[Group],
        charged: &[(usize, u64)],
        now: Option<u64>,
        held: Option<&str>,
    ) -> Vec<(usize, Reply)> {
        let calls = charged.iter().map(|&(g, charged_at)| {
            let receipt = self.receipt(&prepared[groups[g].checks[0]].key);
            async move {
                let refund = Refund {
                    charged_at,
                    receipt: &receipt,
                    held,
                };
                let result = self
                    .call(scripts, prepared, &groups[g], now, Mode::Refund(refund))
                    .await;
                (g, charged_at, receipt, result)
            }
        });
        let mut refunded = Vec::new();
        for (g, charged_at, receipt, result) in futures_util::future::join_all(calls).await {
            match result {
                Ok(reply) => {
                    self.refunded(prepared, &groups[g]);
                    refunded.push((g, reply));
                }
                Err(error) if is_outage(&error) && now.is_none() => {
                    let group: Vec<Prepared> = groups[g]
                        .checks
                        .iter()
                        .map(|&i| prepared[i].clone())
                        .collect();
                    let later = Later::Refund {
                        charged_at,
                        held: held.map(str::to_owned),
                    };
                    self.send_later(group, groups[g].slot, later, receipt);
                }
                Err(_) => bump(&self.inner.counters.refund_errors),
            }
        }
        refunded
    }

    /// Sends a refund that failed to answer again, twice at most, a retry
    /// interval apart (a second at most, so that the last is sent well
    /// within its receipt's 10 s). The receipt makes a refund that did run
    /// the first time give nothing back again.
    pub(crate) fn send_later(
        &self,
        prepared: Vec<Prepared>,
        slot: u16,
        later: Later,
        receipt: String,
    ) {
        let store = self.clone();
        tokio::spawn(async move {
            let group = Group {
                slot,
                checks: (0..prepared.len()).collect(),
            };
            for _ in 0..2 {
                tokio::time::sleep(store.retry_pause()).await;
                let mode = match &later {
                    Later::Refund { charged_at, held } => Mode::Refund(Refund {
                        charged_at: *charged_at,
                        receipt: &receipt,
                        held: held.as_deref(),
                    }),
                    Later::Settle {
                        parts,
                        id,
                        receipt_ms,
                    } => Mode::Settle(SettleCall {
                        id,
                        receipt: &receipt,
                        receipt_ms: *receipt_ms,
                        parts,
                    }),
                };
                let scripts = &store.inner.scripts;
                match store.call(scripts, &prepared, &group, None, mode).await {
                    Ok(reply) => {
                        match later {
                            Later::Refund { .. } => store.refunded(&prepared, &group),
                            Later::Settle { .. } => store.settled(&prepared, &group, &reply),
                        }
                        return;
                    }
                    Err(error) if is_outage(&error) => continue,
                    Err(_) => break,
                }
            }
            match later {
                Later::Refund { .. } => bump(&store.inner.counters.refund_errors),
                Later::Settle { .. } => bump(&store.inner.counters.settle_errors),
            }
        });
    }

    /// Settles an admitted request's charges: in Redis, in the local
    /// fallback for those it made, and nowhere for those admitted without a
    /// decision (`charged.at` 0: nothing was charged). A group that fails
    /// to answer is sent again in the background (on the service's clock
    /// only: `now` is `None`) and the settle fails with its error; its
    /// receipt makes the retries apply it once.
    pub(crate) async fn settle_charges(
        &self,
        id: &str,
        settles: &[Settle<'_>],
        now: Option<u64>,
        receipt_ms: u64,
    ) -> Result<Settled, Error> {
        spillway::store::check_settle_id(id)?;
        let checks: Vec<Check<'_>> = settles.iter().map(|s| s.check()).collect();
        let prepared = self.prepare_at(&checks, now)?;
        let mut decisions: Vec<Option<Decision>> = vec![None; settles.len()];
        let mut applied = false;

        // Charges the local fallback made (under a rule that falls back
        // locally) are settled there.
        let local: Vec<usize> = (0..settles.len())
            .filter(|&i| settles[i].charged.at & fallback::LOCAL != 0 && self.is_local(&checks[i]))
            .collect();
        if let (false, Some(store)) = (local.is_empty(), &self.inner.local) {
            let local_settles: Vec<Settle<'_>> = local
                .iter()
                .map(|&i| {
                    let mut settle = settles[i];
                    settle.charged.at &= !fallback::LOCAL;
                    // The fallback holds nothing open: the charge stands
                    // there until this settle.
                    settle.charged.held = false;
                    settle
                })
                .collect();
            let settled = store.settle_now(id, &local_settles)?;
            applied |= settled.applied;
            for (&i, d) in local.iter().zip(settled.decisions) {
                decisions[i] = Some(d);
            }
        }

        // `at` 0 is a fail-open admission's, but for the test build's
        // virtual clock (`now` given), which starts at 0, and for a lease
        // named by its holder (`Concurrency::drawn`), which its first
        // renew may have taken.
        let remote: Vec<usize> = (0..settles.len())
            .filter(|&i| {
                let charged = settles[i].charged;
                let drawn =
                    prepared[i].params[0] == script::CONCURRENCY && charged.reset_after != 0;
                (charged.at != 0 || now.is_some() || drawn) && charged.at & fallback::LOCAL == 0
            })
            .collect();
        let remote_prepared: Vec<Prepared> = remote.iter().map(|&i| prepared[i].clone()).collect();
        let parts: Vec<SettlePart> = remote
            .iter()
            .map(|&i| {
                let (settle, p) = (&settles[i], &prepared[i]);
                SettlePart {
                    at: settle.charged.at,
                    reset_after: settle.charged.reset_after,
                    actual: settle
                        .actual
                        .min(settle.charged.cost.saturating_add(2 * p.capacity)),
                    held: settle.charged.held,
                }
            })
            .collect();
        let groups = if remote.is_empty() {
            Vec::new()
        } else {
            self.groups(&remote_prepared)
        };
        let scripts = match now {
            #[cfg(feature = "test-time")]
            Some(_) => &self.inner.test_scripts,
            _ => &self.inner.scripts,
        };
        let calls = groups.iter().map(|group| {
            let receipt = format!("{}:settle:{id}", remote_prepared[group.checks[0]].key);
            let parts = &parts;
            let remote_prepared = &remote_prepared;
            async move {
                let mode = Mode::Settle(SettleCall {
                    id,
                    receipt: &receipt,
                    receipt_ms,
                    parts,
                });
                let result = self.call(scripts, remote_prepared, group, now, mode).await;
                (receipt, result)
            }
        });
        let mut first_error = None;
        for (group, (receipt, result)) in groups
            .iter()
            .zip(futures_util::future::join_all(calls).await)
        {
            match result {
                Ok(reply) => {
                    self.settled(&remote_prepared, group, &reply);
                    applied |= reply.allowed;
                    for (&j, d) in group.checks.iter().zip(&reply.decisions) {
                        decisions[remote[j]] = Some(*d);
                    }
                }
                Err(error) => {
                    if is_outage(&error) && now.is_none() {
                        let prepared = group.checks.iter().map(|&j| remote_prepared[j].clone());
                        let parts = group.checks.iter().map(|&j| parts[j]).collect();
                        self.send_later(
                            prepared.collect(),
                            group.slot,
                            Later::Settle {
                                parts,
                                id: id.to_owned(),
                                receipt_ms,
                            },
                            receipt,
                        );
                    } else {
                        bump(&self.inner.counters.settle_errors);
                    }
                    first_error.get_or_insert(error);
                }
            }
        }
        if let Some(error) = first_error {
            return Err(error);
        }
        let (decisions, _) = stand_in_for_unknown(decisions, &prepared);
        Ok(Settled {
            applied,
            decisions: decisions.into_vec(),
        })
    }

    /// Closes the reservations the groups held open under `id`, in the
    /// background, leaving their charges as they stand: for a request that
    /// the failure policy let in after some groups had answered (their
    /// charges cannot be settled by a verdict that is not Redis's). A
    /// group that did not answer may still run its call: it is sent again
    /// once, a retry interval later.
    pub(crate) fn close_later(&self, prepared: &[Prepared], groups: &[Group], id: &str) {
        let store = self.clone();
        let (prepared, groups, id) = (prepared.to_vec(), groups.to_vec(), id.to_owned());
        tokio::spawn(async move {
            let scripts = &store.inner.scripts;
            let mut left: Vec<&Group> = groups.iter().collect();
            for attempt in 0..2 {
                if attempt > 0 {
                    tokio::time::sleep(store.retry_pause()).await;
                }
                let mut failed = Vec::new();
                for group in left {
                    let mode = Mode::Close(&id);
                    if store
                        .call(scripts, &prepared, group, None, mode)
                        .await
                        .is_err()
                    {
                        failed.push(group);
                    }
                }
                left = failed;
            }
        });
    }

    /// How long a receipt must live to cover this store's own sending of a
    /// call: the first try and the two sent again in the background, each
    /// after a pause and within the call timeout, with room to spare.
    pub(crate) fn own_retries(&self) -> Duration {
        Duration::from_secs(10) + 3 * (self.retry_pause() + self.inner.options.timeout)
    }

    /// How long a call sent again in the background waits first: a retry
    /// interval, a second at most.
    fn retry_pause(&self) -> Duration {
        self.inner
            .options
            .retry_interval
            .min(Duration::from_secs(1))
    }

    /// A settle's script call answered: counted if it applied, and the deny
    /// cache forgets its keys (a denial cached before a give-back may no
    /// longer hold).
    pub(crate) fn settled(&self, prepared: &[Prepared], group: &Group, reply: &Reply) {
        if reply.allowed {
            bump(&self.inner.counters.settles);
        }
        self.forget_denials(prepared, group);
    }

    /// A refund ran: counted, and the deny cache forgets its keys (a
    /// denial cached while the charge stood may no longer hold).
    pub(crate) fn refunded(&self, prepared: &[Prepared], group: &Group) {
        bump(&self.inner.counters.refunds);
        self.forget_denials(prepared, group);
    }

    /// A refund receipt's key, in the slot of `key`: unique to this
    /// process and refund.
    pub(crate) fn receipt(&self, key: &str) -> String {
        let c = &self.inner.counters;
        let seq = c.receipts.fetch_add(1, Ordering::Relaxed);
        format!("{key}:refund:{:016x}{seq:x}", c.receipt_prefix)
    }

    /// Gives back an admitted request's charges: in the local fallback if
    /// it decided them, else in Redis (see [`refund_groups`]).
    pub(crate) async fn give_back(
        &self,
        checks: &[Check<'_>],
        charged_at: u64,
    ) -> Result<(), Error> {
        if charged_at == 0 {
            return Ok(());
        }
        if charged_at & fallback::LOCAL != 0 {
            return self.give_back_locally(checks, charged_at & !fallback::LOCAL);
        }
        let prepared = self.prepare(checks)?;
        let groups = self.groups(&prepared);
        let charged: Vec<(usize, u64)> = (0..groups.len()).map(|g| (g, charged_at)).collect();
        self.refund_groups(
            &self.inner.scripts,
            &prepared,
            &groups,
            &charged,
            None,
            None,
        )
        .await;
        Ok(())
    }
}

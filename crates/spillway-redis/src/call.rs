//! One script call: its keys and arguments, how it is sent (on a cluster,
//! by the store's own routing: see `cluster.rs`), and its reply.

use spillway::Decision;

use crate::{Connection, Error, RedisStore, Scripts, bump, script};

/// One check, ready to send.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    pub(crate) key: String,
    pub(crate) params: script::Params,
    pub(crate) cost: u64,
    pub(crate) capacity: u64,
    /// A concurrency check's lease, by name, for a refund to give back (0
    /// when not known: the script then takes the last taken).
    pub(crate) lease: u64,
    /// How long (µs) a reservation of the check's rule stays open
    /// unsettled before it is given back; 0 if it never is.
    pub(crate) release_us: u64,
    /// Whether a reservation holds this check's charge open (when its
    /// rule releases): a check that is not held still gives back its key's
    /// reservations that are due (sent as a negative time).
    pub(crate) held: bool,
    /// Whether the script reads the key's own override (its rule has
    /// some), and the override of a prefix the key is under (the most one
    /// request may cost under it, and when it ends, 0 for never), whose
    /// parameters `params` are: either sends the check to the general
    /// script.
    pub(crate) overridden: Overridden,
}

/// What a check's script call knows of its overrides.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Overridden {
    pub(crate) reads_own: bool,
    pub(crate) prefix: Option<(u64, u64)>,
}

impl Overridden {
    fn any(&self) -> bool {
        self.reads_own || self.prefix.is_some()
    }
}

/// The checks of one script call: all of a request's on a standalone
/// server, those of one slot on a cluster.
#[derive(Debug, Clone)]
pub(crate) struct Group {
    /// The slot (0 on a standalone server): the breaker it answers to.
    pub(crate) slot: u16,
    /// The checks, by index in the request.
    pub(crate) checks: Vec<usize>,
}

/// What one script call answered.
pub(crate) struct Reply {
    pub(crate) allowed: bool,
    pub(crate) now: u64,
    pub(crate) decisions: Vec<Decision>,
    /// A renew's: per check, whether the lease was still held, and the
    /// time it now runs from. Empty for the other modes.
    pub(crate) renewed: Vec<script::LeaseRenewed>,
}

/// What a script call does: decide, or after the decision give charges
/// back or settle them (see `driver.lua`).
#[derive(Clone, Copy)]
pub(crate) enum Mode<'a> {
    Decide,
    Refund(Refund<'a>),
    Settle(SettleCall<'a>),
    /// Renew leases: each check's lease name, by index in the request
    /// (`None`: the request holds no lease yet).
    Renew(&'a [Option<u64>]),
    /// Decide, and hold the charges of rules that give back what is not
    /// settled in time open under this id.
    Reserve(&'a str),
    /// Close the reservations held open under this id, leaving their
    /// charges as they stand.
    Close(&'a str),
}

/// A refund's time of charge and its receipt key, and the id its charges
/// were held open under, if they were (a reservation).
#[derive(Clone, Copy)]
pub(crate) struct Refund<'a> {
    pub(crate) charged_at: u64,
    pub(crate) receipt: &'a str,
    pub(crate) held: Option<&'a str>,
}

/// A settle: its receipt key and how long the receipt lives, and each
/// check's charge and actual cost, by index in the request (as `Prepared`).
#[derive(Clone, Copy)]
pub(crate) struct SettleCall<'a> {
    /// The settle's id, which names the reservations it closes.
    pub(crate) id: &'a str,
    pub(crate) receipt: &'a str,
    pub(crate) receipt_ms: u64,
    pub(crate) parts: &'a [SettlePart],
}

/// One check's part of a settle.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SettlePart {
    /// The charge's time (µs, the store's clock).
    pub(crate) at: u64,
    /// Its decision's `reset_after` (µs).
    pub(crate) reset_after: u64,
    /// The actual cost (no more than the charge plus twice the capacity:
    /// past that, every algorithm's cap makes it the same).
    pub(crate) actual: u64,
    /// The charge is a reservation held open under the settle's id.
    pub(crate) held: bool,
}

impl RedisStore {
    /// One script call for the checks in `group` (all in one slot): the
    /// single-check script of the check's algorithm when it decides one
    /// check, else the general script.
    pub(crate) async fn call(
        &self,
        scripts: &Scripts,
        prepared: &[Prepared],
        group: &Group,
        now: Option<u64>,
        mode: Mode<'_>,
    ) -> Result<Reply, Error> {
        let family = single_family(prepared, &group.checks, mode);
        let script = match family {
            Some(family) => &scripts.single[family],
            None => &scripts.general,
        };
        let mut invocation = script.prepare_invoke();
        assemble(prepared, &group.checks, now, mode, family, &mut invocation);
        bump(&self.inner.counters.redis_calls);
        let timeout = self.inner.options.timeout;
        let reply: Vec<i64> = match &self.connection {
            Connection::Standalone(node) => {
                let call = node.run(async |mut c| invocation.invoke_async(&mut c).await);
                tokio::time::timeout(timeout, call).await
            }
            Connection::Cluster(c) => {
                let eval = || {
                    let mut call = ScriptCall {
                        source: scripts.source(family).to_string(),
                        keys: Vec::new(),
                        args: Vec::new(),
                    };
                    assemble(prepared, &group.checks, now, mode, family, &mut call);
                    call.eval()
                };
                c.run_within(timeout, group.slot, Some(&invocation), eval)
                    .await
            }
        }
        .map_err(|_| Error::Timeout(timeout))??;
        let checks = group.checks.len();
        let (reply, renewed, given_back) = match (mode, family) {
            (Mode::Renew(_), _) => {
                let (reply, renewed) = script::split_renewed(&reply, checks)?;
                (reply, renewed, 0)
            }
            // The general script says last how many it gave back.
            (_, None) => match reply.split_last() {
                Some((&n, head)) => (head, Vec::new(), n.max(0) as u64),
                None => (&reply[..], Vec::new(), 0),
            },
            (_, Some(_)) => (&reply[..], Vec::new(), 0),
        };
        let (allowed, now, decisions) = script::decode(reply, checks)?;
        if given_back > 0 {
            self.inner
                .counters
                .given_back
                .fetch_add(given_back, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(Reply {
            allowed,
            now,
            decisions,
            renewed,
        })
    }
}

/// Which single-check script decides `group`: the one of its check's
/// algorithm when it is one check and a decision; `None` for the general
/// script.
pub(crate) fn single_family(
    prepared: &[Prepared],
    group: &[usize],
    mode: Mode<'_>,
) -> Option<usize> {
    match (group, mode) {
        // A key whose rule gives reservations back is seen to by the
        // general script.
        (&[i], Mode::Decide) if prepared[i].release_us == 0 && !prepared[i].overridden.any() => {
            Some(script::family(&prepared[i].params))
        }
        _ => None,
    }
}

/// Where [`assemble`] puts a script call's keys and arguments: the call
/// itself, or its text for [`RedisStore::script_call`].
pub(crate) trait CallArgs {
    fn key(&mut self, key: &str);
    fn number(&mut self, n: u64);
    fn text(&mut self, s: &str);
}

impl CallArgs for redis::ScriptInvocation<'_> {
    fn key(&mut self, key: &str) {
        redis::ScriptInvocation::key(self, key);
    }
    fn number(&mut self, n: u64) {
        self.arg(n);
    }
    fn text(&mut self, s: &str) {
        self.arg(s);
    }
}

impl CallArgs for ScriptCall {
    fn key(&mut self, key: &str) {
        self.keys.push(key.to_string());
    }
    fn number(&mut self, n: u64) {
        self.args.push(n.to_string());
    }
    fn text(&mut self, s: &str) {
        self.args.push(s.to_string());
    }
}

/// The keys and arguments of the script call for `group`: for a
/// single-check script (`family`), the parameters its algorithm reads, the
/// cost and (only the test build sends one) the time; for the general
/// script, the time or "", the refund's time, "settle", "renew" or "",
/// then each check's algorithm, five parameters and cost, a settle's parts
/// and its receipt's life or a renew's lease times, and a refund's or
/// settle's receipt key last.
pub(crate) fn assemble(
    prepared: &[Prepared],
    group: &[usize],
    now: Option<u64>,
    mode: Mode<'_>,
    family: Option<usize>,
    out: &mut impl CallArgs,
) {
    if family.is_some() {
        let p = &prepared[group[0]];
        out.key(&p.key);
        script::single_args(&p.params)
            .iter()
            .for_each(|&v| out.number(v));
        out.number(p.cost);
        // Only the test build's scripts read it; only it sends one.
        if let Some(t) = now {
            out.number(t);
        }
        return;
    }
    match now {
        Some(t) => out.number(t),
        None => out.text(""),
    }
    match mode {
        Mode::Decide => out.text(""),
        Mode::Refund(r) => out.number(r.charged_at),
        Mode::Settle(_) => out.text("settle"),
        Mode::Renew(_) => out.text("renew"),
        Mode::Reserve(_) => out.text("reserve"),
        Mode::Close(_) => out.text("close"),
    }
    for &i in group {
        let p = &prepared[i];
        out.key(&p.key);
        match p.overridden {
            Overridden {
                prefix: None,
                reads_own: false,
            } => out.number(p.params[0]),
            Overridden { prefix: None, .. } => out.text(&format!("-{}", p.params[0])),
            Overridden {
                prefix: Some((cap, until)),
                ..
            } => out.text(&format!("-{}/{cap}/{until}", p.params[0])),
        }
        p.params[1..].iter().for_each(|&v| out.number(v));
        out.number(p.cost);
        if p.release_us > 0 && !p.held {
            out.text(&format!("-{}", p.release_us));
        } else {
            out.number(p.release_us);
        }
    }
    match mode {
        Mode::Decide => {}
        Mode::Reserve(id) | Mode::Close(id) => out.text(id),
        Mode::Refund(r) => {
            out.key(r.receipt);
            group.iter().for_each(|&i| out.number(prepared[i].lease));
            out.text(r.held.unwrap_or(""));
        }
        Mode::Settle(settle) => {
            for &i in group {
                let part = settle.parts[i];
                out.number(part.at);
                out.number(part.reset_after);
                out.number(part.actual);
                out.number(u64::from(part.held));
            }
            out.number(settle.receipt_ms);
            out.text(settle.id);
            out.key(settle.receipt);
        }
        Mode::Renew(ids) => group.iter().for_each(|&i| match ids[i] {
            Some(id) => out.number(id),
            None => out.text("-1"),
        }),
    }
}

/// A script call as the store makes it: see [`RedisStore::script_call`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptCall {
    /// The script's Lua source (the store runs it by its SHA1).
    pub source: String,
    /// The keys (`KEYS`).
    pub keys: Vec<String>,
    /// The arguments (`ARGV`).
    pub args: Vec<String>,
}

impl ScriptCall {
    /// The call as one EVAL command.
    fn eval(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(&self.source)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }
}

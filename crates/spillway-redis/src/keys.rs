//! A rule's keys as stored: the listing of the admin API (a `SCAN` of each
//! master), and a key's state read or reset.

use spillway::store::RuleId;

use crate::{Connection, Error, RedisStore, cluster, script};

/// Where a listing of a rule's keys ([`RedisStore::keys`]) goes on: the
/// cursor of Redis's `SCAN`, and on a cluster the master it scans (named by
/// the lowest slot it serves). It reads and prints as `SCAN` or
/// `SLOT-SCAN`; the default starts a listing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyCursor {
    node: Option<u16>,
    scan: u64,
}

impl std::fmt::Display for KeyCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.node {
            Some(node) => write!(f, "{node}-{}", self.scan),
            None => write!(f, "{}", self.scan),
        }
    }
}

impl std::str::FromStr for KeyCursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not a cursor a listing gave");
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        match s.split_once('-') {
            None if digits(s) => Ok(Self {
                node: None,
                scan: s.parse().map_err(|_| bad())?,
            }),
            Some((node, scan)) if digits(node) && digits(scan) => Ok(Self {
                node: Some(node.parse().map_err(|_| bad())?),
                scan: scan.parse().map_err(|_| bad())?,
            }),
            _ => Err(bad()),
        }
    }
}

/// `s` as a `SCAN MATCH` pattern that matches it alone.
pub(crate) fn glob_escaped(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        if matches!(ch, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

/// A key as the client gave it, from its escaped form in a Redis key.
pub(crate) fn unescaped(escaped: &str) -> String {
    escaped
        .replace("%3A", ":")
        .replace("%7B", "{")
        .replace("%7D", "}")
        .replace("%25", "%")
}

impl RedisStore {
    /// The Redis key of `key` under `rule`.
    pub(crate) fn stored_key(&self, rule: RuleId, key: &str) -> Result<String, Error> {
        let rule = self
            .inner
            .rules
            .get(rule.0)
            .ok_or(spillway::Error::UnknownRule {
                index: 0,
                rule: rule.0,
            })?;
        Ok(script::redis_key(
            &self.inner.options.key_prefix,
            rule.name(),
            rule.algorithm(),
            key,
        ))
    }

    /// Forgets `key` under `rule`: its state in Redis and its deny-cache
    /// entry. Returns whether Redis held it.
    pub async fn reset(&self, rule: RuleId, key: &str) -> Result<bool, Error> {
        let key = self.stored_key(rule, key)?;
        if let Some(cache) = &self.inner.deny_cache {
            cache.forget(&key);
        }
        let mut cmd = redis::cmd("DEL");
        cmd.arg(&key);
        // A concurrency rule's released leases too (a key of the same
        // slot), as the memory store forgets them with the key.
        if key.ends_with(":ls") {
            cmd.arg(format!("{key}:rel"));
        }
        // And the reservations held open on it: given back later, they
        // would take from what is counted after the reset.
        cmd.arg(format!("{key}:rs")).arg(format!("{key}:rs:c"));
        let deleted: i64 = self.query(&key, &cmd).await?;
        Ok(deleted > 0)
    }

    /// Whether Redis holds `key` under `rule` (its state under the rule's
    /// current algorithm and window): a key whose quota has all come back
    /// has expired.
    pub async fn holds(&self, rule: RuleId, key: &str) -> Result<bool, Error> {
        let key = self.stored_key(rule, key)?;
        let mut cmd = redis::cmd("EXISTS");
        cmd.arg(&key);
        let found: i64 = self.query(&key, &cmd).await?;
        Ok(found > 0)
    }

    /// One page of the keys `rule` holds in Redis, from `cursor` (the
    /// [`KeyCursor`] the page before gave, or the default to start): a
    /// `SCAN` of the keys of the rule's current algorithm and window, so a
    /// page may hold fewer keys than `count`, or more, and the listing ends
    /// when the cursor returned is `None`. As `SCAN` guarantees, a key held
    /// from the first page to the last is listed (twice at most, if Redis
    /// grew its table meanwhile); on a cluster the masters are scanned one
    /// after another, so a slot that moves during the listing may be missed
    /// or listed twice.
    pub async fn keys(
        &self,
        rule: RuleId,
        cursor: KeyCursor,
        count: usize,
    ) -> Result<(Vec<String>, Option<KeyCursor>), Error> {
        // The rule's keys are `prefix{rule:KEY}:suffix`, KEY escaped.
        let sample = self.stored_key(rule, "")?;
        // The rule's name is escaped, and no suffix holds a `}`: the last
        // one closes the key.
        let (head, tail) = sample.split_at(sample.rfind('}').unwrap_or(sample.len()));
        let pattern = format!("{}*{}", glob_escaped(head), glob_escaped(tail));
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor.scan)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(count.max(1));
        let timeout = self.inner.options.timeout;
        let (next, found, node): (u64, Vec<String>, Option<u16>) = match &self.connection {
            Connection::Standalone(node) => {
                let call =
                    node.run(async |mut c| cmd.query_async::<(u64, Vec<String>)>(&mut c).await);
                let (next, found) = tokio::time::timeout(timeout, call)
                    .await
                    .map_err(|_| Error::Timeout(timeout))??;
                (next, found, None)
            }
            Connection::Cluster(c) => {
                let masters = c.master_slots();
                // The master the cursor names, or the first one after it.
                let Some(&slot) = masters.iter().find(|&&s| s >= cursor.node.unwrap_or(0)) else {
                    return Ok((Vec::new(), None));
                };
                let (next, found) = c
                    .run_within::<(u64, Vec<String>)>(timeout, slot, None, || cmd.clone())
                    .await
                    .map_err(|_| Error::Timeout(timeout))??;
                (next, found, Some(slot))
            }
        };
        let keys = found
            .iter()
            .filter_map(|k| k.strip_prefix(head)?.strip_suffix(tail))
            .map(unescaped)
            .collect();
        let next = match (next, node) {
            (0, None) => None,
            (scan, None) => Some(KeyCursor { node: None, scan }),
            (0, Some(slot)) => slot.checked_add(1).map(|after| KeyCursor {
                node: Some(after),
                scan: 0,
            }),
            (scan, Some(slot)) => Some(KeyCursor {
                node: Some(slot),
                scan,
            }),
        };
        Ok((keys, next))
    }

    /// `cmd`, a command on `key` alone, on the node that holds `key`.
    pub(crate) async fn query<T: redis::FromRedisValue>(
        &self,
        key: &str,
        cmd: &redis::Cmd,
    ) -> Result<T, Error> {
        query_on(&self.connection, self.inner.options.timeout, key, cmd).await
    }
}

/// Sends `cmd`, which touches `key` (and keys of its slot only), on
/// `connection`, waiting `timeout` at most.
pub(crate) async fn query_on<T: redis::FromRedisValue>(
    connection: &Connection,
    timeout: std::time::Duration,
    key: &str,
    cmd: &redis::Cmd,
) -> Result<T, Error> {
    match connection {
        Connection::Standalone(node) => {
            let call = node.run(async |mut c| cmd.query_async(&mut c).await);
            tokio::time::timeout(timeout, call).await
        }
        Connection::Cluster(c) => {
            let slot = cluster::slot(key.as_bytes());
            c.run_within(timeout, slot, None, || cmd.clone()).await
        }
    }
    .map_err(|_| Error::Timeout(timeout))?
    .map_err(Error::from)
}

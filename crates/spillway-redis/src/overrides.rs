//! Overrides on Redis, shared by every instance: set, removed and listed
//! here; applied in the decision's own script call.
//!
//! Where they live:
//! - The table, `PREFIX{overrides}`, a hash with one field per override
//!   (`k:RULE:KEY` or `p:RULE:PREFIX`, escaped as state keys are) whose
//!   value is `limit burst delay until` (`-` where an override sets no
//!   burst or delay, until 0 for never) then a newline and the caller's
//!   description; and its version, `PREFIX{overrides}:v`, one more at
//!   every change. Both in one slot, changed in one script.
//! - A key's own override also in the key's slot, beside its state:
//!   `STATEKEY:ov`, `N cap until p1..p5` (its algorithm's number, the most
//!   one request may cost, its end, its script parameters), expiring when
//!   the override does. The decision's script reads it there, so a key's
//!   own override costs no round trip and holds at once everywhere.
//!
//! Each instance keeps a copy of the table ([`OverrideBook`]), read again
//! whenever the version moved (looked at every
//! [`RedisOptions::override_refresh`](crate::RedisOptions::override_refresh)):
//! from it a check knows whether its rule has keys' own overrides (the
//! script then reads `:ov`; a rule without pays nothing) and which prefix
//! its key is under (whose parameters it sends). So an override holds on
//! every instance within one refresh at most: at once for a key whose rule
//! has keys' own overrides already, within a refresh for the first of a
//! rule and for a prefix.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use spillway::Algorithm;
use spillway::algorithm::AnyAlgorithm;
use spillway::store::{
    ListBook, ListEntry, Listed, Override, OverrideBook, OverrideEntry, RuleId, Target, TierBook,
    TierEntry,
};

use crate::call::Overridden;
use crate::{Connection, Error, RedisStore, keys, script};

/// An instance's copy of the overrides, shared by the stores
/// [`RedisStore::with_rules`] makes.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) book: OverrideBook,
    pub(crate) tiers: TierBook,
    pub(crate) lists: ListBook,
    // The table's version the book holds (`None`: never read).
    version: Mutex<Option<u64>>,
    // Held by a refresh from its read to its replace, and by a change
    // from its write to this copy's: a refresh that read the table before
    // a change cannot put back what the change replaced here.
    pub(crate) changing: tokio::sync::Mutex<()>,
}

/// Writes an override into the table and bumps its version (KEYS: the
/// table, its version; ARGV: the field, the value or "" to remove).
/// Returns whether the field was there before.
const WRITE: &str = r"
local had = redis.call('HEXISTS', KEYS[1], ARGV[1])
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
redis.call('INCR', KEYS[2])
return had
";

/// Deletes the rows past their time that a refresh found (KEYS: the
/// table, its version; ARGV: field, value as read, ...), each only if it
/// is still the value read; bumps the version if any went.
const DELETE_ENDED: &str = r"
local deleted = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    deleted = deleted + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
if deleted > 0 then redis.call('INCR', KEYS[2]) end
return deleted
";

/// How many rows a refresh reads, or deletes, in one call.
const REFRESH_PAGE: usize = 500;

fn table_key(prefix: &str) -> String {
    format!("{prefix}{{overrides}}")
}

fn version_key(prefix: &str) -> String {
    format!("{prefix}{{overrides}}:v")
}

/// The table's field of `target` under `rule`.
fn field(rule: &str, target: &Target) -> String {
    let (kind, text) = match target {
        Target::Key(k) => ("k", k.as_str()),
        Target::Prefix(p) => ("p", p.as_str()),
    };
    let mut out = String::with_capacity(rule.len() + text.len() + 4);
    out.push_str(kind);
    out.push(':');
    script::escape_into(&mut out, rule);
    out.push(':');
    script::escape_into(&mut out, text);
    out
}

/// The table's value of `entry`.
fn value(entry: &OverrideEntry) -> String {
    let o = &entry.applied;
    let or_dash = |v: Option<u32>| v.map_or("-".to_string(), |v| v.to_string());
    format!(
        "{} {} {} {}\n{}",
        o.limit_of(),
        or_dash(o.burst().map(|b| b.get())),
        or_dash(o.delay()),
        o.ends_at().unwrap_or(0),
        entry.spec
    )
}

/// The table's field of `api_key`'s tier.
fn tier_field(api_key: &str) -> String {
    let mut out = String::with_capacity(api_key.len() + 2);
    out.push_str("t:");
    script::escape_into(&mut out, api_key);
    out
}

/// The table's value of a tier's entry: its end, the tier (a name of the
/// configuration's, which holds no line break), then the description.
fn tier_value(entry: &TierEntry) -> String {
    format!(
        "{} {}\n{}",
        entry.until.unwrap_or(0),
        entry.tier,
        entry.spec
    )
}

/// The table's field of a list entry: `l:`, what it names (`i`, `a`,
/// `k`), its rule (empty for every rule), its text.
fn list_field(listed: &Listed, rule: Option<&str>) -> String {
    let (kind, text) = match listed {
        Listed::Ip { addr, len } => ("i", format!("{addr}/{len}")),
        Listed::ApiKey(k) => ("a", k.to_string()),
        Listed::Key(k) => ("k", k.to_string()),
    };
    let mut out = format!("l:{kind}:");
    script::escape_into(&mut out, rule.unwrap_or(""));
    out.push(':');
    script::escape_into(&mut out, &text);
    out
}

/// The table's value of a list entry: allow (0/1), status, end, then the
/// description.
fn list_value(entry: &ListEntry) -> String {
    format!(
        "{} {} {}\n{}",
        u8::from(entry.allow),
        entry.status,
        entry.until.unwrap_or(0),
        entry.spec
    )
}

fn parse_list(field: &str, value: &str) -> Option<(Listed, ListEntry)> {
    let mut parts = field.strip_prefix("l:")?.splitn(3, ':');
    let (kind, rule, text) = (parts.next()?, parts.next()?, parts.next()?);
    let text = keys::unescaped(text);
    let listed = match kind {
        "i" => {
            let (addr, len) = text.split_once('/')?;
            Listed::network(addr.parse().ok()?, len.parse().ok()?)?
        }
        "a" => Listed::ApiKey(text.into()),
        "k" => Listed::Key(text.into()),
        _ => return None,
    };
    let (head, spec) = value.split_once('\n')?;
    let mut numbers = head.split(' ');
    let allow = numbers.next()? == "1";
    let status: u16 = numbers.next()?.parse().ok()?;
    let until: u64 = numbers.next()?.parse().ok()?;
    let rule = keys::unescaped(rule);
    let entry = ListEntry {
        allow,
        rule: (!rule.is_empty()).then(|| rule.as_str().into()),
        status,
        until: (until > 0).then_some(until),
        spec: spec.into(),
    };
    Some((listed, entry))
}

/// A row of the table read back.
#[derive(Debug, PartialEq)]
enum Row {
    Override(String, Target, OverrideEntry),
    Tier(String, TierEntry),
    List(Listed, ListEntry),
}

/// A field and its value read back; `None` for one this version does not
/// write.
fn parse_row(field: &str, value: &str) -> Option<Row> {
    if field.starts_with("l:") {
        let (listed, entry) = parse_list(field, value)?;
        return Some(Row::List(listed, entry));
    }
    if let Some(key) = field.strip_prefix("t:") {
        let (head, spec) = value.split_once('\n')?;
        let (until, tier) = head.split_once(' ')?;
        let until: u64 = until.parse().ok()?;
        let entry = TierEntry {
            tier: tier.into(),
            until: (until > 0).then_some(until),
            spec: spec.into(),
        };
        return Some(Row::Tier(keys::unescaped(key), entry));
    }
    let (rule, target, entry) = parse(field, value)?;
    Some(Row::Override(rule, target, entry))
}

/// An override's field and value read back; `None` for one this version
/// does not write.
fn parse(field: &str, value: &str) -> Option<(String, Target, OverrideEntry)> {
    let (kind, rest) = field.split_once(':')?;
    let (rule, text) = rest.split_once(':')?;
    let (rule, text) = (keys::unescaped(rule), keys::unescaped(text));
    let target = match kind {
        "k" => Target::Key(text.into()),
        "p" => Target::Prefix(text.into()),
        _ => return None,
    };
    let (numbers, spec) = value.split_once('\n')?;
    let mut parts = numbers.split(' ');
    let limit: u32 = parts.next()?.parse().ok()?;
    let burst = parts.next()?;
    let delay = parts.next()?;
    let until: u64 = parts.next()?.parse().ok()?;
    let mut o = Override::limit(limit);
    if burst != "-" {
        o = o.with_burst(burst.parse().ok()?);
    }
    if delay != "-" {
        o = o.with_delay(delay.parse().ok()?);
    }
    if until > 0 {
        o = o.until(until);
    }
    let entry = OverrideEntry {
        applied: o,
        spec: spec.into(),
    };
    Some((rule, target, entry))
}

/// The script's view of `o` applied to `rule`: the most one request may
/// cost, and its parameters (a calendar's periods are the call's).
fn script_view(rule: &spillway::store::Rule, o: &Override) -> Result<(u64, script::Params), Error> {
    let not_applied = |reason: String| spillway::Error::Override {
        rule: rule.name().to_string(),
        reason,
    };
    match o.applied_to(rule.algorithm()).map_err(not_applied)? {
        None => Ok((0, script::params(rule.name(), rule.algorithm())?)),
        Some(algorithm) => {
            let params = match algorithm {
                AnyAlgorithm::FixedWindow(fw) if fw.calendar_of().is_some() => {
                    [script::CALENDAR, algorithm.capacity(), 0, 0, 0, 0]
                }
                _ => script::params(rule.name(), &algorithm)?,
            };
            Ok((algorithm.capacity(), params))
        }
    }
}

impl RedisStore {
    /// Sets the override of `target` under store rule `rule`, replacing
    /// any, on every instance that shares this Redis (see the module
    /// docs for how soon). Returns the one it replaced, as this instance
    /// knew it. An error for a rule the store does not have, an override
    /// that does not apply to it
    /// ([`Override::applied_to`](spillway::store::Override::applied_to)),
    /// one whose arithmetic the script cannot do exactly, or Redis's.
    pub async fn set_override(
        &self,
        rule: RuleId,
        target: Target,
        entry: OverrideEntry,
    ) -> Result<Option<OverrideEntry>, Error> {
        let r = self.rule(rule)?;
        script_view(r, &entry.applied)?;
        let _changing = self.inner.overrides.changing.lock().await;
        self.write_row(&field(r.name(), &target), &value(&entry))
            .await?;
        if let Target::Key(key) = &target {
            self.write_own(rule, key, &entry.applied).await?;
        }
        Ok(self.inner.overrides.book.set(r.name(), target, entry))
    }

    /// Writes `key`'s own override `o` of store rule `rule` beside its
    /// state, with the script's parameters of the rule as this store has
    /// it; deletes it there if the rule no longer takes it (a reload gave
    /// it an algorithm that takes none of it: not in force, as in memory).
    async fn write_own(&self, rule: RuleId, key: &str, o: &Override) -> Result<(), Error> {
        let r = self.rule(rule)?;
        let state = self.stored_key(rule, key)?;
        let own = format!("{state}:ov");
        match script_view(r, o) {
            Ok((cap, params)) => {
                let until = o.ends_at().unwrap_or(0);
                let mut set = redis::cmd("SET");
                set.arg(&own).arg(format!(
                    "{} {cap} {until} {} {} {} {} {}",
                    params[0], params[1], params[2], params[3], params[4], params[5]
                ));
                if until > 0 {
                    set.arg("PXAT").arg(until.div_ceil(1000));
                }
                let _: () = self.query(&own, &set).await?;
            }
            Err(_) => {
                let _: i64 = self.query(&own, redis::cmd("DEL").arg(&own)).await?;
            }
        }
        if let Some(cache) = &self.inner.deny_cache {
            cache.forget(&state);
        }
        Ok(())
    }

    /// After a reload ([`with_rules`](Self::with_rules)) from a store with
    /// `previous` rules: writes again, beside each key, the own overrides
    /// of every rule that changed, so that the script decides them under
    /// the rule as it is now. A key's own override carries its rule's
    /// parameters (a bucket's rate, a window's length: the state key of a
    /// fixed window names its window, so a new window is a new key), made
    /// when it was set. Returns how many were written.
    pub async fn rewrite_own_overrides(
        &self,
        previous: &[spillway::store::Rule],
    ) -> Result<usize, Error> {
        let book = &self.inner.overrides.book;
        if book.is_empty() {
            return Ok(0);
        }
        let _changing = self.inner.overrides.changing.lock().await;
        let now = spillway::clock::Clock::now(&spillway::clock::SystemClock);
        let mut written = 0;
        for (i, rule) in self.inner.rules.iter().enumerate() {
            if previous.iter().any(|old| old == rule) {
                continue;
            }
            for (target, entry) in book.list(rule.name(), now) {
                if let Target::Key(key) = target {
                    self.write_own(RuleId(i), &key, &entry.applied).await?;
                    written += 1;
                }
            }
        }
        Ok(written)
    }

    /// Whether store rule `rule` can take `o`: one its algorithm takes
    /// ([`Override::applied_to`]) and whose arithmetic the script does
    /// exactly. What [`set_override`](Self::set_override) checks first.
    pub fn override_fits(&self, rule: RuleId, o: &Override) -> Result<(), Error> {
        script_view(self.rule(rule)?, o).map(|_| ())
    }

    /// Removes the override of `target` under store rule `rule` on every
    /// instance (see the module docs for how soon); returns it, as this
    /// instance knew it. Its keys keep their count under the rule's quota.
    pub async fn remove_override(
        &self,
        rule: RuleId,
        target: &Target,
    ) -> Result<Option<OverrideEntry>, Error> {
        let r = self.rule(rule)?;
        let _changing = self.inner.overrides.changing.lock().await;
        if let Target::Key(key) = target {
            let state = self.stored_key(rule, key)?;
            let own = format!("{state}:ov");
            let _: i64 = self.query(&own, redis::cmd("DEL").arg(&own)).await?;
            if let Some(cache) = &self.inner.deny_cache {
                cache.forget(&state);
            }
        }
        self.write_row(&field(r.name(), target), "").await?;
        Ok(self.inner.overrides.book.remove(r.name(), target))
    }

    /// Puts `api_key` in a tier on every instance that shares this Redis
    /// (within one refresh), replacing any; returns the entry it replaced,
    /// as this instance knew it.
    pub async fn set_tier(
        &self,
        api_key: &str,
        entry: TierEntry,
    ) -> Result<Option<TierEntry>, Error> {
        let _changing = self.inner.overrides.changing.lock().await;
        self.write_row(&tier_field(api_key), &tier_value(&entry))
            .await?;
        Ok(self.inner.overrides.tiers.set(api_key, entry))
    }

    /// Takes `api_key` out of the tier it was put in, on every instance
    /// (within one refresh); returns its entry, as this instance knew it.
    pub async fn remove_tier(&self, api_key: &str) -> Result<Option<TierEntry>, Error> {
        let _changing = self.inner.overrides.changing.lock().await;
        self.write_row(&tier_field(api_key), "").await?;
        Ok(self.inner.overrides.tiers.remove(api_key))
    }

    /// Sets a list entry on every instance that shares this Redis (within
    /// one refresh), replacing any; returns the one it replaced, as this
    /// instance knew it.
    pub async fn set_listed(
        &self,
        listed: Listed,
        entry: ListEntry,
    ) -> Result<Option<ListEntry>, Error> {
        let field = list_field(&listed, entry.rule.as_deref());
        let _changing = self.inner.overrides.changing.lock().await;
        self.write_row(&field, &list_value(&entry)).await?;
        Ok(self.inner.overrides.lists.set(listed, entry))
    }

    /// Removes a list entry on every instance (within one refresh);
    /// returns it, as this instance knew it.
    pub async fn remove_listed(
        &self,
        listed: &Listed,
        rule: Option<&str>,
    ) -> Result<Option<ListEntry>, Error> {
        let _changing = self.inner.overrides.changing.lock().await;
        self.write_row(&list_field(listed, rule), "").await?;
        Ok(self.inner.overrides.lists.remove(listed, rule))
    }

    /// The lists, as this instance knows them (read from Redis at most
    /// one refresh ago).
    pub fn list_book(&self) -> &ListBook {
        &self.inner.overrides.lists
    }

    /// Writes a row of the table (`""`: removes it) and bumps its version.
    async fn write_row(&self, field: &str, value: &str) -> Result<(), Error> {
        let prefix = &self.inner.options.key_prefix;
        let mut write = redis::cmd("EVAL");
        write
            .arg(WRITE)
            .arg(2)
            .arg(table_key(prefix))
            .arg(version_key(prefix))
            .arg(field)
            .arg(value);
        let _: i64 = self.query(&table_key(prefix), &write).await?;
        Ok(())
    }

    /// The API keys put in a tier, as this instance knows them (read from
    /// Redis at most one refresh ago).
    pub fn tier_book(&self) -> &TierBook {
        &self.inner.overrides.tiers
    }

    /// The overrides as this instance knows them (read from Redis at most
    /// one refresh ago; [`refresh_overrides`](Self::refresh_overrides)
    /// first for Redis's own).
    pub fn overrides(&self) -> &OverrideBook {
        &self.inner.overrides.book
    }

    /// Reads the table of overrides again if its version moved since this
    /// instance last did. What every instance does each
    /// [`override_refresh`](crate::RedisOptions::override_refresh).
    pub async fn refresh_overrides(&self) -> Result<(), Error> {
        refresh(
            &self.inner.overrides,
            &self.connection,
            self.inner.options.timeout,
            &self.inner.options.key_prefix,
        )
        .await
    }

    /// What a check of `key` under `rule` sends of its overrides at `now`
    /// (µs): whether the script reads the key's own, and a prefix's that
    /// holds (whose parameters replace `params`).
    pub(crate) fn overridden(
        &self,
        rule: &spillway::store::Rule,
        key: &str,
        now: u64,
        params: &mut script::Params,
    ) -> Overridden {
        let book = &self.inner.overrides.book;
        if book.is_empty() {
            return Overridden::default();
        }
        let reads_own = book.has_keys(rule.name());
        let prefix = book.find_prefix(rule.name(), key, now).and_then(|o| {
            let (cap, view) = script_view(rule, &o).ok()?;
            if view[0] == script::CALENDAR {
                params[1] = view[1];
            } else {
                *params = view;
            }
            Some((cap, o.ends_at().unwrap_or(0)))
        });
        Overridden { reads_own, prefix }
    }

    fn rule(&self, rule: RuleId) -> Result<&spillway::store::Rule, Error> {
        self.inner.rules.get(rule.0).ok_or_else(|| {
            spillway::Error::UnknownRule {
                index: 0,
                rule: rule.0,
            }
            .into()
        })
    }

    /// Keeps this instance's copy of the overrides fresh while a store
    /// that shares it lives.
    pub(crate) fn spawn_override_refresh(&self) {
        let shared: Weak<Shared> = Arc::downgrade(&self.inner.overrides);
        let connection = self.connection.clone();
        let options = &self.inner.options;
        let (every, timeout, prefix) = (
            options.override_refresh,
            options.timeout,
            options.key_prefix.clone(),
        );
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                if let Err(e) = refresh(&shared, &connection, timeout, &prefix).await {
                    tracing::warn!(error = %e, "could not read the overrides from redis");
                }
            }
        });
    }
}

/// Reads the table again into `shared`'s book if its version moved.
async fn refresh(
    shared: &Shared,
    connection: &Connection,
    timeout: Duration,
    prefix: &str,
) -> Result<(), Error> {
    let version_key = version_key(prefix);
    let version: Option<u64> = keys::query_on(
        connection,
        timeout,
        &version_key,
        redis::cmd("GET").arg(&version_key),
    )
    .await?;
    let version = version.unwrap_or(0);
    if *shared.version.lock() == Some(version) {
        return Ok(());
    }
    let _changing = shared.changing.lock().await;
    let table = table_key(prefix);
    // Read a page at a time, each call as short as a check's (a table of
    // many entries in one call would outlast the connection's timeout and
    // hold Redis meanwhile); then the version again: a table that changed
    // while it was read is read again at the next refresh.
    let mut fields: Vec<(String, String)> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let mut scan = redis::cmd("HSCAN");
        scan.arg(&table).arg(cursor).arg("COUNT").arg(REFRESH_PAGE);
        let (next, page): (u64, Vec<(String, String)>) =
            keys::query_on(connection, timeout, &table, &scan).await?;
        fields.extend(page);
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    let after: Option<u64> = keys::query_on(
        connection,
        timeout,
        &version_key,
        redis::cmd("GET").arg(&version_key),
    )
    .await?;
    if after.unwrap_or(0) != version {
        return Ok(());
    }
    // HSCAN may return a field twice: the last read stands.
    fields.sort_by(|a, b| a.0.cmp(&b.0));
    fields.dedup_by(|later, earlier| later.0 == earlier.0);
    let mut unread = 0;
    let (mut overrides, mut tiers, mut lists) = (Vec::new(), Vec::new(), Vec::new());
    let now = crate::wall_clock_micros();
    // The rows past their time, to delete: the table does not grow for
    // ever, and a rule whose keys' own overrides all ended stops reading
    // them.
    let mut ended = Vec::new();
    for (f, v) in &fields {
        let in_force = match parse_row(f, v) {
            Some(Row::Override(rule, target, entry)) => {
                let in_force = entry.applied.in_force_at(now);
                overrides.extend(in_force.then_some((rule, target, entry)));
                in_force
            }
            Some(Row::Tier(key, entry)) => {
                let in_force = entry.in_force_at(now);
                tiers.extend(in_force.then_some((key, entry)));
                in_force
            }
            Some(Row::List(listed, entry)) => {
                let in_force = entry.in_force_at(now);
                lists.extend(in_force.then_some((listed, entry)));
                in_force
            }
            None => {
                unread += 1;
                true
            }
        };
        if !in_force {
            ended.push((f, v));
        }
    }
    // Each only if it is still what was read (not set again since), a
    // page at a time.
    for chunk in ended.chunks(REFRESH_PAGE) {
        let mut delete = redis::cmd("EVAL");
        delete
            .arg(DELETE_ENDED)
            .arg(2)
            .arg(&table)
            .arg(&version_key);
        for (f, v) in chunk {
            delete.arg(f.as_str()).arg(v.as_str());
        }
        let deleted: Result<i64, Error> =
            keys::query_on(connection, timeout, &table, &delete).await;
        if let Err(e) = deleted {
            tracing::warn!(error = %e, "could not delete the overrides that ended");
            break;
        }
    }
    if unread > 0 {
        tracing::warn!(
            unread,
            "overrides in redis this version cannot read were left out"
        );
    }
    shared.book.replace(overrides);
    shared.tiers.replace(tiers);
    shared.lists.replace(lists);
    *shared.version.lock() = Some(version);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    #[test]
    fn a_field_and_value_read_back_as_written() {
        let o = Override::limit(50_000)
            .with_burst(NonZeroU32::new(7).unwrap())
            .until(1_800_000_000_000_000);
        let entry = OverrideEntry {
            applied: o,
            spec: "{\"by\":\"ops\"}\nsecond line".into(),
        };
        let target = Target::Prefix("tenant:{a}%".into());
        let (rule, back, read) = parse(&field("api:v1", &target), &value(&entry)).unwrap();
        assert_eq!((rule.as_str(), back, read), ("api:v1", target, entry));
        let zero = OverrideEntry {
            applied: Override::limit(0).with_delay(3),
            spec: "".into(),
        };
        let key = Target::Key("k".into());
        assert_eq!(parse(&field("r", &key), &value(&zero)).unwrap().2, zero);
        assert_eq!(parse("x:r:k", "1 - - 0\n"), None);
        assert_eq!(parse("k:r:k", "1 - -\n"), None);
        assert_eq!(parse("k:r:k", "one - - 0\n"), None);
        let tier = TierEntry {
            tier: "pro plan".into(),
            until: Some(7),
            spec: "{}".into(),
        };
        let row = parse_row(&tier_field("k:1 %"), &tier_value(&tier));
        assert_eq!(row, Some(Row::Tier("k:1 %".into(), tier)));
        assert_eq!(parse_row("t:k", "pro\n{}"), None);
        for (listed, rule) in [
            (
                Listed::network("2001:db8::".parse().unwrap(), 32).unwrap(),
                None,
            ),
            (Listed::ApiKey("a:b%".into()), Some("r:1")),
            (Listed::Key("ip=1.2.3.4".into()), Some("login")),
        ] {
            let entry = ListEntry {
                allow: rule.is_some(),
                rule: rule.map(Into::into),
                status: 403,
                until: Some(9),
                spec: "{}".into(),
            };
            let row = parse_row(&list_field(&listed, rule), &list_value(&entry));
            assert_eq!(row, Some(Row::List(listed, entry)));
        }
    }
}

//! `/admin/overrides`: another quota for one key of a rule, or for every
//! key under a prefix, set at run time (see docs/runtime-limits.md).
//!
//! An override of a rule holds under each of its quotas (its default's and
//! each tier's, each keeping its own window), on every front end, and on
//! Redis on every instance. Each change is logged with the name of the
//! token that made it.

use std::sync::Arc;

use axum::Extension;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State as Extract};
use axum::response::Response;
use http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use spillway::store::{Override, OverrideEntry, RuleId, Store, Target};

use super::MAX_KEY_BYTES;
use super::admin::Caller;
use super::answer::{json_response, problem};
use super::changes::{
    MAX_PAGE, Refused, Write, bad, on_body, on_query, rfc3339, spec_of, store_failed, until_of,
    wall_micros,
};
use crate::state::{Loaded, State};

/// The body of `POST` and `PUT /admin/overrides`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    rule: String,
    key: Option<String>,
    prefix: Option<String>,
    limit: u64,
    burst: Option<u64>,
    delay: Option<u64>,
    until: Option<String>,
    ttl: Option<String>,
    reason: Option<String>,
}

/// The query of `GET` and `DELETE /admin/overrides`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Which {
    rule: Option<String>,
    key: Option<String>,
    prefix: Option<String>,
    limit: Option<usize>,
    cursor: Option<String>,
}

/// The policy rule called `rule` and its store rules (default, tiers).
fn rule_of(engine: &Loaded, rule: &str) -> Result<Vec<RuleId>, Refused> {
    let policy = engine.layer.policy();
    let Some(index) = policy.rules().iter().position(|r| r.name() == rule) else {
        return Err(bad(format!("`rule`: no rule is named `{rule}`.")));
    };
    let first = policy.rule_id(index, None).0;
    let count = 1 + policy.rules()[index].tiers().count();
    Ok((first..first + count).map(RuleId).collect())
}

/// The target a body or query names: a key or a prefix, not both.
fn target_of(key: Option<String>, prefix: Option<String>) -> Result<Option<Target>, Refused> {
    let long = |field: &str, text: &str| {
        (text.len() > MAX_KEY_BYTES).then(|| {
            bad(format!(
                "`{field}` is {} bytes long; the most is {MAX_KEY_BYTES}.",
                text.len()
            ))
        })
    };
    match (key, prefix) {
        (Some(_), Some(_)) => Err(bad(
            "`key` and `prefix`: an override is for one key or for every key under a prefix, \
             not both.",
        )),
        (Some(key), None) => match long("key", &key) {
            Some(e) => Err(e),
            None => Ok(Some(Target::Key(key.into()))),
        },
        (None, Some(prefix)) if prefix.is_empty() => Err(bad(
            "`prefix` must not be empty (an override for every key of a rule is a change of \
             its limit in the configuration).",
        )),
        (None, Some(prefix)) => match long("prefix", &prefix) {
            Some(e) => Err(e),
            None => Ok(Some(Target::Prefix(prefix.into()))),
        },
        (None, None) => Ok(None),
    }
}

/// The override a body asks for, and what is kept of it for listings.
fn override_of(body: &Body, caller: &Caller) -> Result<OverrideEntry, Refused> {
    let limit = u32::try_from(body.limit)
        .map_err(|_| bad("`limit` must be between 0 and 4294967295 (0 stops every request)."))?;
    let mut o = Override::limit(limit);
    if let Some(burst) = body.burst {
        let burst = u32::try_from(burst)
            .ok()
            .and_then(std::num::NonZeroU32::new)
            .ok_or_else(|| bad("`burst` must be between 1 and 4294967295."))?;
        o = o.with_burst(burst);
    }
    if let Some(delay) = body.delay {
        let delay = u32::try_from(delay).map_err(|_| bad("`delay` is too large."))?;
        o = o.with_delay(delay);
    }
    let now = wall_micros();
    let until = until_of(body.until.as_deref(), body.ttl.as_deref(), now)?;
    if let Some(until) = until {
        o = o.until(until);
    }
    let spec = spec_of(body.reason.as_deref(), caller, now)?;
    Ok(OverrideEntry { applied: o, spec })
}

/// An override as the API shows it.
fn shown(rule: &str, target: &Target, entry: &OverrideEntry) -> Value {
    let o = &entry.applied;
    let spec: Value = serde_json::from_str(&entry.spec).unwrap_or(Value::Null);
    let mut out = json!({
        "rule": rule,
        "limit": o.limit_of(),
        "burst": o.burst().map(|b| b.get()),
        "delay": o.delay(),
        "until": o.ends_at().map(rfc3339),
        "reason": spec.get("reason"),
        "set_by": spec.get("set_by"),
        "set_at": spec.get("set_at"),
    });
    let (field, text) = match target {
        Target::Key(k) => ("key", k),
        Target::Prefix(p) => ("prefix", p),
    };
    out[field] = json!(text.as_str());
    out
}

/// `POST /admin/overrides`: sets an override that does not exist yet (409
/// if one does for that rule and key or prefix).
pub(super) async fn create(
    Extract(state): Extract<State>,
    Extension(caller): Extension<Caller>,
    req: Request,
) -> Response {
    on_body(req, |body| async move {
        set_body(&state, &caller, &body, Write::Create)
            .await
            .map_err(Box::new)
    })
    .await
}

/// `PUT /admin/overrides`: sets an override, replacing any (201 when there
/// was none, 200 when it replaced one).
pub(super) async fn replace(
    Extract(state): Extract<State>,
    Extension(caller): Extension<Caller>,
    req: Request,
) -> Response {
    on_body(req, |body| async move {
        set_body(&state, &caller, &body, Write::Replace)
            .await
            .map_err(Box::new)
    })
    .await
}

async fn set_body(
    state: &State,
    caller: &Caller,
    body: &[u8],
    write: Write,
) -> Result<Response, Response> {
    let body: Body = serde_json::from_slice(body)
        .map_err(|e| problem(StatusCode::BAD_REQUEST, format!("Invalid override: {e}.")))?;
    let engine = state.live.current();
    let ids = rule_of(&engine, &body.rule).map_err(|r| *r)?;
    let Some(target) = target_of(body.key.clone(), body.prefix.clone()).map_err(|r| *r)? else {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "`key` or `prefix`: say which keys the override is for.",
        ));
    };
    // A key must be one the rule's requests can have, or it would never
    // be met.
    if let Target::Key(key) = &target
        && let Some(m) = engine.layer.engine().key_error(&body.rule, key)
    {
        return Err(problem(StatusCode::BAD_REQUEST, m));
    }
    let entry = override_of(&body, caller).map_err(|r| *r)?;
    // Every quota of the rule takes it, or none is changed.
    let store = engine.store();
    for &id in &ids {
        if let Err(e) = store.override_fits(id, &entry.applied) {
            let rule = &store.rules()[id.0];
            let tier = rule.name().split_once('@').map(|(_, t)| t);
            let under = tier.map_or(String::new(), |t| format!(" (the quota of tier `{t}`)"));
            let reason = match e {
                spillway_redis::Error::Check(spillway::Error::Override { reason, .. }) => reason,
                spillway_redis::Error::Rule { reason, .. } => format!("`limit`: {reason}"),
                other => other.to_string(),
            };
            return Err(problem(
                StatusCode::BAD_REQUEST,
                format!("{reason}{under}."),
            ));
        }
    }
    let book = store.overrides().await.map_err(|e| *store_failed(e))?;
    let now = wall_micros();
    let before = book
        .get(store.rules()[ids[0].0].name(), &target)
        .filter(|b| b.applied.in_force_at(now));
    let status = write.status(before.is_some()).map_err(|r| *r)?;
    for &id in &ids {
        if let Err(e) = store.set_override(id, target.clone(), entry.clone()).await {
            return Err(match e {
                spillway_redis::Error::Check(e) => {
                    problem(StatusCode::BAD_REQUEST, format!("{e}."))
                }
                spillway_redis::Error::Rule { reason, .. } => {
                    problem(StatusCode::BAD_REQUEST, format!("`limit`: {reason}."))
                }
                other => *store_failed(other),
            });
        }
    }
    let after = shown(&body.rule, &target, &entry);
    tracing::info!(
        token = %caller.name,
        rule = %body.rule,
        target = ?target,
        before = %before.as_ref().map_or(serde_json::Value::Null, |b| shown(&body.rule, &target, b)),
        after = %after,
        "admin: override set"
    );
    Ok(json_response(status, &after))
}

/// `GET /admin/overrides`: one override (`rule` and `key` or `prefix`), or
/// a page of them (of one `rule`, or of all), in order of rule, then keys
/// before prefixes, each by its text; `next` is the cursor of the next
/// page (`null` at the end).
pub(super) async fn read(
    Extract(state): Extract<State>,
    query: Result<Query<Which>, QueryRejection>,
) -> Response {
    on_query(
        query,
        |which| async move { read_which(&state, which).await },
    )
    .await
}

async fn read_which(state: &State, which: Which) -> Result<Response, Refused> {
    let engine = state.live.current();
    let store = engine.store();
    let target = target_of(which.key, which.prefix)?;
    let book = store.overrides().await.map_err(store_failed)?;
    if let Some(target) = target {
        let Some(rule) = which.rule else {
            return Err(bad("`rule`: say which rule's override."));
        };
        let ids = rule_of(&engine, &rule)?;
        let name = store.rules()[ids[0].0].name();
        return match book.get(name, &target) {
            Some(entry) if entry.applied.in_force_at(wall_micros()) => Ok(json_response(
                StatusCode::OK,
                &shown(&rule, &target, &entry),
            )),
            _ => Ok(problem(
                StatusCode::NOT_FOUND,
                "No override for this rule and key or prefix.",
            )),
        };
    }
    let limit = which.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(bad(format!("`limit` must be between 1 and {MAX_PAGE}.")));
    }
    let policy = engine.layer.policy();
    let rules: Vec<String> = match &which.rule {
        Some(rule) => {
            rule_of(&engine, rule)?;
            vec![rule.clone()]
        }
        None => policy
            .rules()
            .iter()
            .map(|r| r.name().to_string())
            .collect(),
    };
    let after = match which.cursor.as_deref() {
        None | Some("") => None,
        Some(c) => Some(cursor_from(c).ok_or_else(|| bad("`cursor` is not one a page gave."))?),
    };
    let now = wall_micros();
    let mut rules = rules;
    rules.sort();
    let mut page = Vec::new();
    let mut next = None;
    'rules: for rule in &rules {
        if after.as_ref().is_some_and(|(r, _)| r > rule) {
            continue;
        }
        // An override is set under each quota of its rule alike: the
        // default quota's stand for all.
        let ids = rule_of(&engine, rule)?;
        for (target, entry) in book.list(store.rules()[ids[0].0].name(), now) {
            if after
                .as_ref()
                .is_some_and(|(r, t)| (r.as_str(), t) >= (rule.as_str(), &target))
            {
                continue;
            }
            if page.len() == limit {
                next = page
                    .last()
                    .map(|(r, t, _): &(String, Target, Value)| cursor(r, t));
                break 'rules;
            }
            let shown = shown(rule, &target, &entry);
            page.push((rule.clone(), target, shown));
        }
    }
    let overrides: Vec<Value> = page.into_iter().map(|(_, _, v)| v).collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({ "overrides": overrides, "next": next }),
    ))
}

/// A listing's cursor after `target` of `rule`: `k:` or `p:`, the rule,
/// `:`, the text, each with `%` and `:` escaped.
fn cursor(rule: &str, target: &Target) -> String {
    let escaped = |s: &str| s.replace('%', "%25").replace(':', "%3A");
    let (kind, text) = match target {
        Target::Key(k) => ("k", k.as_str()),
        Target::Prefix(p) => ("p", p.as_str()),
    };
    format!("{kind}:{}:{}", escaped(rule), escaped(text))
}

fn cursor_from(c: &str) -> Option<(String, Target)> {
    let unescaped = |s: &str| s.replace("%3A", ":").replace("%25", "%");
    let mut parts = c.splitn(3, ':');
    let (kind, rule, text) = (parts.next()?, parts.next()?, parts.next()?);
    let text = unescaped(text);
    let target = match kind {
        "k" => Target::Key(text.into()),
        "p" => Target::Prefix(text.into()),
        _ => return None,
    };
    Some((unescaped(rule), target))
}

/// `DELETE /admin/overrides?rule=R&key=K` (or `&prefix=P`): removes an
/// override; its keys keep their count under the rule's quota.
pub(super) async fn remove(
    Extract(state): Extract<State>,
    Extension(caller): Extension<Caller>,
    query: Result<Query<Which>, QueryRejection>,
) -> Response {
    on_query(query, |which| async move {
        remove_which(&state, &caller, which).await
    })
    .await
}

async fn remove_which(state: &State, caller: &Caller, which: Which) -> Result<Response, Refused> {
    if which.limit.is_some() || which.cursor.is_some() {
        return Err(bad("`limit` and `cursor` are a listing's."));
    }
    let Some(rule) = which.rule else {
        return Err(bad("`rule`: say which rule's override."));
    };
    let Some(target) = target_of(which.key, which.prefix)? else {
        return Err(bad("`key` or `prefix`: say which override."));
    };
    let engine = state.live.current();
    let ids = rule_of(&engine, &rule)?;
    let store = engine.store();
    // What Redis holds, not what this instance last read: the answer and
    // the log say what was removed.
    store.overrides().await.map_err(store_failed)?;
    let mut removed = None;
    for &id in &ids {
        let gone = store
            .remove_override(id, &target)
            .await
            .map_err(store_failed)?;
        removed = removed.or(gone);
    }
    let Some(removed) = removed else {
        return Ok(problem(
            StatusCode::NOT_FOUND,
            "No override for this rule and key or prefix.",
        ));
    };
    let shown: Arc<Value> = Arc::new(shown(&rule, &target, &removed));
    tracing::info!(
        token = %caller.name,
        rule = %rule,
        target = ?target,
        before = %shown,
        "admin: override removed"
    );
    Ok(json_response(StatusCode::OK, &json!({ "removed": *shown })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_whatever_the_text() {
        for (rule, target) in [
            ("api", Target::Key("api_key=a:b%3A".into())),
            ("r:x", Target::Prefix("%25:".into())),
        ] {
            assert_eq!(
                cursor_from(&cursor(rule, &target)),
                Some((rule.to_string(), target))
            );
        }
        assert_eq!(cursor_from("x:r:k"), None);
        assert_eq!(cursor_from("k:r"), None);
    }
}

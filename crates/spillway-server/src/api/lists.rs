//! `/admin/lists`: block and allow entries set at run time, for a client
//! address or network, an API key, or one rule's key. A block refuses the
//! request at once (403 or 429) without counting it; an allow lets it past
//! one rule, or every rule. Read by each request from this instance's copy
//! (no round trip); on Redis shared by every instance within a refresh.

use axum::Extension;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State as Extract};
use axum::response::Response;
use http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use spillway::store::{ListEntry, Listed};
use spillway_tower::key::api_key_spellings;

use super::MAX_KEY_BYTES;
use super::admin::Caller;
use super::answer::{json_response, problem};
use super::changes::{
    MAX_PAGE, Refused, Write, alias_of, bad, not_an_alias, on_body, on_query, rfc3339, spec_of,
    store_failed, until_of, wall_micros,
};
use crate::state::{Loaded, State};

/// The body of `POST` and `PUT /admin/lists`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    list: String,
    ip: Option<String>,
    api_key: Option<String>,
    key: Option<String>,
    rule: Option<String>,
    status: Option<u16>,
    until: Option<String>,
    ttl: Option<String>,
    reason: Option<String>,
}

/// What an entry names, and its rule.
#[derive(Debug)]
struct Named {
    ip: Option<String>,
    api_key: Option<String>,
    key: Option<String>,
    rule: Option<String>,
}

/// The query of `GET` and `DELETE /admin/lists`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Which {
    ip: Option<String>,
    api_key: Option<String>,
    key: Option<String>,
    rule: Option<String>,
    limit: Option<usize>,
    cursor: Option<String>,
}

/// What `named` names, checked: one of an address or network, an API key,
/// or a key of its rule; and the rule, one of the configuration's. `None`
/// when it names nothing (a listing).
fn listed_of(engine: &Loaded, named: &Named) -> Result<Option<(Listed, Option<String>)>, Refused> {
    if let Some(rule) = &named.rule
        && !engine
            .layer
            .policy()
            .rules()
            .iter()
            .any(|r| r.name() == rule)
    {
        return Err(bad(format!("`rule`: no rule is named `{rule}`.")));
    }
    let long = |field: &str, text: &str| {
        if text.is_empty() {
            return Err(bad(format!("`{field}` must not be empty.")));
        }
        if text.len() > MAX_KEY_BYTES {
            return Err(bad(format!(
                "`{field}` is {} bytes long; the most is {MAX_KEY_BYTES}.",
                text.len()
            )));
        }
        Ok(())
    };
    let listed = match (&named.ip, &named.api_key, &named.key) {
        (None, None, None) => return Ok(None),
        (Some(ip), None, None) => {
            let (addr, len) = match ip.parse::<ipnet::IpNet>() {
                Ok(net) => (net.addr(), net.prefix_len()),
                Err(_) => match ip.parse::<std::net::IpAddr>() {
                    Ok(addr) => (addr, if addr.is_ipv4() { 32 } else { 128 }),
                    Err(_) => {
                        return Err(bad(format!(
                            "`ip`: `{ip}` is not an address or a network like 192.0.2.0/24 or \
                             2001:db8::/32."
                        )));
                    }
                },
            };
            // An IPv4-mapped network is its IPv4 one, as clients are.
            let (addr, len) = match addr {
                std::net::IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() && len >= 96 => {
                    (addr, len)
                }
                std::net::IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
                    return Err(bad(format!(
                        "`ip`: `{ip}` spans IPv4-mapped and other IPv6 addresses; name the IPv4 \
                         network."
                    )));
                }
                _ => (addr, len),
            };
            let len = match addr {
                std::net::IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => len - 96,
                _ => len,
            };
            let listed =
                Listed::network(addr, len).ok_or_else(|| bad("`ip`: bad prefix length."))?;
            (listed, named.rule.clone())
        }
        (None, Some(k), None) => {
            long("api_key", k)?;
            if k.chars().any(|c| c.is_control() || c == ' ' || c == ',') {
                return Err(bad(
                    "`api_key` holds a space, a comma or a control character: no request \
                     carries such a key as one value.",
                ));
            }
            (Listed::ApiKey(k.as_str().into()), named.rule.clone())
        }
        (None, None, Some(k)) => {
            long("key", k)?;
            let Some(rule) = &named.rule else {
                return Err(bad("`key` is one rule's: say which `rule`."));
            };
            if let Some(m) = engine.layer.engine().key_error(rule, k) {
                return Err(bad(m));
            }
            (Listed::Key(k.as_str().into()), Some(rule.clone()))
        }
        _ => {
            return Err(bad(
                "`ip`, `api_key` and `key`: an entry names one of them, not several.",
            ));
        }
    };
    Ok(Some(listed))
}

/// The spellings an entry is stored under: an API key's each (as a
/// header and as a bearer token carry it), anything else's one.
fn spellings(listed: &Listed) -> Vec<Listed> {
    match listed {
        Listed::ApiKey(k) => api_key_spellings(k)
            .into_iter()
            .map(|s| Listed::ApiKey(s.into()))
            .collect(),
        other => vec![other.clone()],
    }
}

/// An entry as the API shows it.
fn shown(listed: &Listed, entry: &ListEntry) -> Value {
    let spec: Value = serde_json::from_str(&entry.spec).unwrap_or(Value::Null);
    let mut out = json!({
        "list": if entry.allow { "allow" } else { "block" },
        "rule": entry.rule.as_deref(),
        "status": (!entry.allow).then_some(entry.status),
        "until": entry.until.map(rfc3339),
        "reason": spec.get("reason"),
        "set_by": spec.get("set_by"),
        "set_at": spec.get("set_at"),
    });
    match listed {
        Listed::Ip { addr, len } => out["ip"] = json!(format!("{addr}/{len}")),
        Listed::ApiKey(k) => out["api_key"] = json!(&**k),
        Listed::Key(k) => out["key"] = json!(&**k),
    }
    out
}

/// Whether an entry is another spelling's (not listed on its own).
fn is_alias(entry: &ListEntry) -> bool {
    alias_of(&entry.spec).is_some()
}

/// A listing's order, and its cursor: what an entry names, then its rule.
fn place(listed: &Listed, rule: Option<&str>) -> String {
    let named = match listed {
        Listed::Ip { addr, len } => format!("i {addr}/{len}"),
        Listed::ApiKey(k) => format!("a {k}"),
        Listed::Key(k) => format!("k {k}"),
    };
    format!("{named}\u{1f}{}", rule.unwrap_or(""))
}

/// `POST /admin/lists`: sets an entry that does not exist yet (409 if
/// one does for what it names and its rule).
pub(super) async fn create(
    Extract(state): Extract<State>,
    Extension(caller): Extension<Caller>,
    req: Request,
) -> Response {
    on_body(req, |body| async move {
        set_body(&state, &caller, &body, Write::Create).await
    })
    .await
}

/// `PUT /admin/lists`: sets an entry, replacing any.
pub(super) async fn replace(
    Extract(state): Extract<State>,
    Extension(caller): Extension<Caller>,
    req: Request,
) -> Response {
    on_body(req, |body| async move {
        set_body(&state, &caller, &body, Write::Replace).await
    })
    .await
}

async fn set_body(
    state: &State,
    caller: &Caller,
    body: &[u8],
    write: Write,
) -> Result<Response, Refused> {
    let body: Body =
        serde_json::from_slice(body).map_err(|e| bad(format!("Invalid entry: {e}.")))?;
    let allow = match body.list.as_str() {
        "allow" => true,
        "block" => false,
        other => {
            return Err(bad(format!(
                "`list` must be `block` or `allow`, not `{other}`."
            )));
        }
    };
    let status = match (allow, body.status) {
        (true, Some(_)) => return Err(bad("`status` is a block's: an allow refuses nothing.")),
        (true, None) | (false, None) => 403,
        (false, Some(s @ (403 | 429))) => s,
        (false, Some(other)) => {
            return Err(bad(format!("`status` must be 403 or 429, not {other}.")));
        }
    };
    let engine = state.live.current();
    let named = Named {
        ip: body.ip.clone(),
        api_key: body.api_key.clone(),
        key: body.key.clone(),
        rule: body.rule.clone(),
    };
    let Some((listed, rule)) = listed_of(&engine, &named)? else {
        return Err(bad("`ip`, `api_key` or `key`: say what the entry names."));
    };
    let now = wall_micros();
    let until = until_of(body.until.as_deref(), body.ttl.as_deref(), now)?;
    let spec = spec_of(body.reason.as_deref(), caller, now)?;
    let entry = ListEntry {
        allow,
        rule: rule.as_deref().map(Into::into),
        status,
        until,
        spec,
    };
    let store = engine.store();
    let book = store.list_book().await.map_err(store_failed)?;
    let found = book
        .get(&listed, rule.as_deref())
        .filter(|e| e.in_force_at(now));
    not_an_alias(found.as_ref().map(|e| &*e.spec))?;
    let before = found;
    let status = write.status(before.is_some())?;
    for (i, spelling) in spellings(&listed).into_iter().enumerate() {
        let mut entry = entry.clone();
        if i > 0 {
            let Listed::ApiKey(key) = &listed else {
                unreachable!("only an API key has other spellings")
            };
            entry.spec = json!({ "alias_of": &**key }).to_string().into();
        }
        store
            .set_listed(spelling, entry)
            .await
            .map_err(store_failed)?;
    }
    let after = shown(&listed, &entry);
    tracing::info!(
        token = %caller.name,
        before = %before.as_ref().map_or(serde_json::Value::Null, |b| shown(&listed, b)),
        after = %after,
        "admin: list entry set"
    );
    Ok(json_response(status, &after))
}

/// `GET /admin/lists`: one entry (`ip`, `api_key` or `key`, and `rule`
/// for one rule's), or a page of them in order of what they name, then
/// rule; `next` is the cursor of the next page (`null` at the end).
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

fn named_of(which: &Which) -> Named {
    Named {
        ip: which.ip.clone(),
        api_key: which.api_key.clone(),
        key: which.key.clone(),
        rule: which.rule.clone(),
    }
}

async fn read_which(state: &State, which: Which) -> Result<Response, Refused> {
    let engine = state.live.current();
    let book = engine.store().list_book().await.map_err(store_failed)?;
    let now = wall_micros();
    if let Some((listed, rule)) = listed_of(&engine, &named_of(&which))? {
        if which.limit.is_some() || which.cursor.is_some() {
            return Err(bad("`limit` and `cursor` are a listing's."));
        }
        return Ok(
            match book
                .get(&listed, rule.as_deref())
                .filter(|e| e.in_force_at(now) && !is_alias(e))
            {
                Some(entry) => json_response(StatusCode::OK, &shown(&listed, &entry)),
                None => problem(StatusCode::NOT_FOUND, "No entry for this."),
            },
        );
    }
    let limit = which.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(bad(format!("`limit` must be between 1 and {MAX_PAGE}.")));
    }
    let after = which.cursor.filter(|c| !c.is_empty());
    let mut all: Vec<(String, Value)> = book
        .list(now)
        .into_iter()
        .filter(|(_, e)| !is_alias(e))
        .filter(|(_, e)| which.rule.is_none() || e.rule.as_deref() == which.rule.as_deref())
        .map(|(l, e)| (place(&l, e.rule.as_deref()), shown(&l, &e)))
        .filter(|(p, _)| after.as_ref().is_none_or(|a| p > a))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let next = (all.len() > limit).then(|| all[limit - 1].0.clone());
    all.truncate(limit);
    let entries: Vec<Value> = all.into_iter().map(|(_, v)| v).collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({ "entries": entries, "next": next }),
    ))
}

/// `DELETE /admin/lists?...`: removes an entry (named as for `GET`).
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
    let engine = state.live.current();
    let Some((listed, rule)) = listed_of(&engine, &named_of(&which))? else {
        return Err(bad("`ip`, `api_key` or `key`: say which entry."));
    };
    let store = engine.store();
    // What the store holds, not what this instance last read.
    let book = store.list_book().await.map_err(store_failed)?;
    not_an_alias(
        book.get(&listed, rule.as_deref())
            .as_ref()
            .map(|e| &*e.spec),
    )?;
    let mut removed = None;
    for spelling in spellings(&listed) {
        let gone = store
            .remove_listed(&spelling, rule.as_deref())
            .await
            .map_err(store_failed)?;
        if removed.is_none() {
            removed = gone.filter(|e| !is_alias(e));
        }
    }
    let Some(removed) = removed else {
        return Ok(problem(StatusCode::NOT_FOUND, "No entry for this."));
    };
    let shown = shown(&listed, &removed);
    tracing::info!(token = %caller.name, before = %shown, "admin: list entry removed");
    Ok(json_response(StatusCode::OK, &json!({ "removed": shown })))
}

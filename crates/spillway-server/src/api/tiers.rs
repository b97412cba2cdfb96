//! `/admin/tiers`: an API key put in a tier at run time, ahead of the
//! configuration's `[tiers]` table (a tier a trusted layer names still
//! wins), in memory for this process or on Redis for every instance.
//!
//! A key is stored under each spelling a request can carry it in
//! ([`api_key_spellings`]): as a header sends it and as the bearer token
//! that reads the same; the listing shows the one given.

use axum::Extension;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State as Extract};
use axum::response::Response;
use http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use spillway::store::TierEntry;
use spillway_tower::key::api_key_spellings;

use super::MAX_KEY_BYTES;
use super::admin::Caller;
use super::answer::{json_response, problem};
use super::changes::{
    MAX_PAGE, Refused, Write, alias_of, bad, not_an_alias, on_body, on_query, rfc3339, spec_of,
    store_failed, until_of, wall_micros,
};
use crate::state::State;

/// The body of `POST` and `PUT /admin/tiers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    api_key: String,
    tier: String,
    until: Option<String>,
    ttl: Option<String>,
    reason: Option<String>,
}

/// The query of `GET` and `DELETE /admin/tiers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Which {
    api_key: Option<String>,
    limit: Option<usize>,
    cursor: Option<String>,
}

/// An API key as the API takes it: not empty, at most `MAX_KEY_BYTES`, no
/// control characters (no request header carries one).
fn api_key_of(key: &str) -> Result<(), Refused> {
    if key.is_empty() {
        return Err(bad("`api_key` must not be empty."));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(bad(format!(
            "`api_key` is {} bytes long; the most is {MAX_KEY_BYTES}.",
            key.len()
        )));
    }
    if key.chars().any(char::is_control) {
        return Err(bad(
            "`api_key` holds a control character, which no request header carries.",
        ));
    }
    Ok(())
}

/// An entry as the API shows it.
fn shown(api_key: &str, entry: &TierEntry) -> Value {
    let spec: Value = serde_json::from_str(&entry.spec).unwrap_or(Value::Null);
    json!({
        "api_key": api_key,
        "tier": &*entry.tier,
        "until": entry.until.map(rfc3339),
        "reason": spec.get("reason"),
        "set_by": spec.get("set_by"),
        "set_at": spec.get("set_at"),
    })
}

/// Whether an entry is another spelling's (not listed on its own).
fn is_alias(entry: &TierEntry) -> bool {
    alias_of(&entry.spec).is_some()
}

/// `POST /admin/tiers`: puts a key in a tier it is in no tier yet by
/// (409 if it was put in one).
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

/// `PUT /admin/tiers`: puts a key in a tier, replacing any (201 when it
/// was in none, 200 when it replaced one).
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
        serde_json::from_slice(body).map_err(|e| bad(format!("Invalid tier: {e}.")))?;
    api_key_of(&body.api_key)?;
    let engine = state.live.current();
    let policy = engine.layer.policy();
    if body.tier.chars().any(char::is_control) {
        return Err(bad("`tier` holds a control character."));
    }
    let known = policy
        .rules()
        .iter()
        .any(|r| r.tiers().any(|t| t == body.tier));
    if !known {
        return Err(bad(format!(
            "`tier`: no rule has a quota for a tier named `{}`.",
            body.tier
        )));
    }
    let now = wall_micros();
    let until = until_of(body.until.as_deref(), body.ttl.as_deref(), now)?;
    let spec = spec_of(body.reason.as_deref(), caller, now)?;
    let store = engine.store();
    let book = store.tier_book().await.map_err(store_failed)?;
    let found = book.get(&body.api_key).filter(|e| e.in_force_at(now));
    not_an_alias(found.as_ref().map(|e| &*e.spec))?;
    let before = found;
    let status = write.status(before.is_some())?;
    let entry = TierEntry {
        tier: body.tier.as_str().into(),
        until,
        spec,
    };
    for (i, spelling) in api_key_spellings(&body.api_key).into_iter().enumerate() {
        let mut entry = entry.clone();
        if i > 0 {
            entry.spec = json!({ "alias_of": body.api_key }).to_string().into();
        }
        store
            .set_tier(&spelling, entry)
            .await
            .map_err(store_failed)?;
    }
    let after = shown(&body.api_key, &entry);
    tracing::info!(
        token = %caller.name,
        api_key = %body.api_key,
        before = %before.as_ref().map_or(serde_json::Value::Null, |b| shown(&body.api_key, b)),
        after = %after,
        "admin: tier set"
    );
    Ok(json_response(status, &after))
}

/// `GET /admin/tiers`: one key's tier (`api_key`), or a page of the keys
/// put in a tier, by key; `next` is the cursor of the next page (`null`
/// at the end).
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
    let book = engine.store().tier_book().await.map_err(store_failed)?;
    let now = wall_micros();
    if let Some(key) = which.api_key {
        if which.limit.is_some() || which.cursor.is_some() {
            return Err(bad(
                "`limit` and `cursor` are a listing's, not `api_key`'s.",
            ));
        }
        return Ok(
            match book
                .get(&key)
                .filter(|e| e.in_force_at(now) && !is_alias(e))
            {
                Some(entry) => json_response(StatusCode::OK, &shown(&key, &entry)),
                None => problem(StatusCode::NOT_FOUND, "This API key was put in no tier."),
            },
        );
    }
    let limit = which.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(bad(format!("`limit` must be between 1 and {MAX_PAGE}.")));
    }
    let after = which.cursor.filter(|c| !c.is_empty());
    let mut page = Vec::new();
    let mut next = None;
    for (key, entry) in book.list(now) {
        if is_alias(&entry) || after.as_ref().is_some_and(|a| key.as_str() <= a.as_str()) {
            continue;
        }
        if page.len() == limit {
            next = page.last().map(|(k, _): &(String, Value)| k.clone());
            break;
        }
        let shown = shown(&key, &entry);
        page.push((key, shown));
    }
    let tiers: Vec<Value> = page.into_iter().map(|(_, v)| v).collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({ "tiers": tiers, "next": next }),
    ))
}

/// `DELETE /admin/tiers?api_key=K`: takes a key out of the tier it was
/// put in; its requests count under the configuration's tier again.
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
    let Some(key) = which.api_key else {
        return Err(bad("`api_key`: say which key."));
    };
    api_key_of(&key)?;
    let engine = state.live.current();
    let store = engine.store();
    // What Redis holds, not what this instance last read.
    let book = store.tier_book().await.map_err(store_failed)?;
    not_an_alias(book.get(&key).as_ref().map(|e| &*e.spec))?;
    let mut removed = None;
    for spelling in api_key_spellings(&key) {
        let gone = store.remove_tier(&spelling).await.map_err(store_failed)?;
        if removed.is_none() {
            removed = gone.filter(|e| !is_alias(e));
        }
    }
    let Some(removed) = removed else {
        return Ok(problem(
            StatusCode::NOT_FOUND,
            "This API key was put in no tier.",
        ));
    };
    let shown = shown(&key, &removed);
    tracing::info!(token = %caller.name, api_key = %key, before = %shown, "admin: tier removed");
    Ok(json_response(StatusCode::OK, &json!({ "removed": shown })))
}

//! The admin API under `/admin`: list the rules and the keys a rule holds,
//! inspect and reset a key, behind the admin token.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Query, Request, State as Extract};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use http::{HeaderValue, StatusCode};
use serde_json::json;
use sha2::{Digest, Sha256};
use spillway::store::{Check, RuleId, Store};

use crate::state::Loaded;
use crate::state::State;

use super::answer::{json_response, ms, not_found, problem, unavailable};

/// Compares two secrets in time independent of where they differ: their
/// SHA-256 digests are compared byte by byte without stopping early.
pub(super) fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    let (a, b) = (Sha256::digest(given), Sha256::digest(expected));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// Who called the admin API: the name of the token it gave, and whether
/// that token may change anything.
#[derive(Debug, Clone)]
pub(super) struct Caller {
    pub(super) name: std::sync::Arc<str>,
    pub(super) write: bool,
}

/// Lets in a request with one of the admin tokens, as a [`Caller`]; a
/// read-only token only reads (`GET`, `HEAD`: 403 otherwise).
pub(super) async fn authorize(
    Extract(state): Extract<State>,
    mut req: Request,
    next: Next,
) -> Response {
    let loaded = state.live.current();
    let server = &loaded.config.server;
    // Without a token the admin API does not exist.
    if server.admin_token.is_none() && server.admin_tokens.is_empty() {
        return not_found().await;
    }
    let given = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, credentials) = v.trim().split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| credentials.trim())
        });
    // Every token is compared, so that the time taken does not say which
    // one was near.
    let mut caller = None;
    if let Some(given) = given {
        let unnamed = server
            .admin_token
            .iter()
            .map(|t| ("admin", t.as_str(), true));
        let named = server
            .admin_tokens
            .iter()
            .map(|t| (t.name.as_str(), t.token.as_str(), t.write));
        for (name, token, write) in unnamed.chain(named) {
            if same_secret(given.as_bytes(), token.as_bytes()) && caller.is_none() {
                caller = Some(Caller {
                    name: name.into(),
                    write,
                });
            }
        }
    }
    match caller {
        Some(caller) => {
            let reads = matches!(*req.method(), http::Method::GET | http::Method::HEAD);
            if !reads && !caller.write {
                return problem(
                    StatusCode::FORBIDDEN,
                    format!(
                        "The token `{}` is read-only: this needs a read_write token.",
                        caller.name
                    ),
                );
            }
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        None => {
            let mut res = problem(
                StatusCode::UNAUTHORIZED,
                "The admin API needs `Authorization: Bearer <admin_token>`.",
            );
            res.headers_mut().insert(
                WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"spillway-admin\""),
            );
            res
        }
    }
}

/// What an admin path names: the engine, the rule, the key, and the
/// rule's store rules (with their tiers).
type AdminTarget = (
    std::sync::Arc<Loaded>,
    String,
    String,
    Vec<(RuleId, Option<String>)>,
);

/// The target of an admin path. A rule is a configured one or a limit
/// override the Envoy service counts (`envoy-override:5-per-minute`).
fn admin_target(
    state: &State,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<AdminTarget, Box<Response>> {
    let (rule, key) = match path {
        Ok(Path(p)) => p,
        Err(rejection) => {
            return Err(Box::new(problem(rejection.status(), rejection.body_text())));
        }
    };
    let engine = state.live.current();
    let targets = match rule_index(&engine, &rule) {
        Some(index) => store_rules_of(&engine, index),
        None => match engine.override_named(&rule) {
            Some(id) => vec![(id, None)],
            None => {
                return Err(Box::new(problem(
                    StatusCode::NOT_FOUND,
                    format!("No rule named `{rule}`."),
                )));
            }
        },
    };
    Ok((engine, rule, key, targets))
}

pub(super) async fn key(
    Extract(state): Extract<State>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (engine, rule, key, targets) = match admin_target(&state, path) {
        Ok(target) => target,
        Err(response) => return *response,
    };
    let mut quotas = Vec::new();
    for (id, tier) in targets {
        // Cost 0: a peek that charges nothing and leaves no state behind.
        let peek = [Check {
            rule: id,
            key: &key,
            cost: 0,
        }];
        let d = match engine.store().check(&peek).await {
            // Its failure policy admitted the peek: nothing is known.
            Ok(verdict) if !verdict.is_decided(0) => {
                return unavailable("The store could not answer: its state is unknown.")
                    .into_response();
            }
            Ok(verdict) => verdict.decisions[0],
            Err(e) => {
                return unavailable(format!("The store could not answer: {e}.")).into_response();
            }
        };
        let held = match holds(&engine, id, &key).await {
            Ok(held) => held,
            Err(response) => return *response,
        };
        quotas.push(json!({
            "store_rule": engine.store().rules()[id.0].name(),
            "tier": tier,
            "held": held,
            "limit": d.limit,
            "remaining": d.remaining,
            "reset_after_ms": ms(d.reset_after),
            "refill_after_ms": ms(d.refill_after),
        }));
    }
    let held = quotas.iter().any(|q| q["held"] == true);
    json_response(
        StatusCode::OK,
        &json!({ "rule": rule, "key": key, "held": held, "quotas": quotas }),
    )
}

/// Whether the store holds `key` under store rule `id`: has counted any of
/// its quota that has not come back.
async fn holds(engine: &Loaded, id: RuleId, key: &str) -> Result<bool, Box<Response>> {
    let store = engine.store();
    match (store.memory(), store.redis()) {
        (Some(memory), _) => Ok(memory.holds(id, key)),
        (None, Some(redis)) => redis.holds(id, key).await.map_err(|e| {
            Box::new(unavailable(format!("The store could not answer: {e}.")).into_response())
        }),
        (None, None) => Ok(false),
    }
}

/// `GET /admin/rules`: every rule, in the configuration's order, with its
/// quotas (the default, then each tier's) and, in memory, how many keys
/// each holds.
pub(super) async fn rules(Extract(state): Extract<State>) -> Response {
    let engine = state.live.current();
    let policy = engine.layer.policy();
    let store = engine.store();
    let rules: Vec<_> = policy
        .rules()
        .iter()
        .enumerate()
        .map(|(index, rule)| {
            let quotas: Vec<_> = store_rules_of(&engine, index)
                .into_iter()
                .map(|(id, tier)| {
                    let r = &store.rules()[id.0];
                    let a = r.algorithm();
                    let quota = spillway::Algorithm::quota(a);
                    let mode = match a {
                        spillway::algorithm::AnyAlgorithm::LeakyBucket(b) => Some(match b.mode() {
                            spillway::algorithm::LeakyMode::Shape => "shape",
                            spillway::algorithm::LeakyMode::Police => "police",
                        }),
                        _ => None,
                    };
                    json!({
                        "store_rule": r.name(),
                        "tier": tier,
                        "algorithm": a.name(),
                        "limit": quota.limit().get(),
                        "window_ms": ms(quota.period()),
                        "capacity": spillway::Algorithm::capacity(a),
                        "mode": mode,
                        "held_keys": store.memory().map(|m| m.len(id)),
                    })
                })
                .collect();
            json!({
                "name": rule.name(),
                "action": rule.on_deny().name(),
                "quotas": quotas,
            })
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({ "store": if store.memory().is_some() { "memory" } else { "redis" }, "rules": rules }),
    )
}

/// The query of a key listing.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Listing {
    /// The most keys a page holds: 1 to 1000, 100 when absent.
    limit: Option<usize>,
    /// Where the page before ended (its `next`).
    cursor: Option<String>,
}

/// The most keys one page of a listing holds.
const MAX_PAGE: usize = 1000;

/// `GET /admin/rules/{rule}/keys`: a page of the keys the rule holds,
/// under each of its quotas in turn, and the cursor of the next page
/// (`null` at the end). In memory a page is full unless it is the last; on
/// Redis it is one `SCAN` step, which may be shorter (even empty) before
/// the end.
pub(super) async fn keys(
    Extract(state): Extract<State>,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<Listing>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let rule = match path {
        Ok(Path(rule)) => rule,
        Err(rejection) => return problem(rejection.status(), rejection.body_text()),
    };
    let Listing { limit, cursor } = match query {
        Ok(Query(q)) => q,
        Err(rejection) => return problem(StatusCode::BAD_REQUEST, rejection.body_text()),
    };
    let limit = limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return problem(
            StatusCode::BAD_REQUEST,
            format!("`limit` must be between 1 and {MAX_PAGE}."),
        );
    }
    let engine = state.live.current();
    let Some(index) = rule_index(&engine, &rule) else {
        return problem(StatusCode::NOT_FOUND, format!("No rule named `{rule}`."));
    };
    let quotas = store_rules_of(&engine, index);
    // `QUOTA.WHERE`: the quota's place among the rule's, and where in it.
    let bad_cursor = || problem(StatusCode::BAD_REQUEST, "`cursor` is not one a page gave.");
    let (mut at, mut inner) = match cursor.as_deref() {
        None | Some("") => (0, String::new()),
        Some(c) => match c
            .split_once('.')
            .and_then(|(q, rest)| Some((q.parse::<usize>().ok()?, rest)))
        {
            Some((q, rest)) if q < quotas.len() => (q, rest.to_string()),
            _ => return bad_cursor(),
        },
    };
    let store = engine.store();
    let mut page = Vec::new();
    let next = loop {
        let (id, tier) = &quotas[at];
        let (found, more) = match (store.memory(), store.redis()) {
            (Some(memory), _) => {
                let after = (!inner.is_empty()).then_some(inner.as_str());
                let (found, more) = memory.keys(*id, after, limit - page.len());
                let last = found.last().cloned();
                (found, more.then(|| last.unwrap_or_default()))
            }
            (None, Some(redis)) => {
                let Ok(cursor) = (if inner.is_empty() {
                    Ok(Default::default())
                } else {
                    inner.parse()
                }) else {
                    return bad_cursor();
                };
                match redis.keys(*id, cursor, limit - page.len()).await {
                    Ok((found, next)) => (found, next.map(|c| c.to_string())),
                    Err(e) => {
                        return unavailable(format!("The store could not list the keys: {e}."))
                            .into_response();
                    }
                }
            }
            (None, None) => (Vec::new(), None),
        };
        page.extend(
            found
                .into_iter()
                .map(|key| json!({ "key": key, "tier": tier })),
        );
        match more {
            Some(rest) => break Some(format!("{at}.{rest}")),
            None if at + 1 < quotas.len() => {
                at += 1;
                inner.clear();
                // A Redis page is one step: the next quota is the next page's.
                if store.memory().is_none() || page.len() == limit {
                    break Some(format!("{at}."));
                }
            }
            None => break None,
        }
    };
    json_response(
        StatusCode::OK,
        &json!({ "rule": rule, "keys": page, "next": next }),
    )
}

pub(super) async fn reset(
    Extract(state): Extract<State>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (engine, rule, key, targets) = match admin_target(&state, path) {
        Ok(target) => target,
        Err(response) => return *response,
    };
    let mut reset = Vec::new();
    let mut held = false;
    for (id, _) in targets {
        let store = engine.store();
        held |= match (store.memory(), store.redis()) {
            (Some(memory), _) => memory.reset(id, &key),
            (None, Some(redis)) => match redis.reset(id, &key).await {
                Ok(held) => held,
                Err(e) => {
                    return unavailable(format!("The store could not reset the key: {e}."))
                        .into_response();
                }
            },
            (None, None) => false,
        };
        reset.push(store.rules()[id.0].name().to_string());
    }
    tracing::info!(rule = %rule, key = %key, held, "admin: key reset");
    json_response(
        StatusCode::OK,
        &json!({ "rule": rule, "key": key, "reset": reset, "held": held }),
    )
}

/// The store rules of HTTP rule `index`: its default quota, then one per
/// tier, with the tier's name (see `Policy::store_rules`).
fn store_rules_of(engine: &Loaded, index: usize) -> Vec<(RuleId, Option<String>)> {
    let policy = engine.layer.policy();
    let name = policy.rules()[index].name();
    let start = policy.rule_id(index, None).0;
    let end = if index + 1 < policy.rules().len() {
        policy.rule_id(index + 1, None).0
    } else {
        // Not the store's count: rules of the Envoy service's limit
        // overrides may follow the policy's.
        policy.store_rules().len()
    };
    let prefix = format!("{name}@");
    (start..end)
        .map(|i| {
            let tier = engine.store().rules()[i]
                .name()
                .strip_prefix(&prefix)
                .map(str::to_string);
            (RuleId(i), tier)
        })
        .collect()
}

fn rule_index(engine: &Loaded, rule: &str) -> Option<usize> {
    engine
        .layer
        .policy()
        .rules()
        .iter()
        .position(|r| r.name() == rule)
}

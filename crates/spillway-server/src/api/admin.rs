//! The admin API under `/admin`: inspect and reset a key, behind the
//! admin token.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Request, State as Extract};
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

pub(super) async fn authorize(
    Extract(state): Extract<State>,
    req: Request,
    next: Next,
) -> Response {
    let token = state.live.current().config.server.admin_token.clone();
    // Without a token the admin API does not exist.
    let Some(token) = token else {
        return not_found().await;
    };
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
    match given {
        Some(given) if same_secret(given.as_bytes(), token.as_bytes()) => next.run(req).await,
        _ => {
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
        quotas.push(json!({
            "store_rule": engine.store().rules()[id.0].name(),
            "tier": tier,
            "limit": d.limit,
            "remaining": d.remaining,
            "reset_after_ms": ms(d.reset_after),
        }));
    }
    json_response(
        StatusCode::OK,
        &json!({ "rule": rule, "key": key, "quotas": quotas }),
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

//! `POST /v1/renew` and `POST /v1/release`: the slots of concurrency rules
//! that `POST /v1/check` took for a caller, kept while the caller's request
//! runs and given back when it ends (docs/server.md, "In-flight limits").
//!
//! The check hands its caller a *lease token*, signed as a settle token is
//! (`settle.rs`): the slots it took (store rule, key, slots, and the charge
//! that names each lease), a release id, and when the token expires: when
//! the lease ends unless renewed. A renew answers a new token, good until
//! the renewed lease ends and naming the same leases; a release is a settle
//! at 0 under the token's id. Both act on a lease by its name, which never
//! changes, so either sent twice (or with an older token of the same lease)
//! does what it does once: a token need not die with a store's receipt, as
//! a settle token must.

use std::time::Duration;

use axum::extract::State as Extract;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use spillway::algorithm::Concurrency;
use spillway::store::{Renew, RuleId, Settle, Store, StoreError as _};
use spillway_tower::{Held, LeaseEvent};

use crate::state::{Loaded, State};

use super::answer::{Answer, bad_request, ms, unavailable};
use super::check::authorized_body;
use super::settle::{
    Refused, SettleKey, Token, TokenCharge, settled_answer, still_applies, token_of, verify_as,
};

/// The prefix of every lease token, and the version of its form.
const PREFIX: &str = "ls1.";

/// The lease token of the concurrency slots `held` took, and how long it
/// is good for; `None` when none of them is a concurrency rule's.
pub(crate) fn issue(loaded: &Loaded, key: &SettleKey, held: &Held) -> Option<(String, Duration)> {
    let engine = loaded.layer.engine();
    let mut life = Duration::MAX;
    let charges: Vec<TokenCharge> = held
        .charges()
        .iter()
        .filter(|(charge, charged)| charged.cost > 0 && engine.lease_of(charge).is_some())
        .map(|(charge, charged)| {
            life = life.min(engine.lease_of(charge).expect("a lease"));
            // A slot taken without a time to name it by (a cluster node
            // that did not answer) gets a name of its own: its first renew
            // takes one under it, and a renew sent again finds it held.
            let charged = match charged.reset_after {
                0 => {
                    let mut random = [0u8; 8];
                    getrandom::fill(&mut random).expect("the OS's random numbers");
                    Concurrency::drawn(charged.cost, u64::from_le_bytes(random))
                }
                _ => *charged,
            };
            TokenCharge::of(engine, charge, &charged)
        })
        .collect();
    token_of(PREFIX, loaded, key, charges, life, None)
}

/// The body of `POST /v1/renew` and `POST /v1/release`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseBody {
    /// The token `POST /v1/check` (or the last renew) answered.
    token: String,
}

pub(super) async fn renew(
    Extract(state): Extract<State>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    match authorized_body(&state, &headers, body).await {
        Ok(body) => renew_answer(&state, &body).await.into_response(),
        Err(refused) => refused,
    }
}

pub(super) async fn release(
    Extract(state): Extract<State>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    match authorized_body(&state, &headers, body).await {
        Ok(body) => release_answer(&state, &body).await.into_response(),
        Err(refused) => refused,
    }
}

/// The token a lease request names, or the answer that refuses it.
fn read_token(state: &State, loaded: &Loaded, body: &[u8]) -> Result<Token, Box<Answer>> {
    let parsed = serde_json::from_slice::<LeaseBody>(body)
        .map_err(|e| Box::new(bad_request(format!("Invalid lease request: {e}."))))?;
    let configured = loaded.config.server.settle_key.as_deref();
    let token = match verify_as(PREFIX, &parsed.token, &state.settle_key, configured) {
        Ok(token) => token,
        Err(Refused::Forged) => {
            return Err(Box::new(bad_request(
                "`token` is not a lease token this server issued.",
            )));
        }
        Err(Refused::Expired(_)) => {
            return Err(Box::new(Answer::problem(
                StatusCode::GONE,
                "The lease token has expired with its lease (renew before `expires_in_ms`): its slot has come back. Check again to take one.",
            )));
        }
    };
    let mut token = token;
    still_applies(state, loaded, &mut token, "its lease ends by itself")?;
    Ok(token)
}

async fn renew_answer(state: &State, body: &[u8]) -> Answer {
    let loaded = state.live.current();
    let token = match read_token(state, &loaded, body) {
        Ok(token) => token,
        Err(refused) => return *refused,
    };
    let engine = loaded.layer.engine();
    let renews: Vec<Renew<'_>> = token
        .charges
        .iter()
        .map(|c| Renew {
            rule: RuleId(c.rule),
            key: &c.key,
            charged: c.charged(),
        })
        .collect();
    let renewed = match engine.store().renew(&renews).await {
        Ok(renewed) => renewed,
        Err(e) if e.invalid_request().is_none() => {
            return unavailable(
                "The rate limiter cannot reach its store; renew again shortly (the lease holds until its token expires).",
            );
        }
        Err(e) => {
            return Answer::problem(
                StatusCode::CONFLICT,
                format!("The lease does not fit the rules as they are now: {e}."),
            );
        }
    };
    let observer = engine.observer();
    let mut charges = Vec::with_capacity(token.charges.len());
    let mut lost = None;
    let mut life = Duration::MAX;
    for (c, r) in token.charges.iter().zip(&renewed) {
        let event = match (r.was_held, r.decision.allowed) {
            (true, _) => LeaseEvent::Renewed,
            (false, true) => LeaseEvent::Retaken,
            (false, false) => LeaseEvent::Lost,
        };
        if let Some(o) = observer {
            o.lease(&c.name, event);
        }
        if !r.decision.allowed {
            lost.get_or_insert(&c.name);
            continue;
        }
        let lease = spillway::Algorithm::quota(engine.store().rules()[c.rule].algorithm()).period();
        life = life.min(lease);
        // The lease keeps its name, unless this renew gave it one.
        let named = r.names(c.charged());
        charges.push(TokenCharge {
            at: named.at,
            reset_after: named.reset_after,
            ..c.clone()
        });
    }
    if let Some(rule) = lost {
        // The request holds not all its slots: those it does hold go back.
        release_now(engine, &charges).await;
        return Answer::problem(
            StatusCode::CONFLICT,
            format!(
                "The lease of rule `{rule}` was released, or had ended and its slot has been taken: the request holds no slot. Check again to take one."
            ),
        );
    }
    let (text, life) = token_of(
        PREFIX,
        &loaded,
        &state.settle_key,
        charges.clone(),
        life,
        None,
    )
    .expect("charged");
    let rules = charges
        .iter()
        .zip(token.charges.iter().zip(&renewed))
        .map(|(c, (_, r))| RenewedRule {
            rule: &c.name,
            key: &c.key,
            was_held: r.was_held,
            limit: r.decision.limit,
            remaining: r.decision.remaining,
        })
        .collect();
    Answer::json(
        StatusCode::OK,
        &RenewedJson {
            lease: LeaseJson {
                token: &text,
                expires_in_ms: ms(life),
            },
            rules,
        },
    )
}

/// The settles at 0 that give `charges` back.
fn releases(charges: &[TokenCharge]) -> Vec<Settle<'_>> {
    charges
        .iter()
        .map(|c| Settle {
            rule: RuleId(c.rule),
            key: &c.key,
            charged: c.charged(),
            actual: 0,
        })
        .collect()
}

/// Gives back `charges` under a release id of its own, new each time: a
/// renew sent again that took a slot back gives it back again (best
/// effort: a slot not given back ends with its lease).
async fn release_now(engine: &super::settle::Engine, charges: &[TokenCharge]) {
    if charges.is_empty() {
        return;
    }
    let settles = releases(charges);
    let id = super::settle::new_id("rp");
    if let Err(e) = engine.store().settle(&id, &settles).await {
        tracing::warn!(error = %e, "could not give back the slots of a lost lease: they end with it");
    }
}

async fn release_answer(state: &State, body: &[u8]) -> Answer {
    let loaded = state.live.current();
    let token = match read_token(state, &loaded, body) {
        Ok(token) => token,
        Err(refused) => return *refused,
    };
    let engine = loaded.layer.engine();
    let settles = releases(&token.charges);
    match engine.store().settle(&token.id, &settles).await {
        Ok(settled) => {
            if settled.applied
                && let Some(o) = engine.observer()
            {
                for c in &token.charges {
                    o.lease(&c.name, LeaseEvent::Released);
                }
            }
            settled_answer(&token, &settled)
        }
        Err(e) if e.invalid_request().is_none() => unavailable(
            "The rate limiter cannot reach its store; send the same release again shortly.",
        ),
        Err(e) => Answer::problem(
            StatusCode::CONFLICT,
            format!("The lease does not fit the rules as they are now: {e}."),
        ),
    }
}

#[derive(Serialize)]
struct LeaseJson<'a> {
    token: &'a str,
    expires_in_ms: u64,
}

#[derive(Serialize)]
struct RenewedJson<'a> {
    lease: LeaseJson<'a>,
    rules: Vec<RenewedRule<'a>>,
}

#[derive(Serialize)]
struct RenewedRule<'a> {
    rule: &'a str,
    key: &'a str,
    /// The lease was still held (else its slot was taken afresh).
    was_held: bool,
    limit: u64,
    remaining: u64,
}

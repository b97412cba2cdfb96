//! Kuadrant limitador's rate limit service, `kuadrant.service.ratelimit.v1`:
//! `CheckRateLimit` and `Report` (a look before the request, its cost
//! charged after the response) and `Reserve` and `Commit` (its cost held
//! before, settled after), on the same descriptors and rules as
//! `ShouldRateLimit` (docs/envoy.md).
//!
//! A reservation id is a signed token, like `POST /v1/check`'s settle
//! token: the charges made (rule, key, cost, time) and a settle id. The
//! service keeps nothing between the two calls, so any instance that shares
//! the store and `[server] settle_key` commits it, and the store's receipt
//! of the id makes a Commit sent twice change nothing.

use std::sync::Arc;
use std::time::Duration;

use spillway::store::{Settle, Store as _};
use spillway_tower::{Asking, BudgetEvent, Outcome, OverCapacity, Ruling, Settled};
use tonic::{Request, Response, Status};

use super::pb::kuadrant::service::ratelimit::v1 as kuadrant;
use super::rls::rate_limit_response::Code;
use super::rls::{RateLimitRequest, RateLimitResponse};
use super::service::{
    Call, Names as _, addend, arrival, charges_of, for_this_domain, headers_of, map_descriptors,
    max_message_bytes, nothing_limited, statuses, store_status, within_call,
};
use crate::api::SettleKey;
use crate::api::settle::{
    Refused, Spend, Token, TokenCharge, longest_hold, longest_life, now_ms, observe,
    rules_unchanged, stands, token_of, verify_as,
};
use crate::state::{Live, Loaded};
use kuadrant::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use kuadrant::{CommitRequest, CommitResponse, ReserveRequest, ReserveResponse};

/// The prefix of a reservation id, and the version of its form.
const PREFIX: &str = "kr1.";

/// Kuadrant limitador's rate limit service over the current engine.
#[derive(Debug, Clone)]
pub struct KuadrantRateLimiter {
    shared: Arc<Live>,
    /// Signs the reservation ids (under `[server] settle_key` when it is
    /// set), names this process's in-memory store, and remembers the ids
    /// committed here.
    key: SettleKey,
}

impl KuadrantRateLimiter {
    /// The service over `shared`.
    pub fn new(shared: Arc<Live>) -> Self {
        Self {
            shared,
            key: SettleKey::random(),
        }
    }

    /// As a tonic service, its messages bounded as `ShouldRateLimit`'s
    /// are ([`EnvoyRateLimiter::into_service`](super::EnvoyRateLimiter::into_service)).
    pub fn into_service(self) -> RateLimitServiceServer<Self> {
        let limit = max_message_bytes(&self.shared);
        RateLimitServiceServer::new(self).max_decoding_message_size(limit)
    }
}

#[tonic::async_trait]
impl RateLimitService for KuadrantRateLimiter {
    async fn check_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let (arrived, deadline, request) = arrival(request);
        let request = &request;
        let call = request.call();
        within_call(&self.shared, arrived, deadline, call, |engine| async move {
            look(&engine, request).await
        })
        .await
        .map(Response::new)
    }

    async fn report(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let (arrived, deadline, request) = arrival(request);
        let request = &request;
        let call = request.call();
        within_call(&self.shared, arrived, deadline, call, |engine| async move {
            if for_this_domain(&engine, call)? {
                charge_regardless(&engine, call, addend(request), true).await?;
            }
            // As limitador: a report is not a decision.
            Ok(RateLimitResponse {
                overall_code: Code::Ok.into(),
                ..RateLimitResponse::default()
            })
        })
        .await
        .map(Response::new)
    }

    async fn reserve(
        &self,
        request: Request<ReserveRequest>,
    ) -> Result<Response<ReserveResponse>, Status> {
        let (arrived, deadline, request) = arrival(request);
        let request = &request;
        let call = request.call();
        let key = &self.key;
        within_call(&self.shared, arrived, deadline, call, |engine| async move {
            reserve(&engine, key, request).await
        })
        .await
        .map(Response::new)
    }

    async fn commit(
        &self,
        request: Request<CommitRequest>,
    ) -> Result<Response<CommitResponse>, Status> {
        let (arrived, deadline, request) = arrival(request);
        let request = &request;
        let call = request.call();
        let key = &self.key;
        within_call(&self.shared, arrived, deadline, call, |engine| async move {
            commit(&engine, key, request).await
        })
        .await
        .map(Response::new)
    }
}

/// `CheckRateLimit`: whether every descriptor's limits have room for the
/// call's cost, charging nothing.
async fn look(engine: &Loaded, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
    let call = request.call();
    if !for_this_domain(engine, call)? {
        return Ok(nothing_limited(call));
    }
    let mapping = map_descriptors(engine, call, addend(request), true)?;
    let costs: Vec<u64> = mapping.mapped.iter().map(|m| m.cost).collect();
    let charges = charges_of(engine, call, &mapping)?;
    let asking = Asking {
        over_capacity: OverCapacity::Deny,
        look_only: true,
        hold_every: false,
        hold_at_most: None,
    };
    let ruling = engine.layer.engine().decide(charges, asking).await;
    decided(&ruling)?;
    // A key in debt, or with less left than the cost, has no room.
    let no_room =
        |i: usize| ruling.denies(i) || ruling.decision(i).is_some_and(|d| d.remaining < costs[i]);
    let statuses = statuses(engine, &mapping, &ruling, &no_room);
    let over = statuses
        .iter()
        .any(|s| s.code == i32::from(Code::OverLimit));
    let (response_headers, _) = headers_of(engine, &ruling, over);
    Ok(RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok }.into(),
        statuses,
        response_headers_to_add: response_headers,
        ..RateLimitResponse::default()
    })
}

/// The ruling's failure as the call's status: a request the store can
/// never decide is the caller's error; a store it cannot reach (its
/// failure policy applied already, fail-closed) is unavailable, and the
/// gateway's failure mode decides.
fn decided(ruling: &Ruling) -> Result<(), Status> {
    match ruling.outcome() {
        Outcome::BadRequest(message) => Err(Status::invalid_argument(message.clone())),
        Outcome::Unavailable(message) => Err(Status::unavailable(message.clone())),
        _ => Ok(()),
    }
}

/// Charges `cost` to every descriptor's limits whatever they have left
/// ([`service::charge_regardless`](super::service::charge_regardless)). A
/// descriptor whose limit override is 0 charges nothing.
async fn charge_regardless(
    engine: &Loaded,
    call: Call<'_>,
    cost: u64,
    descriptor_costs: bool,
) -> Result<(), Status> {
    let mapping = map_descriptors(engine, call, cost, descriptor_costs)?;
    let charges = charges_of(engine, call, &mapping)?;
    let charges: Vec<_> = charges.iter().filter(|c| c.cost() > 0).collect();
    super::service::charge_regardless(engine, &charges).await
}

/// `Reserve`: the call's `amount` charged to every descriptor's limits as
/// `ShouldRateLimit` charges a cost, held open for a `Commit`.
async fn reserve(
    engine: &Loaded,
    key: &SettleKey,
    request: &ReserveRequest,
) -> Result<ReserveResponse, Status> {
    let call = request.call();
    let admitted = |reservation_id: String| ReserveResponse {
        code: Code::Ok.into(),
        reservation_id,
    };
    if !for_this_domain(engine, call)? {
        return Ok(admitted(String::new()));
    }
    let ttl = match request.ttl {
        None => None,
        // Negative parts are refused before prost's conversion, which
        // negates them (and overflows on the least i64).
        Some(ttl) if ttl.seconds < 0 || ttl.nanos < 0 => {
            return Err(Status::invalid_argument("`ttl` must not be negative"));
        }
        Some(ttl) => match Duration::try_from(ttl) {
            Ok(d) if d.is_zero() => None,
            Ok(d) => Some(d),
            Err(_) => return Err(Status::invalid_argument("`ttl` is not a duration")),
        },
    };
    let mapping = map_descriptors(engine, call, request.amount, false)?;
    let charges = charges_of(engine, call, &mapping)?;
    let asking = Asking {
        over_capacity: OverCapacity::Deny,
        look_only: mapping.zero_limit.iter().any(Option::is_some),
        hold_every: true,
        // Never longer than the id lives: a Commit it can still send finds
        // the reservation, and one after that is refused while the
        // reservation stands.
        hold_at_most: Some(ttl.unwrap_or(Duration::MAX).min(longest_hold())),
    };
    let deciding = engine.layer.engine();
    let ruling = deciding.decide(charges, asking).await;
    decided(&ruling)?;
    let over = mapping.zero_limit.iter().any(Option::is_some)
        || (0..ruling.charges().len()).any(|i| ruling.denies(i));
    if over {
        return Ok(ReserveResponse {
            code: Code::OverLimit.into(),
            reservation_id: String::new(),
        });
    }
    let Some(held) = ruling.into_held() else {
        // Nothing charged (a cost of 0, or admitted by a failure policy):
        // nothing to commit.
        return Ok(admitted(String::new()));
    };
    let rules = deciding.store().rules();
    let charges: Vec<TokenCharge> = held
        .charges()
        .iter()
        .filter(|(_, charged)| charged.cost > 0)
        .map(|(charge, charged)| TokenCharge::of(deciding, charge, charged))
        .collect();
    // The id outlives the hold (by half a minute, for clocks a little
    // apart) so that a late Commit is still charged, and the caller's ttl.
    let given_back_after = charges
        .iter()
        .filter(|c| c.held)
        .filter_map(|c| rules.get(c.rule)?.release_after())
        .map(|d| ttl.map_or(d, |t| d.min(t)).min(longest_hold()))
        .max();
    let life = [
        engine.config.server.settle_within,
        ttl.unwrap_or_default(),
        given_back_after.map_or(Duration::ZERO, |d| d + Duration::from_secs(30)),
    ]
    .into_iter()
    .max()
    .unwrap_or_default()
    .min(longest_life());
    let id = token_of(PREFIX, engine, key, charges, life, held.hold_id())
        .map(|(text, _)| text)
        .unwrap_or_default();
    Ok(admitted(id))
}

/// `Commit`: the reservation its id names settled at `actual_amount`
/// (the call's descriptors are not read: the id names every charge), or,
/// with no id, `actual_amount` reported as `Report` charges it.
async fn commit(
    engine: &Loaded,
    key: &SettleKey,
    request: &CommitRequest,
) -> Result<CommitResponse, Status> {
    let released = |reservation_released| CommitResponse {
        reservation_released,
    };
    let actual = request.actual_amount;
    if request.reservation_id.is_empty() {
        let call = request.call();
        if for_this_domain(engine, call)? && actual > 0 {
            charge_regardless(engine, call, actual, false).await?;
        }
        return Ok(released(false));
    }
    let configured = engine.config.server.settle_key.as_deref();
    let mut token = match verify_as(PREFIX, &request.reservation_id, key, configured) {
        Ok(token) => token,
        Err(Refused::Forged) => {
            return Err(Status::invalid_argument(
                "`reservation_id` is not a reservation this service made",
            ));
        }
        Err(Refused::Expired(token)) => {
            observe(engine, &token, Settled::Expired, Some(0));
            return Err(Status::failed_precondition(format!(
                "the reservation has expired: {}",
                stands(&token)
            )));
        }
    };
    let what_stands = stands(&token);
    rules_unchanged(key, engine, &mut token, &what_stands).map_err(Status::failed_precondition)?;
    settle(engine, key, &token, actual).await.map(released)
}

/// Settles `token`'s charges at `actual`, once: whether this call did.
async fn settle(
    engine: &Loaded,
    key: &SettleKey,
    token: &Token,
    actual: u64,
) -> Result<bool, Status> {
    let settles: Vec<Settle<'_>> = token
        .charges
        .iter()
        .map(|c| Settle {
            rule: spillway::store::RuleId(c.rule),
            key: &c.key,
            charged: c.charged(),
            actual,
        })
        .collect();
    match key.spend_in(engine, &token.id, token.exp, now_ms()) {
        Spend::First => {}
        Spend::Again => return Ok(false),
        Spend::Full => {
            return Err(Status::unavailable(
                "too many commits in the last minutes to remember them all; send this one again shortly",
            ));
        }
    }
    let deciding = engine.layer.engine();
    let settled = match deciding.store().settle(&token.id, &settles).await {
        Ok(settled) => settled,
        Err(e) => {
            // Nothing applied: the same Commit may be sent again.
            key.unspend(&token.id);
            return Err(store_status(&e));
        }
    };
    if settled.applied {
        observe(engine, token, Settled::Measured, Some(actual));
        if let Some(observer) = deciding.observer() {
            for (c, d) in token.charges.iter().zip(&settled.decisions) {
                if actual > c.cost && d.remaining == 0 {
                    observer.budget(&c.name, BudgetEvent::Exhausted);
                }
            }
        }
    }
    Ok(settled.applied)
}

//! `POST /v1/settle`: a budget rule's reservation, made by `POST /v1/check`,
//! settled at what the request cost (docs/budgets.md).
//!
//! The check hands its caller a *settle token*: the charges it made (store
//! rule, key, cost, time), a settle id drawn from the OS, and when it
//! expires, signed with HMAC-SHA-256 under the server's settle key. The
//! server keeps nothing: any instance with the same key settles it, and the
//! store's receipt of the id makes a settle sent twice change nothing. A
//! token expires within the time a store remembers a receipt
//! ([`SETTLE_RECEIPT_TTL`](spillway::store::SETTLE_RECEIPT_TTL)), so it cannot outlive its receipt and settle
//! twice; an expired token is refused, and its reservation stands (what
//! was reserved is what it costs: no client is served for free).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State as Extract;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use spillway::Algorithm as _;
use spillway::algorithm::Charged;
use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use spillway::store::{Check, RuleId, SETTLE_RECEIPT_TTL, Settle, Store, StoreError as _};
use spillway_tower::{BudgetEvent, Charge, Held, Settled};

use crate::config::StoreKind;
use crate::state::{Loaded, State};
use crate::store::AnyStore;

/// The engine of `spillway serve`.
pub(crate) type Engine = spillway_tower::Engine<AnyStore>;

use super::answer::{Answer, bad_request, ms, unavailable};
use super::check::authorized_body;

/// What a settle token says, signed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Token {
    /// The settle id: the store's receipt is kept under it.
    pub(crate) id: String,
    /// When the token expires, in milliseconds since the Unix epoch.
    pub(crate) exp: u64,
    /// The store that holds the charges ([`SettleKey::store_id`]): a token
    /// of an in-memory store that has since restarted, or of another
    /// store, is not settled against this one.
    pub(crate) store: String,
    /// The charges to settle.
    pub(crate) charges: Vec<TokenCharge>,
}

/// One charge of a token.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct TokenCharge {
    /// The store rule, and its name then: a reload that renumbered the
    /// rules is seen, not settled against another rule.
    pub(crate) rule: usize,
    pub(crate) name: String,
    pub(crate) key: String,
    pub(crate) cost: u64,
    pub(crate) at: u64,
    pub(crate) reset_after: u64,
    /// The rule's capacity then: a reload that resized it is seen.
    pub(crate) capacity: u64,
    /// The rule's algorithm then: a reload that made a budget rule a
    /// concurrency rule (or back) is seen.
    pub(crate) algorithm: String,
    /// The store holds the charge open under the token's id, and gives it
    /// back if no settle comes in time (`on_expiry = "release"`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) held: bool,
}

impl TokenCharge {
    /// A held charge, as a token names it.
    pub(crate) fn of(engine: &Engine, charge: &Charge, charged: &Charged) -> Self {
        let rule = &engine.store().rules()[charge.rule_id().0];
        Self {
            rule: charge.rule_id().0,
            name: rule.name().to_string(),
            key: charge.key().to_string(),
            cost: charged.cost,
            at: charged.at,
            reset_after: charged.reset_after,
            capacity: rule.algorithm().capacity(),
            algorithm: rule.algorithm().name().to_string(),
            held: charged.held,
        }
    }

    /// The charge as the store named it.
    pub(crate) fn charged(&self) -> Charged {
        Charged {
            cost: self.cost,
            at: self.at,
            reset_after: self.reset_after,
            held: self.held,
        }
    }
}

/// What signs and checks tokens (the configured key, or one drawn at
/// start), names this process's in-memory store, and remembers the tokens
/// settled here.
#[derive(Clone)]
pub(crate) struct SettleKey(std::sync::Arc<Inner>);

struct Inner {
    key: [u8; 32],
    /// Drawn at start: an in-memory store lives and dies with the process.
    memory_store: String,
    spent: Mutex<Spent>,
}

/// The ids of the tokens settled by this process, until they expire, on
/// the in-memory store: a token is settled once here even if the store's
/// receipt of it is gone (it keeps at most 2^20 receipts, the oldest
/// dropped first). Redis keeps every receipt longer than a token lives.
#[derive(Default)]
struct Spent {
    /// Each id, and when its token expires.
    ids: HashMap<String, u64>,
    /// (expiry, id): the first to expire first, whatever order they were
    /// settled in (a token lives from `settle_within` to 9 minutes).
    order: BTreeSet<(u64, String)>,
}

/// The most tokens remembered as settled at once: past it, a settle is
/// answered 503 until the oldest expire (at most `settle_within`).
const MAX_SPENT: usize = if cfg!(test) { 4 } else { 1 << 20 };

/// Whether a token may be settled now.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Spend {
    First,
    Again,
    Full,
}

impl std::fmt::Debug for SettleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SettleKey(..)")
    }
}

impl SettleKey {
    /// A key drawn from the OS, for a server whose configuration has none.
    pub(crate) fn random() -> Self {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the OS's random numbers");
        let mut store = [0u8; 16];
        getrandom::fill(&mut store).expect("the OS's random numbers");
        Self(std::sync::Arc::new(Inner {
            key,
            memory_store: format!("memory-{}", hex(&store)),
            spent: Mutex::default(),
        }))
    }

    /// The MAC under the configured key if there is one, else this one.
    fn mac(&self, configured: Option<&str>) -> Hmac<Sha256> {
        let key = configured.map_or(&self.0.key[..], str::as_bytes);
        <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes keys of any length")
    }

    /// The store `loaded` counts in: this process's memory, or the Redis
    /// servers it names (hashed: a token is readable, and a URL may hold a
    /// password).
    pub(crate) fn store_id(&self, loaded: &Loaded) -> String {
        match &loaded.config.store.kind {
            StoreKind::Memory => self.0.memory_store.clone(),
            StoreKind::Redis(topology) => {
                let digest = Sha256::digest(format!("{topology:?}").as_bytes());
                format!("redis-{}", hex(&digest[..16]))
            }
        }
    }

    /// Records token `id`, good until `exp`, as settled at `now` in the
    /// store `loaded` counts in: remembered here for the in-memory store;
    /// on Redis the store's receipt of the id tells (and nothing here can
    /// fill up).
    pub(crate) fn spend_in(&self, loaded: &Loaded, id: &str, exp: u64, now: u64) -> Spend {
        match loaded.config.store.kind {
            StoreKind::Memory => self.spend(id, exp, now),
            StoreKind::Redis(_) => Spend::First,
        }
    }

    /// Records token `id`, good until `exp`, as settled at `now`.
    fn spend(&self, id: &str, exp: u64, now: u64) -> Spend {
        let mut spent = self.0.spent.lock().unwrap_or_else(|p| p.into_inner());
        let Spent { ids, order } = &mut *spent;
        while let Some(first) = order.first()
            && first.0 <= now
        {
            if let Some((_, old)) = order.pop_first() {
                ids.remove(&old);
            }
        }
        if ids.contains_key(id) {
            return Spend::Again;
        }
        if ids.len() >= MAX_SPENT {
            return Spend::Full;
        }
        ids.insert(id.to_string(), exp);
        order.insert((exp, id.to_string()));
        Spend::First
    }

    /// Forgets token `id`: its settle did not apply, and may be sent again.
    pub(crate) fn unspend(&self, id: &str) {
        let mut spent = self.0.spent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(exp) = spent.ids.remove(id) {
            spent.order.remove(&(exp, id.to_string()));
        }
    }
}

/// The longest a token lives: within the time a store keeps its settle's
/// receipt (by a minute), so that it cannot be settled twice.
pub(crate) fn longest_life() -> Duration {
    SETTLE_RECEIPT_TTL.saturating_sub(Duration::from_secs(60))
}

/// The longest a reservation a token names is held open: half a minute
/// less than the token lives (for clocks a little apart), so that a settle
/// the token can still send never finds it given back, and a request that
/// ran longer than its token is charged what was reserved.
pub(crate) fn longest_hold() -> Duration {
    longest_life().saturating_sub(Duration::from_secs(30))
}

/// The prefix of every token, and the version of its form.
const PREFIX: &str = "st1.";

pub(crate) fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

/// The settle token of the budget charges `held` made, and how long it is
/// good for; `None` when none of them is a budget rule's.
pub(crate) fn issue(loaded: &Loaded, key: &SettleKey, held: &Held) -> Option<(String, Duration)> {
    let engine = loaded.layer.engine();
    let charges: Vec<TokenCharge> = held
        .charges()
        .iter()
        // A charge of nothing (a peek) has nothing to settle.
        .filter(|(charge, charged)| engine.response_cost(charge).is_some() && charged.cost > 0)
        .map(|(charge, charged)| TokenCharge::of(engine, charge, charged))
        .collect();
    // A reservation the store gives back when nobody settles it is still
    // charged in full by a settle that comes later: the token outlives its
    // rule's `settle_within` when a receipt can (by half a minute, for
    // clocks a little apart), so that such a settle is accepted.
    let rules = engine.store().rules();
    let given_back_after = charges
        .iter()
        .filter(|c| c.held)
        .filter_map(|c| rules.get(c.rule)?.release_after())
        .map(|d| d.min(longest_hold()))
        .max();
    let within = given_back_after.map_or(loaded.config.server.settle_within, |d| {
        (d + Duration::from_secs(30))
            .min(longest_life())
            .max(loaded.config.server.settle_within)
    });
    // Settled under the id the store holds the reservations open under.
    token_of(PREFIX, loaded, key, charges, within, held.hold_id())
}

/// A token of the kind `prefix` names (`st1.`, `ls1.`) for `charges`, good
/// for `life`, signed: `None` when there are no charges.
pub(crate) fn token_of(
    prefix: &str,
    loaded: &Loaded,
    key: &SettleKey,
    charges: Vec<TokenCharge>,
    life: Duration,
    id: Option<&str>,
) -> Option<(String, Duration)> {
    if charges.is_empty() {
        return None;
    }
    let token = Token {
        id: id.map_or_else(|| new_id(&prefix[..2]), str::to_owned),
        exp: now_ms().saturating_add(ms(life)),
        store: key.store_id(loaded),
        charges,
    };
    let text = sign(
        prefix,
        &token,
        key,
        loaded.config.server.settle_key.as_deref(),
    );
    Some((text, life))
}

/// A token id drawn from the OS: 128 bits after `kind`.
pub(crate) fn new_id(kind: &str) -> String {
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).expect("the OS's random numbers");
    format!("{kind}-{}", hex(&id))
}

/// `token` signed under the configured key (or the drawn one), as text
/// starting with `prefix` (which the signature covers).
fn sign(prefix: &str, token: &Token, key: &SettleKey, configured: Option<&str>) -> String {
    let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(token).expect("serializable"));
    let mut mac = key.mac(configured);
    mac.update(prefix.as_bytes());
    mac.update(payload.as_bytes());
    let signature = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{prefix}{payload}.{signature}")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Why a token is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not a token this server (or one with its key) signed.
    Forged,
    /// Signed, but past its time.
    Expired(Token),
}

/// The token `text` says, if its signature holds and it has not expired.
fn verify(text: &str, key: &SettleKey, configured: Option<&str>) -> Result<Token, Refused> {
    verify_as(PREFIX, text, key, configured)
}

/// The token `text` (of the kind `prefix` names) says, if its signature
/// holds and it has not expired.
pub(crate) fn verify_as(
    prefix: &str,
    text: &str,
    key: &SettleKey,
    configured: Option<&str>,
) -> Result<Token, Refused> {
    verified(prefix, text, key, configured).and_then(|token| {
        if token.exp <= now_ms() {
            Err(Refused::Expired(token))
        } else {
            Ok(token)
        }
    })
}

/// The token `text` says, if its signature holds, expired or not.
fn verified(
    prefix: &str,
    text: &str,
    key: &SettleKey,
    configured: Option<&str>,
) -> Result<Token, Refused> {
    let rest = text.strip_prefix(prefix).ok_or(Refused::Forged)?;
    let (payload, signature) = rest.split_once('.').ok_or(Refused::Forged)?;
    let signature = URL_SAFE_NO_PAD
        .decode(signature)
        .map_err(|_| Refused::Forged)?;
    let mut mac = key.mac(configured);
    mac.update(prefix.as_bytes());
    mac.update(payload.as_bytes());
    // In time independent of where the signatures differ.
    mac.verify_slice(&signature).map_err(|_| Refused::Forged)?;
    let json = URL_SAFE_NO_PAD
        .decode(payload)
        .map_err(|_| Refused::Forged)?;
    serde_json::from_slice(&json).map_err(|_| Refused::Forged)
}

/// The body of `POST /v1/settle`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SettleBody {
    /// The token `POST /v1/check` answered.
    token: String,
    /// What the request cost, in the rule's units.
    actual: serde_json::Number,
}

pub(super) async fn settle(
    Extract(state): Extract<State>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    match authorized_body(&state, &headers, body).await {
        Ok(body) => settle_answer(&state, &body).await.into_response(),
        Err(refused) => refused,
    }
}

async fn settle_answer(state: &State, body: &[u8]) -> Answer {
    let parsed = match serde_json::from_slice::<SettleBody>(body) {
        Ok(parsed) => parsed,
        Err(e) => return bad_request(format!("Invalid settle: {e}.")),
    };
    let actual = match parsed.actual.as_u64() {
        Some(n) => n,
        None if parsed.actual.as_i64().is_some() => {
            return bad_request(format!(
                "`actual` must not be negative (got {}).",
                parsed.actual
            ));
        }
        None => {
            return bad_request(format!(
                "`actual` must be an integer (got {}).",
                parsed.actual
            ));
        }
    };
    let loaded = state.live.current();
    let configured = loaded.config.server.settle_key.as_deref();
    let token = match verify(&parsed.token, &state.settle_key, configured) {
        Ok(token) => token,
        Err(Refused::Forged) => {
            return bad_request("`token` is not a settle token this server issued.");
        }
        Err(Refused::Expired(token)) => {
            observe(&loaded, &token, Settled::Expired, Some(0));
            return Answer::problem(
                StatusCode::GONE,
                format!(
                    "The settle token has expired (`[server] settle_within`): {}.",
                    stands(&token)
                ),
            );
        }
    };
    let mut token = token;
    let what_stands = stands(&token);
    if let Err(conflict) = still_applies(state, &loaded, &mut token, &what_stands) {
        return *conflict;
    }
    let engine = loaded.layer.engine();
    let settles: Vec<Settle<'_>> = token
        .charges
        .iter()
        .map(|c| Settle {
            rule: RuleId(c.rule),
            key: &c.key,
            charged: c.charged(),
            actual,
        })
        .collect();
    match state
        .settle_key
        .spend_in(&loaded, &token.id, token.exp, now_ms())
    {
        Spend::First => {}
        Spend::Again => return again(&loaded, &token).await,
        Spend::Full => {
            return unavailable(
                "Too many settles in the last `settle_within` to remember them all; send this one again shortly.",
            );
        }
    }
    let settled = engine.store().settle(&token.id, &settles).await;
    if settled.is_err() {
        // Nothing applied: the same settle may be sent again.
        state.settle_key.unspend(&token.id);
    }
    match settled {
        Err(e) if e.invalid_request().is_none() => unavailable(
            "The rate limiter cannot reach its store; send the same settle again shortly.",
        ),
        Ok(settled) => {
            if settled.applied {
                observe(&loaded, &token, Settled::Measured, Some(actual));
                if let Some(observer) = engine.observer() {
                    for (c, d) in token.charges.iter().zip(&settled.decisions) {
                        if actual > c.cost && d.remaining == 0 {
                            observer.budget(&c.name, BudgetEvent::Exhausted);
                        }
                    }
                }
            }
            settled_answer(&token, &settled)
        }
        Err(e) => Answer::problem(
            StatusCode::CONFLICT,
            format!(
                "The settle does not fit the rules as they are now: {}.",
                e.invalid_request()
                    .map_or_else(|| e.to_string(), ToString::to_string)
            ),
        ),
    }
}

/// A 409 when `token`'s charges no longer apply here: made in another
/// store (an in-memory store since restarted), or under a rule a reload has
/// renamed, renumbered or resized. `stands` says what becomes of them.
/// What becomes of a token's reservation that is not settled now.
pub(crate) fn stands(token: &Token) -> String {
    if token.charges.iter().any(|c| c.held) {
        "its reservation stands until its rule's `settle_within`, and is then given back \
         (`on_expiry = \"release\"`)"
            .to_string()
    } else {
        "its reservation stands".to_string()
    }
}

/// Whether the token's charges still apply to the rules as they are now:
/// each rule of the same name, algorithm and capacity, found by its name
/// if a reload moved it (the token is changed to name it where it is).
pub(super) fn still_applies(
    state: &State,
    loaded: &Loaded,
    token: &mut Token,
    stands: &str,
) -> Result<(), Box<Answer>> {
    rules_unchanged(&state.settle_key, loaded, token, stands)
        .map_err(|message| Box::new(Answer::problem(StatusCode::CONFLICT, message)))
}

/// [`still_applies`], for any front end: why not, as a sentence.
pub(crate) fn rules_unchanged(
    key: &SettleKey,
    loaded: &Loaded,
    token: &mut Token,
    stands: &str,
) -> Result<(), String> {
    if token.store != key.store_id(loaded) {
        return Err("The token's charges are in another store (an in-memory store since restarted, or one the configuration no longer names): there is nothing here to settle.".to_string());
    }
    let rules = loaded.layer.engine().store().rules();
    for c in &mut token.charges {
        let same = |r: &spillway::store::Rule| {
            r.name() == c.name
                && r.algorithm().capacity() == c.capacity
                && r.algorithm().name() == c.algorithm
        };
        let at = match rules.get(c.rule) {
            Some(r) if same(r) => Some(c.rule),
            _ => rules.iter().position(same),
        };
        if let Some(at) = at {
            c.rule = at;
        } else {
            return Err(format!(
                "Rule `{}` has changed since the check (the configuration was reloaded): {stands}.",
                c.name
            ));
        }
    }
    Ok(())
}

/// The answer to a token settled before by this process: nothing applied,
/// each key as it stands.
async fn again(loaded: &Loaded, token: &Token) -> Answer {
    let checks: Vec<Check<'_>> = token
        .charges
        .iter()
        .map(|c| Check {
            rule: RuleId(c.rule),
            key: &c.key,
            cost: 0,
        })
        .collect();
    match loaded.layer.engine().store().check(&checks).await {
        Ok(verdict) => settled_answer(
            token,
            &spillway::store::Settled {
                applied: false,
                decisions: verdict.decisions.into_vec(),
            },
        ),
        Err(_) => unavailable("The rate limiter cannot reach its store; try again shortly."),
    }
}

/// Tells the metrics what became of a token's reservations: each opened
/// and closed at once (the server holds none open between the two calls),
/// at `actual`, or kept as charged.
pub(crate) fn observe(loaded: &Loaded, token: &Token, how: Settled, actual: Option<u64>) {
    // An expired token may be sent any number of times: counted each time,
    // it adds no units.
    let expired = how == Settled::Expired;
    let Some(observer) = loaded.layer.engine().observer() else {
        return;
    };
    for c in &token.charges {
        observer.budget(&c.name, BudgetEvent::Opened);
        observer.budget(
            &c.name,
            BudgetEvent::Closed {
                how,
                charged: if expired { 0 } else { c.cost },
                actual: actual.unwrap_or(c.cost),
            },
        );
    }
}

#[derive(Serialize)]
struct SettledJson<'a> {
    applied: bool,
    rules: Vec<SettledRule<'a>>,
}

#[derive(Serialize)]
struct SettledRule<'a> {
    rule: &'a str,
    key: &'a str,
    limit: u64,
    remaining: u64,
    reset_after_ms: u64,
    retry_after_ms: Option<u64>,
}

pub(super) fn settled_answer(token: &Token, settled: &spillway::store::Settled) -> Answer {
    let rules = token
        .charges
        .iter()
        .zip(&settled.decisions)
        .map(|(c, d)| SettledRule {
            rule: &c.name,
            key: &c.key,
            limit: d.limit,
            remaining: d.remaining,
            reset_after_ms: ms(d.reset_after),
            retry_after_ms: d.retry_after.map(ms),
        })
        .collect();
    Answer::json(
        StatusCode::OK,
        &SettledJson {
            applied: settled.applied,
            rules,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> Token {
        Token {
            id: "st-1".into(),
            exp: now_ms() + 60_000,
            store: "memory-0".into(),
            charges: vec![TokenCharge {
                rule: 0,
                name: "tokens".into(),
                key: "api_key=k".into(),
                cost: 500,
                at: 1,
                reset_after: 2,
                capacity: 1000,
                algorithm: "token_bucket".into(),
                held: false,
            }],
        }
    }

    fn sign(token: &Token, key: &SettleKey, configured: Option<&str>) -> String {
        super::sign(PREFIX, token, key, configured)
    }

    #[test]
    fn a_token_holds_only_under_its_key_and_unchanged() {
        let key = SettleKey::random();
        let token = token();
        let text = sign(&token, &key, None);
        assert_eq!(verify(&text, &key, None), Ok(token.clone()));
        // Another process's key, or a configured one.
        assert_eq!(
            verify(&text, &SettleKey::random(), None),
            Err(Refused::Forged)
        );
        let shared = "k".repeat(32);
        assert_eq!(verify(&text, &key, Some(&shared)), Err(Refused::Forged));
        let text = sign(&token, &SettleKey::random(), Some(&shared));
        assert_eq!(verify(&text, &key, Some(&shared)), Ok(token.clone()));

        // A payload changed (a smaller cost, another key) under the old
        // signature.
        let (payload, signature) = text[PREFIX.len()..].split_once('.').unwrap();
        let mut changed = token.clone();
        changed.charges[0].cost = 1;
        let forged_payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&changed).unwrap());
        assert_ne!(forged_payload, payload);
        let forged = format!("{PREFIX}{forged_payload}.{signature}");
        assert_eq!(verify(&forged, &key, Some(&shared)), Err(Refused::Forged));
        for bad in [
            "",
            "st1.",
            "st1..",
            "st1.e30.",
            "st0.e30.AAAA",
            &text[..text.len() - 1],
        ] {
            assert_eq!(
                verify(bad, &key, Some(&shared)),
                Err(Refused::Forged),
                "{bad}"
            );
        }
    }

    #[test]
    fn an_expired_token_is_refused() {
        let key = SettleKey::random();
        let mut old = token();
        old.exp = now_ms() - 1;
        assert_eq!(
            verify(&sign(&old, &key, None), &key, None),
            Err(Refused::Expired(old))
        );
    }

    #[test]
    fn a_token_is_spent_once_until_it_expires_and_the_memory_is_bounded() {
        let key = SettleKey::random();
        assert_eq!(key.spend("a", 100, 0), Spend::First);
        assert_eq!(key.spend("a", 100, 50), Spend::Again);
        for id in ["b", "c", "d"] {
            assert_eq!(key.spend(id, 200, 50), Spend::First);
        }
        // Full of tokens not yet expired: refused, none forgotten.
        assert_eq!(key.spend("e", 200, 60), Spend::Full);
        assert_eq!(key.spend("a", 100, 60), Spend::Again);
        // Once `a` has expired (it can be settled no more), its room is free.
        assert_eq!(key.spend("e", 200, 100), Spend::First);
        key.unspend("e");
        assert_eq!(key.spend("e", 200, 100), Spend::First);
    }

    #[test]
    fn a_long_lived_token_does_not_keep_shorter_ones_remembered() {
        let key = SettleKey::random();
        // Settled first, good for 9 minutes; then three good for a second.
        assert_eq!(key.spend("long", 540_000, 0), Spend::First);
        for id in ["b", "c", "d"] {
            assert_eq!(key.spend(id, 1_000, 0), Spend::First);
        }
        assert_eq!(key.spend("e", 2_000, 500), Spend::Full);
        // At 2 s the three have expired behind the long one: room again.
        assert_eq!(key.spend("e", 3_000, 2_000), Spend::First);
        assert_eq!(key.spend("long", 540_000, 2_000), Spend::Again);
        key.unspend("long");
        assert_eq!(key.spend("long", 540_000, 2_000), Spend::First);
    }
}

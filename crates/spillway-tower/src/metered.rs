//! The response of a request admitted under a budget rule: measured as it
//! passes, and settled at what it cost once it has ended or been left. The
//! response of a request holding slots of concurrency rules carries their
//! guard ([`Leases`]), dropped when it has ended or been left.
//!
//! What each budget charge is settled at:
//! - a 5xx, when its rule gives those back (`release_on_5xx`): nothing;
//! - a response header or trailer ([`Measure::Header`]): its value;
//! - `usage` ([`Measure::Usage`]): what the upstream reported, else (an
//!   event stream that reported nothing) one unit per content delta plus
//!   the prompt's estimate;
//! - a response left before its end (the client went away): what was
//!   counted so far, if anything was;
//! - a 4xx with nothing measured: nothing (the upstream refused the
//!   request);
//! - anything else measured nothing: the reservation stands, as charged.
//!   What cannot be read is never free: a client must not be able to make
//!   a response unmeasurable to be served for nothing.
//!
//! A cut stream ([`Overrun::Cut`]) is charged as it goes: whenever the
//! count passes what its charges cover, the body charges more (at least
//! another reservation's worth) before it lets the events through; once
//! the key has nothing left, it ends the stream between two events.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Response};
use http_body::{Body, Frame};
use smallvec::SmallVec;
use spillway::algorithm::{Charged, Concurrency};
use spillway::store::{Check, Settle, Store};
use spillway::{Algorithm as _, Decision};

use crate::budget::{Measure, Overrun, ResponseCost, Unanswered};
use crate::engine::{BudgetEvent, Charge, Engine, Held, Settled, settle_id};
use crate::headers::retry_after_secs;
use crate::leases::{Keeper, Kept, Leases};
use crate::usage::{Boundaries, UsageField, UsageMeter, cut_event};

/// A boxed future that can cross threads.
pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// How much held-back event a cut stream keeps at most: past it, the bytes
/// go through, and a cut may fall inside that event.
const MAX_HELD_BACK: usize = 1 << 20;

/// What became of a charge made while a response passes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Extended {
    /// Charged: settled with the rest.
    Charged(Charged),
    /// Admitted by the rule's failure policy: nothing was charged.
    Uncharged,
    /// The key has less left than asked (`remaining`), or the store
    /// failed a rule that fails closed; more may come in `retry` seconds.
    Denied { remaining: u64, retry: u64 },
}

/// The engine, without its store's type, as a response body needs it.
pub(crate) trait Budgets: Keeper {
    /// Settles each charge at its actual cost, under the id the store
    /// holds its reservations open under if it holds any, in the
    /// background of the caller (a failure is logged: the store's own
    /// retries are done).
    fn settle(
        self: Arc<Self>,
        parts: Vec<(Charge, Charged, u64)>,
        hold: Option<Arc<str>>,
    ) -> BoxFuture<()>;
    /// Charges `cost` more to `charge`'s rule and key.
    fn extend(self: Arc<Self>, charge: Charge, cost: u64) -> BoxFuture<Extended>;
    /// The budget of `charge`'s rule, if it is a budget rule.
    fn budget(&self, charge: &Charge) -> Option<&ResponseCost>;
    /// The capacity of `charge`'s quota.
    fn capacity(&self, charge: &Charge) -> u64;
    /// The name `charge`'s rule is reported under.
    fn name(&self, charge: &Charge) -> &str;
    /// Tells the observer what became of `charge`'s reservation.
    fn observe(&self, charge: &Charge, event: BudgetEvent);
    /// The lease of `charge`'s rule, if it is a concurrency rule.
    fn lease_of(&self, charge: &Charge) -> Option<std::time::Duration>;
}

impl<St: Store + 'static> Budgets for Engine<St> {
    fn settle(
        self: Arc<Self>,
        parts: Vec<(Charge, Charged, u64)>,
        hold: Option<Arc<str>>,
    ) -> BoxFuture<()> {
        Box::pin(async move {
            let settles: Vec<Settle<'_>> = parts
                .iter()
                .map(|(c, charged, actual)| Settle {
                    rule: c.rule_id(),
                    key: c.key(),
                    charged: *charged,
                    actual: *actual,
                })
                .collect();
            let id = hold.as_deref().map_or_else(settle_id, str::to_owned);
            match self.store().settle(&id, &settles).await {
                Ok(settled) if settled.applied => {
                    // Each budget whose overrun left its key nothing, once.
                    let mut told: SmallVec<[&Charge; 1]> = SmallVec::new();
                    for ((charge, charged, actual), d) in parts.iter().zip(&settled.decisions) {
                        if *actual > charged.cost && d.remaining == 0 && !told.contains(&charge) {
                            told.push(charge);
                            self.observe(charge, BudgetEvent::Exhausted);
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "could not settle a response's cost"),
            }
        })
    }

    fn extend(self: Arc<Self>, charge: Charge, cost: u64) -> BoxFuture<Extended> {
        Box::pin(async move {
            let check = [Check {
                rule: charge.rule_id(),
                key: charge.key(),
                cost,
            }];
            let denied = |d: &Decision| Extended::Denied {
                remaining: d.remaining,
                retry: retry_after_secs(d.retry_after.unwrap_or_default()),
            };
            match self.store().check(&check).await {
                Ok(v) if !v.is_decided(0) => Extended::Uncharged,
                Ok(v) if v.allowed => {
                    Extended::Charged(Charged::of(cost, v.decided_at, &v.decisions[0]))
                }
                Ok(v) => denied(&v.decisions[0]),
                Err(e) => {
                    tracing::warn!(error = %e, "could not charge a stream as it passed: cut");
                    Extended::Denied {
                        remaining: 0,
                        retry: 1,
                    }
                }
            }
        })
    }

    fn budget(&self, charge: &Charge) -> Option<&ResponseCost> {
        self.response_cost(charge)
    }

    fn capacity(&self, charge: &Charge) -> u64 {
        self.store().rules()[charge.rule_id().0]
            .algorithm()
            .capacity()
    }

    fn name(&self, charge: &Charge) -> &str {
        self.rule_name(charge)
    }

    fn observe(&self, charge: &Charge, event: BudgetEvent) {
        if let Some(observer) = self.observer() {
            observer.budget(self.rule_name(charge), event);
        }
    }

    fn lease_of(&self, charge: &Charge) -> Option<std::time::Duration> {
        Engine::lease_of(self, charge)
    }
}

/// Where an event ends in a frame, and each meter's count after it.
type EventEnd = (usize, SmallVec<[u64; 1]>);

/// One budget charge of a response.
#[derive(Debug)]
struct Part {
    charge: Charge,
    // The reservation, then each charge made as the response passed.
    charged: SmallVec<[Charged; 1]>,
    // What the charges cover, with those a failure policy admitted
    // without charging.
    covered: u64,
    // The least a charge made as the stream passes asks for: the
    // reservation (at least 1), so that a long stream costs few store calls.
    step: u64,
    capacity: u64,
    measure: Measure,
    cut: bool,
    release_on_5xx: bool,
    // Which of the response's meters counts it (a usage measure).
    meter: Option<usize>,
    // A header measure's value, once read.
    read: Option<u64>,
    // The key had no more for it: events past `covered` are cut, and the
    // client may retry in this many seconds.
    denied: Option<u64>,
    // A charge of what the key had left was tried after a larger one was
    // denied.
    tried_rest: bool,
    // The wait the last denial gave.
    retry: u64,
}

/// What the body of a response under a budget rule measures and settles
/// (see [`crate::budget`]): opaque, made by the middleware.
pub struct Metering {
    budgets: Arc<dyn Budgets>,
    parts: SmallVec<[Part; 1]>,
    meters: SmallVec<[(UsageField, UsageMeter); 1]>,
    prompt_estimate: u64,
    status: u16,
    // The bytes of an event not yet whole, held back from a stream that may
    // be cut, so that a cut falls between two events.
    tail: BytesMut,
    // A frame's bytes waiting for the charges that cover them, and the
    // events they end: (offset, each meter's count after it).
    staged: Option<(Bytes, Vec<EventEnd>)>,
    // The part being charged more, what it asked, and the store's answer.
    extending: Option<(usize, u64, BoxFuture<Extended>)>,
    // Each meter's count after the last event the client was sent: what a
    // cut stream is charged.
    sent: SmallVec<[u64; 1]>,
    state: State,
    // The inner body has ended: it is not polled again.
    inner_done: bool,
    // Trailers held until the held-back bytes before them have gone out.
    trailers: Option<HeaderMap>,
    // The response is the front end's own, written because the upstream's
    // answer never came ([`Unanswered`]).
    unanswered: bool,
    // The request's in-flight slots, given back when this is dropped.
    leases: Option<Leases>,
    // The id the store holds the budget charges' reservations open under.
    hold: Option<Arc<str>>,
}

/// How a response's metering ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// The body ended (or failed).
    Done,
    /// The limiter cut the stream at the budget.
    Cut,
    /// The response was dropped before its end (the client went away).
    Left,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    // Cut: the last event, then the end.
    Cutting { rule: usize, retry: u64 },
    Ended,
}

impl std::fmt::Debug for Metering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metering")
            .field("parts", &self.parts)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// Takes the slots of concurrency rules out of `held` and keeps them:
/// renewed while the guard lives, from now on, and given back when it is
/// dropped. Answers the guard (none if no charge is a slot) and the other
/// charges (none if there are none).
pub(crate) fn keep_leases(
    budgets: &Arc<dyn Budgets>,
    held: Held,
) -> (Option<Leases>, Option<Held>) {
    let (unmade, made, hold) = held.into_parts();
    // A slot the store could not take (fail_open), or took without a
    // time to name it by (a cluster node that did not answer), is taken at
    // the first renew the store answers, if one is free, under a name drawn
    // here: a request let in while the store was away counts from then on,
    // and a renew sent again finds its slot held.
    let mut leases = Vec::new();
    let mut unmade_rest = Vec::new();
    for charge in unmade {
        match budgets.lease_of(&charge) {
            Some(lease) => leases.push(Kept {
                charged: Concurrency::drawn(charge.cost(), drawn_name()),
                charge,
                lease,
                ends: None,
            }),
            None => unmade_rest.push(charge),
        }
    }
    let mut made_rest = Vec::new();
    for (charge, charged) in made {
        match budgets.lease_of(&charge) {
            Some(lease) => leases.push(Kept {
                charged: match charged.reset_after {
                    0 => Concurrency::drawn(charged.cost, drawn_name()),
                    _ => charged,
                },
                charge,
                lease,
                ends: Some(tokio::time::Instant::now() + lease),
            }),
            None => made_rest.push((charge, charged)),
        }
    }
    let leases = match leases.is_empty() {
        true => None,
        false => {
            let keeper: Arc<dyn Keeper> = budgets.clone();
            Some(Leases::keep(keeper, leases))
        }
    };
    let rest = (!made_rest.is_empty() || !unmade_rest.is_empty())
        .then(|| Held::from_parts(unmade_rest, made_rest, hold));
    (leases, rest)
}

/// A random name for a lease no store took ([`Concurrency::drawn`]).
fn drawn_name() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    RandomState::new().hash_one(NEXT.fetch_add(1, Ordering::Relaxed))
}

impl Metering {
    /// The metering of a response whose request made these charges: none
    /// when no charge is a budget's or a concurrency rule's. The slots of
    /// concurrency rules are kept from now on.
    pub(crate) fn new(budgets: Arc<dyn Budgets>, held: Held, prompt_estimate: u64) -> Option<Self> {
        let (leases, held) = keep_leases(&budgets, held);
        Self::keeping(budgets, held, prompt_estimate, leases)
    }

    /// The metering of a response whose request made the charges `held`
    /// and holds the slots `leases` (kept since its admission: see
    /// [`keep_leases`]).
    pub(crate) fn keeping(
        budgets: Arc<dyn Budgets>,
        held: Option<Held>,
        prompt_estimate: u64,
        leases: Option<Leases>,
    ) -> Option<Self> {
        let (made, hold) = held.map_or_else(Default::default, |h| {
            let (_, made, hold) = h.into_parts();
            (made, hold)
        });
        let parts: SmallVec<[Part; 1]> = made
            .into_iter()
            .filter_map(|(charge, charged)| {
                let budget = budgets.budget(&charge)?;
                let capacity = budgets.capacity(&charge);
                Some(Part {
                    covered: charged.cost,
                    step: charged.cost.max(capacity / 100).max(1),
                    capacity,
                    measure: budget.measure.clone(),
                    cut: budget.on_overrun == Overrun::Cut,
                    release_on_5xx: budget.release_on_5xx,
                    meter: None,
                    read: None,
                    denied: None,
                    tried_rest: false,
                    retry: 1,
                    charged: SmallVec::from_buf([charged]),
                    charge,
                })
            })
            .collect();
        for p in &parts {
            budgets.observe(&p.charge, BudgetEvent::Opened);
        }
        (!parts.is_empty() || leases.is_some()).then(|| Self {
            budgets,
            parts,
            meters: SmallVec::new(),
            prompt_estimate,
            status: 0,
            tail: BytesMut::new(),
            staged: None,
            extending: None,
            sent: SmallVec::new(),
            state: State::Open,
            inner_done: false,
            trailers: None,
            unanswered: false,
            leases,
            hold,
        })
    }

    /// Whether a part reads the response's body (a usage measure).
    pub(crate) fn reads_body(&self) -> bool {
        self.parts
            .iter()
            .any(|p| matches!(p.measure, Measure::Usage(_)))
    }

    /// Reads what the response's head says (its status, a measure's
    /// header, its type) and meters its body.
    pub(crate) fn start<B>(
        mut self: Box<Self>,
        res: Response<B>,
    ) -> Response<crate::ResponseBody<B>> {
        let (head, body) = res.into_parts();
        self.status = head.status.as_u16();
        self.unanswered = head.extensions.get::<Unanswered>().is_some();
        self.read_headers(&head.headers);
        let content_type = head.headers.get(http::header::CONTENT_TYPE);
        // A coded body (one the upstream compressed all the same) cannot be
        // read: nothing is measured, and the reservations stand.
        let coded = head
            .headers
            .get(http::header::CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        for p in &mut self.parts {
            let Measure::Usage(field) = p.measure else {
                continue;
            };
            if coded {
                continue;
            }
            let at = match self.meters.iter().position(|(f, _)| *f == field) {
                Some(at) => at,
                None => {
                    let Some(mut meter) = UsageMeter::for_content_type(content_type, field) else {
                        continue;
                    };
                    meter.set_prompt_estimate(self.prompt_estimate);
                    self.meters.push((field, meter));
                    self.meters.len() - 1
                }
            };
            p.meter = Some(at);
        }
        // A stream cut at its budget ends early: no length can be promised.
        let mut head = head;
        if self.cuts() {
            head.headers.remove(http::header::CONTENT_LENGTH);
        }
        // What the client has been sent so far: the prompt's estimate, which
        // a stream cut before its first event still costs.
        self.sent = self.meters.iter().map(|(_, m)| m.counted()).collect();
        let metering = self;
        Response::from_parts(head, crate::ResponseBody::Metered { body, metering })
    }

    /// Takes each header measure's value from `headers` (the head's, then
    /// the trailers') where it has none yet.
    fn read_headers(&mut self, headers: &HeaderMap) {
        for p in &mut self.parts {
            if let (Measure::Header(name), None) = (&p.measure, p.read) {
                p.read = headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|s| s.trim().parse().ok());
            }
        }
    }

    /// The events each meter saw end in what `look` gave it: where each
    /// ended (the meters parse the same bytes, so they agree) and each
    /// meter's count after it.
    fn events(&mut self, mut look: impl FnMut(&mut UsageMeter) -> Boundaries) -> Vec<EventEnd> {
        let mut events: Vec<EventEnd> = Vec::new();
        for (m, (_, meter)) in self.meters.iter_mut().enumerate() {
            for (k, (end, count)) in look(meter).iter().enumerate() {
                if m == 0 {
                    events.push((end, SmallVec::new()));
                }
                if let Some(e) = events.get_mut(k) {
                    e.1.push(count);
                }
            }
        }
        events
    }

    /// The inner body has ended (or sent its trailers): a cut stream's
    /// last events are staged, or what is held back is returned to go out
    /// as the upstream sent it (an event never ended, which an SSE client
    /// drops).
    fn inner_ended(&mut self) -> Option<Bytes> {
        self.inner_done = true;
        if self.ends_stream() {
            return None;
        }
        let rest = self.tail.split().freeze();
        (!rest.is_empty()).then_some(rest)
    }

    /// At the end of the body, the events whose end only the end of the
    /// stream shows (one ended by a lone CR), staged as any others, so that
    /// a cut stream's last event is charged or cut too; whether there were
    /// any.
    fn ends_stream(&mut self) -> bool {
        if !self.cuts() {
            return false;
        }
        let mut events = self.events(UsageMeter::end_of_stream);
        for e in &mut events {
            e.0 += self.tail.len();
        }
        if events.is_empty() {
            return false;
        }
        let bytes = self.tail.split().freeze();
        self.staged = Some((bytes, events));
        true
    }

    /// Whether some part may cut the stream (and so whole events are held
    /// back until their charges cover them).
    fn cuts(&self) -> bool {
        self.parts
            .iter()
            .any(|p| p.cut && p.meter.is_some_and(|m| self.meters[m].1.is_event_stream()))
    }

    /// The body's next frame.
    pub(crate) fn poll_frame<B: Body<Data = Bytes>>(
        &mut self,
        mut body: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        loop {
            if let Some((p, asked, extending)) = &mut self.extending {
                let extended = ready!(extending.as_mut().poll(cx));
                let (p, asked) = (*p, *asked);
                self.extending = None;
                self.extended(p, asked, extended);
                continue;
            }
            if self.staged.is_some() {
                if let Some(frame) = self.release_staged() {
                    return Poll::Ready(Some(Ok(Frame::data(frame))));
                }
                continue;
            }
            match self.state {
                State::Ended => return Poll::Ready(None),
                State::Cutting { rule, retry } => {
                    self.end(Ending::Cut);
                    let name = self.budgets.name(&self.parts[rule].charge);
                    return Poll::Ready(Some(Ok(Frame::data(cut_event(name, retry)))));
                }
                State::Open => {}
            }
            if self.inner_done {
                if let Some(trailers) = self.trailers.take() {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
                self.end(Ending::Done);
                return Poll::Ready(None);
            }
            let frame = match ready!(body.as_mut().poll_frame(cx)) {
                None => {
                    if let Some(rest) = self.inner_ended() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    continue;
                }
                Some(Err(e)) => {
                    self.end(Ending::Done);
                    return Poll::Ready(Some(Err(e)));
                }
                Some(Ok(frame)) => frame,
            };
            let frame = match frame.into_data() {
                Ok(data) => data,
                Err(frame) => {
                    let Ok(trailers) = frame.into_trailers() else {
                        continue;
                    };
                    self.read_headers(&trailers);
                    // The trailers end the body: what is held back goes
                    // first.
                    self.trailers = Some(trailers);
                    if let Some(rest) = self.inner_ended() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    continue;
                }
            };
            let mut events = self.events(|meter| meter.feed(&frame));
            if !self.cuts() {
                return Poll::Ready(Some(Ok(Frame::data(frame))));
            }
            let held_back = self.tail.len();
            self.tail.extend_from_slice(&frame);
            let bytes = self.tail.split().freeze();
            for e in &mut events {
                e.0 += held_back;
            }
            self.staged = Some((bytes, events));
        }
    }

    /// What a staged frame lets through: nothing yet (a charge has been
    /// started, or there is no whole event), or its whole events up to the
    /// first one a part cannot cover.
    fn release_staged(&mut self) -> Option<Bytes> {
        let (_, events) = self.staged.as_ref().expect("staged");
        // Charges first: each part whose count passes what it covers.
        for (i, p) in self.parts.iter().enumerate() {
            let (true, Some(m), None) = (p.cut, p.meter, p.denied) else {
                continue;
            };
            let last = events.last().map_or(0, |e| e.1[m]);
            if last > p.covered {
                let cost = if p.tried_rest {
                    last - p.covered
                } else {
                    (last - p.covered).max(p.step)
                };
                let cost = cost.min(p.capacity);
                let future = self.budgets.clone().extend(p.charge.clone(), cost);
                self.extending = Some((i, cost, future));
                return None;
            }
        }
        let cut = events.iter().position(|(_, counts)| {
            self.parts
                .iter()
                .any(|p| p.denied.is_some() && p.meter.is_some_and(|m| counts[m] > p.covered))
        });
        let (bytes, events) = self.staged.take().expect("staged");
        let through = match cut {
            Some(k) => {
                let rule = (0..self.parts.len())
                    .find(|&i| {
                        let p = &self.parts[i];
                        p.denied.is_some() && p.meter.is_some_and(|m| events[k].1[m] > p.covered)
                    })
                    .expect("a part cuts");
                let retry = self.parts[rule].denied.expect("denied");
                self.state = State::Cutting { rule, retry };
                k.checked_sub(1).map_or(0, |j| events[j].0)
            }
            None => {
                let end = events.last().map_or(0, |e| e.0);
                if bytes.len() - end > MAX_HELD_BACK {
                    bytes.len()
                } else {
                    end
                }
            }
        };
        if self.state == State::Open {
            self.tail.extend_from_slice(&bytes[through..]);
        }
        let last_sent = match cut {
            Some(k) => k.checked_sub(1),
            None => events.len().checked_sub(1),
        };
        if let Some(j) = last_sent {
            self.sent = events[j].1.clone();
        }
        let through = bytes.slice(..through);
        // An empty frame is not sent: the loop polls on.
        (!through.is_empty()).then_some(through)
    }

    /// Takes in what a charge of `asked` made while the stream passed
    /// came to.
    fn extended(&mut self, p: usize, asked: u64, extended: Extended) {
        let part = &mut self.parts[p];
        match extended {
            Extended::Charged(charged) => {
                part.charged.push(charged);
                // A long stream asks for more each time: few store calls
                // however small its reservation.
                part.step = part
                    .step
                    .saturating_mul(2)
                    .min((part.capacity / 10).max(part.step));
            }
            Extended::Uncharged => {}
            Extended::Denied { remaining, retry } => {
                part.retry = retry;
                if remaining > 0 && !part.tried_rest {
                    // Less than was asked is left: the stream may still
                    // have that, then no more.
                    part.tried_rest = true;
                    let future = self.budgets.clone().extend(part.charge.clone(), remaining);
                    self.extending = Some((p, remaining, future));
                } else {
                    part.denied = Some(retry);
                }
                return;
            }
        }
        part.covered = part.covered.saturating_add(asked);
        if part.tried_rest {
            // What the key had left has been taken: no more after it.
            part.denied = Some(part.retry);
        }
    }

    /// Settles every part, once, and gives the slots back.
    fn end(&mut self, ending: Ending) {
        self.leases = None;
        if self.state == State::Ended {
            return;
        }
        self.state = State::Ended;
        let sent = std::mem::take(&mut self.sent);
        let usages: SmallVec<[Option<u64>; 1]> = std::mem::take(&mut self.meters)
            .into_iter()
            .enumerate()
            .map(|(m, (_, meter))| {
                let counted = meter.counted();
                let usage = meter.finish();
                match ending {
                    Ending::Done => usage.cost(),
                    // What the client was sent, up to the cut, or what the
                    // upstream reported if that is more (the usage of an
                    // event that was cut is still what it spent).
                    Ending::Cut => Some(
                        sent.get(m)
                            .copied()
                            .unwrap_or(0)
                            .max(usage.reported.unwrap_or(0)),
                    ),
                    // What was counted, if anything was: a stream left
                    // before its usage came pays its deltas so far.
                    Ending::Left => {
                        (usage.reported.is_some() || usage.deltas > 0).then_some(counted)
                    }
                }
            })
            .collect();
        let mut settles = Vec::new();
        for p in &self.parts {
            let measured = match p.measure {
                Measure::Header(_) => p.read,
                Measure::Usage(_) => p.meter.and_then(|m| usages[m]),
            };
            // Only a failure that measured nothing, and that the upstream
            // answered itself, is given back.
            let released =
                p.release_on_5xx && self.status >= 500 && measured.is_none() && !self.unanswered;
            let charged: u64 = p.charged.iter().map(|c| c.cost).sum();
            let how = match (measured, ending) {
                _ if released => Settled::Released,
                (None, _) if (400..500).contains(&self.status) => Settled::Released,
                (None, _) => Settled::Kept,
                (Some(_), Ending::Done) => Settled::Measured,
                (Some(_), Ending::Cut) => Settled::Cut,
                (Some(_), Ending::Left) => Settled::Left,
            };
            let actual = match how {
                Settled::Kept => charged,
                _ => measured.unwrap_or(0),
            };
            // A reservation the store holds open is closed even when it
            // stands as charged: else it would be given back in time.
            let held = p.charged.iter().any(|c| c.held);
            self.budgets.observe(
                &p.charge,
                BudgetEvent::Closed {
                    how,
                    charged,
                    actual,
                },
            );
            if how == Settled::Kept && !held {
                continue;
            }
            // The first charges are filled first, the last takes the rest:
            // what was spent early was spent in the early charges' windows.
            let n = p.charged.len();
            let mut left = actual;
            for (k, charged) in p.charged.iter().enumerate() {
                let share = if k + 1 == n {
                    left
                } else {
                    left.min(charged.cost)
                };
                left -= share;
                settles.push((p.charge.clone(), *charged, share));
            }
        }
        if settles.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no runtime to settle a response's cost on: its reservation stands");
            return;
        };
        runtime.spawn(self.budgets.clone().settle(settles, self.hold.clone()));
    }
}

impl Drop for Metering {
    fn drop(&mut self) {
        self.end(Ending::Left);
    }
}

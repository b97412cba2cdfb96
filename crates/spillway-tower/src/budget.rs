//! Budgets: rules whose cost is known only once the response has ended
//! (tokens of an LLM API, bytes served). The request reserves an estimate
//! when it is admitted; its response is measured as it passes; the charge
//! is settled at what the response cost ([`Store::settle`]).
//!
//! [`Store::settle`]: spillway::store::Store::settle

use http::HeaderName;
use http::request::Parts;

use crate::usage::UsageField;

pub use crate::metered::Metering;

/// Where a budget rule reads what a response cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Measure {
    /// A response header, or a trailer of that name when the head has
    /// none (`x-usage-tokens`): a non-negative integer.
    Header(HeaderName),
    /// The OpenAI-compatible `usage` of a JSON body or of a
    /// `text/event-stream` response, read as it passes (see
    /// [`UsageMeter`](crate::usage::UsageMeter)).
    Usage(UsageField),
}

/// What a budget rule reserves when a request is admitted, before
/// [`ResponseCost::max_reserve`] caps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserve {
    /// Always this much.
    Fixed(u64),
    /// The value of this request header, trusted as a cost header is (a
    /// [`RequestCost`](crate::RequestCost)-like extension does not apply:
    /// the header only when the peer is a trusted proxy); `default`
    /// otherwise.
    Header {
        /// The header.
        name: HeaderName,
        /// The reservation when the header is absent or not trusted
        /// (`None`: a tenth of the quota's capacity).
        default: Option<u64>,
    },
    /// What the request asks for, as a layer that read its JSON body
    /// says ([`RequestReserve`]): the top-level number `field` (such as
    /// `max_tokens`), `default` when the request has none, and (unless
    /// only completions are measured) an estimate of the prompt.
    Request {
        /// The body's field.
        field: String,
        /// The reservation of a request that gives no hint (`None`: a
        /// tenth of the quota's capacity).
        default: Option<u64>,
    },
}

/// What is done when a response costs more than its key has left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overrun {
    /// The response ends as the upstream sends it; what it cost past the
    /// budget is charged as debt, which later requests wait out.
    #[default]
    Finish,
    /// An event stream is ended at the budget, between two events, with a
    /// last event saying why ([`cut_event`](crate::usage::cut_event)):
    /// while it passes, what it has cost is charged as it goes, and once
    /// the key has nothing left the client gets no more.
    Cut,
}

/// A response extension, set by a front end on an answer of its own
/// written because the upstream's never came (a response timeout, a
/// connection lost after the request was sent): the upstream may have done
/// the work all the same, so a budget keeps the reservation, whatever its
/// `release_on_5xx` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Unanswered;

/// A request extension, set by a layer that read the request's JSON body
/// (the proxy's, for a rule that reserves what the request asks): the
/// top-level numbers the rules name (`max_tokens`: the most the response
/// may cost, as the request bounds it), and an estimate of what the
/// request itself costs (its prompt).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestReserve {
    /// Each named field the body has, as a non-negative integer.
    pub asked: Vec<(String, u64)>,
    /// An estimate of what the request itself costs (its prompt).
    pub prompt_estimate: u64,
    /// The body could not be read: longer than the reader takes, or not
    /// JSON its parser accepts, when the upstream's may. What the request
    /// asks is unknown, so it reserves the most one request may
    /// ([`ResponseCost::reservation_cap`]): a client gains nothing by
    /// writing its body for one parser and not the other.
    pub unreadable: bool,
}

impl RequestReserve {
    /// A body that could not be read (see [`unreadable`](Self::unreadable)).
    pub fn unreadable() -> Self {
        Self {
            unreadable: true,
            ..Self::default()
        }
    }

    /// The body's `field`, if it has it.
    pub fn asked(&self, field: &str) -> Option<u64> {
        self.asked.iter().find(|(f, _)| f == field).map(|(_, n)| *n)
    }
}

/// A cost known only from the response: what to reserve when the request
/// is admitted, and where to read what it cost (see
/// [`Cost::Response`](crate::Cost::Response)).
///
/// ```
/// use spillway_tower::budget::{Overrun, Reserve, ResponseCost};
/// use spillway_tower::usage::UsageField;
///
/// let asked = Reserve::Request { field: "max_tokens".into(), default: Some(500) };
/// let cost = ResponseCost::usage(UsageField::Total)
///     .reserve(asked)
///     .max_reserve(4_000)
///     .on_overrun(Overrun::Cut);
/// assert_eq!(cost.reservation_cap(100_000), 4_000);
/// // Unset, the cap is half the quota's capacity.
/// assert_eq!(ResponseCost::usage(UsageField::Total).reservation_cap(100_000), 50_000);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseCost {
    pub(crate) measure: Measure,
    pub(crate) reserve: Reserve,
    pub(crate) max_reserve: Option<u64>,
    pub(crate) on_overrun: Overrun,
    pub(crate) release_on_5xx: bool,
    pub(crate) release_after: Option<std::time::Duration>,
}

impl ResponseCost {
    /// Measured by the response's `usage` (its `field`); reserving what
    /// the request asks in `max_tokens` ([`Reserve::Request`], with the
    /// default default).
    pub fn usage(field: UsageField) -> Self {
        Self::measured(Measure::Usage(field))
    }

    /// Measured by a response header or trailer.
    pub fn header(name: HeaderName) -> Self {
        Self::measured(Measure::Header(name))
    }

    fn measured(measure: Measure) -> Self {
        Self {
            measure,
            reserve: Reserve::Request {
                field: "max_tokens".to_string(),
                default: None,
            },
            max_reserve: None,
            on_overrun: Overrun::Finish,
            release_on_5xx: false,
            release_after: None,
        }
    }

    /// What to reserve.
    pub fn reserve(mut self, reserve: Reserve) -> Self {
        self.reserve = reserve;
        self
    }

    /// The most one request reserves (default: half the quota's
    /// capacity), whatever it asks: no request holds a key's whole budget.
    pub fn max_reserve(mut self, max: u64) -> Self {
        self.max_reserve = Some(max);
        self
    }

    /// What to do with a response that costs more than its key has left.
    pub fn on_overrun(mut self, overrun: Overrun) -> Self {
        self.on_overrun = overrun;
        self
    }

    /// Whether a response with a 5xx status gives its whole reservation
    /// back (default: no, it is measured as any other).
    pub fn release_on_5xx(mut self, release: bool) -> Self {
        self.release_on_5xx = release;
        self
    }

    /// Gives back a reservation no settle has closed within `within` of
    /// its charge (`on_expiry = "release"`): the store holds each open
    /// and settles it at 0 by itself once that time has passed, whichever
    /// instance meets its key first
    /// ([`Rule::release_unsettled_after`](spillway::store::Rule::release_unsettled_after)),
    /// so a front end that died with responses in flight costs their
    /// clients nothing past it; a settle that comes later charges the
    /// whole actual cost. Unset (the default), such a reservation stays
    /// charged: what was reserved is what it costs.
    pub fn release_unsettled_after(mut self, within: std::time::Duration) -> Self {
        self.release_after = Some(within);
        self
    }

    /// How long a reservation stays open unsettled before it is given back,
    /// if it ever is ([`release_unsettled_after`](Self::release_unsettled_after)).
    pub fn release_after(&self) -> Option<std::time::Duration> {
        self.release_after
    }

    /// Where the cost is read.
    pub fn measure(&self) -> &Measure {
        &self.measure
    }

    /// What is done with an overrun.
    pub fn overrun(&self) -> Overrun {
        self.on_overrun
    }

    /// The most one request reserves under a quota of `capacity`: the
    /// configured cap, else half the capacity; never more than the
    /// capacity, and at least 1 when the capacity is.
    pub fn reservation_cap(&self, capacity: u64) -> u64 {
        self.max_reserve
            .unwrap_or(capacity / 2)
            .min(capacity)
            .max(capacity.min(1))
    }

    /// What a request reserves under a quota of `capacity`; the message of
    /// a 400 for a trusted reserve header that is not a number.
    pub(crate) fn reservation(
        &self,
        parts: &Parts,
        peer_trusted: bool,
        capacity: u64,
    ) -> Result<u64, String> {
        let default = |d: Option<u64>| d.unwrap_or(capacity / 10);
        let asked = match &self.reserve {
            Reserve::Fixed(n) => *n,
            Reserve::Header { name, default: d } => {
                match parts.headers.get(name).filter(|_| peer_trusted) {
                    None => default(*d),
                    Some(v) => v
                        .to_str()
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                        .ok_or_else(|| {
                            format!("header `{name}` must be a non-negative integer reservation")
                        })?,
                }
            }
            Reserve::Request { field, default: d } => {
                let hint = parts.extensions.get::<RequestReserve>();
                // A completion-only budget does not pay for the prompt.
                let prompt = match (&self.measure, hint) {
                    (Measure::Usage(UsageField::Completion), _) | (_, None) => 0,
                    (_, Some(h)) => h.prompt_estimate,
                };
                if hint.is_some_and(|h| h.unreadable) {
                    return Ok(self.reservation_cap(capacity));
                }
                let output = hint
                    .and_then(|h| h.asked(field))
                    .unwrap_or_else(|| default(*d));
                output.saturating_add(prompt)
            }
        };
        Ok(asked.min(self.reservation_cap(capacity)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)], hint: Option<RequestReserve>) -> Parts {
        let mut req = http::Request::builder().uri("/v1/chat/completions");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let (mut parts, ()) = req.body(()).unwrap().into_parts();
        if let Some(h) = hint {
            parts.extensions.insert(h);
        }
        parts
    }

    #[test]
    fn a_request_reserves_what_it_asks_capped_at_half_the_capacity() {
        let cost = ResponseCost::usage(UsageField::Total);
        let asks = |max_output: Option<u64>, prompt_estimate| {
            let hint = RequestReserve {
                asked: max_output
                    .map(|n| ("max_tokens".to_string(), n))
                    .into_iter()
                    .collect(),
                prompt_estimate,
                unreadable: false,
            };
            cost.reservation(&parts(&[], Some(hint)), false, 10_000)
                .unwrap()
        };
        assert_eq!(asks(Some(800), 200), 1_000);
        assert_eq!(
            asks(None, 200),
            1_200,
            "a tenth of the capacity, and the prompt"
        );
        assert_eq!(asks(Some(1_000_000), 0), 5_000, "never the whole budget");
        assert_eq!(asks(Some(u64::MAX), u64::MAX), 5_000);
        // No reading layer: the default.
        assert_eq!(
            cost.reservation(&parts(&[], None), false, 10_000),
            Ok(1_000)
        );
        // A completion budget does not reserve for the prompt.
        let completion = ResponseCost::usage(UsageField::Completion);
        let hint = RequestReserve {
            asked: vec![("max_tokens".to_string(), 800)],
            prompt_estimate: 200,
            unreadable: false,
        };
        assert_eq!(
            completion.reservation(&parts(&[], Some(hint)), false, 10_000),
            Ok(800)
        );
        // A body that could not be read reserves the most.
        let unreadable = RequestReserve {
            unreadable: true,
            ..RequestReserve::default()
        };
        assert_eq!(
            completion.reservation(&parts(&[], Some(unreadable)), false, 10_000),
            Ok(5_000)
        );
    }

    #[test]
    fn a_reserve_header_counts_only_from_a_trusted_peer() {
        let cost =
            ResponseCost::header(HeaderName::from_static("x-usage")).reserve(Reserve::Header {
                name: HeaderName::from_static("x-reserve"),
                default: Some(7),
            });
        let p = parts(&[("x-reserve", "300")], None);
        assert_eq!(cost.reservation(&p, true, 1_000), Ok(300));
        assert_eq!(cost.reservation(&p, false, 1_000), Ok(7));
        let bad = parts(&[("x-reserve", "-1")], None);
        assert!(cost.reservation(&bad, true, 1_000).is_err());
        assert_eq!(cost.reservation(&bad, false, 1_000), Ok(7));
    }

    #[test]
    fn the_cap_never_passes_the_capacity() {
        let cost = ResponseCost::usage(UsageField::Total).max_reserve(50);
        assert_eq!(cost.reservation_cap(20), 20);
        assert_eq!(cost.reservation_cap(1_000), 50);
        assert_eq!(ResponseCost::usage(UsageField::Total).reservation_cap(1), 1);
        let fixed = ResponseCost::usage(UsageField::Total).reserve(Reserve::Fixed(0));
        assert_eq!(fixed.reservation(&parts(&[], None), false, 100), Ok(0));
    }
}

//! The rate-limit headers: `X-RateLimit-*` and the IETF draft fields
//! `RateLimit-Policy` and `RateLimit`, serialized as structured fields
//! (RFC 9651) with the `sfv` crate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue};
use sfv::StringRef;
use spillway::{Algorithm, AnyAlgorithm, Decision, Quota};

/// `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-11, §3): each
/// rule's quota policy, `q` its quota and `w` its window in seconds.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11, §4): `r` the
/// available quota, `t` the effective window in seconds.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `x-ratelimit-limit-tokens` (OpenAI's name): a budget's quota.
pub const X_RATELIMIT_LIMIT_TOKENS: HeaderName =
    HeaderName::from_static("x-ratelimit-limit-tokens");
/// `x-ratelimit-remaining-tokens` (OpenAI's name): what a budget has left.
pub const X_RATELIMIT_REMAINING_TOKENS: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining-tokens");
/// `x-ratelimit-reset-tokens` (OpenAI's name): when a budget is whole
/// again, as a duration (`6m0s`, `1.5s`, `250ms`).
pub const X_RATELIMIT_RESET_TOKENS: HeaderName =
    HeaderName::from_static("x-ratelimit-reset-tokens");

/// Which headers to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderOptions {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    pub legacy: bool,
    /// The IETF draft fields `RateLimit-Policy` and `RateLimit`.
    pub ietf: bool,
    /// How `X-RateLimit-Reset` is written.
    pub reset: ResetFormat,
    /// `x-ratelimit-limit-tokens`, `x-ratelimit-remaining-tokens` and
    /// `x-ratelimit-reset-tokens`, the names OpenAI's API sends and LLM
    /// client libraries read, describing the request's budget rule (the
    /// one with the least left, if several): sent only when a budget rule
    /// applied. Off by default.
    pub openai: bool,
}

impl Default for HeaderOptions {
    fn default() -> Self {
        Self {
            legacy: true,
            ietf: true,
            reset: ResetFormat::Unix,
            openai: false,
        }
    }
}

/// How `X-RateLimit-Reset` is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResetFormat {
    /// Unix time in seconds at which the quota is back to full (like GitHub).
    #[default]
    Unix,
    /// Seconds from now.
    Delta,
}

/// Whole seconds, rounded up: a client that waits this long is never early.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// `Retry-After` for a wait of `d`: whole seconds, rounded up, and never 0
/// (a client told 0 would retry at once and be denied again).
///
/// ```
/// use std::time::Duration;
///
/// assert_eq!(spillway_tower::retry_after_secs(Duration::from_millis(1500)), 2);
/// assert_eq!(spillway_tower::retry_after_secs(Duration::ZERO), 1);
/// ```
pub fn retry_after_secs(d: Duration) -> u64 {
    ceil_secs(d).max(1)
}

/// The wait of a denial whose decision gives none: the shortest
/// `Retry-After`.
pub(crate) const UNKNOWN_RETRY_AFTER: Duration = Duration::from_secs(1);

/// `RateLimit`'s `t` for `decision`: in draft-ietf-httpapi-ratelimit-headers-11,
/// "the number of seconds until additional quota associated with the quota
/// policy is made available" (earlier drafts said "until the quota
/// resets"; the change is for sliding windows, whose quota comes back
/// before the whole window has passed). Admitted, the time until one more
/// unit than `r` fits ([`Decision::refill_after`]). Denied, the
/// `Retry-After` number: "the Retry-After field value SHOULD NOT reference a
/// point in time earlier than the end of the effective window", and until
/// then the request cannot be made.
fn effective_window_secs(decision: &Decision) -> u64 {
    if decision.allowed {
        ceil_secs(decision.refill_after)
    } else {
        retry_after_secs(decision.retry_after.unwrap_or(UNKNOWN_RETRY_AFTER))
    }
}

/// One rule's part in the headers.
#[derive(Debug, Clone)]
pub(crate) struct Applied<'a> {
    pub name: &'a str,
    pub decision: Decision,
    // The policy's window in seconds: the time the quota takes to refill.
    pub window_secs: u64,
    // The values made in advance for the quota that decided, used when the
    // decision's limit is the one they were made for.
    pub presented: Option<&'a Presented>,
}

impl Applied<'_> {
    fn presented(&self) -> Option<&Presented> {
        self.presented
            .filter(|p| p.limit == self.decision.limit && p.window_secs == self.window_secs)
    }
}

/// The header values a quota always gives, made once per rule and tier:
/// the headers are written on every response, and these parts never change
/// between requests.
#[derive(Debug, Clone)]
pub(crate) struct Presented {
    /// The limit a decision under this quota reports: its capacity.
    pub limit: u64,
    /// The time the quota takes to refill from empty, in whole seconds.
    pub window_secs: u64,
    /// The quota's item in `RateLimit-Policy`: `"name";q=100;w=60`.
    policy_item: String,
}

impl Presented {
    /// The values for `algorithm`'s quota, under the rule whose name is
    /// `sf_name` (see [`sf_name`]).
    pub(crate) fn new(sf_name: &str, algorithm: &AnyAlgorithm) -> Self {
        let limit = algorithm.capacity();
        let window_secs = window_secs_of(algorithm, limit);
        let mut item = BytesMut::with_capacity(sf_name.len() + 48);
        item.extend_from_slice(sf_name.as_bytes());
        push_policy_params(&mut item, limit, window_secs);
        // A rule name (printable ASCII, see `sf_name`) and digits.
        let policy_item = String::from_utf8(item.to_vec()).expect("ASCII");
        Self {
            limit,
            window_secs,
            policy_item,
        }
    }
}

/// The window a policy announces for `algorithm` with a limit of `limit`
/// ([`window_secs`]), or [`NO_WINDOW`] for a concurrency rule.
pub(crate) fn window_secs_of(algorithm: &AnyAlgorithm, limit: u64) -> u64 {
    match algorithm {
        AnyAlgorithm::Concurrency(_) => NO_WINDOW,
        _ => window_secs(&algorithm.quota(), limit),
    }
}

/// The window of a concurrency rule's policy: none. A slot is held while
/// its request runs, not for a time; its policy says
/// `qu="concurrent-requests"` and has no `w`. (A rate's window is never 0:
/// it is rounded up to whole seconds.)
pub(crate) const NO_WINDOW: u64 = 0;

/// A quota policy item's parameters: `q`, and `w` (a rate) or
/// `qu="concurrent-requests"` (a concurrency rule, [`NO_WINDOW`]), the
/// quota unit draft-ietf-httpapi-ratelimit-headers defines for it.
fn push_policy_params(out: &mut BytesMut, limit: u64, window_secs: u64) {
    push_param(out, "q", limit);
    if window_secs == NO_WINDOW {
        out.extend_from_slice(b";qu=\"concurrent-requests\"");
    } else {
        push_param(out, "w", window_secs);
    }
}

/// The time `quota` takes to refill `limit` from empty, in whole seconds
/// rounded up: `limit` x period / the quota's limit, in exact integers.
pub(crate) fn window_secs(quota: &Quota, limit: u64) -> u64 {
    let micros =
        u128::from(quota.period_micros()) * u128::from(limit) / u128::from(quota.limit().get());
    ceil_secs(Duration::from_micros(
        u64::try_from(micros).unwrap_or(u64::MAX),
    ))
}

/// A rule name as a structured-field String (quotes included), serialized
/// by `sfv`, of its [`printable_name`].
pub(crate) fn sf_name(name: &str) -> String {
    let printable = printable_name(name);
    StringRef::from_str(&printable)
        .map(|s| sfv::ItemSerializer::new().bare_item(s).finish())
        .unwrap_or_else(|_| "\"?\"".to_string())
}

/// The name a rule's policy goes by, wherever the client reads it (the
/// structured fields, a quota-exceeded body's `violated-policies`): names
/// are printable ASCII in practice; anything else becomes `?` so that a
/// header stays valid.
pub(crate) fn printable_name(name: &str) -> String {
    name.chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
        .collect()
}

/// Appends `d` as OpenAI's rate-limit headers write a wait (Go's duration
/// format): `250ms` under a second, else hours, minutes and seconds with
/// up to three decimals (`1.5s`, `6m0s`, `1h0m0s`), rounded up to the
/// millisecond, so that a client that waits it is never early.
pub(crate) fn push_go_duration(out: &mut BytesMut, d: Duration) {
    let mut digits = itoa::Buffer::new();
    let ms = d.as_micros().div_ceil(1000);
    if ms < 1000 {
        out.extend_from_slice(digits.format(ms).as_bytes());
        out.extend_from_slice(if ms == 0 { b"s" } else { b"ms" });
        return;
    }
    let (secs, frac) = (ms / 1000, ms % 1000);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if h > 0 {
        out.extend_from_slice(digits.format(h).as_bytes());
        out.extend_from_slice(b"h");
    }
    if h > 0 || m > 0 {
        out.extend_from_slice(digits.format(m).as_bytes());
        out.extend_from_slice(b"m");
    }
    out.extend_from_slice(digits.format(s).as_bytes());
    if frac > 0 {
        let three = [
            b'0' + (frac / 100) as u8,
            b'0' + (frac / 10 % 10) as u8,
            b'0' + (frac % 10) as u8,
        ];
        let keep = three.iter().rposition(|&c| c != b'0').map_or(0, |i| i + 1);
        out.extend_from_slice(b".");
        out.extend_from_slice(&three[..keep]);
    }
    out.extend_from_slice(b"s");
}

/// Appends a parameter `;key=value`. Structured-field integers are their
/// decimal digits, at most 15 of them.
fn push_param(out: &mut BytesMut, key: &str, value: u64) {
    out.extend_from_slice(b";");
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"=");
    let mut buf = itoa::Buffer::new();
    out.extend_from_slice(buf.format(value.min(999_999_999_999_999)).as_bytes());
}

/// The rate-limit header fields of one response, as data: each field's
/// name and value, in the order they are sent. The engine makes them
/// ([`Engine::fields`](crate::Engine::fields)); each front end renders
/// them as it speaks: [`write_to`](Self::write_to) into a `HeaderMap`, or
/// [`iter`](Self::iter) for anything else (HTTP/1.1 header lines, Envoy's
/// header list).
///
/// The values made for one response share one buffer, each field a range
/// of it, or a value made in advance for the rule's quota.
#[derive(Debug, Default, Clone)]
pub struct RateLimitFields {
    values: BytesMut,
    // Each field's range of `values`, in the order of `NAMES`; empty when
    // the field is not sent. Kept this small because answers carrying the
    // fields are moved through every layer of a server.
    spans: [(u32, u32); 8],
}

/// The fields' names, in the order they are sent.
const NAMES: [HeaderName; 8] = [
    X_RATELIMIT_LIMIT,
    X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET,
    RATELIMIT_POLICY,
    RATELIMIT,
    X_RATELIMIT_LIMIT_TOKENS,
    X_RATELIMIT_REMAINING_TOKENS,
    X_RATELIMIT_RESET_TOKENS,
];

impl RateLimitFields {
    /// The fields for the rules that applied; `reported` is the one
    /// `X-RateLimit-*` and `RateLimit` describe. Each rule's name comes
    /// pre-serialized (see [`sf_name`]), and the values that never change
    /// are made in advance ([`Presented`]): this runs on every response, so
    /// it builds the values in one buffer. `tokens` is the decision of
    /// the request's budget rule, if one applied (the OpenAI-style family).
    pub(crate) fn new(
        options: &HeaderOptions,
        applied: &[Applied<'_>],
        reported: usize,
        tokens: Option<&Decision>,
    ) -> Self {
        let Some(main) = applied.get(reported) else {
            return Self::default();
        };
        let d = &main.decision;
        let made = main.presented();
        let mut values = BytesMut::with_capacity(96 + main.name.len());
        let mut spans = [(0u32, 0u32); 8];
        let mut digits = itoa::Buffer::new();
        // The buffer is a few hundred bytes: its offsets fit a u32.
        let span = |values: &BytesMut, start: usize| (start as u32, values.len() as u32);
        if options.legacy {
            let reset = match options.reset {
                ResetFormat::Delta => ceil_secs(d.reset_after),
                ResetFormat::Unix => {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default();
                    ceil_secs(now + d.reset_after)
                }
            };
            let start = values.len();
            values.extend_from_slice(digits.format(d.limit).as_bytes());
            spans[0] = span(&values, start);
            let start = values.len();
            values.extend_from_slice(digits.format(d.remaining).as_bytes());
            spans[1] = span(&values, start);
            let start = values.len();
            values.extend_from_slice(digits.format(reset).as_bytes());
            spans[2] = span(&values, start);
        }
        if options.ietf {
            let start = values.len();
            match (applied, made) {
                ([_], Some(p)) => values.extend_from_slice(p.policy_item.as_bytes()),
                _ => {
                    for (i, a) in applied.iter().enumerate() {
                        if i > 0 {
                            values.extend_from_slice(b", ");
                        }
                        match a.presented() {
                            Some(p) => values.extend_from_slice(p.policy_item.as_bytes()),
                            None => {
                                values.extend_from_slice(a.name.as_bytes());
                                push_policy_params(&mut values, a.decision.limit, a.window_secs);
                            }
                        }
                    }
                }
            }
            spans[3] = span(&values, start);
            let start = values.len();
            values.extend_from_slice(main.name.as_bytes());
            push_param(&mut values, "r", d.remaining);
            push_param(&mut values, "t", effective_window_secs(d));
            spans[4] = span(&values, start);
        }
        if let (true, Some(t)) = (options.openai, tokens) {
            let start = values.len();
            values.extend_from_slice(digits.format(t.limit).as_bytes());
            spans[5] = span(&values, start);
            let start = values.len();
            values.extend_from_slice(digits.format(t.remaining).as_bytes());
            spans[6] = span(&values, start);
            let start = values.len();
            push_go_duration(&mut values, t.reset_after);
            spans[7] = span(&values, start);
        }
        Self { values, spans }
    }

    /// Whether there is no field to send.
    pub fn is_empty(&self) -> bool {
        self.spans.iter().all(|(start, end)| start == end)
    }

    /// Each field's name and value, in the order they are sent.
    pub fn iter(&self) -> impl Iterator<Item = (HeaderName, &[u8])> + '_ {
        NAMES
            .into_iter()
            .zip(self.spans)
            .filter(|(_, (start, end))| start != end)
            .map(|(name, (start, end))| (name, &self.values[start as usize..end as usize]))
    }

    /// Writes the fields into `headers` (replacing any of the same names).
    pub fn write_to(self, headers: &mut HeaderMap) {
        if self.is_empty() {
            return;
        }
        headers.reserve(5);
        // Each header gets a slice of the one buffer, not a copy.
        let values = self.values.freeze();
        for (name, (start, end)) in NAMES.into_iter().zip(self.spans) {
            if start == end {
                continue;
            }
            // Digits and structured fields made here: always valid.
            if let Ok(v) =
                HeaderValue::from_maybe_shared(values.slice(start as usize..end as usize))
            {
                headers.insert(name, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use spillway::Quota;
    use spillway::algorithm::FixedWindow;

    use super::*;

    fn decision(limit: u64) -> Decision {
        Decision {
            allowed: true,
            limit,
            remaining: 1,
            reset_after: Duration::from_secs(5),
            refill_after: Duration::from_secs(2),
            retry_after: None,
            delay: Duration::ZERO,
        }
    }

    #[test]
    fn values_made_in_advance_are_used_only_for_the_limit_they_were_made_for() {
        let quota = Quota::per_minute(NonZeroU32::new(100).expect("nonzero"));
        let name = sf_name("api");
        let made = Presented::new(&name, &FixedWindow::new(quota).into());
        let write_for = |limit, window_secs| {
            let mut map = HeaderMap::new();
            let applied = Applied {
                name: &name,
                decision: decision(limit),
                window_secs,
                presented: Some(&made),
            };
            RateLimitFields::new(&HeaderOptions::default(), &[applied], 0, None).write_to(&mut map);
            map
        };
        let same = write_for(100, 60);
        assert_eq!(same[X_RATELIMIT_LIMIT], "100");
        assert_eq!(same[RATELIMIT_POLICY], "\"api\";q=100;w=60");
        // A store reporting another limit (or window) is described as it
        // reports, not with the values made for the configured quota.
        let other = write_for(40, 24);
        assert_eq!(other[X_RATELIMIT_LIMIT], "40");
        assert_eq!(other[RATELIMIT_POLICY], "\"api\";q=40;w=24");
    }

    #[test]
    fn a_concurrency_policy_counts_concurrent_requests_and_has_no_window() {
        let quota = Quota::new(
            NonZeroU32::new(5).expect("nonzero"),
            Duration::from_secs(30),
        )
        .expect("valid");
        let leases = AnyAlgorithm::from(spillway::algorithm::Concurrency::new(quota));
        let per_minute = Quota::per_minute(NonZeroU32::new(100).expect("nonzero"));
        let (slots, api) = (sf_name("slots"), sf_name("api"));
        let made = Presented::new(&slots, &leases);
        assert_eq!(made.policy_item, "\"slots\";q=5;qu=\"concurrent-requests\"");
        let applied = [
            Applied {
                name: &slots,
                decision: decision(5),
                window_secs: window_secs_of(&leases, 5),
                presented: None,
            },
            Applied {
                name: &api,
                decision: decision(100),
                window_secs: window_secs_of(&FixedWindow::new(per_minute).into(), 100),
                presented: None,
            },
        ];
        let mut map = HeaderMap::new();
        RateLimitFields::new(&HeaderOptions::default(), &applied, 0, None).write_to(&mut map);
        assert_eq!(
            map[RATELIMIT_POLICY],
            "\"slots\";q=5;qu=\"concurrent-requests\", \"api\";q=100;w=60"
        );
        // The free slots (the decision's remaining).
        assert_eq!(map[RATELIMIT], "\"slots\";r=1;t=2");
    }

    /// The fields as listed say what the header map says, for every option
    /// and for one rule or several (values made in advance or not).
    #[test]
    fn a_wait_is_written_as_openai_writes_it_never_early() {
        let go = |micros: u64| {
            let mut out = BytesMut::new();
            push_go_duration(&mut out, Duration::from_micros(micros));
            String::from_utf8(out.to_vec()).expect("ASCII")
        };
        assert_eq!(go(0), "0s");
        assert_eq!(go(1), "1ms");
        assert_eq!(go(250_000), "250ms");
        assert_eq!(go(999_001), "1s");
        assert_eq!(go(1_500_000), "1.5s");
        assert_eq!(go(1_250_000), "1.25s");
        assert_eq!(go(17_003_000), "17.003s");
        assert_eq!(go(59_999_100), "1m0s");
        assert_eq!(go(360_000_000), "6m0s");
        assert_eq!(go(3_600_000_000), "1h0m0s");
        assert_eq!(go(3_723_400_000), "1h2m3.4s");
    }

    #[test]
    fn the_fields_listed_are_the_header_map_written_out() {
        let quota = Quota::per_minute(NonZeroU32::new(100).expect("nonzero"));
        let (api, other) = (sf_name("api"), sf_name("other"));
        let made = Presented::new(&api, &FixedWindow::new(quota).into());
        let applied = [
            Applied {
                name: &api,
                decision: decision(100),
                window_secs: 60,
                presented: Some(&made),
            },
            Applied {
                name: &other,
                decision: decision(7),
                window_secs: 3,
                presented: None,
            },
        ];
        for legacy in [true, false] {
            for ietf in [true, false] {
                for reset in [ResetFormat::Delta, ResetFormat::Unix] {
                    let options = HeaderOptions {
                        legacy,
                        ietf,
                        reset,
                        openai: false,
                    };
                    for (rules, restrictive) in [(&applied[..1], 0), (&applied[..], 1)] {
                        let mut map = HeaderMap::new();
                        RateLimitFields::new(&options, rules, restrictive, None).write_to(&mut map);
                        let mut lines = String::new();
                        for (name, value) in
                            RateLimitFields::new(&options, rules, restrictive, None).iter()
                        {
                            let value = std::str::from_utf8(value).expect("text");
                            lines.push_str(&format!("{name}: {value}\r\n"));
                        }
                        let mut written = String::new();
                        for (name, value) in &map {
                            let value = value.to_str().expect("text");
                            written.push_str(&format!("{name}: {value}\r\n"));
                        }
                        // A Unix reset read a second apart may differ by one.
                        let strip = |text: &str| {
                            text.lines()
                                .filter(|l| !l.starts_with("x-ratelimit-reset"))
                                .collect::<Vec<_>>()
                                .join("\n")
                        };
                        assert_eq!(strip(&lines), strip(&written), "{options:?}");
                        assert_eq!(lines.lines().count(), map.len(), "{options:?}");
                        if reset == ResetFormat::Delta {
                            assert_eq!(lines, written, "{options:?}");
                        }
                    }
                }
            }
        }
    }
}

//! What an LLM-API-style response actually cost, measured while its body
//! passes through.
//!
//! A [`UsageMeter`] looks at each chunk of a response body as the caller
//! forwards it; it never holds the body back and never buffers it. It reads
//! the OpenAI-compatible `usage` object (Chat Completions, legacy
//! Completions and the Responses API; Anthropic's split one too) of:
//!
//! - a **JSON body** (`application/json`): a streaming scanner finds the
//!   top-level object's own `usage` member (never one inside a string or
//!   nested deeper, such as an echoed prompt) and keeps only that member's
//!   bytes, at most 64 KiB;
//! - an **event stream** (`text/event-stream`), parsed by the WHATWG
//!   server-sent events rules: each event's data (at most 1 MiB) is read as
//!   JSON for its `usage` (top-level, or the Responses API's
//!   `response.usage`) and its deltas. Every kind of output counts as a
//!   delta, not only text: reasoning, tool calls, audio, refusals and
//!   whatever an upstream adds (see [`UsageMeter::event_stream`]).
//!   [`UsageMeter::feed`] also tells where each event ends, so that a
//!   stream can be cut exactly between two events and ended with
//!   [`cut_event`]; [`UsageMeter::end_of_stream`] tells where the last one
//!   ends when only the end of the body could tell.
//!
//! A prompt's count includes the tokens of a prompt cache. OpenAI's
//! `prompt_tokens` (and the Responses API's `input_tokens`) count them
//! already; Anthropic's `input_tokens` does not, so there the prompt's
//! count is `input_tokens` plus `cache_creation_input_tokens` plus
//! `cache_read_input_tokens`.
//!
//! Its memory stays bounded whatever the upstream sends; what it cannot
//! read makes the result [`malformed`](Usage::malformed), never a panic.
//!
//! ```
//! use spillway_tower::usage::{UsageField, UsageMeter};
//!
//! let mut meter = UsageMeter::event_stream(UsageField::Total);
//! meter.set_prompt_estimate(10);
//! let ends = meter.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n");
//! // One event ended, past its blank line; it counted one delta.
//! assert_eq!(ends.as_slice(), &[(48, 11)]);
//! meter.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1,\"total_tokens\":10}}\n\n");
//! // The report is below what was counted as the stream went: the running
//! // count never goes back, the cost is what the upstream reported.
//! assert_eq!(meter.counted(), 11);
//! assert_eq!(meter.finish().cost(), Some(10));
//! ```

use bytes::Bytes;
use http::HeaderValue;
use serde_json::Value;
use smallvec::SmallVec;

mod json;
mod sse;
#[cfg(test)]
mod tests;

use json::JsonScanner;
use sse::EventStream;

/// Which number of an OpenAI-compatible `usage` object is the cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UsageField {
    /// `total_tokens`; where it is absent, the prompt's count plus the
    /// completion's (OpenAI's `prompt_tokens` + `completion_tokens`,
    /// Anthropic's `input_tokens` + `output_tokens`), once both are known.
    #[default]
    Total,
    /// `prompt_tokens` (or Anthropic's `input_tokens`).
    Prompt,
    /// `completion_tokens` (or Anthropic's `output_tokens`).
    Completion,
}

impl UsageField {
    /// The field named as in a `usage` object: `total_tokens`,
    /// `prompt_tokens` or `completion_tokens`.
    ///
    /// ```
    /// use spillway_tower::usage::UsageField;
    ///
    /// assert_eq!(UsageField::parse("completion_tokens"), Some(UsageField::Completion));
    /// assert_eq!(UsageField::parse("tokens"), None);
    /// ```
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "total_tokens" => Some(Self::Total),
            "prompt_tokens" => Some(Self::Prompt),
            "completion_tokens" => Some(Self::Completion),
            _ => None,
        }
    }
}

/// Measures one response body's usage as it passes (see the [module
/// docs](self)).
#[derive(Debug)]
pub struct UsageMeter {
    body: Body,
    tally: Tally,
}

/// How the body is read.
#[derive(Debug)]
enum Body {
    Json(JsonScanner),
    EventStream(EventStream),
}

impl UsageMeter {
    /// For a JSON response body.
    ///
    /// The report is the top-level object's own `usage` member; when there
    /// are several, the last one wins (as with most JSON parsers), even if
    /// it is null or cannot be read. `"usage": null`, no `usage`, an empty
    /// body and a body that is JSON but not an object (an array, a string)
    /// report nothing and are not malformed; a body that does not start as
    /// JSON (HTML, say), or breaks the object's structure before its
    /// `usage`, is malformed. A `usage` value past 64 KiB, not valid JSON,
    /// not an object, with a count that is not a non-negative integer
    /// fitting u64 (`12.0` included), or without the field, is malformed.
    pub fn json(field: UsageField) -> Self {
        Self {
            body: Body::Json(JsonScanner::default()),
            tally: Tally::new(field),
        }
    }

    /// For a `text/event-stream` response.
    ///
    /// Each event's data (at most 1 MiB; a larger event is skipped and
    /// makes the result malformed) is read as JSON, except `[DONE]`:
    ///
    /// - a top-level `usage` object (OpenAI's last chunk, Anthropic's
    ///   `message_delta`), the `response.usage` of an OpenAI Responses API
    ///   event (one whose `type` starts with `response.`, such as
    ///   `response.completed`) and the prompt count of Anthropic's
    ///   `message_start` (`message.usage`) are merged over the counts seen
    ///   before, the latest winning; the field's value, once they give it,
    ///   is the report (for [`UsageField::Total`] with Anthropic: the
    ///   input of `message_start` plus the output of the latest
    ///   `message_delta`);
    /// - deltas are counted, one for each:
    ///   - choice (in `choices`) whose `delta` has any member but `role`
    ///     with a value that is not empty (a non-empty string, array or
    ///     object, a number or a boolean): `content`, `reasoning_content`,
    ///     `reasoning`, `refusal`, `tool_calls`, `function_call`, `audio`
    ///     and whatever an upstream adds, so that no kind of output streams
    ///     free; or, in a legacy completions stream, whose `text` is a
    ///     non-empty string;
    ///   - Responses API event whose `type` ends with `.delta` (such as
    ///     `response.output_text.delta` or
    ///     `response.reasoning_summary_text.delta`) and whose `delta` is
    ///     not empty;
    ///   - Anthropic `content_block_delta` event;
    /// - data that is not JSON, or a `usage` that cannot be read, makes
    ///   the result malformed and counts nothing.
    ///
    /// The prompt's count in a `usage` is OpenAI's `prompt_tokens` (which
    /// includes its cached tokens) or else Anthropic's `input_tokens` plus
    /// its `cache_creation_input_tokens` and `cache_read_input_tokens`
    /// (which it does not include).
    ///
    /// ```
    /// use spillway_tower::usage::{UsageField, UsageMeter};
    ///
    /// let mut meter = UsageMeter::event_stream(UsageField::Total);
    /// meter.feed(b"data: {\"choices\":[{\"delta\":{\"reasoning\":\"Hm\"}}]}\n\n");
    /// meter.feed(b"data: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n");
    /// assert_eq!(meter.counted(), 2);
    /// meter.feed(concat!(
    ///     "data: {\"type\":\"response.completed\",\"response\":",
    ///     "{\"usage\":{\"input_tokens\":5,\"output_tokens\":2,\"total_tokens\":7}}}\n\n",
    /// ).as_bytes());
    /// assert_eq!(meter.reported(), Some(7));
    /// ```
    pub fn event_stream(field: UsageField) -> Self {
        Self {
            body: Body::EventStream(EventStream::default()),
            tally: Tally::new(field),
        }
    }

    /// The meter for a response of this `Content-Type`: JSON for
    /// `application/json` and `application/*+json`, an event stream for
    /// `text/event-stream` (case-insensitive, parameters ignored); None for
    /// anything else, or no `Content-Type`.
    ///
    /// ```
    /// use http::HeaderValue;
    /// use spillway_tower::usage::{UsageField, UsageMeter};
    ///
    /// let sse = HeaderValue::from_static("Text/Event-Stream; charset=utf-8");
    /// let meter = UsageMeter::for_content_type(Some(&sse), UsageField::Total).unwrap();
    /// assert!(meter.is_event_stream());
    /// let html = HeaderValue::from_static("text/html");
    /// assert!(UsageMeter::for_content_type(Some(&html), UsageField::Total).is_none());
    /// ```
    pub fn for_content_type(content_type: Option<&HeaderValue>, field: UsageField) -> Option<Self> {
        let value = content_type?.as_bytes();
        let essence = value.split(|&b| b == b';').next()?.trim_ascii();
        if essence.eq_ignore_ascii_case(b"text/event-stream") {
            return Some(Self::event_stream(field));
        }
        let json = essence.eq_ignore_ascii_case(b"application/json")
            || essence.len() > b"application/+json".len()
                && essence[..12].eq_ignore_ascii_case(b"application/")
                && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json");
        json.then(|| Self::json(field))
    }

    /// Whether this meter reads an event stream (whose
    /// [`feed`](Self::feed) reports where events end) rather than a JSON
    /// body.
    pub fn is_event_stream(&self) -> bool {
        matches!(self.body, Body::EventStream(_))
    }

    /// Looks at the next chunk of the body, which the caller forwards
    /// unchanged.
    ///
    /// For an event stream, returns where in `chunk` each complete event
    /// ended (the offset just past the blank line that ends it) and the
    /// running count ([`counted`](Self::counted)) after that event, so that
    /// a caller can cut the stream exactly between two events. A blank
    /// line ended by a CR that is the last byte of a chunk is reported with
    /// the next chunk, at offset 0 (or 1 when that chunk starts with the
    /// LF of a CRLF), or by [`end_of_stream`](Self::end_of_stream) if no
    /// chunk follows: only then is it known where the line end ends. For
    /// JSON, returns no boundaries.
    pub fn feed(&mut self, chunk: &[u8]) -> Boundaries {
        let mut boundaries = Boundaries::default();
        match &mut self.body {
            Body::Json(scanner) => scanner.feed(chunk, &mut self.tally),
            Body::EventStream(stream) => stream.meter(chunk, &mut self.tally, &mut boundaries),
        }
        self.tally.update_counted();
        boundaries
    }

    /// The running count so far: the largest of the usage reported so far
    /// (by the field) and the estimate (for [`UsageField::Total`], the
    /// prompt's cost plus the deltas counted; for `Prompt`, the prompt's
    /// cost; for `Completion`, the deltas). The prompt's cost is
    /// [`set_prompt_estimate`](Self::set_prompt_estimate)'s, or the
    /// upstream's own count (Anthropic's `message_start`) once it sent one
    /// if that is more: a count from the upstream never lowers the
    /// estimate.
    ///
    /// It never decreases, even when a later report is smaller than what
    /// was counted before: a caller charges as the body goes, by the
    /// difference from the last count, and a count that went back would
    /// have it refund in the middle of a response.
    pub fn counted(&self) -> u64 {
        self.tally.counted
    }

    /// The usage the upstream has reported so far for the field, if it has:
    /// what [`finish`](Self::finish) would give as
    /// [`Usage::reported`] if the body ended now.
    ///
    /// A caller settling a stream left midway charges this when there is
    /// one (it counts tokens) rather than the high-water
    /// [`counted`](Self::counted). Unlike `counted`, it follows the
    /// upstream: a later report may be smaller than an earlier one. For a
    /// JSON body cut in its `usage` value, what there is of the value is
    /// parsed (as `finish` would), each time this is called.
    ///
    /// ```
    /// use spillway_tower::usage::{UsageField, UsageMeter};
    ///
    /// let mut meter = UsageMeter::event_stream(UsageField::Total);
    /// meter.set_prompt_estimate(50);
    /// meter.feed(b"data: {\"choices\":[],\"usage\":{\"total_tokens\":30}}\n\n");
    /// assert_eq!((meter.counted(), meter.reported()), (50, Some(30)));
    /// ```
    pub fn reported(&self) -> Option<u64> {
        match &self.body {
            Body::Json(scanner) => scanner.reported_at_end(&self.tally),
            Body::EventStream(_) => self.tally.reported,
        }
    }

    /// The body has ended: its last chunk was fed. Settles what only the
    /// end tells, and returns the boundaries it resolves.
    ///
    /// An event stream whose last blank line ends with a lone CR (which
    /// [`feed`](Self::feed) holds, waiting to see whether a LF follows)
    /// has that event's boundary reported here. Its offset is relative to
    /// the end of the last chunk fed: 0 means "at the end of what was
    /// fed", so the whole stream ends with whole events. An event not
    /// ended by a blank line is discarded, never read (as a client would
    /// discard it, by the WHATWG rules). For JSON, there are no
    /// boundaries, and nothing changes: [`finish`](Self::finish) reads a
    /// `usage` value the body was cut in.
    ///
    /// Call it once, then [`finish`](Self::finish); calling it again
    /// returns no boundaries. The meter is not meant to be fed after it
    /// (what is, is read as new events, never as the rest of a discarded
    /// one).
    ///
    /// ```
    /// use spillway_tower::usage::{UsageField, UsageMeter};
    ///
    /// let mut meter = UsageMeter::event_stream(UsageField::Completion);
    /// let chunk = b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\r\r";
    /// // The last CR may be the start of a CRLF: the boundary waits.
    /// assert!(meter.feed(chunk).is_empty());
    /// assert_eq!(meter.end_of_stream().as_slice(), &[(0, 1)]);
    /// assert_eq!(meter.finish().cost(), Some(1));
    /// ```
    pub fn end_of_stream(&mut self) -> Boundaries {
        let mut boundaries = Boundaries::default();
        if let Body::EventStream(stream) = &mut self.body {
            stream.end_metered(&mut self.tally, &mut boundaries);
        }
        boundaries
    }

    /// Sets an estimate of the prompt's cost (known from the request), used
    /// with the deltas counted until the upstream reports its usage.
    /// Ignored for [`UsageField::Completion`].
    pub fn set_prompt_estimate(&mut self, n: u64) {
        if self.tally.field != UsageField::Completion {
            self.tally.prompt_estimate = n;
            self.tally.update_counted();
        }
    }

    /// The body has ended (or was abandoned): what was measured. An event
    /// that was not ended by its blank line is not read (as a client would
    /// not dispatch it); a JSON `usage` member whose value is complete
    /// counts even when the body was cut after it. It may follow
    /// [`end_of_stream`](Self::end_of_stream) or not: the usage is the
    /// same.
    pub fn finish(mut self) -> Usage {
        if let Body::Json(scanner) = &mut self.body {
            scanner.finish(&mut self.tally);
        }
        let tally = &self.tally;
        Usage {
            reported: tally.reported,
            deltas: tally.deltas,
            estimated: tally.estimated(),
            malformed: tally.malformed,
        }
    }
}

/// Where the events of a chunk ended: `(end_offset, counted_after)` pairs,
/// in order. `end_offset` is the offset in the chunk just past the event's
/// blank line (so `chunk[..end_offset]` ends with whole events);
/// `counted_after` is [`UsageMeter::counted`] once that event was read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Boundaries {
    // Most chunks end a handful of events at most.
    ends: SmallVec<[(usize, u64); 4]>,
}

impl Boundaries {
    /// The `(end_offset, counted_after)` pairs, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (usize, u64)> + '_ {
        self.ends.iter().copied()
    }

    /// The `(end_offset, counted_after)` pairs, in order.
    pub fn as_slice(&self) -> &[(usize, u64)] {
        &self.ends
    }

    /// How many events ended.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether no event ended.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The last event's, if any ended.
    pub fn last(&self) -> Option<(usize, u64)> {
        self.ends.last().copied()
    }

    fn push(&mut self, end: usize, counted: u64) {
        self.ends.push((end, counted));
    }
}

/// What a [`UsageMeter`] measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// The usage the upstream reported (the field's value from the last
    /// usage object seen, merged with the earlier ones of a stream; see
    /// [`UsageField`]), if it did.
    pub reported: Option<u64>,
    /// Deltas counted in an event stream (0 for JSON): chunks of output of
    /// any kind (see [`UsageMeter::event_stream`]).
    pub deltas: u64,
    /// The cost as estimated from the stream, when any delta was counted:
    /// for [`UsageField::Total`], the prompt's cost (the estimate set, or
    /// the upstream's count if it sent one that is more) plus the deltas;
    /// for `Completion`, the deltas; for `Prompt`, always None (deltas say
    /// nothing of a prompt).
    pub estimated: Option<u64>,
    /// Something could not be read: a usage object of the wrong shape or
    /// without the field, an event or a JSON `usage` past the size bounds,
    /// invalid JSON where usage was expected (an event's data, a `usage`
    /// value), or a body that does not start as JSON.
    pub malformed: bool,
}

impl Usage {
    /// The cost to charge: what the upstream [`reported`](Self::reported)
    /// (it counts tokens; deltas are only chunks), else the
    /// [`estimated`](Self::estimated) cost when deltas were counted, else
    /// None: nothing was measured and the caller keeps what it reserved.
    ///
    /// ```
    /// use spillway_tower::usage::Usage;
    ///
    /// let usage = Usage { reported: None, deltas: 3, estimated: Some(13), malformed: false };
    /// assert_eq!(usage.cost(), Some(13));
    /// assert_eq!(Usage { reported: Some(20), ..usage }.cost(), Some(20));
    /// assert_eq!(Usage { deltas: 0, estimated: None, ..usage }.cost(), None);
    /// ```
    pub fn cost(&self) -> Option<u64> {
        self.reported.or(self.estimated)
    }
}

/// The last event of a stream stopped at its budget: an OpenAI-style
/// `event: error` whose data is
/// `{"error":{"message":…,"type":"rate_limit_exceeded","code":"budget_exhausted","param":null,"rule":…,"retry_after":…}}`,
/// then `data: [DONE]` (OpenAI clients stop on it).
///
/// ```
/// let event = spillway_tower::usage::cut_event("tokens \"per\" day", 30);
/// let text = std::str::from_utf8(&event).unwrap();
/// assert!(text.starts_with("event: error\ndata: {\"error\":"));
/// assert!(text.contains(r#""rule":"tokens \"per\" day""#));
/// assert!(text.ends_with("\n\ndata: [DONE]\n\n"));
/// ```
pub fn cut_event(rule: &str, retry_after_secs: u64) -> Bytes {
    let data = serde_json::json!({
        "error": {
            "message": format!(
                "The response was stopped: the budget of rule '{rule}' is exhausted. \
                 Retry after {retry_after_secs} seconds."
            ),
            "type": "rate_limit_exceeded",
            "code": "budget_exhausted",
            "param": null,
            "rule": rule,
            "retry_after": retry_after_secs,
        }
    });
    // Compact JSON escapes every control character in its strings, so the
    // data is one line whatever the rule's name holds.
    let mut event = b"event: error\ndata: ".to_vec();
    event.extend_from_slice(data.to_string().as_bytes());
    event.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    Bytes::from(event)
}

/// The counts of a `usage` object. Absent ones are None: an Anthropic
/// stream sends its prompt's and its completion's in different events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counts {
    input: Option<u64>,
    output: Option<u64>,
    total: Option<u64>,
}

/// A `usage` value that is not null, not an object, has none of the
/// counts, or a count that is not a non-negative integer fitting u64.
#[derive(Debug)]
struct Malformed;

impl Counts {
    /// The counts of a `usage` value; `Ok(None)` for null.
    ///
    /// A count must be an integer: `12.0` is malformed (an upstream that
    /// writes counts as floats is not one this reads, and rounding would
    /// be a guess). A count written null is absent.
    fn read(usage: &Value) -> Result<Option<Self>, Malformed> {
        let members = match usage {
            Value::Null => return Ok(None),
            Value::Object(members) => members,
            _ => return Err(Malformed),
        };
        // The first of `names` present and not null.
        let count = |names: &[&str]| -> Result<Option<u64>, Malformed> {
            match names
                .iter()
                .find_map(|name| members.get(*name).filter(|v| !v.is_null()))
            {
                None => Ok(None),
                Some(v) => v.as_u64().map(Some).ok_or(Malformed),
            }
        };
        // OpenAI's `prompt_tokens` already counts its cached tokens
        // (`prompt_tokens_details.cached_tokens` is a part of it), and so
        // does a proxy's that adds Anthropic's cache counts beside it.
        // Anthropic's `input_tokens` does not: the tokens written to and
        // read from its cache are billed, and counted, apart.
        let input = match count(&["prompt_tokens"])? {
            Some(prompt) => Some(prompt),
            None => {
                let parts = [
                    count(&["input_tokens"])?,
                    count(&["cache_creation_input_tokens"])?,
                    count(&["cache_read_input_tokens"])?,
                ];
                // Saturating: hostile counts must not overflow.
                parts.into_iter().flatten().reduce(u64::saturating_add)
            }
        };
        let counts = Self {
            input,
            output: count(&["completion_tokens", "output_tokens"])?,
            total: count(&["total_tokens"])?,
        };
        if counts == Self::default() {
            return Err(Malformed);
        }
        Ok(Some(counts))
    }

    /// The field's value, if these counts give it.
    fn value(&self, field: UsageField) -> Option<u64> {
        match field {
            // Saturating: two hostile counts must not overflow.
            UsageField::Total => self
                .total
                .or_else(|| Some(self.input?.saturating_add(self.output?))),
            UsageField::Prompt => self.input,
            UsageField::Completion => self.output,
        }
    }
}

/// What has been measured, whichever way the body is read.
#[derive(Debug)]
struct Tally {
    field: UsageField,
    // Every count reported so far, a stream's later ones over its earlier
    // ones: the field may need counts from two events (Anthropic).
    counts: Counts,
    reported: Option<u64>,
    deltas: u64,
    malformed: bool,
    prompt_estimate: u64,
    // The high-water mark `counted()` returns.
    counted: u64,
}

impl Tally {
    fn new(field: UsageField) -> Self {
        Self {
            field,
            counts: Counts::default(),
            reported: None,
            deltas: 0,
            malformed: false,
            prompt_estimate: 0,
            counted: 0,
        }
    }

    /// A JSON body's `usage` member: it replaces any earlier one (the last
    /// duplicate wins, as with most JSON parsers), even if it is null or
    /// cannot be read.
    fn replace(&mut self, usage: Result<Option<Counts>, Malformed>) {
        self.counts = Counts::default();
        self.reported = None;
        match usage {
            Ok(None) => {}
            Ok(Some(counts)) => {
                self.counts = counts;
                self.reported = counts.value(self.field);
                // A body's one report must give the field.
                self.malformed |= self.reported.is_none();
            }
            Err(Malformed) => self.malformed = true,
        }
    }

    /// A stream's `usage`: its counts replace the earlier ones it has,
    /// those it lacks stay (Anthropic's `message_delta` has no prompt
    /// count), except `total_tokens`, which is only ever as recent as the
    /// object that has it. The field's value then, if known, is the report.
    fn merge(&mut self, new: Counts) {
        self.counts = Counts {
            input: new.input.or(self.counts.input),
            output: new.output.or(self.counts.output),
            total: new.total,
        };
        if let Some(value) = self.counts.value(self.field) {
            self.reported = Some(value);
        }
    }

    /// The prompt's cost while no full report settles it: the larger of
    /// the caller's estimate and the upstream's count, if it sent one.
    ///
    /// Never the upstream's count alone: Anthropic sends its prompt's
    /// count first, in `message_start`, and a stream left after it, before
    /// the report that ends it, would otherwise cost less than was
    /// estimated for it before a byte came back. Only a report that gives
    /// the field (`reported`) is taken as it is.
    fn prompt(&self) -> u64 {
        self.counts.input.unwrap_or(0).max(self.prompt_estimate)
    }

    /// The cost from the deltas, without a report.
    fn running_estimate(&self) -> u64 {
        match self.field {
            UsageField::Total => self.prompt().saturating_add(self.deltas),
            UsageField::Prompt => self.prompt(),
            UsageField::Completion => self.deltas,
        }
    }

    fn estimated(&self) -> Option<u64> {
        let deltas_say = self.deltas > 0 && self.field != UsageField::Prompt;
        deltas_say.then(|| self.running_estimate())
    }

    fn update_counted(&mut self) {
        let now = self.reported.unwrap_or(0).max(self.running_estimate());
        self.counted = self.counted.max(now);
    }
}

//! An event stream, parsed by the WHATWG HTML rules for server-sent events
//! (§9.2.6 "Interpreting an event stream"), and what each event's data says
//! of usage.
//!
//! Only `data` fields are kept, and only up to [`MAX_EVENT`] bytes per
//! event; field names are compared by their first bytes and length, and
//! the rest of a line is never copied. So a line or an event of any length
//! takes bounded memory, and the parser's state carries over a chunk
//! boundary at any byte, a CRLF split between two chunks included.

use serde_json::Value;

use super::{Boundaries, Counts, Malformed, Tally};

/// The most data an event may have; past it, the event is skipped.
const MAX_EVENT: usize = 1024 * 1024;

/// The buffer's capacity kept from one event to the next: a large event
/// should not hold its memory for the rest of a long stream.
const KEEP_CAPACITY: usize = 64 * 1024;

/// The UTF-8 byte order mark, skipped at the start of a stream.
const BOM: &[u8; 3] = b"\xEF\xBB\xBF";

/// Where the parser is in the current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Nothing of the line yet.
    Start,
    /// In the field's name.
    Field,
    /// In a comment (a line starting with a colon).
    Comment,
    /// Just after the colon, where one space is dropped.
    ValueStart,
    /// In the field's value.
    Value,
}

/// What the parser found, in stream order.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step<'a> {
    /// An event with this data was dispatched.
    Event(&'a [u8]),
    /// The current event's data went past [`MAX_EVENT`]: it is skipped.
    TooLarge,
    /// An event (with data or not) ended just before this offset of the
    /// chunk.
    Boundary(usize),
}

/// An event stream's parser, fed chunk by chunk.
pub(super) struct EventStream {
    // Some(n) while the stream's first n bytes are the first n of a BOM.
    bom: Option<usize>,
    line: Line,
    // The field name's first 4 bytes and its full length: enough to tell
    // `data` from the rest without keeping a name of any length.
    field: [u8; 4],
    field_len: usize,
    // The current line's value goes to the data.
    data_line: bool,
    // The last byte was a CR, so a LF next is part of the same line end.
    after_cr: bool,
    // That CR ended a blank line, whose boundary waits for the next byte:
    // past the LF if it is one.
    cr_blank: bool,
    data: Vec<u8>,
    // The event has a `data` field (whose value may be empty).
    has_data: bool,
    too_large: bool,
}

impl Default for EventStream {
    fn default() -> Self {
        Self {
            bom: Some(0),
            line: Line::Start,
            field: [0; 4],
            field_len: 0,
            data_line: false,
            after_cr: false,
            cr_blank: false,
            data: Vec::new(),
            has_data: false,
            too_large: false,
        }
    }
}

// By hand: the derived one would print up to a megabyte of data.
impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("line", &self.line)
            .field("data_len", &self.data.len())
            .field("too_large", &self.too_large)
            .finish_non_exhaustive()
    }
}

impl EventStream {
    /// Reads the next chunk into `tally`, and where its events end into
    /// `boundaries`.
    pub(super) fn meter(&mut self, chunk: &[u8], tally: &mut Tally, boundaries: &mut Boundaries) {
        self.feed(chunk, &mut |step| take_step(step, tally, boundaries));
    }

    /// The stream has ended: reads what only its end tells into `tally`
    /// and `boundaries`.
    pub(super) fn end_metered(&mut self, tally: &mut Tally, boundaries: &mut Boundaries) {
        self.end(&mut |step| take_step(step, tally, boundaries));
    }

    /// The stream has ended. A blank line ended by a lone CR was a line
    /// end after all (no LF can follow now): its boundary is at the end,
    /// offset 0 past the last chunk. An event not ended by a blank line is
    /// discarded, undispatched (WHATWG: "If the file ends in the middle of
    /// an event, before the final empty line, the incomplete event is not
    /// dispatched").
    pub(super) fn end(&mut self, sink: &mut impl FnMut(Step<'_>)) {
        if std::mem::take(&mut self.cr_blank) {
            sink(Step::Boundary(0));
        }
        // Whatever comes after, if anything is fed still, starts anew: the
        // discarded event's data must not join a later one's, and its
        // memory (up to MAX_EVENT) is not kept for nothing.
        *self = Self {
            bom: None,
            ..Self::default()
        };
    }

    /// Parses the next chunk.
    pub(super) fn feed(&mut self, chunk: &[u8], sink: &mut impl FnMut(Step<'_>)) {
        let mut start = 0;
        while let Some(matched) = self.bom {
            let Some(&b) = chunk.get(start) else {
                return;
            };
            if b == BOM[matched] {
                start += 1;
                self.bom = (matched + 1 < BOM.len()).then_some(matched + 1);
            } else {
                self.bom = None;
                // They looked like a BOM but start a line: no line end in
                // them, so no offset to get wrong.
                self.parse(&BOM[..matched], 0, sink);
            }
        }
        self.parse(&chunk[start..], start, sink);
    }

    /// Parses `bytes`, which are at `base` in the chunk.
    fn parse(&mut self, bytes: &[u8], base: usize, sink: &mut impl FnMut(Step<'_>)) {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            if std::mem::take(&mut self.after_cr) {
                let crlf = b == b'\n';
                if std::mem::take(&mut self.cr_blank) {
                    sink(Step::Boundary(base + i + usize::from(crlf)));
                }
                if crlf {
                    i += 1;
                    continue;
                }
            }
            match b {
                b'\r' => {
                    self.after_cr = true;
                    self.cr_blank = self.end_line(sink);
                    i += 1;
                }
                b'\n' => {
                    if self.end_line(sink) {
                        sink(Step::Boundary(base + i + 1));
                    }
                    i += 1;
                }
                _ => {
                    let rest = &bytes[i..];
                    let run = rest
                        .iter()
                        .position(|&c| c == b'\r' || c == b'\n')
                        .unwrap_or(rest.len());
                    self.line_part(&rest[..run], sink);
                    i += run;
                }
            }
        }
    }

    /// Part of a line, without line ends.
    fn line_part(&mut self, mut part: &[u8], sink: &mut impl FnMut(Step<'_>)) {
        while let Some(&first) = part.first() {
            match self.line {
                Line::Start if first == b':' => {
                    self.line = Line::Comment;
                    return;
                }
                Line::Start => {
                    self.line = Line::Field;
                    self.field_len = 0;
                }
                Line::Field => {
                    let colon = part.iter().position(|&c| c == b':');
                    self.name(&part[..colon.unwrap_or(part.len())]);
                    let Some(colon) = colon else {
                        return;
                    };
                    self.begin_value(sink);
                    self.line = Line::ValueStart;
                    part = &part[colon + 1..];
                }
                Line::ValueStart => {
                    if first == b' ' {
                        part = &part[1..];
                    }
                    self.line = Line::Value;
                }
                Line::Value => {
                    if self.data_line {
                        self.append(part, sink);
                    }
                    return;
                }
                Line::Comment => return,
            }
        }
    }

    /// More of the field's name.
    fn name(&mut self, part: &[u8]) {
        for (i, &b) in part.iter().enumerate() {
            if let Some(slot) = self.field.get_mut(self.field_len + i) {
                *slot = b;
            }
        }
        self.field_len = self.field_len.saturating_add(part.len());
    }

    /// The field's name is complete: a `data` line joins the event's data.
    fn begin_value(&mut self, sink: &mut impl FnMut(Step<'_>)) {
        self.data_line = self.field_len == 4 && self.field == *b"data";
        if self.data_line {
            if self.has_data {
                self.append(b"\n", sink);
            }
            self.has_data = true;
        }
    }

    /// A line has ended; true if it was blank (so an event ended).
    fn end_line(&mut self, sink: &mut impl FnMut(Step<'_>)) -> bool {
        match self.line {
            Line::Start => {
                self.dispatch(sink);
                return true;
            }
            // A line without a colon is a field with an empty value.
            Line::Field => self.begin_value(sink),
            Line::Comment | Line::ValueStart | Line::Value => {}
        }
        self.line = Line::Start;
        self.data_line = false;
        false
    }

    fn dispatch(&mut self, sink: &mut impl FnMut(Step<'_>)) {
        if self.has_data && !self.too_large {
            sink(Step::Event(&self.data));
        }
        self.data.clear();
        if self.data.capacity() > KEEP_CAPACITY {
            self.data = Vec::new();
        }
        self.has_data = false;
        self.too_large = false;
    }

    /// More of the event's data, up to the bound.
    fn append(&mut self, bytes: &[u8], sink: &mut impl FnMut(Step<'_>)) {
        if self.too_large {
            return;
        }
        let needed = self.data.len() + bytes.len();
        if needed > MAX_EVENT {
            self.too_large = true;
            self.data = Vec::new();
            return sink(Step::TooLarge);
        }
        if self.data.capacity() < needed {
            // Doubling, but never past the bound.
            let capacity = needed.max(2 * self.data.capacity()).min(MAX_EVENT);
            self.data.reserve_exact(capacity - self.data.len());
        }
        self.data.extend_from_slice(bytes);
    }
}

/// Applies what the parser found to what is measured.
fn take_step(step: Step<'_>, tally: &mut Tally, boundaries: &mut Boundaries) {
    match step {
        Step::Event(data) => {
            read_event(data, tally);
            tally.update_counted();
        }
        Step::TooLarge => tally.malformed = true,
        Step::Boundary(end) => boundaries.push(end, tally.counted),
    }
}

/// What an event's data says: a `usage` (OpenAI's, or Anthropic's in
/// `message_delta`, and its prompt's in `message_start`) and deltas.
fn read_event(data: &[u8], tally: &mut Tally) {
    if data == b"[DONE]" {
        return;
    }
    let Ok(event) = serde_json::from_slice::<Value>(data) else {
        tally.malformed = true;
        return;
    };
    let kind = event.get("type").and_then(Value::as_str);
    if kind == Some("message_start") {
        // Anthropic's prompt count. The output count beside it is only
        // what was generated before the first delta: as a report, it
        // would make a stream left early cost nearly nothing.
        if let Some(usage) = event.get("message").and_then(|m| m.get("usage")) {
            merge(
                tally,
                Counts::read(usage).map(|counts| {
                    counts.map(|c| Counts {
                        input: c.input,
                        ..Counts::default()
                    })
                }),
            );
        }
    }
    if let Some(usage) = event.get("usage") {
        merge(tally, Counts::read(usage));
    }
    // The Responses API nests its usage in the response object, which its
    // `response.completed` (and `.incomplete`, `.failed`) events carry;
    // earlier ones have it null. Only there: any other event may well
    // echo an object named `response` that is none of this meter's.
    if kind.is_some_and(|kind| kind.starts_with("response."))
        && let Some(usage) = event.get("response").and_then(|r| r.get("usage"))
    {
        merge(tally, Counts::read(usage));
    }
    tally.deltas = tally.deltas.saturating_add(deltas_in(&event, kind));
}

fn merge(tally: &mut Tally, usage: Result<Option<Counts>, Malformed>) {
    match usage {
        Ok(Some(counts)) => tally.merge(counts),
        // OpenAI sends `"usage": null` in every chunk but the last.
        Ok(None) => {}
        Err(Malformed) => tally.malformed = true,
    }
}

/// The deltas of an event: one for an Anthropic `content_block_delta`,
/// one for a Responses API `*.delta` event that says something, and one
/// per choice that says something (Chat Completions, legacy Completions).
///
/// What says something is any member but a delta's `role`, not by a list
/// of known names: upstreams keep adding kinds of output (`reasoning`,
/// `audio`, ...), and one left off the list would stream for free.
fn deltas_in(event: &Value, kind: Option<&str>) -> u64 {
    let typed = match kind {
        Some("content_block_delta") => true,
        Some(kind) if kind.ends_with(".delta") => event.get("delta").is_some_and(says_something),
        _ => false,
    };
    let choices = event
        .get("choices")
        .and_then(Value::as_array)
        .map_or(0, |choices| {
            choices
                .iter()
                .filter(|choice| choice_says_something(choice))
                .count()
        });
    u64::from(typed).saturating_add(choices as u64)
}

/// Whether a choice of a stream's chunk carries output: its `delta` has a
/// member other than `role` that says something, or (a legacy completion)
/// its `text` is a non-empty string.
fn choice_says_something(choice: &Value) -> bool {
    let delta = choice
        .get("delta")
        .and_then(Value::as_object)
        .is_some_and(|delta| {
            delta
                .iter()
                .any(|(name, value)| name != "role" && says_something(value))
        });
    let text = choice
        .get("text")
        .and_then(Value::as_str)
        .is_some_and(|text| !text.is_empty());
    delta || text
}

/// Whether a value is not empty: a non-empty string, array or object, a
/// number or a boolean (null and `""`, `[]`, `{}` say nothing).
fn says_something(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(_) | Value::Number(_) => true,
        Value::String(s) => !s.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(members) => !members.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Usage, UsageField, UsageMeter};
    use super::*;

    /// What the parser finds in `chunks`: each event's data, the absolute
    /// offsets of the boundaries, and how many events were too large.
    fn parse(chunks: &[&[u8]]) -> (Vec<String>, Vec<usize>, usize) {
        let mut stream = EventStream::default();
        let (mut events, mut ends, mut too_large) = (Vec::new(), Vec::new(), 0);
        let mut at = 0;
        for chunk in chunks {
            stream.feed(chunk, &mut |step| match step {
                Step::Event(data) => events.push(String::from_utf8(data.to_vec()).unwrap()),
                Step::TooLarge => too_large += 1,
                Step::Boundary(end) => ends.push(at + end),
            });
            at += chunk.len();
        }
        (events, ends, too_large)
    }

    fn events(stream: &str) -> Vec<String> {
        parse(&[stream.as_bytes()]).0
    }

    #[test]
    fn lines_end_with_lf_crlf_or_cr() {
        for end in ["\n", "\r\n", "\r"] {
            let stream = "data: a\nid: 1\ndata:b\n\n: note\ndata\n\n".replace('\n', end);
            let (events, ends, _) = parse(&[stream.as_bytes()]);
            assert_eq!(events, ["a\nb", ""], "{end:?}");
            let e = end.len();
            let first = 7 + e + 5 + e + 6 + e + e;
            let second = first + 6 + e + 4 + e + e;
            if end == "\r" {
                // The last CR's line end is not known to be complete.
                assert_eq!(ends, [first]);
            } else {
                assert_eq!(ends, [first, second], "{end:?}");
            }
            assert_eq!(second, stream.len());
        }
        // Mixed in one stream.
        assert_eq!(events("data: a\r\ndata: b\rdata: c\n\r\n"), ["a\nb\nc"]);
    }

    #[test]
    fn a_crlf_split_between_chunks_is_one_line_end() {
        let (events, ends, _) = parse(&[b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]);
        assert_eq!(events, ["a\nb"]);
        assert_eq!(ends, [20]);
        // A blank line ended by a lone CR, then the next event.
        let (events, ends, _) = parse(&[b"data: a\r\r", b"data: b\n\n"]);
        assert_eq!(events, ["a", "b"]);
        assert_eq!(ends, [9, 18]);
    }

    #[test]
    fn a_leading_bom_is_skipped_even_split() {
        let stream = b"\xEF\xBB\xBFdata: a\n\n";
        for i in 0..=stream.len() {
            let (events, ends, _) = parse(&[&stream[..i], &stream[i..]]);
            assert_eq!(
                (events, ends),
                (vec!["a".to_owned()], vec![12]),
                "split at {i}"
            );
        }
        // Only one, and only at the start.
        assert!(events("\u{FEFF}\u{FEFF}data: a\n\n").is_empty());
        assert!(events("data: a\n\n\u{FEFF}data: b\n\n") == ["a"]);
        // Half a BOM is part of the first line.
        assert!(parse(&[b"\xEF\xBBdata: a\n\n"]).0.is_empty());
        assert_eq!(parse(&[b"\xEF", b"\xBB", b"\xBF", b"data: a\n\n"]).0, ["a"]);
    }

    #[test]
    fn fields_follow_the_rules() {
        // One space dropped, not two; a colon in the value kept.
        assert_eq!(events("data:  a: b\n\n"), [" a: b"]);
        assert_eq!(events("data:a\n\n"), ["a"]);
        // Not `data`: other fields, longer or shorter names, case.
        assert!(
            events("event: x\nid: 2\nretry: 5\ndatum: a\ndat: a\nDATA: a\ndataa: b\n\n").is_empty()
        );
        assert!(events(": data: a\n\n").is_empty());
        // Empty data lines still make an event.
        assert_eq!(events("data\ndata:\n\n"), ["\n"]);
    }

    #[test]
    fn an_event_without_data_still_ends() {
        let (events, ends, _) = parse(&[b": keep-alive\n\nevent: ping\n\n\n"]);
        assert!(events.is_empty());
        assert_eq!(ends, [14, 27, 28]);
    }

    #[test]
    fn an_unterminated_event_is_not_dispatched() {
        assert!(events("data: a\n").is_empty());
        assert!(events("data: a").is_empty());
        // Not at the end of the stream either.
        for stream in ["data: a\n", "data: a\r", "data: a\r\n", "data: a"] {
            let mut parser = EventStream::default();
            let mut steps = 0;
            parser.feed(stream.as_bytes(), &mut |_| steps += 1);
            parser.end(&mut |_| steps += 1);
            assert_eq!(steps, 0, "{stream:?}");
            // Nor does it join what is fed after.
            let mut events = Vec::new();
            parser.feed(b"data: b\n\n", &mut |step| {
                if let Step::Event(data) = step {
                    events.push(data.to_vec());
                }
            });
            assert_eq!(events, [b"b".to_vec()], "{stream:?}");
        }
    }

    #[test]
    fn the_end_resolves_a_blank_line_ended_by_a_cr() {
        let mut parser = EventStream::default();
        let mut steps = Vec::new();
        parser.feed(b"data: a\r\r", &mut |step| {
            steps.push(format!("{step:?}"));
        });
        assert_eq!(steps, ["Event([97])"]);
        parser.end(&mut |step| steps.push(format!("{step:?}")));
        assert_eq!(steps, ["Event([97])", "Boundary(0)"]);
        // Once.
        parser.end(&mut |step| steps.push(format!("{step:?}")));
        assert_eq!(steps.len(), 2);
        // Nothing to resolve when the blank line's end was known.
        for stream in ["data: a\n\n", "data: a\r\n\r\n", "data: a\r\r\n", ""] {
            let mut parser = EventStream::default();
            parser.feed(stream.as_bytes(), &mut |_| {});
            let mut steps = 0;
            parser.end(&mut |_| steps += 1);
            assert_eq!(steps, 0, "{stream:?}");
        }
    }

    #[test]
    fn a_huge_event_is_skipped_in_bounded_memory() {
        let huge = format!(
            "data: {}\n\ndata: [DONE]\n\ndata: b\n\n",
            "x".repeat(10 << 20)
        );
        for size in [1, 64 * 1024] {
            let mut stream = EventStream::default();
            let (mut events, mut too_large, mut ends) = (Vec::new(), 0, 0);
            for chunk in huge.as_bytes().chunks(size) {
                stream.feed(chunk, &mut |step| match step {
                    Step::Event(data) => events.push(data.to_vec()),
                    Step::TooLarge => too_large += 1,
                    Step::Boundary(_) => ends += 1,
                });
                assert!(stream.data.capacity() <= MAX_EVENT);
                // Once past the bound, nothing of the event is kept.
                assert!(!stream.too_large || stream.data.capacity() == 0);
            }
            assert_eq!(events, [b"[DONE]".to_vec(), b"b".to_vec()]);
            assert_eq!((too_large, ends), (1, 3));
            assert!(stream.data.capacity() <= KEEP_CAPACITY);
        }
        // Right at the bound, it is read.
        let data = format!(
            r#"{{"choices":[{{"delta":{{"content":"{}"}}}}]}}"#,
            "x".repeat(MAX_EVENT - 38)
        );
        assert_eq!(data.len(), MAX_EVENT);
        assert!(events(&format!("data: {data}\ndata\n\n")).is_empty());
        assert_eq!(events(&format!("data: {data}\n\n")), [data]);
    }

    fn meter(stream: &str, field: UsageField) -> Usage {
        let mut meter = UsageMeter::event_stream(field);
        meter.feed(stream.as_bytes());
        meter.finish()
    }

    #[test]
    fn deltas_count_choices_that_say_something() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}},{\"delta\":{\"content\":\"b\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"refusal\":\"no\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[],\"content\":null}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[{\"message\":{\"content\":\"x\"}}],\"usage\":null}\n\n",
            "data: [DONE]\n\n",
        );
        let usage = meter(stream, UsageField::Completion);
        assert_eq!(
            (usage.deltas, usage.reported, usage.malformed),
            (5, None, false)
        );
        assert_eq!(usage.cost(), Some(5));
    }

    #[test]
    fn every_kind_of_output_is_a_delta() {
        let counted = [
            // Ollama's and OpenRouter's reasoning.
            r#"{"choices":[{"delta":{"role":"assistant","reasoning":"Let me think"}}]}"#,
            r#"{"choices":[{"delta":{"content":null,"reasoning_details":[{"type":"reasoning.text","text":"x"}]}}]}"#,
            // The deprecated function calls, audio, an upstream's own.
            r#"{"choices":[{"delta":{"function_call":{"arguments":"{\"a\""}}}]}"#,
            r#"{"choices":[{"delta":{"audio":{"id":"a1","data":"UklGR"}}}]}"#,
            r#"{"choices":[{"delta":{"thinking":"hm"}}]}"#,
            r#"{"choices":[{"delta":{"x":0}}]}"#,
            r#"{"choices":[{"delta":{"x":false}}]}"#,
            // Legacy completions (`/v1/completions`).
            r#"{"object":"text_completion","choices":[{"text":"Hello","index":0,"finish_reason":null}]}"#,
            // The Responses API.
            r#"{"type":"response.output_text.delta","item_id":"m1","output_index":0,"content_index":0,"delta":"Hi"}"#,
            r#"{"type":"response.reasoning_summary_text.delta","item_id":"r1","delta":"Thinking"}"#,
            r#"{"type":"response.function_call_arguments.delta","item_id":"f1","delta":"{\"a\""}"#,
            r#"{"type":"response.audio.delta","delta":"UklGR"}"#,
        ];
        for data in counted {
            let usage = meter(&format!("data: {data}\n\n"), UsageField::Completion);
            assert_eq!((usage.deltas, usage.malformed), (1, false), "{data}");
        }
        let not_counted = [
            r#"{"choices":[{"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"delta":{"role":"assistant","content":"","reasoning":null,"tool_calls":[],"audio":{}}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"text":"","finish_reason":"stop"}]}"#,
            r#"{"choices":[{"text":null,"delta":null}]}"#,
            r#"{"choices":[{"message":{"content":"x"}}]}"#,
            r#"{"type":"response.output_text.delta","delta":""}"#,
            r#"{"type":"response.created","response":{"output":[{"content":"x"}],"usage":null}}"#,
            r#"{"type":"response.output_text.done","text":"Hi"}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"}}"#,
        ];
        for data in not_counted {
            let usage = meter(&format!("data: {data}\n\n"), UsageField::Completion);
            assert_eq!((usage.deltas, usage.malformed), (0, false), "{data}");
        }
        // One per choice that says something, however much it says.
        let two = r#"{"choices":[{"delta":{"content":"a","reasoning":"b"}},{"text":"c","delta":{"content":"d"}},{"delta":{"role":"assistant"}}]}"#;
        assert_eq!(
            meter(&format!("data: {two}\n\n"), UsageField::Total).deltas,
            2
        );
    }

    /// An OpenAI Responses API stream, as `stream: true` sends it.
    const RESPONSES: &str = concat!(
        "event: response.created\n",
        "data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null}}\n\n",
        "event: response.reasoning_summary_text.delta\n",
        "data: {\"type\":\"response.reasoning_summary_text.delta\",\"sequence_number\":1,\"item_id\":\"rs_1\",\"output_index\":0,\"summary_index\":0,\"delta\":\"Hm\"}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":2,\"item_id\":\"msg_1\",\"output_index\":1,\"content_index\":0,\"delta\":\"Hi\"}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":3,\"item_id\":\"msg_1\",\"output_index\":1,\"content_index\":0,\"delta\":\"!\"}\n\n",
        "event: response.output_text.done\n",
        "data: {\"type\":\"response.output_text.done\",\"sequence_number\":4,\"item_id\":\"msg_1\",\"text\":\"Hi!\"}\n\n",
        "event: response.completed\n",
        "data: {\"type\":\"response.completed\",\"sequence_number\":5,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"usage\":{\"input_tokens\":36,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":87,\"output_tokens_details\":{\"reasoning_tokens\":64},\"total_tokens\":123}}}\n\n",
    );

    #[test]
    fn a_responses_api_stream_reports_its_nested_usage() {
        let usage = meter(RESPONSES, UsageField::Total);
        assert_eq!(
            usage,
            Usage {
                reported: Some(123),
                deltas: 3,
                // The upstream's prompt count (no estimate set) and the deltas.
                estimated: Some(39),
                malformed: false
            }
        );
        assert_eq!(meter(RESPONSES, UsageField::Prompt).reported, Some(36));
        assert_eq!(meter(RESPONSES, UsageField::Completion).reported, Some(87));
        // Left before it completed: its deltas, over the estimate.
        let early = &RESPONSES[..RESPONSES.find("event: response.completed").unwrap()];
        let mut early_meter = UsageMeter::event_stream(UsageField::Total);
        early_meter.set_prompt_estimate(40);
        early_meter.feed(early.as_bytes());
        assert_eq!((early_meter.counted(), early_meter.reported()), (43, None));
        // A `response` member is read only in a `response.*` event.
        for data in [
            r#"{"type":"tool_result","response":{"usage":{"total_tokens":1}}}"#,
            r#"{"response":{"usage":{"total_tokens":1}}}"#,
        ] {
            let usage = meter(&format!("data: {data}\n\n"), UsageField::Total);
            assert_eq!((usage.reported, usage.malformed), (None, false), "{data}");
        }
        // A failed or incomplete response reports what it spent.
        let incomplete = r#"{"type":"response.incomplete","response":{"status":"incomplete","usage":{"input_tokens":5,"output_tokens":7,"total_tokens":12}}}"#;
        let usage = meter(&format!("data: {incomplete}\n\n"), UsageField::Total);
        assert_eq!(usage.reported, Some(12));
        // Its usage, unreadable, is malformed as any other.
        let bad = r#"{"type":"response.completed","response":{"usage":{"total_tokens":"12"}}}"#;
        let usage = meter(&format!("data: {bad}\n\n"), UsageField::Total);
        assert_eq!((usage.reported, usage.malformed), (None, true));
    }

    #[test]
    fn the_latest_usage_wins() {
        let stream = concat!(
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"total_tokens\":6}}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3,\"total_tokens\":8}}\n\n",
        );
        assert_eq!(meter(stream, UsageField::Total).reported, Some(8));
        assert_eq!(meter(stream, UsageField::Completion).reported, Some(3));
    }

    #[test]
    fn what_cannot_be_read_is_malformed() {
        for data in [
            "{\"choices\":[{\"delta\":{\"content\":\"a\"}}]",
            "{\"usage\":{\"total_tokens\":1.5}}",
            "{\"usage\":\"lots\"}",
            "{\"usage\":{}}",
            "[DONE] ",
        ] {
            let usage = meter(&format!("data: {data}\n\n"), UsageField::Total);
            assert!(usage.malformed, "{data}");
            assert_eq!((usage.reported, usage.deltas), (None, 0), "{data}");
        }
        let fine = meter("data: 12\n\ndata: \"usage\"\n\n", UsageField::Total);
        assert!(!fine.malformed);
    }

    const ANTHROPIC: &str = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n",
        "event: content_block_start\n",
        "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
        "event: ping\ndata: {\"type\": \"ping\"}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"!\"}}\n\n",
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );

    #[test]
    fn an_anthropic_stream_sums_its_two_reports() {
        let usage = |field| meter(ANTHROPIC, field);
        assert_eq!(usage(UsageField::Total).reported, Some(40));
        assert_eq!(usage(UsageField::Prompt).reported, Some(25));
        assert_eq!(usage(UsageField::Completion).reported, Some(15));
        let total = usage(UsageField::Total);
        assert_eq!((total.deltas, total.malformed), (2, false));
        assert_eq!(total.cost(), Some(40));
    }

    #[test]
    fn an_anthropic_stream_left_early_pays_its_prompt_and_deltas() {
        let early = &ANTHROPIC[..ANTHROPIC.find("event: message_delta").unwrap()];
        let mut meter = UsageMeter::event_stream(UsageField::Total);
        meter.set_prompt_estimate(100);
        meter.feed(early.as_bytes());
        // The upstream's prompt count (25) does not lower the estimate:
        // each delta counts over it.
        assert_eq!(meter.counted(), 102);
        assert_eq!(meter.reported(), None);
        let usage = meter.finish();
        assert_eq!(usage.reported, None);
        assert_eq!(usage.cost(), Some(102));
        // When it is more than the estimate, it is the prompt's cost.
        let mut meter = UsageMeter::event_stream(UsageField::Total);
        meter.set_prompt_estimate(10);
        meter.feed(early.as_bytes());
        assert_eq!(meter.counted(), 27);
        assert_eq!(meter.finish().cost(), Some(27));
        let mut meter = UsageMeter::event_stream(UsageField::Completion);
        meter.feed(early.as_bytes());
        assert_eq!(meter.finish().cost(), Some(2));
    }

    #[test]
    fn an_anthropic_prompt_report_never_lowers_the_running_count() {
        let mut meter = UsageMeter::event_stream(UsageField::Total);
        meter.set_prompt_estimate(100);
        let mut counts = Vec::new();
        for event in ANTHROPIC.split_inclusive("\n\n") {
            meter.feed(event.as_bytes());
            counts.push(meter.counted());
        }
        // message_start, block start, ping, two deltas, block stop, the
        // report (40, below the count), stop.
        assert_eq!(counts, [100, 100, 100, 101, 102, 102, 102, 102]);
        // The complete report is the cost, as the upstream counted it.
        assert_eq!(meter.reported(), Some(40));
        assert_eq!(meter.finish().cost(), Some(40));
        // For the prompt alone, message_start's count is the report.
        let mut meter = UsageMeter::event_stream(UsageField::Prompt);
        meter.set_prompt_estimate(100);
        meter.feed(ANTHROPIC.as_bytes());
        assert_eq!((meter.counted(), meter.reported()), (100, Some(25)));
    }

    #[test]
    fn an_anthropic_stream_counts_its_cache_tokens() {
        let stream = ANTHROPIC.replace(
            "\"usage\":{\"input_tokens\":25,\"output_tokens\":1}",
            "\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":300,\"cache_read_input_tokens\":4000,\"output_tokens\":1}",
        );
        assert_ne!(stream, ANTHROPIC);
        assert_eq!(meter(&stream, UsageField::Prompt).reported, Some(4325));
        assert_eq!(meter(&stream, UsageField::Total).reported, Some(4340));
        assert_eq!(meter(&stream, UsageField::Completion).reported, Some(15));
        // Left early: the upstream's prompt count, past the estimate.
        let early = &stream[..stream.find("event: message_delta").unwrap()];
        let mut early_meter = UsageMeter::event_stream(UsageField::Total);
        early_meter.set_prompt_estimate(100);
        early_meter.feed(early.as_bytes());
        assert_eq!(early_meter.counted(), 4327);
        // The newer `message_delta`, with every count, cumulative.
        let stream = stream.replace(
            "\"usage\":{\"output_tokens\":15}",
            "\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":300,\"cache_read_input_tokens\":4000,\"output_tokens\":15}",
        );
        assert_eq!(meter(&stream, UsageField::Total).reported, Some(4340));
    }

    #[test]
    fn newer_anthropic_deltas_with_both_counts() {
        let stream = ANTHROPIC.replace(
            "\"usage\":{\"output_tokens\":15}",
            "\"usage\":{\"input_tokens\":30,\"output_tokens\":15}",
        );
        assert_eq!(meter(&stream, UsageField::Total).reported, Some(45));
    }
}

//! The top-level `usage` member of a JSON body, found by a streaming
//! scanner.
//!
//! The scanner follows only the structure JSON needs to be told apart:
//! strings (with their escapes), nesting depth, and the keys and values of
//! the top-level object's members. It keeps no stack (a depth count is
//! enough, since only depth 0 of a member's value matters) and copies only
//! two things: each top-level key, up to [`MAX_KEY`] bytes, to decode it,
//! and the value of a `usage` member, up to [`MAX_USAGE`] bytes, to parse
//! it with serde_json once it closes. It is not a validator: what it
//! cannot make sense of ends the scan, and what follows the top-level
//! object is not looked at.

use serde_json::Value;

use super::{Counts, Malformed, Tally};

/// The longest `usage` value kept. A real one is a few hundred bytes.
const MAX_USAGE: usize = 64 * 1024;

/// The longest raw key decoded; longer ones are not `usage`, however
/// escaped (`"usage"` written all in `\uXXXX` escapes is 30 bytes).
const MAX_KEY: usize = 64;

/// Where the scanner is in the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before the top-level value: only whitespace so far.
    Start,
    /// In the top-level object, where a key (or its closing brace) comes.
    Key,
    /// In a top-level key.
    InKey,
    /// After a top-level key, before its colon.
    Colon,
    /// In a top-level member's value, until the comma or brace that ends
    /// it at depth 0.
    Value,
    /// Nothing more to read: the top-level object has closed, or the body
    /// is not an object.
    Done,
}

/// What is kept of the current member's value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Capture {
    /// Not a `usage` member.
    Off,
    /// A `usage` member's value so far.
    On(Vec<u8>),
    /// A `usage` member's value, past [`MAX_USAGE`]: dropped.
    TooLarge,
}

/// Finds the top-level `usage` member of a JSON body, chunk by chunk.
#[derive(Debug)]
pub(super) struct JsonScanner {
    phase: Phase,
    // Nesting inside the current member's value: its `,` or `}` ends the
    // member only at depth 0.
    depth: u64,
    in_string: bool,
    // The previous byte was a backslash inside a string, so this one
    // cannot end it (it is kept across chunks, like the rest).
    escaped: bool,
    // The current key, raw, quotes included; None once past MAX_KEY.
    key: Option<Vec<u8>>,
    capture: Capture,
}

impl Default for JsonScanner {
    fn default() -> Self {
        Self {
            phase: Phase::Start,
            depth: 0,
            in_string: false,
            escaped: false,
            key: Some(Vec::new()),
            capture: Capture::Off,
        }
    }
}

impl JsonScanner {
    /// Scans the next chunk, telling `tally` of each `usage` member whose
    /// value ends in it.
    pub(super) fn feed(&mut self, chunk: &[u8], tally: &mut Tally) {
        let mut i = 0;
        while i < chunk.len() && self.phase != Phase::Done {
            if self.phase == Phase::Value && self.in_string && !self.escaped {
                // Most of a body is strings: skip to where one may end.
                let rest = &chunk[i..];
                let run = rest
                    .iter()
                    .position(|&b| b == b'"' || b == b'\\')
                    .map_or(rest.len(), |p| p + 1);
                self.keep(&rest[..run]);
                match rest[run - 1] {
                    b'"' => self.in_string = false,
                    b'\\' => self.escaped = true,
                    _ => {}
                }
                i += run;
                continue;
            }
            self.byte(chunk[i], tally);
            i += 1;
        }
    }

    /// The body has ended: a `usage` value it was cut in counts if what
    /// there is of it parses (the body may have been cut just after it).
    pub(super) fn finish(&mut self, tally: &mut Tally) {
        if self.phase == Phase::Value {
            self.end_value(tally);
        }
        self.phase = Phase::Done;
    }

    /// The report [`finish`](Self::finish) would leave in `tally` if the
    /// body ended now, the scan left as it is.
    pub(super) fn reported_at_end(&self, tally: &Tally) -> Option<u64> {
        if self.phase != Phase::Value {
            return tally.reported;
        }
        // As `end_value` then `Tally::replace` would have it: a value that
        // does not parse, or does not give the field, reports nothing.
        match &self.capture {
            Capture::Off => tally.reported,
            Capture::On(value) => read_usage(value)
                .ok()
                .flatten()
                .and_then(|counts| counts.value(tally.field)),
            Capture::TooLarge => None,
        }
    }

    fn byte(&mut self, b: u8, tally: &mut Tally) {
        match self.phase {
            Phase::Start => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b'{' => self.phase = Phase::Key,
                // Valid JSON, but with no top-level members to read.
                b'[' | b'"' | b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => self.phase = Phase::Done,
                _ => self.stop_malformed(tally),
            },
            Phase::Key => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b'"' => {
                    self.phase = Phase::InKey;
                    self.escaped = false;
                    self.key = Some(vec![b'"']);
                }
                b'}' => self.phase = Phase::Done,
                _ => self.stop_malformed(tally),
            },
            Phase::InKey => {
                if let Some(key) = &mut self.key {
                    if key.len() < MAX_KEY + 2 {
                        key.push(b);
                    } else {
                        self.key = None;
                    }
                }
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.phase = Phase::Colon;
                }
            }
            Phase::Colon => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b':' => {
                    self.phase = Phase::Value;
                    self.depth = 0;
                    self.in_string = false;
                    self.escaped = false;
                    self.capture = if self.key.as_deref().is_some_and(is_usage) {
                        Capture::On(Vec::new())
                    } else {
                        Capture::Off
                    };
                }
                _ => self.stop_malformed(tally),
            },
            Phase::Value => self.value_byte(b, tally),
            Phase::Done => {}
        }
    }

    /// A byte of a member's value (strings' runs are taken in `feed`).
    fn value_byte(&mut self, b: u8, tally: &mut Tally) {
        if self.in_string {
            // Only the byte after a backslash comes here.
            self.escaped = false;
            self.keep(&[b]);
            return;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' if self.depth > 0 => self.depth -= 1,
            b',' if self.depth == 0 => {
                self.end_value(tally);
                self.phase = Phase::Key;
                return;
            }
            b'}' if self.depth == 0 => {
                self.end_value(tally);
                self.phase = Phase::Done;
                return;
            }
            b']' => {
                self.end_value(tally);
                return self.stop_malformed(tally);
            }
            _ => {}
        }
        self.keep(&[b]);
    }

    /// Keeps bytes of a `usage` value, up to the bound.
    fn keep(&mut self, bytes: &[u8]) {
        if let Capture::On(value) = &mut self.capture {
            if value.len() + bytes.len() > MAX_USAGE {
                self.capture = Capture::TooLarge;
            } else {
                value.extend_from_slice(bytes);
            }
        }
    }

    /// A member's value has ended: if it was `usage`, it is the report.
    fn end_value(&mut self, tally: &mut Tally) {
        match std::mem::replace(&mut self.capture, Capture::Off) {
            Capture::Off => {}
            Capture::On(value) => tally.replace(read_usage(&value)),
            Capture::TooLarge => tally.replace(Err(Malformed)),
        }
    }

    fn stop_malformed(&mut self, tally: &mut Tally) {
        tally.malformed = true;
        self.phase = Phase::Done;
    }

    /// The bytes kept now, for the tests of the bounds.
    #[cfg(test)]
    fn kept(&self) -> usize {
        let key = self.key.as_ref().map_or(0, Vec::capacity);
        match &self.capture {
            Capture::On(value) => key + value.capacity(),
            _ => key,
        }
    }
}

/// Whether a raw key (quotes included) is `"usage"`, however escaped.
fn is_usage(raw: &[u8]) -> bool {
    if !raw.contains(&b'\\') {
        return raw == b"\"usage\"";
    }
    serde_json::from_slice::<String>(raw).is_ok_and(|key| key == "usage")
}

fn read_usage(value: &[u8]) -> Result<Option<Counts>, Malformed> {
    let value: Value = serde_json::from_slice(value).map_err(|_| Malformed)?;
    Counts::read(&value)
}

#[cfg(test)]
mod tests {
    use super::super::{Usage, UsageField, UsageMeter};
    use super::*;

    fn measure(body: &[u8], field: UsageField) -> Usage {
        let mut meter = UsageMeter::json(field);
        assert!(meter.feed(body).is_empty());
        meter.finish()
    }

    fn total(body: &str) -> Usage {
        measure(body.as_bytes(), UsageField::Total)
    }

    fn reported(n: u64) -> Usage {
        Usage {
            reported: Some(n),
            deltas: 0,
            estimated: None,
            malformed: false,
        }
    }

    const NOTHING: Usage = Usage {
        reported: None,
        deltas: 0,
        estimated: None,
        malformed: false,
    };
    const MALFORMED: Usage = Usage {
        malformed: true,
        ..NOTHING
    };

    const CHAT: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"He said \"usage\": {\"total_tokens\": 999} \\"}}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":0}},"system_fingerprint":"fp"}"#;

    #[test]
    fn reads_each_field() {
        assert_eq!(total(CHAT), reported(21));
        assert_eq!(measure(CHAT.as_bytes(), UsageField::Prompt), reported(9));
        assert_eq!(
            measure(CHAT.as_bytes(), UsageField::Completion),
            reported(12)
        );
    }

    #[test]
    fn any_split_gives_the_same_usage() {
        let body = CHAT.as_bytes();
        for i in 0..=body.len() {
            let mut meter = UsageMeter::json(UsageField::Total);
            meter.feed(&body[..i]);
            meter.feed(&body[i..]);
            assert_eq!(meter.finish(), reported(21), "split at {i}");
        }
        let mut meter = UsageMeter::json(UsageField::Total);
        for b in body {
            meter.feed(std::slice::from_ref(b));
        }
        assert_eq!(meter.finish(), reported(21));
    }

    #[test]
    fn total_falls_back_to_the_sum() {
        assert_eq!(
            total(r#"{"usage":{"prompt_tokens":3,"completion_tokens":4}}"#),
            reported(7)
        );
        // Anthropic's Messages API.
        let anthropic = r#"{"type":"message","content":[{"type":"text","text":"Hi"}],"usage":{"input_tokens":10,"output_tokens":5}}"#;
        assert_eq!(total(anthropic), reported(15));
        assert_eq!(
            measure(anthropic.as_bytes(), UsageField::Completion),
            reported(5)
        );
        // Only one of the two: the total is not known.
        assert_eq!(total(r#"{"usage":{"prompt_tokens":3}}"#), MALFORMED);
    }

    #[test]
    fn anthropic_cache_tokens_are_prompt_tokens() {
        // Anthropic counts the tokens its cache wrote and read apart from
        // `input_tokens`; they are billed, so they are the prompt's.
        let body = r#"{"type":"message","usage":{"input_tokens":3,"cache_creation_input_tokens":1000,"cache_read_input_tokens":20000,"output_tokens":5}}"#;
        assert_eq!(total(body), reported(21_008));
        assert_eq!(
            measure(body.as_bytes(), UsageField::Prompt),
            reported(21_003)
        );
        assert_eq!(
            measure(body.as_bytes(), UsageField::Completion),
            reported(5)
        );
        // Each is optional; null is absent; the sum saturates.
        let body = r#"{"usage":{"input_tokens":3,"cache_creation_input_tokens":null,"cache_read_input_tokens":7,"output_tokens":1}}"#;
        assert_eq!(total(body), reported(11));
        let body = r#"{"usage":{"input_tokens":18446744073709551615,"cache_read_input_tokens":7,"output_tokens":1}}"#;
        assert_eq!(total(body), reported(u64::MAX));
        // A cache count that is not a count is malformed, as any count.
        let body =
            r#"{"usage":{"input_tokens":3,"cache_read_input_tokens":"7","output_tokens":1}}"#;
        assert_eq!(total(body), MALFORMED);
        // OpenAI's `prompt_tokens` already includes its cached tokens, and
        // so does a proxy's that adds Anthropic's cache counts beside it.
        let openai = r#"{"usage":{"prompt_tokens":2006,"completion_tokens":300,"total_tokens":2306,"prompt_tokens_details":{"cached_tokens":1920}}}"#;
        assert_eq!(
            measure(openai.as_bytes(), UsageField::Prompt),
            reported(2006)
        );
        let proxy = r#"{"usage":{"prompt_tokens":2006,"completion_tokens":300,"cache_read_input_tokens":1920}}"#;
        assert_eq!(total(proxy), reported(2306));
    }

    #[test]
    fn a_responses_api_body_has_its_usage_at_the_top() {
        let body = r#"{"id":"resp_1","object":"response","status":"completed","output":[{"type":"message","content":[{"type":"output_text","text":"Hi"}]}],"usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":32},"output_tokens":87,"output_tokens_details":{"reasoning_tokens":64},"total_tokens":123}}"#;
        assert_eq!(total(body), reported(123));
        // Cached tokens are a part of `input_tokens` here, not added to it.
        assert_eq!(measure(body.as_bytes(), UsageField::Prompt), reported(36));
        assert_eq!(
            measure(body.as_bytes(), UsageField::Completion),
            reported(87)
        );
    }

    #[test]
    fn reported_is_what_finish_would_report() {
        let body = br#"{"id":"x","usage":{"total_tokens":5},"choices":[]}"#;
        for i in 0..=body.len() {
            let mut meter = UsageMeter::json(UsageField::Total);
            meter.feed(&body[..i]);
            let now = meter.reported();
            // Asking changes nothing.
            assert_eq!(meter.reported(), now);
            assert!(meter.end_of_stream().is_empty());
            assert_eq!(meter.finish().reported, now, "cut at {i}");
        }
        let mut meter = UsageMeter::json(UsageField::Total);
        meter.feed(br#"{"usage":{"total_tokens":5}"#);
        assert_eq!(meter.reported(), Some(5));
        meter.feed(b",\"usage\":{\"total_tok");
        // A later duplicate, cut: it replaces the first, and reads as nothing.
        assert_eq!(meter.reported(), None);
        meter.feed(br#"ens":9}}"#);
        assert_eq!(meter.reported(), Some(9));
        let mut meter = UsageMeter::json(UsageField::Total);
        meter.feed(br#"{"usage":{"total_tokens":5,"pad":""#);
        meter.feed("x".repeat(MAX_USAGE).as_bytes());
        assert_eq!(meter.reported(), None);
    }

    #[test]
    fn usage_in_strings_or_nested_never_counts() {
        let bodies = [
            r#"{"note":"\"usage\":{\"total_tokens\":5}"}"#,
            r#"{"choices":[{"message":{"usage":{"total_tokens":5}}}]}"#,
            r#"{"echo":{"usage":{"total_tokens":5}},"x":[{"usage":1}]}"#,
            r#"{"a\"usage":{"total_tokens":5}}"#,
            r#"{"usage ":{"total_tokens":5}}"#,
            r#"["usage",{"usage":{"total_tokens":5}}]"#,
            r#""usage""#,
            // Escaped quotes hiding a member in a top-level string.
            r#"{"a":"\",\"usage\":{\"total_tokens\":5}}"#,
        ];
        for body in bodies {
            assert_eq!(total(body), NOTHING, "{body}");
        }
        // A string value ending in an escaped backslash closes there.
        assert_eq!(
            total(r#"{"a":"\\","usage":{"total_tokens":5}}"#),
            reported(5)
        );
        assert_eq!(
            total(r#"{"a":"\\\"usage\":{}","usage":{"total_tokens":6}}"#),
            reported(6)
        );
        let hidden =
            r#"{"a":"\",\"usage\":{\"total_tokens\":9},\"b\":\"","usage":{"total_tokens":6}}"#;
        assert_eq!(total(hidden), reported(6));
    }

    #[test]
    fn an_escaped_key_is_decoded() {
        assert_eq!(total(r#"{"us\u0061ge":{"total_tokens":8}}"#), reported(8));
        let all = r#"{"\u0075\u0073\u0061\u0067\u0065":{"total_tokens":8}}"#;
        assert_eq!(total(all), reported(8));
        assert_eq!(total(r#"{"usag\u0065x":{"total_tokens":8}}"#), NOTHING);
        // Past the key bound: not usage.
        let long = format!(
            r#"{{"usage{}":{{"total_tokens":8}}}}"#,
            "\\u0000".repeat(20)
        );
        assert_eq!(total(&long), NOTHING);
    }

    #[test]
    fn the_last_duplicate_wins() {
        let body = r#"{"usage":{"total_tokens":5},"x":1,"usage":{"total_tokens":7}}"#;
        assert_eq!(total(body), reported(7));
        let null_last = r#"{"usage":{"total_tokens":5},"usage":null}"#;
        assert_eq!(total(null_last), NOTHING);
    }

    #[test]
    fn null_usage_and_no_usage_are_not_malformed() {
        assert_eq!(total(r#"{"usage":null}"#), NOTHING);
        assert_eq!(total(r#"{"error":{"message":"no"}}"#), NOTHING);
        assert_eq!(total(" \n[1,2]"), NOTHING);
        assert_eq!(total(""), NOTHING);
        assert_eq!(total("{}"), NOTHING);
    }

    #[test]
    fn what_cannot_be_read_is_malformed() {
        let bodies = [
            "<html>usage</html>",
            r#"{"usage":{"total_tokens":-1}}"#,
            r#"{"usage":{"total_tokens":12.0}}"#,
            r#"{"usage":{"total_tokens":1e3}}"#,
            r#"{"usage":{"total_tokens":"12"}}"#,
            r#"{"usage":{"total_tokens":18446744073709551616}}"#,
            r#"{"usage":{}}"#,
            r#"{"usage":[1]}"#,
            r#"{"usage":12}"#,
            r#"{"usage":{"total_tokens":5]}"#,
            r#"{"usage":{"total_tokens":5"#,
            r#"{"usage":}"#,
            "{usage:1}",
        ];
        for body in bodies {
            assert_eq!(total(body), MALFORMED, "{body}");
        }
        assert_eq!(
            total(r#"{"usage":{"total_tokens":18446744073709551615}}"#),
            reported(u64::MAX)
        );
    }

    #[test]
    fn a_body_cut_after_its_usage_still_counts() {
        assert_eq!(total(r#"{"usage":{"total_tokens":5}"#), reported(5));
        assert_eq!(total(r#"{"usage":{"total_tokens":5},"choi"#), reported(5));
    }

    #[test]
    fn a_usage_past_its_bound_is_malformed_and_dropped() {
        let padding = "x".repeat(MAX_USAGE);
        let body = format!(r#"{{"usage":{{"total_tokens":5,"pad":"{padding}"}}}}"#);
        let mut meter = UsageMeter::json(UsageField::Total);
        for chunk in body.as_bytes().chunks(1000) {
            meter.feed(chunk);
            let super::super::Body::Json(scanner) = &meter.body else {
                unreachable!()
            };
            assert!(scanner.kept() <= 2 * MAX_USAGE);
        }
        assert_eq!(meter.finish(), MALFORMED);
    }

    /// A chat completion with a 5 MiB `choices` array, usage first or last.
    fn huge(usage_first: bool) -> Vec<u8> {
        let usage = r#""usage":{"prompt_tokens":100,"completion_tokens":23,"total_tokens":123}"#;
        let choice = r#"{"index":0,"message":{"role":"assistant","content":"lorem \"usage\":{} ipsum \\ dolor {[ sit"}}"#;
        let mut body = String::from("{");
        if usage_first {
            body.push_str(usage);
            body.push(',');
        }
        body.push_str(r#""choices":["#);
        while body.len() < 5 * 1024 * 1024 {
            body.push_str(choice);
            body.push(',');
        }
        body.push_str(choice);
        body.push(']');
        if !usage_first {
            body.push(',');
            body.push_str(usage);
        }
        body.push('}');
        body.into_bytes()
    }

    #[test]
    fn a_body_past_every_bound_still_gives_its_usage() {
        for usage_first in [false, true] {
            let body = huge(usage_first);
            assert!(serde_json::from_slice::<Value>(&body).is_ok());
            for size in [1, 7, 64 * 1024] {
                let mut meter = UsageMeter::json(UsageField::Total);
                // Byte by byte only at both ends, where the usage is: 5 MiB
                // of single-byte feeds would only repeat the other sizes.
                let chunks: Box<dyn Iterator<Item = &[u8]>> = if size == 1 {
                    let (head, rest) = body.split_at(4096);
                    let (middle, tail) = rest.split_at(rest.len() - 4096);
                    Box::new(
                        head.chunks(1)
                            .chain(middle.chunks(4096))
                            .chain(tail.chunks(1)),
                    )
                } else {
                    Box::new(body.chunks(size))
                };
                for chunk in chunks {
                    meter.feed(chunk);
                }
                assert_eq!(meter.finish(), reported(123), "first {usage_first}, {size}");
            }
        }
    }

    #[test]
    fn counted_takes_the_report_and_the_estimate() {
        let mut meter = UsageMeter::json(UsageField::Total);
        meter.set_prompt_estimate(50);
        assert_eq!(meter.counted(), 50);
        meter.feed(br#"{"usage":{"total_tokens":80}}"#);
        assert_eq!(meter.counted(), 80);
        let usage = meter.finish();
        assert_eq!(usage.cost(), Some(80));
        let mut meter = UsageMeter::json(UsageField::Total);
        meter.set_prompt_estimate(50);
        meter.feed(br#"{"usage":{"total_tokens":20}}"#);
        assert_eq!(meter.counted(), 50);
        assert_eq!(meter.finish().cost(), Some(20));
    }
}

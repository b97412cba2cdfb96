//! The meter as a caller sees it: content types, chunk splits, the running
//! count and the cut event.

use serde_json::Value;

use super::sse::{EventStream, Step};
use super::*;

/// A chat completion stream as OpenAI sends it with
/// `stream_options.include_usage`, with a comment and a content that looks
/// like usage and like the end of an event.
const OPENAI: &str = concat!(
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    ": OPENROUTER PROCESSING\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" \\\"usage\\\":{\\\"total_tokens\\\":1}\\n\\ndata: x\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\"total_tokens\":15}}\n\n",
    "data: [DONE]\n\n",
);

/// Feeds `chunks` to a meter with a prompt estimate of 10, then ends the
/// stream: what it measured, its boundaries at their offsets in the whole
/// stream, and its count after each chunk.
fn run(chunks: &[&[u8]], field: UsageField) -> (Usage, Vec<(usize, u64)>, Vec<u64>) {
    let mut meter = UsageMeter::event_stream(field);
    meter.set_prompt_estimate(10);
    let (mut ends, mut counts, mut at) = (Vec::new(), Vec::new(), 0);
    for chunk in chunks {
        let boundaries = meter.feed(chunk);
        assert_eq!(boundaries.len(), boundaries.iter().len());
        ends.extend(boundaries.iter().map(|(end, n)| (at + end, n)));
        for (end, _) in boundaries.iter() {
            assert!(end <= chunk.len());
        }
        at += chunk.len();
        counts.push(meter.counted());
    }
    for (end, n) in meter.end_of_stream().iter() {
        // At the end of what was fed: nothing is past it.
        assert_eq!(end, 0);
        ends.push((at, n));
    }
    assert_eq!(meter.counted(), *counts.last().unwrap_or(&10));
    (meter.finish(), ends, counts)
}

fn line_ends(stream: &str, end: &str) -> String {
    stream.replace('\n', end)
}

#[test]
fn an_openai_stream_is_measured() {
    let (usage, ends, _) = run(&[OPENAI.as_bytes()], UsageField::Total);
    assert_eq!(
        usage,
        Usage {
            reported: Some(15),
            deltas: 2,
            // The upstream's prompt count (12), not the estimate (10).
            estimated: Some(14),
            malformed: false
        }
    );
    let counts: Vec<u64> = ends.iter().map(|&(_, n)| n).collect();
    // role, comment, "Hello", the tricky content, stop, usage, [DONE].
    assert_eq!(counts, [10, 10, 11, 12, 12, 15, 15]);
    assert_eq!(ends.last().unwrap().0, OPENAI.len());
    // Each boundary is where an event's text ends.
    let mut from = 0;
    for &(end, _) in &ends {
        assert!(OPENAI[from..end].ends_with("\n\n"));
        assert_eq!(OPENAI[from..end].matches("\n\n").count(), 1);
        from = end;
    }
}

#[test]
fn every_split_gives_the_same_usage_and_boundaries() {
    for end in ["\n", "\r\n", "\r"] {
        let stream = line_ends(OPENAI, end);
        let stream = stream.as_bytes();
        let whole = run(&[stream], UsageField::Total);
        assert_eq!(whole.0.reported, Some(15), "{end:?}");
        // A trailing lone CR holds the last boundary until the end.
        assert_eq!(whole.1.len(), 7, "{end:?}");
        assert_eq!(whole.1.last().unwrap().0, stream.len(), "{end:?}");
        for i in 0..=stream.len() {
            let split = run(&[&stream[..i], &stream[i..]], UsageField::Total);
            assert_eq!(
                (split.0, &split.1),
                (whole.0, &whole.1),
                "{end:?} split at {i}"
            );
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        let (usage, ends, counts) = run(&bytes, UsageField::Total);
        assert_eq!((usage, &ends), (whole.0, &whole.1), "{end:?} byte by byte");
        assert!(counts.is_sorted(), "the count never goes back");
    }
}

#[test]
fn the_count_never_goes_back() {
    // A report below what the deltas counted.
    let stream = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"total_tokens\":3}}\n\n",
    );
    let (usage, ends, _) = run(&[stream.as_bytes()], UsageField::Total);
    assert_eq!(ends.iter().map(|e| e.1).collect::<Vec<_>>(), [11, 12, 12]);
    assert_eq!(usage.cost(), Some(3));
}

#[test]
fn the_prompt_estimate_follows_the_field() {
    let (usage, ends, _) = run(&[OPENAI.as_bytes()], UsageField::Completion);
    // Ignored: the deltas alone.
    assert_eq!(
        ends.iter().map(|e| e.1).collect::<Vec<_>>(),
        [0, 0, 1, 2, 2, 3, 3]
    );
    assert_eq!((usage.reported, usage.estimated), (Some(3), Some(2)));
    let (usage, ends, _) = run(&[OPENAI.as_bytes()], UsageField::Prompt);
    // Deltas say nothing of the prompt.
    assert_eq!(
        ends.iter().map(|e| e.1).collect::<Vec<_>>(),
        [10, 10, 10, 10, 10, 12, 12]
    );
    assert_eq!((usage.reported, usage.estimated), (Some(12), None));
    let cut = &OPENAI[..OPENAI
        .find("data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[]")
        .unwrap()];
    let (usage, _, _) = run(&[cut.as_bytes()], UsageField::Prompt);
    assert_eq!(usage.cost(), None);
}

#[test]
fn nothing_measured_costs_nothing_known() {
    let usage = UsageMeter::event_stream(UsageField::Total).finish();
    assert_eq!(usage.cost(), None);
    let mut meter = UsageMeter::event_stream(UsageField::Total);
    meter.set_prompt_estimate(40);
    meter.feed(b": ping\n\n");
    assert_eq!(meter.counted(), 40);
    assert_eq!(meter.finish().cost(), None);
}

#[test]
fn json_has_no_boundaries() {
    let mut meter = UsageMeter::json(UsageField::Total);
    assert!(!meter.is_event_stream());
    assert!(
        meter
            .feed(b"{\"usage\":{\"total_tokens\":4}}\n\n")
            .is_empty()
    );
    assert_eq!(meter.counted(), 4);
    assert_eq!(meter.finish().reported, Some(4));
}

#[test]
fn the_meter_follows_the_content_type() {
    let kind = |value: &'static str| {
        UsageMeter::for_content_type(Some(&HeaderValue::from_static(value)), UsageField::Total)
            .map(|meter| meter.is_event_stream())
    };
    for json in [
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/vnd.api+json",
        "application/problem+JSON ;x=y",
    ] {
        assert_eq!(kind(json), Some(false), "{json}");
    }
    for sse in ["text/event-stream", " TEXT/Event-Stream;charset=utf-8"] {
        assert_eq!(kind(sse), Some(true), "{sse}");
    }
    for other in [
        "text/plain",
        "application/jsonl",
        "application/json-seq",
        "application/+json",
        "text/json",
        "application/x-ndjson",
        "text/event-streams",
        "",
    ] {
        assert_eq!(kind(other), None, "{other}");
    }
    assert!(UsageMeter::for_content_type(None, UsageField::Total).is_none());
}

#[test]
fn fields_parse_by_their_names() {
    assert_eq!(UsageField::parse("total_tokens"), Some(UsageField::Total));
    assert_eq!(UsageField::parse("prompt_tokens"), Some(UsageField::Prompt));
    assert_eq!(
        UsageField::parse("completion_tokens"),
        Some(UsageField::Completion)
    );
    assert_eq!(UsageField::parse("Total_tokens"), None);
    assert_eq!(UsageField::parse("input_tokens"), None);
    assert_eq!(UsageField::default(), UsageField::Total);
}

#[test]
fn the_cut_event_is_well_formed_whatever_the_rule() {
    let rule = "a\"b\\c\r\n\ndata: [DONE]\n\n\u{2028}</script>";
    let event = cut_event(rule, 42);
    let mut stream = EventStream::default();
    let (mut data, mut ends) = (Vec::new(), Vec::new());
    stream.feed(&event, &mut |step| match step {
        Step::Event(d) => data.push(d.to_vec()),
        Step::TooLarge => panic!("too large"),
        Step::Boundary(end) => ends.push(end),
    });
    assert_eq!(data.len(), 2);
    assert_eq!(data[1], b"[DONE]");
    assert_eq!(ends.last(), Some(&event.len()));
    assert!(event.starts_with(b"event: error\ndata: {"));
    let json: Value = serde_json::from_slice(&data[0]).unwrap();
    let error = &json["error"];
    assert_eq!(error["rule"], rule);
    assert_eq!(error["retry_after"], 42);
    assert_eq!(error["type"], "rate_limit_exceeded");
    assert_eq!(error["code"], "budget_exhausted");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains(rule) && message.contains("42"));
}

#[test]
fn a_stream_cut_between_events_reads_as_one() {
    let stream = OPENAI.as_bytes();
    let (_, ends, _) = run(&[stream], UsageField::Total);
    let mut cut = stream[..ends[2].0].to_vec();
    cut.extend_from_slice(&cut_event("tokens", 7));
    let (usage, cut_ends, _) = run(&[&cut], UsageField::Total);
    assert_eq!(cut_ends.last().unwrap().0, cut.len());
    assert_eq!((usage.deltas, usage.malformed), (1, false));
}

#[test]
fn the_end_of_stream_releases_a_boundary_held_by_a_cr() {
    let first = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\r\r";
    let last = "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\r\r";
    let mut meter = UsageMeter::event_stream(UsageField::Completion);
    // The first one's boundary is held until the next byte tells.
    assert!(meter.feed(first.as_bytes()).is_empty());
    let ends = meter.feed(last.as_bytes());
    assert_eq!(ends.as_slice(), &[(0, 1)]);
    // The last event was read (the count has it); its boundary waits.
    assert_eq!(meter.counted(), 2);
    // Only the end tells it: at the end of what was fed.
    assert_eq!(meter.end_of_stream().as_slice(), &[(0, 2)]);
    // Once; and finish after it reads the same.
    assert!(meter.end_of_stream().is_empty());
    let usage = meter.finish();
    assert_eq!((usage.deltas, usage.cost()), (2, Some(2)));
}

#[test]
fn the_end_of_stream_reads_no_unfinished_event() {
    for tail in [
        "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}",
        "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\r",
        "data: {\"choices\":[],\"usage\":{\"total_tokens\":99}}\r\n",
    ] {
        let mut meter = UsageMeter::event_stream(UsageField::Total);
        meter.set_prompt_estimate(10);
        let ends = meter.feed(
            format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"a\"}}}}]}}\n\n{tail}")
                .as_bytes(),
        );
        assert_eq!(ends.len(), 1);
        assert!(meter.end_of_stream().is_empty(), "{tail:?}");
        assert_eq!((meter.counted(), meter.reported()), (11, None), "{tail:?}");
        let usage = meter.finish();
        assert_eq!((usage.deltas, usage.cost()), (1, Some(11)), "{tail:?}");
    }
}

#[test]
fn the_end_of_a_json_body_changes_nothing() {
    let mut meter = UsageMeter::json(UsageField::Total);
    meter.feed(b"{\"usage\":{\"total_tokens\":4}\r");
    assert!(meter.end_of_stream().is_empty());
    // The value the body was cut after is still finish's to read.
    assert_eq!(meter.reported(), Some(4));
    assert_eq!(meter.finish().reported, Some(4));
}

#[test]
fn reported_is_the_upstreams_report_so_far() {
    let mut meter = UsageMeter::event_stream(UsageField::Total);
    meter.set_prompt_estimate(10);
    assert_eq!(meter.reported(), None);
    let mut reports = Vec::new();
    for event in OPENAI.split_inclusive("\n\n") {
        meter.feed(event.as_bytes());
        reports.push(meter.reported());
    }
    let mut expected = [None; 7];
    expected[5..].fill(Some(15));
    assert_eq!(reports, expected);
    assert_eq!(meter.finish().reported, Some(15));
    // It follows the upstream down, where the count does not.
    let mut meter = UsageMeter::event_stream(UsageField::Completion);
    meter.feed(b"data: {\"usage\":{\"completion_tokens\":8}}\n\n");
    meter.feed(b"data: {\"usage\":{\"completion_tokens\":5}}\n\n");
    assert_eq!((meter.counted(), meter.reported()), (8, Some(5)));
    assert_eq!(meter.finish().reported, Some(5));
}

//! The TOML configuration (`Config::parse`) and the YAML descriptor file
//! (`DescriptorFile::parse`): any text is a configuration or an error that
//! names the field (and, for a syntax error, the line), within a bound.

use std::path::Path;
use std::time::Duration;

use proptest::prelude::*;
use spillway_conformance::hostile::{config, mutated, within};
use spillway_server::config::descriptors::DescriptorFile;
use spillway_server::config::{Config, ConfigError, ConfigErrors, SAMPLE_CONFIG, parse_duration};

/// The most one parse may take: a valid configuration parses in well under
/// a millisecond.
const BOUND: Duration = Duration::from_secs(10);

/// A configuration with a field of nearly every section and kind.
const FULL: &str = r#"
[server]
listen = "127.0.0.1:9000"
grpc_listen = "[::1]:9001"
check_tokens = ["a", "b"]
head_timeout = "5s"
body_timeout = "10s"
write_timeout = "10s"
idle_timeout = "1m"
max_connections = 100

[store]
kind = "redis"
url = ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]
timeout = "20ms"
on_error = "local"
instances = 3

[headers]
legacy = false
reset = "delta"
body = "quota-exceeded"

[clients]
trusted_proxies = ["10.0.0.0/8", "::1"]
forwarded_header = "forwarded"
user_header = "x-user"
tier_header = "x-tier"
ipv6_prefix = 56

[envoy]
domain = "edge"
max_descriptors = 8
max_entries = 4

[tiers.gold]
api_keys = ["g1", "g2"]

[[rules]]
name = "shaped"
match = { methods = ["GET", "post"], path = "/api/{id}/**", host = "*.example.com", exact_path = true }
key = ["ip", "header:x-tenant"]
fallback = ["route"]
algorithm = "leaky_bucket"
mode = "shape"
limit = 10
window = "1s"
burst = 5
delay = 2
cost = "header:x-cost"
action = "degrade"
on_error = "fail_closed"
descriptors = ["tenant"]

[rules.tiers.gold]
limit = 1000
burst = 100

[[rules]]
name = "fixed"
key = ["user", "method"]
algorithm = "fixed_window"
limit = 3
window = "1d"
cost = 1
action = "shadow"
"#;

const SEEDS: &[&[u8]] = &[SAMPLE_CONFIG.as_bytes(), FULL.as_bytes()];

/// TOML's syntax, and values at and past their limits.
const PIECES: &[&[u8]] = &[
    b"=",
    b"\"",
    b"'''",
    b"[",
    b"]",
    b"[[rules]]\n",
    b"{",
    b"}",
    b",",
    b".",
    b"\n",
    b"#",
    b"0",
    b"-1",
    b"18446744073709551616",
    b"9223372036854775807",
    b"1e400",
    b"nan",
    b"\"\\u0000\"",
    b"\"\\uD800\"",
    b"true",
    b"1979-05-27T07:32:00Z",
    b"0ms",
    b"99999999999999999d",
];

/// Checks what `Config::parse` made of `text` and returns it: `Ok`, or
/// an error that names its field, with its line when the file does not
/// parse as TOML (and a line inside the file whenever it has one).
fn parse(text: Vec<u8>) -> Result<(), ConfigErrors> {
    let text = String::from_utf8_lossy(&text).into_owned();
    let shown = format!("{text:?}");
    let lines = text.lines().count() + 1;
    let parsed = within(BOUND, move || Config::parse(&text).map(|_| ()))
        .unwrap_or_else(|e| panic!("{e:?} for {shown}"));
    if let Err(all) = &parsed {
        for e in all.errors() {
            names_what_is_wrong(e, lines);
        }
    }
    parsed
}

fn names_what_is_wrong(e: &ConfigError, lines: usize) {
    assert!(!e.message.trim().is_empty(), "{e:?}");
    assert!(!e.field.trim().is_empty(), "{e:?}");
    if e.field == "(syntax)" || e.field == "(file)" {
        assert!(e.line.is_some(), "a syntax error without a line: {e:?}");
    }
    if let Some(line) = e.line {
        assert!((1..=lines).contains(&line), "line {line} of {lines}: {e:?}");
    }
    let text = e.to_string();
    assert!(text.contains(&e.field), "{text}");
}

/// A valid rule, as TOML, named `name`.
fn rule(name: String) -> impl Strategy<Value = String> {
    let algorithm = prop_oneof![
        Just(("fixed_window", "")),
        Just(("sliding_log", "")),
        Just(("sliding_window", "")),
        Just(("token_bucket", "burst = 7\n")),
        Just(("leaky_bucket", "mode = \"police\"\n")),
        Just(("leaky_bucket", "burst = 3\ndelay = 1\n")),
    ];
    let key = proptest::sample::subsequence(
        vec![
            "\"ip\"",
            "\"api_key\"",
            "\"route\"",
            "\"method\"",
            "\"header:x-tenant\"",
        ],
        0..3,
    );
    let window = proptest::sample::select(&["500ms", "1s", "10s", "1m", "1h", "1d"][..]);
    (algorithm, key, 1..1_000_000u32, window).prop_map(
        move |((algorithm, extra), key, limit, window)| {
            let key = if key.is_empty() {
                String::new()
            } else {
                format!("key = [{}]\n", key.join(", "))
            };
            format!(
                "[[rules]]\nname = \"{name}\"\n{key}algorithm = \"{algorithm}\"\nlimit = {limit}\nwindow = \"{window}\"\n{extra}"
            )
        },
    )
}

/// A valid configuration of 1 to 6 rules, and their names.
fn valid() -> impl Strategy<Value = (String, Vec<String>)> {
    proptest::collection::vec("[a-z][a-z0-9-]{0,8}", 1..6).prop_flat_map(|names| {
        // Names must be unique: number them.
        let names: Vec<String> = names
            .into_iter()
            .enumerate()
            .map(|(i, n)| format!("{n}-{i}"))
            .collect();
        let rules: Vec<_> = names.iter().cloned().map(rule).collect();
        (rules, Just(names)).prop_map(|(rules, names)| (rules.concat(), names))
    })
}

/// A sample descriptor file, and one with every field.
const YAML_SEEDS: &[&[u8]] = &[
    include_bytes!("../../config/envoy-ratelimit.yaml"),
    b"domain: d\ndescriptors:\n  - key: a\n    value: \"x*\"\n    detailed_metric: true\n    rate_limit:\n      name: first\n      unit: second\n      requests_per_unit: 3\n    descriptors:\n      - key: b\n        shadow_mode: true\n        rate_limit:\n          unit: week\n          requests_per_unit: 1\n          replaces:\n            - name: first\n  - key: c\n    rate_limit: { unlimited: true }\n",
];

/// YAML's syntax: anchors, aliases, tags, flow collections, documents.
const YAML_PIECES: &[&[u8]] = &[
    b": ",
    b"- ",
    b"\n",
    b"  ",
    b"&a ",
    b"*a",
    b"<<: *a\n",
    b"!!str ",
    b"!!binary ",
    b"{",
    b"}",
    b"[",
    b"]",
    b"---\n",
    b"...\n",
    b"|\n",
    b">-\n",
    b"'",
    b"\"",
    b"#",
    b"?",
    b"%YAML 1.2\n",
    b"\t",
    b"-1",
    b"4294967296",
    b"9223372036854775808",
    b"~",
    b".inf",
];

/// Checks what `DescriptorFile::parse` made of `text`: its rules, or an
/// error that names the file and its field (a syntax error its line).
fn parse_yaml(text: Vec<u8>) -> Result<usize, ConfigError> {
    let text = String::from_utf8_lossy(&text).into_owned();
    let shown = format!("{text:?}");
    // YAML breaks lines at a CR alone too.
    let lines = text.replace("\r\n", "\n").matches(['\n', '\r']).count() + 1;
    let parsed = within(BOUND, move || {
        DescriptorFile::parse(&text, Path::new("limits.yaml"), 0).map(|f| f.rules.len())
    })
    .unwrap_or_else(|e| panic!("{e:?} for {shown}"));
    if let Err(e) = &parsed {
        assert_eq!(e.file.as_deref(), Some(Path::new("limits.yaml")), "{e:?}");
        assert!(e.to_string().starts_with("limits.yaml: "), "{e}");
        names_what_is_wrong(e, lines);
    }
    parsed
}

/// Values of every type, and at and past their limits, for a field.
const VALUES: &[&str] = &[
    "0",
    "1",
    "-1",
    "4294967296",
    "18446744073709551616",
    "1.5",
    "true",
    "\"\"",
    "\"x\"",
    "\"0s\"",
    "\"1x\"",
    "\"99999999999999999999d\"",
    "\"18446744073709551615d\"",
    "[]",
    "[\"\"]",
    "[1, \"a\"]",
    "{}",
    "\"header:\"",
    "\"header:\\n\"",
    "\"/**/**\"",
    "\"{a}{a}\"",
    "\"256.0.0.1/33\"",
    "\"*\"",
    "\"redis://[::1\"",
];

/// `seed` with the values of some of its `name<sep>value` lines replaced by
/// [`VALUES`]: the file still parses, so the cases reach the checks of
/// every field.
fn swapped(seed: &'static str, sep: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let lines: Vec<&str> = seed.lines().collect();
    let fields: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains(sep) && !lines[i].trim_start().starts_with('#'))
        .collect();
    proptest::collection::vec(
        (
            proptest::sample::select(fields),
            proptest::sample::select(VALUES),
        ),
        1..3,
    )
    .prop_map(move |swaps| {
        let mut lines: Vec<String> = seed.lines().map(str::to_string).collect();
        for (i, value) in swaps {
            let at = lines[i].find(sep).expect("a field line") + sep.len();
            lines[i].replace_range(at.., value);
        }
        (lines.join("\n") + "\n").into_bytes()
    })
}

proptest! {
    #![proptest_config(config(200))]

    #[test]
    fn any_text_is_a_config_or_names_what_is_wrong(text in "(?s).{0,300}") {
        let _ = parse(text.into_bytes());
    }

    #[test]
    fn toml_shaped_text_is_a_config_or_names_what_is_wrong(
        text in "([a-z_.\\[\\]]{0,12} ?= ?(\"[ -~]{0,12}\"|[0-9]{1,20}|\\[[^\\n]{0,20}\\]|\\{[^\\n]{0,20}\\})\n){0,10}"
    ) {
        let _ = parse(text.into_bytes());
    }

    #[test]
    fn a_mutated_config_is_a_config_or_names_what_is_wrong(text in mutated(SEEDS, PIECES)) {
        let _ = parse(text);
    }

    #[test]
    fn a_config_with_values_swapped_is_one_or_names_the_field(
        text in prop_oneof![swapped(FULL, " = "), swapped(SAMPLE_CONFIG, " = ")]
    ) {
        let _ = parse(text);
    }

    #[test]
    fn a_valid_config_is_accepted_with_its_rules((text, names) in valid()) {
        let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e} for {text}"));
        let parsed: Vec<&str> = config.policy.rules().iter().map(|r| r.name()).collect();
        prop_assert_eq!(parsed, names);
    }

    #[test]
    fn any_duration_is_one_or_quotes_itself(text in "(?s).{0,30}") {
        if let Err(e) = parse_duration(&text) {
            prop_assert!(e.contains(text.trim()), "{}", e);
        }
    }

    #[test]
    fn any_text_is_a_descriptor_file_or_names_what_is_wrong(text in "(?s).{0,300}") {
        let _ = parse_yaml(text.into_bytes());
    }

    #[test]
    fn a_descriptor_file_with_values_swapped_is_one_or_names_the_field(
        text in prop_oneof![
            swapped(std::str::from_utf8(YAML_SEEDS[0]).unwrap(), ": "),
            swapped(std::str::from_utf8(YAML_SEEDS[1]).unwrap(), ": "),
        ]
    ) {
        let _ = parse_yaml(text);
    }

    #[test]
    fn a_mutated_descriptor_file_is_one_or_names_what_is_wrong(
        text in mutated(YAML_SEEDS, YAML_PIECES)
    ) {
        let _ = parse_yaml(text);
    }
}

proptest! {
    #![proptest_config(config(64))]

    /// Configuration files are bytes: bytes that are not UTF-8, in the
    /// configuration or in its descriptor file, are an error at their line.
    #[test]
    fn a_file_of_any_bytes_is_a_config_or_names_its_line(
        seed in 0..2usize,
        junk in proptest::collection::vec(any::<u8>(), 1..8),
        at in any::<usize>(),
        into_descriptors in any::<bool>(),
    ) {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("parsers-bytes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let (mut toml, mut yaml) = (
            format!("{}\n[envoy]\ndescriptors_file = \"limits.yaml\"\n", SAMPLE_CONFIG).into_bytes(),
            YAML_SEEDS[seed].to_vec(),
        );
        let target = if into_descriptors { &mut yaml } else { &mut toml };
        let at = at % (target.len() + 1);
        target.splice(at..at, junk);
        let lines = target.split(|&b| b == b'\n').count();
        std::fs::write(dir.join("spillway.toml"), &toml).expect("write");
        std::fs::write(dir.join("limits.yaml"), &yaml).expect("write");
        let path = dir.join("spillway.toml");
        let loaded = within(BOUND, move || Config::load(&path).map(|_| ()))
            .unwrap_or_else(|e| panic!("{e:?}"));
        for e in loaded.err().iter().flat_map(|all| all.errors()) {
            prop_assert!(!e.message.trim().is_empty(), "{:?}", e);
            prop_assert!(!e.field.trim().is_empty(), "{:?}", e);
            if let Some(line) = e.line {
                prop_assert!(line <= lines + 4, "line {} of {}: {:?}", line, lines, e);
            }
            // Only a byte in the descriptor file can be an error of that
            // file; every other error is the configuration file's.
            let file = if into_descriptors { "limits.yaml" } else { "spillway.toml" };
            prop_assert!(
                e.file.as_ref().is_some_and(|f| f.ends_with(file)),
                "{:?}",
                e
            );
        }
    }
}

/// Found while writing the byte property: a file with a byte that is not
/// UTF-8 was "cannot read: stream did not contain valid UTF-8", without
/// its line.
#[test]
fn a_byte_that_is_not_utf8_names_its_line() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("parsers-utf8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    let path = dir.join("spillway.toml");
    std::fs::write(&path, b"[server]\nlisten = \"127.0.0.1:1\xff\"\n").expect("write");
    let e = Config::load(&path).unwrap_err().first().clone();
    assert_eq!(e.line, Some(2), "{e}");
    assert!(
        e.message.contains("0xff") && e.message.contains("not UTF-8"),
        "{e}"
    );
    std::fs::write(&path, b"[envoy]\ndescriptors_file = \"d.yaml\"\n").expect("write");
    std::fs::write(
        dir.join("d.yaml"),
        b"domain: d\ndescriptors:\n  - key: \xc3\n",
    )
    .expect("write");
    let e = Config::load(&path).unwrap_err().first().clone();
    assert_eq!((e.file, e.line), (Some(dir.join("d.yaml")), Some(3)));
}

#[test]
fn the_seeds_are_valid() {
    for seed in SEEDS {
        parse(seed.to_vec()).expect("a valid config");
    }
    assert_eq!(parse_yaml(YAML_SEEDS[0].to_vec()).expect("valid"), 5);
    assert_eq!(parse_yaml(YAML_SEEDS[1].to_vec()).expect("valid"), 2);
}

/// Input that a parser could recurse or expand on without end: nesting
/// deeper than any stack, and YAML aliases that multiply (a "billion
/// laughs"). Each is refused with an error, on a thread with the 2 MiB
/// stack of a tokio worker (where a reload parses), within the bound.
#[test]
fn deep_nesting_and_alias_bombs_are_errors_not_a_crash() {
    fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let worker = std::thread::Builder::new()
            .stack_size(2 * 1024 * 1024)
            .spawn(f)
            .expect("a thread");
        worker.join().expect("no panic")
    }
    let deep = 100_000;
    for text in [
        format!("a = {}{}", "[".repeat(deep), "]".repeat(deep)),
        format!("a = {}1{}", "{b = ".repeat(deep), "}".repeat(deep)),
        format!("{}\n", "[a".repeat(deep)),
        format!("[{}]\n", "a.".repeat(deep) + "b"),
    ] {
        let err = on_small_stack(move || Config::parse(&text).unwrap_err());
        let err = err.first();
        assert!(err.line.is_some() && !err.message.is_empty(), "{err}");
    }
    let mut bomb = String::from("domain: d\nx0: &x0 [a, a, a, a, a, a, a, a, a, a]\n");
    for i in 1..12 {
        let j = i - 1;
        bomb.push_str(&format!(
            "x{i}: &x{i} [*x{j}, *x{j}, *x{j}, *x{j}, *x{j}, *x{j}, *x{j}, *x{j}, *x{j}, *x{j}]\n"
        ));
    }
    for text in [
        format!(
            "domain: d\ndescriptors: {}{}",
            "[".repeat(deep),
            "]".repeat(deep)
        ),
        format!(
            "domain: d\ndescriptors:\n{}",
            "- descriptors:\n".repeat(deep)
        ),
        bomb,
    ] {
        let started = std::time::Instant::now();
        let err = on_small_stack(move || {
            DescriptorFile::parse(&text, Path::new("f.yaml"), 0).unwrap_err()
        });
        assert!(!err.message.is_empty(), "{err}");
        assert!(started.elapsed() < BOUND, "{err}");
    }
}

/// What proptest found, kept with the exact input: a character the TOML
/// parser refuses outright (a control character, a bare CR) came back as
/// an error with an empty message, `line 1: `(file)`: `.
#[test]
fn a_refused_character_is_named() {
    for (text, line, needle) in [
        ("\r0", 1, "U+000D"),
        ("a = 1\n# x\u{14}y\n", 2, "U+0014"),
        ("[server]\nlisten = \"a\u{0}\"\n", 2, "invalid basic string"),
    ] {
        let e = parse(text.as_bytes().to_vec()).unwrap_err().first().clone();
        assert_eq!(e.line, Some(line), "{e}");
        assert!(e.message.contains(needle), "{e}");
    }
}

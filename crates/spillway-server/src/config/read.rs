//! Reading the file into its raw types: the TOML syntax first (which stops
//! at its first error), then each section and each rule on its own, so that
//! one mistake does not hide the next. Every error names its field's full
//! path (`rules[2].match.methd`), found from where the TOML parser says the
//! error is.

use toml_edit::{ArrayOfTables, DocumentMut, ImDocument, Item, Table, TomlError, Value};

use super::RawConfig;
use super::errors::{ConfigError, Text, listed, suggest};

/// The top-level sections of the file.
const SECTIONS: &[&str] = &[
    "server", "store", "headers", "clients", "tiers", "envoy", "proxy", "rules",
];

/// What was read: every section and rule that could be, and the errors of
/// those that could not.
pub(super) struct Read {
    /// The sections that were read (the others as if absent) and the rules
    /// that were read.
    pub(super) raw: RawConfig,
    /// Where each of `raw.rules` is in the file: `rules[rule_index[k]]`.
    pub(super) rule_index: Vec<usize>,
    /// Whether `[tiers]` was read: if not, a rule's tiers cannot be checked
    /// against it.
    pub(super) tiers_read: bool,
    /// What could not be read.
    pub(super) errors: Vec<ConfigError>,
}

/// Reads `text`. `Err` is a TOML syntax error, after which nothing more
/// can be read.
pub(super) fn read(text: &str) -> Result<Read, ConfigError> {
    let doc = ImDocument::parse(text).map_err(|e| syntax_error(text, &e))?;
    let lines = Text(text);
    let mut read = Read {
        raw: RawConfig::default(),
        rule_index: Vec::new(),
        tiers_read: true,
        errors: Vec::new(),
    };
    let root = doc.as_table();
    for (name, item) in root.iter() {
        if name == "rules" {
            read.rules(item, &lines);
        } else if SECTIONS.contains(&name) {
            read.section(name, item, &lines);
        } else {
            let at = root.key(name).and_then(|k| k.span());
            read.errors.push(ConfigError {
                file: None,
                line: at.map(|s| lines.line(s.start)),
                field: name.to_string(),
                message: suggest(
                    format!("unknown section, expected {}", listed(SECTIONS)),
                    name,
                    SECTIONS,
                ),
            });
        }
    }
    Ok(read)
}

impl Read {
    /// Reads section `name` (not `rules`) into `self.raw`.
    fn section(&mut self, name: &str, item: &Item, lines: &Text<'_>) {
        let mut root = Table::new();
        root.insert(name, item.clone());
        match toml_edit::de::from_document::<RawConfig>(DocumentMut::from(root)) {
            Ok(part) => {
                let raw = &mut self.raw;
                match name {
                    "server" => raw.server = part.server,
                    "store" => raw.store = part.store,
                    "headers" => raw.headers = part.headers,
                    "clients" => raw.clients = part.clients,
                    "tiers" => raw.tiers = part.tiers,
                    "envoy" => raw.envoy = part.envoy,
                    "proxy" => raw.proxy = part.proxy,
                    _ => unreachable!("a section of SECTIONS"),
                }
            }
            Err(e) => {
                self.tiers_read &= name != "tiers";
                self.errors.push(described(&e, name, item, lines));
            }
        }
    }

    /// Reads the rules, each on its own.
    fn rules(&mut self, item: &Item, lines: &Text<'_>) {
        // Each rule as a file of that rule alone: `[[rules]]` tables, or
        // the elements of an inline array.
        let alone: Vec<(Item, Item)> = match item {
            Item::ArrayOfTables(tables) => tables
                .iter()
                .map(|t| {
                    let mut one = ArrayOfTables::new();
                    one.push(t.clone());
                    (Item::ArrayOfTables(one), Item::Table(t.clone()))
                })
                .collect(),
            Item::Value(Value::Array(values)) => values
                .iter()
                .map(|v| {
                    let mut one = toml_edit::Array::new();
                    one.push_formatted(v.clone());
                    (Item::Value(Value::Array(one)), Item::Value(v.clone()))
                })
                .collect(),
            // Not a list of rules at all: the error says so.
            other => vec![(other.clone(), other.clone())],
        };
        let listed = matches!(item, Item::ArrayOfTables(_) | Item::Value(Value::Array(_)));
        for (i, (file, rule)) in alone.into_iter().enumerate() {
            let mut root = Table::new();
            root.insert("rules", file);
            match toml_edit::de::from_document::<RawConfig>(DocumentMut::from(root)) {
                Ok(mut part) => {
                    self.raw.rules.append(&mut part.rules);
                    self.rule_index.push(i);
                }
                Err(e) if listed => {
                    self.errors
                        .push(described(&e, &format!("rules[{i}]"), &rule, lines))
                }
                Err(e) => self.errors.push(described(&e, "rules", &rule, lines)),
            }
        }
    }
}

/// A syntax error, at the line the parser stopped.
fn syntax_error(text: &str, e: &TomlError) -> ConfigError {
    let at = e.span().map(|s| s.start);
    let message = match e.message().trim() {
        // The TOML parser says nothing of a character it refuses outright
        // (a control character, a bare CR).
        "" => unexpected_at(text, at),
        m => m.to_string(),
    };
    ConfigError {
        file: None,
        line: at.map(|at| Text(text).line(at)),
        field: "(syntax)".into(),
        message,
    }
}

/// What the parser stopped at, byte `at` of `text`: the character, or the
/// end of the file.
fn unexpected_at(text: &str, at: Option<usize>) -> String {
    match at
        .and_then(|at| text.get(at..))
        .and_then(|rest| rest.chars().next())
    {
        Some(c) if c.is_control() => format!(
            "unexpected control character U+{:04X} (TOML allows only tab, and newline between lines)",
            u32::from(c)
        ),
        Some(c) => format!("unexpected character `{c}`"),
        None => "unexpected end of file".to_string(),
    }
}

/// A deserialization error of `item` (the section or rule at `path`): its
/// line, the full path of the field it is about, and for an unknown name
/// the one probably meant.
fn described(e: &toml_edit::de::Error, path: &str, item: &Item, lines: &Text<'_>) -> ConfigError {
    let at = e.span();
    let within = at
        .as_ref()
        .and_then(|s| path_in_item(item, s.start))
        .unwrap_or_default();
    ConfigError {
        file: None,
        line: at.map(|s| lines.line(s.start)),
        field: format!("{path}{within}"),
        message: reworded(e.message()),
    }
}

/// serde's message, said for a person editing the file: an unknown field
/// or value with the expected ones and the nearest of them.
fn reworded(message: &str) -> String {
    for kind in ["field", "variant"] {
        let Some(rest) = message.strip_prefix(&format!("unknown {kind} `")) else {
            continue;
        };
        let Some((word, expected)) = rest.split_once('`') else {
            continue;
        };
        let candidates: Vec<&str> = expected.split('`').skip(1).step_by(2).collect::<Vec<_>>();
        let noun = if kind == "field" { "field" } else { "value" };
        let message = match candidates.as_slice() {
            [] => format!("unknown {noun} `{word}`: this takes no fields"),
            list => format!("unknown {noun} `{word}`, expected {}", listed(list)),
        };
        return suggest(message, word, &candidates);
    }
    message.to_string()
}

/// The path below `item` of the key or value at byte `at` (`.match.methd`,
/// `.route_costs[1].path`), `Some("")` for `item` itself, `None` if it is not
/// within `item`.
fn path_in_item(item: &Item, at: usize) -> Option<String> {
    match item {
        Item::None => None,
        Item::Value(v) => path_in_value(v, at),
        Item::Table(t) => path_in_table(t, at),
        Item::ArrayOfTables(tables) => tables
            .iter()
            .enumerate()
            .find_map(|(i, t)| path_in_table(t, at).map(|below| format!("[{i}]{below}"))),
    }
}

fn path_in_table(t: &Table, at: usize) -> Option<String> {
    for (name, child) in t.iter() {
        if t.key(name)
            .and_then(|k| k.span())
            .is_some_and(|s| s.contains(&at))
        {
            return Some(format!(".{name}"));
        }
        if let Some(below) = path_in_item(child, at) {
            return Some(format!(".{name}{below}"));
        }
    }
    t.span().filter(|s| s.contains(&at)).map(|_| String::new())
}

fn path_in_value(v: &Value, at: usize) -> Option<String> {
    let below = match v {
        Value::Array(values) => values
            .iter()
            .enumerate()
            .find_map(|(i, v)| path_in_value(v, at).map(|below| format!("[{i}]{below}"))),
        Value::InlineTable(t) => t.iter().find_map(|(name, child)| {
            let on_key = t
                .key(name)
                .and_then(|k| k.span())
                .is_some_and(|s| s.contains(&at));
            if on_key {
                Some(format!(".{name}"))
            } else {
                path_in_value(child, at).map(|below| format!(".{name}{below}"))
            }
        }),
        _ => None,
    };
    below.or_else(|| v.span().filter(|s| s.contains(&at)).map(|_| String::new()))
}

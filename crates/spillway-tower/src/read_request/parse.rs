//! What a JSON body asks, read as leniently as the parsers an upstream may
//! use, so that no spelling of a number gets a smaller reservation than
//! the upstream will serve:
//!
//! - the text: UTF-8, with or without a byte order mark, or UTF-16 or
//!   UTF-32, told apart as Python's `json.loads` does (a BOM, else where
//!   the first bytes are zero). Node's body parsers drop a UTF-8 BOM too.
//! - a field's key: the exact key, and every key equal to it once case is
//!   folded (Go's `encoding/json` matches keys so, `ſ` for `s` and the
//!   Kelvin sign for `k` included); of several, the largest value counts.
//!   The upstream takes one of them (the last, in Python, JavaScript and
//!   Go), never more than the largest.
//! - a field's value: a non-negative integer, and also what lax validators
//!   (pydantic, which OpenAI-compatible servers in Python use) turn into
//!   one: `8000.0`, `8e3`, `"8000"`, `" +8_000 "`, `true`; and what
//!   JavaScript's `Number()` reads as one (`"0x186a0"`). An integer past
//!   `u64::MAX` is `u64::MAX` (the reservation is capped anyway).
//! - the prompt: the bytes of every string value at any depth, not keys.
//!
//! The document itself is parsed by `serde_json`, streamed through a
//! visitor: nothing is built but the fields' numbers and one sum. What it
//! refuses and a laxer parser accepts (Python's `NaN`, a lone surrogate,
//! nesting past 128) is [`Read::Unreadable`], which reserves the most.

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use smallvec::SmallVec;
use std::fmt;

/// What a body says, once read whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Read {
    /// A JSON object: each field's value if it has one (in the order of
    /// the fields asked), and the string bytes of the whole document.
    Object {
        asked: Vec<Option<u64>>,
        string_bytes: u64,
    },
    /// Valid JSON whose top level is not an object: it asks nothing.
    NotObject,
    /// Not JSON to `serde_json`, in any encoding tried.
    Unreadable,
}

/// Reads `body` for the top-level `fields`.
pub(super) fn read(body: &[u8], fields: &[String]) -> Read {
    match decode(body) {
        Some(Text::Utf8(text)) => parse(text, fields),
        Some(Text::Decoded(text)) => parse(text.as_bytes(), fields),
        None => Read::Unreadable,
    }
}

enum Text<'a> {
    Utf8(&'a [u8]),
    Decoded(String),
}

/// The body as UTF-8: its bytes (without a UTF-8 BOM), or decoded from
/// UTF-16 or UTF-32 as Python's `json.detect_encoding` tells them.
fn decode(body: &[u8]) -> Option<Text<'_>> {
    const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";
    let wide = |unit: usize, big: bool, skip: usize| -> Option<Text<'_>> {
        let rest = body.get(skip..)?;
        if rest.len() % unit != 0 {
            return None;
        }
        let word = |c: &[u8]| -> u32 {
            let mut n = 0u32;
            for i in 0..unit {
                let byte = u32::from(c[if big { i } else { unit - 1 - i }]);
                n = n << 8 | byte;
            }
            n
        };
        let text = if unit == 2 {
            let units = rest.chunks_exact(2).map(|c| word(c) as u16);
            char::decode_utf16(units)
                .collect::<Result<String, _>>()
                .ok()?
        } else {
            let chars = rest.chunks_exact(4).map(|c| char::from_u32(word(c)));
            chars.collect::<Option<String>>()?
        };
        Some(Text::Decoded(text))
    };
    match body {
        [0, 0, 0xfe, 0xff, ..] => wide(4, true, 4),
        [0xff, 0xfe, 0, 0, ..] => wide(4, false, 4),
        [0xfe, 0xff, ..] => wide(2, true, 2),
        [0xff, 0xfe, ..] => wide(2, false, 2),
        _ if body.starts_with(UTF8_BOM) => Some(Text::Utf8(&body[UTF8_BOM.len()..])),
        [0, 0, ..] if body.len() >= 4 => wide(4, true, 0),
        [0, _, ..] if body.len() >= 4 || body.len() == 2 => wide(2, true, 0),
        [_, 0, 0, 0, ..] => wide(4, false, 0),
        [_, 0, ..] if body.len() >= 4 || body.len() == 2 => wide(2, false, 0),
        _ => Some(Text::Utf8(body)),
    }
}

fn parse(text: &[u8], fields: &[String]) -> Read {
    let mut found = Found {
        fields,
        asked: vec![None; fields.len()],
        string_bytes: 0,
    };
    let mut json = serde_json::Deserializer::from_slice(text);
    let is_object = match (&mut json).deserialize_any(Top(&mut found)) {
        Ok(is_object) => is_object,
        Err(_) => return Read::Unreadable,
    };
    if json.end().is_err() {
        return Read::Unreadable;
    }
    if !is_object {
        return Read::NotObject;
    }
    Read::Object {
        asked: found.asked,
        string_bytes: found.string_bytes,
    }
}

/// What the visitors gather.
struct Found<'f> {
    fields: &'f [String],
    asked: Vec<Option<u64>>,
    string_bytes: u64,
}

/// The top level: an object whose members are read, or anything else
/// (skipped; `false`).
struct Top<'a, 'f>(&'a mut Found<'f>);

impl<'de> Visitor<'de> for Top<'_, '_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON document")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        let found = self.0;
        while let Some(matches) = map.next_key_seed(Key(found.fields))? {
            let value = map.next_value_seed(Member(&mut found.string_bytes))?;
            if let Some(n) = value {
                for i in matches {
                    found.asked[i] = Some(found.asked[i].map_or(n, |m| m.max(n)));
                }
            }
        }
        Ok(true)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(false)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }
}

/// A top-level key: the indices of the fields it names, exactly or once
/// case is folded.
struct Key<'f>(&'f [String]);

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = SmallVec<[usize; 2]>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key<'_> {
    type Value = SmallVec<[usize; 2]>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Self::Value, E> {
        Ok(self
            .0
            .iter()
            .enumerate()
            .filter(|(_, field)| key == field.as_str() || folds_to(key, field))
            .map(|(i, _)| i)
            .collect())
    }
}

/// Whether `a` and `b` are equal once each character is folded (upper
/// case, then lower case: `ſ`, `S` and `s` all fold to `s`). Folding may
/// equate more than Go's simple folding does, never less; more only
/// reserves more.
fn folds_to(a: &str, b: &str) -> bool {
    if a.is_ascii() && b.is_ascii() {
        return a.eq_ignore_ascii_case(b);
    }
    let fold = |s: &str| {
        s.chars()
            .flat_map(char::to_uppercase)
            .flat_map(char::to_lowercase)
            .collect::<Vec<char>>()
    };
    fold(a) == fold(b)
}

/// A value at any depth: its string bytes are added up, and a number
/// (or a string that lax validators take for one) is returned.
struct Member<'a>(&'a mut u64);

impl<'de> DeserializeSeed<'de> for Member<'_> {
    type Value = Option<u64>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Member<'_> {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Option<u64>, E> {
        Ok(Some(n))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Option<u64>, E> {
        Ok(u64::try_from(n).ok())
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<Option<u64>, E> {
        Ok(whole(n))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Option<u64>, E> {
        *self.0 = self.0.saturating_add(s.len() as u64);
        Ok(lax_integer(s))
    }

    /// pydantic's lax mode takes `true` for 1.
    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Option<u64>, E> {
        Ok(Some(u64::from(b)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<u64>, A::Error> {
        while seq.next_element_seed(Member(&mut *self.0))?.is_some() {}
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<u64>, A::Error> {
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(Member(&mut *self.0))?;
        }
        Ok(None)
    }
}

/// A finite, non-negative, whole number (`-0` is 0), saturated at
/// `u64::MAX`.
fn whole(n: f64) -> Option<u64> {
    // `as` saturates.
    (n.is_finite() && n >= 0.0 && n.fract() == 0.0).then_some(n as u64)
}

/// An integer written as a string, as lax validators read one: spaces
/// around it, a `+`, `_` between digits, or a whole decimal (`"8000.0"`).
fn lax_integer(s: &str) -> Option<u64> {
    let s = s.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    let digits: String = s.chars().filter(|&c| c != '_').collect();
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return Some(digits.parse().unwrap_or(u64::MAX));
    }
    // JavaScript's `Number()` reads "0x186a0", "0o303240" and "0b1..." as
    // integers too.
    for (prefix, radix) in [("0x", 16), ("0o", 8), ("0b", 2)] {
        if let Some(rest) = digits
            .get(..2)
            .filter(|p| p.eq_ignore_ascii_case(prefix))
            .and_then(|_| digits.get(2..))
        {
            return u64::from_str_radix(rest, radix).ok().or_else(|| {
                (!rest.is_empty() && rest.chars().all(|c| c.is_digit(radix))).then_some(u64::MAX)
            });
        }
    }
    // Rust reads "inf" and "NaN" too; `whole` refuses them.
    digits.parse::<f64>().ok().and_then(whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> Vec<String> {
        vec!["max_tokens".into(), "n".into()]
    }

    fn asked(body: &[u8]) -> Option<u64> {
        match read(body, &fields()) {
            Read::Object { asked, .. } => asked[0],
            other => panic!("{other:?} for {:?}", String::from_utf8_lossy(body)),
        }
    }

    #[test]
    fn numbers_as_lax_validators_read_them() {
        for (value, expected) in [
            ("800", Some(800)),
            ("0", Some(0)),
            ("-0", Some(0)),
            ("800.0", Some(800)),
            ("8e2", Some(800)),
            ("8E+2", Some(800)),
            ("18446744073709551616", Some(u64::MAX)),
            // Python and JavaScript round this to 100000 exactly.
            ("100000.0000000000069", Some(100_000)),
            (r#""800""#, Some(800)),
            (r#"" +8_000 ""#, Some(8000)),
            (r#""800.0""#, Some(800)),
            (r#""99999999999999999999999""#, Some(u64::MAX)),
            ("-1", None),
            ("1.5", None),
            (r#""-5""#, None),
            (r#""inf""#, None),
            (r#""NaN""#, None),
            (r#""""#, None),
            (r#""0x186a0""#, Some(100_000)),
            (r#""0X10""#, Some(16)),
            (r#""0b101""#, Some(5)),
            (r#""0x""#, None),
            (r#""0xg""#, None),
            ("true", Some(1)),
            ("false", Some(0)),
            ("null", None),
            ("[800]", None),
            (r#"{"max_tokens":800}"#, None),
        ] {
            let body = format!(r#"{{"max_tokens":{value}}}"#);
            assert_eq!(asked(body.as_bytes()), expected, "{value}");
        }
    }

    #[test]
    fn keys_that_fold_to_a_field_count_and_the_largest_wins() {
        assert_eq!(asked(br#"{"MAX_TOKENS":900}"#), Some(900));
        assert_eq!(asked(br#"{"Max_Tokens":9,"max_tokens":5}"#), Some(9));
        // Go folds U+017F (long s) to `s` and U+212A (Kelvin) to `k`.
        assert_eq!(
            asked("{\"max_to\u{212a}en\u{17f}\":7000}".as_bytes()),
            Some(7000)
        );
        // An escaped key is the same key.
        assert_eq!(asked(br#"{"max_\u0074okens":700}"#), Some(700));
        // Of duplicates the upstream takes one, never more than the most.
        assert_eq!(asked(br#"{"max_tokens":1,"max_tokens":5000}"#), Some(5000));
        assert_eq!(asked(br#"{"max_tokens":5000,"max_tokens":1}"#), Some(5000));
        assert_eq!(asked(br#"{"max_tokens_":700,"max_token":7}"#), None);
    }

    #[test]
    fn strings_at_any_depth_are_counted_and_keys_are_not() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"héllo"}],"n":2}"#;
        let Read::Object {
            asked,
            string_bytes,
        } = read(body.as_bytes(), &fields())
        else {
            panic!()
        };
        assert_eq!(asked, [None, Some(2)]);
        assert_eq!(string_bytes, 1 + 4 + 6);
        // Escapes count as what they stand for.
        let Read::Object { string_bytes, .. } = read(br#"{"p":"\u00e9\n"}"#, &fields()) else {
            panic!()
        };
        assert_eq!(string_bytes, 3);
    }

    #[test]
    fn encodings_python_tells_apart() {
        let json = r#"{"max_tokens":4000,"p":"é"}"#;
        let utf16 = |big: bool| -> Vec<u8> {
            json.encode_utf16()
                .flat_map(|u| {
                    if big {
                        u.to_be_bytes()
                    } else {
                        u.to_le_bytes()
                    }
                })
                .collect()
        };
        let utf32 = |big: bool| -> Vec<u8> {
            json.chars()
                .flat_map(|c| {
                    let c = c as u32;
                    if big {
                        c.to_be_bytes()
                    } else {
                        c.to_le_bytes()
                    }
                })
                .collect()
        };
        let bom = |bom: &[u8], body: Vec<u8>| [bom, &body].concat();
        for body in [
            json.as_bytes().to_vec(),
            bom(b"\xef\xbb\xbf", json.as_bytes().to_vec()),
            utf16(true),
            utf16(false),
            bom(b"\xfe\xff", utf16(true)),
            bom(b"\xff\xfe", utf16(false)),
            utf32(true),
            utf32(false),
            bom(b"\0\0\xfe\xff", utf32(true)),
            bom(b"\xff\xfe\0\0", utf32(false)),
        ] {
            let read = read(&body, &fields());
            let expected = Read::Object {
                asked: vec![Some(4000), None],
                string_bytes: 2,
            };
            assert_eq!(read, expected, "{body:?}");
        }
        // A UTF-16 body cut in the middle of a unit, or a lone surrogate.
        assert_eq!(read(&utf16(true)[1..], &fields()), Read::Unreadable);
        assert_eq!(read(b"\xfe\xff\xd8\x00", &fields()), Read::Unreadable);
    }

    #[test]
    fn what_serde_json_refuses_is_unreadable_and_the_rest_is_not_an_object() {
        for body in [
            &br#"{"max_tokens":800,"t":NaN}"#[..],
            br#"{"max_tokens":800,"p":"\ud800"}"#,
            br#"{"max_tokens":800"#,
            br#"{"max_tokens":800}}"#,
            br#"{"max_tokens":800,}"#,
            br#"{"max_tokens":1e400}"#,
            b"{\"max_tokens\":800,\"p\":\"\xff\"}",
            b"",
        ] {
            assert_eq!(read(body, &fields()), Read::Unreadable, "{body:?}");
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let deep = format!(r#"{{"max_tokens":1,"p":{deep}}}"#);
        assert_eq!(read(deep.as_bytes(), &fields()), Read::Unreadable);
        for body in [
            &b"[800]"[..],
            br#""max_tokens""#,
            b"8000",
            b"null",
            b" true ",
        ] {
            assert_eq!(read(body, &fields()), Read::NotObject, "{body:?}");
        }
    }
}

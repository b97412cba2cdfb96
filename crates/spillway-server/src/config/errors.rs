//! What is wrong with a configuration: each error with its file, line and
//! field, all of a file's errors together, and the suggestion for a name
//! that is almost right.

use std::fmt;
use std::path::PathBuf;

use toml::Spanned;

/// A configuration error: where, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file the error is in: the configuration file when it was read
    /// from one ([`Config::load`](super::Config::load)), or the `[envoy]
    /// descriptors_file`; `None` for a configuration parsed from text.
    pub file: Option<PathBuf>,
    /// The 1-based line, when known.
    pub line: Option<usize>,
    /// The field's path, like `rules[2].limit`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}: ", file.display())?;
        }
        match self.line {
            Some(line) => write!(f, "line {line}: `{}`: {}", self.field, self.message),
            None => write!(f, "`{}`: {}", self.field, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Every error found in a configuration, in the order of the file: at
/// least one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(Vec<ConfigError>);

impl ConfigErrors {
    /// The errors, ordered by file and line; an error without a line comes
    /// after the lined errors of its file.
    ///
    /// # Panics
    /// If `errors` is empty: a configuration that failed has a reason.
    pub fn new(mut errors: Vec<ConfigError>) -> Self {
        assert!(!errors.is_empty(), "a failed configuration has an error");
        errors.sort_by(|a, b| {
            (a.file.is_some(), &a.file, a.line.is_none(), a.line).cmp(&(
                b.file.is_some(),
                &b.file,
                b.line.is_none(),
                b.line,
            ))
        });
        errors.dedup();
        Self(errors)
    }

    /// The first error in the file.
    pub fn first(&self) -> &ConfigError {
        &self.0[0]
    }

    /// Every error.
    pub fn errors(&self) -> &[ConfigError] {
        &self.0
    }

    /// How many errors.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never: there is always at least one error (here for clippy's sake).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Names `file` as the file of every error that names none.
    pub(super) fn in_file(mut self, file: &std::path::Path) -> Self {
        for e in &mut self.0 {
            e.file.get_or_insert_with(|| file.to_path_buf());
        }
        self
    }
}

impl From<ConfigError> for ConfigErrors {
    fn from(e: ConfigError) -> Self {
        Self(vec![e])
    }
}

impl fmt::Display for ConfigErrors {
    /// One error per line; more than one is preceded by the count.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.len() > 1 {
            writeln!(f, "{} errors in the configuration:", self.0.len())?;
        }
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// The errors of a conversion, gathered rather than stopping at the first.
#[derive(Debug, Default)]
pub(super) struct Gathered(pub(super) Vec<ConfigError>);

impl Gathered {
    /// `r`'s value, or `None` with its error kept.
    pub(super) fn take<T>(&mut self, r: Result<T, ConfigError>) -> Option<T> {
        r.map_err(|e| self.0.push(e)).ok()
    }

    /// Whether nothing was wrong.
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Turns byte offsets into line numbers.
pub(super) struct Text<'a>(pub(super) &'a str);

impl Text<'_> {
    /// The 1-based line of byte `offset`.
    pub(super) fn line(&self, offset: usize) -> usize {
        self.0[..offset.min(self.0.len())].matches('\n').count() + 1
    }

    /// An error about the value at `at`.
    pub(super) fn err<T>(
        &self,
        at: &Spanned<T>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            file: None,
            line: Some(self.line(at.span().start)),
            field: field.into(),
            message: message.into(),
        }
    }
}

/// The candidate `word` was most likely meant to be: the nearest by edit
/// distance (a transposition counts once) within a third of its length, one
/// that differs only in case, `-` for `_` or a plural `s`, or one that holds
/// its letters in order with at most three more (`methd`, `methods`).
pub(super) fn nearest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let folded = |s: &str| s.to_ascii_lowercase().replace('-', "_");
    let word_f = folded(word);
    let len = word_f.chars().count();
    let mut best: Option<(usize, &str)> = None;
    for &c in candidates {
        let c_f = folded(c);
        let d = if c_f == word_f
            || c_f.strip_suffix('s') == Some(&word_f)
            || word_f.strip_suffix('s') == Some(&c_f)
        {
            0
        } else {
            strsim::damerau_levenshtein(&word_f, &c_f)
        };
        let near = d <= len.max(3) / 3
            || (len >= 4 && c_f.len() <= word_f.len() + 3 && in_order(&word_f, &c_f));
        if near && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c)
}

/// Whether the characters of `short` appear in `long` in order.
fn in_order(short: &str, long: &str) -> bool {
    let mut rest = long.chars();
    short.chars().all(|c| rest.any(|l| l == c))
}

/// `message` with a "did you mean" for `word` among `candidates`, if one is
/// near.
pub(super) fn suggest(message: String, word: &str, candidates: &[&str]) -> String {
    match nearest(word, candidates) {
        Some(c) if c != word => format!("{message}; did you mean `{c}`?"),
        _ => message,
    }
}

/// `word` is none of `choices`: the message that lists them, with the one
/// probably meant.
pub(super) fn not_one_of(word: &str, choices: &[&str]) -> String {
    suggest(
        format!("`{word}`: expected {}", listed(choices)),
        word,
        choices,
    )
}

/// `a`, `b` or `c`; more than five as "one of" the list.
pub(super) fn listed(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.as_slice() {
        [one] => one.clone(),
        [init @ .., last] if quoted.len() <= 5 => format!("{} or {last}", init.join(", ")),
        all => format!("one of {}", all.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_names_are_suggested_and_far_ones_not() {
        let fields = ["name", "algorithm", "limit", "window", "burst", "match"];
        assert_eq!(nearest("algoritm", &fields), Some("algorithm"));
        assert_eq!(nearest("algorihtm", &fields), Some("algorithm"));
        assert_eq!(nearest("Window", &fields), Some("window"));
        assert_eq!(nearest("limits", &fields), Some("limit"));
        assert_eq!(nearest("bursts", &fields), Some("burst"));
        assert_eq!(nearest("rate", &fields), None);
        assert_eq!(nearest("lmt", &fields), None);
        assert_eq!(
            nearest("methd", &["methods", "path", "host"]),
            Some("methods")
        );
        assert_eq!(nearest("x", &fields), None);
        let algorithms = ["fixed_window", "sliding_window", "token_bucket"];
        assert_eq!(nearest("token-bucket", &algorithms), Some("token_bucket"));
        assert_eq!(
            nearest("sliding-windw", &algorithms),
            Some("sliding_window")
        );
    }

    #[test]
    fn errors_are_in_file_order() {
        let at = |line: Option<usize>, field: &str| ConfigError {
            file: None,
            line,
            field: field.into(),
            message: "m".into(),
        };
        let all = ConfigErrors::new(vec![at(None, "c"), at(Some(9), "b"), at(Some(2), "a")]);
        let fields: Vec<_> = all.errors().iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["a", "b", "c"]);
        assert_eq!(
            all.to_string(),
            "3 errors in the configuration:\nline 2: `a`: m\nline 9: `b`: m\n`c`: m"
        );
    }
}

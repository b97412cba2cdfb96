//! `[envoy]`: the rate limit service's bounds, and envoyproxy/ratelimit's
//! descriptor files.

use std::num::NonZeroUsize;
use std::path::Path;

use serde::Deserialize;
use spillway::Quota;
use spillway::algorithm::FixedWindow;
use spillway_tower::{Action, HttpRule};
use toml::Spanned;

use super::errors::{ConfigError, Text};
use super::{RawConfig, RawRule, descriptors, read_text};

/// `[envoy]`'s bounds on one `ShouldRateLimit` call, refused whole
/// (`INVALID_ARGUMENT`) past them before any work is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyLimits {
    /// The most descriptors in one call (Envoy sends a handful).
    pub max_descriptors: NonZeroUsize,
    /// The most entries in one descriptor.
    pub max_entries: NonZeroUsize,
}

impl EnvoyLimits {
    /// The largest call message read: room for the most descriptors of the
    /// most entries at 256 bytes an entry, and never less than 64 KiB or
    /// more than tonic's default of 4 MiB. The defaults give 256 KiB.
    ///
    /// ```
    /// use spillway_server::config::EnvoyLimits;
    ///
    /// assert_eq!(EnvoyLimits::default().max_message_bytes(), 256 * 1024);
    /// ```
    pub fn max_message_bytes(&self) -> usize {
        self.max_descriptors
            .get()
            .saturating_mul(self.max_entries.get())
            .saturating_mul(256)
            .clamp(64 * 1024, 4 * 1024 * 1024)
    }
}

impl Default for EnvoyLimits {
    fn default() -> Self {
        Self {
            max_descriptors: NonZeroUsize::new(64).expect("nonzero"),
            max_entries: NonZeroUsize::new(16).expect("nonzero"),
        }
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEnvoy {
    domain: Option<Spanned<String>>,
    descriptors_file: Option<Spanned<String>>,
    max_descriptors: Option<Spanned<u64>>,
    max_entries: Option<Spanned<u64>>,
}

/// `[envoy]`: the domain, and the descriptor file's rate limits, which
/// join the rules (by name only).
pub(super) fn convert_envoy(
    raw: &RawConfig,
    dir: &Path,
    lines: &Text<'_>,
    rules: &mut Vec<HttpRule>,
    descriptors: &mut Vec<Vec<String>>,
) -> Result<(Option<String>, Option<descriptors::DescriptorTree>), ConfigError> {
    let envoy_domain = raw.envoy.domain.as_ref().map(|d| d.get_ref().clone());
    Ok(match &raw.envoy.descriptors_file {
        None => (envoy_domain, None),
        Some(path) => {
            let file = descriptor_file(path, dir, raw.envoy.domain.as_ref(), &raw.rules, lines)?;
            for r in &file.rules {
                let quota = Quota::new(r.limit.requests_per_unit, r.limit.unit.duration())
                    .map_err(|e| file_error(&file.path, r, e.to_string()))?;
                let action = if r.shadow {
                    Action::Shadow
                } else {
                    Action::Reject
                };
                // For Envoy's descriptors only, as in envoyproxy/ratelimit:
                // never applied to HTTP requests (the middleware, the proxy,
                // `POST /v1/check` with a request description).
                rules.push(
                    HttpRule::new(r.name.clone(), FixedWindow::new(quota))
                        .action(action)
                        .by_name_only(),
                );
                descriptors.push(Vec::new());
            }
            (Some(file.domain), Some(file.tree))
        }
    })
}

/// `[envoy] max_descriptors` (1 to 10,000) and `max_entries` (1 to 1,000).
pub(super) fn envoy_limits(raw: &RawEnvoy, lines: &Text<'_>) -> Result<EnvoyLimits, ConfigError> {
    let bounded = |v: &Option<Spanned<u64>>, field: &str, max: usize, default: NonZeroUsize| {
        let Some(v) = v else {
            return Ok(default);
        };
        usize::try_from(*v.get_ref())
            .ok()
            .and_then(NonZeroUsize::new)
            .filter(|n| n.get() <= max)
            .ok_or_else(|| lines.err(v, field, format!("must be between 1 and {max}")))
    };
    let default = EnvoyLimits::default();
    Ok(EnvoyLimits {
        max_descriptors: bounded(
            &raw.max_descriptors,
            "envoy.max_descriptors",
            10_000,
            default.max_descriptors,
        )?,
        max_entries: bounded(
            &raw.max_entries,
            "envoy.max_entries",
            1_000,
            default.max_entries,
        )?,
    })
}

/// Reads and converts `[envoy] descriptors_file` (named by `path`, relative
/// to `dir`), whose rules will follow the TOML file's `rules`, and checks it
/// against the TOML file: the same domain as `domain` if set, no rule name
/// twice.
pub(super) fn descriptor_file(
    path: &Spanned<String>,
    dir: &Path,
    domain: Option<&Spanned<String>>,
    rules: &[Spanned<RawRule>],
    lines: &Text<'_>,
) -> Result<descriptors::DescriptorFile, ConfigError> {
    let resolved = descriptors::resolve(path.get_ref(), dir);
    let text = read_text(&resolved).map_err(|(line, message)| match line {
        // Read, but not text: where, in that file.
        Some(line) => ConfigError {
            file: Some(resolved.clone()),
            line: Some(line),
            field: "(file)".into(),
            message,
        },
        None => lines.err(
            path,
            "envoy.descriptors_file",
            format!("`{}`: {message}", resolved.display()),
        ),
    })?;
    let file = descriptors::DescriptorFile::parse(&text, &resolved, rules.len())?;
    if let Some(domain) = domain
        && *domain.get_ref() != file.domain
    {
        return Err(lines.err(
            domain,
            "envoy.domain",
            format!(
                "`{}` is not the domain of `{}` (`{}`{}): set the same, or leave this one out",
                domain.get_ref(),
                resolved.display(),
                file.domain,
                file.domain_line
                    .map(|l| format!(", line {l}"))
                    .unwrap_or_default(),
            ),
        ));
    }
    // Every store rule of the TOML file by name: the rules, and their tiers'
    // quotas (`rule@tier`).
    let mut taken = std::collections::HashMap::new();
    for (i, spanned) in rules.iter().enumerate() {
        let r = spanned.get_ref();
        let name = r.name.get_ref().trim();
        let line = lines.line(r.name.span().start);
        taken.insert(name.to_string(), (format!("rules[{i}]"), line));
        for tier in r.tiers.keys() {
            taken.insert(
                format!("{name}@{}", tier.get_ref()),
                (
                    format!("rules[{i}].tiers.{}", tier.get_ref()),
                    lines.line(tier.span().start),
                ),
            );
        }
    }
    for r in &file.rules {
        if r.name
            .starts_with(crate::config::descriptors::OVERRIDE_PREFIX)
        {
            return Err(file_error(
                &file.path,
                r,
                format!(
                    "`{}`: names starting with `{}` are the Envoy service's, for limit overrides",
                    r.name,
                    crate::config::descriptors::OVERRIDE_PREFIX
                ),
            ));
        }
        if let Some((field, line)) = taken.get(&r.name) {
            return Err(file_error(
                &file.path,
                r,
                format!(
                    "`{}` is also the name of `{field}` (line {line} of the configuration file): rule names must be unique",
                    r.name
                ),
            ));
        }
    }
    Ok(file)
}

/// An error about rule `rule` of the descriptor file `path`.
pub(super) fn file_error(
    path: &Path,
    rule: &descriptors::FileRule,
    message: String,
) -> ConfigError {
    ConfigError {
        file: Some(path.to_path_buf()),
        line: rule.line,
        field: rule.field.clone(),
        message,
    }
}

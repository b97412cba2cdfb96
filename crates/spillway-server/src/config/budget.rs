//! A rule's budget: `cost = "response:..."` and the fields that go with
//! it (`reserve`, `reserve_default`, `max_reserve`, `on_overrun`,
//! `release_on_5xx`, `on_expiry`, `settle_within`).

use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;
use spillway_tower::Cost;
use spillway_tower::budget::{Measure, Overrun, Reserve, ResponseCost};
use spillway_tower::usage::UsageField;
use toml::Spanned;

use super::RawRule;
use super::errors::{ConfigError, Text, not_one_of};
use super::parse_duration;

/// A budget rule's `reserve`: a number, or where to read it.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a reservation: an integer of 0 or more, \"request:json:FIELD\" or \"header:NAME\""
)]
pub(super) enum RawReserve {
    Fixed(u64),
    Read(String),
}

/// The cost of a rule whose `cost` is `text` (a string), if it is read
/// from the response: `response:usage[:FIELD]` or `response:header:NAME`.
/// `None` for any other string (a request header, checked elsewhere).
pub(super) fn response_cost(
    r: &RawRule,
    cost: &Spanned<impl Sized>,
    text: &str,
    settle_within: Duration,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<Option<Cost>, ConfigError> {
    let Some(source) = text.strip_prefix("response:") else {
        return Ok(None);
    };
    let measure = if let Some(name) = source.strip_prefix("header:") {
        Measure::Header(HeaderName::try_from(name).map_err(|_| {
            lines.err(
                cost,
                field("cost"),
                format!("`{name}` is not a header name"),
            )
        })?)
    } else if source == "usage" {
        Measure::Usage(UsageField::Total)
    } else if let Some(name) = source.strip_prefix("usage:") {
        Measure::Usage(UsageField::parse(name).ok_or_else(|| {
            lines.err(
                cost,
                field("cost"),
                not_one_of(
                    name,
                    &["total_tokens", "prompt_tokens", "completion_tokens"],
                ),
            )
        })?)
    } else {
        return Err(lines.err(
            cost,
            field("cost"),
            format!(
                "`{text}`: a cost from the response is \"response:usage\", \
                 \"response:usage:FIELD\" or \"response:header:NAME\""
            ),
        ));
    };
    let mut budget = match &measure {
        Measure::Header(name) => ResponseCost::header(name.clone()),
        Measure::Usage(field) => ResponseCost::usage(*field),
    };
    let default = r.reserve_default.as_ref().map(|d| *d.get_ref());
    let reserve = match r.reserve.as_ref() {
        None => Reserve::Request {
            field: "max_tokens".to_string(),
            default,
        },
        Some(spanned) => match spanned.get_ref() {
            RawReserve::Fixed(n) => {
                if let Some(d) = &r.reserve_default {
                    return Err(lines.err(
                        d,
                        field("reserve_default"),
                        "is the reservation of a request that gives no hint: \
                         with a fixed `reserve`, leave it out",
                    ));
                }
                Reserve::Fixed(*n)
            }
            RawReserve::Read(text) => {
                reserve_read(text, default).map_err(|m| lines.err(spanned, field("reserve"), m))?
            }
        },
    };
    budget = budget.reserve(reserve);
    if let Some(max) = &r.max_reserve {
        budget = budget.max_reserve(*max.get_ref());
    }
    if let Some(o) = &r.on_overrun {
        let overrun = match o.get_ref().as_str() {
            "finish" => Overrun::Finish,
            "cut" => Overrun::Cut,
            other => {
                return Err(lines.err(
                    o,
                    field("on_overrun"),
                    not_one_of(other, &["finish", "cut"]),
                ));
            }
        };
        if overrun == Overrun::Cut && !matches!(measure, Measure::Usage(_)) {
            return Err(lines.err(
                o,
                field("on_overrun"),
                "`cut` stops an event stream as its usage is counted: \
                 it needs `cost = \"response:usage\"`",
            ));
        }
        budget = budget.on_overrun(overrun);
    }
    if let Some(release) = &r.release_on_5xx {
        budget = budget.release_on_5xx(*release.get_ref());
    }
    if let Some(within) = on_expiry(r, settle_within, lines, field)? {
        budget = budget.release_unsettled_after(within);
    }
    if !r.descriptors.is_empty() {
        return Err(lines.err(
            cost,
            field("cost"),
            "a cost from the response is settled when the response ends, \
             which Envoy's rate limit service never sees: a budget rule takes no `descriptors`",
        ));
    }
    Ok(Some(Cost::Response(Box::new(budget))))
}

/// The most a budget rule's `settle_within` may be.
const MOST_SETTLE_WITHIN: Duration = Duration::from_secs(24 * 3600);

/// `on_expiry` and `settle_within`: how long a reservation may go
/// unsettled before the store gives it back, if it does (`"release"`);
/// `None` for `"charge"` (the default: it stays charged).
pub(super) fn on_expiry(
    r: &RawRule,
    default: Duration,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<Option<Duration>, ConfigError> {
    let release = match &r.on_expiry {
        None => false,
        Some(o) => match o.get_ref().as_str() {
            "charge" => false,
            "release" => true,
            other => {
                return Err(lines.err(
                    o,
                    field("on_expiry"),
                    not_one_of(other, &["charge", "release"]),
                ));
            }
        },
    };
    let Some(raw) = &r.settle_within else {
        return Ok(release.then_some(default));
    };
    if !release {
        return Err(lines.err(
            raw,
            field("settle_within"),
            "is how long a reservation stays open before it is given back: \
             it needs `on_expiry = \"release\"`",
        ));
    }
    let within =
        parse_duration(&raw.get_ref().0).map_err(|m| lines.err(raw, field("settle_within"), m))?;
    if within < Duration::from_secs(1) || within > MOST_SETTLE_WITHIN {
        return Err(lines.err(raw, field("settle_within"), "must be between 1s and 24h"));
    }
    Ok(Some(within))
}

/// A `reserve` read from the request.
fn reserve_read(text: &str, default: Option<u64>) -> Result<Reserve, String> {
    if let Some(name) = text.strip_prefix("header:") {
        let name =
            HeaderName::try_from(name).map_err(|_| format!("`{name}` is not a header name"))?;
        return Ok(Reserve::Header { name, default });
    }
    if let Some(field) = text.strip_prefix("request:json:") {
        if field.is_empty() {
            return Err("\"request:json:FIELD\" names a top-level field, like max_tokens".into());
        }
        return Ok(Reserve::Request {
            field: field.to_string(),
            default,
        });
    }
    Err(format!(
        "`{text}`: a reservation is an integer, \"request:json:FIELD\" (like \
         \"request:json:max_tokens\") or \"header:NAME\""
    ))
}

/// The error of a rule whose cost is not read from the response but that
/// sets a field only a budget takes.
pub(super) fn check_not_budget(
    r: &RawRule,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<(), ConfigError> {
    fn only<T>(lines: &Text<'_>, at: &Spanned<T>, field: String) -> Result<(), ConfigError> {
        Err(lines.err(
            at,
            field,
            "only a rule whose cost is read from the response (`cost = \"response:usage\"` \
             or \"response:header:NAME\") takes it",
        ))
    }
    if let Some(at) = &r.reserve {
        return only(lines, at, field("reserve"));
    }
    if let Some(at) = &r.reserve_default {
        return only(lines, at, field("reserve_default"));
    }
    if let Some(at) = &r.max_reserve {
        return only(lines, at, field("max_reserve"));
    }
    if let Some(at) = &r.on_overrun {
        return only(lines, at, field("on_overrun"));
    }
    if let Some(at) = &r.release_on_5xx {
        return only(lines, at, field("release_on_5xx"));
    }
    // On a rule Envoy reaches, they say what becomes of a Kuadrant
    // `Reserve` nobody commits (docs/envoy.md).
    if r.descriptors.is_empty() {
        const EXPIRY: &str = "says what becomes of a reservation nobody settles: only a rule \
             whose cost is read from the response, or one Envoy reaches by `descriptors` \
             (Kuadrant's `Reserve`), takes it";
        if let Some(at) = &r.on_expiry {
            return Err(lines.err(at, field("on_expiry"), EXPIRY));
        }
        if let Some(at) = &r.settle_within {
            return Err(lines.err(at, field("settle_within"), EXPIRY));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, ConfigError};

    const RULE: &str = "[[rules]]\nname = \"tokens\"\nkey = [\"api_key\"]\n\
                        algorithm = \"token_bucket\"\nlimit = 10000\nwindow = \"1m\"\n";

    fn error(text: &str) -> ConfigError {
        Config::parse(text).expect_err("invalid").first().clone()
    }

    fn budget_of(text: &str) -> String {
        let config = Config::parse(text).expect("valid");
        format!("{:?}", config.policy.rules()[0])
    }

    #[test]
    fn a_budget_reads_its_cost_from_the_response() {
        let rule = budget_of(&format!(
            "{RULE}cost = \"response:usage\"\nreserve = \"request:json:max_tokens\"\n\
             reserve_default = 400\nmax_reserve = 2000\non_overrun = \"cut\"\nrelease_on_5xx = true\n"
        ));
        for part in [
            "Usage(Total)",
            "field: \"max_tokens\", default: Some(400)",
            "max_reserve: Some(2000)",
            "on_overrun: Cut",
            "release_on_5xx: true",
        ] {
            assert!(rule.contains(part), "{part} in {rule}");
        }
        let rule = budget_of(&format!(
            "{RULE}cost = \"response:usage:completion_tokens\"\nreserve = 300\n"
        ));
        assert!(
            rule.contains("Usage(Completion)") && rule.contains("Fixed(300)"),
            "{rule}"
        );
        let rule = budget_of(&format!(
            "{RULE}cost = \"response:header:x-usage-tokens\"\nreserve = \"header:x-reserve\"\n"
        ));
        assert!(
            rule.contains("\"x-usage-tokens\"") && rule.contains("\"x-reserve\""),
            "{rule}"
        );
    }

    #[test]
    fn on_expiry_release_has_the_store_give_back_what_is_not_settled_in_time() {
        let release_of = |text: &str| {
            let config = Config::parse(text).expect("valid");
            config.policy.store_rules()[0].release_after()
        };
        let budget = format!("{RULE}cost = \"response:usage\"\n");
        assert_eq!(release_of(&budget), None);
        assert_eq!(
            release_of(&format!("{budget}on_expiry = \"charge\"\n")),
            None
        );
        // By default once a settle token would have expired...
        assert_eq!(
            release_of(&format!("{budget}on_expiry = \"release\"\n")),
            Some(std::time::Duration::from_secs(300))
        );
        assert_eq!(
            release_of(&format!(
                "[server]\nsettle_within = \"2m\"\n{budget}on_expiry = \"release\"\n"
            )),
            Some(std::time::Duration::from_secs(120))
        );
        // An Envoy rule's: for Kuadrant's `Reserve`, beside the policy.
        let envoy = "[[rules]]\nname = \"tokens\"\nalgorithm = \"sliding_log\"\nlimit = 100\n\
                     window = \"1h\"\ndescriptors = [\"user\"]\n";
        let released = |text: &str| {
            let config = Config::parse(text).expect("valid");
            let of = |r: &crate::config::EnvoyRule| r.reserve_released;
            config.envoy_rules.iter().map(of).collect::<Vec<_>>()
        };
        assert_eq!(released(envoy), [None]);
        assert_eq!(
            released(&format!("{envoy}on_expiry = \"release\"\n")),
            [Some(std::time::Duration::from_secs(300))]
        );
        assert_eq!(
            released(&format!(
                "{envoy}on_expiry = \"release\"\nsettle_within = \"45s\"\n"
            )),
            [Some(std::time::Duration::from_secs(45))]
        );
        // ...or as the rule says, for its tiers too.
        let tiered = format!(
            "{budget}on_expiry = \"release\"\nsettle_within = \"90s\"\n\
             [rules.tiers.pro]\nlimit = 50000\nwindow = \"1m\"\n\
             [tiers.pro]\napi_keys = [\"k\"]\n"
        );
        let config = Config::parse(&tiered).expect("valid");
        for rule in config.policy.store_rules() {
            assert_eq!(
                rule.release_after(),
                Some(std::time::Duration::from_secs(90)),
                "{}",
                rule.name()
            );
        }
    }

    #[test]
    fn budget_mistakes_name_the_field_and_line() {
        let cases = [
            (
                "cost = \"response:usage:tokens\"\n",
                "rules[0].cost",
                "total_tokens",
            ),
            (
                "cost = \"response:body\"\n",
                "rules[0].cost",
                "response:usage",
            ),
            (
                "cost = \"response:header:bad name\"\n",
                "rules[0].cost",
                "header name",
            ),
            (
                "cost = \"response:usage\"\nreserve = \"request:max_tokens\"\n",
                "rules[0].reserve",
                "request:json:FIELD",
            ),
            (
                "cost = \"response:usage\"\nreserve = 5\nreserve_default = 3\n",
                "rules[0].reserve_default",
                "fixed",
            ),
            (
                "cost = \"response:header:x-usage\"\non_overrun = \"cut\"\n",
                "rules[0].on_overrun",
                "response:usage",
            ),
            (
                "cost = \"response:usage\"\non_overrun = \"stop\"\n",
                "rules[0].on_overrun",
                "cut",
            ),
            (
                "cost = 2\nmax_reserve = 10\n",
                "rules[0].max_reserve",
                "response",
            ),
            ("reserve = 10\n", "rules[0].reserve", "response"),
            (
                "cost = \"response:usage\"\ndescriptors = [\"tokens\"]\n",
                "rules[0].cost",
                "Envoy",
            ),
            (
                "cost = \"response:usage\"\non_expiry = \"refund\"\n",
                "rules[0].on_expiry",
                "release",
            ),
            (
                "cost = \"response:usage\"\nsettle_within = \"1m\"\n",
                "rules[0].settle_within",
                "on_expiry",
            ),
            (
                "cost = \"response:usage\"\non_expiry = \"release\"\nsettle_within = \"2d\"\n",
                "rules[0].settle_within",
                "24h",
            ),
            (
                "cost = 2\non_expiry = \"release\"\n",
                "rules[0].on_expiry",
                "Kuadrant",
            ),
            (
                "descriptors = [\"user\"]\nsettle_within = \"1m\"\n",
                "rules[0].settle_within",
                "on_expiry",
            ),
            (
                "descriptors = [\"user\"]\non_expiry = \"free\"\n",
                "rules[0].on_expiry",
                "release",
            ),
            (
                "hits_after_response = true\n",
                "rules[0].hits_after_response",
                "descriptors",
            ),
            (
                "cost = \"response:usage\"\nroute_costs = [{ path = \"/a\", cost = 2 }]\n",
                "rules[0].route_costs",
                "route",
            ),
        ];
        for (extra, field, says) in cases {
            let e = error(&format!("{RULE}{extra}"));
            assert_eq!(e.field, field, "{extra}: {e}");
            assert!(e.message.contains(says), "{extra}: {e}");
            assert!(e.line.is_some_and(|l| l >= 7), "{extra}: {e}");
        }
    }
}

//! `[[rules]]`: each rule's match, key, cost, action, quota and tiers.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use http::{HeaderName, Method};
use spillway::Quota;
use spillway::algorithm::calendar::Tz;
use spillway::algorithm::{
    AnyAlgorithm, Calendar, Concurrency, FixedWindow, LeakyBucket, LeakyMode, Period, SlidingLog,
    SlidingWindow, TokenBucket,
};
use spillway_tower::{Action, Cost, HttpRule, KeyPart, RouteCost};
use toml::Spanned;

use super::errors::{ConfigError, Gathered, Text, not_one_of};

/// The algorithms a rule names.
const ALGORITHMS: &[&str] = &[
    "fixed_window",
    "sliding_log",
    "sliding_window",
    "token_bucket",
    "leaky_bucket",
    "concurrency",
];

/// A concurrency rule's lease when `lease` is not set: long enough that a
/// renew every third of it costs little, short enough that the slots of an
/// instance that died come back soon.
const DEFAULT_LEASE: std::time::Duration = std::time::Duration::from_secs(30);

/// The shortest and longest lease: a lease is renewed every third of it, so
/// a shorter one would call the store more often than a request does; a
/// longer one would keep a dead instance's slots for too long.
const LEASES: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_secs(1),
    std::time::Duration::from_secs(3600),
);
use super::{RawCost, RawQuota, RawRule, RawTier, parse_duration};

/// `[[rules]]`: each rule that was read (`rules[k]` is `rules[index[k]]` of
/// the file), the Envoy descriptor keys it answers to, and how long a
/// Kuadrant `Reserve` of it may go uncommitted before it is given back (an
/// Envoy rule's `on_expiry = "release"`); each rule's
/// errors are gathered in `errors`, and a rule with any is left out. With
/// `tiers` `None` (`[tiers]` could not be read), a rule's tiers are not
/// checked against it.
pub(super) fn convert_rules(
    raw: &[Spanned<RawRule>],
    index: &[usize],
    tiers: Option<&BTreeMap<String, RawTier>>,
    settle_within: std::time::Duration,
    lines: &Text<'_>,
    errors: &mut Gathered,
) -> (Vec<HttpRule>, Vec<Vec<String>>, Vec<super::EnvoyRule>) {
    let mut names = std::collections::HashSet::new();
    let mut rules = Vec::new();
    let mut descriptors = Vec::new();
    let mut released = Vec::new();
    for (spanned, &i) in raw.iter().zip(index) {
        let r = spanned.get_ref();
        let before = errors.0.len();
        let field = |f: &str| format!("rules[{i}].{f}");
        let name = r.name.get_ref().trim().to_string();
        errors.take(check_rule_name(&name, r, lines, &field));
        if !names.insert(name.clone()) {
            errors.0.push(lines.err(
                &r.name,
                field("name"),
                format!("`{name}` is used by another rule"),
            ));
        }
        let quota = RawQuota::of(r);
        // A rule whose quota is wrong is still checked for the rest, on a
        // stand-in quota.
        let algorithm = errors
            .take(algorithm_of(&quota, lines, &field))
            .unwrap_or_else(|| FixedWindow::new(Quota::per_minute(NonZeroU32::MIN)).into());
        let leases = matches!(algorithm, AnyAlgorithm::Concurrency(_));
        if leases {
            errors.take(check_concurrency(r, lines, &field));
        }
        let rule = HttpRule::new(name, algorithm);
        let rule = errors.take(denial_of(rule, r, leases, lines, &field));
        let rule = rule.and_then(|rule| errors.take(rule_match(rule, r, lines, &field)));
        let rule = rule.and_then(|rule| {
            errors.take(rule_key_cost_action(
                rule,
                spanned,
                settle_within,
                lines,
                &field,
            ))
        });
        let rule = rule.and_then(|rule| errors.take(rule_tiers(rule, r, tiers, &quota, lines, i)));
        // A budget's `on_expiry` is its own (read with its cost); an Envoy
        // rule's is for the reservations Kuadrant's `Reserve` makes.
        // (A budget rule with descriptors is an error already.)
        let envoy = if rule.is_none() {
            None
        } else {
            errors.take(envoy_rule(r, settle_within, lines, &field))
        };
        if let Some(rule) = rule
            && let Some(envoy) = envoy
            && errors.0.len() == before
        {
            descriptors.push(r.descriptors.clone());
            released.push(envoy);
            rules.push(rule);
        }
    }
    (rules, descriptors, released)
}

/// What a rule says of Envoy's and Kuadrant's calls: nothing without
/// `descriptors`.
fn envoy_rule(
    r: &RawRule,
    settle_within: std::time::Duration,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<super::EnvoyRule, ConfigError> {
    if r.descriptors.is_empty() {
        if let Some(after) = &r.hits_after_response {
            return Err(lines.err(
                after,
                field("hits_after_response"),
                "is about the calls Envoy makes: it needs `descriptors`",
            ));
        }
        return Ok(super::EnvoyRule::default());
    }
    Ok(super::EnvoyRule {
        reserve_released: super::budget::on_expiry(r, settle_within, lines, field)?,
        hits_after_response: r.hits_after_response.as_ref().is_some_and(|h| *h.get_ref()),
    })
}

/// What a concurrency rule may not have: a cost the client or the response
/// chooses (a slot is taken when the request is admitted, at a cost known
/// then, which a client must not be able to set to 0), and Envoy
/// descriptors (Envoy's rate limit service has no call that ends a request,
/// so a slot would be held until its lease ended).
fn check_concurrency(
    r: &RawRule,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<(), ConfigError> {
    if let Some(cost) = &r.cost
        && !matches!(cost.get_ref(), RawCost::Fixed(_))
    {
        return Err(lines.err(
            cost,
            field("cost"),
            "a concurrency rule's cost is the slots a request holds: an integer",
        ));
    }
    if !r.descriptors.is_empty() {
        return Err(lines.err(
            &r.algorithm,
            field("descriptors"),
            "a concurrency rule cannot answer Envoy: Envoy's rate limit service never says \
             when a request ends, so its slot would be held until the lease ran out \
             (see docs/envoy.md)",
        ));
    }
    Ok(())
}

/// A concurrency rule's `retry_after` (the longest wait a denial
/// announces) and `deny_status` (429 or 503); a rate rule has neither: its
/// wait is exact, and a 429 is what a client of a rate limit expects.
fn denial_of(
    mut rule: HttpRule,
    r: &RawRule,
    leases: bool,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<HttpRule, ConfigError> {
    if let Some(hint) = &r.retry_after {
        if !leases {
            return Err(lines.err(
                hint,
                field("retry_after"),
                "applies to concurrency rules only: a rate rule's wait is exact",
            ));
        }
        let d = parse_duration(&hint.get_ref().0)
            .map_err(|m| lines.err(hint, field("retry_after"), m))?;
        if d.is_zero() {
            return Err(lines.err(hint, field("retry_after"), "must be longer than zero"));
        }
        rule = rule.retry_after_hint(d);
    }
    if let Some(status) = &r.deny_status {
        if !leases {
            return Err(lines.err(
                status,
                field("deny_status"),
                "applies to concurrency rules only",
            ));
        }
        rule = rule.deny_status(match status.get_ref() {
            429 => http::StatusCode::TOO_MANY_REQUESTS,
            503 => http::StatusCode::SERVICE_UNAVAILABLE,
            _ => return Err(lines.err(status, field("deny_status"), "must be 429 or 503")),
        });
    }
    Ok(rule)
}

/// A rule's name: not empty, not one the Envoy service makes.
fn check_rule_name(
    name: &str,
    r: &RawRule,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Err(lines.err(&r.name, field("name"), "must not be empty"));
    }
    if name.starts_with(crate::config::descriptors::OVERRIDE_PREFIX) {
        return Err(lines.err(
            &r.name,
            field("name"),
            format!(
                "`{name}`: names starting with `{}` are the Envoy service's, for limit overrides",
                crate::config::descriptors::OVERRIDE_PREFIX
            ),
        ));
    }
    Ok(())
}

/// Methods named in a file (any letter case), each checked.
pub(super) fn methods(
    methods: &[Spanned<String>],
    lines: &Text<'_>,
    field: &str,
) -> Result<Vec<Method>, ConfigError> {
    methods
        .iter()
        .map(|m| {
            Method::from_bytes(m.get_ref().to_ascii_uppercase().as_bytes())
                .map_err(|_| lines.err(m, field, format!("`{}` is not a method", m.get_ref())))
        })
        .collect()
}

/// A rule's `match`: methods, path, host.
fn rule_match(
    mut rule: HttpRule,
    r: &RawRule,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<HttpRule, ConfigError> {
    if let Some(list) = &r.matcher.methods {
        rule = rule.methods(methods(list, lines, &field("match.methods"))?);
    }
    if let Some(path) = &r.matcher.path {
        rule = rule.path(path.clone());
    }
    if let Some(followed) = r.matcher.method_overrides {
        rule = rule.method_overrides(followed);
    }
    if r.matcher.exact_path == Some(true) {
        rule = rule.exact_path();
    }
    if let Some(host) = &r.matcher.host {
        rule = rule.host(host.clone());
    }
    Ok(rule)
}

/// A rule's `key`, `fallback`, `cost` and `action`.
fn rule_key_cost_action(
    mut rule: HttpRule,
    spanned: &Spanned<RawRule>,
    settle_within: std::time::Duration,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<HttpRule, ConfigError> {
    let r = spanned.get_ref();
    let parts = |list: &Vec<Spanned<String>>, f: &str| -> Result<Vec<KeyPart>, ConfigError> {
        list.iter()
            .map(|p| KeyPart::parse(p.get_ref()).map_err(|m| lines.err(p, field(f), m)))
            .collect()
    };
    if let Some(key) = &r.key {
        if key.is_empty() {
            return Err(lines.err(spanned, field("key"), "must list at least one part"));
        }
        rule = rule.key(parts(key, "key")?);
    }
    if let Some(fallback) = &r.fallback {
        rule = rule.fallback(parts(fallback, "fallback")?);
    }
    let budget = match r.cost.as_ref() {
        Some(cost) => match cost.get_ref() {
            RawCost::Header(text) => {
                super::budget::response_cost(r, cost, text, settle_within, lines, field)?
            }
            RawCost::Fixed(_) => None,
        },
        None => None,
    };
    if let Some(budget) = budget {
        if let Some(table) = &r.route_costs {
            return Err(lines.err(
                table,
                field("route_costs"),
                "a rule whose cost is read from the response has no route costs",
            ));
        }
        rule = rule.cost(budget);
    } else if let Some(cost) = &r.cost {
        super::budget::check_not_budget(r, lines, field)?;
        rule = rule.cost(match cost.get_ref() {
            RawCost::Fixed(n) => Cost::Fixed(*n),
            RawCost::Header(h) => {
                let name = h.strip_prefix("header:").ok_or_else(|| {
                    lines.err(
                        cost,
                        field("cost"),
                        "must be an integer, \"header:NAME\", \"response:usage\" or \"response:header:NAME\"",
                    )
                })?;
                Cost::Header {
                    name: HeaderName::try_from(name).map_err(|_| {
                        lines.err(
                            cost,
                            field("cost"),
                            format!("`{name}` is not a header name"),
                        )
                    })?,
                    default: 1,
                }
            }
        });
    } else {
        super::budget::check_not_budget(r, lines, field)?;
    }
    if let Some(table) = &r.route_costs {
        let default = match r.cost.as_ref().map(Spanned::get_ref) {
            None => 1,
            Some(RawCost::Fixed(n)) => *n,
            Some(RawCost::Header(_)) => {
                let cost = r.cost.as_ref().expect("matched");
                return Err(lines.err(
                    cost,
                    field("cost"),
                    "with `route_costs`, `cost` is the cost of a request no route matches: an integer",
                ));
            }
        };
        if table.get_ref().is_empty() {
            return Err(lines.err(table, field("route_costs"), "must list at least one route"));
        }
        let mut routes = Vec::new();
        for (j, row) in table.get_ref().iter().enumerate() {
            let at = |f: &str| field(&format!("route_costs[{j}].{f}"));
            let raw = row.get_ref();
            if !raw.path.get_ref().starts_with('/') {
                return Err(lines.err(&raw.path, at("path"), "must start with `/`"));
            }
            let mut route = RouteCost::new(raw.path.get_ref().clone(), raw.cost);
            if let Some(list) = &raw.methods {
                route = route.methods(methods(list, lines, &at("methods"))?);
            }
            routes.push(route);
        }
        rule = rule.cost(Cost::Routes { routes, default });
    }
    if let Some(a) = &r.action {
        rule = rule.action(match a.get_ref().as_str() {
            "reject" => Action::Reject,
            "shadow" => Action::Shadow,
            "degrade" => Action::Degrade,
            other => {
                return Err(lines.err(
                    a,
                    field("action"),
                    not_one_of(other, &["reject", "shadow", "degrade"]),
                ));
            }
        });
    }
    Ok(rule)
}

/// A rule's `tiers`: each its own quota, over the rule's.
fn rule_tiers(
    mut rule: HttpRule,
    r: &RawRule,
    declared: Option<&BTreeMap<String, RawTier>>,
    quota: &RawQuota,
    lines: &Text<'_>,
    i: usize,
) -> Result<HttpRule, ConfigError> {
    for (tier, over) in &r.tiers {
        if declared.is_some_and(|d| !d.contains_key(tier.get_ref())) {
            return Err(lines.err(
                tier,
                format!("rules[{i}].tiers.{}", tier.get_ref()),
                format!(
                    "unknown tier `{}`: declare it as [tiers.{}]",
                    tier.get_ref(),
                    tier.get_ref()
                ),
            ));
        }
        let merged = over.over(quota);
        let tier_field = |f: &str| format!("rules[{i}].tiers.{}.{f}", tier.get_ref());
        let algorithm = algorithm_of(&merged, lines, &tier_field)?;
        let leases = |a: &AnyAlgorithm| matches!(a, AnyAlgorithm::Concurrency(_));
        if leases(&algorithm) != leases(rule.algorithm())
            && let Some(a) = &over.algorithm
        {
            return Err(lines.err(
                a,
                tier_field("algorithm"),
                "a tier may not turn a concurrency rule into a rate rule, or a rate rule into \
                 a concurrency rule: make it a rule of its own",
            ));
        }
        rule = rule.tier(tier.get_ref().clone(), algorithm);
    }
    Ok(rule)
}

/// The calendar period a window names, if it names one.
fn calendar_period(window: &str) -> Option<Period> {
    [Period::Day, Period::Week, Period::Month]
        .into_iter()
        .find(|p| p.name() == window)
}

/// A fixed window over calendar periods in `q`'s time zone (UTC unless
/// it says another).
fn calendar_of(
    q: &RawQuota,
    name: &str,
    limit: NonZeroU32,
    period: Period,
    window_field: &Spanned<super::RawDuration>,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<AnyAlgorithm, ConfigError> {
    if name != "fixed_window" {
        return Err(lines.err(
            window_field,
            field("window"),
            format!(
                "a calendar window starts afresh at each {}: it is a fixed window's, not {name}'s",
                match period {
                    Period::Day => "day",
                    Period::Week => "week",
                    Period::Month => "month",
                }
            ),
        ));
    }
    for (v, f) in [(&q.burst, "burst"), (&q.delay, "delay")] {
        if let Some(v) = v {
            return Err(lines.err(v, field(f), format!("does not apply to {name}")));
        }
    }
    if let Some(m) = &q.mode {
        return Err(lines.err(m, field("mode"), format!("does not apply to {name}")));
    }
    let zone = match &q.time_zone {
        None => Tz::UTC,
        Some(z) => z.get_ref().parse::<Tz>().map_err(|_| {
            lines.err(
                z,
                field("time_zone"),
                format!(
                    "`{}` is not a time zone of the IANA database (like \"Europe/Paris\", \
                     \"America/New_York\" or \"UTC\")",
                    z.get_ref()
                ),
            )
        })?,
    };
    Ok(FixedWindow::calendar(limit, Calendar::new(period, zone)).into())
}

/// A rule's (or a tier's) algorithm on its quota.
pub(super) fn algorithm_of(
    q: &RawQuota,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<AnyAlgorithm, ConfigError> {
    // Always set: `RawRule` requires them, and a tier's quota falls back to
    // its rule's.
    fn required<T>(v: &Option<Spanned<T>>, field: String) -> Result<&Spanned<T>, ConfigError> {
        v.as_ref().ok_or(ConfigError {
            file: None,
            line: None,
            field,
            message: "is required".into(),
        })
    }
    let algorithm = required(&q.algorithm, field("algorithm"))?;
    let limit_field = required(&q.limit, field("limit"))?;
    let name = algorithm.get_ref().as_str();
    if name == "concurrency" {
        return concurrency_of(q, limit_field, lines, field);
    }
    if let Some(lease) = &q.lease {
        return Err(lines.err(lease, field("lease"), format!("does not apply to {name}")));
    }
    let window_field = q
        .window
        .as_ref()
        .ok_or_else(|| lines.err(algorithm, field("window"), format!("is required by {name}")))?;
    let limit = u32::try_from(*limit_field.get_ref())
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(|| {
            lines.err(
                limit_field,
                field("limit"),
                "must be between 1 and 4294967295",
            )
        })?;
    if let Some(period) = calendar_period(&window_field.get_ref().0) {
        return calendar_of(q, name, limit, period, window_field, lines, field);
    }
    if let Some(zone) = &q.time_zone {
        return Err(lines.err(
            zone,
            field("time_zone"),
            "applies to a calendar window only (`window = \"calendar_day\"`, \
             \"calendar_week\" or \"calendar_month\")",
        ));
    }
    let window = parse_duration(&window_field.get_ref().0)
        .map_err(|m| lines.err(window_field, field("window"), m))?;
    // The quota's period is the file's window.
    let quota = Quota::new(limit, window)
        .map_err(|e| lines.err(window_field, field("window"), e.message()))?;
    let not_for = |v: &Option<Spanned<u64>>, f: &str| match v {
        Some(v) => Err(lines.err(v, field(f), format!("does not apply to {name}"))),
        None => Ok(()),
    };
    Ok(match name {
        "fixed_window" | "sliding_log" | "sliding_window" => {
            not_for(&q.burst, "burst")?;
            not_for(&q.delay, "delay")?;
            if let Some(m) = &q.mode {
                return Err(lines.err(m, field("mode"), format!("does not apply to {name}")));
            }
            match name {
                "fixed_window" => FixedWindow::new(quota).into(),
                "sliding_log" => SlidingLog::new(quota).into(),
                _ => SlidingWindow::new(quota).into(),
            }
        }
        "token_bucket" => {
            not_for(&q.delay, "delay")?;
            if let Some(m) = &q.mode {
                return Err(lines.err(m, field("mode"), "does not apply to token_bucket"));
            }
            TokenBucket::new(quota, count_of(&q.burst, "burst", limit, lines, field)?).into()
        }
        "leaky_bucket" => leaky_bucket_of(q, quota, limit, lines, field)?.into(),
        other => {
            return Err(lines.err(algorithm, field("algorithm"), not_one_of(other, ALGORITHMS)));
        }
    })
}

/// A concurrency rule's quota: `limit` slots, each a `lease` (see
/// [`algorithm_of`]).
fn concurrency_of(
    q: &RawQuota,
    limit_field: &Spanned<u64>,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<AnyAlgorithm, ConfigError> {
    if let Some(window) = &q.window {
        return Err(lines.err(
            window,
            field("window"),
            "does not apply to concurrency: a slot is held for as long as its request runs, \
             and `lease` says how long one not given back is held",
        ));
    }
    for (v, f) in [(&q.burst, "burst"), (&q.delay, "delay")] {
        if let Some(v) = v {
            return Err(lines.err(v, field(f), "does not apply to concurrency"));
        }
    }
    if let Some(m) = &q.mode {
        return Err(lines.err(m, field("mode"), "does not apply to concurrency"));
    }
    let slots = u32::try_from(*limit_field.get_ref())
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(|| {
            lines.err(
                limit_field,
                field("limit"),
                "must be between 1 and 4294967295",
            )
        })?;
    let lease = match &q.lease {
        None => DEFAULT_LEASE,
        Some(lease) => {
            let d = parse_duration(&lease.get_ref().0)
                .map_err(|m| lines.err(lease, field("lease"), m))?;
            if d < LEASES.0 || d > LEASES.1 {
                return Err(lines.err(lease, field("lease"), "must be between 1s and 1h"));
            }
            d
        }
    };
    let quota = Quota::new(slots, lease).expect("a lease of 1s to 1h is a valid period");
    Ok(Concurrency::new(quota).into())
}

/// A leaky bucket's `mode`, `burst` and `delay` (see [`algorithm_of`]).
fn leaky_bucket_of(
    q: &RawQuota,
    quota: Quota,
    limit: NonZeroU32,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<LeakyBucket, ConfigError> {
    let mode = match &q.mode {
        None => LeakyMode::Shape,
        Some(m) => match m.get_ref().as_str() {
            "shape" => LeakyMode::Shape,
            "police" => LeakyMode::Police,
            other => {
                return Err(lines.err(m, field("mode"), not_one_of(other, &["shape", "police"])));
            }
        },
    };
    let capacity = count_of(&q.burst, "burst", limit, lines, field)?;
    let delay = match &q.delay {
        None => 0,
        Some(d) => {
            u32::try_from(*d.get_ref()).map_err(|_| lines.err(d, field("delay"), "is too large"))?
        }
    };
    Ok(LeakyBucket::new(quota, capacity, mode).with_delay(delay))
}

/// A count of 1 or more (`burst`), `default` when absent.
fn count_of(
    v: &Option<Spanned<u64>>,
    name: &str,
    default: NonZeroU32,
    lines: &Text<'_>,
    field: &dyn Fn(&str) -> String,
) -> Result<NonZeroU32, ConfigError> {
    match v {
        None => Ok(default),
        Some(v) => u32::try_from(*v.get_ref())
            .ok()
            .and_then(NonZeroU32::new)
            .ok_or_else(|| lines.err(v, field(name), "must be between 1 and 4294967295")),
    }
}

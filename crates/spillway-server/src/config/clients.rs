//! `[clients]` (who the client is, which proxies are trusted) and
//! `[headers]` (the rate-limit fields sent).

use http::HeaderName;
use serde::Deserialize;
use spillway_tower::{
    BodyFormat, Clients, Credential, ForwardedHeader, HeaderOptions, Ipv6Prefix, ResetFormat,
};
use toml::Spanned;

use super::OneOrMany;
use super::errors::{ConfigError, Text, not_one_of};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHeaders {
    #[serde(default = "yes")]
    legacy: bool,
    #[serde(default = "yes")]
    ietf: bool,
    #[serde(default)]
    openai: bool,
    reset: Option<Spanned<String>>,
    body: Option<Spanned<String>>,
}

impl Default for RawHeaders {
    fn default() -> Self {
        Self {
            legacy: true,
            ietf: true,
            openai: false,
            reset: None,
            body: None,
        }
    }
}

pub(super) fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClients {
    #[serde(default)]
    trusted_proxies: Vec<Spanned<String>>,
    api_key: Option<Spanned<OneOrMany>>,
    api_key_header: Option<Spanned<String>>,
    user_header: Option<Spanned<String>>,
    tier_header: Option<Spanned<String>>,
    forwarded_header: Option<Spanned<String>>,
    ipv6_prefix: Option<Spanned<i64>>,
}

/// `[clients]`.
pub(super) fn convert_clients(raw: &RawClients, lines: &Text<'_>) -> Result<Clients, ConfigError> {
    let header = |v: &Spanned<String>, field: &str| {
        HeaderName::try_from(v.get_ref().as_str())
            .map_err(|_| lines.err(v, field, format!("`{}` is not a header name", v.get_ref())))
    };
    let mut clients = Clients::default();
    for (i, p) in raw.trusted_proxies.iter().enumerate() {
        let s = p.get_ref();
        let net = s
            .parse::<ipnet::IpNet>()
            .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                lines.err(
                    p,
                    format!("clients.trusted_proxies[{i}]"),
                    format!("`{s}` is not an address or CIDR"),
                )
            })?;
        clients.trusted_proxies.push(net);
    }
    match (&raw.api_key, &raw.api_key_header) {
        (Some(_), Some(h)) => {
            return Err(lines.err(
                h,
                "clients.api_key_header",
                "set `clients.api_key` alone: it names every place API keys come from",
            ));
        }
        (Some(places), None) => {
            let names = match places.get_ref() {
                OneOrMany::One(name) => std::slice::from_ref(name),
                OneOrMany::Many(names) => names.as_slice(),
            };
            if names.is_empty() {
                return Err(lines.err(
                    places,
                    "clients.api_key",
                    "name where API keys come from: \"bearer\", \"header:x-api-key\", ...",
                ));
            }
            clients.api_key = names
                .iter()
                .map(|name| Credential::parse(name))
                .collect::<Result<_, _>>()
                .map_err(|m| lines.err(places, "clients.api_key", m))?;
        }
        // The older spelling: this header, or `Authorization: Bearer`.
        (None, Some(h)) => {
            clients.api_key = vec![
                Credential::Header(header(h, "clients.api_key_header")?),
                Credential::bearer(),
            ];
        }
        (None, None) => {}
    }
    clients.user_header = raw
        .user_header
        .as_ref()
        .map(|h| header(h, "clients.user_header"))
        .transpose()?;
    clients.tier_header = raw
        .tier_header
        .as_ref()
        .map(|h| header(h, "clients.tier_header"))
        .transpose()?;
    if let Some(h) = &raw.forwarded_header {
        clients.forwarded_header = match h.get_ref().to_ascii_lowercase().as_str() {
            "x-forwarded-for" => ForwardedHeader::XForwardedFor,
            "forwarded" => ForwardedHeader::Forwarded,
            other => {
                return Err(lines.err(
                    h,
                    "clients.forwarded_header",
                    format!(
                        "{} (the header your proxies write)",
                        not_one_of(other, &["x-forwarded-for", "forwarded"])
                    ),
                ));
            }
        };
    }
    if let Some(p) = &raw.ipv6_prefix {
        clients.ipv6_prefix = u8::try_from(*p.get_ref())
            .ok()
            .and_then(Ipv6Prefix::new)
            .ok_or_else(|| {
                lines.err(
                    p,
                    "clients.ipv6_prefix",
                    format!(
                        "`{}`: must be between 1 and 128 (the bits of an IPv6 client's address its key keeps)",
                        p.get_ref()
                    ),
                )
            })?;
    }
    Ok(clients)
}

/// `[headers]`: which fields, and the 429's body.
pub(super) fn convert_headers(
    raw: &RawHeaders,
    lines: &Text<'_>,
) -> Result<(HeaderOptions, BodyFormat), ConfigError> {
    let mut headers = HeaderOptions {
        legacy: raw.legacy,
        ietf: raw.ietf,
        reset: ResetFormat::Unix,
        openai: raw.openai,
    };
    if let Some(r) = &raw.reset {
        headers.reset = match r.get_ref().as_str() {
            "unix" => ResetFormat::Unix,
            "delta" => ResetFormat::Delta,
            other => {
                return Err(lines.err(r, "headers.reset", not_one_of(other, &["unix", "delta"])));
            }
        };
    }
    let body = match &raw.body {
        None => BodyFormat::Problem,
        Some(b) => match b.get_ref().as_str() {
            "problem" => BodyFormat::Problem,
            "quota-exceeded" => BodyFormat::QuotaExceeded,
            "json" => BodyFormat::Json,
            "text" => BodyFormat::Text,
            "empty" => BodyFormat::Empty,
            other => {
                return Err(lines.err(
                    b,
                    "headers.body",
                    not_one_of(
                        other,
                        &["problem", "quota-exceeded", "json", "text", "empty"],
                    ),
                ));
            }
        },
    };
    Ok((headers, body))
}

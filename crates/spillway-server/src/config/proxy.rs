//! `[proxy]`: how `spillway proxy` reads paths, and its bounds.

use std::num::{NonZeroU32, NonZeroUsize};

use serde::Deserialize;
use toml::Spanned;

use super::errors::{ConfigError, Text, not_one_of};
use super::store::{RawSize, parse_size};

/// What to do with `%2F` and `%5C` in a path: whether an encoded slash is
/// a slash is where upstreams differ most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    /// Forward them as they are (the default): the path `/a%2Fb` has one
    /// segment, for the rules as for most upstreams.
    #[default]
    Keep,
    /// Refuse the request with 400.
    Reject,
    /// Decode them to `/` and `\` before the rules run, and forward the
    /// decoded path (then merged and cleaned like the rest).
    Unescape,
}

impl std::str::FromStr for EscapedSlashes {
    type Err = String;

    /// `keep`, `reject` or `unescape`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" => Ok(Self::Keep),
            "reject" => Ok(Self::Reject),
            "unescape" => Ok(Self::Unescape),
            other => Err(not_one_of(other, &["keep", "reject", "unescape"])),
        }
    }
}

/// How the proxy normalizes a request target before the rules run (and
/// forwards it so). The defaults are on, as they should be in front of an
/// upstream whose router is not known.
///
/// ```
/// use spillway_server::config::{EscapedSlashes, Normalize};
///
/// let normalize = Normalize::default();
/// assert!(normalize.path && normalize.merge_slashes);
/// assert_eq!(normalize.escaped_slashes, EscapedSlashes::Keep);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Normalize {
    /// Decode percent-encoded unreserved characters and remove dot
    /// segments (Envoy's `normalize_path`). Default on.
    pub path: bool,
    /// Merge runs of `/` (Envoy's `merge_slashes`). Default on.
    pub merge_slashes: bool,
    /// What to do with `%2F` and `%5C`. Default: keep them.
    pub escaped_slashes: EscapedSlashes,
    /// Pass on request headers whose names hold `_` (nginx's
    /// `underscores_in_headers`). Default off: they are dropped, as nginx
    /// drops them, because CGI and WSGI upstreams read `X_Api_Key` and
    /// `X-Api-Key` as one header (`HTTP_X_API_KEY`), which the rules do not.
    /// When on, those that fold onto a header the proxy writes or reads
    /// (the forwarding headers, the degrade marker) are dropped all the same.
    pub underscores_in_headers: bool,
}

impl Default for Normalize {
    fn default() -> Self {
        Self {
            path: true,
            merge_slashes: true,
            escaped_slashes: EscapedSlashes::Keep,
            underscores_in_headers: false,
        }
    }
}

/// `[proxy]`'s bounds on what clients may hold at once: HTTP/2 clients
/// carry many requests on one connection, each of which needs an upstream
/// connection of its own (the upstream speaks HTTP/1.1), and a shaping
/// bucket holds its requests for their turn.
///
/// ```
/// use spillway_server::config::ProxyBounds;
///
/// let bounds = ProxyBounds::default();
/// assert!(bounds.http2);
/// assert_eq!(bounds.http2_max_streams.get(), 100);
/// assert_eq!(bounds.pool_max_connections.get(), 1_000);
/// assert_eq!(bounds.max_held.get(), 10_000);
/// assert_eq!(bounds.max_read_body.get(), 1 << 20);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyBounds {
    /// Whether HTTP/2 clients (prior knowledge) are served at all. Default
    /// on.
    pub http2: bool,
    /// The most requests one HTTP/2 connection may have open at once (sent
    /// as `SETTINGS_MAX_CONCURRENT_STREAMS`). Default 100.
    pub http2_max_streams: NonZeroU32,
    /// The most upstream connections HTTP/2 clients' requests hold at once,
    /// idle ones kept for their next requests included, all clients
    /// together. Default 1,000.
    pub pool_max_connections: NonZeroUsize,
    /// The most requests held for their shaping turn (leaky bucket, `mode
    /// = "shape"`) at once, all rules and clients together; one more is
    /// answered 503. Default 10,000.
    pub max_held: NonZeroUsize,
    /// The longest request body read for a budget rule that reserves what
    /// the body asks (`reserve = "request:json:FIELD"`); a longer one
    /// reserves the rule's `max_reserve`. Default 1 MiB.
    pub max_read_body: NonZeroUsize,
    /// The most bytes all the bodies being read for such rules may hold at
    /// once; past it, a body is forwarded unread and reserves the most.
    /// Default 256 MiB.
    pub max_read_bodies: NonZeroUsize,
}

impl Default for ProxyBounds {
    fn default() -> Self {
        Self {
            http2: true,
            http2_max_streams: NonZeroU32::new(100).expect("nonzero"),
            pool_max_connections: NonZeroUsize::new(1_000).expect("nonzero"),
            max_held: NonZeroUsize::new(10_000).expect("nonzero"),
            max_read_body: NonZeroUsize::new(1 << 20).expect("nonzero"),
            max_read_bodies: NonZeroUsize::new(256 << 20).expect("nonzero"),
        }
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProxy {
    http2: Option<bool>,
    http2_max_streams: Option<Spanned<u64>>,
    pool_max_connections: Option<Spanned<u64>>,
    max_held: Option<Spanned<u64>>,
    max_read_body: Option<Spanned<RawSize>>,
    max_read_bodies: Option<Spanned<RawSize>>,
    normalize_path: Option<bool>,
    merge_slashes: Option<bool>,
    escaped_slashes: Option<Spanned<String>>,
    underscores_in_headers: Option<bool>,
}

/// `[proxy]`: how the proxy normalizes a request's target.
pub(super) fn convert_proxy(raw: &RawProxy, lines: &Text<'_>) -> Result<Normalize, ConfigError> {
    let defaults = Normalize::default();
    Ok(Normalize {
        path: raw.normalize_path.unwrap_or(defaults.path),
        merge_slashes: raw.merge_slashes.unwrap_or(defaults.merge_slashes),
        escaped_slashes: match &raw.escaped_slashes {
            Some(v) => v
                .get_ref()
                .parse()
                .map_err(|m| lines.err(v, "proxy.escaped_slashes", m))?,
            None => defaults.escaped_slashes,
        },
        underscores_in_headers: raw
            .underscores_in_headers
            .unwrap_or(defaults.underscores_in_headers),
    })
}

/// `[proxy]`: what the proxy's clients may hold at once.
pub(super) fn convert_proxy_bounds(
    raw: &RawProxy,
    lines: &Text<'_>,
) -> Result<ProxyBounds, ConfigError> {
    let defaults = ProxyBounds::default();
    // A count of 1 to `max`, or an error naming the field.
    let within = |n: &Spanned<u64>, field: &str, max: u64| {
        Some(*n.get_ref())
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| lines.err(n, field, format!("must be between 1 and {max}")))
    };
    let count = |n: &Option<Spanned<u64>>, field: &str, default: NonZeroUsize| match n {
        None => Ok(default),
        Some(n) => {
            let n = within(n, field, 1_000_000)?;
            Ok(NonZeroUsize::new(n as usize).expect("between 1 and 1,000,000"))
        }
    };
    Ok(ProxyBounds {
        http2: raw.http2.unwrap_or(defaults.http2),
        http2_max_streams: match &raw.http2_max_streams {
            None => defaults.http2_max_streams,
            Some(n) => {
                let n = within(n, "proxy.http2_max_streams", 10_000)?;
                NonZeroU32::new(n as u32).expect("between 1 and 10,000")
            }
        },
        pool_max_connections: count(
            &raw.pool_max_connections,
            "proxy.pool_max_connections",
            defaults.pool_max_connections,
        )?,
        max_held: count(&raw.max_held, "proxy.max_held", defaults.max_held)?,
        max_read_body: size(
            &raw.max_read_body,
            "proxy.max_read_body",
            defaults.max_read_body,
            lines,
        )?,
        max_read_bodies: size(
            &raw.max_read_bodies,
            "proxy.max_read_bodies",
            defaults.max_read_bodies,
            lines,
        )?,
    })
}

/// A size of 1 KiB to 1 GiB: a number of bytes or a string with a unit.
fn size(
    raw: &Option<Spanned<RawSize>>,
    field: &str,
    default: NonZeroUsize,
    lines: &Text<'_>,
) -> Result<NonZeroUsize, ConfigError> {
    let Some(v) = raw else {
        return Ok(default);
    };
    let bytes = match v.get_ref() {
        RawSize::Bytes(n) => u64::try_from(*n).ok(),
        RawSize::Fraction(_) => None,
        RawSize::Text(t) => Some(parse_size(t).map_err(|m| lines.err(v, field, m))?),
    };
    bytes
        .filter(|n| (1 << 10..=1 << 30).contains(n))
        .and_then(|n| NonZeroUsize::new(usize::try_from(n).ok()?))
        .ok_or_else(|| {
            lines.err(
                v,
                field,
                "must be a size between 1KiB and 1GiB, like \"4MiB\"",
            )
        })
}

//! `[server]`: the HTTP API's address, secrets and timeouts.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use serde::Deserialize;
use spillway::store::SETTLE_RECEIPT_TTL;
use toml::Spanned;

use super::errors::{ConfigError, Text};
use super::{RawDuration, parse_duration};

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The HTTP API's address.
    pub listen: SocketAddr,
    /// The Envoy rate limit gRPC API's address, if served.
    pub grpc_listen: Option<SocketAddr>,
    /// The admin API's bearer token (the file's, or `SPILLWAY_ADMIN_TOKEN`);
    /// without one the admin API is off. It reads and writes, under the
    /// name `admin` in the log of changes.
    pub admin_token: Option<String>,
    /// The admin API's named tokens (`[[server.admin_tokens]]`), each
    /// read-only or read-write: the log of changes names who made each.
    pub admin_tokens: Vec<AdminToken>,
    /// The bearer tokens `POST /v1/check` accepts (the file's
    /// `check_tokens`, or `SPILLWAY_CHECK_TOKENS`, comma-separated); any
    /// one of them will do, so that a new token can be rolled out before
    /// the old one is removed. Empty: the endpoint is open to anyone who
    /// can reach the address.
    pub check_tokens: Vec<String>,
    /// The longest a client may take to send a whole request head, idle
    /// keep-alive time included, and an HTTP/2 client its connection
    /// preface.
    pub head_timeout: Duration,
    /// The longest a client may take to send a whole request body, from the
    /// end of its head.
    pub body_timeout: Duration,
    /// The longest a response may take to be written: a client that does
    /// not read is closed after it.
    pub write_timeout: Duration,
    /// How long an HTTP/2 connection may stay open with no request on it.
    pub idle_timeout: Duration,
    /// The most client connections open at once; one more is answered 503
    /// and closed at once.
    pub max_connections: NonZeroUsize,
    /// The longest a stopping server waits for its requests in flight
    /// (SIGTERM to exit): past it, the connections still open are closed
    /// and the process exits, so that a stuck client cannot hold it.
    pub drain_timeout: Duration,
    /// The key that signs the settle tokens `POST /v1/check` hands out for
    /// budget rules (the file's `settle_key`, or `SPILLWAY_SETTLE_KEY`):
    /// instances that share it settle each other's tokens. `None`: a key
    /// drawn at start, good for this process only.
    pub settle_key: Option<String>,
    /// How long a settle token is good for (`settle_within`, default 5
    /// minutes, at most 9): a reservation not settled by then stands.
    pub settle_within: Duration,
}

impl ServerConfig {
    /// The default of [`head_timeout`](Self::head_timeout).
    pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
    /// The default of [`body_timeout`](Self::body_timeout).
    pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
    /// The default of [`write_timeout`](Self::write_timeout).
    pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
    /// The default of [`idle_timeout`](Self::idle_timeout).
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// The default of [`max_connections`](Self::max_connections): well
    /// under the 65,536 file descriptors a service is commonly given
    /// (systemd's `LimitNOFILE`), each connection taking one.
    pub const MAX_CONNECTIONS: NonZeroUsize = NonZeroUsize::new(10_000).expect("nonzero");
    /// The default of [`drain_timeout`](Self::drain_timeout): under the
    /// 30 s a supervisor commonly waits before SIGKILL (Kubernetes'
    /// `terminationGracePeriodSeconds`).
    pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(20);
    /// The default of [`settle_within`](Self::settle_within).
    pub const SETTLE_WITHIN: Duration = Duration::from_secs(300);
}

/// A named bearer token of the admin API.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken {
    /// Who it is, in the log of changes.
    pub name: String,
    /// The secret.
    pub token: String,
    /// Whether it may change anything (else it may only read).
    pub write: bool,
}

impl std::fmt::Debug for AdminToken {
    // The secret stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminToken")
            .field("name", &self.name)
            .field("write", &self.write)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdminToken {
    name: Spanned<String>,
    token: Spanned<String>,
    access: Spanned<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    listen: Option<Spanned<String>>,
    grpc_listen: Option<Spanned<String>>,
    admin_token: Option<String>,
    admin_tokens: Option<Vec<RawAdminToken>>,
    check_tokens: Option<Spanned<Vec<String>>>,
    head_timeout: Option<Spanned<RawDuration>>,
    body_timeout: Option<Spanned<RawDuration>>,
    write_timeout: Option<Spanned<RawDuration>>,
    idle_timeout: Option<Spanned<RawDuration>>,
    max_connections: Option<Spanned<u64>>,
    drain_timeout: Option<Spanned<RawDuration>>,
    settle_key: Option<Spanned<String>>,
    settle_within: Option<Spanned<RawDuration>>,
}

/// `[server]`.
pub(super) fn convert_server(
    raw: &RawServer,
    lines: &Text<'_>,
) -> Result<ServerConfig, ConfigError> {
    let addr = |v: &Spanned<String>, field: &str| {
        v.get_ref().parse::<SocketAddr>().map_err(|_| {
            lines.err(
                v,
                field,
                format!("`{}` is not an address like 127.0.0.1:8080", v.get_ref()),
            )
        })
    };
    let admin_token = std::env::var("SPILLWAY_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or(raw.admin_token.clone())
        .filter(|t| !t.is_empty());
    Ok(ServerConfig {
        listen: match &raw.listen {
            Some(v) => addr(v, "server.listen")?,
            None => "127.0.0.1:8080".parse().expect("a valid address"),
        },
        grpc_listen: raw
            .grpc_listen
            .as_ref()
            .map(|v| addr(v, "server.grpc_listen"))
            .transpose()?,
        admin_token: admin_token.clone(),
        admin_tokens: admin_tokens(
            raw.admin_tokens.as_deref().unwrap_or_default(),
            admin_token.as_deref(),
            lines,
        )?,
        check_tokens: check_tokens(raw.check_tokens.as_ref(), lines)?,
        head_timeout: timeout(
            &raw.head_timeout,
            "server.head_timeout",
            ServerConfig::HEAD_TIMEOUT,
            lines,
        )?,
        body_timeout: timeout(
            &raw.body_timeout,
            "server.body_timeout",
            ServerConfig::BODY_TIMEOUT,
            lines,
        )?,
        write_timeout: timeout(
            &raw.write_timeout,
            "server.write_timeout",
            ServerConfig::WRITE_TIMEOUT,
            lines,
        )?,
        idle_timeout: timeout(
            &raw.idle_timeout,
            "server.idle_timeout",
            ServerConfig::IDLE_TIMEOUT,
            lines,
        )?,
        max_connections: match &raw.max_connections {
            None => ServerConfig::MAX_CONNECTIONS,
            Some(n) => usize::try_from(*n.get_ref())
                .ok()
                .and_then(NonZeroUsize::new)
                .filter(|n| n.get() <= 1_000_000)
                .ok_or_else(|| {
                    lines.err(n, "server.max_connections", "must be between 1 and 1000000")
                })?,
        },
        drain_timeout: timeout(
            &raw.drain_timeout,
            "server.drain_timeout",
            ServerConfig::DRAIN_TIMEOUT,
            lines,
        )?,
        settle_key: settle_key(raw.settle_key.as_ref(), lines)?,
        settle_within: settle_within(raw.settle_within.as_ref(), lines)?,
    })
}

/// The `[server] check_tokens`, or `SPILLWAY_CHECK_TOKENS` (comma-separated)
/// when set, which wins as `SPILLWAY_ADMIN_TOKEN` does. An empty token would
/// let an empty `Authorization: Bearer` through: it is an error in the file,
/// and skipped in the variable (`a,,b`).
pub(super) fn check_tokens(
    raw: Option<&Spanned<Vec<String>>>,
    lines: &Text<'_>,
) -> Result<Vec<String>, ConfigError> {
    if let Ok(env) = std::env::var("SPILLWAY_CHECK_TOKENS") {
        let tokens: Vec<String> = env
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect();
        if !tokens.is_empty() {
            return Ok(tokens);
        }
    }
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    for (i, token) in raw.get_ref().iter().enumerate() {
        if token.trim().is_empty() {
            return Err(lines.err(
                raw,
                format!("server.check_tokens[{i}]"),
                "must not be empty",
            ));
        }
        if token.trim() != token || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(lines.err(
                raw,
                format!("server.check_tokens[{i}]"),
                "must be printable ASCII without spaces (a bearer token)",
            ));
        }
    }
    Ok(raw.get_ref().clone())
}

/// The shortest named admin token: a secret a guess does not find.
const SHORTEST_ADMIN_TOKEN: usize = 16;

/// `[[server.admin_tokens]]`: each named once, each secret printable
/// ASCII of 16 bytes or more and used once, each `read_only` or
/// `read_write`.
fn admin_tokens(
    raw: &[RawAdminToken],
    admin_token: Option<&str>,
    lines: &Text<'_>,
) -> Result<Vec<AdminToken>, ConfigError> {
    let mut out: Vec<AdminToken> = Vec::new();
    for (i, t) in raw.iter().enumerate() {
        let field = |f: &str| format!("server.admin_tokens[{i}].{f}");
        let name = t.name.get_ref().trim();
        if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(lines.err(
                &t.name,
                field("name"),
                "must be 1 to 64 printable ASCII characters without spaces",
            ));
        }
        if name == "admin" || out.iter().any(|o| o.name == name) {
            return Err(lines.err(
                &t.name,
                field("name"),
                format!("`{name}` is taken (`admin` is `admin_token`'s)"),
            ));
        }
        let token = t.token.get_ref();
        if token.len() < SHORTEST_ADMIN_TOKEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(lines.err(
                &t.token,
                field("token"),
                format!(
                    "must be printable ASCII without spaces, at least {SHORTEST_ADMIN_TOKEN} \
                     bytes (a bearer token)"
                ),
            ));
        }
        if out.iter().any(|o| o.token == *token) || admin_token == Some(token.as_str()) {
            return Err(lines.err(
                &t.token,
                field("token"),
                "is another token's too (or `admin_token`'s): the log could not tell who \
                 made a change, and a read-only one would read and write",
            ));
        }
        let write = match t.access.get_ref().as_str() {
            "read_write" => true,
            "read_only" => false,
            other => {
                return Err(lines.err(
                    &t.access,
                    field("access"),
                    super::errors::not_one_of(other, &["read_only", "read_write"]),
                ));
            }
        };
        out.push(AdminToken {
            name: name.to_string(),
            token: token.clone(),
            write,
        });
    }
    Ok(out)
}

/// A `[server]` timeout: longer than zero, at most an hour.
pub(super) fn timeout(
    raw: &Option<Spanned<RawDuration>>,
    field: &str,
    default: Duration,
    lines: &Text<'_>,
) -> Result<Duration, ConfigError> {
    let Some(t) = raw else {
        return Ok(default);
    };
    let d = parse_duration(&t.get_ref().0).map_err(|m| lines.err(t, field, m))?;
    if d.is_zero() || d > Duration::from_secs(3600) {
        return Err(lines.err(t, field, "must be longer than zero and at most 1h"));
    }
    Ok(d)
}

/// `[server] settle_key`, or `SPILLWAY_SETTLE_KEY` when set (it wins, as
/// the other secrets' variables do): at least 32 bytes, so that a token's
/// signature cannot be forged by guessing the key.
pub(super) fn settle_key(
    raw: Option<&Spanned<String>>,
    lines: &Text<'_>,
) -> Result<Option<String>, ConfigError> {
    const MIN: usize = 32;
    if let Ok(env) = std::env::var("SPILLWAY_SETTLE_KEY")
        && !env.is_empty()
    {
        if env.len() < MIN {
            return Err(ConfigError {
                file: None,
                line: None,
                field: "SPILLWAY_SETTLE_KEY".into(),
                message: format!("must be at least {MIN} bytes long (got {})", env.len()),
            });
        }
        return Ok(Some(env));
    }
    let Some(raw) = raw else {
        return Ok(None);
    };
    if raw.get_ref().len() < MIN {
        return Err(lines.err(
            raw,
            "server.settle_key",
            format!(
                "must be at least {MIN} bytes long (got {}); `openssl rand -hex 32` makes one",
                raw.get_ref().len()
            ),
        ));
    }
    Ok(Some(raw.get_ref().clone()))
}

/// `[server] settle_within`: a second at least, and a minute less than the
/// time a store remembers a settle ([`SETTLE_RECEIPT_TTL`]): a token must
/// expire before its receipt, with room for a store's own retries of a
/// settle and for clocks that differ a little (a token expires on the wall
/// clock of the instance that issued it, a receipt on the store's).
pub(super) fn settle_within(
    raw: Option<&Spanned<RawDuration>>,
    lines: &Text<'_>,
) -> Result<Duration, ConfigError> {
    let Some(raw) = raw else {
        return Ok(ServerConfig::SETTLE_WITHIN);
    };
    let d =
        parse_duration(&raw.get_ref().0).map_err(|m| lines.err(raw, "server.settle_within", m))?;
    let most = SETTLE_RECEIPT_TTL.saturating_sub(Duration::from_secs(60));
    if d < Duration::from_secs(1) || d > most {
        return Err(lines.err(
            raw,
            "server.settle_within",
            format!(
                "must be between 1s and {}s (a minute less than a store remembers a settle)",
                most.as_secs()
            ),
        ));
    }
    Ok(d)
}

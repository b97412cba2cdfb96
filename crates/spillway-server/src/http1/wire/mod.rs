//! HTTP/1.1 on the wire, for our servers: request and response heads parsed
//! with `httparse`, message framing (RFC 9112 section 6), and a chunked
//! body's framing followed byte by byte.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Request, StatusCode, Uri, Version};

/// The most header lines a request or response head may have.
pub(crate) const MAX_HEADERS: usize = 100;
/// The longest request or response head, in bytes.
pub(crate) const MAX_HEAD: usize = 64 * 1024;
/// The longest chunk-size line (size, extensions) or trailer section.
const MAX_CHUNK_LINE: usize = 4 * 1024;
const MAX_TRAILERS: usize = 16 * 1024;

/// Why a message cannot be relayed; each is answered (to a client) or
/// reported (of an upstream) as such.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    /// Not HTTP/1.x, or a head that does not parse.
    #[error("malformed message head: {0}")]
    Malformed(&'static str),
    /// A head longer than [`MAX_HEAD`] or with more than [`MAX_HEADERS`]
    /// lines.
    #[error("message head too large")]
    TooLarge,
    /// Framing that cannot be trusted: both `Content-Length` and
    /// `Transfer-Encoding`, conflicting lengths, an encoding other than
    /// chunked (RFC 9112 section 6.3).
    #[error("ambiguous or unsupported message framing: {0}")]
    Framing(&'static str),
    /// A chunked body whose framing is broken.
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
}

impl WireError {
    /// The status a client gets for its request failing so.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::TooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// How a message's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunked transfer coding: the body ends with its last chunk and
    /// trailers.
    Chunked,
}

/// Where a head ends: the index after its blank line, if it is all in `buf`.
pub(crate) fn head_end(buf: &[u8]) -> Option<usize> {
    // Lines may end in a bare LF (RFC 9112 section 2.2 lets a recipient
    // accept it); httparse does, so the end is found the same way.
    for lf in memchr::memchr_iter(b'\n', buf) {
        match buf.get(lf + 1) {
            Some(b'\n') => return Some(lf + 2),
            Some(b'\r') if buf.get(lf + 2) == Some(&b'\n') => return Some(lf + 3),
            Some(_) => {}
            None => return None,
        }
    }
    None
}

/// A request head's line and what its headers say of the message, without
/// the headers themselves (see [`parse_request_line`]).
#[derive(Debug)]
pub(crate) struct RequestLine {
    pub(crate) method: Method,
    /// The request target, as sent.
    pub(crate) target: Bytes,
    pub(crate) version: Version,
    pub(crate) framing: Framing,
    pub(crate) keep_alive: bool,
    /// `Expect: 100-continue` was sent.
    pub(crate) expects_continue: bool,
}

/// Parses a complete request head (`head` ends with its blank line) into
/// its parts, the headers sharing `head`'s memory.
pub(crate) fn parse_request(head: &Bytes) -> Result<Parts, WireError> {
    parse_head(head, |line, lines| request_parts(head, line, lines))
}

/// A parsed request head's parts, the headers sharing `head`'s memory.
fn request_parts(
    head: &Bytes,
    line: RequestLine,
    lines: &[httparse::Header<'_>],
) -> Result<Parts, WireError> {
    let uri = Uri::from_maybe_shared(line.target)
        .map_err(|_| WireError::Malformed("bad request target"))?;
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.method = line.method;
    parts.uri = uri;
    parts.version = line.version;
    parts.headers = header_map(head, lines, FORWARDING_ROOM)?;
    Ok(parts)
}

/// A plain request: HTTP/1.1, no body, no `Expect`, no `Upgrade`, not
/// `CONNECT` (see [`parse_plain_request`]).
#[derive(Debug)]
pub(crate) struct Plain {
    /// Its parts, the headers sharing the head's memory.
    pub(crate) parts: Parts,
    /// The client keeps the connection open after it.
    pub(crate) keep_alive: bool,
}

/// Parses a complete request head as [`parse_request`] does if it is
/// [`Plain`]; `None` for any other, and for a head that does not parse or
/// whose framing is refused: another server, which reads it from its first
/// byte, answers those.
pub(crate) fn parse_plain_request(head: &Bytes) -> Option<Plain> {
    let parsed = parse_head(head, |line, lines| {
        let plain = line.version == Version::HTTP_11
            && line.framing == Framing::Empty
            && !line.expects_continue
            && line.method != Method::CONNECT
            // An `Expect` other than 100-continue and an `Upgrade` are
            // what another server reads its own way; so is a length given
            // as a list (`0, 0`), which RFC 9110 lets a recipient take and
            // hyper refuses.
            && !lines.iter().any(|l| {
                l.name.eq_ignore_ascii_case("expect")
                    || l.name.eq_ignore_ascii_case("upgrade")
                    || (l.name.eq_ignore_ascii_case("content-length") && l.value.contains(&b','))
            });
        if !plain {
            return Ok(None);
        }
        let keep_alive = line.keep_alive;
        let parts = request_parts(head, line, lines)?;
        Ok(Some(Plain { parts, keep_alive }))
    });
    parsed.ok().flatten()
}

/// Parses a complete request head as [`parse_request`] does, and checks it
/// the same way, but keeps only its line and what its headers say of the
/// message: for a server that does not need the headers themselves.
pub(crate) fn parse_request_line(head: &Bytes) -> Result<RequestLine, WireError> {
    parse_head(head, |line, _| Ok(line))
}

/// Parses `head` and hands its line and header lines to `then`.
fn parse_head<R>(
    head: &Bytes,
    then: impl FnOnce(RequestLine, &[httparse::Header<'_>]) -> Result<R, WireError>,
) -> Result<R, WireError> {
    // Not zeroed: httparse writes the lines it returns.
    let mut lines =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    match req.parse_with_uninit_headers(head, &mut lines) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(WireError::Malformed("incomplete head")),
        Err(httparse::Error::TooManyHeaders) => return Err(WireError::TooLarge),
        Err(_) => return Err(WireError::Malformed("not an HTTP/1.x request")),
    }
    let (Some(method), Some(target), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(WireError::Malformed("incomplete request line"));
    };
    let method =
        Method::from_bytes(method.as_bytes()).map_err(|_| WireError::Malformed("bad method"))?;
    let version = if minor == 0 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let lines: &[httparse::Header<'_>] = req.headers;
    let framing = request_framing(lines, version)?;
    let keep_alive = keeps_alive(lines, version);
    let expects_continue = version == Version::HTTP_11
        && lines
            .values(&header::EXPECT)
            .next()
            .is_some_and(|v| v.eq_ignore_ascii_case(b"100-continue"));
    let line = RequestLine {
        method,
        target: head.slice_ref(target.as_bytes()),
        version,
        framing,
        keep_alive,
        expects_continue,
    };
    then(line, lines)
}

/// Room in a request's headers for those the proxy adds (`Host` again,
/// `X-Forwarded-For`, `-Proto`, `-Host`, `Forwarded`, `X-Real-IP`, a
/// framing header): a map that grows copies every header it has.
const FORWARDING_ROOM: usize = 8;
/// Room in a response's headers for the rate-limit fields (five at most).
const RATE_LIMIT_ROOM: usize = 6;

/// The headers of a parsed head, their values sharing `head`'s memory,
/// with room for `more`.
fn header_map(
    head: &Bytes,
    lines: &[httparse::Header<'_>],
    more: usize,
) -> Result<HeaderMap, WireError> {
    let mut headers = HeaderMap::with_capacity(lines.len() + more);
    for line in lines {
        let name = HeaderName::from_bytes(line.name.as_bytes())
            .map_err(|_| WireError::Malformed("bad header name"))?;
        let value = HeaderValue::from_maybe_shared(head.slice_ref(line.value))
            .map_err(|_| WireError::Malformed("bad header value"))?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// How an upstream's response body ends (RFC 9112 section 6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyEnd {
    /// No body: the answer to a `HEAD`, a 1xx, 204 or 304, or a length of 0.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// The body ends when the upstream closes the connection.
    Close,
}

/// A parsed response head: its parts (the headers sharing the head's
/// memory), how its body ends, and whether the connection stays open
/// after it.
#[derive(Debug)]
pub(crate) struct ResponseHead {
    pub(crate) parts: http::response::Parts,
    pub(crate) body: BodyEnd,
    pub(crate) keep_alive: bool,
}

/// Parses a complete response head (`head` ends with its blank line), the
/// answer to a `HEAD` request if `to_head`. Framing a recipient could read
/// two ways is refused rather than guessed (RFC 9112 section 6.3): both
/// `Content-Length` and `Transfer-Encoding`, a coding other than a lone
/// `chunked` (the proxy forwards bodies decoded and framed again, and
/// decodes no other coding), conflicting or invalid lengths.
pub(crate) fn parse_response(head: &Bytes, to_head: bool) -> Result<ResponseHead, WireError> {
    parse_response_as(head, to_head, false)
}

/// Parses and checks a response head as [`parse_response`] does, but
/// keeps its header lines as they came, in a [`RawHead`] extension of the
/// parts, whose headers are left empty: for a server that writes them as
/// they came.
pub(crate) fn parse_response_raw(head: &Bytes, to_head: bool) -> Result<ResponseHead, WireError> {
    parse_response_as(head, to_head, true)
}

fn parse_response_as(head: &Bytes, to_head: bool, raw: bool) -> Result<ResponseHead, WireError> {
    // Not zeroed: httparse writes the lines it returns.
    let mut lines =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut res = httparse::Response::new(&mut []);
    let parsing = httparse::ParserConfig::default();
    match parsing.parse_response_with_uninit_headers(&mut res, head, &mut lines) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(WireError::Malformed("incomplete head")),
        Err(httparse::Error::TooManyHeaders) => return Err(WireError::TooLarge),
        Err(_) => return Err(WireError::Malformed("not an HTTP/1.x response")),
    }
    let (Some(minor), Some(code)) = (res.version, res.code) else {
        return Err(WireError::Malformed("incomplete status line"));
    };
    let status = StatusCode::from_u16(code).map_err(|_| WireError::Malformed("bad status code"))?;
    let version = if minor == 0 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let lines: &[httparse::Header<'_>] = res.headers;
    let body = if to_head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        BodyEnd::Empty
    } else if chunked(lines, version, "Transfer-Encoding in an HTTP/1.0 response")? {
        BodyEnd::Chunked
    } else {
        match content_length(lines)? {
            Some(0) => BodyEnd::Empty,
            Some(n) => BodyEnd::Length(n),
            None => BodyEnd::Close,
        }
    };
    let keep_alive = body != BodyEnd::Close && keeps_alive(lines, version);
    let (mut parts, ()) = http::Response::new(()).into_parts();
    parts.status = status;
    parts.version = version;
    if raw {
        parts.extensions.insert(RawHead::of(head, lines));
    } else {
        parts.headers = header_map(head, lines, RATE_LIMIT_ROOM)?;
    }
    Ok(ResponseHead {
        parts,
        body,
        keep_alive,
    })
}

/// A response head's header lines as they came (see
/// [`parse_response_raw`]): each line's name and value, as offsets into
/// the head.
#[derive(Debug, Clone)]
pub(crate) struct RawHead {
    head: Bytes,
    lines: smallvec::SmallVec<[RawLine; 12]>,
    /// The body's length, once the `Content-Length` lines have been taken
    /// out of the lines (the server writes its own).
    pub(crate) length: Option<u64>,
}

/// Where a line's name and value are in the head.
#[derive(Debug, Clone, Copy)]
struct RawLine {
    name: (u32, u32),
    value: (u32, u32),
}

impl RawHead {
    fn of(head: &Bytes, lines: &[httparse::Header<'_>]) -> Self {
        // httparse's slices are within `head`, whose length fits a u32.
        let at = |part: &[u8]| {
            let start = part.as_ptr() as usize - head.as_ptr() as usize;
            (start as u32, (start + part.len()) as u32)
        };
        Self {
            head: head.clone(),
            lines: lines
                .iter()
                .map(|line| RawLine {
                    name: at(line.name.as_bytes()),
                    value: at(line.value),
                })
                .collect(),
            length: None,
        }
    }

    /// Each line's name and value, in order.
    pub(crate) fn lines(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let part = |(start, end): (u32, u32)| &self.head[start as usize..end as usize];
        self.lines
            .iter()
            .map(move |line| (part(line.name), part(line.value)))
    }

    /// Keeps only the lines whose name and value `keep` accepts.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&[u8], &[u8]) -> bool) {
        let head = &self.head;
        let part = |(start, end): (u32, u32)| &head[start as usize..end as usize];
        self.lines
            .retain(|line| keep(part(line.name), part(line.value)));
    }
}

/// Header lines looked up by name: a [`HeaderMap`], or a head's lines as
/// httparse left them.
pub(crate) trait Lines {
    /// The values of the `name` lines, in order.
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl Iterator<Item = &'a [u8]> + 'a;
}

impl Lines for HeaderMap {
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.get_all(name).into_iter().map(HeaderValue::as_bytes)
    }
}

impl Lines for [httparse::Header<'_>] {
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.iter()
            .filter(|line| line.name.eq_ignore_ascii_case(name.as_str()))
            .map(|line| line.value)
    }
}

/// Whether the sender of a message with these headers keeps the
/// connection open after it (RFC 9112 section 9.3).
pub(crate) fn keeps_alive(headers: &(impl Lines + ?Sized), version: Version) -> bool {
    let has = |token: &[u8]| {
        headers.values(&header::CONNECTION).any(|v| {
            v.split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
        })
    };
    if version == Version::HTTP_11 {
        !has(b"close")
    } else {
        has(b"keep-alive") && !has(b"close")
    }
}

/// A request's body framing (RFC 9112 section 6.3): chunked, a length, or
/// none. Anything a proxy could read differently from its upstream (both
/// headers, conflicting lengths, another coding) is refused.
fn request_framing(
    headers: &(impl Lines + ?Sized),
    version: Version,
) -> Result<Framing, WireError> {
    if chunked(headers, version, "Transfer-Encoding in an HTTP/1.0 request")? {
        return Ok(Framing::Chunked);
    }
    match content_length(headers)? {
        None | Some(0) => Ok(Framing::Empty),
        Some(n) => Ok(Framing::Length(n)),
    }
}

/// Whether a message's body is chunked (RFC 9112 section 6.3): it is when
/// it has `Transfer-Encoding`, which must then say exactly `chunked`, in
/// HTTP/1.1, with no `Content-Length` beside it; anything else with the
/// header is refused, as a proxy and its peer could read it two ways.
/// `in_http10` is the refusal of a coding in an HTTP/1.0 message.
fn chunked(
    lines: &(impl Lines + ?Sized),
    version: Version,
    in_http10: &'static str,
) -> Result<bool, WireError> {
    if lines.values(&header::TRANSFER_ENCODING).next().is_none() {
        return Ok(false);
    }
    if version == Version::HTTP_10 {
        return Err(WireError::Framing(in_http10));
    }
    if lines.values(&header::CONTENT_LENGTH).next().is_some() {
        return Err(WireError::Framing(
            "both Content-Length and Transfer-Encoding",
        ));
    }
    if !only_chunked(lines) {
        return Err(WireError::Framing("a transfer coding other than chunked"));
    }
    Ok(true)
}

/// `Transfer-Encoding` says exactly `chunked` (the relay passes chunked
/// bodies through and decodes no other coding).
fn only_chunked(headers: &(impl Lines + ?Sized)) -> bool {
    let mut codings = headers
        .values(&header::TRANSFER_ENCODING)
        .flat_map(|v| v.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty());
    codings
        .next()
        .is_some_and(|t| t.eq_ignore_ascii_case(b"chunked"))
        && codings.next().is_none()
}

/// `Content-Length`, if present: every line and list member the same
/// decimal number.
fn content_length(headers: &(impl Lines + ?Sized)) -> Result<Option<u64>, WireError> {
    let mut length = None;
    for value in headers.values(&header::CONTENT_LENGTH) {
        for member in value.split(|&b| b == b',') {
            let digits = member.trim_ascii();
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) || digits.len() > 19 {
                return Err(WireError::Framing("an invalid Content-Length"));
            }
            let n = digits
                .iter()
                .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
            if length.is_some_and(|l| l != n) {
                return Err(WireError::Framing("conflicting Content-Length values"));
            }
            length = Some(n);
        }
    }
    Ok(length)
}

/// Appends `name: value\r\n`.
pub(crate) fn put_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends a decimal number.
pub(crate) fn put_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// Appends a status line, `HTTP/1.1 429 Too Many Requests\r\n`.
pub(crate) fn put_status_line(out: &mut Vec<u8>, status: StatusCode) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("Unknown").as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Where a chunked body's framing is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// In a chunk-size line: the size so far, and whether an extension
    /// started.
    Size {
        size: u64,
        digits: u8,
        ext: bool,
    },
    /// After the size line's CR.
    SizeLf {
        size: u64,
    },
    /// In a chunk's data: bytes left.
    Data(u64),
    /// After a chunk's data: its CR, then its LF.
    DataCr,
    DataLf,
    /// In the trailer section: at the start of a line (or inside one).
    Trailer {
        line_start: bool,
    },
    /// After a trailer line's CR.
    TrailerLf {
        line_start: bool,
    },
    /// The body is over.
    Done,
}

/// Follows a chunked body's framing (RFC 9112 section 7.1) as its bytes go
/// by, so that the relay knows where it ends and can pass it through as it
/// came, or take out the data alone.
#[derive(Debug, Clone)]
pub(crate) struct Chunked {
    state: ChunkState,
    // Bytes of the current size line or of the trailers, against the limits.
    line: usize,
}

impl Default for Chunked {
    fn default() -> Self {
        Self {
            state: ChunkState::Size {
                size: 0,
                digits: 0,
                ext: false,
            },
            line: 0,
        }
    }
}

impl Chunked {
    /// Whether the last chunk and the trailers have gone by.
    pub(crate) fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Reads `input` up to the end of the body: returns how many bytes
    /// belong to the body, calling `data` with the chunk data among them.
    pub(crate) fn feed(
        &mut self,
        input: &[u8],
        mut data: impl FnMut(&[u8]),
    ) -> Result<usize, WireError> {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            self.state = match self.state {
                ChunkState::Size { size, digits, ext } => self.size_line(size, digits, ext, b)?,
                ChunkState::SizeLf { size } => match b {
                    b'\n' => self.after_size(size),
                    _ => return Err(WireError::Chunked("expected LF after chunk size")),
                },
                ChunkState::Data(left) => {
                    let take = (input.len() - i).min(usize::try_from(left).unwrap_or(usize::MAX));
                    data(&input[i..i + take]);
                    i += take;
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        ChunkState::DataCr
                    } else {
                        ChunkState::Data(left)
                    };
                    continue;
                }
                ChunkState::DataCr => match b {
                    b'\r' => ChunkState::DataLf,
                    b'\n' => self.next_size(),
                    _ => return Err(WireError::Chunked("expected CRLF after chunk data")),
                },
                ChunkState::DataLf => match b {
                    b'\n' => self.next_size(),
                    _ => return Err(WireError::Chunked("expected LF after chunk data")),
                },
                ChunkState::Trailer { line_start } => self.trailer(line_start, b)?,
                ChunkState::TrailerLf { line_start } => match b {
                    b'\n' if line_start => ChunkState::Done,
                    b'\n' => ChunkState::Trailer { line_start: true },
                    _ => return Err(WireError::Chunked("expected LF in trailers")),
                },
                ChunkState::Done => return Ok(i),
            };
            i += 1;
            if self.state == ChunkState::Done {
                return Ok(i);
            }
        }
        Ok(i)
    }

    /// The state after byte `b` of a chunk-size line, from
    /// [`ChunkState::Size`] `{ size, digits, ext }`: `b` is a hex digit,
    /// starts an extension (skipped to the end of the line), or ends the line.
    fn size_line(
        &mut self,
        size: u64,
        digits: u8,
        ext: bool,
        b: u8,
    ) -> Result<ChunkState, WireError> {
        self.line += 1;
        if self.line > MAX_CHUNK_LINE {
            return Err(WireError::Chunked("chunk-size line too long"));
        }
        Ok(match b {
            b'\r' if digits > 0 => ChunkState::SizeLf { size },
            b'\n' if digits > 0 => self.after_size(size),
            _ if ext => ChunkState::Size { size, digits, ext },
            b';' | b' ' | b'\t' if digits > 0 => ChunkState::Size {
                size,
                digits,
                ext: true,
            },
            _ => {
                let Some(d) = (b as char).to_digit(16) else {
                    return Err(WireError::Chunked("bad chunk size"));
                };
                if digits >= 15 {
                    return Err(WireError::Chunked("chunk size too large"));
                }
                ChunkState::Size {
                    size: size * 16 + u64::from(d),
                    digits: digits + 1,
                    ext,
                }
            }
        })
    }

    /// The state after byte `b` of the trailer section, from
    /// [`ChunkState::Trailer`] `{ line_start }`: an empty line ends the body.
    fn trailer(&mut self, line_start: bool, b: u8) -> Result<ChunkState, WireError> {
        self.line += 1;
        if self.line > MAX_TRAILERS {
            return Err(WireError::Chunked("trailers too long"));
        }
        Ok(match b {
            b'\r' => ChunkState::TrailerLf { line_start },
            b'\n' if line_start => ChunkState::Done,
            b'\n' => ChunkState::Trailer { line_start: true },
            _ => ChunkState::Trailer { line_start: false },
        })
    }

    fn after_size(&mut self, size: u64) -> ChunkState {
        self.line = 0;
        if size == 0 {
            ChunkState::Trailer { line_start: true }
        } else {
            ChunkState::Data(size)
        }
    }

    fn next_size(&mut self) -> ChunkState {
        self.line = 0;
        ChunkState::Size {
            size: 0,
            digits: 0,
            ext: false,
        }
    }
}

#[cfg(test)]
mod tests;

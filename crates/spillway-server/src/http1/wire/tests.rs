//! The wire code's tests: heads, framing, chunked bodies, and properties
//! over any bytes.

use super::*;

fn request(text: &str) -> Result<RequestLine, WireError> {
    parse_request_line(&Bytes::copy_from_slice(text.as_bytes()))
}

fn parts(text: &str) -> Parts {
    parse_request(&Bytes::copy_from_slice(text.as_bytes())).unwrap()
}

#[test]
fn a_head_ends_at_its_blank_line() {
    assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: a\r\n\r\nrest"), Some(27));
    assert_eq!(head_end(b"GET / HTTP/1.1\nHost: a\n\nrest"), Some(24));
    assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: a\r\n"), None);
    assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: a\r\n\r"), None);
}

#[test]
fn a_request_head_becomes_parts_with_its_framing() {
    let text = "POST /a?b HTTP/1.1\r\nHost: x\r\nX-Tag: 1\r\nx-tag: 2\r\nContent-Length: 5\r\n\r\n";
    let parts = parts(text);
    assert_eq!(parts.method, Method::POST);
    assert_eq!(parts.uri, "/a?b");
    assert_eq!(parts.version, Version::HTTP_11);
    let tags: Vec<_> = parts.headers.get_all("x-tag").iter().collect();
    assert_eq!(tags, ["1", "2"]);
    let head = request(text).unwrap();
    assert_eq!(head.framing, Framing::Length(5));
    assert!(head.keep_alive);
    assert!(!head.expects_continue);
}

/// Only a request with nothing another server could read its own way is
/// plain: HTTP/1.1, no body however framed, no `Expect`, no `Upgrade`, not
/// `CONNECT`, and a head that parses; it becomes the same parts as
/// [`parse_request`] makes.
#[test]
fn a_plain_request_has_no_body_nothing_unusual_and_parses() {
    let plain = |text: &str| parse_plain_request(&Bytes::copy_from_slice(text.as_bytes()));
    for text in [
        "GET /a?b HTTP/1.1\r\nHost: x\r\nX-Tag: 1\r\nx-tag: 2\r\n\r\n",
        "DELETE /a HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        "HEAD / HTTP/1.1\r\nhost: x\r\nConnection: close\r\n\r\n",
        "OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
    ] {
        let found = plain(text).unwrap_or_else(|| panic!("plain: {text:?}"));
        let expected = parts(text);
        assert_eq!(found.parts.method, expected.method);
        assert_eq!(found.parts.uri, expected.uri);
        assert_eq!(found.parts.version, expected.version);
        assert_eq!(found.parts.headers, expected.headers);
        assert_eq!(
            found.keep_alive,
            request(text).unwrap().keep_alive,
            "{text:?}"
        );
    }
    for text in [
        "GET / HTTP/1.0\r\nHost: x\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 1\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: +0\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 0, 0\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 0,0\r\nContent-Length: 00\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: x\r\nEXPECT: something-else\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        "CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
        "GET /a b HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
        "GET / HTTP/2.0\r\nHost: x\r\n\r\n",
    ] {
        assert!(plain(text).is_none(), "not plain: {text:?}");
    }
}

#[test]
fn keep_alive_follows_the_version_and_connection() {
    let alive = |text: &str| request(text).unwrap().keep_alive;
    assert!(!alive("GET / HTTP/1.1\r\nConnection: Close\r\n\r\n"));
    assert!(!alive("GET / HTTP/1.0\r\n\r\n"));
    assert!(alive("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
    assert!(alive(
        "GET / HTTP/1.1\r\nConnection: x-a, keep-alive\r\n\r\n"
    ));
}

#[test]
fn framing_a_proxy_could_read_differently_is_refused() {
    let framing = |text: &str| request(text).map(|h| h.framing);
    assert_eq!(
        framing("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
        Ok(Framing::Chunked)
    );
    assert_eq!(
        framing("POST / HTTP/1.1\r\nContent-Length: 3, 3\r\n\r\n"),
        Ok(Framing::Length(3))
    );
    assert_eq!(
        framing("POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"),
        Ok(Framing::Empty)
    );
    for bad in [
        "POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
        "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
    ] {
        assert!(matches!(framing(bad), Err(WireError::Framing(_))), "{bad}");
    }
}

#[test]
fn a_response_body_ends_as_its_status_and_framing_say() {
    let end = |text: &str, to_head: bool| {
        parse_response(&Bytes::copy_from_slice(text.as_bytes()), to_head)
            .map(|r| (r.body, r.keep_alive))
    };
    let ok = "HTTP/1.1 200 OK\r\n";
    assert_eq!(
        end(&format!("{ok}Content-Length: 5\r\n\r\n"), false),
        Ok((BodyEnd::Length(5), true))
    );
    assert_eq!(
        end(&format!("{ok}Content-Length: 5\r\n\r\n"), true),
        Ok((BodyEnd::Empty, true)),
        "the answer to a HEAD"
    );
    assert_eq!(
        end(&format!("{ok}Transfer-Encoding: Chunked \r\n\r\n"), false),
        Ok((BodyEnd::Chunked, true))
    );
    assert_eq!(
        end(&format!("{ok}\r\n"), false),
        Ok((BodyEnd::Close, false))
    );
    assert_eq!(
        end(
            "HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
            false
        ),
        Ok((BodyEnd::Empty, true))
    );
    assert_eq!(
        end(
            "HTTP/1.1 204 No Content\r\nTransfer-Encoding: gzip\r\n\r\n",
            false
        ),
        Ok((BodyEnd::Empty, true))
    );
    assert_eq!(
        end("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", false),
        Ok((BodyEnd::Length(1), false))
    );
    assert_eq!(
        end(
            "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n",
            false
        ),
        Ok((BodyEnd::Length(1), true))
    );
    assert_eq!(
        end(
            &format!("{ok}Connection: close\r\nContent-Length: 0\r\n\r\n"),
            false
        ),
        Ok((BodyEnd::Empty, false))
    );
    for bad in [
        "Content-Length: 3\r\nTransfer-Encoding: chunked",
        "Transfer-Encoding: gzip, chunked",
        "Transfer-Encoding: chunked, chunked",
        "Transfer-Encoding: identity",
        "Content-Length: 3\r\nContent-Length: 4",
        "Content-Length: 3, 4",
        "Content-Length: -3",
        "Content-Length: ",
    ] {
        let framed = end(&format!("{ok}{bad}\r\n\r\n"), false);
        assert!(
            matches!(framed, Err(WireError::Framing(_))),
            "{bad}: {framed:?}"
        );
    }
    assert!(matches!(
        end(
            "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            false
        ),
        Err(WireError::Framing(_))
    ));
    assert!(matches!(
        end("HTTP/2 200\r\n\r\n", false),
        Err(WireError::Malformed(_))
    ));
    assert!(matches!(
        end("HTTP/1.1 20 OK\r\n\r\n", false),
        Err(WireError::Malformed(_))
    ));
}

#[test]
fn a_malformed_or_oversized_head_is_an_error() {
    assert!(matches!(
        request("HELLO\r\n\r\n"),
        Err(WireError::Malformed(_))
    ));
    assert!(matches!(
        request("GET / HTTP/2.0\r\n\r\n"),
        Err(WireError::Malformed(_))
    ));
    let many = format!(
        "GET / HTTP/1.1\r\n{}\r\n",
        "a: b\r\n".repeat(MAX_HEADERS + 1)
    );
    assert_eq!(request(&many).unwrap_err(), WireError::TooLarge);
    assert_eq!(
        WireError::TooLarge.status(),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
}

fn dechunk(parts: &[&[u8]]) -> Result<(Vec<u8>, usize, bool), WireError> {
    let mut chunked = Chunked::default();
    let mut data = Vec::new();
    let mut used = 0;
    for part in parts {
        used += chunked.feed(part, |d| data.extend_from_slice(d))?;
        if chunked.is_done() {
            break;
        }
    }
    Ok((data, used, chunked.is_done()))
}

#[test]
fn a_chunked_body_is_followed_to_its_end_across_reads() {
    let body = b"5;ext=1\r\nhello\r\nA\r\n0123456789\r\n0\r\nX-Sum: 1\r\n\r\nNEXT";
    let whole = dechunk(&[body]).unwrap();
    assert_eq!(whole, (b"hello0123456789".to_vec(), body.len() - 4, true));
    // Byte by byte, the same.
    let bytes: Vec<&[u8]> = body.chunks(1).collect();
    assert_eq!(dechunk(&bytes).unwrap(), whole);
    let unfinished = dechunk(&[b"5\r\nhel"]).unwrap();
    assert_eq!(unfinished, (b"hel".to_vec(), 6, false));
}

#[test]
fn broken_chunked_framing_is_an_error() {
    for bad in [
        &b"x\r\n"[..],
        b"5\r\nhelloX",
        b"\r\n",
        b"1234567890abcdef0\r\n",
    ] {
        assert!(
            dechunk(&[bad]).is_err(),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
    let long_line = vec![b'a'; MAX_CHUNK_LINE + 1];
    assert!(dechunk(&[&long_line]).is_err());
}

#[test]
fn numbers_and_status_lines_are_written_as_text() {
    let mut out = Vec::new();
    put_u64(&mut out, 0);
    out.push(b' ');
    put_u64(&mut out, u64::MAX);
    assert_eq!(out, b"0 18446744073709551615");
    let mut line = Vec::new();
    put_status_line(&mut line, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(line, b"HTTP/1.1 429 Too Many Requests\r\n");
}

/// Properties of the framing code over inputs no example list covers:
/// the connection code trusts these functions with bytes straight from
/// the network.
mod properties {
    use proptest::prelude::*;

    use super::*;

    /// Where a head ends, the slow way: after the first line that is
    /// empty (a bare LF or CRLF) following another line.
    fn head_end_slowly(buf: &[u8]) -> Option<usize> {
        (1..=buf.len()).find(|&end| {
            let seen = &buf[..end];
            seen.ends_with(b"\n\n") || seen.ends_with(b"\n\r\n")
        })
    }

    /// A chunked encoding of `chunks`, with an extension on some size
    /// lines and `trailers` after the last chunk.
    fn encode(chunks: &[Vec<u8>], with_ext: &[bool], trailers: &[String]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            out.extend_from_slice(format!("{:x}", chunk.len()).as_bytes());
            if with_ext.get(i) == Some(&true) {
                out.extend_from_slice(b";name=\"v\"");
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(chunk);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n");
        for t in trailers {
            out.extend_from_slice(t.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    /// `bytes` cut at `cuts` (positions, in any order, maybe repeated).
    fn pieces<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        at.push(0);
        at.push(bytes.len());
        at.sort_unstable();
        at.windows(2).map(|w| &bytes[w[0]..w[1]]).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn head_end_is_the_first_empty_line(
            buf in proptest::collection::vec(
                prop_oneof![Just(b'\n'), Just(b'\r'), Just(b'a'), any::<u8>()],
                0..64,
            )
        ) {
            prop_assert_eq!(head_end(&buf), head_end_slowly(&buf));
        }

        #[test]
        fn a_chunked_body_reads_back_whatever_the_reads(
            chunks in proptest::collection::vec(
                proptest::collection::vec(any::<u8>(), 1..40), 0..8),
            with_ext in proptest::collection::vec(any::<bool>(), 8),
            trailers in proptest::collection::vec("[A-Za-z-]{1,8}: [ -~]{0,12}", 0..3),
            next in proptest::collection::vec(any::<u8>(), 0..16),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let body = encode(&chunks, &with_ext, &trailers);
            let mut stream = body.clone();
            stream.extend_from_slice(&next);
            let (data, used, done) = dechunk(&pieces(&stream, &cuts)).unwrap();
            prop_assert_eq!(data, chunks.concat());
            prop_assert_eq!(used, body.len(), "the next request's bytes are not the body's");
            prop_assert!(done);
        }

        #[test]
        fn a_cut_short_chunked_body_is_not_done(
            chunks in proptest::collection::vec(
                proptest::collection::vec(any::<u8>(), 1..40), 0..8),
            keep in any::<usize>(),
        ) {
            let body = encode(&chunks, &[], &[]);
            let short = &body[..keep % body.len()];
            let (data, used, done) = dechunk(&[short]).unwrap();
            prop_assert!(!done);
            prop_assert_eq!(used, short.len());
            prop_assert!(chunks.concat().starts_with(&data));
        }

        #[test]
        fn any_bytes_are_framed_or_refused_never_a_panic(
            bytes in proptest::collection::vec(
                prop_oneof![
                    Just(b'\r'), Just(b'\n'), Just(b'0'), Just(b'f'), Just(b';'),
                    any::<u8>(),
                ],
                0..200,
            ),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            if let Ok((_, used, _)) = dechunk(&pieces(&bytes, &cuts)) {
                prop_assert!(used <= bytes.len());
            }
        }

        #[test]
        fn any_head_parses_or_is_refused_never_a_panic(
            text in "[A-Z]{0,8} [ -~]{0,40} HTTP/1\\.[0-9]\r\n([A-Za-z-]{0,12}:[ -~\t]{0,30}\r?\n){0,6}\r?\n",
            noise in proptest::collection::vec(any::<u8>(), 0..8),
            at in any::<usize>(),
        ) {
            let mut bytes = text.into_bytes();
            let at = at % (bytes.len() + 1);
            bytes.splice(at..at, noise);
            let head = Bytes::from(bytes);
            let _ = parse_request(&head);
            let _ = parse_request_line(&head);
        }

        #[test]
        fn any_response_head_parses_or_is_refused_never_a_panic(
            text in "HTTP/1\\.[0-9] [0-9]{0,4} [ -~]{0,20}\r\n((Content-Length|Transfer-Encoding|Connection|[A-Za-z-]{0,12}):[ -~\t]{0,30}\r?\n){0,6}\r?\n",
            noise in proptest::collection::vec(any::<u8>(), 0..8),
            at in any::<usize>(),
            to_head in any::<bool>(),
        ) {
            let mut bytes = text.into_bytes();
            let at = at % (bytes.len() + 1);
            bytes.splice(at..at, noise);
            let head = Bytes::from(bytes);
            let mapped = parse_response(&head, to_head);
            let raw = parse_response_raw(&head, to_head);
            if let Ok(res) = &mapped {
                // A body that ends at the close never leaves the
                // connection to be reused.
                prop_assert!(!(res.body == BodyEnd::Close && res.keep_alive));
            }
            // Kept as lines, a head is accepted and framed exactly as when
            // made a header map, and its lines are the map's.
            match (mapped, raw) {
                (Ok(mapped), Ok(raw)) => {
                    prop_assert_eq!(mapped.body, raw.body);
                    prop_assert_eq!(mapped.keep_alive, raw.keep_alive);
                    prop_assert_eq!(mapped.parts.status, raw.parts.status);
                    let lines = raw.parts.extensions.get::<RawHead>().expect("lines kept");
                    let from_lines: Vec<(String, Vec<u8>)> = lines
                        .lines()
                        .map(|(n, v)| (String::from_utf8_lossy(n).to_lowercase(), v.to_vec()))
                        .collect();
                    let from_map: Vec<(String, Vec<u8>)> = mapped
                        .parts
                        .headers
                        .iter()
                        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                        .collect();
                    let mut from_lines_sorted = from_lines.clone();
                    from_lines_sorted.sort();
                    let mut from_map_sorted = from_map;
                    from_map_sorted.sort();
                    prop_assert_eq!(from_lines_sorted, from_map_sorted);
                }
                (Err(a), Err(b)) => prop_assert_eq!(a, b),
                (a, b) => prop_assert!(false, "{:?} against {:?}", a.is_ok(), b.is_ok()),
            }
        }
    }
}

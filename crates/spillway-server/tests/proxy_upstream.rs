//! `spillway proxy`'s own HTTP/1.1 client, toward the upstream, on the
//! wire: upstreams that are raw sockets answer with the bytes a test
//! chooses (framed two ways, cut short, early, interim, after the body), and
//! the tests check what reaches the client, which connection each request
//! went on, and that no request is sent twice where it must not be.

mod clock_support;
mod wire_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use spillway_server::proxy::ProxyOptions;

use wire_support::*;

/// An upstream that answers the first request of its first connection,
/// reads the second and closes without an answer (as one does whose idle
/// timeout passes while the request is on its way), then answers every
/// request on later connections.
async fn closes_unanswered_once() -> RawUpstream {
    let requests = std::sync::atomic::AtomicUsize::new(0);
    RawUpstream::start(move |request| {
        match requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            1 => Reply {
                bytes: Vec::new(),
                close: true,
            },
            _ => echo(request),
        }
    })
    .await
}

#[tokio::test]
async fn a_get_whose_kept_upstream_connection_closes_unanswered_goes_again_on_a_new_one() {
    let upstream = closes_unanswered_once().await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    assert_eq!(client.exchange(&get("/first")).await.status, 200);

    let second = client.exchange(&get("/second")).await;
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.text(), "upstream got GET /second");
    let seen: Vec<_> = upstream
        .seen()
        .into_iter()
        .map(|s| (s.connection, s.request.target))
        .collect();
    assert_eq!(
        seen,
        [
            (0, "/first".into()),
            (0, "/second".into()),
            (1, "/second".into())
        ]
    );
}

#[tokio::test]
async fn an_upstream_response_whose_framing_reads_two_ways_gives_502_and_is_not_passed_on() {
    // Each could be read as another body length by the client, or its
    // rest as another response (response splitting): refused, not guessed.
    for framing in [
        "Content-Length: 5\r\nTransfer-Encoding: chunked",
        "Transfer-Encoding: gzip, chunked",
        "Transfer-Encoding: gzip",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
        "Content-Length: 5\r\nContent-Length: 6",
        "Content-Length: 5, 6",
        "Content-Length: +5",
        "Content-Length: 0x5",
    ] {
        let bytes = format!("HTTP/1.1 200 OK\r\n{framing}\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
        let upstream = RawUpstream::start(move |_| Reply {
            bytes: bytes.clone().into_bytes(),
            close: false,
        })
        .await;
        let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
        let response = client.exchange(&get("/split")).await;
        assert_eq!(response.status, 502, "{framing}: {}", response.text());
        assert!(!response.text().contains("hello"), "{framing}");
    }
}

#[tokio::test]
async fn bytes_after_an_upstream_response_are_never_read_as_the_next_response() {
    let upstream = RawUpstream::start(|request| match request.target.as_str() {
        "/first" => Reply {
            bytes: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok\
                     HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged"
                .to_vec(),
            close: false,
        },
        _ => echo(request),
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    assert_eq!(client.exchange(&get("/first")).await.text(), "ok");
    let second = client.exchange(&get("/second")).await;
    assert_eq!(second.text(), "upstream got GET /second");
    let connections: Vec<_> = upstream.seen().iter().map(|s| s.connection).collect();
    assert_eq!(connections, [0, 1], "a new connection for the second");
}

#[tokio::test]
async fn a_response_head_over_max_head_is_refused_even_when_it_arrives_fast() {
    // 120 KiB of head, well past MAX_HEAD (64 KiB), written in three bursts
    // so that the proxy's reads are short and its buffer grows past the limit.
    let addr = scripted_upstream(|_, mut wire| async move {
        let Some(_request) = wire.request().await else {
            return;
        };
        let big = "a".repeat(120 * 1024);
        let head = format!("HTTP/1.1 200 OK\r\nX-Big: {big}\r\nContent-Length: 2\r\n\r\nok");
        let bytes = head.into_bytes();
        let (a, rest) = bytes.split_at(40 * 1024);
        let (b, c) = rest.split_at(20 * 1024);
        for piece in [a, b, c] {
            wire.send(piece).await.ok();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        while wire.fill().await {}
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, addr).await).await;
    let response = client.exchange(&get("/big")).await;
    let big = response.headers.all("x-big").first().map_or(0, |v| v.len());
    assert_eq!(
        response.status, 502,
        "a {} byte X-Big header was passed on (MAX_HEAD is 65536)",
        big
    );
}

#[tokio::test]
async fn a_head_response_with_a_late_body_is_never_read_as_the_next_response() {
    let addr = scripted_upstream(|_, mut wire| async move {
        while let Some(request) = wire.request().await {
            if request.method == "HEAD" {
                wire.send(b"HTTP/1.1 200 OK\r\nContent-Length: 38\r\n\r\n")
                    .await
                    .ok();
                tokio::time::sleep(Duration::from_millis(50)).await;
                // A buggy upstream's body, which reads as a response.
                wire.send(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged")
                    .await
                    .ok();
            } else {
                let r = echo(&request);
                wire.send(&r.bytes).await.ok();
            }
        }
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, addr).await).await;
    let head = client
        .exchange(b"HEAD /h HTTP/1.1\r\nHost: spillway.test\r\n\r\n")
        .await;
    assert_eq!(head.status, 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let next = client.exchange(&get("/next")).await;
    assert_eq!(next.text(), "upstream got GET /next");
}

#[tokio::test]
async fn an_early_response_during_an_upload_never_reuses_the_connection() {
    // The upstream answers after the head, before reading the body, then
    // reads whatever comes as further requests.
    let seen = Arc::new(Mutex::new(Vec::<(usize, String)>::new()));
    let log = seen.clone();
    let addr = scripted_upstream(move |n, mut wire| {
        let log = log.clone();
        async move {
            // The head alone: the body is left unread.
            let Some(first) = wire.head(request_head).await else {
                return;
            };
            log.lock().unwrap().push((n, first.target.clone()));
            wire.send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await
                .ok();
            // Now read the rest as requests (what a CL.0 upstream does).
            loop {
                match request_head(&wire.buf) {
                    Ok(Some((len, r))) => {
                        wire.buf.drain(..len);
                        log.lock().unwrap().push((n, r.target.clone()));
                        let e = echo(&r);
                        wire.send(&e.bytes).await.ok();
                    }
                    Ok(None) => {
                        if !wire.fill().await {
                            return;
                        }
                    }
                    Err(_) => {
                        // Skip a byte of body.
                        wire.buf.drain(..1);
                    }
                }
            }
        }
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, addr).await).await;
    let body = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    let head = format!(
        "POST /upload HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    client.send(head.as_bytes()).await.unwrap();
    let first = client.response("POST").await.expect("a response");
    assert_eq!(first.text(), "ok");
    tokio::time::sleep(PAUSE).await;
    client.send(body).await.ok();
    tokio::time::sleep(PAUSE).await;
    if let Some(next) = client.try_exchange(&get("/next")).await {
        assert_eq!(next.text(), "upstream got GET /next");
    }
    tokio::time::sleep(PAUSE).await;
    let seen = seen.lock().unwrap().clone();
    // The body may reach the (buggy) upstream on the first connection, but
    // /next must never share a connection with the upload.
    let upload_conn = seen.iter().find(|(_, t)| t == "/upload").unwrap().0;
    assert!(
        !seen.iter().any(|(c, t)| t == "/next" && *c == upload_conn),
        "{seen:?}"
    );
}

/// An upstream that answers every request with `first`, then `again` and
/// again, `every` apart, never ending its head: the client gets 504 at the
/// response timeout (1 s here), not a hang.
async fn assert_a_head_never_ending_ends_at_the_response_timeout(
    first: &'static [u8],
    again: &'static [u8],
    every: Duration,
) {
    let addr = scripted_upstream(move |_, mut wire| async move {
        let Some(_) = wire.request().await else {
            return;
        };
        if wire.send(first).await.is_err() {
            return;
        }
        loop {
            if wire.send(again).await.is_err() {
                return;
            }
            tokio::time::sleep(every).await;
        }
    })
    .await;
    let options = ProxyOptions {
        response_timeout: Duration::from_secs(1),
        ..ProxyOptions::default()
    };
    let mut client = Wire::connect(start_proxy_with(GENEROUS, addr, options).await).await;
    let started = std::time::Instant::now();
    let response = client.exchange(&get("/endless")).await;
    assert_eq!(response.status, 504);
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn endless_interim_responses_end_at_the_response_timeout() {
    let interim = b"HTTP/1.1 100 Continue\r\n\r\n";
    assert_a_head_never_ending_ends_at_the_response_timeout(
        interim,
        interim,
        Duration::from_millis(1),
    )
    .await;
}

#[tokio::test]
async fn a_trickled_response_head_ends_at_the_response_timeout() {
    assert_a_head_never_ending_ends_at_the_response_timeout(
        b"HTTP/1.1 200 OK\r\n",
        b"X: y\r\n",
        Duration::from_millis(100),
    )
    .await;
}

#[tokio::test]
async fn many_interim_responses_then_the_final_one_keep_the_connection() {
    let interim = "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n".repeat(2000);
    let upstream = RawUpstream::start(move |request| Reply {
        bytes: [interim.as_bytes(), &echo(request).bytes].concat(),
        close: false,
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    let first = client.exchange(&get("/a")).await;
    assert_eq!(first.text(), "upstream got GET /a");
    let second = client.exchange(&get("/b")).await;
    assert_eq!(second.text(), "upstream got GET /b");
    let connections: Vec<_> = upstream.seen().iter().map(|s| s.connection).collect();
    assert_eq!(connections, [0, 0]);
}

#[tokio::test]
async fn a_chunked_response_with_a_huge_size_line_is_cut_not_buffered() {
    let addr = scripted_upstream(|_, mut wire| async move {
        let Some(_) = wire.request().await else {
            return;
        };
        wire.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=")
            .await
            .ok();
        let filler = vec![b'a'; 64 * 1024];
        for _ in 0..64 {
            if wire.send(&filler).await.is_err() {
                return;
            }
        }
        while wire.fill().await {}
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, addr).await).await;
    client.send(&get("/huge-ext")).await.unwrap();
    // Either no response at all (the first frame failed before the head
    // went out) or a 200 whose body ends broken: never a hang, never a
    // buffer that grows with the line.
    if let Some(head) = client.head(response_head).await {
        assert_eq!(head.status, 200);
        while client.fill().await {}
        let body = String::from_utf8_lossy(&client.buf).into_owned();
        assert!(!body.contains("aaaa"), "{body:?}");
    }
}

#[tokio::test]
async fn a_chunked_response_with_extensions_and_trailers_arrives_and_keeps_the_connection() {
    let upstream = RawUpstream::start(|request| match request.target.as_str() {
        "/chunked" => Reply {
            bytes: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n\
                     5;a=b\r\nhello\r\n6 ; c\r\n world\r\n0;last\r\nX-T: 1\r\nX-U: 2\r\n\r\n"
                .to_vec(),
            close: false,
        },
        _ => echo(request),
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    let response = client.exchange(&get("/chunked")).await;
    assert_eq!(response.text(), "hello world");
    let next = client.exchange(&get("/next")).await;
    assert_eq!(next.text(), "upstream got GET /next");
    let connections: Vec<_> = upstream.seen().iter().map(|s| s.connection).collect();
    assert_eq!(connections, [0, 0]);
}

#[tokio::test]
async fn a_response_head_trickled_byte_by_byte_is_read_whole() {
    for head in [
        &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\nok"[..],
        &b"HTTP/1.1 200 OK\nContent-Length: 2\nX-A: b\n\nok"[..],
        &b"HTTP/1.1 200 OK\r\nContent-Length: 2\nX-A: b\n\r\nok"[..],
    ] {
        let head = head.to_vec();
        let addr = scripted_upstream(move |_, mut wire| {
            let head = head.clone();
            async move {
                while let Some(request) = wire.request().await {
                    if request.target == "/trickle" {
                        for b in &head {
                            wire.send(&[*b]).await.ok();
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                    } else {
                        wire.send(&echo(&request).bytes).await.ok();
                    }
                }
            }
        })
        .await;
        let mut client = Wire::connect(start_proxy(GENEROUS, addr).await).await;
        let response = client.exchange(&get("/trickle")).await;
        assert_eq!((response.status, response.text()), (200, "ok".into()));
        assert_eq!(response.headers.all("x-a"), ["b"]);
        let next = client.exchange(&get("/next")).await;
        assert_eq!(next.text(), "upstream got GET /next");
    }
}

#[tokio::test]
async fn options_star_reaches_the_upstream_as_asterisk_form() {
    let upstream = RawUpstream::echo().await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    let response = client
        .exchange(b"OPTIONS * HTTP/1.1\r\nHost: spillway.test\r\n\r\n")
        .await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(upstream.targets(), ["*"]);
}

#[tokio::test]
async fn an_http10_upload_reaches_the_upstream_as_http11_with_its_length() {
    let upstream = RawUpstream::echo().await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    let response = client
        .exchange(b"POST /p HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello")
        .await;
    assert_eq!(response.text(), "upstream got POST /p");
    let seen = &upstream.seen()[0].request;
    assert_eq!(seen.body, b"hello");
    assert_eq!(seen.headers.all("content-length"), ["5"]);
    assert!(seen.headers.all("transfer-encoding").is_empty());
}

#[tokio::test]
async fn a_chunked_upload_with_trailers_arrives_without_them_and_the_connection_is_reused() {
    let upstream = RawUpstream::echo().await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    let request = b"POST /p HTTP/1.1\r\nHost: spillway.test\r\nTransfer-Encoding: chunked\r\n\r\n\
                    3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n";
    let response = client.exchange(request).await;
    assert_eq!(response.text(), "upstream got POST /p");
    let next = client.exchange(&get("/next")).await;
    assert_eq!(next.text(), "upstream got GET /next");
    let seen = upstream.seen();
    assert_eq!(seen[0].request.body, b"abc");
    assert!(seen[0].request.headers.all("x-trailer").is_empty());
    assert_eq!(seen[1].request.target, "/next");
    assert_eq!(seen[1].connection, 0);
}

/// An upstream that answers its first connection's first request, then
/// on the second sends `partial` and closes; answers all later connections.
async fn answers_then(partial: &'static [u8]) -> RawUpstream {
    let requests = std::sync::atomic::AtomicUsize::new(0);
    RawUpstream::start(move |request| {
        match requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            1 => Reply {
                bytes: partial.to_vec(),
                close: true,
            },
            _ => echo(request),
        }
    })
    .await
}

#[tokio::test]
async fn a_get_answered_in_part_is_never_sent_again() {
    for partial in [
        &b"HTTP/1.1 100 Continue\r\n\r\n"[..],
        &b"HTTP/1.1 200 OK\r\nContent-"[..],
        &b"H"[..],
    ] {
        let upstream = answers_then(partial).await;
        let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
        assert_eq!(client.exchange(&get("/first")).await.status, 200);
        let second = client.exchange(&get("/second")).await;
        assert_eq!(second.status, 502, "{partial:?}");
        assert_eq!(upstream.targets(), ["/first", "/second"], "{partial:?}");
    }
}

#[tokio::test]
async fn only_bodiless_idempotent_requests_go_again() {
    for (request, again) in [
        (b"PUT /x HTTP/1.1\r\nHost: spillway.test\r\n\r\n".to_vec(), true),
        (b"DELETE /x HTTP/1.1\r\nHost: spillway.test\r\n\r\n".to_vec(), true),
        (b"PUT /x HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: 0\r\n\r\n".to_vec(), true),
        (b"PUT /x HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: 1\r\n\r\nx".to_vec(), false),
        (b"GET /x HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: 1\r\n\r\nx".to_vec(), false),
        (
            b"GET /x HTTP/1.1\r\nHost: spillway.test\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            false,
        ),
        (b"PATCH /x HTTP/1.1\r\nHost: spillway.test\r\n\r\n".to_vec(), false),
        (b"POST /x HTTP/1.1\r\nHost: spillway.test\r\n\r\n".to_vec(), false),
    ] {
        let upstream = closes_unanswered_once().await;
        let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
        assert_eq!(client.exchange(&get("/first")).await.status, 200);
        let second = client.exchange(&request).await;
        let sent = upstream.targets().iter().filter(|t| *t == "/x").count();
        let what = String::from_utf8_lossy(&request).into_owned();
        if again {
            assert_eq!((second.status, sent), (200, 2), "{what}");
        } else {
            assert_eq!((second.status, sent), (502, 1), "{what}");
        }
    }
}

#[tokio::test]
async fn an_early_close_delimited_response_streams_while_the_upload_goes_on() {
    // The upstream answers at once with a close-delimited body and echoes
    // the upload as it reads it.
    let addr = scripted_upstream(|_, mut wire| async move {
        // The head alone: the body is left unread.
        if wire.head(request_head).await.is_none() {
            return;
        }
        wire.send(b"HTTP/1.1 200 OK\r\n\r\n").await.ok();
        let mut got = 0;
        while got < 15 {
            if wire.buf.is_empty() && !wire.fill().await {
                return;
            }
            let chunk = std::mem::take(&mut wire.buf);
            got += chunk.len();
            wire.send(&chunk).await.ok();
        }
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, addr).await).await;
    client
        .send(b"POST /echo HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: 15\r\n\r\nfirst")
        .await
        .unwrap();
    let head = client.head(response_head).await.expect("a head");
    assert_eq!(head.status, 200);
    // The first piece comes back before the rest is sent.
    let mut echoed: Vec<u8> = client.buf.drain(..).collect();
    while !String::from_utf8_lossy(&echoed).contains("first") {
        assert!(client.fill().await);
        echoed.append(&mut client.buf);
    }
    client.send(b"second").await.unwrap();
    tokio::time::sleep(PAUSE).await;
    client.send(b"last").await.unwrap();
    while client.fill().await {
        echoed.append(&mut client.buf);
        if String::from_utf8_lossy(&echoed).contains("last") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&echoed).into_owned();
    assert!(text.contains("second") && text.contains("last"), "{text:?}");
}

#[tokio::test]
async fn a_request_body_longer_than_a_response_that_ends_first_is_cut_and_not_reused() {
    // The upstream answers 204 at once; the client keeps uploading.
    let early = scripted_upstream(|n, mut wire| async move {
        let mut got_head = false;
        loop {
            if !got_head {
                if let Ok(Some((len, _))) = request_head(&wire.buf) {
                    wire.buf.drain(..len);
                    got_head = true;
                    let reply = format!("HTTP/1.1 204 No Content\r\nX-Conn: {n}\r\n\r\n");
                    wire.send(reply.as_bytes()).await.ok();
                    continue;
                }
            } else {
                wire.buf.clear();
            }
            if !wire.fill().await {
                return;
            }
        }
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, early).await).await;
    client
        .send(b"POST /a HTTP/1.1\r\nHost: spillway.test\r\nContent-Length: 100\r\n\r\npart")
        .await
        .unwrap();
    let first = client.response("POST").await.expect("a response");
    assert_eq!(first.status, 204);
    assert_eq!(first.headers.all("x-conn"), ["0"]);
    // The proxy may close the client's connection (its body was not read);
    // if it does not, the next request must go on a new upstream connection.
    client.send(&pattern(96)).await.ok();
    if let Some(next) = client.try_exchange(&get("/b")).await {
        assert_eq!(next.status, 204);
        assert_eq!(next.headers.all("x-conn"), ["1"]);
    }
}

#[tokio::test]
async fn a_no_content_response_with_a_late_body_is_never_read_as_the_next_response() {
    let addr = scripted_upstream(|_, mut wire| async move {
        while let Some(request) = wire.request().await {
            if request.target == "/no-content" {
                wire.send(b"HTTP/1.1 204 No Content\r\nContent-Length: 44\r\n\r\n")
                    .await
                    .ok();
                tokio::time::sleep(Duration::from_millis(50)).await;
                wire.send(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged")
                    .await
                    .ok();
            } else {
                wire.send(&echo(&request).bytes).await.ok();
            }
        }
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, addr).await).await;
    assert_eq!(client.exchange(&get("/no-content")).await.status, 204);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let next = client.exchange(&get("/next")).await;
    assert_eq!(next.text(), "upstream got GET /next");
}

#[tokio::test]
async fn a_chunked_answer_to_head_with_its_last_chunk_is_not_reused() {
    let upstream = RawUpstream::start(|request| match request.method.as_str() {
        "HEAD" => Reply {
            bytes: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            close: false,
        },
        _ => echo(request),
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    let head = client
        .exchange(b"HEAD /h HTTP/1.1\r\nHost: spillway.test\r\n\r\n")
        .await;
    assert_eq!(head.status, 200);
    let next = client.exchange(&get("/next")).await;
    assert_eq!(next.text(), "upstream got GET /next");
    let connections: Vec<_> = upstream.seen().iter().map(|s| s.connection).collect();
    assert_eq!(connections, [0, 1]);
}

#[tokio::test]
async fn a_switch_after_an_interim_response_gives_502_and_is_not_reused() {
    let upstream = RawUpstream::start(|request| match request.target.as_str() {
        "/ws" => Reply {
            bytes: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"
                .to_vec(),
            close: false,
        },
        _ => echo(request),
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    assert_eq!(client.exchange(&get("/ws")).await.status, 502);
    let next = client.exchange(&get("/next")).await;
    assert_eq!(next.text(), "upstream got GET /next");
    let connections: Vec<_> = upstream.seen().iter().map(|s| s.connection).collect();
    assert_eq!(connections, [0, 1]);
}

#[tokio::test]
async fn a_response_body_cut_short_is_never_passed_on_as_whole_and_not_reused() {
    let upstream = RawUpstream::start(|request| match request.target.as_str() {
        "/short" => Reply {
            bytes: b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc".to_vec(),
            close: true,
        },
        _ => echo(request),
    })
    .await;
    let mut client = Wire::connect(start_proxy(GENEROUS, upstream.addr).await).await;
    client.send(&get("/short")).await.unwrap();
    if let Some(head) = client.head(response_head).await {
        assert_eq!(head.status, 200);
        // The client must see the connection end before 10 bytes.
        while client.fill().await {}
        assert!(client.buf.len() < 10, "{:?}", client.buf);
    }
}

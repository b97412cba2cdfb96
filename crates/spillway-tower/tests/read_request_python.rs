//! `ReadRequestLayer` against the parser an OpenAI-compatible server in
//! Python runs: FastAPI reads a body with `json.loads` and validates
//! `max_tokens` with pydantic's lax mode. For each hostile body, whatever
//! Python would serve, the layer must reserve at least as much: the field's
//! value, or the most a request may (an unreadable body). Otherwise a client
//! could spell its body so that the budget holds less than the upstream
//! spends while the response runs.
//!
//! Needs `python3` with pydantic; without them it is skipped with a
//! message, unless `SPILLWAY_REQUIRE_PYTHON=1` (CI sets it).

use std::io::Write;
use std::process::{Command, Stdio};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use spillway_tower::budget::RequestReserve;
use spillway_tower::{ReadBody, ReadRequestLayer};
use tower::{Layer, ServiceExt, service_fn};

/// Reads each body (hex, one a line) as FastAPI and pydantic would, and
/// prints what `max_tokens` the upstream takes from it.
const ORACLE: &str = r#"
import json, sys
from pydantic import TypeAdapter, ValidationError
as_int = TypeAdapter(int)
for line in sys.stdin:
    try:
        doc = json.loads(bytes.fromhex(line.strip()))
    except Exception:
        print("refused"); continue
    if not isinstance(doc, dict) or "max_tokens" not in doc:
        print("none"); continue
    try:
        print(as_int.validate_python(doc["max_tokens"]))
    except ValidationError:
        print("refused")
"#;

fn utf16(text: &str, big: bool, bom: bool) -> Vec<u8> {
    let bom = bom.then_some(0xfeff_u16);
    bom.into_iter()
        .chain(text.encode_utf16())
        .flat_map(|u| {
            if big {
                u.to_be_bytes()
            } else {
                u.to_le_bytes()
            }
        })
        .collect()
}

fn utf32(text: &str, big: bool) -> Vec<u8> {
    text.chars()
        .flat_map(|c| {
            let c = c as u32;
            if big {
                c.to_be_bytes()
            } else {
                c.to_le_bytes()
            }
        })
        .collect()
}

/// Bodies meant to be read one way by the layer and another by Python.
fn hostile() -> Vec<Vec<u8>> {
    let mut bodies: Vec<Vec<u8>> = [
        r#"{"max_tokens":8000}"#,
        r#"{"max_tokens":8000.0}"#,
        r#"{"max_tokens":8e3}"#,
        r#"{"max_tokens":"8000"}"#,
        r#"{"max_tokens":" +8_000 "}"#,
        r#"{"max_tokens":"8000.0"}"#,
        r#"{"max_tokens":"1_0.0"}"#,
        r#"{"max_tokens":true}"#,
        r#"{"max_tokens":99999999999999999999999}"#,
        r#"{"max_tokens":"99999999999999999999999"}"#,
        r#"{"max_tokens":-0}"#,
        r#"{"max_tokens":100000.0000000000069}"#,
        r#"{"max_tokens":8000.000000000000000000001}"#,
        r#"{"max_tokens":1,"max_tokens":8000}"#,
        r#"{"max_tokens":8000,"max_tokens":1}"#,
        r#"{"max_\u0074okens":8000}"#,
        r#"{"max_tokens":8000,"temperature":NaN}"#,
        r#"{"max_tokens":8000,"temperature":Infinity}"#,
        r#"{"max_tokens":8000,"temperature":-Infinity}"#,
        r#"{"max_tokens":8000,"p":"\ud800"}"#,
        r#"{"max_tokens":8000,"p":"\udc00\ud800"}"#,
        "\t{\"max_tokens\" :\n8000 }\r\n",
        r#"{"max_tokens":1e400}"#,
        r#"{"max_tokens":8000,}"#,
        r#"{"max_tokens":8000} {}"#,
        r#"[{"max_tokens":8000}]"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    let plain = r#"{"max_tokens":8000,"messages":[{"role":"user","content":"héllo"}]}"#;
    bodies.push([&b"\xef\xbb\xbf"[..], plain.as_bytes()].concat());
    for big in [true, false] {
        bodies.push(utf16(plain, big, false));
        bodies.push(utf16(plain, big, true));
        bodies.push(utf32(plain, big));
    }
    // Deeper than serde_json goes, not than Python does.
    let deep = format!(
        r#"{{"max_tokens":8000,"p":{}{}}}"#,
        "[".repeat(300),
        "]".repeat(300)
    );
    bodies.push(deep.into_bytes());
    // Invalid UTF-8 in a string: Python refuses it too.
    bodies.push(b"{\"max_tokens\":8000,\"p\":\"\xff\"}".to_vec());
    bodies
}

/// What the layer reserves from `body` (`None`: nothing read).
async fn layer_reads(body: Vec<u8>) -> Option<RequestReserve> {
    let inner = service_fn(|req: Request<ReadBody<Full<Bytes>>>| async move {
        let mut res = Response::new(Full::new(Bytes::new()));
        if let Some(reserve) = req.extensions().get::<RequestReserve>() {
            res.extensions_mut().insert(reserve.clone());
        }
        Ok::<_, std::convert::Infallible>(res)
    });
    let service = ReadRequestLayer::new(["max_tokens"]).layer(inner);
    let req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let res = service.oneshot(req).await.unwrap();
    res.extensions().get::<RequestReserve>().cloned()
}

/// What Python's side says of each body, or `None` when it cannot run.
fn python_reads(bodies: &[Vec<u8>]) -> Option<Vec<String>> {
    let child = Command::new("python3")
        .args(["-c", ORACLE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = child.ok()?;
    let mut stdin = child.stdin.take().unwrap();
    for body in bodies {
        let hex: String = body.iter().map(|b| format!("{b:02x}")).collect();
        writeln!(stdin, "{hex}").unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        eprintln!("python3: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    let lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(lines.len(), bodies.len());
    Some(lines)
}

#[tokio::test]
async fn the_layer_never_reserves_less_than_python_serves() {
    let bodies = hostile();
    let Some(python) = python_reads(&bodies) else {
        assert!(
            std::env::var("SPILLWAY_REQUIRE_PYTHON").as_deref() != Ok("1"),
            "python3 with pydantic is required (SPILLWAY_REQUIRE_PYTHON=1)"
        );
        eprintln!("SKIPPED: python3 with pydantic not found");
        return;
    };
    let mut served = 0;
    for (body, python) in bodies.into_iter().zip(python) {
        let shown = String::from_utf8_lossy(&body).into_owned();
        let ours = layer_reads(body).await.expect("a JSON body is read");
        let Ok(upstream) = python.parse::<i128>() else {
            continue;
        };
        served += 1;
        if ours.unreadable || upstream < 0 {
            continue;
        }
        let asked = ours.asked("max_tokens");
        let upstream = u64::try_from(upstream).unwrap_or(u64::MAX);
        assert!(
            asked.is_some_and(|n| n >= upstream),
            "{shown:?}: Python serves max_tokens={upstream}, the layer read {ours:?}"
        );
    }
    // The corpus is made of bodies Python serves, most of them.
    assert!(served >= 25, "only {served} bodies served by Python");
}

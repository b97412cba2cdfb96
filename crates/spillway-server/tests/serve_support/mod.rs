//! What the `serve*` tests share: a service started with `run()` on port 0,
//! a real HTTP client, and polling with a deadline.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use spillway_server::config::Config;
use spillway_server::{ConfigSource, State};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// One answer, read whole.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn content_type(&self) -> &str {
        self.headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

/// A real HTTP/1.1 client.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl Http {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
        }
    }

    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Answer {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(body.into())).expect("a valid request");
        let res = tokio::time::timeout(Duration::from_secs(30), self.client.request(req))
            .await
            .expect("an answer within 30 s")
            .expect("the request is answered");
        let (parts, body) = res.into_parts();
        let body = body.collect().await.expect("a whole body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.send(Method::GET, path, &[], Bytes::new()).await
    }

    pub async fn check(&self, body: Value) -> Answer {
        self.send(
            Method::POST,
            "/v1/check",
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await
    }

    /// The value of one metric series, by its full text before the value
    /// (`spillway_decisions_total{rule="a",outcome="allowed"}`).
    pub async fn metric(&self, series: &str) -> Option<f64> {
        metric_value(&self.get("/metrics").await.text(), series)
    }
}

/// The value of `series` in a Prometheus text exposition.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// A service started with `run()` on 127.0.0.1:0.
pub struct Service {
    pub addr: SocketAddr,
    pub http: Http,
    pub state: State,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<std::io::Result<()>>>,
}

impl Service {
    /// Starts the service on `config`, reloading from `source` if given.
    pub async fn start(config: Config, source: Option<ConfigSource>) -> Self {
        let state = State::new(config).await.expect("the store starts");
        Self::start_with(state, source).await
    }

    pub async fn start_with(state: State, source: Option<ConfigSource>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("an address");
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(spillway_server::run(
            listener,
            None,
            state.clone(),
            source,
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            addr,
            http: Http::new(addr),
            state,
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    /// Signals shutdown; the returned handle resolves when `run` returns.
    pub fn shutdown(&mut self) -> JoinHandle<std::io::Result<()>> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.handle.take().expect("not shut down yet")
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Polls `condition` every 20 ms until it holds, failing after `within`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if condition().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fresh directory for one test's files.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}

/// Replaces a file's content at once (write aside, then rename), so that a
/// poller never reads it half written.
pub fn write_atomically(path: &std::path::Path, content: &str) {
    let aside = path.with_extension("tmp");
    std::fs::write(&aside, content).expect("write");
    std::fs::rename(&aside, path).expect("rename");
}

/// The body of `GET path` once the service answers it 200 (it may refuse
/// connections for a while), within 5 s.
pub async fn eventually_answered(http: &Http, path: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let res = http
            .client
            .get(format!("{}{path}", http.base).parse().expect("a URI"))
            .await;
        if let Ok(res) = res
            && res.status() == StatusCode::OK
        {
            let body = res.into_body().collect().await.expect("a body").to_bytes();
            return String::from_utf8_lossy(&body).into_owned();
        }
        assert!(Instant::now() < deadline, "{path} never answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What an answer listing `rules` (a check, a settle, a release) says is
/// left under `rule`.
pub fn remaining(answer: &Value, rule: &str) -> u64 {
    answer["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|r| r["rule"] == rule)
        .and_then(|r| r["remaining"].as_u64())
        .unwrap_or_else(|| panic!("{rule} in {answer}"))
}

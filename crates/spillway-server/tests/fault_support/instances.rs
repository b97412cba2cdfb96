//! `spillway serve` processes: the real binary, each on its own port,
//! killed (by its own PID) when dropped.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How many of its last log lines an instance keeps, for failure messages.
const KEPT_LINES: usize = 40;

/// One `spillway serve` process.
#[derive(Debug)]
pub struct Instance {
    child: Child,
    /// Where it answers HTTP.
    pub addr: SocketAddr,
    log: Arc<Mutex<VecDeque<String>>>,
}

impl Instance {
    /// Starts `spillway serve --config CONFIG --listen 127.0.0.1:0` and
    /// waits (up to 20 s) until it listens.
    pub fn start(config: &Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_spillway"))
            .arg("serve")
            .arg("--config")
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .env_remove("SPILLWAY_ADMIN_TOKEN")
            .env_remove("SPILLWAY_CHECK_TOKENS")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let kept = log.clone();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
                let mut log = kept.lock().expect("log");
                if log.len() == KEPT_LINES {
                    log.pop_front();
                }
                log.push_back(line);
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(addr) => addr.parse().expect("a socket address"),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "spillway serve did not listen within 20 s; its log:\n{}",
                    Vec::from(log.lock().expect("log").clone()).join("\n")
                );
            }
        };
        Self { child, addr, log }
    }

    /// Its last log lines.
    pub fn log_tail(&self) -> String {
        Vec::from(self.log.lock().expect("log").clone()).join("\n")
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

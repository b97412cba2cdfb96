//! `[store] state_file`: the in-memory store's counters and run-time
//! tables kept across restarts. Read once at start, before anything is
//! served ([`restore`]); written every `snapshot_every` while serving and
//! once more when the service stops, after its requests in flight have
//! been answered ([`Snapshots`]).
//!
//! What a restart can lose is what was admitted after the last write: all
//! of a `snapshot_every` at most when the process is killed outright
//! (SIGKILL, a crash, the host going down), nothing when it is stopped
//! (SIGTERM, Ctrl-C) and lets its last write finish.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use spillway::clock::{Clock, SystemClock};
use spillway::store::{StateFileError, read_state_file, state_file_rules};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::StateFile;
use crate::config::descriptors::parse_override_name;
use crate::metrics::Metrics;
use crate::state::Live;

/// Why the state file could not be used at start.
#[derive(Debug, thiserror::Error)]
#[error("[store] state_file {}: {reason}", path.display())]
pub struct RestoreError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

/// The lock that keeps a second process from using the same state file
/// (each would overwrite the other's counts): held as long as the process
/// serves, on a file beside it (`<state_file>.lock`), since the state file
/// itself is replaced at each write.
#[derive(Debug)]
pub struct StateLock {
    _file: File,
}

/// Takes the state file's lock, then reads the file into the in-memory
/// store `live` serves with, which has served nothing yet: first counting
/// the Envoy limit overrides the file has keys of (each a store rule made
/// when first met), then the keys and tables, then each override set under
/// every tier (one the configuration added since takes the rule's). No
/// file yet is a first start (logged). A file that cannot be read, is not
/// a state file, is of another format version or is damaged is an error,
/// and the service does not start: starting empty would hand every client
/// a fresh quota without anyone knowing.
pub async fn restore(file: &StateFile, live: &Live) -> Result<StateLock, RestoreError> {
    let fail = |reason: String| RestoreError {
        path: file.path.clone(),
        reason,
    };
    let lock = lock(file).map_err(fail)?;
    let started = Instant::now();
    let refused = |e: StateFileError| {
        let hint = match e {
            StateFileError::Io(_) => "",
            _ => "; move it aside to start with no counts (every client then gets a fresh quota)",
        };
        fail(format!("{e}{hint}"))
    };
    let Some(bytes) = read_state_file(&file.path).map_err(refused)? else {
        tracing::info!(
            path = %file.path.display(),
            "no state file yet: starting with no counts; it is written every {:?} and at shutdown",
            file.every
        );
        return Ok(StateLock { _file: lock });
    };
    let limits: Vec<_> = state_file_rules(&bytes)
        .map_err(refused)?
        .iter()
        .filter_map(|name| parse_override_name(name))
        .collect();
    if let Err(e) = live.with_overrides(&limits).await {
        tracing::warn!(error = %e, "the state file's Envoy limit overrides could not all be counted again");
    }
    let loaded = live.current();
    let store = loaded.store().memory().expect("an in-memory store");
    let restored = store.restore_state(&bytes).map_err(refused)?;
    crate::state::overrides_under_every_tier(&loaded.config.policy, loaded.store()).await;
    let age = SystemClock.now().saturating_sub(restored.written_at) / 1_000_000;
    tracing::info!(
        path = %file.path.display(),
        keys = restored.keys,
        idle_or_no_room = restored.keys_left,
        entries = restored.entries,
        reservations = restored.reservations,
        written_seconds_ago = age,
        ms = started.elapsed().as_millis() as u64,
        "state file read: counts and run-time tables restored"
    );
    for (rule, keys) in &restored.rules_left {
        tracing::warn!(
            rule = %rule,
            keys,
            "the state file's keys of a rule that is gone or counts another way now \
             (another algorithm or window) were left out: they start afresh"
        );
    }
    Ok(StateLock { _file: lock })
}

/// Takes the lock beside `file` (`<state_file>.lock`), held as long as
/// the returned file is open.
fn lock(file: &StateFile) -> Result<File, String> {
    let mut lock_path = file.path.clone().into_os_string();
    lock_path.push(".lock");
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let lock = options
        .open(&lock_path)
        .map_err(|e| format!("cannot open its lock file: {e}"))?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(TryLockError::WouldBlock) => Err(format!(
            "another process holds {}: two processes cannot share one state file",
            PathBuf::from(lock_path).display()
        )),
        Err(TryLockError::Error(e)) => Err(format!("cannot lock it: {e}")),
    }
}

/// The writes of the state file while serving: every `snapshot_every`,
/// then once more at [`finish`](Self::finish).
#[derive(Debug)]
pub struct Snapshots {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
    writer: Writer,
}

#[derive(Debug, Clone)]
struct Writer {
    file: StateFile,
    live: Arc<Live>,
    metrics: Arc<Metrics>,
}

impl Writer {
    /// Writes the current engine's in-memory store to the file, off the
    /// async threads; logs and counts the outcome. A failed write leaves
    /// the last good file in place. Whether it was written.
    async fn write(&self) -> bool {
        let loaded = self.live.current();
        if loaded.store().memory().is_none() {
            return false;
        }
        let path = self.file.path.clone();
        let started = Instant::now();
        let written = tokio::task::spawn_blocking(move || {
            let store = loaded.store().memory().expect("checked above");
            store.save_state_file(&path)
        })
        .await;
        match written {
            Ok(Ok(saved)) => {
                self.metrics.state_file_written(true);
                tracing::debug!(
                    path = %self.file.path.display(),
                    keys = saved.keys,
                    entries = saved.entries,
                    bytes = saved.bytes,
                    ms = started.elapsed().as_millis() as u64,
                    "state file written"
                );
                true
            }
            Ok(Err(e)) => {
                self.metrics.state_file_written(false);
                tracing::error!(path = %self.file.path.display(), error = %e,
                    "the state file could not be written: the last one written stays");
                false
            }
            Err(e) => {
                self.metrics.state_file_written(false);
                tracing::error!(path = %self.file.path.display(), error = %e,
                    "the state file's writer failed: the last one written stays");
                false
            }
        }
    }
}

impl Snapshots {
    /// Starts writing `file` every `file.every` from the store `live`
    /// serves with (after a reload, the new store: a reload to Redis
    /// writes nothing).
    pub fn start(file: StateFile, live: Arc<Live>, metrics: Arc<Metrics>) -> Self {
        let writer = Writer {
            file,
            live,
            metrics,
        };
        let (stop, mut stopped) = oneshot::channel();
        let every = writer.file.every;
        let periodic = writer.clone();
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            // A write that took longer than the period is followed by the
            // next one a period later, not by a burst of them.
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = &mut stopped => return,
                    _ = ticks.tick() => {
                        periodic.write().await;
                    }
                }
            }
        });
        Self { stop, task, writer }
    }

    /// Stops the periodic writes (waiting for one under way) and writes
    /// the file a last time: call it once nothing more will be admitted.
    pub async fn finish(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
        if self.writer.write().await {
            tracing::info!(path = %self.writer.file.path.display(), "state file written at shutdown");
        }
    }
}

//! Hot reload: on SIGHUP, and when the configuration file changes.
//!
//! The file is read again, validated ([`Config::load`](crate::config::Config::load))
//! and built into a new engine with the old one as `previous`, so the
//! in-memory counters of unchanged rules carry over; then the new engine
//! replaces the old one at once ([`Live::replace`](crate::state::Live::replace)).
//! Requests in flight finish on the engine they started with.
//!
//! A configuration that does not load (a syntax error, a zero limit, an
//! unknown tier, a Redis that cannot be reached...) is refused: an error log
//! line names the field and the line, and the old configuration keeps
//! serving. The file is polled every second (its content is compared, so an
//! edit within the same second as the previous one is seen too).

use std::io;
use std::time::Duration;

use spillway_redis::Error as StoreError;

use crate::config::ConfigErrors;
use crate::config::ConfigSource;
use crate::state::{Loaded, State};

/// How often the file is polled for changes.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Why a reload was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The service was not started from a file.
    #[error("no configuration file to reload (the built-in sample is in use)")]
    NoFile,
    /// The file does not load.
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    /// The store could not be set up (Redis unreachable, a rule it cannot run).
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// Reloads one service's configuration.
#[derive(Debug)]
pub struct Reloader {
    state: State,
    source: Option<ConfigSource>,
    // The file's content when last read, to tell a change.
    last: Option<Vec<u8>>,
    #[cfg(unix)]
    hangups: tokio::signal::unix::Signal,
}

impl Reloader {
    /// A reloader for the service `state` started from `source`. Installs
    /// the SIGHUP handler at once (so call it within the runtime, before
    /// serving): from then on SIGHUP reloads instead of ending the process.
    pub fn new(state: State, source: Option<ConfigSource>) -> io::Result<Self> {
        let last = source.as_ref().and_then(|s| std::fs::read(&s.path).ok());
        Ok(Self {
            state,
            source,
            last,
            #[cfg(unix)]
            hangups: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?,
        })
    }

    /// Reloads now: loads the file, builds the new engine, swaps it in.
    /// On error nothing changes. Either way the outcome is logged and
    /// counted in `spillway_config_reloads_total`.
    pub async fn reload(&mut self) -> Result<(), ReloadError> {
        let result = self.try_reload().await;
        match &result {
            Ok(()) => {}
            Err(ReloadError::Config(e)) => tracing::error!(
                path = %self.source.as_ref().map(|s| s.path.display().to_string()).unwrap_or_default(),
                field = %e.first().field,
                line = e.first().line,
                errors = e.len(),
                "configuration refused, the previous one keeps serving: {e}"
            ),
            Err(e) => {
                tracing::error!("configuration refused, the previous one keeps serving: {e}")
            }
        }
        if !matches!(result, Err(ReloadError::NoFile)) {
            self.state.metrics.reload(result.is_ok());
        }
        result
    }

    async fn try_reload(&mut self) -> Result<(), ReloadError> {
        let source = self.source.as_ref().ok_or(ReloadError::NoFile)?;
        if let Ok(content) = std::fs::read(&source.path) {
            self.last = Some(content);
        }
        let config = source.load()?;
        // No new limit override while the next engine is made from this one.
        let _changing = self.state.live.changing().await;
        let old = self.state.live.current();
        let (was, now) = (&old.config.server, &config.server);
        if was.listen != now.listen || was.grpc_listen != now.grpc_listen {
            tracing::warn!("server.listen and server.grpc_listen take effect on restart only");
        }
        if old.config.store.state_file != config.store.state_file {
            tracing::warn!("store.state_file and store.snapshot_every take effect on restart only");
        }
        let engine = Loaded::counted(config, Some(&old), &self.state.metrics).await?;
        let rules = engine.config.policy.rules().len();
        self.state.live.replace(engine);
        self.state.metrics.retire(old.store());
        tracing::info!(
            path = %source.path.display(),
            rules,
            "configuration reloaded"
        );
        Ok(())
    }

    /// Whether the file's content differs from when it was last read.
    fn changed(&self) -> bool {
        let Some(source) = &self.source else {
            return false;
        };
        match std::fs::read(&source.path) {
            Ok(content) => self.last.as_deref() != Some(content.as_slice()),
            // Being replaced (some editors delete, then write): look again
            // at the next tick.
            Err(_) => false,
        }
    }

    /// Reloads on SIGHUP and when the file changes, until `stop` resolves.
    pub async fn watch(mut self, stop: impl Future<Output = ()>) {
        let mut poll = tokio::time::interval(POLL_INTERVAL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                () = &mut stop => return,
                () = self.hangup() => {
                    tracing::info!("SIGHUP: reloading the configuration");
                    if let Err(ReloadError::NoFile) = self.reload().await {
                        tracing::warn!("SIGHUP ignored: {}", ReloadError::NoFile);
                    }
                }
                _ = poll.tick(), if self.source.is_some() => {
                    if self.changed() {
                        tracing::info!("the configuration file changed: reloading");
                        let _ = self.reload().await;
                    }
                }
            }
        }
    }

    #[cfg(unix)]
    async fn hangup(&mut self) {
        if self.hangups.recv().await.is_none() {
            std::future::pending::<()>().await;
        }
    }

    #[cfg(not(unix))]
    async fn hangup(&mut self) {
        std::future::pending::<()>().await;
    }
}

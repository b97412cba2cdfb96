//! Running the service: the state its endpoints share, and [`run`].

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use spillway_redis::{Error as StoreError, Topology};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::{Config, ConfigError, StoreKind};
use crate::engine::{Engine, Shared, StoreObserver};
use crate::metrics::{DecisionObserver, Metrics};
use crate::reload::Reloader;

/// The sample configuration that ships in the repository
/// (`config/spillway.toml`): what `spillway serve` runs when it finds no
/// configuration file.
pub const SAMPLE_CONFIG: &str = include_str!("../config/spillway.toml");

/// Where `spillway serve` looks for its configuration when not told.
pub const DEFAULT_CONFIG_PATH: &str = "config/spillway.toml";

/// What the endpoints share: the engine in use and the metrics it reports
/// to. Cheap to clone.
#[derive(Debug, Clone)]
pub struct State {
    /// The engine in use, replaced on reload.
    pub shared: Arc<Shared>,
    /// The metrics every engine of this service reports to.
    pub metrics: Arc<Metrics>,
}

impl State {
    /// Builds the engine for `config` (connecting to Redis if configured),
    /// reporting to fresh metrics.
    pub async fn new(config: Config) -> Result<Self, StoreError> {
        let metrics = Arc::new(Metrics::new());
        let engine = build_engine(config, None, &metrics).await?;
        Ok(Self {
            shared: Arc::new(Shared::new(engine)),
            metrics,
        })
    }
}

/// Builds an engine for `config` whose store calls and decisions are counted
/// in `metrics`; `previous` is the engine it replaces, if any (see
/// [`Engine::build`]: unchanged in-memory counters carry over).
pub async fn build_engine(
    config: Config,
    previous: Option<&Engine>,
    metrics: &Arc<Metrics>,
) -> Result<Engine, StoreError> {
    let observer: Arc<dyn StoreObserver> = metrics.clone();
    let engine = Engine::build(config, previous, Some(observer)).await?;
    Ok(engine.observed(DecisionObserver(metrics.clone())))
}

/// Command-line settings that take precedence over the configuration file,
/// on start and on every reload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--redis URL`: use this Redis whatever `[store] kind` says.
    pub redis: Option<String>,
}

impl Overrides {
    /// Applies the overrides to a configuration.
    pub fn apply(&self, config: &mut Config) {
        if let Some(url) = &self.redis {
            config.store.kind = StoreKind::Redis(Topology::Standalone(url.clone()));
        }
    }
}

/// The configuration file a service was started from, and what overrides it:
/// what a reload reads again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigSource {
    /// The file.
    pub path: PathBuf,
    /// The command-line settings that win over it.
    pub overrides: Overrides,
}

impl From<PathBuf> for ConfigSource {
    fn from(path: PathBuf) -> Self {
        Self {
            path,
            overrides: Overrides::default(),
        }
    }
}

impl ConfigSource {
    /// Reads and validates the file, then applies the overrides.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = Config::load(&self.path)?;
        self.overrides.apply(&mut config);
        Ok(config)
    }
}

/// The configuration file to use: `explicit` if given, else
/// [`DEFAULT_CONFIG_PATH`] if it exists (relative to the working
/// directory), else none (and [`SAMPLE_CONFIG`] is used).
pub fn locate_config(explicit: Option<PathBuf>) -> Option<PathBuf> {
    explicit.or_else(|| {
        let default = Path::new(DEFAULT_CONFIG_PATH);
        default.is_file().then(|| default.to_path_buf())
    })
}

/// Serves the HTTP API ([`app`](crate::app())) on `listener` and, when
/// given, the Envoy rate limit service on `grpc_listener`, until `shutdown`
/// resolves; then stops accepting connections, closes idle ones and returns
/// once the requests in flight have been answered. HTTP/1.1 is served by
/// Spillway's own server (`POST /v1/check` answered without the router),
/// HTTP/2 (prior knowledge) by hyper; see `docs/server.md`.
///
/// With a `config` source, the configuration is reloaded on SIGHUP and when
/// the file changes (it is polled every second): a new configuration that
/// does not load is refused with an error log line, and the old one keeps
/// serving. Without one, SIGHUP is logged and ignored.
///
/// ```
/// use spillway_server::config::Config;
/// use spillway_server::{State, run};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
/// let state = State::new(Config::parse("").unwrap()).await.unwrap();
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let server = tokio::spawn(run(listener, None, state, None, async {
///     let _ = stopped.await;
/// }));
/// // ... serve until told to stop, then drain and return.
/// stop.send(()).unwrap();
/// server.await.unwrap().unwrap();
/// # }
/// ```
pub async fn run(
    listener: TcpListener,
    grpc_listener: Option<TcpListener>,
    state: State,
    config: Option<ConfigSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    // One shutdown signal, many listeners: the HTTP server, the gRPC server
    // and the reload watcher each wait on their own receiver.
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    let stopped = move || {
        let mut rx = rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };

    // The SIGHUP handler is installed before anything is served, so that a
    // SIGHUP from now on reloads instead of ending the process.
    let reloader = Reloader::new(state.clone(), config)?;
    let watcher = tokio::spawn(reloader.watch(stopped()));

    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!("listening on http://{addr}");
    let http = crate::front::serve(listener, state.clone(), stopped());
    let grpc = async {
        match grpc_listener {
            Some(listener) => {
                tracing::info!(
                    "Envoy rate limit service (gRPC) on {}",
                    listener.local_addr()?
                );
                crate::grpc::serve(listener, state.shared.clone(), stopped()).await
            }
            None => Ok(()),
        }
    };
    let served = tokio::try_join!(http, grpc).map(drop);
    if served.is_ok() {
        let _ = watcher.await;
    } else {
        watcher.abort();
    }
    tracing::info!("stopped");
    served
}

//! [`run`]: `spillway serve`'s listeners, its reloads and its shutdown.

use std::io;
use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::ConfigSource;
use crate::reload::Reloader;
use crate::state::State;

/// Serves the HTTP API ([`app`](crate::api::app)) on `listener` and, when
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
    // The forward-auth hook's held answers hear it too.
    let draining = spillway_tower::Draining::new(rx.clone());
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
    let snapshots = state.snapshots();
    let watcher = tokio::spawn(reloader.watch(stopped()));
    tokio::spawn(crate::probe::watch_store(state.live.clone(), stopped()));

    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!("listening on http://{addr}");
    let http = crate::api::serve(listener, state.clone(), draining, stopped());
    let grpc = async {
        match grpc_listener {
            Some(listener) => {
                tracing::info!(
                    "Envoy rate limit service (gRPC) on {}",
                    listener.local_addr()?
                );
                crate::envoy::serve(listener, state.live.clone(), stopped()).await
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
    // Nothing more is admitted: the last write of the state file.
    if let Some(snapshots) = snapshots {
        snapshots.finish().await;
    }
    tracing::info!("stopped");
    served
}

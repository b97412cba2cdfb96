//! `spillway`: the Spillway command. Thin: parse the flags, call the library.

use std::io;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use mimalloc::MiMalloc;
use spillway_sim::scenario::{Params, ScenarioKind};
use spillway_sim::{AlgorithmKind, Options, parse_duration};

// Allocation-heavy paths (the proxy's buffers and headers, each request's
// futures) run faster on mimalloc than on glibc's malloc.
#[global_allocator]
static ALLOCATOR: MiMalloc = MiMalloc;

/// Rate limiting for HTTP APIs.
#[derive(Debug, Parser)]
#[command(name = "spillway", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the algorithms side by side on the same synthetic traffic, on a
    /// virtual clock, and print what each did (charts with --out).
    Simulate(SimulateArgs),
    /// The decision service: the HTTP API (POST /v1/check, /metrics,
    /// /healthz, /readyz, /admin) and, with grpc_listen, the Envoy rate
    /// limit service. Reloads the configuration on SIGHUP and file change.
    Serve(ServeArgs),
    /// Validates a configuration file: prints OK, or the error with its
    /// field and line (and exits non-zero).
    CheckConfig(CheckConfigArgs),
    /// A reverse proxy that applies the rules in front of any HTTP service
    /// (shaping leaky-bucket rules). Reloads like `serve`.
    Proxy(ProxyArgs),
}

#[derive(Debug, Args)]
struct ProxyArgs {
    /// The service to forward to, as a base URL: http://host:port.
    #[arg(long, value_name = "URL")]
    upstream: http::Uri,
    /// The proxy's address [default: the file's server.listen].
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// The configuration file [default: config/spillway.toml if present,
    /// else the built-in sample configuration].
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Keep the counters in this Redis (a redis:// URL), whatever the file says.
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
    /// The longest to wait for a connection to the upstream (then 504).
    #[arg(long, default_value = "5s", value_parser = parse_std_duration)]
    connect_timeout: std::time::Duration,
    /// The longest to wait for the upstream's response head (then 504).
    #[arg(long, default_value = "60s", value_parser = parse_std_duration)]
    upstream_timeout: std::time::Duration,
    /// What Host the upstream sees: `keep` (the client's, default) or
    /// `upstream` (the upstream's host:port).
    #[arg(long, default_value = "keep")]
    host_header: spillway_server::proxy::HostHeader,
    /// Serve /metrics, /healthz, /readyz and the admin API on this address,
    /// off the proxied port (which forwards every path) [default: none].
    #[arg(long, value_name = "ADDR")]
    admin_listen: Option<std::net::SocketAddr>,
}

fn parse_std_duration(s: &str) -> Result<std::time::Duration, String> {
    spillway_server::config::parse_duration(s)
}

#[derive(Debug, Args)]
struct SimulateArgs {
    /// Scenarios, comma-separated, or `all`: steady_below, steady_at,
    /// steady_above, bursty, boundary_burst, poisson, hammer, shared_key.
    /// Defaults to all, or to none when --trace is given.
    #[arg(long, value_name = "NAME|all")]
    scenario: Option<String>,
    /// Algorithms, comma-separated, or `all`: fixed_window, sliding_log,
    /// sliding_window, token_bucket, leaky_bucket_shape,
    /// leaky_bucket_police (`leaky_bucket` is both modes).
    #[arg(long, value_name = "NAME|all", default_value = "all")]
    algorithm: String,
    /// L: the limit per window (and the buckets' rate per window).
    #[arg(long, default_value = "100")]
    limit: std::num::NonZeroU32,
    /// W: the window (and the buckets' rate period), e.g. 10s, 500ms, 1m.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    window: u64,
    /// The token bucket's burst and the leaky bucket's capacity [default: the limit].
    #[arg(long)]
    burst: Option<std::num::NonZeroU32>,
    /// Simulated time per scenario, e.g. 60s, 1h.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: u64,
    /// Seed of the random arrivals (Poisson, bursty, shared_key).
    #[arg(long, default_value = "1")]
    seed: u64,
    /// Also replay this CSV trace: rows `timestamp,key,cost`, timestamps in
    /// microseconds.
    #[arg(long, value_name = "FILE.csv")]
    trace: Option<PathBuf>,
    /// Write one SVG chart per scenario and an index.html into this directory.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also simulate a slow backend behind no limit, a rate limit and a
    /// concurrency limit: requests in flight and latency over time.
    #[arg(long)]
    backend: bool,
}

impl SimulateArgs {
    fn into_options(self, command: String) -> Result<Options, String> {
        let scenarios = match self.scenario.as_deref() {
            None if self.trace.is_some() => Vec::new(),
            None | Some("all") => ScenarioKind::ALL.to_vec(),
            Some(list) => list
                .split(',')
                .map(|s| s.trim().parse())
                .collect::<Result<_, _>>()?,
        };
        Ok(Options {
            params: Params {
                limit: self.limit,
                window: self.window,
                burst: self.burst.unwrap_or(self.limit),
                duration: self.duration,
                seed: self.seed,
            },
            scenarios,
            trace: self.trace,
            algorithms: AlgorithmKind::parse_list(&self.algorithm)?,
            out: self.out,
            json: self.json,
            backend: self.backend,
            command,
        })
    }
}

fn main() -> ExitCode {
    // As typed, with the binary's name rather than its path.
    let command = std::iter::once("spillway".to_owned())
        .chain(std::env::args().skip(1))
        .map(|a| if a.contains(' ') { format!("'{a}'") } else { a })
        .collect::<Vec<_>>()
        .join(" ");
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => args.into_options(command).and_then(|options| {
            spillway_sim::simulate(&options, &mut io::stdout().lock())
                .map(drop)
                .map_err(|e| e.to_string())
        }),
        Command::Serve(args) => serve(args),
        Command::CheckConfig(args) => check_config(&args.file),
        Command::Proxy(args) => proxy(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// The configuration file [default: config/spillway.toml if present,
    /// else the built-in sample configuration].
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The HTTP API's address [default: the file's server.listen].
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// The Envoy rate limit service's address [default: the file's
    /// server.grpc_listen; off without one].
    #[arg(long, value_name = "ADDR")]
    grpc_listen: Option<std::net::SocketAddr>,
    /// Keep the counters in this Redis (a redis:// URL), whatever the file says.
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
}

#[derive(Debug, Args)]
struct CheckConfigArgs {
    /// The configuration file.
    file: PathBuf,
}

/// Logs to stderr; `RUST_LOG` (e.g. `debug`, `spillway_server=debug`)
/// sets the level, `info` by default.
fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| v.parse::<Targets>().ok())
        .unwrap_or_else(|| Targets::new().with_default(tracing::Level::INFO));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(io::stderr)
        .with_ansi(io::stderr().is_terminal());
    tracing_subscriber::registry().with(fmt).with(filter).init();
}

fn check_config(file: &std::path::Path) -> Result<(), String> {
    let config = spillway_server::config::Config::load(file).map_err(|e| e.to_string())?;
    println!(
        "{}: OK ({} rules)",
        file.display(),
        config.policy.rules().len()
    );
    Ok(())
}

/// The configuration `serve` and `proxy` start from: the file (found as
/// `serve` documents), with the command line's overrides.
fn load_config(
    explicit: Option<PathBuf>,
    redis: Option<String>,
) -> Result<
    (
        spillway_server::config::Config,
        Option<spillway_server::config::ConfigSource>,
    ),
    String,
> {
    use spillway_server::config::Config;
    use spillway_server::config::{ConfigSource, Overrides, SAMPLE_CONFIG, locate_config};

    if let Some(url) = &redis
        && !(url.starts_with("redis://") || url.starts_with("rediss://"))
    {
        return Err(format!("--redis: `{url}` is not a redis:// URL"));
    }
    let overrides = Overrides { redis };
    let source = locate_config(explicit).map(|path| ConfigSource {
        path,
        overrides: overrides.clone(),
    });
    let config = match &source {
        Some(source) => source.load().map_err(|e| e.to_string())?,
        None => {
            let mut config = Config::parse(SAMPLE_CONFIG)
                .map_err(|e| format!("the built-in configuration: {e}"))?;
            overrides.apply(&mut config);
            config
        }
    };
    match &source {
        Some(source) => tracing::info!("configuration: {}", source.path.display()),
        None => tracing::info!("configuration: the built-in sample (no config/spillway.toml here)"),
    }
    Ok((config, source))
}

fn proxy(args: ProxyArgs) -> Result<(), String> {
    use spillway_server::State;
    use spillway_server::proxy::{ProxyOptions, serve_with};
    use spillway_server::reload::Reloader;

    init_logging();
    let (config, source) = load_config(args.config, args.redis)?;
    let listen = args.listen.unwrap_or(config.server.listen);
    let options = ProxyOptions {
        connect_timeout: args.connect_timeout,
        response_timeout: args.upstream_timeout,
        host: args.host_header,
        normalize: config.proxy,
        write_timeout: config.server.write_timeout,
        head_timeout: config.server.head_timeout,
        idle_timeout: config.server.idle_timeout,
        max_connections: config.server.max_connections.get(),
        drain_timeout: config.server.drain_timeout,
        bounds: config.proxy_bounds,
        ..ProxyOptions::default()
    };
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let admin_listener = match args.admin_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| format!("cannot listen on {addr}: {e}"))?,
            ),
            None => None,
        };
        let state = State::new(config).await.map_err(|e| e.to_string())?;
        let reloader = Reloader::new(state.clone(), source).map_err(|e| e.to_string())?;
        // One stop for the reload watcher, the store probe and the admin
        // listener, once the proxy has drained.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = move || {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|stop| *stop).await;
            }
        };
        let watcher = tokio::spawn(reloader.watch(stopped()));
        let snapshots = state.snapshots();
        tokio::spawn(spillway_server::probe::watch_store(
            state.live.clone(),
            stopped(),
        ));
        let admin = admin_listener.map(|listener| {
            tokio::spawn(spillway_server::api::serve_admin(
                listener,
                state.clone(),
                stopped(),
            ))
        });
        let result = serve_with(
            listener,
            args.upstream,
            state.live.clone(),
            options,
            shutdown_signal(),
        )
        .await
        .map_err(|e| e.to_string());
        stop_tx.send(true).ok();
        watcher.await.ok();
        if let Some(admin) = admin {
            admin.await.ok();
        }
        // Nothing more is admitted: the last write of the state file.
        if let Some(snapshots) = snapshots {
            snapshots.finish().await;
        }
        result
    })
}

fn serve(args: ServeArgs) -> Result<(), String> {
    use spillway_server::State;

    init_logging();
    let (config, source) = load_config(args.config, args.redis)?;
    let listen = args.listen.unwrap_or(config.server.listen);
    let grpc_listen = args.grpc_listen.or(config.server.grpc_listen);
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let grpc_listener = match grpc_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| format!("cannot listen on {addr}: {e}"))?,
            ),
            None => None,
        };
        let state = State::new(config).await.map_err(|e| e.to_string())?;
        spillway_server::run(listener, grpc_listener, state, source, shutdown_signal())
            .await
            .map_err(|e| e.to_string())
    })
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: finishing the requests in flight");
}

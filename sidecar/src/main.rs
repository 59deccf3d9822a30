use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tracing_subscriber::EnvFilter;
use weir_core::scheduler::Policy;
use weir_sidecar::dispatch::Dispatcher;
use weir_sidecar::http::listener::{self, Protocols};
use weir_sidecar::http::server::{admin_router, router};
use weir_sidecar::intake::app::App;
use weir_sidecar::ledger::Ledger;
use weir_sidecar::metrics::Metrics;
use weir_sidecar::reload::{Overrides, Reloader};
use weir_sidecar::replica::discovery::{FileResolver, Resolver, SystemResolver};
use weir_sidecar::support::live::Live;

/// weir's dispatcher sidecar: fair queues in front of engine pools.
///
/// Prints `weir-sidecar listening on http://ADDR (policy P), admin on http://ADMIN` on stdout
/// once it accepts connections. Reloads its config on SIGHUP and when the file changes.
#[derive(Parser)]
#[command(name = "weir-sidecar", version)]
struct Cli {
    /// Configuration file (YAML or JSON).
    #[arg(long)]
    config: PathBuf,
    /// Overrides the config's listen address (port 0 picks a free port).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Overrides the config's admin (metrics, health) address (port 0 picks a free port).
    #[arg(long)]
    admin_listen: Option<std::net::SocketAddr>,
    /// Overrides the config's policy: `fair` or `fifo`.
    #[arg(long)]
    policy: Option<String>,
    /// Overrides the config's ledger path.
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// Resolves pools' `discovery.dns` names from this file (`NAME ADDRESS ...` lines, read at
    /// every resolution) instead of DNS: for tests and set-ups without DNS.
    #[arg(long, value_name = "FILE")]
    resolve_from: Option<PathBuf>,
}

/// After the grace period, how long the ended requests get to hand back their records.
const CUT_WAIT: Duration = Duration::from_secs(2);
/// How long the ledger may take to write what it was sent before the process exits.
const LEDGER_FLUSH_WAIT: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // Before anything else: SIGHUP's default action would end the process.
    let hangup = signal(SignalKind::hangup())
        .inspect_err(|e| tracing::warn!("no SIGHUP handler ({e}): reloads follow the file only"))
        .ok();
    let overrides = Overrides {
        listen: cli.listen,
        admin_listen: cli.admin_listen,
        policy: cli.policy,
        ledger: cli.ledger,
    };
    let config = weir_sidecar::reload::load(&cli.config, &overrides)?;
    let secrets = config
        .signing
        .as_ref()
        .map(|s| s.secrets())
        .transpose()?
        .unwrap_or_default();

    let export = (config.metrics.otlp.as_ref())
        .map(weir_sidecar::metrics::otlp::Export::start)
        .transpose()?;
    let meter = export.as_ref().map(|e| e.meter());
    let (metrics, registry) = Metrics::new(&config.metrics, meter.as_ref());
    let policy = if config.policy == "fifo" {
        Policy::Fifo
    } else {
        Policy::Fair
    };
    let (events, rx) = mpsc::unbounded_channel();
    let resolver: Arc<dyn Resolver> = match cli.resolve_from {
        Some(path) => Arc::new(FileResolver { path }),
        None => Arc::new(SystemResolver),
    };
    let mut reloader = Reloader::new(cli.config.clone(), overrides, resolver, events.clone())?;
    let plan = reloader.plan(config.clone())?;

    let dispatcher = Dispatcher::new(
        policy,
        config.fair_share,
        Vec::new(),
        config.queue.clone(),
        metrics.clone(),
        &events,
    );
    let store = config.ledger_store.as_ref();
    let ledger = Ledger::start(&config.ledger, store, metrics.ledger.clone())?;
    let (cut, cut_rx) = watch::channel(false);
    let (stop, stopping) = watch::channel(false);
    let (drain_started, draining) = watch::channel(false);
    let app = Arc::new(App {
        events: events.clone(),
        ledger_reader: weir_sidecar::ledger::Reader::open(&config.ledger, store)?,
        metrics: metrics.clone(),
        registry,
        ledger,
        pools: Live::new(plan.routes.clone()),
        exact_below_bytes: Live::new(config.estimator.exact_below_bytes),
        max_body_bytes: Live::new(config.max_body_bytes),
        // Salts are keyed with the signing secret: one secret fewer to manage, and a rotation
        // only costs one cold prefix cache.
        cache_salt_key: secrets.first().cloned().unwrap_or_default(),
        queue_deadline_ms: Live::new(config.queue.deadline_ms),
        trust: weir_sidecar::intake::trust::Trust::new(secrets),
        idempotency: weir_sidecar::intake::idempotency::Idempotency::new(
            config.idempotency.clone(),
        ),
        relay: Live::new(config.relay.clone()),
        backoff: dispatcher.backoff(),
        predictions: weir_sidecar::intake::prediction::Predictions::new(config.prediction.clone()),
        quota: config.quota.as_ref().map(|q| q.store()).transpose()?,
        cut: cut_rx,
        draining,
    });
    let (health, checks) = mpsc::unbounded_channel();
    tokio::spawn(weir_sidecar::replica::health::supervise(
        checks,
        events.clone(),
    ));
    let dispatcher = dispatcher.with_health(health);
    tokio::spawn(dispatcher.run(rx));
    // The pools, their replicas and discovery, as every later reload applies them.
    reloader.apply(plan, &app);
    let grace = reloader.shutdown_grace_ms.clone();
    tokio::spawn(reloader.watch(app.clone(), hangup));

    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let admin = tokio::net::TcpListener::bind(config.admin_listen).await?;
    println!(
        "weir-sidecar listening on http://{} (policy {}), admin on http://{}",
        listener.local_addr()?,
        config.policy,
        admin.local_addr()?
    );
    let mut api = tokio::spawn(listener::serve(
        listener,
        router(app.clone()),
        Protocols::Http1AndHttp2,
        raised(stopping.clone()),
    ));
    // The admin port serves through the drain (`/ready` says 503, `/metrics` goes on) and
    // stops with the process.
    let admin = tokio::spawn(listener::serve(
        admin,
        admin_router(app.clone()),
        Protocols::Http1,
        std::future::pending(),
    ));
    tokio::select! {
        result = &mut api => {
            result?;
            return Ok(());
        }
        () = termination() => {}
    }
    // `/ready` says 503 from now on; requests are still taken until the gateways have seen it.
    let _ = drain_started.send(true);
    tokio::time::sleep(Duration::from_millis(config.shutdown_leave_ms)).await;
    drain(
        app,
        stop,
        cut,
        api,
        admin,
        Duration::from_millis(*grace.load()),
    )
    .await;
    if let Some(export) = export {
        // The SDK's shutdown blocks while it pushes the last figures.
        let _ = tokio::task::spawn_blocking(move || export.shutdown()).await;
    }
    Ok(())
}

/// Resolves on SIGTERM (what Kubernetes sends) or SIGINT (Ctrl-C).
async fn termination() {
    let terminate = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = terminate => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Resolves once `flag` turns true.
async fn raised(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|&f| f).await;
}

/// Stops accepting connections, lets in-flight requests finish for up to `grace`, ends the rest
/// (each with its record), and flushes the ledger, so no usage record is lost on the way out.
async fn drain(
    app: Arc<App>,
    stop: watch::Sender<bool>,
    cut: watch::Sender<bool>,
    mut api: tokio::task::JoinHandle<()>,
    admin: tokio::task::JoinHandle<()>,
    grace: Duration,
) {
    tracing::info!("stopping: no new connections; in-flight requests have {grace:?} to finish");
    let _ = stop.send(true);
    if tokio::time::timeout(grace, &mut api).await.is_err() {
        tracing::warn!("grace period over: ending the requests still running");
        let _ = cut.send(true);
        if tokio::time::timeout(CUT_WAIT, &mut api).await.is_err() {
            api.abort();
        }
    }
    admin.abort();
    let flushed = tokio::task::spawn_blocking(move || app.ledger.flush(LEDGER_FLUSH_WAIT)).await;
    if !matches!(flushed, Ok(true)) {
        tracing::error!(
            "the ledger did not flush within {LEDGER_FLUSH_WAIT:?}: records may be lost"
        );
    }
}

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use prometheus_client::registry::Registry;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing_subscriber::EnvFilter;
use weir_core::scheduler::Policy;
use weir_sidecar::config::SidecarConfig as Config;
use weir_sidecar::dispatch::{Dispatcher, Event};
use weir_sidecar::http::listener::{self, Protocols};
use weir_sidecar::http::server::{admin_router, router};
use weir_sidecar::intake::app::{App, Route};
use weir_sidecar::ledger::Ledger;
use weir_sidecar::metrics::Metrics;
use weir_sidecar::reload::{Overrides, Reloader};
use weir_sidecar::replica::discovery::{FileResolver, Resolver, SystemResolver};
use weir_sidecar::support::backoff::Backoff;
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
    let (path, overrides, resolver) = cli.split();
    let config = weir_sidecar::reload::load(&path, &overrides)?;
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
    let (events, rx) = mpsc::unbounded_channel();
    let mut reloader = Reloader::new(path, overrides, resolver, events.clone())?;
    let plan = reloader.plan(config.clone())?;
    let dispatcher = dispatcher(&config, &metrics, &events);
    let (switches, heeded) = switches();
    let backoff = dispatcher.backoff();
    let records = (metrics, registry);
    let routes = plan.routes.clone();
    let app = app(
        &config,
        routes,
        secrets,
        records,
        events.clone(),
        backoff,
        heeded.app,
    )?;
    start_dispatcher(dispatcher, rx, events);
    // The pools, their replicas and discovery, as every later reload applies them.
    reloader.apply(plan, &app);
    let grace = reloader.shutdown_grace_ms.clone();
    tokio::spawn(reloader.watch(app.clone(), hangup));
    let (mut api, admin) = listen(&config, &app, heeded.stopping).await?;
    tokio::select! {
        result = &mut api => {
            result?;
            return Ok(());
        }
        () = termination() => {}
    }
    // `/ready` says 503 from now on; requests are still taken until the gateways have seen it.
    let _ = switches.drain_started.send(true);
    tokio::time::sleep(Duration::from_millis(config.shutdown_leave_ms)).await;
    let grace = Duration::from_millis(*grace.load());
    drain(app, switches, api, admin, grace).await;
    if let Some(export) = export {
        // The SDK's shutdown blocks while it pushes the last figures.
        let _ = tokio::task::spawn_blocking(move || export.shutdown()).await;
    }
    Ok(())
}

impl Cli {
    /// The config's path, what the command line overrides in it, and how pools' discovery
    /// names are resolved.
    fn split(self) -> (PathBuf, Overrides, Arc<dyn Resolver>) {
        let overrides = Overrides {
            listen: self.listen,
            admin_listen: self.admin_listen,
            policy: self.policy,
            ledger: self.ledger,
        };
        let resolver: Arc<dyn Resolver> = match self.resolve_from {
            Some(path) => Arc::new(FileResolver { path }),
            None => Arc::new(SystemResolver),
        };
        (self.config, overrides, resolver)
    }
}

/// The dispatcher, with no pools yet (the first reload plan brings them).
fn dispatcher(config: &Config, metrics: &Metrics, events: &Events) -> Dispatcher {
    let policy = if config.policy == "fifo" {
        Policy::Fifo
    } else {
        Policy::Fair
    };
    Dispatcher::new(
        policy,
        config.fair_share,
        Vec::new(),
        config.queue.clone(),
        metrics.clone(),
        events,
    )
}

/// The dispatcher's sender of events.
type Events = mpsc::UnboundedSender<Event>;

/// The switches of a shutdown, in the order they are thrown: `/ready` turns 503
/// (`drain_started`), the serving port stops taking connections (`stop`), and once the grace
/// period is over the requests still running are ended (`cut`).
struct Switches {
    drain_started: watch::Sender<bool>,
    stop: watch::Sender<bool>,
    cut: watch::Sender<bool>,
}

/// Who heeds the switches: the serving port, and the handlers (through the [`App`]).
struct Heeded {
    stopping: watch::Receiver<bool>,
    app: AppSwitches,
}

/// The switches the handlers see: the grace period over (`cut`), and the drain begun.
struct AppSwitches {
    cut: watch::Receiver<bool>,
    draining: watch::Receiver<bool>,
}

fn switches() -> (Switches, Heeded) {
    let (cut, cut_rx) = watch::channel(false);
    let (stop, stopping) = watch::channel(false);
    let (drain_started, draining) = watch::channel(false);
    let switches = Switches {
        drain_started,
        stop,
        cut,
    };
    let app = AppSwitches {
        cut: cut_rx,
        draining,
    };
    (switches, Heeded { stopping, app })
}

/// The state the handlers share, with the first reload plan's routes.
fn app(
    config: &Config,
    routes: Vec<Route>,
    secrets: Vec<Vec<u8>>,
    (metrics, registry): (Metrics, Registry),
    events: Events,
    backoff: Backoff,
    switches: AppSwitches,
) -> anyhow::Result<Arc<App>> {
    let store = config.ledger_store.as_ref();
    let ledger = Ledger::start(&config.ledger, store, metrics.ledger.clone())?;
    let approvals = weir_sidecar::approvals::Approvals::new(Default::default(), metrics.clone());
    Ok(Arc::new(App {
        events,
        ledger_reader: weir_sidecar::ledger::Reader::open(&config.ledger, store)?,
        metrics,
        registry,
        ledger,
        pools: Live::new(routes),
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
        backoff,
        predictions: weir_sidecar::intake::prediction::Predictions::new(config.prediction.clone()),
        approvals,
        quota: config.quota.as_ref().map(|q| q.store()).transpose()?,
        cut: switches.cut,
        draining: switches.draining,
    }))
}

/// Starts the dispatcher's event loop, and the health checks that report to it.
fn start_dispatcher(dispatcher: Dispatcher, rx: mpsc::UnboundedReceiver<Event>, events: Events) {
    let (health, checks) = mpsc::unbounded_channel();
    tokio::spawn(weir_sidecar::replica::health::supervise(checks, events));
    let dispatcher = dispatcher.with_health(health);
    tokio::spawn(dispatcher.run(rx));
}

/// Binds the serving and admin ports, says where (the line tests and scripts wait for), and
/// serves them.
async fn listen(
    config: &Config,
    app: &Arc<App>,
    stopping: watch::Receiver<bool>,
) -> anyhow::Result<(JoinHandle<()>, JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let admin = tokio::net::TcpListener::bind(config.admin_listen).await?;
    println!(
        "weir-sidecar listening on http://{} (policy {}), admin on http://{}",
        listener.local_addr()?,
        config.policy,
        admin.local_addr()?
    );
    let api = tokio::spawn(listener::serve(
        listener,
        router(app.clone()),
        Protocols::Http1AndHttp2,
        raised(stopping),
    ));
    // The admin port serves through the drain (`/ready` says 503, `/metrics` goes on) and
    // stops with the process.
    let admin = tokio::spawn(listener::serve(
        admin,
        admin_router(app.clone()),
        Protocols::Http1,
        std::future::pending(),
    ));
    Ok((api, admin))
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
    switches: Switches,
    mut api: JoinHandle<()>,
    admin: JoinHandle<()>,
    grace: Duration,
) {
    tracing::info!("stopping: no new connections; in-flight requests have {grace:?} to finish");
    let _ = switches.stop.send(true);
    if tokio::time::timeout(grace, &mut api).await.is_err() {
        tracing::warn!("grace period over: ending the requests still running");
        let _ = switches.cut.send(true);
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

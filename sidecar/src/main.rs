use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use clap::Parser;
use tokio::sync::mpsc;
use tracing_subscriber::EnvFilter;
use weir_core::scheduler::Policy;
use weir_sidecar::config::SidecarConfig;
use weir_sidecar::dispatcher::{Dispatcher, Event};
use weir_sidecar::ledger::Ledger;
use weir_sidecar::metrics::Metrics;
use weir_sidecar::pool::{EngineSample, Pool};
use weir_sidecar::server::{App, admin_router, router};

/// weir's dispatcher sidecar: fair queues in front of engine pools.
///
/// Prints `weir-sidecar listening on http://ADDR (policy P), admin on http://ADMIN` on stdout
/// once it accepts connections.
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
}

/// How often each replica's `/metrics` is read (it doubles as the health probe).
const PROBE_EVERY: Duration = Duration::from_millis(100);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let mut config = SidecarConfig::from_file(&cli.config)?;
    config.listen = cli.listen.unwrap_or(config.listen);
    config.admin_listen = cli.admin_listen.unwrap_or(config.admin_listen);
    config.policy = cli.policy.unwrap_or(config.policy);
    config.ledger = cli.ledger.unwrap_or(config.ledger);
    config.validate()?;

    let (metrics, registry) = Metrics::new();
    let pools: Vec<Pool> = config.pools.iter().map(Pool::new).collect();
    let configured = config
        .pools
        .iter()
        .map(|p| p.kv_tokens_per_replica.is_some())
        .collect();
    let policy = if config.policy == "fifo" {
        Policy::Fifo
    } else {
        Policy::Fair
    };
    let (events, rx) = mpsc::unbounded_channel();
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .build()?;

    for (p, pool) in pools.iter().enumerate() {
        for (r, replica) in pool.replicas.iter().enumerate() {
            tokio::spawn(probe(
                http.clone(),
                events.clone(),
                p,
                r,
                replica.url.clone(),
            ));
        }
    }
    let ledger = Ledger::start(&config.ledger)?;
    let app = Arc::new(App {
        events: events.clone(),
        ledger_reader: std::sync::Mutex::new(weir_sidecar::ledger::open(&config.ledger)?),
        http,
        metrics: metrics.clone(),
        registry,
        ledger,
        pools: config
            .pools
            .iter()
            .map(|p| (p.model.clone(), p.affinity_prefix_bytes))
            .collect(),
        cache_salt_secret: config.cache_salt_secret.clone(),
        queue_deadline_ms: config.queue.deadline_ms,
        relay: config.relay.clone(),
    });
    let dispatcher = Dispatcher::new(
        policy,
        pools,
        configured,
        config.queue.clone(),
        metrics,
        &events,
    );
    tokio::spawn(dispatcher.run(rx));

    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let admin = tokio::net::TcpListener::bind(config.admin_listen).await?;
    println!(
        "weir-sidecar listening on http://{} (policy {}), admin on http://{}",
        listener.local_addr()?,
        config.policy,
        admin.local_addr()?
    );
    // Chunks are small writes: without TCP_NODELAY, Nagle holds them for the peer's delayed ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::select! {
        result = axum::serve(listener, router(app.clone())) => result?,
        result = axum::serve(admin, admin_router(app)) => result?,
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

/// Reads a replica's metrics forever; an unreadable replica is reported unhealthy and ejected
/// until it answers again.
async fn probe(
    http: reqwest::Client,
    events: mpsc::UnboundedSender<Event>,
    pool: usize,
    replica: usize,
    url: String,
) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    loop {
        tick.tick().await;
        let read = async {
            let resp = http
                .get(format!("{url}/metrics"))
                .timeout(Duration::from_secs(1))
                .send()
                .await
                .ok()?;
            let text = resp.error_for_status().ok()?.text().await.ok()?;
            Some(EngineSample::parse(&text))
        };
        let sample = read.await;
        if events
            .send(Event::Sample {
                pool,
                replica,
                sample,
            })
            .is_err()
        {
            return;
        }
    }
}

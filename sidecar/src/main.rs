use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tracing_subscriber::EnvFilter;
use weir_core::scheduler::Policy;
use weir_sidecar::answer::{MAX_ANSWER_BYTES, read_bounded};
use weir_sidecar::config::SidecarConfig;
use weir_sidecar::dispatcher::{Dispatcher, Event};
use weir_sidecar::engine::{Dialect, EngineChoice, EngineLimits, EngineSample};
use weir_sidecar::isolation_probe::Prober;
use weir_sidecar::ledger::Ledger;
use weir_sidecar::metrics::Metrics;
use weir_sidecar::pool::Pool;
use weir_sidecar::server::{App, PoolRoute, admin_router, router};

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
    let mut config = SidecarConfig::from_file(&cli.config)?;
    config.listen = cli.listen.unwrap_or(config.listen);
    config.admin_listen = cli.admin_listen.unwrap_or(config.admin_listen);
    config.policy = cli.policy.unwrap_or(config.policy);
    config.ledger = cli.ledger.unwrap_or(config.ledger);
    config.validate()?;
    let secrets = config
        .signing
        .as_ref()
        .map(|s| s.secrets())
        .transpose()?
        .unwrap_or_default();

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

    for (p, (pool, pool_config)) in pools.iter().zip(&config.pools).enumerate() {
        for (r, replica) in pool.replicas.iter().enumerate() {
            let isolation = Prober::new(
                http.clone(),
                replica.url.clone(),
                pool.model.clone(),
                pool_config.cache_isolation,
            );
            tokio::spawn(probe(
                http.clone(),
                events.clone(),
                p,
                r,
                replica.url.clone(),
                pool_config.engine,
                isolation,
            ));
        }
    }
    let ledger = Ledger::start(&config.ledger, metrics.ledger.clone())?;
    let (cut, cut_rx) = watch::channel(false);
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
            .map(|p| PoolRoute {
                model: p.model.clone(),
                affinity_prefix_bytes: p.affinity_prefix_bytes,
                encoding: p.encoding,
            })
            .collect(),
        exact_below_bytes: config.estimator.exact_below_bytes,
        max_body_bytes: config.max_body_bytes,
        // Salts are keyed with the signing secret: one secret fewer to manage, and a rotation
        // only costs one cold prefix cache.
        cache_salt_key: secrets.first().cloned().unwrap_or_default(),
        queue_deadline_ms: config.queue.deadline_ms,
        trust: weir_sidecar::trust::Trust::new(secrets),
        idempotency: weir_sidecar::idempotency::Idempotency::new(config.idempotency.clone()),
        relay: config.relay.clone(),
        cut: cut_rx,
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
    let (stop, stopping) = watch::channel(false);
    let mut api = tokio::spawn(
        axum::serve(listener, router(app.clone()))
            .with_graceful_shutdown(raised(stopping.clone()))
            .into_future(),
    );
    let admin = tokio::spawn(
        axum::serve(admin, admin_router(app.clone()))
            .with_graceful_shutdown(raised(stopping))
            .into_future(),
    );
    tokio::select! {
        result = &mut api => {
            result??;
            return Ok(());
        }
        () = termination() => {}
    }
    drain(
        app,
        stop,
        cut,
        api,
        admin,
        Duration::from_millis(config.shutdown_grace_ms),
    )
    .await;
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
    mut api: tokio::task::JoinHandle<std::io::Result<()>>,
    admin: tokio::task::JoinHandle<std::io::Result<()>>,
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

/// Reads a replica's metrics forever; an unreadable replica is reported unhealthy and ejected
/// until it answers again. When it joins (answers after unknown or unreachable), what its
/// engine says of its limits is read first ([`Event::Joined`]), so it never admits more than
/// the engine's slots, and its prefix-cache isolation is probed before it gets work.
async fn probe(
    http: reqwest::Client,
    events: mpsc::UnboundedSender<Event>,
    pool: usize,
    replica: usize,
    url: String,
    engine: EngineChoice,
    mut isolation: Prober,
) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    // An isolation probe takes a while: no burst of catch-up reads after it.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut joined = false;
    // Odd engine output is logged once per replica, not ten times a second.
    let mut warned = false;
    loop {
        tick.tick().await;
        let sample = match get_text(&http, &format!("{url}/metrics")).await {
            None => {
                joined = false;
                None
            }
            Some(text) => {
                let dialect = engine.dialect(&text);
                if !joined {
                    let limits = read_limits(&http, &url, dialect).await;
                    tracing::info!(
                        replica = %url,
                        engine = dialect.map_or("unknown", Dialect::name),
                        concurrency = ?limits.max_concurrency,
                        kv_tokens = ?limits.kv_tokens,
                        "replica joined"
                    );
                    if events
                        .send(Event::Joined {
                            pool,
                            replica,
                            limits,
                        })
                        .is_err()
                    {
                        return;
                    }
                    joined = true;
                }
                Some(match dialect {
                    Some(dialect) => dialect.parse(&text, |line| {
                        if !std::mem::replace(&mut warned, true) {
                            tracing::warn!(replica = %url, "ignoring a metrics line weir cannot read: {line:.200}");
                        }
                    }),
                    None => {
                        if !std::mem::replace(&mut warned, true) {
                            tracing::warn!(replica = %url, "no metrics of a known engine: admitted by its concurrency limit alone");
                        }
                        EngineSample::default()
                    }
                })
            }
        };
        let healthy = sample.is_some();
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
        if let Some(isolation) = isolation.after_sample(healthy).await
            && events
                .send(Event::Isolated {
                    pool,
                    replica,
                    isolation,
                })
                .is_err()
        {
            return;
        }
    }
}

/// A successful answer's text, within a second and [`MAX_ANSWER_BYTES`].
async fn get_text(http: &reqwest::Client, url: &str) -> Option<String> {
    let resp = http
        .get(url)
        .timeout(Duration::from_secs(1))
        .send()
        .await
        .ok()?;
    let body = read_bounded(resp.error_for_status().ok()?, MAX_ANSWER_BYTES).await?;
    Some(String::from_utf8_lossy(&body).into_owned())
}

/// What a replica's engine says of its limits: nothing for engines that do not say, or that
/// say it in a way weir cannot read (logged).
async fn read_limits(http: &reqwest::Client, url: &str, dialect: Option<Dialect>) -> EngineLimits {
    let Some((dialect, path)) = dialect.and_then(|d| Some((d, d.limits_path()?))) else {
        return EngineLimits::default();
    };
    let limits = get_text(http, &format!("{url}{path}"))
        .await
        .and_then(|body| dialect.parse_limits(&body));
    limits.unwrap_or_else(|| {
        tracing::warn!(replica = %url, "no concurrency limit readable at {path}: the configured or adaptive limit holds");
        EngineLimits::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-shot engine that answers any request with `len` bytes of metric comments.
    async fn engine_answering(len: usize) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let mut request = [0u8; 4096];
            let _ = conn.read(&mut request).await;
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
            let _ = conn.write_all(head.as_bytes()).await;
            let line = b"# filler\n".repeat(1 << 16);
            let mut sent = 0;
            while sent < len {
                let n = line.len().min(len - sent);
                if conn.write_all(&line[..n]).await.is_err() {
                    return;
                }
                sent += n;
            }
        });
        url
    }

    #[tokio::test]
    async fn an_engine_s_oversized_answer_is_not_read_whole() {
        let http = reqwest::Client::new();
        let small = engine_answering(1_000).await;
        assert_eq!(get_text(&http, &small).await.map(|t| t.len()), Some(1_000));
        let huge = engine_answering(256 << 20).await;
        assert_eq!(get_text(&http, &huge).await.map(|t| t.len()), None);
    }
}

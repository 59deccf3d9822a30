//! Live reload: the config is read again on SIGHUP and whenever its file — or a CA or
//! credential file it names — changes (modification time, size or inode, checked every
//! `reload.poll_ms`; a Kubernetes ConfigMap or Secret update swaps the file under its path,
//! which this sees), and applied without a restart and
//! without losing state: queued and running requests go on, fairness counters, idempotency
//! claims, replicas' limits and the ledger stay.
//!
//! What changes live, for the next decision: the queue's bounds and deadlines, the relay's
//! timeouts, `max_body_bytes`, the estimator, the shutdown grace period, the poll interval, and
//! pools — added (their replicas
//! join as any replica does: probed before they get work), removed (they take no new requests;
//! their replicas leave once the requests queued for them are done), or changed (replicas
//! listed or discovered, affinity, KV budget, concurrency limit, engine dialect, cache
//! isolation, CA file, credential; files are read again at every reload).
//!
//! What needs a restart, and is logged as such when a reload changes it: `listen`,
//! `admin_listen` (sockets bound at start-up), `ledger` (the file records are appended to),
//! `policy` (the schedulers' order, with requests in them), `signing` (the secrets in use, and
//! the prefix-cache salts keyed with them), `idempotency` (the claims' memory bounds),
//! `quota` (the store's connection), `metrics` (the labels' depth, the fairness window and the
//! OTLP exporter, set up with the instruments) and `shutdown_leave_ms` (read when the drain is
//! set up).
//!
//! A config that does not parse or validate, or whose files cannot be read, is logged with the
//! field it is in and not applied: the running config stays, whole.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::signal::unix::Signal;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use weir_core::tokens::Encoding;

use crate::config::{DiscoveryConfig, SidecarConfig};
use crate::dispatch::{Event, PoolSpec};
use crate::intake::app::{App, Route};
use crate::replica::discovery::Resolver;
use crate::replica::upstream::Upstream;
use crate::support::live::Live;

/// Command-line settings that hold over the file's, at start-up and at every reload.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub listen: Option<std::net::SocketAddr>,
    pub admin_listen: Option<std::net::SocketAddr>,
    pub policy: Option<String>,
    pub ledger: Option<PathBuf>,
}

/// Reads, overrides and validates the config at `path`.
pub fn load(path: &Path, overrides: &Overrides) -> anyhow::Result<SidecarConfig> {
    let mut config = SidecarConfig::from_file(path)?;
    config.listen = overrides.listen.unwrap_or(config.listen);
    config.admin_listen = overrides.admin_listen.unwrap_or(config.admin_listen);
    if let Some(policy) = &overrides.policy {
        config.policy = policy.clone();
    }
    if let Some(ledger) = &overrides.ledger {
        config.ledger = ledger.clone();
    }
    config.validate()?;
    Ok(config)
}

/// A config ready to apply: its files read, its pools numbered.
pub struct Plan {
    pub config: SidecarConfig,
    pub routes: Vec<Route>,
    pools: Vec<PoolSpec>,
    /// Every model that has had a pool, by index.
    models: Vec<String>,
}

/// The settings that need a restart that differ between `old` and `new`.
pub fn restart_only_changes(old: &SidecarConfig, new: &SidecarConfig) -> Vec<&'static str> {
    let mut changed = Vec::new();
    if old.listen != new.listen {
        changed.push("listen");
    }
    if old.admin_listen != new.admin_listen {
        changed.push("admin_listen");
    }
    if old.ledger != new.ledger {
        changed.push("ledger");
    }
    if old.ledger_store != new.ledger_store {
        changed.push("ledger_store");
    }
    if old.policy != new.policy {
        changed.push("policy");
    }
    if old.fair_share != new.fair_share {
        changed.push("fair_share");
    }
    if old.signing != new.signing {
        changed.push("signing");
    }
    if old.idempotency != new.idempotency {
        changed.push("idempotency");
    }
    if old.shutdown_leave_ms != new.shutdown_leave_ms {
        changed.push("shutdown_leave_ms");
    }
    if old.metrics != new.metrics {
        changed.push("metrics");
    }
    if old.quota != new.quota {
        changed.push("quota");
    }
    changed
}

/// Applies configs to the running sidecar: the first at start-up, then each reload.
pub struct Reloader {
    path: PathBuf,
    overrides: Overrides,
    /// The config in force.
    applied: Option<SidecarConfig>,
    models: Vec<String>,
    discovery: HashMap<usize, (DiscoveryConfig, JoinHandle<()>)>,
    resolver: Arc<dyn Resolver>,
    /// The client of pools without a CA file of their own.
    shared: reqwest::Client,
    events: mpsc::UnboundedSender<Event>,
    /// Read when the sidecar stops.
    pub shutdown_grace_ms: Arc<Live<u64>>,
}

impl Reloader {
    pub fn new(
        path: PathBuf,
        overrides: Overrides,
        resolver: Arc<dyn Resolver>,
        events: mpsc::UnboundedSender<Event>,
    ) -> anyhow::Result<Reloader> {
        Ok(Reloader {
            path,
            overrides,
            applied: None,
            models: Vec::new(),
            discovery: HashMap::new(),
            resolver,
            shared: crate::replica::upstream::client(None)?,
            events,
            shutdown_grace_ms: Arc::new(Live::new(0)),
        })
    }

    /// Reads the pools' files (CA, credential) and numbers them; errors name the field.
    pub fn plan(&self, config: SidecarConfig) -> anyhow::Result<Plan> {
        let mut models = self.models.clone();
        let mut routes = Vec::new();
        let mut pools = Vec::new();
        for (i, pool) in config.pools.iter().enumerate() {
            let index = match models.iter().position(|m| *m == pool.model) {
                Some(index) => index,
                None => {
                    models.push(pool.model.clone());
                    models.len() - 1
                }
            };
            let upstream = Upstream::of(pool, &self.shared, &format!("pools[{i}]"))?;
            // Load the vocabulary now (tens of milliseconds, once per encoding and process),
            // not on the pool's first requests, which would wait for it.
            if pool.encoding.bpe().is_err() {
                anyhow::bail!(
                    "pools[{i}].encoding: the {:?} vocabulary did not load",
                    pool.encoding
                );
            }
            routes.push(Route {
                model: pool.model.clone(),
                pool: index,
                affinity_prefix_bytes: pool.affinity_prefix_bytes,
                encoding: pool.encoding,
            });
            pools.push(PoolSpec {
                index,
                config: pool.clone(),
                upstream,
            });
        }
        Ok(Plan {
            config,
            routes,
            pools,
            models,
        })
    }

    /// Puts `plan` in force: the dispatcher's pools and queue bounds first (so a request routed
    /// to a new pool finds it), then what the handlers read, then the discovery tasks.
    pub fn apply(&mut self, plan: Plan, app: &App) {
        let Plan {
            config,
            routes,
            pools,
            models,
        } = plan;
        let mut wanted: HashMap<usize, DiscoveryConfig> = HashMap::new();
        for spec in &pools {
            if let Some(d) = &spec.config.discovery {
                wanted.insert(spec.index, d.clone());
            }
        }
        let _ = self.events.send(Event::Configure {
            queue: config.queue.clone(),
            pools,
        });
        app.pools.store(routes);
        app.queue_deadline_ms.store(config.queue.deadline_ms);
        app.relay.store(config.relay.clone());
        app.predictions.config.store(config.prediction.clone());
        app.max_body_bytes.store(config.max_body_bytes);
        app.exact_below_bytes
            .store(config.estimator.exact_below_bytes);
        self.shutdown_grace_ms.store(config.shutdown_grace_ms);
        self.discovery.retain(|index, (spec, task)| {
            let keep = wanted.get(index) == Some(spec);
            if !keep {
                task.abort();
            }
            keep
        });
        for (index, spec) in wanted {
            if self.discovery.contains_key(&index) {
                continue;
            }
            let task = tokio::spawn(crate::replica::discovery::run(
                self.resolver.clone(),
                index,
                spec.clone(),
                self.events.clone(),
            ));
            self.discovery.insert(index, (spec, task));
        }
        self.models = models;
        self.applied = Some(config);
    }

    /// Reads the file and plans it. The pools' vocabularies load on a blocking thread first:
    /// the first load of one parses megabytes (64 ms for cl100k_base in a release build, more
    /// for o200k_base), a stall of every task on the runtime's worker were it done there.
    async fn prepare(&self) -> anyhow::Result<Plan> {
        let config = load(&self.path, &self.overrides)?;
        let encodings: Vec<Encoding> = config.pools.iter().map(|p| p.encoding).collect();
        let loaded = tokio::task::spawn_blocking(move || {
            for encoding in encodings {
                let _ = encoding.bpe();
            }
        });
        // A load that failed fails the plan, which names the pool.
        let _ = loaded.await;
        self.plan(config)
    }

    /// Reads the file again and applies it, or logs why not and keeps the config in force.
    pub async fn reload(&mut self, app: &App, why: &str) {
        let plan = match self.prepare().await {
            Ok(plan) => plan,
            Err(e) => {
                tracing::error!(
                    config = %self.path.display(),
                    "config not reloaded ({why}): {e:#}; the config in force stays"
                );
                return;
            }
        };
        if let Some(old) = &self.applied {
            for field in restart_only_changes(old, &plan.config) {
                tracing::warn!(
                    config = %self.path.display(),
                    "{field} changed: it takes effect at the next restart, not now"
                );
            }
        }
        let pools = plan.routes.len();
        self.apply(plan, app);
        tracing::info!(config = %self.path.display(), pools, "config reloaded ({why})");
    }

    /// The files whose changes reload the config: the file itself, and the CA and credential
    /// files its pools name (a rotated secret is mounted anew).
    fn watched(&self) -> Vec<(PathBuf, Stamp)> {
        let pools = self.applied.iter().flat_map(|c| &c.pools);
        let files = pools.flat_map(|p| {
            let ca = p.tls.as_ref().and_then(|t| t.ca_file.as_deref());
            let credential = p.credential.as_ref().and_then(|c| c.file.as_deref());
            [ca, credential]
        });
        std::iter::once(self.path.as_path())
            .chain(files.flatten())
            .map(|p| (p.to_owned(), Stamp::of(p)))
            .collect()
    }

    /// Reloads on SIGHUP and when the file (or one it names) changes, for ever.
    pub async fn watch(mut self, app: Arc<App>, mut hangup: Option<Signal>) {
        let mut seen = self.watched();
        loop {
            let poll_ms = self.applied.as_ref().map_or(0, |c| c.reload.poll_ms);
            let hup = async {
                match &mut hangup {
                    Some(signal) => signal.recv().await,
                    None => std::future::pending().await,
                }
            };
            let poll = async {
                if poll_ms == 0 {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(poll_ms)).await;
            };
            let why = tokio::select! {
                signal = hup => {
                    if signal.is_none() {
                        hangup = None;
                        continue;
                    }
                    "SIGHUP"
                }
                () = poll => {
                    if self.watched() == seen {
                        continue;
                    }
                    "a file changed"
                }
            };
            // Taken before reading: a change made while reading is seen at the next poll.
            let before = self.watched();
            self.reload(&app, why).await;
            // The files the config now names, as they were before reading where known.
            seen = self
                .watched()
                .into_iter()
                .map(
                    |(path, now)| match before.iter().position(|(p, _)| *p == path) {
                        Some(i) => (path, before[i].1),
                        None => (path, now),
                    },
                )
                .collect();
        }
    }
}

/// What tells a file changed: modification time, size and inode (an editor or a ConfigMap
/// update may replace it rather than write it).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Stamp(Option<(SystemTime, u64, u64)>);

impl Stamp {
    fn of(path: &Path) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp(
            std::fs::metadata(path)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len(), m.ino()))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> SidecarConfig {
        let config = SidecarConfig::parse(json, true).unwrap();
        config.validate().unwrap();
        config
    }

    const BASE: &str = r#"{"signing": {"secret_env": "X"}, "pools": [
        {"model": "a", "replicas": ["http://a"]}, {"model": "b", "replicas": ["http://b"]}]}"#;

    #[test]
    fn a_model_keeps_its_pool_index_across_reloads() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let mut reloader = Reloader::new(
            "unused".into(),
            Overrides::default(),
            Arc::new(crate::replica::discovery::SystemResolver),
            tx,
        )
        .unwrap();
        let first = reloader.plan(config(BASE)).unwrap();
        let indices = |plan: &Plan| -> Vec<(String, usize)> {
            plan.routes
                .iter()
                .map(|r| (r.model.clone(), r.pool))
                .collect()
        };
        assert_eq!(indices(&first), [("a".into(), 0), ("b".into(), 1)]);
        reloader.models = first.models;
        // b removed, c added, a moved to the end: a keeps 0, c gets 2, b's 1 stays b's.
        let next = config(
            r#"{"signing": {"secret_env": "X"}, "pools": [
            {"model": "c", "replicas": ["http://c"]}, {"model": "a", "replicas": ["http://a"]}]}"#,
        );
        let second = reloader.plan(next).unwrap();
        assert_eq!(indices(&second), [("c".into(), 2), ("a".into(), 0)]);
        reloader.models = second.models;
        let back = reloader.plan(config(BASE)).unwrap();
        assert_eq!(indices(&back), [("a".into(), 0), ("b".into(), 1)]);
    }

    #[test]
    fn a_pool_whose_files_cannot_be_read_fails_the_plan_with_its_field() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let reloader = Reloader::new(
            "unused".into(),
            Overrides::default(),
            Arc::new(crate::replica::discovery::SystemResolver),
            tx,
        )
        .unwrap();
        let missing = config(
            r#"{"signing": {"secret_env": "X"}, "pools": [{"model": "a", "replicas": ["http://a"]},
            {"model": "b", "replicas": ["https://b"], "tls": {"ca_file": "/surely/not/here.pem"}}]}"#,
        );
        let error = format!("{:#}", reloader.plan(missing).err().unwrap());
        assert!(error.contains("pools[1].tls.ca_file"), "{error}");
        let unset = config(
            r#"{"signing": {"secret_env": "X"}, "pools": [{"model": "a", "replicas": ["http://a"],
            "credential": {"env": "WEIR_TEST_SURELY_UNSET_TOKEN"}}]}"#,
        );
        let error = format!("{:#}", reloader.plan(unset).err().unwrap());
        assert!(error.contains("pools[0].credential.env"), "{error}");
    }

    /// A reload that brings in a vocabulary not loaded yet (o200k_base: no other test of this
    /// binary loads it) leaves the runtime's thread free while it loads: a task ticking every
    /// 5 ms on it is never held up for long.
    #[tokio::test]
    async fn a_vocabulary_loads_off_the_runtime() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let dir = std::env::temp_dir().join(format!("weir-vocab-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sidecar.json");
        std::fs::write(
            &path,
            r#"{"signing": {"secret_env": "X"}, "pools": [
            {"model": "a", "replicas": ["http://a"], "encoding": "o200k_base"}]}"#,
        )
        .unwrap();
        let (tx, _rx) = mpsc::unbounded_channel();
        let reloader = Reloader::new(
            path,
            Overrides::default(),
            Arc::new(crate::replica::discovery::SystemResolver),
            tx,
        )
        .unwrap();
        let longest_us = Arc::new(AtomicU64::new(0));
        let ticker = tokio::spawn({
            let longest_us = longest_us.clone();
            async move {
                loop {
                    let before = std::time::Instant::now();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let waited = before.elapsed().as_micros() as u64;
                    longest_us.fetch_max(waited, Ordering::Relaxed);
                }
            }
        });
        tokio::task::yield_now().await;
        assert!(reloader.prepare().await.is_ok());
        tokio::time::sleep(Duration::from_millis(20)).await;
        ticker.abort();
        let longest = Duration::from_micros(longest_us.load(Ordering::Relaxed));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            longest < Duration::from_millis(100),
            "the runtime stalled {longest:?}"
        );
    }

    #[test]
    fn settings_that_need_a_restart_are_named() {
        let old = config(BASE);
        let mut new = old.clone();
        assert!(restart_only_changes(&old, &new).is_empty());
        new.queue.max_total = 1;
        new.relay.first_byte_ms = 5;
        new.prediction.quantile = 0.95;
        assert!(restart_only_changes(&old, &new).is_empty(), "live settings");
        new.listen = "127.0.0.1:1".parse().unwrap();
        new.policy = "fifo".into();
        new.signing = None;
        new.shutdown_leave_ms = 1000;
        assert_eq!(
            restart_only_changes(&old, &new),
            ["listen", "policy", "signing", "shutdown_leave_ms"]
        );
    }

    #[test]
    fn an_invalid_config_names_the_field_it_is_in() {
        let error = SidecarConfig::parse(
            r#"{"pools": [{"model": "a", "replicas": ["http://a"]}], "queue": {"max_total": "many"}}"#,
            true,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            error.starts_with("queue.max_total: must be a non-negative integer, not \"many\""),
            "{error}"
        );
        let yaml = "pools:\n  - model: a\n    replicas: [http://a]\n    credential: sk-inline\n";
        let error = SidecarConfig::parse(yaml, false).err().unwrap().to_string();
        assert!(error.starts_with("pools[0].credential: "), "{error}");
        assert!(!error.contains("sk-inline"), "{error}");
    }

    #[test]
    fn a_file_replaced_or_rewritten_has_a_new_stamp() {
        let dir = std::env::temp_dir().join(format!("weir-stamp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.yaml");
        assert_eq!(Stamp::of(&path), Stamp(None));
        std::fs::write(&path, "a").unwrap();
        let first = Stamp::of(&path);
        assert_eq!(first, Stamp::of(&path));
        let next = dir.join("c.yaml.new");
        std::fs::write(&next, "b").unwrap();
        std::fs::rename(&next, &path).unwrap();
        assert_ne!(first, Stamp::of(&path), "replaced: another inode");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

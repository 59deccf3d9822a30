//! The sidecar's configuration file (YAML or JSON).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Deserialize;

pub mod credential;
pub mod engine;
pub mod idempotency;
pub mod ledger;
pub mod metrics;
pub mod quota;

use credential::CredentialConfig;
use engine::{CacheIsolation, EngineChoice, EngineShare};
use idempotency::IdempotencyConfig;
use ledger::LedgerStoreConfig;
use metrics::MetricsConfig;
use quota::QuotaConfig;
pub use weir_core::config::EstimatorConfig;
pub use weir_core::prediction::PredictionConfig;
use weir_core::scheduler::Share;
use weir_core::tokens::Encoding;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarConfig {
    /// Where Envoy sends filtered requests: the inference API and nothing else.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Metrics (`/metrics`) and the probes' health check (`/health`): every tenant's figures,
    /// so on an address the gateway never routes to (loopback by default; scrape it from the pod).
    #[serde(default = "default_admin_listen")]
    pub admin_listen: SocketAddr,
    /// `fair` (virtual token counter) or `fifo` (the benchmark baseline).
    #[serde(default = "default_policy")]
    pub policy: String,
    /// `hierarchy`: a pool is shared among orgs by weight, an org's share among its workspaces,
    /// and so on down to keys. `key`: among keys, each on its own (an org's share grows with
    /// the keys it mints).
    #[serde(default)]
    pub fair_share: Share,
    #[serde(default)]
    pub queue: QueueConfig,
    #[serde(default)]
    pub relay: RelayConfig,
    /// On SIGTERM or SIGINT: how long in-flight requests may run on (no new connections are
    /// accepted) before the rest are ended, each with its ledger record.
    #[serde(default = "default_shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// On SIGTERM, how long the sidecar goes on accepting requests while `/ready` already
    /// answers 503, before it stops accepting and the grace period starts: time for gateways
    /// that health-check it (several sidecars per pool) to take it out of their ring, so no
    /// request meets a closed port. 0 (default) where the platform does that first (a
    /// Kubernetes `preStop` sleep). Read at start-up.
    #[serde(default)]
    pub shutdown_leave_ms: u64,
    #[serde(default = "default_ledger")]
    pub ledger: PathBuf,
    /// The ledger on PostgreSQL, behind a local spool; `ledger` (SQLite) when unset.
    #[serde(default)]
    pub ledger_store: Option<LedgerStoreConfig>,
    pub pools: Vec<PoolConfig>,
    /// The secrets the filter's signatures are checked with. Required: without them the
    /// sidecar would serve whatever a workload that reaches its port claims to be.
    #[serde(default)]
    pub signing: Option<SigningConfig>,
    /// Deduplication by `Idempotency-Key`: how completed responses are kept for replay.
    #[serde(default)]
    pub idempotency: IdempotencyConfig,
    /// How a request's prompt is counted for fair-share charges and KV admission until the
    /// engine reports its own count (the filter's rule: see its `estimator`).
    #[serde(default)]
    pub estimator: EstimatorConfig,
    /// Request bodies larger than this are refused (413); above the filter's `max_body_bytes`
    /// (4 MiB by default).
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// The tenant labels' depth, the fairness window, OTLP export ([`crate::metrics`]).
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// How the config file is watched for changes ([`crate::reload`]).
    #[serde(default)]
    pub reload: ReloadConfig,
    /// How much output KV admission holds for a request beyond its prompt
    /// ([`crate::intake::prediction`]).
    #[serde(default)]
    pub prediction: PredictionConfig,
    /// The quota service for fleet-wide limits ([`crate::quota`]); without it the lease
    /// endpoint answers 404.
    #[serde(default)]
    pub quota: Option<QuotaConfig>,
}

/// Live reload: the config is read again on SIGHUP and whenever the file changes.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ReloadConfig {
    /// How often the file's modification time is checked; 0: on SIGHUP only.
    pub poll_ms: u64,
}

impl Default for ReloadConfig {
    fn default() -> Self {
        ReloadConfig { poll_ms: 1_000 }
    }
}

fn default_max_body_bytes() -> usize {
    8 * 1024 * 1024
}

/// Where the signing secrets are read from: a file and/or an environment variable for the
/// current secret, and optionally for the previous one (accepted too, during a rotation).
/// Never inline in the config.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SigningConfig {
    pub secret_file: Option<PathBuf>,
    pub secret_env: Option<String>,
    pub previous_secret_file: Option<PathBuf>,
    pub previous_secret_env: Option<String>,
}

impl SigningConfig {
    /// The accepted secrets, current first. Each passes
    /// [`weir_core::signature::check_secret`] (long enough, not a placeholder); surrounding
    /// whitespace (a file's final newline) is not part of it.
    pub fn secrets(&self) -> anyhow::Result<Vec<Vec<u8>>> {
        let current = read_secret(
            "signing.secret",
            self.secret_file.as_deref(),
            self.secret_env.as_deref(),
        )?
        .context("signing: set secret_file or secret_env")?;
        let previous = read_secret(
            "signing.previous_secret",
            self.previous_secret_file.as_deref(),
            self.previous_secret_env.as_deref(),
        )?;
        Ok([Some(current), previous].into_iter().flatten().collect())
    }
}

fn read_secret(
    field: &str,
    file: Option<&Path>,
    env: Option<&str>,
) -> anyhow::Result<Option<Vec<u8>>> {
    let text = match (file, env) {
        (Some(_), Some(_)) => bail!("{field}_file and {field}_env: set one, not both"),
        (Some(path), None) => std::fs::read_to_string(path)
            .with_context(|| format!("{field}_file: reading {}", path.display()))?,
        (None, Some(var)) => {
            std::env::var(var).with_context(|| format!("{field}_env: ${var} is not set"))?
        }
        (None, None) => return Ok(None),
    };
    let secret = text.trim().as_bytes().to_vec();
    if let Err(problem) = weir_core::signature::check_secret(&secret) {
        bail!("{field}: the secret {problem}");
    }
    Ok(Some(secret))
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Requests one tenant may have waiting; more get 429 at once.
    pub max_per_tenant: usize,
    /// Requests one org may have waiting under all its keys: an org cannot fill the queue
    /// for everyone by minting keys.
    pub max_per_org: usize,
    /// Requests waiting in total; more get 429 at once.
    pub max_total: usize,
    /// How long a request may wait for dispatch, counted from when its body has come (the
    /// filter sends the headers on before it).
    pub deadline_ms: u64,
    /// A batch request waiting this long goes ahead of interactive work.
    pub batch_aging_ms: u64,
    /// Past this share of `max_total` queued, free-tier requests are shed (429) before anyone
    /// else's: the cheapest work goes first when the pool is overloaded.
    pub shed_free_tier_above: f64,
    /// Share of a pool's KV, and of its slots (rounded up), no single tenant may take while
    /// other tenants are active, so a newcomer's request finds room at once instead of waiting
    /// for a flood to drain.
    pub kv_headroom: f64,
    /// A tenant counts as active this long after its last request arrived.
    pub active_window_ms: u64,
    /// The longest `Retry-After` a refusal gives (it is drawn around the pool's projected wait).
    pub retry_after_max_ms: u64,
    /// Interactive work that has waited this long for room in a pool that has none preempts
    /// running batch streams to make it (invariant 7; see the README's "Preemption"); 0: never.
    pub preempt_batch_after_ms: u64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            max_per_tenant: 256,
            max_per_org: 1024,
            max_total: 4096,
            deadline_ms: 30_000,
            batch_aging_ms: 30_000,
            shed_free_tier_above: 0.5,
            kv_headroom: 0.2,
            active_window_ms: 10_000,
            retry_after_max_ms: 60_000,
            preempt_batch_after_ms: 500,
        }
    }
}

/// How long a stream may hold a replica for a client: a client that stops reading (or reads a
/// byte every few minutes) must not pin the engine's KV forever.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Longest a streamed chunk may wait for the client to take it; then the stream is ended.
    pub client_stall_ms: u64,
    /// Longest a stream may last from dispatch, however fast it is read.
    pub max_stream_ms: u64,
    /// Longest an engine may take, from dispatch, to send its response headers, and for a
    /// non-streamed request its whole answer: an engine that accepts a request and goes silent
    /// must not hold the replica for ever.
    pub max_response_ms: u64,
    /// Longest an engine may take, from dispatch, to start a stream (its first body bytes):
    /// past it the request is cancelled upstream and answered 503 `first_byte_deadline`, and
    /// the replica's concurrency limit drops. A stream's first bytes come once the engine has
    /// prefilled the prompt, so this bounds the longest prefill too.
    pub first_byte_ms: u64,
    /// Most bytes of a non-streamed answer (an error's too) the sidecar reads: it holds one
    /// whole to parse its usage and answer the caller, so a misbehaving engine, or a batch of
    /// embeddings too large, must not grow the sidecar until it is killed. Past it the caller
    /// gets 502 `response_too_large`.
    pub max_response_bytes: usize,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            client_stall_ms: 30_000,
            max_stream_ms: 30 * 60_000,
            max_response_ms: 30 * 60_000,
            first_byte_ms: 30_000,
            max_response_bytes: 64 << 20,
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub model: String,
    /// Replicas by URL (`http://10.0.0.5:8000`, `https://api.example.com`).
    #[serde(default)]
    pub replicas: Vec<String>,
    /// Replicas found in DNS (a Kubernetes headless Service), besides `replicas`.
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    /// HTTPS to the pool's replicas: a CA of its own, besides the platform's trusted roots.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// The token weir sends the pool's replicas (`Authorization: Bearer`), from a file or the
    /// environment, never inline.
    #[serde(default)]
    pub credential: Option<CredentialConfig>,
    /// KV tokens each replica holds; read from the engine's `vllm:cache_config_info` if unset.
    #[serde(default)]
    pub kv_tokens_per_replica: Option<u64>,
    /// Above this KV usage (0–1) the prefix-affine replica is passed over for the least loaded.
    #[serde(default = "default_affinity_threshold")]
    pub affinity_load_threshold: f64,
    /// Leading prompt bytes hashed (with the tenant) to pick the affine replica.
    #[serde(default = "default_affinity_prefix")]
    pub affinity_prefix_bytes: usize,
    /// The most requests each replica runs at once when its engine does not say (llama.cpp
    /// and SGLang do; vLLM and TGI do not): set it to the engine's `--max-num-seqs` or batch
    /// size. Unset, the adaptive limit alone holds, from 16 up to 1024.
    #[serde(default)]
    pub max_concurrency_per_replica: Option<u64>,
    /// `true` (default): each replica's limit adapts under the engine's (or configured) one, to
    /// the engine's queue or, for an engine that reports none, its time to first byte and
    /// goodput ([`crate::replica::limiter`]). `false`: it holds at that one (16 where neither names one).
    #[serde(default = "adaptive_by_default")]
    pub adaptive_concurrency: bool,
    /// The engine's metric dialect: `auto` (detected from `/metrics`), `vllm`, `sglang`,
    /// `llamacpp` or `tgi`.
    #[serde(default)]
    pub engine: EngineChoice,
    /// The old name of `max_concurrency_per_replica`, which now holds whatever the KV figures
    /// say: refused with a message saying so, so no config changes meaning silently.
    #[serde(default)]
    pub max_in_flight_without_kv: Option<serde::de::IgnoredAny>,
    /// `probe` (default): each replica is probed for how its prefix cache can be kept per
    /// tenant, and gets no traffic until it is, nor if it cannot be. `shared`: not probed; the
    /// pool's tenants may share its replicas' prefix caches.
    #[serde(default)]
    pub cache_isolation: CacheIsolation,
    /// The model's tokenizer, for counting prompts until the engine reports its own count.
    #[serde(default)]
    pub encoding: Encoding,
    /// How many sidecars front these replicas, this one included (several sidecars per pool,
    /// each org on one): each admits against `1/sidecars` of every replica's KV and
    /// concurrency ([`crate::replica::share`]).
    #[serde(default)]
    pub sidecars: EngineShare,
}

/// A DNS name whose addresses are a pool's replicas ([`crate::replica::discovery`]), resolved again every
/// `interval_ms`: replicas join and leave as the name's addresses change.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// The name: a headless Service (`vllm-llama.models.svc.cluster.local`).
    pub dns: String,
    /// The engines' port.
    pub port: u16,
    #[serde(default)]
    pub scheme: Scheme,
    #[serde(default = "default_discovery_interval")]
    pub interval_ms: u64,
}

impl DiscoveryConfig {
    /// The same name, port and scheme (the interval aside): the same replicas.
    pub fn same_source(&self, other: &DiscoveryConfig) -> bool {
        (&self.dns, self.port, self.scheme) == (&other.dns, other.port, other.scheme)
    }
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    #[default]
    Http,
    Https,
}

impl Scheme {
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }
}

fn default_discovery_interval() -> u64 {
    5_000
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificates trusted for this pool's replicas, besides the platform's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}

impl PoolConfig {
    /// A pool of `model` over `replicas`, every other setting at its default.
    pub fn listing(model: &str, replicas: impl IntoIterator<Item = String>) -> PoolConfig {
        PoolConfig {
            model: model.to_owned(),
            replicas: replicas.into_iter().collect(),
            discovery: None,
            tls: None,
            credential: None,
            kv_tokens_per_replica: None,
            affinity_load_threshold: default_affinity_threshold(),
            affinity_prefix_bytes: default_affinity_prefix(),
            max_concurrency_per_replica: None,
            adaptive_concurrency: true,
            engine: EngineChoice::Auto,
            max_in_flight_without_kv: None,
            cache_isolation: CacheIsolation::Probe,
            encoding: Encoding::default(),
            sidecars: EngineShare::default(),
        }
    }
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9100))
}

fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9101))
}

fn default_shutdown_grace_ms() -> u64 {
    // Inside Kubernetes' default 30 s termination grace period, with time to flush the ledger.
    25_000
}

fn default_policy() -> String {
    "fair".into()
}

fn default_ledger() -> PathBuf {
    PathBuf::from("weir-ledger.sqlite")
}

fn adaptive_by_default() -> bool {
    true
}

fn default_affinity_threshold() -> f64 {
    0.85
}

fn default_affinity_prefix() -> usize {
    1024
}

impl SidecarConfig {
    /// Reads, parses and validates the config file, by its contents as [`Self::from_text`]
    /// does (not by its name), so `weir config check` reads it as the sidecar does.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_text(&text)
    }

    /// Parses and validates a config given as text, JSON when it is a JSON object, else YAML
    /// (what `weir config check` reads).
    pub fn from_text(text: &str) -> anyhow::Result<Self> {
        let config = Self::parse(text, text.trim_start().starts_with('{'))?;
        config.validate()?;
        Ok(config)
    }

    /// Parses a config (JSON, else YAML); an error names the field it is in, in plain words
    /// (`pools[1].queue.max_total: must be a non-negative integer, not -1`).
    pub fn parse(text: &str, json: bool) -> anyhow::Result<Self> {
        fn at(path: &serde_path_to_error::Path, error: impl std::fmt::Display) -> anyhow::Error {
            let field = path.to_string();
            let message = weir_core::parse_error::plain(&field, &error.to_string());
            match field.as_str() {
                "." => anyhow::anyhow!("{message}"),
                field => anyhow::anyhow!("{field}: {message}"),
            }
        }
        if json {
            let mut de = serde_json::Deserializer::from_str(text);
            serde_path_to_error::deserialize(&mut de).map_err(|e| at(e.path(), e.inner()))
        } else {
            let de = serde_yaml_ng::Deserializer::from_str(text);
            serde_path_to_error::deserialize(de).map_err(|e| at(e.path(), e.inner()))
        }
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if !matches!(self.policy.as_str(), "fair" | "fifo") {
            bail!("policy must be 'fair' or 'fifo', not '{}'", self.policy);
        }
        if self.pools.is_empty() {
            bail!("pools: at least one pool is needed");
        }
        for (i, pool) in self.pools.iter().enumerate() {
            self.check_pool(i, pool)?;
        }
        let relay = &self.relay;
        if [
            relay.client_stall_ms,
            relay.max_stream_ms,
            relay.max_response_ms,
            relay.first_byte_ms,
        ]
        .contains(&0)
        {
            bail!(
                "relay: client_stall_ms, max_stream_ms, max_response_ms and first_byte_ms must be above 0"
            );
        }
        if let Err((field, message)) = self.prediction.validate() {
            bail!("{field}: {message}");
        }
        if self.signing.is_none() {
            bail!("signing: required (secret_file or secret_env with the filter's signing secret)");
        }
        Ok(())
    }

    /// The checks of `pool`, the `i`th (its model unique among those before it).
    fn check_pool(&self, i: usize, pool: &PoolConfig) -> anyhow::Result<()> {
        if pool.replicas.is_empty() && pool.discovery.is_none() {
            bail!("pools[{i}].replicas: at least one replica (or a discovery) is needed");
        }
        if let Some(model) = self.pools[..i].iter().find(|p| p.model == pool.model) {
            bail!("pools[{i}].model: {} has a pool already", model.model);
        }
        for (r, url) in pool.replicas.iter().enumerate() {
            match reqwest::Url::parse(url) {
                // A replica's URL is its name in logs, metrics labels, `/ready` and the
                // ledger: a password in it would be in all of them.
                Ok(u) if !u.username().is_empty() || u.password().is_some() => bail!(
                    "pools[{i}].replicas[{r}]: a URL with credentials in it (they would be \
                     in every log line, metric and ledger record naming the replica): set \
                     the pool's `credential` instead"
                ),
                Ok(u) if matches!(u.scheme(), "http" | "https") && u.has_host() => {}
                _ => bail!("pools[{i}].replicas[{r}]: not an http:// or https:// URL"),
            }
        }
        if let Some(d) = &pool.discovery {
            if d.dns.trim().is_empty() {
                bail!("pools[{i}].discovery.dns: a name is needed");
            }
            if d.port == 0 || d.interval_ms == 0 {
                bail!("pools[{i}].discovery: port and interval_ms must be above 0");
            }
        }
        if pool.max_in_flight_without_kv.is_some() {
            bail!(
                "pools[{i}].max_in_flight_without_kv was renamed max_concurrency_per_replica: \
                 it now caps every replica, KV figures or not, and applies only when the \
                 engine does not report its own limit"
            );
        }
        if pool.max_concurrency_per_replica == Some(0) {
            bail!("pools[{i}].max_concurrency_per_replica: at least 1");
        }
        if pool.sidecars.sidecars() == 0 {
            bail!("pools[{i}].sidecars: at least 1 (this one)");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(signing: &str) -> anyhow::Result<SidecarConfig> {
        let json = format!(r#"{{"pools": [{{"model": "m", "replicas": ["http://r"]}}]{signing}}}"#);
        let config: SidecarConfig = serde_json::from_str(&json)?;
        config.validate()?;
        Ok(config)
    }

    #[test]
    fn the_sidecar_needs_a_signing_secret_from_a_file_or_the_environment() {
        let missing = config("").unwrap_err().to_string();
        assert!(missing.contains("signing: required"), "{missing}");
        assert!(
            config(r#", "signing": {"secret": "inline"}"#).is_err(),
            "never inline"
        );

        let dir = std::env::temp_dir().join(format!("weir-secret-{}", std::process::id()));
        std::fs::write(&dir, "0123456789abcdef0123456789abcdef\n").unwrap();
        let from_file = format!(r#", "signing": {{"secret_file": "{}"}}"#, dir.display());
        let secrets = config(&from_file)
            .unwrap()
            .signing
            .unwrap()
            .secrets()
            .unwrap();
        assert_eq!(secrets, vec![b"0123456789abcdef0123456789abcdef".to_vec()]);

        let both = format!(
            r#", "signing": {{"secret_file": "{}", "secret_env": "PATH"}}"#,
            dir.display()
        );
        assert!(config(&both).unwrap().signing.unwrap().secrets().is_err());
        let unset = r#", "signing": {"secret_env": "WEIR_TEST_SURELY_UNSET_VARIABLE"}"#;
        assert!(config(unset).unwrap().signing.unwrap().secrets().is_err());
        let none = r#", "signing": {"previous_secret_env": "PATH"}"#;
        assert!(
            config(none).unwrap().signing.unwrap().secrets().is_err(),
            "current needed"
        );
        std::fs::write(&dir, "short").unwrap();
        assert!(
            config(&from_file)
                .unwrap()
                .signing
                .unwrap()
                .secrets()
                .is_err()
        );
        let _ = std::fs::remove_file(&dir);
    }

    #[test]
    fn a_file_is_read_by_its_contents_as_config_check_reads_it() {
        let dir = std::env::temp_dir().join(format!("weir-config-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let yaml = "pools:\n- model: m\n  replicas: [http://r]\nsigning: {secret_env: X}\n";
        let json = r#"{"pools": [{"model": "m", "replicas": ["http://r"]}], "signing": {"secret_env": "X"}}"#;
        for (name, text) in [
            ("a.json", yaml),
            ("b.yaml", json),
            ("c.yaml", yaml),
            ("d.json", json),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            assert!(SidecarConfig::from_text(text).is_ok(), "{name}");
            let read = SidecarConfig::from_file(&path);
            assert!(read.is_ok(), "{name}: {:#}", read.unwrap_err());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn pool_config(pool: &str) -> anyhow::Result<SidecarConfig> {
        let json = format!(
            r#"{{"pools": [{{"model": "m", "replicas": ["http://r"]{pool}}}],
                "signing": {{"secret_env": "WEIR_UNUSED"}}}}"#
        );
        let config: SidecarConfig = serde_json::from_str(&json)?;
        config.validate()?;
        Ok(config)
    }

    #[test]
    fn a_pool_counts_the_sidecars_that_share_it_one_by_default() {
        let one = &pool_config("").unwrap().pools[0];
        assert_eq!(one.sidecars.sidecars(), 1);
        let two = &pool_config(r#", "sidecars": 2"#).unwrap().pools[0];
        assert_eq!(two.sidecars.sidecars(), 2);
        let none = pool_config(r#", "sidecars": 0"#).unwrap_err().to_string();
        assert!(none.contains("pools[0].sidecars"), "{none}");
    }

    #[test]
    fn a_pool_names_its_engine_and_concurrency_and_the_old_name_is_refused_clearly() {
        let config =
            pool_config(r#", "engine": "llamacpp", "max_concurrency_per_replica": 4"#).unwrap();
        let pool = &config.pools[0];
        assert_eq!(
            (pool.engine, pool.max_concurrency_per_replica),
            (EngineChoice::Llamacpp, Some(4))
        );
        assert_eq!(pool_config("").unwrap().pools[0].engine, EngineChoice::Auto);
        assert!(pool_config("").unwrap().pools[0].adaptive_concurrency);
        let fixed = pool_config(r#", "adaptive_concurrency": false"#).unwrap();
        assert!(!fixed.pools[0].adaptive_concurrency);
        assert!(pool_config(r#", "engine": "ollama""#).is_err());
        assert!(pool_config(r#", "max_concurrency_per_replica": 0"#).is_err());
        let old = pool_config(r#", "max_in_flight_without_kv": 16"#)
            .unwrap_err()
            .to_string();
        assert!(old.contains("renamed max_concurrency_per_replica"), "{old}");
    }

    #[test]
    fn a_pool_may_discover_its_replicas_in_dns_and_name_its_tls_and_credential() {
        let config = pool_config(
            r#", "discovery": {"dns": "vllm.models.svc.cluster.local", "port": 8000},
               "tls": {"ca_file": "/etc/weir/ca.pem"}, "credential": {"env": "ENGINE_TOKEN"}"#,
        )
        .unwrap();
        let pool = &config.pools[0];
        let discovery = pool.discovery.as_ref().unwrap();
        assert_eq!(
            (discovery.port, discovery.scheme, discovery.interval_ms),
            (8000, Scheme::Http, 5_000)
        );
        assert_eq!(
            pool.credential.as_ref().unwrap().env.as_deref(),
            Some("ENGINE_TOKEN")
        );
        let only_dns: SidecarConfig = serde_json::from_str(
            r#"{"pools": [{"model": "m", "discovery": {"dns": "svc", "port": 80, "scheme": "https"}}],
                "signing": {"secret_env": "WEIR_UNUSED"}}"#,
        )
        .unwrap();
        only_dns.validate().unwrap();
        let none: SidecarConfig = serde_json::from_str(
            r#"{"pools": [{"model": "m"}], "signing": {"secret_env": "WEIR_UNUSED"}}"#,
        )
        .unwrap();
        assert!(none.validate().is_err(), "neither replicas nor discovery");
        let bad_port = pool_config(r#", "discovery": {"dns": "svc", "port": 0}"#);
        assert!(
            bad_port
                .unwrap_err()
                .to_string()
                .contains("pools[0].discovery")
        );
        let not_url = serde_json::from_str::<SidecarConfig>(
            r#"{"pools": [{"model": "m", "replicas": ["10.0.0.5:8000"]}], "signing": {"secret_env": "X"}}"#,
        )
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
        assert!(not_url.contains("pools[0].replicas[0]"), "{not_url}");
        for with_credentials in ["http://weir:s3cret@r:8000", "https://token@api.example.com"] {
            let refused = serde_json::from_str::<SidecarConfig>(&format!(
                r#"{{"pools": [{{"model": "m", "replicas": ["{with_credentials}"]}}], "signing": {{"secret_env": "X"}}}}"#
            ))
            .unwrap()
            .validate()
            .map(|_| ())
            .map_err(|e| e.to_string());
            let Err(error) = refused else {
                panic!(
                    "{with_credentials} accepted: its secret would name the replica in logs, metrics and the ledger"
                );
            };
            assert!(error.contains("credential"), "{error}");
            assert!(
                !error.contains("s3cret") && !error.contains("token@"),
                "{error}"
            );
        }
        let twice = serde_json::from_str::<SidecarConfig>(
            r#"{"pools": [{"model": "m", "replicas": ["http://a"]}, {"model": "m", "replicas": ["http://b"]}],
                "signing": {"secret_env": "X"}}"#,
        )
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
        assert!(twice.contains("pools[1].model"), "{twice}");
    }
}

//! The quota service: fleet-wide limits as leases ([`weir_core::fleet`]).
//!
//! Every Envoy's filter renews its leases here in the background (`POST /v1/quota/leases`, one
//! call per renewal period for all its counters, never one per request); the budgets live in a
//! Redis-protocol store ([`store`]) shared by every sidecar, so a limit holds across the fleet.
//! The endpoint is on the serving port (where Envoy's cluster points), so it trusts only what
//! the filter signed, body included ([`crate::intake::trust::Trust::check_call`]), and refuses anything
//! else before the store is touched. Without a `quota` section it answers 404, like any
//! unknown route.

pub mod asks;
pub mod runs;
pub mod store;

use std::time::Duration;

use anyhow::{Context, bail};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::config::quota::QuotaConfig;

pub use store::Store;

type Labels = Vec<(&'static str, String)>;

/// The quota service's metrics: grants per tenant and window (the per-tenant labels the
/// sidecar's other metrics carry, never a counter's full name), store errors by kind, and the
/// store's latency.
#[derive(Clone)]
pub struct QuotaMetrics {
    pub granted: Family<Labels, Counter>,
    pub store_errors: Family<Labels, Counter>,
    pub store_latency: Histogram,
}

impl Default for QuotaMetrics {
    fn default() -> Self {
        QuotaMetrics {
            granted: Family::default(),
            store_errors: Family::default(),
            store_latency: Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
        }
    }
}

impl QuotaMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "quota_granted",
            "Tokens (or micro-units of a budget) the quota service granted as leases, per tenant and window",
            self.granted.clone(),
        );
        registry.register(
            "quota_store_errors",
            "Renewals the quota store failed (timeout, error, malformed): each answered 503",
            self.store_errors.clone(),
        );
        registry.register(
            "quota_store_seconds",
            "Time the quota store took to answer a renewal",
            self.store_latency.clone(),
        );
    }
}

/// Longest key prefix: keys stay short, and a prefix is a name, not data.
const MAX_PREFIX_BYTES: usize = 64;

impl QuotaConfig {
    /// The store's URL, read from the environment or the file (surrounding whitespace, a
    /// file's final newline, is not part of it).
    pub fn redis_url(&self) -> anyhow::Result<String> {
        let url = match (&self.redis_url_env, &self.redis_url_file) {
            (Some(_), Some(_)) => bail!("quota: set redis_url_env or redis_url_file, not both"),
            (Some(var), None) => std::env::var(var)
                .with_context(|| format!("quota.redis_url_env: ${var} is not set"))?,
            (None, Some(path)) => std::fs::read_to_string(path)
                .with_context(|| format!("quota.redis_url_file: reading {}", path.display()))?,
            (None, None) => bail!("quota: set redis_url_env or redis_url_file"),
        };
        let url = url.trim().to_owned();
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            // Not the URL itself: it may carry a password.
            bail!("quota: the store's URL must start with redis:// or rediss://");
        }
        Ok(url)
    }

    /// The store this section names, connected lazily (the sidecar starts while it is down).
    pub fn store(&self) -> anyhow::Result<Store> {
        if self.key_prefix.len() > MAX_PREFIX_BYTES
            || !self.key_prefix.bytes().all(|b| b.is_ascii_graphic())
        {
            bail!("quota.key_prefix: at most {MAX_PREFIX_BYTES} visible ASCII characters");
        }
        if self.timeout_ms == 0 || self.connect_timeout_ms == 0 {
            bail!("quota: timeout_ms and connect_timeout_ms must be above 0");
        }
        let url = self.redis_url()?;
        let ca_pem = match &self.ca_file {
            Some(_) if !url.starts_with("rediss://") => {
                bail!("quota.ca_file: needs a rediss:// URL")
            }
            Some(path) => Some(
                std::fs::read(path)
                    .with_context(|| format!("quota.ca_file: reading {}", path.display()))?,
            ),
            None => None,
        };
        Store::new(
            &url,
            ca_pem,
            &self.key_prefix,
            Duration::from_millis(self.timeout_ms),
            Duration::from_millis(self.connect_timeout_ms),
        )
        // redis' errors may quote the URL, password and all.
        .map_err(|_| anyhow::anyhow!("quota: the store's URL (or ca_file) is not usable"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> QuotaConfig {
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn the_url_comes_from_a_file_never_inline_and_never_echoed() {
        let dir = std::env::temp_dir().join(format!("weir-quota-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("url");
        std::fs::write(&file, "redis://:hunter2@127.0.0.1:6379/0\n").unwrap();
        let c = config(&format!(r#"{{"redis_url_file": {:?}}}"#, file));
        assert_eq!(c.key_prefix, "weir:");
        assert_eq!(c.timeout_ms, 250);
        assert_eq!(
            c.redis_url().ok().as_deref(),
            Some("redis://:hunter2@127.0.0.1:6379/0")
        );
        std::fs::write(&file, "http://:hunter2@x").unwrap();
        let e = c
            .redis_url()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("redis://") && !e.contains("hunter2"), "{e}");
        assert!(
            serde_json::from_str::<QuotaConfig>(r#"{"redis_url": "redis://x"}"#).is_err(),
            "no inline URL"
        );
        assert!(config("{}").redis_url().is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

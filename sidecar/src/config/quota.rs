//! The `quota` section: where the fleet's quota store is and how long a call to it may take.

use std::path::PathBuf;

use serde::Deserialize;

/// The `quota` section: where the store is and how long a call to it may take.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    /// The environment variable holding the store's URL (`redis://` or `rediss://`; it may
    /// carry a password, so it is never inline in the config).
    pub redis_url_env: Option<String>,
    /// Or a file holding it (a mounted Secret).
    pub redis_url_file: Option<PathBuf>,
    /// For `rediss://`: a PEM CA file to check the store's certificate against, instead of the
    /// platform's roots (a private CA).
    pub ca_file: Option<PathBuf>,
    /// Prepended to every key the service writes, so one store can serve several fleets.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// Longest a renewal may wait for the store; then it is answered 503 at once, and the
    /// filter applies its `fail_open`/`fail_closed` rule.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Longest one attempt to (re)connect may take.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
}

fn default_key_prefix() -> String {
    "weir:".into()
}

fn default_timeout_ms() -> u64 {
    250
}

fn default_connect_timeout_ms() -> u64 {
    1_000
}

//! `ledger_store`: where usage records are kept when not in the local SQLite file.

use std::path::PathBuf;

use serde::Deserialize;

/// Where records are kept (`ledger_store`; without it, the SQLite file `ledger`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LedgerStoreConfig {
    pub postgres: PostgresConfig,
    /// The local durable queue records wait in while PostgreSQL cannot be reached (SQLite).
    #[serde(default = "default_spool")]
    pub spool: PathBuf,
}

fn default_spool() -> PathBuf {
    PathBuf::from("weir-ledger-spool.sqlite")
}

/// The PostgreSQL connection URL (`postgresql://user:password@host:port/db`), which may hold a
/// password: so read from an environment variable or a file, never inline in the config.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PostgresConfig {
    pub url_env: Option<String>,
    pub url_file: Option<PathBuf>,
}

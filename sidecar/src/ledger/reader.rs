//! Reading the ledger for the idempotency module: the attempts recorded under a caller's
//! `Idempotency-Key`. With PostgreSQL that is the shared table (a tenant's earlier attempts
//! may have run on another sidecar, before a failover) and what this sidecar still holds in its
//! spool. The spool is read first: a record that moves to PostgreSQL meanwhile is then found
//! there, so none is missed.

use std::path::Path;
use std::sync::Mutex;

use super::{KeyHistory, postgres, spool, sqlite};
use crate::config::ledger::LedgerStoreConfig;

pub enum Reader {
    Local(Mutex<rusqlite::Connection>),
    Remote(Box<Remote>),
}

/// PostgreSQL and the spool beside it.
pub struct Remote {
    url: String,
    /// Opened on first use and again after a failure: the sidecar starts while PostgreSQL is
    /// down.
    postgres: Mutex<Option<::postgres::Client>>,
    spool: Mutex<rusqlite::Connection>,
}

impl Reader {
    pub fn open(path: &Path, store: Option<&LedgerStoreConfig>) -> anyhow::Result<Reader> {
        Ok(match store {
            None => Reader::Local(Mutex::new(sqlite::open(path)?)),
            Some(config) => Reader::Remote(Box::new(Remote {
                url: config.postgres.url()?,
                postgres: Mutex::new(None),
                spool: Mutex::new(spool::open(&config.spool)?),
            })),
        })
    }

    /// What the ledger knows of (tenant, key); `None` when it cannot be read.
    pub fn history(&self, tenant: &str, key: &str) -> Option<KeyHistory> {
        match self {
            Reader::Local(conn) => conn
                .lock()
                .ok()
                .and_then(|conn| sqlite::history(&conn, tenant, key).ok()),
            Reader::Remote(remote) => off_worker(|| {
                let spooled = spool::history(&*remote.spool.lock().ok()?, tenant, key).ok()?;
                let mut client = remote.postgres.lock().ok()?;
                if client.is_none() {
                    *client = postgres::connect(&remote.url).ok();
                }
                match postgres::history(client.as_mut()?, tenant, key) {
                    Ok(stored) => Some(stored.and(spooled)),
                    Err(_) => {
                        *client = None;
                        None
                    }
                }
            }),
        }
    }
}

/// Runs blocking work from an async worker without stalling the other tasks on it (the
/// multi-threaded runtime moves them elsewhere meanwhile).
fn off_worker<T>(work: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

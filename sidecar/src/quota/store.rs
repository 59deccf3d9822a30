//! The quota service's store: any Redis-protocol server (Redis, Valkey, a managed Redis),
//! reached over `redis://` or `rediss://` (TLS).
//!
//! A renewal is one round trip: one Lua script (`leases.lua`, run with EVALSHA, loaded again by
//! itself after a store restart) applies every ask atomically, so concurrent renewals from any
//! number of sidecars never grant more than the store holds. The script reads the store's own
//! clock (`TIME`): every sidecar then refills buckets and cuts calendar windows on one clock,
//! whatever their own clocks' skew.
//!
//! Each call is bounded by `timeout_ms`, and the connection reconnects by itself when the store
//! returns ([`ConnectionManager`]); the sidecar starts, and answers 503, while the store is down.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script, TlsCertificates};
use weir_core::fleet::{CounterAsk, Grant, Holder, LeaseRequest};

const SCRIPT: &str = include_str!("leases.lua");

/// Why the store could not answer; the renewal is refused as a whole (nothing was granted).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the quota store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the quota store failed: {0}")]
    Failed(#[from] redis::RedisError),
    #[error("the quota store answered {0} values for {1} asks")]
    Malformed(usize, usize),
}

impl StoreError {
    /// For the metric of store errors: `timeout`, `error` or `malformed`.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Failed(_) => "error",
            StoreError::Malformed(..) => "malformed",
        }
    }
}

pub struct Store {
    pub(super) conn: ConnectionManager,
    script: Script,
    pub(super) prefix: String,
    pub(super) timeout: Duration,
}

impl Store {
    /// A store at `url` whose keys start with `prefix`; over `rediss://`, its certificate is
    /// checked against `ca_pem` if given, else the platform's roots. Connects lazily: fails
    /// only on a URL it cannot use, never because the store is down.
    pub fn new(
        url: &str,
        ca_pem: Option<Vec<u8>>,
        prefix: &str,
        timeout: Duration,
        connect_timeout: Duration,
    ) -> anyhow::Result<Store> {
        let client = match ca_pem {
            Some(root_cert) => Client::build_with_tls(
                url,
                TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root_cert),
                },
            )?,
            None => Client::open(url)?,
        };
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(timeout))
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_secs(1));
        Ok(Store {
            conn: ConnectionManager::new_lazy_with_config(client, config)?,
            script: Script::new(SCRIPT),
            prefix: prefix.to_owned(),
            timeout,
        })
    }

    /// Grants for `asks`, in order, at the store's clock.
    pub async fn renew(&self, request: &LeaseRequest) -> Result<Vec<Grant>, StoreError> {
        self.renew_at(&request.counters, request.holder.as_ref(), None)
            .await
    }

    /// [`Store::renew`] at `now_ms` instead of the store's clock: for tests of window
    /// boundaries, which cannot wait for the end of a month.
    pub async fn renew_at(
        &self,
        asks: &[CounterAsk],
        holder: Option<&Holder>,
        now_ms: Option<u64>,
    ) -> Result<Vec<Grant>, StoreError> {
        if asks.is_empty() {
            return Ok(Vec::new());
        }
        let mut call = self.script.prepare_invoke();
        call.arg(now_ms.map(|n| n.to_string()).unwrap_or_default());
        call.arg(holder.map_or("", |h| h.id.as_str()))
            .arg(holder.map_or(0, |h| h.hold_ms));
        let text = |n: Option<u64>| n.map(|n| n.to_string()).unwrap_or_default();
        for ask in asks {
            call.key(self.stored_key(ask))
                .arg(ask.window.name())
                .arg(ask.limit);
            call.arg(ask.want).arg(ask.returned);
            call.arg(text(ask.returned_window_start_ms))
                .arg(text(ask.held))
                .arg(text(ask.held_window_start_ms));
        }
        let mut conn = self.conn.clone();
        let values: Vec<i64> = tokio::time::timeout(self.timeout, call.invoke_async(&mut conn))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??;
        if values.len() != asks.len() * 4 {
            return Err(StoreError::Malformed(values.len(), asks.len()));
        }
        let count = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(asks
            .iter()
            .zip(values.chunks_exact(4))
            .map(|(ask, v)| Grant {
                key: ask.key.clone(),
                granted: count(v[0]).min(ask.want),
                remaining: count(v[1]),
                resets_ms: count(v[2]),
                window_start_ms: u64::try_from(v[3]).ok(),
            })
            .collect())
    }

    /// Where a counter lives: under the prefix, and apart per window kind (a bucket is a hash,
    /// a window's count a string with the window's start appended).
    pub fn stored_key(&self, ask: &CounterAsk) -> String {
        format!("{}{}:{}", self.prefix, ask.key, ask.window.name())
    }
}

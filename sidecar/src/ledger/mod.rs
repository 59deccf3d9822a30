//! The usage ledger: append-only records, one per attempt that used an engine, keyed by
//! (tenant, idempotency key, attempt). Every attempt is billed for what it used — a cancelled
//! first try and its full retry are two records — and writing the same attempt twice adds
//! nothing. Writes happen on a thread of their own, off the async workers.
//!
//! The idempotency key is the caller's `Idempotency-Key`, or weir's own id of the attempt when
//! it sent none (then every request is its own key, attempt 1).
//!
//! Records go to SQLite ([`sqlite`], embedded, the default) or to PostgreSQL ([`postgres`],
//! shared by several sidecars), behind a local durable [`spool`] that holds them, in order,
//! while PostgreSQL cannot be reached ([`remote`]).

pub mod postgres;
pub mod reader;
pub mod remote;
pub mod spool;
pub mod sqlite;

use std::path::Path;
use std::sync::mpsc;

use anyhow::{Context, bail};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::config::ledger::{LedgerStoreConfig, PostgresConfig};

pub use reader::Reader;
pub use sqlite::{append, history, open, open_read_only, query};

/// What one attempt used, as billed. Engine counts when the engine reported them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    pub tenant: String,
    /// The caller's `Idempotency-Key`, else `request_id`.
    pub idempotency_key: String,
    /// 1 for the first attempt under the key, then 2, 3, … for retries.
    pub attempt: u32,
    /// weir's id of this attempt (`x-weir-request-id`).
    pub request_id: String,
    pub model: String,
    /// The API called: `chat_completions`, `completions`, `responses`, `messages`,
    /// `embeddings` (`unknown` in rows written before it was recorded).
    pub api: String,
    pub replica: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Of `prompt_tokens`, those the engine served from its prefix cache (0 when it did not
    /// say, and in rows written before it was recorded).
    #[serde(default)]
    pub cached_prompt_tokens: u64,
    /// `engine` (usage reported) or `counted` (tokens seen streaming).
    pub source: String,
    /// `ok`, `cancelled`, `failed`, `upstream_error`, `slow_client`, `stream_deadline`,
    /// `response_deadline`, `first_byte_deadline`, `shutdown`.
    pub outcome: String,
    pub queued_ms: u64,
    pub finished_at_ms: u64,
    /// When the sidecar took the request in (Unix ms; `None` in rows written before it was
    /// recorded): with `finished_at_ms`, how long a run took.
    #[serde(default)]
    pub started_at_ms: Option<u64>,
    /// The price the filter charged the request at (its signed `x-weir-price`), per million
    /// tokens, and the cost at it; all `None` when the request carried no price.
    #[serde(default)]
    pub currency: Option<String>,
    #[serde(default)]
    pub price_input: Option<f64>,
    #[serde(default)]
    pub price_cached_input: Option<f64>,
    #[serde(default)]
    pub price_output: Option<f64>,
    /// In micro-units of `currency` ([`weir_core::price::Price::cost_micros`]).
    #[serde(default)]
    pub cost_micros: Option<u64>,
    /// The gateway route the request came in on, as the filter's metrics label it (`None`
    /// from filters older than the route header, and in rows written before it was recorded).
    #[serde(default)]
    pub route: Option<String>,
    /// The mode the filter applied: `off`, `shadow` or `enforce` (`None` as for `route`).
    #[serde(default)]
    pub mode: Option<String>,
    /// The run the call belongs to (its signed `x-weir-run-id`), `None` outside a run and in
    /// rows written before runs were recorded. Runs are per tenant: `(tenant, run_id)` is one.
    #[serde(default)]
    pub run_id: Option<String>,
    /// The agent of the key that made the call (its signed `x-weir-agent`), if named.
    #[serde(default)]
    pub agent_id: Option<String>,
    /// Tool calls the answer made (0 for an answer that made none, and in rows written before
    /// they were counted).
    #[serde(default)]
    pub tool_calls: u64,
}

impl UsageRecord {
    /// Sets the price the request ran at and its cost over the record's counts.
    pub fn priced(mut self, currency: &str, price: &weir_core::price::Price) -> UsageRecord {
        let usage = weir_core::price::Usage {
            input_tokens: self.prompt_tokens,
            cached_input_tokens: self.cached_prompt_tokens,
            output_tokens: self.completion_tokens,
        };
        self.cost_micros = Some(price.cost_micros(usage));
        self.currency = Some(currency.to_owned());
        self.price_input = Some(price.input);
        self.price_cached_input = Some(price.cached_input());
        self.price_output = Some(price.output);
        self
    }
}

/// What the ledger knows of a tenant's idempotency key: the last attempt recorded, and whether
/// one completed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyHistory {
    pub attempts: u32,
    pub completed: bool,
}

impl KeyHistory {
    /// What two stores holding parts of a key's records know together.
    pub fn and(self, other: KeyHistory) -> KeyHistory {
        KeyHistory {
            attempts: self.attempts.max(other.attempts),
            completed: self.completed || other.completed,
        }
    }
}

impl PostgresConfig {
    pub fn url(&self) -> anyhow::Result<String> {
        read_url(self.url_env.as_deref(), self.url_file.as_deref())
    }
}

/// A PostgreSQL URL from `$env` or the file `file` (one of them), trimmed.
pub fn read_url(env: Option<&str>, file: Option<&Path>) -> anyhow::Result<String> {
    let url = match (env, file) {
        (Some(_), Some(_)) => bail!("postgres: set url_env or url_file, not both"),
        (Some(var), None) => {
            std::env::var(var).with_context(|| format!("postgres.url_env: ${var} is not set"))?
        }
        (None, Some(path)) => std::fs::read_to_string(path)
            .with_context(|| format!("postgres.url_file: reading {}", path.display()))?,
        (None, None) => bail!("postgres: set url_env or url_file"),
    };
    let url = url.trim().to_owned();
    if url.is_empty() {
        bail!("postgres: the URL is empty");
    }
    // Refused at start rather than retried for ever, its records spooled: a URL the client
    // cannot parse never connects (the client's message holds no part of the URL, so no
    // password).
    if let Err(e) = url.parse::<::postgres::Config>() {
        bail!(
            "postgres: the URL is not one weir can use: {e} (weir connects without TLS: \
             sslmode=disable or prefer)"
        );
    }
    Ok(url)
}

/// What the writer thread is sent: records, in order, and flush requests behind them.
enum Entry {
    Record(Box<UsageRecord>),
    /// Answered once every record sent before it is written (or, with PostgreSQL, spooled).
    Flush(mpsc::Sender<()>),
}

/// How far the writer is behind, for the metrics: records sent to it and not yet written,
/// writes that failed (each a record lost to billing), records waiting in the spool for
/// PostgreSQL, and PostgreSQL writes and connections that failed (their records spooled).
#[derive(Clone, Default)]
pub struct LedgerGauges {
    pub pending: Gauge,
    pub failures: Counter,
    pub spooled: Gauge,
    pub store_failures: Counter,
}

impl LedgerGauges {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "ledger_pending_records",
            "Usage records handed to the ledger writer and not yet written (how far billing lags)",
            self.pending.clone(),
        );
        registry.register(
            "ledger_write_failures",
            "Usage records the ledger could not write",
            self.failures.clone(),
        );
        registry.register(
            "ledger_spooled_records",
            "Usage records waiting in the local spool for PostgreSQL (ledger_store)",
            self.spooled.clone(),
        );
        registry.register(
            "ledger_store_failures",
            "Failed PostgreSQL connections and writes (their records wait in the spool)",
            self.store_failures.clone(),
        );
    }
}

/// Where the writer thread puts records.
enum Sink {
    Local(rusqlite::Connection),
    Remote(Box<remote::Remote<::postgres::Client>>),
}

/// A handle to the writer thread.
#[derive(Clone)]
pub struct Ledger {
    tx: mpsc::Sender<Entry>,
    pending: Gauge,
}

impl Ledger {
    /// Opens the store and starts its writer thread: the SQLite file `path`, or PostgreSQL
    /// behind its spool when `store` is set.
    pub fn start(
        path: &Path,
        store: Option<&LedgerStoreConfig>,
        gauges: LedgerGauges,
    ) -> anyhow::Result<Ledger> {
        let mut sink = match store {
            None => Sink::Local(open(path)?),
            Some(config) => {
                let url = config.postgres.url()?;
                let connect = move || postgres::connect(&url);
                Sink::Remote(Box::new(remote::Remote::open(
                    &config.spool,
                    Box::new(connect),
                    gauges.spooled.clone(),
                    gauges.store_failures.clone(),
                )?))
            }
        };
        let (tx, rx) = mpsc::channel::<Entry>();
        let LedgerGauges {
            pending, failures, ..
        } = gauges;
        let written = pending.clone();
        std::thread::Builder::new()
            .name("ledger".into())
            .spawn(move || {
                loop {
                    let entry = match &mut sink {
                        Sink::Local(_) => rx.recv().ok(),
                        Sink::Remote(remote) => match rx.recv_timeout(remote.retry_in()) {
                            Ok(entry) => Some(entry),
                            Err(mpsc::RecvTimeoutError::Timeout) => {
                                remote.replay(false);
                                continue;
                            }
                            Err(mpsc::RecvTimeoutError::Disconnected) => None,
                        },
                    };
                    match entry {
                        None => return,
                        Some(Entry::Record(record)) => {
                            let kept = match &mut sink {
                                Sink::Local(conn) => append(conn, &record).map(|_| ()).map_err(Into::into),
                                Sink::Remote(remote) => remote.write(&record),
                            };
                            if let Err(e) = kept {
                                failures.inc();
                                tracing::error!(request = %record.request_id, "ledger write failed: {e}");
                            }
                            written.dec();
                        }
                        Some(Entry::Flush(done)) => {
                            if let Sink::Remote(remote) = &mut sink {
                                remote.replay(true);
                            }
                            let _ = done.send(());
                        }
                    }
                }
            })?;
        Ok(Ledger { tx, pending })
    }

    pub fn record(&self, record: UsageRecord) {
        self.pending.inc();
        if self.tx.send(Entry::Record(Box::new(record))).is_err() {
            self.pending.dec();
        }
    }

    /// Waits (blocking, up to `within`) until every record sent so far is written — with
    /// PostgreSQL: taken by it, or else durable in the spool for the next start — and false if
    /// that took longer. For shutdown: nothing recorded before it is lost when the process ends.
    pub fn flush(&self, within: std::time::Duration) -> bool {
        let (done, written) = mpsc::channel();
        self.tx.send(Entry::Flush(done)).is_ok() && written.recv_timeout(within).is_ok()
    }
}

/// A record for the tests: key `key`, attempt `attempt`, finished at `at`.
#[cfg(test)]
pub(crate) fn sample(key: &str, attempt: u32, tenant: &str, at: u64) -> UsageRecord {
    UsageRecord {
        tenant: tenant.into(),
        idempotency_key: key.into(),
        attempt,
        request_id: format!("weir-{key}-{attempt}"),
        model: "m".into(),
        api: "chat_completions".into(),
        replica: "r".into(),
        prompt_tokens: 10,
        completion_tokens: 5,
        source: "engine".into(),
        outcome: "ok".into(),
        queued_ms: 1,
        finished_at_ms: at,
        ..UsageRecord::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_the_client_cannot_use_is_refused_at_start_without_its_password() {
        let file = std::env::temp_dir().join(format!("weir-dsn-{}", std::process::id()));
        std::fs::write(
            &file,
            "postgresql://weir:s3cret@db:5432/weir_ledger?sslmode=verify-full\n",
        )
        .unwrap();
        let e = read_url(None, Some(&file)).unwrap_err().to_string();
        assert!(e.contains("not one weir can use"), "{e}");
        assert!(!e.contains("s3cret"), "{e}");
        std::fs::write(
            &file,
            "postgresql://weir:s3cret@db:5432/weir_ledger?sslmode=disable",
        )
        .unwrap();
        assert!(read_url(None, Some(&file)).is_ok());
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn a_flush_returns_once_everything_sent_before_it_is_written() {
        let path = std::env::temp_dir().join(format!("weir-ledger-flush-{}", std::process::id()));
        let gauges = LedgerGauges::default();
        let ledger = Ledger::start(&path, None, gauges.clone()).unwrap();
        for i in 0..200 {
            ledger.record(sample(&format!("r{i}"), 1, "a", i));
        }
        assert!(ledger.flush(std::time::Duration::from_secs(10)));
        assert_eq!(gauges.pending.get(), 0, "every record sent was written");
        assert_eq!(gauges.failures.get(), 0);
        let conn = open(&path).unwrap();
        assert_eq!(query(&conn, None, 0).unwrap().len(), 200);
        drop(conn);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_record_is_priced_over_its_engine_counts() {
        let price = weir_core::price::Price {
            input: 0.15,
            cached_input: Some(0.075),
            output: 0.6,
        };
        let mut r = sample("k", 1, "a", 1);
        r.prompt_tokens = 1_000;
        r.cached_prompt_tokens = 400;
        r.completion_tokens = 100;
        let r = r.priced("USD", &price);
        assert_eq!(r.cost_micros, Some(180));
        assert_eq!(
            (r.currency.as_deref(), r.price_cached_input),
            (Some("USD"), Some(0.075))
        );
    }
}

//! The usage ledger: append-only records in SQLite (WAL), one per attempt that used an engine,
//! keyed by (tenant, idempotency key, attempt). Every attempt is billed for what it used — a
//! cancelled first try and its full retry are two records — and writing the same attempt twice
//! adds nothing. Writes happen on a thread of their own, off the async workers.
//!
//! The idempotency key is the caller's `Idempotency-Key`, or weir's own id of the attempt when
//! it sent none (then every request is its own key, attempt 1). A ledger written before
//! attempts were recorded (primary key `request_id`) is migrated in place when opened: each old
//! row becomes attempt 1 of a key equal to its request id. A ledger written before the API was
//! recorded gets the column, its old rows `unknown`.

use std::path::Path;
use std::sync::mpsc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;

/// What one attempt used, as billed. Engine counts when the engine reported them.
#[derive(Clone, Debug, PartialEq, Serialize)]
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
    /// `engine` (usage reported) or `counted` (tokens seen streaming).
    pub source: String,
    /// `ok`, `cancelled`, `failed`, `upstream_error`, `slow_client`, `stream_deadline`,
    /// `response_deadline`, `first_byte_deadline`, `shutdown`.
    pub outcome: String,
    pub queued_ms: u64,
    pub finished_at_ms: u64,
}

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS usage (
        tenant            TEXT NOT NULL,
        idempotency_key   TEXT NOT NULL,
        attempt           INTEGER NOT NULL,
        request_id        TEXT NOT NULL,
        model             TEXT NOT NULL,
        replica           TEXT NOT NULL,
        prompt_tokens     INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        source            TEXT NOT NULL,
        outcome           TEXT NOT NULL,
        queued_ms         INTEGER NOT NULL,
        finished_at_ms    INTEGER NOT NULL,
        api               TEXT NOT NULL DEFAULT 'unknown',
        PRIMARY KEY (tenant, idempotency_key, attempt)
    );
    CREATE INDEX IF NOT EXISTS usage_by_tenant ON usage (tenant, finished_at_ms);";

/// Moves a ledger with one row per request id (no `attempt` column) to the attempt schema.
const MIGRATE_FROM_REQUEST_IDS: &str = "
    ALTER TABLE usage RENAME TO usage_by_request_id;
    DROP INDEX IF EXISTS usage_by_tenant;";
const COPY_FROM_REQUEST_IDS: &str = "
    INSERT INTO usage SELECT tenant, request_id, 1, request_id, model, replica, prompt_tokens,
        completion_tokens, source, outcome, queued_ms, finished_at_ms, 'unknown'
        FROM usage_by_request_id;
    DROP TABLE usage_by_request_id;";
/// Adds the API column to a ledger written before it was recorded.
const ADD_API: &str = "ALTER TABLE usage ADD COLUMN api TEXT NOT NULL DEFAULT 'unknown';";

pub fn open(path: &Path) -> rusqlite::Result<Connection> {
    let mut conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    let tx = conn.transaction()?;
    let columns: Vec<String> = tx
        .prepare("SELECT name FROM pragma_table_info('usage')")?
        .query_map([], |row| row.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let has = |name: &str| columns.iter().any(|c| c == name);
    let old = !columns.is_empty() && !has("attempt");
    if old {
        tx.execute_batch(MIGRATE_FROM_REQUEST_IDS)?;
    } else if !columns.is_empty() && !has("api") {
        tx.execute_batch(ADD_API)?;
    }
    tx.execute_batch(SCHEMA)?;
    if old {
        tx.execute_batch(COPY_FROM_REQUEST_IDS)?;
    }
    tx.commit()?;
    Ok(conn)
}

/// Appends a record; returns whether it was new. Writing the same attempt again (same request
/// id) adds nothing. A record whose attempt number another attempt of the key already holds —
/// numbered from a history read before that one was written — becomes the key's next attempt:
/// every attempt that used an engine is billed, none is lost.
pub fn append(conn: &Connection, r: &UsageRecord) -> rusqlite::Result<bool> {
    if insert(conn, r, r.attempt)? {
        return Ok(true);
    }
    let holder: Option<String> = conn
        .query_row(
            "SELECT request_id FROM usage WHERE tenant = ?1 AND idempotency_key = ?2
             AND attempt = ?3",
            params![r.tenant, r.idempotency_key, r.attempt],
            |row| row.get(0),
        )
        .optional()?;
    if holder.as_deref() == Some(r.request_id.as_str()) {
        return Ok(false);
    }
    let next: u32 = conn.query_row(
        "SELECT COALESCE(MAX(attempt), 0) + 1 FROM usage WHERE tenant = ?1 AND idempotency_key = ?2",
        params![r.tenant, r.idempotency_key],
        |row| row.get(0),
    )?;
    insert(conn, r, next)
}

fn insert(conn: &Connection, r: &UsageRecord, attempt: u32) -> rusqlite::Result<bool> {
    let inserted = conn.execute(
        "INSERT OR IGNORE INTO usage (tenant, idempotency_key, attempt, request_id, model, replica,
             prompt_tokens, completion_tokens, source, outcome, queued_ms, finished_at_ms, api)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
        params![
            r.tenant,
            r.idempotency_key,
            attempt,
            r.request_id,
            r.model,
            r.replica,
            r.prompt_tokens as i64,
            r.completion_tokens as i64,
            r.source,
            r.outcome,
            r.queued_ms as i64,
            r.finished_at_ms as i64,
            r.api,
        ],
    )?;
    Ok(inserted == 1)
}

/// What the ledger knows of a tenant's idempotency key: the last attempt recorded, and whether
/// one completed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyHistory {
    pub attempts: u32,
    pub completed: bool,
}

pub fn history(conn: &Connection, tenant: &str, key: &str) -> rusqlite::Result<KeyHistory> {
    conn.query_row(
        "SELECT COALESCE(MAX(attempt), 0), COALESCE(MAX(outcome = 'ok'), 0)
         FROM usage WHERE tenant = ?1 AND idempotency_key = ?2",
        params![tenant, key],
        |row| {
            Ok(KeyHistory {
                attempts: row.get(0)?,
                completed: row.get(1)?,
            })
        },
    )
}

/// Records of a tenant (all tenants with `None`) finished at or after `since_ms`.
pub fn query(
    conn: &Connection,
    tenant: Option<&str>,
    since_ms: u64,
) -> rusqlite::Result<Vec<UsageRecord>> {
    let mut stmt = conn.prepare(
        "SELECT tenant, idempotency_key, attempt, request_id, model, replica, prompt_tokens,
                completion_tokens, source, outcome, queued_ms, finished_at_ms, api
         FROM usage WHERE (?1 IS NULL OR tenant = ?1) AND finished_at_ms >= ?2
         ORDER BY finished_at_ms",
    )?;
    let rows = stmt.query_map(params![tenant, since_ms as i64], |row| {
        Ok(UsageRecord {
            tenant: row.get(0)?,
            idempotency_key: row.get(1)?,
            attempt: row.get(2)?,
            request_id: row.get(3)?,
            model: row.get(4)?,
            replica: row.get(5)?,
            prompt_tokens: row.get::<_, i64>(6)? as u64,
            completion_tokens: row.get::<_, i64>(7)? as u64,
            source: row.get(8)?,
            outcome: row.get(9)?,
            queued_ms: row.get::<_, i64>(10)? as u64,
            finished_at_ms: row.get::<_, i64>(11)? as u64,
            api: row.get(12)?,
        })
    })?;
    rows.collect()
}

/// What the writer thread is sent: records, in order, and flush requests behind them.
enum Entry {
    Record(Box<UsageRecord>),
    /// Answered once every record sent before it is written.
    Flush(mpsc::Sender<()>),
}

/// How far the writer is behind, for the metrics: records sent to it and not yet written, and
/// writes that failed (each a record lost to billing).
#[derive(Clone, Default)]
pub struct LedgerGauges {
    pub pending: Gauge,
    pub failures: Counter,
}

/// A handle to the writer thread.
#[derive(Clone)]
pub struct Ledger {
    tx: mpsc::Sender<Entry>,
    pending: Gauge,
}

impl Ledger {
    /// Opens the database and starts its writer thread.
    pub fn start(path: &Path, gauges: LedgerGauges) -> anyhow::Result<Ledger> {
        let conn = open(path)?;
        let (tx, rx) = mpsc::channel::<Entry>();
        let LedgerGauges { pending, failures } = gauges;
        let written = pending.clone();
        std::thread::Builder::new()
            .name("ledger".into())
            .spawn(move || {
                for entry in rx {
                    match entry {
                        Entry::Record(record) => {
                            if let Err(e) = append(&conn, &record) {
                                failures.inc();
                                tracing::error!(request = %record.request_id, "ledger write failed: {e}");
                            }
                            written.dec();
                        }
                        Entry::Flush(done) => {
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

    /// Waits (blocking, up to `within`) until every record sent so far is written; false if
    /// that took longer. For shutdown: nothing recorded before it is lost when the process ends.
    pub fn flush(&self, within: std::time::Duration) -> bool {
        let (done, written) = mpsc::channel();
        self.tx.send(Entry::Flush(done)).is_ok() && written.recv_timeout(within).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, attempt: u32, tenant: &str, at: u64) -> UsageRecord {
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
        }
    }

    fn temp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("weir-ledger-{name}-{}", std::process::id()))
    }

    #[test]
    fn every_attempt_is_a_record_and_each_attempt_is_written_once() {
        let path = temp("attempts");
        let conn = open(&path).unwrap();
        assert_eq!(history(&conn, "a", "k").unwrap(), KeyHistory::default());
        let mut cancelled = record("k", 1, "a", 100);
        cancelled.outcome = "cancelled".into();
        assert!(append(&conn, &cancelled).unwrap());
        assert_eq!(
            history(&conn, "a", "k").unwrap(),
            KeyHistory {
                attempts: 1,
                completed: false
            }
        );
        assert!(append(&conn, &record("k", 2, "a", 200)).unwrap());
        assert!(
            !append(&conn, &record("k", 2, "a", 250)).unwrap(),
            "same attempt"
        );
        let mut other = record("k", 2, "a", 260);
        other.request_id = "weir-another-attempt".into();
        assert!(
            append(&conn, &other).unwrap(),
            "another attempt numbered 2 becomes attempt 3, not lost"
        );
        assert_eq!(history(&conn, "a", "k").unwrap().attempts, 3);
        assert!(
            append(&conn, &record("k", 1, "b", 300)).unwrap(),
            "keys are per tenant"
        );
        assert_eq!(
            history(&conn, "a", "k").unwrap(),
            KeyHistory {
                attempts: 3,
                completed: true
            }
        );
        assert_eq!(query(&conn, Some("a"), 0).unwrap().len(), 3);
        assert_eq!(query(&conn, None, 150).unwrap().len(), 3);
        drop(conn);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_ledger_keyed_by_request_id_is_migrated_when_opened() {
        let path = temp("migrate");
        let _ = std::fs::remove_file(&path);
        let old = Connection::open(&path).unwrap();
        old.execute_batch(
            "CREATE TABLE usage (request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL,
                model TEXT NOT NULL, replica TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
                completion_tokens INTEGER NOT NULL, source TEXT NOT NULL, outcome TEXT NOT NULL,
                queued_ms INTEGER NOT NULL, finished_at_ms INTEGER NOT NULL);
             CREATE INDEX usage_by_tenant ON usage (tenant, finished_at_ms);
             INSERT INTO usage VALUES ('r1', 'a', 'm', 'x', 7, 3, 'engine', 'ok', 1, 100);",
        )
        .unwrap();
        drop(old);
        let conn = open(&path).unwrap();
        let rows = query(&conn, None, 0).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(
            (
                rows[0].idempotency_key.as_str(),
                rows[0].attempt,
                rows[0].completion_tokens
            ),
            ("r1", 1, 3)
        );
        drop(conn);
        let again = open(&path).unwrap();
        assert_eq!(
            query(&again, None, 0).unwrap().len(),
            1,
            "opening twice is harmless"
        );
        drop(again);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_ledger_without_the_api_column_gets_it() {
        let path = temp("add-api");
        let _ = std::fs::remove_file(&path);
        let old = Connection::open(&path).unwrap();
        old.execute_batch(
            "CREATE TABLE usage (tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL,
                attempt INTEGER NOT NULL, request_id TEXT NOT NULL, model TEXT NOT NULL,
                replica TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
                completion_tokens INTEGER NOT NULL, source TEXT NOT NULL, outcome TEXT NOT NULL,
                queued_ms INTEGER NOT NULL, finished_at_ms INTEGER NOT NULL,
                PRIMARY KEY (tenant, idempotency_key, attempt));
             INSERT INTO usage VALUES ('a', 'k', 1, 'r1', 'm', 'x', 7, 3, 'engine', 'ok', 1, 100);",
        )
        .unwrap();
        drop(old);
        let conn = open(&path).unwrap();
        let mut new = record("k2", 1, "a", 200);
        new.api = "embeddings".into();
        assert!(append(&conn, &new).unwrap());
        let apis: Vec<String> = query(&conn, None, 0)
            .unwrap()
            .into_iter()
            .map(|r| r.api)
            .collect();
        assert_eq!(apis, ["unknown", "embeddings"]);
        drop(conn);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_flush_returns_once_everything_sent_before_it_is_written() {
        let path = std::env::temp_dir().join(format!("weir-ledger-flush-{}", std::process::id()));
        let gauges = LedgerGauges::default();
        let ledger = Ledger::start(&path, gauges.clone()).unwrap();
        for i in 0..200 {
            ledger.record(record(&format!("r{i}"), 1, "a", i));
        }
        assert!(ledger.flush(std::time::Duration::from_secs(10)));
        assert_eq!(gauges.pending.get(), 0, "every record sent was written");
        assert_eq!(gauges.failures.get(), 0);
        let conn = open(&path).unwrap();
        assert_eq!(query(&conn, None, 0).unwrap().len(), 200);
        drop(conn);
        let _ = std::fs::remove_file(&path);
    }
}

//! The usage ledger: one append-only record per request id, in SQLite (WAL). A retried request id
//! never adds a second charge. Writes happen on a thread of their own, off the async workers.

use std::path::Path;
use std::sync::mpsc;

use rusqlite::{Connection, params};
use serde::Serialize;

/// What a request used, as billed. Engine counts when the engine reported them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UsageRecord {
    pub request_id: String,
    pub tenant: String,
    pub model: String,
    pub replica: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// `engine` (usage reported) or `counted` (tokens seen streaming).
    pub source: String,
    /// `ok`, `cancelled`, `failed`, `upstream_error`.
    pub outcome: String,
    pub queued_ms: u64,
    pub finished_at_ms: u64,
}

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS usage (
        request_id        TEXT PRIMARY KEY,
        tenant            TEXT NOT NULL,
        model             TEXT NOT NULL,
        replica           TEXT NOT NULL,
        prompt_tokens     INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        source            TEXT NOT NULL,
        outcome           TEXT NOT NULL,
        queued_ms         INTEGER NOT NULL,
        finished_at_ms    INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS usage_by_tenant ON usage (tenant, finished_at_ms);";

pub fn open(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.execute_batch(SCHEMA)?;
    Ok(conn)
}

/// Appends a record unless its request id is already there; returns whether it was new.
pub fn append(conn: &Connection, r: &UsageRecord) -> rusqlite::Result<bool> {
    let inserted = conn.execute(
        "INSERT OR IGNORE INTO usage VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
        params![
            r.request_id,
            r.tenant,
            r.model,
            r.replica,
            r.prompt_tokens as i64,
            r.completion_tokens as i64,
            r.source,
            r.outcome,
            r.queued_ms as i64,
            r.finished_at_ms as i64,
        ],
    )?;
    Ok(inserted == 1)
}

/// Whether a request id already completed: a replay must not run again unbilled.
pub fn completed(conn: &Connection, request_id: &str) -> rusqlite::Result<bool> {
    conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM usage WHERE request_id = ?1 AND outcome = 'ok')",
        params![request_id],
        |row| row.get(0),
    )
}

/// Records of a tenant (all tenants with `None`) finished at or after `since_ms`.
pub fn query(
    conn: &Connection,
    tenant: Option<&str>,
    since_ms: u64,
) -> rusqlite::Result<Vec<UsageRecord>> {
    let mut stmt = conn.prepare(
        "SELECT request_id, tenant, model, replica, prompt_tokens, completion_tokens, source,
                outcome, queued_ms, finished_at_ms
         FROM usage WHERE (?1 IS NULL OR tenant = ?1) AND finished_at_ms >= ?2
         ORDER BY finished_at_ms",
    )?;
    let rows = stmt.query_map(params![tenant, since_ms as i64], |row| {
        Ok(UsageRecord {
            request_id: row.get(0)?,
            tenant: row.get(1)?,
            model: row.get(2)?,
            replica: row.get(3)?,
            prompt_tokens: row.get::<_, i64>(4)? as u64,
            completion_tokens: row.get::<_, i64>(5)? as u64,
            source: row.get(6)?,
            outcome: row.get(7)?,
            queued_ms: row.get::<_, i64>(8)? as u64,
            finished_at_ms: row.get::<_, i64>(9)? as u64,
        })
    })?;
    rows.collect()
}

/// What the writer thread is sent: records, in order, and flush requests behind them.
enum Entry {
    Record(UsageRecord),
    /// Answered once every record sent before it is written.
    Flush(mpsc::Sender<()>),
}

/// A handle to the writer thread.
#[derive(Clone)]
pub struct Ledger {
    tx: mpsc::Sender<Entry>,
}

impl Ledger {
    /// Opens the database and starts its writer thread.
    pub fn start(path: &Path) -> anyhow::Result<Ledger> {
        let conn = open(path)?;
        let (tx, rx) = mpsc::channel::<Entry>();
        std::thread::Builder::new()
            .name("ledger".into())
            .spawn(move || {
                for entry in rx {
                    match entry {
                        Entry::Record(record) => {
                            if let Err(e) = append(&conn, &record) {
                                tracing::error!(request = %record.request_id, "ledger write failed: {e}");
                            }
                        }
                        Entry::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            })?;
        Ok(Ledger { tx })
    }

    pub fn record(&self, record: UsageRecord) {
        let _ = self.tx.send(Entry::Record(record));
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

    fn record(id: &str, tenant: &str, at: u64) -> UsageRecord {
        UsageRecord {
            request_id: id.into(),
            tenant: tenant.into(),
            model: "m".into(),
            replica: "r".into(),
            prompt_tokens: 10,
            completion_tokens: 5,
            source: "engine".into(),
            outcome: "ok".into(),
            queued_ms: 1,
            finished_at_ms: at,
        }
    }

    #[test]
    fn a_request_id_is_charged_once() {
        let dir = std::env::temp_dir().join(format!("weir-ledger-{}", std::process::id()));
        let conn = open(&dir).unwrap();
        assert!(!completed(&conn, "r1").unwrap());
        assert!(append(&conn, &record("r1", "a", 100)).unwrap());
        assert!(completed(&conn, "r1").unwrap());
        assert!(
            !append(&conn, &record("r1", "a", 200)).unwrap(),
            "retry ignored"
        );
        assert!(append(&conn, &record("r2", "b", 300)).unwrap());
        assert_eq!(query(&conn, Some("a"), 0).unwrap().len(), 1);
        assert_eq!(query(&conn, None, 150).unwrap().len(), 1);
        assert_eq!(query(&conn, None, 0).unwrap()[0].finished_at_ms, 100);
        drop(conn);
        let _ = std::fs::remove_file(&dir);
    }

    #[test]
    fn a_flush_returns_once_everything_sent_before_it_is_written() {
        let path = std::env::temp_dir().join(format!("weir-ledger-flush-{}", std::process::id()));
        let ledger = Ledger::start(&path).unwrap();
        for i in 0..200 {
            ledger.record(record(&format!("r{i}"), "a", i));
        }
        assert!(ledger.flush(std::time::Duration::from_secs(10)));
        let conn = open(&path).unwrap();
        assert_eq!(query(&conn, None, 0).unwrap().len(), 200);
        drop(conn);
        let _ = std::fs::remove_file(&path);
    }
}

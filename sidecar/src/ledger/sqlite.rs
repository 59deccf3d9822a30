//! The embedded store: SQLite (WAL), the default. A ledger written before attempts were
//! recorded (primary key `request_id`) is migrated in place when opened: each old row becomes
//! attempt 1 of a key equal to its request id. Columns added since (the API, cached prompt
//! tokens, the price and cost, the route and mode, the run, agent, tool calls and start) are added to an
//! older ledger when it is opened, its old rows `unknown`, 0 and NULL.

use std::path::Path;

use rusqlite::{Connection, Row, params};

use super::{KeyHistory, UsageRecord};

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
        cached_prompt_tokens INTEGER NOT NULL DEFAULT 0,
        currency          TEXT,
        price_input       REAL,
        price_cached_input REAL,
        price_output      REAL,
        cost_micros       INTEGER,
        route             TEXT,
        mode              TEXT,
        run_id            TEXT,
        agent_id          TEXT,
        tool_calls        INTEGER NOT NULL DEFAULT 0,
        started_at_ms     INTEGER,
        PRIMARY KEY (tenant, idempotency_key, attempt)
    );
    CREATE INDEX IF NOT EXISTS usage_by_tenant ON usage (tenant, finished_at_ms);
    CREATE INDEX IF NOT EXISTS usage_by_run ON usage (tenant, run_id) WHERE run_id IS NOT NULL;";

/// Moves a ledger with one row per request id (no `attempt` column) to the attempt schema.
const MIGRATE_FROM_REQUEST_IDS: &str = "
    ALTER TABLE usage RENAME TO usage_by_request_id;
    DROP INDEX IF EXISTS usage_by_tenant;";
const COPY_FROM_REQUEST_IDS: &str = "
    INSERT INTO usage SELECT tenant, request_id, 1, request_id, model, replica, prompt_tokens,
        completion_tokens, source, outcome, queued_ms, finished_at_ms, 'unknown', 0, NULL, NULL,
        NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL
        FROM usage_by_request_id;
    DROP TABLE usage_by_request_id;";
/// Columns added since the attempt schema, each added to a ledger written before it.
const ADDED: [(&str, &str); 13] = [
    ("api", "TEXT NOT NULL DEFAULT 'unknown'"),
    ("cached_prompt_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("currency", "TEXT"),
    ("price_input", "REAL"),
    ("price_cached_input", "REAL"),
    ("price_output", "REAL"),
    ("cost_micros", "INTEGER"),
    ("route", "TEXT"),
    ("mode", "TEXT"),
    ("run_id", "TEXT"),
    ("agent_id", "TEXT"),
    ("tool_calls", "INTEGER NOT NULL DEFAULT 0"),
    ("started_at_ms", "INTEGER"),
];

/// A ledger opened to read only, as `weir usage` does: never created, written or migrated. A
/// missing file, or a ledger from an earlier version (which the sidecar migrates in place when
/// it next opens it), is an error that says so, not an empty export.
pub fn open_read_only(path: &Path) -> anyhow::Result<Connection> {
    if !path.is_file() {
        anyhow::bail!(
            "{}: no ledger there (the sidecar's `ledger` setting names its file)",
            path.display()
        );
    }
    let conn = open_unwritten(path)?;
    let columns = columns(&conn)?;
    if columns.is_empty() {
        anyhow::bail!("{}: not a weir ledger (no usage table)", path.display());
    }
    let current = ["attempt"]
        .into_iter()
        .chain(ADDED.iter().map(|(name, _)| *name))
        .all(|name| columns.iter().any(|c| c == name));
    if !current {
        anyhow::bail!(
            "{}: a ledger from an earlier weir version; the sidecar migrates it in place when it \
             next opens it (weir usage only reads)",
            path.display()
        );
    }
    Ok(conn)
}

/// Opens `path` to read without writing a byte anywhere. The ledger is in WAL mode, and a
/// read-only SQLite connection to a WAL database creates its `-shm` and `-wal` files when they
/// are missing (a ledger closed cleanly has neither): files left owned by whoever read, which
/// the sidecar may not be able to write when it next opens its ledger. Without them every
/// record is in the database file and it is read as it is (`immutable`); with them (the
/// sidecar has it open) it is read through them, which creates nothing.
fn open_unwritten(path: &Path) -> rusqlite::Result<Connection> {
    use rusqlite::OpenFlags;
    let beside = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        std::path::PathBuf::from(name).exists()
    };
    if beside("-wal") || beside("-shm") {
        return Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY);
    }
    let mut uri = String::from("file:");
    for &b in path.as_os_str().as_encoded_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.' | b'~') {
            uri.push(char::from(b));
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri.push_str("?immutable=1");
    Connection::open_with_flags(
        uri,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI,
    )
}

/// The `usage` table's columns (none when there is no such table).
fn columns(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    conn.prepare("SELECT name FROM pragma_table_info('usage')")?
        .query_map([], |row| row.get(0))?
        .collect()
}

pub fn open(path: &Path) -> rusqlite::Result<Connection> {
    let mut conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    let tx = conn.transaction()?;
    let columns = columns(&tx)?;
    let has = |name: &str| columns.iter().any(|c| c == name);
    let old = !columns.is_empty() && !has("attempt");
    if old {
        tx.execute_batch(MIGRATE_FROM_REQUEST_IDS)?;
    } else if !columns.is_empty() {
        for (name, ddl) in ADDED.iter().filter(|(name, _)| !has(name)) {
            tx.execute_batch(&format!("ALTER TABLE usage ADD COLUMN {name} {ddl};"))?;
        }
    }
    tx.execute_batch(SCHEMA)?;
    if old {
        tx.execute_batch(COPY_FROM_REQUEST_IDS)?;
    }
    tx.commit()?;
    Ok(conn)
}

/// Appends a record; returns whether it was new. Writing the same attempt again (same request
/// id, whatever number it was given) adds nothing. A record whose attempt number another attempt of the key already holds —
/// numbered from a history read before that one was written — becomes the key's next attempt:
/// every attempt that used an engine is billed, none is lost.
pub fn append(conn: &Connection, r: &UsageRecord) -> rusqlite::Result<bool> {
    if insert(conn, r, r.attempt)? {
        return Ok(true);
    }
    let written: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM usage WHERE tenant = ?1 AND idempotency_key = ?2
             AND request_id = ?3)",
        params![r.tenant, r.idempotency_key, r.request_id],
        |row| row.get(0),
    )?;
    if written {
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
    // Prepared once per connection: parsing the statement cost as much as running it.
    let inserted = conn.prepare_cached(
        "INSERT OR IGNORE INTO usage (tenant, idempotency_key, attempt, request_id, model, replica,
             prompt_tokens, completion_tokens, source, outcome, queued_ms, finished_at_ms, api,
             cached_prompt_tokens, currency, price_input, price_cached_input, price_output,
             cost_micros, route, mode, run_id, agent_id, tool_calls, started_at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17,
             ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25)",
    )?
    .execute(params![
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
            r.cached_prompt_tokens as i64,
            r.currency,
            r.price_input,
            r.price_cached_input,
            r.price_output,
            r.cost_micros.map(|c| c as i64),
            r.route,
            r.mode,
            r.run_id,
            r.agent_id,
            r.tool_calls as i64,
            r.started_at_ms.map(|t| t as i64),
        ])?;
    Ok(inserted == 1)
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

/// Records of a tenant, or of every tenant under a prefix of its path (`acme`, `acme/ml`: never
/// `acme2/…`), finished at or after `since_ms`; all tenants with `None`. Compared by `substr`,
/// not `LIKE`: SQLite's `LIKE` ignores case, and ids do not.
pub fn query(
    conn: &Connection,
    tenant: Option<&str>,
    since_ms: u64,
) -> rusqlite::Result<Vec<UsageRecord>> {
    let mut stmt = conn.prepare(
        "SELECT tenant, idempotency_key, attempt, request_id, model, replica, prompt_tokens,
                completion_tokens, source, outcome, queued_ms, finished_at_ms, api,
                cached_prompt_tokens, currency, price_input, price_cached_input, price_output,
                cost_micros, route, mode, run_id, agent_id, tool_calls, started_at_ms
         FROM usage
         WHERE (?1 IS NULL OR tenant = ?1 OR substr(tenant, 1, length(?1) + 1) = ?1 || '/')
           AND finished_at_ms >= ?2
         ORDER BY finished_at_ms",
    )?;
    let rows = stmt.query_map(params![tenant, since_ms as i64], read)?;
    rows.collect()
}

/// A row in the column order [`query`] selects.
fn read(row: &Row) -> rusqlite::Result<UsageRecord> {
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
        cached_prompt_tokens: row.get::<_, i64>(13)? as u64,
        currency: row.get(14)?,
        price_input: row.get(15)?,
        price_cached_input: row.get(16)?,
        price_output: row.get(17)?,
        cost_micros: row.get::<_, Option<i64>>(18)?.map(|c| c as u64),
        route: row.get(19)?,
        mode: row.get(20)?,
        run_id: row.get(21)?,
        agent_id: row.get(22)?,
        tool_calls: row.get::<_, i64>(23)? as u64,
        started_at_ms: row.get::<_, Option<i64>>(24)?.map(|t| t as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::sample as record;

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
    fn a_ledger_without_the_newer_columns_gets_them_its_old_rows_unpriced() {
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
        new.cached_prompt_tokens = 4;
        new.currency = Some("USD".into());
        new.cost_micros = Some(12);
        assert!(append(&conn, &new).unwrap());
        let rows: Vec<(String, u64, Option<u64>)> = query(&conn, None, 0)
            .unwrap()
            .into_iter()
            .map(|r| (r.api, r.cached_prompt_tokens, r.cost_micros))
            .collect();
        assert_eq!(
            rows,
            [
                ("unknown".to_owned(), 0, None),
                ("embeddings".to_owned(), 4, Some(12))
            ]
        );
        drop(conn);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn ledger_migrates_and_records_run_id() {
        let path = temp("runs");
        let _ = std::fs::remove_file(&path);
        // A ledger as the release before runs wrote it: every column up to `mode`.
        let old = Connection::open(&path).unwrap();
        let before: String = SCHEMA
            .replace("run_id            TEXT,", "")
            .replace("agent_id          TEXT,", "")
            .replace("tool_calls        INTEGER NOT NULL DEFAULT 0,", "")
            .replace("started_at_ms     INTEGER,", "");
        let before = before
            .split("CREATE INDEX IF NOT EXISTS usage_by_run")
            .next()
            .unwrap();
        old.execute_batch(before).unwrap();
        let had = columns(&old).unwrap();
        assert!(had.contains(&"mode".to_owned()) && !had.contains(&"run_id".to_owned()));
        append_old(&old);
        drop(old);
        let conn = open(&path).unwrap();
        let mut step = record("k2", 1, "a", 200);
        step.run_id = Some("run-1".into());
        step.agent_id = Some("planner".into());
        step.tool_calls = 3;
        step.started_at_ms = Some(150);
        assert!(append(&conn, &step).unwrap());
        let rows: Vec<_> = query(&conn, None, 0)
            .unwrap()
            .into_iter()
            .map(|r| (r.run_id, r.agent_id, r.tool_calls, r.started_at_ms))
            .collect();
        assert_eq!(
            rows,
            [
                (None, None, 0, None),
                (Some("run-1".into()), Some("planner".into()), 3, Some(150))
            ]
        );
        drop(conn);
        assert!(
            open_read_only(&path).is_ok(),
            "migrated: current for weir usage"
        );
        let _ = std::fs::remove_file(&path);
    }

    /// A row as the release before runs wrote it.
    fn append_old(conn: &Connection) {
        conn.execute_batch(
            "INSERT INTO usage (tenant, idempotency_key, attempt, request_id, model, replica,
                 prompt_tokens, completion_tokens, source, outcome, queued_ms, finished_at_ms)
             VALUES ('a', 'k', 1, 'r1', 'm', 'x', 7, 3, 'engine', 'ok', 1, 100);",
        )
        .unwrap();
    }
}

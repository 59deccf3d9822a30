//! The spool: a local durable queue (a SQLite file) of records PostgreSQL has not taken yet,
//! in the order they were written. Its sequence is an autoincrement key, so order survives a
//! restart, and every push is synced to disk before the writer moves on (`synchronous=FULL`):
//! a record in the spool outlives a crash of the process or the machine.

use std::path::Path;

use rusqlite::{Connection, params};

use super::{KeyHistory, UsageRecord};

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS spool (
        seq             INTEGER PRIMARY KEY AUTOINCREMENT,
        tenant          TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        record          TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS spool_by_key ON spool (tenant, idempotency_key);";

/// Opens (creating if missing) the spool at `path`.
pub fn open(path: &Path) -> anyhow::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch(SCHEMA)?;
    Ok(conn)
}

/// Appends a record behind every one spooled before it.
pub fn push(conn: &Connection, r: &UsageRecord) -> anyhow::Result<()> {
    conn.execute(
        "INSERT INTO spool (tenant, idempotency_key, record) VALUES (?1, ?2, ?3)",
        params![r.tenant, r.idempotency_key, serde_json::to_string(r)?],
    )?;
    Ok(())
}

/// The oldest `limit` records with their sequence numbers, oldest first.
pub fn front(conn: &Connection, limit: usize) -> anyhow::Result<Vec<(i64, UsageRecord)>> {
    let mut stmt = conn.prepare("SELECT seq, record FROM spool ORDER BY seq LIMIT ?1")?;
    let rows = stmt.query_map(params![limit as i64], |row| {
        Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?))
    })?;
    rows.map(|row| {
        let (seq, json) = row?;
        Ok((seq, serde_json::from_str(&json)?))
    })
    .collect()
}

/// Removes every record up to and including `seq` (the store acknowledged them).
pub fn remove_through(conn: &Connection, seq: i64) -> anyhow::Result<()> {
    conn.execute("DELETE FROM spool WHERE seq <= ?1", params![seq])?;
    Ok(())
}

/// Records waiting.
pub fn depth(conn: &Connection) -> anyhow::Result<u64> {
    Ok(conn.query_row("SELECT COUNT(*) FROM spool", [], |row| row.get::<_, i64>(0))? as u64)
}

/// What the spooled records say of a tenant's idempotency key.
pub fn history(conn: &Connection, tenant: &str, key: &str) -> anyhow::Result<KeyHistory> {
    let mut stmt =
        conn.prepare("SELECT record FROM spool WHERE tenant = ?1 AND idempotency_key = ?2")?;
    let rows = stmt.query_map(params![tenant, key], |row| row.get::<_, String>(0))?;
    let mut past = KeyHistory::default();
    for json in rows {
        let r: UsageRecord = serde_json::from_str(&json?)?;
        past = past.and(KeyHistory {
            attempts: r.attempt,
            completed: weir_core::outcome::completed(&r.outcome),
        });
    }
    Ok(past)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::sample;

    #[test]
    fn records_leave_in_the_order_they_came_and_survive_a_reopen() {
        let path = std::env::temp_dir().join(format!("weir-spool-order-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let conn = open(&path).unwrap();
        for i in 0..5 {
            push(&conn, &sample(&format!("k{i}"), 1, "a", i)).unwrap();
        }
        let mut failed = sample("k", 2, "b", 9);
        failed.outcome = "failed".into();
        push(&conn, &failed).unwrap();
        drop(conn);
        let conn = open(&path).unwrap();
        assert_eq!(depth(&conn).unwrap(), 6);
        let first = front(&conn, 3).unwrap();
        let keys: Vec<&str> = first
            .iter()
            .map(|(_, r)| r.idempotency_key.as_str())
            .collect();
        assert_eq!(keys, ["k0", "k1", "k2"]);
        remove_through(&conn, first[2].0).unwrap();
        let rest: Vec<String> = front(&conn, 10)
            .unwrap()
            .into_iter()
            .map(|(_, r)| r.idempotency_key)
            .collect();
        assert_eq!(rest, ["k3", "k4", "k"]);
        assert_eq!(
            history(&conn, "b", "k").unwrap(),
            KeyHistory {
                attempts: 2,
                completed: false
            }
        );
        assert_eq!(history(&conn, "a", "k").unwrap(), KeyHistory::default());
        drop(conn);
        let _ = std::fs::remove_file(&path);
    }
}

//! The shared store: PostgreSQL, written by every sidecar of a fleet. The table is created
//! when missing (under an advisory lock, so sidecars starting together do not race), and
//! every insert is `ON CONFLICT DO NOTHING` on two keys: (tenant, idempotency key, attempt),
//! the primary key, and (tenant, request id), so a record written twice — by a replay of the
//! spool after a crash — adds nothing. Several sidecars may write concurrently: PostgreSQL
//! serializes inserts of one key, and a record that finds its attempt number taken by another
//! attempt becomes the key's next one, as in [`super::sqlite`].
//!
//! `weir_usage_by_tenant` on (tenant, finished_at_ms) serves the per-tenant, per-period export
//! (`weir usage --tenant T --since P` is one range scan). An index rather than partitions:
//! partitions by month would need creating ahead of time and a unique key that includes the
//! partition column, which the conflict keys do not; an operator may still partition by
//! attaching the table later.

use std::time::Duration;

use postgres::{Client, NoTls, Row, Transaction};

use super::remote::Store;
use super::{KeyHistory, UsageRecord};

/// How long a connection attempt may take: the writer spools rather than wait longer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one write (or a silent connection) may take before it counts as a failure.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Serializes the migration among sidecars starting at once (any constant unique to weir).
const MIGRATION_LOCK: i64 = 0x7765_6972_6c65_6467;

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS weir_usage (
        tenant               TEXT NOT NULL,
        idempotency_key      TEXT NOT NULL,
        attempt              INTEGER NOT NULL,
        request_id           TEXT NOT NULL,
        model                TEXT NOT NULL,
        api                  TEXT NOT NULL,
        replica              TEXT NOT NULL,
        prompt_tokens        BIGINT NOT NULL,
        completion_tokens    BIGINT NOT NULL,
        cached_prompt_tokens BIGINT NOT NULL DEFAULT 0,
        source               TEXT NOT NULL,
        outcome              TEXT NOT NULL,
        queued_ms            BIGINT NOT NULL,
        finished_at_ms       BIGINT NOT NULL,
        currency             TEXT,
        price_input          DOUBLE PRECISION,
        price_cached_input   DOUBLE PRECISION,
        price_output         DOUBLE PRECISION,
        cost_micros          BIGINT,
        route                TEXT,
        mode                 TEXT,
        run_id               TEXT,
        agent_id             TEXT,
        tool_calls           BIGINT NOT NULL DEFAULT 0,
        started_at_ms        BIGINT,
        PRIMARY KEY (tenant, idempotency_key, attempt)
    );
    ALTER TABLE weir_usage ADD COLUMN IF NOT EXISTS route TEXT;
    ALTER TABLE weir_usage ADD COLUMN IF NOT EXISTS mode TEXT;
    ALTER TABLE weir_usage ADD COLUMN IF NOT EXISTS run_id TEXT;
    ALTER TABLE weir_usage ADD COLUMN IF NOT EXISTS agent_id TEXT;
    ALTER TABLE weir_usage ADD COLUMN IF NOT EXISTS tool_calls BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE weir_usage ADD COLUMN IF NOT EXISTS started_at_ms BIGINT;
    CREATE UNIQUE INDEX IF NOT EXISTS weir_usage_request ON weir_usage (tenant, request_id);
    CREATE INDEX IF NOT EXISTS weir_usage_by_tenant ON weir_usage (tenant, finished_at_ms);
    CREATE INDEX IF NOT EXISTS weir_usage_by_run ON weir_usage (tenant, run_id)
        WHERE run_id IS NOT NULL;";

const COLUMNS: &str = "tenant, idempotency_key, attempt, request_id, model, api, replica,
    prompt_tokens, completion_tokens, cached_prompt_tokens, source, outcome, queued_ms,
    finished_at_ms, currency, price_input, price_cached_input, price_output, cost_micros, route,
    mode, run_id, agent_id, tool_calls, started_at_ms";

/// Connects to `url` and creates the schema if it is missing (or adds what it lacks).
pub fn connect(url: &str) -> anyhow::Result<Client> {
    let mut client = open(url)?;
    migrate(&mut client)?;
    Ok(client)
}

/// Connects to `url` to read only, as `weir usage` does: a ledger missing or from an earlier
/// version (which a sidecar migrates when it next connects) is an error, never created or
/// changed from here.
pub fn connect_read_only(url: &str) -> anyhow::Result<Client> {
    let mut client = open(url)?;
    let columns: Vec<String> = client
        .query(
            "SELECT column_name::TEXT FROM information_schema.columns
             WHERE table_name = 'weir_usage' AND table_schema = current_schema()",
            &[],
        )?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if columns.is_empty() {
        anyhow::bail!("no weir ledger there (no weir_usage table)");
    }
    let missing: Vec<&str> = COLUMNS
        .split(',')
        .map(str::trim)
        .filter(|c| !columns.iter().any(|have| have == c))
        .collect();
    if !missing.is_empty() {
        anyhow::bail!(
            "a ledger from an earlier weir version (no {}); a sidecar migrates it when it next \
             connects (weir usage only reads)",
            missing.join(", ")
        );
    }
    Ok(client)
}

fn open(url: &str) -> anyhow::Result<Client> {
    let mut config: postgres::Config = url.parse()?;
    config.connect_timeout(CONNECT_TIMEOUT);
    // A write that hangs (a lock wait, a server gone quiet, a dropped network path) fails
    // instead, so its records go to the spool rather than waiting behind it in memory.
    config.options(&format!(
        "-c statement_timeout={ms} -c lock_timeout={ms}",
        ms = WRITE_TIMEOUT.as_millis()
    ));
    config.tcp_user_timeout(WRITE_TIMEOUT);
    config.keepalives_idle(WRITE_TIMEOUT);
    Ok(config.connect(NoTls)?)
}

fn migrate(client: &mut Client) -> anyhow::Result<()> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(SCHEMA)?;
    tx.commit()?;
    Ok(())
}

impl Store for Client {
    fn append_all(&mut self, records: &[UsageRecord]) -> anyhow::Result<()> {
        let mut tx = self.transaction()?;
        for r in records {
            append(&mut tx, r)?;
        }
        tx.commit()?;
        Ok(())
    }
}

/// Appends a record; returns whether it was new (see the module doc).
pub fn append(tx: &mut Transaction, r: &UsageRecord) -> anyhow::Result<bool> {
    let insert = format!(
        "INSERT INTO weir_usage ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
             $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25)
         ON CONFLICT DO NOTHING"
    );
    let mut attempt = i32::try_from(r.attempt)?;
    // Each round loses only to an attempt another writer committed meanwhile.
    for _ in 0..16 {
        let inserted = tx.execute(
            &insert,
            &[
                &r.tenant,
                &r.idempotency_key,
                &attempt,
                &r.request_id,
                &r.model,
                &r.api,
                &r.replica,
                &(r.prompt_tokens as i64),
                &(r.completion_tokens as i64),
                &(r.cached_prompt_tokens as i64),
                &r.source,
                &r.outcome,
                &(r.queued_ms as i64),
                &(r.finished_at_ms as i64),
                &r.currency,
                &r.price_input,
                &r.price_cached_input,
                &r.price_output,
                &r.cost_micros.map(|c| c as i64),
                &r.route,
                &r.mode,
                &r.run_id,
                &r.agent_id,
                &i64::try_from(r.tool_calls)?,
                &r.started_at_ms.map(i64::try_from).transpose()?,
            ],
        )?;
        if inserted == 1 {
            return Ok(true);
        }
        let written: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM weir_usage WHERE tenant = $1 AND request_id = $2)",
                &[&r.tenant, &r.request_id],
            )?
            .get(0);
        if written {
            return Ok(false);
        }
        attempt = tx
            .query_one(
                "SELECT COALESCE(MAX(attempt), 0) + 1 FROM weir_usage
                 WHERE tenant = $1 AND idempotency_key = $2",
                &[&r.tenant, &r.idempotency_key],
            )?
            .get(0);
    }
    anyhow::bail!(
        "no free attempt number for a record of request {}",
        r.request_id
    )
}

pub fn history(client: &mut Client, tenant: &str, key: &str) -> anyhow::Result<KeyHistory> {
    let row = client.query_one(
        "SELECT COALESCE(MAX(attempt), 0), COALESCE(BOOL_OR(outcome = 'ok'), false)
         FROM weir_usage WHERE tenant = $1 AND idempotency_key = $2",
        &[&tenant, &key],
    )?;
    Ok(KeyHistory {
        attempts: row.get::<_, i32>(0).try_into()?,
        completed: row.get(1),
    })
}

/// Records of a tenant, or of every tenant under a prefix of its path, finished at or after
/// `since_ms`; all tenants with `None`. As [`super::sqlite::query`].
pub fn query(
    client: &mut Client,
    tenant: Option<&str>,
    since_ms: u64,
) -> anyhow::Result<Vec<UsageRecord>> {
    let rows = client.query(
        &format!(
            "SELECT {COLUMNS} FROM weir_usage
             WHERE ($1::TEXT IS NULL OR tenant = $1
                    OR substr(tenant, 1, length($1) + 1) = $1 || '/')
               AND finished_at_ms >= $2
             ORDER BY finished_at_ms, request_id"
        ),
        &[&tenant, &(since_ms as i64)],
    )?;
    rows.iter().map(read).collect()
}

fn read(row: &Row) -> anyhow::Result<UsageRecord> {
    let count = |i: usize| -> anyhow::Result<u64> { Ok(u64::try_from(row.try_get::<_, i64>(i)?)?) };
    Ok(UsageRecord {
        tenant: row.try_get(0)?,
        idempotency_key: row.try_get(1)?,
        attempt: u32::try_from(row.try_get::<_, i32>(2)?)?,
        request_id: row.try_get(3)?,
        model: row.try_get(4)?,
        api: row.try_get(5)?,
        replica: row.try_get(6)?,
        prompt_tokens: count(7)?,
        completion_tokens: count(8)?,
        cached_prompt_tokens: count(9)?,
        source: row.try_get(10)?,
        outcome: row.try_get(11)?,
        queued_ms: count(12)?,
        finished_at_ms: count(13)?,
        currency: row.try_get(14)?,
        price_input: row.try_get(15)?,
        price_cached_input: row.try_get(16)?,
        price_output: row.try_get(17)?,
        cost_micros: row
            .try_get::<_, Option<i64>>(18)?
            .map(u64::try_from)
            .transpose()?,
        route: row.try_get(19)?,
        mode: row.try_get(20)?,
        run_id: row.try_get(21)?,
        agent_id: row.try_get(22)?,
        tool_calls: count(23)?,
        started_at_ms: row
            .try_get::<_, Option<i64>>(24)?
            .map(u64::try_from)
            .transpose()?,
    })
}

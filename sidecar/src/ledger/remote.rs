//! A remote store behind the spool. A record goes straight to the store while nothing is
//! spooled and the store answers; otherwise it goes to the back of the spool, which is
//! replayed, oldest first, whenever the store can be reached again. So records reach the store
//! in the order they were written, and none is lost while it is down.
//!
//! A record leaves the spool only after the store acknowledged it (its batch committed). A
//! crash between the commit and the removal replays the batch on the next start, and the
//! store's conflict key (one row per request id) makes the second write add nothing: nothing
//! lost, nothing doubled.

use std::path::Path;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use super::{UsageRecord, spool};

/// A store the spool drains into.
pub trait Store {
    /// Writes `records`, in order, all or none (one transaction); `Ok` once committed.
    /// Records it already holds (same tenant and request id) are skipped.
    fn append_all(&mut self, records: &[UsageRecord]) -> anyhow::Result<()>;
}

/// Opens a connection to the store.
pub type Connect<S> = Box<dyn FnMut() -> anyhow::Result<S> + Send>;

/// How long after a failure the store is tried again.
const RETRY: Duration = Duration::from_secs(1);
/// Records replayed per transaction.
const BATCH: usize = 256;
/// How long the writer waits for a record when nothing is spooled (nothing to retry).
const IDLE: Duration = Duration::from_secs(3600);

pub struct Remote<S> {
    spool: rusqlite::Connection,
    connect: Connect<S>,
    store: Option<S>,
    depth: u64,
    retry_at: Instant,
    spooled: Gauge,
    failures: Counter,
}

impl<S: Store> Remote<S> {
    /// Opens the spool at `path`; what an earlier run left in it is replayed first.
    pub fn open(
        path: &Path,
        connect: Connect<S>,
        spooled: Gauge,
        failures: Counter,
    ) -> anyhow::Result<Remote<S>> {
        let conn = spool::open(path)?;
        let depth = spool::depth(&conn)?;
        spooled.set(depth as i64);
        Ok(Remote {
            spool: conn,
            connect,
            store: None,
            depth,
            retry_at: Instant::now(),
            spooled,
            failures,
        })
    }

    /// How long the writer may wait for the next record before it should [`replay`](Self::replay).
    pub fn retry_in(&self) -> Duration {
        if self.depth == 0 {
            IDLE
        } else {
            self.retry_at.saturating_duration_since(Instant::now())
        }
    }

    /// Records spooled and not yet taken by the store.
    pub fn depth(&self) -> u64 {
        self.depth
    }

    /// Writes a record to the store, or to the spool behind the ones waiting; `Err` only when
    /// the spool cannot take it either (the record is lost).
    pub fn write(&mut self, record: &UsageRecord) -> anyhow::Result<()> {
        if self.depth == 0 && self.reach(false) {
            match self.store_append(std::slice::from_ref(record)) {
                Ok(()) => return Ok(()),
                Err(e) => self.lost(&e),
            }
        }
        spool::push(&self.spool, record)?;
        self.depth += 1;
        self.spooled.set(self.depth as i64);
        if Instant::now() >= self.retry_at {
            self.replay(false);
        }
        Ok(())
    }

    /// Moves spooled records to the store, oldest first, until the spool is empty or the store
    /// fails. `now`: try at once, even within the pause after a failure (a flush).
    pub fn replay(&mut self, now: bool) {
        while self.depth > 0 && self.reach(now) {
            let batch = match spool::front(&self.spool, BATCH) {
                Ok(batch) => batch,
                Err(e) => {
                    tracing::error!("ledger spool unreadable: {e}");
                    return;
                }
            };
            let Some(last) = batch.last().map(|(seq, _)| *seq) else {
                self.depth = 0;
                break;
            };
            let records: Vec<UsageRecord> = batch.into_iter().map(|(_, r)| r).collect();
            if let Err(e) = self.store_append(&records) {
                self.lost(&e);
                return;
            }
            // Acknowledged: only now may the records leave the spool.
            if let Err(e) = spool::remove_through(&self.spool, last) {
                tracing::error!("ledger spool: replayed records not removed: {e}");
                return;
            }
            self.depth = spool::depth(&self.spool).unwrap_or(0);
            self.spooled.set(self.depth as i64);
        }
        self.spooled.set(self.depth as i64);
    }

    /// Whether a connection is open, opening one if none is and a try is due (or `now`).
    fn reach(&mut self, now: bool) -> bool {
        if self.store.is_some() {
            return true;
        }
        if !now && Instant::now() < self.retry_at {
            return false;
        }
        match (self.connect)() {
            Ok(store) => {
                tracing::info!(spooled = self.depth, "ledger store reachable");
                self.store = Some(store);
                true
            }
            Err(e) => {
                self.lost(&e);
                false
            }
        }
    }

    fn store_append(&mut self, records: &[UsageRecord]) -> anyhow::Result<()> {
        match &mut self.store {
            Some(store) => store.append_all(records),
            None => anyhow::bail!("not connected"),
        }
    }

    /// The store failed: drop the connection, spool until the next try.
    fn lost(&mut self, e: &anyhow::Error) {
        self.failures.inc();
        self.store = None;
        self.retry_at = Instant::now() + RETRY;
        tracing::warn!(
            spooled = self.depth,
            "ledger store unavailable, spooling: {e:#}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::sample;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    /// A store in memory that can be taken down, and can lose its acknowledgements (commit,
    /// then fail), as a connection cut after PostgreSQL committed does. It skips request ids
    /// it holds, as the conflict key does.
    #[derive(Clone, Default)]
    struct Flaky {
        down: Arc<AtomicBool>,
        lose_acks: Arc<AtomicBool>,
        rows: Arc<Mutex<Vec<UsageRecord>>>,
    }

    impl Store for Flaky {
        fn append_all(&mut self, records: &[UsageRecord]) -> anyhow::Result<()> {
            if self.down.load(Ordering::SeqCst) {
                anyhow::bail!("down");
            }
            let mut rows = self.rows.lock().unwrap();
            for r in records {
                if !rows.iter().any(|have| have.request_id == r.request_id) {
                    rows.push(r.clone());
                }
            }
            if self.lose_acks.load(Ordering::SeqCst) {
                anyhow::bail!("connection lost after commit");
            }
            Ok(())
        }
    }

    fn remote(path: &Path, store: &Flaky) -> Remote<Flaky> {
        let store = store.clone();
        let connect = move || {
            if store.down.load(Ordering::SeqCst) {
                anyhow::bail!("refused");
            }
            Ok(store.clone())
        };
        Remote::open(
            path,
            Box::new(connect),
            Gauge::default(),
            Counter::default(),
        )
        .unwrap()
    }

    fn ids(store: &Flaky) -> Vec<String> {
        let rows = store.rows.lock().unwrap();
        rows.iter().map(|r| r.idempotency_key.clone()).collect()
    }

    fn temp(name: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("weir-remote-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        path
    }

    #[test]
    fn records_written_while_the_store_is_down_reach_it_in_order_once() {
        let path = temp("order");
        let store = Flaky::default();
        let mut r = remote(&path, &store);
        r.write(&sample("a", 1, "t", 1)).unwrap();
        store.down.store(true, Ordering::SeqCst);
        r.write(&sample("b", 1, "t", 2)).unwrap();
        r.write(&sample("c", 1, "t", 3)).unwrap();
        assert_eq!(r.depth(), 2, "spooled while down");
        store.down.store(false, Ordering::SeqCst);
        // Back up, but the spool is not empty: a new record goes behind it, not ahead.
        r.write(&sample("d", 1, "t", 4)).unwrap();
        assert_eq!(ids(&store), ["a"], "the retry pause has not passed");
        r.replay(true);
        assert_eq!(r.depth(), 0);
        assert_eq!(ids(&store), ["a", "b", "c", "d"]);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_lost_acknowledgement_or_a_restart_replays_without_doubling() {
        let path = temp("replay");
        let store = Flaky::default();
        store.down.store(true, Ordering::SeqCst);
        let mut r = remote(&path, &store);
        for key in ["a", "b", "c"] {
            r.write(&sample(key, 1, "t", 1)).unwrap();
        }
        store.down.store(false, Ordering::SeqCst);
        store.lose_acks.store(true, Ordering::SeqCst);
        r.replay(true);
        assert_eq!(r.depth(), 3, "not acknowledged: still spooled");
        assert_eq!(ids(&store), ["a", "b", "c"], "though committed");
        drop(r);
        // The process ends here and starts again: the spool is replayed from disk.
        store.lose_acks.store(false, Ordering::SeqCst);
        let mut again = remote(&path, &store);
        assert_eq!(again.depth(), 3);
        again.write(&sample("d", 1, "t", 2)).unwrap();
        again.replay(true);
        assert_eq!(again.depth(), 0);
        assert_eq!(ids(&store), ["a", "b", "c", "d"], "none doubled, none lost");
        let _ = std::fs::remove_file(&path);
    }
}

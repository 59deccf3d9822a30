//! Which replicas a pool has, while it runs: replicas join and leave without a restart.
//!
//! A pool's replicas are those its config lists (`replicas:`) and those its discovery found in
//! DNS last ([`crate::replica::discovery`]); a reload ([`crate::reload`]) changes the first, each
//! resolution the second. [`Pool::reconcile`] brings the pool to that set:
//!
//! - **A new URL joins** as a replica that comes back does: unhealthy and `unprobed`, so it
//!   gets no traffic until its health check has answered, its engine's limits are read and its
//!   prefix-cache isolation is probed ([`crate::replica::health`]).
//! - **A URL no longer in the set leaves**: it gets no new work at once, and is dropped when
//!   the last request running there ends — a stream is never cut for it; each request's KV
//!   hold and slot come back as usual, through its assignment.
//! - **A leaving URL that is back** (a DNS answer that flapped) stays, as it was: its health
//!   check never stopped.
//! - **A retired pool** (removed from the config) keeps its replicas while requests it had
//!   queued wait for them; then they all leave.
//!
//! Each change is returned so the dispatcher starts or stops the replica's health check and
//! its metric series, and logs it.

use crate::replica::pool::{Pool, Replica, ReplicaId};
use std::collections::BTreeSet;

/// One replica's move in or out of its pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// New to the pool: its health check starts.
    Joined(ReplicaId, String),
    /// Gone from the set, requests still running there: no new work.
    Leaving(ReplicaId, String),
    /// Back in the set before it had drained.
    Stayed(ReplicaId, String),
    /// Drained and dropped: its health check and metrics stop.
    Left(ReplicaId, String),
}

impl Pool {
    /// The replicas the pool should have now. `queued`: requests wait in its queue.
    pub fn wanted(&self, queued: bool) -> BTreeSet<String> {
        if !self.retired {
            return self.listed.union(&self.discovered).cloned().collect();
        }
        if queued {
            // Retired, with requests still waiting for the replicas it has.
            return self
                .replicas
                .iter()
                .filter(|r| !r.leaving)
                .map(|r| r.url.clone())
                .collect();
        }
        BTreeSet::new()
    }

    /// Brings the replicas to `wanted` (see the module doc); returns what changed.
    pub fn reconcile(&mut self, wanted: &BTreeSet<String>) -> Vec<Change> {
        let mut changes = Vec::new();
        for r in &mut self.replicas {
            let keep = wanted.contains(&r.url);
            if r.leaving && keep {
                r.leaving = false;
                changes.push(Change::Stayed(r.id, r.url.clone()));
            } else if !r.leaving && !keep {
                r.leaving = true;
                changes.push(Change::Leaving(r.id, r.url.clone()));
            }
        }
        for url in wanted {
            if self.replicas.iter().any(|r| r.url == *url) {
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            self.replicas.push(Replica::new(id, url, &self.config));
            changes.push(Change::Joined(id, url.clone()));
        }
        changes.extend(self.drop_drained());
        changes
    }

    /// Drops the leaving replicas nothing runs on any more.
    pub fn drop_drained(&mut self) -> Vec<Change> {
        let mut changes = Vec::new();
        self.replicas.retain(|r| {
            let drained = r.leaving && r.in_flight == 0;
            if drained {
                changes.push(Change::Left(r.id, r.url.clone()));
            }
            !drained
        });
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PoolConfig;
    use crate::isolation::Isolation;

    fn set(urls: &[&str]) -> BTreeSet<String> {
        urls.iter().map(|u| u.to_string()).collect()
    }

    fn serving(pool: &mut Pool) {
        for r in &mut pool.replicas {
            r.healthy = true;
            r.isolation = Isolation::Salt;
        }
    }

    fn urls(pool: &Pool) -> Vec<&str> {
        pool.replicas.iter().map(|r| r.url.as_str()).collect()
    }

    #[test]
    fn a_new_address_joins_unprobed_and_a_gone_one_leaves_once_its_requests_end() {
        let config = PoolConfig::listing("m", ["http://a/".to_owned()]);
        let mut pool = Pool::new(&config);
        assert_eq!(urls(&pool), ["http://a"], "normalised");
        serving(&mut pool);
        pool.discovered = set(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        let changes = pool.reconcile(&pool.wanted(false));
        assert_eq!(
            changes,
            [
                Change::Joined(1, "http://10.0.0.1:8000".into()),
                Change::Joined(2, "http://10.0.0.2:8000".into())
            ]
        );
        let joined = pool.replica(1).unwrap();
        assert!(!joined.healthy && joined.isolation == Isolation::Unprobed);
        assert!(!joined.serves(), "no traffic before its probes");
        serving(&mut pool);

        // 10.0.0.1 vanishes while a request runs there: no new work, still counted.
        pool.replica_mut(1).unwrap().in_flight = 1;
        pool.discovered = set(&["http://10.0.0.2:8000"]);
        let changes = pool.reconcile(&pool.wanted(false));
        assert_eq!(changes, [Change::Leaving(1, "http://10.0.0.1:8000".into())]);
        let leaving = pool.replica(1).unwrap();
        assert!(leaving.leaving && !leaving.serves());
        assert_eq!(pool.concurrency(), 2 * 16, "the two that serve");
        assert!(pool.route(0, 1).is_some_and(|i| pool.replicas[i].id != 1));
        assert_eq!(pool.drop_drained(), [], "its request still runs");

        // Its request ends: dropped.
        pool.replica_mut(1).unwrap().in_flight = 0;
        assert_eq!(
            pool.drop_drained(),
            [Change::Left(1, "http://10.0.0.1:8000".into())]
        );
        assert_eq!(urls(&pool), ["http://a", "http://10.0.0.2:8000"]);

        // Back later: a new replica, a new id (events about the old one find nothing).
        pool.discovered = set(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        let changes = pool.reconcile(&pool.wanted(false));
        assert_eq!(changes, [Change::Joined(3, "http://10.0.0.1:8000".into())]);
        assert!(pool.replica(1).is_none());
    }

    #[test]
    fn an_address_that_flaps_back_before_draining_stays_as_it_was() {
        let mut pool = Pool::new(&PoolConfig::listing("m", ["http://a".to_owned()]));
        serving(&mut pool);
        pool.replicas[0].in_flight = 2;
        pool.listed.clear();
        assert_eq!(
            pool.reconcile(&pool.wanted(false)),
            [Change::Leaving(0, "http://a".into())]
        );
        pool.listed = set(&["http://a"]);
        assert_eq!(
            pool.reconcile(&pool.wanted(false)),
            [Change::Stayed(0, "http://a".into())]
        );
        assert!(pool.replicas[0].serves(), "probed already, still healthy");
        assert_eq!(pool.reconcile(&pool.wanted(false)), [], "nothing more");
    }

    #[test]
    fn an_idle_replica_that_leaves_is_dropped_at_once() {
        let mut pool = Pool::new(&PoolConfig::listing(
            "m",
            ["http://a".to_owned(), "http://b".to_owned()],
        ));
        pool.listed = set(&["http://b"]);
        assert_eq!(
            pool.reconcile(&pool.wanted(false)),
            [
                Change::Leaving(0, "http://a".into()),
                Change::Left(0, "http://a".into())
            ]
        );
        assert_eq!(urls(&pool), ["http://b"]);
    }

    #[test]
    fn a_retired_pool_keeps_its_replicas_while_requests_wait_for_them() {
        let mut pool = Pool::new(&PoolConfig::listing("m", ["http://a".to_owned()]));
        pool.retired = true;
        assert_eq!(pool.reconcile(&pool.wanted(true)), [], "requests queued");
        assert_eq!(pool.wanted(false), BTreeSet::new());
        assert_eq!(pool.reconcile(&pool.wanted(false)).len(), 2, "leaves, left");
        assert!(pool.replicas.is_empty());
    }
}

//! One pool as the dispatcher keeps it: its replicas, and the queue, shares, pace, fairness
//! window and preemptions its decisions read. Decisions are made per pool, so a request
//! waiting for room in one pool never holds up another pool's work, and one pool's load never
//! limits another's.

use std::sync::Arc;

use tokio::sync::watch;
use weir_core::scheduler::headroom::Shares;
use weir_core::scheduler::{Policy, Scheduler, Share, TokenWeights};

use super::accounting::Fairness;
use super::preemption::{Pending, Running};
use super::protocol::Job;
use crate::replica::health::Link;
use crate::replica::pool::Pool;
use crate::replica::projection::Paces;

pub(super) struct PoolState {
    pub pool: Pool,
    /// Its fair queue; its counters are its own (each pool is a resource shared on its own).
    pub scheduler: Scheduler<Job>,
    /// What its replicas' health checks follow.
    pub link: watch::Sender<Arc<Link>>,
    /// The live fairness measurement ([`weir_core::fairness`]).
    pub fairness: Fairness,
    /// The active shares and what each holds here: the headroom rule applies within a pool.
    pub shares: Shares,
    /// Preemptible requests running here, and the preemptions not yet done.
    pub running: Vec<Running>,
    pub preempting: Vec<Pending>,
    /// Its pace and its tenants' (dispatches per second): what projected waits are computed
    /// from (one pool's pace says nothing of another's).
    pub paces: Paces,
}

impl PoolState {
    pub fn new(
        pool: Pool,
        (policy, share): (Policy, Share),
        aging_ms: u64,
        fairness_window_ms: u64,
        now: u64,
    ) -> PoolState {
        PoolState {
            link: watch::Sender::new(link(&pool)),
            pool,
            scheduler: Scheduler::new(policy, share, TokenWeights::default(), aging_ms),
            fairness: Fairness::new(fairness_window_ms),
            shares: Shares::default(),
            running: Vec::new(),
            preempting: Vec::new(),
            paces: Paces::new(now),
        }
    }

    /// Tells its replicas' health checks of the pool's settings, if they changed.
    pub fn relink(&self) {
        let next = link(&self.pool);
        self.link.send_if_modified(|current| {
            let changed = **current != *next;
            if changed {
                *current = next;
            }
            changed
        });
    }
}

/// What a pool's health checks follow.
fn link(pool: &Pool) -> Arc<Link> {
    Arc::new(Link {
        model: pool.model.clone(),
        engine: pool.config.engine,
        cache_isolation: pool.config.cache_isolation,
        upstream: pool.upstream.clone(),
    })
}

//! What each tenant holds and has queued, per pool and replica: KV and slots for the headroom
//! rule and the metrics, its virtual token counter charged, the live fairness figures.

use std::collections::{HashMap, HashSet};

use weir_core::fairness::{Window, gap_bound};
use weir_core::scheduler::{Scheduler, Share, TokenWeights};

use crate::metrics::Labels;
use crate::replica::pool::ReplicaId;
use crate::support::clock::now_ms;

use super::{Dispatcher, Job, PoolState};

/// A pool's fairness window, and the tenant labels its last report showed a backlogged ratio
/// for.
pub(super) struct Fairness {
    pub(super) window: Window,
    pub(super) published: HashSet<String>,
}

impl Fairness {
    pub(super) fn new(window_ms: u64) -> Self {
        Fairness {
            window: Window::new(window_ms, now_ms()),
            published: HashSet::new(),
        }
    }
}

impl Dispatcher {
    /// Adds `add` and removes `remove` KV tokens held by a tenant on a replica.
    pub(super) fn adjust_hold(
        &mut self,
        pool: usize,
        replica: ReplicaId,
        t: &str,
        add: u64,
        remove: u64,
    ) {
        if let Some(r) = self.replica_mut(pool, replica) {
            r.reserved = (r.reserved + add).saturating_sub(remove);
        }
        self.update_replica_hold(pool, replica);
        if let Some(shares) = self.pools.get_mut(pool).map(|p| &mut p.shares) {
            let org = self.share.of(t);
            shares.hold(t, org, 0, add, true);
            shares.hold(t, org, 0, remove, false);
        }
        let held = self.tenant_kv.entry(t.to_owned()).or_default();
        *held = (*held + add).saturating_sub(remove);
        self.publish_hold(pool, replica, t, add, remove);
    }

    /// `t`'s share starts (`add`) or stops running `sequences` sequences in `pool`.
    pub(super) fn hold_slots(&mut self, pool: usize, t: &str, sequences: u64, add: bool) {
        if let Some(shares) = self.pools.get_mut(pool).map(|p| &mut p.shares) {
            shares.hold(t, self.share.of(t), sequences, 0, add);
        }
    }

    /// What a tenant's label holds, in all and on the replica: the sums over its keys.
    pub(super) fn publish_hold(
        &mut self,
        pool: usize,
        replica: ReplicaId,
        t: &str,
        add: u64,
        remove: u64,
    ) {
        let label = self.metrics.tenant(t);
        let held = self.label_kv.entry(label.to_owned()).or_default();
        *held = (*held + add).saturating_sub(remove);
        let m = &self.metrics;
        m.active_kv_tokens.set(&[("tenant", label)], *held as i64);
        if let Some(r) = self.pools.get(pool).and_then(|p| p.pool.replica(replica)) {
            let on = (self.replica_label_kv)
                .entry((r.url.clone(), label.to_owned()))
                .or_default();
            *on = (*on + add).saturating_sub(remove);
            let labels: Labels = &[("replica", &r.url), ("tenant", label)];
            m.replica_tenant_kv.set(labels, *on as i64);
        }
    }

    /// Removes the per-tenant KV series of a replica that left.
    pub(super) fn forget_replica_holds(&mut self, url: &str) {
        let m = &self.metrics;
        self.replica_label_kv.retain(|(on, label), _| {
            let gone = on == url;
            if gone {
                m.replica_tenant_kv
                    .remove(&[("replica", on), ("tenant", label)]);
            }
            !gone
        });
    }

    /// Publishes the counter of a tenant's label: the tree's node at that level (or the key's,
    /// where keys share the pool on their own).
    pub(super) fn update_counter(&self, pool: usize, t: &str) {
        let Some(PoolState {
            scheduler: s,
            pool: p,
            ..
        }) = self.pools.get(pool)
        else {
            return;
        };
        let label = self.metrics.tenant(t);
        let counter = s.counter_at(label).unwrap_or_else(|| s.counter(t));
        (self.metrics.vtc_counter).set(&[("tenant", label), ("pool", &p.model)], counter);
    }

    /// Charges `t` on `pool` with `charge` (which returns the weighted tokens it charged), and
    /// credits them to the fairness window.
    pub(super) fn charge(
        &mut self,
        pool: usize,
        t: &str,
        charge: impl FnOnce(&mut Scheduler<Job>, &str) -> f64,
    ) {
        let Some(PoolState {
            scheduler: s,
            fairness: w,
            ..
        }) = self.pools.get_mut(pool)
        else {
            return;
        };
        let cost = charge(s, t);
        let share = s.share_of(t);
        w.window.served(share, s.share_weight(share), cost);
        self.update_counter(pool, t);
    }

    /// Samples every pool's fairness window and publishes the report of one that closed.
    pub(super) fn sample_fairness(&mut self, now: u64) {
        for state in &mut self.pools {
            let (s, w, p) = (&state.scheduler, &mut state.fairness, &state.pool);
            let Some(report) = w.window.sample(now, s.backlogged_shares()) else {
                continue;
            };
            let (m, labels): (_, Labels) = (&self.metrics, &[("pool", &p.model)]);
            // Undefined with fewer than two tenants backlogged: no series, rather than a
            // 1.0 that would read as a fair pool.
            match report.index {
                Some(index) => m.fairness_index.set(labels, index),
                None => m.fairness_index.remove(labels),
            }
            m.fairness_backlogged.set(labels, report.backlogged as i64);
            m.fairness_gap.set(labels, report.gap);
            // L_in and M: a prompt and a batch are both bounded by the largest replica's KV.
            let kv = p.replicas.iter().map(|r| r.kv_budget).max().unwrap_or(0);
            if kv > 0 {
                let w = TokenWeights::default();
                m.fairness_gap_bound
                    .set(labels, gap_bound(w.input, kv, w.output, kv));
            }
            let mut ratios: HashMap<&str, f64> = HashMap::new();
            for (share, ratio) in &report.backlogged_ratio {
                let at = ratios.entry(m.tenant(share)).or_default();
                *at = at.max(*ratio);
            }
            // A tenant idle through the window is not in its report: its series from an
            // older window would otherwise stay at what it waited then.
            for gone in w
                .published
                .iter()
                .filter(|l| !ratios.contains_key(l.as_str()))
            {
                m.backlogged_ratio
                    .remove(&[("tenant", gone), ("pool", &p.model)]);
            }
            w.published = ratios.keys().map(|l| (*l).to_owned()).collect();
            for (label, ratio) in ratios {
                m.backlogged_ratio
                    .set(&[("tenant", label), ("pool", &p.model)], ratio);
            }
        }
    }

    pub(super) fn update_replica_hold(&self, pool: usize, replica: ReplicaId) {
        let Some(r) = self.pools.get(pool).and_then(|p| p.pool.replica(replica)) else {
            return;
        };
        let labels: Labels = &[("replica", &r.url)];
        (self.metrics.replica_reserved_kv).set(labels, r.reserved as i64);
        (self.metrics.replica_in_flight).set(labels, r.in_flight as i64);
    }

    /// `t` is active in `pool` from `now` (for the headroom rule), with the weights it was
    /// queued with: its org's among orgs, and its own below the org (the product of its
    /// path's weights under `fair_share: key`, where every key is an org of its own).
    pub(super) fn activate(&mut self, pool: usize, t: &str, now: u64, weights: &[f64]) {
        let sane = |w: &f64| if w.is_finite() && *w > 0.0 { *w } else { 1.0 };
        let (org_weight, key_weight) = match self.share {
            Share::Hierarchy => (
                weights.first().map_or(1.0, sane),
                weights.iter().skip(1).map(sane).product(),
            ),
            Share::Key => (weights.iter().map(sane).product(), 1.0),
        };
        if let Some(shares) = self.pools.get_mut(pool).map(|p| &mut p.shares) {
            shares.arrived(t, self.share.of(t), org_weight, key_weight, now);
        }
    }

    /// Publishes the queue depth of a tenant's label: the sum over its keys.
    pub(super) fn update_depth(&mut self, t: &str) {
        for p in &mut self.pools {
            p.shares.queued(t, self.share.of(t), p.scheduler.depth(t));
        }
        let now = self.depth(t);
        let before = if now == 0 {
            self.leaf_depth.remove(t)
        } else {
            self.leaf_depth.insert(t.to_owned(), now)
        };
        let label = self.metrics.tenant(t);
        let total = self.label_depth.entry(label.to_owned()).or_default();
        *total = (*total + now).saturating_sub(before.unwrap_or(0));
        let total = *total;
        if total == 0 {
            self.label_depth.remove(label);
        }
        (self.metrics.queue_depth).set(&[("tenant", label)], total as i64);
    }
}

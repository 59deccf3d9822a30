//! The queue's decisions: a job admitted or refused on arrival (bounds, shedding, its own
//! projected wait), expired, and dispatched — the fairest eligible job first, where it fits
//! and the headroom rule lets it start.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};
use weir_core::config::Priority;
use weir_core::scheduler::headroom::{Headroom, Start};
use weir_core::scheduler::{Share, Verdict};

use crate::metrics::Labels;
use crate::support::backoff::Waits;
use crate::support::clock::now_ms;

use super::preemption::{MAX_PREEMPTIONS, Running};
use super::{Assignment, Dispatcher, Event, Job, PoolState, Refusal};

/// How the headroom rule admits `job` now: under the FIFO baseline, as alone (it keeps out of
/// engines' own queues, as before the rule), else by the rule ([`Headroom::admission`]).
pub(super) fn admission(fair: bool, headroom: &Headroom, share: Share, job: &Job) -> Option<Start> {
    if !fair {
        return Some(Start::Alone);
    }
    let t = &job.tenant;
    headroom.admission(t, share.of(t), job.sequences, job.kv_need)
}

impl Dispatcher {
    /// Requests waiting, in every pool.
    pub(super) fn queued(&self) -> usize {
        self.pools.iter().map(|p| p.scheduler.len()).sum()
    }

    /// Requests a tenant has waiting, in every pool.
    pub(super) fn depth(&self, t: &str) -> usize {
        self.pools.iter().map(|p| p.scheduler.depth(t)).sum()
    }

    /// Requests of `t`'s org waiting, in every pool.
    pub(super) fn org_depth(&self, t: &str) -> usize {
        self.pools.iter().map(|p| p.scheduler.org_depth(t)).sum()
    }

    /// Turns a job away at once when its tenant's own demand cannot be served in time: its
    /// own queue (and its org's) bounded, free tier shed once it has work queued under
    /// overload, and no waiting that would outlast its deadline anyway. Under the fair policy
    /// every figure is the tenant's own ([`crate::replica::projection`]): a tenant with nothing queued
    /// is never refused for another's backlog, and a full queue makes room for it by refusing
    /// the longest queue's newest request instead. The FIFO baseline has one line for all.
    pub(super) fn refusal(&mut self, job: &Job, now: u64) -> Option<(Refusal, &'static str)> {
        let t = job.tenant.as_str();
        let depth = self.depth(t);
        if depth >= self.queue.max_per_tenant {
            return Some((
                Refusal::QueueFull(self.tenant_wait_ms(job.pool, t, job.priority)),
                "queue_full",
            ));
        }
        let org = t.split('/').next().unwrap_or(t);
        if (self.org_depth(t) >= self.queue.max_per_org && !self.make_room(t, Some(org)))
            || (self.queued() >= self.queue.max_total && !self.make_room(t, None))
        {
            return Some((
                Refusal::QueueFull(self.tenant_wait_ms(job.pool, t, job.priority)),
                "queue_full",
            ));
        }
        if job.tier == "free"
            && (depth > 0 || !self.fair)
            && self.queued() as f64 >= self.queue.shed_free_tier_above * self.queue.max_total as f64
            && !self.may_start(job)
        {
            return Some((
                Refusal::Shed(self.tenant_wait_ms(job.pool, t, job.priority)),
                "shed_free_tier",
            ));
        }
        // Only once the request cannot start now does a queue mean waiting.
        if !self.may_start(job)
            && let Some(projected_ms) = self.projected_ms(job.pool, t, job.priority)
            && projected_ms > 0.0
            && now as f64 + projected_ms > job.deadline_ms as f64
        {
            return Some((
                Refusal::ProjectedWait(projected_ms as u64),
                "projected_wait",
            ));
        }
        None
    }

    /// Whether `job` could start now: it fits a replica and, under the fair policy, its share
    /// is within the headroom rule.
    pub(super) fn may_start(&self, job: &Job) -> bool {
        let Some(PoolState {
            pool: p, shares, ..
        }) = self.pools.get(job.pool)
        else {
            return false;
        };
        let headroom = shares.headroom(p.room(), self.queue.kv_headroom);
        admission(self.fair, &headroom, self.share, job)
            .is_some_and(|start| p.fits_for(job.kv_need, job.sequences, start))
    }

    /// Makes room in a full queue (`org`'s, or the whole sidecar's) for a request of `t`:
    /// refuses the newest request of the longest queue in it — the org with the most queued,
    /// then its key with the most — unless that is `t`'s own or no longer than it, or that
    /// request is a preempted stream waiting to resume (then `t` is the one refused: false). So the refusal falls on the tenant whose backlog filled
    /// the queue, never on one with less queued.
    pub(super) fn make_room(&mut self, t: &str, org: Option<&str>) -> bool {
        let org_of = |key: &str| key.split('/').next().unwrap_or(key).to_owned();
        // The queues compared: within an org, its keys; in the whole queue, the shares (orgs,
        // or keys with `fair_share: key`), then their keys.
        let share = self.share;
        let group_of = |key: &str| share.of(key).to_owned();
        let mut groups: HashMap<String, usize> = HashMap::new();
        for (key, depth) in &self.leaf_depth {
            if org.is_none_or(|o| org_of(key) == o) {
                *groups.entry(group_of(key)).or_default() += depth;
            }
        }
        let own_group = group_of(t);
        let own_group_depth = groups.get(&own_group).copied().unwrap_or(0);
        let own_depth = self.depth(t);
        // The longest first: groups by what they have queued, then their keys.
        let mut candidates: Vec<(usize, usize, String)> = (self.leaf_depth.iter())
            .filter_map(|(key, &depth)| Some((*groups.get(&group_of(key))?, depth, key.clone())))
            .collect();
        candidates.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        for (group_depth, depth, victim) in candidates {
            // Another share gives way if it has more queued than `t`'s; within `t`'s, a key
            // with more queued than `t`.
            let longer = if group_of(&victim) == own_group {
                victim != t && depth > own_depth
            } else {
                group_depth > own_group_depth
            };
            if !longer {
                continue;
            }
            let mut pools: Vec<usize> = (0..self.pools.len()).collect();
            pools.sort_by_key(|&p| std::cmp::Reverse(self.pools[p].scheduler.depth(&victim)));
            for pool in pools {
                // A preempted request is a stream already running for its client: never given
                // up; another of the tenant's, or the next longest queue's, is.
                let Some(job) = self.pools[pool]
                    .scheduler
                    .pop_newest_where(&victim, |j| j.preemptions == 0)
                else {
                    continue;
                };
                self.update_depth(&victim);
                let refusal = Refusal::QueueFull(self.tenant_wait_ms(pool, &victim, job.priority));
                (self.metrics).reject("queue_full", &victim, refusal.status());
                let _ = job.reply.send(Err(refusal));
                return true;
            }
        }
        false
    }

    /// How long a new request of `t` would wait in `pool`, once a pace is known: under the
    /// fair policy its own backlog at its own pace ([`Paces::tenant_wait_ms`]), under FIFO the
    /// pool's whole queue.
    pub(super) fn projected_ms(&self, pool: usize, t: &str, priority: Priority) -> Option<f64> {
        let PoolState {
            scheduler: s,
            paces,
            shares,
            ..
        } = self.pools.get(pool)?;
        if !self.fair {
            return paces.pool_wait_ms(s.len());
        }
        paces.tenant_wait_ms(t, s.queued_ahead(t, priority), shares.part(t))
    }

    /// [`projected_ms`](Self::projected_ms) in whole ms, 0 while unknown: what a refusal of
    /// `t` tells it to wait.
    pub(super) fn tenant_wait_ms(&self, pool: usize, t: &str, priority: Priority) -> u64 {
        self.projected_ms(pool, t, priority)
            .map_or(0, |ms| ms as u64)
    }

    /// Publishes each pool's projected wait (before a rate is known: how long its oldest
    /// request has waited), for `Retry-After` and as a metric.
    pub(super) fn publish_waits(&self, now: u64) {
        let projected_ms: Vec<u64> = (self.pools.iter())
            .map(|p| {
                p.paces.pool_wait_ms(p.scheduler.len()).map_or_else(
                    || {
                        [Priority::Interactive, Priority::Batch]
                            .into_iter()
                            .filter_map(|c| p.scheduler.oldest_ms(c))
                            .min()
                            .map_or(0, |t| now.saturating_sub(t))
                    },
                    |ms| ms as u64,
                )
            })
            .collect();
        for (pool, ms) in self.pools.iter().zip(&projected_ms) {
            (self.metrics.projected_wait).set(&[("pool", &pool.pool.model)], *ms as f64 / 1e3);
        }
        let next = Waits {
            projected_ms,
            cap_ms: self.queue.retry_after_max_ms,
        };
        self.waits.send_if_modified(|current| {
            let changed = **current != next;
            if changed {
                *current = Arc::new(next);
            }
            changed
        });
    }

    pub(super) fn enqueue(&mut self, job: Job) {
        // A retired pool takes no new work (the handler saw it just before a reload).
        if self.pools.get(job.pool).is_none_or(|p| p.pool.retired) {
            let _ = job.reply.send(Err(Refusal::NoReplica));
            return;
        }
        let now = now_ms();
        if let Some(p) = self.pools.get_mut(job.pool) {
            p.paces.touch(&job.tenant, now);
        }
        if let Some((refusal, reason)) = self.refusal(&job, now) {
            (self.metrics).reject(reason, &job.tenant, refusal.status());
            let _ = job.reply.send(Err(refusal));
            return;
        }
        let (t, pool, weights, priority, arrived) = (
            job.tenant.clone(),
            job.pool,
            job.weights.clone(),
            job.priority,
            job.arrived_ms,
        );
        self.pools[pool]
            .scheduler
            .push(&t, &weights, priority, job, arrived);
        self.activate(pool, &t, arrived, &weights);
        self.update_counter(pool, &t);
        self.update_depth(&t);
    }

    /// Drops jobs whose deadline passed (they get a retryable refusal) or whose client left.
    pub(super) fn expire(&mut self, now: u64) {
        let gone: Vec<Job> = self
            .pools
            .iter_mut()
            .flat_map(|p| {
                p.scheduler
                    .remove_where(|job| job.deadline_ms <= now || job.reply.is_closed())
            })
            .collect();
        for job in gone {
            self.update_depth(&job.tenant);
            if !job.reply.is_closed() {
                let refusal = Refusal::DeadlinePassed(self.tenant_wait_ms(
                    job.pool,
                    &job.tenant,
                    job.priority,
                ));
                (self.metrics).reject("deadline", &job.tenant, refusal.status());
                let _ = job.reply.send(Err(refusal));
            }
        }
    }

    /// Hands out work while something fits, pool by pool: the fairest eligible job first.
    pub(super) fn dispatch(&mut self, now: u64) {
        for pool in 0..self.pools.len() {
            while self.dispatch_one(pool, now) {}
        }
    }

    /// Dispatches the next job of a pool if one may go; false when the pool has to wait.
    pub(super) fn dispatch_one(&mut self, pool: usize, now: u64) -> bool {
        let Some(events) = self.events.upgrade() else {
            return false;
        };
        let Some((t, job, taken)) = self.next_job(pool, now) else {
            return false;
        };
        self.assign(pool, now, t, job, taken, events);
        true
    }

    /// The pool's next job in fair order that may start now, and how it starts.
    fn next_job(&mut self, pool: usize, now: u64) -> Option<(String, Job, Start)> {
        let Dispatcher {
            pools,
            tenant_kv,
            queue,
            fair,
            share,
            ..
        } = self;
        let PoolState {
            scheduler,
            pool: p,
            shares,
            ..
        } = pools.get_mut(pool)?;
        // A tenant over its own KV cap, or its share past its fair part while others are
        // active ([`weir_core::scheduler::headroom`]), (or a client gone) is passed over; the next job in fair
        // order that does not fit yet holds the line until room frees.
        let headroom = shares.headroom(p.room(), queue.kv_headroom);
        // How the job taken starts ([`Start`]).
        let mut taken = Start::Alone;
        // Whether a flood next in line fits but for requests waiting inside the engines, or
        // for its prefills: it holds the line for the floods after it, not for quiet tenants'
        // requests, which may go there.
        let mut floods_wait = false;
        let judge = |t: &str, job: &Job| {
            let held = tenant_kv.get(t).copied().unwrap_or(0);
            let under_cap = job
                .kv_cap
                .is_none_or(|cap| held == 0 || held.saturating_add(job.kv_need) <= cap);
            let start = admission(*fair, &headroom, *share, job);
            match start {
                _ if !under_cap || job.reply.is_closed() => Verdict::Skip,
                None => Verdict::Skip,
                Some(start) if start.floods() && floods_wait => Verdict::Skip,
                Some(start) if p.fits_for(job.kv_need, job.sequences, start) => {
                    taken = start;
                    Verdict::Take
                }
                Some(start)
                    if start.floods() && p.fits_for(job.kv_need, job.sequences, Start::Quiet) =>
                {
                    floods_wait = true;
                    Verdict::Skip
                }
                Some(_) => Verdict::Wait,
            }
        };
        let d = scheduler.pop_where(now, judge)?;
        Some((d.tenant.to_owned(), d.item, taken))
    }

    /// Places `job` of `t` on a replica of `pool` and hands it its [`Assignment`]: the slots
    /// and KV it holds there, its tenant's counter charged for its prompt.
    fn assign(
        &mut self,
        pool: usize,
        now: u64,
        t: String,
        job: Job,
        taken: Start,
        events: mpsc::UnboundedSender<Event>,
    ) {
        let p = &self.pools[pool].pool;
        let Some(index) = p.route_for(job.affinity, job.kv_need, job.sequences, taken) else {
            let _ = job.reply.send(Err(Refusal::NoReplica));
            return;
        };
        let upstream = self.pools[pool].pool.upstream.clone();
        let r = &mut self.pools[pool].pool.replicas[index];
        r.in_flight = r.in_flight.saturating_add(job.sequences);
        let ticket = r.limiter.dispatch();
        match taken {
            start if start.floods() && job.stream => r.prefilling.push(ticket),
            Start::Quiet => r.answering.push((ticket, now)),
            _ => {}
        }
        let (resumes, dialect) = (r.resumes(), r.dialect);
        let (replica, url, isolation) = (r.id, r.url.clone(), r.isolation);
        self.hold_slots(pool, &t, job.sequences, true);
        self.adjust_hold(pool, replica, &t, job.kv_need, 0);
        let input = job.input_tokens;
        self.charge(pool, &t, |s, t| s.charge(t, input, 0));
        if let Some(p) = self.pools.get_mut(pool) {
            p.paces.dispatched(&t, now);
        }
        self.update_depth(&t);
        let queued_ms = now.saturating_sub(job.arrived_ms);
        let labels: Labels = &[("tenant", self.metrics.tenant(&t))];
        (self.metrics.queue_wait).observe(labels, queued_ms as f64 / 1e3);
        let mut job = job;
        let reply = std::mem::replace(&mut job.reply, oneshot::channel().0);
        // Only where its engine could continue it (a mixed pool could send the continuation
        // elsewhere; pools are one engine in practice).
        let (preempt, preempted) =
            if job.preemptible && resumes && job.preemptions < MAX_PREEMPTIONS {
                let (tx, rx) = oneshot::channel();
                (Some(tx), Some(rx))
            } else {
                (None, None)
            };
        // If the client left between the check and now, the assignment comes back and is
        // dropped here, which gives the room back.
        let sent = reply.send(Ok(Assignment {
            pool,
            replica,
            url,
            upstream,
            isolation,
            dialect,
            queued_ms,
            tenant: t,
            kv_held: job.kv_need,
            sequences: job.sequences,
            released: false,
            preempt: preempted,
            ticket,
            dispatched: Instant::now(),
            events,
        }));
        if let (Ok(()), Some(preempt)) = (sent, preempt) {
            self.pools[pool].running.push(Running {
                replica,
                ticket,
                dispatched_ms: now,
                started_ms: None,
                job,
                preempt,
            });
        }
    }
}

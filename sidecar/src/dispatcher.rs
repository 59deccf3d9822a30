//! The dispatch loop: one task owns the fair queues and the pools' KV accounting. Handlers
//! enqueue jobs and wait for an assignment; relays report tokens served and completion; probes
//! report engine metrics. Nothing else mutates this state, so it needs no locks.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use weir_core::config::Priority;
use weir_core::scheduler::{Policy, Scheduler, TokenWeights, Verdict};

use crate::config::QueueConfig;
use crate::metrics::{Metrics, tenant};
use crate::pool::{EngineSample, Pool};

/// A request waiting for a replica.
pub struct Job {
    pub tenant: String,
    pub tier: String,
    pub weight: f64,
    pub priority: Priority,
    pub pool: usize,
    pub input_tokens: u64,
    /// KV tokens to reserve: the prompt plus the output it may still produce.
    pub kv_need: u64,
    /// The tenant's active-KV cap (`active_kv_tokens`), if it has one.
    pub kv_cap: Option<u64>,
    pub affinity: u64,
    pub arrived_ms: u64,
    /// Wall-clock ms by which it must be dispatched, or it is dropped.
    pub deadline_ms: u64,
    pub reply: oneshot::Sender<Result<Assignment, Refusal>>,
}

/// Where a job runs.
#[derive(Debug)]
pub struct Assignment {
    pub pool: usize,
    pub replica: usize,
    pub url: String,
    pub queued_ms: u64,
}

/// Why a job was not dispatched.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    /// The tenant (or the whole sidecar) has as many requests waiting as it may.
    QueueFull,
    /// It waited past its deadline.
    DeadlinePassed,
    /// No healthy replica could take it.
    NoReplica,
    /// Overload: free-tier work is shed first.
    Shed,
    /// At the current dispatch rate it would wait past its deadline.
    ProjectedWait,
}

pub enum Event {
    Enqueue(Job),
    /// Output tokens streamed to a tenant: charged to its virtual token counter.
    Served {
        tenant: String,
        output_tokens: u64,
    },
    Finished {
        pool: usize,
        replica: usize,
        tenant: String,
        kv_need: u64,
    },
    ReplicaFailed {
        pool: usize,
        replica: usize,
    },
    Sample {
        pool: usize,
        replica: usize,
        sample: Option<EngineSample>,
    },
}

pub struct Dispatcher {
    scheduler: Scheduler<Job>,
    /// The FIFO baseline is plain arrival order: no headroom rule either.
    fair: bool,
    pools: Vec<Pool>,
    /// Which replicas' KV budgets come from the config (not the engine's report).
    budget_configured: Vec<bool>,
    tenant_kv: HashMap<String, u64>,
    /// When each tenant's last request arrived, for the KV headroom rule.
    active: HashMap<String, u64>,
    queue: QueueConfig,
    metrics: Metrics,
    /// Dispatches per second, smoothed: what projected waits are computed from.
    rate: f64,
    dispatched_since_tick: u64,
    last_tick_ms: u64,
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Dispatcher {
    pub fn new(
        policy: Policy,
        pools: Vec<Pool>,
        budget_configured: Vec<bool>,
        queue: QueueConfig,
        metrics: Metrics,
    ) -> Self {
        Dispatcher {
            scheduler: Scheduler::new(policy, TokenWeights::default(), queue.batch_aging_ms),
            fair: policy == Policy::Fair,
            pools,
            budget_configured,
            tenant_kv: HashMap::new(),
            active: HashMap::new(),
            queue,
            metrics,
            rate: 0.0,
            dispatched_since_tick: 0,
            last_tick_ms: now_ms(),
        }
    }

    pub async fn run(mut self, mut events: mpsc::UnboundedReceiver<Event>) {
        let mut tick = tokio::time::interval(Duration::from_millis(25));
        loop {
            tokio::select! {
                event = events.recv() => match event {
                    Some(event) => self.apply(event),
                    None => return,
                },
                _ = tick.tick() => {
                    let now = now_ms();
                    self.measure_rate(now);
                    self.expire(now);
                    let window = self.queue.active_window_ms;
                    self.active.retain(|_, seen| now.saturating_sub(*seen) < window);
                }
            }
            while let Ok(event) = events.try_recv() {
                self.apply(event);
            }
            self.dispatch(now_ms());
        }
    }

    fn apply(&mut self, event: Event) {
        match event {
            Event::Enqueue(job) => self.enqueue(job),
            Event::Served {
                tenant: t,
                output_tokens,
            } => {
                self.scheduler.charge(&t, 0, output_tokens);
                self.metrics
                    .vtc_counter
                    .get_or_create(&tenant(&t))
                    .set(self.scheduler.counter(&t));
            }
            Event::Finished {
                pool,
                replica,
                tenant: t,
                kv_need,
            } => {
                if let Some(r) = self
                    .pools
                    .get_mut(pool)
                    .and_then(|p| p.replicas.get_mut(replica))
                {
                    r.reserved = r.reserved.saturating_sub(kv_need);
                    r.in_flight = r.in_flight.saturating_sub(1);
                }
                let held = self.tenant_kv.entry(t.clone()).or_default();
                *held = held.saturating_sub(kv_need);
                self.metrics
                    .active_kv_tokens
                    .get_or_create(&tenant(&t))
                    .set(*held as i64);
            }
            Event::ReplicaFailed { pool, replica } => {
                if let Some(r) = self
                    .pools
                    .get_mut(pool)
                    .and_then(|p| p.replicas.get_mut(replica))
                {
                    r.healthy = false;
                }
            }
            Event::Sample {
                pool,
                replica,
                sample,
            } => self.observe(pool, replica, sample),
        }
    }

    fn observe(&mut self, pool: usize, replica: usize, sample: Option<EngineSample>) {
        let configured = self.budget_configured.get(pool).copied().unwrap_or(false);
        let Some(r) = self
            .pools
            .get_mut(pool)
            .and_then(|p| p.replicas.get_mut(replica))
        else {
            return;
        };
        r.healthy = sample.is_some();
        if let Some(s) = sample {
            r.engine = s;
            if !configured {
                r.kv_budget = s.kv_tokens.unwrap_or(r.kv_budget);
            }
        }
        let labels = vec![("replica", r.url.clone())];
        self.metrics
            .replica_healthy
            .get_or_create(&labels)
            .set(i64::from(r.healthy));
        self.metrics
            .replica_kv_usage
            .get_or_create(&labels)
            .set(r.engine.kv_usage);
        self.metrics
            .replica_running
            .get_or_create(&labels)
            .set(r.engine.running as i64);
        self.metrics
            .replica_waiting
            .get_or_create(&labels)
            .set(r.engine.waiting as i64);
    }

    /// Smooths the dispatch rate over one-second windows. Idle windows (nothing dispatched,
    /// nothing waiting) say nothing about capacity and leave it as it was.
    fn measure_rate(&mut self, now: u64) {
        let elapsed = now.saturating_sub(self.last_tick_ms);
        if elapsed >= 1_000 && self.dispatched_since_tick == 0 && self.scheduler.is_empty() {
            self.last_tick_ms = now;
        } else if elapsed >= 1_000 {
            let current = self.dispatched_since_tick as f64 * 1_000.0 / elapsed as f64;
            self.rate = if self.rate == 0.0 {
                current
            } else {
                0.7 * self.rate + 0.3 * current
            };
            self.dispatched_since_tick = 0;
            self.last_tick_ms = now;
        }
    }

    /// Turns a job away at once when it cannot be served in time: bounded queues, free tier
    /// shed first under overload, and no waiting that would outlast the deadline anyway.
    fn refusal(&self, job: &Job, now: u64) -> Option<(Refusal, &'static str)> {
        let queued = self.scheduler.len();
        if self.scheduler.depth(&job.tenant) >= self.queue.max_per_tenant
            || queued >= self.queue.max_total
        {
            return Some((Refusal::QueueFull, "queue_full"));
        }
        if job.tier == "free"
            && queued as f64 >= self.queue.shed_free_tier_above * self.queue.max_total as f64
        {
            return Some((Refusal::Shed, "shed_free_tier"));
        }
        // Only once the pool is saturated does a queue mean waiting.
        let saturated = !self.pools[job.pool].fits(job.kv_need);
        if saturated && self.rate > 0.0 {
            let projected_ms = queued as f64 / self.rate * 1_000.0;
            if now as f64 + projected_ms > job.deadline_ms as f64 {
                return Some((Refusal::ProjectedWait, "projected_wait"));
            }
        }
        None
    }

    fn enqueue(&mut self, job: Job) {
        if let Some((refusal, reason)) = self.refusal(&job, now_ms()) {
            self.metrics.reject(reason);
            let _ = job.reply.send(Err(refusal));
            return;
        }
        let (t, weight, priority, arrived) =
            (job.tenant.clone(), job.weight, job.priority, job.arrived_ms);
        self.active.insert(t.clone(), arrived);
        self.scheduler.push(&t, weight, priority, job, arrived);
        self.update_depth(&t);
    }

    fn update_depth(&self, t: &str) {
        self.metrics
            .queue_depth
            .get_or_create(&tenant(t))
            .set(self.scheduler.depth(t) as i64);
    }

    /// Drops jobs whose deadline passed (they get a retryable refusal) or whose client left.
    fn expire(&mut self, now: u64) {
        let gone = self
            .scheduler
            .remove_where(|job| job.deadline_ms <= now || job.reply.is_closed());
        for job in gone {
            self.update_depth(&job.tenant);
            if !job.reply.is_closed() {
                self.metrics.reject("deadline");
                let _ = job.reply.send(Err(Refusal::DeadlinePassed));
            }
        }
    }

    /// Hands out work while something fits: the fairest eligible job first.
    fn dispatch(&mut self, now: u64) {
        loop {
            let Dispatcher {
                scheduler,
                pools,
                tenant_kv,
                active,
                queue,
                fair,
                ..
            } = self;
            // A tenant over its own KV cap, or over its share while others are active, (or a
            // client gone) is passed over; the next job in fair order that does not fit yet
            // holds the line until room frees.
            let judge = |t: &str, job: &Job| {
                let held = tenant_kv.get(t).copied().unwrap_or(0);
                let under_cap = job
                    .kv_cap
                    .is_none_or(|cap| held == 0 || held + job.kv_need <= cap);
                let others_active = active.len() > usize::from(active.contains_key(t));
                let share = (1.0 - queue.kv_headroom) * pools[job.pool].capacity() as f64;
                let within_share =
                    !*fair || !others_active || held == 0 || (held + job.kv_need) as f64 <= share;
                if !under_cap || !within_share || job.reply.is_closed() {
                    Verdict::Skip
                } else if pools[job.pool].fits(job.kv_need) {
                    Verdict::Take
                } else {
                    Verdict::Wait
                }
            };
            let Some(d) = scheduler.pop_where(now, judge) else {
                return;
            };
            let (t, job) = (d.tenant.to_owned(), d.item);
            let pool = &mut self.pools[job.pool];
            let Some(replica) = pool.route(job.affinity, job.kv_need) else {
                let _ = job.reply.send(Err(Refusal::NoReplica));
                continue;
            };
            let r = &mut pool.replicas[replica];
            r.reserved += job.kv_need;
            r.in_flight += 1;
            let url = r.url.clone();
            let held = self.tenant_kv.entry(t.clone()).or_default();
            *held += job.kv_need;
            self.metrics
                .active_kv_tokens
                .get_or_create(&tenant(&t))
                .set(*held as i64);
            self.scheduler.charge(&t, job.input_tokens, 0);
            self.dispatched_since_tick += 1;
            self.update_depth(&t);
            let queued_ms = now.saturating_sub(job.arrived_ms);
            self.metrics
                .queue_wait
                .get_or_create(&tenant(&t))
                .observe(queued_ms as f64 / 1e3);
            let assignment = Assignment {
                pool: job.pool,
                replica,
                url,
                queued_ms,
            };
            if job.reply.send(Ok(assignment)).is_err() {
                // The client left between the check and now: give the room back.
                self.apply(Event::Finished {
                    pool: job.pool,
                    replica,
                    tenant: t,
                    kv_need: job.kv_need,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PoolConfig;

    fn dispatcher(max_total: usize) -> Dispatcher {
        let config = PoolConfig {
            model: "m".into(),
            replicas: vec!["http://r0".into()],
            kv_tokens_per_replica: Some(1_000),
            affinity_load_threshold: 0.85,
            affinity_prefix_bytes: 64,
        };
        let mut pool = Pool::new(&config);
        pool.replicas[0].healthy = true;
        let queue = QueueConfig {
            max_per_tenant: 3,
            max_total,
            ..QueueConfig::default()
        };
        Dispatcher::new(
            Policy::Fair,
            vec![pool],
            vec![true],
            queue,
            Metrics::new().0,
        )
    }

    fn job(
        tenant: &str,
        tier: &str,
        kv_need: u64,
    ) -> (Job, oneshot::Receiver<Result<Assignment, Refusal>>) {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            tenant: tenant.into(),
            tier: tier.into(),
            weight: 1.0,
            priority: Priority::Interactive,
            pool: 0,
            input_tokens: kv_need,
            kv_need,
            kv_cap: None,
            affinity: 0,
            arrived_ms: 0,
            deadline_ms: u64::MAX,
            reply,
        };
        (job, rx)
    }

    #[test]
    fn work_that_fits_is_dispatched_and_the_rest_queues() {
        let mut d = dispatcher(100);
        let (a, mut a_rx) = job("t", "standard", 600);
        let (b, mut b_rx) = job("t", "standard", 600);
        d.apply(Event::Enqueue(a));
        d.apply(Event::Enqueue(b));
        d.dispatch(0);
        assert!(matches!(a_rx.try_recv(), Ok(Ok(_))));
        assert!(
            b_rx.try_recv().is_err(),
            "600 + 600 > 1000: the second waits"
        );
        d.apply(Event::Finished {
            pool: 0,
            replica: 0,
            tenant: "t".into(),
            kv_need: 600,
        });
        d.dispatch(0);
        assert!(matches!(b_rx.try_recv(), Ok(Ok(_))));
    }

    #[test]
    fn a_flooding_tenant_leaves_headroom_once_others_are_active() {
        let mut d = dispatcher(100);
        let mut rx = Vec::new();
        for _ in 0..2 {
            let (j, r) = job("noisy", "standard", 450);
            d.apply(Event::Enqueue(j));
            rx.push(r);
        }
        d.dispatch(0);
        assert!(
            rx.iter_mut().all(|r| matches!(r.try_recv(), Ok(Ok(_)))),
            "alone, it may fill the pool"
        );

        d.apply(Event::Finished {
            pool: 0,
            replica: 0,
            tenant: "noisy".into(),
            kv_need: 450,
        });
        let (small, mut small_rx) = job("small", "standard", 100);
        d.apply(Event::Enqueue(small));
        let (more, mut more_rx) = job("noisy", "standard", 400);
        d.apply(Event::Enqueue(more));
        d.dispatch(0);
        assert!(matches!(small_rx.try_recv(), Ok(Ok(_))));
        assert!(
            more_rx.try_recv().is_err(),
            "450 + 400 > 80% of 1000 while small is active"
        );
    }

    #[test]
    fn bounded_queues_and_free_tier_shedding() {
        let mut d = dispatcher(8);
        let mut held = Vec::new();
        for _ in 0..4 {
            let (j, rx) = job("busy", "standard", 2_000);
            d.apply(Event::Enqueue(j));
            held.push(rx);
        }
        assert!(
            matches!(held[3].try_recv(), Ok(Err(Refusal::QueueFull))),
            "3 per tenant"
        );
        let (j, mut rx) = job("other", "standard", 2_000);
        d.apply(Event::Enqueue(j));
        held.push(rx);
        let (free, mut free_rx) = job("cheap", "free", 10);
        d.apply(Event::Enqueue(free));
        assert!(
            matches!(free_rx.try_recv(), Ok(Err(Refusal::Shed))),
            "4 of 8 queued: shed free tier"
        );
        rx = held.pop().unwrap();
        assert!(rx.try_recv().is_err(), "standard tier still queues");
    }

    #[test]
    fn a_projected_wait_past_the_deadline_is_refused_at_once() {
        let mut d = dispatcher(100);
        let (hog, hog_rx) = job("a", "standard", 1_000);
        d.apply(Event::Enqueue(hog));
        d.dispatch(0);
        let mut waiting = vec![hog_rx];
        for _ in 0..3 {
            let (j, rx) = job("b", "standard", 500);
            d.apply(Event::Enqueue(j));
            waiting.push(rx);
        }
        d.rate = 1.0; // one dispatch a second
        let (mut late, mut late_rx) = job("c", "standard", 500);
        late.deadline_ms = now_ms() + 1_000;
        d.apply(Event::Enqueue(late));
        assert!(matches!(
            late_rx.try_recv(),
            Ok(Err(Refusal::ProjectedWait))
        ));
    }
}

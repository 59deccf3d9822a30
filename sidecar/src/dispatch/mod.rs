//! The dispatch loop: one task owns the fair queues, the pools' KV accounting, the replicas'
//! concurrency limits and which replicas each pool has. Handlers enqueue jobs and wait for an
//! assignment; relays report tokens served, first bytes and completion; health checks report
//! engine metrics, limits and isolation modes; discovery and reloads report the replicas and
//! settings pools should have ([`crate::replica::roster`]). Nothing else mutates this state, so it
//! needs no locks.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use weir_core::scheduler::{Policy, Share};

use crate::config::{PoolConfig, QueueConfig};
use crate::isolation::Isolation;
use crate::metrics::{Labels, Metrics};
use crate::replica::engine::EngineSample;
use crate::replica::event::ReplicaEvent;
use crate::replica::health::Command;
use crate::replica::limiter::Ticket;
use crate::replica::pool::{Pool, Replica, ReplicaId};
use crate::replica::readiness::Readiness;
use crate::replica::roster::Change;
use crate::support::backoff::{Backoff, Waits};
use crate::support::clock::now_ms;

mod accounting;
mod admission;
mod pool_state;
mod preemption;
mod protocol;

use pool_state::PoolState;
pub use preemption::MAX_PREEMPTIONS;
pub use protocol::{Assignment, Event, Job, PoolSpec, Refusal, Requeued};

pub struct Dispatcher {
    /// The FIFO baseline is plain arrival order: no headroom rule either.
    fair: bool,
    policy: Policy,
    share: Share,
    pools: Vec<PoolState>,
    /// Starts and stops replicas' health checks ([`crate::replica::health::supervise`]); none in tests.
    health: Option<mpsc::UnboundedSender<Command>>,
    /// KV each tenant holds across pools, against its `active_kv_tokens` cap.
    tenant_kv: HashMap<String, u64>,
    /// What the metrics show per tenant label (a level above the keys, summed over them): KV
    /// held in all and per replica URL, and queue depth (with each key's, to sum deltas).
    label_kv: HashMap<String, u64>,
    replica_label_kv: HashMap<(String, String), u64>,
    leaf_depth: HashMap<String, usize>,
    label_depth: HashMap<String, usize>,
    queue: QueueConfig,
    metrics: Metrics,
    /// For the assignments' releases; weak, so the loop still ends when every handler is gone.
    events: mpsc::WeakUnboundedSender<Event>,
    /// The projected waits refusals' `Retry-After` is drawn from.
    waits: watch::Sender<Arc<Waits>>,
}

impl Dispatcher {
    pub fn new(
        policy: Policy,
        share: Share,
        pools: Vec<Pool>,
        queue: QueueConfig,
        metrics: Metrics,
        events: &mpsc::UnboundedSender<Event>,
    ) -> Self {
        for r in pools.iter().flat_map(|p| &p.replicas) {
            metrics.cache_isolation(&r.url, r.isolation);
        }
        let (aging, window, now) = (queue.batch_aging_ms, metrics.fairness_window_ms, now_ms());
        Dispatcher {
            health: None,
            pools: (pools.into_iter())
                .map(|p| PoolState::new(p, (policy, share), aging, window, now))
                .collect(),
            fair: policy == Policy::Fair,
            policy,
            share,
            tenant_kv: HashMap::new(),
            label_kv: HashMap::new(),
            replica_label_kv: HashMap::new(),
            leaf_depth: HashMap::new(),
            label_depth: HashMap::new(),
            queue,
            metrics,
            events: events.downgrade(),
            waits: watch::Sender::new(Arc::default()),
        }
    }

    /// Where the handlers read the projected waits for `Retry-After`.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(self.waits.subscribe())
    }

    /// Starts and stops replicas' health checks through `health` as they join and leave.
    pub fn with_health(mut self, health: mpsc::UnboundedSender<Command>) -> Self {
        for (p, state) in self.pools.iter().enumerate() {
            for r in &state.pool.replicas {
                let _ = health.send(Command::Start {
                    pool: p,
                    replica: r.id,
                    url: r.url.clone(),
                    link: state.link.subscribe(),
                });
            }
        }
        self.health = Some(health);
        self
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
                    let window = self.queue.active_window_ms;
                    for p in &mut self.pools {
                        let s = &p.scheduler;
                        p.paces.measure(now, s.len(), |t| s.depth(t), window);
                    }
                    self.expire(now);
                    self.publish_waits(now);
                    self.sample_fairness(now);
                    for p in &mut self.pools {
                        p.shares.expire(now, window);
                        for r in &mut p.pool.replicas {
                            r.unguard_older(now);
                        }
                    }
                    // A retired pool's replicas leave once its queue is empty.
                    for pool in 0..self.pools.len() {
                        if self.pools[pool].pool.retired && !self.pools[pool].pool.replicas.is_empty() {
                            self.reconcile(pool);
                        }
                    }
                }
            }
            while let Ok(event) = events.try_recv() {
                self.apply(event);
            }
            let now = now_ms();
            self.dispatch(now);
            for pool in 0..self.pools.len() {
                self.preempt(pool, now);
            }
        }
    }

    /// What the replica side found ([`ReplicaEvent`]).
    fn on_replica(&mut self, event: ReplicaEvent) {
        match event {
            ReplicaEvent::Joined {
                pool,
                replica,
                limits,
                dialect,
            } => {
                let configured = self.budget_configured(pool);
                if let Some(r) = self.replica_mut(pool, replica) {
                    r.join(limits, dialect);
                    // What an engine said before no longer holds (another may answer here
                    // now): its figure, or none until a sample says.
                    if !configured {
                        r.hold_kv(limits.kv_tokens.unwrap_or(0));
                    }
                }
                self.update_limits(pool, replica);
            }
            ReplicaEvent::Sample {
                pool,
                replica,
                sample,
            } => self.observe(pool, replica, sample),
            ReplicaEvent::Isolated {
                pool,
                replica,
                isolation,
            } => {
                if let Some(r) = self.replica_mut(pool, replica) {
                    r.isolation = isolation;
                    let url = r.url.clone();
                    self.metrics.cache_isolation(&url, isolation);
                }
            }
            ReplicaEvent::Discovered {
                pool,
                source,
                replicas,
            } => {
                let Some(p) = self.pools.get_mut(pool).map(|s| &mut s.pool) else {
                    return;
                };
                if p.config
                    .discovery
                    .as_ref()
                    .is_some_and(|d| d.same_source(&source))
                {
                    p.discovered = replicas;
                    self.reconcile(pool);
                }
            }
        }
    }

    fn apply(&mut self, event: Event) {
        match event {
            Event::Enqueue(job) => self.enqueue(job),
            Event::Replica(event) => self.on_replica(event),
            Event::Served {
                pool,
                replica,
                tenant: t,
                output_tokens,
            } => self.served(pool, replica, &t, output_tokens),
            Event::Reconciled {
                pool,
                tenant: t,
                estimated,
                reported,
            } => {
                self.charge(pool, &t, |s, t| s.correct_input(t, estimated, reported));
            }
            Event::Resized {
                pool,
                replica,
                ticket,
                tenant: t,
                from,
                to,
            } => self.resized(pool, replica, ticket, &t, from, to),
            Event::Finished {
                pool,
                replica,
                ticket,
                tenant: t,
                kv_need,
                sequences,
            } => self.finished(pool, replica, ticket, &t, kv_need, sequences),
            Event::ReplicaFailed { pool, replica } => {
                if let Some(r) = self.replica_mut(pool, replica) {
                    r.healthy = false;
                }
            }
            Event::FirstByte {
                pool,
                replica,
                ticket,
                ttfb_ms,
                prompt_tokens,
            } => self.first_byte(pool, replica, ticket, ttfb_ms, prompt_tokens),
            Event::Answered {
                pool,
                replica,
                ticket,
            } => {
                if let Some(r) = self.replica_mut(pool, replica) {
                    let in_flight = r.in_flight;
                    r.limiter.answered(ticket, in_flight);
                    r.prefilled(ticket);
                }
                self.update_limits(pool, replica);
            }
            Event::FirstByteTimeout {
                pool,
                replica,
                ticket,
            } => self.first_byte_timeout(pool, replica, ticket),
            Event::Ready(reply) => {
                let _ = reply.send(Readiness::of(self.pools.iter().map(|p| &p.pool)));
            }
            Event::Configure { queue, pools } => self.configure(queue, pools),
        }
    }

    /// Output tokens streamed to `t`: charged to its counter, counted in the replica's goodput.
    fn served(&mut self, pool: usize, replica: ReplicaId, t: &str, output_tokens: u64) {
        self.charge(pool, t, |s, t| s.charge(t, 0, output_tokens));
        if let Some(r) = self.replica_mut(pool, replica) {
            let in_flight = r.in_flight;
            r.limiter.served(output_tokens, in_flight, now_ms());
        }
        self.update_limits(pool, replica);
    }

    /// A running request's KV hold corrected from `from` to `to`.
    fn resized(
        &mut self,
        pool: usize,
        replica: ReplicaId,
        ticket: Ticket,
        t: &str,
        from: u64,
        to: u64,
    ) {
        self.adjust_hold(pool, replica, t, 0, from);
        self.adjust_hold(pool, replica, t, to, 0);
        // Preempted, it goes on from what it holds now (its prompt and what it has
        // generated), not from its first prediction.
        if let Some(r) = self
            .pools
            .get_mut(pool)
            .map(|s| &mut s.running)
            .and_then(|running| {
                running
                    .iter_mut()
                    .find(|r| r.replica == replica && r.ticket == ticket)
            })
        {
            r.job.kv_need = to;
        }
    }

    /// A dispatch ended: its slots and KV come back, a preemption waiting for it is done, and a
    /// leaving replica it drained leaves.
    fn finished(
        &mut self,
        pool: usize,
        replica: ReplicaId,
        ticket: Ticket,
        t: &str,
        kv_need: u64,
        sequences: u64,
    ) {
        if let Some(r) = self.replica_mut(pool, replica) {
            r.in_flight = r.in_flight.saturating_sub(sequences);
            r.prefilled(ticket);
        }
        self.hold_slots(pool, t, sequences, false);
        self.adjust_hold(pool, replica, t, 0, kv_need);
        if let Some(pending) = self.pools.get_mut(pool).map(|s| &mut s.preempting)
            && let Some(i) = pending
                .iter()
                .position(|p| p.replica == replica && p.ticket == ticket)
        {
            pending.swap_remove(i);
        }
        if self.replica_mut(pool, replica).is_some_and(|r| r.leaving) {
            let changes = self.pools[pool].pool.drop_drained();
            self.changed(pool, changes);
        }
    }

    /// A dispatch's first bytes came after `ttfb_ms`: the replica's limiter learns from it, its
    /// prefill is over, and a preemptible stream's bound runs from then.
    fn first_byte(
        &mut self,
        pool: usize,
        replica: ReplicaId,
        ticket: Ticket,
        ttfb_ms: f64,
        prompt_tokens: u64,
    ) {
        if let Some(r) = self.replica_mut(pool, replica) {
            let in_flight = r.in_flight;
            r.limiter
                .first_byte(ticket, ttfb_ms, prompt_tokens, in_flight);
            r.prefilled(ticket);
        }
        if let Some(running) = self.pools.get_mut(pool).map(|s| &mut s.running)
            && let Some(r) = running
                .iter_mut()
                .find(|r| r.replica == replica && r.ticket == ticket)
        {
            r.started_ms = Some(r.dispatched_ms + ttfb_ms as u64);
        }
        self.update_limits(pool, replica);
    }

    /// A dispatch's engine did not start it within `relay.first_byte_ms`.
    fn first_byte_timeout(&mut self, pool: usize, replica: ReplicaId, ticket: Ticket) {
        if let Some(r) = self.replica_mut(pool, replica) {
            r.limiter.timed_out(ticket);
            r.prefilled(ticket);
            let url = r.url.clone();
            (self.metrics.replica_first_byte_timeouts).inc(&[("replica", &url)]);
        }
        self.update_limits(pool, replica);
    }

    /// Whether a pool's replicas' KV budgets come from the config (not the engine's report).
    fn budget_configured(&self, pool: usize) -> bool {
        self.pools
            .get(pool)
            .is_some_and(|p| p.pool.config.kv_tokens_per_replica.is_some())
    }

    /// Applies a config: queue bounds for the next decision, pools created, updated, revived
    /// or retired, and their replica sets brought to what the config lists.
    fn configure(&mut self, queue: QueueConfig, specs: Vec<PoolSpec>) {
        for p in &mut self.pools {
            p.scheduler.set_aging_ms(queue.batch_aging_ms);
        }
        self.queue = queue;
        let named: BTreeSet<usize> = specs.iter().map(|s| s.index).collect();
        for spec in specs {
            let index = spec.index;
            if index > self.pools.len() {
                tracing::error!(pool = index, "pool index out of order: ignored");
                continue;
            }
            if index == self.pools.len() {
                let pool = Pool::with_upstream(
                    &PoolConfig {
                        replicas: Vec::new(),
                        ..spec.config.clone()
                    },
                    spec.upstream.clone(),
                );
                self.pools.push(PoolState::new(
                    pool,
                    (self.policy, self.share),
                    self.queue.batch_aging_ms,
                    self.metrics.fairness_window_ms,
                    now_ms(),
                ));
            }
            self.update_pool(index, spec);
        }
        for pool in 0..self.pools.len() {
            if !named.contains(&pool) && !self.pools[pool].pool.retired {
                tracing::info!(model = %self.pools[pool].pool.model, "pool removed from the config: retired once its queue is empty");
                self.pools[pool].pool.retired = true;
            }
            self.reconcile(pool);
        }
    }

    /// A pool's new settings: the next decision holds to them.
    fn update_pool(&mut self, index: usize, spec: PoolSpec) {
        let Some(state) = self.pools.get_mut(index) else {
            return;
        };
        let p = &mut state.pool;
        let (old, new) = (&p.config, &spec.config);
        if p.retired {
            tracing::info!(model = %p.model, "pool back in the config");
        }
        p.retired = false;
        p.listed = crate::replica::pool::listed(new);
        match (&old.discovery, &new.discovery) {
            (Some(a), Some(b)) if a.same_source(b) => {}
            _ => p.discovered.clear(),
        }
        p.affinity_load_threshold = new.affinity_load_threshold;
        p.affinity_prefix_bytes = new.affinity_prefix_bytes;
        let isolation_changed = old.cache_isolation != new.cache_isolation;
        let limit_changed = old.max_concurrency_per_replica != new.max_concurrency_per_replica;
        let adaptive_changed = old.adaptive_concurrency != new.adaptive_concurrency;
        let share_changed = old.sidecars != new.sidecars;
        for r in &mut p.replicas {
            r.share = new.sidecars;
            if let Some(kv) = new.kv_tokens_per_replica {
                r.hold_kv(kv);
            }
            if isolation_changed {
                r.isolation = Isolation::initial(new.cache_isolation);
            }
            if limit_changed {
                r.configured_limit = new.max_concurrency_per_replica;
            }
            r.adaptive = new.adaptive_concurrency;
            // A scraped KV budget takes the new share at the next scrape.
            if (limit_changed && r.engine_limit.is_none()) || share_changed || adaptive_changed {
                r.restart_limiter();
            }
        }
        p.config = spec.config;
        p.upstream = spec.upstream;
        state.relink();
        let ids: Vec<ReplicaId> = self.pools[index]
            .pool
            .replicas
            .iter()
            .map(|r| r.id)
            .collect();
        for id in ids {
            if let Some(r) = self.pools[index].pool.replica(id) {
                let (url, isolation) = (r.url.clone(), r.isolation);
                self.metrics.cache_isolation(&url, isolation);
            }
            self.update_limits(index, id);
        }
    }

    /// Brings a pool's replicas to the set it should have ([`crate::replica::roster`]).
    fn reconcile(&mut self, pool: usize) {
        let Some(PoolState {
            pool: p, scheduler, ..
        }) = self.pools.get_mut(pool)
        else {
            return;
        };
        let queued = !scheduler.is_empty();
        let wanted = p.wanted(queued);
        let changes = p.reconcile(&wanted);
        self.changed(pool, changes);
    }

    /// Starts or stops health checks and metric series for replicas that joined or left.
    fn changed(&mut self, pool: usize, changes: Vec<Change>) {
        let model = self
            .pools
            .get(pool)
            .map(|p| p.pool.model.clone())
            .unwrap_or_default();
        for change in changes {
            match change {
                Change::Joined(id, url) => {
                    tracing::info!(%model, replica = %url, "replica added: probed before it gets work");
                    if let Some(r) = self.pools.get(pool).and_then(|s| s.pool.replica(id)) {
                        self.metrics.cache_isolation(&url, r.isolation);
                    }
                    self.update_limits(pool, id);
                    if let (Some(health), Some(link)) =
                        (&self.health, self.pools.get(pool).map(|s| &s.link))
                    {
                        let _ = health.send(Command::Start {
                            pool,
                            replica: id,
                            url,
                            link: link.subscribe(),
                        });
                    }
                }
                Change::Leaving(_, url) => {
                    tracing::info!(%model, replica = %url, "replica removed: no new work; it leaves once its requests end");
                }
                Change::Stayed(_, url) => {
                    tracing::info!(%model, replica = %url, "replica back before it had left: it stays");
                }
                Change::Left(id, url) => {
                    tracing::info!(%model, replica = %url, "replica left");
                    self.metrics.forget_replica(&url);
                    self.forget_replica_holds(&url);
                    if let Some(health) = &self.health {
                        let _ = health.send(Command::Stop { pool, replica: id });
                    }
                }
            }
        }
    }

    /// Publishes a replica's limits: effective, adaptive, the engine's, and its TTFB floor.
    fn update_limits(&self, pool: usize, replica: ReplicaId) {
        let Some(r) = self.pools.get(pool).and_then(|s| s.pool.replica(replica)) else {
            return;
        };
        let labels: Labels = &[("replica", &r.url)];
        let m = &self.metrics;
        m.replica_limit.set(labels, r.limit() as i64);
        m.replica_adaptive_limit.set(labels, r.limiter.adaptive());
        if let Some(limit) = r.engine_limit {
            m.replica_engine_limit.set(labels, limit as i64);
        }
        if let Some(floor) = r.limiter.floor_ms() {
            m.replica_ttfb_floor.set(labels, floor / 1e3);
        }
    }

    fn replica_mut(&mut self, pool: usize, replica: ReplicaId) -> Option<&mut Replica> {
        self.pools
            .get_mut(pool)
            .and_then(|p| p.pool.replica_mut(replica))
    }

    fn observe(&mut self, pool: usize, replica: ReplicaId, sample: Option<EngineSample>) {
        let configured = self.budget_configured(pool);
        let Some(r) = self
            .pools
            .get_mut(pool)
            .and_then(|p| p.pool.replica_mut(replica))
        else {
            return;
        };
        r.healthy = sample.is_some();
        if let Some(s) = sample {
            r.engine = s;
            if let (false, Some(kv)) = (configured, s.kv_tokens) {
                r.hold_kv(kv);
            }
            // Without KV figures a queue in the engine is a shortage of slots; with them, of
            // KV, which admission handles (see `crate::replica::limiter`).
            if r.kv_budget == 0 {
                r.limiter.engine_scrape(s.waiting, s.running);
            }
        }
        let (url, healthy, engine) = (r.url.clone(), r.healthy, r.engine);
        let (labels, m): (Labels, _) = (&[("replica", &url)], &self.metrics);
        m.replica_healthy.set(labels, i64::from(healthy));
        m.replica_kv_usage.set(labels, engine.kv_usage);
        m.replica_running.set(labels, engine.running as i64);
        m.replica_waiting.set(labels, engine.waiting as i64);
        self.update_limits(pool, replica);
    }
}

#[cfg(test)]
mod tests;

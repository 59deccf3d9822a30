//! The dispatcher's tests, by concern; the helpers they share are here.

use tokio::sync::oneshot;
use weir_core::config::Priority;

use super::*;
use crate::config::{DiscoveryConfig, PoolConfig};
use crate::replica::engine::{Dialect, EngineLimits};
use crate::replica::upstream::Upstream;

mod accounting;
mod admission;
mod headroom;
mod preemption;
mod refusals;
mod replicas;

type Reply = oneshot::Receiver<Result<Assignment, Refusal>>;

fn pool_config(model: &str, kv: Option<u64>) -> PoolConfig {
    PoolConfig {
        kv_tokens_per_replica: kv,
        affinity_prefix_bytes: 64,
        ..PoolConfig::listing(model, [format!("http://{model}")])
    }
}

/// The handlers' side of the event channel (the dispatcher holds the sender only weakly).
type Events = (mpsc::UnboundedSender<Event>, mpsc::UnboundedReceiver<Event>);

/// A dispatcher over healthy pools (of engines that can resume a preempted stream), with
/// the channel of the events it is sent.
fn dispatcher_of(configs: &[PoolConfig], max_total: usize) -> (Dispatcher, Events) {
    let pools = configs
        .iter()
        .map(|c| {
            let mut pool = Pool::new(c);
            for r in &mut pool.replicas {
                r.healthy = true;
                r.isolation = Isolation::Salt;
                r.dialect = Some(Dialect::Vllm);
            }
            pool
        })
        .collect();
    let queue = QueueConfig {
        max_per_tenant: 3,
        max_per_org: 5,
        max_total,
        ..QueueConfig::default()
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let d = Dispatcher::new(
        Policy::Fair,
        Share::Hierarchy,
        pools,
        queue,
        Metrics::new(&crate::config::metrics::MetricsConfig::default(), None).0,
        &tx,
    );
    (d, (tx, rx))
}

fn dispatcher(max_total: usize) -> (Dispatcher, Events) {
    dispatcher_of(&[pool_config("m", Some(1_000))], max_total)
}

/// Applies what was sent to the dispatcher (releases of dropped assignments), then dispatches.
fn settle(d: &mut Dispatcher, events: &mut Events) {
    while let Ok(event) = events.1.try_recv() {
        d.apply(event);
    }
    d.dispatch(0);
}

fn job(tenant: &str, tier: &str, kv_need: u64) -> (Job, Reply) {
    job_in(0, tenant, tier, kv_need)
}

fn job_in(pool: usize, tenant: &str, tier: &str, kv_need: u64) -> (Job, Reply) {
    let (reply, rx) = oneshot::channel();
    let job = Job {
        tenant: tenant.into(),
        tier: tier.into(),
        weights: vec![1.0],
        priority: Priority::Interactive,
        pool,
        input_tokens: kv_need,
        kv_need,
        sequences: 1,
        kv_cap: None,
        affinity: 0,
        arrived_ms: 0,
        deadline_ms: u64::MAX,
        preemptible: false,
        stream: false,
        preemptions: 0,
        reply,
    };
    (job, rx)
}

fn assigned(rx: &mut Reply) -> Assignment {
    match rx.try_recv() {
        Ok(Ok(a)) => a,
        other => panic!("not assigned: {other:?}"),
    }
}

/// A dispatcher over one pool of `replicas` replicas with room for `limit` requests each
/// (and KV to spare).
fn slotted(replicas: usize, limit: u64) -> (Dispatcher, Events) {
    let config = PoolConfig {
        replicas: (0..replicas).map(|i| format!("http://r{i}")).collect(),
        max_concurrency_per_replica: Some(limit),
        ..pool_config("slots", Some(1_000_000))
    };
    dispatcher_of(&[config], 100)
}

/// Enqueues `n` jobs of a tenant, dispatching after each (at most 3 wait per tenant);
/// returns their replies.
fn enqueue(d: &mut Dispatcher, tenant: &str, n: usize) -> Vec<Reply> {
    (0..n)
        .map(|_| {
            let (j, rx) = job(tenant, "standard", 10);
            d.apply(Event::Enqueue(j));
            d.dispatch(0);
            rx
        })
        .collect()
}

fn assigned_of(replies: &mut [Reply]) -> Vec<Assignment> {
    replies
        .iter_mut()
        .filter_map(|rx| rx.try_recv().ok()?.ok())
        .collect()
}

/// Every health-check command sent so far, as (start?, pool, replica, url).
fn commands(rx: &mut mpsc::UnboundedReceiver<Command>) -> Vec<(bool, usize, ReplicaId)> {
    let mut out = Vec::new();
    while let Ok(c) = rx.try_recv() {
        out.push(match c {
            Command::Start { pool, replica, .. } => (true, pool, replica),
            Command::Stop { pool, replica } => (false, pool, replica),
        });
    }
    out
}

fn spec(index: usize, config: PoolConfig) -> PoolSpec {
    PoolSpec {
        index,
        config,
        upstream: Upstream::plain(),
    }
}

/// Marks a replica healthy and isolated, as its health check would.
fn probed(d: &mut Dispatcher, pool: usize, replica: ReplicaId) {
    d.apply(Event::Replica(ReplicaEvent::Sample {
        pool,
        replica,
        sample: Some(EngineSample::default()),
    }));
    d.apply(Event::Replica(ReplicaEvent::Isolated {
        pool,
        replica,
        isolation: Isolation::Salt,
    }));
}

//! Preempting batch streams for interactive work waiting with no room: which stream, how
//! often, and when its room is counted back.

use tokio::sync::oneshot;
use weir_core::config::Priority;
use weir_core::scheduler::headroom::Start;
use weir_core::scheduler::{Scheduler, Verdict};

use crate::replica::limiter::Ticket;
use crate::replica::pool::{Pool, ReplicaId};

use super::{Dispatcher, Job, PoolState, Requeued};

/// A preemptible request running on a replica: the job as it was queued (to queue it again)
/// and the way to tell its relay. Its relay holds the other end in the [`Assignment`], so an
/// entry whose request ended is seen closed.
pub(super) struct Running {
    pub(super) replica: ReplicaId,
    pub(super) ticket: Ticket,
    pub(super) dispatched_ms: u64,
    /// When the engine started it (its first bytes came, on the dispatcher's clock): it has
    /// generated something to go on from. The preemption bound runs from then, not from its
    /// dispatch, so a stream whose (re-)prefill was long decodes before it can go again.
    pub(super) started_ms: Option<u64>,
    pub(super) job: Job,
    pub(super) preempt: oneshot::Sender<Requeued>,
}

/// A preemption signalled whose room has not come back yet: it comes back when that dispatch
/// (not another of the tenant's on the replica) finishes.
pub(super) struct Pending {
    pub(super) replica: ReplicaId,
    pub(super) ticket: Ticket,
    pub(super) signalled_ms: u64,
}

/// How many times one request may be preempted: each costs it a wait in the queue and a
/// prefill again, and a stream preempted without end would run into `relay.max_stream_ms`
/// and end unfinished.
pub const MAX_PREEMPTIONS: u32 = 3;

/// How long a signalled preemption may take to free its room before another is tried: a
/// relay that has just finished (or cannot resume) never frees it.
pub(super) const PREEMPTION_GRACE_MS: u64 = 1_000;

impl Dispatcher {
    /// Preempts running batch streams of a pool for the first interactive request, in fair
    /// order, that has waited `queue.preempt_batch_after_ms` and fits no replica: on the
    /// replica where the fewest streams free room for it, the latest arrived first (as vLLM
    /// picks its own victims: the least generated, so the least to prefill again), each having
    /// streamed at least that long since its engine last started it (so a resumed stream makes
    /// progress before it can be preempted again). Each is
    /// queued again at the head of its tenant's batch queue and its relay told; the room comes
    /// back when the relay lets the stream go. One preemption at a time per pool.
    pub(super) fn preempt(&mut self, pool: usize, now: u64) {
        let after = self.queue.preempt_batch_after_ms;
        let Some(PoolState {
            running,
            preempting: pending,
            scheduler,
            pool: p,
            ..
        }) = self.pools.get_mut(pool)
        else {
            return;
        };
        running.retain(|r| !r.preempt.is_closed());
        pending.retain(|p| now.saturating_sub(p.signalled_ms) < PREEMPTION_GRACE_MS);
        if after == 0 || running.is_empty() || !pending.is_empty() {
            return;
        }
        let waited = |since: u64| now.saturating_sub(since) >= after;
        let Some((kv_need, sequences)) = wanted(scheduler, p, now, waited) else {
            return;
        };
        let victims = victims(p, running, kv_need, sequences, waited);
        let Some(mut victims) = victims else {
            return;
        };
        victims.sort_unstable_by(|a, b| b.cmp(a));
        let model = p.model.clone();
        let mut requeued_for = Vec::new();
        for i in victims {
            let Running {
                replica,
                ticket,
                mut job,
                preempt,
                ..
            } = running.swap_remove(i);
            let (reply, requeued) = oneshot::channel();
            job.reply = reply;
            // Charged at its first dispatch; bounded from now on by its stream's time
            // (`relay.max_stream_ms`), not by the queue's deadline.
            job.input_tokens = 0;
            job.deadline_ms = u64::MAX;
            job.preemptions += 1;
            if preempt.send(requeued).is_err() {
                continue;
            }
            let t = job.tenant.clone();
            tracing::info!(pool = %model, tenant = %t, tier = %job.tier, "batch stream preempted for waiting interactive work");
            (self.metrics.preemptions).inc(&[("pool", &model), ("tier", &job.tier)]);
            pending.push(Pending {
                replica,
                ticket,
                signalled_ms: now,
            });
            let (weights, priority) = (job.weights.clone(), job.priority);
            scheduler.push_front(&t, &weights, priority, job, now);
            requeued_for.push((t, weights));
        }
        for (t, weights) in requeued_for {
            self.activate(pool, &t, now, &weights);
            self.update_depth(&t);
        }
    }
}

/// The first interactive request in fair order that has waited `waited` and fits no replica
/// of `p`: what it needs (KV tokens, sequences), for which streams are preempted.
fn wanted(
    scheduler: &mut Scheduler<Job>,
    p: &Pool,
    now: u64,
    waited: impl Fn(u64) -> bool,
) -> Option<(u64, u64)> {
    if !scheduler
        .oldest_ms(Priority::Interactive)
        .is_some_and(&waited)
    {
        return None;
    }
    let mut wanted = None;
    scheduler.pop_where(now, |_, job| {
        if wanted.is_none()
            && job.priority == Priority::Interactive
            && waited(job.arrived_ms)
            && !job.reply.is_closed()
            && !p.fits_for(job.kv_need, job.sequences, Start::Alone)
        {
            wanted = Some((job.kv_need, job.sequences));
        }
        Verdict::Skip
    });
    wanted
}

/// The streams to preempt for an interactive request of `kv_need` KV tokens and `sequences`
/// slots: on the replica where the fewest free room for it, the latest arrived first, each
/// having streamed long enough since its engine last started it (`waited`). Indices into
/// `running`; `None` when no replica can free enough.
fn victims(
    p: &Pool,
    running: &[Running],
    kv_need: u64,
    sequences: u64,
    waited: impl Fn(u64) -> bool,
) -> Option<Vec<usize>> {
    p.replicas
        .iter()
        .filter(|r| r.serves())
        .filter_map(|r| {
            let mut candidates: Vec<usize> = (0..running.len())
                .filter(|&i| {
                    let c = &running[i];
                    c.replica == r.id && c.started_ms.is_some_and(&waited)
                })
                .collect();
            candidates.sort_by_key(|&i| std::cmp::Reverse(running[i].job.arrived_ms));
            let (mut kv, mut seqs, mut chosen) = (0, 0, Vec::new());
            for i in candidates {
                kv += running[i].job.kv_need;
                seqs += running[i].job.sequences;
                chosen.push(i);
                let kv_room = r.kv_budget == 0
                    || r.reserved.saturating_sub(kv).saturating_add(kv_need) <= r.kv_budget;
                let slot_room =
                    r.in_flight.saturating_sub(seqs).saturating_add(sequences) <= r.limit();
                if kv_room && slot_room {
                    return Some(chosen);
                }
            }
            None
        })
        .min_by_key(Vec::len)
}

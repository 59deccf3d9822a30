//! What the handlers, the relays and the replica side say to the dispatch loop ([`Event`]),
//! and what it answers: a job's [`Assignment`] (its hold on a replica, given back exactly once)
//! or its [`Refusal`].

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};
use weir_core::config::Priority;

use crate::config::{PoolConfig, QueueConfig};
use crate::isolation::Isolation;
use crate::replica::engine::Dialect;
use crate::replica::event::ReplicaEvent;
use crate::replica::limiter::Ticket;
use crate::replica::pool::ReplicaId;
use crate::replica::readiness::Readiness;
use crate::replica::upstream::Upstream;

/// A request waiting for a replica.
pub struct Job {
    pub tenant: String,
    pub tier: String,
    /// The scheduling weight of each level of the tenant path, org first.
    pub weights: Vec<f64>,
    pub priority: Priority,
    pub pool: usize,
    pub input_tokens: u64,
    /// KV tokens to reserve: the prompt plus the output it may still produce.
    pub kv_need: u64,
    /// Sequences the engine runs for it at once (a completions batch: one per prompt), each
    /// in a slot of its own: what it takes of a replica's concurrency limit and of the
    /// tenant's share of slots. At least 1.
    pub sequences: u64,
    /// The tenant's active-KV cap (`active_kv_tokens`), if it has one.
    pub kv_cap: Option<u64>,
    pub affinity: u64,
    pub arrived_ms: u64,
    /// Wall-clock ms by which it must be dispatched, or it is dropped.
    pub deadline_ms: u64,
    /// A batch stream its relay can resume elsewhere ([`crate::relay::resume`]): it may be preempted
    /// for interactive work.
    pub preemptible: bool,
    /// Streamed: its first bytes come when the engine has prefilled its prompt.
    pub stream: bool,
    /// Times it was preempted: past [`MAX_PREEMPTIONS`] it runs to its end.
    pub preemptions: u32,
    pub reply: oneshot::Sender<Result<Assignment, Refusal>>,
}

/// What a preempted request's relay gets: the reply its next assignment comes on, once the
/// request, back at the head of its tenant's queue, is dispatched again.
pub type Requeued = oneshot::Receiver<Result<Assignment, Refusal>>;

/// Where a job runs, and its hold on that replica (KV tokens and an in-flight slot). The hold is
/// given back exactly once, when the assignment is dropped or [released](Self::release):
/// whichever way the request ends — done, failed, or the client gone while the assignment was
/// on its way, while connecting upstream or mid-stream — the replica's accounting comes down.
#[derive(Debug)]
pub struct Assignment {
    pub pool: usize,
    pub replica: ReplicaId,
    pub url: String,
    /// How to reach it: the pool's client and credential when the job was dispatched.
    pub upstream: Arc<Upstream>,
    /// The replica's isolation mode when the job was dispatched: what the body must carry.
    pub isolation: Isolation,
    /// Its engine's dialect when the job was dispatched (`None`: OpenAI's API only).
    pub dialect: Option<Dialect>,
    pub queued_ms: u64,
    pub(super) tenant: String,
    pub(super) kv_held: u64,
    /// Slots held on the replica (the job's sequences).
    pub(super) sequences: u64,
    pub(super) released: bool,
    /// Where the dispatcher's word comes if the request is preempted (preemptible jobs only).
    pub(super) preempt: Option<oneshot::Receiver<Requeued>>,
    /// Its place in the replica's dispatch order, for the replica's limiter.
    pub(super) ticket: Ticket,
    pub(super) dispatched: Instant,
    pub(super) events: mpsc::UnboundedSender<Event>,
}

impl Assignment {
    /// The engine started the request (its first body bytes came): a time-to-first-byte sample
    /// for the replica's limiter.
    pub fn started(&self, prompt_tokens: u64) {
        let _ = self.events.send(Event::FirstByte {
            pool: self.pool,
            replica: self.replica,
            ticket: self.ticket,
            ttfb_ms: self.dispatched.elapsed().as_secs_f64() * 1e3,
            prompt_tokens,
        });
    }

    /// The engine answered a non-streamed request.
    pub fn answered(&self) {
        let _ = self.events.send(Event::Answered {
            pool: self.pool,
            replica: self.replica,
            ticket: self.ticket,
        });
    }

    /// The engine did not start the request within `relay.first_byte_ms`.
    pub fn not_started(&self) {
        let _ = self.events.send(Event::FirstByteTimeout {
            pool: self.pool,
            replica: self.replica,
            ticket: self.ticket,
        });
    }

    /// The dispatcher's word if it preempts this request (once; `None` if not preemptible).
    pub fn take_preemption(&mut self) -> Option<oneshot::Receiver<Requeued>> {
        self.preempt.take()
    }

    /// KV tokens held on the replica for this request.
    pub fn kv_held(&self) -> u64 {
        self.kv_held
    }

    /// Corrects the KV held (once the engine's prompt count replaces the estimate).
    pub fn resize(&mut self, kv: u64) {
        if self.released || kv == self.kv_held {
            return;
        }
        let _ = self.events.send(Event::Resized {
            pool: self.pool,
            replica: self.replica,
            ticket: self.ticket,
            tenant: self.tenant.clone(),
            from: self.kv_held,
            to: kv,
        });
        self.kv_held = kv;
    }

    /// Gives the KV and the slot back now; dropping it later does nothing more.
    pub fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        let _ = self.events.send(Event::Finished {
            pool: self.pool,
            replica: self.replica,
            ticket: self.ticket,
            tenant: std::mem::take(&mut self.tenant),
            kv_need: self.kv_held,
            sequences: self.sequences,
        });
    }
}

/// An assignment for the relay's tests: a hold on replica 0 of pool 0, `kv` tokens, reported on
/// `events`, preemptible through `preempt` if given. Those of one test share a client: building
/// one takes milliseconds (its TLS roots), and a test may dispatch thousands of streams (one
/// per thread, as a client's connections belong to the runtime of the test that made them).
#[cfg(test)]
impl Assignment {
    pub(crate) fn for_tests(
        events: mpsc::UnboundedSender<Event>,
        kv: u64,
        preempt: Option<oneshot::Receiver<Requeued>>,
    ) -> Assignment {
        thread_local! {
            static UPSTREAM: Arc<crate::replica::upstream::Upstream> = crate::replica::upstream::Upstream::plain();
        }
        Assignment {
            pool: 0,
            replica: 0,
            url: "http://127.0.0.1:9".into(),
            upstream: UPSTREAM.with(Arc::clone),
            isolation: Isolation::default(),
            dialect: Some(Dialect::Vllm),
            queued_ms: 0,
            tenant: "t".into(),
            kv_held: kv,
            sequences: 1,
            released: false,
            preempt,
            ticket: Ticket::for_tests(),
            dispatched: Instant::now(),
            events,
        }
    }
}

impl Drop for Assignment {
    fn drop(&mut self) {
        self.release();
    }
}

/// Why a job was not dispatched, with the tenant's own projected wait in ms (what its
/// `Retry-After` is drawn from; 0 while unknown).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Refusal {
    /// The tenant (or its org) has as many requests waiting as it may, or its queue was the
    /// longest in a full one.
    QueueFull(u64),
    /// It waited past its deadline.
    DeadlinePassed(u64),
    /// No healthy replica could take it.
    NoReplica,
    /// Overload: free-tier work queued beyond a first request is shed first.
    Shed(u64),
    /// At its tenant's pace it would wait past its deadline.
    ProjectedWait(u64),
}

impl Refusal {
    /// The HTTP status the caller gets for it: 429 for what the tenant can fix by slowing
    /// down, 503 for a saturated or empty pool.
    pub fn status(self) -> u16 {
        match self {
            Refusal::QueueFull(_) | Refusal::Shed(_) => 429,
            Refusal::DeadlinePassed(_) | Refusal::NoReplica | Refusal::ProjectedWait(_) => 503,
        }
    }

    /// The refused tenant's own projected wait (ms), if the refusal has one.
    pub fn wait_ms(self) -> Option<u64> {
        match self {
            Refusal::QueueFull(ms)
            | Refusal::Shed(ms)
            | Refusal::DeadlinePassed(ms)
            | Refusal::ProjectedWait(ms) => Some(ms),
            Refusal::NoReplica => None,
        }
    }
}

pub enum Event {
    Enqueue(Job),
    /// Output tokens streamed to a tenant: charged to its virtual token counter in that pool,
    /// and counted in the replica's goodput.
    Served {
        pool: usize,
        replica: ReplicaId,
        tenant: String,
        output_tokens: u64,
    },
    /// The engine counted a prompt of `reported` tokens that was charged at dispatch as
    /// `estimated`: the tenant's counter in that pool is corrected.
    Reconciled {
        pool: usize,
        tenant: String,
        estimated: u64,
        reported: u64,
    },
    /// Sent by [`Assignment::resize`]: a running request's KV hold, corrected.
    Resized {
        pool: usize,
        replica: ReplicaId,
        ticket: Ticket,
        tenant: String,
        from: u64,
        to: u64,
    },
    /// Sent by [`Assignment`] only, so it comes exactly once per dispatch.
    Finished {
        pool: usize,
        replica: ReplicaId,
        ticket: Ticket,
        tenant: String,
        kv_need: u64,
        sequences: u64,
    },
    ReplicaFailed {
        pool: usize,
        replica: ReplicaId,
    },
    /// Sent by [`Assignment::started`].
    FirstByte {
        pool: usize,
        replica: ReplicaId,
        ticket: Ticket,
        ttfb_ms: f64,
        prompt_tokens: u64,
    },
    /// Sent by [`Assignment::answered`].
    Answered {
        pool: usize,
        replica: ReplicaId,
        ticket: Ticket,
    },
    /// Sent by [`Assignment::not_started`].
    FirstByteTimeout {
        pool: usize,
        replica: ReplicaId,
        ticket: Ticket,
    },
    /// What the replica side found: a replica joined, its engine's figures, its isolation, a
    /// pool's discovered replicas.
    Replica(ReplicaEvent),
    /// A snapshot for `/ready`.
    Ready(oneshot::Sender<Readiness>),
    /// The config, at start-up and at each reload ([`crate::reload`]): the queue's bounds and
    /// every pool by its index (pools not named are retired).
    Configure {
        queue: QueueConfig,
        pools: Vec<PoolSpec>,
    },
}

impl From<ReplicaEvent> for Event {
    fn from(event: ReplicaEvent) -> Event {
        Event::Replica(event)
    }
}

/// One pool as configured: its index (fixed per model for the process's life) and settings.
pub struct PoolSpec {
    pub index: usize,
    pub config: PoolConfig,
    pub upstream: Arc<Upstream>,
}

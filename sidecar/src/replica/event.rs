//! What the replica side reports to the dispatcher — a replica joined, its engine's figures, its
//! prefix-cache isolation, a pool's discovered replicas — without knowing the dispatcher: the
//! health checks and discovery send into any channel whose events are made from these.

use std::collections::BTreeSet;

use crate::config::DiscoveryConfig;
use crate::isolation::Isolation;
use crate::replica::engine::{Dialect, EngineLimits, EngineSample};
use crate::replica::pool::ReplicaId;

#[derive(Debug)]
pub enum ReplicaEvent {
    /// A replica answered its probe for the first time or again after being unreachable, with
    /// what its engine says of its limits; sent before that probe's [`ReplicaEvent::Sample`].
    Joined {
        pool: usize,
        replica: ReplicaId,
        limits: EngineLimits,
        /// Its engine's dialect, if the probe recognised it.
        dialect: Option<Dialect>,
    },
    /// What a replica's engine said at its last probe (`None`: it did not answer).
    Sample {
        pool: usize,
        replica: ReplicaId,
        sample: Option<EngineSample>,
    },
    /// A replica's isolation mode changed ([`crate::replica::isolation_probe::Prober`]).
    Isolated {
        pool: usize,
        replica: ReplicaId,
        isolation: Isolation,
    },
    /// What a pool's discovery found last (ignored unless the pool still discovers `source`).
    Discovered {
        pool: usize,
        source: DiscoveryConfig,
        replicas: BTreeSet<String>,
    },
}

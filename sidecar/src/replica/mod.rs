//! The engines and their pools: what a replica's engine says (dialects, limits, figures), its
//! health and prefix-cache isolation, which replicas a pool has (listed, discovered), where a
//! request runs (`pool`, under the headroom rule of [`weir_core::scheduler::headroom`]), and
//! what the replica side reports to the dispatcher ([`event::ReplicaEvent`]) without knowing
//! it.

pub mod discovery;
pub mod engine;
pub mod event;
pub mod health;
pub mod isolation_probe;
pub mod limiter;
pub mod pool;
pub mod projection;
pub mod readiness;
pub mod roster;
pub mod share;
pub mod upstream;

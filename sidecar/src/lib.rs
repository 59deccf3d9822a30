//! weir-sidecar: the dispatcher between Envoy (with the weir filter) and pools of
//! OpenAI-compatible engines. Per-tenant fair queues, KV-aware admission, tenant-scoped prefix
//! affinity with per-tenant prefix-cache isolation (`cache_salt`, or the engine's own
//! off-switch where the salt is ignored), a streaming relay with cancellation, an idempotent
//! usage ledger and Prometheus metrics.

// Layers, each built on those declared before it: a module imports from its own layer and
// earlier ones, never from a later one, and no modules import each other round in a cycle
// (`cargo xtask test` checks both).

// layer: support — leaves: the clock, values reloads replace, bounded reads, `Retry-After`
pub mod support;

// layer: config — the config's schema and validation; it owns every config type
pub mod config;

// layer: records — the usage ledger, the metrics, the quota store, prefix-cache isolation modes,
// the tool calls held for an approver
pub mod approvals;
pub mod isolation;
pub mod ledger;
pub mod metrics;
pub mod quota;

// layer: replica — engines and their pools: dialects, limits, health, discovery, placement
pub mod replica;

// layer: dispatch — the event loop: fair queues, admission, placement, preemption
pub mod dispatch;

// layer: intake and relay — a request made ready for its pool, and its answer relayed
pub mod intake;
pub mod relay;

// layer: http — the serving and admin ports, the quota service's endpoint
pub mod http;

// layer: control — the config read again, and applied
pub mod reload;

/// The seed of a randomised test: `WEIR_SEED` to replay one, else drawn (and printed).
#[cfg(test)]
fn test_seed() -> u64 {
    let seed = std::env::var("WEIR_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("seed {seed} (WEIR_SEED={seed} replays it)");
    seed
}

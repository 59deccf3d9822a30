//! weir-sidecar: the dispatcher between Envoy (with the weir filter) and pools of
//! OpenAI-compatible engines. Per-tenant fair queues, KV-aware admission, tenant-scoped prefix
//! affinity with per-tenant prefix-cache isolation (`cache_salt`, or the engine's own
//! off-switch where the salt is ignored), a streaming relay with cancellation, an idempotent
//! usage ledger and Prometheus metrics.

pub mod answer;
pub mod backoff;
pub mod config;
pub mod credential;
pub mod demand;
pub mod discovery;
pub mod dispatcher;
pub mod engine;
pub mod headroom;
pub mod health;
pub mod idempotency;
pub mod isolation;
pub mod isolation_probe;
pub mod ledger;
pub mod limiter;
pub mod listener;
pub mod metrics;
pub mod pool;
pub mod prediction;
pub mod projection;
pub mod quota;
pub mod readiness;
pub mod relay;
pub mod reload;
pub mod resume;
pub mod roster;
pub mod server;
pub mod share;
pub mod stream_end;
pub mod trust;
pub mod upstream;

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

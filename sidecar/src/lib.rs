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

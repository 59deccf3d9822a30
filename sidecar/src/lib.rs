//! weir-sidecar: the dispatcher between Envoy (with the weir filter) and pools of
//! OpenAI-compatible engines. Per-tenant fair queues, KV-aware admission, tenant-scoped prefix
//! affinity with per-tenant `cache_salt`, a streaming relay with cancellation, an idempotent
//! usage ledger and Prometheus metrics.

pub mod config;
pub mod dispatcher;
pub mod engine;
pub mod idempotency;
pub mod ledger;
pub mod limiter;
pub mod metrics;
pub mod pool;
pub mod relay;
pub mod server;
pub mod trust;

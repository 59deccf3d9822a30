//! The `idempotency` section: how long and how much of completed responses is kept for replay.

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    /// How long a completed response is kept to be replayed.
    pub replay_ttl_ms: u64,
    /// Larger responses are not kept (a later duplicate gets 409 instead of a replay).
    pub max_response_bytes: usize,
    /// Bytes of responses kept in total; past it the oldest are dropped.
    pub max_cache_bytes: usize,
    /// Keys remembered at once; past it the oldest settled ones are forgotten (the ledger
    /// still refuses a completed key).
    pub max_keys: usize,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            replay_ttl_ms: 10 * 60 * 1000,
            max_response_bytes: 256 * 1024,
            max_cache_bytes: 64 * 1024 * 1024,
            max_keys: 100_000,
        }
    }
}

//! Deduplication by the caller's `Idempotency-Key` (IETF httpapi draft semantics), scoped per
//! tenant.
//!
//! Before a request is queued it claims its (tenant, key) atomically:
//! - nobody holds it → it runs as the next attempt;
//! - an attempt is in flight → 409 `idempotency_key_in_use`;
//! - it was used with a different request (path and body) → 422 `idempotency_key_reused`;
//! - it completed → the stored response is replayed (not run, not billed again), or, once the
//!   response is no longer kept (older than `replay_ttl_ms`, too large, or the sidecar
//!   restarted), 409 `idempotency_key_completed`;
//! - its last attempt failed or was cancelled → the retry runs as the next attempt.
//!
//! Completed responses are kept in memory only, bounded in size and time; nothing of a prompt
//! or a response is written to disk or logs (the ledger holds the key, the attempt and counts).
//! A claim released without completing (client gone while queued, engine failure) frees the key
//! for a retry: it is a guard, so a dropped request future cannot leave a key held forever.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use weir_core::error::ApiError;

use crate::ledger::KeyHistory;

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

/// A response kept for replay.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredResponse {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Bytes,
}

#[derive(Debug)]
enum State {
    InFlight,
    /// The last attempt failed or was cancelled: a retry may run.
    Open,
    Completed(Option<StoredResponse>),
}

#[derive(Debug)]
struct Entry {
    fingerprint: [u8; 32],
    /// Attempts that used an engine so far.
    attempts: u32,
    state: State,
    settled_ms: u64,
}

/// The outcome of a claim.
pub enum Claimed {
    Run(Claim),
    Replay(StoredResponse),
    Refused(ApiError),
}

/// The keys of every tenant.
pub struct Idempotency {
    config: IdempotencyConfig,
    keys: Mutex<Keys>,
}

#[derive(Default)]
struct Keys {
    entries: HashMap<(String, String), Entry>,
    cached_bytes: usize,
}

/// What identifies "the same request" under a key: the endpoint and the exact body.
pub fn fingerprint(path: &str, body: &[u8]) -> [u8; 32] {
    Sha256::new()
        .chain_update(path.as_bytes())
        .chain_update([0u8])
        .chain_update(body)
        .finalize()
        .into()
}

impl Idempotency {
    pub fn new(config: IdempotencyConfig) -> Arc<Idempotency> {
        Arc::new(Idempotency {
            config,
            keys: Mutex::new(Keys::default()),
        })
    }

    /// Claims (tenant, key) for a request. `history` reads what the ledger knows of the key; it
    /// is asked only for keys this process does not remember. A ledger that cannot be read
    /// refuses the claim (503): running the key blind could run completed work again.
    pub fn claim(
        self: &Arc<Self>,
        tenant: &str,
        key: &str,
        fingerprint: [u8; 32],
        now_ms: u64,
        history: impl FnOnce() -> Option<KeyHistory>,
    ) -> Claimed {
        let id = (tenant.to_owned(), key.to_owned());
        let remembered = self.lock().entries.contains_key(&id);
        let past = if remembered {
            KeyHistory::default()
        } else {
            match history() {
                Some(past) => past,
                None => {
                    return Claimed::Refused(
                        ApiError::new(
                            503,
                            "ServiceUnavailableError",
                            "the usage ledger cannot be read to check this Idempotency-Key; retry",
                        )
                        .with_code("ledger_unavailable"),
                    );
                }
            }
        };
        let mut keys = self.lock();
        self.expire(&mut keys, now_ms);
        let entry = keys.entries.entry(id).or_insert_with(|| Entry {
            fingerprint,
            attempts: past.attempts,
            state: if past.completed {
                State::Completed(None)
            } else {
                State::Open
            },
            settled_ms: now_ms,
        });
        if entry.fingerprint != fingerprint {
            return Claimed::Refused(
                ApiError::new(
                    422,
                    "UnprocessableEntityError",
                    "this Idempotency-Key was used with a different request; use a new key",
                )
                .with_param("Idempotency-Key")
                .with_code("idempotency_key_reused"),
            );
        }
        let refusal = match &entry.state {
            State::Open => None,
            State::Completed(Some(response)) => return Claimed::Replay(response.clone()),
            State::InFlight => Some(
                ApiError::new(
                    409,
                    "ConflictError",
                    "a request with this Idempotency-Key is in progress; retry after it ends",
                )
                .with_code("idempotency_key_in_use"),
            ),
            State::Completed(None) => Some(
                ApiError::new(
                    409,
                    "ConflictError",
                    "a request with this Idempotency-Key already completed and was billed; \
                     its response is no longer kept. Use a new key for new work.",
                )
                .with_code("idempotency_key_completed"),
            ),
        };
        if let Some(error) = refusal {
            return Claimed::Refused(error);
        }
        entry.state = State::InFlight;
        let attempt = entry.attempts + 1;
        self.evict(&mut keys);
        Claimed::Run(Claim {
            registry: self.clone(),
            key: (tenant.to_owned(), key.to_owned()),
            attempt,
            settled: false,
        })
    }

    /// The largest response kept for replay.
    pub fn max_response_bytes(&self) -> usize {
        self.config.max_response_bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Drops replayable responses past their lifetime (the key stays known as completed).
    fn expire(&self, keys: &mut Keys, now_ms: u64) {
        let ttl = self.config.replay_ttl_ms;
        let mut freed = 0;
        for entry in keys.entries.values_mut() {
            if let State::Completed(stored @ Some(_)) = &mut entry.state
                && now_ms.saturating_sub(entry.settled_ms) > ttl
            {
                freed += stored.take().map_or(0, |r| r.body.len());
            }
        }
        keys.cached_bytes -= freed;
    }

    /// Keeps the map and the kept responses within bounds: the tenant holding the most goes
    /// first, oldest settled first, so one tenant minting keys pushes out its own, never another
    /// tenant's kept responses.
    fn evict(&self, keys: &mut Keys) {
        loop {
            let over_keys = keys.entries.len() > self.config.max_keys;
            let over_bytes = keys.cached_bytes > self.config.max_cache_bytes;
            if !over_keys && !over_bytes {
                return;
            }
            let Some(oldest) = next_to_forget(&keys.entries, !over_keys) else {
                return;
            };
            if let Some(Entry {
                state: State::Completed(Some(r)),
                ..
            }) = keys.entries.remove(&oldest)
            {
                keys.cached_bytes -= r.body.len();
            }
        }
    }

    fn settle(&self, key: &(String, String), outcome: Settled, now_ms: u64) {
        let mut keys = self.lock();
        let mut added = 0;
        let never_ran = keys
            .entries
            .get(key)
            .is_some_and(|e| e.attempts == 0 && matches!(outcome, Settled::Unused));
        if never_ran {
            // Nothing to remember that the ledger does not know: a key refused or abandoned
            // before any attempt takes no room (a flood of refused requests evicts nothing).
            keys.entries.remove(key);
            return;
        }
        if let Some(entry) = keys.entries.get_mut(key) {
            entry.settled_ms = now_ms;
            match outcome {
                Settled::Unused => entry.state = State::Open,
                Settled::Attempted { attempt, completed } => {
                    entry.attempts = entry.attempts.max(attempt);
                    entry.state = match completed {
                        None => State::Open,
                        Some(response) => {
                            let keep =
                                response.filter(|r| r.body.len() <= self.config.max_response_bytes);
                            added = keep.as_ref().map_or(0, |r| r.body.len());
                            State::Completed(keep)
                        }
                    };
                }
            }
        }
        keys.cached_bytes += added;
        self.evict(&mut keys);
    }
}

/// Bytes of the response an entry keeps for replay.
fn kept_bytes(entry: &Entry) -> usize {
    match &entry.state {
        State::Completed(Some(r)) => r.body.len(),
        _ => 0,
    }
}

/// The settled entry to forget next: the oldest of the tenant that holds the most settled keys
/// (or, when only the bytes are over, the most kept response bytes).
fn next_to_forget(
    entries: &HashMap<(String, String), Entry>,
    by_bytes: bool,
) -> Option<(String, String)> {
    let settled = || {
        entries
            .iter()
            .filter(|(_, e)| !matches!(e.state, State::InFlight))
            .filter(move |(_, e)| !by_bytes || kept_bytes(e) > 0)
    };
    let mut held: HashMap<&str, usize> = HashMap::new();
    for ((tenant, _), entry) in settled() {
        *held.entry(tenant.as_str()).or_default() += if by_bytes { kept_bytes(entry) } else { 1 };
    }
    let heaviest = held
        .into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(a.0)))?
        .0;
    settled()
        .filter(|((tenant, _), _)| tenant == heaviest)
        .min_by_key(|(_, e)| e.settled_ms)
        .map(|(k, _)| k.clone())
}

enum Settled {
    /// No engine was used (refused or abandoned before dispatch).
    Unused,
    Attempted {
        attempt: u32,
        /// `Some` when the work completed, with the response to replay if it was captured.
        completed: Option<Option<StoredResponse>>,
    },
}

/// A held key: the request runs as `attempt`. Dropped without [`Claim::finish`], the key is
/// released for a retry.
pub struct Claim {
    registry: Arc<Idempotency>,
    key: (String, String),
    attempt: u32,
    settled: bool,
}

impl Claim {
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Settles an attempt that used an engine: completed (with its response, when captured) or
    /// not (the key is free for a retry).
    pub fn finish(&mut self, completed: Option<Option<StoredResponse>>, now_ms: u64) {
        if self.settled {
            return;
        }
        self.settled = true;
        let outcome = Settled::Attempted {
            attempt: self.attempt,
            completed,
        };
        self.registry.settle(&self.key, outcome, now_ms);
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.settled {
            self.settled = true;
            let now = crate::dispatcher::now_ms();
            self.registry.settle(&self.key, Settled::Unused, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> Arc<Idempotency> {
        Idempotency::new(IdempotencyConfig {
            replay_ttl_ms: 1_000,
            max_response_bytes: 10,
            max_cache_bytes: 15,
            max_keys: 3,
        })
    }

    fn response(body: &'static str) -> StoredResponse {
        StoredResponse {
            status: 200,
            content_type: "application/json",
            body: Bytes::from_static(body.as_bytes()),
        }
    }

    fn claim(r: &Arc<Idempotency>, tenant: &str, key: &str, body: &str, now: u64) -> Claimed {
        r.claim(tenant, key, fingerprint("/p", body.as_bytes()), now, || {
            Some(KeyHistory::default())
        })
    }

    fn code(c: Claimed) -> String {
        match c {
            Claimed::Refused(e) => e.to_json()["error"]["code"].as_str().unwrap().to_owned(),
            Claimed::Run(_) => "run".into(),
            Claimed::Replay(_) => "replay".into(),
        }
    }

    #[test]
    fn in_flight_conflicts_a_different_body_is_refused_and_completed_work_replays() {
        let r = registry();
        let Claimed::Run(mut first) = claim(&r, "a", "k", "body", 0) else {
            panic!("first claim runs")
        };
        assert_eq!(first.attempt(), 1);
        assert_eq!(
            code(claim(&r, "a", "k", "body", 1)),
            "idempotency_key_in_use"
        );
        assert_eq!(
            code(claim(&r, "a", "k", "other", 1)),
            "idempotency_key_reused"
        );
        assert_eq!(code(claim(&r, "b", "k", "other", 1)), "run", "per tenant");
        first.finish(Some(Some(response("{}"))), 10);
        match claim(&r, "a", "k", "body", 20) {
            Claimed::Replay(resp) => assert_eq!(resp, response("{}")),
            other => panic!("expected a replay, got {}", code(other)),
        }
        // Past the replay lifetime the key is still known as completed.
        assert_eq!(
            code(claim(&r, "a", "k", "body", 2_000)),
            "idempotency_key_completed"
        );
    }

    #[test]
    fn failed_attempts_and_abandoned_claims_free_the_key_for_a_numbered_retry() {
        let r = registry();
        let Claimed::Run(mut first) = claim(&r, "a", "k", "body", 0) else {
            panic!()
        };
        first.finish(None, 5);
        let Claimed::Run(abandoned) = claim(&r, "a", "k", "body", 6) else {
            panic!()
        };
        assert_eq!(abandoned.attempt(), 2);
        drop(abandoned);
        let Claimed::Run(retry) = claim(&r, "a", "k", "body", 7) else {
            panic!()
        };
        assert_eq!(
            retry.attempt(),
            2,
            "an attempt that used no engine is not counted"
        );
    }

    #[test]
    fn the_ledger_history_numbers_attempts_and_refuses_completed_keys_after_a_restart() {
        let r = registry();
        let past = || {
            Some(KeyHistory {
                attempts: 2,
                completed: false,
            })
        };
        let Claimed::Run(c) = r.claim("a", "k", fingerprint("/p", b"x"), 0, past) else {
            panic!()
        };
        assert_eq!(c.attempt(), 3);
        let done = || {
            Some(KeyHistory {
                attempts: 1,
                completed: true,
            })
        };
        let refused = r.claim("a", "j", fingerprint("/p", b"x"), 0, done);
        assert_eq!(code(refused), "idempotency_key_completed");
        let unreadable = r.claim("a", "u", fingerprint("/p", b"x"), 0, || None);
        assert_eq!(code(unreadable), "ledger_unavailable", "never run blind");
    }

    #[test]
    fn a_tenant_minting_keys_evicts_its_own_first() {
        let r = registry();
        let Claimed::Run(mut kept) = claim(&r, "victim", "v", "body", 0) else {
            panic!()
        };
        kept.finish(Some(Some(response("answer"))), 0);
        for i in 1..10u64 {
            let Claimed::Run(mut c) = claim(&r, "flood", &format!("f{i}"), "body", i) else {
                panic!()
            };
            c.finish(None, i);
        }
        // Refused before any attempt: not remembered at all.
        let Claimed::Run(refused) = claim(&r, "flood", "never", "body", 20) else {
            panic!()
        };
        drop(refused);
        assert!(
            !r.lock()
                .entries
                .contains_key(&("flood".into(), "never".into()))
        );
        assert!(matches!(
            claim(&r, "victim", "v", "body", 21),
            Claimed::Replay(_)
        ));
    }

    #[test]
    fn kept_responses_and_keys_stay_within_bounds() {
        let r = registry();
        for (i, key) in ["k1", "k2", "k3", "k4"].iter().enumerate() {
            let Claimed::Run(mut c) = claim(&r, "a", key, "body", i as u64) else {
                panic!()
            };
            c.finish(Some(Some(response("0123456789"))), i as u64);
        }
        let keys = r.lock();
        assert!(keys.entries.len() <= 3);
        assert!(keys.cached_bytes <= 15, "{}", keys.cached_bytes);
        drop(keys);
        let Claimed::Run(mut big) = claim(&r, "a", "big", "body", 9) else {
            panic!()
        };
        big.finish(Some(Some(response("more than ten bytes"))), 9);
        assert_eq!(
            code(claim(&r, "a", "big", "body", 10)),
            "idempotency_key_completed"
        );
    }
}

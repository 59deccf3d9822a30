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
//!
//! A claim or a settle costs O(log n) in the keys remembered (amortised: a kept response expires
//! once, a key is forgotten once). Each tenant's keys sit beside indexes ordered by when they
//! settled, and tenants are ranked by what they hold, so expiring the oldest responses and
//! forgetting the heaviest tenant's oldest key take the front of an ordered map. A pass over
//! every key under the one lock made each claim of every tenant slower as one tenant minted keys.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use sha2::{Digest, Sha256};
use weir_core::error::ApiError;

use crate::config::idempotency::IdempotencyConfig;
use crate::ledger::KeyHistory;

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
    /// Drawn once per entry, so two entries settled in the same millisecond have distinct
    /// [`Slot`]s (the older entry first).
    seq: u64,
}

impl Entry {
    /// A key this process does not remember, as the ledger knows it.
    fn from_history(past: KeyHistory, fingerprint: [u8; 32], now_ms: u64, seq: u64) -> Entry {
        Entry {
            fingerprint,
            attempts: past.attempts,
            state: if past.completed {
                State::Completed(None)
            } else {
                State::Open
            },
            settled_ms: now_ms,
            seq,
        }
    }
}

/// An entry's place in the ordered indexes: when it settled, then its `seq`.
type Slot = (u64, u64);

/// Which indexes hold an entry, and where.
#[derive(Clone, Copy, PartialEq)]
struct Placement {
    slot: Slot,
    /// In its tenant's settled keys (a key in flight is never forgotten).
    settled: bool,
    /// The bytes of the response it keeps: in the replays, and in its tenant's kept responses
    /// unless empty.
    kept: Option<usize>,
}

impl Entry {
    fn placement(&self) -> Placement {
        Placement {
            slot: (self.settled_ms, self.seq),
            settled: !matches!(self.state, State::InFlight),
            kept: match &self.state {
                State::Completed(Some(response)) => Some(response.body.len()),
                _ => None,
            },
        }
    }
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

/// Every remembered key, each under its tenant, and the indexes that expiry and fair eviction
/// read from their front.
#[derive(Default)]
struct Keys {
    tenants: HashMap<Arc<str>, Tenant>,
    index: Index,
    last_seq: u64,
}

/// One tenant's keys, and its settled ones oldest first: what eviction forgets from it.
struct Tenant {
    name: Arc<str>,
    entries: HashMap<Arc<str>, Entry>,
    /// Settled keys (past `max_keys`).
    settled: BTreeMap<Slot, Arc<str>>,
    /// Keys keeping a non-empty response (past `max_cache_bytes`).
    kept: BTreeMap<Slot, Arc<str>>,
    kept_bytes: usize,
}

/// Tenants ranked by what they hold: the last one is the heaviest (of equals, the first name).
type Ranking = BTreeSet<(usize, Reverse<Arc<str>>)>;

/// What spans tenants.
#[derive(Default)]
struct Index {
    /// Every kept response of every tenant, oldest settled first (the lifetime is the same for
    /// all, so this is also the order they expire in).
    replays: BTreeMap<Slot, (Arc<str>, Arc<str>)>,
    /// Tenants by settled keys held.
    by_keys: Ranking,
    /// Tenants by bytes of responses kept.
    by_bytes: Ranking,
    /// Entries of every tenant.
    len: usize,
    /// Bytes of every kept response.
    cached_bytes: usize,
}

impl Keys {
    fn get(&self, tenant: &str, key: &str) -> Option<&Entry> {
        self.tenants.get(tenant)?.entries.get(key)
    }

    fn next_seq(&mut self) -> u64 {
        self.last_seq += 1;
        self.last_seq
    }

    fn insert(&mut self, tenant: &str, key: &str, entry: Entry) {
        if !self.tenants.contains_key(tenant) {
            let name: Arc<str> = tenant.into();
            self.tenants.insert(name.clone(), Tenant::new(name));
        }
        let Some(t) = self.tenants.get_mut(tenant) else {
            return;
        };
        let key: Arc<str> = key.into();
        let after = entry.placement();
        let before = t.entries.insert(key.clone(), entry).map(|e| e.placement());
        self.index.place(t, &key, before, Some(after));
    }

    /// Changes an entry in place; only the indexes its placement left or entered are touched.
    fn update<R>(
        &mut self,
        tenant: &str,
        key: &str,
        change: impl FnOnce(&mut Entry) -> R,
    ) -> Option<R> {
        let t = self.tenants.get_mut(tenant)?;
        let (key, _) = t.entries.get_key_value(key)?;
        let key = key.clone();
        let entry = t.entries.get_mut(&key)?;
        let before = entry.placement();
        let out = change(entry);
        let after = entry.placement();
        self.index.place(t, &key, Some(before), Some(after));
        Some(out)
    }

    fn remove(&mut self, tenant: &str, key: &str) -> Option<Entry> {
        let t = self.tenants.get_mut(tenant)?;
        let (key, entry) = t.entries.remove_entry(key)?;
        self.index.place(t, &key, Some(entry.placement()), None);
        if t.entries.is_empty() {
            self.tenants.remove(tenant);
        }
        Some(entry)
    }

    /// Drops replayable responses past their lifetime, oldest first (the key stays known as
    /// completed).
    fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        while let Some((&(settled_ms, _), (tenant, key))) = self.index.replays.first_key_value()
            && now_ms.saturating_sub(settled_ms) > ttl_ms
        {
            let (tenant, key) = (tenant.clone(), key.clone());
            let dropped = self.update(&tenant, &key, |entry| {
                if let State::Completed(stored) = &mut entry.state {
                    *stored = None;
                }
            });
            if dropped.is_none() {
                return;
            }
        }
    }

    /// Keeps the keys and the kept responses within bounds: the tenant holding the most goes
    /// first, oldest settled first, so one tenant minting keys pushes out its own, never another
    /// tenant's kept responses. Past `max_keys` it is the most settled keys that count; past
    /// only `max_cache_bytes`, the most kept response bytes.
    fn evict(&mut self, max_keys: usize, max_cache_bytes: usize) {
        loop {
            let by_bytes = if self.index.len > max_keys {
                false
            } else if self.index.cached_bytes > max_cache_bytes {
                true
            } else {
                return;
            };
            let ranking = if by_bytes {
                &self.index.by_bytes
            } else {
                &self.index.by_keys
            };
            let Some(t) = ranking
                .last()
                .and_then(|(_, Reverse(heaviest))| self.tenants.get(heaviest))
            else {
                return;
            };
            let oldest = if by_bytes { &t.kept } else { &t.settled };
            let Some((_, key)) = oldest.first_key_value() else {
                return;
            };
            let (tenant, key) = (t.name.clone(), key.clone());
            if self.remove(&tenant, &key).is_none() {
                return;
            }
        }
    }
}

impl Tenant {
    fn new(name: Arc<str>) -> Tenant {
        Tenant {
            name,
            entries: HashMap::new(),
            settled: BTreeMap::new(),
            kept: BTreeMap::new(),
            kept_bytes: 0,
        }
    }
}

impl Index {
    /// Moves `t`'s `key` from where it sat (`None`: it was not remembered) to where it sits
    /// now (`None`: it is forgotten). The one place the indexes change, so they cannot drift
    /// from the entries.
    fn place(
        &mut self,
        t: &mut Tenant,
        key: &Arc<str>,
        before: Option<Placement>,
        after: Option<Placement>,
    ) {
        let (held_keys, held_bytes) = (t.settled.len(), t.kept_bytes);
        let settled = |p: Option<Placement>| p.filter(|p| p.settled).map(|p| p.slot);
        if settled(before) != settled(after) {
            if let Some(slot) = settled(before) {
                t.settled.remove(&slot);
            }
            if let Some(slot) = settled(after) {
                t.settled.insert(slot, key.clone());
            }
        }
        let kept = |p: Option<Placement>| p.and_then(|p| Some((p.slot, p.kept?)));
        if kept(before) != kept(after) {
            if let Some((slot, bytes)) = kept(before) {
                self.replays.remove(&slot);
                if bytes > 0 {
                    t.kept.remove(&slot);
                }
                t.kept_bytes -= bytes;
                self.cached_bytes -= bytes;
            }
            if let Some((slot, bytes)) = kept(after) {
                self.replays.insert(slot, (t.name.clone(), key.clone()));
                if bytes > 0 {
                    t.kept.insert(slot, key.clone());
                }
                t.kept_bytes += bytes;
                self.cached_bytes += bytes;
            }
        }
        self.len = self.len + usize::from(after.is_some()) - usize::from(before.is_some());
        rerank(&mut self.by_keys, &t.name, held_keys, t.settled.len());
        rerank(&mut self.by_bytes, &t.name, held_bytes, t.kept_bytes);
    }
}

/// Moves a tenant from `before` to `after` in a ranking (out of it at zero).
fn rerank(ranking: &mut Ranking, tenant: &Arc<str>, before: usize, after: usize) {
    if before == after {
        return;
    }
    if before > 0 {
        ranking.remove(&(before, Reverse(tenant.clone())));
    }
    if after > 0 {
        ranking.insert((after, Reverse(tenant.clone())));
    }
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
    /// is asked only for keys this process does not remember, without the lock held. A ledger
    /// that cannot be read refuses the claim (503): running the key blind could run completed
    /// work again. A key remembered when looked at but evicted by another claim before it is
    /// held is looked up in the ledger too, never taken for a new one.
    pub fn claim(
        self: &Arc<Self>,
        tenant: &str,
        key: &str,
        fingerprint: [u8; 32],
        now_ms: u64,
        history: impl FnOnce() -> Option<KeyHistory>,
    ) -> Claimed {
        let mut history = Some(history);
        let mut past = None;
        let verdict = loop {
            let mut keys = self.lock();
            keys.expire(now_ms, self.config.replay_ttl_ms);
            if let Some(verdict) = keys.update(tenant, key, |entry| hold(entry, fingerprint)) {
                break Some((verdict, keys));
            }
            if let Some(past) = past {
                let mut entry = Entry::from_history(past, fingerprint, now_ms, keys.next_seq());
                let verdict = hold(&mut entry, fingerprint);
                keys.insert(tenant, key, entry);
                break Some((verdict, keys));
            }
            drop(keys);
            // Not remembered: what the ledger knows, read once without the lock, and again.
            past = history.take().and_then(|read| read());
            if past.is_none() {
                break None;
            }
        };
        let Some((verdict, mut keys)) = verdict else {
            return Claimed::Refused(
                ApiError::new(
                    503,
                    "the usage ledger cannot be read to check this Idempotency-Key; retry",
                )
                .with_code("ledger_unavailable"),
            );
        };
        // Also when refused: a key the ledger knows completed is remembered from now on.
        self.evict(&mut keys);
        drop(keys);
        match verdict {
            Ok(attempt) => Claimed::Run(Claim {
                registry: self.clone(),
                tenant: tenant.to_owned(),
                key: key.to_owned(),
                attempt,
                settled: false,
            }),
            Err(answer) => answer,
        }
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

    fn evict(&self, keys: &mut Keys) {
        keys.evict(self.config.max_keys, self.config.max_cache_bytes);
    }

    fn settle(&self, tenant: &str, key: &str, outcome: Settled, now_ms: u64) {
        let mut keys = self.lock();
        let never_ran = keys
            .get(tenant, key)
            .is_some_and(|e| e.attempts == 0 && matches!(outcome, Settled::Unused));
        if never_ran {
            // Nothing to remember that the ledger does not know: a key refused or abandoned
            // before any attempt takes no room (a flood of refused requests evicts nothing).
            keys.remove(tenant, key);
            return;
        }
        let max_response_bytes = self.config.max_response_bytes;
        keys.update(tenant, key, |entry| {
            entry.settled_ms = now_ms;
            match outcome {
                Settled::Unused => entry.state = State::Open,
                Settled::Attempted { attempt, completed } => {
                    entry.attempts = entry.attempts.max(attempt);
                    entry.state = match completed {
                        None => State::Open,
                        Some(response) => State::Completed(
                            response.filter(|r| r.body.len() <= max_response_bytes),
                        ),
                    };
                }
            }
        });
        self.evict(&mut keys);
    }
}

/// Holds a key for its next attempt, or says why the request does not run.
fn hold(entry: &mut Entry, fingerprint: [u8; 32]) -> Result<u32, Claimed> {
    if entry.fingerprint != fingerprint {
        return Err(Claimed::Refused(
            ApiError::new(
                422,
                "this Idempotency-Key was used with a different request; use a new key",
            )
            .with_param("Idempotency-Key")
            .with_code("idempotency_key_reused"),
        ));
    }
    let refusal = match &entry.state {
        State::Open => {
            entry.state = State::InFlight;
            return Ok(entry.attempts + 1);
        }
        State::Completed(Some(response)) => return Err(Claimed::Replay(response.clone())),
        State::InFlight => ApiError::new(
            409,
            "a request with this Idempotency-Key is in progress; retry after it ends",
        )
        .with_code("idempotency_key_in_use"),
        State::Completed(None) => ApiError::new(
            409,
            "a request with this Idempotency-Key already completed and was billed; \
             its response is no longer kept. Use a new key for new work.",
        )
        .with_code("idempotency_key_completed"),
    };
    Err(Claimed::Refused(refusal))
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
    tenant: String,
    key: String,
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
        self.registry
            .settle(&self.tenant, &self.key, outcome, now_ms);
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.settled {
            self.settled = true;
            let now = crate::support::clock::now_ms();
            self.registry
                .settle(&self.tenant, &self.key, Settled::Unused, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> IdempotencyConfig {
        IdempotencyConfig {
            replay_ttl_ms: 1_000,
            max_response_bytes: 10,
            max_cache_bytes: 15,
            max_keys: 3,
        }
    }

    fn registry() -> Arc<Idempotency> {
        Idempotency::new(config())
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
    fn a_completed_key_evicted_while_it_is_claimed_is_never_run_again() {
        // One thread claims a completed key over and over (the ledger knows it completed)
        // while another mints keys of the same tenant, evicting it. Before, a claim that found
        // the key remembered, let go of the lock, and found it evicted when it took the lock
        // again created it as new without asking the ledger: the completed work ran again.
        let r = registry();
        let Claimed::Run(mut done) = claim(&r, "a", "done", "body", 0) else {
            panic!()
        };
        done.finish(Some(None), 0);
        let completed = || {
            Some(KeyHistory {
                attempts: 1,
                completed: true,
            })
        };
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let minter = std::thread::spawn({
            let (r, stop) = (r.clone(), stop.clone());
            move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    if let Claimed::Run(mut c) = claim(&r, "a", &format!("k{i}"), "body", 0) {
                        c.finish(Some(None), 0);
                    }
                }
                i
            }
        });
        let print = fingerprint("/p", b"body");
        let (mut ran, mut claims) = (0, 0);
        let started = std::time::Instant::now();
        while started.elapsed() < std::time::Duration::from_millis(400) {
            claims += 1;
            if let Claimed::Run(c) = r.claim("a", "done", print, 0, completed) {
                ran += 1;
                drop(c);
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let minted = minter.join().unwrap();
        assert_eq!(
            ran, 0,
            "ran {ran} of {claims} claims while {minted} keys were minted"
        );
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
        assert!(r.lock().get("flood", "never").is_none());
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
        assert!(keys.index.len <= 3);
        assert!(keys.index.cached_bytes <= 15, "{}", keys.index.cached_bytes);
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

    fn run(r: &Arc<Idempotency>, tenant: &str, key: &str, now: u64) -> Claim {
        match claim(r, tenant, key, "body", now) {
            Claimed::Run(c) => c,
            other => panic!("{tenant}/{key} should run, got {}", code(other)),
        }
    }

    fn remembered(r: &Arc<Idempotency>, tenant: &str, key: &str) -> bool {
        r.lock().get(tenant, key).is_some()
    }

    #[test]
    fn kept_responses_expire_oldest_first_once_past_their_lifetime() {
        let r = registry();
        for (tenant, at) in [("c", 0), ("a", 5), ("b", 10)] {
            run(&r, tenant, "k", at).finish(Some(Some(response("{}"))), at);
        }
        assert_eq!(r.lock().index.cached_bytes, 6);
        assert_eq!(
            code(claim(&r, "c", "k", "body", 1_005)),
            "idempotency_key_completed"
        );
        assert_eq!(r.lock().index.cached_bytes, 4);
        assert_eq!(
            code(claim(&r, "a", "k", "body", 1_005)),
            "replay",
            "exactly replay_ttl_ms old: still kept"
        );
        assert_eq!(code(claim(&r, "b", "k", "body", 1_010)), "replay");
        assert_eq!(
            code(claim(&r, "a", "k", "body", 1_010)),
            "idempotency_key_completed"
        );
        let keys = r.lock();
        assert_eq!(keys.index.cached_bytes, 2);
        assert_eq!(
            keys.index.len, 3,
            "an expired key is still known as completed"
        );
    }

    #[test]
    fn past_max_keys_the_tenant_holding_the_most_settled_keys_loses_its_oldest() {
        let r = Idempotency::new(IdempotencyConfig {
            max_keys: 4,
            ..config()
        });
        run(&r, "a", "a0", 0).finish(None, 0);
        let in_flight = run(&r, "b", "b1", 1);
        run(&r, "b", "b2", 2).finish(None, 2);
        run(&r, "b", "b3", 3).finish(None, 3);
        run(&r, "c", "c4", 4).finish(None, 4);
        assert!(!remembered(&r, "b", "b2"), "b held the most settled keys");
        assert!(
            remembered(&r, "b", "b1"),
            "a key in flight is never forgotten"
        );
        assert!(
            remembered(&r, "a", "a0"),
            "the oldest key, but not the heaviest tenant's"
        );
        drop(in_flight);

        // Of tenants holding equally many, the first name gives way.
        let r = Idempotency::new(IdempotencyConfig {
            max_keys: 4,
            ..config()
        });
        for (tenant, key, at) in [
            ("b", "b0", 0),
            ("a", "a1", 1),
            ("b", "b2", 2),
            ("a", "a3", 3),
        ] {
            run(&r, tenant, key, at).finish(None, at);
        }
        run(&r, "c", "c4", 4).finish(None, 4);
        assert!(!remembered(&r, "a", "a1"));
        assert!(remembered(&r, "b", "b0"));
    }

    #[test]
    fn past_max_cache_bytes_the_tenant_keeping_the_most_bytes_loses_its_oldest_response() {
        let r = Idempotency::new(IdempotencyConfig {
            max_keys: 100,
            ..config()
        });
        run(&r, "big", "k", 0).finish(Some(Some(response("012345678"))), 0);
        for i in 1..5u64 {
            run(&r, "many", &format!("k{i}"), i).finish(Some(Some(response("ab"))), i);
        }
        // 17 bytes: "big" keeps 9 in one key, "many" 8 in four.
        assert!(!remembered(&r, "big", "k"));
        assert!((1..5).all(|i| remembered(&r, "many", &format!("k{i}"))));
        assert_eq!(r.lock().index.cached_bytes, 8);
    }

    #[test]
    fn keys_the_ledger_knows_completed_are_remembered_within_max_keys() {
        let r = registry();
        let done = || {
            Some(KeyHistory {
                attempts: 1,
                completed: true,
            })
        };
        for i in 0..10 {
            let refused = r.claim("a", &format!("k{i}"), fingerprint("/p", b"x"), i, done);
            assert_eq!(code(refused), "idempotency_key_completed");
        }
        assert_eq!(r.lock().index.len, 3);
    }

    /// What a key holds, as the model and the registry must agree on it.
    #[derive(Clone, Debug, PartialEq)]
    struct Seen {
        fingerprint: [u8; 32],
        attempts: u32,
        state: Kind,
        settled_ms: u64,
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Kind {
        InFlight,
        Open,
        Completed,
        /// Completed, keeping a response of so many bytes.
        Kept(usize),
    }

    impl Seen {
        fn of(entry: &Entry) -> Seen {
            Seen {
                fingerprint: entry.fingerprint,
                attempts: entry.attempts,
                state: match &entry.state {
                    State::InFlight => Kind::InFlight,
                    State::Open => Kind::Open,
                    State::Completed(None) => Kind::Completed,
                    State::Completed(Some(r)) => Kind::Kept(r.body.len()),
                },
                settled_ms: entry.settled_ms,
            }
        }
    }

    /// The rules written as plainly as they can be, by passes over every key (as the registry
    /// did before its indexes), to check the indexed registry against.
    struct Model {
        config: IdempotencyConfig,
        keys: BTreeMap<(String, String), (Seen, u64)>,
        created: u64,
    }

    impl Model {
        fn claim(
            &mut self,
            tenant: &str,
            key: &str,
            fingerprint: [u8; 32],
            now: u64,
            history: Option<KeyHistory>,
        ) -> (&'static str, Option<u32>) {
            let id = (tenant.to_owned(), key.to_owned());
            // Kept responses past their life go first, whatever the claim's fate.
            self.expire(now);
            let past = if self.keys.contains_key(&id) {
                KeyHistory::default()
            } else {
                match history {
                    Some(past) => past,
                    None => return ("ledger_unavailable", None),
                }
            };
            self.created += 1;
            let (seen, _) = self.keys.entry(id).or_insert_with(|| {
                let state = if past.completed {
                    Kind::Completed
                } else {
                    Kind::Open
                };
                let seen = Seen {
                    fingerprint,
                    attempts: past.attempts,
                    state,
                    settled_ms: now,
                };
                (seen, self.created)
            });
            let answer = if seen.fingerprint != fingerprint {
                ("idempotency_key_reused", None)
            } else {
                match seen.state {
                    Kind::Open => {
                        seen.state = Kind::InFlight;
                        ("run", Some(seen.attempts + 1))
                    }
                    Kind::Kept(_) => ("replay", None),
                    Kind::InFlight => ("idempotency_key_in_use", None),
                    Kind::Completed => ("idempotency_key_completed", None),
                }
            };
            self.evict();
            answer
        }

        /// `attempted`: `None` when no engine was used, else the attempt and how it ended
        /// (`Some(Some(bytes))`: completed with a response of so many bytes).
        fn settle(
            &mut self,
            tenant: &str,
            key: &str,
            attempted: Option<(u32, Option<Option<usize>>)>,
            now: u64,
        ) {
            let id = (tenant.to_owned(), key.to_owned());
            let max_response_bytes = self.config.max_response_bytes;
            if let Some((seen, _)) = self.keys.get_mut(&id) {
                if seen.attempts == 0 && attempted.is_none() {
                    self.keys.remove(&id);
                } else {
                    seen.settled_ms = now;
                    seen.state = match attempted {
                        None | Some((_, None)) => Kind::Open,
                        Some((_, Some(Some(bytes)))) if bytes <= max_response_bytes => {
                            Kind::Kept(bytes)
                        }
                        Some((_, Some(_))) => Kind::Completed,
                    };
                    if let Some((attempt, _)) = attempted {
                        seen.attempts = seen.attempts.max(attempt);
                    }
                }
            }
            self.evict();
        }

        fn expire(&mut self, now: u64) {
            for (seen, _) in self.keys.values_mut() {
                if matches!(seen.state, Kind::Kept(_))
                    && now.saturating_sub(seen.settled_ms) > self.config.replay_ttl_ms
                {
                    seen.state = Kind::Completed;
                }
            }
        }

        fn cached_bytes(&self) -> usize {
            self.keys
                .values()
                .map(|(seen, _)| match seen.state {
                    Kind::Kept(bytes) => bytes,
                    _ => 0,
                })
                .sum()
        }

        fn evict(&mut self) {
            loop {
                let by_bytes = if self.keys.len() > self.config.max_keys {
                    false
                } else if self.cached_bytes() > self.config.max_cache_bytes {
                    true
                } else {
                    return;
                };
                let weight = |seen: &Seen| match seen.state {
                    Kind::InFlight => 0,
                    Kind::Kept(bytes) if by_bytes => bytes,
                    _ if by_bytes => 0,
                    _ => 1,
                };
                let mut held: BTreeMap<&str, usize> = BTreeMap::new();
                for ((tenant, _), (seen, _)) in &self.keys {
                    if weight(seen) > 0 {
                        *held.entry(tenant).or_default() += weight(seen);
                    }
                }
                let Some(heaviest) = held
                    .into_iter()
                    .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(a.0)))
                    .map(|(tenant, _)| tenant.to_owned())
                else {
                    return;
                };
                let oldest = self
                    .keys
                    .iter()
                    .filter(|((tenant, _), (seen, _))| *tenant == heaviest && weight(seen) > 0)
                    .min_by_key(|(_, (seen, created))| (seen.settled_ms, *created))
                    .map(|(id, _)| id.clone());
                if let Some(oldest) = oldest {
                    self.keys.remove(&oldest);
                }
            }
        }
    }

    /// Every index recomputed from the entries, and the entries against the model's.
    fn check(keys: &Keys, model: &Model, at: &str) {
        let (mut len, mut cached_bytes) = (0, 0);
        let mut replays = BTreeMap::new();
        let (mut by_keys, mut by_bytes) = (Ranking::new(), Ranking::new());
        let mut seen = BTreeMap::new();
        for (name, tenant) in &keys.tenants {
            assert_eq!(&tenant.name, name, "{at}");
            assert!(!tenant.entries.is_empty(), "{at}: no tenant is kept empty");
            let (mut settled, mut kept, mut kept_bytes) = (BTreeMap::new(), BTreeMap::new(), 0);
            for (key, entry) in &tenant.entries {
                let slot = (entry.settled_ms, entry.seq);
                if !matches!(entry.state, State::InFlight) {
                    settled.insert(slot, key.clone());
                }
                if let State::Completed(Some(response)) = &entry.state {
                    replays.insert(slot, (name.clone(), key.clone()));
                    if !response.body.is_empty() {
                        kept.insert(slot, key.clone());
                        kept_bytes += response.body.len();
                    }
                }
                seen.insert((name.to_string(), key.to_string()), Seen::of(entry));
            }
            assert_eq!(tenant.settled, settled, "{at}: {name}'s settled keys");
            assert_eq!(tenant.kept, kept, "{at}: {name}'s kept responses");
            assert_eq!(tenant.kept_bytes, kept_bytes, "{at}: {name}'s kept bytes");
            if !settled.is_empty() {
                by_keys.insert((settled.len(), Reverse(name.clone())));
            }
            if kept_bytes > 0 {
                by_bytes.insert((kept_bytes, Reverse(name.clone())));
            }
            len += tenant.entries.len();
            cached_bytes += kept_bytes;
        }
        assert_eq!(keys.index.len, len, "{at}");
        assert_eq!(keys.index.cached_bytes, cached_bytes, "{at}");
        assert_eq!(
            keys.index.replays, replays,
            "{at}: every kept response, in order"
        );
        assert_eq!(keys.index.by_keys, by_keys, "{at}: tenants by settled keys");
        assert_eq!(keys.index.by_bytes, by_bytes, "{at}: tenants by kept bytes");
        let modelled: BTreeMap<_, _> = model
            .keys
            .iter()
            .map(|(id, (seen, _))| (id.clone(), seen.clone()))
            .collect();
        assert_eq!(seen, modelled, "{at}: the registry and the model disagree");
    }

    /// Releases a claim as dropping it does, at `now` rather than the clock's time.
    fn release(mut claim: Claim, now: u64) {
        claim.settled = true;
        claim
            .registry
            .settle(&claim.tenant, &claim.key, Settled::Unused, now);
    }

    #[test]
    fn the_indexes_follow_random_claims_settles_expiries_and_evictions_as_the_plain_rules_do() {
        // Bounds drawn small so that every step may expire or evict; three tenants over six
        // keys each, sometimes another body, a ledger that knows the key or cannot be read;
        // claims finished (failed, completed, with a response of 0-13 bytes) or released.
        let seed = crate::test_seed();
        let mut rng = fastrand::Rng::with_seed(seed);
        for round in 0..300 {
            let config = IdempotencyConfig {
                replay_ttl_ms: rng.u64(0..40),
                max_response_bytes: rng.usize(0..12),
                max_cache_bytes: rng.usize(0..40),
                max_keys: rng.usize(0..10),
            };
            let r = Idempotency::new(config.clone());
            let mut model = Model {
                config,
                keys: BTreeMap::new(),
                created: 0,
            };
            let mut held = Vec::new();
            let mut now = 0;
            for step in 0..200 {
                let at = format!("seed {seed}, round {round}, step {step}");
                now += rng.u64(0..5);
                match rng.u32(0..10) {
                    0..5 => {
                        let tenant = ["a", "b", "c"][rng.usize(0..3)];
                        let key = format!("k{}", rng.u32(0..6));
                        let body: &[u8] = if rng.u32(0..8) == 0 {
                            b"other"
                        } else {
                            b"body"
                        };
                        let fp = fingerprint("/p", body);
                        let history = match rng.u32(0..10) {
                            0 => None,
                            1 | 2 => Some(KeyHistory {
                                attempts: rng.u32(0..3),
                                completed: rng.bool(),
                            }),
                            _ => Some(KeyHistory::default()),
                        };
                        let want = model.claim(tenant, &key, fp, now, history);
                        let got = match r.claim(tenant, &key, fp, now, || history) {
                            Claimed::Run(c) => {
                                let attempt = c.attempt();
                                held.push(c);
                                ("run".to_owned(), Some(attempt))
                            }
                            other => (code(other), None),
                        };
                        assert_eq!((got.0.as_str(), got.1), want, "{at}: {tenant}/{key}");
                    }
                    5..8 if !held.is_empty() => {
                        let mut c = held.swap_remove(rng.usize(..held.len()));
                        let completed = match rng.u32(0..3) {
                            0 => None,
                            1 => Some(None),
                            _ => Some(Some(rng.usize(0..14))),
                        };
                        model.settle(&c.tenant, &c.key, Some((c.attempt, completed)), now);
                        let kept = |bytes| StoredResponse {
                            body: Bytes::from(vec![b'x'; bytes]),
                            ..response("")
                        };
                        c.finish(completed.map(|c| c.map(kept)), now);
                    }
                    _ if !held.is_empty() => {
                        let c = held.swap_remove(rng.usize(..held.len()));
                        model.settle(&c.tenant, &c.key, None, now);
                        release(c, now);
                    }
                    _ => {}
                }
                check(&r.lock(), &model, &at);
            }
        }
    }
}

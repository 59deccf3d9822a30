//! What counts as a retry, and how a key's recent calls are remembered to tell one. A client
//! stuck in a retry loop is the noisy tenant of an agent platform: past its
//! `retries_per_minute` its retries are refused with a `Retry-After` that grows with the
//! streak, while its first attempts still flow. A retried step that offers a `side_effect`
//! tool must carry the `Idempotency-Key` it had the first time (so the sidecar answers it with
//! the first answer rather than running the step twice).
//!
//! A key's recent fingerprints live in [`SHARDS`] shared-data keys, created when the config
//! loads ([`prepare`]: a compare-and-swap on a key that does not exist yet is not atomic, and
//! shared data cannot be deleted), each a ring of the newest [`RING`] calls; its streak of
//! refused retries in one more, so every worker of the Envoy sees the same.

use sha2::{Digest, Sha256};

use crate::config::{Tenant, ToolClass, ToolRule};
use crate::error::ApiError;
use crate::store::{SharedStore, StoreError, Update, update};
use crate::tools::offered_names;

/// Shards of a key's recent fingerprints: a storm's compare-and-swaps spread over them.
pub const SHARDS: u64 = 16;
/// Calls a shard remembers, the newest.
pub const RING: usize = 64;
/// The longest `Retry-After` a refused retry is told, in seconds.
pub const MAX_RETRY_AFTER_S: u64 = 60;
/// How long a call is remembered: a call repeated later is a first attempt again.
pub const WINDOW_MS: u64 = 60_000;

const ENTRY: usize = 16;
/// A shard's first byte: never empty, since a host may read an empty value as no value.
const TAG: u8 = 1;

/// A call's fingerprint as a retry of another: its idempotency key, else its caller's request
/// id together with its body. A call with neither is never a retry (a trace id alone never
/// makes one: two calls of one trace are two calls).
pub fn fingerprint(
    idempotency_key: Option<&str>,
    request_id: Option<&str>,
    body: &[u8],
) -> Option<u64> {
    let mut h = Sha256::new();
    match (idempotency_key, request_id) {
        (Some(key), _) => {
            h.update(b"idempotency-key\0");
            h.update(key.as_bytes());
        }
        (None, Some(id)) => {
            h.update(b"request-id\0");
            h.update(id.as_bytes());
            h.update([0]);
            h.update(body);
        }
        (None, None) => return None,
    }
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(digest.get(..8)?);
    Some(u64::from_le_bytes(first))
}

/// The shared-data key of the shard holding `fp` among `key_path`'s.
pub fn shard_key(key_path: &str, fp: u64) -> String {
    format!("weir:retry:{key_path}:{}", fp % SHARDS)
}

/// The shared-data key of `key_path`'s streak of refused retries.
fn streak_key(key_path: &str) -> String {
    format!("weir:retry:{key_path}:streak")
}

/// Whether the key's calls are told apart as first attempts and retries: it has a retry
/// budget (`retries_per_minute`, or its runs' `retries`) or a tool policy (whose
/// `side_effect` tools a retry must offer with its idempotency key).
pub fn watched(tenant: &Tenant) -> bool {
    tenant.tightest(|l| l.retries_per_minute).is_some()
        || tenant.run_budgets.retries.is_some()
        || !tenant.tools.is_empty()
}

/// Creates the shards and streak of every watched key (at config load, before any call).
pub fn prepare<'a>(store: &impl SharedStore, tenants: impl IntoIterator<Item = &'a Tenant>) {
    for tenant in tenants.into_iter().filter(|t| watched(t)) {
        let _ = create_shards(store, tenant.path());
    }
}

/// Creates `key_path`'s shards and streak where they do not exist yet.
pub fn create_shards(store: &impl SharedStore, key_path: &str) -> Result<(), StoreError> {
    let keys = (0..SHARDS).map(|shard| shard_key(key_path, shard));
    for key in keys.chain([streak_key(key_path)]) {
        if store.load(&key).is_none() && !crate::store::create(store, &key, &[TAG]) {
            // Another worker created it between the load and the write: it stands.
            store.load(&key).ok_or(StoreError::Failed)?;
        }
    }
    Ok(())
}

/// Records a call of `key_path` at `now_ms` under each of its fingerprints (its idempotency
/// key's, and its request id's with its body), so a later retry is told by either; whether
/// either was seen within the [`WINDOW_MS`] before: the call is a retry.
pub fn is_retry(
    store: &impl SharedStore,
    key_path: &str,
    idempotency_key: Option<&str>,
    request_id: Option<&str>,
    body: &[u8],
    now_ms: u64,
) -> bool {
    let fps = [
        idempotency_key.and_then(|k| fingerprint(Some(k), None, body)),
        fingerprint(None, request_id, body),
    ];
    // Every fingerprint is recorded, so no short circuit.
    let seen: Vec<bool> = (fps.into_iter().flatten())
        .map(|fp| observe(store, key_path, fp, now_ms, WINDOW_MS) == Some(true))
        .collect();
    seen.contains(&true)
}

/// The first tool the body offers whose class is `side_effect`, if any.
pub fn side_effect_tool(tenant: &Tenant, body: &[u8]) -> Option<String> {
    if tenant.tools.is_empty() {
        return None;
    }
    offered_names(body)
        .into_iter()
        .find(|name| tenant.tools.rule(name) == ToolRule::Allowed(ToolClass::SideEffect))
}

/// Counts one more retry of `key_path` refused; returns the refusals in a row before it (0
/// for the first, and again once a [`WINDOW_MS`] passed since the last), for
/// [`retry_after_s`]. 0 when the store would not take the count.
pub fn refused(store: &impl SharedStore, key_path: &str, now_ms: u64) -> u32 {
    let mut before = 0;
    let _ = update::<()>(store, &streak_key(key_path), |current| {
        let (streak, last_ms) = decode_streak(current.unwrap_or_default());
        before = if now_ms.saturating_sub(last_ms) < WINDOW_MS {
            streak
        } else {
            0
        };
        Ok(encode_streak(before.saturating_add(1), now_ms))
    });
    before
}

/// A retry of `key_path` was let through: its streak of refusals ends.
pub fn admitted(store: &impl SharedStore, key_path: &str) {
    let _ = update::<()>(store, &streak_key(key_path), |current| match decode_streak(
        current.unwrap_or_default(),
    ) {
        (0, _) => Err(()),
        _ => Ok(vec![TAG]),
    });
}

/// 429 `retry_budget_exceeded`: the key's retries passed `limit` a minute at `level`.
pub fn budget_exceeded(level: &str, limit: u64, retry_after_s: u64) -> ApiError {
    ApiError::rate_limited(format!(
        "Retry budget exceeded on {level}: limit {limit} retries per minute. Retry after \
         {retry_after_s}s; calls that are not retries are not held to it."
    ))
    .with_type("retry_budget_exceeded")
    .with_code("retry_budget_exceeded")
    .with_extra("limit", limit)
}

/// 409: a retry offering the `side_effect` tool `tool` came without an idempotency key.
pub fn side_effect_retry(tool: &str) -> ApiError {
    ApiError::new(
        409,
        format!(
            "This call repeats one that offers the side-effect tool `{tool}`: send it with the \
             Idempotency-Key of its first attempt, so its effect is not repeated."
        ),
    )
    .with_code("side_effect_retry_requires_idempotency_key")
    .with_extra("tool", tool)
}

/// A streak as stored: its length and when its last refusal was (an empty value: none).
fn decode_streak(bytes: &[u8]) -> (u32, u64) {
    let Some((&TAG, rest)) = bytes.split_first() else {
        return (0, 0);
    };
    let streak = rest.get(..4).and_then(|b| b.try_into().ok());
    let last = rest.get(4..12).and_then(|b| b.try_into().ok());
    match (streak, last) {
        (Some(s), Some(l)) => (u32::from_le_bytes(s), u64::from_le_bytes(l)),
        _ => (0, 0),
    }
}

fn encode_streak(streak: u32, last_ms: u64) -> Vec<u8> {
    let mut out = vec![TAG];
    out.extend_from_slice(&streak.to_le_bytes());
    out.extend_from_slice(&last_ms.to_le_bytes());
    out
}

/// Records the call `fp` of `key_path` at `now_ms`; whether the same call was seen within the
/// `window_ms` before (it is a retry). `None` when the store would not take the record: the
/// caller then treats the call as a first attempt (a retry budget never refuses a call it
/// could not tell was one).
pub fn observe(
    store: &impl SharedStore,
    key_path: &str,
    fp: u64,
    now_ms: u64,
    window_ms: u64,
) -> Option<bool> {
    let mut seen = false;
    let outcome = update::<()>(store, &shard_key(key_path, fp), |current| {
        let mut ring = decode(current.unwrap_or_default());
        seen = ring
            .iter()
            .any(|&(f, at)| f == fp && now_ms.saturating_sub(at) < window_ms);
        ring.retain(|&(f, _)| f != fp);
        ring.push((fp, now_ms));
        let keep = ring.len().saturating_sub(RING);
        Ok(encode(ring.get(keep..).unwrap_or_default()))
    });
    matches!(outcome, Update::Done(())).then_some(seen)
}

/// How long a refused retry is told to wait: doubling with each refusal in a row, up to
/// [`MAX_RETRY_AFTER_S`].
pub fn retry_after_s(streak: u32) -> u64 {
    1u64.checked_shl(streak.min(63))
        .unwrap_or(u64::MAX)
        .min(MAX_RETRY_AFTER_S)
}

fn decode(bytes: &[u8]) -> Vec<(u64, u64)> {
    let entries = match bytes.split_first() {
        Some((&TAG, entries)) => entries,
        _ => &[],
    };
    entries
        .chunks_exact(ENTRY)
        .filter_map(|e| {
            let fp = u64::from_le_bytes(e.get(..8)?.try_into().ok()?);
            let at = u64::from_le_bytes(e.get(8..)?.try_into().ok()?);
            Some((fp, at))
        })
        .collect()
}

fn encode(ring: &[(u64, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + ring.len() * ENTRY);
    out.push(TAG);
    for (fp, at) in ring {
        out.extend_from_slice(&fp.to_le_bytes());
        out.extend_from_slice(&at.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::reservation::tests::Memory;
    use crate::reservation::{self, Demand, Denial, Ledger, LimitKind, SlotLease};

    /// The tenant `acme/w/p/k` with the org's and the key's `limits` and the key's `policy`.
    fn tenant(org_limits: &str, key_limits: &str, policy: &str) -> Tenant {
        let json = format!(
            r#"{{"orgs":[{{"id":"acme","limits":{org_limits},"workspaces":[{{"id":"w","projects":[
                {{"id":"p","keys":[{{"id":"k","sha256":"{h}","limits":{key_limits},
                  "policy":{policy}}}]}}]}}]}}]}}"#,
            h = "a".repeat(64)
        );
        let config = Config::parse(json.as_bytes()).unwrap();
        let directory = config.directory();
        directory.lookup(&"a".repeat(64)).unwrap().as_ref().clone()
    }

    #[test]
    fn shards_are_made_for_keys_with_a_retry_budget_or_a_tool_policy_only() {
        let store = Memory::default();
        let budget = tenant("{}", r#"{"retries_per_minute": 3}"#, "{}");
        let tools = tenant(
            "{}",
            "{}",
            r#"{"tools": {"classes": {"send_*": "side_effect"}}}"#,
        );
        let run = tenant("{}", "{}", r#"{"runs": {"budgets": {"retries": 2}}}"#);
        let none = tenant("{}", r#"{"requests_per_minute": 3}"#, "{}");
        assert!([&budget, &tools, &run].iter().all(|t| watched(t)));
        assert!(!watched(&none));
        prepare(&store, [&none]);
        assert!(store.load(&streak_key("acme/w/p/k")).is_none());
        prepare(&store, [&budget]);
        for shard in 0..SHARDS {
            assert!(store.load(&shard_key("acme/w/p/k", shard)).is_some());
        }
        assert!(store.load(&streak_key("acme/w/p/k")).is_some());
    }

    #[test]
    fn a_retry_is_told_by_its_key_or_by_its_request_id_and_body() {
        let store = Memory::default();
        create_shards(&store, "t").unwrap();
        let body = br#"{"model":"m"}"#;
        assert!(!is_retry(&store, "t", Some("K"), Some("r1"), body, 0));
        // Without its key, by its request id and body; with it, whatever the request id.
        assert!(is_retry(&store, "t", None, Some("r1"), body, 1));
        assert!(is_retry(&store, "t", Some("K"), Some("r2"), b"{}", 2));
        // One trace's other call (same request id, other body) is a first attempt.
        assert!(!is_retry(&store, "t", None, Some("r1"), b"{\"n\":2}", 3));
        assert!(!is_retry(&store, "t", None, None, body, 4));
        assert!(!is_retry(
            &store,
            "t",
            None,
            Some("r1"),
            body,
            2 + WINDOW_MS
        ));
    }

    #[test]
    fn a_streak_of_refusals_grows_and_ends_at_a_retry_let_through_or_after_a_window() {
        let store = Memory::default();
        create_shards(&store, "t").unwrap();
        let streak: Vec<u32> = (0..4).map(|i| refused(&store, "t", i)).collect();
        assert_eq!(streak, [0, 1, 2, 3]);
        admitted(&store, "t");
        assert_eq!(refused(&store, "t", 10), 0);
        assert_eq!(refused(&store, "t", 11), 1);
        assert_eq!(
            refused(&store, "t", 11 + WINDOW_MS),
            0,
            "a minute since the last"
        );
        // Another key's streak is its own.
        create_shards(&store, "u").unwrap();
        assert_eq!(refused(&store, "u", 12), 0);
    }

    #[test]
    fn the_retry_budget_is_charged_by_retries_alone_at_every_level() {
        let store = Memory::default();
        let t = tenant(
            r#"{"retries_per_minute": 5}"#,
            r#"{"retries_per_minute": 2}"#,
            "{}",
        );
        reservation::initialize(&store, [&t], 0);
        let slot = SlotLease { id: 1, ttl_ms: 1 };
        // First attempts never touch it.
        for _ in 0..10 {
            reservation::reserve(&store, &t, Demand::default(), Ledger::Enforce, slot, 0).unwrap();
        }
        let charge = || reservation::charge_retry(&store, &t, Ledger::Enforce, 0);
        assert_eq!(charge(), Ok(()));
        assert_eq!(charge(), Ok(()));
        match charge() {
            Err(Denial::Limit {
                level, kind, limit, ..
            }) => {
                assert_eq!(
                    (level.as_str(), kind, limit),
                    ("acme/w/p/k", LimitKind::Retries, 2)
                );
            }
            other => panic!("{other:?}"),
        }
        // The org's bucket was charged for the two let through, not for the one refused.
        let org = store.load("weir:e:acme:retries").unwrap().0;
        let level = crate::bucket::Bucket::decode(&org).unwrap().level;
        assert_eq!(level, 3.0);
        // A second later the key's bucket has refilled by 2/60: still short; 30 s, one more.
        assert!(reservation::charge_retry(&store, &t, Ledger::Enforce, 1_000).is_err());
        assert_eq!(
            reservation::charge_retry(&store, &t, Ledger::Enforce, 30_000),
            Ok(())
        );
    }

    #[test]
    fn a_side_effect_tool_offered_is_found_in_the_body() {
        let t = tenant(
            "{}",
            "{}",
            r#"{"tools": {"classes": {"send_*": "side_effect", "deploy": "approval"}}}"#,
        );
        let chat = |name: &str| {
            format!(r#"{{"tools":[{{"type":"function","function":{{"name":"{name}"}}}}]}}"#)
        };
        let found = |name: &str| side_effect_tool(&t, chat(name).as_bytes());
        assert_eq!(found("send_email").as_deref(), Some("send_email"));
        assert_eq!(found("search"), None);
        assert_eq!(found("deploy"), None);
        let error = side_effect_retry("send_email");
        assert_eq!(error.status, 409);
        let body = error.to_json_in(crate::error::ErrorShape::Anthropic);
        assert_eq!(
            body["error"]["code"],
            "side_effect_retry_requires_idempotency_key"
        );
        let error =
            budget_exceeded("acme/w/p/k", 2, 4).to_json_in(crate::error::ErrorShape::OpenAi);
        assert_eq!(error["error"]["type"], "retry_budget_exceeded");
        assert_eq!(error["error"]["code"], "retry_budget_exceeded");
    }

    #[test]
    fn a_retry_is_the_same_key_or_the_same_request_id_and_body_never_a_trace_alone() {
        let body = br#"{"model":"m"}"#;
        let by_key = fingerprint(Some("k1"), Some("r1"), body);
        assert_eq!(
            by_key,
            fingerprint(Some("k1"), Some("r2"), b"other"),
            "the key decides"
        );
        assert_ne!(by_key, fingerprint(Some("k2"), Some("r1"), body));
        let by_id = fingerprint(None, Some("r1"), body);
        assert_eq!(by_id, fingerprint(None, Some("r1"), body));
        assert_ne!(by_id, fingerprint(None, Some("r1"), b"another body"));
        assert_ne!(by_id, fingerprint(None, Some("r2"), body));
        assert_eq!(fingerprint(None, None, body), None);
        assert!(by_key.is_some() && by_id.is_some());
    }

    #[test]
    fn a_call_seen_within_the_window_is_a_retry_and_after_it_a_first_attempt() {
        let store = Memory::default();
        create_shards(&store, "acme/w/p/k").unwrap();
        let fp = fingerprint(Some("k1"), None, b"").unwrap();
        assert_eq!(
            observe(&store, "acme/w/p/k", fp, 1_000, 60_000),
            Some(false)
        );
        assert_eq!(observe(&store, "acme/w/p/k", fp, 2_000, 60_000), Some(true));
        assert_eq!(
            observe(&store, "acme/w/p/k", fp, 62_001, 60_000),
            Some(false)
        );
        // Another key's identical call is its own.
        create_shards(&store, "globex/w/p/k").unwrap();
        assert_eq!(
            observe(&store, "globex/w/p/k", fp, 62_002, 60_000),
            Some(false)
        );
    }

    #[test]
    fn a_shard_remembers_its_newest_calls_and_reads_garbage_as_nothing_seen() {
        let store = Memory::default();
        create_shards(&store, "t").unwrap();
        // Fingerprints of one shard: the oldest is forgotten once RING newer ones came.
        let fps: Vec<u64> = (0..=RING as u64).map(|i| i * SHARDS).collect();
        for (i, fp) in fps.iter().enumerate() {
            assert_eq!(observe(&store, "t", *fp, i as u64, 1_000_000), Some(false));
        }
        let (ring, _) = store.load(&shard_key("t", 0)).unwrap();
        assert_eq!(ring.len(), 1 + RING * ENTRY);
        assert_eq!(
            observe(&store, "t", fps[0], 100, 1_000_000),
            Some(false),
            "forgotten"
        );
        assert_eq!(observe(&store, "t", fps[RING], 101, 1_000_000), Some(true));
        store
            .store(&shard_key("t", 1), b"\x01\x02\x03", None)
            .unwrap();
        assert_eq!(observe(&store, "t", 1, 5, 1_000), Some(false));
    }

    #[test]
    fn a_refused_retry_waits_twice_as_long_each_time_up_to_a_minute() {
        let waits: Vec<u64> = (0..8).map(retry_after_s).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(retry_after_s(u32::MAX), MAX_RETRY_AFTER_S);
    }
}

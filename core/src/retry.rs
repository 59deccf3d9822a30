//! What counts as a retry, and how a key's recent calls are remembered to tell one. A client
//! stuck in a retry loop is the noisy tenant of an agent platform: past its
//! `retries_per_minute` its retries are refused with a `Retry-After` that grows with the
//! streak, while its first attempts still flow.
//!
//! A key's recent fingerprints live in [`SHARDS`] shared-data keys, created when the config
//! loads ([`create_shards`]: a compare-and-swap on a key that does not exist yet is not
//! atomic, and shared data cannot be deleted), each a ring of the newest [`RING`] calls.

use sha2::{Digest, Sha256};

use crate::store::{SharedStore, StoreError, Update, update};

/// Shards of a key's recent fingerprints: a storm's compare-and-swaps spread over them.
pub const SHARDS: u64 = 16;
/// Calls a shard remembers, the newest.
pub const RING: usize = 64;
/// The longest `Retry-After` a refused retry is told, in seconds.
pub const MAX_RETRY_AFTER_S: u64 = 60;

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

/// Creates `key_path`'s shards where they do not exist yet (at config load, before any call).
pub fn create_shards(store: &impl SharedStore, key_path: &str) -> Result<(), StoreError> {
    for shard in 0..SHARDS {
        let key = shard_key(key_path, shard);
        if store.load(&key).is_none() {
            store.store(&key, &[TAG], None)?;
        }
    }
    Ok(())
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
    use crate::reservation::tests::Memory;

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

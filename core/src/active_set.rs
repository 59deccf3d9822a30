//! The fleet-wide counters this Envoy renews: a list in shared data that a reservation adds a
//! counter to the first time it takes a lease there, and the renewal reads and prunes.

use crate::allowance::Allowance;
use crate::fleet::MAX_COUNTERS;
use crate::store::{SharedStore, Update, update};

/// Shared-data key of the active set: counter keys, one per line.
pub const ACTIVE_KEY: &str = "weir:fleet:active";

pub(crate) fn active(store: &impl SharedStore) -> Vec<String> {
    store
        .load(ACTIVE_KEY)
        .and_then(|(v, _)| String::from_utf8(v).ok())
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Adds a counter to the active set (once; the set holds at most [`MAX_COUNTERS`]). When it
/// cannot (the set is full, or kept changing), the counter's mark is cleared so that its next
/// request tries again: a marked counter never lists itself, and would never be renewed.
pub fn enlist(store: &impl SharedStore, key: &str) {
    let listed = update(store, ACTIVE_KEY, |current| {
        let text = current
            .and_then(|v| std::str::from_utf8(v).ok())
            .unwrap_or("");
        if text.lines().any(|k| k == key) {
            return Err(true);
        }
        if text.lines().count() >= MAX_COUNTERS {
            return Err(false);
        }
        let mut next = text.to_owned();
        if !next.is_empty() {
            next.push('\n');
        }
        next.push_str(key);
        Ok(next.into_bytes())
    });
    if matches!(listed, Update::Done(()) | Update::Refused(true)) {
        return;
    }
    let _ = update::<()>(store, key, |current| {
        let mut a = current.and_then(Allowance::decode).ok_or(())?;
        a.listed = false;
        Ok(a.encode())
    });
}

pub(crate) fn delist(store: &impl SharedStore, key: &str) {
    let _ = update::<()>(store, ACTIVE_KEY, |current| {
        let text = current
            .and_then(|v| std::str::from_utf8(v).ok())
            .unwrap_or("");
        let kept: Vec<&str> = text.lines().filter(|k| *k != key).collect();
        Ok(kept.join("\n").into_bytes())
    });
}

//! The shared data every worker (and VM) of an Envoy sees: a key-value store with
//! compare-and-swap (proxy-wasm shared data behind the filter's host layer), and the one way
//! weir changes a key in it: read, transform, write back if nobody wrote since, retry.

/// Attempts per counter before a reservation gives up as contended.
pub const MAX_CAS_ATTEMPTS: usize = 16;

/// Key-value storage with compare-and-swap, shared by every worker (proxy-wasm shared data).
pub trait SharedStore {
    /// The value and its CAS token, if the key exists.
    fn load(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes if the key's CAS token still equals `cas` (`None`: unconditionally). A key that
    /// does not exist is written whatever `cas` says, as Envoy's shared data does.
    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// A CAS token no key holds: Envoy draws a key's token from one counter over every write of
/// the process, from 1 up (skipping 0 when it wraps), so a key holds this one only in the
/// instant after the one write in 2^32 that drew it.
const NO_KEY_HOLDS: u32 = u32::MAX;

/// Writes `value` under `key` only if the key does not exist yet: `true` when it was written.
/// Shared data has no create, but a write on an absent key ignores its CAS token while one on
/// an existing key checks it; with a token no key holds, a key another worker created (and
/// may have used) in the meantime is never overwritten.
pub fn create(store: &impl SharedStore, key: &str, value: &[u8]) -> bool {
    store.store(key, value, Some(NO_KEY_HOLDS)).is_ok()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// Someone else wrote the key since it was read.
    CasMismatch,
    Failed,
}

/// Outcome of one compare-and-swap update.
pub(crate) enum Update<T, D = ()> {
    Done(D),
    Refused(T),
    Contended,
}

/// Reads, transforms and conditionally writes one key, retrying on CAS conflicts.
pub(crate) fn update<T>(
    store: &impl SharedStore,
    key: &str,
    mut f: impl FnMut(Option<&[u8]>) -> Result<Vec<u8>, T>,
) -> Update<T> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let current = store.load(key);
        let next = match f(current.as_ref().map(|(v, _)| v.as_slice())) {
            Ok(next) => next,
            Err(refusal) => return Update::Refused(refusal),
        };
        match store.store(key, &next, current.map(|(_, cas)| cas)) {
            Ok(()) => return Update::Done(()),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return Update::Contended,
        }
    }
    Update::Contended
}

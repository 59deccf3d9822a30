//! Where a key's runs live: a fixed table of slots in shared data, created when the config
//! loads.
//!
//! Envoy's shared data cannot delete a key, and a compare-and-swap on a key that does not
//! exist yet is no compare at all (two workers may both "create" it). So a run never creates
//! its own key: each run-enabled key gets `slots` keys `weir:run:{key_path}:{i}` up front, each
//! holding up to [`ENTRIES_PER_SLOT`] runs, and a run lives in slot `digest mod slots`. Every
//! later change is a CAS on a key that exists. An ended run's entry is reused in place; a slot
//! whose entries are all live refuses new runs of its own key only.

use crate::config::{RunBudgets, Tenant};
use crate::store::SharedStore;

use super::entry::{ENTRIES_PER_SLOT, Slot};
use super::identity::RunKey;

/// Runs a key may have active when its config names no other number.
pub const DEFAULT_MAX_ACTIVE: u32 = 1024;

/// How long a run may sit idle before it has ended, when the config names no other time.
pub const DEFAULT_IDLE_TTL_MS: u64 = 900_000;

/// The shape of a key's run table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunTable {
    /// Slots per key (at least one).
    pub slots: u32,
    /// A run idle this long, with no call in flight, has ended.
    pub idle_ttl_ms: u64,
}

impl Default for RunTable {
    fn default() -> Self {
        RunTable::new(DEFAULT_MAX_ACTIVE, DEFAULT_IDLE_TTL_MS)
    }
}

impl RunTable {
    /// A table for about `max_active` runs per key.
    pub fn new(max_active: u32, idle_ttl_ms: u64) -> RunTable {
        let per_slot = u32::try_from(ENTRIES_PER_SLOT).unwrap_or(1).max(1);
        RunTable {
            slots: max_active.div_ceil(per_slot).max(1),
            idle_ttl_ms,
        }
    }

    /// The shared-data key of slot `i` of the key at `key_path`.
    pub fn slot_key(key_path: &str, i: u32) -> String {
        format!("weir:run:{key_path}:{i}")
    }

    /// The shared-data key of the slot `run` lives in.
    pub fn key_of(&self, key_path: &str, run: &RunKey) -> String {
        let i = run.spread().checked_rem(u64::from(self.slots)).unwrap_or(0);
        RunTable::slot_key(key_path, u32::try_from(i).unwrap_or(0))
    }
}

/// Whether a tenant's runs are held to anything.
pub fn runs_enabled(tenant: &Tenant) -> bool {
    tenant.run_budgets != RunBudgets::default()
}

/// Creates the slots of every run-enabled tenant, at config load (`on_configure`). Idempotent:
/// a slot that exists and parses is left as it is (its runs go on); one that does not parse is
/// rewritten empty, which forgets what its runs had used. Returns the slots written.
pub fn create<'a>(
    store: &impl SharedStore,
    tenants: impl IntoIterator<Item = &'a Tenant>,
    table: RunTable,
) -> usize {
    let empty = Slot::default().encode();
    let mut written = 0usize;
    for tenant in tenants.into_iter().filter(|t| runs_enabled(t)) {
        for i in 0..table.slots {
            let key = RunTable::slot_key(tenant.path(), i);
            let current = store.load(&key);
            if current
                .as_ref()
                .is_some_and(|(v, _)| Slot::decode(v).is_some())
            {
                continue;
            }
            // An absent key is created only if still absent: another worker may have created
            // it and admitted a run there meanwhile. A corrupt one: a CAS on what was read.
            let wrote = match current {
                None => crate::store::create(store, &key, &empty),
                Some((_, cas)) => store.store(&key, &empty, Some(cas)).is_ok(),
            };
            if wrote {
                written = written.saturating_add(1);
            }
        }
    }
    written
}

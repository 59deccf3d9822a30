//! Concurrency slots as leases, so a slot whose holder vanished comes back by itself.
//!
//! A token bucket heals by refilling; a bare counter of slots in use does not: a request whose
//! context dies without settling (its VM trapped and was replaced by `FAIL_RELOAD`, a release
//! that ran out of compare-and-swap attempts, a failed rollback) would hold its slot until
//! Envoy restarts. So each slot is a lease `(id, expiry)` in the counter's shared-data value:
//! taking one drops the expired leases first, the VM holding a lease renews it while the
//! request lives (a root-context tick, a bounded walk over that VM's own requests), and a lease
//! nobody renews lapses after its time to live. The value holds at most `limit` live leases, so
//! every operation is O(limit).
//!
//! Layout: an 8-byte tag, then 16 bytes per lease (id and expiry in ms, little-endian). A value
//! without the tag is a count from an earlier version of weir, read as that many leases that
//! expire one time-to-live from now.

/// Marks a lease table; never a plausible slot count.
const TAG: u64 = u64::MAX - 0x4C45_4153; // "LEAS"

/// One holder's claim on a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub expires_ms: u64,
}

/// The leases on one concurrency counter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leases(Vec<Lease>);

/// No slot is free: the counter holds `limit` live leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Full;

impl Leases {
    pub fn decode(bytes: &[u8], now_ms: u64, ttl_ms: u64) -> Option<Self> {
        let tag = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        if tag != TAG {
            // A bare count, from before leases.
            let anonymous = Lease {
                id: 0,
                expires_ms: now_ms.saturating_add(ttl_ms),
            };
            let count = usize::try_from(tag).ok()?.min(1 << 16);
            return Some(Leases(vec![anonymous; count]));
        }
        let rest = bytes.get(8..)?;
        if !rest.len().is_multiple_of(16) {
            return None;
        }
        let leases = rest
            .chunks_exact(16)
            .map(|c| {
                let (id, expires) = c.split_at(8);
                Some(Lease {
                    id: u64::from_le_bytes(id.try_into().ok()?),
                    expires_ms: u64::from_le_bytes(expires.try_into().ok()?),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Leases(leases))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 16 * self.0.len());
        out.extend_from_slice(&TAG.to_le_bytes());
        for lease in &self.0 {
            out.extend_from_slice(&lease.id.to_le_bytes());
            out.extend_from_slice(&lease.expires_ms.to_le_bytes());
        }
        out
    }

    /// Slots held by live leases.
    pub fn held(&self, now_ms: u64) -> usize {
        self.0.iter().filter(|l| l.expires_ms > now_ms).count()
    }

    fn without_expired(mut self, now_ms: u64) -> Self {
        self.0.retain(|l| l.expires_ms > now_ms);
        self
    }

    /// Takes a slot for `id` until `now_ms + ttl_ms`, if fewer than `limit` are held.
    pub fn acquire(self, id: u64, limit: u64, now_ms: u64, ttl_ms: u64) -> Result<Self, Full> {
        let mut live = self.without_expired(now_ms);
        if live.0.len() as u64 >= limit {
            return Err(Full);
        }
        live.0.push(Lease {
            id,
            expires_ms: now_ms.saturating_add(ttl_ms),
        });
        Ok(live)
    }

    /// Gives `id`'s slot back (one lease, should an id ever repeat).
    pub fn release(self, id: u64, now_ms: u64) -> Self {
        let mut live = self.without_expired(now_ms);
        if let Some(i) = live.0.iter().position(|l| l.id == id) {
            live.0.swap_remove(i);
        }
        live
    }

    /// Extends `id`'s lease. A lease that already lapsed is taken again if a slot is free;
    /// otherwise the request runs on without one (its slot went to someone else).
    pub fn renew(self, id: u64, limit: u64, now_ms: u64, ttl_ms: u64) -> Self {
        let mut live = self.without_expired(now_ms);
        let expires_ms = now_ms.saturating_add(ttl_ms);
        match live.0.iter_mut().find(|l| l.id == id) {
            Some(lease) => {
                lease.expires_ms = expires_ms;
                live
            }
            None => live
                .clone()
                .acquire(id, limit, now_ms, ttl_ms)
                .unwrap_or(live),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: u64 = 1_000;

    #[test]
    fn a_full_table_refuses_until_a_lease_is_released_or_lapses() {
        let t = Leases::default().acquire(1, 2, 0, TTL).unwrap();
        let t = t.acquire(2, 2, 0, TTL).unwrap();
        assert_eq!(t.clone().acquire(3, 2, 500, TTL), Err(Full));
        let freed = t.clone().release(1, 500);
        assert_eq!(freed.held(500), 1);
        assert!(freed.acquire(3, 2, 500, TTL).is_ok());
        // Nobody renewed: both leases lapse at 1,000 ms.
        let healed = t.acquire(3, 2, TTL, TTL).unwrap();
        assert_eq!(healed.held(TTL), 1);
    }

    #[test]
    fn renewing_keeps_a_slot_past_its_first_expiry() {
        let t = Leases::default().acquire(1, 1, 0, TTL).unwrap();
        let t = t.renew(1, 1, 900, TTL);
        assert_eq!(t.clone().acquire(2, 1, 1_500, TTL), Err(Full));
        // A lapsed lease is taken again when there is room.
        let t = t.renew(1, 1, 5_000, TTL);
        assert_eq!(t.held(5_000), 1);
        assert_eq!(t.clone().acquire(2, 1, 5_500, TTL), Err(Full));
        // ... and not when someone else holds the slot.
        let taken = Leases::default().acquire(2, 1, 0, TTL).unwrap();
        assert_eq!(taken.renew(1, 1, 10, TTL).held(10), 1);
    }

    #[test]
    fn encoding_round_trips_and_reads_old_counts_as_lapsing_leases() {
        let t = Leases::default().acquire(7, 4, 0, TTL).unwrap();
        assert_eq!(Leases::decode(&t.encode(), 0, TTL), Some(t.clone()));
        let old = Leases::decode(&3u64.to_le_bytes(), 100, TTL).unwrap();
        assert_eq!(old.held(100), 3);
        assert_eq!(old.held(100 + TTL), 0);
        assert_eq!(Leases::decode(&[1, 2], 0, TTL), None);
        let mut torn = t.encode();
        torn.pop();
        assert_eq!(Leases::decode(&torn, 0, TTL), None);
    }
}

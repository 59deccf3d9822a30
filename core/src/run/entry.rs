//! A run's state in shared data: what it has used and reserved, and its calls in flight, and
//! the slot value that holds a few runs.
//!
//! Layout of a slot (little-endian, the [`crate::lease`] style): an 8-byte tag, then each
//! entry: its 16-byte digest, `first_ms`, `last_ms`, the six counts (model calls, tool calls,
//! input tokens, output tokens, cost in micros, retries), the number of calls in flight, and
//! 16 bytes per call in flight (its id and lease expiry). A value that does not parse is
//! never guessed at: the caller refuses, and the table is rewritten empty when the config
//! loads ([`super::table::create`]).

use crate::lease::Lease;

/// Marks a run slot.
const TAG: u64 = u64::MAX - 0x5255_4E53; // "RUNS"

/// Entries one slot holds.
pub const ENTRIES_PER_SLOT: usize = 4;

/// Calls of one run in flight at once, whatever `parallel_calls` says: bounds an entry's size.
pub const MAX_CALLS_IN_FLIGHT: usize = 64;

/// Bytes of an entry before its calls in flight.
const ENTRY_HEAD: usize = 16 + 8 + 8 + 6 * 8 + 8;

/// What a run has used (or a call reserves, or a call used), measure by measure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub model_calls: u64,
    pub tool_calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_micros: u64,
    pub retries: u64,
}

impl Counts {
    fn fields(self) -> [u64; 6] {
        [
            self.model_calls,
            self.tool_calls,
            self.input_tokens,
            self.output_tokens,
            self.cost_micros,
            self.retries,
        ]
    }

    fn from_fields(f: [u64; 6]) -> Counts {
        let [
            model_calls,
            tool_calls,
            input_tokens,
            output_tokens,
            cost_micros,
            retries,
        ] = f;
        Counts {
            model_calls,
            tool_calls,
            input_tokens,
            output_tokens,
            cost_micros,
            retries,
        }
    }

    fn zip(self, other: Counts, f: impl Fn(u64, u64) -> u64) -> Counts {
        let mut out = self.fields();
        for (a, b) in out.iter_mut().zip(other.fields()) {
            *a = f(*a, b);
        }
        Counts::from_fields(out)
    }

    pub fn plus(self, other: Counts) -> Counts {
        self.zip(other, u64::saturating_add)
    }

    /// Takes `other` away, never below zero.
    pub fn minus(self, other: Counts) -> Counts {
        self.zip(other, u64::saturating_sub)
    }
}

/// One run's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub digest: [u8; 16],
    /// When the run's first call came: the run's start, for `runtime_ms`.
    pub first_ms: u64,
    /// When a call of the run last reserved or settled.
    pub last_ms: u64,
    /// Used plus reserved.
    pub counts: Counts,
    /// One lease per call in flight.
    pub calls: Vec<Lease>,
}

impl Entry {
    pub fn new(digest: [u8; 16], now_ms: u64) -> Entry {
        Entry {
            digest,
            first_ms: now_ms,
            last_ms: now_ms,
            counts: Counts::default(),
            calls: Vec::new(),
        }
    }

    /// Calls in flight whose lease has not lapsed.
    pub fn live_calls(&self, now_ms: u64) -> usize {
        self.calls.iter().filter(|c| c.expires_ms > now_ms).count()
    }

    /// Whether the run has ended: idle past `idle_ttl_ms` with no live call in flight.
    pub fn is_idle(&self, now_ms: u64, idle_ttl_ms: u64) -> bool {
        self.live_calls(now_ms) == 0 && now_ms.saturating_sub(self.last_ms) > idle_ttl_ms
    }
}

/// The runs one slot holds (at most [`ENTRIES_PER_SLOT`] once written by weir).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    pub entries: Vec<Entry>,
}

impl Slot {
    pub fn decode(bytes: &[u8]) -> Option<Slot> {
        let mut rest = bytes;
        if read_u64(&mut rest)? != TAG {
            return None;
        }
        let mut entries = Vec::new();
        while !rest.is_empty() {
            if entries.len() >= ENTRIES_PER_SLOT {
                return None;
            }
            entries.push(read_entry(&mut rest)?);
        }
        Some(Slot { entries })
    }

    pub fn encode(&self) -> Vec<u8> {
        let calls: usize = self.entries.iter().map(|e| e.calls.len()).sum();
        let size = 8usize
            .saturating_add(ENTRY_HEAD.saturating_mul(self.entries.len()))
            .saturating_add(calls.saturating_mul(16));
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(&TAG.to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.digest);
            out.extend_from_slice(&e.first_ms.to_le_bytes());
            out.extend_from_slice(&e.last_ms.to_le_bytes());
            for c in e.counts.fields() {
                out.extend_from_slice(&c.to_le_bytes());
            }
            out.extend_from_slice(&(e.calls.len() as u64).to_le_bytes());
            for call in &e.calls {
                out.extend_from_slice(&call.id.to_le_bytes());
                out.extend_from_slice(&call.expires_ms.to_le_bytes());
            }
        }
        out
    }
}

fn take<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if rest.len() < n {
        return None;
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Some(head)
}

fn read_u64(rest: &mut &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(take(rest, 8)?.try_into().ok()?))
}

fn read_entry(rest: &mut &[u8]) -> Option<Entry> {
    let digest: [u8; 16] = take(rest, 16)?.try_into().ok()?;
    let first_ms = read_u64(rest)?;
    let last_ms = read_u64(rest)?;
    let mut fields = [0u64; 6];
    for f in fields.iter_mut() {
        *f = read_u64(rest)?;
    }
    let n = usize::try_from(read_u64(rest)?).ok()?;
    if n > MAX_CALLS_IN_FLIGHT {
        return None;
    }
    let mut calls = Vec::with_capacity(n);
    for _ in 0..n {
        let id = read_u64(rest)?;
        let expires_ms = read_u64(rest)?;
        calls.push(Lease { id, expires_ms });
    }
    Some(Entry {
        digest,
        first_ms,
        last_ms,
        counts: Counts::from_fields(fields),
        calls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_round_trips_and_torn_or_foreign_values_do_not_parse() {
        let mut e = Entry::new([7; 16], 5);
        e.counts.output_tokens = 300;
        e.calls.push(Lease {
            id: 9,
            expires_ms: 100,
        });
        let slot = Slot {
            entries: vec![e.clone(), Entry::new([1; 16], 6)],
        };
        let bytes = slot.encode();
        assert_eq!(Slot::decode(&bytes), Some(slot));
        assert_eq!(
            Slot::decode(&Slot::default().encode()),
            Some(Slot::default())
        );
        for cut in 0..bytes.len() {
            let torn = bytes.get(..cut).unwrap_or_default();
            // Only the cut after the first whole entry (or the bare tag) parses.
            let parses = Slot::decode(torn).is_some();
            assert_eq!(
                parses,
                cut == 8 || cut == 8 + ENTRY_HEAD + 16,
                "cut at {cut}"
            );
        }
        assert_eq!(Slot::decode(&3u64.to_le_bytes()), None);
        assert_eq!(Slot::decode(b"garbage"), None);
    }
}

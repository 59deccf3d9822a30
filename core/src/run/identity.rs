//! Which run a call belongs to: the client's run id (and agent), bound to the key that named it.
//!
//! The digest covers the key's tenant path as well as the ids, and the shared-data key of the
//! run's slot holds the tenant path too, so a run id one key chose can never address another
//! key's run, however the ids collide.

use sha2::{Digest, Sha256};

/// Longest run id or agent name accepted.
pub const MAX_ID_LEN: usize = 128;

/// A run as one key names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunKey {
    pub run_id: String,
    pub agent: Option<String>,
    /// The first 16 bytes of SHA-256(key_path ‖ 0 ‖ agent ‖ 0 ‖ run_id).
    pub digest: [u8; 16],
}

/// Why a run id or agent name was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadRunId {
    Empty,
    TooLong,
    /// Holds a character outside visible ASCII (`!` to `~`).
    NotVisibleAscii,
}

impl RunKey {
    /// The run `run_id` (of `agent`, if named) of the key at `key_path`.
    pub fn new(key_path: &str, agent: Option<&str>, run_id: &str) -> Result<RunKey, BadRunId> {
        check(run_id)?;
        if let Some(agent) = agent {
            check(agent)?;
        }
        let mut hash = Sha256::new();
        hash.update(key_path.as_bytes());
        hash.update([0]);
        hash.update(agent.unwrap_or("").as_bytes());
        hash.update([0]);
        hash.update(run_id.as_bytes());
        let full = hash.finalize();
        let mut digest = [0u8; 16];
        for (d, s) in digest.iter_mut().zip(full.iter()) {
            *d = *s;
        }
        Ok(RunKey {
            run_id: run_id.to_owned(),
            agent: agent.map(str::to_owned),
            digest,
        })
    }

    /// The digest's first 8 bytes as a number, to pick the run's slot.
    pub(crate) fn spread(&self) -> u64 {
        let mut head = [0u8; 8];
        for (d, s) in head.iter_mut().zip(self.digest.iter()) {
            *d = *s;
        }
        u64::from_le_bytes(head)
    }
}

fn check(id: &str) -> Result<(), BadRunId> {
    if id.is_empty() {
        Err(BadRunId::Empty)
    } else if id.len() > MAX_ID_LEN {
        Err(BadRunId::TooLong)
    } else if !id.bytes().all(|b| b.is_ascii_graphic()) {
        Err(BadRunId::NotVisibleAscii)
    } else {
        Ok(())
    }
}

//! Token buckets as they live in proxy-wasm shared data (concurrency slots are leases, see
//! [`crate::lease`]).
//!
//! A bucket holds up to one minute of its rate and refills continuously. Its level may go
//! negative: settling a request that used more than it reserved leaves a debt that later
//! requests wait out. State is a fixed 16-byte record so every worker reads the same layout.

/// The stored state of a bucket: its level in tokens and when it was last refilled.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Bucket {
    pub level: f64,
    pub updated_ms: u64,
}

/// Why a bucket refused: how long until the amount fits, and what was left.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shortfall {
    pub retry_after_ms: u64,
    pub remaining: u64,
}

impl Bucket {
    /// A full bucket.
    pub fn full(per_minute: u64, now_ms: u64) -> Self {
        Bucket {
            level: per_minute as f64,
            updated_ms: now_ms,
        }
    }

    pub fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.level.to_le_bytes());
        out[8..].copy_from_slice(&self.updated_ms.to_le_bytes());
        out
    }

    /// `None` for anything but a bucket's 16 bytes (a fleet-wide counter's lease, say, left by
    /// an earlier configuration of the same limit).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != 16 {
            return None;
        }
        let level = f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let updated_ms = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
        level.is_finite().then_some(Bucket { level, updated_ms })
    }

    /// The state after refilling up to `now_ms`.
    pub fn refilled(self, per_minute: u64, now_ms: u64) -> Self {
        let elapsed = now_ms.saturating_sub(self.updated_ms) as f64;
        let capacity = per_minute as f64;
        Bucket {
            level: (self.level + elapsed * capacity / 60_000.0).min(capacity),
            updated_ms: now_ms.max(self.updated_ms),
        }
    }

    /// Takes `amount`, or says how long until it fits. A request larger than the whole bucket
    /// is let through when the bucket is full, leaving a debt, so it is slowed, not banned.
    pub fn take(self, per_minute: u64, amount: u64, now_ms: u64) -> Result<Self, Shortfall> {
        let b = self.refilled(per_minute, now_ms);
        let capacity = per_minute as f64;
        let need = (amount as f64).min(capacity);
        if b.level >= need {
            return Ok(Bucket {
                level: b.level - amount as f64,
                ..b
            });
        }
        let per_ms = capacity / 60_000.0;
        let wait = if per_ms > 0.0 {
            ((need - b.level) / per_ms).ceil() as u64
        } else {
            u64::MAX
        };
        Err(Shortfall {
            retry_after_ms: wait.max(1),
            remaining: b.level.max(0.0) as u64,
        })
    }

    /// Adds `delta` tokens back (negative: charges more), never above capacity.
    pub fn adjust(self, per_minute: u64, delta: f64, now_ms: u64) -> Self {
        let b = self.refilled(per_minute, now_ms);
        Bucket {
            level: (b.level + delta).min(per_minute as f64),
            ..b
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_round_trips() {
        let b = Bucket {
            level: -12.5,
            updated_ms: 99,
        };
        assert_eq!(Bucket::decode(&b.encode()), Some(b));
        assert_eq!(Bucket::decode(&[1, 2, 3]), None);
    }

    #[test]
    fn take_then_refill() {
        let b = Bucket::full(600, 0);
        let b = b.take(600, 600, 0).unwrap();
        assert_eq!(b.level, 0.0);
        // 600/min is 10 per second: 50 tokens need 5 s.
        let short = b.take(600, 50, 0).unwrap_err();
        assert_eq!(short.retry_after_ms, 5_000);
        assert_eq!(short.remaining, 0);
        assert!(b.take(600, 50, 5_000).is_ok());
    }

    #[test]
    fn refill_caps_at_one_minute() {
        let b = Bucket::full(100, 0).take(100, 100, 0).unwrap();
        assert_eq!(b.refilled(100, 10 * 60_000).level, 100.0);
    }

    #[test]
    fn oversized_requests_pass_only_from_a_full_bucket_and_leave_debt() {
        let b = Bucket::full(100, 0);
        let b = b.take(100, 250, 0).unwrap();
        assert_eq!(b.level, -150.0);
        let short = b.take(100, 10, 0).unwrap_err();
        assert_eq!(short.retry_after_ms, 96_000, "(150 + 10) tokens at 100/min");
    }

    #[test]
    fn adjust_refunds_and_charges() {
        let b = Bucket::full(100, 0).take(100, 80, 0).unwrap();
        assert_eq!(b.adjust(100, 30.0, 0).level, 50.0);
        assert_eq!(b.adjust(100, -30.0, 0).level, -10.0);
        assert_eq!(b.adjust(100, 1_000.0, 0).level, 100.0, "capped at capacity");
    }

    #[test]
    fn clocks_going_backwards_do_not_refill() {
        let b = Bucket {
            level: 0.0,
            updated_ms: 10_000,
        };
        let r = b.refilled(60, 5_000);
        assert_eq!((r.level, r.updated_ms), (0.0, 10_000));
    }
}

//! `Retry-After` from the queue: a refused client is told to come back about when the pool's
//! projected wait has passed, not after a constant, and each is told a slightly different time
//! so refused clients do not all retry in the same second and refuse each other again.

use std::sync::Arc;

use tokio::sync::watch;

/// What the dispatcher last projected (every tick): per pool, how long the work queued there
/// takes to dispatch at the current rate; and the longest `Retry-After` to give.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Waits {
    pub projected_ms: Vec<u64>,
    pub cap_ms: u64,
}

/// The handlers' view of [`Waits`].
#[derive(Clone)]
pub struct Backoff {
    waits: watch::Receiver<Arc<Waits>>,
}

impl Backoff {
    pub fn new(waits: watch::Receiver<Arc<Waits>>) -> Self {
        Backoff { waits }
    }

    /// Seconds to send in `Retry-After` for a refusal in `pool` (none: before a pool is known).
    pub fn retry_after_s(&self, pool: Option<usize>) -> u64 {
        let waits = self.waits.borrow();
        let projected = pool
            .and_then(|p| waits.projected_ms.get(p).copied())
            .unwrap_or(0);
        spread(projected, waits.cap_ms, fastrand::f64())
    }

    /// Seconds to send in `Retry-After` for a refusal whose tenant's own projected wait is
    /// `wait_ms`: [`spread`] around it, capped.
    pub fn retry_after_wait_s(&self, wait_ms: u64) -> u64 {
        spread(wait_ms, self.waits.borrow().cap_ms, fastrand::f64())
    }

    /// Seconds to send in `Retry-After` for an engine's refusal in `pool` that gave its own
    /// `Retry-After` of `engine_s` seconds: see [`after_engine`].
    pub fn after_engine_s(&self, pool: usize, engine_s: u64) -> u64 {
        let waits = self.waits.borrow();
        let projected = waits.projected_ms.get(pool).copied().unwrap_or(0);
        after_engine(engine_s, projected, waits.cap_ms, fastrand::f64())
    }
}

/// `Retry-After` seconds for a projected wait: the wait (at least a second) scaled by a factor
/// between 0.5 and 1.5 drawn from `jitter` (in `[0, 1)`), rounded up, at least 1 and at most
/// the cap (itself at least a second).
pub fn spread(projected_ms: u64, cap_ms: u64, jitter: f64) -> u64 {
    let base = projected_ms.max(1_000) as f64;
    let factor = 0.5 + jitter.clamp(0.0, 1.0);
    let seconds = (base * factor / 1_000.0).ceil() as u64;
    seconds.clamp(1, cap_ms.div_ceil(1_000).max(1))
}

/// `Retry-After` seconds for a refusal the engine gave its own `Retry-After` for: the pool's
/// projected wait, [`spread`], when it is longer; else never sooner than the engine asked but
/// up to half as long again, drawn from `jitter` (an engine gives every throttled request the
/// same figure, and they would all retry in the same second); capped like every other (an
/// engine's `0` is not passed on, nor its hour).
pub fn after_engine(engine_s: u64, projected_ms: u64, cap_ms: u64, jitter: f64) -> u64 {
    if engine_s.saturating_mul(1_000) <= projected_ms {
        return spread(projected_ms, cap_ms, jitter);
    }
    let seconds = (engine_s as f64 * (1.0 + 0.5 * jitter.clamp(0.0, 1.0))).ceil() as u64;
    seconds.clamp(1, cap_ms.div_ceil(1_000).max(1))
}

#[cfg(test)]
mod tests {
    use super::{after_engine, spread};

    #[test]
    fn an_engine_s_own_wait_is_the_least_given_spread_and_capped() {
        // The engine asks for 10 s: 10-15 s, never sooner.
        assert_eq!(after_engine(10, 0, 60_000, 0.0), 10);
        assert_eq!(after_engine(10, 0, 60_000, 0.5), 13);
        assert_eq!(after_engine(10, 0, 60_000, 0.999), 15);
        // A longer projected wait of the pool's own counts as ever.
        assert_eq!(after_engine(10, 40_000, 60_000, 0.5), 40);
        // An engine's 0 is not passed on as 0, nor its hour past the cap.
        assert_eq!(after_engine(0, 0, 60_000, 0.0), 1);
        assert_eq!(after_engine(0, 0, 60_000, 0.9), 2);
        assert_eq!(after_engine(3_600, 0, 60_000, 0.3), 60);
        assert_eq!(after_engine(u64::MAX, u64::MAX, 0, 0.3), 1);
    }

    #[test]
    fn the_wait_is_spread_around_the_projection_and_capped() {
        // A projected 10 s becomes 5-15 s, depending on the draw.
        assert_eq!(spread(10_000, 60_000, 0.0), 5);
        assert_eq!(spread(10_000, 60_000, 0.5), 10);
        assert_eq!(spread(10_000, 60_000, 0.999), 15);
        // Nothing queued: a second or two.
        assert_eq!(spread(0, 60_000, 0.0), 1);
        assert_eq!(spread(0, 60_000, 0.9), 2);
        // Never past the cap, never below a second.
        assert_eq!(spread(600_000, 30_000, 0.7), 30);
        assert_eq!(spread(600_000, 0, 0.7), 1);
    }
}

//! This sidecar's share of a pool's engines when `k` sidecars front the same replicas (a
//! pool's `sidecars: k`; Envoy sends each org to one of them).
//!
//! Each sidecar admits only against what it was counted: it knows its own reservations and
//! in-flight requests, not the others'. Were each to admit against a whole replica, `k`
//! sidecars would send it `k` times its KV and its slots and the excess would queue inside
//! the engine, in arrival order, where no fair scheduler reaches it. So each takes
//! `⌊total / k⌋` of every replica's KV budget and concurrency limit, whether configured or
//! read from the engine: the `k` shares never add up to more than the replica. The engine's own
//! figures (`num_requests_waiting`, KV usage) still count everyone's work and keep gating
//! dispatch, a backstop for a share set wrong.
//!
//! The share is static: when a sidecar is gone its share idles until it returns (or a reload
//! says `k - 1`); sidecar/README.md ("Several sidecars per pool") bounds what that costs.

use crate::config::engine::EngineShare;

impl EngineShare {
    pub fn of(sidecars: u64) -> EngineShare {
        EngineShare { sidecars }
    }

    pub fn sidecars(self) -> u64 {
        self.sidecars
    }

    /// This sidecar's part of a replica's `total` KV tokens or slots: `⌊total / k⌋`, at least
    /// 1 (a replica smaller than its sidecars still runs one request for each). 0, "no figure",
    /// stays 0.
    pub fn part(self, total: u64) -> u64 {
        if total == 0 {
            return 0;
        }
        (total / self.sidecars.max(1)).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::EngineShare;

    #[test]
    fn shares_never_add_up_to_more_than_the_replica() {
        for total in [1, 2, 3, 7, 16, 381_000] {
            for k in 1..=5 {
                let part = EngineShare::of(k).part(total);
                assert!(part >= 1, "{total}/{k}");
                assert!(part * k <= total.max(k), "{total}/{k}: {part}");
            }
        }
        assert_eq!(
            EngineShare::default().part(256),
            256,
            "one sidecar has it all"
        );
        assert_eq!(EngineShare::of(2).part(256), 128);
        assert_eq!(EngineShare::of(3).part(16), 5);
        assert_eq!(EngineShare::of(2).part(0), 0, "no figure stays no figure");
    }
}

//! KV admission's output predictions: what a request is held for on its replica beyond its
//! prompt, learned per tenant and pool from the outputs the relay counted
//! ([`weir_core::prediction`] holds the rule and its configuration).
//!
//! A request is held for its prompt plus the prediction per sequence (never more than its own
//! output limit); a stream that runs past it grows its hold as its tokens arrive
//! ([`crate::relay`]), so admission sees what the replica really holds. With prediction off, a
//! sequence is held for [`UNBOUNDED_OUTPUT_TOKENS`] as before. Histories live in memory: a
//! restarted sidecar starts cold, at the configured `initial`.

use std::collections::HashMap;
use std::sync::Mutex;

use weir_core::prediction::{OutputHistory, PredictionConfig};

use crate::intake::demand::UNBOUNDED_OUTPUT_TOKENS;
use crate::support::live::Live;

/// Histories kept at most. Tenants come from signed headers, so their number is the filter's
/// config's; past this bound (a config of that many keys), newcomers share their pool's record.
const MAX_HISTORIES: usize = 65_536;

/// The tenant of the history a pool's newcomers share once [`MAX_HISTORIES`] are kept.
const SHARED: &str = "";

pub struct Predictions {
    pub config: Live<PredictionConfig>,
    histories: Mutex<HashMap<(String, usize), OutputHistory>>,
}

impl Predictions {
    pub fn new(config: PredictionConfig) -> Predictions {
        Predictions {
            config: Live::new(config),
            histories: Mutex::default(),
        }
    }

    /// Output tokens to hold per sequence of `tenant`'s next request on `pool`.
    pub fn predict(&self, tenant: &str, pool: usize) -> u64 {
        let config = self.config.load();
        if !config.enabled {
            return UNBOUNDED_OUTPUT_TOKENS;
        }
        let Ok(histories) = self.histories.lock() else {
            return config.initial;
        };
        let history = histories
            .get(&(tenant.to_owned(), pool))
            .or_else(|| histories.get(&(SHARED.to_owned(), pool)));
        history.map_or_else(
            || OutputHistory::default().predict(&config, None),
            |h| h.predict(&config, None),
        )
    }

    /// Learns one completed answer of `tokens` for `tenant` on `pool`.
    pub fn learn(&self, tenant: &str, pool: usize, tokens: u64) {
        let config = self.config.load();
        let Ok(mut histories) = self.histories.lock() else {
            return;
        };
        if !config.enabled {
            return;
        }
        let mut key = (tenant.to_owned(), pool);
        if !histories.contains_key(&key) && histories.len() >= MAX_HISTORIES {
            key.0 = SHARED.to_owned();
        }
        histories.entry(key).or_default().learn(tokens, &config);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tenant_and_pool_learns_its_own_and_the_number_kept_is_bounded() {
        let p = Predictions::new(PredictionConfig {
            min_samples: 2,
            ..PredictionConfig::default()
        });
        assert_eq!(p.predict("a", 0), 1024, "cold: the initial value");
        p.learn("a", 0, 300);
        p.learn("a", 0, 300);
        assert_eq!(p.predict("a", 0), 304);
        assert_eq!(p.predict("a", 1), 1024, "another pool");
        assert_eq!(p.predict("b", 0), 1024, "another tenant");

        let full = Predictions::new(PredictionConfig::default());
        for i in 0..MAX_HISTORIES {
            full.learn(&format!("t{i}"), 0, 50);
        }
        for _ in 0..30 {
            full.learn("newcomer", 0, 50);
        }
        assert_eq!(full.histories.lock().unwrap().len(), MAX_HISTORIES + 1);
        assert_eq!(full.predict("another", 0), 53, "the shared record");

        let off = Predictions::new(PredictionConfig {
            enabled: false,
            ..PredictionConfig::default()
        });
        off.learn("a", 0, 5000);
        assert_eq!(off.predict("a", 0), UNBOUNDED_OUTPUT_TOKENS);
    }
}

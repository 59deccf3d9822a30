//! Predicted output lengths: what a request that sets no output limit is reserved for.
//!
//! The OpenAI SDKs send no `max_tokens` by default. Reserving the rest of the context for such a
//! request (~131k tokens on an 8B model) turns an output-token budget into one request at a time
//! and makes KV admission hold memory nobody uses. Instead weir reserves a *prediction*: a
//! quantile (p90 by default) of the output lengths the same tenant recently got from the same
//! model, learned from the engine's counts when requests settle.
//!
//! The record is a histogram over log-spaced buckets (four per doubling, so a bucket's upper
//! edge is at most 19% above any length in it) whose weights decay by half every
//! `half_life_samples` new samples: recent behaviour counts, old behaviour fades, and no
//! window of raw samples is kept. A quantile is read as the upper edge of the bucket where the
//! cumulative weight reaches it (rounding up, never down). Until `min_samples` outputs have been
//! seen the prediction is the configured `initial` value. Every prediction is at least `floor`
//! and never above the request's cap (the rest of its context, the key's `max_output_tokens`).
//!
//! A prediction only sizes the reservation: nothing is cut off at it (weir never adds a limit
//! the caller did not send), and an answer that runs past it is charged in full when it settles.
//! The record encodes to a few hundred bytes at most (only non-empty buckets), so the filter
//! keeps one per tenant and model in proxy-wasm shared data ([`learn_shared`]).

use serde::Deserialize;

use crate::store::{SharedStore, Update, update};

/// Buckets per doubling of the length.
const PER_OCTAVE: f64 = 4.0;
/// Bucket 0 holds lengths 0 and 1; bucket `i` lengths in (2^((i-1)/4), 2^(i/4)]; the last one
/// everything from 2^24 (16M tokens) up.
const BUCKETS: usize = 97;
/// Weights below this are dropped: they no longer move a quantile and would cost bytes.
const NEGLIGIBLE: f32 = 1e-3;
/// Leading byte of an encoded record, so a changed layout is read as no record, never as noise.
const VERSION: u8 = 1;

/// How predictions are made (`prediction` in the filter's and the sidecar's config).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PredictionConfig {
    /// Off: a request without an output limit reserves the rest of its context, as before.
    pub enabled: bool,
    /// The quantile of recent output lengths reserved (0.5 to 0.999).
    pub quantile: f64,
    /// Samples after which an output's weight has halved: the window's length.
    pub half_life_samples: u32,
    /// The least any prediction is, in tokens.
    pub floor: u64,
    /// What is reserved until `min_samples` outputs have been seen, in tokens.
    pub initial: u64,
    /// Outputs to see before the record is trusted over `initial`.
    pub min_samples: u32,
}

impl Default for PredictionConfig {
    fn default() -> Self {
        PredictionConfig {
            enabled: true,
            quantile: 0.9,
            half_life_samples: 200,
            floor: 16,
            initial: 1024,
            min_samples: 20,
        }
    }
}

impl PredictionConfig {
    /// Checks the values; the error names the field (under `prediction.`).
    pub fn validate(&self) -> Result<(), (&'static str, &'static str)> {
        if !(0.5..=0.999).contains(&self.quantile) {
            return Err(("prediction.quantile", "must be between 0.5 and 0.999"));
        }
        if !(1..=1_000_000).contains(&self.half_life_samples) {
            return Err((
                "prediction.half_life_samples",
                "must be between 1 and 1000000",
            ));
        }
        if self.floor == 0 {
            return Err(("prediction.floor", "must be at least 1"));
        }
        if self.initial < self.floor {
            return Err(("prediction.initial", "must be at least prediction.floor"));
        }
        if self.initial > crate::trusted::MAX_TOKENS {
            return Err(("prediction.initial", "is more than one request may reserve"));
        }
        Ok(())
    }

    /// The weight every older sample keeps when a new one arrives.
    fn decay(&self) -> f32 {
        0.5f64.powf(1.0 / f64::from(self.half_life_samples.max(1))) as f32
    }
}

/// The recent output lengths of one tenant on one model, as a decaying histogram.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputHistory {
    weights: [f32; BUCKETS],
    /// Outputs seen (saturating): what the cold start counts.
    samples: u32,
}

impl Default for OutputHistory {
    fn default() -> Self {
        OutputHistory {
            weights: [0.0; BUCKETS],
            samples: 0,
        }
    }
}

fn bucket_of(tokens: u64) -> usize {
    if tokens <= 1 {
        return 0;
    }
    let i = ((tokens as f64).log2() * PER_OCTAVE).ceil() as usize;
    i.min(BUCKETS - 1)
}

/// The largest length bucket `i` holds (for the last bucket, its lower edge).
fn upper_edge(i: usize) -> u64 {
    2f64.powf(i as f64 / PER_OCTAVE).floor() as u64
}

impl OutputHistory {
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// Adds one output of `tokens`; every older one weighs a little less.
    pub fn learn(&mut self, tokens: u64, config: &PredictionConfig) {
        let decay = config.decay();
        for w in &mut self.weights {
            *w *= decay;
            if *w < NEGLIGIBLE {
                *w = 0.0;
            }
        }
        self.weights[bucket_of(tokens)] += 1.0;
        self.samples = self.samples.saturating_add(1);
    }

    /// The `q` quantile of the recorded lengths, rounded up to its bucket's edge; `None` with
    /// nothing recorded.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let total: f64 = self.weights.iter().map(|&w| f64::from(w)).sum();
        if total <= 0.0 {
            return None;
        }
        let target = q.clamp(0.0, 1.0) * total;
        let mut seen = 0.0;
        for (i, &w) in self.weights.iter().enumerate() {
            seen += f64::from(w);
            if w > 0.0 && seen >= target {
                return Some(upper_edge(i));
            }
        }
        self.weights.iter().rposition(|&w| w > 0.0).map(upper_edge)
    }

    /// Output tokens to reserve for one answer whose hard cap is `cap` (the rest of its
    /// context, the key's per-request limit): the configured quantile once enough outputs were
    /// seen, else `initial`; at least `floor`, never above `cap`.
    pub fn predict(&self, config: &PredictionConfig, cap: Option<u64>) -> u64 {
        let learned = (self.samples >= config.min_samples)
            .then(|| self.quantile(config.quantile))
            .flatten();
        let prediction = learned.unwrap_or(config.initial).max(config.floor);
        cap.map_or(prediction, |cap| prediction.min(cap))
    }

    /// The record as bytes: version, sample count, then (bucket, weight) for non-empty buckets.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5 + 5 * 16);
        out.push(VERSION);
        out.extend_from_slice(&self.samples.to_le_bytes());
        for (i, &w) in self.weights.iter().enumerate() {
            if w > 0.0 {
                out.push(i as u8);
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
        out
    }

    /// Reads [`encode`](Self::encode)'s bytes; `None` for anything else.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version != VERSION || rest.len() < 4 || (rest.len() - 4) % 5 != 0 {
            return None;
        }
        let mut history = OutputHistory {
            samples: u32::from_le_bytes(rest.get(..4)?.try_into().ok()?),
            ..OutputHistory::default()
        };
        for entry in rest[4..].chunks_exact(5) {
            let i = usize::from(entry[0]);
            let w = f32::from_le_bytes(entry[1..].try_into().ok()?);
            if i >= BUCKETS || !w.is_finite() || w < 0.0 {
                return None;
            }
            history.weights[i] = w;
        }
        Some(history)
    }
}

/// The shared-data key of a tenant's history on `model`. Only models the config names get one
/// of their own; every other name a body brings shares the tenant's `*` record, so callers
/// cannot mint keys (tenant paths come from the config too).
pub fn shared_key(tenant_path: &str, model: &str, configured: bool) -> String {
    let model = if configured { model } else { "*" };
    format!("weir:p:{tenant_path}:{model}")
}

/// The history stored under `key` (an empty one when there is none or it is unreadable).
pub fn load_shared(store: &impl SharedStore, key: &str) -> OutputHistory {
    store
        .load(key)
        .and_then(|(bytes, _)| OutputHistory::decode(&bytes))
        .unwrap_or_default()
}

/// Adds one output to the history under `key`, by compare-and-swap as the buckets are updated.
/// Returns false when the update lost every race (the sample is dropped: a prediction is an
/// estimate, and the next settle learns again).
pub fn learn_shared(
    store: &impl SharedStore,
    key: &str,
    tokens: u64,
    config: &PredictionConfig,
) -> bool {
    let outcome = update::<()>(store, key, |current| {
        let mut history = current.and_then(OutputHistory::decode).unwrap_or_default();
        history.learn(tokens, config);
        Ok(history.encode())
    });
    matches!(outcome, Update::Done(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reservation::tests::Memory;

    fn learned(lengths: impl IntoIterator<Item = u64>, config: &PredictionConfig) -> OutputHistory {
        let mut h = OutputHistory::default();
        for n in lengths {
            h.learn(n, config);
        }
        h
    }

    #[test]
    fn buckets_are_log_spaced_and_rounded_up() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1), 0);
        assert_eq!(upper_edge(bucket_of(256)), 256, "a power of two is an edge");
        for n in [2, 3, 7, 100, 257, 1000, 4097, 131_072, 1_000_000] {
            let edge = upper_edge(bucket_of(n));
            assert!(
                edge >= n && (edge as f64) <= n as f64 * 1.19 + 1.0,
                "{n} → {edge}"
            );
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn the_quantile_of_a_known_distribution() {
        let c = PredictionConfig {
            half_life_samples: 1_000_000,
            ..PredictionConfig::default()
        };
        // 1..=1000 once each, hardly decayed: p90 is 900, rounded up to its bucket's edge.
        let h = learned(1..=1000, &c);
        let p90 = h.quantile(0.9).unwrap();
        assert!((900..=1071).contains(&p90), "{p90}");
        let p50 = h.quantile(0.5).unwrap();
        assert!((500..=595).contains(&p50), "{p50}");
        assert_eq!(OutputHistory::default().quantile(0.9), None);
    }

    #[test]
    fn cold_start_floor_and_cap() {
        let c = PredictionConfig {
            min_samples: 5,
            initial: 300,
            floor: 40,
            ..PredictionConfig::default()
        };
        let mut h = learned([10; 4], &c);
        assert_eq!(h.predict(&c, None), 300, "cold: the initial value");
        assert_eq!(h.predict(&c, Some(100)), 100, "never above the cap");
        h.learn(10, &c);
        assert_eq!(h.predict(&c, None), 40, "learned 10, lifted to the floor");
        let long = learned([5000; 10], &c);
        assert_eq!(long.predict(&c, Some(4096)), 4096, "the cap wins");
        assert_eq!(long.predict(&c, Some(10)), 10, "even below the floor");
    }

    #[test]
    fn old_behaviour_fades_with_the_half_life() {
        let c = PredictionConfig {
            half_life_samples: 20,
            ..PredictionConfig::default()
        };
        let mut h = learned([2000; 100], &c);
        assert!(h.quantile(0.9).unwrap() >= 2000);
        for _ in 0..100 {
            h.learn(100, &c);
        }
        // After five half-lives the long answers weigh 1/32 of the short ones: under 10%.
        let p90 = h.quantile(0.9).unwrap();
        assert!((100..=119).contains(&p90), "{p90}");
    }

    #[test]
    fn the_record_is_compact_and_round_trips() {
        let c = PredictionConfig::default();
        let h = learned((0..500).map(|i| 50 + (i * 37) % 700), &c);
        let bytes = h.encode();
        assert!(bytes.len() <= 5 + 5 * BUCKETS, "{}", bytes.len());
        assert!(
            bytes.len() < 120,
            "a narrow distribution uses few buckets: {}",
            bytes.len()
        );
        assert_eq!(OutputHistory::decode(&bytes), Some(h));
        for bad in [
            &b""[..],
            &[2, 0, 0, 0, 0],
            &[1, 0, 0, 0],
            &[1, 0, 0, 0, 0, 200, 0, 0, 0, 0],
        ] {
            assert_eq!(OutputHistory::decode(bad), None, "{bad:?}");
        }
        let nan = [&[1u8, 1, 0, 0, 0, 3][..], &f32::NAN.to_le_bytes()].concat();
        assert_eq!(OutputHistory::decode(&nan), None);
    }

    #[test]
    fn shared_records_learn_by_compare_and_swap_and_bound_their_keys() {
        let c = PredictionConfig {
            min_samples: 1,
            ..PredictionConfig::default()
        };
        let store = Memory::default();
        let key = shared_key("acme/w/p/k", "llama", true);
        assert_eq!(key, "weir:p:acme/w/p/k:llama");
        assert_eq!(
            shared_key("acme/w/p/k", "anything-a-caller-sends", false),
            "weir:p:acme/w/p/k:*"
        );
        assert_eq!(load_shared(&store, &key).samples(), 0);
        store.conflicts.set(3);
        assert!(
            learn_shared(&store, &key, 300, &c),
            "retried past conflicts"
        );
        assert!(learn_shared(&store, &key, 300, &c));
        let h = load_shared(&store, &key);
        assert_eq!(h.samples(), 2);
        assert_eq!(h.predict(&c, None), 304);
        store.conflicts.set(crate::store::MAX_CAS_ATTEMPTS);
        assert!(!learn_shared(&store, &key, 300, &c), "gives up, bounded");
    }

    #[test]
    fn config_values_are_checked() {
        assert_eq!(PredictionConfig::default().validate(), Ok(()));
        let bad = |c: PredictionConfig| c.validate().unwrap_err().0;
        let d = PredictionConfig::default;
        assert_eq!(
            bad(PredictionConfig {
                quantile: 1.0,
                ..d()
            }),
            "prediction.quantile"
        );
        assert_eq!(
            bad(PredictionConfig {
                half_life_samples: 0,
                ..d()
            }),
            "prediction.half_life_samples"
        );
        assert_eq!(
            bad(PredictionConfig { floor: 0, ..d() }),
            "prediction.floor"
        );
        assert_eq!(
            bad(PredictionConfig {
                initial: 8,
                floor: 16,
                ..d()
            }),
            "prediction.initial"
        );
    }
}

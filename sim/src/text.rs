//! Deterministic generated text: the same seed always yields the same pieces and length.

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};

use crate::profile::OutputLength;

/// Pieces of text, one streamed per generated token: each is one token in both vocabularies and
/// no two merge, so generated text re-tokenizes to as many tokens as were generated — as a real
/// engine's output does, and as a continuation's re-prefill relies on.
const PIECES: &[&str] = &[
    " the", " a", " token", " cache", " of", " and", " model", " to", " is", " in", " memory",
    " each", " tenant", " request", " stream", " batch", " that", " block", " queue", " for",
    " prefix", " with", " on", " time", " fair", " share", " it", " as", " so", " then", " we",
    " key", " value", " step", " decode", " fill", " GPU", " runs", " waits", " fits",
];

/// The generator for one request.
pub struct TextGen {
    rng: SmallRng,
}

impl TextGen {
    pub fn new(seed: u64) -> Self {
        TextGen {
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// How long the answer runs before its natural end, never zero.
    pub fn natural_length(&mut self, dist: &OutputLength) -> u32 {
        let drawn = match *dist {
            OutputLength::Fixed { tokens } => f64::from(tokens),
            OutputLength::Uniform { min, max } => {
                f64::from(self.rng.random_range(min.min(max)..=max.max(min)))
            }
            OutputLength::Exponential { mean } => {
                Exp::new(1.0 / mean.max(1.0)).map_or(mean, |d| d.sample(&mut self.rng))
            }
            OutputLength::LogNormal { median, sigma } => {
                LogNormal::new(median.max(1.0).ln(), sigma)
                    .map_or(median, |d| d.sample(&mut self.rng))
            }
        };
        drawn.round().clamp(1.0, f64::from(u32::MAX)) as u32
    }

    pub fn next_piece(&mut self) -> &'static str {
        PIECES[self.rng.random_range(0..PIECES.len())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_core::tokens::Encoding;

    #[test]
    fn every_piece_and_pair_of_pieces_tokenizes_as_generated() {
        for encoding in [Encoding::Cl100kBase, Encoding::O200kBase] {
            for a in PIECES {
                for b in PIECES {
                    let text = format!("{a}{b}");
                    assert_eq!(
                        encoding.encode(&text).unwrap().len(),
                        2,
                        "{encoding:?} {text:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn same_seed_same_text() {
        let take = |seed| {
            let mut g = TextGen::new(seed);
            (0..20).map(|_| g.next_piece()).collect::<String>()
        };
        assert_eq!(take(7), take(7));
        assert_ne!(take(7), take(8));
    }

    #[test]
    fn lengths_follow_the_distribution() {
        let mut g = TextGen::new(1);
        let fixed = OutputLength::Fixed { tokens: 42 };
        assert_eq!(g.natural_length(&fixed), 42);
        let uniform = OutputLength::Uniform { min: 10, max: 20 };
        assert!((0..100).all(|_| (10..=20).contains(&g.natural_length(&uniform))));
        let lognormal = OutputLength::LogNormal {
            median: 100.0,
            sigma: 0.5,
        };
        let mut xs: Vec<u32> = (0..1001).map(|_| g.natural_length(&lognormal)).collect();
        xs.sort_unstable();
        assert!((85..=115).contains(&xs[500]), "median {}", xs[500]);
        assert_eq!(g.natural_length(&OutputLength::Fixed { tokens: 0 }), 1);
    }
}

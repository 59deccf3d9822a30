//! Prediction learning: a completed answer teaches the tenant's output prediction on its pool
//! its real length ([`crate::intake::prediction`]).

use crate::intake::app::App;

/// What the attempt's answer can teach.
pub struct Learning {
    /// The request set no output limit: its answer's length teaches the prediction (one cut
    /// short by a small `max_tokens` would teach it low, as the filter also holds).
    pub(super) uncapped: bool,
    /// Sequences the engine runs for it: what one answer's length is learned from.
    pub(super) sequences: u64,
    /// Output tokens its KV hold was sized for (the prediction).
    pub(super) output_held: u64,
}

impl Learning {
    /// A completed answer of `completion` tokens teaches `tenant`'s prediction on `pool` its
    /// real length, and the prediction's error is published (per pool, named by its `model`:
    /// no tenant label).
    pub(super) fn teach(
        &self,
        app: &App,
        (tenant, pool): (&str, usize),
        model: &str,
        completion: u64,
    ) {
        let per_sequence = completion / self.sequences.max(1);
        app.predictions.learn(tenant, pool, per_sequence);
        if self.output_held > 0 {
            let ratio = completion as f64 / self.output_held as f64;
            (app.metrics.output_prediction_ratio).observe(&[("pool", model)], ratio);
        }
    }
}

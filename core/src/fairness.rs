//! Whether the fairness promise holds, measured live over a window of a pool's service.
//!
//! The entities measured are those fair share is divided among at the top of the tree (orgs,
//! or keys with `fair_share: key`). A share counts as *backlogged in the window* once it had
//! work queued for nearly all of it (90%, allowing for the sampling); only those are owed an
//! equal (weighted) service, VTC's promise to tenants backlogged through an interval, so only
//! they enter the index. Each one's service is its weighted tokens
//! (`w_in · input + w_out · output`) over its weight, per unit of the time it was backlogged.
//! A tenant that asks for less than its share is not measured, as it should not be: it got all
//! it asked for, even though on a saturated pool each of its requests waits a moment for a
//! slot (the small tenants of the noisy-neighbour scenario have work queued 30–55% of the time).
//!
//! Jain's index `(Σx)² / (n · Σx²)` is 1 when every backlogged share got the same and `1/n`
//! when one got everything. With fewer than two backlogged shares there is nobody to compare:
//! the index is undefined (`None`, and the sidecar publishes no series for the pool), never a
//! perfect 1 that would read as fairness on an idle pool. The service gap is the largest difference between the
//! virtual counters of two shares backlogged at the same moment, sampled through the window:
//! VTC keeps it within `2 · max(w_in · L_in, w_out · M)` (Sheng et al., OSDI 2024, Theorem
//! 4.3), with `L_in` the longest prompt and `M` the most tokens a batch holds.

use std::collections::HashMap;

/// Share of the window a share must have been backlogged to be measured.
const BACKLOGGED: f64 = 0.9;

/// A pool's fairness over the last complete window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// Jain's index over the backlogged shares; `None` with fewer than two.
    pub index: Option<f64>,
    /// Shares backlogged for nearly all the window.
    pub backlogged: usize,
    /// Largest virtual-counter difference between two shares backlogged at once.
    pub gap: f64,
    /// Every share seen in the window, with the fraction of it spent backlogged.
    pub backlogged_ratio: Vec<(String, f64)>,
}

#[derive(Default)]
struct Share {
    weight: f64,
    /// Weighted tokens served in the window.
    service: f64,
    backlogged_ms: u64,
}

/// One pool's window: service and backlog per share, folded into a [`Report`] as it closes.
pub struct Window {
    length_ms: u64,
    started_ms: u64,
    sampled_ms: u64,
    shares: HashMap<String, Share>,
    gap: f64,
}

impl Window {
    pub fn new(length_ms: u64, now_ms: u64) -> Self {
        Window {
            length_ms: length_ms.max(1),
            started_ms: now_ms,
            sampled_ms: now_ms,
            shares: HashMap::new(),
            gap: 0.0,
        }
    }

    /// `weighted_tokens` served to `share` (weight `weight` among its siblings).
    pub fn served(&mut self, share: &str, weight: f64, weighted_tokens: f64) {
        let s = self.share(share, weight);
        s.service += weighted_tokens;
    }

    fn share(&mut self, share: &str, weight: f64) -> &mut Share {
        let s = self.shares.entry(share.to_owned()).or_default();
        s.weight = weight;
        s
    }

    /// Records which shares have work queued now (name, weight, virtual counter), crediting
    /// each with the time since the last sample; returns the window's report when it closes.
    pub fn sample<'a>(
        &mut self,
        now_ms: u64,
        backlogged: impl IntoIterator<Item = (&'a str, f64, f64)>,
    ) -> Option<Report> {
        let elapsed = now_ms.saturating_sub(self.sampled_ms);
        self.sampled_ms = now_ms;
        let (mut low, mut high, mut n) = (f64::INFINITY, f64::NEG_INFINITY, 0);
        for (name, weight, counter) in backlogged {
            self.share(name, weight).backlogged_ms += elapsed;
            low = low.min(counter);
            high = high.max(counter);
            n += 1;
        }
        if n >= 2 {
            self.gap = self.gap.max(high - low);
        }
        (now_ms.saturating_sub(self.started_ms) >= self.length_ms).then(|| self.close(now_ms))
    }

    fn close(&mut self, now_ms: u64) -> Report {
        let length = now_ms.saturating_sub(self.started_ms).max(1) as f64;
        let mut ratio: Vec<(String, f64)> = self
            .shares
            .iter()
            .map(|(name, s)| (name.clone(), (s.backlogged_ms as f64 / length).min(1.0)))
            .collect();
        ratio.sort_by(|a, b| a.0.cmp(&b.0));
        let rates: Vec<f64> = self
            .shares
            .values()
            .filter_map(|s| {
                let part = s.backlogged_ms as f64 / length;
                (part >= BACKLOGGED && s.weight > 0.0).then(|| s.service / (s.weight * part))
            })
            .collect();
        let report = Report {
            index: (rates.len() >= 2).then(|| jain(&rates)),
            backlogged: rates.len(),
            gap: self.gap,
            backlogged_ratio: ratio,
        };
        self.started_ms = now_ms;
        self.shares.clear();
        self.gap = 0.0;
        report
    }
}

/// Jain's fairness index of `x`: 1 for fewer than two values or when nobody got anything
/// (everyone alike).
pub fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    if x.len() < 2 || squares <= 0.0 {
        return 1.0;
    }
    (sum * sum / (x.len() as f64 * squares)).clamp(0.0, 1.0)
}

/// VTC's bound on the service gap between two backlogged shares: `2 · max(w_in · L_in,
/// w_out · M)`.
pub fn gap_bound(w_in: f64, longest_prompt: u64, w_out: f64, batch_tokens: u64) -> f64 {
    2.0 * (w_in * longest_prompt as f64).max(w_out * batch_tokens as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_is_one_for_equal_service_and_one_over_n_for_one_taker() {
        assert_eq!(jain(&[3.0, 3.0, 3.0]), 1.0);
        assert!((jain(&[9.0, 0.0, 0.0]) - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(jain(&[5.0]), 1.0);
        assert_eq!(jain(&[]), 1.0);
        assert_eq!(jain(&[0.0, 0.0]), 1.0);
    }

    /// Samples every 100 ms for a second with `backlogged` queued throughout.
    fn run(w: &mut Window, start: u64, backlogged: &[(&str, f64, f64)]) -> Option<Report> {
        let mut last = None;
        for t in 1..=10 {
            last = w.sample(start + t * 100, backlogged.iter().copied());
        }
        last
    }

    #[test]
    fn backlogged_shares_served_alike_are_fair_and_a_starved_one_is_not() {
        let mut w = Window::new(1_000, 0);
        w.served("a", 1.0, 500.0);
        w.served("b", 1.0, 500.0);
        let r = run(&mut w, 0, &[("a", 1.0, 10.0), ("b", 1.0, 40.0)]).expect("closed");
        assert_eq!((r.index, r.backlogged, r.gap), (Some(1.0), 2, 30.0));

        w.served("a", 1.0, 950.0);
        w.served("b", 1.0, 50.0);
        let r = run(&mut w, 1_000, &[("a", 1.0, 0.0), ("b", 1.0, 0.0)]).expect("closed");
        assert!(r.index.is_some_and(|i| i < 0.6), "{r:?}");
        assert_eq!(r.gap, 0.0, "a new window starts from nothing");
    }

    #[test]
    fn service_is_weighed_and_compared_per_time_backlogged() {
        let mut w = Window::new(1_000, 0);
        // Weight 2 gets twice the tokens: the same weighted service.
        w.served("heavy", 2.0, 800.0);
        w.served("light", 1.0, 400.0);
        // A share that asked for little was never backlogged: not owed, not measured.
        w.served("quiet", 1.0, 10.0);
        let r = run(&mut w, 0, &[("heavy", 2.0, 0.0), ("light", 1.0, 0.0)]).expect("closed");
        assert_eq!((r.index, r.backlogged), (Some(1.0), 2));
        assert!(r.backlogged_ratio.contains(&("quiet".to_owned(), 0.0)));
        assert!(r.backlogged_ratio.contains(&("heavy".to_owned(), 1.0)));

        // Two floods backlogged throughout, served alike, and a small tenant whose requests
        // each wait a moment for a slot (queued 60% of the window) and got all it asked for:
        // not owed the floods' service, so not measured.
        let mut w = Window::new(1_000, 0);
        w.served("noisy", 1.0, 1_000.0);
        w.served("heavy", 1.0, 1_000.0);
        w.served("small", 1.0, 100.0);
        for t in 1..=10 {
            let queued = [
                ("noisy", 1.0, 0.0),
                ("heavy", 1.0, 0.0),
                ("small", 1.0, 0.0),
            ];
            let now = queued.iter().copied().filter(|q| t <= 6 || q.0 != "small");
            if let Some(r) = w.sample(t * 100, now) {
                assert_eq!((r.index, r.backlogged), (Some(1.0), 2), "{r:?}");
            }
        }

        // Backlogged for 95% of the window and served 95% as much: treated alike.
        let mut w = Window::new(2_000, 0);
        w.served("always", 1.0, 1_000.0);
        w.served("most", 1.0, 950.0);
        for t in 1..=20 {
            let queued = [("always", 1.0, 0.0), ("most", 1.0, 0.0)];
            let now = queued.iter().copied().filter(|q| t > 1 || q.0 == "always");
            if let Some(r) = w.sample(t * 100, now) {
                assert!(r.index.is_some_and(|i| (i - 1.0).abs() < 1e-9), "{r:?}");
                assert_eq!(r.backlogged, 2);
            }
        }
    }

    #[test]
    fn an_idle_pool_or_one_tenant_alone_has_no_index_not_a_perfect_one() {
        let mut w = Window::new(1_000, 0);
        let r = run(&mut w, 0, &[]).expect("closed");
        assert_eq!((r.index, r.backlogged), (None, 0));
        w.served("alone", 1.0, 500.0);
        let r = run(&mut w, 1_000, &[("alone", 1.0, 0.0)]).expect("closed");
        assert_eq!((r.index, r.backlogged), (None, 1));
    }

    #[test]
    fn the_bound_is_the_larger_of_a_prompt_and_a_batch() {
        assert_eq!(gap_bound(1.0, 8_000, 2.0, 1_000), 16_000.0);
        assert_eq!(gap_bound(1.0, 100, 2.0, 1_000), 4_000.0);
    }
}

//! Projected waits: how long a request would wait for dispatch, for the refusal rule and for
//! `Retry-After`.
//!
//! Under the fair policy a request's wait is where it sits in the fair order, not the pool's
//! queue length: a tenant with nothing queued is next in its own queue, lifted to the
//! smallest counter on arrival (no banked credit, but no debt either), and the headroom rule
//! ([`weir_core::scheduler::headroom`]) keeps a slot free for it while others flood, so its wait is about
//! one decision, whatever the others have queued. A tenant with work queued waits for its own
//! backlog: the requests it has ahead of the new one, at the pace its own requests are
//! dispatched (measured over seconds throughout which it had work queued, so it is the pace
//! its share of the pool allows), or, before that is known, at its fair part of the pool's
//! pace. So a flood's projected wait grows with the flood's own queue, and the refusals it
//! brings fall on the flood. The FIFO baseline keeps the pool-wide projection (its queue is one
//! line for everyone).

use std::collections::HashMap;

/// A pace in dispatches per second, smoothed over one-second windows. Only a window throughout
/// which work was queued measures capacity; one in which the queue ran dry measures demand,
/// which says only that capacity is at least that (a pool that served 3 requests a second while
/// 3 came must not turn a burst away as if it could serve no more).
#[derive(Clone, Debug)]
pub struct DispatchRate {
    pub per_s: f64,
    /// Whether `per_s` came from a window throughout which work was queued.
    pub measured: bool,
    /// Dispatched since the window began.
    pub dispatched: u64,
    window_start_ms: u64,
    /// Work was queued at every tick of the window so far.
    backlogged: bool,
}

impl DispatchRate {
    pub fn new(now_ms: u64) -> Self {
        DispatchRate {
            per_s: 0.0,
            measured: false,
            dispatched: 0,
            window_start_ms: now_ms,
            backlogged: true,
        }
    }

    /// Called every tick with what is `queued`. While nothing is queued or dispatched the
    /// window keeps starting afresh, so the first window of a burst is not diluted by the
    /// idle time before it; once a second has passed the window closes.
    pub fn measure(&mut self, now_ms: u64, queued: usize) {
        if self.dispatched == 0 && queued == 0 {
            self.window_start_ms = now_ms;
            self.backlogged = true;
            return;
        }
        self.backlogged &= queued > 0;
        let elapsed = now_ms.saturating_sub(self.window_start_ms);
        if elapsed < 1_000 {
            return;
        }
        let current = self.dispatched as f64 * 1_000.0 / elapsed as f64;
        if self.per_s == 0.0 {
            self.per_s = current;
        } else if self.backlogged || current > self.per_s {
            self.per_s = 0.7 * self.per_s + 0.3 * current;
        }
        self.measured |= self.backlogged;
        self.dispatched = 0;
        self.window_start_ms = now_ms;
        self.backlogged = true;
    }
}

/// A pool's pace and each of its tenants' (keys'), while they are active.
#[derive(Clone, Debug)]
pub struct Paces {
    pub pool: DispatchRate,
    tenants: HashMap<String, Pace>,
}

#[derive(Clone, Debug)]
struct Pace {
    rate: DispatchRate,
    last_ms: u64,
}

impl Paces {
    pub fn new(now_ms: u64) -> Self {
        Paces {
            pool: DispatchRate::new(now_ms),
            tenants: HashMap::new(),
        }
    }

    /// A request of `tenant` arrived or was dispatched: it is followed from now.
    pub fn touch(&mut self, tenant: &str, now_ms: u64) {
        match self.tenants.get_mut(tenant) {
            Some(p) => p.last_ms = now_ms,
            None => {
                self.tenants.insert(
                    tenant.to_owned(),
                    Pace {
                        rate: DispatchRate::new(now_ms),
                        last_ms: now_ms,
                    },
                );
            }
        }
    }

    pub fn dispatched(&mut self, tenant: &str, now_ms: u64) {
        self.pool.dispatched += 1;
        self.touch(tenant, now_ms);
        if let Some(p) = self.tenants.get_mut(tenant) {
            p.rate.dispatched += 1;
        }
    }

    /// Every tick: the pool's and each tenant's window, given what each has `queued`; a
    /// tenant with nothing queued and no request for `forget_ms` is forgotten.
    pub fn measure(
        &mut self,
        now_ms: u64,
        queued: usize,
        depth: impl Fn(&str) -> usize,
        forget_ms: u64,
    ) {
        self.pool.measure(now_ms, queued);
        self.tenants.retain(|t, p| {
            let queued = depth(t);
            p.rate.measure(now_ms, queued);
            queued > 0 || now_ms.saturating_sub(p.last_ms) < forget_ms
        });
    }

    /// The pool's whole queue at its pace (the FIFO projection), once a pace is known.
    pub fn pool_wait_ms(&self, queued: usize) -> Option<f64> {
        (self.pool.per_s > 0.0).then(|| queued as f64 / self.pool.per_s * 1_000.0)
    }

    /// How long a new request of `tenant` waits behind the `ahead` requests it has queued
    /// itself: at its own measured pace, else at `fair_part` (0–1) of the pool's. Nothing
    /// ahead: no wait to project (it is next in its own queue). `None` before any pace is
    /// known.
    pub fn tenant_wait_ms(&self, tenant: &str, ahead: usize, fair_part: f64) -> Option<f64> {
        if ahead == 0 {
            return Some(0.0);
        }
        let own = self
            .tenants
            .get(tenant)
            .filter(|p| p.rate.measured && p.rate.per_s > 0.0)
            .map(|p| p.rate.per_s);
        let rate = own.unwrap_or(self.pool.per_s * fair_part.clamp(0.0, 1.0));
        (rate > 0.0).then(|| ahead as f64 / rate * 1_000.0)
    }

    /// Tenants followed (for tests of the bound).
    #[cfg(test)]
    pub fn followed(&self) -> usize {
        self.tenants.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_with_nothing_queued_has_no_wait_whatever_the_pool_has() {
        let mut p = Paces::new(0);
        p.pool.per_s = 0.01;
        assert_eq!(p.tenant_wait_ms("quiet", 0, 0.001), Some(0.0));
    }

    #[test]
    fn a_backlog_waits_at_its_own_measured_pace_else_at_its_fair_part() {
        let mut p = Paces::new(0);
        p.pool.per_s = 10.0;
        p.touch("flood", 0);
        // Not measured yet: a third of the pool's 10 a second.
        assert_eq!(
            p.tenant_wait_ms("flood", 10, 1.0 / 3.0).map(f64::round),
            Some(3_000.0)
        );
        // Two seconds with work queued throughout, one dispatch a second.
        for ms in (0..=2_000).step_by(25) {
            if ms % 1_000 == 500 {
                p.dispatched("flood", ms);
            }
            p.measure(ms, 5, |_| 5, 10_000);
        }
        assert_eq!(
            p.tenant_wait_ms("flood", 10, 1.0 / 3.0).map(f64::round),
            Some(10_000.0)
        );
    }

    #[test]
    fn tenants_are_forgotten_once_idle() {
        let mut p = Paces::new(0);
        p.touch("a", 0);
        p.measure(5_000, 0, |_| 0, 10_000);
        assert_eq!(p.followed(), 1);
        p.measure(10_000, 0, |_| 0, 10_000);
        assert_eq!(p.followed(), 0);
    }

    #[test]
    fn the_dispatch_rate_measures_capacity_not_demand() {
        let mut r = DispatchRate::new(0);
        // Idle for 900 ms, then a burst: the window starts with the burst, not before it.
        for t in (0..900).step_by(25) {
            r.measure(t, 0);
        }
        for t in (900..1_950).step_by(25) {
            r.dispatched += 1;
            r.measure(t, 60);
        }
        assert!(
            r.per_s > 30.0,
            "a burst's first window reads its pace: {}",
            r.per_s
        );
        // A quiet stretch with the queue running dry (3 a second, as they come) never lowers it.
        let before = r.per_s;
        for t in (2_000..5_000).step_by(25) {
            if t % 325 == 0 {
                r.dispatched += 1;
            }
            r.measure(t, 0);
        }
        assert_eq!(r.per_s, before, "demand is not capacity");
        // A backlogged window that serves less does lower it.
        for t in (5_000..7_200).step_by(25) {
            if t % 100 == 0 {
                r.dispatched += 1;
            }
            r.measure(t, 60);
        }
        assert!(r.per_s < before, "{} < {before}", r.per_s);
    }
}

//! Where a request's time in the filter goes, for `cargo xtask bench`; compiled only with the
//! `profile` feature (its own build, `target/wasm32-wasip1/stage-profile/weir_filter.wasm`,
//! never a shipped one).
//!
//! Each callback is a stage (and admission, the body's parse and estimate, a stage within the
//! request body's): its wall-clock time inside weir code and the host calls it made, counted
//! where [`crate::host`] makes them. Stages are summed per VM into counters
//! `weir.profile.<stage>.{ns,calls,runs}` at the end of each request, after its last stage
//! ended, so reporting costs no stage any time.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::time::Instant;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

thread_local! {
    static HOST_CALLS: Cell<u64> = const { Cell::new(0) };
    /// Stages ended since the last report: name, nanoseconds, host calls.
    static ENDED: RefCell<Vec<(&'static str, u64, u64)>> = const { RefCell::new(Vec::new()) };
    static METRICS: RefCell<HashMap<&'static str, [Option<u32>; 3]>> = RefCell::new(HashMap::new());
}

/// Counts one host call.
pub fn host_call() {
    HOST_CALLS.with(|c| c.set(c.get() + 1));
}

/// A stage under way; it ends when dropped.
pub struct Stage {
    name: &'static str,
    started: Instant,
    calls_before: u64,
}

pub fn stage(name: &'static str) -> Stage {
    Stage {
        name,
        started: Instant::now(),
        calls_before: HOST_CALLS.with(Cell::get),
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let ns = self.started.elapsed().as_nanos() as u64;
        let calls = HOST_CALLS.with(Cell::get) - self.calls_before;
        ENDED.with(|e| e.borrow_mut().push((self.name, ns, calls)));
    }
}

/// Adds the stages ended since the last report to their counters.
pub fn report() {
    let ended = ENDED.with(|e| std::mem::take(&mut *e.borrow_mut()));
    METRICS.with(|m| {
        let mut metrics = m.borrow_mut();
        for (name, ns, calls) in ended {
            let ids = metrics.entry(name).or_insert_with(|| {
                ["ns", "calls", "runs"].map(|what| {
                    let metric = format!("weir.profile.{name}.{what}");
                    hostcalls::define_metric(MetricType::Counter, &metric).ok()
                })
            });
            for (id, delta) in ids.iter().zip([ns, calls, 1]) {
                if let Some(id) = id {
                    let _ = hostcalls::increment_metric(*id, delta as i64);
                }
            }
        }
    });
}

//! The sidecar's Prometheus metrics: per tenant (queue, fairness, KV, latency, tokens) and per
//! replica. Labels carry tenant paths, replica URLs and fixed names only, never content.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::isolation::Isolation;
use crate::ledger::LedgerGauges;

type Labels = Vec<(&'static str, String)>;

fn latency_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

#[derive(Clone)]
pub struct Metrics {
    pub queue_depth: Family<Labels, Gauge>,
    pub queue_wait: Family<Labels, Histogram, fn() -> Histogram>,
    pub vtc_counter: Family<Labels, Gauge<f64, AtomicU64>>,
    pub projected_wait: Family<Labels, Gauge<f64, AtomicU64>>,
    pub active_kv_tokens: Family<Labels, Gauge>,
    pub ttft: Family<Labels, Histogram, fn() -> Histogram>,
    pub itl: Family<Labels, Histogram, fn() -> Histogram>,
    pub tokens: Family<Labels, Counter>,
    pub goodput_tokens: Family<Labels, Counter>,
    pub rejections: Family<Labels, Counter>,
    pub preemptions: Family<Labels, Counter>,
    pub replica_kv_usage: Family<Labels, Gauge<f64, AtomicU64>>,
    pub replica_running: Family<Labels, Gauge>,
    pub replica_waiting: Family<Labels, Gauge>,
    pub replica_healthy: Family<Labels, Gauge>,
    pub replica_reserved_kv: Family<Labels, Gauge>,
    pub replica_in_flight: Family<Labels, Gauge>,
    pub replica_limit: Family<Labels, Gauge>,
    pub replica_adaptive_limit: Family<Labels, Gauge<f64, AtomicU64>>,
    pub replica_engine_limit: Family<Labels, Gauge>,
    pub replica_ttfb_floor: Family<Labels, Gauge<f64, AtomicU64>>,
    pub replica_first_byte_timeouts: Family<Labels, Counter>,
    pub replica_cache_isolation: Family<Labels, Gauge>,
    pub output_prediction_ratio: Family<Labels, Histogram, fn() -> Histogram>,
    pub ledger: LedgerGauges,
}

/// Actual output over the output held for it: 1 is exact, above 1 the hold had to grow.
fn prediction_ratio_histogram() -> Histogram {
    Histogram::new([0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0, 8.0])
}

pub fn tenant(t: &str) -> Labels {
    vec![("tenant", t.to_owned())]
}

impl Metrics {
    pub fn new() -> (Metrics, Registry) {
        let m = Metrics {
            queue_depth: Family::default(),
            queue_wait: Family::new_with_constructor(latency_histogram),
            vtc_counter: Family::default(),
            projected_wait: Family::default(),
            active_kv_tokens: Family::default(),
            ttft: Family::new_with_constructor(latency_histogram),
            itl: Family::new_with_constructor(latency_histogram),
            tokens: Family::default(),
            goodput_tokens: Family::default(),
            rejections: Family::default(),
            preemptions: Family::default(),
            replica_kv_usage: Family::default(),
            replica_running: Family::default(),
            replica_waiting: Family::default(),
            replica_healthy: Family::default(),
            replica_reserved_kv: Family::default(),
            replica_in_flight: Family::default(),
            replica_limit: Family::default(),
            replica_adaptive_limit: Family::default(),
            replica_engine_limit: Family::default(),
            replica_ttfb_floor: Family::default(),
            replica_first_byte_timeouts: Family::default(),
            replica_cache_isolation: Family::default(),
            output_prediction_ratio: Family::new_with_constructor(prediction_ratio_histogram),
            ledger: LedgerGauges::default(),
        };
        let mut r = Registry::with_prefix("weir");
        r.register(
            "queue_depth",
            "Requests waiting per tenant",
            m.queue_depth.clone(),
        );
        r.register(
            "queue_wait_seconds",
            "Time from arrival to dispatch",
            m.queue_wait.clone(),
        );
        r.register(
            "vtc_counter",
            "Virtual token counter per tenant and pool (fairness debt)",
            m.vtc_counter.clone(),
        );
        r.register(
            "projected_wait_seconds",
            "How long a pool's queue takes to dispatch at the current rate (what Retry-After is drawn from)",
            m.projected_wait.clone(),
        );
        r.register(
            "active_kv_tokens",
            "KV tokens reserved by a tenant's running requests",
            m.active_kv_tokens.clone(),
        );
        r.register(
            "ttft_seconds",
            "Time to first token, arrival to first chunk",
            m.ttft.clone(),
        );
        r.register("itl_seconds", "Time between streamed chunks", m.itl.clone());
        r.register(
            "tokens",
            "Tokens served per tenant and direction",
            m.tokens.clone(),
        );
        r.register(
            "goodput_tokens",
            "Tokens of requests completed within their deadline, per tier",
            m.goodput_tokens.clone(),
        );
        r.register(
            "rejections",
            "Requests turned away, by reason",
            m.rejections.clone(),
        );
        r.register(
            "preemptions",
            "Batch streams preempted for waiting interactive work, per pool and tier",
            m.preemptions.clone(),
        );
        r.register(
            "replica_kv_usage",
            "Engine-reported KV usage (0-1)",
            m.replica_kv_usage.clone(),
        );
        r.register(
            "output_prediction_ratio",
            "Completed answers' output over the output predicted for them, per pool (its model)",
            m.output_prediction_ratio.clone(),
        );
        r.register(
            "replica_running",
            "Engine-reported running requests",
            m.replica_running.clone(),
        );
        r.register(
            "replica_waiting",
            "Engine-reported waiting requests",
            m.replica_waiting.clone(),
        );
        r.register(
            "replica_healthy",
            "1 while the replica answers its probes",
            m.replica_healthy.clone(),
        );
        r.register(
            "replica_reserved_kv_tokens",
            "KV tokens weir holds on the replica for requests it dispatched there",
            m.replica_reserved_kv.clone(),
        );
        r.register(
            "replica_in_flight",
            "Requests weir dispatched to the replica and not finished",
            m.replica_in_flight.clone(),
        );
        r.register(
            "replica_concurrency_limit",
            "Requests weir may run on the replica at once: the engine's (or configured) limit, lowered while the engine is slow to start requests",
            m.replica_limit.clone(),
        );
        r.register(
            "replica_adaptive_limit",
            "The adaptive concurrency limit before rounding down",
            m.replica_adaptive_limit.clone(),
        );
        r.register(
            "replica_engine_concurrency_limit",
            "Requests the engine says it runs at once (llama.cpp slots, SGLang max_running_requests)",
            m.replica_engine_limit.clone(),
        );
        r.register(
            "replica_ttfb_floor_seconds",
            "Least time from dispatch to a stream's first bytes seen on the replica",
            m.replica_ttfb_floor.clone(),
        );
        r.register(
            "replica_first_byte_timeouts",
            "Requests the engine did not start within relay.first_byte_ms",
            m.replica_first_byte_timeouts.clone(),
        );
        r.register(
            "replica_cache_isolation",
            "1 for the replica's prefix-cache isolation mode (unprobed, salt, cache_off, none, shared), 0 for the others",
            m.replica_cache_isolation.clone(),
        );
        r.register(
            "ledger_pending_records",
            "Usage records handed to the ledger writer and not yet written (how far billing lags)",
            m.ledger.pending.clone(),
        );
        r.register(
            "ledger_write_failures",
            "Usage records the ledger could not write",
            m.ledger.failures.clone(),
        );
        (m, r)
    }

    /// Sets a replica's isolation mode: one series per mode, so the labels stay bounded.
    pub fn cache_isolation(&self, replica: &str, mode: Isolation) {
        for label in Isolation::MODES {
            self.replica_cache_isolation
                .get_or_create(&vec![
                    ("replica", replica.to_owned()),
                    ("mode", label.to_owned()),
                ])
                .set(i64::from(label == mode.label()));
        }
    }

    /// Removes every series of a replica that left its pool, so `/metrics` shows the current
    /// set.
    pub fn forget_replica(&self, replica: &str) {
        let labels = vec![("replica", replica.to_owned())];
        self.replica_kv_usage.remove(&labels);
        self.replica_running.remove(&labels);
        self.replica_waiting.remove(&labels);
        self.replica_healthy.remove(&labels);
        self.replica_reserved_kv.remove(&labels);
        self.replica_in_flight.remove(&labels);
        self.replica_limit.remove(&labels);
        self.replica_adaptive_limit.remove(&labels);
        self.replica_engine_limit.remove(&labels);
        self.replica_ttfb_floor.remove(&labels);
        self.replica_first_byte_timeouts.remove(&labels);
        for label in Isolation::MODES {
            self.replica_cache_isolation.remove(&vec![
                ("replica", replica.to_owned()),
                ("mode", label.to_owned()),
            ]);
        }
    }

    pub fn reject(&self, reason: &'static str) {
        self.rejections
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::Gap;

    #[test]
    fn a_replicas_isolation_mode_is_one_series_per_mode() {
        let (m, registry) = Metrics::new();
        m.cache_isolation("http://r", Isolation::Salt);
        m.cache_isolation("http://r", Isolation::Unisolated(Gap::SaltIgnored));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("weir_replica_cache_isolation{"))
            .collect();
        assert_eq!(series.len(), Isolation::MODES.len(), "{series:?}");
        let on: Vec<&&str> = series.iter().filter(|l| l.ends_with(" 1")).collect();
        assert_eq!(on.len(), 1);
        assert!(on[0].contains("mode=\"none\""), "{on:?}");

        m.replica_healthy
            .get_or_create(&vec![("replica", "http://r".to_owned())])
            .set(1);
        m.forget_replica("http://r");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            !text.contains("http://r"),
            "a replica that left has no series"
        );
    }
}

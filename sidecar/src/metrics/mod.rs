//! The sidecar's metrics: per tenant (queue, fairness, KV, latency, tokens, spend), per pool
//! (fairness, goodput, waits) and per replica, plus the OpenTelemetry GenAI conventions'
//! instruments. Served on `/metrics` and, when configured, pushed over OTLP ([`otlp`]).
//! Labels carry tenant paths cut to the configured depth ([`TenantDepth`]), replica URLs and
//! fixed names only: never a key, never content.

pub mod approvals;
pub mod gen_ai;
pub mod instrument;
pub mod otlp;
mod tenant;

use std::sync::Arc;

use opentelemetry::metrics::Meter;
use prometheus_client::registry::Registry;

pub use instrument::{Counter, Gauge, Histogram, HistogramSeries, IntGauge, Labels};

use crate::config::metrics::{MetricsConfig, TenantDepth};
use crate::isolation::Isolation;
use crate::ledger::LedgerGauges;
use crate::quota::QuotaMetrics;
use approvals::ApprovalMetrics;
use instrument::{HistogramUnit, Maker};

pub mod buckets {
    /// Latencies in seconds (queue wait, TTFT, ITL).
    pub const LATENCY: [f64; 13] = [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    /// Actual output over the output held for it: 1 is exact, above 1 the hold had to grow.
    pub const PREDICTION_RATIO: [f64; 10] = [0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0, 8.0];
    /// The estimate over the engine's count: 1 is exact.
    pub const ESTIMATE_RATIO: [f64; 11] =
        [0.5, 0.75, 0.9, 0.95, 0.99, 1.0, 1.01, 1.05, 1.1, 1.25, 1.5];
}

#[derive(Clone)]
pub struct Metrics {
    pub depth: TenantDepth,
    pub fairness_window_ms: u64,
    pub queue_depth: IntGauge,
    pub queue_wait: Histogram,
    pub vtc_counter: Gauge,
    pub backlogged_ratio: Gauge,
    pub fairness_index: Gauge,
    pub fairness_backlogged: IntGauge,
    pub fairness_gap: Gauge,
    pub fairness_gap_bound: Gauge,
    pub projected_wait: Gauge,
    pub active_kv_tokens: IntGauge,
    pub replica_tenant_kv: IntGauge,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub tokens: Counter,
    pub goodput_tokens: Counter,
    pub spend: Counter,
    pub rejections: Counter,
    pub preemptions: Counter,
    pub estimate_error: Histogram,
    pub replica_kv_usage: Gauge,
    pub replica_running: IntGauge,
    pub replica_waiting: IntGauge,
    pub replica_healthy: IntGauge,
    pub replica_reserved_kv: IntGauge,
    pub replica_in_flight: IntGauge,
    pub replica_limit: IntGauge,
    pub replica_adaptive_limit: Gauge,
    pub replica_engine_limit: IntGauge,
    pub replica_ttfb_floor: Gauge,
    pub replica_first_byte_timeouts: Counter,
    pub replica_cache_isolation: IntGauge,
    pub output_prediction_ratio: Histogram,
    pub approvals: ApprovalMetrics,
    pub gen_ai: GenAi,
    pub ledger: LedgerGauges,
    pub quota: QuotaMetrics,
    /// The Prometheus family names of the instruments above (the ledger's and the quota
    /// service's aside), for checking what alerts and dashboards name.
    pub families: Arc<Vec<String>>,
}

/// The GenAI conventions' instruments ([`gen_ai`]).
#[derive(Clone)]
pub struct GenAi {
    pub token_usage: Histogram,
    pub request_duration: Histogram,
    pub time_to_first_token: Histogram,
    pub time_per_output_token: Histogram,
}

impl GenAi {
    fn register(m: &mut Maker) -> GenAi {
        GenAi {
            token_usage: m.histogram(
                "gen_ai.client.token.usage",
                "Number of input and output tokens used, per request",
                HistogramUnit::Annotation("{token}"),
                &gen_ai::TOKEN_USAGE,
            ),
            request_duration: m.histogram(
                "gen_ai.server.request.duration",
                "Generative AI server request duration, arrival to the last byte",
                HistogramUnit::Seconds,
                &gen_ai::DURATION,
            ),
            time_to_first_token: m.histogram(
                "gen_ai.server.time_to_first_token",
                "Time to generate first token for successful responses",
                HistogramUnit::Seconds,
                &gen_ai::TIME_TO_FIRST_TOKEN,
            ),
            time_per_output_token: m.histogram(
                "gen_ai.server.time_per_output_token",
                "Time per output token generated after the first token for successful responses",
                HistogramUnit::Seconds,
                &gen_ai::TIME_PER_OUTPUT_TOKEN,
            ),
        }
    }
}

/// A latency histogram, in seconds (queue wait, TTFT, ITL).
fn latency(m: &mut Maker, name: &str, help: &str) -> Histogram {
    m.histogram(name, help, HistogramUnit::Seconds, &buckets::LATENCY)
}

/// The families under `weir_`, by group, in the order they are registered.
struct Weir {
    queues: Queues,
    service: Service,
    replicas: Replicas,
    output_prediction_ratio: Histogram,
    approvals: ApprovalMetrics,
}

impl Weir {
    fn register(m: &mut Maker) -> Weir {
        Weir {
            queues: Queues::register(m),
            service: Service::register(m),
            replicas: Replicas::register(m),
            output_prediction_ratio: m.histogram(
                "output_prediction_ratio",
                "Completed answers' output over the output predicted for them, per pool (its model)",
                HistogramUnit::Annotation("1"),
                &buckets::PREDICTION_RATIO,
            ),
            approvals: ApprovalMetrics::register(m),
        }
    }
}

/// Queues and fairness: what waits per tenant, the scheduler's counters, how fair the last
/// window was per pool, and how long its queue takes.
struct Queues {
    queue_depth: IntGauge,
    queue_wait: Histogram,
    vtc_counter: Gauge,
    backlogged_ratio: Gauge,
    fairness_index: Gauge,
    fairness_backlogged: IntGauge,
    fairness_gap: Gauge,
    fairness_gap_bound: Gauge,
    projected_wait: Gauge,
}

impl Queues {
    fn register(m: &mut Maker) -> Queues {
        Queues {
            queue_depth: m.int_gauge("queue_depth", "Requests waiting per tenant"),
            queue_wait: latency(m, "queue_wait", "Time from arrival to dispatch"),
            vtc_counter: m.gauge(
                "vtc_counter",
                "Virtual token counter per tenant and pool (fairness debt)",
            ),
            backlogged_ratio: m.gauge(
                "backlogged_ratio",
                "Fraction of the last fairness window a tenant had work waiting, per pool",
            ),
            fairness_index: m.gauge(
                "fairness_index",
                "Jain's index over the weighted service of the tenants backlogged in the last window (1: equal)",
            ),
            fairness_backlogged: m.int_gauge(
                "fairness_backlogged_tenants",
                "Tenants backlogged for nearly all (90%) of the last fairness window",
            ),
            fairness_gap: m.gauge(
                "fairness_service_gap",
                "Largest virtual-counter gap between two tenants backlogged at once in the last window",
            ),
            fairness_gap_bound: m.gauge(
                "fairness_gap_bound",
                "VTC's bound on that gap: 2 max(w_in L_in, w_out M)",
            ),
            projected_wait: m.gauge(
                "projected_wait_seconds",
                "How long a pool's queue takes to dispatch at the current rate (what Retry-After is drawn from)",
            ),
        }
    }
}

/// What tenants are served: KV held, latencies, tokens, spend, refusals, preemptions and the
/// prompt estimate's error.
struct Service {
    active_kv_tokens: IntGauge,
    replica_tenant_kv: IntGauge,
    ttft: Histogram,
    itl: Histogram,
    tokens: Counter,
    goodput_tokens: Counter,
    spend: Counter,
    rejections: Counter,
    preemptions: Counter,
    estimate_error: Histogram,
}

impl Service {
    fn register(m: &mut Maker) -> Service {
        Service {
            active_kv_tokens: m.int_gauge(
                "active_kv_tokens",
                "KV tokens reserved by a tenant's running requests",
            ),
            replica_tenant_kv: m.int_gauge(
                "replica_tenant_kv_tokens",
                "KV tokens a tenant's running requests hold on a replica",
            ),
            ttft: latency(m, "ttft", "Time to first token, arrival to first chunk"),
            itl: latency(m, "itl", "Time between streamed chunks"),
            tokens: m.counter("tokens", "Tokens served per tenant and direction"),
            goodput_tokens: m.counter(
                "goodput_tokens",
                "Tokens of requests completed within their deadline, per pool and tier",
            ),
            spend: m.counter(
                "spend_micros",
                "What requests cost at the price table in force, in millionths of its currency",
            ),
            rejections: m.counter(
                "rejections",
                "Requests turned away, by reason, tenant and status",
            ),
            preemptions: m.counter(
                "preemptions",
                "Batch streams preempted for waiting interactive work, per pool and tier",
            ),
            estimate_error: m.histogram(
                "estimate_error_ratio",
                "The prompt estimate over the engine's count, per API (1: exact)",
                HistogramUnit::Annotation("1"),
                &buckets::ESTIMATE_RATIO,
            ),
        }
    }
}

/// Per replica: what the engine reports, what weir holds on it, its limits and isolation mode.
struct Replicas {
    replica_kv_usage: Gauge,
    replica_running: IntGauge,
    replica_waiting: IntGauge,
    replica_healthy: IntGauge,
    replica_reserved_kv: IntGauge,
    replica_in_flight: IntGauge,
    replica_limit: IntGauge,
    replica_adaptive_limit: Gauge,
    replica_engine_limit: IntGauge,
    replica_ttfb_floor: Gauge,
    replica_first_byte_timeouts: Counter,
    replica_cache_isolation: IntGauge,
}

impl Replicas {
    fn register(m: &mut Maker) -> Replicas {
        Replicas {
            replica_kv_usage: m.gauge("replica_kv_usage", "Engine-reported KV usage (0-1)"),
            replica_running: m.int_gauge("replica_running", "Engine-reported running requests"),
            replica_waiting: m.int_gauge("replica_waiting", "Engine-reported waiting requests"),
            replica_healthy: m.int_gauge(
                "replica_healthy",
                "1 while the replica answers its probes",
            ),
            replica_reserved_kv: m.int_gauge(
                "replica_reserved_kv_tokens",
                "KV tokens weir holds on the replica for requests it dispatched there",
            ),
            replica_in_flight: m.int_gauge(
                "replica_in_flight",
                "Requests weir dispatched to the replica and not finished",
            ),
            replica_limit: m.int_gauge(
                "replica_concurrency_limit",
                "Requests weir may run on the replica at once: the engine's (or configured) limit, lowered while the engine holds a queue (or, for an engine that reports none, as its time to first byte and goodput say)",
            ),
            replica_adaptive_limit: m.gauge(
                "replica_adaptive_limit",
                "The adaptive concurrency limit before rounding down",
            ),
            replica_engine_limit: m.int_gauge(
                "replica_engine_concurrency_limit",
                "Requests the engine says it runs at once (llama.cpp slots, SGLang max_running_requests)",
            ),
            replica_ttfb_floor: m.gauge(
                "replica_ttfb_floor_seconds",
                "Least time from dispatch to a stream's first bytes seen on the replica",
            ),
            replica_first_byte_timeouts: m.counter(
                "replica_first_byte_timeouts",
                "Requests the engine did not start within relay.first_byte_ms",
            ),
            replica_cache_isolation: m.int_gauge(
                "replica_cache_isolation",
                "1 for the replica's prefix-cache isolation mode (unprobed, salt, cache_off, none, shared), 0 for the others",
            ),
        }
    }
}

impl Metrics {
    /// The metrics and the registry `/metrics` serves; each also recorded into `meter`'s
    /// instruments when OTLP export is on. Families are registered group by group, in the
    /// order `/metrics` lists them.
    pub fn new(config: &MetricsConfig, meter: Option<&Meter>) -> (Metrics, Registry) {
        let mut root = Registry::default();
        let (gen_ai, mut families) = {
            let mut m = Maker {
                registry: &mut root,
                meter,
                prefix: "",
                families: Vec::new(),
            };
            (GenAi::register(&mut m), m.families)
        };
        let ledger = LedgerGauges::default();
        let quota = QuotaMetrics::default();
        let weir = root.sub_registry_with_prefix("weir");
        ledger.register(weir);
        quota.register(weir);
        let mut m = Maker {
            registry: weir,
            meter,
            prefix: "weir.",
            families: Vec::new(),
        };
        let weir = Weir::register(&mut m);
        families.extend(m.families);
        let metrics = Metrics::assemble(config, weir, gen_ai, (ledger, quota), families);
        (metrics, root)
    }

    /// The metrics from their groups, in the struct's order.
    fn assemble(
        config: &MetricsConfig,
        weir: Weir,
        gen_ai: GenAi,
        (ledger, quota): (LedgerGauges, QuotaMetrics),
        families: Vec<String>,
    ) -> Metrics {
        let Weir {
            queues,
            service,
            replicas,
            output_prediction_ratio,
            approvals,
        } = weir;
        Metrics {
            depth: config.tenant_depth,
            fairness_window_ms: config.fairness_window_ms,
            queue_depth: queues.queue_depth,
            queue_wait: queues.queue_wait,
            vtc_counter: queues.vtc_counter,
            backlogged_ratio: queues.backlogged_ratio,
            fairness_index: queues.fairness_index,
            fairness_backlogged: queues.fairness_backlogged,
            fairness_gap: queues.fairness_gap,
            fairness_gap_bound: queues.fairness_gap_bound,
            projected_wait: queues.projected_wait,
            active_kv_tokens: service.active_kv_tokens,
            replica_tenant_kv: service.replica_tenant_kv,
            ttft: service.ttft,
            itl: service.itl,
            tokens: service.tokens,
            goodput_tokens: service.goodput_tokens,
            spend: service.spend,
            rejections: service.rejections,
            preemptions: service.preemptions,
            estimate_error: service.estimate_error,
            replica_kv_usage: replicas.replica_kv_usage,
            replica_running: replicas.replica_running,
            replica_waiting: replicas.replica_waiting,
            replica_healthy: replicas.replica_healthy,
            replica_reserved_kv: replicas.replica_reserved_kv,
            replica_in_flight: replicas.replica_in_flight,
            replica_limit: replicas.replica_limit,
            replica_adaptive_limit: replicas.replica_adaptive_limit,
            replica_engine_limit: replicas.replica_engine_limit,
            replica_ttfb_floor: replicas.replica_ttfb_floor,
            replica_first_byte_timeouts: replicas.replica_first_byte_timeouts,
            replica_cache_isolation: replicas.replica_cache_isolation,
            output_prediction_ratio,
            approvals,
            gen_ai,
            ledger,
            quota,
            families: Arc::new(families),
        }
    }

    /// The label a tenant's series carry: its path at the configured depth.
    pub fn tenant<'t>(&self, tenant: &'t str) -> &'t str {
        self.depth.label(tenant)
    }

    /// Sets a replica's isolation mode: one series per mode, so the labels stay bounded.
    pub fn cache_isolation(&self, replica: &str, mode: Isolation) {
        for label in Isolation::MODES {
            self.replica_cache_isolation.set(
                &[("replica", replica), ("mode", label)],
                i64::from(label == mode.label()),
            );
        }
    }

    /// Removes every series of a replica that left its pool, so `/metrics` shows the current
    /// set.
    pub fn forget_replica(&self, replica: &str) {
        let labels: Labels = &[("replica", replica)];
        self.replica_kv_usage.remove(labels);
        self.replica_running.remove(labels);
        self.replica_waiting.remove(labels);
        self.replica_healthy.remove(labels);
        self.replica_reserved_kv.remove(labels);
        self.replica_in_flight.remove(labels);
        self.replica_limit.remove(labels);
        self.replica_adaptive_limit.remove(labels);
        self.replica_engine_limit.remove(labels);
        self.replica_ttfb_floor.remove(labels);
        self.replica_first_byte_timeouts.remove(labels);
        for label in Isolation::MODES {
            self.replica_cache_isolation
                .remove(&[("replica", replica), ("mode", label)]);
        }
    }

    /// A request turned away: `tenant` is its full path (cut here), empty where nobody was
    /// established (an unsigned request).
    pub fn reject(&self, reason: &str, tenant: &str, status: u16) {
        let status = status.to_string();
        self.rejections.inc(&[
            ("reason", reason),
            ("tenant", self.tenant(tenant)),
            ("status", &status),
        ]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::Gap;

    #[test]
    fn a_replicas_isolation_mode_is_one_series_per_mode() {
        let (m, registry) = Metrics::new(&MetricsConfig::default(), None);
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

        m.replica_healthy.set(&[("replica", "http://r")], 1);
        m.forget_replica("http://r");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            !text.contains("http://r"),
            "a replica that left has no series"
        );
    }
}

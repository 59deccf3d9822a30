//! What the engine measures, in engine-neutral terms. The driver records; each dialect
//! ([`crate::dialect`]) exposes the measurements under its engine's metric names.
//! Latencies are in model seconds (wall seconds × `--time-scale`).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::engine::Finished;

const ITERATION_BUCKETS: [f64; 12] = [
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

/// Histogram buckets of the latencies, which each engine chooses differently.
pub struct LatencyBuckets {
    pub ttft: &'static [f64],
    pub itl: &'static [f64],
    pub e2e: &'static [f64],
    pub queue: &'static [f64],
}

/// Every measurement of the engine. Clones share the same underlying series.
#[derive(Clone)]
pub struct EngineMetrics {
    // The engine's state, refreshed after every step and command.
    pub running: Gauge,
    pub waiting: Gauge,
    /// Fraction of KV blocks held by live sequences.
    pub kv_usage: Gauge<f64, AtomicU64>,

    // Per step.
    pub steps: Counter,
    /// Sequences per step, summed over steps.
    pub batched_sequences: Counter,
    pub iteration_tokens: Histogram,
    pub preemptions: Counter,
    /// Prompt tokens looked up in, and served from, the prefix cache at admission.
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    /// Hit rate of the last step that admitted prompts.
    pub recent_prefix_hit_rate: Gauge<f64, AtomicU64>,
    /// Tokens generated per model second over the last [`THROUGHPUT_WINDOW`] steps.
    pub recent_generation_throughput: Gauge<f64, AtomicU64>,

    // Per token.
    pub generation_tokens: Counter,
    pub ttft: Histogram,
    pub itl: Histogram,

    // Per finished request.
    pub finished: Counter,
    pub request_success: Family<Vec<(&'static str, &'static str)>, Counter>,
    pub prompt_tokens: Counter,
    pub cached_tokens: Counter,
    pub completion_tokens: Counter,
    /// Time from first scheduling to the first token, summed.
    pub prompt_seconds: Counter<f64, AtomicU64>,
    /// Time from the first token to the last, summed.
    pub decode_seconds: Counter<f64, AtomicU64>,
    /// The longest sequence (prompt + output) finished so far.
    pub longest_sequence: Gauge,
    pub e2e: Histogram,
    pub queue_time: Histogram,

    // Per request the client abandoned.
    pub aborted: Counter,
}

/// Steps over which the recent generation throughput is measured (SGLang logs its own every
/// 40 decode steps).
pub const THROUGHPUT_WINDOW: u64 = 40;

impl EngineMetrics {
    pub fn new(buckets: &LatencyBuckets) -> Self {
        EngineMetrics {
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            steps: Counter::default(),
            batched_sequences: Counter::default(),
            iteration_tokens: Histogram::new(ITERATION_BUCKETS),
            preemptions: Counter::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            recent_prefix_hit_rate: Gauge::default(),
            recent_generation_throughput: Gauge::default(),
            generation_tokens: Counter::default(),
            ttft: Histogram::new(buckets.ttft.iter().copied()),
            itl: Histogram::new(buckets.itl.iter().copied()),
            finished: Counter::default(),
            request_success: Family::default(),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            prompt_seconds: Counter::default(),
            decode_seconds: Counter::default(),
            longest_sequence: Gauge::default(),
            e2e: Histogram::new(buckets.e2e.iter().copied()),
            queue_time: Histogram::new(buckets.queue.iter().copied()),
            aborted: Counter::default(),
        }
    }

    /// Records a request that generated all its tokens.
    pub fn record_finished(&self, done: &Finished, finish_reason: &'static str) {
        let usage = &done.usage;
        self.finished.inc();
        self.request_success
            .get_or_create(&vec![("finished_reason", finish_reason)])
            .inc();
        self.prompt_tokens.inc_by(usage.prompt_tokens);
        self.cached_tokens.inc_by(usage.cached_tokens);
        self.completion_tokens
            .inc_by(u64::from(usage.completion_tokens));
        self.prompt_seconds
            .inc_by(done.ttft_seconds - done.queue_seconds);
        self.decode_seconds
            .inc_by(done.e2e_seconds - done.ttft_seconds);
        let length = usage.prompt_tokens + u64::from(usage.completion_tokens);
        let length = i64::try_from(length).unwrap_or(i64::MAX);
        if length > self.longest_sequence.get() {
            self.longest_sequence.set(length);
        }
        self.e2e.observe(done.e2e_seconds);
        self.queue_time.observe(done.queue_seconds);
    }
}

/// Renders a registry in the OpenMetrics text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

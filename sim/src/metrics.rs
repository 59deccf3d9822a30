//! `/metrics` with vLLM's metric names, so whatever scrapes a real engine scrapes the simulator.
//! Latencies are in model seconds (wall seconds × `--time-scale`).

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::profile::Profile;

const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: [f64; 18] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0,
];
const REQUEST_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const ITERATION_BUCKETS: [f64; 12] = [
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

/// Every metric the simulator exports. Clones share the same underlying series.
#[derive(Clone)]
pub struct EngineMetrics {
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_usage: Gauge<f64, AtomicU64>,
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub preemptions: Counter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub request_success: Family<Vec<(&'static str, &'static str)>, Counter>,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub iteration_tokens: Histogram,
}

impl EngineMetrics {
    /// Builds the metrics and a registry that exposes them with vLLM's labels.
    pub fn new(profile: &Profile) -> (Self, Registry) {
        let m = EngineMetrics {
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_BUCKETS),
            queue_time: Histogram::new(REQUEST_BUCKETS),
            iteration_tokens: Histogram::new(ITERATION_BUCKETS),
        };
        let labels = [
            (Cow::Borrowed("engine"), Cow::Borrowed("0")),
            (
                Cow::Borrowed("model_name"),
                Cow::Owned(profile.model.name.clone()),
            ),
        ];
        let mut r = Registry::with_labels(labels.into_iter());
        r.register(
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            m.running.clone(),
        );
        r.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            m.waiting.clone(),
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            m.kv_usage.clone(),
        );
        r.register(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            m.prefix_queries.clone(),
        );
        r.register(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            m.prefix_hits.clone(),
        );
        r.register(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine",
            m.preemptions.clone(),
        );
        r.register(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed",
            m.prompt_tokens.clone(),
        );
        r.register(
            "vllm:generation_tokens",
            "Number of generation tokens processed",
            m.generation_tokens.clone(),
        );
        r.register(
            "vllm:request_success",
            "Count of successfully processed requests",
            m.request_success.clone(),
        );
        r.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            m.ttft.clone(),
        );
        r.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            m.itl.clone(),
        );
        r.register(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds",
            m.e2e.clone(),
        );
        r.register(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request",
            m.queue_time.clone(),
        );
        r.register(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step",
            m.iteration_tokens.clone(),
        );
        let e = &profile.engine;
        r.register(
            "vllm:cache_config",
            "Information of the LLMEngine CacheConfig",
            Info::new(vec![
                ("block_size", "16".to_owned()),
                ("num_gpu_blocks", profile.kv_blocks().to_string()),
                (
                    "gpu_memory_utilization",
                    e.gpu_memory_utilization.to_string(),
                ),
                ("enable_prefix_caching", e.enable_prefix_caching.to_string()),
            ]),
        );
        (m, r)
    }

    pub fn count_success(&self, finished_reason: &'static str) {
        self.request_success
            .get_or_create(&vec![("finished_reason", finished_reason)])
            .inc();
    }
}

/// Renders a registry in the text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

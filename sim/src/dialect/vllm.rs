//! vLLM: `vllm:*` metrics with `engine` and `model_name` labels (as the captures in
//! `shared/reference/vllm-0.32/`), `vllm:cache_config_info`, and `cache_salt` honoured.

use std::borrow::Cow;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use serde_json::json;

use super::{Dialect, openmetrics};
use crate::metrics::{EngineMetrics, LatencyBuckets};
use crate::profile::Profile;

const BUCKETS: LatencyBuckets = LatencyBuckets {
    ttft: &[
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ],
    itl: &[
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0,
    ],
    e2e: REQUEST_BUCKETS,
    queue: REQUEST_BUCKETS,
};

const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

pub struct Vllm {
    registry: Registry,
    model: String,
    max_model_len: u64,
}

impl Vllm {
    pub fn new(profile: &Profile) -> (Self, EngineMetrics) {
        let m = EngineMetrics::new(&BUCKETS);
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
        let dialect = Vllm {
            registry: r,
            model: profile.model.name.clone(),
            max_model_len: profile.model.max_model_len,
        };
        (dialect, m)
    }
}

impl Dialect for Vllm {
    fn endpoints(self: Arc<Self>) -> Router {
        let models = json!({
            "object": "list",
            "data": [{
                "id": self.model,
                "object": "model",
                "owned_by": "weir-sim",
                "max_model_len": self.max_model_len,
            }],
        });
        Router::new()
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/v1/models", get(move || async move { axum::Json(models) }))
            .route(
                "/metrics",
                get(move || async move { openmetrics(&self.registry) }),
            )
    }
}

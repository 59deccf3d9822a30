//! SGLang, as its current sources have it (`python/sglang/srt/metrics/collector.py`,
//! `entrypoints/http_server.py`): `sglang:*` metrics, the scheduler's gauges labelled
//! `model_name, engine_type, tp_rank, pp_rank, moe_ep_rank` and the tokenizer's counters and
//! histograms `model_name, engine_type`; `GET /server_info` (and its deprecated alias
//! `/get_server_info`) with the server arguments, `max_total_num_tokens` and the effective
//! `max_running_requests`. `cache_salt` scopes the radix cache (since SGLang PR #23300), usage
//! reports cached tokens (as with `--enable-cache-report`), and any `model` name is answered.
//! Help texts are SGLang's less their final period, which the encoder adds.

use std::borrow::Cow;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use weir_core::error::ApiError;

use super::{Dialect, openmetrics, unix_now};
use crate::metrics::{EngineMetrics, LatencyBuckets};
use crate::profile::Profile;

const BUCKETS: LatencyBuckets = LatencyBuckets {
    ttft: &[
        0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
        200.0, 400.0,
    ],
    itl: &[
        0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
        0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
    ],
    e2e: &[
        0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
        200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0,
    ],
    queue: &[
        0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
        70.0, 80.0, 90.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0,
        1200.0, 1400.0, 1600.0, 1800.0, 2000.0, 2500.0, 3000.0,
    ],
};

pub struct Sglang {
    registry: Registry,
    metrics: EngineMetrics,
    /// KV tokens held by live sequences, derived from the usage fraction when scraped.
    used_tokens: Gauge,
    capacity: u64,
    server_info: Value,
    models: Value,
}

impl Sglang {
    pub fn new(profile: &Profile) -> (Self, EngineMetrics) {
        let m = EngineMetrics::new(&BUCKETS);
        let capacity = profile.kv_capacity_tokens();
        let used_tokens = Gauge::default();
        let max_total_num_tokens: Gauge = Gauge::default();
        max_total_num_tokens.set(i64::try_from(capacity).unwrap_or(i64::MAX));

        let labels = [
            (
                Cow::Borrowed("model_name"),
                Cow::Owned(profile.model.name.clone()),
            ),
            (Cow::Borrowed("engine_type"), Cow::Borrowed("unified")),
        ];
        let mut r = Registry::with_labels(labels.into_iter());
        r.register(
            "sglang:prompt_tokens",
            "Number of prefill tokens processed",
            m.prompt_tokens.clone(),
        );
        r.register(
            "sglang:generation_tokens",
            "Number of generation tokens processed",
            m.completion_tokens.clone(),
        );
        r.register(
            "sglang:cached_tokens",
            "Number of cached prompt tokens",
            m.cached_tokens.clone(),
        );
        r.register(
            "sglang:num_requests",
            "Number of requests processed",
            m.finished.clone(),
        );
        r.register(
            "sglang:num_aborted_requests",
            "Number of requests aborted",
            m.aborted.clone(),
        );
        r.register(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            m.ttft.clone(),
        );
        r.register(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            m.itl.clone(),
        );
        r.register(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            m.e2e.clone(),
        );

        let scheduler = r
            .sub_registry_with_label((Cow::Borrowed("tp_rank"), Cow::Borrowed("0")))
            .sub_registry_with_label((Cow::Borrowed("pp_rank"), Cow::Borrowed("0")))
            .sub_registry_with_label((Cow::Borrowed("moe_ep_rank"), Cow::Borrowed("0")));
        scheduler.register(
            "sglang:num_running_reqs",
            "The number of running requests",
            m.running.clone(),
        );
        scheduler.register(
            "sglang:num_used_tokens",
            "The number of used tokens",
            used_tokens.clone(),
        );
        scheduler.register("sglang:token_usage", "The token usage", m.kv_usage.clone());
        scheduler.register(
            "sglang:gen_throughput",
            "The generation throughput (token/s)",
            m.recent_generation_throughput.clone(),
        );
        scheduler.register(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue",
            m.waiting.clone(),
        );
        scheduler.register(
            "sglang:cache_hit_rate",
            "The prefix cache hit rate",
            m.recent_prefix_hit_rate.clone(),
        );
        scheduler.register(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool",
            max_total_num_tokens,
        );
        scheduler.register(
            "sglang:num_retracted_requests",
            "Total number of retracted requests",
            m.preemptions.clone(),
        );
        scheduler.register(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds",
            m.queue_time.clone(),
        );

        let dialect = Sglang {
            registry: r,
            metrics: m.clone(),
            used_tokens,
            capacity,
            server_info: server_info(profile),
            models: json!({
                "object": "list",
                "data": [{
                    "id": profile.model.name,
                    "object": "model",
                    "created": unix_now(),
                    "owned_by": "sglang",
                    "root": profile.model.name,
                    "max_model_len": profile.model.max_model_len,
                }],
            }),
        };
        (dialect, m)
    }

    fn metrics(&self) -> axum::response::Response {
        let used = self.metrics.kv_usage.get() * self.capacity as f64;
        self.used_tokens.set(used.round() as i64);
        openmetrics(&self.registry)
    }

    /// `/server_info`: the launch arguments, the scheduler's limits and its live state.
    fn server_info(&self) -> Value {
        let mut info = self.server_info.clone();
        if let Some(state) = info
            .get_mut("internal_states")
            .and_then(|s| s.get_mut(0))
            .and_then(Value::as_object_mut)
        {
            state.insert(
                "last_gen_throughput".into(),
                json!(self.metrics.recent_generation_throughput.get()),
            );
        }
        info
    }
}

/// The fields of SGLang's `/server_info` that describe capacity, as a launch with this profile
/// would report them.
fn server_info(profile: &Profile) -> Value {
    let e = &profile.engine;
    let capacity = profile.kv_capacity_tokens();
    let args = json!({
        "model_path": profile.model.name,
        "served_model_name": profile.model.name,
        "context_length": profile.model.max_model_len,
        "mem_fraction_static": e.gpu_memory_utilization,
        "max_running_requests": e.max_num_seqs,
        "max_queued_requests": null,
        "max_total_tokens": null,
        "chunked_prefill_size": if e.enable_chunked_prefill {
            json!(e.max_num_batched_tokens)
        } else {
            json!(-1)
        },
        "schedule_policy": "fcfs",
        "page_size": 16,
        "disable_radix_cache": !e.enable_prefix_caching,
        "tp_size": profile.gpu.count,
        "dp_size": 1,
        "enable_metrics": true,
        "enable_cache_report": true,
    });
    let mut internal = args.clone();
    if let Some(state) = internal.as_object_mut() {
        state.insert("last_gen_throughput".into(), json!(0.0));
        state.insert("memory_usage".into(), json!({"token_capacity": capacity}));
        state.insert(
            "effective_max_running_requests_per_dp".into(),
            json!(e.max_num_seqs),
        );
    }
    let mut info = args;
    if let Some(obj) = info.as_object_mut() {
        obj.insert("status".into(), json!("ready"));
        obj.insert("max_total_num_tokens".into(), json!(capacity));
        obj.insert(
            "max_req_input_len".into(),
            json!(profile.model.max_model_len.min(capacity).saturating_sub(1)),
        );
        obj.insert("internal_states".into(), json!([internal]));
        obj.insert(
            "version".into(),
            json!(format!("weir-sim {}", env!("CARGO_PKG_VERSION"))),
        );
    }
    info
}

impl Dialect for Sglang {
    fn endpoints(self: Arc<Self>) -> Router {
        let (info, metrics) = (self.clone(), self.clone());
        Router::new()
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/health_generate", get(|| async { StatusCode::OK }))
            .route(
                "/v1/models",
                get(move || async move { axum::Json(self.models.clone()) }),
            )
            .route("/metrics", get(move || async move { metrics.metrics() }))
            .route(
                "/server_info",
                get({
                    let info = info.clone();
                    move || async move { axum::Json(info.server_info()) }
                }),
            )
            .route(
                "/get_server_info",
                get(move || async move { axum::Json(info.server_info()) }),
            )
    }

    /// SGLang's OpenAI routes answer whatever `model` is asked for, under that name.
    fn served_model(&self, requested: &str, _served: &str) -> Result<String, ApiError> {
        Ok(requested.to_owned())
    }
}

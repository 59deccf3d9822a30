//! llama.cpp's `llama-server`, after the captures in `shared/reference/llama.cpp-server/`.
//!
//! A fixed number of slots (`--slots`, the engine's max concurrent sequences), each with a
//! context of `n_ctx` tokens: requests beyond the free slots are accepted and wait inside the
//! server, first in first out (`llamacpp:requests_deferred`), and a waiting stream's response
//! headers are sent only once a slot starts it. `max_tokens` past the slot's context is not
//! refused: generation stops at the context's end. There is no KV-usage gauge. `cache_salt` is
//! ignored — an identical prompt from another tenant reuses the cached prefix — while llama.cpp's
//! own `"cache_prompt": false` keeps a request out of the prompt cache.

mod wire;

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};
use weir_core::error::ApiError;
use weir_core::kv_profile::BLOCK_TOKENS;
use weir_core::request::InferenceRequest;

use super::{CacheScope, Dialect, Refusal, unix_now, with_retry_after};
use crate::metrics::{EngineMetrics, LatencyBuckets};
use crate::profile::Profile;
use crate::wire::Wire;

/// What llama-server reports as its build, in `system_fingerprint` and `/props`.
const BUILD_INFO: &str = "b1-weir-sim";

/// The error type of a prompt that does not fit the slot.
const EXCEED_CONTEXT: &str = "exceed_context_size_error";

/// llama.cpp's default sampling parameters, as `/props` reports them.
const DEFAULT_PARAMS: &str = include_str!("default_params.json");

/// llama.cpp exports no latency histograms; these only size the unused neutral ones.
const BUCKETS: LatencyBuckets = LatencyBuckets {
    ttft: &[1.0],
    itl: &[1.0],
    e2e: &[1.0],
    queue: &[1.0],
};

pub struct LlamaCpp {
    metrics: EngineMetrics,
    model: String,
    slots: usize,
    /// Context of one slot, in tokens.
    n_ctx: u64,
    max_model_len: u64,
    total_params: u64,
    weight_bytes: u64,
}

impl LlamaCpp {
    pub fn new(profile: &Profile) -> (Self, EngineMetrics) {
        let metrics = EngineMetrics::new(&BUCKETS);
        let slots = profile.engine.max_num_seqs;
        let dialect = LlamaCpp {
            metrics: metrics.clone(),
            model: profile.model.name.clone(),
            slots,
            n_ctx: slot_context(profile),
            max_model_len: profile.model.max_model_len,
            total_params: profile.model.total_params as u64,
            weight_bytes: (profile.model.total_params * profile.model.weight_bytes_per_param)
                as u64,
        };
        (dialect, metrics)
    }

    /// `/metrics`: exactly the `llamacpp:*` families of the capture, in its order and format.
    fn metrics(&self) -> Response {
        let m = &self.metrics;
        let processed = m.prompt_tokens.get().saturating_sub(m.cached_tokens.get());
        let per_second = |tokens: u64, seconds: f64| {
            if seconds > 0.0 {
                tokens as f64 / seconds
            } else {
                0.0
            }
        };
        let busy_per_decode = if m.steps.get() > 0 {
            m.batched_sequences.get() as f64 / m.steps.get() as f64
        } else {
            0.0
        };
        let families: [(&str, &str, &str, f64); 15] = [
            (
                "prompt_tokens_total",
                "counter",
                "Number of prompt tokens processed, excluding cached tokens",
                processed as f64,
            ),
            (
                "prompt_tokens_cached_total",
                "counter",
                "Number of prompt tokens reused from the cache",
                m.cached_tokens.get() as f64,
            ),
            (
                "prompt_seconds_total",
                "counter",
                "Total time spent processing prompts",
                m.prompt_seconds.get(),
            ),
            (
                "tokens_predicted_total",
                "counter",
                "Number of generation tokens processed",
                m.completion_tokens.get() as f64,
            ),
            (
                "tokens_predicted_seconds_total",
                "counter",
                "Total time spent generating tokens",
                m.decode_seconds.get(),
            ),
            (
                "n_decode_total",
                "counter",
                "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
                m.steps.get() as f64,
            ),
            (
                "n_tokens_max",
                "counter",
                "Largest observed sequence length (prompt + generation)",
                m.longest_sequence.get() as f64,
            ),
            (
                "spec_decode_num_draft_tokens_total",
                "counter",
                "Speculative: Total draft tokens generated",
                0.0,
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "counter",
                "Speculative: Total draft tokens accepted by the target model",
                0.0,
            ),
            (
                "spec_decode_num_drafts_total",
                "counter",
                "Speculative: Total speculative decoding verification steps",
                0.0,
            ),
            (
                "prompt_tokens_seconds",
                "gauge",
                "Average prompt throughput in tokens/s",
                per_second(processed, m.prompt_seconds.get()),
            ),
            (
                "predicted_tokens_seconds",
                "gauge",
                "Average generation throughput in tokens/s",
                per_second(m.completion_tokens.get(), m.decode_seconds.get()),
            ),
            (
                "requests_processing",
                "gauge",
                "Number of requests processing",
                m.running.get() as f64,
            ),
            (
                "requests_deferred",
                "gauge",
                "Number of requests deferred",
                m.waiting.get() as f64,
            ),
            (
                "n_busy_slots_per_decode",
                "gauge",
                "Average number of busy slots per llama_decode() call",
                busy_per_decode,
            ),
        ];
        let mut text = String::new();
        for (name, kind, help, value) in families {
            let _ = write!(
                text,
                "# HELP llamacpp:{name} {help}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {}\n",
                cpp_number(value)
            );
        }
        ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
    }

    fn props(&self) -> Value {
        let params: Value = serde_json::from_str(DEFAULT_PARAMS).unwrap_or(Value::Null);
        json!({
            "default_generation_settings": {"params": params, "n_ctx": self.n_ctx},
            "total_slots": self.slots,
            "model_alias": self.model,
            "model_path": format!("{}.gguf", self.model),
            "modalities": {"vision": false, "video": false, "audio": false},
            "endpoint_slots": true,
            "endpoint_props": false,
            "endpoint_metrics": true,
            "build_info": BUILD_INFO,
            "is_sleeping": false,
        })
    }

    /// `/slots`. The engine does not pin sequences to slot ids, so the busy ones are listed first.
    fn slots(&self) -> Value {
        let busy = usize::try_from(self.metrics.running.get()).unwrap_or(0);
        (0..self.slots)
            .map(|id| {
                json!({
                    "id": id,
                    "n_ctx": self.n_ctx,
                    "speculative": false,
                    "is_processing": id < busy,
                })
            })
            .collect()
    }

    fn models(&self) -> Value {
        json!({
            "models": [{
                "name": self.model,
                "model": self.model,
                "modified_at": "",
                "size": "",
                "digest": "",
                "type": "model",
                "description": "",
                "tags": [""],
                "capabilities": ["completion"],
                "parameters": "",
                "details": {
                    "parent_model": "",
                    "format": "gguf",
                    "family": "",
                    "families": [""],
                    "parameter_size": "",
                    "quantization_level": "",
                },
            }],
            "object": "list",
            "data": [{
                "id": self.model,
                "aliases": [self.model],
                "tags": [],
                "object": "model",
                "created": unix_now(),
                "owned_by": "llamacpp",
                "meta": {
                    "n_ctx": self.n_ctx,
                    "n_ctx_train": self.max_model_len,
                    "n_params": self.total_params,
                    "size": self.weight_bytes,
                },
            }],
        })
    }
}

/// One slot's context: the model's length, or the slot's even share of the KV cache if smaller,
/// in whole blocks, so that full slots never run out of KV and nothing is ever preempted.
pub fn slot_context(profile: &Profile) -> u64 {
    let share = profile.kv_capacity_tokens() / profile.engine.max_num_seqs.max(1) as u64;
    profile.model.max_model_len.min(share) / BLOCK_TOKENS * BLOCK_TOKENS
}

/// A number as llama-server prints it (C++ stream defaults: six significant digits).
fn cpp_number(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let exponent = v.abs().log10().floor() as i32;
    if !(-5..6).contains(&exponent) {
        let s = format!("{v:.5e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let decimals = usize::try_from(5 - exponent).unwrap_or(0);
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// llama.cpp's own request fields the simulator honours.
#[derive(Deserialize)]
struct Extensions {
    /// `false` keeps the request out of the prompt cache.
    #[serde(default)]
    cache_prompt: Option<bool>,
}

impl Dialect for LlamaCpp {
    fn endpoints(self: Arc<Self>) -> Router {
        let (metrics, props, slots) = (self.clone(), self.clone(), self.clone());
        Router::new()
            .route(
                "/health",
                get(|| async { axum::Json(json!({"status": "ok"})) }),
            )
            .route(
                "/v1/models",
                get(move || async move { axum::Json(self.models()) }),
            )
            .route("/metrics", get(move || async move { metrics.metrics() }))
            .route(
                "/props",
                get(move || async move { axum::Json(props.props()) }),
            )
            .route(
                "/slots",
                get(move || async move { axum::Json(slots.slots()) }),
            )
    }

    /// llama-server serves one model whatever `model` says, and echoes the name asked for.
    fn served_model(&self, requested: &str, _served: &str) -> Result<String, ApiError> {
        Ok(requested.to_owned())
    }

    /// `cache_salt` is ignored; `"cache_prompt": false` bypasses the cache.
    fn cache_scope<'r>(&self, _req: &'r InferenceRequest, body: &[u8]) -> CacheScope<'r> {
        match serde_json::from_slice::<Extensions>(body) {
            Ok(Extensions {
                cache_prompt: Some(false),
            }) => CacheScope::Off,
            _ => CacheScope::Salted(None),
        }
    }

    /// A prompt that fills the slot is refused (an embedding's may fill it exactly); any output
    /// limit is cut to the slot's context. `n_predict` is read before the API's own limit.
    fn output_budget(
        &self,
        req: &InferenceRequest,
        prompt_len: u64,
        _profile: &Profile,
    ) -> Result<u32, Refusal> {
        let generates = req.endpoint.generates();
        if prompt_len > self.n_ctx || (generates && prompt_len == self.n_ctx) {
            let error = ApiError::bad_request(
                "the request exceeds the available context size, try increasing it",
            )
            .with_type(EXCEED_CONTEXT);
            let mut details = serde_json::Map::new();
            details.insert("n_prompt_tokens".into(), json!(prompt_len));
            details.insert("n_ctx".into(), json!(self.n_ctx));
            return Err(Refusal { error, details });
        }
        if !generates {
            return Ok(0);
        }
        let room = self.n_ctx - prompt_len;
        let n_predict = req
            .output_limits
            .iter()
            .find(|(name, _)| *name == "n_predict")
            .map(|&(_, l)| l);
        let limit = n_predict
            .or(req.max_output_tokens())
            .map_or(room, |l| u64::from(l).min(room));
        Ok(u32::try_from(limit).unwrap_or(u32::MAX))
    }

    /// `{"error": {"code", "message", "type"}}` with llama.cpp's type names, and the fields
    /// llama.cpp adds to some errors.
    fn error(&self, refusal: &Refusal) -> Response {
        let e = &refusal.error;
        let kind = match e.status {
            _ if e.kind == Some(EXCEED_CONTEXT) => EXCEED_CONTEXT,
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            501 => "not_supported_error",
            503 => "unavailable_error",
            s if s < 500 => "invalid_request_error",
            _ => "server_error",
        };
        let mut error = serde_json::Map::new();
        error.insert("code".into(), json!(e.status));
        error.insert("message".into(), json!(e.message));
        error.insert("type".into(), json!(kind));
        error.extend(refusal.details.clone());
        with_retry_after(e.status, axum::Json(json!({ "error": error })))
    }

    fn defers_headers(&self) -> bool {
        true
    }

    fn wire(&self) -> &dyn Wire {
        &wire::LlamaCppWire
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_as_cpp_streams_do() {
        assert_eq!(cpp_number(68.0), "68");
        assert_eq!(cpp_number(0.0), "0");
        assert_eq!(cpp_number(0.010019), "0.010019");
        assert_eq!(cpp_number(6787.123), "6787.12");
        assert_eq!(cpp_number(505.2419), "505.242");
        assert_eq!(cpp_number(1.0), "1");
        assert_eq!(cpp_number(2_500_000.0), "2.5e+06");
    }

    #[test]
    fn slots_split_the_kv_cache_in_whole_blocks() {
        let mut tiny = Profile::preset("tiny").unwrap_or_else(|e| panic!("{e}"));
        tiny.engine.max_num_seqs = 4;
        let n_ctx = slot_context(&tiny);
        assert_eq!(n_ctx % BLOCK_TOKENS, 0);
        assert!(n_ctx * 4 <= tiny.kv_capacity_tokens());
        assert!(n_ctx <= tiny.model.max_model_len);
    }
}

//! The engines the simulator can play. The physics are shared (continuous batching, paged KV,
//! chunked prefill, prefix cache); a dialect is one engine's observable surface — metric names,
//! info endpoints, error bodies, wire shape — and its admission rules: whether `cache_salt`
//! scopes the prefix cache, how output is bounded, and whether a stream's response headers
//! wait until the engine starts the request. The trait's defaults are vLLM's.

pub mod llamacpp;
pub mod sglang;
pub mod vllm;

use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::registry::Registry;
use serde_json::{Map, Value};
use weir_core::error::{ApiError, ErrorShape};
use weir_core::request::InferenceRequest;

use crate::metrics::{EngineMetrics, render};
use crate::profile::Profile;
use crate::wire::{VllmWire, Wire};

/// The engine whose surface the simulator plays (`--metrics-dialect`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DialectName {
    Vllm,
    Sglang,
    Llamacpp,
}

impl DialectName {
    /// The dialect for this profile and the metrics its engine loop records into.
    pub fn build(self, profile: &Profile) -> (Arc<dyn Dialect>, EngineMetrics) {
        match self {
            DialectName::Vllm => {
                let (d, m) = vllm::Vllm::new(profile);
                (Arc::new(d), m)
            }
            DialectName::Sglang => {
                let (d, m) = sglang::Sglang::new(profile);
                (Arc::new(d), m)
            }
            DialectName::Llamacpp => {
                let (d, m) = llamacpp::LlamaCpp::new(profile);
                (Arc::new(d), m)
            }
        }
    }
}

/// Whether and how a request's prompt blocks take part in the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheScope<'r> {
    /// Reused by, and reusable for, requests with the same salt (`None`: unsalted).
    Salted(Option<&'r str>),
    /// Neither looked up nor kept.
    Off,
}

/// Why a request is not served: the error, and any fields the engine adds to its own error
/// body (llama.cpp's `n_prompt_tokens` and `n_ctx`).
#[derive(Clone, Debug)]
pub struct Refusal {
    pub error: ApiError,
    pub details: Map<String, Value>,
}

impl From<ApiError> for Refusal {
    fn from(error: ApiError) -> Self {
        Refusal {
            error,
            details: Map::new(),
        }
    }
}

impl Refusal {
    /// The refusal in the shape of the API that was called: Anthropic's envelope for the
    /// Messages API whatever the engine, else the engine's own.
    pub fn reply(&self, dialect: &dyn Dialect, shape: ErrorShape) -> Response {
        match shape {
            ErrorShape::Anthropic => with_retry_after(
                self.error.status,
                axum::Json(self.error.to_json_in(ErrorShape::Anthropic)),
            ),
            ErrorShape::OpenAi => dialect.error(self),
        }
    }
}

/// One engine's surface and admission rules.
pub trait Dialect: Send + Sync {
    /// Health, models, metrics and the engine's own info endpoints.
    fn endpoints(self: Arc<Self>) -> Router;

    /// The model name an answer carries, or why the request is refused. vLLM serves only its
    /// own name and answers 404 otherwise.
    fn served_model(&self, requested: &str, served: &str) -> Result<String, ApiError> {
        if requested == served {
            return Ok(served.to_owned());
        }
        Err(ApiError::not_found(format!(
            "The model `{requested}` does not exist. Valid aliases: {served}."
        ))
        .with_param("model"))
    }

    /// How one of the request's prompts takes part in the prefix cache. vLLM scopes it by
    /// `cache_salt`.
    fn cache_scope<'r>(&self, req: &'r InferenceRequest, _body: &[u8]) -> CacheScope<'r> {
        CacheScope::Salted(req.cache_salt.as_deref())
    }

    /// The most tokens one sequence of the request may generate (0 for an API that generates
    /// nothing), or the refusal. vLLM refuses a prompt plus `max_tokens` over the model's length,
    /// and fills the context when no limit is set.
    fn output_budget(
        &self,
        req: &InferenceRequest,
        prompt_len: u64,
        profile: &Profile,
    ) -> Result<u32, Refusal> {
        let max_len = profile.model.max_model_len;
        let generates = req.endpoint.generates();
        let max_tokens = if generates {
            req.max_output_tokens()
                .map_or(max_len.saturating_sub(prompt_len), u64::from)
        } else {
            0
        };
        if (generates && max_tokens == 0) || prompt_len + max_tokens > max_len {
            let error = ApiError::context_length_exceeded(max_len, prompt_len, max_tokens);
            return Err(error.into());
        }
        let capacity = profile.kv_capacity_tokens();
        if prompt_len + max_tokens > capacity {
            let error = ApiError::bad_request(format!(
                "{} tokens of context exceed the KV cache capacity of {capacity} tokens",
                prompt_len + max_tokens
            ))
            .with_param("max_tokens");
            return Err(error.into());
        }
        Ok(u32::try_from(max_tokens).unwrap_or(u32::MAX))
    }

    /// An error as this engine shapes it. vLLM: OpenAI's `{"error": {message, type, param,
    /// code}}`, with `Retry-After` on 429 and 503.
    fn error(&self, refusal: &Refusal) -> Response {
        let body = crate::wire::vllm::error_body(&refusal.error);
        with_retry_after(refusal.error.status, axum::Json(body))
    }

    /// Whether a stream's response headers wait until the engine starts the request.
    fn defers_headers(&self) -> bool {
        false
    }

    /// How answers are laid out on the wire.
    fn wire(&self) -> &dyn Wire {
        &VllmWire
    }
}

/// A JSON error body with its status, plus `Retry-After: 1` on the retryable ones.
pub fn with_retry_after(status: u16, body: impl IntoResponse) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, body).into_response();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// A registry as an OpenMetrics `/metrics` answer (what vLLM's and SGLang's scrapers read).
fn openmetrics(registry: &Registry) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        render(registry),
    )
        .into_response()
}

/// Seconds since the Unix epoch, for `created` fields.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

//! Errors in the shape of the API that was called, with the values its provider sends: OpenAI's
//! `{"error": {"message", "type", "param", "code"}}` for the OpenAI-compatible APIs, Anthropic's
//! `{"type": "error", "error": {"type", "message"}}` for the Messages API. Clients that read the
//! body, not only the status, find what they would from the provider itself: OpenAI's `type` is
//! `invalid_request_error` for a refused request, `server_error` for a failure on the service's
//! side, the limit's measure (`requests`, `tokens`) or `insufficient_quota` for a 429, and its
//! `code` a string or null. `core/tests/error_shapes.rs` holds the providers' values, citing the
//! pages that document them.

use serde_json::{Value, json};

/// Which error body a client of an API expects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ErrorShape {
    #[default]
    OpenAi,
    Anthropic,
}

/// An error: its status, message, and OpenAI's `param` and machine-readable `code`, if any.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    /// OpenAI's `type` where the status alone does not decide it (a rate limit's measure).
    pub kind: Option<&'static str>,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind: None,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, message)
    }

    /// A model nobody serves, in OpenAI's words for it.
    pub fn model_not_found(model: &str) -> Self {
        Self::not_found(format!(
            "The model `{model}` does not exist or you do not have access to it."
        ))
        .with_code("model_not_found")
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            413,
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(429, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, message)
    }

    pub fn context_length_exceeded(max_context: u64, prompt: u64, completion: u64) -> Self {
        Self::bad_request(format!(
            "This model's maximum context length is {max_context} tokens. However, you requested \
             {} tokens ({prompt} in the messages, {completion} in the completion). Please reduce \
             the length of the messages or completion.",
            prompt + completion
        ))
        .with_param("messages")
        .with_code("context_length_exceeded")
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_owned());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_type(mut self, kind: &'static str) -> Self {
        self.kind = Some(kind);
        self
    }

    /// OpenAI's `type`: the one set, else the status's.
    pub fn openai_type(&self) -> &'static str {
        self.kind.unwrap_or(match self.status {
            429 => "requests",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        })
    }

    /// The OpenAI-shaped body.
    pub fn to_json(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.openai_type(),
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// The body in the shape of the API that was called.
    pub fn to_json_in(&self, shape: ErrorShape) -> Value {
        match shape {
            ErrorShape::OpenAi => self.to_json(),
            ErrorShape::Anthropic => json!({
                "type": "error",
                "error": {"type": anthropic_type(self.status), "message": self.message},
            }),
        }
    }
}

/// An engine's own error answer with the provider's values, as weir's own answers carry them:
/// the engine's message kept, and in OpenAI's shape its `param` and a string `code` (vLLM and
/// llama.cpp's server send an exception class or their own `type`, and the status as `code`);
/// in Anthropic's, its envelope and the status's type. `None` for a body that is not an error
/// object (passed on as it came).
pub fn from_engine(status: u16, body: &[u8], shape: ErrorShape) -> Option<Value> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let error = value.get("error")?;
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .or_else(|| error.as_str())?;
    let mut shaped = ApiError::new(status, message).to_json_in(shape);
    if shape == ErrorShape::OpenAi {
        let text = |field: &str| error.get(field).filter(|v| v.is_string()).cloned();
        shaped["error"]["param"] = text("param").unwrap_or(Value::Null);
        shaped["error"]["code"] = text("code").unwrap_or(Value::Null);
    }
    Some(shaped)
}

/// Anthropic's error type for an HTTP status (its SDK picks the exception by status; the type
/// names the error for people reading the body).
fn anthropic_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

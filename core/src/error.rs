//! Errors in the shape of the API that was called: OpenAI's
//! `{"error": {"message", "type", "param", "code"}}` for the OpenAI-compatible APIs, Anthropic's
//! `{"type": "error", "error": {"type", "message"}}` for the Messages API, so each official SDK
//! raises its own typed exception (`RateLimitError`, `BadRequestError`, ...) from weir's replies.

use serde_json::{Value, json};

/// Which error body a client of an API expects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ErrorShape {
    #[default]
    OpenAi,
    Anthropic,
}

/// An error in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.
///
/// `code` carries a machine-readable code where one exists (`context_length_exceeded`) and
/// otherwise the HTTP status, as vLLM does.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequestError", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, "NotFoundError", message)
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            413,
            "BadRequestError",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(429, "RateLimitError", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalServerError", message)
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

    /// The OpenAI-shaped body.
    pub fn to_json(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code.map_or_else(|| json!(self.status), |c| json!(c)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_errors_name_their_code_or_status() {
        let v = ApiError::context_length_exceeded(100, 90, 20).to_json();
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("110 tokens"))
        );
        let v = ApiError::not_found("nope").to_json();
        assert_eq!(v["error"]["code"], 404);
        assert!(v["error"]["param"].is_null());
    }

    #[test]
    fn anthropic_errors_have_anthropic_s_envelope_and_types() {
        let shaped = |e: ApiError| e.to_json_in(ErrorShape::Anthropic);
        let v = shaped(ApiError::rate_limited("slow down").with_code("rate_limit_exceeded"));
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["message"], "slow down");
        assert_eq!(
            shaped(ApiError::bad_request("x"))["error"]["type"],
            "invalid_request_error"
        );
        assert_eq!(
            shaped(ApiError::new(401, "AuthenticationError", "x"))["error"]["type"],
            "authentication_error"
        );
        assert_eq!(
            shaped(ApiError::payload_too_large(10))["error"]["type"],
            "request_too_large"
        );
        assert_eq!(
            shaped(ApiError::new(503, "ServiceUnavailableError", "x"))["error"]["type"],
            "overloaded_error"
        );
        assert_eq!(
            ApiError::internal("x").to_json_in(ErrorShape::OpenAi),
            ApiError::internal("x").to_json()
        );
    }
}

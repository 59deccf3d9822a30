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
    pub param: Option<Box<str>>,
    pub code: Option<&'static str>,
    /// Fields of weir's own beside the provider's (a run budget's `budget`, `limit`, `used`):
    /// in the error object, after the provider's fields. Boxed: most errors have none, and an
    /// error travels in `Result`s.
    pub extra: Option<Box<Vec<(&'static str, Value)>>>,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind: None,
            message: message.into(),
            param: None,
            code: None,
            extra: None,
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
        self.param = Some(param.into());
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

    /// Adds a field of weir's own to the error object.
    pub fn with_extra(mut self, name: &'static str, value: impl Into<Value>) -> Self {
        self.extra
            .get_or_insert_default()
            .push((name, value.into()));
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
        let mut error = json!({
            "message": self.message,
            "type": self.openai_type(),
            "param": self.param,
            "code": self.code,
        });
        self.add_extra(&mut error);
        json!({ "error": error })
    }

    /// weir's own fields, and its `code` where the shape has none of its own.
    fn add_extra(&self, error: &mut Value) {
        let Some(object) = error.as_object_mut() else {
            return;
        };
        if let Some(code) = self.code {
            object.entry("code").or_insert_with(|| Value::from(code));
        }
        for (name, value) in self.extra.iter().flat_map(|e| e.iter()) {
            object.entry(*name).or_insert_with(|| value.clone());
        }
    }

    /// The body in the shape of the API that was called.
    pub fn to_json_in(&self, shape: ErrorShape) -> Value {
        match shape {
            ErrorShape::OpenAi => self.to_json(),
            ErrorShape::Anthropic => {
                let mut error =
                    json!({"type": anthropic_type(self.status), "message": self.message});
                if self.extra.is_some() {
                    self.add_extra(&mut error);
                }
                json!({"type": "error", "error": error})
            }
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

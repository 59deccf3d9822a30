//! The inference APIs weir meters, and what differs between them at the front door: the path
//! engines serve each on, the name the ledger records, the error shape its clients expect and
//! whether it generates output at all.

use crate::error::ErrorShape;

/// An inference API weir meters. [`crate::path`] says which one a request path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// OpenAI Chat Completions.
    ChatCompletions,
    /// OpenAI (legacy) Completions, prompt arrays included.
    Completions,
    /// OpenAI Responses.
    Responses,
    /// Anthropic Messages.
    Messages,
    /// OpenAI Embeddings: input tokens only.
    Embeddings,
}

impl Endpoint {
    pub const ALL: [Endpoint; 5] = [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Responses,
        Endpoint::Messages,
        Endpoint::Embeddings,
    ];

    /// The path engines serve the API on.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }

    /// The API's name in the ledger, metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
            Endpoint::Embeddings => "embeddings",
        }
    }

    /// The error body the API's clients (and their SDKs) expect.
    pub fn error_shape(self) -> ErrorShape {
        match self {
            Endpoint::Messages => ErrorShape::Anthropic,
            _ => ErrorShape::OpenAi,
        }
    }

    /// Whether the API generates output tokens (embeddings only read their input).
    pub fn generates(self) -> bool {
        self != Endpoint::Embeddings
    }

    /// Whether a stream reports its usage only when asked (`stream_options.include_usage`);
    /// the other APIs always report it.
    pub fn usage_is_optional(self) -> bool {
        matches!(self, Endpoint::ChatCompletions | Endpoint::Completions)
    }
}

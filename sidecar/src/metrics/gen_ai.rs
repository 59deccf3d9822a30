//! The OpenTelemetry GenAI semantic conventions (v1.41.0, `docs/gen-ai/gen-ai-metrics.md`):
//! their instruments' names, units and recommended bucket boundaries, so dashboards and
//! collectors built for any GenAI system read weir's figures as they are.

use weir_core::endpoint::Endpoint;

/// `gen_ai.client.token.usage` (`{token}`): tokens per request, `gen_ai.token.type` input or
/// output. weir is the client of its engines.
pub const TOKEN_USAGE: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];

/// `gen_ai.server.request.duration` (s): arrival to the last byte.
pub const DURATION: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

/// `gen_ai.server.time_to_first_token` (s).
pub const TIME_TO_FIRST_TOKEN: [f64; 16] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

/// `gen_ai.server.time_per_output_token` (s): after the first token, per output token.
pub const TIME_PER_OUTPUT_TOKEN: [f64; 13] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];

pub const OPERATION: &str = "gen_ai.operation.name";
pub const PROVIDER: &str = "gen_ai.provider.name";
pub const REQUEST_MODEL: &str = "gen_ai.request.model";
pub const TOKEN_TYPE: &str = "gen_ai.token.type";
pub const ERROR_TYPE: &str = "error.type";
/// weir's own attribute: the tenant at the configured depth ([`crate::config::metrics::TenantDepth`]).
pub const TENANT: &str = "weir.tenant";

/// The conventions' `gen_ai.operation.name` for an API: the chat-shaped ones (chat
/// completions, responses, messages) are `chat`.
pub fn operation(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Embeddings => "embeddings",
        Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages => "chat",
    }
}

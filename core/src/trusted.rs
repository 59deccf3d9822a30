//! The headers the filter sets for the upstream, after removing any a caller sent. Only the
//! filter writes `x-weir-*`, and it signs them ([`crate::signature`]): the sidecar trusts what
//! verifies, not what is present.

pub const PREFIX: &str = "x-weir-";
/// `org/workspace/project/key` of the authenticated key.
pub const TENANT: &str = "x-weir-tenant";
pub const TIER: &str = "x-weir-tier";
pub const WEIGHT: &str = "x-weir-weight";
/// `interactive` or `batch`.
pub const PRIORITY: &str = "x-weir-priority";
/// weir's own id for this attempt (unique, never the caller's `x-request-id`, which is a trace id).
pub const REQUEST_ID: &str = "x-weir-request-id";
/// The caller's `Idempotency-Key`, if it sent one: deduplication is scoped to (tenant, key).
pub const IDEMPOTENCY_KEY: &str = "x-weir-idempotency-key";
/// `v1:<expires_ms>:<hex HMAC-SHA256>` over every other `x-weir-*` header.
pub const SIGNATURE: &str = "x-weir-signature";
/// Prompt tokens as the gateway estimated them.
pub const INPUT_TOKENS: &str = "x-weir-input-tokens";
/// Output tokens reserved for the answer.
pub const RESERVED_OUTPUT: &str = "x-weir-reserved-output";
/// The tenant's cap on KV tokens held by its running requests (`active_kv_tokens`), if any.
pub const KV_LIMIT: &str = "x-weir-kv-limit";
/// `exact` or `fast`: how the prompt was counted.
pub const ESTIMATE: &str = "x-weir-estimate";
/// On responses of shadow routes: what enforcement would have done.
pub const SHADOW_DECISION: &str = "x-weir-shadow";

/// Whether a header is in weir's namespace (and must not come from a caller).
pub fn is_reserved(name: &str) -> bool {
    name.len() >= PREFIX.len() && name[..PREFIX.len()].eq_ignore_ascii_case(PREFIX)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reserved_names_are_case_insensitive() {
        assert!(super::is_reserved("x-weir-tenant"));
        assert!(super::is_reserved("X-Weir-Anything"));
        assert!(!super::is_reserved("x-wei"));
        assert!(!super::is_reserved("authorization"));
    }
}

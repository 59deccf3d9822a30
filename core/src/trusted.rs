//! The headers the filter sets for the upstream, after removing any a caller sent. Only the
//! filter writes `x-weir-*`, and it signs them ([`crate::signature`]): the sidecar trusts what
//! verifies, not what is present.
//!
//! The strict parsers below are shared by both sides: the filter's configuration cannot hold a
//! value the sidecar would refuse, and the sidecar never replaces a bad value with a default.

pub const PREFIX: &str = "x-weir-";
/// `org/workspace/project/key` of the authenticated key.
pub const TENANT: &str = "x-weir-tenant";
/// The org of [`TENANT`] alone: what Envoy hashes on to send an org's requests to one sidecar
/// of a pool (its whole fair-queue hierarchy in one place). A header of its own because
/// Istio's and Envoy Gateway's consistent hashing take a header's value as it is.
pub const ORG: &str = "x-weir-org";
pub const TIER: &str = "x-weir-tier";
/// The scheduling weight of each level of the tenant path, org first, comma-separated.
pub const WEIGHT: &str = "x-weir-weight";
/// `interactive` or `batch`.
pub const PRIORITY: &str = "x-weir-priority";
/// weir's own id for this attempt (unique, never the caller's `x-request-id`, which is a trace id).
pub const REQUEST_ID: &str = "x-weir-request-id";
/// The caller's `Idempotency-Key`, if it sent one: deduplication is scoped to (tenant, key).
pub const IDEMPOTENCY_KEY: &str = "x-weir-idempotency-key";
/// The run a call belongs to: the caller's run id (read from the route's `run_id_header`,
/// this name by default, before the caller's `x-weir-*` headers are stripped), vouched on.
pub const RUN_ID: &str = "x-weir-run-id";
/// The agent of the key that makes the call, when the route names one (`agent_header`).
pub const AGENT: &str = "x-weir-agent";
/// On calls to weir's approvals API: the tenant subtrees the key approves for (`approves`),
/// comma-separated.
pub const APPROVES: &str = "x-weir-approves";
/// The tool patterns whose calls wait for an approver (class `approval`), comma-separated: the
/// sidecar holds such a call when its answer makes one.
pub const TOOL_APPROVAL: &str = "x-weir-tool-approval";
/// With [`TOOL_APPROVAL`]: the terms those calls wait under
/// ([`crate::config::ApprovalTerms::to_header`]: ttl, most pending, self approval).
pub const APPROVAL_TERMS: &str = "x-weir-approval-terms";
/// `v1:<expires_ms>:<hex HMAC-SHA256>` over every other `x-weir-*` header.
pub const SIGNATURE: &str = "x-weir-signature";
/// The tenant's cap on KV tokens held by its running requests (`active_kv_tokens`), if any.
pub const KV_LIMIT: &str = "x-weir-kv-limit";
/// The models the key may use (`policy.models`), comma-separated; absent when it may use any.
/// The sidecar's model list shows only these.
pub const MODELS: &str = "x-weir-models";
/// The price table the filter charges at (`<currency>:<model>=<input>,<cached_input>,<output>;…`
/// per million tokens, [`crate::price::Prices::to_header`]): the ledger records each request's
/// cost at its model's entry.
pub const PRICE: &str = "x-weir-price";
/// On quota lease calls: the hex SHA-256 of the body, so the signature covers the body too.
pub const BODY_SHA256: &str = "x-weir-body-sha256";
/// On responses of shadow routes: what enforcement would have done.
pub const SHADOW_DECISION: &str = "x-weir-shadow";
/// The route the filter served the request on, as its metrics label it: the ledger records
/// it, so a rollout step's requests can be told from another route's.
pub const ROUTE: &str = "x-weir-route";
/// The mode the filter applied to this request: `off`, `shadow` or `enforce` (`off` too for a
/// request outside a route's `rollout_percent`). The ledger records it, so shadow rows are
/// told from enforced ones.
pub const MODE: &str = "x-weir-mode";
/// The modes [`MODE`] may carry.
pub const MODES: [&str; 3] = ["off", "shadow", "enforce"];

/// Scheduling weights outside this range are refused (in config and on the wire): a weight of
/// `1e300` or `NaN` would let one tenant starve every other.
pub const WEIGHT_RANGE: std::ops::RangeInclusive<f64> = 1e-3..=1e3;
/// Longest id weir accepts for a request or an idempotency key.
pub const MAX_ID_LEN: usize = 255;
/// Largest token count a trusted header may carry (far above any context window).
pub const MAX_TOKENS: u64 = 1 << 32;
/// Levels of a tenant path (`org/workspace/project/key`).
pub const MAX_TENANT_LEVELS: usize = 4;

/// A weight: a finite decimal within [`WEIGHT_RANGE`].
pub fn parse_weight(value: &str) -> Option<f64> {
    let w: f64 = value.parse().ok()?;
    (w.is_finite() && WEIGHT_RANGE.contains(&w)).then_some(w)
}

/// Weights as [`WEIGHT`] carries them.
pub fn format_weights(weights: &[f64]) -> String {
    weights
        .iter()
        .map(f64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The weights of a tenant path of `levels` levels: one valid weight per level. A single
/// weight is a filter from before per-level weights, whose one weight was the tenant's own:
/// it weighs the key among its siblings (never its org among the orgs), so sidecars can be
/// upgraded before the filters.
pub fn parse_weights(value: &str, levels: usize) -> Option<Vec<f64>> {
    let weights: Vec<f64> = value.split(',').map(parse_weight).collect::<Option<_>>()?;
    match weights[..] {
        [key] if levels > 1 => {
            let mut all = vec![1.0; levels - 1];
            all.push(key);
            Some(all)
        }
        _ => (weights.len() == levels).then_some(weights),
    }
}

/// A token count or cap: plain decimal digits, at most [`MAX_TOKENS`].
pub fn parse_tokens(value: &str) -> Option<u64> {
    if value.is_empty() || value.len() > 20 || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok().filter(|&n| n <= MAX_TOKENS)
}

/// One id of the hierarchy (or a tier name): letters, digits, `-`, `_`, `.`; not `.` or `..`.
pub fn is_level_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A tenant path: one to four level ids joined by `/`.
pub fn is_tenant_path(path: &str) -> bool {
    path.split('/').count() <= MAX_TENANT_LEVELS && path.split('/').all(is_level_id)
}

/// A request id or idempotency key: 1–255 visible ASCII characters (no spaces or controls), so
/// it is safe in logs, headers and ledger rows.
pub fn is_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_LEN && id.bytes().all(|b| b.is_ascii_graphic())
}

/// A model name: 1–255 visible ASCII characters other than `,` (the list separator).
pub fn is_model_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_ID_LEN
        && name.bytes().all(|b| b.is_ascii_graphic() && b != b',')
}

/// A list of model names as [`MODELS`] carries it.
pub fn parse_models(value: &str) -> Option<Vec<String>> {
    let names: Vec<String> = value.split(',').map(str::to_owned).collect();
    names.iter().all(|n| is_model_name(n)).then_some(names)
}

/// Whether a header is in weir's namespace (and must not come from a caller).
pub fn is_reserved(name: &str) -> bool {
    // Byte-wise: a name with a multi-byte character where the prefix ends must not panic.
    name.as_bytes()
        .get(..PREFIX.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(PREFIX.as_bytes()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn reserved_names_are_case_insensitive() {
        assert!(super::is_reserved("x-weir-tenant"));
        assert!(super::is_reserved("X-Weir-Anything"));
        assert!(!super::is_reserved("x-wei"));
        assert!(!super::is_reserved("authorization"));
        assert!(
            !super::is_reserved("x-weiré-tenant"),
            "no panic mid-character"
        );
        assert!(!super::is_reserved("x-wei\u{e9}"));
    }

    #[test]
    fn model_lists_are_comma_separated_visible_names() {
        use super::parse_models;
        assert_eq!(
            parse_models("llama-3.1-8b,org/model:v2"),
            Some(vec!["llama-3.1-8b".to_owned(), "org/model:v2".to_owned()])
        );
        for bad in ["", "a,,b", "a b", "a,", "é"] {
            assert_eq!(parse_models(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn weights_come_one_per_level() {
        use super::{format_weights, parse_weights};
        assert_eq!(format_weights(&[3.0, 1.0, 0.5, 1.0]), "3,1,0.5,1");
        assert_eq!(
            parse_weights("3,1,0.5,1", 4),
            Some(vec![3.0, 1.0, 0.5, 1.0])
        );
        assert_eq!(parse_weights("2", 1), Some(vec![2.0]));
        // An older filter's single weight is the key's, not its org's.
        assert_eq!(parse_weights("3", 4), Some(vec![1.0, 1.0, 1.0, 3.0]));
        for (bad, levels) in [
            ("3,1", 4),
            ("3,1,1,1,1", 4),
            ("1,,1", 3),
            ("1,NaN", 2),
            ("", 1),
        ] {
            assert_eq!(parse_weights(bad, levels), None, "{bad:?}");
        }
    }

    #[test]
    fn weights_are_finite_and_bounded() {
        use super::parse_weight;
        assert_eq!(parse_weight("2"), Some(2.0));
        assert_eq!(parse_weight("0.5"), Some(0.5));
        for bad in [
            "NaN", "inf", "-inf", "1e300", "0", "-1", "1e-9", "", " 1", "0x10",
        ] {
            assert_eq!(parse_weight(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn token_counts_are_plain_bounded_digits() {
        use super::parse_tokens;
        assert_eq!(parse_tokens("0"), Some(0));
        assert_eq!(parse_tokens("4096"), Some(4096));
        for bad in [
            "",
            "-1",
            "+1",
            "1.5",
            "1e3",
            " 5",
            "99999999999999999999999",
            "4294967297",
        ] {
            assert_eq!(parse_tokens(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tenant_paths_and_ids_are_sane() {
        use super::{is_id, is_tenant_path};
        assert!(is_tenant_path("acme/lab/e2e/plain"));
        assert!(is_tenant_path("anonymous"));
        for bad in [
            "",
            "a//b",
            "a/b/c/d/e",
            "../x",
            "a/./b",
            "a b",
            "a/b\n",
            "ü",
        ] {
            assert!(!is_tenant_path(bad), "{bad:?}");
        }
        assert!(is_id("weir-0123abcd"));
        assert!(!is_id(""));
        assert!(!is_id("has space"));
        assert!(!is_id(&"x".repeat(256)));
    }
}

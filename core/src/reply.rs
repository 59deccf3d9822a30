//! Local replies the gateway sends instead of forwarding, in the error shape of the API that was
//! called, and the rate-limit headers every answer carries.
//!
//! OpenAI's clients read `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset as a
//! duration: `250ms`, `12s`, `1m30s`); Anthropic's read
//! `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`
//! (reset as an RFC 3339 time). Each family reports the tightest limit on the key's path — the
//! one with the least left. Concurrency, which neither API defines, is reported under its own
//! name: `x-ratelimit-{limit,remaining}-concurrent-requests`.

use crate::error::{ApiError, ErrorShape};
use crate::fleet_config::Measure;
use crate::price;
use crate::reservation::{Denial, LimitKind, Standing};

/// On a `budget_exceeded` refusal: which budget (level, window, measure, limit, reset).
pub const BUDGET_HEADER: &str = "x-weir-budget-exceeded";

/// A complete response to send back.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn error(error: &ApiError, shape: ErrorShape) -> Reply {
        Reply {
            status: error.status,
            headers: vec![("content-type", "application/json".into())],
            body: error.to_json_in(shape).to_string().into_bytes(),
        }
    }

    /// 429 for a reservation that did not fit, with `Retry-After` (unless no wait would make it
    /// fit) and the refused limit's rate-limit headers.
    pub fn denied(denial: &Denial, shape: ErrorShape, now_ms: u64) -> Reply {
        let mut code = "rate_limit_exceeded";
        let mut budget = None;
        let (message, retry_after_ms, standing) = match denial {
            Denial::Limit {
                level,
                kind,
                limit,
                remaining,
                retry_after_ms,
            }
            | Denial::Unleased {
                level,
                kind,
                limit,
                remaining,
                retry_after_ms,
            } => {
                let message = format!(
                    "Rate limit reached for {} on {level}: limit {limit}, remaining {remaining}. \
                     Retry after {}.",
                    kind.name(),
                    duration(*retry_after_ms)
                );
                let standing = Standing {
                    kind: *kind,
                    limit: *limit,
                    remaining: *remaining,
                    reset_ms: *retry_after_ms,
                };
                (message, Some(*retry_after_ms), Some(standing))
            }
            Denial::TooLarge {
                level,
                kind,
                limit,
                requested,
            } => {
                code = "request_too_large";
                let message = format!(
                    "Request too large for {} on {level}: limit {limit}, requested {requested}. \
                     Reduce the prompt to run it: no wait makes it fit.",
                    kind.name()
                );
                (message, None, None)
            }
            Denial::QuotaUnavailable {
                level,
                kind,
                retry_after_ms,
            } => {
                code = "quota_unavailable";
                let message = format!(
                    "The fleet-wide {} on {level} cannot be checked: the quota store is \
                     unreachable and this limit fails closed. Retry after {}.",
                    kind.name(),
                    duration(*retry_after_ms)
                );
                (message, Some(*retry_after_ms), None)
            }
            Denial::BudgetExceeded {
                level,
                window,
                measure,
                limit,
                resets_ms,
            } => {
                code = "budget_exceeded";
                let amount = match measure {
                    Measure::Spend => format!("{}", *limit as f64 / price::MICROS),
                    _ => format!("{limit} tokens"),
                };
                let resets = rfc3339(*resets_ms);
                budget = Some(format!(
                    "level={level}; window={}; measure={}; limit={limit}; resets={resets}",
                    window.name(),
                    measure.name()
                ));
                let message = format!(
                    "The {} {} budget of {amount} on {level} is exhausted; it resets at {resets}.",
                    window.name(),
                    measure.name(),
                );
                (message, Some(resets_ms.saturating_sub(now_ms)), None)
            }
            Denial::Contended => (
                "Quota counters are busy; retry shortly.".to_owned(),
                Some(1_000),
                None,
            ),
        };
        let error = ApiError::rate_limited(message)
            .with_type(openai_type(denial))
            .with_code(code);
        let mut reply = Reply::error(&error, shape);
        if let Some(budget) = budget {
            reply.headers.push((BUDGET_HEADER, budget));
        }
        if let Some(retry_after_ms) = retry_after_ms {
            let seconds = retry_after_ms.div_ceil(1_000).max(1);
            reply.headers.push(("retry-after", seconds.to_string()));
        }
        reply
            .headers
            .extend(quota_headers(standing.as_slice(), shape, now_ms));
        reply
    }
}

/// OpenAI's `type` for a refusal names what ran out: billing quota (so clients tell a spent
/// budget from a rate limit), else the limit's measure, `tokens` or `requests`.
fn openai_type(denial: &Denial) -> &'static str {
    match denial {
        Denial::BudgetExceeded { .. } => "insufficient_quota",
        Denial::Limit { kind, .. }
        | Denial::Unleased { kind, .. }
        | Denial::QuotaUnavailable { kind, .. }
        | Denial::TooLarge { kind, .. }
            if matches!(kind, LimitKind::InputTokens | LimitKind::OutputTokens) =>
        {
            "tokens"
        }
        _ => "requests",
    }
}

/// Whether a response header is a rate-limit header of either API (an upstream's own, which
/// weir replaces: a hosted API's figures are the platform's, not the tenant's).
pub fn is_quota_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name.starts_with("x-ratelimit-") || name.starts_with("anthropic-ratelimit-")
}

/// The tightest of the limits of `kinds`: the one with the least left (then the smallest).
fn tightest(standing: &[Standing], kinds: &[LimitKind]) -> Option<Standing> {
    standing
        .iter()
        .filter(|s| kinds.contains(&s.kind))
        .min_by_key(|s| (s.remaining, s.limit))
        .copied()
}

/// The rate-limit headers for where the limits on a key's path stand.
pub fn quota_headers(
    standing: &[Standing],
    shape: ErrorShape,
    now_ms: u64,
) -> Vec<(&'static str, String)> {
    use LimitKind::{Concurrency, InputTokens, OutputTokens, Requests};
    let mut headers = Vec::new();
    let mut family = |names: [&'static str; 3], kinds: &[LimitKind]| {
        if let Some(s) = tightest(standing, kinds) {
            let reset = match shape {
                ErrorShape::OpenAi => duration(s.reset_ms),
                ErrorShape::Anthropic => rfc3339(now_ms.saturating_add(s.reset_ms)),
            };
            headers.push((names[0], s.limit.to_string()));
            headers.push((names[1], s.remaining.to_string()));
            headers.push((names[2], reset));
        }
    };
    match shape {
        ErrorShape::OpenAi => {
            family(
                [
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ],
                &[Requests],
            );
            family(
                [
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ],
                &[InputTokens, OutputTokens],
            );
        }
        ErrorShape::Anthropic => {
            for (names, kinds) in [
                (
                    [
                        "anthropic-ratelimit-requests-limit",
                        "anthropic-ratelimit-requests-remaining",
                        "anthropic-ratelimit-requests-reset",
                    ],
                    &[Requests][..],
                ),
                (
                    [
                        "anthropic-ratelimit-tokens-limit",
                        "anthropic-ratelimit-tokens-remaining",
                        "anthropic-ratelimit-tokens-reset",
                    ],
                    &[InputTokens, OutputTokens][..],
                ),
                (
                    [
                        "anthropic-ratelimit-input-tokens-limit",
                        "anthropic-ratelimit-input-tokens-remaining",
                        "anthropic-ratelimit-input-tokens-reset",
                    ],
                    &[InputTokens][..],
                ),
                (
                    [
                        "anthropic-ratelimit-output-tokens-limit",
                        "anthropic-ratelimit-output-tokens-remaining",
                        "anthropic-ratelimit-output-tokens-reset",
                    ],
                    &[OutputTokens][..],
                ),
            ] {
                family(names, kinds);
            }
        }
    }
    if let Some(s) = tightest(standing, &[Concurrency]) {
        headers.push(("x-ratelimit-limit-concurrent-requests", s.limit.to_string()));
        headers.push((
            "x-ratelimit-remaining-concurrent-requests",
            s.remaining.to_string(),
        ));
    }
    headers
}

/// OpenAI's reset format: `250ms`, `12s`, `1m30s`.
fn duration(ms: u64) -> String {
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    let s = ms.div_ceil(1_000);
    match (s / 60, s % 60) {
        (0, s) => format!("{s}s"),
        (m, s) => format!("{m}m{s}s"),
    }
}

/// A Unix time in ms as RFC 3339 in UTC, to the second (`2026-12-01T18:04:05Z`).
fn rfc3339(ms: u64) -> String {
    let secs = ms.div_ceil(1_000);
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = crate::fleet::civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header<'a>(reply: &'a [(&'static str, String)], name: &str) -> Option<&'a str> {
        reply
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn token_denials_carry_retry_after_and_ratelimit_headers() {
        let reply = Reply::denied(
            &Denial::Limit {
                level: "acme/w".into(),
                kind: LimitKind::InputTokens,
                limit: 1000,
                remaining: 12,
                retry_after_ms: 90_500,
            },
            ErrorShape::OpenAi,
            0,
        );
        assert_eq!(reply.status, 429);
        let h = &reply.headers;
        assert_eq!(header(h, "retry-after"), Some("91"));
        assert_eq!(header(h, "x-ratelimit-limit-tokens"), Some("1000"));
        assert_eq!(header(h, "x-ratelimit-remaining-tokens"), Some("12"));
        assert_eq!(header(h, "x-ratelimit-reset-tokens"), Some("1m31s"));
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("input_tokens_per_minute on acme/w")
        );
    }

    #[test]
    fn anthropic_denials_are_anthropic_shaped() {
        let reply = Reply::denied(
            &Denial::Limit {
                level: "acme".into(),
                kind: LimitKind::OutputTokens,
                limit: 500,
                remaining: 3,
                retry_after_ms: 2_000,
            },
            ErrorShape::Anthropic,
            1_764_612_245_000,
        );
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(body["error"]["type"], "rate_limit_error");
        let h = &reply.headers;
        assert_eq!(header(h, "retry-after"), Some("2"));
        assert_eq!(
            header(h, "anthropic-ratelimit-output-tokens-remaining"),
            Some("3")
        );
        assert_eq!(
            header(h, "anthropic-ratelimit-output-tokens-reset"),
            Some("2025-12-01T18:04:07Z")
        );
        assert_eq!(header(h, "anthropic-ratelimit-tokens-limit"), Some("500"));
        assert_eq!(header(h, "anthropic-ratelimit-input-tokens-limit"), None);
    }

    #[test]
    fn each_family_reports_its_tightest_limit() {
        let standing = [
            Standing {
                kind: LimitKind::Requests,
                limit: 60,
                remaining: 59,
                reset_ms: 1_000,
            },
            Standing {
                kind: LimitKind::InputTokens,
                limit: 100_000,
                remaining: 90_000,
                reset_ms: 6_000,
            },
            Standing {
                kind: LimitKind::InputTokens,
                limit: 20_000,
                remaining: 19_000,
                reset_ms: 3_000,
            },
            Standing {
                kind: LimitKind::OutputTokens,
                limit: 50_000,
                remaining: 40_000,
                reset_ms: 12_000,
            },
            Standing {
                kind: LimitKind::Concurrency,
                limit: 4,
                remaining: 3,
                reset_ms: 0,
            },
        ];
        let openai = quota_headers(&standing, ErrorShape::OpenAi, 0);
        assert_eq!(
            header(&openai, "x-ratelimit-remaining-requests"),
            Some("59")
        );
        assert_eq!(header(&openai, "x-ratelimit-limit-tokens"), Some("20000"));
        assert_eq!(header(&openai, "x-ratelimit-reset-tokens"), Some("3s"));
        assert_eq!(
            header(&openai, "x-ratelimit-limit-concurrent-requests"),
            Some("4")
        );
        assert_eq!(
            header(&openai, "x-ratelimit-remaining-concurrent-requests"),
            Some("3")
        );
        let anthropic = quota_headers(&standing, ErrorShape::Anthropic, 0);
        assert_eq!(
            header(&anthropic, "anthropic-ratelimit-input-tokens-remaining"),
            Some("19000")
        );
        assert_eq!(
            header(&anthropic, "anthropic-ratelimit-output-tokens-remaining"),
            Some("40000")
        );
        assert_eq!(
            header(&anthropic, "anthropic-ratelimit-requests-reset"),
            Some("1970-01-01T00:00:01Z")
        );
        assert!(quota_headers(&[], ErrorShape::OpenAi, 0).is_empty());
        assert!(is_quota_header("X-RateLimit-Remaining-Tokens") && !is_quota_header("retry-after"));
    }

    #[test]
    fn times_are_rfc3339_in_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(4_107_542_399_000), "2100-02-28T23:59:59Z");
    }

    #[test]
    fn a_request_too_large_names_the_limit_and_the_size_and_no_wait() {
        let reply = Reply::denied(
            &Denial::TooLarge {
                level: "acme/w/p/k".into(),
                kind: LimitKind::InputTokens,
                limit: 60_000,
                requested: 80_000,
            },
            ErrorShape::OpenAi,
            0,
        );
        assert_eq!(reply.status, 429);
        assert_eq!(header(&reply.headers, "retry-after"), None);
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(body["error"]["code"], "request_too_large");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("input_tokens_per_minute on acme/w/p/k")
                && message.contains("limit 60000, requested 80000"),
            "{message}"
        );
    }

    #[test]
    fn short_waits_round_up_to_a_second() {
        let reply = Reply::denied(
            &Denial::Limit {
                level: "a".into(),
                kind: LimitKind::Concurrency,
                limit: 2,
                remaining: 0,
                retry_after_ms: 250,
            },
            ErrorShape::OpenAi,
            0,
        );
        assert_eq!(header(&reply.headers, "retry-after"), Some("1"));
        assert_eq!(
            header(&reply.headers, "x-ratelimit-remaining-concurrent-requests"),
            Some("0")
        );
        assert_eq!(
            Reply::denied(&Denial::Contended, ErrorShape::OpenAi, 0).status,
            429
        );
    }
}

//! Local replies the gateway sends instead of forwarding, in the error shape of the API that was
//! called, and the rate-limit headers every answer carries.
//!
//! OpenAI's clients read `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset as a
//! duration: `250ms`, `12s`, `1m30s`); Anthropic's read
//! `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`
//! (reset as an RFC 3339 time). Each family reports the tightest limit on the key's path — the
//! one with the least left. Concurrency, which neither API defines, is reported under its own
//! name: `x-ratelimit-{limit,remaining}-concurrent-requests`.

use serde_json::{Value, json};

use crate::endpoint::Endpoint;
use crate::error::{ApiError, ErrorShape};
use crate::fleet::Window;
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
        let refusal = Refusal::of(denial, now_ms);
        let error = ApiError::rate_limited(refusal.message)
            .with_type(openai_type(denial))
            .with_code(refusal.code);
        let mut reply = Reply::error(&error, shape);
        if let Some(budget) = refusal.budget {
            reply.headers.push((BUDGET_HEADER, budget));
        }
        if let Some(retry_after_ms) = refusal.retry_after_ms {
            let seconds = retry_after_ms.div_ceil(1_000).max(1);
            reply.headers.push(("retry-after", seconds.to_string()));
        }
        reply
            .headers
            .extend(quota_headers(refusal.standing.as_slice(), shape, now_ms));
        reply
    }
}

/// The last event of a stream that weir ends itself (a replica lost, a tool call withheld), in
/// the event shape of the API that was streaming, so the client's SDK reports an error rather
/// than a cut connection: an error chunk and `[DONE]` for Chat Completions and Completions (the
/// `openai` SDK raises on a chunk with an `error`), an `error` event for the Responses API (the
/// SDK yields it as a `ResponseErrorEvent`), Anthropic's `error` event for Messages (its SDK
/// raises on it). weir's own fields ride in the error object.
pub fn stream_error_event(endpoint: Endpoint, error: &ApiError) -> Vec<u8> {
    let text = match endpoint {
        Endpoint::Responses => {
            let mut body = error.to_json();
            let mut event = body
                .get_mut("error")
                .map(Value::take)
                .unwrap_or_else(|| json!({}));
            if let Some(event) = event.as_object_mut() {
                event.insert("type".into(), "error".into());
                event.insert("sequence_number".into(), 0.into());
            }
            format!("event: error\ndata: {event}\n\n")
        }
        Endpoint::Messages => format!(
            "event: error\ndata: {}\n\n",
            error.to_json_in(ErrorShape::Anthropic)
        ),
        Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Embeddings => {
            format!("data: {}\n\ndata: [DONE]\n\n", error.to_json())
        }
    };
    text.into_bytes()
}

/// What a 429 tells the client about its denial.
struct Refusal {
    code: &'static str,
    message: String,
    /// When a retry could fit; `None` when no wait would make it.
    retry_after_ms: Option<u64>,
    /// The refused limit, for its rate-limit headers.
    standing: Option<Standing>,
    /// The spent budget, for [`BUDGET_HEADER`].
    budget: Option<String>,
}

impl Refusal {
    fn of(denial: &Denial, now_ms: u64) -> Refusal {
        match denial {
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
            } => Refusal::limit_reached(
                level,
                Standing {
                    kind: *kind,
                    limit: *limit,
                    remaining: *remaining,
                    reset_ms: *retry_after_ms,
                },
            ),
            Denial::TooLarge {
                level,
                kind,
                limit,
                requested,
            } => Refusal::too_large(level, *kind, *limit, *requested),
            Denial::QuotaUnavailable {
                level,
                kind,
                retry_after_ms,
            } => Refusal::quota_unavailable(level, *kind, *retry_after_ms),
            Denial::BudgetExceeded {
                level,
                window,
                measure,
                limit,
                resets_ms,
            } => Refusal::budget_exceeded(level, *window, *measure, *limit, *resets_ms, now_ms),
            Denial::Contended => Refusal {
                code: "rate_limit_exceeded",
                message: "Quota counters are busy; retry shortly.".to_owned(),
                retry_after_ms: Some(1_000),
                standing: None,
                budget: None,
            },
        }
    }

    /// A limit with too little left now: retry once the request would fit.
    fn limit_reached(level: &str, standing: Standing) -> Refusal {
        let Standing {
            kind,
            limit,
            remaining,
            reset_ms,
        } = standing;
        let message = format!(
            "Rate limit reached for {} on {level}: limit {limit}, remaining {remaining}. \
             Retry after {}.",
            kind.name(),
            duration(reset_ms)
        );
        Refusal {
            code: "rate_limit_exceeded",
            message,
            retry_after_ms: Some(reset_ms),
            standing: Some(standing),
            budget: None,
        }
    }

    /// A request larger than the limit itself: no wait makes it fit.
    fn too_large(level: &str, kind: LimitKind, limit: u64, requested: u64) -> Refusal {
        let message = format!(
            "Request too large for {} on {level}: limit {limit}, requested {requested}. \
             Reduce the prompt to run it: no wait makes it fit.",
            kind.name()
        );
        Refusal {
            code: "request_too_large",
            message,
            retry_after_ms: None,
            standing: None,
            budget: None,
        }
    }

    /// A fleet-wide limit that fails closed while the quota store is unreachable.
    fn quota_unavailable(level: &str, kind: LimitKind, retry_after_ms: u64) -> Refusal {
        let message = format!(
            "The fleet-wide {} on {level} cannot be checked: the quota store is \
             unreachable and this limit fails closed. Retry after {}.",
            kind.name(),
            duration(retry_after_ms)
        );
        Refusal {
            code: "quota_unavailable",
            message,
            retry_after_ms: Some(retry_after_ms),
            standing: None,
            budget: None,
        }
    }

    /// A spent budget: retry when its window resets.
    fn budget_exceeded(
        level: &str,
        window: Window,
        measure: Measure,
        limit: u64,
        resets_ms: u64,
        now_ms: u64,
    ) -> Refusal {
        let amount = match measure {
            Measure::Spend => format!("{}", limit as f64 / price::MICROS),
            _ => format!("{limit} tokens"),
        };
        let resets = rfc3339(resets_ms);
        let budget = format!(
            "level={level}; window={}; measure={}; limit={limit}; resets={resets}",
            window.name(),
            measure.name()
        );
        let message = format!(
            "The {} {} budget of {amount} on {level} is exhausted; it resets at {resets}.",
            window.name(),
            measure.name(),
        );
        Refusal {
            code: "budget_exceeded",
            message,
            retry_after_ms: Some(resets_ms.saturating_sub(now_ms)),
            standing: None,
            budget: Some(budget),
        }
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

/// A family of rate-limit headers — its limit, remaining and reset header names — and the
/// limits whose tightest it reports.
type Family = ([&'static str; 3], &'static [LimitKind]);

const OPENAI_FAMILIES: [Family; 2] = [
    (
        [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ],
        &[LimitKind::Requests],
    ),
    (
        [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ],
        &[LimitKind::InputTokens, LimitKind::OutputTokens],
    ),
];

const ANTHROPIC_FAMILIES: [Family; 4] = [
    (
        [
            "anthropic-ratelimit-requests-limit",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
        ],
        &[LimitKind::Requests],
    ),
    (
        [
            "anthropic-ratelimit-tokens-limit",
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-tokens-reset",
        ],
        &[LimitKind::InputTokens, LimitKind::OutputTokens],
    ),
    (
        [
            "anthropic-ratelimit-input-tokens-limit",
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-input-tokens-reset",
        ],
        &[LimitKind::InputTokens],
    ),
    (
        [
            "anthropic-ratelimit-output-tokens-limit",
            "anthropic-ratelimit-output-tokens-remaining",
            "anthropic-ratelimit-output-tokens-reset",
        ],
        &[LimitKind::OutputTokens],
    ),
];

/// The rate-limit headers for where the limits on a key's path stand.
pub fn quota_headers(
    standing: &[Standing],
    shape: ErrorShape,
    now_ms: u64,
) -> Vec<(&'static str, String)> {
    let families: &[Family] = match shape {
        ErrorShape::OpenAi => &OPENAI_FAMILIES,
        ErrorShape::Anthropic => &ANTHROPIC_FAMILIES,
    };
    let mut headers = Vec::new();
    for &([limit, remaining, reset], kinds) in families {
        if let Some(s) = tightest(standing, kinds) {
            let reset_at = match shape {
                ErrorShape::OpenAi => duration(s.reset_ms),
                ErrorShape::Anthropic => rfc3339(now_ms.saturating_add(s.reset_ms)),
            };
            headers.push((limit, s.limit.to_string()));
            headers.push((remaining, s.remaining.to_string()));
            headers.push((reset, reset_at));
        }
    }
    if let Some(s) = tightest(standing, &[LimitKind::Concurrency]) {
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

    #[test]
    fn each_api_s_meter_reads_a_stream_error_event_as_an_error_with_weir_s_fields() {
        let error = ApiError::new(403, "withheld")
            .with_type("tool_blocked")
            .with_code("tool_blocked")
            .with_extra("tool", "shell");
        for endpoint in Endpoint::ALL {
            let event = stream_error_event(endpoint, &error);
            let mut meter = crate::meter::StreamMeter::new(endpoint, false);
            meter.feed(&event, true);
            assert_eq!(meter.error_events(), 1, "{endpoint:?}");
            let first = &event[..crate::sse::event_end(&event).unwrap()];
            let data = crate::sse::event_data(first).unwrap();
            let data: Value = serde_json::from_slice(&data).unwrap();
            let object = match endpoint {
                Endpoint::Responses => &data,
                _ => &data["error"],
            };
            assert_eq!(object["tool"], "shell", "{endpoint:?}: {data}");
            assert_eq!(object["code"], "tool_blocked", "{endpoint:?}: {data}");
        }
        let chat = stream_error_event(Endpoint::ChatCompletions, &error);
        assert!(chat.ends_with(b"data: [DONE]\n\n"));
        let responses = stream_error_event(Endpoint::Responses, &error);
        let data = crate::sse::event_data(&responses).unwrap();
        let data: Value = serde_json::from_slice(&data).unwrap();
        assert_eq!(
            data["type"], "error",
            "the event's type, not OpenAI's error type"
        );
    }

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

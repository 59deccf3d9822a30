//! Local replies the gateway sends instead of forwarding: OpenAI-shaped error bodies, with
//! `Retry-After` and OpenAI-style `x-ratelimit-*` headers when quota ran out.

use crate::error::ApiError;
use crate::reservation::{Denial, LimitKind};

/// A complete response to send back.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn error(error: &ApiError) -> Reply {
        Reply {
            status: error.status,
            headers: vec![("content-type", "application/json".into())],
            body: error.to_json().to_string().into_bytes(),
        }
    }

    /// 429 for a reservation that did not fit.
    pub fn denied(denial: &Denial) -> Reply {
        let (message, retry_after_ms, family) = match denial {
            Denial::Limit {
                level,
                kind,
                limit,
                remaining,
                retry_after_ms,
            } => {
                let family = match kind {
                    LimitKind::InputTokens | LimitKind::OutputTokens => "tokens",
                    LimitKind::Requests | LimitKind::Concurrency => "requests",
                };
                let message = format!(
                    "Rate limit reached for {} on {level}: limit {limit}, remaining {remaining}. \
                     Retry after {}.",
                    kind.name(),
                    duration(*retry_after_ms)
                );
                (message, *retry_after_ms, Some((family, *limit, *remaining)))
            }
            Denial::Contended => (
                "Quota counters are busy; retry shortly.".to_owned(),
                1_000,
                None,
            ),
        };
        let error = ApiError::rate_limited(message).with_code("rate_limit_exceeded");
        let mut reply = Reply::error(&error);
        let seconds = retry_after_ms.div_ceil(1_000).max(1);
        reply.headers.push(("retry-after", seconds.to_string()));
        if let Some((family, limit, remaining)) = family {
            let (l, r, t) = match family {
                "tokens" => (
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ),
                _ => (
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ),
            };
            reply.headers.push((l, limit.to_string()));
            reply.headers.push((r, remaining.to_string()));
            reply.headers.push((t, duration(retry_after_ms)));
        }
        reply
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_denials_carry_retry_after_and_ratelimit_headers() {
        let reply = Reply::denied(&Denial::Limit {
            level: "acme/w".into(),
            kind: LimitKind::InputTokens,
            limit: 1000,
            remaining: 12,
            retry_after_ms: 90_500,
        });
        assert_eq!(reply.status, 429);
        let header = |n: &str| {
            reply
                .headers
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(header("retry-after"), Some("91"));
        assert_eq!(header("x-ratelimit-limit-tokens"), Some("1000"));
        assert_eq!(header("x-ratelimit-remaining-tokens"), Some("12"));
        assert_eq!(header("x-ratelimit-reset-tokens"), Some("1m31s"));
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
    fn short_waits_round_up_to_a_second() {
        let reply = Reply::denied(&Denial::Limit {
            level: "a".into(),
            kind: LimitKind::Concurrency,
            limit: 2,
            remaining: 0,
            retry_after_ms: 250,
        });
        assert!(reply.headers.contains(&("retry-after", "1".into())));
        assert!(
            reply
                .headers
                .contains(&("x-ratelimit-reset-requests", "250ms".into()))
        );
        assert_eq!(Reply::denied(&Denial::Contended).status, 429);
    }
}

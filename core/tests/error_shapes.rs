//! weir's error bodies against what the providers send for the same exit: one row per exit the
//! gateway answers itself, with OpenAI's `type` and `code` and Anthropic's `type`, each row
//! citing where the provider's values are documented or shown verbatim.
//!
//! OpenAI documents its statuses (<https://platform.openai.com/docs/guides/error-codes>) but no
//! body; the bodies its API sends are quoted whole in the issue threads cited per row. Anthropic
//! documents a `type` per status (<https://docs.claude.com/en/api/errors>).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use serde_json::{Value, json};
use weir_core::error::{ApiError, ErrorShape, from_engine};
use weir_core::fleet::Window;
use weir_core::fleet_config::Measure;
use weir_core::reply::Reply;
use weir_core::reservation::{Denial, LimitKind};

/// One exit: how weir builds it, and what each provider sends for it.
struct Row {
    exit: &'static str,
    error: fn() -> Body,
    status: u16,
    openai_type: &'static str,
    openai_code: Option<&'static str>,
    anthropic_type: &'static str,
}

/// A body in both shapes, with its status.
struct Body {
    status: u16,
    openai: Value,
    anthropic: Value,
}

fn of(error: ApiError) -> Body {
    Body {
        status: error.status,
        openai: error.to_json_in(ErrorShape::OpenAi),
        anthropic: error.to_json_in(ErrorShape::Anthropic),
    }
}

fn denied(denial: Denial) -> Body {
    let body = |shape| {
        let reply = Reply::denied(&denial, shape, 0);
        (reply.status, serde_json::from_slice(&reply.body).unwrap())
    };
    let (status, openai) = body(ErrorShape::OpenAi);
    let (_, anthropic) = body(ErrorShape::Anthropic);
    Body {
        status,
        openai,
        anthropic,
    }
}

fn limit(kind: LimitKind) -> Denial {
    Denial::Limit {
        level: "acme".into(),
        kind,
        limit: 10,
        remaining: 0,
        retry_after_ms: 1_000,
    }
}

const TABLE: &[Row] = &[
    // OpenAI, a request it cannot read: {"message": "Invalid URL (POST /v1)", "type":
    // "invalid_request_error", "param": null, "code": null}
    // (https://github.com/binary-husky/gpt_academic/issues/892). Anthropic: 400
    // invalid_request_error (https://docs.claude.com/en/api/errors).
    Row {
        exit: "malformed request",
        error: || of(ApiError::bad_request("malformed JSON")),
        status: 400,
        openai_type: "invalid_request_error",
        openai_code: None,
        anthropic_type: "invalid_request_error",
    },
    // OpenAI: "This model's maximum context length is …", invalid_request_error, param
    // "messages", code "context_length_exceeded"
    // (https://platform.openai.com/docs/guides/error-codes, and vLLM's message, which copies it).
    Row {
        exit: "over the context",
        error: || of(ApiError::context_length_exceeded(100, 90, 20)),
        status: 400,
        openai_type: "invalid_request_error",
        openai_code: Some("context_length_exceeded"),
        anthropic_type: "invalid_request_error",
    },
    // OpenAI, a wrong key: 401 {"message": "Incorrect API key provided: …", "type":
    // "invalid_request_error", "param": None, "code": "invalid_api_key"}
    // (https://github.com/popjane/free_chatgpt_api/issues/3). Anthropic: 401
    // authentication_error (https://docs.claude.com/en/api/errors).
    Row {
        exit: "unknown API key",
        error: || of(ApiError::new(401, "Incorrect API key provided.").with_code("invalid_api_key")),
        status: 401,
        openai_type: "invalid_request_error",
        openai_code: Some("invalid_api_key"),
        anthropic_type: "authentication_error",
    },
    // A key whose policy does not allow the model. OpenAI sends invalid_request_error for the
    // 4xx it refuses (the rows above); weir's own code names the refusal. Anthropic: 403
    // permission_error (https://docs.claude.com/en/api/errors).
    Row {
        exit: "model not allowed",
        error: || of(ApiError::new(403, "model 'm' is not allowed").with_code("model_not_allowed")),
        status: 403,
        openai_type: "invalid_request_error",
        openai_code: Some("model_not_allowed"),
        anthropic_type: "permission_error",
    },
    // OpenAI: 404 {"message": "The model `computer-use-preview-2025-03-11` does not exist or you
    // do not have access to it.", "type": "invalid_request_error", "param": null, "code":
    // "model_not_found"} (https://github.com/openai/openai-agents-python/issues/458).
    // Anthropic: 404 not_found_error (https://docs.claude.com/en/api/errors).
    Row {
        exit: "unknown model",
        error: || of(ApiError::model_not_found("nope")),
        status: 404,
        openai_type: "invalid_request_error",
        openai_code: Some("model_not_found"),
        anthropic_type: "not_found_error",
    },
    // A method a path does not take. Anthropic: "We may also use this error type for other 4XX
    // status codes not listed" (https://docs.claude.com/en/api/errors).
    Row {
        exit: "method not allowed",
        error: || of(ApiError::new(405, "use POST")),
        status: 405,
        openai_type: "invalid_request_error",
        openai_code: None,
        anthropic_type: "invalid_request_error",
    },
    // Anthropic: 413 request_too_large (https://docs.claude.com/en/api/errors).
    Row {
        exit: "body too large",
        error: || of(ApiError::payload_too_large(4 << 20)),
        status: 413,
        openai_type: "invalid_request_error",
        openai_code: None,
        anthropic_type: "request_too_large",
    },
    // OpenAI, a rate limit: 429 {"message": "Rate limit reached for gpt-4 … on tokens per min
    // …", "type": "tokens", "param": null, "code": "rate_limit_exceeded"}
    // (https://github.com/jorge-menjivar/unsaged/issues/53,
    // https://github.com/TheR1D/shell_gpt/issues/653): the type is the limit's measure, `requests`
    // for requests per minute. Anthropic: 429 rate_limit_error
    // (https://docs.claude.com/en/api/errors).
    Row {
        exit: "over requests per minute",
        error: || denied(limit(LimitKind::Requests)),
        status: 429,
        openai_type: "requests",
        openai_code: Some("rate_limit_exceeded"),
        anthropic_type: "rate_limit_error",
    },
    Row {
        exit: "over input tokens per minute",
        error: || denied(limit(LimitKind::InputTokens)),
        status: 429,
        openai_type: "tokens",
        openai_code: Some("rate_limit_exceeded"),
        anthropic_type: "rate_limit_error",
    },
    Row {
        exit: "over concurrent requests",
        error: || denied(limit(LimitKind::Concurrency)),
        status: 429,
        openai_type: "requests",
        openai_code: Some("rate_limit_exceeded"),
        anthropic_type: "rate_limit_error",
    },
    // OpenAI, spent credit: 429 {"message": "You exceeded your current quota, …", "type":
    // "insufficient_quota", "param": null, "code": "insufficient_quota"}
    // (https://github.com/ChatGPTNextWeb/NextChat/issues/3123); weir's code names which budget
    // kind of refusal it is. Anthropic: 429 rate_limit_error.
    Row {
        exit: "budget spent",
        error: || {
            denied(Denial::BudgetExceeded {
                level: "acme".into(),
                window: Window::Month,
                measure: Measure::Spend,
                limit: 1_000_000,
                resets_ms: 1_000,
            })
        },
        status: 429,
        openai_type: "insufficient_quota",
        openai_code: Some("budget_exceeded"),
        anthropic_type: "rate_limit_error",
    },
    // OpenAI: 500 {"message": "The server had an error processing your request. …", "type":
    // "server_error", "param": null, "code": null}
    // (https://github.com/openai/openai-cua-sample-app/issues/54). Anthropic: 500 api_error
    // (https://docs.claude.com/en/api/errors).
    Row {
        exit: "internal error",
        error: || of(ApiError::internal("the request lost its admission state")),
        status: 500,
        openai_type: "server_error",
        openai_code: None,
        anthropic_type: "api_error",
    },
    Row {
        exit: "engine unreachable",
        error: || {
            of(ApiError::new(
                502,
                "the engine replica could not be reached; retry",
            ))
        },
        status: 502,
        openai_type: "server_error",
        openai_code: None,
        anthropic_type: "api_error",
    },
    // Anthropic: overloaded_error for an overloaded API (https://docs.claude.com/en/api/errors).
    Row {
        exit: "no capacity",
        error: || of(ApiError::new(503, "retry").with_code("queue_deadline")),
        status: 503,
        openai_type: "server_error",
        openai_code: Some("queue_deadline"),
        anthropic_type: "overloaded_error",
    },
    Row {
        exit: "engine too slow",
        error: || of(ApiError::new(504, "retry").with_code("response_deadline")),
        status: 504,
        openai_type: "server_error",
        openai_code: Some("response_deadline"),
        anthropic_type: "api_error",
    },
];

#[test]
fn every_exit_carries_the_provider_s_own_type_and_code() {
    for row in TABLE {
        let body = (row.error)();
        let exit = row.exit;
        assert_eq!(body.status, row.status, "{exit}");
        let openai = &body.openai["error"];
        assert_eq!(openai["type"], row.openai_type, "{exit}: {openai}");
        assert_eq!(openai["code"], json!(row.openai_code), "{exit}: {openai}");
        assert!(openai["message"].is_string(), "{exit}: {openai}");
        assert!(
            openai.as_object().is_some_and(|o| o.contains_key("param")),
            "{exit}: {openai}"
        );
        let anthropic = &body.anthropic;
        assert_eq!(anthropic["type"], "error", "{exit}: {anthropic}");
        assert_eq!(
            anthropic["error"]["type"], row.anthropic_type,
            "{exit}: {anthropic}"
        );
        assert!(anthropic["error"]["message"].is_string(), "{exit}");
    }
}

#[test]
fn no_status_becomes_a_numeric_code() {
    for status in 400..600 {
        let body = ApiError::new(status, "x").to_json();
        assert!(body["error"]["code"].is_null(), "{status}: {body}");
        let kind = body["error"]["type"].as_str().unwrap_or_default();
        let expected = match status {
            429 => "requests",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        };
        assert_eq!(kind, expected, "{status}");
    }
}

/// An engine's own error answer, relayed with the providers' values: vLLM and llama.cpp's server
/// answer with their own `type` and the status as `code` (both captured in the engines'
/// reference captures); weir keeps the engine's message, `param` and a string `code`.
#[test]
fn an_engine_s_error_answer_carries_the_provider_s_values_and_its_own_message() {
    let vllm = br#"{"error":{"message":"The model `nope` does not exist.","type":"NotFoundError","param":"model","code":404}}"#;
    let v = from_engine(404, vllm, ErrorShape::OpenAi).expect("an error object");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(
        v["error"]["code"],
        Value::Null,
        "never the status as a number"
    );
    assert_eq!(v["error"]["param"], "model");
    assert_eq!(v["error"]["message"], "The model `nope` does not exist.");
    let llama = br#"{"error":{"code":400,"message":"Expected 'messages' to be an array","type":"invalid_request_error"}}"#;
    let v = from_engine(400, llama, ErrorShape::Anthropic).expect("an error object");
    assert_eq!(
        v,
        json!({"type": "error", "error": {"type": "invalid_request_error",
            "message": "Expected 'messages' to be an array"}})
    );
    let coded = br#"{"error":{"message":"too long","type":"BadRequestError","code":"context_length_exceeded"}}"#;
    let v = from_engine(400, coded, ErrorShape::OpenAi).expect("an error object");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let v = from_engine(500, br#"{"error":"boom"}"#, ErrorShape::OpenAi).expect("a string error");
    assert_eq!(v["error"]["type"], "server_error");
    assert_eq!(from_engine(400, b"not json", ErrorShape::OpenAi), None);
    assert_eq!(
        from_engine(400, br#"{"detail":"x"}"#, ErrorShape::OpenAi),
        None
    );
}

//! The front door's decision on a request body: is it well-formed and allowed, how many tokens
//! does it bring and may it take, and what the upstream receives instead of it.
//!
//! Nothing is silently downgraded: a request over a limit is rejected with the limit named.
//! The only value weir fills in is `max_tokens` when the request sets none and the tenant's
//! config states a cap (`default_max_tokens`, else the `max_output_tokens` limit).

use crate::config::{Config, Tenant};
use crate::estimate::{self, Method};
use crate::json::{self, TopLevel};
use crate::openai::{ApiError, CompletionRequest, Endpoint};

/// Output tokens reserved when neither the request, the tenant nor the model bounds the answer.
/// Only the reservation uses it; settlement charges what the engine reports.
pub const UNBOUNDED_OUTPUT_RESERVATION: u64 = 1024;

/// A request that may proceed.
#[derive(Clone, Debug, PartialEq)]
pub struct Admitted {
    pub model: String,
    pub prompt_tokens: u64,
    pub method: Method,
    /// Output tokens to reserve: the request's cap, or the cap weir filled in.
    pub reserved_output: u64,
    pub stream: bool,
    /// The client asked for the usage chunk (weir always asks the engine for it).
    pub client_wants_usage: bool,
    /// The body to send upstream, when it differs from the client's.
    pub rewritten_body: Option<Vec<u8>>,
}

/// A request turned away, with the metric label of why.
#[derive(Clone, Debug, PartialEq)]
pub struct Rejection {
    pub error: ApiError,
    pub reason: &'static str,
}

fn reject(reason: &'static str, error: ApiError) -> Rejection {
    Rejection { error, reason }
}

/// Decides on a complete request body.
pub fn admit(
    config: &Config,
    tenant: &Tenant,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<Admitted, Rejection> {
    if body.len() > config.max_body_bytes {
        return Err(reject(
            "body_too_large",
            ApiError::payload_too_large(config.max_body_bytes),
        ));
    }
    let malformed = |e: serde_json::Error| {
        reject(
            "malformed_body",
            ApiError::bad_request(format!("malformed JSON: {e}")),
        )
    };
    json::check_unique_keys(body).map_err(malformed)?;
    let fields = TopLevel::parse(body).map_err(|e| {
        reject(
            "malformed_body",
            ApiError::bad_request(format!("the request body must be a JSON object: {e}")),
        )
    })?;
    let req = CompletionRequest::from_body(body).map_err(|e| {
        reject(
            "malformed_body",
            ApiError::bad_request(format!("invalid request: {e}")),
        )
    })?;
    req.validate(endpoint)
        .map_err(|e| reject("invalid_request", e))?;
    refuse_request_templates(&fields)?;

    if !tenant.may_use(&req.model) {
        return Err(reject(
            "model_not_allowed",
            ApiError::new(
                403,
                "PermissionDeniedError",
                format!("model '{}' is not allowed for this API key", req.model),
            )
            .with_param("model")
            .with_code("model_not_allowed"),
        ));
    }

    let output_cap = tenant.tightest(|l| l.max_output_tokens);
    if let Some(cap) = output_cap {
        check_output_limits(&req, cap)?;
    }
    // weir fills in `max_tokens` only when the request sets no OpenAI output limit; a request
    // with only llama.cpp's `n_predict` still gets it, for engines that ignore `n_predict`.
    let filled_in = match req.max_output_tokens() {
        Some(_) => None,
        None => tenant.default_max_tokens.or(output_cap),
    };
    let requested = req.largest_output_limit().map(u64::from);

    let (encoding, model_context) = config.model(&req.model);
    let (prompt_tokens, method) =
        estimate::prompt_tokens(&req, endpoint, encoding, config.estimator.exact_below_bytes);

    let context_cap = [model_context, tenant.tightest(|l| l.max_context_tokens)]
        .into_iter()
        .flatten()
        .min();
    let output = requested.max(filled_in);
    if let Some(cap) = context_cap
        && prompt_tokens + output.unwrap_or(1) > cap
    {
        return Err(reject(
            "context_length_exceeded",
            ApiError::context_length_exceeded(cap, prompt_tokens, output.unwrap_or(0)),
        ));
    }
    let reserved_output = output
        .or_else(|| context_cap.map(|cap| cap - prompt_tokens))
        .unwrap_or(UNBOUNDED_OUTPUT_RESERVATION);

    let stream = req.is_streaming();
    let client_wants_usage = req.wants_stream_usage();
    let rewritten_body = rewrite(fields, stream && !client_wants_usage, filled_in)
        .map_err(|e| reject("internal", ApiError::internal(e.to_string())))?;
    Ok(Admitted {
        model: req.model,
        prompt_tokens,
        method,
        reserved_output,
        stream,
        client_wants_usage,
        rewritten_body,
    })
}

/// Body fields that make the engine render the prompt from a template the request brings
/// (vLLM's `chat_template`; a few bytes of Jinja can loop into any number of tokens), so the
/// prompt weir counted is not the one the engine runs.
pub const REQUEST_TEMPLATE_FIELDS: [&str; 1] = ["chat_template"];

/// Refuses a request that brings its own prompt template (see [`REQUEST_TEMPLATE_FIELDS`]).
fn refuse_request_templates(fields: &TopLevel) -> Result<(), Rejection> {
    let brought = REQUEST_TEMPLATE_FIELDS
        .into_iter()
        .find(|f| fields.get(f).is_some_and(|v| v.get() != "null"));
    match brought {
        Some(field) => Err(reject(
            "invalid_request",
            ApiError::bad_request(format!(
                "{field} is not accepted: the prompt is rendered with the model's own template, \
                 so that what is admitted is what the engine runs"
            ))
            .with_param(field),
        )),
        None => Ok(()),
    }
}

/// Refuses a request when any output limit it sets, whichever an engine reads, is over the
/// key's per-request cap.
fn check_output_limits(req: &CompletionRequest, cap: u64) -> Result<(), Rejection> {
    match req.output_limits().find(|&(_, l)| u64::from(l) > cap) {
        Some((param, asked)) => Err(reject(
            "max_tokens_over_limit",
            ApiError::bad_request(format!(
                "{param} {asked} exceeds this key's limit of {cap} output tokens per request"
            ))
            .with_param(param),
        )),
        None => Ok(()),
    }
}

/// Body fields by which a request steers the engine itself, across the tenant boundary, and
/// that only weir may set: vLLM's `cache_salt` (prefix-cache scope; the sidecar sets a
/// per-tenant one), `priority` (reorders the engine's own queue: queueing belongs to weir),
/// `kv_transfer_params` (KV blocks to pull from a prefill instance, another tenant's if
/// guessed) and `request_id` (the engine's id for the request; a collision mixes or aborts
/// another tenant's).
pub const ENGINE_CONTROL_FIELDS: [&str; 4] =
    ["cache_salt", "priority", "kv_transfer_params", "request_id"];

/// Strips the [`ENGINE_CONTROL_FIELDS`], asks the engine for stream usage, and fills in
/// `max_tokens`; returns the new body if anything changed.
fn rewrite(
    mut fields: TopLevel,
    ask_usage: bool,
    max_tokens: Option<u64>,
) -> Result<Option<Vec<u8>>, serde_json::Error> {
    let mut changed = false;
    for field in ENGINE_CONTROL_FIELDS {
        changed |= fields.remove(field);
    }
    if ask_usage {
        let mut options = fields
            .get("stream_options")
            .and_then(|o| TopLevel::parse(o.get().as_bytes()).ok())
            .unwrap_or_default();
        options.set("include_usage", true)?;
        fields.set_raw("stream_options", options.to_raw()?);
        changed = true;
    }
    if let Some(n) = max_tokens {
        fields.set("max_tokens", n)?;
        changed = true;
    }
    changed.then(|| fields.to_vec()).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn config(key_limits: &str, policy: &str) -> Config {
        let json = format!(
            r#"{{"orgs":[{{"id":"o","policy":{policy},"workspaces":[{{"id":"w","projects":[{{"id":"p",
                "keys":[{{"id":"k","sha256":"{h}","limits":{key_limits}}}]}}]}}]}}],
                "models":{{"small":{{"max_context_tokens":100}}}},"max_body_bytes":2000}}"#,
            h = "a".repeat(64)
        );
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn run(config: &Config, body: &str) -> Result<Admitted, Rejection> {
        let tenant = config
            .directory()
            .lookup(&"a".repeat(64))
            .unwrap()
            .as_ref()
            .clone();
        admit(config, &tenant, Endpoint::ChatCompletions, body.as_bytes())
    }

    fn reason(r: Result<Admitted, Rejection>) -> (&'static str, u16) {
        let rej = r.unwrap_err();
        (rej.reason, rej.error.status)
    }

    const HELLO: &str = r#"{"model":"big","messages":[{"role":"user","content":"hello"}]"#;

    #[test]
    fn bad_bodies_are_named() {
        let c = config("{}", "{}");
        assert_eq!(reason(run(&c, "{nope")), ("malformed_body", 400));
        assert_eq!(reason(run(&c, r#"{"model":1}"#)), ("malformed_body", 400));
        assert_eq!(
            reason(run(&c, r#"{"model":"m","messages":[]}"#)),
            ("invalid_request", 400)
        );
        assert_eq!(reason(run(&c, &" ".repeat(2001))), ("body_too_large", 413));
    }

    #[test]
    fn models_outside_the_allow_list_are_forbidden() {
        let c = config("{}", r#"{"models":["small"]}"#);
        assert_eq!(
            reason(run(&c, &format!("{HELLO}}}"))),
            ("model_not_allowed", 403)
        );
    }

    #[test]
    fn context_and_output_limits_reject_instead_of_downgrading() {
        let c = config(r#"{"max_output_tokens":50}"#, "{}");
        let over = format!("{HELLO},\"max_tokens\":51}}");
        assert_eq!(reason(run(&c, &over)), ("max_tokens_over_limit", 400));
        let small =
            r#"{"model":"small","messages":[{"role":"user","content":"hello"}],"max_tokens":95}"#;
        let uncapped = config("{}", "{}");
        let rej = run(&uncapped, small).unwrap_err();
        assert_eq!(rej.error.code, Some("context_length_exceeded"));
        assert!(run(&uncapped, &small.replace("95", "50")).is_ok());
    }

    #[test]
    fn every_output_limit_is_capped_and_the_largest_reserved() {
        let c = config(r#"{"max_output_tokens":50}"#, "{}");
        let over = format!("{HELLO},\"max_completion_tokens\":5,\"max_tokens\":51}}");
        let rej = run(&c, &over).unwrap_err();
        assert_eq!(rej.error.param.as_deref(), Some("max_tokens"));
        let over = format!("{HELLO},\"max_tokens\":5,\"n_predict\":51}}");
        let rej = run(&c, &over).unwrap_err();
        assert_eq!(rej.error.param.as_deref(), Some("n_predict"));

        let within = format!("{HELLO},\"max_completion_tokens\":5,\"max_tokens\":9}}");
        assert_eq!(run(&c, &within).unwrap().reserved_output, 9);
        // Only llama.cpp's limit: `max_tokens` is still filled in for the engines ignoring it.
        let a = run(&c, &format!("{HELLO},\"n_predict\":30}}")).unwrap();
        assert_eq!(a.reserved_output, 50);
        let body: Value = serde_json::from_slice(&a.rewritten_body.unwrap()).unwrap();
        assert_eq!(body["max_tokens"], 50);
    }

    #[test]
    fn engine_control_fields_are_stripped() {
        let c = config("{}", "{}");
        let body =
            format!("{HELLO},\"priority\":-9,\"request_id\":\"x\",\"kv_transfer_params\":{{}}}}");
        let sent: Value =
            serde_json::from_slice(&run(&c, &body).unwrap().rewritten_body.unwrap()).unwrap();
        for field in ENGINE_CONTROL_FIELDS {
            assert!(sent.get(field).is_none(), "{field}");
        }
    }

    #[test]
    fn request_templates_are_refused() {
        let c = config("{}", "{}");
        let body = format!("{HELLO},\"chat_template\":\"{{{{ 'x' * 99999 }}}}\"}}");
        let rej = run(&c, &body).unwrap_err();
        assert_eq!(rej.error.param.as_deref(), Some("chat_template"));
        assert!(run(&c, &format!("{HELLO},\"chat_template\":null}}")).is_ok());
    }

    #[test]
    fn repeated_keys_are_malformed() {
        let c = config("{}", "{}");
        let body = format!("{HELLO},\"max_tokens\":20,\"max_tokens\":5}}");
        assert_eq!(reason(run(&c, &body)), ("malformed_body", 400));
    }

    #[test]
    fn missing_max_tokens_gets_the_stated_cap() {
        let c = config(
            r#"{"max_output_tokens":50}"#,
            r#"{"default_max_tokens":20}"#,
        );
        let a = run(&c, &format!("{HELLO}}}")).unwrap();
        assert_eq!(a.reserved_output, 20);
        let body: Value = serde_json::from_slice(&a.rewritten_body.unwrap()).unwrap();
        assert_eq!(body["max_tokens"], 20);

        let uncapped = config("{}", "{}");
        let a = run(&uncapped, &format!("{HELLO}}}")).unwrap();
        assert_eq!(a.reserved_output, UNBOUNDED_OUTPUT_RESERVATION);
        assert_eq!(a.rewritten_body, None, "nothing to change");

        let small = r#"{"model":"small","messages":[{"role":"user","content":"hello"}]}"#;
        let a = run(&uncapped, small).unwrap();
        assert_eq!(
            a.reserved_output,
            100 - a.prompt_tokens,
            "the rest of the context"
        );
    }

    #[test]
    fn streams_ask_the_engine_for_usage_and_salts_are_stripped() {
        let c = config("{}", "{}");
        let body = format!("{HELLO},\"stream\":true,\"max_tokens\":5,\"cache_salt\":\"steal\"}}");
        let a = run(&c, &body).unwrap();
        assert!(a.stream && !a.client_wants_usage);
        let sent: Value = serde_json::from_slice(&a.rewritten_body.unwrap()).unwrap();
        assert_eq!(sent["stream_options"]["include_usage"], true);
        assert!(sent.get("cache_salt").is_none());
        assert_eq!(
            a.prompt_tokens, 8,
            "'hello' + 3 framing + 'user' + 3 priming"
        );

        for options in [
            "null",
            r#"{"include_usage":false}"#,
            r#"{"include_usage":null}"#,
            "{}",
        ] {
            let body = format!("{HELLO},\"stream\":true,\"stream_options\":{options}}}");
            let a = run(&c, &body).unwrap();
            assert!(!a.client_wants_usage, "{options}");
            let sent: Value = serde_json::from_slice(&a.rewritten_body.unwrap()).unwrap();
            assert_eq!(sent["stream_options"]["include_usage"], true, "{options}");
        }

        let asked =
            format!("{HELLO},\"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}");
        let a = run(&c, &asked).unwrap();
        assert!(a.client_wants_usage);
        assert_eq!(a.rewritten_body, None);
    }
}

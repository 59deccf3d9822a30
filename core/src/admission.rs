//! The front door's decision on a request body, whatever API it was sent to: is it
//! well-formed and allowed, how many tokens does it bring and may it take, and what the upstream
//! receives instead of it.
//!
//! Nothing is silently downgraded: a request over a limit is rejected with the limit named.
//! The only value weir fills in is the API's own output limit (`max_tokens`, the Responses
//! API's `max_output_tokens`) when the request sets none and the tenant's config states a cap
//! (`default_max_tokens`, else the `max_output_tokens` limit). A request with no output limit
//! of its own nor a `default_max_tokens` is reserved a prediction of its output
//! ([`crate::prediction`]), which limits nothing.

use crate::config::{Config, OnBlockedOffered, Tenant, ToolRule};
use crate::endpoint::Endpoint;
use crate::error::ApiError;
use crate::estimate::{self, Counting, Estimate, Method};
use crate::json::{self, TopLevel};
use crate::prediction::OutputHistory;
use crate::request::InferenceRequest;
use crate::rewrite::Rewrite;
use crate::tokens::Encoding;
use crate::tools::offered;
use crate::trusted;

/// Output tokens reserved when neither the request, the tenant nor the model bounds the answer.
/// Only the reservation uses it; settlement charges what the engine reports.
pub const UNBOUNDED_OUTPUT_RESERVATION: u64 = 1024;

/// The output an answer nobody read is billed — a non-streamed answer the client left before
/// it came, or one with no usage weir could count: its limit (`per_answer`, the request's or
/// the one weir filled in) for each of its `answers`, else [`UNBOUNDED_OUTPUT_RESERVATION`]
/// each. The sidecar bills the same figure from the body it is sent, so the quota charge and
/// the ledger agree with no word between them (the client is gone).
pub fn unread_output(per_answer: Option<u64>, answers: u64) -> u64 {
    per_answer
        .unwrap_or(UNBOUNDED_OUTPUT_RESERVATION)
        .saturating_mul(answers)
}

/// A request that may proceed.
#[derive(Clone, Debug, PartialEq)]
pub struct Admitted {
    pub endpoint: Endpoint,
    pub model: String,
    pub prompt_tokens: u64,
    pub method: Method,
    /// Whether counting the prompt exactly could still change `prompt_tokens` (see
    /// [`estimate::Estimate::recountable`]).
    pub recountable: bool,
    /// Output tokens to reserve: the request's cap, or the cap weir filled in, for every answer
    /// it asks for (each prompt of a completions batch); 0 for embeddings.
    pub reserved_output: u64,
    /// `reserved_output` is a prediction ([`crate::prediction`]): the answer's real length is
    /// learned when it settles.
    pub predicted: bool,
    /// Output tokens an answer nobody read is charged ([`unread_output`]): its limit, never
    /// the prediction. Charging the prediction would let a key train it low and then get long
    /// unreadable answers for the price of short ones, without ever going into debt.
    pub unread_output: u64,
    /// A limit bounds each answer (the request's, or one weir filled in): `unread_output` is
    /// then a ceiling the engine is held to, not a guess.
    pub output_bounded: bool,
    /// Answers the request asks for (each prompt of a completions batch).
    pub answers: u64,
    pub stream: bool,
    /// weir asked the engine for a usage event the client did not ask for: the meter removes
    /// it again.
    pub hide_usage_event: bool,
    /// The body to send upstream, when it differs from the client's.
    pub rewritten_body: Option<Vec<u8>>,
    /// The tools the request offers the model, by name, when the key has a tool policy (a
    /// call to another is not passed on); empty without one.
    pub offered_tools: Vec<String>,
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

/// Decides on a complete request body. `history` gives the tenant's recent output lengths on a
/// model, read only for a request whose output is predicted.
pub fn admit(
    config: &Config,
    tenant: &Tenant,
    endpoint: Endpoint,
    body: &[u8],
    counting: Counting,
    history: impl FnOnce(&str) -> OutputHistory,
) -> Result<Admitted, Rejection> {
    let (mut fields, mut req) = read(config, endpoint, body)?;
    check_model(config, tenant, &req.model)?;
    let offer = judge_tools(tenant, endpoint, &mut fields, &mut req)?;
    let limits = OutputLimits::of(&req, tenant)?;
    let (encoding, model_context) = config.model(&req.model);
    let context_cap = [model_context, tenant.tightest(|l| l.max_context_tokens)]
        .into_iter()
        .flatten()
        .min();
    let estimate = count_prompt(config, &req, encoding, counting, context_cap, &limits)?;
    let rest_of_context = context_cap.map(|cap| cap - estimate.longest);
    let (reserved_output, predicted) =
        reserve_output(config, tenant, &req, &limits, rest_of_context, history)?;

    let stream = req.is_streaming();
    let ask_usage = stream && req.usage_is_optional() && !req.wants_stream_usage();
    let rewrite = Rewrite {
        cache_salt: None,
        ask_usage,
        output_limit: limits.filled_in,
    };
    let rewritten_body = if offer.rewritten.is_some() {
        // Tools were taken out: the body differs whatever else the rewrite does.
        rewrite
            .apply(&mut fields)
            .and_then(|_| fields.to_vec())
            .map(Some)
    } else {
        rewrite.body(fields)
    }
    .map_err(|e| reject("internal", ApiError::internal(e.to_string())))?;
    Ok(Admitted {
        endpoint,
        model: req.model.clone(),
        prompt_tokens: estimate.tokens,
        method: estimate.method,
        recountable: estimate.recountable,
        reserved_output,
        predicted,
        unread_output: unread_output(limits.per_answer, req.answers()),
        output_bounded: limits.per_answer.is_some(),
        answers: req.answers(),
        stream,
        hide_usage_event: ask_usage,
        rewritten_body,
        offered_tools: offer.names,
    })
}

/// The key's tool policy on the tools the request offers (nothing is read for a key without
/// one): a blocked tool refuses the request, or is taken out of the body, and then the prompt
/// is the rewritten body's.
fn judge_tools(
    tenant: &Tenant,
    endpoint: Endpoint,
    fields: &mut TopLevel,
    req: &mut InferenceRequest,
) -> Result<offered::Offer, Rejection> {
    if tenant.tools.is_empty() {
        return Ok(offered::Offer::default());
    }
    let remove = tenant.tools.on_blocked_offered == OnBlockedOffered::Remove;
    let offer = offered::judge(
        fields.get("tools"),
        fields.get("functions"),
        fields.get("tool_choice"),
        |name| tenant.tools.rule(name) == ToolRule::Blocked,
        remove,
    )
    .map_err(|e| reject("tool_blocked", e))?;
    let Some(tools) = &offer.rewritten else {
        return Ok(offer);
    };
    let internal = |e: serde_json::Error| reject("internal", ApiError::internal(e.to_string()));
    match tools {
        Some(tools) => {
            let raw = serde_json::value::RawValue::from_string(tools.clone()).map_err(internal)?;
            fields.set_raw("tools", raw);
        }
        None => {
            fields.remove("tools");
            fields.remove("tool_choice");
        }
    }
    *req = InferenceRequest::parse(endpoint, &fields.to_vec().map_err(internal)?)
        .map_err(|e| reject("malformed_body", e))?;
    Ok(offer)
}

/// Reads a body: within the size bound, one meaning only (no repeated keys), a JSON object,
/// a valid request of `endpoint`'s API that brings no prompt template or adapters of its own.
fn read(
    config: &Config,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(TopLevel, InferenceRequest), Rejection> {
    if body.len() > config.max_body_bytes {
        return Err(reject(
            "body_too_large",
            ApiError::payload_too_large(config.max_body_bytes),
        ));
    }
    json::check_unique_keys(body).map_err(|e| {
        reject(
            "malformed_body",
            ApiError::bad_request(format!("malformed JSON: {e}")),
        )
    })?;
    let fields = TopLevel::parse(body).map_err(|e| {
        reject(
            "malformed_body",
            ApiError::bad_request(format!("the request body must be a JSON object: {e}")),
        )
    })?;
    let req = InferenceRequest::parse(endpoint, body).map_err(|e| reject("malformed_body", e))?;
    req.validate().map_err(|e| reject("invalid_request", e))?;
    refuse_request_templates(&fields)?;
    refuse_request_adapters(&fields)?;
    Ok((fields, req))
}

/// Refuses a model the gateway does not serve, or that the tenant may not use.
fn check_model(config: &Config, tenant: &Tenant, model: &str) -> Result<(), Rejection> {
    if !config.serves(model) {
        return Err(reject("model_not_found", ApiError::model_not_found(model)));
    }
    if !tenant.may_use(model) {
        return Err(reject(
            "model_not_allowed",
            ApiError::new(
                403,
                format!("model '{model}' is not allowed for this API key"),
            )
            .with_param("model")
            .with_code("model_not_allowed"),
        ));
    }
    Ok(())
}

/// How long a request's answers may be, as its own limits and the tenant's say.
struct OutputLimits {
    /// The API's own limit field and the cap weir fills in, when the request sets none.
    filled_in: Option<(&'static str, u64)>,
    /// The largest limit the request sets, whichever engine reads it.
    requested: Option<u64>,
    /// Most output one answer may produce: the larger of those two; 0 for embeddings; `None`
    /// when nothing bounds it.
    per_answer: Option<u64>,
}

impl OutputLimits {
    /// The request's limits, refused when any is over the key's cap.
    fn of(req: &InferenceRequest, tenant: &Tenant) -> Result<OutputLimits, Rejection> {
        let generates = req.endpoint.generates();
        let output_cap = tenant.tightest(|l| l.max_output_tokens);
        if let (Some(cap), true) = (output_cap, generates) {
            check_output_limits(req, cap)?;
        }
        // weir fills in the API's own limit only when the request sets none; a request with
        // only another engine's (`n_predict`) still gets it, for engines that ignore that one.
        let filled_in = match (req.max_output_tokens(), req.fill_in_field()) {
            (None, Some(field)) => tenant
                .default_max_tokens
                .or(output_cap)
                .map(|cap| (field, cap)),
            _ => None,
        };
        let requested = req.largest_output_limit().map(u64::from);
        let per_answer = if generates {
            requested.max(filled_in.map(|(_, cap)| cap))
        } else {
            Some(0)
        };
        Ok(OutputLimits {
            filled_in,
            requested,
            per_answer,
        })
    }
}

/// Counts the prompt, refusing it when it and the answer's limit (at least one token where the
/// API generates) overflow the context. An estimate decides the context check only where the
/// prompt's bytes (its most tokens) fit too; otherwise it is counted exactly, when short
/// enough for that.
fn count_prompt(
    config: &Config,
    req: &InferenceRequest,
    encoding: Encoding,
    counting: Counting,
    context_cap: Option<u64>,
    limits: &OutputLimits,
) -> Result<Estimate, Rejection> {
    let at_least = u64::from(req.endpoint.generates());
    let out = limits.per_answer.unwrap_or(at_least);
    let exact_below = config.estimator.exact_below_bytes;
    let mut estimate = estimate::prompt_tokens(req, encoding, exact_below, counting);
    if estimate.recountable
        && context_cap.is_some_and(|cap| estimate.longest_bound.saturating_add(out) > cap)
    {
        estimate = estimate::prompt_tokens(req, encoding, exact_below, Counting::Exact);
    }
    if let Some(cap) = context_cap
        && estimate.longest.saturating_add(out) > cap
    {
        return Err(reject(
            "context_length_exceeded",
            ApiError::context_length_exceeded(
                cap,
                estimate.longest,
                limits.per_answer.unwrap_or(0),
            ),
        ));
    }
    Ok(estimate)
}

/// The output tokens to reserve for all of a request's answers, and whether that is a
/// prediction. Neither the caller nor its policy's `default_max_tokens` says how long the
/// answer may be: reserve what this tenant's answers on this model have recently needed,
/// never more than the rest of the context or the key's `max_output_tokens` (which is still
/// filled in). Otherwise, the most weir can bound the answer to.
fn reserve_output(
    config: &Config,
    tenant: &Tenant,
    req: &InferenceRequest,
    limits: &OutputLimits,
    rest_of_context: Option<u64>,
    history: impl FnOnce(&str) -> OutputHistory,
) -> Result<(u64, bool), Rejection> {
    let predicted = req.endpoint.generates()
        && limits.requested.is_none()
        && tenant.default_max_tokens.is_none()
        && config.prediction.enabled;
    let per_answer = if predicted {
        let cap = [limits.per_answer, rest_of_context]
            .into_iter()
            .flatten()
            .min();
        history(&req.model).predict(&config.prediction, cap)
    } else {
        (limits.per_answer)
            .or(rest_of_context)
            .unwrap_or(UNBOUNDED_OUTPUT_RESERVATION)
    };
    let reserved_output = per_answer.saturating_mul(req.answers());
    if reserved_output > trusted::MAX_TOKENS {
        return Err(reject(
            "max_tokens_over_limit",
            ApiError::bad_request(format!(
                "the request asks for {reserved_output} output tokens in all, more than the \
                 {} one request may reserve",
                trusted::MAX_TOKENS
            )),
        ));
    }
    Ok((reserved_output, predicted))
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

/// Body fields by which a request applies adapters the engine has loaded — llama.cpp's `lora`
/// (adapters by id, with a scale), SGLang's `lora_path` (by name) — so that a model other than
/// the one it names runs: one the key's `models` policy never allowed, another tenant's
/// fine-tune among them. The model name is what selects an adapter (vLLM serves each as a model
/// of its own).
pub const REQUEST_ADAPTER_FIELDS: [&str; 2] = ["lora", "lora_path"];

/// Refuses a request that names adapters of its own (see [`REQUEST_ADAPTER_FIELDS`]).
fn refuse_request_adapters(fields: &TopLevel) -> Result<(), Rejection> {
    let named = REQUEST_ADAPTER_FIELDS
        .into_iter()
        .find(|f| fields.get(f).is_some_and(|v| v.get() != "null"));
    match named {
        Some(field) => Err(reject(
            "invalid_request",
            ApiError::bad_request(format!(
                "{field} is not accepted: adapters are chosen by the model name, which this key \
                 may use as its policy allows; name the adapter's model instead"
            ))
            .with_param(field),
        )),
        None => Ok(()),
    }
}

/// Refuses a request when any output limit it sets, whichever an engine reads, is over the
/// key's per-request cap.
fn check_output_limits(req: &InferenceRequest, cap: u64) -> Result<(), Rejection> {
    match req.output_limits.iter().find(|&&(_, l)| u64::from(l) > cap) {
        Some(&(param, asked)) => Err(reject(
            "max_tokens_over_limit",
            ApiError::bad_request(format!(
                "{param} {asked} exceeds this key's limit of {cap} output tokens per request"
            ))
            .with_param(param),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::ENGINE_CONTROL_FIELDS;
    use serde_json::Value;

    fn config(key_limits: &str, policy: &str) -> Config {
        let json = format!(
            r#"{{"orgs":[{{"id":"o","policy":{policy},"workspaces":[{{"id":"w","projects":[{{"id":"p",
                "keys":[{{"id":"k","sha256":"{h}","limits":{key_limits}}}]}}]}}]}}],
                "models":{{"small":{{"max_context_tokens":100}}}},"max_body_bytes":2000}}"#,
            h = "a".repeat(64)
        );
        Config::parse(json.as_bytes()).unwrap()
    }

    fn run(config: &Config, body: &str) -> Result<Admitted, Rejection> {
        run_on(config, Endpoint::ChatCompletions, body)
    }

    /// The tenant of the one key in [`config`]'s configs.
    fn tenant_of(config: &Config) -> Tenant {
        config
            .directory()
            .lookup(&"a".repeat(64))
            .unwrap()
            .as_ref()
            .clone()
    }

    fn run_on(config: &Config, endpoint: Endpoint, body: &str) -> Result<Admitted, Rejection> {
        let tenant = tenant_of(config);
        admit(
            config,
            &tenant,
            endpoint,
            body.as_bytes(),
            Counting::Estimated,
            |_| OutputHistory::default(),
        )
    }

    fn reason(r: Result<Admitted, Rejection>) -> (&'static str, u16) {
        let rej = r.unwrap_err();
        (rej.reason, rej.error.status)
    }

    const HELLO: &str = r#"{"model":"big","messages":[{"role":"user","content":"hello"}]"#;

    #[test]
    fn a_removed_tool_leaves_the_body_and_its_prompt_estimate() {
        let policy = r#"{"tools":{"blocked":["shell_*"],"on_blocked_offered":"remove"}}"#;
        let c = config("{}", policy);
        let tool = |name: &str| {
            format!(
                r#"{{"type":"function","function":{{"name":"{name}","description":"{}"}}}}"#,
                "a long description of the tool ".repeat(20)
            )
        };
        let body = |tools: &[String]| {
            format!(
                r#"{{"model":"big","messages":[{{"role":"user","content":"hello"}}],"tools":[{}]}}"#,
                tools.join(",")
            )
        };
        let offered = run(&c, &body(&[tool("search"), tool("shell_rm")])).unwrap();
        let plain = run(&c, &body(&[tool("search")])).unwrap();
        assert_eq!(offered.offered_tools, ["search"]);
        assert_eq!(
            offered.prompt_tokens, plain.prompt_tokens,
            "the rewritten body's"
        );
        let sent: Value = serde_json::from_slice(&offered.rewritten_body.unwrap()).unwrap();
        assert_eq!(sent["tools"].as_array().unwrap().len(), 1, "{sent}");
        // Refused by default, and nothing read for a key with no tool policy.
        let refuse = config("{}", r#"{"tools":{"blocked":["shell_*"]}}"#);
        assert_eq!(
            reason(run(&refuse, &body(&[tool("shell_rm")]))),
            ("tool_blocked", 403)
        );
        let open = config("{}", "{}");
        let passed = run(&open, &body(&[tool("shell_rm")])).unwrap();
        assert!(passed.offered_tools.is_empty() && passed.rewritten_body.is_none());
    }

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
    fn unknown_models_are_not_found_when_the_config_refuses_them() {
        let mut c = config("{}", r#"{"models":["big"]}"#);
        let unlisted = format!("{HELLO}}}");
        assert!(run(&c, &unlisted).is_ok(), "served by default");
        c.unknown_models = crate::config::UnknownModels::Refuse;
        let rej = run(&c, &unlisted).unwrap_err();
        assert_eq!((rej.reason, rej.error.status), ("model_not_found", 404));
        assert_eq!(rej.error.code, Some("model_not_found"));
        let listed = unlisted.replace("big", "small");
        assert_eq!(
            reason(run(&c, &listed)),
            ("model_not_allowed", 403),
            "a listed model is the key's policy's to allow"
        );
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
    fn prompts_are_counted_exactly_only_where_the_estimate_cannot_decide_the_window() {
        let c = config("{}", "{}");
        let tenant = tenant_of(&c);
        let body = |model: &str, words: usize, max_tokens: u64| {
            format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":"{}"}}],"max_tokens":{max_tokens}}}"#,
                "word ".repeat(words)
            )
        };
        let admit_as = |body: &str, counting| {
            admit(
                &c,
                &tenant,
                Endpoint::ChatCompletions,
                body.as_bytes(),
                counting,
                |_| OutputHistory::default(),
            )
            .unwrap()
        };
        let unbounded = body("big", 20, 10);
        assert_eq!(
            admit_as(&unbounded, Counting::Estimated).method,
            Method::Fast
        );
        assert_eq!(admit_as(&unbounded, Counting::Exact).method, Method::Exact);
        // 15 words and 20 output tokens fit the window of 100, but the prompt's 75 bytes (as
        // many tokens, at most) and its framing do not: the estimate cannot decide.
        let near = admit_as(&body("small", 15, 20), Counting::Estimated);
        assert_eq!(near.method, Method::Exact);
        assert!(near.prompt_tokens + 20 <= 100, "{}", near.prompt_tokens);
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
    fn per_request_adapters_are_refused_on_every_api() {
        // llama.cpp applies the server's LoRA adapters a request names by id, SGLang by name:
        // a model the key's `models` policy never allowed (another tenant's fine-tune, say).
        let c = config("{}", r#"{"models":["big"]}"#);
        for (endpoint, body) in [
            (Endpoint::ChatCompletions, format!("{HELLO},\"lora\":[{{\"id\":0,\"scale\":1.0}}]}}")),
            (Endpoint::Completions, r#"{"model":"big","prompt":"x","lora_path":"tenant-b"}"#.to_owned()),
            (Endpoint::Messages, r#"{"model":"big","max_tokens":5,"messages":[{"role":"user","content":"x"}],"lora":[{"id":1,"scale":1}]}"#.to_owned()),
            (Endpoint::Embeddings, r#"{"model":"big","input":"x","lora_path":["tenant-b"]}"#.to_owned()),
        ] {
            let rej = run_on(&c, endpoint, &body).unwrap_err();
            assert_eq!(rej.error.status, 400, "{endpoint:?}");
            assert!(matches!(rej.error.param.as_deref(), Some("lora" | "lora_path")), "{endpoint:?}");
        }
        assert!(run(&c, &format!("{HELLO},\"lora\":null}}")).is_ok());
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
    fn a_request_without_a_limit_reserves_its_tenant_s_predicted_output() {
        let prediction = crate::prediction::PredictionConfig {
            min_samples: 3,
            ..Default::default()
        };
        let mut history = OutputHistory::default();
        for _ in 0..3 {
            history.learn(300, &prediction);
        }
        let admit_with = |key_limits: &str, policy: &str, enabled: bool, body: &str| {
            let mut c = config(key_limits, policy);
            c.prediction = crate::prediction::PredictionConfig {
                enabled,
                ..prediction.clone()
            };
            let tenant = tenant_of(&c);
            let mut asked = None;
            let a = admit(
                &c,
                &tenant,
                Endpoint::ChatCompletions,
                body.as_bytes(),
                Counting::Estimated,
                |m| {
                    asked = Some(m.to_owned());
                    history.clone()
                },
            )
            .unwrap();
            (a, asked)
        };
        let plain = format!("{HELLO}}}");
        let (a, asked) = admit_with("{}", "{}", true, &plain);
        assert_eq!((a.reserved_output, a.predicted), (304, true));
        assert_eq!(
            a.unread_output, UNBOUNDED_OUTPUT_RESERVATION,
            "an answer it cannot read is charged what it would have reserved, not the prediction"
        );
        assert_eq!(asked.as_deref(), Some("big"), "the model's history");
        assert_eq!(a.rewritten_body, None, "no limit is added");

        // The key's cap is still filled in, and bounds the prediction.
        let (a, _) = admit_with(r#"{"max_output_tokens":200}"#, "{}", true, &plain);
        assert_eq!((a.reserved_output, a.predicted), (200, true));
        assert_eq!(
            a.unread_output, 200,
            "the key's cap bounds what it may produce"
        );
        assert_eq!(sent(&a)["max_tokens"], 200);
        // The rest of the context bounds the reservation too. An unread answer is billed by a
        // rule the sidecar can apply to the body alone (it knows no context sizes).
        let small = r#"{"model":"small","messages":[{"role":"user","content":"hello"}]}"#;
        let (a, _) = admit_with("{}", "{}", true, small);
        assert_eq!(a.reserved_output, 100 - a.prompt_tokens);
        assert_eq!(a.unread_output, UNBOUNDED_OUTPUT_RESERVATION);

        // A limit of the caller's or of its policy is reserved as before, and so is the context
        // with prediction off.
        let (a, asked) = admit_with("{}", "{}", true, &format!("{HELLO},\"max_tokens\":50}}"));
        assert_eq!((a.reserved_output, a.predicted, asked), (50, false, None));
        assert_eq!(
            a.unread_output, 50,
            "without a prediction, what was reserved"
        );
        let (a, _) = admit_with("{}", r#"{"default_max_tokens":20}"#, true, &plain);
        assert_eq!((a.reserved_output, a.predicted), (20, false));
        let (a, _) = admit_with("{}", "{}", false, small);
        assert_eq!(
            (a.reserved_output, a.predicted),
            (100 - a.prompt_tokens, false)
        );
    }

    #[test]
    fn streams_ask_the_engine_for_usage_and_salts_are_stripped() {
        let c = config("{}", "{}");
        let body = format!("{HELLO},\"stream\":true,\"max_tokens\":5,\"cache_salt\":\"steal\"}}");
        let a = run(&c, &body).unwrap();
        assert!(a.stream && a.hide_usage_event);
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
            assert!(a.hide_usage_event, "{options}");
            let sent: Value = serde_json::from_slice(&a.rewritten_body.unwrap()).unwrap();
            assert_eq!(sent["stream_options"]["include_usage"], true, "{options}");
        }

        let asked =
            format!("{HELLO},\"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}");
        let a = run(&c, &asked).unwrap();
        assert!(!a.hide_usage_event);
        assert_eq!(a.rewritten_body, None);
    }

    fn sent(a: &Admitted) -> Value {
        serde_json::from_slice(a.rewritten_body.as_deref().unwrap()).unwrap()
    }

    #[test]
    fn each_api_reserves_and_fills_in_its_own_output_limit() {
        let c = config(
            r#"{"max_output_tokens":50}"#,
            r#"{"default_max_tokens":20}"#,
        );
        let responses = run_on(&c, Endpoint::Responses, r#"{"model":"big","input":"hi"}"#).unwrap();
        assert_eq!(responses.reserved_output, 20);
        assert_eq!(sent(&responses)["max_output_tokens"], 20);
        assert!(sent(&responses).get("max_tokens").is_none());
        let over = run_on(
            &c,
            Endpoint::Responses,
            r#"{"model":"big","input":"hi","max_output_tokens":51}"#,
        );
        assert_eq!(
            over.unwrap_err().error.param.as_deref(),
            Some("max_output_tokens")
        );

        let messages =
            r#"{"model":"big","max_tokens":30,"messages":[{"role":"user","content":"hi"}]}"#;
        let a = run_on(&c, Endpoint::Messages, messages).unwrap();
        assert_eq!((a.reserved_output, a.rewritten_body), (30, None));
        let missing = r#"{"model":"big","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(
            reason(run_on(&c, Endpoint::Messages, missing)),
            ("invalid_request", 400)
        );

        let batch = run_on(
            &c,
            Endpoint::Completions,
            r#"{"model":"big","prompt":["a","b","c"],"max_tokens":10}"#,
        );
        assert_eq!(
            batch.unwrap().reserved_output,
            30,
            "each prompt of a batch is answered"
        );
    }

    #[test]
    fn embeddings_reserve_no_output_and_each_input_meets_the_context() {
        let c = config("{}", "{}");
        let word = "word ".repeat(60);
        let inputs = serde_json::json!([word, word, word]).to_string();
        let body = format!(r#"{{"model":"small","input":{inputs},"max_tokens":9999}}"#);
        let a = run_on(&c, Endpoint::Embeddings, &body).unwrap();
        assert_eq!(a.reserved_output, 0);
        assert!(
            a.prompt_tokens > 100,
            "all of the inputs are charged: {}",
            a.prompt_tokens
        );
        let long = format!(r#"{{"model":"small","input":["{}"]}}"#, "word ".repeat(120));
        let rej = run_on(&c, Endpoint::Embeddings, &long).unwrap_err();
        assert_eq!(rej.error.code, Some("context_length_exceeded"));
    }

    #[test]
    fn engine_control_fields_are_stripped_on_every_api() {
        let c = config("{}", "{}");
        for (endpoint, body) in [
            (
                Endpoint::Responses,
                r#"{"model":"big","input":"hi","cache_salt":"x","priority":-9}"#,
            ),
            (
                Endpoint::Messages,
                r#"{"model":"big","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"cache_salt":"x"}"#,
            ),
            (
                Endpoint::Embeddings,
                r#"{"model":"big","input":"hi","request_id":"x"}"#,
            ),
        ] {
            let a = run_on(&c, endpoint, body).unwrap();
            let sent = sent(&a);
            for field in ENGINE_CONTROL_FIELDS {
                assert!(sent.get(field).is_none(), "{endpoint:?} {field}");
            }
        }
    }

    #[test]
    fn only_chat_and_completions_streams_are_asked_for_usage() {
        let c = config("{}", "{}");
        let a = run_on(
            &c,
            Endpoint::Responses,
            r#"{"model":"big","input":"hi","stream":true,"max_output_tokens":5}"#,
        )
        .unwrap();
        assert!(a.stream && !a.hide_usage_event);
        assert_eq!(a.rewritten_body, None);
    }

    #[test]
    fn no_request_reserves_more_than_can_be_vouched_for() {
        let c = config("{}", "{}");
        let body = r#"{"model":"big","prompt":["a","b"],"max_tokens":4294967295}"#;
        let rej = run_on(&c, Endpoint::Completions, body).unwrap_err();
        assert_eq!(
            (rej.reason, rej.error.status),
            ("max_tokens_over_limit", 400)
        );
    }

    #[test]
    fn token_caps_past_what_can_be_vouched_for_are_refused_in_config() {
        let err = Config::parse(
            br#"{"orgs":[{"id":"o","policy":{"default_max_tokens":18446744073709551615}}]}"#,
        )
        .err()
        .map(|e| e.to_string());
        assert!(
            err.as_ref()
                .is_some_and(|e| e.contains("orgs[0].policy.default_max_tokens")),
            "{err:?}"
        );
    }
}

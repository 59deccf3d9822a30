//! Retries at the front door (`retry.rs`): told by the key's recent calls, refused past the
//! key's retry budget with a growing `Retry-After`, and refused when a `side_effect` step is
//! retried without its idempotency key.

use super::*;

/// A gateway with one key under `acme` whose org has `limits` and whose key has `policy`.
fn retry_gateway(limits: Value, policy: Value) -> (Rc<Gateway>, Mock) {
    let config = json!({
        "orgs": [{"id": "acme", "limits": limits, "workspaces": [{"id": "w", "projects": [
            {"id": "p", "keys": [{"id": "k", "sha256": hash_key(KEY), "policy": policy}]}]}]}],
        "routes": {"default": {"mode": "enforce"}},
        "slot_lease_ms": LEASE_MS,
    });
    let config = Config::parse(config.to_string().as_bytes()).unwrap();
    let gw = Rc::new(Gateway::new(config, None, Metrics::default()));
    let host = Mock::new(None);
    configured(&gw, &host);
    weir_core::retry::prepare(&host.store, gw.directory.tenants());
    (gw, host)
}

/// What became of one call sent with `headers`.
struct Sent {
    x: Exchange,
    /// The local reply's status, body and `Retry-After`, if it was refused.
    refused: Option<(u16, Value, Option<String>)>,
}

fn send(gw: &Rc<Gateway>, host: &Mock, path: &str, headers: &[(&str, &str)], body: &str) -> Sent {
    *host.reply.borrow_mut() = None;
    let mut x = Exchange::new(Rc::clone(gw));
    let mut all = pairs(&[
        (":method", "POST"),
        (":path", path),
        ("content-type", "application/json"),
    ]);
    all.push(("authorization".into(), format!("Bearer {KEY}")));
    all.extend(pairs(headers));
    *host.request_headers.borrow_mut() = all;
    assert_eq!(x.on_headers(host, false), Action::Continue);
    body_arrives(&mut x, host, body.as_bytes().to_vec());
    let refused = host.reply.borrow().as_ref().map(|(status, headers, body)| {
        let retry_after = (headers.iter())
            .find(|(k, _)| k == "retry-after")
            .map(|(_, v)| v.clone());
        (*status, serde_json::from_slice(body).unwrap(), retry_after)
    });
    if refused.is_none() {
        x.on_log(host);
    }
    Sent { x, refused }
}

fn chat_with(content: &str) -> String {
    json!({"model": "tiny", "messages": [{"role": "user", "content": content}]}).to_string()
}

const CHAT: &str = "/v1/chat/completions";

/// A Messages call sent twice with the request id `id`: the retry's refusal, status and body.
fn messages_retried(gw: &Rc<Gateway>, host: &Mock, id: &str, body: &str) -> (u16, Value) {
    send(gw, host, "/v1/messages", &[("x-request-id", id)], body);
    let retry = send(gw, host, "/v1/messages", &[("x-request-id", id)], body);
    let (status, error, _) = retry.refused.expect("refused");
    (status, error)
}

#[test]
fn retries_past_budget_get_growing_retry_after() {
    let (gw, host) = retry_gateway(
        json!({"retries_per_minute": 2, "requests_per_minute": 100}),
        json!({}),
    );
    let t = tenant(&gw);
    let body = chat_with("hello");
    let first = send(&gw, &host, CHAT, &[("x-request-id", "r1")], &body);
    assert!(first.refused.is_none() && !first.x.retry);
    // Two retries fit the budget of 2 a minute; they are marked as retries.
    for _ in 0..2 {
        let retry = send(&gw, &host, CHAT, &[("x-request-id", "r1")], &body);
        assert!(retry.refused.is_none(), "{:?}", retry.refused);
        assert!(retry.x.retry);
    }
    // Past it: refused, each refusal in a row told to wait twice as long.
    let mut waits = Vec::new();
    for _ in 0..7 {
        let retry = send(&gw, &host, CHAT, &[("x-request-id", "r1")], &body);
        let (status, error, retry_after) = retry.refused.expect("refused");
        assert_eq!(status, 429);
        assert_eq!(error["error"]["type"], "retry_budget_exceeded", "{error}");
        assert_eq!(error["error"]["code"], "retry_budget_exceeded", "{error}");
        waits.push(retry_after.unwrap());
    }
    assert_eq!(waits, ["1", "2", "4", "8", "16", "32", "60"]);
    assert_eq!(host.metric("weir.rejections.retry_budget_exceeded"), 7);
    assert_eq!(host.metric("weir.retries_refused_total.tenant.acme"), 7);
    // Each refusal was held back before it went (`tarpit`); the calls let through were not.
    assert_eq!(host.held_replies.get(), 7);
    // The refused ones took nothing: their request charges went back.
    assert_eq!(host.remaining(&t, LimitKind::Requests), 100 - 3);
    // Anthropic's clients get their shape, with weir's code.
    let messages = json!({"model": "tiny", "max_tokens": 8,
                          "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let (status, error) = messages_retried(&gw, &host, "m1", &messages);
    assert_eq!(status, 429);
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["error"]["type"], "rate_limit_error", "{error}");
    assert_eq!(error["error"]["code"], "retry_budget_exceeded", "{error}");
    // A minute on the budget has refilled; the retry let through ends the streak.
    host.now.set(NOW + 60_000);
    assert!(
        send(&gw, &host, CHAT, &[("x-request-id", "r2")], &body)
            .refused
            .is_none()
    );
    assert!(
        send(&gw, &host, CHAT, &[("x-request-id", "r2")], &body)
            .refused
            .is_none()
    );
    host.now.set(NOW + 60_001);
    send(&gw, &host, CHAT, &[("x-request-id", "r2")], &body);
    let retry = send(&gw, &host, CHAT, &[("x-request-id", "r2")], &body);
    assert_eq!(retry.refused.expect("refused").2.as_deref(), Some("1"));
}

#[test]
fn first_attempts_flow_while_retries_refused() {
    let (gw, host) = retry_gateway(json!({"retries_per_minute": 1}), json!({}));
    let body = chat_with("hello");
    let key = [("idempotency-key", "K1")];
    send(&gw, &host, CHAT, &key, &body);
    assert!(send(&gw, &host, CHAT, &key, &body).refused.is_none());
    assert!(send(&gw, &host, CHAT, &key, &body).refused.is_some());
    for i in 0..20 {
        let id = format!("first-{i}");
        let first = send(&gw, &host, CHAT, &[("x-request-id", &id)], &body);
        assert!(first.refused.is_none(), "{i}: {:?}", first.refused);
        assert!(!first.x.retry);
        let keyed = format!("K-{i}");
        let first = send(&gw, &host, CHAT, &[("idempotency-key", &keyed)], &body);
        assert!(first.refused.is_none(), "{i}: {:?}", first.refused);
    }
    // Calls with neither header are never retries.
    for _ in 0..5 {
        assert!(send(&gw, &host, CHAT, &[], &body).refused.is_none());
    }
    assert_eq!(send(&gw, &host, CHAT, &key, &body).refused.unwrap().0, 429);
}

#[test]
fn same_trace_id_other_body_is_no_retry() {
    let (gw, host) = retry_gateway(json!({"retries_per_minute": 1}), json!({}));
    let trace = [("x-request-id", "trace-1")];
    for i in 0..10 {
        let call = send(&gw, &host, CHAT, &trace, &chat_with(&format!("step {i}")));
        assert!(call.refused.is_none(), "{i}: {:?}", call.refused);
        assert!(!call.x.retry, "{i}");
    }
    // The same body again is a retry: the first fits the budget, the next does not.
    let again = send(&gw, &host, CHAT, &trace, &chat_with("step 9"));
    assert!(again.refused.is_none() && again.x.retry);
    let again = send(&gw, &host, CHAT, &trace, &chat_with("step 9"));
    assert_eq!(again.refused.unwrap().0, 429);
}

#[test]
fn side_effect_retry_without_key_refused_with_key_passes() {
    let policy = json!({"tools": {"classes": {"send_*": "side_effect"}}});
    let (gw, host) = retry_gateway(json!({}), policy);
    let tools = |name: &str| {
        json!({"model": "tiny", "messages": [{"role": "user", "content": "mail bob"}],
               "tools": [{"type": "function", "function": {"name": name, "parameters": {}}}]})
        .to_string()
    };
    let step = tools("send_email");
    let keyed = [("x-request-id", "step-1"), ("idempotency-key", "K1")];
    assert!(send(&gw, &host, CHAT, &keyed, &step).refused.is_none());
    // The same step again without its key: refused, and nothing held.
    let bare = send(&gw, &host, CHAT, &[("x-request-id", "step-1")], &step);
    let (status, error, _) = bare.refused.expect("refused");
    assert_eq!(status, 409);
    assert_eq!(
        error["error"]["code"], "side_effect_retry_requires_idempotency_key",
        "{error}"
    );
    assert_eq!(error["error"]["tool"], "send_email", "{error}");
    assert_eq!(
        host.metric("weir.rejections.side_effect_retry_requires_idempotency_key"),
        1
    );
    assert_eq!(
        host.held_replies.get(),
        1,
        "held back as any retry's refusal"
    );
    // With its key it passes (the sidecar answers it with the first answer).
    let keyed_again = send(&gw, &host, CHAT, &keyed, &step);
    assert!(keyed_again.refused.is_none() && keyed_again.x.retry);
    // A step offering only read-only tools may be retried bare.
    let search = tools("search");
    send(&gw, &host, CHAT, &[("x-request-id", "step-2")], &search);
    let again = send(&gw, &host, CHAT, &[("x-request-id", "step-2")], &search);
    assert!(again.refused.is_none() && again.x.retry);
    // In the Messages API too, in Anthropic's shape.
    let messages = json!({"model": "tiny", "max_tokens": 8,
        "messages": [{"role": "user", "content": "mail bob"}],
        "tools": [{"name": "send_email", "input_schema": {"type": "object"}}]})
    .to_string();
    let (status, error) = messages_retried(&gw, &host, "m-1", &messages);
    assert_eq!(status, 409);
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(
        error["error"]["code"], "side_effect_retry_requires_idempotency_key",
        "{error}"
    );
}

#[test]
fn an_approval_re_send_is_no_retry_and_spends_no_retry_budget() {
    let policy = json!({"tools": {"classes": {"send_*": "side_effect", "deploy": "approval"}}});
    let (gw, host) = retry_gateway(json!({"retries_per_minute": 1}), policy);
    let step = json!({"model": "tiny", "messages": [{"role": "user", "content": "ship it"}],
        "tools": [{"type": "function", "function": {"name": "send_email"}},
                  {"type": "function", "function": {"name": "deploy"}}]})
    .to_string();
    let id = [("x-request-id", "step-9")];
    assert!(send(&gw, &host, CHAT, &id, &step).refused.is_none());
    // The same request sent again for its approved call, as often as the client needs: the
    // sidecar answers it from the approval, so it is neither a side-effect retry nor a retry.
    let resend = [("x-request-id", "step-9"), ("weir-approval-id", "apr_x")];
    for _ in 0..3 {
        let again = send(&gw, &host, CHAT, &resend, &step);
        assert!(again.refused.is_none(), "{:?}", again.refused);
        assert!(!again.x.retry);
    }
    // A real retry still is one (and, without its key, refused for its side-effect tool).
    let bare = send(&gw, &host, CHAT, &id, &step);
    assert_eq!(bare.refused.expect("refused").0, 409);
}

#[test]
fn attack_a_forged_approval_id_on_a_key_without_approval_tools_buys_no_retries() {
    let policy = json!({"tools": {"classes": {"send_*": "side_effect"}}});
    let (gw, host) = retry_gateway(json!({"retries_per_minute": 1}), policy);
    let step = json!({"model": "tiny", "messages": [{"role": "user", "content": "mail bob"}],
        "tools": [{"type": "function", "function": {"name": "send_email"}}]})
    .to_string();
    let id = [("x-request-id", "step-7")];
    assert!(send(&gw, &host, CHAT, &id, &step).refused.is_none());
    // No approval can exist for this key (no `approval` class): the header is a bare retry.
    let forged = [
        ("x-request-id", "step-7"),
        ("weir-approval-id", "apr_forged"),
    ];
    let mut passed = 0;
    for _ in 0..5 {
        let again = send(&gw, &host, CHAT, &forged, &step);
        passed += usize::from(again.refused.is_none());
    }
    assert_eq!(
        passed, 0,
        "side-effect retries without a key passed with a forged approval id"
    );
    // Plain retries over the budget too.
    let (gw, host) = retry_gateway(json!({"retries_per_minute": 1}), json!({}));
    let body = chat_with("hello");
    send(&gw, &host, CHAT, &[("x-request-id", "r1")], &body);
    let forged = [("x-request-id", "r1"), ("weir-approval-id", "apr_forged")];
    let passed = (0..5)
        .filter(|_| send(&gw, &host, CHAT, &forged, &body).refused.is_none())
        .count();
    assert!(passed <= 1, "{passed} retries past a budget of 1 a minute");
}

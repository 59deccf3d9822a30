//! Tool calls held for an approver, end to end: the sidecar holds the approval-class call an
//! answer makes (called as the filter calls it, with signed headers), approvers decide on it
//! through weir's API behind the real Envoy and filter (an approver key, a key that approves
//! nothing, another org's approver), and the re-send gets the call once, without the engine
//! running again and without a ledger record. The whole flow also runs through the gateway
//! alone: the filter withholds the call, the client approves and re-sends as an agent would.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::time::Duration;

use reqwest::Response;
use serde_json::{Value, json};
use weir_core::tools::approval_id;
use weir_e2e::{Envoy, Sidecar, Sim, api_key, sse_events, vouched};

const AGENT: &str = "agentco/w/p/agent";
/// How long key `gw`'s held calls wait (its tool policy's `approval.ttl_ms`).
const GW_TTL_MS: u64 = 3_000;
const RUN: &str = "run-1";

struct Stack {
    sim: Sim,
    sidecar: Sidecar,
    envoy: Envoy,
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sim = Sim::start_tiny_fast(&[]);
        let sidecar = Sidecar::start(json!({
            "pools": [{"model": "tiny", "replicas": [sim.url], "cache_isolation": "shared"}],
        }));
        let mut ops = api_key("ops");
        ops["approves"] = json!(["agentco"]);
        let mut other = api_key("other");
        other["approves"] = json!(["globex"]);
        // The agent whose calls go through the gateway: its tool policy holds `deploy_*`.
        let mut gw = api_key("gw");
        gw["policy"] = json!({"tools": {"classes": {"deploy_*": "approval"},
                                        "approval": {"ttl_ms": GW_TTL_MS}}});
        let org = |id: &str, keys: Vec<Value>| {
            json!({"id": id, "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": keys}]}]})
        };
        let config = json!({
            "orgs": [
                org("agentco", vec![api_key("agent"), ops, api_key("dev"), gw]),
                org("globex", vec![other]),
            ],
            "models": {"tiny": {"max_context_tokens": 4096}},
        });
        let envoy = Envoy::start(&config, sidecar.port, sidecar.port);
        Stack {
            sim,
            sidecar,
            envoy,
        }
    })
}

/// A chat request offering `deploy_prod` whose prompt makes the simulator call it.
fn deploy_body(stream: bool) -> Value {
    json!({
        "model": "tiny", "max_tokens": 64, "stream": stream,
        "messages": [{"role": "user", "content": "call deploy_prod"}],
        "tools": [{"type": "function", "function": {"name": "deploy_prod",
            "parameters": {"type": "object", "properties": {"env": {"type": "string"}}}}}],
    })
}

/// One test at a time: each counts the engine's runs and the ledger's rows.
async fn turn() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A fresh attempt id, as the filter draws one per forward.
fn attempt_id() -> String {
    let n = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("weir-apr-{}-{n}", std::process::id())
}

/// Sends `body` to the sidecar as the filter would for `tenant` in `run` (approval patterns
/// `deploy_*` vouched), with `approval` as `weir-approval-id` if given.
async fn call(tenant: &str, run: &str, body: &Value, approval: Option<&str>) -> (String, Response) {
    call_at("/v1/chat/completions", tenant, run, body, approval).await
}

/// [`call`] to another API's path.
async fn call_at(
    path: &str,
    tenant: &str,
    run: &str,
    body: &Value,
    approval: Option<&str>,
) -> (String, Response) {
    let attempt = attempt_id();
    let extra = [("x-weir-run-id", run), ("x-weir-tool-approval", "deploy_*")];
    let mut req = reqwest::Client::new()
        .post(format!("{}{path}", stack().sidecar.url))
        .json(body);
    for (name, value) in vouched(tenant, &attempt, &extra) {
        req = req.header(name, value);
    }
    if let Some(id) = approval {
        req = req.header("weir-approval-id", id);
    }
    (attempt, req.send().await.unwrap())
}

/// The call of a streamed chat answer: its id, name and arguments assembled.
fn streamed_call(text: &str) -> (String, String, String) {
    let (mut id, mut name, mut arguments) = (String::new(), String::new(), String::new());
    for event in sse_events(text) {
        for delta in event["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            id.push_str(delta["id"].as_str().unwrap_or_default());
            name.push_str(delta["function"]["name"].as_str().unwrap_or_default());
            arguments.push_str(delta["function"]["arguments"].as_str().unwrap_or_default());
        }
    }
    (id, name, arguments)
}

/// Makes the model call `deploy_prod` in run `run`: the approval id and the call as made.
async fn held_call(run: &str, stream: bool) -> (String, (String, String, String)) {
    let body = deploy_body(stream);
    let (attempt, resp) = call(AGENT, run, &body, None).await;
    assert_eq!(resp.status(), 200);
    let made = if stream {
        streamed_call(&resp.text().await.unwrap())
    } else {
        let v: Value = resp.json().await.unwrap();
        let c = &v["choices"][0]["message"]["tool_calls"][0];
        let s = |v: &Value| v.as_str().unwrap().to_owned();
        (
            s(&c["id"]),
            s(&c["function"]["name"]),
            s(&c["function"]["arguments"]),
        )
    };
    assert_eq!(made.1, "deploy_prod");
    (approval_id(&attempt, 0, &made.0), made)
}

/// weir's approvals API through Envoy and the filter, with key `key-{key}`.
async fn api(key: &str, method: &str, path: &str) -> (u16, Value) {
    let url = format!("{}/v1/weir/approvals{path}", stack().envoy.url);
    let req = match method {
        "POST" => reqwest::Client::new().post(url),
        _ => reqwest::Client::new().get(url),
    };
    let resp = req.bearer_auth(format!("key-{key}")).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}

async fn engine_runs() -> f64 {
    stack().sim.gauge("vllm:request_success_total").await
}

#[tokio::test]
async fn an_approved_call_is_delivered_once_without_running_the_model_again() {
    let _turn = turn().await;
    let (id, made) = held_call(RUN, true).await;
    let body = deploy_body(true);

    // Pending: the re-send is told to wait.
    let (_, pending) = call(AGENT, RUN, &body, Some(&id)).await;
    assert_eq!(pending.status(), 409);
    assert!(pending.headers().get("retry-after").is_some());
    let pending: Value = pending.json().await.unwrap();
    assert_eq!(code(&pending), "approval_pending");

    // The approver sees it in its list, with the call whole, and approves it.
    let (status, list) = api("ops", "GET", "?state=pending").await;
    assert_eq!(status, 200, "{list}");
    let listed = list["data"].as_array().unwrap();
    let it = listed
        .iter()
        .find(|a| a["id"] == id.as_str())
        .expect("listed");
    assert_eq!(
        (&it["tool"], &it["arguments"]),
        (&json!("deploy_prod"), &json!(made.2))
    );
    assert_eq!((&it["tenant"], &it["run_id"]), (&json!(AGENT), &json!(RUN)));
    let (status, approved) = api("ops", "POST", &format!("/{id}/approve")).await;
    assert_eq!((status, &approved["state"]), (200, &json!("approved")));
    assert_eq!(approved["decided_by"], "agentco/w/p/ops");

    // Another tenant, another run, another body: refused, and none of it uses the approval.
    let (_, other_tenant) = call("globex/w/p/other", RUN, &body, Some(&id)).await;
    let (_, other_run) = call(AGENT, "run-2", &body, Some(&id)).await;
    assert_eq!(
        (other_tenant.status().as_u16(), other_run.status().as_u16()),
        (404, 404)
    );
    let other_run: Value = other_run.json().await.unwrap();
    assert_eq!(code(&other_run), "approval_not_found");
    let mut changed = body.clone();
    changed["max_tokens"] = json!(65);
    let (_, mismatch) = call(AGENT, RUN, &changed, Some(&id)).await;
    assert_eq!(mismatch.status(), 409);
    let mismatch: Value = mismatch.json().await.unwrap();
    assert_eq!(code(&mismatch), "approval_request_mismatch");

    // The re-send gets the call as the model made it, with the engine not run, no record.
    let runs = engine_runs().await;
    // The held call's own record is written by then (the writer is asynchronous).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rows = stack().sidecar.ledger_rows(Some(AGENT)).len();
    let (_, delivered) = call(AGENT, RUN, &body, Some(&id)).await;
    assert_eq!(delivered.status(), 200);
    let header = |name: &str| {
        delivered
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    assert_eq!(header("idempotent-replayed").as_deref(), Some("true"));
    assert_eq!(header("weir-approval").as_deref(), Some("delivered"));
    assert_eq!(streamed_call(&delivered.text().await.unwrap()), made);
    assert_eq!(engine_runs().await, runs, "the model did not run again");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        stack().sidecar.ledger_rows(Some(AGENT)).len(),
        rows,
        "nothing billed"
    );

    // Once only.
    let (_, again) = call(AGENT, RUN, &body, Some(&id)).await;
    assert_eq!(again.status(), 409);
    let again: Value = again.json().await.unwrap();
    assert_eq!(code(&again), "approval_used");
    let metrics = stack().sidecar.metrics().await;
    assert!(
        metrics.contains(r#"weir_approvals_total{tenant="agentco",outcome="delivered"}"#),
        "{metrics}"
    );
    let leaks: Vec<&str> = (metrics.lines())
        .filter(|l| !l.starts_with('#') && (l.contains(&id) || l.contains(&format!("\"{RUN}\""))))
        .collect();
    assert!(
        leaks.is_empty(),
        "no approval or run id in a label: {leaks:?}"
    );
}

#[tokio::test]
async fn a_rejected_call_is_never_delivered() {
    let _turn = turn().await;
    let (id, _) = held_call("run-rejected", false).await;
    let (status, rejected) = api("ops", "POST", &format!("/{id}/reject")).await;
    assert_eq!((status, &rejected["state"]), (200, &json!("rejected")));
    let (status, again) = api("ops", "POST", &format!("/{id}/approve")).await;
    assert_eq!((status, code(&again)), (409, "approval_decided"));
    let (_, resend) = call(AGENT, "run-rejected", &deploy_body(false), Some(&id)).await;
    assert_eq!(resend.status(), 403);
    let resend: Value = resend.json().await.unwrap();
    assert_eq!(code(&resend), "approval_rejected");
}

#[tokio::test]
async fn only_an_approver_of_the_tenant_decides_and_never_the_calling_key() {
    let _turn = turn().await;
    let (id, _) = held_call("run-scope", true).await;
    // A key that approves nothing is refused outright.
    let (status, dev) = api("dev", "GET", "?state=pending").await;
    assert_eq!((status, code(&dev)), (403, "not_an_approver"));
    let (status, dev) = api("dev", "POST", &format!("/{id}/approve")).await;
    assert_eq!((status, code(&dev)), (403, "not_an_approver"));
    // Another org's approver cannot see it, as if it did not exist.
    let (status, list) = api("other", "GET", "").await;
    assert_eq!(status, 200);
    assert!(
        !list["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["id"] == id.as_str())
    );
    for (method, path) in [
        ("GET", format!("/{id}")),
        ("POST", format!("/{id}/approve")),
    ] {
        let (status, other) = api("other", method, &path).await;
        assert_eq!(
            (status, code(&other)),
            (404, "approval_not_found"),
            "{method}"
        );
    }
    let (status, unknown) = api("ops", "GET", "/apr_aaaaaaaaaaaaaaaaaaaaaaaa").await;
    assert_eq!((status, code(&unknown)), (404, "approval_not_found"));
    // No key, or a forged approver header, gets nothing.
    let anonymous = reqwest::Client::new()
        .get(format!("{}/v1/weir/approvals", stack().envoy.url))
        .header("x-weir-approves", "agentco")
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    // The calling key, even vouched as an approver over itself, may not approve its own call.
    let attempt = attempt_id();
    let mut own = reqwest::Client::new().post(format!(
        "{}/v1/weir/approvals/{id}/approve",
        stack().sidecar.url
    ));
    for (name, value) in vouched(AGENT, &attempt, &[("x-weir-approves", "agentco")]) {
        own = own.header(name, value);
    }
    let own = own.send().await.unwrap();
    assert_eq!(own.status(), 403);
    let own: Value = own.json().await.unwrap();
    assert_eq!(code(&own), "self_approval_not_allowed");
    // The approver of its org may, through the gateway.
    let (status, approved) = api("ops", "POST", &format!("/{id}/approve")).await;
    assert_eq!((status, &approved["state"]), (200, &json!("approved")));
}

#[tokio::test]
async fn a_messages_call_is_held_and_delivered_in_anthropic_s_shape() {
    let _turn = turn().await;
    let body = json!({
        "model": "tiny", "max_tokens": 64,
        "messages": [{"role": "user", "content": "call deploy_prod"}],
        "tools": [{"name": "deploy_prod",
            "input_schema": {"type": "object", "properties": {"env": {"type": "string"}}}}],
    });
    let run = "run-messages";
    let (attempt, made) = call_at("/v1/messages", AGENT, run, &body, None).await;
    let made: Value = made.json().await.unwrap();
    let block = made["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .expect("a tool_use block")
        .clone();
    let id = approval_id(&attempt, 0, block["id"].as_str().unwrap());
    let (_, pending) = call_at("/v1/messages", AGENT, run, &body, Some(&id)).await;
    assert_eq!(pending.status(), 409);
    let pending: Value = pending.json().await.unwrap();
    assert_eq!(pending["type"], "error", "{pending}");
    assert_eq!(code(&pending), "approval_pending");
    let (status, _) = api("ops", "POST", &format!("/{id}/approve")).await;
    assert_eq!(status, 200);
    let runs = engine_runs().await;
    let (_, delivered) = call_at("/v1/messages", AGENT, run, &body, Some(&id)).await;
    assert_eq!(delivered.status(), 200);
    let delivered: Value = delivered.json().await.unwrap();
    assert_eq!(delivered["type"], "message");
    assert_eq!(delivered["stop_reason"], "tool_use");
    assert_eq!(delivered["content"], json!([block]));
    assert_eq!(delivered["usage"]["output_tokens"], 0);
    assert_eq!(engine_runs().await, runs, "the model did not run again");
}

/// Key `gw`'s streamed call in `run` through the gateway (`approval` as `weir-approval-id`):
/// its status and text.
async fn through_gateway(key: &str, run: &str, approval: Option<&str>) -> (u16, String) {
    let url = format!("{}/v1/chat/completions", stack().envoy.url);
    let mut headers = vec![("x-weir-run-id", run)];
    headers.extend(approval.map(|id| ("weir-approval-id", id)));
    let body = deploy_body(true).to_string();
    let resp = weir_e2e::post_json(&url, Some(key), body, &headers).await;
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// The error a withheld answer ended with (its stream's error event), or a refusal's body's.
fn error_in(text: &str) -> Value {
    let events = if text.starts_with('{') {
        vec![serde_json::from_str(text).unwrap()]
    } else {
        sse_events(text)
    };
    let event = events.into_iter().find(|e| e.get("error").is_some());
    event.map(|e| e["error"].clone()).unwrap_or(Value::Null)
}

/// Makes key `gw`'s model call `deploy_prod` in `run` through the gateway: the approval the
/// filter names, after checking no part of the call reached the client.
async fn withheld(run: &str) -> Value {
    let (status, text) = through_gateway("gw", run, None).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        streamed_call(&text).1,
        "",
        "no part of the call reached the client: {text}"
    );
    let error = error_in(&text);
    assert_eq!(error["code"], "approval_required", "{text}");
    assert_eq!(error["tool"], "deploy_prod");
    assert_eq!(error["run_id"], run);
    error
}

#[tokio::test]
async fn through_the_gateway_a_call_is_withheld_approved_and_delivered_once() {
    let _turn = turn().await;
    let runs = engine_runs().await;
    let error = withheld("gw-run").await;
    let id = error["approval_id"].as_str().unwrap().to_owned();
    assert_eq!(engine_runs().await, runs + 1.0);

    // Pending, then approved by the org's approver through weir's API.
    let (status, pending) = through_gateway("gw", "gw-run", Some(&id)).await;
    assert_eq!(
        (status, code(&serde_json::from_str(&pending).unwrap())),
        (409, "approval_pending")
    );
    let (status, approved) = api("ops", "POST", &format!("/{id}/approve")).await;
    assert_eq!(
        (status, &approved["state"]),
        (200, &json!("approved")),
        "{approved}"
    );

    // Another tenant presenting it, or another run, finds nothing.
    for (key, run) in [("other", "gw-run"), ("gw", "gw-run-2")] {
        let (status, text) = through_gateway(key, run, Some(&id)).await;
        assert_eq!(
            (status, error_in(&text)["code"].as_str()),
            (404, Some("approval_not_found"))
        );
    }

    // The re-send gets the call as the model made it, the digest the one the filter named, and
    // the engine does not run again.
    let (status, text) = through_gateway("gw", "gw-run", Some(&id)).await;
    assert_eq!(status, 200, "{text}");
    let (call_id, name, arguments) = streamed_call(&text);
    assert_eq!(name, "deploy_prod", "{text}");
    assert!(!call_id.is_empty(), "{text}");
    let digest = weir_core::tools::arguments_sha256(&arguments);
    assert_eq!(json!(digest), error["arguments_sha256"]);
    assert_eq!(engine_runs().await, runs + 1.0, "the model ran once");

    // Replayed: used.
    let (status, text) = through_gateway("gw", "gw-run", Some(&id)).await;
    assert_eq!(
        (status, error_in(&text)["code"].as_str()),
        (409, Some("approval_used"))
    );
    assert_eq!(engine_runs().await, runs + 1.0);
}

#[tokio::test]
async fn through_the_gateway_a_rejected_or_expired_call_is_never_delivered() {
    let _turn = turn().await;
    let rejected = withheld("gw-rejected").await;
    let rejected = rejected["approval_id"].as_str().unwrap().to_owned();
    let expiring = withheld("gw-expiring").await;
    let expiring = expiring["approval_id"].as_str().unwrap().to_owned();
    let (status, _) = api("ops", "POST", &format!("/{rejected}/reject")).await;
    assert_eq!(status, 200);
    let (status, text) = through_gateway("gw", "gw-rejected", Some(&rejected)).await;
    assert_eq!(
        (status, error_in(&text)["code"].as_str()),
        (403, Some("approval_rejected"))
    );
    // Past the key's `approval.ttl_ms`: gone, for the approver and for the re-send alike.
    tokio::time::sleep(Duration::from_millis(GW_TTL_MS + 200)).await;
    let (status, late) = api("ops", "POST", &format!("/{expiring}/approve")).await;
    assert_eq!((status, code(&late)), (404, "approval_not_found"));
    let (status, text) = through_gateway("gw", "gw-expiring", Some(&expiring)).await;
    assert_eq!(
        (status, error_in(&text)["code"].as_str()),
        (404, Some("approval_not_found"))
    );
}

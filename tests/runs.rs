//! A run's budgets through the real stack — Envoy with the built filter, the sidecar, the
//! simulator: concurrent calls of one run admitted exactly up to the budget, and run ids that
//! never reach across tenants.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::BTreeMap;
use std::sync::OnceLock;

use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, post_json, sidecar_bin};

/// Calls sent at once in the concurrency tests.
const CALLS: usize = 32;
const MODEL_CALLS: u64 = 10;
/// Each call's `max_tokens`: what it reserves of an output budget.
const MAX_TOKENS: u64 = 16;

struct Stack {
    _sim: Sim,
    _sidecar: Sidecar,
    envoy: Envoy,
}

/// A key in an org of its own whose runs are held to `budgets`.
fn org(id: &str, budgets: Value) -> Value {
    json!({"id": id, "policy": {"runs": {"budgets": budgets}},
           "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [api_key(id)]}]}]})
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        // Slow enough that the calls of a burst are in flight together.
        let sim = Sim::start(&["--preset", "tiny", "--time-scale", "2"]);
        let sidecar = Sidecar::start_from(
            &sidecar_bin(),
            json!({
                "queue": {"max_per_tenant": 128, "deadline_ms": 30000},
                "pools": [{"model": "tiny", "replicas": [sim.url]}],
            }),
        );
        sidecar.wait_for_probes(1);
        let config = json!({
            "orgs": [
                org("calls", json!({"model_calls": MODEL_CALLS})),
                org("tokens", json!({"output_tokens": MODEL_CALLS * MAX_TOKENS})),
                org("alpha", json!({"model_calls": 3})),
                org("beta", json!({"model_calls": 3})),
            ],
            "models": {"tiny": {"max_context_tokens": 4096}},
        });
        let envoy = Envoy::start(&config, sidecar.port, sidecar.port);
        Stack {
            _sim: sim,
            _sidecar: sidecar,
            envoy,
        }
    })
}

/// One call of run `run_id` as `key`: its status and body.
async fn call(key: &str, run_id: &str) -> (StatusCode, Value) {
    let url = format!("{}/v1/chat/completions", stack().envoy.url);
    let body = chat_body(
        "tiny",
        "a step of the run",
        json!({"max_tokens": MAX_TOKENS}),
    );
    let resp = post_json(
        &url,
        Some(key),
        body.to_string(),
        &[("x-weir-run-id", run_id)],
    )
    .await;
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// `CALLS` calls of one run at once: how many got each status, and the budgets refusals named.
async fn burst(key: &str, run_id: &str) -> (BTreeMap<u16, usize>, BTreeMap<String, usize>) {
    let answers = join_all((0..CALLS).map(|_| call(key, run_id))).await;
    let (mut statuses, mut budgets) = (BTreeMap::new(), BTreeMap::new());
    for (status, body) in answers {
        *statuses.entry(status.as_u16()).or_default() += 1;
        if status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(body["error"]["code"], "run_budget_exceeded", "{body}");
            let budget = body["error"]["budget"].as_str().unwrap_or("?").to_owned();
            *budgets.entry(budget).or_default() += 1;
        }
    }
    (statuses, budgets)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_calls_of_one_run_admit_exactly_its_budget() {
    let (statuses, budgets) = burst("calls", "burst-1").await;
    println!(
        "{CALLS} calls at once, model_calls {MODEL_CALLS}: {statuses:?}, refusals {budgets:?}"
    );
    let admitted = MODEL_CALLS as usize;
    assert_eq!(
        statuses,
        BTreeMap::from([(200, admitted), (429, CALLS - admitted)]),
        "exactly the budget is admitted, every other call refused by it"
    );
    assert_eq!(
        budgets,
        BTreeMap::from([("model_calls".to_owned(), CALLS - admitted)])
    );
    // The run stays spent; another run of the same key has its own budget.
    assert_eq!(
        call("calls", "burst-1").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(call("calls", "burst-2").await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_calls_of_one_run_admit_exactly_its_output_token_budget() {
    let (statuses, budgets) = burst("tokens", "burst-1").await;
    let budget = MODEL_CALLS * MAX_TOKENS;
    println!(
        "{CALLS} calls at once, output_tokens {budget} ({MAX_TOKENS} each): {statuses:?}, refusals {budgets:?}"
    );
    // Each call reserves its ceiling, so the budget admits exactly budget / ceiling calls.
    let admitted = MODEL_CALLS as usize;
    assert_eq!(
        statuses,
        BTreeMap::from([(200, admitted), (429, CALLS - admitted)])
    );
    assert_eq!(
        budgets,
        BTreeMap::from([("output_tokens".to_owned(), CALLS - admitted)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_s_run_id_cannot_read_extend_or_exhaust_another_tenant_s_run() {
    // Tenant alpha spends its run `shared-id`.
    for i in 0..3 {
        assert_eq!(
            call("alpha", "shared-id").await.0,
            StatusCode::OK,
            "alpha call {i}"
        );
    }
    let (status, refusal) = call("alpha", "shared-id").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        (
            refusal["error"]["used"].as_u64(),
            refusal["error"]["limit"].as_u64()
        ),
        (Some(3), Some(3))
    );
    // Beta's run of the same id is another run: its whole budget, and its refusal tells only
    // its own use.
    for i in 0..3 {
        assert_eq!(
            call("beta", "shared-id").await.0,
            StatusCode::OK,
            "beta call {i}"
        );
    }
    let (status, refusal) = call("beta", "shared-id").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refusal["error"]["run_id"], "shared-id");
    assert_eq!(refusal["error"]["used"].as_u64(), Some(3));
    // Alpha's is still spent (beta's calls did not reset or refund it), and a caller cannot
    // pass weir's own trusted run header to reach it: the filter strips and re-vouches it.
    assert_eq!(
        call("alpha", "shared-id").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let url = format!("{}/v1/chat/completions", stack().envoy.url);
    let body = chat_body("tiny", "x", json!({"max_tokens": 4}));
    let forged = post_json(
        &url,
        Some("beta"),
        body.to_string(),
        &[
            ("x-weir-run-id", "fresh"),
            ("x-weir-tenant", "alpha/w/p/alpha"),
        ],
    )
    .await;
    assert_eq!(forged.status(), StatusCode::OK, "beta's own run `fresh`");
    assert_eq!(
        call("alpha", "shared-id").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

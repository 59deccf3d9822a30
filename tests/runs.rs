//! A run's budgets through the real stack — Envoy with the built filter, the sidecar, the
//! simulator: scripted agents on the official `openai` and `anthropic` SDKs
//! (`tests/python/agent_loop.py`) refused at exactly the call that would cross each budget,
//! concurrent calls of one run admitted exactly up to the budget, and run ids that never reach
//! across tenants.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::OnceLock;

use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, post_json, sidecar_bin, workspace_root};

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
                org("loop-calls", json!({"model_calls": LOOP_CALLS})),
                org("loop-output", json!({"output_tokens": LOOP_OUTPUT})),
                org("loop-input", json!({"input_tokens": LOOP_INPUT})),
                org("loop-cost", json!({"cost_micros": LOOP_COST})),
                org("loop-runtime", json!({"runtime_ms": LOOP_RUNTIME_MS})),
                org("loop-parallel", json!({"parallel_calls": 2})),
                org("loop-retries", json!({"retries": 2})),
                org("loop-tools", json!({"tool_calls": LOOP_TOOLS})),
            ],
            "models": {"tiny": {"max_context_tokens": 4096}},
            // A micro-unit per token, so a cost budget reads as tokens.
            "prices": {"currency": "USD", "default": {"input": 1.0, "output": 1.0}},
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
    // Counted by tenant and budget on Envoy's Prometheus page (never by run id).
    let page = reqwest::get(format!("{}/stats/prometheus", stack().envoy.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let counter = r#"weir_run_refusals_total{tenant="calls",budget="model_calls"}"#;
    let counted = (page.lines()).find_map(|l| l.strip_prefix(counter)?.trim().parse::<u64>().ok());
    assert_eq!(
        counted,
        Some((CALLS - admitted) as u64),
        "{counter} in Envoy's stats"
    );
    assert!(!page.contains("burst-1"), "no run id in metrics");
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

/// `calls` calls of run `run_id` as `key`, each answered, then one more, refused: its body.
async fn spend(key: &str, run_id: &str, calls: usize) -> Value {
    for i in 0..calls {
        assert_eq!(call(key, run_id).await.0, StatusCode::OK, "{key} call {i}");
    }
    let (status, refusal) = call(key, run_id).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{refusal}");
    refusal
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_s_run_id_cannot_read_extend_or_exhaust_another_tenant_s_run() {
    // Tenant alpha spends its run `shared-id`.
    let refusal = spend("alpha", "shared-id", 3).await;
    assert_eq!(
        (
            refusal["error"]["used"].as_u64(),
            refusal["error"]["limit"].as_u64()
        ),
        (Some(3), Some(3))
    );
    // Beta's run of the same id is another run: its whole budget, and its refusal tells only
    // its own use.
    let refusal = spend("beta", "shared-id", 3).await;
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

const LOOP_CALLS: u64 = 6;
/// Five calls' `max_tokens` and half of one: the sixth call's ceiling crosses it.
const LOOP_OUTPUT: u64 = 5 * MAX_TOKENS + MAX_TOKENS / 2;
const LOOP_INPUT: u64 = 400;
const LOOP_COST: u64 = 500;
const LOOP_RUNTIME_MS: u64 = 2_500;
/// The agent's model calls alternate a tool call and text (the simulator answers a tool
/// result with text): the third tool call comes at its fifth model call.
const LOOP_TOOLS: u64 = 2;

/// What one call of a scripted agent came to (a line of `agent_loop.py`'s output).
#[derive(Debug)]
struct Step {
    ok: bool,
    status: Option<u64>,
    error: Value,
    prompt_tokens: u64,
    tool_calls: u64,
}

/// Runs the scripted agent on `sdk` as `key` for run `run_id`, up to `calls` calls (`extra`
/// its further flags): each call's outcome, in order.
fn agent(sdk: &str, key: &str, run_id: &str, calls: u64, extra: &[&str]) -> Vec<Step> {
    let root = workspace_root();
    let out = Command::new(root.join(".weir/venv/bin/python"))
        .arg(root.join("tests/python/agent_loop.py"))
        .args([
            sdk,
            &stack().envoy.url,
            &format!("key-{key}"),
            run_id,
            &calls.to_string(),
        ])
        .args(extra)
        .output()
        .expect("the project venv's python (`cargo xtask test` installs it)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "agent_loop.py failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap();
            Step {
                ok: v["ok"] == true,
                status: v["status"].as_u64(),
                error: v["error"].clone(),
                prompt_tokens: v["prompt_tokens"].as_u64().unwrap_or(0),
                tool_calls: v["tool_calls"].as_u64().unwrap_or(0),
            }
        })
        .collect()
}

/// The agent's calls up to its first refusal: how many were served, and the refusal, which
/// must be `run_budget_exceeded` on `budget`, status 429.
fn refused_after(steps: &[Step], budget: &str) -> (usize, Value) {
    refused_with(steps, budget, &[Some(429)])
}

/// [`refused_after`] for a refusal with one of `statuses` (as the SDK tells it).
fn refused_with(steps: &[Step], budget: &str, statuses: &[Option<u64>]) -> (usize, Value) {
    let served = steps.iter().take_while(|s| s.ok).count();
    let refused = steps
        .get(served)
        .unwrap_or_else(|| panic!("never refused: {steps:?}"));
    let error = &refused.error;
    assert!(statuses.contains(&refused.status), "{refused:?}");
    assert_eq!(error["code"], "run_budget_exceeded", "{error}");
    assert_eq!(error["budget"], budget, "{error}");
    (served, error.clone())
}

const SDKS: [&str; 2] = ["openai", "anthropic"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_agents_are_refused_at_the_call_that_would_cross_a_model_call_budget() {
    for sdk in SDKS {
        let run = format!("{sdk}-calls");
        let steps = agent(sdk, "loop-calls", &run, 20, &[]);
        let (served, error) = refused_after(&steps, "model_calls");
        println!("{sdk}: model_calls {LOOP_CALLS}: {served} calls served, then {error}");
        assert_eq!(served as u64, LOOP_CALLS, "{sdk}");
        assert_eq!(
            (error["limit"].as_u64(), error["used"].as_u64()),
            (Some(LOOP_CALLS), Some(LOOP_CALLS))
        );
        assert!(steps.iter().any(|s| s.ok), "{sdk}");
        // A second run of the same key is unaffected.
        let other = agent(sdk, "loop-calls", &format!("{run}-2"), 2, &[]);
        assert!(other.iter().all(|s| s.ok), "{sdk}: {other:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_agents_are_refused_at_the_call_that_would_cross_an_output_token_budget() {
    for sdk in SDKS {
        let steps = agent(
            sdk,
            "loop-output",
            &format!("{sdk}-output"),
            20,
            &["--ignore-eos"],
        );
        let (served, error) = refused_after(&steps, "output_tokens");
        println!(
            "{sdk}: output_tokens {LOOP_OUTPUT} ({MAX_TOKENS} a call): {served} served, then {error}"
        );
        // Each call reserves its ceiling and, ignoring its end, uses all of it.
        assert_eq!(served, 5, "{sdk}");
        assert_eq!(error["used"].as_u64(), Some(5 * MAX_TOKENS), "{sdk}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_agents_are_refused_at_the_call_that_would_cross_an_input_token_or_cost_budget() {
    for sdk in SDKS {
        for (key, budget, limit) in [
            ("loop-input", "input_tokens", LOOP_INPUT),
            ("loop-cost", "cost_micros", LOOP_COST),
        ] {
            let steps = agent(sdk, key, &format!("{sdk}-{budget}"), 40, &[]);
            let (served, error) = refused_after(&steps, budget);
            let used = error["used"].as_u64().unwrap();
            println!("{sdk}: {budget} {limit}: {served} served, used {used}");
            assert!(served > 0 && used <= limit, "{sdk} {budget}: {error}");
            // What the served calls used is what the run counted: the engine's own counts.
            let prompts: u64 = steps[..served].iter().map(|s| s.prompt_tokens).sum();
            if budget == "input_tokens" {
                assert_eq!(
                    used, prompts,
                    "{sdk}: the run counts the engine's prompt tokens"
                );
            } else {
                assert!(used > prompts, "{sdk}: cost counts output too");
            }
            // Refused because this call's ask (its prompt's estimate, and its output ceiling
            // at the price) would have crossed it.
            let requested = error["requested"].as_u64().unwrap();
            assert!(
                used + requested > limit,
                "{sdk} {budget}: refused with room left: {error}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_agents_are_refused_once_the_run_s_runtime_is_over() {
    for sdk in SDKS {
        // A call a second: the fourth comes 3 s after the first, past 2.5 s.
        let steps = agent(
            sdk,
            "loop-runtime",
            &format!("{sdk}-runtime"),
            10,
            &["--pause", "1"],
        );
        let (served, error) = refused_after(&steps, "runtime_ms");
        println!("{sdk}: runtime_ms {LOOP_RUNTIME_MS}: {served} served, then {error}");
        assert_eq!(served, 3, "{sdk}");
        assert!(error["used"].as_u64().unwrap() > LOOP_RUNTIME_MS);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_branches_past_the_run_s_parallel_calls_are_refused() {
    for sdk in SDKS {
        // Three long branches at once against two places.
        let args = ["--parallel", "3", "--max-tokens", "200", "--ignore-eos"];
        let steps = agent(sdk, "loop-parallel", &format!("{sdk}-parallel"), 3, &args);
        let refused: Vec<&Step> = steps.iter().filter(|s| !s.ok).collect();
        println!(
            "{sdk}: parallel_calls 2, 3 branches: {} refused",
            refused.len()
        );
        assert_eq!(refused.len(), 1, "{sdk}: {steps:?}");
        assert_eq!(refused[0].error["budget"], "parallel_calls");
        assert_eq!(refused[0].status, Some(429));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_agents_that_retry_each_call_are_refused_at_the_retry_past_the_budget() {
    for sdk in SDKS {
        // Each call sent twice: first, retry, first, retry, first, then the third retry.
        let steps = agent(
            sdk,
            "loop-retries",
            &format!("{sdk}-retries"),
            10,
            &["--retry-each"],
        );
        let (served, error) = refused_after(&steps, "retries");
        println!("{sdk}: retries 2, every call retried once: {served} sends served, then {error}");
        assert_eq!(served, 5, "{sdk}");
        assert_eq!(
            (error["used"].as_u64(), error["limit"].as_u64()),
            (Some(2), Some(2))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_agents_are_cut_at_the_tool_call_that_would_cross_a_tool_call_budget() {
    for sdk in SDKS {
        let steps = agent(sdk, "loop-tools", &format!("{sdk}-tools"), 20, &[]);
        // The answer's headers went before its third call was made: the SDK reads the error
        // event that ends the stream (OpenAI's SDK gives it no status, Anthropic's the 200).
        let (served, error) = refused_with(&steps, "tool_calls", &[None, Some(200)]);
        let made: u64 = steps[..served].iter().map(|s| s.tool_calls).sum();
        println!(
            "{sdk}: tool_calls {LOOP_TOOLS}: {served} calls served making {made} tool calls, then {error}"
        );
        assert_eq!(made, LOOP_TOOLS, "{sdk}: {steps:?}");
        assert_eq!(
            served, 4,
            "{sdk}: tool, text, tool, text, then the third tool call"
        );
        assert_eq!(
            (error["limit"].as_u64(), error["used"].as_u64()),
            (Some(LOOP_TOOLS), Some(LOOP_TOOLS)),
            "{error}"
        );
    }
}

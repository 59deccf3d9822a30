//! Tenant isolation of engines' prefix caches, end to end: real Envoy with the filter → the
//! sidecar → a simulator in vLLM's dialect (honours `cache_salt`), one in llama.cpp's
//! (ignores it, honours `cache_prompt: false`), and an engine that ignores both. Each pool has
//! one replica, so two tenants' identical prompts meet on the same engine. The stack is shared
//! by the tests of this binary; each uses prompts of its own.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, post_json};

struct Stack {
    vllm: Sim,
    llama: Sim,
    sidecar: Sidecar,
    envoy: Envoy,
}

const TENANTS: [&str; 8] = [
    "vllm-a", "vllm-b", "llama-a", "llama-b", "forcer-a", "forcer-b", "unsafe", "probe",
];

/// The x-request-id prefix of weir's own probe requests.
const PROBE_ID: &str = "weir-isolation-probe-";

fn weir_config() -> Value {
    let keys: Vec<Value> = TENANTS.iter().map(|id| api_key(id)).collect();
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "iso", "keys": keys}]}]}],
        "models": {
            "tiny": {"max_context_tokens": 4096},
            "llama": {"max_context_tokens": 4096},
            "unsafe": {"max_context_tokens": 4096},
        },
    })
}

/// Tenant requests (not weir's probes) that reached the [`unsafe_engine`].
static UNSAFE_TENANT_POSTS: AtomicUsize = AtomicUsize::new(0);

/// An engine with a prefix cache it shares across salts and that its `cache_prompt` does not
/// turn off: every answer reports 288 cached tokens. weir can isolate nothing there.
fn unsafe_engine() -> String {
    weir_e2e::serve_engine(|head, _body| {
        if !head.starts_with("POST") {
            return ("text/plain", String::new());
        }
        if !head.contains(PROBE_ID) {
            UNSAFE_TENANT_POSTS.fetch_add(1, Ordering::SeqCst);
        }
        let answer = json!({"id": "chatcmpl-unsafe", "object": "chat.completion", "created": 0,
            "model": "unsafe", "choices": [{"index": 0, "finish_reason": "length",
            "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301,
                "prompt_tokens_details": {"cached_tokens": 288}}});
        ("application/json", answer.to_string())
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let vllm = Sim::start_tiny_fast(&["--record-requests", "256"]);
        let llama = Sim::start_tiny_fast(&[
            "--served-model-name",
            "llama",
            "--metrics-dialect",
            "llamacpp",
            "--record-requests",
            "256",
        ]);
        let unsafe_engine = unsafe_engine();
        let sidecar = Sidecar::start(json!({
            // A request for a pool no replica of which serves is refused within this.
            "queue": {"deadline_ms": 3000},
            "pools": [
                {"model": "tiny", "replicas": [vllm.url]},
                {"model": "llama", "replicas": [llama.url]},
                {"model": "unsafe", "replicas": [unsafe_engine]},
            ],
        }));
        let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
        sidecar.wait_for_probes(3);
        Stack {
            vllm,
            llama,
            sidecar,
            envoy,
        }
    })
}

/// A prompt of about 600 tokens, distinct per `tag`: many cache blocks.
fn prompt(tag: &str) -> String {
    format!("{tag}: {}", "pack the cache ".repeat(200))
}

/// Sends `content` to `model` as tenant `key` through Envoy; returns the answer's status and
/// body.
async fn ask(key: &str, model: &str, content: &str, extra: Value) -> (StatusCode, Value) {
    let mut extra = extra;
    extra["max_tokens"] = json!(1);
    let body = chat_body(model, content, extra).to_string();
    let url = format!("{}/v1/chat/completions", stack().envoy.url);
    let resp = post_json(&url, Some(key), body, &[]).await;
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// The cached prompt tokens a tenant's answer reports (absent counts as 0).
async fn cached(key: &str, model: &str, content: &str, extra: Value) -> u64 {
    let (status, v) = ask(key, model, content, extra).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// What an engine received with a prompt starting with `tag`.
async fn received_with(sim: &Sim, tag: &str) -> Vec<Value> {
    sim.received()
        .await
        .into_iter()
        .filter(|r| {
            r["body"]["messages"][0]["content"]
                .as_str()
                .is_some_and(|c| c.starts_with(tag))
        })
        .collect()
}

#[tokio::test]
async fn a_second_tenants_identical_prompt_gets_no_hit_from_the_first_on_an_engine_that_ignores_the_salt()
 {
    let s = stack();
    let p = prompt("llama shared");
    cached("llama-a", "llama", &p, json!({})).await;
    cached("llama-a", "llama", &p, json!({})).await;
    assert_eq!(
        cached("llama-b", "llama", &p, json!({})).await,
        0,
        "tenant B's identical prompt is not served from tenant A's cache"
    );
    let sent = received_with(&s.llama, "llama shared").await;
    assert_eq!(sent.len(), 3);
    for r in &sent {
        assert_eq!(
            r["body"]["cache_prompt"], false,
            "weir's off-switch on every request"
        );
    }
}

#[tokio::test]
async fn an_engine_that_honours_the_salt_keeps_hits_within_a_tenant_only() {
    let p = prompt("vllm shared");
    assert_eq!(cached("vllm-a", "tiny", &p, json!({})).await, 0, "cold");
    assert!(
        cached("vllm-a", "tiny", &p, json!({})).await > 500,
        "a tenant's second identical prompt hits its own cache"
    );
    assert_eq!(
        cached("vllm-b", "tiny", &p, json!({})).await,
        0,
        "another tenant's identical prompt does not"
    );
    let sent = received_with(&stack().vllm, "vllm shared").await;
    assert!(
        sent.iter().all(|r| r["body"].get("cache_prompt").is_none()),
        "the salt alone isolates: no off-switch"
    );
}

#[tokio::test]
async fn a_callers_cache_prompt_cannot_override_weirs_off_switch() {
    let s = stack();
    let p = prompt("forced on");
    let on = json!({"cache_prompt": true});
    cached("forcer-a", "llama", &p, on.clone()).await;
    cached("forcer-a", "llama", &p, on.clone()).await;
    assert_eq!(
        cached("forcer-b", "llama", &p, on).await,
        0,
        "asking for the cache does not get another tenant's hits"
    );
    let sent = received_with(&s.llama, "forced on").await;
    assert_eq!(sent.len(), 3);
    for r in &sent {
        assert_eq!(r["body"]["cache_prompt"], false, "{}", r["body"]);
    }
}

#[tokio::test]
async fn ready_and_the_metric_report_each_replicas_mode() {
    let s = stack();
    let (status, ready) = s.sidecar.ready().await;
    assert_eq!(
        status, 503,
        "the unsafe pool has no replica that may serve: {ready}"
    );
    assert_eq!(ready["ready"], false);
    let replica = |model: &str| {
        let pool = ready["pools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["model"] == model)
            .unwrap_or_else(|| panic!("{model} in {ready}"));
        pool["replicas"][0].clone()
    };
    let (vllm, llama, unsafe_) = (replica("tiny"), replica("llama"), replica("unsafe"));
    assert_eq!(
        (&vllm["cache_isolation"], &vllm["serving"]),
        (&json!("salt"), &json!(true))
    );
    assert_eq!(
        (&llama["cache_isolation"], &llama["serving"]),
        (&json!("cache_off"), &json!(true))
    );
    assert_eq!(
        (
            &unsafe_["cache_isolation"],
            &unsafe_["healthy"],
            &unsafe_["serving"]
        ),
        (&json!("none"), &json!(true), &json!(false))
    );
    assert!(
        unsafe_["cache_isolation_reason"]
            .as_str()
            .is_some_and(|r| r.contains("ignores cache_salt")),
        "{unsafe_}"
    );

    let metrics = s.sidecar.metrics().await;
    let mode = |url: &Value| {
        let on: Vec<&str> = metrics
            .lines()
            .filter(|l| {
                l.starts_with(&format!(
                    "weir_replica_cache_isolation{{replica=\"{}\",",
                    url.as_str().unwrap()
                )) && l.ends_with(" 1")
            })
            .collect();
        assert_eq!(on.len(), 1, "one mode per replica: {on:?}");
        on[0]
            .split("mode=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .to_owned()
    };
    assert_eq!(mode(&vllm["url"]), "salt");
    assert_eq!(mode(&llama["url"]), "cache_off");
    assert_eq!(mode(&unsafe_["url"]), "none");
}

#[tokio::test]
async fn a_replica_weir_cannot_isolate_gets_no_tenant_traffic() {
    let (status, v) = ask("unsafe", "unsafe", "anything", json!({})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(UNSAFE_TENANT_POSTS.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn probe_traffic_is_weirs_own() {
    let s = stack();
    // A tenant request, to compare salts with.
    cached("probe", "tiny", &prompt("probe compare"), json!({})).await;
    cached("probe", "llama", &prompt("probe compare"), json!({})).await;
    let mut tenant_salts = Vec::new();
    for sim in [&s.vllm, &s.llama] {
        for r in received_with(sim, "probe compare").await {
            tenant_salts.push(r["body"]["cache_salt"].clone());
        }
    }
    assert_eq!(tenant_salts.len(), 2);
    for sim in [&s.vllm, &s.llama] {
        let probes: Vec<Value> = sim
            .received()
            .await
            .into_iter()
            .filter(|r| {
                r["headers"]["x-request-id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with(PROBE_ID))
            })
            .collect();
        assert!(probes.len() >= 3, "probed: {}", probes.len());
        for p in &probes {
            assert_eq!(p["body"]["max_tokens"], 1);
            assert_eq!(p["body"]["stream"], false);
            assert!(
                !tenant_salts.contains(&p["body"]["cache_salt"]),
                "never a tenant's salt"
            );
        }
    }
    let off_switched = received_probe_count(&s.llama, true).await;
    assert!(off_switched >= 1, "the off-switch was tried on llama.cpp");
    assert_eq!(received_probe_count(&s.vllm, true).await, 0);
    // Never in the ledger: every row is a tenant's request.
    for row in s.sidecar.ledger_rows(None) {
        assert!(
            TENANTS
                .iter()
                .any(|t| row.tenant == format!("acme/lab/iso/{t}")),
            "{row:?}"
        );
        assert!(!row.request_id.starts_with(PROBE_ID));
    }
}

/// Probe requests an engine received with the off-switch (`with_switch`) or without it.
async fn received_probe_count(sim: &Sim, with_switch: bool) -> usize {
    sim.received()
        .await
        .iter()
        .filter(|r| {
            r["headers"]["x-request-id"]
                .as_str()
                .is_some_and(|id| id.starts_with(PROBE_ID))
                && (r["body"]["cache_prompt"] == false) == with_switch
        })
        .count()
}

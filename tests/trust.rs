//! Trust between the filter and the sidecar, the identity of attempts, idempotency and billing
//! of retries, and the rollout modes — end to end: real Envoy with the filter → the sidecar →
//! the simulator, on loopback.
//!
//! Two Envoys share one sidecar. `main` has the shipped routes (enforce on `/`, shadow on
//! `/shadow/`, a 0% rollout on `/dark/`) and sends `/alt/` straight to a recording engine, so a
//! test can capture what the filter signs. `rollout` enforces `/` for half of the requests and
//! has `/alt/` off.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::time::Duration;

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};
use weir_core::keys::hash_key;
use weir_e2e::{Envoy, Sidecar, Sim, http_get, wait_for};
use weir_sidecar::ledger::UsageRecord;

struct Stack {
    _engine: Sim,
    recorder: Sim,
    sidecar: Sidecar,
    main: Envoy,
    _rollout: Envoy,
}

const KEYS: [&str; 8] = [
    "alice", "bob", "trace", "idem", "race", "retry", "modes", "capture",
];

fn weir_config(routes: Value) -> Value {
    let keys: Vec<Value> = KEYS
        .iter()
        .map(|id| json!({"id": id, "sha256": hash_key(&format!("key-{id}"))}))
        .collect();
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "trust", "keys": keys}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "routes": routes,
        "default_tenant": {"path": "anonymous", "tier": "free", "weight": 0.5},
        "signing": {"secret_env": weir_e2e::SIGNING_SECRET_ENV, "ttl_ms": 3000},
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let engine = Sim::start(&[
            "--preset",
            "tiny",
            "--time-scale",
            "10",
            "--output-len",
            "fixed:8",
            "--record-requests",
            "500",
        ]);
        let recorder = Sim::start(&[
            "--preset",
            "tiny",
            "--time-scale",
            "10",
            "--output-len",
            "fixed:4",
            "--record-requests",
            "100",
        ]);
        let sidecar = Sidecar::start(json!({
            "cache_salt_secret": "trust-e2e-salt-0123456789",
            "pools": [{"model": "tiny", "replicas": [engine.url]}],
        }));
        let main = Envoy::start(
            &weir_config(json!({"by_name": {"shadowed": {"mode": "shadow"}}})),
            sidecar.port,
            recorder.port,
        );
        let rollout = Envoy::start(
            &weir_config(json!({
                "default": {"mode": "enforce", "rollout_percent": 50},
                "by_name": {"alt": {"mode": "off"}},
            })),
            sidecar.port,
            sidecar.port,
        );
        let addr = sidecar.url.trim_start_matches("http://").to_owned();
        wait_for(Duration::from_secs(10), || {
            let text = http_get(&addr, "/metrics")?;
            text.contains("weir_replica_healthy{").then_some(())
        })
        .expect("replica probed");
        Stack {
            _engine: engine,
            recorder,
            sidecar,
            main,
            _rollout: rollout,
        }
    })
}

fn chat(content: &str, extra: Value) -> String {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": content}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body.to_string()
}

async fn send(url: &str, key: Option<&str>, body: String, headers: &[(&str, &str)]) -> Response {
    let mut req = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(key) = key {
        req = req.bearer_auth(format!("key-{key}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

/// A chat request through the main Envoy.
async fn post(path: &str, key: Option<&str>, body: String, headers: &[(&str, &str)]) -> Response {
    let url = format!("{}{path}v1/chat/completions", stack().main.url);
    send(&url, key, body, headers).await
}

async fn code_of(resp: Response) -> (StatusCode, String) {
    let status = resp.status();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    (status, v["error"]["code"].as_str().unwrap_or("").to_owned())
}

/// Ledger rows of a tenant, once there are at least `n` of them (or after five seconds).
fn ledger_of(tenant: &str, n: usize) -> Vec<UsageRecord> {
    let read = || {
        let conn = weir_sidecar::ledger::open(&stack().sidecar.ledger).unwrap();
        weir_sidecar::ledger::query(&conn, Some(tenant), 0).unwrap()
    };
    wait_for(Duration::from_secs(5), || {
        let rows = read();
        (rows.len() >= n).then_some(rows)
    })
    .unwrap_or_else(read)
}

// ---- The sidecar serves only what the filter signed -------------------------------------

/// The headers the filter sent for one request, captured at a recording engine.
async fn captured_weir_headers(marker: &str) -> Vec<(String, String)> {
    let resp = post(
        "/alt/",
        Some("capture"),
        chat(marker, json!({"max_tokens": 2})),
        &[],
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let seen = stack().recorder.received().await;
    let request = seen
        .iter()
        .rev()
        .find(|r| r.to_string().contains(marker))
        .expect("the recording engine saw the request");
    request["headers"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("x-weir-"))
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect()
}

async fn straight_to_sidecar(headers: &[(String, String)], body: String) -> (StatusCode, String) {
    let url = format!("{}/v1/chat/completions", stack().sidecar.url);
    let view: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    code_of(send(&url, None, body, &view).await).await
}

#[tokio::test]
async fn the_sidecar_refuses_unsigned_forged_replayed_and_expired_requests() {
    // A workload that reaches the sidecar's port claims a tenant and an absurd weight.
    let claimed = [
        ("x-weir-tenant", "acme/lab/trust/alice"),
        ("x-weir-request-id", "forged-1"),
        ("x-weir-weight", "NaN"),
        ("x-weir-priority", "interactive"),
        ("x-weir-tier", "enterprise"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let body = || chat("bill alice for this", json!({"max_tokens": 2}));
    assert_eq!(
        straight_to_sidecar(&claimed, body()).await,
        (StatusCode::UNAUTHORIZED, "untrusted_request".into()),
        "unsigned claims are refused"
    );

    // What the filter signed for a real request: the signature covers every x-weir-* value.
    let signed = captured_weir_headers("capture me").await;
    assert!(
        signed.iter().any(|(k, _)| k == "x-weir-signature"),
        "{signed:?}"
    );
    let mut heavier = signed.clone();
    for (k, v) in &mut heavier {
        if k == "x-weir-weight" {
            *v = "1e300".into();
        }
    }
    assert_eq!(
        straight_to_sidecar(&heavier, body()).await,
        (StatusCode::UNAUTHORIZED, "untrusted_request".into()),
        "a changed value breaks the signature"
    );
    let mut another = signed.clone();
    another.retain(|(k, _)| k != "x-weir-kv-limit");
    another.push(("x-weir-tenant".into(), "acme/lab/trust/bob".into()));
    let (status, _) = straight_to_sidecar(&another, body()).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "an added header breaks it"
    );

    // The captured request, replayed: served once (it never reached the sidecar), then refused.
    assert_eq!(straight_to_sidecar(&signed, body()).await.0, StatusCode::OK);
    assert_eq!(
        straight_to_sidecar(&signed, body()).await,
        (StatusCode::UNAUTHORIZED, "replayed_request".into()),
        "a signature serves one request"
    );

    // Past its lifetime (3 s here) a signature is refused even if never used.
    let fresh = captured_weir_headers("capture me later").await;
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert_eq!(
        straight_to_sidecar(&fresh, body()).await,
        (StatusCode::UNAUTHORIZED, "signature_expired".into())
    );
    // Nothing was billed to the tenant the forger named.
    assert!(
        ledger_of("acme/lab/trust/alice", 0).is_empty(),
        "{:?}",
        ledger_of("acme/lab/trust/alice", 0)
    );
}

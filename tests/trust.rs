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
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, post_json};
use weir_sidecar::ledger::UsageRecord;

struct Stack {
    engine: Sim,
    /// Real-time decoding (about 11 ms a token), for streams a client leaves halfway.
    _slow: Sim,
    recorder: Sim,
    sidecar: Sidecar,
    main: Envoy,
    rollout: Envoy,
}

const KEYS: [&str; 9] = [
    "alice", "bob", "trace", "idem", "race", "retry", "modes", "capture", "refused",
];

fn weir_config(routes: Value) -> Value {
    let keys: Vec<Value> = KEYS
        .iter()
        .map(|id| {
            let mut key = api_key(id);
            if *id == "idem" {
                // Room for about two answers of 3 tokens a minute.
                key["limits"] = json!({"output_tokens_per_minute": 8});
            }
            key
        })
        .collect();
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "trust", "keys": keys}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}, "slow": {"max_context_tokens": 4096}},
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
        let slow = Sim::start(&["--preset", "tiny", "--served-model-name", "slow"]);
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
            "pools": [
                {"model": "tiny", "replicas": [engine.url]},
                {"model": "slow", "replicas": [slow.url]},
            ],
        }));
        let main = Envoy::start(
            &weir_config(json!({"default": {"mode": "enforce"}, "by_name": {"shadowed": {"mode": "shadow"}}})),
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
        sidecar.wait_for_probes(2);
        Stack {
            engine,
            _slow: slow,
            recorder,
            sidecar,
            main,
            rollout,
        }
    })
}

fn chat(content: &str, extra: Value) -> String {
    chat_body("tiny", content, extra).to_string()
}

/// A chat request through the main Envoy.
async fn post(path: &str, key: Option<&str>, body: String, headers: &[(&str, &str)]) -> Response {
    let url = format!("{}{path}v1/chat/completions", stack().main.url);
    post_json(&url, key, body, headers).await
}

async fn code_of(resp: Response) -> (StatusCode, String) {
    let status = resp.status();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    (status, v["error"]["code"].as_str().unwrap_or("").to_owned())
}

/// Ledger rows of a tenant, once there are at least `n` of them (or after five seconds). Waits
/// asynchronously, so the test's own connections (a stream it dropped) make progress meanwhile.
async fn ledger_of(tenant: &str, n: usize) -> Vec<UsageRecord> {
    let read = || stack().sidecar.ledger_rows(Some(tenant));
    for _ in 0..100 {
        let rows = read();
        if rows.len() >= n {
            return rows;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    read()
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
    code_of(post_json(&url, None, body, &view).await).await
}

#[tokio::test]
async fn a_body_refused_after_its_signed_headers_went_on_is_run_and_billed_nowhere() {
    // The filter sends a request's headers on, signed, before it reads the body; the body it
    // then refuses must not be run: the sidecar, which had the headers only, sees the stream
    // reset and queues nothing, bills nothing.
    let refusals = [
        (
            json!({"max_tokens": 5, "chat_template": "{{ messages }}"}),
            400,
        ),
        (json!({"max_tokens": 100_000}), 400),
    ];
    for (i, (extra, status)) in refusals.into_iter().enumerate() {
        let marker = format!("refused-after-its-headers-{i}");
        let resp = post("/", Some("refused"), chat(&marker, extra.clone()), &[]).await;
        assert_eq!(resp.status().as_u16(), status, "{extra}");
        let seen = stack().engine.received().await;
        assert!(
            seen.iter().all(|r| !r.to_string().contains(&marker)),
            "{extra} reached the engine"
        );
    }
    // And the key is not charged for them: a request it may send goes through.
    let resp = post(
        "/",
        Some("refused"),
        chat("fine", json!({"max_tokens": 2})),
        &[],
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let rows = ledger_of("acme/lab/trust/refused", 1).await;
    assert_eq!(
        rows.len(),
        1,
        "only the admitted request is billed: {rows:?}"
    );
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
        ledger_of("acme/lab/trust/alice", 0).await.is_empty(),
        "{:?}",
        ledger_of("acme/lab/trust/alice", 0).await
    );
}

#[test]
fn a_filter_told_to_sign_without_a_usable_secret_does_not_start() {
    // The named variable is not passed into the VM (not in host_env_keys): refused.
    let unset = json!({"signing": {"secret_env": "WEIR_NOT_PASSED_TO_THE_VM"}});
    let log = Envoy::refusal(&unset, &"s".repeat(64));
    assert!(
        log.contains("signing.secret_env: $WEIR_NOT_PASSED_TO_THE_VM is not set"),
        "{log}"
    );
    // Passed, but too short to be a secret: refused.
    let log = Envoy::refusal(&json!({}), "short");
    assert!(log.contains("shorter than 32 bytes"), "{log}");
}

// ---- Rollout modes: a mode that promises not to reject never rejects --------------------

/// Asserts `resp` was served and billed as `tenant`. Other tests in this binary bill the same
/// tenants concurrently (the default tenant above all), so the request is told apart by its
/// answer's length: each call here asks for a number of tokens no other call does.
async fn served_as(resp: Response, tenant: &str, tokens: u64) {
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert_eq!(status, StatusCode::OK, "{text}");
    let ours = || {
        stack()
            .sidecar
            .ledger_rows(Some(tenant))
            .into_iter()
            .filter(|r| r.completion_tokens == tokens)
            .count()
    };
    for _ in 0..100 {
        if ours() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ours(), 1, "scheduled and billed as {tenant}");
}

#[tokio::test]
async fn every_mode_is_signed_and_scheduled_through_the_sidecar() {
    let s = stack();
    let body = |tokens: u64| {
        chat(
            "which mode am I",
            json!({"max_tokens": tokens, "ignore_eos": true}),
        )
    };
    let modes = "acme/lab/trust/modes";

    // enforce, valid key: the key's tenant.
    served_as(post("/", Some("modes"), body(41), &[]).await, modes, 41).await;
    // shadow, valid key: the key's tenant.
    served_as(
        post("/shadow/", Some("modes"), body(43), &[]).await,
        modes,
        43,
    )
    .await;
    // shadow, unknown and missing key: the default tenant (and the shadow verdict).
    for (key, tokens) in [(Some("nobody"), 47), (None, 53)] {
        let resp = post("/shadow/", key, body(tokens), &[]).await;
        assert!(
            resp.headers()["x-weir-shadow"]
                .to_str()
                .unwrap()
                .contains("would-reject")
        );
        served_as(resp, "anonymous", tokens).await;
    }
    // Outside the rollout (the 0% `/dark/` route): the key's tenant, or the default one.
    served_as(
        post("/dark/", Some("modes"), body(59), &[]).await,
        modes,
        59,
    )
    .await;
    served_as(post("/dark/", None, body(61), &[]).await, "anonymous", 61).await;
    // off: the same.
    let off = format!("{}/alt/v1/chat/completions", s.rollout.url);
    served_as(
        post_json(&off, Some("modes"), body(67), &[]).await,
        modes,
        67,
    )
    .await;
    served_as(
        post_json(&off, Some("nobody"), body(71), &[]).await,
        "anonymous",
        71,
    )
    .await;
    // enforce still refuses a missing key at the filter.
    assert_eq!(
        code_of(post("/", None, body(2), &[]).await).await,
        (StatusCode::UNAUTHORIZED, "invalid_api_key".into())
    );
}

#[tokio::test]
async fn the_rollout_share_cannot_be_steered_with_a_request_id() {
    // Under a 50% rollout, one fixed x-request-id must not pick the unenforced half: each
    // request draws its own share, so a keyless caller is refused about half of the time.
    let url = format!("{}/v1/chat/completions", stack().rollout.url);
    let mut refused = 0;
    let mut served = 0;
    for _ in 0..24 {
        let resp = post_json(
            &url,
            None,
            chat("steer me", json!({"max_tokens": 1})),
            &[("x-request-id", "always-the-same")],
        )
        .await;
        match code_of(resp).await {
            (StatusCode::UNAUTHORIZED, code) if code == "invalid_api_key" => refused += 1,
            (StatusCode::OK, _) => served += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(
        refused > 0 && served > 0,
        "refused {refused}, served {served}"
    );
}

// ---- x-request-id is a trace id; Idempotency-Key deduplicates ---------------------------

#[tokio::test]
async fn one_trace_id_on_two_different_calls_is_not_a_conflict() {
    // An app serving one inbound request (one mesh trace id) makes two model calls.
    let trace = [("x-request-id", "trace-from-the-mesh")];
    let first = post(
        "/",
        Some("trace"),
        chat("first call", json!({"max_tokens": 2})),
        &trace,
    )
    .await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(
        first.headers()["x-request-id"],
        "trace-from-the-mesh",
        "returned"
    );
    first.bytes().await.unwrap();
    let second = post(
        "/",
        Some("trace"),
        chat("second call", json!({"max_tokens": 2})),
        &trace,
    )
    .await;
    assert_eq!(second.status(), StatusCode::OK, "{:?}", second.text().await);
    // Another tenant using the same trace id is not affected either.
    let other = post(
        "/",
        Some("bob"),
        chat("first call", json!({"max_tokens": 2})),
        &trace,
    )
    .await;
    assert_eq!(other.status(), StatusCode::OK);
    let rows = ledger_of("acme/lab/trust/trace", 2).await;
    assert_eq!(rows.len(), 2, "both calls billed: {rows:?}");
    assert_ne!(
        rows[0].request_id, rows[1].request_id,
        "weir ids each attempt"
    );
    // The trace id reaches the engine with each call, made unique per attempt: engines such as
    // vLLM take x-request-id as their own request id, so the calls must not meet there.
    let traced: std::collections::HashSet<String> = stack()
        .engine
        .received()
        .await
        .iter()
        .filter_map(|r| r["headers"]["x-request-id"].as_str().map(str::to_owned))
        .filter(|id| id.starts_with("trace-from-the-mesh.weir-"))
        .collect();
    assert_eq!(traced.len(), 3, "{traced:?}");
}

#[tokio::test]
async fn an_idempotency_key_replays_the_outcome_and_refuses_a_different_body() {
    let tenant = "acme/lab/trust/idem";
    let key = [("idempotency-key", "order-7781")];
    let body = || chat("charge the card once", json!({"max_tokens": 3}));
    let first = post("/", Some("idem"), body(), &key).await;
    assert_eq!(first.status(), StatusCode::OK);
    let first: Value = first.json().await.unwrap();
    // The same key and body again: the same answer, not run or billed again.
    let again = post("/", Some("idem"), body(), &key).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    let again: Value = again.json().await.unwrap();
    assert_eq!(again, first);
    // Replays cost no quota either: nothing ran (the key's budget fits about two answers).
    for _ in 0..3 {
        let replay = post("/", Some("idem"), body(), &key).await;
        assert_eq!(replay.status(), StatusCode::OK, "{:?}", replay.text().await);
    }
    // The same key with another body is a client error.
    let other = post(
        "/",
        Some("idem"),
        chat("another order", json!({"max_tokens": 3})),
        &key,
    )
    .await;
    assert_eq!(
        code_of(other).await,
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused".into()
        )
    );
    // Keys are per tenant: bob's request with alice's key runs as bob's own.
    let bobs = post(
        "/",
        Some("bob"),
        chat("another order", json!({"max_tokens": 3})),
        &key,
    )
    .await;
    assert_eq!(bobs.status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rows = ledger_of(tenant, 1).await;
    assert_eq!(rows.len(), 1, "billed once: {rows:?}");
    assert_eq!(rows[0].idempotency_key, "order-7781");
    assert_eq!((rows[0].attempt, rows[0].completion_tokens), (1, 3));
}

#[tokio::test]
async fn a_concurrent_duplicate_of_an_in_flight_key_gets_409() {
    let key = [("idempotency-key", "race-1")];
    let body = || {
        chat(
            "slow and unique",
            json!({"max_tokens": 200, "ignore_eos": true}),
        )
    };
    let attempts = (0..4).map(|_| post("/", Some("race"), body(), &key));
    let results = futures::future::join_all(attempts).await;
    let mut codes = Vec::new();
    for r in results {
        codes.push(code_of(r).await);
    }
    let ok = codes.iter().filter(|(s, _)| *s == StatusCode::OK).count();
    let busy = codes
        .iter()
        .filter(|c| **c == (StatusCode::CONFLICT, "idempotency_key_in_use".to_owned()))
        .count();
    assert_eq!((ok, busy), (1, 3), "{codes:?}");
    let rows = ledger_of("acme/lab/trust/race", 1).await;
    assert_eq!(rows.len(), 1, "one engine run: {rows:?}");
}

// ---- Every attempt that used an engine is billed for what it used -----------------------

#[tokio::test]
async fn a_cancelled_attempt_and_its_full_retry_are_both_billed() {
    let tenant = "acme/lab/trust/retry";
    // The client sends the same ids on its retry, as SDKs do.
    let ids = [
        ("idempotency-key", "retry-300"),
        ("x-request-id", "retry-300"),
    ];
    let body = || {
        json!({"model": "slow", "stream": true, "max_tokens": 300, "ignore_eos": true,
            "messages": [{"role": "user", "content": "a long answer"}]})
        .to_string()
    };
    let mut first = post("/", Some("retry"), body(), &ids).await;
    assert_eq!(first.status(), StatusCode::OK);
    for _ in 0..5 {
        first.chunk().await.unwrap().unwrap();
    }
    drop(first);
    let cancelled = ledger_of(tenant, 1).await;
    assert_eq!(cancelled.len(), 1, "{cancelled:?}");
    assert_eq!(cancelled[0].outcome, "cancelled", "{cancelled:?}");

    let retry = post("/", Some("retry"), body(), &ids).await;
    assert_eq!(retry.status(), StatusCode::OK);
    let text = retry.text().await.unwrap();
    assert!(text.contains("[DONE]"));
    let rows = ledger_of(tenant, 2).await;
    assert_eq!(rows.len(), 2, "both attempts recorded: {rows:?}");
    let full = rows.iter().find(|r| r.outcome == "ok").expect("the retry");
    assert_eq!((full.attempt, full.completion_tokens), (2, 300), "{rows:?}");
    let partial = rows.iter().find(|r| r.outcome == "cancelled").unwrap();
    assert_eq!(partial.attempt, 1);
    assert!(partial.completion_tokens < 300, "{rows:?}");
    let billed: u64 = rows.iter().map(|r| r.completion_tokens).sum();
    assert_eq!(billed, 300 + partial.completion_tokens);

    // Once completed, the key's work is never billed again.
    let replay = post("/", Some("retry"), body(), &ids).await;
    assert_eq!(replay.status(), StatusCode::OK);
    replay.bytes().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ledger_of(tenant, 2).await.len(), 2);
}

#[tokio::test]
async fn keyless_callers_do_not_share_idempotency_keys() {
    // Every keyless caller of a shadow route is the default tenant: one caller's
    // Idempotency-Key must not block, or be answered with, another's work.
    let url = format!("{}/shadow/v1/chat/completions", stack().main.url);
    let key = [("idempotency-key", "shared-by-strangers")];
    for (i, prompt) in ["the first stranger", "the second stranger"]
        .iter()
        .enumerate()
    {
        let resp = post_json(&url, None, chat(prompt, json!({"max_tokens": 1})), &key).await;
        assert_eq!(resp.status(), StatusCode::OK, "caller {i}");
        assert!(resp.headers().get("idempotent-replayed").is_none());
    }
}

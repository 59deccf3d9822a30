//! Retry budgets through the real stack (Envoy with the built filter, the sidecar, the
//! simulator): a retry storm of one tenant is capped by its `retries_per_minute`, its refusals
//! held back a second each, while another tenant's time to first token holds, the storming tenant's first attempts still flow, and a
//! `side_effect` step retried without its idempotency key is refused while with it the
//! sidecar answers with the first answer.
//!
//! The stack is started once for this binary and shared by its tests, which take turns.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::{Mutex, MutexGuard};
use weir_e2e::{
    Envoy, Sidecar, Sim, api_key, api_key_limited, chat_body, idle_turn, p95, post_json, prompt_of,
};

/// The storming tenant's retries a minute (and its bucket's burst: a bucket holds a minute).
const RETRIES_PER_MINUTE: u64 = 30;
/// Clients in the storm, each retrying its own call with no backoff.
const STORM_CLIENTS: usize = 50;
/// The model every tenant calls.
const MODEL: &str = "m";

struct Stack {
    sims: Vec<Sim>,
    sim: String,
    envoy: Envoy,
    _sidecar: Sidecar,
}

/// Org `storm` (key `a`) has a retry budget; org `calm` (key `b`) is the neighbour whose
/// latency is watched; org `agentco` (key `agent`) offers a `side_effect` tool.
fn weir_config() -> Value {
    let org = |id: &str, key: Value| json!({"id": id, "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [key]}]}]});
    let mut agent = api_key("agent");
    agent["policy"] = json!({"tools": {"classes": {"send_*": "side_effect"}}});
    json!({
        "orgs": [
            org("storm", api_key_limited("a", json!({"retries_per_minute": RETRIES_PER_MINUTE}))),
            org("calm", api_key("b")),
            org("agentco", agent),
        ],
        "models": {MODEL: {"max_context_tokens": 4096}},
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        // The tiny model at real speed: the neighbour's time to first token is its prompt's
        // prefill, tens of milliseconds, not noise.
        let sim = Sim::start(&[
            "--preset",
            "tiny",
            "--served-model-name",
            MODEL,
            "--output-len",
            "fixed:16",
        ]);
        let sidecar = Sidecar::start(json!({
            "policy": "fair",
            "pools": [{"model": MODEL, "replicas": [sim.url]}],
        }));
        let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
        sidecar.wait_for_probes(1);
        Stack {
            sim: sim.url.clone(),
            sims: vec![sim],
            envoy,
            _sidecar: sidecar,
        }
    })
}

async fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::const_new(());
    idle_turn(&TURN, &stack().sims).await
}

fn url() -> String {
    format!("{}/v1/chat/completions", stack().envoy.url)
}

/// Times to first token of key `b`'s streamed calls, `clients` at a time, until `until`.
async fn neighbour_ttfts(until: Instant, clients: usize) -> Vec<f64> {
    let client = |c: usize| async move {
        let mut ttfts = Vec::new();
        let mut n = 0;
        while Instant::now() < until {
            let prompt = prompt_of(&format!("calm {c} {n} {}", rand_tag()), 1_500);
            let body = chat_body(MODEL, &prompt, json!({"max_tokens": 4, "stream": true}));
            let sent = Instant::now();
            let mut resp = post_json(&url(), Some("b"), body.to_string(), &[]).await;
            if resp.status() != StatusCode::OK {
                panic!("{}: {}", resp.status(), resp.text().await.unwrap());
            }
            let mut first = None;
            while let Some(chunk) = resp.chunk().await.unwrap() {
                if first.is_none() && String::from_utf8_lossy(&chunk).contains("\"content\":\"") {
                    first = Some(sent.elapsed().as_secs_f64());
                }
            }
            ttfts.push(first.expect("a stream with tokens"));
            n += 1;
        }
        ttfts
    };
    futures::future::join_all((0..clients).map(client))
        .await
        .concat()
}

/// A tag distinct per run, so prompts of two runs never share a prefix.
fn rand_tag() -> u64 {
    static TAG: OnceLock<u64> = OnceLock::new();
    *TAG.get_or_init(weir_sidecar::support::clock::now_ms)
}

/// What one storming client got: calls let through, refused as retries past the budget,
/// refused because the counters stayed busy under the storm (429 with `Retry-After`, fail
/// closed), the longest `Retry-After` it was told, and how soon its quickest refusal came.
#[derive(Default)]
struct Storm {
    admitted: u64,
    refused: u64,
    busy: u64,
    longest_wait: u64,
    quickest_refusal: Option<Duration>,
    other: Vec<String>,
}

/// One client of key `a` retrying its call (one request id, one body) until `until`, no
/// backoff.
async fn storm_client(i: usize, until: Instant) -> Storm {
    let http = reqwest::Client::new();
    let body = chat_body(MODEL, &format!("storm {i}"), json!({"max_tokens": 2})).to_string();
    let id = format!("storm-{i}");
    let mut got = Storm::default();
    while Instant::now() < until {
        let sent = Instant::now();
        let resp = http
            .post(url())
            .bearer_auth("key-a")
            .header("content-type", "application/json")
            .header("x-request-id", &id)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let wait = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let text = resp.text().await.unwrap();
        match status {
            StatusCode::OK => got.admitted += 1,
            StatusCode::TOO_MANY_REQUESTS if text.contains("retry_budget_exceeded") => {
                got.refused += 1;
                got.longest_wait = got.longest_wait.max(wait.expect("Retry-After"));
                let took = sent.elapsed();
                got.quickest_refusal = Some(got.quickest_refusal.map_or(took, |q| q.min(took)));
            }
            StatusCode::TOO_MANY_REQUESTS if wait.is_some() => got.busy += 1,
            _ => got.other.push(format!("{status}: {text}")),
        }
    }
    got
}

/// The storm's clients, on a thread and runtime of their own at the lowest CPU priority: the
/// load generator is not the system under test, and sharing the test's runtime (or the CPU at
/// its priority) with the neighbour's clients would delay the neighbour's own clock readings
/// by the generator's work rather than by weir's.
fn storm_apart(until: Instant) -> std::thread::JoinHandle<Vec<Storm>> {
    std::thread::spawn(move || {
        // SAFETY: setpriority(2) with who = 0 sets the calling thread's nice value on Linux.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, 0, 19);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the storm");
        runtime.block_on(futures::future::join_all(
            (0..STORM_CLIENTS).map(|i| storm_client(i, until)),
        ))
    })
}

/// Key `a`'s first attempts (each its own request id, `phase` keeping the two windows' ids
/// apart) until `until`: every one must pass.
async fn first_attempts(phase: &str, until: Instant) -> (u64, Vec<String>) {
    let (mut passed, mut failed) = (0, Vec::new());
    let mut n = 0;
    while Instant::now() < until {
        let body = chat_body(MODEL, &format!("fresh {n}"), json!({"max_tokens": 2}));
        let id = format!("fresh-{phase}-{n}-{}", rand_tag());
        let resp = post_json(
            &url(),
            Some("a"),
            body.to_string(),
            &[("x-request-id", &id)],
        )
        .await;
        let status = resp.status();
        let text = resp.text().await.unwrap();
        if status == StatusCode::OK {
            passed += 1;
        } else {
            failed.push(format!("{status}: {text}"));
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (passed, failed)
}

#[tokio::test]
async fn a_retry_storm_is_capped_by_the_retry_budget_and_the_neighbour_s_ttft_holds() {
    let _turn = turn().await;
    // Warm the path (connections, the sidecar's probes) before measuring.
    neighbour_ttfts(Instant::now() + Duration::from_secs(1), 1).await;
    // The baseline carries the storming tenant's ordinary traffic (its first attempts) as the
    // storm window does, and lasts as long: the two windows differ by the retry storm alone.
    let storm_for = Duration::from_secs(8);
    let calm_until = Instant::now() + storm_for;
    let (baseline, (calm_fresh, calm_failed)) = tokio::join!(
        neighbour_ttfts(calm_until, 2),
        first_attempts("calm", calm_until)
    );
    assert!(calm_fresh > 0 && calm_failed.is_empty(), "{calm_failed:?}");

    let started = Instant::now();
    let until = started + storm_for;
    let storm = storm_apart(until);
    let (during, (fresh, fresh_failed)) =
        tokio::join!(neighbour_ttfts(until, 2), first_attempts("storm", until));
    let storm = storm.join().expect("the storm's thread");
    let elapsed = started.elapsed().as_secs_f64();

    let admitted: u64 = storm.iter().map(|s| s.admitted).sum();
    let refused: u64 = storm.iter().map(|s| s.refused).sum();
    let busy: u64 = storm.iter().map(|s| s.busy).sum();
    let other: Vec<&String> = storm.iter().flat_map(|s| &s.other).collect();
    let longest_wait = storm.iter().map(|s| s.longest_wait).max().unwrap_or(0);
    let quickest_refusal = storm.iter().filter_map(|s| s.quickest_refusal).min();
    // Each client's first call is a first attempt; the rest are retries.
    let first_calls = storm.iter().filter(|s| s.admitted > 0).count() as u64;
    let retries_admitted = admitted - first_calls;
    // The bucket starts full (a minute's worth, its burst) and refills at its rate.
    let bound = RETRIES_PER_MINUTE + (RETRIES_PER_MINUTE as f64 * elapsed / 60.0).ceil() as u64;
    let (quiet, stormy) = (p95(baseline.clone()), p95(during.clone()));
    let ratio = stormy / quiet;
    println!(
        "retry storm: {STORM_CLIENTS} clients x one request id each, no backoff, {elapsed:.1} s, \
         retries_per_minute {RETRIES_PER_MINUTE}: {} calls, {first_calls} first attempts, \
         {retries_admitted} retries admitted (bound {bound} = burst {RETRIES_PER_MINUTE} + \
         refill), {refused} refused retry_budget_exceeded, {busy} refused as counters busy, \
         longest Retry-After {longest_wait} s, quickest refusal {quickest_refusal:?} (held \
         back a second), {} other answers",
        admitted + refused + busy + other.len() as u64,
        other.len()
    );
    println!(
        "storming tenant's first attempts during the storm: {fresh} passed, {} refused",
        fresh_failed.len()
    );
    println!(
        "neighbour TTFT p95: baseline {:.1} ms ({} streams), during the storm {:.1} ms ({} \
         streams); ratio {ratio:.3} (bound 1.2)",
        quiet * 1e3,
        baseline.len(),
        stormy * 1e3,
        during.len()
    );
    assert!(other.is_empty(), "{other:?}");
    assert_eq!(
        first_calls, STORM_CLIENTS as u64,
        "every client's first call passed"
    );
    assert!(retries_admitted <= bound, "{retries_admitted} > {bound}");
    // Every client kept at it, each refusal sent once its second's hold was over: a storm
    // that would have made tens of thousands of calls makes a few a second per client.
    assert!(
        refused >= 5 * STORM_CLIENTS as u64,
        "it was a storm: {refused} refused"
    );
    let held = quickest_refusal.expect("refusals");
    assert!(held >= Duration::from_millis(900), "held back: {held:?}");
    assert!(longest_wait >= 8, "Retry-After grew: {longest_wait}");
    assert!(fresh > 0 && fresh_failed.is_empty(), "{fresh_failed:?}");
    assert!(ratio <= 1.2, "neighbour TTFT p95 ratio {ratio:.3}");
}

#[tokio::test]
async fn a_side_effect_step_retried_without_its_key_is_refused_and_with_it_replayed() {
    let _turn = turn().await;
    let step = chat_body(
        MODEL,
        "mail bob",
        json!({"max_tokens": 8, "tools": [{"type": "function", "function": {
            "name": "send_email", "parameters": {"type": "object"}}}]}),
    )
    .to_string();
    let id = format!("step-{}", rand_tag());
    let key = format!("K-{}", rand_tag());
    let runs = || async {
        let metrics = reqwest::get(format!("{}/metrics", stack().sim))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        weir_e2e::metric_sum(&metrics, "vllm:request_success_total").unwrap_or(0.0)
    };
    let keyed = [
        ("x-request-id", id.as_str()),
        ("idempotency-key", key.as_str()),
    ];
    let first = post_json(&url(), Some("agent"), step.clone(), &keyed).await;
    assert_eq!(first.status(), StatusCode::OK);
    let first: Value = first.json().await.unwrap();
    let ran = runs().await;

    let bare = post_json(
        &url(),
        Some("agent"),
        step.clone(),
        &[("x-request-id", &id)],
    )
    .await;
    assert_eq!(bare.status(), StatusCode::CONFLICT);
    let error: Value = bare.json().await.unwrap();
    assert_eq!(
        error["error"]["code"], "side_effect_retry_requires_idempotency_key",
        "{error}"
    );
    assert_eq!(error["error"]["tool"], "send_email", "{error}");

    let again = post_json(&url(), Some("agent"), step.clone(), &keyed).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let again: Value = again.json().await.unwrap();
    assert_eq!(again, first, "the first answer, replayed");
    assert_eq!(runs().await, ran, "the engine ran the step once");
    println!(
        "side_effect retry: bare 409 side_effect_retry_requires_idempotency_key; with its key \
         replayed, engine runs {ran}"
    );
}

//! The sidecar's resources end to end: what it exposes through the gateway, what it holds for a
//! request (KV, a slot on a replica) and gives back on every path, how fairly it shares pools, and
//! what it keeps when stopped. Real Envoy with the filter → the sidecar → simulator replicas.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::time::Duration;

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::{Mutex, MutexGuard};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, idle_turn, post_json};

struct Stack {
    sims: Vec<Sim>,
    /// An engine that reports no KV figures at all (as SGLang or llama.cpp may not).
    bare: String,
    sidecar: Sidecar,
    envoy: Envoy,
}

/// A minimal OpenAI-compatible engine whose `/metrics` is empty: no `vllm:cache_config_info`,
/// nothing about KV. Answers every chat completion with one token. Serves until the test
/// binary exits.
fn bare_engine() -> String {
    weir_e2e::serve_engine(|head, _body| {
        let answer = if head.starts_with("POST") {
            json!({"id": "chatcmpl-bare", "object": "chat.completion", "created": 0,
                "model": "bare", "choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hi"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
            .to_string()
        } else {
            String::new()
        };
        ("application/json", answer)
    })
}

/// One key per test role.
const TENANTS: [&str; 9] = [
    "peek", "solo", "joiner", "narrow", "quitter", "liar", "slow", "term", "filler",
];

fn weir_config() -> Value {
    let keys: Vec<Value> = TENANTS.iter().map(|id| api_key(id)).collect();
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "res", "keys": keys}]}]}],
        "models": {
            "tiny": {"max_context_tokens": 8192},
            "narrow": {"max_context_tokens": 8192},
            "bare": {"max_context_tokens": 8192},
        },
        "routes": {"default": {"mode": "enforce"}, "by_name": {"shadowed": {"mode": "shadow"}}},
        // The fast estimate above 1 kB, so a prompt can be built that it underestimates.
        "estimator": {"exact_below_bytes": 1000},
    })
}

fn sidecar_config(sims: &[Sim], bare: &str) -> Value {
    json!({
        "policy": "fair",
        "queue": {"max_per_tenant": 64, "deadline_ms": 20000},
        // Short enough for a test to outlast; streams here take under a second otherwise.
        "relay": {"max_stream_ms": 1500},
        "pools": [
            {"model": "tiny", "replicas": [sims[0].url, sims[1].url]},
            // One replica with room for one long prompt at a time: easy to fill.
            {"model": "narrow", "replicas": [sims[2].url], "kv_tokens_per_replica": 3000},
            // Neither the engine nor the config gives a KV capacity.
            // Reports no cached tokens: its isolation could not be verified.
            {"model": "bare", "replicas": [bare], "cache_isolation": "shared"},
        ],
    })
}

/// Starts the sidecar (and an Envoy in front of it) once its probes have read every replica.
fn start_sidecar(sims: &[Sim], config: Value) -> (Sidecar, Envoy) {
    let sidecar = Sidecar::start(config);
    let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
    sidecar.wait_for_probes(sims.len());
    (sidecar, envoy)
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sims = vec![
            Sim::start_tiny_fast(&[]),
            Sim::start_tiny_fast(&[]),
            Sim::start_tiny_fast(&["--served-model-name", "narrow"]),
        ];
        let bare = bare_engine();
        let (sidecar, envoy) = start_sidecar(&sims, sidecar_config(&sims, &bare));
        Stack {
            sims,
            bare,
            sidecar,
            envoy,
        }
    })
}

/// One test at a time on the shared pools, starting once the previous test's work has drained.
async fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::const_new(());
    idle_turn(&TURN, &stack().sims).await
}

fn chat(model: &str, content: &str, extra: Value) -> String {
    chat_body(model, content, extra).to_string()
}

async fn post(envoy: &Envoy, key: &str, body: String) -> Response {
    let url = format!("{}/v1/chat/completions", envoy.url);
    post_json(&url, Some(key), body, &[]).await
}

#[tokio::test]
async fn no_gateway_route_serves_the_sidecars_metrics() {
    let _turn = turn().await;
    let s = stack();
    // Some traffic first, so the sidecar has per-tenant figures to leak.
    let resp = post(
        &s.envoy,
        "peek",
        chat("tiny", "hello", json!({"max_tokens": 2})),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    resp.bytes().await.unwrap();
    let own = s.sidecar.metrics().await;
    assert!(
        own.contains("weir_tokens_total{tenant=\"acme\""),
        "the admin address serves the metrics: {own}"
    );

    let client = reqwest::Client::new();
    for prefix in ["", "/dark", "/shadow", "/alt"] {
        for path in ["/metrics", "/health", "/metrics?x=1"] {
            for key in [None, Some("key-peek")] {
                let mut req = client.get(format!("{}{prefix}{path}", s.envoy.url));
                if let Some(key) = key {
                    req = req.bearer_auth(key);
                }
                let resp = req.send().await.unwrap();
                let status = resp.status();
                let body = resp.text().await.unwrap();
                assert!(
                    !body.contains("weir_") && !body.contains("acme/lab"),
                    "{prefix}{path} with key {key:?} ({status}) leaked: {body}"
                );
            }
        }
    }
    // And straight to the serving port (what any workload that reaches it sees).
    let direct = reqwest::get(format!("{}/metrics", s.sidecar.url))
        .await
        .unwrap();
    assert_eq!(direct.status(), StatusCode::NOT_FOUND);
}

/// A prompt of about `tokens` tokens, distinct per `tag`.
fn prompt(tag: &str, tokens: usize) -> String {
    format!("{tag}: {}", "pack the cache ".repeat(tokens / 3))
}

/// A gauge of the sidecar's metrics (0 when the series does not exist yet).
async fn gauge(series: &str) -> f64 {
    stack()
        .sidecar
        .metrics()
        .await
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_request_waiting_for_room_in_one_pool_does_not_hold_up_another_pool() {
    let _turn = turn().await;
    let s = stack();
    // Fills the narrow pool for about three seconds.
    let long = chat(
        "narrow",
        &prompt("long", 1500),
        json!({"max_tokens": 2400, "ignore_eos": true}),
    );
    let started = std::time::Instant::now();
    let first = tokio::spawn(post(&s.envoy, "narrow", long.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The same tenant's next request there has to wait for that room...
    let second = tokio::spawn(post(&s.envoy, "narrow", long));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...which must not stop its request to the other pool.
    let sent = std::time::Instant::now();
    let resp = post(
        &s.envoy,
        "narrow",
        chat("tiny", "elsewhere", json!({"max_tokens": 5})),
    )
    .await;
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert_eq!(status, StatusCode::OK, "{text}");
    let waited = sent.elapsed();
    let first = first.await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    first.bytes().await.unwrap();
    let blocked_for = started.elapsed();
    assert!(
        waited < Duration::from_secs(1) && waited * 3 < blocked_for,
        "the tiny pool's request took {waited:?} while the narrow pool was full for {blocked_for:?}"
    );
    let second = second.await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    second.bytes().await.unwrap();
}

#[tokio::test]
async fn requests_abandoned_at_any_stage_give_their_kv_back() {
    let _turn = turn().await;
    let s = stack();
    // The narrow pool is busy, so the abandoned requests are caught queued, at dispatch,
    // connecting upstream and mid-stream.
    let filler = tokio::spawn(post(
        &s.envoy,
        "filler",
        chat(
            "narrow",
            &prompt("filler", 1500),
            json!({"max_tokens": 1500, "ignore_eos": true}),
        ),
    ));
    let quitters = (0..40u64).map(|i| async move {
        let body = chat(
            "narrow",
            &prompt(&format!("quit {i}"), 600),
            json!({"max_tokens": 300, "ignore_eos": true, "stream": true}),
        );
        let patience = Duration::from_millis(150 + i * 53 % 2500);
        let _ = tokio::time::timeout(patience, async {
            let mut resp = post(&stack().envoy, "quitter", body).await;
            while let Ok(Some(_)) = resp.chunk().await {}
        })
        .await;
    });
    futures::future::join_all(quitters).await;
    filler.await.unwrap().bytes().await.unwrap();
    let narrow = &s.sims[2].url;
    let held = || async {
        (
            gauge("weir_active_kv_tokens{tenant=\"acme\"}").await,
            gauge(&format!(
                "weir_replica_reserved_kv_tokens{{replica=\"{narrow}\"}}"
            ))
            .await,
            gauge(&format!("weir_replica_in_flight{{replica=\"{narrow}\"}}")).await,
        )
    };
    let mut now = held().await;
    for _ in 0..100 {
        if now == (0.0, 0.0, 0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = held().await;
    }
    assert_eq!(
        now,
        (0.0, 0.0, 0.0),
        "KV (tenant, replica) and slots still held after every request ended"
    );
}

#[tokio::test]
async fn a_tenant_that_ran_alone_is_not_starved_when_another_arrives() {
    let _turn = turn().await;
    let s = stack();
    // solo has the pool to itself for a while: its counter runs up while nobody else queues.
    let alone = std::time::Instant::now();
    let solo_alone = (0..8).map(|c| async move {
        let mut n = 0;
        while alone.elapsed() < Duration::from_secs(3) {
            let tag = format!("solo alone {c} {n}");
            let body = chat("tiny", &prompt(&tag, 3000), json!({"max_tokens": 1}));
            let resp = post(&stack().envoy, "solo", body).await;
            assert_eq!(resp.status(), StatusCode::OK);
            resp.bytes().await.unwrap();
            n += 1;
        }
    });
    futures::future::join_all(solo_alone).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Then joiner floods the pool (arriving to an empty queue), and solo comes back to it.
    let start = std::time::Instant::now();
    let window = Duration::from_secs(4);
    let client = |key: &'static str, delay: Duration| async move {
        tokio::time::sleep(delay).await;
        let mut n = 0;
        while start.elapsed() < window {
            let body = chat(
                "tiny",
                &prompt(&format!("{key} busy {n}"), 1500),
                json!({"max_tokens": 40, "ignore_eos": true}),
            );
            let resp = post(&stack().envoy, key, body).await;
            assert_eq!(resp.status(), StatusCode::OK);
            resp.bytes().await.unwrap();
            n += 1;
        }
    };
    let joined = Duration::from_millis(300);
    let solo_back_ms = weir_sidecar::support::clock::now_ms() + joined.as_millis() as u64;
    let clients = (0..24).flat_map(|_| [client("joiner", Duration::ZERO), client("solo", joined)]);
    futures::future::join_all(clients).await;

    // From solo's return on, both are backlogged: they share the pool evenly.
    let contended = (solo_back_ms + 300)..(solo_back_ms + 3_000);
    let served = |tenant: &str| -> u64 {
        s.sidecar
            .ledger_rows(None)
            .iter()
            .filter(|r| r.tenant == tenant && contended.contains(&r.finished_at_ms))
            .map(|r| r.prompt_tokens + r.completion_tokens)
            .sum()
    };
    let (solo, joiner) = (served("acme/lab/res/solo"), served("acme/lab/res/joiner"));
    let ratio = solo as f64 / joiner.max(1) as f64;
    println!("after solo's return, solo:joiner = {ratio:.2} ({solo} vs {joiner} tokens)");
    assert!(
        (0.6..=1.6).contains(&ratio),
        "solo:joiner = {ratio:.2} ({solo} vs {joiner} tokens): one of them monopolised the pool"
    );
}

/// The virtual token counter of the tenants' org in the tiny pool (metrics show orgs, not
/// keys): a test's tenant's own, as tests take turns on the stack.
async fn vtc() -> f64 {
    gauge("weir_vtc_counter{tenant=\"acme\",pool=\"tiny\"}").await
}

/// Letters without spaces or repeats: one "word" to the fast estimate, many tokens to BPE.
fn gibberish(len: usize) -> String {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

#[tokio::test]
async fn the_engines_prompt_count_replaces_the_estimate_in_the_fair_share() {
    let _turn = turn().await;
    let send = |content: String, stream: bool| async move {
        let mut extra = json!({"max_tokens": 5, "stream": stream});
        if stream {
            extra["stream_options"] = json!({"include_usage": true});
        }
        let resp = post(&stack().envoy, "liar", chat("tiny", &content, extra)).await;
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, StatusCode::OK, "{text}");
        let body = if stream {
            text.split("\n\n")
                .filter_map(|e| e.strip_prefix("data: "))
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .find(|e| !e["usage"].is_null())
                .unwrap()
        } else {
            serde_json::from_str::<Value>(&text).unwrap()
        };
        let usage = &body["usage"];
        (
            usage["prompt_tokens"].as_u64().unwrap(),
            usage["completion_tokens"].as_u64().unwrap(),
        )
    };
    // The first request lifts the tenant's counter to the others'; measure from there.
    send("hello".into(), false).await;
    for stream in [false, true] {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = vtc().await;
        let (prompt, completion) = send(gibberish(2400), stream).await;
        let mut after = vtc().await;
        for _ in 0..20 {
            if after != before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            after = vtc().await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = vtc().await;
        println!("stream {stream}: engine counted {prompt} prompt tokens");
        assert_eq!(
            after - before,
            (prompt + 2 * completion) as f64,
            "stream {stream}: the counter grows by the engine's {prompt} prompt and {completion} completion tokens"
        );
    }
}

/// The body of a chunked HTTP/1.1 response, as far as it was read.
fn dechunk(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    let Some((_, mut rest)) = text.split_once("\r\n\r\n") else {
        return String::new();
    };
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        let Some(chunk) = tail.get(..size) else {
            break;
        };
        out.push_str(chunk);
        rest = tail.get(size + 2..).unwrap_or_default();
    }
    out
}

#[tokio::test]
async fn a_slow_reader_does_not_hold_the_engine_past_the_streams_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _turn = turn().await;
    let s = stack();
    let body = chat(
        "tiny",
        "write at length",
        json!({"stream": true, "max_tokens": 3500, "ignore_eos": true}),
    );
    let addr: std::net::SocketAddr = s.envoy.url.trim_start_matches("http://").parse().unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut conn = socket.connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer key-slow\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    // A few bytes every 100 ms: the answer (about 4 s of generation) would take minutes to read.
    let started = std::time::Instant::now();
    let mut raw = Vec::new();
    let mut buf = [0u8; 64];
    while started.elapsed() < Duration::from_millis(2800) {
        let n = conn.read(&mut buf).await.unwrap();
        raw.extend_from_slice(&buf[..n]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Still connected and reading, but the engine's work and the reservation are gone.
    let running = s.sims[0].metric("vllm:num_requests_running").await
        + s.sims[1].metric("vllm:num_requests_running").await;
    assert_eq!(
        running, 0.0,
        "the engine stopped generating for the slow reader"
    );
    assert_eq!(
        gauge("weir_active_kv_tokens{tenant=\"acme\"}").await,
        0.0,
        "its KV reservation was released"
    );
    let records: Vec<_> = s
        .sidecar
        .ledger_rows(None)
        .into_iter()
        .filter(|r| r.tenant == "acme/lab/res/slow")
        .collect();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].outcome, "stream_deadline");
    assert!(records[0].completion_tokens > 0, "what streamed is billed");
    // The rest, read at once, ends with an OpenAI-shaped error event and [DONE].
    while !dechunk(&raw).ends_with("data: [DONE]\n\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
            .await
            .expect("the stream ends")
            .unwrap();
        assert!(n > 0, "closed before [DONE]: {}", dechunk(&raw));
        raw.extend_from_slice(&buf[..n]);
    }
    let text = dechunk(&raw);
    let error = text
        .split("\n\n")
        .find(|e| e.contains("\"error\""))
        .unwrap_or_else(|| panic!("no error event in {text}"));
    let event: Value = serde_json::from_str(error.trim_start_matches("data: ")).unwrap();
    assert_eq!(event["error"]["code"], "stream_deadline");
}

#[tokio::test]
async fn sigterm_under_load_leaves_one_record_for_every_answered_request() {
    let _turn = turn().await;
    let s = stack();
    let mut config = sidecar_config(&s.sims, &s.bare);
    config["shutdown_grace_ms"] = json!(1500);
    let (mut sidecar, envoy) = start_sidecar(&s.sims, config);
    let envoy = &envoy;
    let start = std::time::Instant::now();
    // Short answers that finish within the grace period and long ones that do not, streamed
    // and not, arriving until and after the signal.
    let client = |c: usize| async move {
        let mut answered = 0;
        let mut i = 0;
        while start.elapsed() < Duration::from_secs(3) {
            let (max_tokens, stream) = match (c + i) % 4 {
                0 => (3000, true),
                1 => (3000, false),
                2 => (100, true),
                _ => (100, false),
            };
            i += 1;
            let body = chat(
                "tiny",
                &format!("client {c} request {i}"),
                json!({"max_tokens": max_tokens, "ignore_eos": true, "stream": stream}),
            );
            let Ok(resp) =
                tokio::time::timeout(Duration::from_secs(10), post(envoy, "term", body)).await
            else {
                continue;
            };
            let ok = resp.status() == StatusCode::OK;
            let text = resp.text().await.unwrap_or_default();
            // An answer from the engine, or the sidecar's word that it was cut at the deadline.
            if ok || text.contains("shutting_down") {
                answered += 1;
            }
        }
        answered
    };
    let signal = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        tokio::task::spawn_blocking(move || {
            let sent = std::time::Instant::now();
            let status = sidecar.terminate(Duration::from_secs(10));
            (sidecar, status, sent.elapsed())
        })
        .await
        .unwrap()
    };
    let (answered, (sidecar, status, took)) =
        tokio::join!(futures::future::join_all((0..12).map(client)), signal);
    let answered: usize = answered.iter().sum();
    let status = status.expect("the sidecar exits after SIGTERM");
    let records: Vec<_> = sidecar
        .ledger_rows(None)
        .into_iter()
        .filter(|r| r.tenant == "acme/lab/res/term")
        .collect();
    let ids: std::collections::HashSet<_> = records.iter().map(|r| &r.request_id).collect();
    assert_eq!(ids.len(), records.len(), "one record per request");
    println!(
        "{answered} answered, {} records, {} cut at the grace deadline",
        records.len(),
        records.iter().filter(|r| r.outcome == "shutdown").count()
    );
    assert!(answered > 12, "under load: {answered}");
    assert_eq!(
        records.len(),
        answered,
        "every request that got an answer has its record"
    );
    assert!(
        records.iter().any(|r| r.outcome == "shutdown"),
        "long requests were still running at the deadline"
    );
    assert!(status.success(), "a clean exit: {status:?}");
    assert!(
        took < Duration::from_millis(1500 + 4000),
        "within the grace period and a flush: {took:?}"
    );
}

#[tokio::test]
async fn a_pool_whose_engines_report_no_kv_figures_is_still_served() {
    let _turn = turn().await;
    let s = stack();
    let requests = (0..4).map(|i| async move {
        let body = chat("bare", &format!("hello {i}"), json!({"max_tokens": 1}));
        tokio::time::timeout(Duration::from_secs(5), post(&s.envoy, "peek", body)).await
    });
    for resp in futures::future::join_all(requests).await {
        let resp = resp.expect("dispatched at once, not left waiting for a KV budget");
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap()["choices"][0]["message"]["content"],
            "hi"
        );
    }
}

//! Attacks on the front door found by red-teaming it, each kept as a regression test: real
//! Envoy (shipped template) with the built filter, in front of the simulator, on loopback.
//! Each test checks what reached the engine (the simulator records it), not only the answer.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::io::{Read, Write};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use weir_e2e::{Envoy, EnvoyOptions, Sim, api_key_limited, post_json};

struct Stack {
    sim: Sim,
    envoy: Envoy,
}

/// One key on the free tier, capped at 1,024 output tokens per request.
fn weir_config() -> Value {
    json!({
        "orgs": [{"id": "initech", "policy": {"tier": "free"}, "workspaces": [{"id": "default", "projects": [{"id": "trial", "keys": [
            api_key_limited("free", json!({"max_output_tokens": 1024})),
            // Its own output bucket, which the rate-limit headers report exactly.
            api_key_limited("reserving", json!({"max_output_tokens": 1024, "output_tokens_per_minute": 1_000_000})),
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sim = Sim::start(&[
            "--preset",
            "tiny",
            "--time-scale",
            "5",
            "--output-len",
            "fixed:5",
            "--record-requests",
            "1000",
        ]);
        let envoy = Envoy::start(&weir_config(), sim.port, sim.port);
        Stack { sim, envoy }
    })
}

const CHAT: &str = "/v1/chat/completions";

/// Posts `body` byte for byte as a chat completion; returns the status and the JSON answer.
async fn post(id: &str, body: &str) -> (u16, Value) {
    let url = format!("{}{CHAT}", stack().envoy.url);
    let resp = post_json(&url, Some("free"), body.to_owned(), &[("x-request-id", id)]).await;
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let value = serde_json::from_str(&text).unwrap_or_else(|_| json!(text));
    (status, value)
}

/// What the engine received with this `x-request-id`.
async fn arrived(id: &str) -> Vec<Value> {
    stack().sim.received_with_id(id).await
}

const MESSAGES: &str = r#""messages":[{"role":"user","content":"hi"}]"#;

#[tokio::test]
async fn bodies_with_duplicate_keys_are_refused_at_the_door() {
    // weir's parser keeps the last `max_tokens` (5, within the key's cap); an engine or hosted
    // API that keeps the first (gjson, simdjson) generates 2,000.
    for (i, body) in [
        format!(r#"{{"model":"tiny",{MESSAGES},"max_tokens":2000,"max_tokens":5}}"#),
        format!(r#"{{"model":"tiny","model":"tiny",{MESSAGES}}}"#),
        r#"{"model":"tiny","messages":[{"role":"user","content":"a novel","content":"hi"}]}"#
            .to_owned(),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("duplicate-keys-{i}");
        let (status, answer) = post(&id, &body).await;
        assert!(
            arrived(&id).await.is_empty(),
            "{body} reached the engine, admitted on one reading of its duplicate keys"
        );
        assert_eq!(status, 400, "{body}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("duplicate key"), "{body}: {answer}");
    }
}

#[tokio::test]
async fn every_output_limit_an_engine_may_read_is_within_the_keys_cap() {
    // vLLM reads `max_completion_tokens` first; engines that predate it (and TGI) read
    // `max_tokens`; llama.cpp reads `n_predict` before `max_tokens`, on its OpenAI endpoints too.
    for (i, (extra, param)) in [
        (
            json!({"max_completion_tokens": 5, "max_tokens": 2000}),
            "max_tokens",
        ),
        (json!({"max_tokens": 5, "n_predict": 3000}), "n_predict"),
        (json!({"n_predict": 3000}), "n_predict"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let id = format!("output-limits-{i}");
        let (status, answer) = post(&id, &body.to_string()).await;
        let seen = arrived(&id).await;
        assert!(seen.is_empty(), "{extra} reached the engine: {seen:?}");
        assert_eq!(status, 400, "{extra}: {answer}");
        assert_eq!(answer["error"]["param"], param, "{extra}: {answer}");
    }

    // Within the cap, the reservation covers the largest of them: the key's output bucket
    // (full, and refilled in microseconds) stands 40 below its limit once it is taken.
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 5, "max_tokens": 40, "n_predict": 30});
    let url = format!("{}{CHAT}", stack().envoy.url);
    let headers = [("anthropic-version", "2023-06-01")];
    let resp = post_json(&url, Some("reserving"), body.to_string(), &headers).await;
    assert_eq!(resp.status(), 200);
    let number = |name: &str| -> u64 { resp.headers()[name].to_str().unwrap().parse().unwrap() };
    let limit = number("anthropic-ratelimit-output-tokens-limit");
    let remaining = number("anthropic-ratelimit-output-tokens-remaining");
    assert_eq!(
        limit - remaining,
        40,
        "the largest output limit is reserved"
    );
}

#[tokio::test]
async fn fields_that_steer_the_engine_across_tenants_never_reach_it() {
    // vLLM's `priority` reorders its own queue (queueing belongs to weir), `kv_transfer_params`
    // names KV blocks to pull from a prefill instance (another tenant's, if guessed) and
    // `request_id` names the engine's request (collisions mix or abort another tenant's).
    let id = "steering-fields";
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5, "priority": -100, "request_id": "chatcmpl-victim",
        "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [1, 2, 3]}});
    let (status, answer) = post(id, &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let seen = arrived(id).await;
    assert_eq!(seen.len(), 1);
    let sent = &seen[0]["body"];
    for field in ["priority", "request_id", "kv_transfer_params"] {
        assert!(
            sent.get(field).is_none(),
            "`{field}` reached the engine: {sent}"
        );
    }
    assert_eq!(sent["messages"][0]["content"], "hi");
}

/// Resident memory of a process, in MiB (Linux).
fn resident_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib / 1024
}

#[tokio::test]
async fn a_body_under_the_limit_cannot_grow_the_vm_by_many_times_its_size() {
    // 3.9 MB of small objects: a tree of it (`serde_json::Value`) takes ~150 MB, and a VM's
    // linear memory never shrinks, so each worker would keep that much for good.
    let head = format!(r#"{{"model":"tiny",{MESSAGES},"max_tokens":2000,"x":["#);
    let body = format!("{head}{}{{}}]}}", r#"{"a":0},"#.repeat(3_900_000 / 8));
    // Warm both workers up (first requests, vocabularies) before measuring.
    for i in 0..4 {
        post(&format!("warm-{i}"), &format!("{head}]}}")).await;
    }
    let pid = stack().envoy.pid();
    let before = resident_mib(pid);
    for i in 0..6 {
        let id = format!("object-flood-{i}");
        let (status, answer) = post(&id, &body).await;
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"]["param"], "max_tokens", "{answer}");
    }
    let grown = resident_mib(pid).saturating_sub(before);
    assert!(
        grown < 64,
        "six {} MB bodies grew Envoy by {grown} MiB",
        body.len() / 1_000_000
    );
}

#[tokio::test]
async fn a_client_that_never_finishes_its_body_cannot_pin_the_buffer() {
    // weir buffers a metered body until it is complete; the shipped config bounds how long a
    // request may take to arrive (60 s; shortened here, the rest of the template as shipped).
    let shipped = "request_timeout: 60s";
    let envoy = Envoy::launch_edited(
        EnvoyOptions {
            weir_config: &weir_config(),
            upstream_port: stack().sim.port,
            alt_port: stack().sim.port,
            listen_port: 0,
            with_filter: true,
        },
        |template| template.replace(shipped, "request_timeout: 2s"),
    );
    let addr = envoy.url.trim_start_matches("http://").to_owned();
    let answer = tokio::task::spawn_blocking(move || {
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        // Two of the three megabytes it announces, then nothing more.
        let head = format!(
            "POST {CHAT} HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-free\r\n\
             X-Request-Id: never-finished\r\nContent-Length: 3000000\r\n\r\n"
        );
        conn.write_all(head.as_bytes()).unwrap();
        conn.write_all(&vec![b' '; 2_000_000]).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let started = Instant::now();
        let mut answer = vec![0u8; 4096];
        let n = conn.read(&mut answer).unwrap_or(0);
        answer.truncate(n);
        (
            String::from_utf8_lossy(&answer).into_owned(),
            started.elapsed(),
        )
    })
    .await
    .unwrap();
    let (answer, waited) = answer;
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "a 2 MB partial body was still held after {waited:?}: {answer:?}"
    );
    assert!(
        answer.contains(r#""code":null"#) && answer.contains(r#""type":"invalid_request_error""#),
        "OpenAI-shaped, with OpenAI's values: {answer}"
    );
    assert!(arrived("never-finished").await.is_empty());
}

#[tokio::test]
async fn trusted_header_names_spelt_with_underscores_never_reach_the_upstream() {
    // weir strips `x-weir-*`; servers behind CGI/WSGI-style gateways (and nginx with
    // `underscores_in_headers`) read `x_weir_tenant` as the same header as `x-weir-tenant`.
    let id = "underscored-identity";
    let resp = reqwest::Client::new()
        .post(format!("{}{CHAT}", stack().envoy.url))
        .bearer_auth("key-free")
        .header("x-request-id", id)
        .header("x_weir_tenant", "acme/prod/assistant/ci")
        .header("X_Weir_Tier", "enterprise")
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let seen = arrived(id).await;
    let headers = seen[0]["headers"].as_object().unwrap();
    let underscored: Vec<&String> = headers.keys().filter(|k| k.contains('_')).collect();
    assert!(
        underscored.is_empty(),
        "reached the upstream: {underscored:?}"
    );
    assert_eq!(headers["x-weir-tenant"], "initech/default/trial/free");
}

#[tokio::test]
async fn a_request_cannot_bring_the_template_its_prompt_is_rendered_with() {
    // vLLM renders the prompt with a request's own `chat_template`: a few bytes of Jinja loop
    // into a prompt of any size, while weir counted two words of `messages`.
    let id = "request-template";
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5, "chat_template": "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"});
    let (status, answer) = post(id, &body.to_string()).await;
    assert!(
        arrived(id).await.is_empty(),
        "a request-supplied chat_template reached the engine"
    );
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["param"], "chat_template", "{answer}");
}

#[tokio::test]
async fn a_body_that_is_not_a_json_object_never_reaches_the_engine() {
    // serde's derived structs read a JSON array positionally (so do serde-based engines: the
    // simulator, TGI). weir rewrote only objects, so an array carried its `cache_salt` (position
    // 11) past the strip, and a stream past the usage request.
    let id = "positional-body";
    let body = json!(["tiny", [{"role": "user", "content": "hi"}], null, true, null, 5,
        null, null, null, null, null, "another-tenants-salt"]);
    let (status, answer) = post(id, &body.to_string()).await;
    let seen = arrived(id).await;
    assert!(
        seen.is_empty(),
        "a positional body reached the engine: {}",
        seen[0]["body"]
    );
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("must be a JSON object"),
        "{answer}"
    );
}

#[tokio::test]
async fn bodies_held_back_cannot_keep_more_requests_open_upstream_than_the_key_may_run() {
    // The filter sends a request's headers on before it has read the body (all a mesh lets it
    // do), so from its headers on a request holds a stream at the upstream — the sidecar's
    // connections, the cluster's circuit breakers, shared by every tenant. A key allowed two
    // requests at once that sends headers and holds its bodies back must hold two, not any
    // number: its concurrency slots are taken before the headers go.
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = upstream.local_addr().unwrap().port();
    let heads = Arc::new(AtomicUsize::new(0));
    let seen = heads.clone();
    std::thread::spawn(move || {
        for conn in upstream.incoming().flatten() {
            let seen = seen.clone();
            std::thread::spawn(move || {
                let mut reader = std::io::BufReader::new(conn);
                let mut line = String::new();
                while std::io::BufRead::read_line(&mut reader, &mut line).unwrap_or(0) > 0 {
                    if line == "\r\n" {
                        seen.fetch_add(1, Ordering::SeqCst);
                    }
                    line.clear();
                }
            });
        }
    });
    let config = json!({
        "orgs": [{"id": "initech", "workspaces": [{"id": "default", "projects": [{"id": "trial",
            "keys": [api_key_limited("holder", json!({"concurrent_requests": 2}))]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
    });
    let envoy = Envoy::start(&config, port, port);
    let addr = envoy.url.trim_start_matches("http://").to_owned();
    let held: Vec<std::net::TcpStream> = (0..5)
        .map(|_| {
            let mut conn = std::net::TcpStream::connect(&addr).unwrap();
            let head = format!(
                "POST {CHAT} HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-holder\r\n\
                 Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{{\"model\":"
            );
            conn.write_all(head.as_bytes()).unwrap();
            // One at a time, so which ones get the slots is deterministic.
            std::thread::sleep(Duration::from_millis(100));
            conn
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let open_upstream = heads.load(Ordering::SeqCst);
    assert_eq!(
        open_upstream, 2,
        "{open_upstream} requests held open upstream by a key allowed 2 at once"
    );
    // The others were refused at once, over the concurrency limit.
    for mut conn in held.into_iter().skip(2) {
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut answer = vec![0u8; 4096];
        let n = conn.read(&mut answer).unwrap_or(0);
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
        assert!(answer.contains("concurrent_requests"), "{answer}");
    }
}

#[tokio::test]
async fn a_model_name_cannot_write_lines_of_its_own_into_the_access_log() {
    // The model is the caller's string, any JSON string: a line break in it ended the request's
    // access log line and began one the caller wrote, naming any tenant and any token counts
    // (the log a platform reads who used what from); a long one made each line as long.
    let forged = "[forged] POST /v1/chat/completions 200 id=forged route=llm-api api=chat \
                  tenant=victim/w/p/k model=tiny tokens_in=1 tokens_out=1 outcome=ok";
    let model = format!("tiny\n{forged}\r\n{}", "x".repeat(64 * 1024));
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    post("log-forge", &body.to_string()).await;
    let lines = stack().envoy.access_log_for("log-forge");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let log = std::fs::read_to_string(&stack().envoy.access_log).unwrap();
    assert!(
        !log.lines().any(|l| l.starts_with("[forged]")),
        "a line of the caller's in the access log"
    );
    assert!(lines[0].len() < 2_048, "a line of {} bytes", lines[0].len());
}

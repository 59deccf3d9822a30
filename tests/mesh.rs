//! weir as a mesh runs it: the filter's config delivered over ECDS (as Istio and Envoy Gateway
//! deliver Wasm) and changed live — keys revoked, limits changed — without a restart and
//! without resetting anyone's buckets or slots; and on a shared gateway, routes the config does
//! not name left as they came. Real Envoy with the filter in front of a simulator.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::{Mutex, MutexGuard};
use weir_e2e::ecds::{EcdsEnvoy, Plugin};
use weir_e2e::{EnvoyOptions, Sim, api_key, api_key_limited, chat_body, post_json};

/// Per-minute token limits of the `bucketed` key: a refill of 20 tokens a second, slow enough to
/// read a bucket's level to within a few tokens.
const BUCKET_LIMIT: u64 = 1200;

/// Slot leases of this stack: short, so a lease the push stopped renewing would lapse in the test.
const SLOT_LEASE: Duration = Duration::from_secs(1);

struct Stack {
    sim: Sim,
    gateway: EcdsEnvoy,
}

/// The config of the stack, with `revoked` among the keys or not, and the `tightened` key's
/// request rate.
fn weir_config(with_revoked: bool, tightened_rpm: u64, extra_key: Option<&str>) -> Value {
    let mut keys = vec![
        api_key("steady"),
        api_key_limited(
            "bucketed",
            json!({"input_tokens_per_minute": BUCKET_LIMIT, "output_tokens_per_minute": BUCKET_LIMIT}),
        ),
        api_key_limited("held", json!({"concurrent_requests": 2})),
        api_key_limited("tightened", json!({"requests_per_minute": tightened_rpm})),
    ];
    if with_revoked {
        keys.push(api_key("revoked"));
    }
    keys.extend(extra_key.map(api_key));
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "mesh", "keys": keys}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "slot_lease_ms": SLOT_LEASE.as_millis() as u64,
        // weir acts on the catch-all route only; `/alt/` (and any other) is not its route.
        "routes": {"by_name": {"llm-api": {"mode": "enforce"}}},
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sim = Sim::start_tiny_fast(&["--record-requests", "256"]);
        let config = weir_config(true, 100, None);
        let opts = EnvoyOptions {
            weir_config: &config,
            upstream_port: sim.port,
            alt_port: sim.port,
            listen_port: 0,
            with_filter: true,
        };
        let gateway = EcdsEnvoy::start(opts, Plugin::default());
        Stack { sim, gateway }
    })
}

/// One test at a time: pushes change what every test's requests meet.
async fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::const_new(());
    let guard = TURN.lock().await;
    stack();
    guard
}

async fn chat(path: &str, key: &str, extra: Value) -> reqwest::Response {
    let url = format!("{}{path}", stack().gateway.envoy.url);
    let body = chat_body("tiny", "hello", extra).to_string();
    post_json(&url, Some(key), body, &[]).await
}

/// A header of the key's answer on the model list, as a number.
async fn standing(key: &str, header: &str) -> u64 {
    let resp = reqwest::Client::new()
        .get(format!("{}/v1/models", stack().gateway.envoy.url))
        .bearer_auth(format!("key-{key}"))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.headers()[header].to_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn routes_the_config_does_not_name_are_left_as_they_came() {
    let _turn = turn().await;
    let url = format!("{}/alt/v1/chat/completions", stack().gateway.envoy.url);
    let body = chat_body("tiny", "hello", json!({"max_tokens": 1})).to_string();
    let headers = [
        ("x-request-id", "not-weirs"),
        ("authorization", "Bearer an-apps-own-credential"),
    ];
    let resp = post_json(&url, None, body, &headers).await;
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "no key needed: not weir's route"
    );
    assert!(!resp.headers().contains_key("x-ratelimit-limit-requests"));
    let seen = stack().sim.received_with_id("not-weirs").await;
    assert_eq!(seen.len(), 1);
    let h = seen[0]["headers"].as_object().unwrap();
    assert!(
        h.keys().all(|k| !k.starts_with("x-weir-")),
        "nothing of weir's added: {h:?}"
    );
    assert_eq!(h["authorization"], "Bearer an-apps-own-credential");
    assert_eq!(
        seen[0]["body"]["max_tokens"], 1,
        "the body as it came, not admitted"
    );
    // The route weir is configured for still enforces.
    let refused = chat("/v1/chat/completions", "nobody", json!({"max_tokens": 1})).await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_config_that_acts_on_no_route_says_so_when_it_loads() {
    // `ignore` is the default for routes a config does not name. A config written for an
    // earlier weir (whose default was `enforce`) names none: it loads, and every request on the
    // gateway then passes unauthenticated and unmetered — to engines, where Envoy routes
    // straight to them. It must not do so silently.
    let _turn = turn().await;
    let mut config = weir_config(true, 100, None);
    config["routes"] = json!({});
    let opts = EnvoyOptions {
        weir_config: &config,
        upstream_port: stack().sim.port,
        alt_port: stack().sim.port,
        listen_port: 0,
        with_filter: true,
    };
    let gateway = EcdsEnvoy::start(opts, Plugin::default());
    let resp = post_json(
        &format!("{}/v1/chat/completions", gateway.envoy.url),
        None,
        chat_body("tiny", "hello", json!({"max_tokens": 1})).to_string(),
        &[],
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK, "not weir's route: served");
    let log = gateway.envoy.log();
    assert!(
        log.contains("routes.by_name names no route weir acts on"),
        "loaded without a word:\n{log}"
    );
}

#[tokio::test]
async fn a_key_revoked_by_a_push_is_refused_on_every_worker_within_two_seconds() {
    let _turn = turn().await;
    let gateway = &stack().gateway;
    assert_eq!(
        chat("/v1/chat/completions", "revoked", json!({"max_tokens": 1}))
            .await
            .status(),
        StatusCode::OK
    );
    // Another tenant's traffic runs throughout the push.
    let stop = AtomicBool::new(false);
    let steady = async {
        let mut statuses = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            statuses.push(
                chat("/v1/chat/completions", "steady", json!({"max_tokens": 1}))
                    .await
                    .status(),
            );
        }
        statuses
    };
    let revoke = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let pushed = Instant::now();
        gateway.push(&weir_config(false, 100, None)).await;
        // Every worker refuses: ten requests in a row on connections of their own.
        let refused_everywhere = loop {
            let mut all = true;
            for _ in 0..10 {
                let status = chat("/v1/chat/completions", "revoked", json!({"max_tokens": 1}))
                    .await
                    .status();
                all &= status == StatusCode::UNAUTHORIZED;
            }
            if all || pushed.elapsed() > Duration::from_secs(5) {
                break pushed.elapsed();
            }
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        stop.store(true, Ordering::SeqCst);
        refused_everywhere
    };
    let (statuses, refused_after) = tokio::join!(steady, revoke);
    eprintln!(
        "revoked on every worker {} ms after the push; {} requests of another tenant meanwhile",
        refused_after.as_millis(),
        statuses.len()
    );
    assert!(
        refused_after < Duration::from_secs(2),
        "refused everywhere after {refused_after:?}"
    );
    assert!(statuses.len() > 5, "the other tenant's traffic ran");
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "another tenant's requests during the push: {statuses:?}"
    );
    // The key comes back with the next push that names it.
    gateway.push(&weir_config(true, 100, None)).await;
}

#[tokio::test]
async fn a_push_resets_no_bucket_and_no_slot() {
    let _turn = turn().await;
    let gateway = &stack().gateway;
    // Some of the bucket spent, so a reset to full would show.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(40);
    let resp = chat(
        "/v1/chat/completions",
        "bucketed",
        json!({"max_tokens": 1, "messages": [{"role": "user", "content": long}]}),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    // A slot held by a long stream across the push.
    let mut held = chat(
        "/v1/chat/completions",
        "held",
        json!({"stream": true, "max_tokens": 2000, "ignore_eos": true}),
    )
    .await;
    assert_eq!(held.status(), StatusCode::OK);
    assert!(held.chunk().await.unwrap().is_some());

    let input = "anthropic-ratelimit-input-tokens-remaining";
    let slots = "x-ratelimit-remaining-concurrent-requests";
    let (level_before, slots_before) = (
        standing("bucketed", input).await,
        standing("held", slots).await,
    );
    let before = Instant::now();
    gateway
        .push(&weir_config(true, 100, Some("unrelated")))
        .await;
    let (level_after, slots_after) = (
        standing("bucketed", input).await,
        standing("held", slots).await,
    );
    let refill = (BUCKET_LIMIT as f64 / 60.0 * before.elapsed().as_secs_f64()).ceil() as u64 + 1;
    eprintln!(
        "input bucket {level_before} -> {level_after} across the push (refill up to {refill}); \
         free slots {slots_before} -> {slots_after}"
    );
    assert!(level_before < BUCKET_LIMIT - 300, "spent: {level_before}");
    assert!(
        level_after >= level_before && level_after <= level_before + refill,
        "the bucket kept its level: {level_before} -> {level_after}"
    );
    assert_eq!(
        (slots_before, slots_after),
        (1, 1),
        "the held slot is still held"
    );
    drop(held);
}

#[tokio::test]
async fn a_slot_held_across_a_push_stays_held_past_its_lease_time() {
    let _turn = turn().await;
    let gateway = &stack().gateway;
    let slots = "x-ratelimit-remaining-concurrent-requests";
    // A request whose body never comes holds its slot from its headers on, for as long as the
    // client keeps it open: renewed by the VM that took it, whatever config came since.
    let addr = gateway.envoy.url.trim_start_matches("http://").to_owned();
    let mut held = std::net::TcpStream::connect(addr).unwrap();
    std::io::Write::write_all(
        &mut held,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-held\r\n\
          Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(standing("held", slots).await, 1, "its slot is taken");
    gateway
        .push(&weir_config(true, 100, Some("newcomer")))
        .await;
    tokio::time::sleep(SLOT_LEASE * 3).await;
    assert_eq!(
        standing("held", slots).await,
        1,
        "the slot lapsed after the push: the VM that took it stopped renewing it"
    );
    drop(held);
    gateway.push(&weir_config(true, 100, None)).await;
}

#[tokio::test]
async fn a_changed_limit_applies_from_the_next_request() {
    let _turn = turn().await;
    let gateway = &stack().gateway;
    for _ in 0..3 {
        let status = chat(
            "/v1/chat/completions",
            "tightened",
            json!({"max_tokens": 1}),
        )
        .await
        .status();
        assert_eq!(status, StatusCode::OK, "100 requests a minute");
    }
    gateway.push(&weir_config(true, 1, None)).await;
    let statuses = [
        chat(
            "/v1/chat/completions",
            "tightened",
            json!({"max_tokens": 1}),
        )
        .await
        .status(),
        chat(
            "/v1/chat/completions",
            "tightened",
            json!({"max_tokens": 1}),
        )
        .await
        .status(),
    ];
    assert_eq!(
        statuses,
        [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS],
        "one request a minute from the push on"
    );
    gateway.push(&weir_config(true, 100, None)).await;
}

#[tokio::test]
async fn a_yaml_config_is_read_as_its_json_is() {
    let _turn = turn().await;
    let gateway = &stack().gateway;
    let hash = |key: &str| weir_core::keys::hash_key(&format!("key-{key}"));
    let yaml = format!(
        "# A plain Envoy user's config, as written.\n\
         orgs:\n\
         - id: acme\n  \
           workspaces:\n  \
           - id: lab\n    \
             projects:\n    \
             - id: mesh\n      \
               keys:\n      \
               - {{id: steady, sha256: {steady}}}\n      \
               - {{id: yaml-only, sha256: {yaml_only}, limits: {{requests_per_minute: 1}}}}\n\
         models:\n  tiny: {{max_context_tokens: 4096}}\n\
         routes:\n  by_name:\n    llm-api: {{mode: enforce}}\n\
         signing: {{secret_env: {env}}}\n",
        steady = hash("steady"),
        yaml_only = hash("yaml-only"),
        env = weir_e2e::SIGNING_SECRET_ENV,
    );
    gateway.push_text(&yaml).await;
    let statuses = [
        chat(
            "/v1/chat/completions",
            "yaml-only",
            json!({"max_tokens": 1}),
        )
        .await
        .status(),
        chat(
            "/v1/chat/completions",
            "yaml-only",
            json!({"max_tokens": 1}),
        )
        .await
        .status(),
        chat("/v1/chat/completions", "revoked", json!({"max_tokens": 1}))
            .await
            .status(),
    ];
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::UNAUTHORIZED
        ],
        "the YAML's key, its limit, and no key it does not list"
    );
    gateway.push(&weir_config(true, 100, None)).await;
}

#[tokio::test]
async fn disabled_and_expired_keys_are_refused_and_a_rotated_key_answers_to_both_hashes() {
    let _turn = turn().await;
    let gateway = &stack().gateway;
    let hash = |key: &str| weir_core::keys::hash_key(&format!("key-{key}"));
    let mut config = weir_config(true, 100, None);
    let keys = config["orgs"][0]["workspaces"][0]["projects"][0]["keys"]
        .as_array_mut()
        .unwrap();
    keys.push(json!({"id": "retired", "sha256": hash("retired"), "disabled": true}));
    keys.push(
        json!({"id": "lapsed", "sha256": hash("lapsed"), "expires_at": "2020-01-01T00:00:00Z"}),
    );
    keys.push(
        json!({"id": "rotating", "sha256": [hash("rotating"), hash("rotating-new")],
        "limits": {"requests_per_minute": 60}}),
    );
    gateway.push(&config).await;
    for (key, code) in [("retired", "key_disabled"), ("lapsed", "key_expired")] {
        let resp = chat("/v1/chat/completions", key, json!({"max_tokens": 1})).await;
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{key}");
        let error: Value = resp.json().await.unwrap();
        assert_eq!(error["error"]["code"], code, "{key}: {error}");
    }
    // The old key and the new one are one tenant with one set of counters.
    let requests = "anthropic-ratelimit-requests-remaining";
    let before = standing("rotating", requests).await;
    for key in ["rotating", "rotating-new"] {
        let status = chat("/v1/chat/completions", key, json!({"max_tokens": 1}))
            .await
            .status();
        assert_eq!(status, StatusCode::OK, "{key}");
    }
    let after = standing("rotating-new", requests).await;
    assert_eq!(before - after, 2, "both keys spent the same bucket");
    gateway.push(&weir_config(true, 100, None)).await;
}

//! The sidecar as a mesh runs it, end to end: replicas found in DNS join and leave while
//! traffic flows (the name resolved from a file the test rewrites, `--resolve-from`, with the
//! simulators on distinct loopback addresses and one port, as a headless Service's pods are),
//! the config reloaded under load, and HTTPS with a pool's own CA and a credential to engines
//! that refuse requests without it. Real Envoy with the filter → the sidecar → simulators and
//! stub engines on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use weir_e2e::{
    Envoy, Sidecar, Sim, TINY_FAST, api_key, chat_body, post_json, sidecar_bin, sim_bin,
};

const TENANTS: [&str; 5] = ["load", "steady", "burst", "guarded", "other"];

/// `steady` is an org of its own: metrics show tenants at the org level, and the reload test
/// reads its counter there while `load` runs.
fn org_of(id: &str) -> &'static str {
    if id == "steady" { "steady" } else { "acme" }
}

fn weir_config() -> Value {
    let org = |id: &str| {
        let keys: Vec<Value> = (TENANTS.iter())
            .filter(|t| org_of(t) == id)
            .map(|t| api_key(t))
            .collect();
        json!({"id": id, "workspaces": [{"id": "lab", "projects": [{"id": "mesh", "keys": keys}]}]})
    };
    let model = json!({"max_context_tokens": 8192});
    json!({
        "orgs": [org("acme"), org("steady")],
        "models": {"tiny": model, "tiny2": model, "guarded": model, "guarded-tls": model},
    })
}

fn tenant(id: &str) -> String {
    format!("{}/lab/mesh/{id}", org_of(id))
}

/// Clients streaming chat completions through Envoy in a loop until stopped; every answer is
/// checked: a 200 stream that ends with `[DONE]` and carries no error event.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<(u64, Vec<String>)>>,
}

impl Load {
    fn start(envoy: &Envoy, key: &'static str, model: &'static str, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..clients)
            .map(|c| {
                let (stop, url) = (stop.clone(), format!("{}/v1/chat/completions", envoy.url));
                tokio::spawn(async move {
                    let (mut ok, mut failures) = (0, Vec::new());
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let body = chat_body(
                            model,
                            &format!("client {c} request {i}: hello"),
                            json!({"stream": true}),
                        );
                        let resp = post_json(&url, Some(key), body.to_string(), &[]).await;
                        let status = resp.status();
                        let text = resp.text().await.unwrap_or_default();
                        if status == 200 && text.contains("[DONE]") && !text.contains("\"error\"") {
                            ok += 1;
                        } else {
                            failures.push(format!("{status}: {text:.300}"));
                        }
                    }
                    (ok, failures)
                })
            })
            .collect();
        Load { stop, tasks }
    }

    /// Stops the clients; returns the answers that were right and the others.
    /// Stops the clients; asserts none of their requests failed and returns how many succeeded.
    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let (mut ok, mut failures) = (0, Vec::new());
        for task in self.tasks {
            let (o, f) = task.await.unwrap();
            ok += o;
            failures.extend(f);
        }
        assert!(
            failures.is_empty(),
            "{} failed: {:?}",
            failures.len(),
            &failures[..failures.len().min(3)]
        );
        ok
    }
}

/// Replicas of `/ready`'s pool of `model`, by URL.
async fn ready_replicas(sidecar: &Sidecar, model: &str) -> Vec<String> {
    let (_, ready) = sidecar.ready().await;
    ready["pools"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["model"] == model)
        .flat_map(|p| p["replicas"].as_array().cloned().unwrap_or_default())
        .map(|r| r["url"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Ledger rows per replica URL.
fn served_by(sidecar: &Sidecar, replica: &str) -> usize {
    sidecar
        .ledger_rows(None)
        .iter()
        .filter(|r| r.replica == replica)
        .count()
}

/// A tenant's ledger rows once there are `n` of them (records are written as requests end, by
/// the ledger's own thread), or after five seconds, as they are.
fn records(sidecar: &Sidecar, id: &str, n: u64) -> Vec<weir_sidecar::ledger::UsageRecord> {
    let rows = || sidecar.ledger_rows(Some(&tenant(id)));
    weir_e2e::wait_for(Duration::from_secs(5), || {
        let rows = rows();
        (rows.len() as u64 >= n).then_some(rows)
    })
    .unwrap_or_else(rows)
}

/// Polls `probe` every 50 ms for up to `limit`.
async fn eventually(limit: Duration, mut probe: impl AsyncFnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if probe().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_found_in_dns_join_and_leave_under_load_and_no_request_fails() {
    // Three engines behind one name, one port, three addresses: a headless Service's pods.
    // The first one's answers are long: streams are running on it when it goes away.
    let long = [&TINY_FAST[..4], &["--output-len", "fixed:2000"]].concat();
    let first = Sim::start_at(&sim_bin(), "127.0.0.2", 0, &long);
    let port = first.port;
    let second = Sim::start_at(&sim_bin(), "127.0.0.3", port, &TINY_FAST);
    let third = Sim::start_at(&sim_bin(), "127.0.0.4", port, &TINY_FAST);
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    let name = "vllm-tiny.models.svc.cluster.local";
    let resolve = |addrs: &str| {
        let next = dir.path().join("hosts.next");
        std::fs::write(&next, format!("# the test's DNS\n{name} {addrs}\n")).unwrap();
        std::fs::rename(&next, &hosts).unwrap();
    };
    resolve("127.0.0.2");
    let config = json!({
        "queue": {"max_per_tenant": 64},
        "pools": [{"model": "tiny", "discovery": {"dns": name, "port": port, "interval_ms": 100}}],
    });
    let sidecar = Sidecar::start_with_args(
        &sidecar_bin(),
        config,
        &["--resolve-from", hosts.to_str().unwrap()],
    );
    let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
    sidecar.wait_for_probes(1);
    assert_eq!(
        ready_replicas(&sidecar, "tiny").await,
        vec![first.url.clone()]
    );

    let load = Load::start(&envoy, "load", "tiny", 4);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Two more pods: they join (probed first) and get work, while traffic flows.
    resolve("127.0.0.2 127.0.0.3 127.0.0.4");
    let joined = eventually(Duration::from_secs(20), async || {
        served_by(&sidecar, &second.url) > 0 && served_by(&sidecar, &third.url) > 0
    })
    .await;
    assert!(
        joined,
        "new replicas got work: {:?}",
        ready_replicas(&sidecar, "tiny").await
    );
    assert_eq!(ready_replicas(&sidecar, "tiny").await.len(), 3);

    // The first pod goes away from the name while streams run on it: it takes no new work,
    // its running streams end normally, then it leaves /ready and /metrics. Load-aware routing
    // sends less to a replica busy with long answers, so wait for a moment one runs there.
    let busy = eventually(Duration::from_secs(10), async || {
        let (_, ready) = sidecar.ready().await;
        ready["pools"][0]["replicas"].as_array().is_some_and(|rs| {
            rs.iter()
                .any(|r| r["url"] == first.url.as_str() && r["in_flight"].as_u64().unwrap_or(0) > 0)
        })
    })
    .await;
    assert!(busy, "a stream ran on the first replica");
    resolve("127.0.0.3 127.0.0.4");
    // While it drains, /ready shows it leaving, and what runs there only goes down.
    let mut draining: Vec<u64> = Vec::new();
    let left = eventually(Duration::from_secs(10), async || {
        let (_, ready) = sidecar.ready().await;
        let replicas = ready["pools"][0]["replicas"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        match replicas.iter().find(|r| r["url"] == first.url.as_str()) {
            Some(r) if r["leaving"] == true => {
                draining.push(r["in_flight"].as_u64().unwrap_or_default());
                false
            }
            Some(_) => false,
            None => true,
        }
    })
    .await;
    assert!(left, "{:?}", ready_replicas(&sidecar, "tiny").await);
    assert!(
        draining.windows(2).all(|w| w[1] <= w[0]),
        "no new work while it drained: {draining:?}"
    );
    assert!(
        draining.first().is_some_and(|n| *n > 0),
        "streams were running on it when it left: {draining:?}"
    );
    assert!(!ready_replicas(&sidecar, "tiny").await.contains(&first.url));
    let metrics = sidecar.metrics().await;
    assert!(!metrics.contains(&first.url), "its series went with it");
    assert!(metrics.contains(&format!(
        "weir_replica_healthy{{replica=\"{}\"}} 1",
        second.url
    )));
    let on_first = served_by(&sidecar, &first.url);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let ok = load.stop().await;
    assert!(ok > 20, "{ok} requests served");
    assert_eq!(
        served_by(&sidecar, &first.url),
        on_first,
        "no work after it left"
    );
    let rows = records(&sidecar, "load", ok);
    assert_eq!(rows.len() as u64, ok, "one record per request");
    assert!(rows.iter().all(|r| r.outcome == "ok"));
    eprintln!(
        "discovery under load: {ok} streams, none failed; served by 127.0.0.2 (left) {on_first}, \
         .3 {}, .4 {}",
        served_by(&sidecar, &second.url),
        served_by(&sidecar, &third.url)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_setting_a_reload_changes_applies_from_the_next_request() {
    // The sidecar's body limit (and its estimator's) were read once at start-up: a reload
    // said "config reloaded" and kept serving the old limit, neither applied nor named as a
    // setting that needs a restart.
    let sim = Sim::start_tiny_fast(&[]);
    let config = |max_body_bytes: usize| {
        json!({"reload": {"poll_ms": 100}, "max_body_bytes": max_body_bytes,
            "pools": [{"model": "tiny", "replicas": [sim.url]}]})
    };
    let sidecar = Sidecar::start(config(8 << 20));
    let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
    sidecar.wait_for_probes(1);
    let url = format!("{}/v1/chat/completions", envoy.url);
    let body = chat_body("tiny", &"word ".repeat(1000), json!({"max_tokens": 1})).to_string();
    let resp = post_json(&url, Some("steady"), body.clone(), &[]).await;
    assert_eq!(resp.status(), 200);
    sidecar.rewrite_config(config(1024));
    let reloaded = eventually(Duration::from_secs(5), async || {
        sidecar.log().contains("config reloaded")
    })
    .await;
    assert!(reloaded, "{}", sidecar.log());
    let resp = post_json(&url, Some("steady"), body, &[]).await;
    assert_eq!(
        resp.status(),
        413,
        "a 5 kB body was served after max_body_bytes was reloaded as 1024"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_deadline_counts_from_the_body_not_from_the_headers() {
    // The filter sends a request's headers on before it has read the body, so the sidecar has
    // them for as long as the body takes to come. The queue deadline bounds the wait for
    // dispatch: a request whose body took longer than it, served at once on an idle pool, met
    // its deadline - and under load it must get its wait, not an immediate 503.
    let sim = Sim::start_tiny_fast(&[]);
    let sidecar = Sidecar::start(json!({"queue": {"deadline_ms": 1000},
        "pools": [{"model": "tiny", "replicas": [sim.url]}]}));
    let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
    sidecar.wait_for_probes(1);
    let goodput = "weir_goodput_tokens_total{pool=\"tiny\",tier=\"standard\"}";
    let before = series(&sidecar.metrics().await, goodput).unwrap_or(0.0);
    let body = chat_body("tiny", "a body on a slow link", json!({"max_tokens": 4})).to_string();
    let addr = envoy.url.trim_start_matches("http://").to_owned();
    let answer = tokio::task::spawn_blocking(move || {
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-steady\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        conn.write_all(body.as_bytes()).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        answer
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let counted = eventually(Duration::from_secs(5), async || {
        series(&sidecar.metrics().await, goodput).unwrap_or(0.0) > before
    })
    .await;
    assert!(
        counted,
        "served at once after its body came, yet counted as past its deadline (no goodput):\n{}",
        sidecar.metrics().await
    );
}

/// The value of one series of the sidecar's metrics, by its full name and labels.
fn series(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_rewritten_under_load_applies_without_losing_state() {
    let a = Sim::start_tiny_fast(&[]);
    let b = Sim::start_tiny_fast(&[]);
    let c = Sim::start_tiny_fast(&["--served-model-name", "tiny2"]);
    let before = json!({
        "queue": {"max_per_tenant": 64},
        "reload": {"poll_ms": 100},
        "pools": [{"model": "tiny", "replicas": [a.url]}],
    });
    let sidecar = Sidecar::start(before.clone());
    let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
    sidecar.wait_for_probes(1);
    let chat_url = format!("{}/v1/chat/completions", envoy.url);

    // State to keep: a tenant's fairness counter, a completed idempotency key, the ledger.
    let body = chat_body("tiny", "remember me", json!({})).to_string();
    let resp = post_json(
        &chat_url,
        Some("steady"),
        body.clone(),
        &[("idempotency-key", "steady-1")],
    )
    .await;
    assert_eq!(resp.status(), 200);
    let answer = resp.text().await.unwrap();
    let counter_of = "weir_vtc_counter{tenant=\"steady\",pool=\"tiny\"}";
    let counter = series(&sidecar.metrics().await, counter_of).expect("steady's counter");
    assert!(counter > 0.0);

    let load = Load::start(&envoy, "load", "tiny", 2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A replica and a pool added, the queue bound and the new pool's concurrency set.
    let after = json!({
        "queue": {"max_per_tenant": 3},
        "reload": {"poll_ms": 100},
        "pools": [
            {"model": "tiny", "replicas": [a.url, b.url]},
            {"model": "tiny2", "replicas": [c.url], "max_concurrency_per_replica": 1},
        ],
    });
    sidecar.rewrite_config(after.clone());
    let reloaded = eventually(Duration::from_secs(20), async || {
        served_by(&sidecar, &b.url) > 0 && ready_replicas(&sidecar, "tiny2").await.len() == 1
    })
    .await;
    assert!(
        reloaded,
        "the added replica got work, the added pool is there:\n{}",
        sidecar.log()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ok = load.stop().await;
    assert!(ok > 10, "{ok}");

    // Nothing was lost: the counter, the claim (replayed, not run again), the records.
    let metrics = sidecar.metrics().await;
    assert_eq!(
        series(&metrics, counter_of),
        Some(counter),
        "the counter stayed"
    );
    let replay = post_json(
        &chat_url,
        Some("steady"),
        body,
        &[("idempotency-key", "steady-1")],
    )
    .await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), answer);
    assert_eq!(sidecar.ledger_rows(Some(&tenant("steady"))).len(), 1);
    assert_eq!(records(&sidecar, "load", ok).len() as u64, ok);

    // The new settings hold for the next decisions: one at a time on tiny2, three may wait.
    let burst: Vec<_> = (0..10)
        .map(|i| {
            let url = chat_url.clone();
            tokio::spawn(async move {
                let body = chat_body("tiny2", &format!("burst {i}"), json!({"max_tokens": 20}));
                let resp = post_json(&url, Some("burst"), body.to_string(), &[]).await;
                (
                    resp.status().as_u16(),
                    resp.text().await.unwrap_or_default(),
                )
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in burst {
        let (status, text) = task.await.unwrap();
        assert!(
            status == 200 || text.contains("queue_full"),
            "{status}: {text}"
        );
        statuses.push(status);
    }
    let served = statuses.iter().filter(|s| **s == 200).count();
    assert!(
        served >= 1 && statuses.contains(&429),
        "1 running + 3 queued at once: {statuses:?}"
    );
    let recorded = eventually(Duration::from_secs(5), async || {
        served_by(&sidecar, &c.url) == served
    })
    .await;
    assert!(recorded, "tiny2's requests ran on its replica");

    // An invalid config is logged with its field and changes nothing; so is one on SIGHUP.
    let mut invalid = after.clone();
    invalid["queue"]["max_total"] = "many".into();
    sidecar.rewrite_config(invalid);
    let logged = eventually(Duration::from_secs(5), async || {
        sidecar
            .log()
            .contains("queue.max_total: must be a non-negative integer")
    })
    .await;
    assert!(logged, "{}", sidecar.log());
    assert!(sidecar.log().contains("the config in force stays"));
    sidecar.hangup();
    let again = eventually(Duration::from_secs(5), async || {
        sidecar
            .log()
            .matches("queue.max_total: must be a non-negative integer")
            .count()
            >= 2
    })
    .await;
    assert!(again, "SIGHUP reloads too");
    assert_eq!(ready_replicas(&sidecar, "tiny").await.len(), 2);
    let resp = post_json(
        &chat_url,
        Some("other"),
        chat_body("tiny2", "still here", json!({})).to_string(),
        &[],
    )
    .await;
    assert_eq!(resp.status(), 200);

    // Settings that need a restart are said to, and kept.
    let mut fifo = after;
    fifo["policy"] = "fifo".into();
    sidecar.rewrite_config(fifo);
    let warned = eventually(Duration::from_secs(5), async || {
        sidecar
            .log()
            .contains("policy changed: it takes effect at the next restart")
    })
    .await;
    assert!(warned, "{}", sidecar.log());
    // And the pool removed from the config goes: tiny2's model is then not served.
    sidecar.rewrite_config(before);
    let gone = eventually(Duration::from_secs(5), async || {
        ready_replicas(&sidecar, "tiny2").await.is_empty()
            && ready_replicas(&sidecar, "tiny").await.len() == 1
    })
    .await;
    assert!(gone);
    let resp = post_json(
        &chat_url,
        Some("other"),
        chat_body("tiny2", "gone", json!({})).to_string(),
        &[],
    )
    .await;
    assert_eq!(resp.status(), 404);
    eprintln!("reload under load: {ok} streams, none failed; tiny2 burst {statuses:?}");
}

/// What a stub engine saw: requests with the right token, by path, and requests without it.
#[derive(Default)]
struct Seen {
    authorized: Mutex<Vec<String>>,
    refused: AtomicU64,
    /// The token it takes: a test may rotate it.
    token: Mutex<String>,
}

/// A prompt the guarded engine answers with 401, quoting the token it got: as a hosted API
/// answers once it has revoked the pool's key.
const REVOKE_MARK: &str = "the engine no longer takes this key";

/// A prompt the guarded engine answers with 429 and a `Retry-After`, in a hosted API's words:
/// the platform account's limit and usage, every tenant's traffic together.
const THROTTLE_MARK: &str = "the account behind the pool is over its rate";

/// An engine that answers only requests carrying `Authorization: Bearer <token>` (401
/// otherwise): `/metrics` in vLLM's names, chat completions with a prefix cache keyed by
/// `cache_salt` (so weir's isolation probe finds `salt`). Over TLS with `tls`'s certificate
/// and key (DER). Serves until the test binary exits.
fn guarded_engine(token: &str, tls: Option<Arc<rustls::ServerConfig>>) -> (String, Arc<Seen>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Seen {
        token: Mutex::new(token.to_owned()),
        ..Seen::default()
    });
    let cache: Arc<Mutex<HashSet<String>>> = Arc::default();
    let state = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let (tls, seen, cache) = (tls.clone(), state.clone(), cache.clone());
            std::thread::spawn(move || {
                let stream: Box<dyn ReadWrite> = match tls {
                    Some(config) => {
                        let conn = rustls::ServerConnection::new(config).unwrap();
                        Box::new(rustls::StreamOwned::new(conn, tcp))
                    }
                    None => Box::new(tcp),
                };
                serve_guarded(stream, &seen, &cache);
            });
        }
    });
    (url, seen)
}

trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send> ReadWrite for T {}

fn serve_guarded(stream: Box<dyn ReadWrite>, seen: &Seen, cache: &Mutex<HashSet<String>>) {
    let mut reader = BufReader::new(stream);
    loop {
        let (mut request_line, mut length, mut authorized) = (String::new(), 0, false);
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let lower = line.to_ascii_lowercase();
            if request_line.is_empty() {
                request_line = line.clone();
            } else if let Some(v) = lower.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            } else if let Some(v) = lower.strip_prefix("authorization:") {
                let expected = format!("bearer {}", seen.token.lock().unwrap());
                authorized = v.trim() == expected.to_ascii_lowercase();
            }
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let path = request_line
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        // A hosted API's answer to a key it no longer takes quotes part of the key.
        let revoked = String::from_utf8_lossy(&body).contains(REVOKE_MARK);
        let throttled = String::from_utf8_lossy(&body).contains(THROTTLE_MARK);
        let (status, answer) = if throttled {
            (
                "429 Too Many Requests\r\nretry-after: 7",
                json!({"error": {"message": "Rate limit reached for llama in organization \
                    org-platform on tokens per min (TPM): Limit 90000, Used 89950, Requested 400.",
                    "type": "tokens", "code": "rate_limit_exceeded"}})
                .to_string(),
            )
        } else if revoked {
            let token = seen.token.lock().unwrap().clone();
            (
                "401 Unauthorized",
                json!({"error": {"message": format!("Incorrect API key provided: {token}"),
                    "code": "invalid_api_key"}})
                .to_string(),
            )
        } else if !authorized {
            seen.refused.fetch_add(1, Ordering::Relaxed);
            (
                "401 Unauthorized",
                json!({"error": {"message": "no token"}}).to_string(),
            )
        } else {
            seen.authorized.lock().unwrap().push(path.clone());
            if path == "GET /metrics" {
                (
                    "200 OK",
                    "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n".to_owned(),
                )
            } else if path == "POST /v1/chat/completions" {
                let request: Value = serde_json::from_slice(&body).unwrap_or_default();
                let key = format!("{}|{}", request["cache_salt"], request["messages"]);
                let cached = if cache.lock().unwrap().insert(key) {
                    0
                } else {
                    300
                };
                let answer = json!({"id": "chatcmpl-guarded", "object": "chat.completion", "created": 0,
                    "model": request["model"], "choices": [{"index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "guarded hello"}}],
                    "usage": {"prompt_tokens": 320, "completion_tokens": 2, "total_tokens": 322,
                        "prompt_tokens_details": {"cached_tokens": cached}}});
                ("200 OK", answer.to_string())
            } else {
                ("404 Not Found", String::new())
            }
        };
        let response = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if reader.get_mut().write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}

/// A CA and a server certificate it signed for 127.0.0.1 and localhost: (CA PEM, server TLS
/// config).
fn test_ca() -> (String, Arc<rustls::ServerConfig>) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let ca = weir_e2e::loopback_ca::LoopbackCa::new();
    let leaf = CertificateDer::from_pem_slice(ca.leaf_pem.as_bytes()).unwrap();
    let key = PrivateKeyDer::from_pem_slice(ca.key_pem.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![leaf], key)
        .unwrap();
    (ca.ca_pem, Arc::new(config))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_behind_a_credential_and_tls_get_weir_s_requests_and_probes_with_it() {
    let token = "engine-token-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("engine-token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let tls_token_file = dir.path().join("tls-engine-token");
    std::fs::write(&tls_token_file, token).unwrap();
    let (ca_pem, tls) = test_ca();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca_pem).unwrap();
    let (plain, plain_seen) = guarded_engine(token, None);
    let (secure, secure_seen) = guarded_engine(token, Some(tls));
    let credential = json!({"file": tls_token_file});
    let sidecar = Sidecar::start(json!({"reload": {"poll_ms": 100}, "pools": [
        {"model": "guarded", "replicas": [plain], "credential": {"file": token_file}},
        {"model": "guarded-tls", "replicas": [secure], "credential": credential,
         "tls": {"ca_file": ca_file}},
        // The same engine, without its CA: its certificate is not trusted, it never serves.
        {"model": "untrusted", "replicas": [secure.replace("127.0.0.1", "localhost")],
         "credential": credential},
    ]}));
    let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
    sidecar.wait_for_probes(3);

    // Without the token the engine refuses (what weir's requests would meet without it).
    let refused = reqwest::get(format!("{plain}/metrics")).await.unwrap();
    assert_eq!(refused.status(), 401);
    plain_seen.refused.store(0, Ordering::Relaxed);

    let (status, ready) = sidecar.ready().await;
    assert_eq!(status, 503, "one pool cannot serve: {ready}");
    let pools = ready["pools"].as_array().unwrap();
    for (pool, (healthy, mode)) in
        pools
            .iter()
            .zip([(true, "salt"), (true, "salt"), (false, "unprobed")])
    {
        let replica = &pool["replicas"][0];
        assert_eq!(
            (
                replica["healthy"].as_bool(),
                replica["cache_isolation"].as_str()
            ),
            (Some(healthy), Some(mode)),
            "{pool}"
        );
    }
    for model in ["guarded", "guarded-tls"] {
        let body = chat_body(model, "hello through the gateway", json!({}));
        let resp = post_json(
            &format!("{}/v1/chat/completions", envoy.url),
            Some("guarded"),
            body.to_string(),
            &[],
        )
        .await;
        assert_eq!(resp.status(), 200, "{model}");
        let answer: Value = resp.json().await.unwrap();
        assert_eq!(answer["choices"][0]["message"]["content"], "guarded hello");
    }
    for (name, seen) in [("plain", &plain_seen), ("tls", &secure_seen)] {
        let paths = seen.authorized.lock().unwrap().clone();
        assert!(
            paths.iter().any(|p| p == "GET /metrics"),
            "{name}: health checks: {paths:?}"
        );
        // Isolation probe (at least three) and the tenant's request.
        let chats = paths
            .iter()
            .filter(|p| *p == "POST /v1/chat/completions")
            .count();
        assert!(chats >= 4, "{name}: {paths:?}");
    }
    assert_eq!(
        plain_seen.refused.load(Ordering::Relaxed),
        0,
        "every request carried the token"
    );
    assert_eq!(secure_seen.refused.load(Ordering::Relaxed), 0);
    // Records are written as requests end, by the ledger's own thread.
    let rows = weir_e2e::wait_for(Duration::from_secs(5), || {
        let rows = sidecar.ledger_rows(Some(&tenant("guarded")));
        (rows.len() == 2).then_some(rows)
    })
    .expect("a record per request");
    assert!(
        rows.iter()
            .all(|r| r.outcome == "ok" && r.source == "engine")
    );

    // The engine's token is rotated, then the secret file weir reads (as a Secret's update
    // mounts it): weir's checks are refused meanwhile, and it follows the file, no restart.
    *plain_seen.token.lock().unwrap() = "rotated-token-9876543210".into();
    let plain_ready = async |healthy: bool, mode: &str| {
        let (_, ready) = sidecar.ready().await;
        let replica = &ready["pools"][0]["replicas"][0];
        replica["healthy"] == healthy && replica["cache_isolation"] == mode
    };
    assert!(
        eventually(Duration::from_secs(5), async || plain_ready(
            false, "unprobed"
        )
        .await)
        .await,
        "refused with the old token"
    );
    let next = dir.path().join("engine-token.next");
    std::fs::write(&next, "rotated-token-9876543210\n").unwrap();
    std::fs::rename(&next, &token_file).unwrap();
    assert!(
        eventually(Duration::from_secs(10), async || plain_ready(true, "salt")
            .await)
        .await,
        "healthy and probed again with the new token:\n{}",
        sidecar.log()
    );
    let body = chat_body("guarded", "after the rotation", json!({}));
    let resp = post_json(
        &format!("{}/v1/chat/completions", envoy.url),
        Some("guarded"),
        body.to_string(),
        &[],
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        secure_seen.refused.load(Ordering::Relaxed),
        0,
        "the other pool's token stayed"
    );

    // The engine refuses the pool's credential: the tenant's key was fine, and what the engine
    // says of the credential it got is not the tenant's to read.
    let body = chat_body("guarded", REVOKE_MARK, json!({}));
    let resp = post_json(
        &format!("{}/v1/chat/completions", envoy.url),
        Some("guarded"),
        body.to_string(),
        &[],
    )
    .await;
    let status = resp.status();
    let answer = resp.text().await.unwrap();
    assert!(
        !answer.contains("rotated-token"),
        "the engine's credential reached the tenant: {status} {answer}"
    );
    assert_eq!(status, 502, "{answer}");
    assert!(answer.contains("engine_unauthorized"), "{answer}");

    // The engine throttles the pool's account: the tenant may retry when the engine says, but
    // the account's limit and usage (every tenant's traffic) are not its to read.
    let body = chat_body("guarded", THROTTLE_MARK, json!({}));
    let resp = post_json(
        &format!("{}/v1/chat/completions", envoy.url),
        Some("guarded"),
        body.to_string(),
        &[],
    )
    .await;
    let status = resp.status();
    let retry_after = resp.headers().get("retry-after").cloned();
    let answer = resp.text().await.unwrap();
    assert!(
        !answer.contains("org-platform") && !answer.contains("89950"),
        "the pool account's usage reached the tenant: {status} {answer}"
    );
    assert_eq!(status, 429, "{answer}");
    let retry_after: u64 = retry_after.unwrap().to_str().unwrap().parse().unwrap();
    assert!(
        (7..=11).contains(&retry_after),
        "the engine's 7 s, never sooner, spread up to half as long again: {retry_after}"
    );
}

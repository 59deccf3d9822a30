//! Predicted output reservations end to end: real Envoy with the filter → the sidecar → the
//! simulator, answers of their natural length (the 8B preset's: log-normal, median 256 tokens).
//! Requests are sent as the OpenAI SDK sends them by default, with no `max_tokens`, by a key
//! with a budget of 60k output tokens a minute on a model of 131k tokens of context.
//!
//! The same traffic goes through a second Envoy whose filter has prediction off (`prediction:
//! {enabled: false}`), for contrast: there each request reserves the rest of its context.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sidecar, Sim, api_key_limited, chat_body, post_json};

const MODEL: &str = "llama-3.1-8b";
const CONTEXT: u64 = 131_072;
const BUDGET: u64 = 60_000;
const TENANT: &str = "acme/lab/sdk/on";

fn weir_config(prediction: Value) -> Value {
    let limits = json!({"output_tokens_per_minute": BUDGET});
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "sdk", "keys": [
            api_key_limited("on", limits.clone()),
            api_key_limited("off", limits),
            api_key_limited("long", json!({})),
        ]}]}]}],
        "models": {MODEL: {"max_context_tokens": CONTEXT}},
        "prediction": prediction,
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// What a burst of SDK-default requests got.
#[derive(Debug, Default)]
struct Burst {
    admitted: usize,
    refused: usize,
    /// Most answers streaming back at once.
    peak_in_flight: usize,
    /// When the first request was sent (Unix ms).
    started_ms: u64,
}

/// `clients` callers, each sending requests one after another for `length` (every other one
/// streamed), waiting a quarter second after a 429.
async fn burst(envoy: &Envoy, key: &'static str, clients: usize, length: Duration) -> Burst {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let in_flight = AtomicUsize::new(0);
    let peak = AtomicUsize::new(0);
    let started_ms = now_ms();
    let start = Instant::now();
    let url = format!("{}/v1/chat/completions", envoy.url);
    let client = |c: usize| {
        let (url, in_flight, peak) = (&url, &in_flight, &peak);
        async move {
            let (mut admitted, mut refused) = (0, 0);
            while start.elapsed() < length {
                let n = SEQ.fetch_add(1, Ordering::Relaxed);
                let body = chat_body(
                    MODEL,
                    &format!("question {n} from caller {c}: tell me about rivers"),
                    json!({"stream": n.is_multiple_of(2)}),
                );
                let resp = post_json(url, Some(key), body.to_string(), &[]).await;
                match resp.status() {
                    StatusCode::OK => {
                        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(now, Ordering::SeqCst);
                        let text = resp.text().await.unwrap();
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        assert!(!text.contains("\"error\""), "{text}");
                        admitted += 1;
                    }
                    StatusCode::TOO_MANY_REQUESTS => {
                        let text = resp.text().await.unwrap();
                        assert!(text.contains("output_tokens_per_minute"), "{text}");
                        refused += 1;
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    other => panic!("{other}: {}", resp.text().await.unwrap()),
                }
            }
            (admitted, refused)
        }
    };
    let results = futures::future::join_all((0..clients).map(client)).await;
    Burst {
        admitted: results.iter().map(|r| r.0).sum(),
        refused: results.iter().map(|r| r.1).sum(),
        peak_in_flight: peak.load(Ordering::SeqCst),
        started_ms,
    }
}

/// The most the tenant's delivered output ran over its budget at any moment since `from_ms`,
/// from a full bucket: the ledger's completed answers against a minute's worth plus the refill.
fn overshoot(sidecar: &Sidecar, from_ms: u64) -> (i64, u64) {
    let mut rows: Vec<_> = sidecar
        .ledger_rows(Some(TENANT))
        .into_iter()
        .filter(|r| r.finished_at_ms >= from_ms)
        .collect();
    rows.sort_by_key(|r| r.finished_at_ms);
    let mut delivered = 0;
    let mut worst = i64::MIN;
    for r in &rows {
        delivered += r.completion_tokens;
        let allowance = BUDGET + BUDGET * (r.finished_at_ms - from_ms) / 60_000;
        worst = worst.max(delivered as i64 - allowance as i64);
    }
    (worst, delivered)
}

async fn overrun_tokens(envoy: &Envoy) -> u64 {
    envoy.stats().await["weir.prediction.overrun_tokens"]
}

/// The output reserved for the next request: the bucket's remaining tokens on an answer, taken
/// from a full bucket (the answer's headers report the standing after its reservation).
async fn reserved_from_full(envoy: &Envoy, key: &str) -> u64 {
    let body = chat_body(MODEL, "a probe of the reservation", json!({}));
    let url = format!("{}/v1/chat/completions", envoy.url);
    let resp = post_json(&url, Some(key), body.to_string(), &[]).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let remaining: u64 = resp.headers()["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    resp.text().await.unwrap();
    BUDGET - remaining
}

/// The KV tokens the sidecar holds on its replicas.
async fn sidecar_reserved_kv(sidecar: &Sidecar) -> u64 {
    sidecar
        .metrics()
        .await
        .lines()
        .filter(|l| l.starts_with("weir_replica_reserved_kv_tokens{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Waits until the key's bucket has refilled what `tokens` of output took from it.
async fn refill(tokens: u64) {
    tokio::time::sleep(Duration::from_millis(tokens * 60_000 / BUDGET + 1_000)).await;
}

#[tokio::test]
async fn sdk_default_requests_are_admitted_at_the_rate_of_their_real_outputs() {
    let sim = Sim::start(&[
        "--preset",
        MODEL,
        "--time-scale",
        "10",
        "--record-requests",
        "400",
    ]);
    let sidecar = Sidecar::start(json!({
        "queue": {"max_per_tenant": 64, "deadline_ms": 20000},
        "pools": [{"model": MODEL, "replicas": [sim.url]}],
    }));
    let predicted = Envoy::start(&weir_config(json!({})), sidecar.port, sidecar.port);
    let unpredicted = Envoy::start(
        &weir_config(json!({"enabled": false})),
        sidecar.port,
        sidecar.port,
    );
    sidecar.wait_for_probes(1);

    // A stream that runs past the output its KV hold was sized for (cold: the initial 1,024)
    // goes on, and its hold grows with it, so admission sees what the replica holds.
    let body = chat_body(
        MODEL,
        "a long one",
        json!({"stream": true, "max_tokens": 3000, "ignore_eos": true}),
    );
    let url = format!("{}/v1/chat/completions", predicted.url);
    let mut resp = post_json(&url, Some("long"), body.to_string(), &[]).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut streamed = 0;
    while streamed < 2000 {
        let chunk = resp.chunk().await.unwrap().unwrap();
        streamed += String::from_utf8_lossy(&chunk)
            .matches("\"content\":\"")
            .count();
    }
    let held = sidecar_reserved_kv(&sidecar).await;
    println!("a stream {streamed} tokens in (hold sized for 1,024): {held} KV tokens held");
    // The relay charges and resizes per 16 tokens (`CHARGE_EVERY`): the hold trails the
    // stream by less than that (a CI run read 1,994 for 2,000). Without the growth it would
    // stay near the 1,024 it was sized for.
    assert!(
        held + 16 > streamed as u64,
        "{held} held for {streamed} streamed"
    );
    while resp.chunk().await.unwrap().is_some() {}

    // Cold, the filter reserves the configured initial value; 24 answers teach it the tenant's
    // lengths (20 are needed), then it reserves their p90.
    let learning = burst(&predicted, "on", 4, Duration::from_secs(3)).await;
    assert!(learning.admitted >= 24, "{learning:?}");
    let (_, learned_tokens) = overshoot(&sidecar, learning.started_ms);
    refill(learned_tokens).await;
    let reserved = reserved_from_full(&predicted, "on").await;
    let rows = sidecar.ledger_rows(Some(TENANT));
    let mut lengths: Vec<u64> = rows.iter().map(|r| r.completion_tokens).collect();
    lengths.sort_unstable();
    let p90 = lengths[lengths.len() * 9 / 10];
    println!(
        "learned from {} answers (median {}, p90 {}): reserves {reserved} output tokens, not \
         the {CONTEXT}-token context",
        lengths.len(),
        lengths[lengths.len() / 2],
        p90
    );
    assert!(
        reserved >= lengths[lengths.len() / 2] && reserved <= 2 * p90 + 64,
        "reserved {reserved}, p90 {p90}"
    );
    refill(reserved).await;

    // The burst: 48 callers for 10 s, each sending again as soon as it has its answer.
    let overrun_before = overrun_tokens(&predicted).await;
    let on = burst(&predicted, "on", 48, Duration::from_secs(10)).await;
    let overrun = overrun_tokens(&predicted).await - overrun_before;
    let (over, delivered) = overshoot(&sidecar, on.started_ms);
    let seconds = (now_ms() - on.started_ms) as f64 / 1e3;
    println!(
        "prediction on:  {} admitted ({:.1}/s), {} refused (429), {} answering at once at the \
         peak, {delivered} output tokens in {seconds:.1} s (budget {} by then); overshoot at \
         worst {over} tokens, bound: the {overrun} tokens answers ran past their predictions \
         (worst case {} in flight x (context - prediction) = {})",
        on.admitted,
        on.admitted as f64 / seconds,
        on.refused,
        on.peak_in_flight,
        BUDGET + (BUDGET as f64 * seconds / 60.0) as u64,
        on.peak_in_flight,
        on.peak_in_flight as u64 * (CONTEXT - reserved),
    );
    assert!(on.peak_in_flight >= 16, "many at once: {on:?}");
    assert!(on.refused > 0, "the burst exhausted the budget: {on:?}");
    assert!(
        over <= overrun as i64,
        "overshoot {over} within the documented bound {overrun}"
    );
    assert!(
        delivered as f64 >= 0.8 * (BUDGET as f64 + BUDGET as f64 * 10.0 / 60.0),
        "the budget is used, not left idle: {delivered}"
    );
    // Nothing was cut short: weir added no limit the caller did not send.
    let received: Vec<Value> = sim
        .received()
        .await
        .into_iter()
        .map(|r| r["body"].clone())
        .filter(|b| {
            b["messages"][0]["content"]
                .as_str()
                .is_some_and(|c| c.contains("rivers"))
        })
        .collect();
    assert!(received.len() > 100, "{}", received.len());
    for body in &received {
        assert!(body.get("max_tokens").is_none(), "{body}");
    }
    // The sidecar learned and published its prediction error per pool: some answers ran past
    // what their KV hold was sized for, and went on (their hold grew as they streamed).
    let metrics = sidecar.metrics().await;
    let model = format!("pool=\"{MODEL}\"");
    let series = |name: &str, label: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l.contains(&model) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let count = series("weir_output_prediction_ratio_count{", "");
    let within = series("weir_output_prediction_ratio_bucket{", "le=\"1.0\"");
    println!("sidecar: {within} of {count} answers within their predicted KV hold");
    assert!(count as usize >= on.admitted, "{count} observed");
    assert!(within > count / 2 && within < count, "{within} of {count}");

    // The same burst with prediction off: each request reserves the rest of the context,
    // more than the whole bucket, so only a full bucket admits one, alone.
    let off = burst(&unpredicted, "off", 48, Duration::from_secs(10)).await;
    let seconds_off = (now_ms() - off.started_ms) as f64 / 1e3;
    println!(
        "prediction off: {} admitted ({:.1}/s), {} refused (429), {} answering at once at the peak",
        off.admitted,
        off.admitted as f64 / seconds_off,
        off.refused,
        off.peak_in_flight
    );
    assert!(off.peak_in_flight <= 2, "one at a time: {off:?}");
    assert!(
        on.admitted >= 4 * off.admitted,
        "{} vs {}",
        on.admitted,
        off.admitted
    );
}

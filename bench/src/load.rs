//! Generates a scenario's load against an OpenAI-compatible endpoint and records every request.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Exp};
use serde::Serialize;
use serde_json::json;

use crate::scenario::{Arrival, Length, Scenario, TenantLoad};
use crate::target::Endpoint;

/// One request as the client saw it.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub tenant: String,
    /// Seconds from the start of the run when it was sent.
    pub sent_s: f64,
    pub status: u16,
    pub ttft_s: Option<f64>,
    /// Mean gap between streamed tokens.
    pub itl_s: Option<f64>,
    pub e2e_s: f64,
    pub output_tokens: u64,
}

pub type Records = Arc<Mutex<Vec<Record>>>;

fn draw(len: &Length, rng: &mut SmallRng) -> usize {
    match *len {
        Length::Fixed(n) => n,
        Length::Uniform { min, max } => rng.random_range(min.min(max)..=max.max(min)),
    }
}

/// About `tokens` tokens of text (" word" is one cl100k token), unique after the shared prefix.
fn prompt(tenant: &TenantLoad, tokens: usize, n: u64) -> String {
    let shared = " shared".repeat(tenant.shared_prefix_tokens.min(tokens));
    let own = tokens.saturating_sub(tenant.shared_prefix_tokens);
    format!(
        "{shared}{} {} {n}",
        " word".repeat(own.saturating_sub(3)),
        tenant.name
    )
}

/// Where one tenant's requests go and as whom.
#[derive(Clone)]
struct Caller {
    http: reqwest::Client,
    url: String,
    model: String,
    key: String,
}

/// Sends one request and times it.
async fn send(to: &Caller, tenant: &TenantLoad, n: u64, rng_seed: u64, start: Instant) -> Record {
    let mut rng = SmallRng::seed_from_u64(rng_seed);
    let (prompt_tokens, output_tokens) = (
        draw(&tenant.prompt_tokens, &mut rng),
        draw(&tenant.output_tokens, &mut rng),
    );
    let body = json!({
        "model": to.model,
        "messages": [{"role": "user", "content": prompt(tenant, prompt_tokens, n)}],
        "max_tokens": output_tokens.max(1),
        "ignore_eos": true,
        "stream": tenant.stream,
    });
    let sent = Instant::now();
    let mut record = Record {
        tenant: tenant.name.clone(),
        sent_s: (sent - start).as_secs_f64(),
        status: 0,
        ttft_s: None,
        itl_s: None,
        e2e_s: 0.0,
        output_tokens: 0,
    };
    let resp = to
        .http
        .post(format!("{}/v1/chat/completions", to.url))
        .bearer_auth(&to.key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await;
    let Ok(mut resp) = resp else {
        record.e2e_s = sent.elapsed().as_secs_f64();
        return record;
    };
    record.status = resp.status().as_u16();
    let mut gaps = Vec::new();
    if !tenant.stream {
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        record.output_tokens = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        record.e2e_s = sent.elapsed().as_secs_f64();
        return record;
    }
    let mut last_token: Option<Instant> = None;
    while let Ok(Some(chunk)) = resp.chunk().await {
        let text = String::from_utf8_lossy(&chunk);
        // One content delta per token; the role chunk's empty content is not one.
        let tokens =
            text.matches("\"content\":\"").count() - text.matches("\"content\":\"\"").count();
        if tokens > 0 {
            let now = Instant::now();
            match last_token {
                None => record.ttft_s = Some((now - sent).as_secs_f64()),
                Some(prev) => gaps.push((now - prev).as_secs_f64() / tokens as f64),
            }
            last_token = Some(now);
            record.output_tokens += tokens as u64;
        }
    }
    record.e2e_s = sent.elapsed().as_secs_f64();
    if !gaps.is_empty() {
        record.itl_s = Some(gaps.iter().sum::<f64>() / gaps.len() as f64);
    }
    record
}

/// Runs every tenant's arrival process for the scenario's duration.
pub async fn run(scenario: &Scenario, endpoint: &Endpoint, records: Records) {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .build()
        .unwrap_or_default();
    let start = Instant::now();
    let end = Duration::from_secs_f64(scenario.duration_s);
    let mut tasks = Vec::new();
    for (i, tenant) in scenario.tenants.iter().enumerate() {
        let to = Caller {
            http: http.clone(),
            url: endpoint.url.clone(),
            model: endpoint.model.clone(),
            key: endpoint.keys.of(&tenant.name).to_owned(),
        };
        let (tenant, records) = (tenant.clone(), records.clone());
        let stop = tenant
            .stop_s
            .map_or(end, |s| Duration::from_secs_f64(s).min(end));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs_f64(tenant.start_s)).await;
            let mut rng = SmallRng::seed_from_u64(i as u64);
            let mut inflight = Vec::new();
            let mut n = 0u64;
            let fire = |n: u64, seed: u64| {
                let (to, tenant, records) = (to.clone(), tenant.clone(), records.clone());
                tokio::spawn(async move {
                    let r = send(&to, &tenant, n, seed, start).await;
                    if let Ok(mut all) = records.lock() {
                        all.push(r);
                    }
                })
            };
            match tenant.arrival {
                Arrival::Poisson { rate_per_s } => {
                    let gaps = Exp::new(rate_per_s.max(1e-6)).ok();
                    while start.elapsed() < stop {
                        inflight.push(fire(n, rng.random()));
                        n += 1;
                        let gap = gaps.as_ref().map_or(1.0, |g| g.sample(&mut rng));
                        tokio::time::sleep(Duration::from_secs_f64(gap)).await;
                    }
                }
                Arrival::Burst { every_s, count } => {
                    while start.elapsed() < stop {
                        for _ in 0..count {
                            inflight.push(fire(n, rng.random()));
                            n += 1;
                        }
                        tokio::time::sleep(Duration::from_secs_f64(every_s)).await;
                    }
                }
                Arrival::Closed { concurrency } => {
                    let clients = (0..concurrency).map(|c| {
                        let (to, tenant, records) = (to.clone(), tenant.clone(), records.clone());
                        tokio::spawn(async move {
                            let mut k = 0u64;
                            while start.elapsed() < stop {
                                let r =
                                    send(&to, &tenant, (c as u64) << 32 | k, k ^ c as u64, start)
                                        .await;
                                if r.status == 429 || r.status == 503 {
                                    tokio::time::sleep(Duration::from_millis(100)).await;
                                }
                                if let Ok(mut all) = records.lock() {
                                    all.push(r);
                                }
                                k += 1;
                            }
                        })
                    });
                    inflight.extend(clients);
                }
            }
            for task in inflight {
                let _ = task.await;
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
}

//! The flood-shape grid: flood shapes drawn at random from a seed, and the runner that measures
//! one against a stack — real Envoy with the built filter → a real weir sidecar (fair, or the
//! FIFO baseline on Envoy's `/alt/` route) → engines — for `tests/flood_grid.rs` (simulators)
//! and `tests/llama_grid.rs` (llama.cpp's server).
//!
//! The fairness guarantee is a property across shapes, not of one hand-picked scenario: while
//! flooding tenants ask far more than the pool holds, small tenants are served as they are
//! beside the flooders' fair share, and every refusal falls on a flooder. A shape
//! ([`Shape::draw`]):
//!
//! - 1–4 flooding tenants whose clients together keep 1–8× the pool's slots asking (the total
//!   split evenly over them), each with its own prompt (10–4,000 tokens) and answer (50–2,000
//!   tokens) lengths, log-uniform, the prompt clamped to what the engine's context leaves; each
//!   client streams one answer after another (bulk generation), and on a refusal waits its
//!   `Retry-After` as the OpenAI SDK does;
//! - 1–6 small tenants, each a Poisson stream (exponential gaps) of 0.5–8 requests/s
//!   (log-uniform) of short chats (prompt 10–200 tokens, answer 8–32), each request streamed or
//!   not at random;
//! - every tenant interactive or batch at random (its key's `policy.priority`), and each an org
//!   of its own: its own share of the pool.
//!
//! Each shape runs per policy in two phases ([`Phase`]): a baseline, where each flooder keeps
//! only its fair share of the pool in flight (so nothing queues), then the flood. The small
//! tenants' time to first token is compared between the two, per kind (a stream's first
//! content chunk, a plain request's whole answer), over the requests each sent within its
//! fair part of the slots ([`Shape::part`]): that is what the headroom rule keeps for a
//! tenant. A Poisson tenant sometimes runs more at once; such a burst past its part is its own
//! backlog and may wait for a slot to free (beside the flooders' fair share it borrows the
//! slots they leave idle, under the flood those are lent to the flood), so the report prints
//! all streams too, unchecked. The small tenants run on a thread of their own, so reading the
//! flood's streams never delays their clocks. For the diagnosis of a shape that fails, the
//! report also reads how long the sidecar itself held the small requests (its queue-wait and
//! TTFT histograms) and how far its adaptive limiter lowered the pool's concurrency.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::watch;
use weir_core::config::Priority;

use crate::{api_key, chat_body, has_content, metric_sum, p95, post_json, prompt_of, retry_after};

/// SplitMix64: a few lines, and the same draws for a seed on every platform and release (a
/// replayed seed must draw the same shapes and arrivals), where a crate's generator may change
/// its stream between versions.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream of its own for `label` (one shape's arrivals, say), so drawing more in one
    /// never shifts another.
    pub fn stream(seed: u64, label: &str) -> Rng {
        // FNV-1a of the label.
        let hash = label.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        Rng(seed ^ hash)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    pub fn int(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.unit() * f64::from(hi - lo + 1)) as u32
    }

    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + self.unit() * (hi - lo)
    }

    /// Log-uniform in [lo, hi]: every doubling as likely as the next, so short and long both
    /// come up.
    pub fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + self.unit() * (hi.ln() - lo.ln())).exp()
    }

    /// The gap to the next arrival of a Poisson process of `rate` per second, in seconds.
    pub fn gap(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate
    }

    pub fn coin(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }
}

/// The run's seed: `WEIR_SEED` if set, else drawn from the OS. Printed first, so any run can
/// be replayed.
pub fn seed() -> u64 {
    let seed = match std::env::var("WEIR_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("WEIR_SEED={text}: not a whole number")),
        Err(_) => {
            use std::io::Read;
            let mut bytes = [0u8; 8];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| f.read_exact(&mut bytes))
                .expect("read /dev/urandom");
            // Short enough to type.
            u64::from_le_bytes(bytes) % 1_000_000_000
        }
    };
    println!("seed {seed} (WEIR_SEED={seed} replays it)");
    seed
}

/// An engine's own metric names: sequences running and waiting inside it, and tokens generated.
#[derive(Clone, Copy, Debug)]
pub struct EngineMetrics {
    pub running: &'static str,
    pub waiting: &'static str,
    pub generated: &'static str,
}

pub const VLLM_METRICS: EngineMetrics = EngineMetrics {
    running: "vllm:num_requests_running",
    waiting: "vllm:num_requests_waiting",
    generated: "vllm:generation_tokens_total",
};

pub const SGLANG_METRICS: EngineMetrics = EngineMetrics {
    running: "sglang:num_running_reqs",
    waiting: "sglang:num_queue_reqs",
    generated: "sglang:generation_tokens_total",
};

pub const LLAMACPP_METRICS: EngineMetrics = EngineMetrics {
    running: "llamacpp:requests_processing",
    waiting: "llamacpp:requests_deferred",
    generated: "llamacpp:tokens_predicted_total",
};

/// A pool the grid runs on, as weir's sidecar sees it.
#[derive(Clone, Debug)]
pub struct Pool {
    /// What the report calls it (`llama.cpp-like, 2 × 4 slots`).
    pub label: String,
    /// The model it serves (its `pools[].model` in the sidecar).
    pub model: String,
    /// Requests weir runs on it at once: its replicas' concurrency limits summed.
    pub slots: u32,
    /// KV tokens over its replicas, as weir admits by them; 0 where the engines report none.
    pub kv_tokens: u64,
    /// Tokens of context a request may fill, prompt and answer (the filter's
    /// `max_context_tokens` for the model).
    pub context: u32,
    /// Each replica's base URL, for its `/metrics`.
    pub engines: Vec<String>,
    pub metrics: EngineMetrics,
}

impl Pool {
    /// A drawn prompt and answer within the context: the prompt is cut first (the answer's
    /// length is what makes a flood long), then the answer if need be.
    fn clamp(&self, prompt: u32, output: u32) -> (u32, u32) {
        let room = self.context - CONTEXT_MARGIN;
        let output = output.min(room - MIN_PROMPT);
        (prompt.min(room - output).max(MIN_PROMPT), output)
    }

    /// The sum of `name` over the replicas' `/metrics`.
    async fn engine_sum(&self, name: &str) -> f64 {
        let mut total = 0.0;
        for url in &self.engines {
            let text = reqwest::get(format!("{url}/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            total += metric_sum(&text, name)
                .unwrap_or_else(|| panic!("{name} missing from {url}/metrics"));
        }
        total
    }

    /// Waits (up to 15 s) until no replica runs or holds anything, then for the sidecars'
    /// probes (every 100 ms) to have seen it, so the next phase does not route on stale load.
    async fn wait_idle(&self) {
        for _ in 0..300 {
            let busy = self.engine_sum(self.metrics.running).await
                + self.engine_sum(self.metrics.waiting).await;
            if busy == 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The shortest prompt drawn, in tokens.
const MIN_PROMPT: u32 = 10;

/// Tokens of a request's context kept free of its drawn prompt and answer: the prompt's tag
/// and the chat's framing.
const CONTEXT_MARGIN: u32 = 64;

/// A flooding tenant: `clients` streams at a time, one after another, each of a `prompt`-token
/// prompt and an `output`-token answer.
#[derive(Clone, Debug)]
pub struct Flooder {
    pub key: String,
    pub priority: Priority,
    pub prompt: u32,
    pub output: u32,
    pub clients: u32,
}

/// A small tenant: Poisson arrivals at `rate` per second of short chats.
#[derive(Clone, Debug)]
pub struct Small {
    pub key: String,
    pub priority: Priority,
    pub rate: f64,
    pub prompt: u32,
    pub output: u32,
}

/// One flood shape on one pool.
#[derive(Clone, Debug)]
pub struct Shape {
    pub index: usize,
    /// Which of the run's pools it runs on.
    pub pool: usize,
    /// The flooders' clients together, over the pool's slots.
    pub load: f64,
    pub flooders: Vec<Flooder>,
    pub small: Vec<Small>,
}

impl Shape {
    /// Draws shape `index` for `pool` (the `pool_index`th of the run's); see the module's doc
    /// for the ranges.
    pub fn draw(rng: &mut Rng, index: usize, pool_index: usize, pool: &Pool) -> Shape {
        let priority = |rng: &mut Rng| {
            if rng.coin() {
                Priority::Batch
            } else {
                Priority::Interactive
            }
        };
        let flooders = rng.int(1, 4);
        let small = rng.int(1, 6);
        let load = rng.uniform(1.0, 8.0);
        let clients = (load * f64::from(pool.slots)).round() as u32;
        let flooders = (0..flooders)
            .map(|j| {
                let output = rng.log_uniform(50.0, 2_000.0).round() as u32;
                let prompt = rng.log_uniform(10.0, 4_000.0).round() as u32;
                let (prompt, output) = pool.clamp(prompt, output);
                Flooder {
                    key: format!("s{index}-flood-{j}"),
                    priority: priority(rng),
                    prompt,
                    output,
                    // An even split, the remainder to the first ones.
                    clients: clients / flooders + u32::from(j < clients % flooders),
                }
            })
            .collect();
        let small = (0..small)
            .map(|j| Small {
                key: format!("s{index}-small-{j}"),
                priority: priority(rng),
                rate: rng.log_uniform(0.5, 8.0),
                prompt: rng.log_uniform(10.0, 200.0).round() as u32,
                output: rng.int(8, 32),
            })
            .collect();
        Shape {
            index,
            pool: pool_index,
            load,
            flooders,
            small,
        }
    }

    /// Every tenant's key and priority.
    fn tenants(&self) -> impl Iterator<Item = (&str, Priority)> {
        let flood = self.flooders.iter().map(|f| (f.key.as_str(), f.priority));
        flood.chain(self.small.iter().map(|s| (s.key.as_str(), s.priority)))
    }

    /// A tenant's fair part of `pool`'s slots: split evenly over the shape's tenants (each an
    /// org of weight 1), at least one.
    pub fn part(&self, pool: &Pool) -> u32 {
        let tenants = (self.flooders.len() + self.small.len()) as u32;
        (pool.slots / tenants).max(1)
    }

    /// The requests `f` keeps in flight as its fair share of `pool` when weir runs `slots` on
    /// it: the slots and the pool's KV split evenly over the shape's tenants (each an org of
    /// weight 1: the headroom rule's fair part), at least one request (a share holding nothing
    /// always starts one).
    pub fn share_clients(&self, pool: &Pool, slots: u32, f: &Flooder) -> u32 {
        let tenants = (self.flooders.len() + self.small.len()) as u64;
        let by_slots = (u64::from(slots) / tenants).max(1);
        let by_kv = match pool.kv_tokens {
            0 => by_slots,
            kv => kv / tenants / u64::from(f.prompt + f.output),
        };
        by_slots.min(by_kv).max(1).min(u64::from(f.clients)) as u32
    }

    /// The shape's parameters, as the report's head.
    fn describe(&self, pool: &Pool) -> String {
        let clients: u32 = self.flooders.iter().map(|f| f.clients).sum();
        let rate: f64 = self.small.iter().map(|s| s.rate).sum();
        let mut out = format!(
            "flood: {} tenant(s), {:.1}x the {} slots = {clients} clients in all\n",
            self.flooders.len(),
            self.load,
            pool.slots
        );
        for f in &self.flooders {
            let _ = writeln!(
                out,
                "  {:<13} {:<11} {:>3} clients (fair share {:>2})  prompt {:>5}  answer {:>5} tokens",
                f.key,
                f.priority.as_str(),
                f.clients,
                self.share_clients(pool, pool.slots, f),
                f.prompt,
                f.output
            );
        }
        let _ = writeln!(
            out,
            "small: {} tenant(s), {rate:.1} requests/s in all",
            self.small.len()
        );
        for s in &self.small {
            let _ = writeln!(
                out,
                "  {:<13} {:<11} {:>5.2}/s  prompt {:>5}  answer {:>5} tokens, streamed or not at random",
                s.key,
                s.priority.as_str(),
                s.rate,
                s.prompt,
                s.output
            );
        }
        out
    }
}

/// The filter's config for `shapes` on `pools`: every tenant an org of its own with one key,
/// `key-{tenant}`, batch or interactive as drawn; every pool's model with its context.
pub fn weir_config(shapes: &[Shape], pools: &[Pool]) -> Value {
    let orgs: Vec<Value> = shapes
        .iter()
        .flat_map(Shape::tenants)
        .map(|(id, priority)| {
            let mut key = api_key(id);
            key["policy"] = json!({"priority": priority.as_str()});
            json!({"id": id, "workspaces": [{"id": "grid", "projects": [{"id": "grid", "keys": [key]}]}]})
        })
        .collect();
    let models: serde_json::Map<String, Value> = pools
        .iter()
        .map(|p| (p.model.clone(), json!({"max_context_tokens": p.context})))
        .collect();
    json!({"orgs": orgs, "models": models})
}

/// How long a request may wait in weir's queue before it is answered 503.
pub const DEADLINE_MS: u64 = 5_000;

/// A tenant stays active this long after its last request (the sidecar's default): the
/// headroom rule keeps its turn that long, well beyond the gaps of a small tenant at 0.5/s.
pub const ACTIVE_WINDOW_MS: u64 = 10_000;

/// A tenant may queue this many requests in weir; more are 429 `queue_full`.
pub const MAX_PER_TENANT: u64 = 32;

/// The sidecars' `queue` settings.
pub fn queue_config() -> Value {
    json!({"max_per_tenant": MAX_PER_TENANT, "deadline_ms": DEADLINE_MS,
           "active_window_ms": ACTIVE_WINDOW_MS})
}

/// The baseline's clock: the small tenants alone for half a second, then the flooders' fair
/// shares ramp up for a second before small requests count, for three and a half seconds.
pub const BASELINE: Timing = Timing {
    flood_start: Duration::from_millis(500),
    measure_from: Duration::from_millis(1_500),
    until: Duration::from_millis(5_000),
};

/// The flood's: the same start and ramp (the flood fills the pool at once, and its queue
/// within a second), then five and a half seconds counted.
pub const FLOOD: Timing = Timing {
    flood_start: Duration::from_millis(500),
    measure_from: Duration::from_millis(1_500),
    until: Duration::from_millis(7_000),
};

/// Small requests a counted window should hold, both kinds together: a p95 of about twenty of
/// each kind is the second slowest, not the slowest.
const SAMPLES: f64 = 40.0;

/// Longest the counted windows are stretched to for small tenants that arrive seldom.
const LONGEST_WINDOW: Duration = Duration::from_secs(8);

/// A TTFT p95 of a kind is compared only over at least this many samples in each phase: fewer,
/// and the "p95" is not a tail at all (of two samples it is the faster).
pub const MIN_SAMPLES: usize = 5;

impl Timing {
    /// This clock with its counted window stretched (up to [`LONGEST_WINDOW`]) so small tenants
    /// arriving at `rate` per second in all send about [`SAMPLES`] requests in it.
    fn stretched(self, rate: f64) -> Timing {
        let window = self.until - self.measure_from;
        let wanted = Duration::from_secs_f64(SAMPLES / rate);
        Timing {
            until: self.measure_from + wanted.clamp(window, LONGEST_WINDOW.max(window)),
            ..self
        }
    }
}

/// `count` shapes drawn from `seed`, spread over `pools` in turn.
///
/// `WEIR_SHAPES=1,7` keeps only those of the seed's shapes (drawn the same), to replay one
/// that failed.
pub fn draw_shapes(seed: u64, count: usize, pools: &[Pool]) -> Vec<Shape> {
    let mut rng = Rng::stream(seed, "shapes");
    let only: Option<Vec<usize>> = std::env::var("WEIR_SHAPES").ok().map(|list| {
        let index = |i: &str| {
            i.trim()
                .parse()
                .unwrap_or_else(|_| panic!("WEIR_SHAPES={list}"))
        };
        list.split(',').map(index).collect()
    });
    (0..count)
        .map(|i| Shape::draw(&mut rng, i, i % pools.len(), &pools[i % pools.len()]))
        .filter(|shape| only.as_ref().is_none_or(|only| only.contains(&shape.index)))
        .collect()
}

/// A sidecar as the grid reaches it: through Envoy, on the route in front of it.
#[derive(Clone, Copy, Debug)]
pub struct Route {
    pub policy: &'static str,
    pub prefix: &'static str,
}

/// The fair sidecar, on Envoy's main route.
pub const FAIR: Route = Route {
    policy: "fair",
    prefix: "",
};

/// The FIFO baseline, on Envoy's `/alt/` route.
pub const FIFO: Route = Route {
    policy: "fifo",
    prefix: "/alt",
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Each flooder keeps its fair share in flight ([`Shape::share_clients`]) of the slots weir
    /// runs on the pool as the phase starts (its adaptive limiter may have lowered them).
    Baseline,
    /// Each flooder runs all its clients.
    Flood,
}

/// A phase's clock, from its start. Small tenants come first: active, as in a running service,
/// when the flood arrives at `flood_start`. Small requests sent from `measure_from` until
/// `until` are counted; flooders run until the last of them is answered.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub flood_start: Duration,
    pub measure_from: Duration,
    pub until: Duration,
}

/// How one request ended.
#[derive(Clone, Debug)]
enum Outcome {
    /// 200 with content: seconds to the first content chunk (a stream) or to the whole answer
    /// (plain), to the response's headers (a stream's dispatch), and to its end.
    Served { ttft: f64, headers: f64, total: f64 },
    /// Turned away with a 429 or 503 (`"503 projected_wait"`) and the `Retry-After` it gave.
    Refused {
        code: String,
        retry_after: Option<u64>,
    },
    /// Anything else: another status, a broken stream, no content.
    Failed(String),
}

/// Sends one chat `body` to `url` as `key` and reads it to its end.
async fn ask(url: &str, key: &str, body: Value) -> Outcome {
    let stream = body["stream"] == true;
    let sent = Instant::now();
    let mut resp = post_json(url, Some(key), body.to_string(), &[]).await;
    let headers = sent.elapsed().as_secs_f64();
    let status = resp.status();
    if status != StatusCode::OK {
        let retry = resp
            .headers()
            .contains_key("retry-after")
            .then(|| retry_after(&resp));
        let text = resp.text().await.unwrap_or_default();
        return refusal(status, &text, retry);
    }
    if !stream {
        let text = resp.text().await.unwrap_or_default();
        let total = sent.elapsed().as_secs_f64();
        let answer: Value = serde_json::from_str(&text).unwrap_or_default();
        return match answer["choices"][0]["message"]["content"].as_str() {
            Some(content) if !content.is_empty() => Outcome::Served {
                ttft: total,
                headers,
                total,
            },
            _ => Outcome::Failed(format!("200 without content: {}", clip(&text))),
        };
    }
    // The start until the first content chunk, then only the last bytes (for `[DONE]`).
    let (mut head, mut tail, mut ttft) = (String::new(), Vec::new(), None);
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if ttft.is_none() {
                    head.push_str(&String::from_utf8_lossy(&chunk));
                    if crate::sse_events(&head).iter().any(has_content) {
                        ttft = Some(sent.elapsed().as_secs_f64());
                    }
                }
                tail.extend_from_slice(&chunk);
                tail.drain(..tail.len().saturating_sub(32));
            }
            Ok(None) => break,
            Err(e) => return Outcome::Failed(format!("stream broken: {e}")),
        }
    }
    let done = tail.ends_with(b"data: [DONE]\n\n");
    match ttft {
        Some(ttft) if done => Outcome::Served {
            ttft,
            headers,
            total: sent.elapsed().as_secs_f64(),
        },
        _ => Outcome::Failed(format!("stream without content or [DONE]: {}", clip(&head))),
    }
}

/// A non-200 answer: a refusal (429/503, named by its error code) or a failure.
fn refusal(status: StatusCode, text: &str, retry_after: Option<u64>) -> Outcome {
    let error: Value = serde_json::from_str(text).unwrap_or_default();
    let code = error["error"]["code"]
        .as_str()
        .or(error["error"]["type"].as_str());
    match (status.as_u16(), code) {
        (429 | 503, Some(code)) => Outcome::Refused {
            code: format!("{} {code}", status.as_u16()),
            retry_after,
        },
        _ => Outcome::Failed(format!("{status} {}", clip(text))),
    }
}

fn clip(text: &str) -> String {
    text.chars().take(160).collect()
}

/// What one tenant saw in a phase.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub sent: usize,
    pub served: usize,
    /// Refusals by status and error code (`"429 queue_full"`).
    pub refused: BTreeMap<String, usize>,
    pub failed: Vec<String>,
    /// Times to first token of the served requests.
    pub samples: Vec<Sample>,
    /// The longest a served stream waited for its response to start (its dispatch), in s.
    pub longest_wait: f64,
    /// The longest served stream, start to end, in s.
    pub longest_stream: f64,
    /// Seconds its served requests took, start to end, summed: over a window's length, how
    /// many it had in flight on average (Little's law).
    pub busy: f64,
}

/// A served request's time to first token, in seconds: a stream's first content chunk, a plain
/// request's whole answer.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub ttft: f64,
    pub stream: bool,
    /// Sent while its tenant's requests in flight, with it, were within its fair part of the
    /// slots ([`Shape::part`]): what the headroom rule keeps a tenant's service for. A request
    /// past the part is its tenant's own burst, which may wait for a slot to free.
    pub within: bool,
}

impl Tally {
    /// Times to first token of one kind (streams, or plain requests), of requests sent within
    /// their tenant's part if `within`, else of all.
    pub fn ttfts(&self, stream: bool, within: bool) -> Vec<f64> {
        self.samples
            .iter()
            .filter(|s| s.stream == stream && (s.within || !within))
            .map(|s| s.ttft)
            .collect()
    }

    fn add(&mut self, outcome: &Outcome, stream: bool, within: bool) {
        self.sent += 1;
        match outcome {
            Outcome::Served {
                ttft,
                headers,
                total,
            } => {
                self.served += 1;
                self.busy += total;
                self.samples.push(Sample {
                    ttft: *ttft,
                    stream,
                    within,
                });
                if stream {
                    self.longest_wait = self.longest_wait.max(*headers);
                    self.longest_stream = self.longest_stream.max(*total);
                }
            }
            Outcome::Refused { code, .. } => *self.refused.entry(code.clone()).or_default() += 1,
            Outcome::Failed(why) => self.failed.push(why.clone()),
        }
    }

    fn refusals(&self) -> usize {
        self.refused.values().sum()
    }

    /// Several tenants' tallies as one.
    fn merged<'a>(tallies: impl IntoIterator<Item = &'a Tally>) -> Tally {
        let mut all = Tally::default();
        for t in tallies {
            all.sent += t.sent;
            all.served += t.served;
            for (code, n) in &t.refused {
                *all.refused.entry(code.clone()).or_default() += n;
            }
            all.failed.extend(t.failed.iter().cloned());
            all.samples.extend(&t.samples);
            all.longest_wait = all.longest_wait.max(t.longest_wait);
            all.longest_stream = all.longest_stream.max(t.longest_stream);
            all.busy += t.busy;
        }
        all
    }
}

/// What a phase measured.
#[derive(Clone, Debug)]
pub struct PhaseResult {
    /// Per small tenant, its requests sent in the measured window.
    pub small: Vec<Tally>,
    /// All the small tenants' requests of the phase, by their wait in weir's queue, and their
    /// streams by their time to first token as weir saw it (queue and engine).
    pub small_queued: Latencies,
    pub small_weir_ttft: Latencies,
    /// Per flooder, every request it sent.
    pub flood: Vec<Tally>,
    /// The flooders' clients together.
    pub flood_clients: u32,
    /// Seconds the small requests were counted over.
    pub window: f64,
    pub engines: EngineWatch,
}

/// A small tenant's arrivals in a phase: a Poisson process from 0 (its first request at once:
/// it is active when the flood comes) until `until`, each request streamed or not at random.
fn arrivals(rng: &mut Rng, rate: f64, until: Duration) -> Vec<(Duration, bool)> {
    let mut at = 0.0;
    let mut out = Vec::new();
    while at < until.as_secs_f64() {
        out.push((Duration::from_secs_f64(at), rng.coin()));
        at += rng.gap(rate);
    }
    out
}

/// Runs a small tenant's `schedule` (each request at its time, whatever is still running):
/// the tally of the requests sent from `measure_from` on, each noting whether it was sent
/// within its tenant's fair `part` of the slots.
async fn small_tenant(
    url: &str,
    model: &str,
    small: &Small,
    schedule: Vec<(Duration, bool)>,
    (start, measure_from): (Instant, Duration),
    part: u32,
) -> Tally {
    let in_flight = Cell::new(0usize);
    let asks = schedule.into_iter().enumerate().map(|(n, (at, stream))| {
        let body = chat_body(
            model,
            &prompt_of(&format!("{} asks {n}", small.key), small.prompt),
            json!({"stream": stream, "max_tokens": small.output, "ignore_eos": true}),
        );
        let in_flight = &in_flight;
        async move {
            tokio::time::sleep_until((start + at).into()).await;
            in_flight.set(in_flight.get() + 1);
            let within = in_flight.get() <= part as usize;
            let outcome = ask(url, &small.key, body).await;
            in_flight.set(in_flight.get() - 1);
            (at >= measure_from, stream, within, outcome)
        }
    });
    let mut tally = Tally::default();
    for (counted, stream, within, outcome) in join_all(asks).await {
        if counted {
            tally.add(&outcome, stream, within);
        }
    }
    tally
}

/// Runs the small tenants' `schedules` on a thread and runtime of their own, so that reading
/// the flood's thousands of chunks a second on the test's runtime never delays the moment a
/// small request's first token is seen; their tallies come back on the returned channel.
fn small_tenants_apart(
    url: String,
    model: String,
    small: Vec<Small>,
    schedules: Vec<Vec<(Duration, bool)>>,
    clock: (Instant, Duration),
    part: u32,
) -> tokio::sync::oneshot::Receiver<Vec<Tally>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let asks = small
            .iter()
            .zip(schedules)
            .map(|(s, schedule)| small_tenant(&url, &model, s, schedule, clock, part));
        let _ = tx.send(runtime.block_on(join_all(asks)));
    });
    rx
}

/// A flooder's `clients`, from `flood_start` until `stop`: each streams one answer after
/// another, waits a refusal's `Retry-After` (as the OpenAI SDK does) and 100 ms after a
/// failure. Streams still running at `stop` are dropped (the sidecar cancels them).
async fn flooder(
    url: &str,
    model: &str,
    f: &Flooder,
    clients: u32,
    from: Instant,
    stop: watch::Receiver<bool>,
) -> Tally {
    let tally = RefCell::new(Tally::default());
    let client = |c: u32| {
        let (tally, mut stop) = (&tally, stop.clone());
        async move {
            let work = async {
                tokio::time::sleep_until(from.into()).await;
                for n in 0.. {
                    let body = chat_body(
                        model,
                        &prompt_of(&format!("{} bulk {c}.{n}", f.key), f.prompt),
                        json!({"stream": true, "max_tokens": f.output, "ignore_eos": true}),
                    );
                    let outcome = ask(url, &f.key, body).await;
                    tally.borrow_mut().add(&outcome, true, false);
                    let pause = match outcome {
                        Outcome::Refused { retry_after, .. } => {
                            Duration::from_secs(retry_after.unwrap_or(1))
                        }
                        Outcome::Failed(_) => Duration::from_millis(100),
                        Outcome::Served { .. } => Duration::ZERO,
                    };
                    tokio::time::sleep(pause).await;
                }
            };
            tokio::select! {
                _ = stop.wait_for(|s| *s) => {}
                () = work => {}
            }
        }
    };
    join_all((0..clients).map(client)).await;
    tally.into_inner()
}

/// What a phase saw of the engines, polled every 100 ms until its end.
#[derive(Clone, Copy, Debug)]
pub struct EngineWatch {
    /// Most sequences the engines ran at once, and most waiting inside them.
    pub peak_running: f64,
    pub peak_waiting: f64,
    /// The fewest requests the sidecar would run on the pool at once: its replicas'
    /// concurrency limits summed, as its adaptive limiter lowers them when engines are slow to
    /// start requests.
    pub least_limit: f64,
    /// Tokens the engines generated per second from `measure_from` to `until` (or to the end,
    /// if it comes first). Some engines count a request's tokens as it ends, so this is over
    /// whole seconds of answers ending, not token by token.
    pub tokens_per_s: f64,
}

/// The sum of the sidecar's `weir_replica_concurrency_limit` over `pool`'s replicas.
async fn weir_limit(admin: &str, pool: &Pool) -> f64 {
    let text = reqwest::get(format!("{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    pool.engines
        .iter()
        .filter_map(|url| {
            let series = format!("weir_replica_concurrency_limit{{replica=\"{url}\"}}");
            metric_sum(&text, &series)
        })
        .sum()
}

/// Watches the engines (and the sidecar at `admin`) through a phase, until `stop`.
async fn watch_engines(
    pool: &Pool,
    admin: &str,
    start: Instant,
    timing: Timing,
    stop: watch::Receiver<bool>,
) -> EngineWatch {
    let generated = || async {
        (
            Instant::now(),
            pool.engine_sum(pool.metrics.generated).await,
        )
    };
    let (mut running, mut waiting, mut limit) = (0.0f64, 0.0f64, f64::INFINITY);
    let (mut from, mut to) = (None, None);
    while !*stop.borrow() {
        running = running.max(pool.engine_sum(pool.metrics.running).await);
        waiting = waiting.max(pool.engine_sum(pool.metrics.waiting).await);
        limit = limit.min(weir_limit(admin, pool).await);
        let elapsed = start.elapsed();
        if from.is_none() && elapsed >= timing.measure_from {
            from = Some(generated().await);
        }
        if to.is_none() && elapsed >= timing.until {
            to = Some(generated().await);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let tokens_per_s = match (from, to.or(Some(generated().await))) {
        (Some((t0, from)), Some((t1, to))) => (to - from) / (t1 - t0).as_secs_f64(),
        _ => 0.0,
    };
    EngineWatch {
        peak_running: running,
        peak_waiting: waiting,
        least_limit: limit,
        tokens_per_s,
    }
}

/// The small tenants' requests as one of the sidecar's latency histograms counts them: in all,
/// and within 25 and 100 ms. `weir_queue_wait_seconds` (arrival to dispatch) is what the
/// scheduler made them wait; `weir_ttft_seconds` (a stream's arrival to its first chunk) adds
/// the engine's time, so the two tell weir's queue from the engine's.
#[derive(Clone, Copy, Debug, Default)]
pub struct Latencies {
    pub all: f64,
    pub within_25ms: f64,
    pub within_100ms: f64,
}

/// The histograms [`Latencies`] reads.
const QUEUE_WAIT: &str = "weir_queue_wait_seconds_bucket{";
const WEIR_TTFT: &str = "weir_ttft_seconds_bucket{";

impl Latencies {
    /// What `histogram` counts of the small tenants (`keys`) on the sidecar whose admin address
    /// is `admin`, so far.
    async fn read(admin: &str, histogram: &str, keys: &[&str]) -> Latencies {
        let text = reqwest::get(format!("{admin}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let mut waits = Latencies::default();
        for line in text.lines() {
            let Some((labels, count)) = line
                .strip_prefix(histogram)
                .and_then(|rest| rest.split_once("} "))
            else {
                continue;
            };
            let label = |name: &str| {
                labels
                    .split(',')
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix("=\"")?.strip_suffix('"'))
            };
            if !label("tenant").is_some_and(|t| keys.contains(&t)) {
                continue;
            }
            let count: f64 = count.trim().parse().unwrap_or(0.0);
            match label("le") {
                Some("+Inf") => waits.all += count,
                Some("0.025") => waits.within_25ms += count,
                Some("0.1") => waits.within_100ms += count,
                _ => {}
            }
        }
        waits
    }

    fn since(self, before: Latencies) -> Latencies {
        Latencies {
            all: self.all - before.all,
            within_25ms: self.within_25ms - before.within_25ms,
            within_100ms: self.within_100ms - before.within_100ms,
        }
    }

    /// `3 / 1 of 60`: past 25 ms, past 100 ms, of all.
    fn cell(self) -> String {
        format!(
            "{:.0} / {:.0} of {:.0}",
            self.all - self.within_25ms,
            self.all - self.within_100ms,
            self.all
        )
    }
}

/// Runs one phase of `shape` through Envoy at `envoy` on `lane`'s route. Arrivals are drawn
/// from `seed`, the same for either route.
pub async fn run_phase(
    envoy: &str,
    lane: &Lane,
    pool: &Pool,
    shape: &Shape,
    phase: Phase,
    timing: Timing,
    seed: u64,
) -> PhaseResult {
    let url = format!("{envoy}{}/v1/chat/completions", lane.route.prefix);
    let keys: Vec<&str> = shape.small.iter().map(|s| s.key.as_str()).collect();
    let read = |histogram| Latencies::read(&lane.admin, histogram, &keys);
    let before = [read(QUEUE_WAIT).await, read(WEIR_TTFT).await];
    let mut rng = Rng::stream(seed, &format!("shape {} {phase:?} arrivals", shape.index));
    let schedules: Vec<_> = shape
        .small
        .iter()
        .map(|s| arrivals(&mut rng, s.rate, timing.until))
        .collect();
    let slots = (weir_limit(&lane.admin, pool).await as u32).min(pool.slots);
    let clients: Vec<u32> = shape
        .flooders
        .iter()
        .map(|f| match phase {
            Phase::Baseline => shape.share_clients(pool, slots, f),
            Phase::Flood => f.clients,
        })
        .collect();
    let start = Instant::now();
    let (stop_tx, stop) = watch::channel(false);
    let small = async {
        let tallies = small_tenants_apart(
            url.clone(),
            pool.model.clone(),
            shape.small.clone(),
            schedules,
            (start, timing.measure_from),
            shape.part(pool),
        )
        .await
        .expect("the small tenants' thread ends with their tallies");
        let _ = stop_tx.send(true);
        tallies
    };
    let flood = join_all(shape.flooders.iter().zip(&clients).map(|(f, &clients)| {
        let from = start + timing.flood_start;
        flooder(&url, &pool.model, f, clients, from, stop.clone())
    }));
    let engines = watch_engines(pool, &lane.admin, start, timing, stop.clone());
    let (small, flood, engines) = tokio::join!(small, flood, engines);
    pool.wait_idle().await;
    PhaseResult {
        small,
        small_queued: read(QUEUE_WAIT).await.since(before[0]),
        small_weir_ttft: read(WEIR_TTFT).await.since(before[1]),
        flood,
        flood_clients: clients.iter().sum(),
        window: (timing.until - timing.measure_from).as_secs_f64(),
        engines,
    }
}

/// One policy's two phases of a shape.
#[derive(Clone, Debug)]
pub struct PolicyRun {
    pub route: Route,
    pub baseline: PhaseResult,
    pub flood: PhaseResult,
}

/// A sidecar as the grid uses it: its route through Envoy, its admin address (metrics), and
/// when the grid last sent it anything.
#[derive(Clone, Debug)]
pub struct Lane {
    pub route: Route,
    pub admin: String,
    pub last_used: Option<Instant>,
}

impl Lane {
    pub fn new(route: Route, sidecar: &crate::Sidecar) -> Self {
        Lane {
            route,
            admin: sidecar.admin.clone(),
            last_used: None,
        }
    }
}

/// Everything one shape measured.
#[derive(Clone, Debug)]
pub struct ShapeRun {
    pub shape: Shape,
    pub runs: Vec<PolicyRun>,
}

/// Runs `shape` on each sidecar's lane in turn (the fair one first): its baseline, then its
/// flood. A sidecar gets a shape only once the last shape's tenants there are no longer active
/// (`active_window` after its last request), so no stale tenant holds a share of the pool.
pub async fn run_shape(
    envoy: &str,
    lanes: &mut [Lane],
    pool: &Pool,
    shape: &Shape,
    timing: [Timing; 2],
    seed: u64,
    active_window: Duration,
) -> ShapeRun {
    let mut runs = Vec::new();
    for lane in lanes.iter_mut() {
        if let Some(last) = lane.last_used {
            tokio::time::sleep_until((last + active_window).into()).await;
        }
        let baseline = run_phase(envoy, lane, pool, shape, Phase::Baseline, timing[0], seed).await;
        let flood = run_phase(envoy, lane, pool, shape, Phase::Flood, timing[1], seed).await;
        lane.last_used = Some(Instant::now());
        runs.push(PolicyRun {
            route: lane.route,
            baseline,
            flood,
        });
    }
    ShapeRun {
        shape: shape.clone(),
        runs,
    }
}

/// Runs every shape, one after another, through `envoy` to the `fair` sidecar (its main route)
/// and the `fifo` one (`/alt/`), printing each shape's figures as it ends and a summary at the
/// end.
pub async fn run_grid(
    envoy: &crate::Envoy,
    [fair, fifo]: [&crate::Sidecar; 2],
    pools: &[Pool],
    shapes: &[Shape],
    seed: u64,
) -> Vec<ShapeRun> {
    let mut lanes = [Lane::new(FAIR, fair), Lane::new(FIFO, fifo)];
    let window = Duration::from_millis(ACTIVE_WINDOW_MS);
    let mut runs = Vec::new();
    for shape in shapes {
        let pool = &pools[shape.pool];
        let rate = shape.small.iter().map(|s| s.rate).sum();
        let timing = [BASELINE.stretched(rate), FLOOD.stretched(rate)];
        let run = run_shape(&envoy.url, &mut lanes, pool, shape, timing, seed, window).await;
        println!("{}", run.report(pool, seed));
        runs.push(run);
    }
    println!("{}", summary(&runs, pools, seed));
    runs
}

/// A p95 in ms with its sample count, or `-` without samples.
fn p95_ms(xs: &[f64]) -> Option<f64> {
    (!xs.is_empty()).then(|| p95(xs.to_vec()) * 1e3)
}

/// `refused` as `503 projected_wait 3, 429 queue_full 1`, or `-`.
fn codes(refused: &BTreeMap<String, usize>) -> String {
    if refused.is_empty() {
        return "-".into();
    }
    let parts: Vec<String> = refused.iter().map(|(c, n)| format!("{c} {n}")).collect();
    parts.join(", ")
}

/// A kind's TTFT p95 in one phase (`12.3 ms (n 40)`), and against the baseline's under the
/// flood (`12.3 ms (n 40) 1.05x`).
fn ttft_cell(xs: &[f64], baseline: Option<&[f64]>) -> String {
    let Some(p) = p95_ms(xs) else {
        return "-".into();
    };
    let mut cell = format!("{p:.1} ms (n {})", xs.len());
    if let Some(base) = baseline.and_then(p95_ms) {
        let _ = write!(cell, " {:.2}x", p / base);
    }
    cell
}

impl ShapeRun {
    /// Every figure of the shape, per policy and phase, as a block of lines: the small
    /// tenants' service and TTFT p95 by kind (under the flood, against the baseline's; streams
    /// also of requests sent while their tenant had nothing else in flight), how many waited in
    /// weir's queue and to their first chunk as weir saw it, the refusals of
    /// small tenants and flooders by code, the flooders' longest wait for a stream to start,
    /// the engines' peaks (running, waiting inside them), the least of weir's concurrency limit
    /// over the pool, and the pool's output tokens per second.
    pub fn report(&self, pool: &Pool, seed: u64) -> String {
        let shape = &self.shape;
        let mut out = format!(
            "── shape {} on {} (seed {seed}) ──\n{}",
            shape.index,
            pool.label,
            shape.describe(pool)
        );
        let _ = writeln!(
            out,
            "{:<4} {:<8} | {:>15} | {:<25} | {:<25} | {:<25} | {:<17} | {:<17} | {:<13} | {:>17} | {:<38} | {:>8} | {:>14} | {:>6}",
            "",
            "phase",
            "small served",
            "TTFT p95 stream",
            "stream, within its part",
            "plain, within its part",
            "queued >25/>100ms",
            "weir TTFT >25/100",
            "small refused",
            "flood s/sent (clients)",
            "flood refused",
            "flood wait",
            "run/wait/limit",
            "tok/s"
        );
        for run in &self.runs {
            let base = Tally::merged(&run.baseline.small);
            for (phase, result) in [("baseline", &run.baseline), ("flood", &run.flood)] {
                let small = Tally::merged(&result.small);
                let flood = Tally::merged(&result.flood);
                let cell = |stream: bool, within: bool| {
                    let against = base.ttfts(stream, within);
                    ttft_cell(
                        &small.ttfts(stream, within),
                        (phase == "flood").then_some(against.as_slice()),
                    )
                };
                let _ = writeln!(
                    out,
                    "{:<4} {:<8} | {:>5}/{:<5} {:>4.0}% | {:<25} | {:<25} | {:<25} | {:<17} | {:<17} | {:<13} | {:>5}/{:<5} ({:>3}) | {:<38} | {:>6.2} s | {:>4}/{:>3}/{:<5} | {:>6.0}",
                    run.route.policy,
                    phase,
                    small.served,
                    small.sent,
                    percent(small.served, small.sent),
                    cell(true, false),
                    cell(true, true),
                    cell(false, true),
                    result.small_queued.cell(),
                    result.small_weir_ttft.cell(),
                    codes(&small.refused),
                    flood.served,
                    flood.sent,
                    result.flood_clients,
                    codes(&flood.refused),
                    flood.longest_wait,
                    result.engines.peak_running,
                    result.engines.peak_waiting,
                    result.engines.least_limit,
                    result.engines.tokens_per_s,
                );
                for failed in small.failed.iter().chain(&flood.failed).take(3) {
                    let _ = writeln!(out, "     failed: {failed}");
                }
            }
        }
        if let Some(fair) = self.fair() {
            out.push_str(&self.small_loads(pool, &fair.baseline));
        }
        out
    }

    /// Each small tenant's requests in flight on average beside the flooders' fair share, against
    /// its fair part of the slots: a tenant past its part has a backlog of its own, which the
    /// scheduler may make wait and refuse.
    fn small_loads(&self, pool: &Pool, baseline: &PhaseResult) -> String {
        let part = self.shape.part(pool);
        let loads: Vec<String> = self
            .shape
            .small
            .iter()
            .zip(&baseline.small)
            .map(|(s, tally)| {
                let load = tally.busy / baseline.window;
                let over = if load > f64::from(part) {
                    " (over)"
                } else {
                    ""
                };
                format!("{} {load:.2}{over}", s.key)
            })
            .collect();
        format!(
            "small tenants' requests in flight on average at the fair baseline, against a fair part of {part} slot(s) each: {}\n",
            loads.join(", ")
        )
    }

    /// The fair policy's run.
    fn fair(&self) -> Option<&PolicyRun> {
        self.runs.iter().find(|r| r.route.policy == FAIR.policy)
    }

    /// What the fair policy did not keep in this shape, each naming the seed: a small tenant
    /// refused (every refusal must fall on a flooder), or the small tenants' TTFT p95 of a kind,
    /// within their parts, under the flood past twice its baseline (over [`MIN_SAMPLES`] or
    /// more in each phase).
    pub fn fair_failures(&self, pool: &Pool, seed: u64) -> Vec<String> {
        let Some(run) = self.fair() else {
            return Vec::new();
        };
        let at = format!("seed {seed}, shape {} on {}", self.shape.index, pool.label);
        let mut failures = Vec::new();
        for (phase, result) in [("baseline", &run.baseline), ("flood", &run.flood)] {
            for (s, tally) in self.shape.small.iter().zip(&result.small) {
                if !tally.refused.is_empty() {
                    failures.push(format!(
                        "{at}: fair {phase}: small tenant {} ({}, {:.2}/s) refused: {}",
                        s.key,
                        s.priority.as_str(),
                        s.rate,
                        codes(&tally.refused)
                    ));
                }
            }
        }
        let (base, flood) = (
            Tally::merged(&run.baseline.small),
            Tally::merged(&run.flood.small),
        );
        for (kind, stream) in [("stream", true), ("plain", false)] {
            let (b, f) = (&base.ttfts(stream, true), &flood.ttfts(stream, true));
            if b.len().min(f.len()) < MIN_SAMPLES {
                println!(
                    "{at}: {kind} TTFT not checked: {} baseline and {} flood samples within the parts (fewer than {MIN_SAMPLES})",
                    b.len(),
                    f.len()
                );
                continue;
            }
            if let (Some(b), Some(f)) = (p95_ms(b), p95_ms(f))
                && f > 2.0 * b
            {
                failures.push(format!(
                    "{at}: fair: small tenants' TTFT p95 ({kind}, within their parts) {b:.1} ms beside the flooders' fair share -> {f:.1} ms under the flood ({:.2}x, at most 2x)",
                    f / b
                ));
            }
        }
        failures
    }

    /// Whether the shape measured what it claims, per policy, each naming the seed: the
    /// baseline queued nothing (flooders' streams started within a second) and the flood
    /// saturated the pool (a flooder's stream waited a second or more, or was refused, or the
    /// engines ran every slot).
    pub fn premise_failures(&self, pool: &Pool, seed: u64) -> Vec<String> {
        let at = format!("seed {seed}, shape {} on {}", self.shape.index, pool.label);
        let mut failures = Vec::new();
        for run in &self.runs {
            let policy = run.route.policy;
            let baseline = Tally::merged(&run.baseline.flood);
            if baseline.longest_wait >= 1.0 {
                failures.push(format!(
                    "{at}: {policy} baseline: a flooder's stream waited {:.2} s at its fair share (a queue formed)",
                    baseline.longest_wait
                ));
            }
        }
        // The flood saturates the pool under one policy at least: under the fair one, weir's
        // headroom may keep the engines below full and the flooders' waits short (a flood of
        // 1.1x the slots), which is the policy working, not a shape that floods nothing.
        let saturated = |run: &PolicyRun| {
            let flood = Tally::merged(&run.flood.flood);
            let full = run.flood.engines.peak_running >= f64::from(pool.slots);
            flood.longest_wait >= 1.0 || flood.refusals() > 0 || full
        };
        if !self.runs.iter().any(saturated) {
            let seen: Vec<String> = (self.runs.iter())
                .map(|run| {
                    let flood = Tally::merged(&run.flood.flood);
                    format!(
                        "{}: longest wait {:.2} s, engines ran {} of {} slots",
                        run.route.policy,
                        flood.longest_wait,
                        run.flood.engines.peak_running,
                        pool.slots
                    )
                })
                .collect();
            failures.push(format!(
                "{at}: no flooder's stream waited a second or was refused, and the engines never ran full under any policy: the pool was not saturated ({})",
                seen.join("; ")
            ));
        }
        failures
    }
}

/// `part` of `whole` in percent (100 when there is nothing to count).
pub fn percent(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        100.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

/// The small tenants' requests served and sent under the fair policy's floods, over `runs`.
pub fn fair_flood_service(runs: &[ShapeRun]) -> (usize, usize) {
    runs.iter()
        .filter_map(ShapeRun::fair)
        .flat_map(|r| &r.flood.small)
        .fold((0, 0), |(served, sent), t| {
            (served + t.served, sent + t.sent)
        })
}

/// One line per shape: the fair policy's figures beside FIFO's — small requests served under
/// the flood, TTFT p95 under the flood over the baseline's (streams; streams sent within their
/// tenant's part; plain requests within it), small refusals.
pub fn summary(runs: &[ShapeRun], pools: &[Pool], seed: u64) -> String {
    let mut out = format!(
        "── summary (seed {seed}) ──\n{:<5} {:<38} | {:<56} | {:<56}\n",
        "shape",
        "pool",
        "fair: served, TTFT p95 x stream (within) / plain, refused",
        "fifo: the same"
    );
    for run in runs {
        let _ = write!(
            out,
            "{:<5} {:<38}",
            run.shape.index, pools[run.shape.pool].label
        );
        for policy in &run.runs {
            let (base, flood) = (
                Tally::merged(&policy.baseline.small),
                Tally::merged(&policy.flood.small),
            );
            let ratio = |stream: bool, within: bool| {
                let b = base.ttfts(stream, within);
                match (p95_ms(&b), p95_ms(&flood.ttfts(stream, within))) {
                    (Some(b), Some(f)) => format!("{:.2}x", f / b),
                    _ => "-".into(),
                }
            };
            let _ = write!(
                out,
                " | {:>5.1}% of {:<4} {:>8} ({:>8}) / {:<8} refused {:<4}",
                percent(flood.served, flood.sent),
                flood.sent,
                ratio(true, false),
                ratio(true, true),
                ratio(false, true),
                flood.refusals()
            );
        }
        out.push('\n');
    }
    out
}

/// The grid's verdict over `runs`: every shape's premise held, and under the fair policy no
/// small tenant was refused, their TTFT p95 within their parts stayed within twice the
/// baseline's per kind ([`ShapeRun::fair_failures`]), and at least 99% of their requests under the floods were
/// served. Every failure names the seed; on failure the fair sidecar's rejections (by reason
/// and tenant) are printed first, for the diagnosis.
pub async fn assert_fair(runs: &[ShapeRun], pools: &[Pool], seed: u64, fair: &crate::Sidecar) {
    let pool = |r: &ShapeRun| &pools[r.shape.pool];
    let mut failures: Vec<String> = runs
        .iter()
        .flat_map(|r| r.premise_failures(pool(r), seed))
        .collect();
    failures.extend(runs.iter().flat_map(|r| r.fair_failures(pool(r), seed)));
    let (served, sent) = fair_flood_service(runs);
    let share = percent(served, sent);
    println!(
        "fair: small tenants served {served} of {sent} requests under the floods ({share:.2}%)"
    );
    if share < 99.0 {
        failures.push(format!(
            "seed {seed}: fair: small tenants served {served} of {sent} requests under the floods ({share:.2}%, at least 99%)"
        ));
    }
    if !failures.is_empty() {
        let metrics = fair.metrics().await;
        let rejections: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("weir_rejections_total"))
            .collect();
        println!("the fair sidecar's rejections:\n{}", rejections.join("\n"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

//! The fairness guarantee as a property across random flood shapes ([`weir_e2e::grid`]), on
//! simulated engines: real Envoy with the built filter → the real sidecar (fair; the FIFO
//! baseline on `/alt/`, for contrast) → three pools of two `weir-sim` replicas each — a
//! llama.cpp-like one with few slots and no KV figures, a vLLM-like one bound by its KV cache,
//! an SGLang-like one with room to spare — each shape on one pool, in turn.
//!
//! The engines are time-scaled so a long flood answer streams for seconds, as on real engines
//! (a pool whose streams end in a fraction of a second never stays saturated), while a short
//! chat is answered in tens of milliseconds. Each shape checks that premise: its flood queued,
//! was refused or ran every slot, and its baseline queued nothing.
//!
//! Under the fair policy, across all shapes, small tenants get at least 99% of their requests
//! served through the floods, none refused (the flooders absorb every refusal), and their time
//! to first token p95, per kind, of the requests each sent within its fair part of the slots,
//! within twice what it was beside the flooders' fair share.
//! FIFO's figures are printed for contrast only. `WEIR_SEED=N` replays a run's shapes and
//! arrivals; `cargo test -p weir-e2e --test flood_grid -- --nocapture` prints every figure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use serde_json::{Value, json};
use weir_e2e::grid::{self, EngineMetrics, LLAMACPP_METRICS, Pool, SGLANG_METRICS, VLLM_METRICS};
use weir_e2e::{Envoy, Sidecar, Sim};

/// Shapes per run, spread over the pools in turn.
const SHAPES: usize = 8;

/// Replicas per pool.
const REPLICAS: usize = 2;

/// One pool's engine: what its replicas run and what weir sees of each.
struct Preset {
    label: &'static str,
    model: &'static str,
    /// `weir-sim`'s arguments, but for the served model's name.
    args: &'static [&'static str],
    /// Sequences a replica runs at once.
    slots: u32,
    /// KV tokens a replica reports (0: none), as `weir-sim` prints them at start.
    kv_tokens: u64,
    /// Tokens of context per request: llama.cpp's slot, else what the filter allows.
    context: u32,
    metrics: EngineMetrics,
    /// vLLM does not report its `--max-num-seqs`: the sidecar is told.
    configured_limit: bool,
}

/// The `tiny` preset decodes a token in about 10.5 ms of model time: at four times real speed a
/// 2,000-token answer streams for about 5 s, a 16-token chat for some 40 ms. The 8B preset at
/// twice real speed: 3 to 5 ms a token as its batch fills.
const PRESETS: [Preset; 3] = [
    Preset {
        label: "llama.cpp-like, tiny, 2 x 4 slots",
        model: "grid-llamacpp",
        args: &[
            "--preset",
            "tiny",
            "--metrics-dialect",
            "llamacpp",
            "--slots",
            "4",
            "--time-scale",
            "4",
        ],
        slots: 4,
        kv_tokens: 0,
        // The tiny preset's 9,760 KV tokens over 4 slots, in whole 16-token blocks.
        context: 2_432,
        metrics: LLAMACPP_METRICS,
        configured_limit: false,
    },
    Preset {
        label: "vLLM-like, tiny, 2 x 8 seqs, KV-bound",
        model: "grid-vllm",
        args: &[
            "--preset",
            "tiny",
            "--max-num-seqs",
            "8",
            "--time-scale",
            "4",
        ],
        slots: 8,
        kv_tokens: 9_760,
        context: 4_096,
        metrics: VLLM_METRICS,
        configured_limit: true,
    },
    Preset {
        label: "SGLang-like, 8B, 2 x 6 seqs",
        model: "grid-sglang",
        args: &[
            "--preset",
            "llama-3.1-8b",
            "--metrics-dialect",
            "sglang",
            "--max-num-seqs",
            "6",
            "--time-scale",
            "2",
        ],
        slots: 6,
        kv_tokens: 381_456,
        context: 8_192,
        metrics: SGLANG_METRICS,
        configured_limit: false,
    },
];

/// Starts a preset's replicas; returns them and their pool.
fn start_pool(preset: &Preset) -> (Vec<Sim>, Pool) {
    let args = [preset.args, &["--served-model-name", preset.model]].concat();
    let sims: Vec<Sim> = (0..REPLICAS).map(|_| Sim::start(&args)).collect();
    let pool = Pool {
        label: preset.label.into(),
        model: preset.model.into(),
        slots: preset.slots * REPLICAS as u32,
        kv_tokens: preset.kv_tokens * REPLICAS as u64,
        context: preset.context,
        engines: sims.iter().map(|s| s.url.clone()).collect(),
        metrics: preset.metrics,
    };
    (sims, pool)
}

/// A sidecar's config for `policy` over the pools.
fn sidecar_config(policy: &str, pools: &[Pool]) -> Value {
    let pools: Vec<Value> = PRESETS
        .iter()
        .zip(pools)
        .map(|(preset, pool)| {
            let mut entry = json!({"model": pool.model, "replicas": pool.engines});
            if preset.configured_limit {
                entry["max_concurrency_per_replica"] = preset.slots.into();
            }
            entry
        })
        .collect();
    json!({"policy": policy, "queue": grid::queue_config(), "pools": pools})
}

#[tokio::test]
async fn small_tenants_keep_their_service_through_random_floods() {
    let seed = grid::seed();
    let (_sims, pools): (Vec<Vec<Sim>>, Vec<Pool>) = PRESETS.iter().map(start_pool).unzip();
    let shapes = grid::draw_shapes(seed, SHAPES, &pools);
    let fair = Sidecar::start(sidecar_config("fair", &pools));
    let fifo = Sidecar::start(sidecar_config("fifo", &pools));
    let envoy = Envoy::start(&grid::weir_config(&shapes, &pools), fair.port, fifo.port);
    fair.wait_for_probes(pools.len() * REPLICAS);
    fifo.wait_for_probes(pools.len() * REPLICAS);

    let runs = grid::run_grid(&envoy, [&fair, &fifo], &pools, &shapes, seed).await;
    grid::assert_fair(&runs, &pools, seed, &fair).await;
}

//! The flood-shape grid ([`weir_e2e::grid`]) on real engines: real Envoy with the built filter →
//! the real sidecar (fair; the FIFO baseline on `/alt/`, for contrast) → two llama.cpp
//! `llama-server` replicas of 4 slots of 2,048 tokens, serving the tiny random-weight model
//! (`tests/llama.rs` builds the server on first use). Prompts and answers are clamped to the
//! slot's context.
//!
//! The same property as `tests/flood_grid.rs`, on fewer shapes (a real engine's time cannot be
//! scaled): under the fair policy small tenants get at least 99% of their requests served
//! through the floods, none refused, and their time to first token p95, per kind, of the
//! requests each sent within its fair part of the slots, within twice what it was beside the
//! flooders' fair share. `WEIR_SEED=N` replays a run's shapes and
//! arrivals; `cargo test -p weir-e2e --test llama_grid -- --nocapture` prints every figure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use serde_json::json;
use weir_e2e::grid::{self, LLAMACPP_METRICS, Pool};
use weir_e2e::llama::{LlamaServer, MODEL};
use weir_e2e::{Envoy, Sidecar};

/// Shapes per run.
const SHAPES: usize = 4;

const SLOTS: u32 = 4;

/// Tokens of context per slot.
const CONTEXT: u32 = 2_048;

#[tokio::test]
// Not in `cargo xtask test`: every small request is served and every refusal falls on a
// flooder, but on two shared cores the TTFT ratio is the machine's noise, not weir's: the
// engines decode on the CPU beside Envoy, both sidecars and the clients, and one shape measured
// 2.18x and then 0.73x on consecutive runs (sidecar/README.md, "Fair under any flood").
// Run with `-- --ignored`.
#[ignore = "real llama.cpp's TTFT p95 on two shared cores is noise-bound (issue 26)"]
async fn small_tenants_keep_their_service_through_random_floods_on_llama_cpp() {
    let seed = grid::seed();
    let engines = [
        LlamaServer::start(SLOTS, CONTEXT),
        LlamaServer::start(SLOTS, CONTEXT),
    ];
    let pool = Pool {
        label: format!("llama.cpp, 2 x {SLOTS} slots"),
        model: MODEL.into(),
        slots: 2 * SLOTS,
        kv_tokens: 0,
        context: CONTEXT,
        engines: engines.iter().map(|e| e.url.clone()).collect(),
        metrics: LLAMACPP_METRICS,
    };
    let pools = [pool];
    let shapes = grid::draw_shapes(seed, SHAPES, &pools);
    let config = |policy: &str| {
        json!({"policy": policy, "queue": grid::queue_config(),
               "pools": [{"model": MODEL, "replicas": pools[0].engines}]})
    };
    let fair = Sidecar::start(config("fair"));
    let fifo = Sidecar::start(config("fifo"));
    let envoy = Envoy::start(&grid::weir_config(&shapes, &pools), fair.port, fifo.port);
    fair.wait_for_probes(engines.len());
    fifo.wait_for_probes(engines.len());

    let runs = grid::run_grid(&envoy, [&fair, &fifo], &pools, &shapes, seed).await;
    grid::assert_fair(&runs, &pools, seed, &fair).await;
}

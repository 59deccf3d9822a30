//! What fairness costs a saturated pool: the same burst of streams from 100 tenants through a
//! sidecar scheduling fairly and through one scheduling first come, first served, each in
//! front of an identical engine kept full. The engine's throughput bounds both; what fair
//! queueing costs is what it takes away from it. The engines run at model speed (a step of the
//! glm-5.2 preset's batch is ~1.8 ms), as a GPU would: time-scaled 1000×, their steps took
//! microseconds, and the 2 cores' relaying of the tokens bounded both instead, so the ratio
//! measured CPU contention between the two sides (rounds from 0.75 to 1.43).

use std::path::Path;

use serde_json::json;
use weir_e2e::{Sidecar, Sim};

use super::{Hop, RELAY_TOKENS, Row, Target, alternate, streams};

/// Streams in the burst, and the engine's batch (and the sidecar's per-replica cap): the rest
/// wait in the sidecar's queue, where the policy orders them.
const STREAMS: usize = 2_000;
const BATCH: usize = 64;
const ROUNDS: usize = 3;

fn pool(sim_bin: &Path, sidecar_bin: &Path, policy: &str) -> (Sim, Sidecar) {
    let batch = BATCH.to_string();
    let sim = Sim::start_from(
        sim_bin,
        &[
            "--preset",
            "glm-5.2",
            "--time-scale",
            "1",
            "--max-num-seqs",
            &batch,
        ],
    );
    let sidecar = Sidecar::start_from(
        sidecar_bin,
        json!({
            "policy": policy,
            "queue": {"max_per_tenant": 10000, "max_per_org": 20000, "max_total": 20000, "deadline_ms": 600000},
            "pools": [{"model": "glm-5.2", "replicas": [sim.url], "max_concurrency_per_replica": BATCH}],
        }),
    );
    (sim, sidecar)
}

pub fn fairness_cost(sim_bin: &Path, sidecar_bin: &Path) -> anyhow::Result<Vec<Row>> {
    let (_fair_sim, fair) = pool(sim_bin, sidecar_bin, "fair");
    let (_fifo_sim, fifo) = pool(sim_bin, sidecar_bin, "fifo");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let runtime = tokio::runtime::Runtime::new()?;
    let r = alternate(ROUNDS, || {
        let fair = runtime.block_on(streams(&fair.url, STREAMS, true, Hop::Http1))?;
        Ok((
            runtime.block_on(streams(&fifo.url, STREAMS, true, Hop::Http1))?,
            fair,
        ))
    })?;
    let ratio = r.ratio;
    println!(
        "\nfairness cost: {STREAMS} streams of {RELAY_TOKENS} tokens from 100 tenants at once, an engine batch of {BATCH}"
    );
    println!("(glm-5.2 preset at model speed), fair vs FIFO sidecar, {ROUNDS} alternating rounds");
    println!(
        "{:>14} {:>14} {:>7} {:>15}",
        "fair tok/s", "FIFO tok/s", "ratio", "range"
    );
    println!(
        "{:>14.0} {:>14.0} {ratio:>6.3}x {:>15}",
        r.measured,
        r.baseline,
        format!("[{:.3}–{:.3}]", r.low, r.high)
    );
    Ok(vec![Row::new(
        "fairness cost: saturated pool, fair vs FIFO, tokens/s",
        "FIFO throughput",
        ratio,
        Target::AtLeast(0.99),
        "×",
    )])
}

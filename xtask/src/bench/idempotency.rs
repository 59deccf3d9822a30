//! Idempotency claims with the memory full at 1,000, 100,000 and 1,000,000 remembered keys
//! (`sidecar/benches/idempotency.rs`): instructions a claim, counted by callgrind, with
//! criterion's wall clock from the same run beside them. Instructions are what the claim's work
//! is; the wall clock also rises as the keys outgrow the caches.

use std::path::Path;
use std::process::Command;

use super::{Row, Target, criterion_mean_ns};

const SIZES: [(usize, &str); 3] = [(1_000, "1k"), (100_000, "100k"), (1_000_000, "1m")];

/// Claims `measured_claims` makes after the filling (as the bench's `main` does).
const CLAIMS: f64 = 10_000.0;

/// Instructions a claim with `keys` remembered: callgrind counts `measured_claims` only.
fn instructions_per_claim(bench: &Path, keys: usize) -> anyhow::Result<f64> {
    let out = Command::new("valgrind")
        .args([
            "--tool=callgrind",
            "--toggle-collect=*measured_claims*",
            "--callgrind-out-file=/dev/null",
        ])
        .arg(bench)
        .env("WEIR_CLAIMS_KEYS", keys.to_string())
        .output()?;
    anyhow::ensure!(out.status.success(), "callgrind failed: {}", out.status);
    let collected = String::from_utf8_lossy(&out.stderr)
        .lines()
        .find_map(|line| line.split_once("Collected :")?.1.trim().parse::<f64>().ok())
        .ok_or_else(|| anyhow::anyhow!("no `Collected :` count in callgrind's output"))?;
    Ok(collected / CLAIMS)
}

/// The claim at 1,000,000 keys against 1,000, in instructions; `bench` is the bench's
/// executable, `criterion` where its run just wrote its estimates.
pub fn idempotency_claims(bench: &Path, criterion: &Path) -> anyhow::Result<Row> {
    let mut instructions = Vec::new();
    let mut micros = Vec::new();
    for (keys, size) in SIZES {
        eprintln!("xtask: callgrind, a claim with {keys} keys remembered");
        instructions.push(instructions_per_claim(bench, keys)?);
        micros.push(criterion_mean_ns(criterion, &format!("idempotency_claim_{size}_keys"))? / 1e3);
    }
    let list = |v: &[f64], decimals: usize| {
        v.iter()
            .map(|x| format!("{x:.decimals$}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let ratio = instructions[2] / instructions[0];
    Ok(Row::new(
        "idempotency claim, 1,000,000 keys remembered, instructions",
        "1,000 keys",
        ratio,
        Target::AtMost(2.0),
        "×",
    )
    .noting(format!(
        "{} instructions, {} µs ({:.2}× wall clock) at 1,000 / 100,000 / 1,000,000 keys",
        list(&instructions, 0),
        list(&micros, 2),
        micros[2] / micros[0],
    )))
}

//! Tenant-scoped prefix affinity against no affinity (every request to the least-loaded
//! replica): the prefix-affinity scenario (16 tenants, each with its own ~8k-token system
//! prompt, on four replicas of the 8B preset), run by weir-bench once each way.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::{Row, Target};

const SCENARIO: &str = "bench/scenarios/prefix-affinity.yaml";

/// TTFT p90 and ITL p50 in ms over every answered request of one run.
fn run(bench_bin: &Path, root: &Path, affinity: bool) -> anyhow::Result<(f64, f64, usize)> {
    let out = root
        .join("target/bench/affinity")
        .join(affinity.to_string());
    let _ = std::fs::remove_dir_all(&out);
    let status = Command::new(bench_bin)
        .arg(root.join(SCENARIO))
        .args(["--affinity", &affinity.to_string(), "--out"])
        .arg(&out)
        .current_dir(root)
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "weir-bench failed: {status}");
    let dir = std::fs::read_dir(&out)?
        .filter_map(Result::ok)
        .find(|e| e.path().join("results.json").exists())
        .ok_or_else(|| anyhow::anyhow!("no results under {}", out.display()))?;
    let results: Value = serde_json::from_slice(&std::fs::read(dir.path().join("results.json"))?)?;
    let answered: Vec<&Value> = results["requests"]
        .as_array()
        .map(|r| r.iter().filter(|r| r["status"] == 200).collect())
        .unwrap_or_default();
    let mut ttft: Vec<f64> = answered
        .iter()
        .filter_map(|r| r["ttft_s"].as_f64())
        .collect();
    let mut itl: Vec<f64> = answered
        .iter()
        .filter_map(|r| r["itl_s"].as_f64())
        .collect();
    let at = |xs: &mut Vec<f64>, q: f64| {
        xs.sort_by(f64::total_cmp);
        let i = ((xs.len().saturating_sub(1)) as f64 * q).round() as usize;
        xs.get(i).map_or(0.0, |x| x * 1e3)
    };
    Ok((at(&mut ttft, 0.90), at(&mut itl, 0.50), answered.len()))
}

pub fn prefix_affinity(bench_bin: &Path, root: &Path) -> anyhow::Result<Vec<Row>> {
    let (on_ttft, on_itl, on_n) = run(bench_bin, root, true)?;
    let (off_ttft, off_itl, off_n) = run(bench_bin, root, false)?;
    println!(
        "\nprefix affinity: 16 tenants with their own ~8k-token system prompts, 4 replicas of the 8B preset"
    );
    println!("(time-scaled 10x), weir-bench's prefix-affinity scenario once each way");
    println!(
        "{:<28} {:>9} {:>13} {:>11}",
        "", "answered", "TTFT p90 ms", "ITL p50 ms"
    );
    println!(
        "{:<28} {on_n:>9} {on_ttft:>13.1} {on_itl:>11.2}",
        "affinity"
    );
    println!(
        "{:<28} {off_n:>9} {off_ttft:>13.1} {off_itl:>11.2}",
        "off (least-loaded replica)"
    );
    const BASELINE: &str = "no affinity (least-loaded)";
    Ok(vec![
        Row::new(
            "prefix affinity, TTFT p90 lower by",
            BASELINE,
            off_ttft / on_ttft.max(f64::MIN_POSITIVE),
            Target::AtLeast(5.0),
            "×",
        )
        .noting(format!("{on_ttft:.1} vs {off_ttft:.1} ms")),
        Row::new(
            "prefix affinity, ITL p50",
            BASELINE,
            on_itl / off_itl.max(f64::MIN_POSITIVE),
            Target::AtMost(1.0),
            "×",
        )
        .noting(format!("{on_itl:.2} vs {off_itl:.2} ms")),
    ])
}

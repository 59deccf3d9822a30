//! weir-bench: runs scenario files against the real stack it starts, or against any
//! deployment's gateway (`--endpoint`), and reports per-tenant latency, rejections, tokens and
//! goodput as a table, JSON and an SVG plot.

mod cli;
mod keys;
mod load;
mod report;
mod scenario;
mod stack;
mod target;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::Cli;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let scenario = cli.scenario()?;
    let target = cli.target(&scenario)?;
    let label = target.label(&scenario);
    let records: load::Records = Arc::new(Mutex::new(Vec::new()));

    let bar = ProgressBar::new((scenario.duration_s * 10.0) as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:40}] {elapsed}/{duration_s}s {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(label.clone());
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let run = load::run(&scenario, &target.endpoint, records.clone());
        let ticker = async {
            let start = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                bar.set_position((start.elapsed().as_secs_f64() * 10.0) as u64);
                let done = records.lock().map_or(0, |r| r.len());
                bar.set_message(format!("{done} requests done"));
            }
        };
        tokio::select! {
            _ = run => {}
            _ = ticker => {}
        }
    });
    bar.finish_and_clear();

    let records = records.lock().map(|r| r.clone()).unwrap_or_default();
    let stats = report::summarize(&records, scenario.duration_s);
    println!(
        "{label}: {} requests in {:.0} s to {} ({})",
        records.len(),
        scenario.duration_s,
        target.endpoint.url,
        target.endpoint.model,
    );
    print!("{}", report::table(&stats));
    let dir = cli.out.join(&label);
    std::fs::create_dir_all(&dir)?;
    let json = serde_json::json!({
        "scenario": scenario,
        "target": target.record(),
        "tenants": stats,
        "requests": records,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    report::plot(
        &records,
        &format!("{label}: time to first token"),
        &dir.join("ttft.svg"),
    )?;
    println!(
        "results: {}/results.json, plot: {}/ttft.svg",
        dir.display(),
        dir.display()
    );
    drop(target);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;

    /// A short, time-scaled run on the real stack: the shape of the results, not their times.
    #[test]
    fn a_short_run_reports_every_tenant_and_applies_budgets() {
        let yaml = r#"
name: smoke
duration_s: 3
stack: {preset: tiny, replicas: 1, time_scale: 20, policy: fair, budgets: true}
tenants:
  - {name: streamer, arrival: {kind: poisson, rate_per_s: 8}, prompt_tokens: 100, output_tokens: 20}
  - {name: closed, arrival: {kind: closed, concurrency: 2}, prompt_tokens: 200, output_tokens: 30, stream: false}
  - {name: capped, arrival: {kind: burst, every_s: 0.5, count: 5}, prompt_tokens: 400, output_tokens: 5, budget_tokens_per_minute: 2000}
"#;
        let scenario: Scenario = serde_yaml_ng::from_str(yaml).unwrap();
        let target = target::Target::start(&scenario);
        let records: load::Records = Arc::new(Mutex::new(Vec::new()));
        tokio::runtime::Runtime::new().unwrap().block_on(load::run(
            &scenario,
            &target.endpoint,
            records.clone(),
        ));
        let records = records.lock().unwrap().clone();
        let stats = report::summarize(&records, scenario.duration_s);
        assert_eq!(stats.len(), 3, "{stats:?}");
        let streamer = &stats["streamer"];
        assert!(streamer.ok >= 5 && streamer.ok == streamer.requests);
        assert_eq!(streamer.output_tokens, 20 * streamer.ok as u64);
        assert!(streamer.ttft_ms.p50 > 0.0 && streamer.itl_ms.p50 > 0.0);
        let closed = &stats["closed"];
        assert_eq!(closed.output_tokens, 30 * closed.ok as u64);
        assert_eq!(closed.ttft_ms.p50, 0.0, "not streamed: no first-token time");
        let capped = &stats["capped"];
        assert!(
            capped.rejected_429 > 0 && capped.ok > 0,
            "the 2,000 tokens/min budget bites: {capped:?}"
        );

        let dir = std::env::temp_dir().join(format!("weir-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        report::plot(&records, "smoke", &dir.join("ttft.svg")).unwrap();
        let svg = std::fs::read_to_string(dir.join("ttft.svg")).unwrap();
        assert!(svg.contains("streamer") && svg.contains("<circle"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Fleet mode on vs off: the filter's added latency when the tenant's per-minute limits are
//! fleet-wide (leases from the sidecar's quota service on a real Redis, renewed in the
//! background) against the same limits in the Envoy's own buckets. Renewals must stay off the
//! request path, so the ratio should be ~1.0.

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use weir_e2e::redis_server::Redis;
use weir_e2e::{Envoy, EnvoyOptions, Sidecar, Sim, metric_sum};

use super::{bench_config, chat_request, percentiles, timed_chat};

/// Requests per side (fleet mode on, off), sent in turn to the four Envoys (so machine noise hits
/// both sides, and no fleet lease sits idle long enough to lapse).
const REQUESTS: usize = 3_000;
/// The Envoys' sides in launch order, ABBA: with one Envoy per side, whichever started first
/// measured the lower p99 in either role, so each side gets one early and one late.
const SIDES: [usize; 4] = [ON, OFF, OFF, ON];
const ON: usize = 0;
const OFF: usize = 1;
const RENEW_MS: u64 = 250;
/// Far above what the bench spends in a minute (a few hundred ~410-token requests/s per side), so
/// nothing is refused; low enough that the smallest lease (1% of the limit) drains within a
/// second or two, so renewals keep coming during the run.
const INPUT_TOKENS_PER_MINUTE: u64 = 20_000_000;
const REQUESTS_PER_MINUTE: u64 = 100_000;

/// Sidecar series read before and after the run: tokens and requests granted as leases, and
/// renewals answered by the store.
const GRANTED: &str = "weir_quota_granted_total";
const STORE_CALLS: &str = "weir_quota_store_seconds_count";

/// Prints p50/p99 of each side and their ratio; fails on any refusal or if no lease was renewed.
pub fn fleet_overhead(sim_bin: &Path, sidecar_bin: &Path) -> anyhow::Result<()> {
    let sim = Sim::start_from(sim_bin, &["--preset", "tiny", "--time-scale", "1000"]);
    let redis = Redis::launch();
    let sidecar = Sidecar::start_with_quota(
        sidecar_bin,
        json!({"pools": [{"model": "tiny", "replicas": [sim.url]}]}),
        &redis,
    );
    sidecar.wait_for_probes(1);
    let limits = json!({
        "requests_per_minute": REQUESTS_PER_MINUTE,
        "input_tokens_per_minute": INPUT_TOKENS_PER_MINUTE,
    });
    let mut fleet_limits = limits.clone();
    // fail_closed: a renewal that failed would show as a refusal, which the run forbids.
    fleet_limits["fleet_wide"] = json!({
        "requests_per_minute": "fail_closed",
        "input_tokens_per_minute": "fail_closed",
    });
    let launch = |config: &serde_json::Value| {
        Envoy::launch(EnvoyOptions {
            weir_config: config,
            upstream_port: sidecar.port,
            alt_port: sidecar.port,
            listen_port: 0,
            with_filter: true,
        })
    };
    let configs = [
        bench_config(
            fleet_limits,
            json!({"fleet": {"cluster": "upstream", "renew_ms": RENEW_MS}}),
        ),
        bench_config(limits, json!({})),
    ];
    let envoys: Vec<Envoy> = SIDES.iter().map(|&side| launch(&configs[side])).collect();
    let body = chat_request();

    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let client = reqwest::Client::new();
        // Warm both; the fleet side answers 429 until its first grant (one renewal period).
        for url in envoys.iter().map(|e| &e.url) {
            let mut served = 0;
            for _ in 0..2_000 {
                let (status, _) = timed_chat(&client, url, &body).await?;
                if status.is_success() {
                    served += 1;
                    if served == 200 {
                        break;
                    }
                } else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            anyhow::ensure!(served == 200, "{url} served only {served} warm-up requests");
        }
        let before = sidecar.metrics().await;
        let mut latencies = [Vec::new(), Vec::new()];
        let mut refused = [0u32; 2];
        for i in 0..REQUESTS * 2 / SIDES.len() {
            // Rotate which Envoy goes first, so none always follows another.
            for k in 0..SIDES.len() {
                let at = (i + k) % SIDES.len();
                let side = SIDES[at];
                let (status, took) = timed_chat(&client, &envoys[at].url, &body).await?;
                if status.is_success() {
                    latencies[side].push(took);
                } else {
                    refused[side] += 1;
                }
            }
        }
        let after = sidecar.metrics().await;
        let grown = |name| {
            metric_sum(&after, name).unwrap_or(0.0) - metric_sum(&before, name).unwrap_or(0.0)
        };
        let (granted, renewals) = (grown(GRANTED), grown(STORE_CALLS));

        println!(
            "\nfleet mode: the same ~2 KB chat request and limits ({REQUESTS_PER_MINUTE} requests, \
             {INPUT_TOKENS_PER_MINUTE} input tokens per minute) on four Envoys in front of one sidecar,"
        );
        println!(
            "fleet-wide (leases from the sidecar's quota service on redis-server, renew_ms {RENEW_MS}) \
             vs local buckets (two Envoys each, launched on-off-off-on); {REQUESTS} requests per side, in turn"
        );
        println!(
            "{:<22} {:>8} {:>8} {:>8}",
            "", "p50 µs", "p99 µs", "refused"
        );
        let (on50, on99) = percentiles(&mut latencies[ON]);
        let (off50, off99) = percentiles(&mut latencies[OFF]);
        println!(
            "{:<22} {on50:>8.0} {on99:>8.0} {:>8}",
            "fleet-wide (on)", refused[ON]
        );
        println!(
            "{:<22} {off50:>8.0} {off99:>8.0} {:>8}",
            "local buckets (off)", refused[OFF]
        );
        println!(
            "{:<22} {:>7.2}x {:>7.2}x",
            "ratio on/off",
            on50 / off50,
            on99 / off99
        );
        println!(
            "during the run the quota service answered {renewals} renewals from the store, granting {granted} (tokens + requests)"
        );
        anyhow::ensure!(
            refused == [0, 0],
            "requests refused during the run: {refused:?}"
        );
        anyhow::ensure!(
            renewals > 0.0 && granted > 0.0,
            "no lease was renewed during the run"
        );
        Ok(())
    })
}

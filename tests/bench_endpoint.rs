//! `weir-bench --endpoint`: the benchmark measuring a deployment it does not run. The
//! deployment is a stack started here — Envoy with the built filter, the sidecar, two simulator
//! replicas — with keys of its own; weir-bench gets one tenant's key by flag and the other's in
//! a keys file, and its answers must be the stack's: in its results and in the sidecar's ledger
//! and metrics.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::{Value, json};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, bench_bin, http_get, metric_sum, wait_for};

/// A streaming open-loop tenant and a closed-loop one; the `stack` section names a preset the
/// deployment does not serve and settings it does not have, which `--endpoint` must not use.
const SCENARIO: &str = "
name: ops
duration_s: 60
stack: {preset: glm-5.2, policy: fifo, budgets: true}
tenants:
  - {name: alpha, arrival: {kind: poisson, rate_per_s: 6}, prompt_tokens: 200, output_tokens: 20}
  - {name: beta, arrival: {kind: closed, concurrency: 2}, prompt_tokens: 300, output_tokens: 20, stream: false, start_s: 0.5}
";

fn bench(dir: &Path, args: &[&str]) -> Output {
    Command::new(bench_bin())
        .arg(dir.join("scenario.yaml"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

#[test]
fn weir_bench_drives_a_deployment_it_does_not_run() {
    let sims = [Sim::start_tiny_fast(&[]), Sim::start_tiny_fast(&[])];
    let sidecar = Sidecar::start(json!({
        "pools": [{"model": "tiny", "replicas": [sims[0].url, sims[1].url]}],
    }));
    let weir = json!({"orgs": [{"id": "ops", "workspaces": [{"id": "w", "projects": [{"id": "p",
        "keys": [api_key("alpha"), api_key("beta")]}]}]}]});
    let envoy = Envoy::start(&weir, sidecar.port, sidecar.port);
    sidecar.wait_for_probes(sims.len());

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("scenario.yaml"), SCENARIO).unwrap();
    std::fs::write(
        dir.path().join("keys.txt"),
        "# ops tenants\nbeta = key-beta\n",
    )
    .unwrap();
    let endpoint = [
        "--endpoint",
        &envoy.url,
        "--model",
        "tiny",
        "--duration",
        "3",
    ];

    // A tenant without a key: refused before any request is sent.
    let out = bench(
        dir.path(),
        &[&endpoint[..], &["--key", "alpha=key-alpha"]].concat(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no key for scenario tenant(s) beta"),
        "{stderr}"
    );
    assert!(!stderr.contains("key-alpha"), "no key is shown: {stderr}");
    // The stack's settings are the deployment's own.
    let out = bench(dir.path(), &[&endpoint[..], &["--policy", "fair"]].concat());
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--endpoint cannot be used with --policy")
    );
    assert!(sidecar.ledger_rows(None).is_empty(), "nothing was sent");

    let keys = ["--key", "alpha=key-alpha", "--keys-file", "keys.txt"];
    let out = bench(
        dir.path(),
        &[&endpoint[..], &keys, &["--out", "out"]].concat(),
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains(&envoy.url), "{stdout}");
    let port = envoy.url.rsplit(':').next().unwrap();
    let run = dir.path().join(format!("out/ops-127.0.0.1-{port}"));
    let text = std::fs::read_to_string(run.join("results.json")).unwrap();
    for shown in [&*stdout, &*stderr, &text] {
        assert!(
            !shown.contains("key-alpha") && !shown.contains("key-beta"),
            "no key is shown or written"
        );
    }
    let results: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        results["target"],
        json!({"endpoint": envoy.url, "model": "tiny", "started_by_weir_bench": false})
    );
    let svg = std::fs::read_to_string(run.join("ttft.svg")).unwrap();
    assert!(
        svg.contains("alpha") && svg.contains("<circle"),
        "streamed TTFTs plotted"
    );

    for tenant in ["alpha", "beta"] {
        let stats = &results["tenants"][tenant];
        let (requests, ok) = (stats["requests"].as_u64().unwrap(), stats["ok"].as_u64());
        assert!(requests > 0 && ok == Some(requests), "{tenant}: {stats}");
        assert!(stdout.contains(&format!("\n{tenant} ")), "{stdout}");
        // The deployment saw them: one ledger record per answer (written as it ends).
        let path = format!("ops/w/p/{tenant}");
        let answered = wait_for(Duration::from_secs(5), || {
            let rows = sidecar.ledger_rows(Some(&path));
            let ok_rows = rows.iter().filter(|r| r.outcome == "ok").count() as u64;
            (ok_rows == requests).then_some(ok_rows)
        });
        assert_eq!(answered, Some(requests), "{tenant}'s ledger records");
    }
    // And their tokens in its metrics, under their org (metrics show tenants no deeper).
    let metrics = http_get(sidecar.admin.trim_start_matches("http://"), "/metrics").unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("weir_tokens_total{tenant=\"ops\"")
                && metric_sum(l, "weir_tokens_total") > Some(0.0)),
        "the tenants' tokens in the sidecar's metrics: {metrics}"
    );
}

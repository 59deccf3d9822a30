//! Starts the real stack a scenario runs against when no `--endpoint` is given: simulated
//! replicas, the sidecar, and Envoy with the weir filter, with one key per scenario tenant.

use serde_json::json;
use weir_core::keys::hash_key;
use weir_e2e::{Envoy, Sidecar, Sim, workspace_root};

use crate::scenario::Scenario;

/// The running stack; every process stops when it is dropped.
pub struct Stack {
    pub envoy: Envoy,
    pub model: String,
    _sidecar: Sidecar,
    _replicas: Vec<Sim>,
}

/// The key the started stack gives `tenant`.
pub fn key_of(tenant: &str) -> String {
    format!("wk-bench-{tenant}")
}

/// The sibling binaries of this build: release ones for a release `weir-bench`
/// (`cargo build --release --workspace`), debug ones in tests.
fn bin(name: &str) -> std::path::PathBuf {
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    workspace_root().join("target").join(profile).join(name)
}

impl Stack {
    pub fn start(s: &Scenario) -> Stack {
        let spec = &s.stack;
        let scale = spec.time_scale.to_string();
        let replicas: Vec<Sim> = (0..spec.replicas.max(1))
            .map(|_| {
                Sim::start_from(
                    &bin("weir-sim"),
                    &["--preset", &spec.preset, "--time-scale", &scale],
                )
            })
            .collect();
        let model = spec.preset.clone();
        let sidecar = Sidecar::start_from(
            &bin("weir-sidecar"),
            json!({
                "policy": spec.policy,
                "queue": {"max_per_tenant": 512, "max_total": 8192, "deadline_ms": 60000},
                "pools": [{
                    "model": model,
                    "replicas": replicas.iter().map(|r| r.url.clone()).collect::<Vec<_>>(),
                    "affinity_load_threshold": if spec.affinity { 0.85 } else { 0.0 },
                    // The simulator's `--max-num-seqs` (its presets' default), which vLLM's
                    // metrics do not say.
                    "max_concurrency_per_replica": 256,
                }],
            }),
        );
        let keys: Vec<_> = s
            .tenants
            .iter()
            .map(|t| {
                let mut key = json!({"id": t.name, "sha256": hash_key(&key_of(&t.name)), "policy": {"weight": t.weight}});
                if t.batch {
                    key["policy"]["priority"] = json!("batch");
                }
                if let (true, Some(budget)) = (spec.budgets, t.budget_tokens_per_minute) {
                    key["limits"] = json!({"input_tokens_per_minute": budget});
                }
                key
            })
            .collect();
        let weir = json!({
            "orgs": [{"id": "bench", "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": keys}]}]}],
            "estimator": {"exact_below_bytes": 0},
        });
        let envoy = Envoy::start(&weir, sidecar.port, sidecar.port);
        // Dispatch waits for the sidecar's first probes of every replica (health and cache
        // isolation): no scenario's first requests wait for them.
        sidecar.wait_for_probes(replicas.len());
        Stack {
            envoy,
            model,
            _sidecar: sidecar,
            _replicas: replicas,
        }
    }
}

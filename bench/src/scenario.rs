//! Scenario files: who sends what, how often, for how long, against which stack.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    /// Seconds the load runs.
    pub duration_s: f64,
    #[serde(default)]
    pub stack: StackSpec,
    pub tenants: Vec<TenantLoad>,
}

/// The stack the scenario starts: Envoy + filter → sidecar → simulated replicas.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StackSpec {
    pub preset: String,
    pub replicas: usize,
    pub time_scale: f64,
    /// `fair` or `fifo`.
    pub policy: String,
    /// Per-tenant input-token budgets (`budget_tokens_per_minute` of each tenant) on or off.
    pub budgets: bool,
    /// Tenant-scoped prefix affinity; off sends every request to the least-loaded replica.
    pub affinity: bool,
}

impl Default for StackSpec {
    fn default() -> Self {
        StackSpec {
            preset: "tiny".into(),
            replicas: 2,
            time_scale: 10.0,
            policy: "fair".into(),
            budgets: false,
            affinity: true,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLoad {
    pub name: String,
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub batch: bool,
    pub arrival: Arrival,
    pub prompt_tokens: Length,
    pub output_tokens: Length,
    #[serde(default = "yes")]
    pub stream: bool,
    /// Requests of this tenant start with the same text of this many tokens.
    #[serde(default)]
    pub shared_prefix_tokens: usize,
    /// When this tenant starts and stops sending, in seconds from the start.
    #[serde(default)]
    pub start_s: f64,
    #[serde(default)]
    pub stop_s: Option<f64>,
    /// Input tokens per minute this tenant may use when the stack's budgets are on.
    #[serde(default)]
    pub budget_tokens_per_minute: Option<u64>,
}

fn one() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Arrival {
    /// Open loop, exponential gaps.
    Poisson { rate_per_s: f64 },
    /// `count` requests at once every `every_s`.
    Burst { every_s: f64, count: usize },
    /// `concurrency` clients, each sending its next request when the last one ends.
    Closed { concurrency: usize },
}

/// A token count: a number, or `{min, max}` drawn uniformly.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Length {
    Fixed(usize),
    Uniform { min: usize, max: usize },
}

impl Scenario {
    pub fn load(path: &Path) -> anyhow::Result<Scenario> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let scenario: Scenario = serde_yaml_ng::from_str(&text)
            .with_context(|| format!("parsing {}", path.display()))?;
        anyhow::ensure!(
            !scenario.tenants.is_empty(),
            "{}: no tenants",
            path.display()
        );
        anyhow::ensure!(
            scenario.duration_s > 0.0,
            "{}: duration_s must be positive",
            path.display()
        );
        Ok(scenario)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_scenarios_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let s = Scenario::load(&path).unwrap();
            assert!(!s.tenants.is_empty(), "{}", path.display());
            n += 1;
        }
        assert!(n >= 1);
    }
}

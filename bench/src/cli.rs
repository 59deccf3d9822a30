//! The command line: a scenario, and either the stack weir-bench starts (with overrides of the
//! scenario's `stack` section) or a deployment's endpoint with a key per tenant. Options that
//! belong to the other target are refused rather than ignored, so no run silently measures
//! something other than what was asked.

use std::path::PathBuf;

use clap::Parser;

use crate::keys::Keys;
use crate::scenario::Scenario;
use crate::target::Target;

const EXAMPLES: &str = "\
Examples:
  # The stack weir-bench starts: Envoy + weir filter + sidecar + simulated engines
  weir-bench bench/scenarios/noisy-neighbour.yaml --policy fifo --budgets true

  # Your own deployment: nothing is started, the load goes to URL/v1/chat/completions
  weir-bench bench/scenarios/noisy-neighbour.yaml --endpoint https://gateway.example:8443 \\
      --keys-file bench-keys.txt --model my-model

A keys file has one `tenant=key` a line, one for each tenant of the scenario; blank lines and
lines starting with # are skipped. Keys are never printed nor written to the results.";

#[derive(Parser)]
#[command(
    name = "weir-bench",
    version,
    about = "Run a load scenario against a stack it starts (Envoy + weir filter + sidecar + \
             simulated engines) or against any deployment's gateway (--endpoint)",
    after_help = EXAMPLES
)]
pub struct Cli {
    /// Scenario file (YAML).
    scenario: PathBuf,
    /// Measure the deployment whose gateway is at URL (e.g. `http://gateway.example:8080`)
    /// instead of starting a stack; requests go to URL/v1/chat/completions.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// With --endpoint: a scenario tenant's key, as TENANT=KEY; repeatable. Visible in the
    /// process list: prefer --keys-file.
    #[arg(long, value_name = "TENANT=KEY")]
    key: Vec<String>,
    /// With --endpoint: a file of `tenant=key` lines (see below).
    #[arg(long, visible_alias = "keys", value_name = "FILE")]
    keys_file: Option<PathBuf>,
    /// With --endpoint: the model name sent (default: the scenario's `stack.preset`).
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// Started stack only: overrides the scenario's scheduling policy, `fair` or `fifo`.
    #[arg(long)]
    policy: Option<String>,
    /// Started stack only: overrides whether per-tenant token budgets are on.
    #[arg(long)]
    budgets: Option<bool>,
    /// Started stack only: overrides whether tenant-scoped prefix affinity is on.
    #[arg(long)]
    affinity: Option<bool>,
    /// Overrides the scenario's duration, in seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// Where results.json and ttft.svg go (in a directory named after the run).
    #[arg(long, default_value = "target/bench")]
    pub out: PathBuf,
}

impl Cli {
    /// Refuses the options of the target not chosen: the stack's settings with `--endpoint`
    /// (the deployment's own configuration decides them), keys and model without it (the
    /// started stack makes its own).
    fn check(&self) -> anyhow::Result<()> {
        let given = |flags: &[(&str, bool)]| -> Vec<String> {
            flags
                .iter()
                .filter(|(_, set)| *set)
                .map(|(flag, _)| flag.to_string())
                .collect()
        };
        if self.endpoint.is_some() {
            let stack_only = given(&[
                ("--policy", self.policy.is_some()),
                ("--budgets", self.budgets.is_some()),
                ("--affinity", self.affinity.is_some()),
            ]);
            anyhow::ensure!(
                stack_only.is_empty(),
                "--endpoint cannot be used with {}: those options configure the stack \
                 weir-bench starts, while the deployment's own configuration decides for it",
                stack_only.join(", ")
            );
        } else {
            let endpoint_only = given(&[
                ("--key", !self.key.is_empty()),
                ("--keys-file", self.keys_file.is_some()),
                ("--model", self.model.is_some()),
            ]);
            anyhow::ensure!(
                endpoint_only.is_empty(),
                "{} cannot be used without --endpoint: the stack weir-bench starts makes its own \
                 keys and serves the scenario's preset",
                endpoint_only.join(", ")
            );
        }
        Ok(())
    }

    /// The scenario file with the options' overrides, once the options are consistent.
    pub fn scenario(&self) -> anyhow::Result<Scenario> {
        self.check()?;
        let mut scenario = Scenario::load(&self.scenario)?;
        if let Some(policy) = &self.policy {
            scenario.stack.policy = policy.clone();
        }
        if let Some(budgets) = self.budgets {
            scenario.stack.budgets = budgets;
        }
        if let Some(affinity) = self.affinity {
            scenario.stack.affinity = affinity;
        }
        if let Some(d) = self.duration {
            scenario.duration_s = d;
        }
        Ok(scenario)
    }

    /// The `--endpoint` deployment, checked (a key for every tenant), or else the scenario's
    /// stack, started.
    pub fn target(&self, scenario: &Scenario) -> anyhow::Result<Target> {
        let Some(url) = &self.endpoint else {
            return Ok(Target::start(scenario));
        };
        let mut keys = Keys::from_flags(&self.key)?;
        if let Some(file) = &self.keys_file {
            keys.add_file(file)?;
        }
        Target::external(url, self.model.clone(), keys, scenario)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from([&["weir-bench", "s.yaml"], args].concat()).unwrap()
    }

    fn refusal(args: &[&str]) -> String {
        cli(args).check().unwrap_err().to_string()
    }

    #[test]
    fn stack_options_are_refused_with_an_endpoint() {
        let err = refusal(&["--endpoint", "http://gw", "--policy", "fifo"]);
        assert!(
            err.starts_with("--endpoint cannot be used with --policy: those options configure the stack weir-bench starts"),
            "{err}"
        );
        let err = refusal(&[
            "--endpoint",
            "http://gw",
            "--budgets",
            "true",
            "--affinity",
            "false",
        ]);
        assert!(
            err.starts_with("--endpoint cannot be used with --budgets, --affinity:"),
            "{err}"
        );
        cli(&["--endpoint", "http://gw", "--duration", "3", "--key", "a=k"])
            .check()
            .unwrap();
    }

    #[test]
    fn endpoint_options_are_refused_without_one() {
        let err = refusal(&["--key", "a=wk-secret", "--model", "m"]);
        assert!(
            err.starts_with("--key, --model cannot be used without --endpoint"),
            "{err}"
        );
        assert!(!err.contains("wk-secret"), "{err}");
        let err = refusal(&["--keys", "keys.txt"]);
        assert!(
            err.starts_with("--keys-file cannot be used without --endpoint"),
            "{err}"
        );
        cli(&["--policy", "fifo", "--budgets", "true"])
            .check()
            .unwrap();
    }

    #[test]
    fn an_endpoint_target_takes_keys_from_flags_and_file() {
        let scenario: Scenario = serde_yaml_ng::from_str(
            "{name: s, duration_s: 1, tenants: [
                {name: a, arrival: {kind: closed, concurrency: 1}, prompt_tokens: 1, output_tokens: 1},
                {name: b, arrival: {kind: closed, concurrency: 1}, prompt_tokens: 1, output_tokens: 1}]}",
        )
        .unwrap();
        let file = std::env::temp_dir().join(format!("weir-bench-keys-{}", std::process::id()));
        std::fs::write(&file, "# staging\nb=wk-b\n").unwrap();
        let path = file.display().to_string();
        let args = ["--endpoint", "http://gw:8080", "--key", "a=wk-a"];
        let target = cli(&[&args[..], &["--keys-file", &path]].concat())
            .target(&scenario)
            .unwrap();
        assert_eq!(
            (target.endpoint.keys.of("a"), target.endpoint.keys.of("b")),
            ("wk-a", "wk-b")
        );
        let err = cli(&args).target(&scenario).err().unwrap().to_string();
        assert!(err.starts_with("no key for scenario tenant(s) b:"), "{err}");
        let _ = std::fs::remove_file(&file);
    }
}

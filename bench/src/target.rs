//! Where a run's load goes: the stack weir-bench starts from the scenario's `stack` section
//! (`stack.rs`), or a deployment it does not run, given by its gateway's base URL and a key per
//! scenario tenant. The load, the table and the result files are the same for both.

use serde_json::json;

use crate::keys::Keys;
use crate::scenario::Scenario;
use crate::stack::{Stack, key_of};

/// What the load generator sends to: `{url}/v1/chat/completions`, `model` in every body, each
/// tenant's key as its bearer token.
pub struct Endpoint {
    pub url: String,
    pub model: String,
    pub keys: Keys,
}

pub struct Target {
    pub endpoint: Endpoint,
    /// The stack weir-bench started, stopped when the target is dropped; `None` for a
    /// deployment it does not run.
    stack: Option<Stack>,
}

impl Target {
    /// Starts the scenario's stack, with one key per scenario tenant.
    pub fn start(scenario: &Scenario) -> Target {
        let stack = Stack::start(scenario);
        let endpoint = Endpoint {
            url: stack.envoy.url.clone(),
            model: stack.model.clone(),
            keys: scenario
                .tenants
                .iter()
                .map(|t| (t.name.clone(), key_of(&t.name)))
                .collect(),
        };
        Target {
            endpoint,
            stack: Some(stack),
        }
    }

    /// A deployment at `url` (its gateway's base: `http[s]://host[:port][/prefix]`), sent
    /// `model` (the scenario's preset if `None`); every scenario tenant must have a key in `keys`.
    pub fn external(
        url: &str,
        model: Option<String>,
        keys: Keys,
        scenario: &Scenario,
    ) -> anyhow::Result<Target> {
        // No error shows the URL: one may hold credentials by mistake.
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| anyhow::anyhow!("--endpoint is not a URL: {e}"))?;
        anyhow::ensure!(
            matches!(parsed.scheme(), "http" | "https") && parsed.host_str().is_some(),
            "--endpoint: expected http://host[:port] or https://host[:port]"
        );
        // The URL lands in results.json and on the terminal: credentials go in keys only.
        anyhow::ensure!(
            parsed.username().is_empty() && parsed.password().is_none(),
            "--endpoint: the URL holds credentials; give keys with --key or --keys-file instead"
        );
        anyhow::ensure!(
            parsed.query().is_none() && parsed.fragment().is_none(),
            "--endpoint: expected the gateway's base URL, without a query or fragment"
        );
        keys.check_covers(&scenario.tenants)?;
        Ok(Target {
            endpoint: Endpoint {
                url: url.trim_end_matches('/').to_owned(),
                model: model.unwrap_or_else(|| scenario.stack.preset.clone()),
                keys,
            },
            stack: None,
        })
    }

    /// The run's name, and its directory under `--out`: the scenario and the stack's settings
    /// for a started stack; the scenario and the endpoint's host and port otherwise.
    pub fn label(&self, scenario: &Scenario) -> String {
        let spec = &scenario.stack;
        match self.stack {
            Some(_) => format!(
                "{}-{}{}{}",
                scenario.name,
                spec.policy,
                if spec.budgets { "-budgets" } else { "" },
                if spec.affinity { "" } else { "-no-affinity" }
            ),
            None => {
                let at: String = self
                    .endpoint
                    .url
                    .split_once("://")
                    .map_or(self.endpoint.url.as_str(), |(_, rest)| rest)
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || c == '.' {
                            c
                        } else {
                            '-'
                        }
                    })
                    .collect();
                format!("{}-{}", scenario.name, at.trim_matches('-'))
            }
        }
    }

    /// What was measured, for results.json: the endpoint and model, never the keys.
    pub fn record(&self) -> serde_json::Value {
        json!({
            "endpoint": self.endpoint.url,
            "model": self.endpoint.model,
            "started_by_weir_bench": self.stack.is_some(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario() -> Scenario {
        serde_yaml_ng::from_str(
            "{name: s, duration_s: 1, stack: {preset: tiny}, tenants: [{name: alpha, arrival: {kind: closed, concurrency: 1}, prompt_tokens: 1, output_tokens: 1}]}",
        )
        .unwrap()
    }

    fn keys() -> Keys {
        Keys::from_flags(&["alpha=wk-secret".into()]).unwrap()
    }

    #[test]
    fn an_endpoint_is_normalised_labelled_and_recorded_without_keys() {
        let t = Target::external("http://gw.example:8080/", None, keys(), &scenario()).unwrap();
        assert_eq!(t.endpoint.url, "http://gw.example:8080");
        assert_eq!(t.endpoint.model, "tiny", "the scenario's preset by default");
        assert_eq!(t.endpoint.keys.of("alpha"), "wk-secret");
        assert_eq!(t.label(&scenario()), "s-gw.example-8080");
        let record = t.record().to_string();
        assert!(record.contains("http://gw.example:8080") && !record.contains("wk-secret"));

        let t = Target::external(
            "https://gw.example/llm",
            Some("my-model".into()),
            keys(),
            &scenario(),
        )
        .unwrap();
        assert_eq!(t.endpoint.model, "my-model");
        assert_eq!(t.label(&scenario()), "s-gw.example-llm");
    }

    #[test]
    fn bad_endpoints_are_refused() {
        for (url, says) in [
            ("gw.example:8080", "expected http"),
            ("ftp://gw.example", "expected http"),
            ("not a url", "is not a URL"),
            ("http://user:pw@gw.example", "holds credentials"),
            ("http://gw.example/?key=x", "without a query"),
        ] {
            let err = Target::external(url, None, keys(), &scenario())
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains(says), "{url}: {err}");
            assert!(!err.contains("pw@") && !err.contains("key=x"), "{err}");
        }
    }

    #[test]
    fn a_tenant_without_a_key_is_refused() {
        let err = Target::external("http://gw", None, Keys::default(), &scenario())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.starts_with("no key for scenario tenant(s) alpha"),
            "{err}"
        );
    }
}

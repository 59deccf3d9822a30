//! `weir config check FILE`: validates a config exactly as the filter and the sidecar will read
//! it — the same parsers, so a file that passes here loads there — for CI pipelines (exit code
//! 1 on any error, each error naming its field), and warns of what loads but cannot be meant:
//! placeholders left from the examples ([`crate::placeholders`]), a config acting on no route.
//! A manifest's config is also read as Kubernetes will read it: a bare `off` there is refused
//! ([`crate::yaml11`]).
//!
//! A file may be a filter config, a sidecar config, or the Kubernetes manifests that carry them:
//! an Istio `WasmPlugin` (its `pluginConfig`), an Istio `EnvoyFilter` (the `configuration` of
//! each Wasm filter it patches in), an Envoy Gateway `EnvoyExtensionPolicy` (each wasm entry's
//! `config`), a `ConfigMap` (each value that is a sidecar config), in one document or many
//! (`kubectl kustomize` output).

use std::fmt;

use anyhow::bail;
use serde::Deserialize;
use serde_json::Value;
use weir_core::config::Config;
use weir_core::prediction::PredictionConfig;
use weir_sidecar::config::SidecarConfig;

use crate::placeholders::{self, Placeholder};
use crate::yaml11::{self, BareWord};

/// Which config a file (or a part of a manifest) holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Decided from the contents.
    Auto,
    /// The whole file is a filter config.
    Filter,
    /// The whole file is a sidecar config.
    Sidecar,
}

/// One config found in a file, and where (empty: the file is the config).
struct Found {
    place: String,
    kind: Kind,
    text: String,
    /// The environment variables a manifest passes into the filter's VM, when it says: the
    /// signing secret's must be among them, or the filter does not start.
    vm_env: Option<Vec<String>>,
    /// Bare YAML-1.1 boolean words in a config Kubernetes reads (a manifest's, not a
    /// ConfigMap's text), their paths from the config's root.
    bare: Vec<BareWord>,
}

/// How a line of the report weighs: errors fail the check, warnings only under `--strict`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    Ok,
    /// Neither passed nor failed: a manifest with no weir config in it.
    Note,
    Warn,
    Error,
}

/// One line of the report, naming the file as the user gave it.
pub struct Line {
    pub verdict: Verdict,
    text: String,
}

impl Line {
    /// About `place` in `file` (an empty place: the file as a whole).
    fn new(verdict: Verdict, file: &str, place: &str, message: impl fmt::Display) -> Line {
        let text = if place.is_empty() {
            format!("{file}: {message}")
        } else {
            format!("{file}: {place}: {message}")
        };
        Line { verdict, text }
    }

    /// A file that could not be read.
    pub fn unreadable(file: &str, error: &std::io::Error) -> Line {
        Line::new(Verdict::Error, file, "", format!("cannot be read: {error}"))
    }

    fn placeholder(file: &str, place: &str, p: Placeholder) -> Line {
        let message = format!("{}: {}", p.field, p.message);
        Line::new(Verdict::Warn, file, place, message)
    }
}

impl fmt::Display for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = match self.verdict {
            Verdict::Ok => "ok",
            Verdict::Note => "note",
            Verdict::Warn => "warn",
            Verdict::Error => "error",
        };
        write!(f, "{label:<5} {}", self.text)
    }
}

/// Checks each input (its name as the user gave it, and its text or why it could not be read),
/// a file with no weir config in it being a note; but a check that found none in any input
/// was pointed at the wrong files, and fails.
pub fn check_all(inputs: Vec<(String, std::io::Result<String>)>, kind: Kind) -> Vec<Line> {
    let count = inputs.len();
    let mut lines = Vec::new();
    let mut last = String::new();
    for (name, text) in inputs {
        match text {
            Ok(text) => lines.extend(check(&name, &text, kind)),
            Err(e) => lines.push(Line::unreadable(&name, &e)),
        }
        last = name;
    }
    if lines.iter().filter(|l| l.verdict == Verdict::Note).count() < count {
        return lines;
    }
    let hint = "(a filter config has `orgs`, a sidecar config `pools`)";
    if count == 1 {
        lines.retain(|l| l.verdict != Verdict::Note);
        let message = format!("no weir config in it {hint}");
        lines.push(Line::new(Verdict::Error, &last, "", message));
    } else {
        let text = format!("no weir config in any of these {count} inputs {hint}");
        lines.push(Line {
            verdict: Verdict::Error,
            text,
        });
    }
    lines
}

/// Checks every config in `text`, read from `file`: a line per config checked, per mistake and
/// per warning, the errors last.
pub fn check(file: &str, text: &str, kind: Kind) -> Vec<Line> {
    let (found, in_manifests) = match find(text, kind) {
        Ok(found) => found,
        Err(e) => return vec![Line::new(Verdict::Error, file, "", format!("{e:#}"))],
    };
    let mut lines: Vec<Line> = in_manifests
        .into_iter()
        .map(|(place, p)| Line::placeholder(file, &place, p))
        .collect();
    if found.is_empty() {
        // A Deployment or a Secret among the manifests: only its placeholders to check.
        let message = "no weir config in it (placeholders checked)";
        lines.push(Line::new(Verdict::Note, file, "", message));
    }
    for f in found {
        let place = f.place.as_str();
        for bare in &f.bare {
            let message = format!("{}: {}", bare.path, bare.message());
            lines.push(Line::new(Verdict::Error, file, place, message));
        }
        let checked = match f.kind {
            Kind::Sidecar => SidecarConfig::from_text(&f.text).map(|c| describe_sidecar(&c)),
            _ => Config::parse(f.text.as_bytes())
                .map_err(anyhow::Error::from)
                .and_then(|c| {
                    secret_reaches_the_vm(&c, f.vm_env.as_deref())?;
                    let keys = placeholders::in_keys(&c).into_iter();
                    lines.extend(keys.map(|p| Line::placeholder(file, place, p)));
                    if c.acts_on_no_named_route() {
                        let message = "routes: weir acts on no route (only one whose metadata \
                                       sets a mode)";
                        lines.push(Line::new(Verdict::Warn, file, place, message));
                    }
                    Ok(describe_filter(&c))
                }),
        };
        match checked {
            Ok(_) if !f.bare.is_empty() => {}
            Ok(line) => lines.push(Line::new(Verdict::Ok, file, place, line)),
            Err(e) => lines.push(Line::new(Verdict::Error, file, place, format!("{e:#}"))),
        }
    }
    lines.sort_by_key(|l| l.verdict);
    lines
}

/// The filter reads its signing secret from the VM's environment, which holds only the
/// variables its manifest passes: one it does not pass stops the filter at start-up.
fn secret_reaches_the_vm(config: &Config, vm_env: Option<&[String]>) -> anyhow::Result<()> {
    let (Some(signing), Some(env)) = (&config.signing, vm_env) else {
        return Ok(());
    };
    if !env.contains(&signing.secret_env) {
        let passed = if env.is_empty() {
            "none".to_owned()
        } else {
            env.join(", ")
        };
        bail!(
            "signing.secret_env: ${} is not passed into the filter's VM (the manifest passes \
             {passed}): the filter would not start",
            signing.secret_env
        );
    }
    Ok(())
}

/// Placeholders found in a file's manifests, each with the document it is in.
type InManifests = Vec<(String, Placeholder)>;

/// The configs in a file (the file itself, or what its manifests carry), and the placeholders
/// its manifests hold outside them.
fn find(text: &str, kind: Kind) -> anyhow::Result<(Vec<Found>, InManifests)> {
    let whole = |kind| Found {
        place: String::new(),
        kind,
        text: text.to_owned(),
        vm_env: None,
        bare: Vec::new(),
    };
    if kind != Kind::Auto {
        return Ok((vec![whole(kind)], Vec::new()));
    }
    // Read twice over: as values, and for how their words were written; both stop at the first
    // broken document (the parser's stream does not end after one).
    let walked = serde_yaml_ng::Deserializer::from_str(text);
    let (mut docs, mut bare) = (Vec::new(), Vec::new());
    for (i, (doc, walk)) in serde_yaml_ng::Deserializer::from_str(text)
        .zip(walked)
        .enumerate()
    {
        let doc = Value::deserialize(doc).map_err(|e| {
            let message = weir_core::parse_error::plain("", &e.to_string());
            anyhow::anyhow!("document {}: {message}", i + 1)
        })?;
        docs.push(doc);
        bare.push(yaml11::bare_words(text, walk));
    }
    if let [doc] = docs.as_slice()
        && doc.get("kind").is_none()
    {
        // One config, read as written (YAML stays YAML).
        return Ok((kind_of(doc).map(whole).into_iter().collect(), Vec::new()));
    }
    let (mut found, mut in_manifests) = (Vec::new(), Vec::new());
    for (i, (doc, bare)) in docs.iter().zip(bare).enumerate() {
        let n = i + 1;
        found.extend(in_document(doc, n, &bare));
        if let Some(kind) = doc["kind"].as_str() {
            let name = doc["metadata"]["name"].as_str().unwrap_or("?");
            let place = format!("document {n} ({kind} {name})");
            let held = placeholders::in_manifest(doc).into_iter();
            in_manifests.extend(held.map(|p| (place.clone(), p)));
        }
    }
    Ok((found, in_manifests))
}

/// The configs one document carries; `bare`: its bare YAML-1.1 boolean words.
fn in_document(doc: &Value, n: usize, bare: &[BareWord]) -> Vec<Found> {
    let name = doc["metadata"]["name"].as_str().unwrap_or("?");
    let at = |what: String| format!("document {n} ({what})");
    let json = |v: &Value| v.to_string();
    match doc["kind"].as_str() {
        Some("WasmPlugin") => vec![Found {
            place: at(format!("WasmPlugin {name} pluginConfig")),
            kind: Kind::Filter,
            text: json(&doc["spec"]["pluginConfig"]),
            vm_env: Some(names(&doc["spec"]["vmConfig"]["env"], |e| &e["name"])),
            bare: under(bare, "spec.pluginConfig"),
        }],
        Some("EnvoyExtensionPolicy") => doc["spec"]["wasm"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, wasm)| Found {
                place: at(format!("EnvoyExtensionPolicy {name} wasm[{i}].config")),
                kind: Kind::Filter,
                text: json(&wasm["config"]),
                vm_env: Some(names(&wasm["env"]["hostKeys"], |k| k)),
                bare: under(bare, &format!("spec.wasm[{i}].config")),
            })
            .collect(),
        Some("ConfigMap") => doc["data"]
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(key, value)| {
                let text = value.as_str()?;
                let parsed: Value = serde_yaml_ng::from_str(text).ok()?;
                let kind = kind_of(&parsed)?;
                Some(Found {
                    place: at(format!("ConfigMap {name} {key}")),
                    kind,
                    text: text.to_owned(),
                    vm_env: None,
                    bare: Vec::new(),
                })
            })
            .collect(),
        Some("EnvoyFilter") => {
            let mut configs = Vec::new();
            wasm_configurations(&doc["spec"], &mut configs);
            configs
                .into_iter()
                .enumerate()
                .map(|(i, (text, vm_env))| Found {
                    place: at(format!("EnvoyFilter {name} Wasm filter {i}")),
                    kind: Kind::Filter,
                    text: text.to_owned(),
                    vm_env: Some(vm_env),
                    bare: Vec::new(),
                })
                .collect()
        }
        Some(_) => Vec::new(),
        None => kind_of(doc)
            .map(|kind| Found {
                place: at("config".into()),
                kind,
                text: json(doc),
                vm_env: None,
                bare: Vec::new(),
            })
            .into_iter()
            .collect(),
    }
}

/// The words of `bare` under `root`, their paths from it.
fn under(bare: &[BareWord], root: &str) -> Vec<BareWord> {
    bare.iter()
        .filter_map(|b| {
            let rest = b.path.strip_prefix(root)?;
            let path = rest
                .strip_prefix('.')
                .or_else(|| rest.starts_with('[').then_some(rest))?;
            Some(BareWord {
                path: path.to_owned(),
                word: b.word.clone(),
            })
        })
        .collect()
}

/// The strings `at` finds in each item of the array `list` (none when it is not one).
fn names(list: &Value, at: impl Fn(&Value) -> &Value) -> Vec<String> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| at(item).as_str().map(str::to_owned))
        .collect()
}

/// The plugin configuration of every Wasm HTTP filter config in `value`, wherever it sits (an
/// `EnvoyFilter` adds one as an extension config or as a filter of the chain), with the
/// environment variables its VM gets.
fn wasm_configurations<'v>(value: &'v Value, out: &mut Vec<(&'v str, Vec<String>)>) {
    match value {
        Value::Object(fields) => {
            let is_wasm = fields
                .get("@type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.ends_with("envoy.extensions.filters.http.wasm.v3.Wasm"));
            let config = &value["config"];
            if let (true, Some(text)) = (is_wasm, config["configuration"]["value"].as_str()) {
                let env = &config["vm_config"]["environment_variables"];
                let mut vm_env = names(&env["host_env_keys"], |k| k);
                let values = env["key_values"].as_object().into_iter().flatten();
                vm_env.extend(values.map(|(name, _)| name.clone()));
                out.push((text, vm_env));
            }
            for field in fields.values() {
                wasm_configurations(field, out);
            }
        }
        Value::Array(items) => items.iter().for_each(|v| wasm_configurations(v, out)),
        _ => {}
    }
}

/// A filter config has `orgs`; a sidecar config `pools`.
fn kind_of(config: &Value) -> Option<Kind> {
    if config.get("orgs").is_some() {
        Some(Kind::Filter)
    } else if config.get("pools").is_some() {
        Some(Kind::Sidecar)
    } else {
        None
    }
}

fn describe_filter(config: &Config) -> String {
    let directory = config.directory();
    let keys: usize = config
        .orgs
        .iter()
        .flat_map(|o| &o.workspaces)
        .flat_map(|w| &w.projects)
        .map(|p| p.keys.len())
        .sum();
    let mut routes: Vec<String> = config
        .routes
        .by_name
        .iter()
        .map(|(name, r)| format!("{name}: {:?} {}%", r.mode, r.rollout_percent))
        .collect();
    routes.push(format!("others: {:?}", config.routes.default.mode));
    format!(
        "filter config, {} orgs, {keys} keys ({} key hashes), routes [{}], {}",
        config.orgs.len(),
        directory.len(),
        routes.join(", ").to_lowercase(),
        describe_prediction(&config.prediction)
    )
}

fn describe_sidecar(config: &SidecarConfig) -> String {
    let pools: Vec<&str> = config.pools.iter().map(|p| p.model.as_str()).collect();
    format!(
        "sidecar config, policy {}, pools [{}], {}",
        config.policy,
        pools.join(", "),
        describe_prediction(&config.prediction)
    )
}

/// What a request without an output limit is reserved for.
fn describe_prediction(p: &PredictionConfig) -> String {
    if !p.enabled {
        return "output prediction off".into();
    }
    format!(
        "output prediction p{} (half-life {} samples, floor {}, initial {} until {} samples)",
        p.quantile * 100.0,
        p.half_life_samples,
        p.floor,
        p.initial,
        p.min_samples
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    fn filter(keys: &str) -> String {
        format!(
            "orgs:\n- id: acme\n  workspaces:\n  - id: w\n    projects:\n    - id: p\n      keys:\n{keys}"
        )
    }

    /// The report's lines of `verdict`.
    fn lines(text: &str, verdict: Verdict) -> Vec<String> {
        let report = check("weir.yaml", text, Kind::Auto);
        let of = report.iter().filter(|l| l.verdict == verdict);
        of.map(ToString::to_string).collect()
    }

    /// The ok lines, there being no error.
    fn passed(text: &str) -> Vec<String> {
        let errors = lines(text, Verdict::Error);
        assert!(errors.is_empty(), "{errors:?}");
        lines(text, Verdict::Ok)
    }

    fn error_of(text: &str) -> String {
        let errors = lines(text, Verdict::Error);
        assert!(!errors.is_empty(), "no error in {text}");
        errors.join("\n")
    }

    #[test]
    fn each_class_of_mistake_is_caught_with_its_field() {
        let key = format!("      - {{id: k, sha256: {KEY}}}\n");
        let report = passed(&filter(&key));
        assert!(
            report[0]
                .contains("output prediction p90 (half-life 200 samples, floor 16, initial 1024"),
            "{report:?}"
        );
        let off = format!("{}prediction: {{enabled: false}}\n", filter(&key));
        assert!(passed(&off)[0].contains("output prediction off"));
        let cases = [
            (
                filter(&format!("      - {{id: k, sha256: {KEY}, limitz: {{}}}}\n")),
                "unknown field `limitz`",
            ),
            (
                filter(&format!("      - {{id: k, sha256: {KEY}}}\n      - {{id: j, sha256: {KEY}}}\n")),
                "orgs[0].workspaces[0].projects[0].keys[1].sha256: duplicate key hash",
            ),
            (
                filter(&format!("      - {{id: k, sha256: {KEY}, limits: {{requests_per_minute: 0}}}}\n")),
                "keys[0].limits.requests_per_minute: 0 would reject every request",
            ),
            (
                filter(&format!(
                    "      - {{id: k, sha256: {KEY}, limits: {{max_output_tokens: 10}}, policy: {{default_max_tokens: 20}}}}\n"
                )),
                "over the max_output_tokens",
            ),
            (
                filter(&format!("      - {{id: k, sha256: {KEY}, limits: {{requests_per_minute: many}}}}\n")),
                "keys[0].limits.requests_per_minute: must be a non-negative integer, not \"many\"",
            ),
            (
                "pools:\n- model: m\n  replicas: [http://e:8000]\n  replicaz: 2\nsigning: {secret_env: S}\n".into(),
                "unknown field `replicaz`",
            ),
            ("pools: []\nsigning: {secret_env: S}\n".into(), "at least one pool"),
            (
                format!("{}prediction: {{quantile: 1.5}}\n", filter(&key)),
                "prediction.quantile: must be between 0.5 and 0.999",
            ),
            (
                "pools:\n- model: m\n  replicas: [http://e:8000]\nsigning: {secret_env: S}\nprediction: {floor: 0}\n".into(),
                "prediction.floor: must be at least 1",
            ),
        ];
        for (text, expected) in cases {
            let error = error_of(&text);
            assert!(error.contains(expected), "expected {expected:?} in {error}");
        }
    }

    #[test]
    fn manifests_are_checked_for_the_configs_they_carry() {
        let plugin = format!(
            "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\nmetadata: {{name: weir}}\nspec:\n  pluginConfig:\n    orgs:\n    - id: acme\n      workspaces: [{{id: w, projects: [{{id: p, keys: [{{id: k, sha256: {KEY}}}]}}]}}]\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: sidecar}}\ndata:\n  sidecar.yaml: |\n    pools:\n    - model: m\n      replicas: [http://e:8000]\n    signing: {{secret_file: /run/secrets/s}}\n  other: not a config\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: x}}\n"
        );
        let report = passed(&plugin);
        assert_eq!(report.len(), 2, "{report:?}");
        assert!(
            report[0].contains("WasmPlugin weir pluginConfig): filter config, 1 orgs, 1 keys"),
            "{report:?}"
        );
        assert!(report[1].contains("ConfigMap sidecar sidecar.yaml): sidecar config"));
        let broken = plugin.replace("replicas: [http://e:8000]", "replicas: []");
        assert!(error_of(&broken).contains("pools[0].replicas: at least one replica"));
        assert_eq!(
            lines("kind: Service\n", Verdict::Note),
            ["note  weir.yaml: no weir config in it (placeholders checked)"]
        );
    }

    #[test]
    fn inputs_without_a_config_are_notes_unless_none_has_one() {
        // Before, one file of manifests without a weir config failed the check.
        let input = |name: &str, text: &str| (name.to_owned(), Ok(text.to_owned()));
        let report = |inputs| {
            let lines = check_all(inputs, Kind::Auto);
            lines.iter().map(ToString::to_string).collect::<Vec<_>>()
        };
        let config = "orgs: []\nroutes: {default: {mode: enforce}}\n";
        let two = report(vec![
            input("service.yaml", "kind: Service\n"),
            input("weir.yaml", config),
        ]);
        assert_eq!(
            two[0],
            "note  service.yaml: no weir config in it (placeholders checked)"
        );
        assert!(
            two[1].starts_with("ok    weir.yaml: filter config"),
            "{two:?}"
        );
        assert_eq!(two.len(), 2, "{two:?}");
        // Pointed at the wrong files, a check fails.
        let none = report(vec![
            input("a.yaml", "kind: Service\n"),
            input("b.yaml", "kind: Secret\n"),
        ]);
        assert_eq!(
            none.last().map(String::as_str),
            Some(
                "error no weir config in any of these 2 inputs (a filter config has `orgs`, a \
                 sidecar config `pools`)"
            )
        );
        let one = report(vec![input("a.yaml", "kind: Service\n")]);
        assert_eq!(
            one,
            [
                "error a.yaml: no weir config in it (a filter config has `orgs`, a sidecar config \
              `pools`)"
            ]
        );
        // A broken input is its own error, and not one with no config.
        let broken = report(vec![input("a.yaml", "orgs: [\n")]);
        assert_eq!(broken.len(), 1, "{broken:?}");
    }

    #[test]
    fn a_bare_off_in_a_manifest_s_config_is_refused_as_kubernetes_reads_it() {
        // Before, `ok`: Kubernetes hands the filter `"mode": false`, which it refuses.
        let plugin = format!(
            "kind: WasmPlugin\nmetadata: {{name: weir}}\nspec:\n  pluginConfig:\n    \
             orgs: [{{id: acme, workspaces: [{{id: w, projects: [{{id: p, keys: [{{id: k, sha256: {KEY}}}]}}]}}]}}]\n    \
             routes:\n      by_name:\n        llm-api: {{mode: off}}\n"
        );
        let error = error_of(&plugin);
        assert_eq!(
            error,
            "error weir.yaml: document 1 (WasmPlugin weir pluginConfig): \
             routes.by_name.llm-api.mode: quote it: \"off\" — Kubernetes reads a bare off as false"
        );
        assert!(passed(&plugin.replace("mode: off", "mode: \"off\""))[0].contains("llm-api: off"));
        let policy = "kind: EnvoyExtensionPolicy\nmetadata: {name: weir}\nspec:\n  wasm:\n  - config:\n      \
                      orgs: []\n      routes: {default: {mode: Off}}\n";
        assert!(
            error_of(policy).contains("wasm[0].config): routes.default.mode: quote it: \"Off\""),
            "{}",
            error_of(policy)
        );
        // A config file of its own, and a ConfigMap's, are read by weir: YAML 1.2, `off` is "off".
        assert!(passed("orgs: []\nroutes: {default: {mode: off}}\n")[0].contains("others: off"));
    }

    #[test]
    fn the_shipped_manifests_are_checked_whichever_variant_carries_the_filter() {
        for (file, text, carrier) in [
            (
                "istio/wasmplugin.yaml",
                include_str!("../../deploy/istio/wasmplugin.yaml"),
                "WasmPlugin weir",
            ),
            (
                "istio/envoyfilter.yaml",
                include_str!("../../deploy/istio/envoyfilter.yaml"),
                "EnvoyFilter weir",
            ),
            (
                "envoy-gateway/extensionpolicy.yaml",
                include_str!("../../deploy/envoy-gateway/extensionpolicy.yaml"),
                "EnvoyExtensionPolicy weir",
            ),
        ] {
            let report = passed(text);
            assert_eq!(report.len(), 1, "{file}: {report:?}");
            assert!(
                report[0].contains(carrier) && report[0].contains("filter config, 1 orgs"),
                "{file}: {report:?}"
            );
            // Its placeholders, left for whoever deploys it to fill in: warned of.
            let warnings = lines(text, Verdict::Warn).join("\n");
            for placeholder in [
                "a placeholder digest",
                "keys[0].sha256: 64 zeros",
                "an example.com registry",
            ] {
                assert!(warnings.contains(placeholder), "{file}: {warnings}");
            }
            // The same manifest passing another variable into the VM than the one the config
            // names: the filter would not start ("$WEIR_SIGNING_SECRET is not set in the VM").
            let unpassed = text
                .replace("WEIR_SIGNING_SECRET", "SOME_OTHER_VARIABLE")
                .replace(
                    "secret_env: SOME_OTHER_VARIABLE",
                    "secret_env: WEIR_SIGNING_SECRET",
                )
                .replace(
                    "\"secret_env\": \"SOME_OTHER_VARIABLE\"",
                    "\"secret_env\": \"WEIR_SIGNING_SECRET\"",
                );
            let error = error_of(&unpassed);
            assert!(
                error.contains("$WEIR_SIGNING_SECRET is not passed into the filter's VM"),
                "{file}: {error}"
            );
        }
    }
}

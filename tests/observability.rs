//! What an operator sees, checked where they see it: a real Prometheus running the shipped
//! scrape config scrapes the whole stack (Envoy with the filter, the sidecar, the simulators)
//! while `weir-bench --endpoint` drives the noisy-neighbour scenario through it. Every query of
//! the shipped Grafana dashboard returns data; the live fairness index tells the fair policy
//! from FIFO; the GenAI instruments carry the OpenTelemetry conventions' names, units,
//! attributes and buckets, on `/metrics` and over OTLP; and no label anywhere holds a key, a
//! prompt or a tenant below the configured depth, with 1,000 tenants as with ten.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use futures::StreamExt;
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use prost::Message;
use serde_json::{Value, json};
use weir_e2e::prometheus::Prometheus;
use weir_e2e::{
    Envoy, Sidecar, Sim, api_key, bench_bin, chat_body, post_json, read_http_request,
    workspace_root,
};

/// The noisy-neighbour scenario's tenants, each an org of its own (fair share is divided among
/// orgs), plus a second heavy tenant so that two tenants are backlogged at once through the
/// flood: the fairness index compares the service of backlogged tenants, so it needs two.
const TENANTS: [&str; 5] = ["small-1", "small-2", "small-3", "noisy", "heavy"];
const HEAVY: &str = "
  - name: heavy
    arrival: {kind: closed, concurrency: 10}
    prompt_tokens: 1500
    output_tokens: 500
    stream: false
    start_s: 4
    stop_s: 24
";

fn weir_config() -> Value {
    let orgs: Vec<Value> = TENANTS
        .iter()
        .map(|t| {
            json!({"id": t, "workspaces": [{"id": "ws", "projects": [{"id": "proj",
                "keys": [api_key(t)]}]}]})
        })
        .collect();
    json!({
        "orgs": orgs,
        "models": {"tiny": {"max_context_tokens": 4096}},
        "prices": {"currency": "USD", "default": {"input": 1.0, "output": 2.0}},
    })
}

/// Two simulated engines as the scenario's stack runs them, a sidecar with `policy`, Envoy.
struct Stack {
    sims: [Sim; 2],
    sidecar: Sidecar,
    envoy: Envoy,
}

impl Stack {
    fn start(policy: &str) -> Stack {
        let sim = || Sim::start(&["--preset", "tiny", "--time-scale", "10"]);
        let sims = [sim(), sim()];
        let sidecar = Sidecar::start(json!({
            "policy": policy,
            "metrics": {"fairness_window_ms": 4000},
            "pools": [{"model": "tiny", "replicas": [sims[0].url, sims[1].url]}],
        }));
        let envoy = Envoy::start(&weir_config(), sidecar.port, sidecar.port);
        sidecar.wait_for_probes(2);
        Stack {
            sims,
            sidecar,
            envoy,
        }
    }

    /// Points the shipped config's three jobs at this stack.
    async fn scraped_by(&self, prometheus: &Prometheus) {
        let addr = |url: &str| url.trim_start_matches("http://").to_owned();
        prometheus.targets("weir-sidecar", &[&addr(&self.sidecar.admin)]);
        prometheus.targets("weir-envoy", &[&addr(&self.envoy.admin)]);
        let engines: Vec<String> = self.sims.iter().map(|s| addr(&s.url)).collect();
        let engines: Vec<&str> = engines.iter().map(String::as_str).collect();
        prometheus.targets("weir-engine", &engines);
        prometheus.wait_for_targets(4).await;
    }

    /// Runs the noisy-neighbour scenario (with the second heavy tenant) through Envoy.
    fn drive(&self, dir: &Path) {
        let shipped =
            std::fs::read_to_string(workspace_root().join("bench/scenarios/noisy-neighbour.yaml"))
                .unwrap();
        // The flood runs 20 s instead of 8, so that several whole fairness windows fall in it.
        let longer = shipped
            .replace("duration_s: 16", "duration_s: 28")
            .replace("stop_s: 12", "stop_s: 24");
        assert_ne!(longer, shipped, "the scenario's flood is stretched");
        std::fs::write(dir.join("scenario.yaml"), format!("{longer}{HEAVY}")).unwrap();
        let keys: String = TENANTS.iter().map(|t| format!("{t} = key-{t}\n")).collect();
        std::fs::write(dir.join("keys.txt"), keys).unwrap();
        let out = Command::new(bench_bin())
            .args([
                "scenario.yaml",
                "--endpoint",
                &self.envoy.url,
                "--model",
                "tiny",
            ])
            .args(["--keys-file", "keys.txt", "--out", "out"])
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn instance(&self) -> String {
        self.sidecar.admin.trim_start_matches("http://").to_owned()
    }
}

/// The fairness index of each window in which at least two tenants were backlogged (a gauge
/// holds a window's value until the next closes: consecutive equal samples are one window),
/// and their median.
async fn fairness(prometheus: &Prometheus, instance: &str) -> (f64, Vec<f64>) {
    let expr = format!(
        "weir_fairness_index{{instance=\"{instance}\"}} and on(instance, pool) \
         weir_fairness_backlogged_tenants{{instance=\"{instance}\"}} >= 2"
    );
    let result = prometheus.query_range(&expr, 90).await;
    assert_eq!(result.len(), 1, "{expr}: {result:?}");
    let mut windows: Vec<f64> = Vec::new();
    for sample in result[0]["values"].as_array().unwrap() {
        let v: f64 = sample[1].as_str().unwrap().parse().unwrap();
        if windows.last() != Some(&v) {
            windows.push(v);
        }
    }
    let mut sorted = windows.clone();
    sorted.sort_by(f64::total_cmp);
    (sorted[sorted.len() / 2], windows)
}

/// Every PromQL query in the dashboard, with its variables as Grafana's "All" sends them.
fn dashboard_queries() -> (Vec<String>, Vec<(String, String)>) {
    let text = std::fs::read_to_string(workspace_root().join("deploy/grafana/weir.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                exprs.push(
                    expr.replace("$__rate_interval", "1m")
                        .replace("$pool", ".*")
                        .replace("$tenant", ".*")
                        .replace("$route", ".*"),
                );
            }
        }
    }
    // `label_values(metric, label)`: Grafana's variable queries.
    let mut variables = Vec::new();
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        let query = var["query"].as_str().or(var["query"]["query"].as_str());
        if let Some(args) = query.and_then(|q| q.strip_prefix("label_values(")) {
            let (metric, label) = args.trim_end_matches(')').split_once(',').unwrap();
            variables.push((metric.trim().to_owned(), label.trim().to_owned()));
        }
    }
    (exprs, variables)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_has_data_and_the_fairness_index_tells_fair_from_fifo() {
    let prometheus = Prometheus::start();
    let dir = tempfile::tempdir().unwrap();

    let fair = Stack::start("fair");
    fair.scraped_by(&prometheus).await;
    fair.drive(dir.path());
    // The last window closes and is scraped.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (fair_index, fair_windows) = fairness(&prometheus, &fair.instance()).await;

    let (exprs, variables) = dashboard_queries();
    assert!(exprs.len() > 30, "{} queries", exprs.len());
    let mut empty = Vec::new();
    // Over the run, as the dashboard's panels ask (a series gone since, such as an idle
    // tenant's backlogged ratio, still shows where it was).
    for expr in &exprs {
        if prometheus.query_range(expr, 60).await.is_empty() {
            empty.push(expr.clone());
        }
    }
    for (metric, label) in &variables {
        if prometheus.label_values(metric, label).await.is_empty() {
            empty.push(format!("label_values({metric}, {label})"));
        }
    }
    assert!(empty.is_empty(), "queries without data: {empty:#?}");
    println!(
        "dashboard: {} queries and {} variables, every one with data",
        exprs.len(),
        variables.len()
    );
    no_label_holds_a_key_a_prompt_or_a_key_level_tenant(&prometheus).await;
    drop(fair);

    let fifo = Stack::start("fifo");
    fifo.scraped_by(&prometheus).await;
    fifo.drive(dir.path());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (fifo_index, fifo_windows) = fairness(&prometheus, &fifo.instance()).await;
    println!(
        "fairness index under the noisy-neighbour scenario, median of the 4 s windows with 2+ \
         tenants backlogged: fair {fair_index:.3} {fair_windows:.3?}, fifo {fifo_index:.3} \
         {fifo_windows:.3?}"
    );
    assert!(fair_index >= 0.9, "fair: {fair_index}");
    assert!(
        fifo_index < fair_index - 0.1,
        "fifo {fifo_index} vs fair {fair_index}"
    );
}

/// Every series Prometheus holds: tenant labels are orgs (the default depth), no label value
/// holds a key (`key-…`) or the scenario's prompt text.
async fn no_label_holds_a_key_a_prompt_or_a_key_level_tenant(prometheus: &Prometheus) {
    let series = prometheus.all_series().await;
    assert!(series.len() > 100, "{} series", series.len());
    let mut tenants = BTreeSet::new();
    for labels in &series {
        for (name, value) in labels {
            let value = value.as_str().unwrap_or_default();
            assert!(!value.contains("key-"), "{name}={value} names a key");
            // weir-bench's prompts are its filler word, repeated.
            assert!(
                !value.contains("word word"),
                "{name}={value} holds prompt text"
            );
            if name == "tenant" || name == "weir_tenant" || name == "exported_tenant" {
                tenants.insert(value.to_owned());
            }
        }
    }
    let orgs: BTreeSet<String> = TENANTS.iter().map(|t| (*t).to_owned()).collect();
    assert!(
        !tenants.is_empty() && tenants.is_subset(&orgs),
        "{tenants:?}"
    );
}

/// The GenAI conventions (v1.41.0, docs/gen-ai/gen-ai-metrics.md) weir implements: name,
/// instrument, unit, the attributes every data point carries, and the recommended buckets.
struct Convention {
    name: &'static str,
    unit: &'static str,
    attributes: &'static [&'static str],
    buckets: &'static [f64],
}

const SERVER_ATTRIBUTES: &[&str] = &[
    "gen_ai.operation.name",
    "gen_ai.provider.name",
    "gen_ai.request.model",
];
const CONVENTIONS: [Convention; 4] = [
    Convention {
        name: "gen_ai.client.token.usage",
        unit: "{token}",
        attributes: &[
            "gen_ai.operation.name",
            "gen_ai.provider.name",
            "gen_ai.request.model",
            "gen_ai.token.type",
        ],
        buckets: &[
            1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
            4194304.0, 16777216.0, 67108864.0,
        ],
    },
    Convention {
        name: "gen_ai.server.request.duration",
        unit: "s",
        attributes: SERVER_ATTRIBUTES,
        buckets: &[
            0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
        ],
    },
    Convention {
        name: "gen_ai.server.time_to_first_token",
        unit: "s",
        attributes: SERVER_ATTRIBUTES,
        buckets: &[
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0,
        ],
    },
    Convention {
        name: "gen_ai.server.time_per_output_token",
        unit: "s",
        attributes: SERVER_ATTRIBUTES,
        buckets: &[
            0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
        ],
    },
];

impl Convention {
    /// Its name in Prometheus: `.` as `_`, and seconds as a `_seconds` suffix (the
    /// OpenTelemetry-to-Prometheus mapping; `{token}` is an annotation and leaves no suffix).
    fn prometheus_name(&self) -> String {
        let base = self.name.replace('.', "_");
        match self.unit {
            "s" => format!("{base}_seconds"),
            _ => base,
        }
    }
}

/// An OTLP/HTTP collector stand-in: answers every export with 200 and hands its body over.
fn otlp_receiver() -> (String, mpsc::Receiver<ExportMetricsServiceRequest>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut conn = conn;
                while let Some((head, body)) = read_http_request(&mut reader) {
                    assert!(head.starts_with("POST /v1/metrics "), "{head}");
                    assert!(
                        head.to_ascii_lowercase()
                            .contains("content-type: application/x-protobuf"),
                        "{head}"
                    );
                    let _ = tx.send(ExportMetricsServiceRequest::decode(&body[..]).unwrap());
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\n\
                              content-length: 0\r\n\r\n";
                    if conn.write_all(ok.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, rx)
}

fn string_value(v: &opentelemetry_proto::tonic::common::v1::AnyValue) -> String {
    match &v.value {
        Some(AnyValue::StringValue(s)) => s.clone(),
        other => format!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn genai_metrics_follow_the_conventions_on_metrics_and_over_otlp_and_labels_stay_bounded() {
    let (collector, exports) = otlp_receiver();
    let sim = Sim::start_tiny_fast(&[]);
    let sidecar = Sidecar::start(json!({
        // Short fairness windows: both snapshots below come after idle ones, in which no
        // tenant has a backlogged ratio, so the two differ only in the keys that sent.
        "metrics": {"otlp": {"endpoint": collector, "interval_ms": 500}, "fairness_window_ms": 200},
        "pools": [{"model": "tiny", "replicas": [sim.url]}],
    }));
    // 1,000 tenants: ten orgs of 100 keys each.
    let orgs: Vec<Value> = (0..10)
        .map(|o| {
            let keys: Vec<Value> = (0..100).map(|k| api_key(&format!("o{o}k{k}"))).collect();
            json!({"id": format!("org{o}"), "workspaces": [{"id": "ws", "projects": [{"id": "proj",
                "keys": keys}]}]})
        })
        .collect();
    let envoy = Envoy::start(
        &json!({"orgs": orgs, "models": {"tiny": {"max_context_tokens": 4096}}}),
        sidecar.port,
        sidecar.port,
    );
    sidecar.wait_for_probes(1);
    let url = format!("{}/v1/chat/completions", envoy.url);
    let send = |keys: Vec<String>| {
        let url = url.clone();
        async move {
            let requests = keys.into_iter().map(|key| {
                let url = url.clone();
                async move {
                    let body =
                        chat_body("tiny", "canary-prompt-31337 hello", json!({"stream": true}));
                    let resp = post_json(&url, Some(&key), body.to_string(), &[]).await;
                    assert_eq!(resp.status(), 200);
                    resp.text().await.unwrap();
                }
            });
            futures::stream::iter(requests)
                .buffer_unordered(16)
                .collect::<Vec<()>>()
                .await;
        }
    };
    let series = |text: &str| text.lines().filter(|l| !l.starts_with('#')).count();

    // Ten keys of each org first (the same traffic shape), then all 1,000.
    send(
        (0..10)
            .flat_map(|o| (0..10).map(move |k| format!("o{o}k{k}")))
            .collect(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let at_ten = sidecar.metrics().await;
    send(
        (0..10)
            .flat_map(|o| (0..100).map(move |k| format!("o{o}k{k}")))
            .collect(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let at_thousand = sidecar.metrics().await;
    println!(
        "sidecar series: {} with 100 tenants active, {} with 1,000 (10 orgs, tenant_depth org)",
        series(&at_ten),
        series(&at_thousand)
    );
    let names = |text: &str| -> BTreeSet<String> {
        (text.lines())
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| Some(l.rsplit_once(' ')?.0.to_owned()))
            .collect()
    };
    let grown: Vec<String> = names(&at_thousand)
        .difference(&names(&at_ten))
        .cloned()
        .collect();
    assert!(
        grown.is_empty(),
        "series that came with more keys: {grown:#?}"
    );
    for text in [&at_thousand, &envoy_stats(&envoy).await] {
        assert!(!text.contains("canary-prompt"), "prompt text in metrics");
        assert!(!text.contains("key-"), "a key in metrics");
        assert!(!text.contains("/ws/"), "a tenant below its org in metrics");
    }

    // The conventions on /metrics: type, unit, buckets and attributes.
    for c in &CONVENTIONS {
        let name = c.prometheus_name();
        assert!(
            at_thousand.contains(&format!("# TYPE {name} histogram\n")),
            "{name}"
        );
        if c.unit == "s" {
            assert!(
                at_thousand.contains(&format!("# UNIT {name} seconds\n")),
                "{name}"
            );
        }
        let bucket = format!("{name}_bucket{{");
        let line = at_thousand
            .lines()
            .find(|l| l.starts_with(&bucket) && l.contains("gen_ai_operation_name=\"chat\""))
            .unwrap_or_else(|| panic!("no {name} series"));
        for attribute in c.attributes {
            assert!(
                line.contains(&format!("{}=\"", attribute.replace('.', "_"))),
                "{attribute} on {line}"
            );
        }
        assert!(line.contains("gen_ai_provider_name=\"vllm\""), "{line}");
        assert!(line.contains("gen_ai_request_model=\"tiny\""), "{line}");
        // A bucket line as (its series' labels without `le`, its `le`).
        let split = |l: &str| -> Option<(String, String)> {
            let (before, rest) = l.split_once("le=\"")?;
            let (le, after) = rest.split_once('"')?;
            Some((
                format!("{before}{}", after.split_once(' ')?.0),
                le.to_owned(),
            ))
        };
        let (series, _) = split(line).unwrap();
        let le: Vec<f64> = (at_thousand.lines())
            .filter_map(split)
            .filter(|(s, le)| *s == series && le != "+Inf")
            .map(|(_, le)| le.parse().unwrap())
            .collect();
        assert_eq!(le, c.buckets, "{name}'s buckets");
    }

    // The same instruments over OTLP, under the conventions' own names and units.
    let mut seen: BTreeMap<String, (String, Vec<f64>, BTreeSet<String>)> = BTreeMap::new();
    let mut service = String::new();
    while seen.len() < 40 {
        let export = exports
            .recv_timeout(Duration::from_secs(10))
            .expect("an OTLP export");
        for resource in export.resource_metrics {
            for attr in resource.resource.iter().flat_map(|r| &r.attributes) {
                if attr.key == "service.name" {
                    service = attr.value.as_ref().map(string_value).unwrap_or_default();
                }
            }
            for metric in resource.scope_metrics.iter().flat_map(|s| &s.metrics) {
                let (bounds, keys) = match &metric.data {
                    Some(Data::Histogram(h)) => (
                        h.data_points
                            .first()
                            .map(|p| p.explicit_bounds.clone())
                            .unwrap_or_default(),
                        h.data_points
                            .iter()
                            .flat_map(|p| &p.attributes)
                            .map(|a| a.key.clone())
                            .collect(),
                    ),
                    _ => (Vec::new(), BTreeSet::new()),
                };
                seen.insert(metric.name.clone(), (metric.unit.clone(), bounds, keys));
            }
        }
        if CONVENTIONS.iter().all(|c| seen.contains_key(c.name)) && seen.contains_key("weir.tokens")
        {
            break;
        }
    }
    assert_eq!(service, "weir-sidecar");
    for c in &CONVENTIONS {
        let (unit, bounds, keys) = seen
            .get(c.name)
            .unwrap_or_else(|| panic!("{} not exported: {:?}", c.name, seen.keys()));
        assert_eq!(unit, c.unit, "{}", c.name);
        assert_eq!(bounds, c.buckets, "{}", c.name);
        for attribute in c.attributes {
            assert!(keys.contains(*attribute), "{} lacks {attribute}", c.name);
        }
    }
    assert!(
        seen.contains_key("weir.tokens"),
        "weir's own: {:?}",
        seen.keys()
    );
}

async fn envoy_stats(envoy: &Envoy) -> String {
    reqwest::get(format!("{}/stats/prometheus", envoy.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

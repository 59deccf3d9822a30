//! `deploy/` is what runs. `kubectl kustomize deploy/k8s` is rendered offline (kubectl 1.37 from
//! the venv) and read as Kubernetes would apply it; the real sidecar runs on the rendered
//! ConfigMap's config with the rendered Secret's signing secret, and real Envoy runs the filter
//! with the exact `pluginConfig` of `deploy/istio/wasmplugin.yaml`, delivered over ECDS in the
//! shape istiod gives it (the resource `<namespace>.<name>`, `root_id` = `pluginName`, an empty
//! `vm_id`, the failure policy of `failStrategy`, the host variables of `vmConfig.env`). As
//! shipped, at the rollout runbook's first step (`off`), every caller is served; then the
//! runbook's `enforce` is pushed over ECDS and the README's SDK example — a streamed chat
//! completion — goes through gateway, sidecar and engine.
//!
//! What is not the shipped files', and why:
//! - the pool's engines are two local simulators on one port, its headless Service's name
//!   resolved to them from a file (`--resolve-from`) rather than the cluster's DNS;
//! - the sidecar listens on loopback ports of its own, and its ledger and the Secret's file are
//!   in a temporary directory: where the pod's network and volumes put them in a cluster (the
//!   first test checks the Deployment mounts them where the config reads them);
//! - the key's hash: the shipped one is a placeholder (all zeros, no key's hash), swapped for a
//!   test key's;
//! - the signing secret: the Secret's is a public placeholder, which the sidecar and the filter
//!   both refuse to start with (a test below shows it); the harness's random one stands in for
//!   the operator's, in the Secret's file and the gateway's environment alike;
//! - the gateway's routes: the Envoy template's catch-all route is named after the
//!   VirtualService's route that `routes.by_name` names (`llm-api`), and its `/alt/` route after
//!   the one it does not (`status-page`), both read from `deploy/istio/virtualservice.yaml` — as
//!   Istio names Envoy routes after VirtualService routes. The shipped files keep the names a
//!   platform's VirtualService would use; the template's (`llm-api`, `alt`) are the demo's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use weir_e2e::ecds::{EcdsEnvoy, Plugin};
use weir_e2e::{
    Envoy, EnvoyOptions, Sidecar, Sim, TINY_FAST, api_key, kubectl_bin, sidecar_bin,
    signing_secret, sim_bin, wait_for, workspace_root,
};

/// Every document of a YAML stream, as JSON values.
fn yaml_docs(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// The documents of a file of the repository.
fn file_docs(path: &str) -> Vec<Value> {
    yaml_docs(&std::fs::read_to_string(workspace_root().join(path)).unwrap())
}

/// `kubectl kustomize deploy/k8s`: what `kubectl apply -k deploy/k8s` would apply.
fn rendered() -> Vec<Value> {
    let out = Command::new(kubectl_bin())
        .args(["kustomize", "deploy/k8s"])
        .current_dir(workspace_root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/k8s: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    yaml_docs(std::str::from_utf8(&out.stdout).unwrap())
}

/// The only document of `kind` (and `name`, when given).
fn the<'a>(docs: &'a [Value], kind: &str, name: Option<&str>) -> &'a Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == kind && name.is_none_or(|n| d["metadata"]["name"] == n))
        .collect();
    assert_eq!(found.len(), 1, "one {kind} {name:?}, found {}", found.len());
    found[0]
}

fn port_of(addr: &Value) -> u64 {
    addr.as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// What the rendered base says, and the one container of its Deployment.
struct Base {
    docs: Vec<Value>,
    /// The ConfigMap's `sidecar.yaml`.
    sidecar_config: Value,
    /// The Secret's `signing-secret`: a placeholder.
    signing_secret: String,
}

impl Base {
    fn render() -> Base {
        let docs = rendered();
        let config_map = the(&docs, "ConfigMap", None);
        let sidecar_config =
            serde_yaml_ng::from_str(config_map["data"]["sidecar.yaml"].as_str().unwrap()).unwrap();
        let secret = the(&docs, "Secret", None);
        let signing_secret = secret["stringData"]["signing-secret"]
            .as_str()
            .unwrap()
            .to_owned();
        Base {
            docs,
            sidecar_config,
            signing_secret,
        }
    }

    fn deployment(&self) -> &Value {
        the(&self.docs, "Deployment", None)
    }

    fn container(&self) -> &Value {
        let containers = self.deployment()["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap();
        assert_eq!(containers.len(), 1);
        &containers[0]
    }

    /// Where the container mounts the volume whose source has `field` (`configMap`, `secret`,
    /// `persistentVolumeClaim`), and that source.
    fn mount(&self, field: &str) -> (String, &Value) {
        let pod = &self.deployment()["spec"]["template"]["spec"];
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v.get(field).is_some())
            .unwrap_or_else(|| panic!("no {field} volume"));
        let mount = self.container()["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == volume["name"])
            .unwrap();
        (
            mount["mountPath"].as_str().unwrap().to_owned(),
            &volume[field],
        )
    }

    /// The path a one-item volume (ConfigMap, Secret) puts its item at, and the item's key.
    fn item_path(&self, field: &str) -> (String, String) {
        let (dir, source) = self.mount(field);
        let items = source["items"].as_array().unwrap();
        assert_eq!(items.len(), 1, "{field}: one item mounted");
        (
            format!("{dir}/{}", items[0]["path"].as_str().unwrap()),
            items[0]["key"].as_str().unwrap().to_owned(),
        )
    }

    fn container_port(&self, name: &str) -> u64 {
        self.container()["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no container port {name}"))["containerPort"]
            .as_u64()
            .unwrap()
    }
}

#[test]
fn the_rendered_base_holds_every_kind_and_its_parts_agree() {
    let base = Base::render();
    let kinds: BTreeSet<&str> = base
        .docs
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    for kind in [
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "PrometheusRule",
        "PersistentVolumeClaim",
    ] {
        assert!(kinds.contains(kind), "{kind} missing from {kinds:?}");
    }
    let config = &base.sidecar_config;
    let container = base.container();

    // The config file is the ConfigMap's, at the path the sidecar is started with.
    let (config_path, key) = base.item_path("configMap");
    assert_eq!(container["args"], json!(["--config", config_path]));
    assert_eq!(key, "sidecar.yaml");
    let (_, source) = base.mount("configMap");
    assert_eq!(
        source["name"],
        the(&base.docs, "ConfigMap", None)["metadata"]["name"]
    );
    // The signing secret is read from the file the Secret is mounted as; the DSN is not mounted.
    let (secret_path, key) = base.item_path("secret");
    assert_eq!(config["signing"]["secret_file"], secret_path.as_str());
    assert_eq!(key, "signing-secret");
    // The ledger is on the claimed volume.
    let (ledger_dir, claim) = base.mount("persistentVolumeClaim");
    let ledger = config["ledger"].as_str().unwrap();
    assert!(ledger.starts_with(&format!("{ledger_dir}/")), "{ledger}");
    assert_eq!(
        claim["claimName"],
        the(&base.docs, "PersistentVolumeClaim", None)["metadata"]["name"]
    );
    assert_eq!(
        base.deployment()["spec"]["strategy"]["type"],
        "Recreate",
        "one SQLite writer"
    );

    // Ports: the config's, the container's, the Services'.
    let serving = port_of(&config["listen"]);
    let admin = port_of(&config["admin_listen"]);
    assert_eq!(base.container_port("http-serving"), serving);
    assert_eq!(base.container_port("http-admin"), admin);
    let service = the(&base.docs, "Service", Some("weir-sidecar-llama-3-1-8b"));
    assert_eq!(
        service["spec"]["ports"],
        json!([{"name": "http-serving", "port": serving, "targetPort": "http-serving", "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]),
        "the gateway's Service has the serving port only"
    );
    let metrics = the(
        &base.docs,
        "Service",
        Some("weir-sidecar-llama-3-1-8b-metrics"),
    );
    assert_eq!(metrics["spec"]["clusterIP"], "None");
    assert_eq!(metrics["spec"]["ports"][0]["targetPort"], "http-admin");
    let monitor = the(&base.docs, "ServiceMonitor", None);
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "http-admin");
    for (label, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(&metrics["metadata"]["labels"][label], value);
    }
    for (probe, path) in [("livenessProbe", "/health"), ("readinessProbe", "/ready")] {
        assert_eq!(
            container[probe]["httpGet"],
            json!({"path": path, "port": "http-admin"})
        );
    }
    let policy = the(&base.docs, "NetworkPolicy", None);
    let ports: Vec<&Value> = policy["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .map(|rule| &rule["ports"][0]["port"])
        .collect();
    assert_eq!(ports, [&json!("http-serving"), &json!("http-admin")]);
    // The serving port's peers are the gateways' pods in their namespace, each. Envoy Gateway
    // runs every Gateway's proxies in its own namespace, so its peer names the Gateway its
    // HTTPRoute attaches to by namespace and name: any other Gateway's proxies run there too.
    let peers = policy["spec"]["ingress"][0]["from"].as_array().unwrap();
    for peer in peers {
        assert!(
            peer["namespaceSelector"].is_object() && peer["podSelector"].is_object(),
            "{peer}"
        );
    }
    let route = the(
        &file_docs("deploy/envoy-gateway/extensionpolicy.yaml"),
        "HTTPRoute",
        None,
    )
    .clone();
    let parent = &route["spec"]["parentRefs"][0];
    let proxies = peers
        .iter()
        .find(|p| {
            p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                == parent["namespace"]
        })
        .expect("Envoy Gateway's namespace is a peer");
    let labels = &proxies["podSelector"]["matchLabels"];
    assert_eq!(
        labels["gateway.envoyproxy.io/owning-gateway-name"],
        parent["name"]
    );
    assert_eq!(
        labels["gateway.envoyproxy.io/owning-gateway-namespace"], parent["namespace"],
        "{proxies}"
    );

    // SIGKILL never lands before the drain and the ledger flush are done: preStop, the grace
    // period, the ended requests' records (2 s) and the flush (at most 5 s).
    let pod = &base.deployment()["spec"]["template"]["spec"];
    let grace_ms = pod["terminationGracePeriodSeconds"].as_u64().unwrap() * 1000;
    let pre_stop_ms = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap()
        * 1000;
    let drain_ms = config["shutdown_grace_ms"].as_u64().unwrap();
    assert!(
        grace_ms > pre_stop_ms + drain_ms + 2_000 + 5_000,
        "terminationGracePeriodSeconds {grace_ms} ms"
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"]["drop"], json!(["ALL"]));
}

/// The only document of `kind` in a file of the repository.
fn the_shipped(path: &str, kind: &str) -> Value {
    the(&file_docs(path), kind, None).clone()
}

/// The WasmPlugin of `deploy/istio/wasmplugin.yaml`.
fn wasm_plugin() -> Value {
    the_shipped("deploy/istio/wasmplugin.yaml", "WasmPlugin")
}

#[test]
fn the_envoyfilter_and_envoy_gateway_variants_carry_the_wasmplugins_configuration() {
    let plugin = wasm_plugin();
    let plugin_config = &plugin["spec"]["pluginConfig"];
    let filter = the_shipped("deploy/istio/envoyfilter.yaml", "EnvoyFilter");
    let extension = &filter["spec"]["configPatches"][0]["patch"]["value"];
    let name = format!(
        "{}.{}",
        plugin["metadata"]["namespace"].as_str().unwrap(),
        plugin["metadata"]["name"].as_str().unwrap()
    );
    assert_eq!(extension["name"], name.as_str());
    assert_eq!(
        filter["spec"]["configPatches"][1]["patch"]["value"]["name"],
        name.as_str()
    );
    let wasm = &extension["typed_config"]["config"];
    let configuration: Value =
        serde_json::from_str(wasm["configuration"]["value"].as_str().unwrap()).unwrap();
    assert_eq!(&configuration, plugin_config);
    assert_eq!(wasm["root_id"], plugin["spec"]["pluginName"]);
    assert_eq!(wasm["failure_policy"], plugin["spec"]["failStrategy"]);

    // Envoy Gateway's: the same but for `routes`, where the policy's attachment picks the routes.
    let policy = the_shipped(
        "deploy/envoy-gateway/extensionpolicy.yaml",
        "EnvoyExtensionPolicy",
    );
    assert_eq!(policy["spec"]["targetRefs"][0]["kind"], "HTTPRoute");
    let mut config = policy["spec"]["wasm"][0]["config"].clone();
    assert_eq!(config["routes"], json!({"default": {"mode": "off"}}));
    config["routes"] = plugin_config["routes"].clone();
    assert_eq!(&config, plugin_config);
}

/// The names of the VirtualService's http routes: the one `routes.by_name` configures, and the
/// one it leaves to be ignored.
fn virtual_service_routes(plugin_config: &Value) -> (String, String) {
    let service = the_shipped("deploy/istio/virtualservice.yaml", "VirtualService");
    let routes = service["spec"]["http"].as_array().unwrap();
    let names: Vec<&str> = routes.iter().map(|r| r["name"].as_str().unwrap()).collect();
    for r in routes {
        for m in r["match"].as_array().unwrap() {
            assert!(
                m.get("name").is_none(),
                "a named match renames the Envoy route: {m}"
            );
        }
    }
    let by_name: Vec<&String> = plugin_config["routes"]["by_name"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(by_name.len(), 1, "{by_name:?}");
    assert!(
        names.contains(&by_name[0].as_str()),
        "routes.by_name names a VirtualService route: {by_name:?} in {names:?}"
    );
    let ignored: Vec<&&str> = names.iter().filter(|n| **n != by_name[0]).collect();
    assert_eq!(ignored.len(), 1, "{names:?}");
    (by_name[0].clone(), (*ignored[0]).to_owned())
}

/// The weir configuration as tested: the shipped `pluginConfig`, its placeholder key hash
/// swapped for the hash of `key-ci`.
fn plugin_config_with_test_key(plugin_config: &Value) -> Value {
    let mut config = plugin_config.clone();
    let key = &mut config["orgs"][0]["workspaces"][0]["projects"][0]["keys"][0];
    assert_eq!(
        key["sha256"],
        "0".repeat(64),
        "only a placeholder hash is swapped"
    );
    key["sha256"] = api_key(key["id"].as_str().unwrap())["sha256"].clone();
    config
}

#[test]
fn the_sidecar_image_has_trusted_roots_for_https_to_engines() {
    // The sidecar verifies an engine's certificate with the platform's trusted roots (and a
    // pool's own CA), read where rustls-platform-verifier reads them on Linux. The image is
    // `scratch`: without a bundle copied in, no engine with a public certificate (a hosted API,
    // say) ever passes its health check.
    let containerfile =
        std::fs::read_to_string(workspace_root().join("deploy/sidecar/Containerfile")).unwrap();
    let copies: Vec<&str> = containerfile
        .lines()
        .filter(|l| l.starts_with("COPY "))
        .collect();
    assert!(
        copies
            .iter()
            .any(|l| l.ends_with(" /etc/ssl/certs/ca-certificates.crt")),
        "no trusted roots in the image: {copies:?}"
    );
    // `cargo xtask image` puts the bundle in the build context, then starts the built image's
    // binary from the image's files and asks /health: without the roots it does not start.
}

#[test]
fn the_shipped_placeholder_secret_is_refused_by_the_sidecar_and_the_filter() {
    // Whoever knows the signing secret can claim any tenant to the sidecar, and the Secret's
    // value is in this repository: a cluster applied as shipped, with the same placeholder
    // copied into the gateway's environment, would serve whatever any workload signs with it.
    let base = Base::render();
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("signing-secret");
    std::fs::write(&secret_file, &base.signing_secret).unwrap();
    let mut config = base.sidecar_config.clone();
    config["signing"]["secret_file"] = secret_file.display().to_string().into();
    let config_file = dir.path().join("sidecar.json");
    std::fs::write(&config_file, config.to_string()).unwrap();
    let ledger = dir.path().join("ledger.sqlite");
    let mut child = weir_e2e::spawn_owned({
        let mut cmd = Command::new(sidecar_bin());
        cmd.arg("--config")
            .arg(&config_file)
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .arg("--ledger")
            .arg(&ledger)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        cmd
    });
    let status = wait_for(Duration::from_secs(10), || child.try_wait().ok().flatten());
    let _ = child.kill();
    assert!(
        status.is_some_and(|s| !s.success()),
        "the sidecar started on the shipped placeholder secret"
    );
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("placeholder"), "{stderr}");

    let plugin = wasm_plugin();
    let plugin_config = plugin_config_with_test_key(&plugin["spec"]["pluginConfig"]);
    let log = Envoy::refusal(&plugin_config, &base.signing_secret);
    assert!(log.contains("placeholder"), "{log}");
}

/// The SSE events' data of a streamed answer.
fn events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            event
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .map(str::to_owned)
        })
        .collect()
}

#[tokio::test]
async fn the_shipped_configs_run_and_stream_the_sdk_example() {
    let base = Base::render();
    let plugin = wasm_plugin();
    let spec = &plugin["spec"];
    let plugin_config = &spec["pluginConfig"];
    let (weir_route, ignored_route) = virtual_service_routes(plugin_config);

    // The sidecar: the ConfigMap's config, the pool's replicas swapped for simulators, the
    // Secret's signing secret in a file, as the Deployment mounts it.
    let mut sidecar_config = base.sidecar_config.clone();
    let pool = &mut sidecar_config["pools"][0];
    let model = pool["model"].as_str().unwrap().to_owned();
    assert!(
        plugin_config["models"].get(&model).is_some(),
        "the filter knows the pool's model {model}"
    );
    // The headless Service's pods: two simulators on one port, the name resolved to both
    // from a file (`--resolve-from`), as the cluster's DNS would.
    let name = pool["discovery"]["dns"].as_str().unwrap().to_owned();
    let served = [&TINY_FAST[..], &["--served-model-name", &model]].concat();
    let first = Sim::start_at(&sim_bin(), "127.0.0.2", 0, &served);
    let second = Sim::start_at(&sim_bin(), "127.0.0.3", first.port, &served);
    pool["discovery"]["port"] = first.port.into();
    pool["discovery"]["interval_ms"] = 200.into();
    let names = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(names.path(), format!("{name} 127.0.0.2 127.0.0.3\n")).unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("signing-secret");
    std::fs::write(&secret_file, signing_secret()).unwrap();
    sidecar_config["signing"]["secret_file"] = secret_file.display().to_string().into();
    let sidecar = Sidecar::start_with_args(
        &sidecar_bin(),
        sidecar_config,
        &["--resolve-from", names.path().to_str().unwrap()],
    );
    sidecar.wait_for_probes(2);
    let (_, ready) = sidecar.ready().await;
    let found: BTreeSet<&str> = ready["pools"][0]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["url"].as_str())
        .collect();
    assert_eq!(
        found,
        BTreeSet::from([first.url.as_str(), second.url.as_str()]),
        "the Service's pods are the pool"
    );

    // The gateway: the pluginConfig over ECDS as istiod sends it, the signing secret in
    // Envoy's environment as the gateway pod has it.
    let host_env_keys: Vec<String> = spec["vmConfig"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["valueFrom"] == "HOST")
        .map(|e| e["name"].as_str().unwrap().to_owned())
        .collect();
    let secret_env = plugin_config["signing"]["secret_env"].as_str().unwrap();
    assert!(host_env_keys.iter().any(|k| k == secret_env));
    let istio_plugin = Plugin {
        name: format!(
            "{}.{}",
            plugin["metadata"]["namespace"].as_str().unwrap(),
            plugin["metadata"]["name"].as_str().unwrap()
        ),
        root_id: spec["pluginName"].as_str().unwrap().to_owned(),
        vm_id: String::new(),
        failure_policy: spec["failStrategy"].as_str().unwrap().to_owned(),
        host_env_keys,
    };
    let status_page = Sim::start_tiny_fast(&["--record-requests", "16"]);
    let weir_config = plugin_config_with_test_key(plugin_config);
    let opts = EnvoyOptions {
        weir_config: &weir_config,
        upstream_port: sidecar.port,
        alt_port: status_page.port,
        listen_port: 0,
        with_filter: true,
    };
    let rename = |mut t: String| {
        for (route, name) in [("llm-api", &weir_route), ("alt", &ignored_route)] {
            // The route's entry (its match follows), not the cluster of the same name.
            let entry = format!("- name: {route}\n                match:");
            assert_eq!(t.matches(&entry).count(), 1, "the template's route {route}");
            t = t.replace(&entry, &format!("- name: {name}\n                match:"));
        }
        t
    };
    let gateway = EcdsEnvoy::start_with(
        opts,
        istio_plugin,
        &[(secret_env, signing_secret())],
        rename,
    );
    let url = &gateway.envoy.url;

    // As shipped, the route is at the runbook's first step, `off`: every caller is served and
    // signed, the keyless one as the default tenant, nobody metered or refused.
    let chat = |key: Option<&str>| {
        let mut request = reqwest::Client::new()
            .post(format!("{url}/v1/chat/completions"))
            .json(&json!({"model": model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "hello"}]}));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        request.send()
    };
    for key in [Some("key-ci"), None] {
        let resp = chat(key).await.unwrap();
        assert_eq!(
            resp.status(),
            StatusCode::OK,
            "{key:?}: {}",
            gateway.envoy.log()
        );
        assert!(
            resp.headers().get("x-ratelimit-limit-requests").is_none(),
            "off meters nothing"
        );
    }

    // The runbook's last step, pushed over ECDS as an edit of the WasmPlugin's line.
    let mut enforced = weir_config.clone();
    enforced["routes"]["by_name"][&weir_route] = json!({"mode": "enforce"});
    gateway.push(&enforced).await;

    // The README's SDK example: a streamed chat completion, as the `openai` client sends it.
    let mut resp = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("key-ci")
        .json(&json!({"model": model, "stream": true,
            "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "{}", gateway.envoy.log());
    let content_type = resp.headers()["content-type"].to_str().unwrap();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    assert_eq!(
        resp.headers()["x-ratelimit-limit-concurrent-requests"],
        "16",
        "the key's limits, from pluginConfig"
    );
    let (mut body, mut chunks) = (String::new(), 0);
    while let Some(chunk) = resp.chunk().await.unwrap() {
        chunks += 1;
        body.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let events = events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let parsed: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = parsed
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty(), "{body}");
    assert!(
        parsed
            .iter()
            .all(|e| e.get("usage").is_none_or(Value::is_null)),
        "the usage chunk weir asks for is hidden from a client that did not: {body}"
    );
    eprintln!(
        "streamed {} events in {chunks} chunks through the shipped configs: {text:?}",
        parsed.len()
    );

    // Enforced: no key, no answer.
    let refused = chat(None).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    // The route pluginConfig does not name is left as it came.
    let passed = reqwest::Client::new()
        .post(format!("{url}/alt/v1/chat/completions"))
        .header("x-request-id", "not-weirs")
        .json(&json!({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(passed.status(), StatusCode::OK);
    let seen = status_page.received_with_id("not-weirs").await;
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0]["headers"]
            .as_object()
            .unwrap()
            .keys()
            .all(|k| !k.starts_with("x-weir-")),
        "{seen:?}"
    );

    // Each request billed once, to the key's tenant, by the sidecar's ledger, with the route
    // and the mode it was served in.
    let rows = wait_for(Duration::from_secs(5), || {
        Some(sidecar.ledger_rows(Some("acme/prod/assistant/ci"))).filter(|r| r.len() >= 2)
    })
    .expect("the ledger's records");
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(
        rows.iter()
            .all(|r| r.completion_tokens > 0 && r.outcome == "ok"),
        "{rows:?}"
    );
    let steps: Vec<(Option<&str>, Option<&str>)> = rows
        .iter()
        .map(|r| (r.route.as_deref(), r.mode.as_deref()))
        .collect();
    let route = Some(weir_route.as_str());
    assert_eq!(
        steps,
        [(route, Some("off")), (route, Some("enforce"))],
        "{rows:?}"
    );

    // The sidecar refuses what the gateway did not sign, with the Secret's secret.
    let unsigned = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", sidecar.url))
        .header("x-weir-tenant", "acme/prod/assistant/ci")
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(unsigned.status(), StatusCode::UNAUTHORIZED);

    // Every sidecar metric the shipped alerts use is one the sidecar registers, and serves once
    // it has a series (a counter of first-byte timeouts has none until one happens).
    let served = sidecar.metrics().await;
    let families: BTreeSet<&str> = served
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    // What it registers: its instruments, and the ledger's unlabelled series (always served).
    let (metrics, _) = weir_sidecar::metrics::Metrics::new(&Default::default(), None);
    let mut registered: BTreeSet<String> = metrics.families.iter().cloned().collect();
    registered.extend(families.iter().map(|f| (*f).to_owned()));
    let rules = the(&base.docs, "PrometheusRule", None).to_string();
    let used: BTreeSet<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("weir_"))
        .collect();
    assert!(used.len() >= 8, "{used:?}");
    let mut unseen = Vec::new();
    for name in used {
        let family = ["_bucket", "_total"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        assert!(
            registered.contains(family),
            "{name} is not a metric of the sidecar: {registered:?}"
        );
        if !families.contains(family) {
            unseen.push(family);
        }
    }
    for family in [
        "weir_queue_depth",
        "weir_rejections",
        "weir_replica_healthy",
        "weir_ledger_pending_records",
    ] {
        assert!(
            families.contains(family),
            "{family} not served: {families:?}"
        );
    }
    eprintln!("alerted-on metrics with no series yet: {unseen:?}");
}

#[test]
fn every_shipped_gateway_hashes_an_org_to_one_sidecar_of_the_pool() {
    let org = weir_core::trusted::ORG;
    let service = the_shipped("deploy/istio/virtualservice.yaml", "VirtualService");
    let rule = the_shipped("deploy/istio/virtualservice.yaml", "DestinationRule");
    assert_eq!(
        rule["spec"]["host"], service["spec"]["http"][0]["route"][0]["destination"]["host"],
        "the rule is for the sidecars' Service"
    );
    assert_eq!(
        rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"],
        org
    );
    let gateway = file_docs("deploy/envoy-gateway/extensionpolicy.yaml");
    let policy = the(&gateway, "BackendTrafficPolicy", None);
    let route = the(&gateway, "HTTPRoute", None);
    assert_eq!(
        policy["spec"]["targetRefs"][0]["name"],
        route["metadata"]["name"]
    );
    assert_eq!(
        policy["spec"]["loadBalancer"]["consistentHash"]["header"]["name"],
        org
    );
    let plain = std::fs::read_to_string(workspace_root().join("deploy/envoy/envoy.yaml")).unwrap();
    assert!(
        plain.contains(&format!("header_name: {org}")) && plain.contains("lb_policy: RING_HASH")
    );
}

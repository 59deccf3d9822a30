//! `deploy/` is what runs. `kubectl kustomize deploy/k8s` (the base) and the overlays of
//! `deploy/k8s-examples/` are rendered offline (kubectl 1.37 from the venv) and read as
//! Kubernetes would apply them; the real sidecar runs on the rendered ConfigMap's config (the
//! PostgreSQL example's on a real PostgreSQL at the placeholder Secret's DSN, its server swapped
//! for a local one), and refuses the placeholder Secret's signing secret; real Envoy runs the filter
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
//! - the PostgreSQL example's server: a local one, its user, password and address swapped into
//!   the Secret's DSN (the database and options as shipped), the pool's engine one simulator
//!   listed by URL;
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
use weir_e2e::postgres::Postgres;
use weir_e2e::{
    Envoy, EnvoyOptions, Sidecar, Sim, TINY_FAST, api_key, chat_body, kubectl_bin, sidecar_bin,
    signing_secret, sim_bin, vouched, wait_for, workspace_root,
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

/// The kustomize base: the sidecar of one pool, without its Secret.
const BASE: &str = "deploy/k8s";
/// The base with the Secret's public placeholders.
const PLACEHOLDER_SECRET: &str = "deploy/k8s-examples/placeholder-secret";
/// The base with its Secret made by the External Secrets Operator.
const EXTERNAL_SECRET: &str = "deploy/k8s-examples/external-secret";
/// Two sidecars of the pool sharing the PostgreSQL ledger.
const POSTGRES_LEDGER: &str = "deploy/k8s-examples/postgres-ledger";

/// `kubectl kustomize DIR`: what `kubectl apply -k DIR` would apply.
fn rendered(dir: &str) -> Vec<Value> {
    let out = Command::new(kubectl_bin())
        .args(["kustomize", dir])
        .current_dir(workspace_root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    yaml_docs(std::str::from_utf8(&out.stdout).unwrap())
}

/// The value of `key` in the placeholder Secret (`deploy/k8s-examples/placeholder-secret`).
fn placeholder(key: &str) -> String {
    let docs = rendered(PLACEHOLDER_SECRET);
    the(&docs, "Secret", None)["stringData"][key]
        .as_str()
        .unwrap_or_else(|| panic!("no {key} in the placeholder Secret"))
        .to_owned()
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

/// What a rendered kustomization says, and the one container of its Deployment.
struct Rendered {
    docs: Vec<Value>,
    /// The ConfigMap's `sidecar.yaml`.
    sidecar_config: Value,
}

impl Rendered {
    fn of(dir: &str) -> Rendered {
        let docs = rendered(dir);
        let config_map = the(&docs, "ConfigMap", None);
        let sidecar_config =
            serde_yaml_ng::from_str(config_map["data"]["sidecar.yaml"].as_str().unwrap()).unwrap();
        Rendered {
            docs,
            sidecar_config,
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

    /// Where the container reads the key `key` of the volume whose source has `field`.
    fn item_at(&self, field: &str, key: &str) -> String {
        let (dir, source) = self.mount(field);
        let item = source["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["key"] == key)
            .unwrap_or_else(|| panic!("{field}: {key} is not mounted"));
        format!("{dir}/{}", item["path"].as_str().unwrap())
    }

    /// The keys of the Secret the Deployment mounts, and its name.
    fn mounted_secret(&self) -> (&Value, BTreeSet<&str>) {
        let (_, source) = self.mount("secret");
        let keys = source["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["key"].as_str().unwrap())
            .collect();
        (&source["secretName"], keys)
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
    let base = Rendered::of(BASE);
    let kinds: BTreeSet<&str> = base
        .docs
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    for kind in [
        "Deployment",
        "Service",
        "ConfigMap",
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

#[test]
fn the_base_holds_no_secret_and_each_example_supplies_the_one_it_mounts() {
    // A Secret in the base would be applied again at every `kubectl apply -k`, putting the
    // placeholder back over the operator's values.
    let base = Rendered::of(BASE);
    let kinds: Vec<&Value> = base.docs.iter().map(|d| &d["kind"]).collect();
    assert!(!kinds.contains(&&json!("Secret")), "{kinds:?}");
    let namespace = &base.deployment()["metadata"]["namespace"];
    let (name, mut mounted) = base.mounted_secret();
    let postgres = Rendered::of(POSTGRES_LEDGER);
    let (postgres_name, postgres_keys) = postgres.mounted_secret();
    assert_eq!(postgres_name, name);
    mounted.extend(postgres_keys);
    assert!(mounted.contains("ledger-dsn"), "{mounted:?}");

    // The placeholder Secret, and the External Secrets Operator's, hold every key mounted.
    let example = rendered(PLACEHOLDER_SECRET);
    let secret = the(&example, "Secret", None);
    assert_eq!(&secret["metadata"]["name"], name);
    assert_eq!(&secret["metadata"]["namespace"], namespace);
    let held: BTreeSet<&str> = secret["stringData"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert!(mounted.is_subset(&held), "{mounted:?} in {held:?}");
    let external = rendered(EXTERNAL_SECRET);
    assert!(external.iter().all(|d| d["kind"] != "Secret"));
    let made = the(&external, "ExternalSecret", None);
    assert_eq!(&made["spec"]["target"]["name"], name);
    assert_eq!(&made["metadata"]["namespace"], namespace);
    let made_keys: BTreeSet<&str> = made["spec"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["secretKey"].as_str().unwrap())
        .collect();
    assert!(
        mounted.is_subset(&made_keys),
        "{mounted:?} in {made_keys:?}"
    );
}

#[test]
fn the_sidecar_image_is_pinned_by_digest() {
    // A tag can be moved to other bytes; a digest cannot.
    let base = Rendered::of(BASE);
    let image = base.container()["image"].as_str().unwrap();
    let (_, digest) = image
        .split_once("@sha256:")
        .unwrap_or_else(|| panic!("not pinned by digest: {image}"));
    assert!(
        digest.len() == 64 && digest.chars().all(|c| c.is_ascii_hexdigit()),
        "{image}"
    );
}

/// The egress rules of a NetworkPolicy that let the pod reach `port` over `protocol`.
fn egress_to<'a>(policy: &'a Value, port: u64, protocol: &str) -> Vec<&'a Value> {
    policy["spec"]["egress"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|rule| {
            rule["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["port"] == port && p["protocol"] == protocol)
        })
        .collect()
}

/// The namespaces a rule's peers are in, by name (a peer without a namespace selector is in
/// the policy's own).
fn peer_namespaces<'a>(rule: &'a Value, policy: &'a Value) -> Vec<&'a Value> {
    rule["to"]
        .as_array()
        .unwrap()
        .iter()
        .map(|peer| match peer.get("namespaceSelector") {
            Some(selector) => &selector["matchLabels"]["kubernetes.io/metadata.name"],
            None => &policy["metadata"]["namespace"],
        })
        .collect()
}

/// The namespace of a cluster DNS name (`service.namespace.svc.cluster.local`).
fn namespace_of(host: &str) -> Value {
    json!(host.split('.').nth(1).unwrap())
}

#[test]
fn the_network_policy_lets_the_sidecar_reach_what_its_config_names_and_nothing_else() {
    let base = Rendered::of(BASE);
    let policy = the(&base.docs, "NetworkPolicy", None);
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    // No rule without peers or ports: that would open every address or every port.
    for rule in policy["spec"]["egress"].as_array().unwrap() {
        assert!(
            !rule["to"].as_array().unwrap().is_empty()
                && !rule["ports"].as_array().unwrap().is_empty(),
            "{rule}"
        );
    }
    // DNS (every name the config holds is looked up), over UDP and TCP, to the cluster's DNS.
    for protocol in ["UDP", "TCP"] {
        let rules = egress_to(policy, 53, protocol);
        assert_eq!(rules.len(), 1, "DNS over {protocol}");
        assert_eq!(
            rules[0]["to"][0]["podSelector"]["matchLabels"]["k8s-app"],
            "kube-dns"
        );
    }
    // Each pool's engines: the headless Service's namespace, on discovery's port.
    for pool in base.sidecar_config["pools"].as_array().unwrap() {
        let discovery = &pool["discovery"];
        let namespace = namespace_of(discovery["dns"].as_str().unwrap());
        let rules = egress_to(policy, discovery["port"].as_u64().unwrap(), "TCP");
        assert!(
            rules
                .iter()
                .any(|r| peer_namespaces(r, policy).contains(&&namespace)),
            "no egress to {discovery} in {rules:?}"
        );
    }
    // In the mesh (the namespace is labelled for injection) the pod's proxy asks istiod.
    let namespace = the(&base.docs, "Namespace", None);
    assert_eq!(
        namespace["metadata"]["labels"]["istio-injection"],
        "enabled"
    );
    let istiod = egress_to(policy, 15012, "TCP");
    assert_eq!(istiod.len(), 1);
    assert_eq!(peer_namespaces(istiod[0], policy), [&json!("istio-system")]);

    // The PostgreSQL ledger: the example's policy lets its sidecars reach the Secret's DSN.
    let dsn = placeholder("ledger-dsn");
    let server = dsn.split('@').nth(1).unwrap().split('/').next().unwrap();
    let (host, port) = server.split_once(':').unwrap();
    let postgres = Rendered::of(POSTGRES_LEDGER);
    let policy = the(&postgres.docs, "NetworkPolicy", None);
    let rules = egress_to(policy, port.parse().unwrap(), "TCP");
    assert!(
        rules
            .iter()
            .any(|r| peer_namespaces(r, policy).contains(&&namespace_of(host))),
        "no egress to {server} in {rules:?}"
    );
}

#[test]
fn the_postgres_ledger_example_mounts_what_its_config_reads_one_sidecar_per_share() {
    let base = Rendered::of(BASE);
    let example = Rendered::of(POSTGRES_LEDGER);
    let config = &example.sidecar_config;
    let deployment = example.deployment();
    let replicas = deployment["spec"]["replicas"].as_u64().unwrap();
    assert!(replicas >= 2, "{replicas}");
    for pool in config["pools"].as_array().unwrap() {
        assert_eq!(pool["sidecars"], replicas, "each sidecar admits its share");
    }
    // A rollout brings a new sidecar up before an old one drains.
    let strategy = &deployment["spec"]["strategy"];
    assert_eq!(strategy["type"], "RollingUpdate");
    assert_eq!(strategy["rollingUpdate"]["maxUnavailable"], 0);
    // Nothing on a claimed volume: the replicas could not share a ReadWriteOnce one.
    let pod = &deployment["spec"]["template"]["spec"];
    assert!(
        example
            .docs
            .iter()
            .all(|d| d["kind"] != "PersistentVolumeClaim")
    );
    for volume in pod["volumes"].as_array().unwrap() {
        assert!(volume.get("persistentVolumeClaim").is_none(), "{volume}");
    }
    // The DSN and the signing secret are read where the Secret's keys are mounted.
    let store = &config["ledger_store"];
    assert_eq!(
        store["postgres"]["url_file"],
        example.item_at("secret", "ledger-dsn").as_str()
    );
    assert_eq!(
        config["signing"]["secret_file"],
        example.item_at("secret", "signing-secret").as_str()
    );
    // The spool is on a writable volume: the root file system is read-only.
    let spool = std::path::Path::new(store["spool"].as_str().unwrap());
    let mounts = example.container()["volumeMounts"].as_array().unwrap();
    assert!(
        mounts.iter().any(
            |m| spool.parent() == m["mountPath"].as_str().map(std::path::Path::new)
                && m["readOnly"] != true
        ),
        "{spool:?} on {mounts:?}"
    );
    // Everything else is the base's config.
    let rest = |config: &Value| {
        let mut config = config.clone();
        let fields = config.as_object_mut().unwrap();
        fields.remove("ledger");
        fields.remove("ledger_store");
        for pool in config["pools"].as_array_mut().unwrap() {
            pool.as_object_mut().unwrap().remove("sidecars");
        }
        config
    };
    assert_eq!(rest(config), rest(&base.sidecar_config));
}

#[test]
fn the_postgres_ledger_example_bills_into_postgresql_at_the_secrets_dsn() {
    // The example's config, run by the real sidecar on a real PostgreSQL at the DSN the
    // placeholder Secret shapes: its user, password and server swapped for the local server's,
    // its database and options as shipped.
    let example = Rendered::of(POSTGRES_LEDGER);
    let dsn = placeholder("ledger-dsn");
    let (_, database_and_options) = dsn.split_once('@').unwrap().1.split_once('/').unwrap();
    let database = database_and_options.split('?').next().unwrap();
    let pg = Postgres::start();
    postgres::Client::connect(&pg.url(), postgres::NoTls)
        .unwrap()
        .batch_execute(&format!("CREATE DATABASE {database}"))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url_file = dir.path().join("ledger-dsn");
    let local = format!("postgresql://postgres@127.0.0.1:{}", pg.port);
    std::fs::write(&url_file, format!("{local}/{database_and_options}")).unwrap();

    let mut config = example.sidecar_config.clone();
    let store = &mut config["ledger_store"];
    store["postgres"]["url_file"] = url_file.display().to_string().into();
    store["spool"] = dir.path().join("spool.sqlite").display().to_string().into();
    // The harness's signing secret, from the environment; the pool's engine a simulator.
    config.as_object_mut().unwrap().remove("signing");
    let pool = &mut config["pools"][0];
    let model = pool["model"].as_str().unwrap().to_owned();
    let sim = Sim::start_tiny_fast(&["--served-model-name", &model]);
    pool.as_object_mut().unwrap().remove("discovery");
    pool["replicas"] = json!([sim.url]);
    let sidecar = Sidecar::start(config);
    sidecar.wait_for_probes(1);

    let tenant = "acme/k8s/ledger/ci";
    let answered = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut request = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", sidecar.url))
            .json(&chat_body(&model, "hello", json!({"max_tokens": 4})));
        for (name, value) in vouched(tenant, "weir-k8s-ledger-1", &[]) {
            request = request.header(name, value);
        }
        request.send().await.unwrap().status()
    });
    assert_eq!(answered, StatusCode::OK, "{}", sidecar.log());
    // In PostgreSQL, not waiting in the spool.
    let mut client =
        weir_sidecar::ledger::postgres::connect(&format!("{local}/{database}")).unwrap();
    let rows = wait_for(Duration::from_secs(10), || {
        let rows = weir_sidecar::ledger::postgres::query(&mut client, Some(tenant), 0).ok()?;
        Some(rows).filter(|r| !r.is_empty())
    })
    .unwrap_or_else(|| panic!("no record in PostgreSQL at {dsn:?}: {}", sidecar.log()));
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].outcome, "ok", "{rows:?}");
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
    // Whoever knows the signing secret can claim any tenant to the sidecar, and the example
    // Secret's value is in this repository: a cluster applied with it, and the same placeholder
    // copied into the gateway's environment, would serve whatever any workload signs with it.
    let base = Rendered::of(BASE);
    let secret = placeholder("signing-secret");
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("signing-secret");
    std::fs::write(&secret_file, &secret).unwrap();
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
    let log = Envoy::refusal(&plugin_config, &secret);
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
    let base = Rendered::of(BASE);
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

/// A stat name as `/stats/prometheus` shows it under the `stats_tags` of `bootstrap`: each
/// regex that matches the whole name gives its tag the second group's value and cuts the first
/// group from the name (Envoy matches every regex against the name as the filter made it).
fn prometheus_series(bootstrap: &str, stat: &str) -> String {
    let block = bootstrap
        .split("\nstats_config:\n")
        .nth(1)
        .and_then(|rest| rest.split("\nstatic_resources:").next())
        .unwrap();
    let config: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&format!("stats_config:\n{block}")).unwrap();
    let mut cut = Vec::new();
    let mut labels = Vec::new();
    for tag in config["stats_config"]["stats_tags"].as_sequence().unwrap() {
        let regex = regex::Regex::new(tag["regex"].as_str().unwrap()).unwrap();
        if let Some(groups) = regex.captures(stat) {
            let (whole, value) = (groups.get(1).unwrap(), groups.get(2).unwrap());
            cut.push(whole.range());
            labels.push(format!(
                "{}=\"{}\"",
                tag["tag_name"].as_str().unwrap(),
                value.as_str()
            ));
        }
    }
    let name: String = stat
        .char_indices()
        .filter(|(i, _)| !cut.iter().any(|r| r.contains(i)))
        .map(|(_, c)| c)
        .collect();
    let name = name.trim_start_matches("wasmcustom.").replace('.', "_");
    format!("{name}{{{}}}", labels.join(","))
}

#[test]
fn the_shipped_stats_tags_label_the_run_counters_by_tenant_never_more() {
    for file in ["deploy/envoy/envoy.yaml", "envoy/envoy.yaml.tmpl"] {
        let bootstrap = std::fs::read_to_string(workspace_root().join(file)).unwrap();
        let series = |stat: &str| prometheus_series(&bootstrap, &format!("wasmcustom.{stat}"));
        for (stat, expected) in [
            (
                "weir.run_refusals_total.tenant.acme.budget.model_calls",
                r#"weir_run_refusals_total{tenant="acme",budget="model_calls"}"#,
            ),
            (
                "weir.tools_blocked_total.tenant.acme_eu.where.called",
                r#"weir_tools_blocked_total{tenant="acme_eu",where="called"}"#,
            ),
            (
                "weir.retries_refused_total.tenant.acme",
                r#"weir_retries_refused_total{tenant="acme"}"#,
            ),
            // The decisions keep their three labels and gain none.
            (
                "weir.filter.decisions.route.llm.mode.enforce.decision.admitted",
                r#"weir_filter_decisions{route="llm",mode="enforce",decision="admitted"}"#,
            ),
            (
                "weir.rejections.budget_exceeded",
                "weir_rejections_budget_exceeded{}",
            ),
        ] {
            assert_eq!(series(stat), expected, "{file}");
        }
    }
}

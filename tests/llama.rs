//! llama.cpp's `llama-server`: a real engine for the engine-compatibility suite
//! (`tests/llama_server.rs`).
//!
//! Nothing of llama.cpp is committed: [`build`] fetches the PyPI sdist of `llama-cpp-python`
//! (pinned by version and digest, which vendors llama.cpp's sources), builds only the
//! `llama-server` target (CPU, Release, static, no HTTPS, no web UI, no tests or examples, two
//! jobs) and writes a tiny random-weight model with `tests/python/tiny_llama_gguf.py` and the
//! `gguf-py` package from the same sources. Both land in a cache outside the clone, keyed by
//! the version, the build options and the model script, so only the first run pays for the
//! build (minutes) and later ones start the server in about a second. `cargo xtask test` builds
//! before any test runs, so no test's timeout includes the build; `cargo test` alone builds on
//! demand. The tools come from the project venv (`cmake`, `numpy` and `pyyaml` from
//! `tests/python/requirements.txt`), or `cmake` from `PATH`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

use crate::{spawn_owned, wait_for, workspace_root};

/// The `llama-cpp-python` release whose sdist the server is built from, and the sdist's SHA-256.
pub const LLAMA_CPP_PYTHON: &str = "0.3.36";
const SDIST_SHA256: &str = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e";

/// The name the tiny model is served under (`--alias`), as in `reference/llama.cpp-server/`.
pub const MODEL: &str = "tiny-llama";

/// Only what the server needs: no OpenSSL (it would fetch models over HTTPS; llama.cpp no longer
/// uses libcurl), no web UI (its prebuilt assets come from a model hub), no tests, examples or
/// unified app; one static, portable (not `-march=native`) binary to keep in the cache.
const CMAKE_OPTIONS: [&str; 9] = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
];

/// The built server and the model it serves.
#[derive(Clone, Debug)]
pub struct LlamaBuild {
    pub server: PathBuf,
    pub model: PathBuf,
}

/// `$WEIR_CACHE_DIR`, else `$XDG_CACHE_HOME/weir`, else `~/.cache/weir`: outside the clone, so a
/// fresh clone (CI's) on the same machine reuses the build.
fn cache_root() -> PathBuf {
    let env = |var| std::env::var_os(var).filter(|v| !v.is_empty());
    if let Some(dir) = env("WEIR_CACHE_DIR") {
        return dir.into();
    }
    env("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|home| Path::new(&home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("weir")
}

/// This build's directory: the version and a digest of the build options in its name.
fn build_dir() -> PathBuf {
    let options = weir_core::keys::hash_key(&CMAKE_OPTIONS.join(" "));
    cache_root().join(format!(
        "llama-server-{LLAMA_CPP_PYTHON}-{}",
        &options[..12]
    ))
}

/// The server binary and the tiny model, built and written first if the cache lacks them.
/// Concurrent callers (two test runs on one machine) wait for one build under a file lock.
pub fn build() -> anyhow::Result<LlamaBuild> {
    let dir = build_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let _lock = FileLock::acquire(&dir.join("lock"))?;
    let server = dir.join("bin/llama-server");
    if !server.exists() {
        let started = Instant::now();
        compile_server(&dir)?;
        eprintln!(
            "llama-server: built in {:.1} min, cached in {}",
            started.elapsed().as_secs_f64() / 60.0,
            dir.display()
        );
    }
    let model = write_model(&dir)?;
    Ok(LlamaBuild { server, model })
}

fn venv_bin(name: &str) -> PathBuf {
    workspace_root().join(".weir/venv/bin").join(name)
}

fn python() -> anyhow::Result<PathBuf> {
    let python = venv_bin("python");
    if !python.exists() {
        bail!(
            "{} not found: run `cargo xtask test` once, which installs the project venv",
            python.display()
        );
    }
    Ok(python)
}

/// Runs `cmd`, its output appended to `log`; on failure says so with the log's last lines.
fn run_logged(what: &str, cmd: &mut Command, log: &Path) -> anyhow::Result<()> {
    eprintln!("llama-server: {what}");
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let status = cmd
        .stdout(out.try_clone()?)
        .stderr(out)
        .status()
        .with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "{what} failed ({status}); last lines of {}:\n{}",
            log.display(),
            tail.join("\n")
        );
    }
    Ok(())
}

/// Fetches the sdist with pip, checks its digest, unpacks llama.cpp, builds `llama-server`,
/// keeps the binary and `gguf-py` in `dir` and deletes the rest.
fn compile_server(dir: &Path) -> anyhow::Result<()> {
    let work = dir.join("work");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let log = dir.join("build.log");
    let _ = std::fs::remove_file(&log);
    run_logged(
        &format!("fetching the llama-cpp-python {LLAMA_CPP_PYTHON} sdist from PyPI"),
        Command::new(python()?)
            .args(["-m", "pip", "download", "--disable-pip-version-check"])
            .args(["--no-deps", "--no-binary", "llama-cpp-python", "--dest"])
            .arg(&work)
            .arg(format!("llama-cpp-python=={LLAMA_CPP_PYTHON}")),
        &log,
    )?;
    let sdist = work.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"));
    let digest = Sha256::digest(std::fs::read(&sdist)?);
    let digest: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    if digest != SDIST_SHA256 {
        bail!(
            "{} has SHA-256 {digest}, not {SDIST_SHA256}",
            sdist.display()
        );
    }
    let vendored = format!("llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp");
    run_logged(
        "unpacking llama.cpp",
        Command::new("tar")
            .arg("-xzf")
            .arg(&sdist)
            .arg("-C")
            .arg(&work)
            .arg(&vendored),
        &log,
    )?;
    let source = work.join(&vendored);
    let build = work.join("build");
    let cmake = Some(venv_bin("cmake"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| "cmake".into());
    run_logged(
        "configuring (cmake)",
        Command::new(&cmake)
            .arg("-S")
            .arg(&source)
            .arg("-B")
            .arg(&build)
            .args(CMAKE_OPTIONS),
        &log,
    )?;
    run_logged(
        "building the llama-server target (-j2; several minutes the first time)",
        Command::new(&cmake).arg("--build").arg(&build).args([
            "--target",
            "llama-server",
            "-j",
            "2",
        ]),
        &log,
    )?;
    let kept_gguf_py = dir.join("gguf-py");
    let _ = std::fs::remove_dir_all(&kept_gguf_py);
    std::fs::rename(source.join("gguf-py"), &kept_gguf_py)?;
    std::fs::create_dir_all(dir.join("bin"))?;
    // Renamed into place last: its presence is what marks the build complete.
    std::fs::rename(build.join("bin/llama-server"), dir.join("bin/llama-server"))?;
    std::fs::remove_dir_all(&work)?;
    Ok(())
}

/// The tiny model, written by the committed script (its digest names the file, so a changed
/// script writes a new model).
fn write_model(dir: &Path) -> anyhow::Result<PathBuf> {
    let script = workspace_root().join("tests/python/tiny_llama_gguf.py");
    let text = std::fs::read_to_string(&script)?;
    let digest = weir_core::keys::hash_key(&text);
    let model = dir.join(format!("{MODEL}-{}.gguf", &digest[..12]));
    if model.exists() {
        return Ok(model);
    }
    let partial = model.with_extension("partial");
    run_logged(
        "writing the tiny model",
        Command::new(python()?)
            .arg(&script)
            .arg(dir.join("gguf-py"))
            .arg(&partial),
        &dir.join("model.log"),
    )?;
    std::fs::rename(&partial, &model)?;
    Ok(model)
}

/// An exclusive `flock(2)` on a file, released when dropped (or when the process dies).
struct FileLock(std::fs::File);

impl FileLock {
    fn acquire(path: &Path) -> anyhow::Result<FileLock> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        // SAFETY: flock on a descriptor this struct owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            bail!(
                "locking {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(FileLock(file))
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: as above.
        unsafe {
            libc::flock(self.0.as_raw_fd(), libc::LOCK_UN);
        }
    }
}

/// A running `llama-server` on a free loopback port, serving the tiny model as [`MODEL`] with
/// `--metrics --slots --jinja`; stopped when dropped. It logs into a temporary directory (where
/// its address is read from), kept while it runs.
pub struct LlamaServer {
    pub url: String,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl LlamaServer {
    /// `slots` parallel slots of `ctx` tokens each (building the server first if need be), one
    /// CPU thread: several replicas share the machine's cores with Envoy and the sidecar.
    pub fn start(slots: u32, ctx: u32) -> LlamaServer {
        let build = build().expect("llama-server built");
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("llama-server.log");
        let mut cmd = Command::new(&build.server);
        cmd.arg("--model")
            .arg(&build.model)
            .args(["--alias", MODEL, "--host", "127.0.0.1", "--port", "0"])
            .args(["--parallel", &slots.to_string()])
            .args(["--ctx-size", &(slots * ctx).to_string()])
            .args(["--threads", "1", "--threads-batch", "1"])
            .args(["--metrics", "--slots", "--jinja", "--no-webui"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let child = spawn_owned(cmd);
        let addr = wait_for(Duration::from_secs(60), || {
            let text = std::fs::read_to_string(&log).ok()?;
            let rest = text.split("listening on http://").nth(1)?;
            Some(rest.split_whitespace().next()?.to_owned())
        })
        .unwrap_or_else(|| {
            panic!(
                "llama-server did not listen:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        // `/health` answers 503 until the model is loaded.
        wait_for(Duration::from_secs(60), || {
            crate::http_get(&addr, "/health").filter(|body| body.contains("\"ok\""))
        })
        .expect("llama-server healthy");
        LlamaServer {
            url: format!("http://{addr}"),
            child,
            _dir: dir,
        }
    }

    async fn get(&self, path: &str) -> String {
        reqwest::get(format!("{}{path}", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// `/slots`: one object per slot, with `is_processing`.
    pub async fn slots(&self) -> Vec<serde_json::Value> {
        serde_json::from_str(&self.get("/slots").await).unwrap()
    }

    /// Slots busy now, by `/slots`.
    pub async fn busy_slots(&self) -> usize {
        self.slots()
            .await
            .iter()
            .filter(|s| s["is_processing"] == true)
            .count()
    }

    /// A series of `/metrics` by name (`llamacpp:` ones carry no labels).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from {}/metrics", self.url))
    }
}

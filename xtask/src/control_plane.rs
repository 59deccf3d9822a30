//! `cargo xtask up`'s control plane: the filter's config is a file of the user's to edit, and
//! each saved change is checked as the filter reads it and pushed to Envoy over ECDS — the way
//! istiod pushes a `WasmPlugin` edit: no restart, no bucket or slot reset. A runbook step
//! (`routes.by_name.<route>.mode`) is one edit of that file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use weir_core::config::Config;
use weir_e2e::ecds::Source;

/// How often the file is read for a change.
const POLL: Duration = Duration::from_millis(200);

/// The file the user edits; it lives until the stack stops.
pub struct ControlPlane {
    pub file: PathBuf,
    _dir: tempfile::TempDir,
}

impl ControlPlane {
    /// Writes `config` (YAML, as a `WasmPlugin`'s `pluginConfig` is written) and follows the
    /// file's changes into `source`.
    pub fn start(config: &serde_json::Value, source: Source) -> anyhow::Result<ControlPlane> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("weir-filter.yaml");
        std::fs::write(&file, serde_yaml_ng::to_string(config)?)?;
        let followed = file.clone();
        std::thread::spawn(move || follow(&followed, &source));
        Ok(ControlPlane { file, _dir: dir })
    }
}

/// Pushes each new content of `file` the filter would accept, once it has stood unchanged for
/// a poll (an editor that truncates, then writes, must not push the empty or half-written
/// file between); says why it did not push one it would refuse (the running config stays, as
/// with a mesh's rejected update).
fn follow(file: &Path, source: &Source) {
    let mut pushed = std::fs::read(file).ok();
    let mut last = pushed.clone();
    loop {
        std::thread::sleep(POLL);
        let Ok(text) = std::fs::read(file) else {
            continue;
        };
        let settled = last.as_ref() == Some(&text);
        last = Some(text.clone());
        if !settled || pushed.as_ref() == Some(&text) {
            continue;
        }
        match refusal(&text) {
            None => {
                source.write_text(&String::from_utf8_lossy(&text));
                eprintln!("xtask: pushed {} to Envoy", file.display());
            }
            Some(why) => eprintln!("xtask: {} not pushed: {why}", file.display()),
        }
        pushed = Some(text);
    }
}

/// Why the filter would refuse `text`, or would let every request through unsigned (a config
/// emptied by mistake), if it would.
fn refusal(text: &[u8]) -> Option<String> {
    match Config::parse(text) {
        Err(e) => Some(e.to_string()),
        Ok(config) if config.signing.is_none() => {
            Some("no `signing`: the sidecar would refuse every request".into())
        }
        Ok(_) => None,
    }
}

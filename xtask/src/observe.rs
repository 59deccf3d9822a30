//! `cargo xtask up --observe`: a real Prometheus scraping the stack `up` started, with the
//! shipped `deploy/prometheus/prometheus.yml` as it is. That config reads its targets from
//! `targets/<job>.json` beside itself, so it is copied into a run directory and the target files
//! are written next to it; the repository's `deploy/` stays untouched.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// The Debian package's binary (`debian_tools` installs it when missing).
pub const PROMETHEUS: &str = "prometheus";

/// What Prometheus scrapes: base URLs (`http://host:port`, an engine's may have a path).
pub struct Targets<'a> {
    pub sidecar_admins: Vec<&'a str>,
    pub envoy_admins: Vec<&'a str>,
    pub engines: Vec<&'a str>,
}

/// A running Prometheus, its data in a temporary directory; stopped when dropped.
pub struct Prometheus {
    pub url: String,
    child: Child,
    /// The config, its target files, the TSDB and the log.
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus on a free loopback port and waits until it is ready.
    pub fn start(targets: &Targets<'_>) -> anyhow::Result<Prometheus> {
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("prometheus.yml");
        let shipped = crate::root().join("deploy/prometheus/prometheus.yml");
        std::fs::copy(&shipped, &config)
            .with_context(|| format!("copying {}", shipped.display()))?;
        let target_dir = dir.path().join("targets");
        std::fs::create_dir(&target_dir)?;
        for (job, urls) in [
            ("weir-sidecar", &targets.sidecar_admins),
            ("weir-envoy", &targets.envoy_admins),
            ("weir-engine", &targets.engines),
        ] {
            let groups: Vec<Value> = urls.iter().map(|url| target_group(url)).collect();
            std::fs::write(
                target_dir.join(format!("{job}.json")),
                serde_json::to_vec_pretty(&groups)?,
            )?;
        }
        let addr = format!("127.0.0.1:{}", free_port()?);
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let mut cmd = Command::new(PROMETHEUS);
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(log);
        let child = weir_e2e::spawn_owned(cmd);
        let mut prometheus = Prometheus {
            url: format!("http://{addr}"),
            child,
            dir,
        };
        let ready = weir_e2e::wait_for(Duration::from_secs(30), || {
            if let Ok(Some(status)) = prometheus.child.try_wait() {
                return Some(Err(status));
            }
            weir_e2e::http_get(&addr, "/-/ready")
                .filter(|body| body.contains("Ready"))
                .map(Ok)
        });
        match ready {
            Some(Ok(_)) => Ok(prometheus),
            Some(Err(status)) => bail!("prometheus exited ({status}): {}", prometheus.log()),
            None => bail!("prometheus not ready within 30 s: {}", prometheus.log()),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }
}

/// One file_sd group for a base URL: its `host:port`, with the scheme and any path prefix as
/// the relabelling labels Prometheus honours (`__scheme__`, `__metrics_path__`) when they are
/// not the job's.
fn target_group(url: &str) -> Value {
    let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
    let (host, path) = match rest.split_once('/') {
        Some((host, path)) => (host, path.trim_end_matches('/')),
        None => (rest, ""),
    };
    let mut labels = serde_json::Map::new();
    if scheme != "http" {
        labels.insert("__scheme__".into(), json!(scheme));
    }
    if !path.is_empty() {
        labels.insert("__metrics_path__".into(), json!(format!("/{path}/metrics")));
    }
    json!({"targets": [host], "labels": labels})
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::target_group;
    use serde_json::json;

    #[test]
    fn targets_keep_a_scheme_and_path_prefix_other_than_the_jobs() {
        assert_eq!(
            target_group("http://127.0.0.1:9901"),
            json!({"targets": ["127.0.0.1:9901"], "labels": {}})
        );
        assert_eq!(
            target_group("https://engines.internal:8443/replica-1/"),
            json!({"targets": ["engines.internal:8443"], "labels": {
                "__scheme__": "https", "__metrics_path__": "/replica-1/metrics"}})
        );
    }
}

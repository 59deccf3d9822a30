//! A real Prometheus for the observability tests: Debian's `prometheus` (`/usr/bin/prometheus`
//! or on `PATH`; `cargo xtask test` installs it) on loopback, running the shipped scrape config
//! (`deploy/prometheus/prometheus.yml`) with its target files written by the test, scraping
//! every second. Queries go through its HTTP API, as Grafana's do.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::{spawn_owned, wait_for, workspace_root};

pub struct Prometheus {
    pub url: String,
    dir: tempfile::TempDir,
    child: Child,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes a file_sd file whole (renamed into place, so Prometheus never reads half of one).
fn write_targets(dir: &Path, job: &str, addrs: &[&str]) {
    let groups = serde_json::json!([{"targets": addrs}]);
    let next = dir.join("targets").join(format!("{job}.json.next"));
    std::fs::write(&next, groups.to_string()).unwrap();
    std::fs::rename(next, dir.join(format!("targets/{job}.json"))).unwrap();
}

fn binary() -> PathBuf {
    let debian = PathBuf::from("/usr/bin/prometheus");
    if debian.exists() {
        debian
    } else {
        PathBuf::from("prometheus")
    }
}

impl Prometheus {
    /// Starts it with the shipped config, every job's target file empty, and waits until it
    /// is ready.
    pub fn start() -> Prometheus {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let shipped =
            std::fs::read_to_string(workspace_root().join("deploy/prometheus/prometheus.yml"))
                .unwrap();
        assert!(
            shipped.contains("scrape_interval: 5s"),
            "the shipped interval"
        );
        let config = shipped.replace("scrape_interval: 5s", "scrape_interval: 1s");
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        std::fs::create_dir(dir.path().join("targets")).unwrap();
        for job in ["weir-sidecar", "weir-envoy", "weir-engine"] {
            write_targets(dir.path(), job, &[]);
        }
        let mut cmd = Command::new(binary());
        let path = |name: &str| dir.path().join(name).display().to_string();
        cmd.arg(format!("--config.file={}", path("prometheus.yml")))
            .arg(format!("--storage.tsdb.path={}", path("data")))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(path("prometheus.log")).unwrap());
        let child = spawn_owned(cmd);
        let p = Prometheus {
            url: format!("http://127.0.0.1:{port}"),
            dir,
            child,
        };
        let ready = wait_for(Duration::from_secs(30), || {
            crate::http_get(&p.url["http://".len()..], "/-/ready").filter(|b| b.contains("Ready"))
        });
        assert!(ready.is_some(), "prometheus is not ready: {}", p.log());
        p
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// Writes a job's file_sd target file (`host:port` addresses); Prometheus re-reads it.
    pub fn targets(&self, job: &str, addrs: &[&str]) {
        write_targets(self.dir.path(), job, addrs);
    }

    /// Waits until `n` targets are up, each scraped at least once.
    pub async fn wait_for_targets(&self, n: usize) {
        for _ in 0..300 {
            let targets = self.api("/api/v1/targets", &[]).await;
            let up = targets["data"]["activeTargets"]
                .as_array()
                .map_or(0, |t| t.iter().filter(|t| t["health"] == "up").count());
            if up >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "{n} targets were not up: {}",
            self.api("/api/v1/targets", &[]).await
        );
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.url), query).unwrap();
        let resp = reqwest::get(url).await.unwrap();
        resp.json().await.unwrap()
    }

    /// An instant query's result vector (panics on an error: a query that does not parse).
    pub async fn query(&self, expr: &str) -> Vec<Value> {
        let answer = self.api("/api/v1/query", &[("query", expr)]).await;
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// A range query's result matrix over the last `seconds` (as a Grafana panel asks).
    pub async fn query_range(&self, expr: &str, seconds: u64) -> Vec<Value> {
        let end = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let (start, end) = ((end - seconds).to_string(), end.to_string());
        let query = [
            ("query", expr),
            ("start", &start),
            ("end", &end),
            ("step", "1"),
        ];
        let answer = self.api("/api/v1/query_range", &query).await;
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The values a label takes on a metric's series (Grafana's `label_values(metric, label)`).
    pub async fn label_values(&self, metric: &str, label: &str) -> Vec<String> {
        let path = format!("/api/v1/label/{label}/values");
        let answer = self.api(&path, &[("match[]", metric)]).await;
        assert_eq!(answer["status"], "success", "{metric}/{label}: {answer}");
        let values = answer["data"].as_array().cloned().unwrap_or_default();
        values
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect()
    }

    /// Every series Prometheus holds, as label sets (the name in `__name__`).
    pub async fn all_series(&self) -> Vec<serde_json::Map<String, Value>> {
        let answer = self
            .api("/api/v1/series", &[("match[]", "{__name__=~\".+\"}")])
            .await;
        let series = answer["data"].as_array().cloned().unwrap_or_default();
        series
            .into_iter()
            .filter_map(|s| s.as_object().cloned())
            .collect()
    }
}

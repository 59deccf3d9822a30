//! Starts the real `weir-sim` binary on a free loopback port for a test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check
#![allow(dead_code)] // every test binary compiles this module and uses a part of it

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

pub struct Sim {
    child: Child,
    pub base: String,
    pub http: reqwest::Client,
}

impl Sim {
    pub fn start(args: &[&str]) -> Sim {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weir-sim"))
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn weir-sim");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read banner");
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in banner {line:?}"));
        Sim {
            child,
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn post(&self, path: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request")
    }

    /// The text of `/metrics`.
    pub async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics body")
    }

    /// The value of the first series named `name` in `/metrics`, labelled or not.
    pub async fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }

    /// A GET answered with JSON.
    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        self.http
            .get(self.url(path))
            .send()
            .await
            .expect("request")
            .json()
            .await
            .expect("JSON body")
    }

    /// Switches the hang fault; returns what `/debug/faults` says afterwards.
    pub async fn set_hang(&self, on: bool) -> serde_json::Value {
        self.http
            .put(self.url("/debug/faults/hang"))
            .body(on.to_string())
            .send()
            .await
            .expect("hang switch")
            .json()
            .await
            .expect("fault state")
    }

    /// Polls a metric until `done` holds, for at most ten seconds of wall time.
    pub async fn wait_for_metric(&self, name: &str, done: impl Fn(f64) -> bool) -> f64 {
        let mut value = self.metric(name).await;
        for _ in 0..200 {
            if done(value) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            value = self.metric(name).await;
        }
        value
    }

    /// Waits for the process to exit on its own and returns its exit code.
    pub fn wait_exit(&mut self) -> Option<i32> {
        self.child.wait().ok().and_then(|s| s.code())
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A chat completion body.
pub fn chat(model: &str, content: &str, extra: serde_json::Value) -> String {
    let mut body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

/// The `(event, data)` pairs of a stream of named events (Responses, Messages).
pub fn named_events(text: &str) -> Vec<(String, serde_json::Value)> {
    text.split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap_or_else(|| panic!("{frame}"));
            let event = event.strip_prefix("event: ").unwrap().to_owned();
            let data: serde_json::Value =
                serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            (event, data)
        })
        .collect()
}

/// The JSON chunks of a chat or completions stream, which must end with `[DONE]`.
pub fn data_chunks(text: &str) -> Vec<serde_json::Value> {
    let frames: Vec<&str> = text.split("\n\n").filter(|f| !f.is_empty()).collect();
    assert_eq!(frames.last(), Some(&"data: [DONE]"), "{text}");
    frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str(f.strip_prefix("data: ").unwrap()).unwrap())
        .collect()
}

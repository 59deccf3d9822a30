//! What the HTTP handlers share: the engine, its profile and dialect, the faults, the server's
//! settings, and the requests recorded for tests.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use weir_core::error::ErrorShape;

use crate::dialect::{Dialect, Refusal};
use crate::driver::EngineHandle;
use crate::faults::Faults;
use crate::profile::Profile;
use crate::shape::ShapeFlags;

/// Server settings from the command line.
pub struct Settings {
    /// The model name clients must send.
    pub model: String,
    pub seed: u64,
    pub max_body_bytes: usize,
    /// Keep the last N requests (headers and body) for `GET /debug/requests`; 0 keeps none.
    pub record_requests: usize,
    /// How answers are laid out on the wire.
    pub shape: ShapeFlags,
}

/// Everything the handlers share.
pub struct App {
    pub(crate) engine: EngineHandle,
    pub(crate) profile: Profile,
    pub(crate) dialect: Arc<dyn Dialect>,
    pub(crate) faults: Faults,
    pub(crate) settings: Settings,
    recorded: Mutex<VecDeque<Value>>,
    /// The next engine sequence id.
    pub(crate) next_id: AtomicU64,
}

impl App {
    pub fn new(
        engine: EngineHandle,
        profile: Profile,
        dialect: Arc<dyn Dialect>,
        faults: Faults,
        settings: Settings,
    ) -> Self {
        App {
            engine,
            profile,
            dialect,
            faults,
            settings,
            recorded: Mutex::new(VecDeque::new()),
            next_id: AtomicU64::new(1),
        }
    }

    /// A refusal in the error shape the API's clients expect.
    pub(crate) fn refuse(&self, shape: ErrorShape, refusal: impl Into<Refusal>) -> Response {
        refusal.into().reply(self.dialect.as_ref(), shape)
    }

    /// Keeps what a request looked like on arrival, for tests of the proxies in front.
    pub(crate) fn record(&self, path: &str, headers: &HeaderMap, body: &[u8]) {
        if self.settings.record_requests == 0 {
            return;
        }
        // By name (a repeated header's last value), and every line as sent: name and bytes.
        let pairs: Vec<Value> = headers
            .iter()
            .map(|(k, v)| json!([k.as_str(), v.as_bytes()]))
            .collect();
        let headers: serde_json::Map<String, Value> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), json!(String::from_utf8_lossy(v.as_bytes()))))
            .collect();
        let body =
            serde_json::from_slice(body).unwrap_or_else(|_| json!(String::from_utf8_lossy(body)));
        let mut recorded = self.recorded.lock().unwrap_or_else(|e| e.into_inner());
        if recorded.len() == self.settings.record_requests {
            recorded.pop_front();
        }
        recorded.push_back(
            json!({"path": path, "headers": headers, "header_pairs": pairs, "body": body}),
        );
    }

    /// The requests recorded, oldest first.
    pub(crate) fn recorded(&self) -> Vec<Value> {
        let recorded = self.recorded.lock().unwrap_or_else(|e| e.into_inner());
        recorded.iter().cloned().collect()
    }
}

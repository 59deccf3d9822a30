//! What every request handler and relay shares: the dispatcher's channel, the ledger, the
//! metrics, the trust keys, the live settings a reload replaces. Built once by `main`, replaced
//! piecemeal by reloads.

use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use crate::config::RelayConfig;
use crate::dispatch::Event;
use crate::intake::idempotency::Idempotency;
use crate::intake::prediction::Predictions;
use crate::intake::trust::Trust;
use crate::ledger::{Ledger, Reader};
use crate::metrics::Metrics;
use crate::quota::Store;
use crate::support::backoff::Backoff;
use crate::support::live::Live;

/// A model served, and where its requests go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub model: String,
    /// The pool's index in the dispatcher: fixed per model for the process's life.
    pub pool: usize,
    pub affinity_prefix_bytes: usize,
    /// The model's tokenizer, for counting prompts until the engine reports its count.
    pub encoding: weir_core::tokens::Encoding,
}

/// The state every handler and relay shares.
pub struct App {
    pub events: mpsc::UnboundedSender<Event>,
    /// A read connection to the ledger, for the history of idempotency keys.
    pub ledger_reader: Reader,
    pub metrics: Metrics,
    pub registry: Registry,
    pub ledger: Ledger,
    /// The models served, each with its pool's index, affinity prefix length and tokenizer
    /// (live: a reload changes them).
    pub pools: Live<Vec<Route>>,
    /// Prompts up to this many bytes are counted exactly (see [`crate::intake::demand`]).
    pub exact_below_bytes: Live<usize>,
    /// Request bodies larger than this are refused (413).
    pub max_body_bytes: Live<usize>,
    /// Keys each tenant's `cache_salt` (the current signing secret).
    pub cache_salt_key: Vec<u8>,
    pub queue_deadline_ms: Live<u64>,
    /// Verifies the filter's signatures.
    pub trust: Trust,
    /// Claims on callers' idempotency keys.
    pub idempotency: Arc<Idempotency>,
    pub relay: Live<RelayConfig>,
    /// What refusals' `Retry-After` is drawn from.
    pub backoff: Backoff,
    /// The output KV admission holds per request, learned per tenant and pool.
    pub predictions: Predictions,
    /// Tool calls held for an approver ([`crate::approvals`]).
    pub approvals: crate::approvals::Approvals,
    /// The quota service's store, when the config has a `quota` section ([`crate::quota`]).
    pub quota: Option<Store>,
    /// Turns true when the shutdown grace period ends: every request still running is ended
    /// and recorded.
    pub cut: tokio::sync::watch::Receiver<bool>,
    /// Turns true on SIGTERM: `/ready` answers 503 from then on, so gateways health-checking
    /// it (several sidecars per pool) take this one out of their ring before it stops
    /// accepting (`shutdown_leave_ms` later).
    pub draining: tokio::sync::watch::Receiver<bool>,
}

//! The host side of lease renewal ([`weir_core::renewal`]): on every root tick a worker tries
//! to claim the period; the one that wins sends the period's single signed call to the quota
//! service, and its answer (or its failure) lands here. Never on a request's path.

use std::collections::HashMap;

use weir_core::config::{Config, Directory};
use weir_core::fleet::{self, LeaseResponse};
use weir_core::fleet_config::FleetConfig;
use weir_core::keys::hash_key;
use weir_core::renewal::{self, Spec};
use weir_core::reservation;
use weir_core::trusted;

use crate::host::{self, Metrics, SharedData};
use crate::signer::Signer;
use crate::telemetry;

/// What a worker needs to renew: the quota service and every fleet-wide counter's terms.
pub struct Renewal {
    config: FleetConfig,
    specs: HashMap<String, Spec>,
    /// This worker's id in the claim record.
    holder: u64,
    /// The token of this worker's call in flight.
    pending: Option<u32>,
}

impl Renewal {
    /// `None` when the config has no fleet-wide limit to renew.
    pub fn new(config: &Config, directory: &Directory) -> Option<Renewal> {
        let fleet = config.fleet.clone()?;
        let specs: HashMap<String, Spec> = directory
            .tenants()
            .flat_map(reservation::fleet_counters)
            .map(|(key, limit, fleet)| (key, Spec { limit, fleet }))
            .collect();
        (!specs.is_empty()).then(|| Renewal {
            config: fleet,
            specs,
            holder: host::random_u64(),
            pending: None,
        })
    }

    pub fn period_ms(&self) -> u64 {
        self.config.renew_ms
    }

    /// Sends this period's renewal if this worker claims it.
    pub fn tick(&mut self, signer: Option<&Signer>, metrics: &Metrics) {
        let now = host::now_ms();
        let (renew, timeout) = (self.config.renew_ms, self.config.timeout_ms);
        if !renewal::claim(&SharedData, self.holder, now, renew, timeout) {
            return;
        }
        let ask = renewal::plan(&SharedData, &self.specs, now);
        if ask.counters.is_empty() {
            renewal::release(&SharedData, self.holder);
            return;
        }
        let body = serde_json::to_vec(&ask).unwrap_or_default();
        let digest = hash_key(&String::from_utf8_lossy(&body));
        // A fresh id per call: two Envoys may send the same body in the same millisecond, and
        // the service takes each signed call once.
        let call_id = host::unique_id();
        let vouched = [
            (trusted::REQUEST_ID, call_id.as_str()),
            (trusted::BODY_SHA256, digest.as_str()),
        ];
        let signature = signer.and_then(|s| s.sign(&vouched, now));
        let mut headers = vec![
            (":method", "POST"),
            (":path", fleet::PATH),
            (":authority", self.config.authority.as_str()),
            ("content-type", "application/json"),
            (trusted::REQUEST_ID, call_id.as_str()),
            (trusted::BODY_SHA256, digest.as_str()),
        ];
        if let Some(signature) = &signature {
            headers.push((trusted::SIGNATURE, signature));
        }
        match host::dispatch(&self.config.cluster, &headers, &body, timeout) {
            Ok(token) => self.pending = Some(token),
            Err(status) => {
                log::warn!("weir: cannot call the quota service: {status:?}");
                self.failed(metrics, now);
            }
        }
    }

    /// The quota service's answer to this worker's call.
    pub fn answered(&mut self, token: u32, body_size: usize, metrics: &Metrics) {
        if self.pending != Some(token) {
            return;
        }
        self.pending = None;
        let now = host::now_ms();
        let (status, body) = host::call_response(body_size);
        let parsed = serde_json::from_slice::<LeaseResponse>(&body);
        match (status, parsed) {
            (Some(200), Ok(response)) => {
                renewal::apply(&SharedData, &self.specs, &response, now);
                renewal::release(&SharedData, self.holder);
                metrics.add(telemetry::FLEET_RENEWALS, 1);
            }
            (status, _) => {
                log::warn!(
                    "weir: lease renewal failed (status {status:?}); the store counts as down"
                );
                self.failed(metrics, now);
            }
        }
    }

    fn failed(&self, metrics: &Metrics, now: u64) {
        renewal::mark_down(&SharedData, now);
        renewal::release(&SharedData, self.holder);
        metrics.add(telemetry::FLEET_RENEWAL_FAILURES, 1);
    }
}

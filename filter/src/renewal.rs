//! The host side of lease renewal ([`weir_core::renewal`]): on every root tick a worker tries
//! to claim the period; the one that wins sends the period's single signed call to the quota
//! service, and its answer (or its failure) lands here. A request that finds no lease sends
//! its own call at once ([`send`], [`answer`]; `crate::exchange`). Both go through the
//! exchange's [`Host`], so a request's own call runs natively in its tests.

use std::collections::HashMap;

use weir_core::config::{Config, Directory};
use weir_core::fleet::{self, LeaseRequest, LeaseResponse};
use weir_core::fleet_config::FleetConfig;
use weir_core::keys::hash_key;
use weir_core::renewal::{self, Spec};
use weir_core::trusted;

use crate::exchange::Host;
use crate::host::{self, SharedData};
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
    /// `None` when the config has no fleet-wide limit to renew. Names this Envoy as a holder
    /// of leases, if no VM of it has yet.
    pub fn new(config: &Config, directory: &Directory) -> Option<Renewal> {
        let fleet = config.fleet.clone()?;
        let specs = renewal::specs(directory.tenants());
        if !specs.is_empty() {
            renewal::name_holder(&SharedData, &format!("{:016x}", host::random_u64()));
        }
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
    pub fn tick(&mut self, host: &impl Host, signer: Option<&Signer>) {
        let now = host.now_ms();
        let (renew, timeout) = (self.config.renew_ms, self.config.timeout_ms);
        if !renewal::claim(host.store(), self.holder, now, renew, timeout) {
            return;
        }
        let ask = renewal::plan(host.store(), &self.specs, now);
        if ask.counters.is_empty() {
            renewal::release(host.store(), self.holder);
            return;
        }
        match send(host, &self.config, signer, ask, now) {
            Some(token) => self.pending = Some(token),
            None => self.failed(host),
        }
    }

    /// The quota service's answer to this worker's call.
    pub fn answered(&mut self, host: &impl Host, token: u32, body_size: usize) {
        if self.pending != Some(token) {
            return;
        }
        self.pending = None;
        let now = host.now_ms();
        if answer(host, &self.specs, body_size, now) {
            renewal::release(host.store(), self.holder);
            host.add(telemetry::FLEET_RENEWALS, 1);
        } else {
            self.failed(host);
        }
    }

    /// The call failed (the store is marked down): the next period's holder tries again.
    fn failed(&self, host: &impl Host) {
        renewal::release(host.store(), self.holder);
        host.add(telemetry::FLEET_RENEWAL_FAILURES, 1);
    }
}

/// Sends `ask` to the quota service as this Envoy's, signed; the call's token, or `None`
/// (logged, and the store marked down) when it cannot be sent.
pub fn send(
    host: &impl Host,
    config: &FleetConfig,
    signer: Option<&Signer>,
    mut ask: LeaseRequest,
    now: u64,
) -> Option<u32> {
    ask.holder = renewal::holder(host.store(), config.hold_ms());
    let body = serde_json::to_vec(&ask).unwrap_or_default();
    match call(host, config, signer, fleet::PATH, &body, now) {
        Ok(token) => Some(token),
        Err(status) => {
            log::warn!("weir: cannot call the quota service: {status:?}");
            renewal::mark_down(host.store(), now);
            None
        }
    }
}

/// Posts `body` to the quota service's `path`, signed over its digest; the call's token.
pub fn call(
    host: &impl Host,
    config: &FleetConfig,
    signer: Option<&Signer>,
    path: &str,
    body: &[u8],
    now: u64,
) -> Result<u32, proxy_wasm::types::Status> {
    let digest = hash_key(&String::from_utf8_lossy(body));
    // A fresh id per call: two Envoys may send the same body in the same millisecond, and
    // the service takes each signed call once.
    let call_id = host.unique_id();
    let vouched = [
        (trusted::REQUEST_ID, call_id.as_str()),
        (trusted::BODY_SHA256, digest.as_str()),
    ];
    let signature = signer.and_then(|s| s.sign(&vouched, now));
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", config.authority.as_str()),
        ("content-type", "application/json"),
        (trusted::REQUEST_ID, call_id.as_str()),
        (trusted::BODY_SHA256, digest.as_str()),
    ];
    if let Some(signature) = &signature {
        headers.push((trusted::SIGNATURE, signature));
    }
    host.dispatch(&config.cluster, &headers, body, config.timeout_ms)
}

/// Applies the quota service's answer to a call of [`send`] (its grants to `specs`' leases);
/// `false`, logged and the store marked down, when it failed.
pub fn answer(host: &impl Host, specs: &HashMap<String, Spec>, body_size: usize, now: u64) -> bool {
    let (status, body) = host.call_response(body_size);
    match (status, serde_json::from_slice::<LeaseResponse>(&body)) {
        (Some(200), Ok(response)) => {
            renewal::apply(host.store(), specs, &response, now);
            true
        }
        (status, _) => {
            log::warn!("weir: lease call failed (status {status:?}); the store counts as down");
            renewal::mark_down(host.store(), now);
            false
        }
    }
}

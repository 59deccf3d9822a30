//! The request headers: strip what the caller may not send, draw the attempt id, pick the
//! route's mode, authenticate, route to an API, take the request's slot, and send the headers
//! on (the body, if any, is held: `admit.rs`).

use std::sync::Arc;

use proxy_wasm::types::Action;
use weir_core::config::{KeyRefusal, Mode, RouteConfig, Tenant};
use weir_core::endpoint::Endpoint;
use weir_core::error::{ApiError, ErrorShape};
use weir_core::keys::{hash_key, key_from_headers};
use weir_core::path::{self, Route};
use weir_core::reservation::{self, Ledger};
use weir_core::trusted;

use super::respond::is_identity;
use super::tools;
use super::{Exchange, Headers, Host, Side, Stage};
use crate::host::staged;
use crate::telemetry;
use weir_core::outcome;

/// The caller's deduplication header (IETF httpapi `Idempotency-Key`).
const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// Sent by Anthropic's SDKs on every request: such a client gets Anthropic-shaped errors and
/// rate-limit headers on any path.
const ANTHROPIC_VERSION_HEADER: &str = "anthropic-version";

impl Exchange {
    pub fn on_headers(&mut self, host: &impl Host, end_of_stream: bool) -> Action {
        let headers = host.headers(Side::Request);
        for name in headers.names() {
            if trusted::is_reserved(name) {
                host.set_header(Side::Request, name, None);
            }
        }
        self.shape = staged("shape", || self.error_shape(&headers));
        #[cfg(feature = "fault-injection")]
        {
            self.fault = crate::fault::asked(&headers);
        }
        // The caller's x-request-id is a trace id (a mesh propagates it across calls): it is
        // passed on untouched and never identifies an attempt.
        let attempt_id = host.unique_id();
        let (label, route) = staged("route", || self.route(host));
        // Read before the strip above took effect: the default run-id header is weir's own.
        let run_header = route.run_id_header.as_deref();
        let run_id = headers.get(run_header.unwrap_or(super::run::DEFAULT_RUN_ID_HEADER));
        let mode = mode(&route, &attempt_id);
        if mode == Mode::Ignore {
            self.stage = Stage::Ignored;
            return Action::Continue;
        }
        self.vouch(trusted::ROUTE, label.clone());
        self.vouch(trusted::MODE, mode.as_str());
        self.counted_as = Some((label, route.mode));
        self.vouch(trusted::REQUEST_ID, attempt_id);
        self.caller_request_id = headers.get("x-request-id").map(str::to_owned);
        self.approval_resend = headers.get(tools::APPROVAL_ID_HEADER).is_some();
        let idempotency_key = Self::idempotency_key(&headers);
        if let Ok(Some(key)) = &idempotency_key {
            self.vouch(trusted::IDEMPOTENCY_KEY, key.clone());
        }
        if mode == Mode::Off {
            if let Ok(tenant) = self.authenticate(host, &headers) {
                self.identify(tenant);
            }
            return self.send_headers(host);
        }
        self.shadow = mode == Mode::Shadow;
        self.outcome = outcome::OK;
        self.enforce_headers(host, &headers, idempotency_key, run_id, end_of_stream)
    }

    /// A route that enforces (or shadows enforcement): the caller's key must be valid, and so
    /// must its idempotency key.
    fn enforce_headers(
        &mut self,
        host: &impl Host,
        headers: &Headers,
        idempotency_key: Result<Option<String>, ApiError>,
        run_id: Option<&str>,
        end_of_stream: bool,
    ) -> Action {
        let tenant = match staged("authenticate", || self.authenticate(host, headers)) {
            Ok(tenant) => tenant,
            Err((reason, message)) => {
                // OpenAI's code for a missing or unknown key; weir's own for a known one refused.
                let code = if reason == "missing_api_key" {
                    "invalid_api_key"
                } else {
                    reason
                };
                let error = ApiError::new(401, message).with_code(code);
                return self.refuse_with(host, &error, reason, Stage::Passthrough);
            }
        };
        if let Err(error) = idempotency_key {
            return self.refuse_with(host, &error, "invalid_idempotency_key", Stage::Passthrough);
        }
        self.withhold_api_key(host);
        self.identify(tenant);
        if let Err(error) = self.name_run(run_id) {
            return self.refuse_with(host, &error, "invalid_run_id", Stage::Passthrough);
        }
        self.route_to_api(host, headers, end_of_stream)
    }

    /// The request's route: its metrics label, and its config with what the route's metadata
    /// sets.
    fn route(&self, host: &impl Host) -> (String, RouteConfig) {
        let route_name = host.property(&["xds", "route_name"]);
        let mut route = self.gw.config.route(route_name.as_deref()).clone();
        let meta = |key| host.property(&["xds", "route_metadata", "filter_metadata", "weir", key]);
        if let Some(mode) = meta("mode").and_then(|m| serde_json::from_value(m.into()).ok()) {
            route.mode = mode;
        }
        if let Some(pct) = meta("rollout_percent").and_then(|p| p.parse().ok()) {
            route.rollout_percent = pct;
        }
        (telemetry::route_label(route_name.as_deref()), route)
    }

    /// The tenant of the request's key, if it carries a known one that may be used now.
    fn authenticate(
        &self,
        host: &impl Host,
        headers: &Headers,
    ) -> Result<Arc<Tenant>, (&'static str, &'static str)> {
        let key = key_from_headers(headers.get("authorization"), headers.get("x-api-key"));
        let tenant = key.and_then(|k| self.gw.directory.lookup(&hash_key(k)).cloned());
        match (key, tenant) {
            (None, _) => Err((
                "missing_api_key",
                "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
            )),
            (Some(_), None) => Err(("invalid_api_key", "Incorrect API key provided.")),
            (Some(_), Some(tenant)) => match tenant.refusal(host.now_ms()) {
                None => Ok(tenant),
                Some(KeyRefusal::Disabled) => {
                    Err(("key_disabled", "This API key has been disabled."))
                }
                Some(KeyRefusal::Expired) => Err(("key_expired", "This API key has expired.")),
            },
        }
    }

    /// The caller's `Idempotency-Key`, carried to the sidecar (which deduplicates per tenant),
    /// or why it cannot be used.
    fn idempotency_key(headers: &Headers) -> Result<Option<String>, ApiError> {
        match headers.get(IDEMPOTENCY_KEY_HEADER) {
            None => Ok(None),
            Some(key) if trusted::is_id(key) => Ok(Some(key.to_owned())),
            Some(_) => Err(ApiError::bad_request(
                "Idempotency-Key must be 1 to 255 visible ASCII characters",
            )
            .with_param("Idempotency-Key")
            .with_code("invalid_idempotency_key")),
        }
    }

    /// Anthropic's shape for the Messages API and for Anthropic's SDKs (which say so in every
    /// request), OpenAI's for everything else.
    fn error_shape(&self, headers: &Headers) -> ErrorShape {
        let raw = headers.get(":path").unwrap_or_default();
        let messages = path::canonical(raw).is_ok_and(|p| {
            path::classify(&p, self.gw.config.allowed_paths.as_slice())
                == path::Api::Metered(Endpoint::Messages)
        });
        if messages || headers.get(ANTHROPIC_VERSION_HEADER).is_some() {
            ErrorShape::Anthropic
        } else {
            ErrorShape::OpenAi
        }
    }

    /// The key stops at the gateway unless the config forwards it. Routes where weir is not in
    /// play (off, outside the rollout) pass the caller's headers on untouched: the upstream may
    /// authenticate the caller itself.
    fn withhold_api_key(&self, host: &impl Host) {
        if !self.gw.config.forward_api_key {
            host.set_header(Side::Request, "authorization", None);
            host.set_header(Side::Request, "x-api-key", None);
        }
    }

    /// Which API the request is for, by the canonical spelling of its path and by its method
    /// (deny by default, see [`path::route`]).
    fn route_to_api(&mut self, host: &impl Host, headers: &Headers, end_of_stream: bool) -> Action {
        let raw = headers.get(":path").unwrap_or_default();
        let method = headers.get(":method").unwrap_or_default();
        match path::route(raw, method, &self.gw.config.allowed_paths) {
            Ok(Route::Metered(endpoint)) => {
                self.endpoint = Some(endpoint);
                self.await_body(host, headers, end_of_stream)
            }
            Ok(Route::Unmetered) => {
                // Not inference (models, health, ...): authenticated, nothing to meter; the
                // answer still says where the key's limits stand.
                if let (Some(tenant), false) = (&self.tenant, self.shadow) {
                    self.standing =
                        reservation::standing(host.store(), tenant, Ledger::Enforce, host.now_ms());
                }
                self.stage = Stage::Forwarded;
                self.send_headers(host)
            }
            Ok(Route::Weir) => {
                // weir's approvals API, answered by the sidecar: it trusts the key's approver
                // scopes only as vouched here.
                if let Some(tenant) = self.tenant.as_ref().filter(|t| !t.approves.is_empty()) {
                    self.vouch(trusted::APPROVES, tenant.approves.join(","));
                }
                self.stage = Stage::Forwarded;
                self.send_headers(host)
            }
            Err(refusal) => {
                let mut reply = self.error_reply(&refusal.error);
                if let Some(allow) = refusal.allow {
                    reply.headers.push(("allow", allow.to_owned()));
                }
                self.refuse(host, reply, refusal.reason, Stage::Passthrough)
            }
        }
    }

    /// Sends the headers on and holds the body until it is read, unless the body cannot be
    /// admitted anyway.
    fn await_body(&mut self, host: &impl Host, headers: &Headers, end_of_stream: bool) -> Action {
        if let Some(encoding) = headers.get("content-encoding").filter(|e| !is_identity(e)) {
            let error = ApiError::new(
                415,
                format!(
                    "Compressed request bodies (content-encoding: {encoding}) are not accepted; \
                     send the JSON body uncompressed."
                ),
            )
            .with_code("unsupported_content_encoding");
            return self.refuse_with(host, &error, "unsupported_encoding", Stage::Passthrough);
        }
        // Usage is read from the response as it passes: the upstream must not compress it.
        host.set_header(Side::Request, "accept-encoding", Some("identity"));
        let limit = self.gw.config.max_body_bytes;
        let declared = headers.get("content-length").and_then(|v| v.parse().ok());
        if declared.is_some_and(|len: usize| len > limit) {
            let error = ApiError::payload_too_large(limit);
            return self.refuse_with(host, &error, "body_too_large", Stage::Passthrough);
        }
        if end_of_stream {
            let error = ApiError::bad_request("a JSON request body is required");
            return self.refuse_with(host, &error, "missing_body", Stage::Passthrough);
        }
        // Admission may rewrite the body, whose length is not known until then.
        host.set_header(Side::Request, "content-length", None);
        self.stage = Stage::AwaitingBody;
        let action = staged("reserve", || self.reserve_request(host));
        if self.stage == Stage::Replied {
            return action;
        }
        self.send_headers(host)
    }
}

/// The route's mode for a request, after the route's rollout share. The share is drawn from
/// `attempt_id`, which weir generates at random, so no caller can steer its bucket.
fn mode(route: &RouteConfig, attempt_id: &str) -> Mode {
    if route.mode == Mode::Ignore || rollout_bucket(attempt_id) < u32::from(route.rollout_percent) {
        route.mode
    } else {
        Mode::Off
    }
}

/// A stable 0–99 bucket for a request id (FNV-1a), so rollout shares are deterministic.
pub(super) fn rollout_bucket(request_id: &str) -> u32 {
    let hash = request_id.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    hash % 100
}

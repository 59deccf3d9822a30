//! One HTTP exchange through the filter, from request headers to the access log.
//!
//! ```text
//! headers ─► strip x-weir-*, new attempt id, pick route mode, authenticate, route
//!        ─► charge the request and its concurrency slot at every level (a metered API)
//!        ─► send the headers on with the trusted x-weir-* identity headers, signed (every
//!           request, whatever the mode: off, shadow and out-of-rollout requests are scheduled
//!           too, as their tenant when the key is valid, else as the configured default tenant)
//! body    ─► held until complete (at its end, or at its trailers when it ends in them)
//!        ─► admit (parse, limits, estimate) ─► reserve its tokens ─► rewrite ─► let it go
//!           (a refusal answers locally; the upstream, which had only the headers, is reset)
//! response─► meter the stream/body as it passes (usage chunk hidden unless asked for)
//! end     ─► settle: engine usage replaces the reservation   (on_log settles anything left:
//!                                                             client gone, upstream reset)
//! ```
//!
//! The headers go on before the body is read because that is all a mesh lets a module do:
//! Istio's `WasmPlugin` and Envoy Gateway's `EnvoyExtensionPolicy` cannot set
//! `allow_on_headers_stop_iteration`, without which a module that stops the headers never sees
//! the body. Holding the body is enough to fail closed: no body, no work. So what the trusted
//! headers carry is what authentication knows (the identity), and the sidecar derives the
//! rest (the prompt's size, the output reserved) from the admitted body it receives. A request
//! holds a stream upstream from its headers on, so it takes its concurrency slot before they
//! go: a tenant holding bodies back cannot keep more requests open at the upstream (the
//! sidecar's connections, the cluster's circuit breakers, shared by every tenant) than its
//! limits allow.

use std::rc::Rc;
use std::sync::Arc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use weir_core::admission::{self, Admitted};
use weir_core::config::{KeyRefusal, Mode, RouteConfig, Tenant};
use weir_core::endpoint::Endpoint;
use weir_core::error::{ApiError, ErrorShape};
use weir_core::estimate::{Counting, Method};
use weir_core::keys::{hash_key, key_from_headers};
use weir_core::meter::{BodyMeter, BodyUsage, StreamMeter};
use weir_core::path::{self, Route};
use weir_core::prediction;
use weir_core::price;
use weir_core::renewal;
use weir_core::reply::{self, Reply};
use weir_core::reservation::{
    self, Demand, Denial, Ledger, LimitKind, Reservation, SlotLease, Standing,
};
use weir_core::trusted;

use crate::Gateway;
use crate::host::{self, Headers, SharedData, Side};
use crate::telemetry::{self, AccessRecord, Decision};

/// The caller's deduplication header (IETF httpapi `Idempotency-Key`).
const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// Set on a response the sidecar (or a hosted API) answered from completed work.
const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Sent by Anthropic's SDKs on every request: such a client gets Anthropic-shaped errors and
/// rate-limit headers on any path.
const ANTHROPIC_VERSION_HEADER: &str = "anthropic-version";

/// Non-streamed response bodies larger than this are not copied: only their usage is read, as
/// they pass (no estimate from their text when they report none).
const MAX_METERED_BODY: usize = 4 * 1024 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Not weir's route (mode `ignore`): passed as it came, nothing recorded.
    Ignored,
    /// Not metered: the route is off or outside its rollout, or shadow let it through. Still
    /// forwarded with signed trusted headers.
    Passthrough,
    /// Authenticated, headers sent on; the body is held until it is complete and admitted.
    AwaitingBody,
    /// Admitted and sent upstream whole; waiting for the response.
    Forwarded,
    Responding,
    /// Answered locally (rejected).
    Replied,
    /// Settled.
    Done,
}

/// A lease the request asked the quota service for at once: a fleet-wide token limit had none
/// on this Envoy for its body ([`Denial::Unleased`]: the first request after a start, or after
/// the tenant was idle), though the store may hold the tokens. Rather than refused, the body
/// waits for the answer (at most the fleet's `timeout_ms`; a failed call marks the store down,
/// and its `fail_open`/`fail_closed` rule decides), then is charged again — once: a second
/// shortage is the limit's refusal. (A request count found no lease at the headers is owed
/// instead, its slot held: see `Allowance::owe`.)
enum Lease {
    NotAsked,
    /// The call's token, and the body waiting for the answer once it is whole.
    Asked {
        token: u32,
        waiting: Option<Vec<u8>>,
    },
    Answered,
}

enum Meter {
    None,
    Stream(StreamMeter),
    Body(BodyMeter),
    /// The upstream encoded the response (`content-encoding`) although asked not to: passed on
    /// untouched, and the reservation stands as the charge.
    Unreadable,
}

pub struct Request {
    gw: Rc<Gateway>,
    stage: Stage,
    shadow: bool,
    endpoint: Option<Endpoint>,
    tenant: Option<Arc<Tenant>>,
    admitted: Option<Admitted>,
    reservation: Option<Reservation>,
    lease: Lease,
    meter: Meter,
    upstream_status: u16,
    /// In shadow mode, the first rejection enforcement would have made.
    would_reject: Option<&'static str>,
    /// The route's metrics label and mode, which its decision is counted under (none on an
    /// ignored route).
    counted_as: Option<(String, Mode)>,
    outcome: &'static str,
    usage: Demand,
    /// The `x-weir-*` headers this request carries upstream, written and signed together when
    /// its headers are sent on.
    vouched: Vec<(&'static str, String)>,
    /// The headers have gone upstream: nothing more can be added to them.
    headers_sent: bool,
    /// The upstream answered from completed work (an idempotency replay): nothing ran.
    replayed: bool,
    /// The error body and rate-limit headers the caller's API uses.
    shape: ErrorShape,
    /// Where the limits on the key's path stood when the request was let through: reported on
    /// the answer.
    standing: Vec<Standing>,
    /// The fault a test asked this request for (`filter/src/fault.rs`).
    #[cfg(feature = "fault-injection")]
    fault: Option<String>,
}

impl Request {
    pub fn new(gw: Rc<Gateway>) -> Self {
        Request {
            gw,
            stage: Stage::Passthrough,
            shadow: false,
            endpoint: None,
            tenant: None,
            admitted: None,
            reservation: None,
            lease: Lease::NotAsked,
            meter: Meter::None,
            upstream_status: 0,
            would_reject: None,
            counted_as: None,
            outcome: "passthrough",
            usage: Demand::default(),
            vouched: Vec::new(),
            headers_sent: false,
            replayed: false,
            shape: ErrorShape::OpenAi,
            standing: Vec::new(),
            #[cfg(feature = "fault-injection")]
            fault: None,
        }
    }

    /// A local error reply in the caller's API's shape.
    fn error_reply(&self, error: &ApiError) -> Reply {
        Reply::error(error, self.shape)
    }

    /// The request's route: its metrics label, and its config with what the route's metadata
    /// sets.
    fn route(&self) -> (String, RouteConfig) {
        let route_name = host::property(vec!["xds", "route_name"]);
        let mut route = self.gw.config.route(route_name.as_deref()).clone();
        let meta = |key| {
            host::property(vec![
                "xds",
                "route_metadata",
                "filter_metadata",
                "weir",
                key,
            ])
        };
        if let Some(mode) = meta("mode").and_then(|m| serde_json::from_value(m.into()).ok()) {
            route.mode = mode;
        }
        if let Some(pct) = meta("rollout_percent").and_then(|p| p.parse().ok()) {
            route.rollout_percent = pct;
        }
        (telemetry::route_label(route_name.as_deref()), route)
    }

    /// What the filter decided on the request, once it has: none while the body it decides on
    /// is awaited (the caller left before sending it all).
    fn decision(&self) -> Option<Decision> {
        if self.stage == Stage::Replied {
            Some(Decision::Rejected)
        } else if self.would_reject.is_some() {
            Some(Decision::WouldReject)
        } else if self.admitted.is_some() {
            Some(Decision::Admitted)
        } else if self.stage == Stage::AwaitingBody {
            None
        } else {
            Some(Decision::Unmetered)
        }
    }

    /// Enforce: answer locally and stop. Shadow: note what would have happened and go on at
    /// `shadow_stage`. Either way the request holds nothing from then on: what it had reserved
    /// is given back.
    fn refuse(&mut self, reply: Reply, reason: &'static str, shadow_stage: Stage) -> Action {
        self.cancel_reservation();
        let counter = telemetry::rejection_metric(reason, self.shadow);
        self.gw.metrics.add(&counter, 1);
        if self.shadow {
            self.gw.metrics.add(telemetry::SHADOW_WOULD_REJECT, 1);
            self.would_reject.get_or_insert(reason);
            self.stage = shadow_stage;
            if shadow_stage == Stage::Passthrough {
                self.outcome = "passthrough";
            }
            return self.send_headers();
        }
        self.stage = Stage::Replied;
        self.outcome = "rejected";
        host::local_reply(reply.status, &reply.headers, &reply.body);
        Action::Pause
    }

    /// The counters this request is charged to.
    fn ledger(&self) -> Ledger {
        if self.shadow {
            Ledger::Shadow
        } else {
            Ledger::Enforce
        }
    }

    /// Takes the request and its concurrency slot at every level on the key's path before its
    /// headers go on; its tokens follow once the body says how many ([`Self::admit_body`]).
    fn reserve_request(&mut self) -> Action {
        let Some(tenant) = self.tenant.clone() else {
            return Action::Continue;
        };
        let slot = SlotLease {
            id: host::random_u64(),
            ttl_ms: self.gw.config.slot_lease_ms,
        };
        let now = host::now_ms();
        match reservation::reserve(
            &SharedData,
            &tenant,
            Demand::default(),
            self.ledger(),
            slot,
            now,
        ) {
            Ok(r) => {
                if let Ok(mut in_flight) = self.gw.in_flight.try_borrow_mut() {
                    in_flight.insert(slot.id, r.clone());
                }
                self.reservation = Some(r);
                Action::Continue
            }
            Err(denial) => {
                // In shadow mode the request goes on, metered but holding no reservation.
                let reply = Reply::denied(&denial, self.shape, now);
                self.refuse(reply, denial_reason(&denial), Stage::AwaitingBody)
            }
        }
    }

    /// Asks the quota service at once for the leases the tenant's fleet-wide limits lack
    /// ([`Lease`]): `true` when the call went out, `false` when the request asked already,
    /// has nothing to ask, or the call cannot be sent (then the refusal stands, and the store
    /// counts as down for the next request).
    fn ask_lease(&mut self) -> bool {
        let (Lease::NotAsked, false, Some(fleet), Some(tenant)) = (
            &self.lease,
            self.shadow,
            self.gw.config.fleet.as_ref(),
            self.tenant.as_deref(),
        ) else {
            return false;
        };
        let now = host::now_ms();
        let ask = renewal::plan_for(&SharedData, &renewal::specs([tenant]), now);
        if ask.counters.is_empty() {
            return false;
        }
        self.lease = Lease::Answered;
        let Some(token) = crate::renewal::send(fleet, self.gw.signer.as_ref(), ask, now) else {
            return false;
        };
        self.gw
            .metrics
            .add(telemetry::FLEET_LEASES_ASKED_AT_ONCE, 1);
        self.lease = Lease::Asked {
            token,
            waiting: None,
        };
        true
    }

    /// The quota service answered this request's call ([`Self::ask_lease`]): its grants go to
    /// the leases, and a body that waited for them is admitted again.
    fn on_lease(&mut self, token: u32, body_size: usize) {
        if !matches!(self.lease, Lease::Asked { token: asked, .. } if asked == token) {
            return;
        }
        let Lease::Asked { waiting, .. } = std::mem::replace(&mut self.lease, Lease::Answered)
        else {
            return;
        };
        if let Some(tenant) = self.tenant.as_deref() {
            crate::renewal::answer(&renewal::specs([tenant]), body_size, host::now_ms());
        }
        if let Some(body) = waiting
            && matches!(self.admit_body(body), Action::Continue)
        {
            host::resume_request();
        }
    }

    /// Gives back whatever the request holds, its request count too.
    fn cancel_reservation(&mut self) {
        let Some(r) = self.reservation.take() else {
            return;
        };
        if let Ok(mut in_flight) = self.gw.in_flight.try_borrow_mut() {
            in_flight.remove(&r.slot.id);
        }
        let conflicts = reservation::cancel(&SharedData, &r, host::now_ms());
        self.gw
            .metrics
            .add(telemetry::SETTLE_CONFLICTS, conflicts as i64);
        self.gw.metrics.add(telemetry::RESERVED, -total(r.demand));
    }

    /// Adds a trusted header to what this request will carry.
    fn vouch(&mut self, name: &'static str, value: impl Into<String>) {
        self.vouched.retain(|(n, _)| *n != name);
        self.vouched.push((name, value.into()));
    }

    /// Vouches for the identity the request is scheduled as.
    fn identify(&mut self, tenant: Arc<Tenant>) {
        self.vouch(trusted::TENANT, tenant.path());
        self.vouch(trusted::ORG, tenant.org.clone());
        self.vouch(trusted::TIER, tenant.tier.as_str());
        self.vouch(trusted::WEIGHT, trusted::format_weights(&tenant.weights));
        self.vouch(trusted::PRIORITY, tenant.priority.as_str());
        if let Some(cap) = tenant.tightest(|l| l.active_kv_tokens) {
            self.vouch(trusted::KV_LIMIT, cap.to_string());
        }
        if let Some(models) = &tenant.models {
            self.vouch(trusted::MODELS, models.join(","));
        }
        if let Some(prices) = &self.gw.price_header {
            self.vouch(trusted::PRICE, prices.clone());
        }
        self.tenant = Some(tenant);
    }

    /// Lets the request's headers go upstream: writes every trusted header and, when signing
    /// is configured, the signature over them. The only way a request leaves the filter (its
    /// body may still be held); a request with no identity yet (a route that does not enforce,
    /// no valid key) goes as the default tenant. Once only.
    fn send_headers(&mut self) -> Action {
        if std::mem::replace(&mut self.headers_sent, true) {
            return Action::Continue;
        }
        if self.tenant.is_none() {
            // Every keyless caller shares the default tenant: an idempotency key there would
            // let one caller block, or be answered with, another's work.
            self.vouched.retain(|(n, _)| *n != trusted::IDEMPOTENCY_KEY);
            self.identify(self.gw.default_tenant.clone());
        }
        for (name, value) in &self.vouched {
            host::set_header(Side::Request, name, Some(value));
        }
        if let Some(signer) = &self.gw.signer {
            let view: Vec<(&str, &str)> =
                self.vouched.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let signature = host::staged("sign", || signer.sign(&view, host::now_ms()));
            host::set_header(Side::Request, trusted::SIGNATURE, signature.as_deref());
        }
        Action::Continue
    }

    /// The tenant of the request's key, if it carries a known one that may be used now.
    fn authenticate(&self, headers: &Headers) -> Result<Arc<Tenant>, (&'static str, &'static str)> {
        let key = key_from_headers(headers.get("authorization"), headers.get("x-api-key"));
        let tenant = key.and_then(|k| self.gw.directory.lookup(&hash_key(k)).cloned());
        match (key, tenant) {
            (None, _) => Err((
                "missing_api_key",
                "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
            )),
            (Some(_), None) => Err(("invalid_api_key", "Incorrect API key provided.")),
            (Some(_), Some(tenant)) => match tenant.refusal(host::now_ms()) {
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

    fn on_headers(&mut self, end_of_stream: bool) -> Action {
        let headers = Headers::read(Side::Request);
        for name in headers.names() {
            if trusted::is_reserved(name) {
                host::set_header(Side::Request, name, None);
            }
        }
        self.shape = host::staged("shape", || self.error_shape(&headers));
        #[cfg(feature = "fault-injection")]
        {
            self.fault = crate::fault::asked(&headers);
        }
        // The caller's x-request-id is a trace id (a mesh propagates it across calls): it is
        // passed on untouched and never identifies an attempt.
        let attempt_id = host::unique_id();
        let (label, route) = host::staged("route", || self.route());
        let mode = mode(&route, &attempt_id);
        if mode == Mode::Ignore {
            self.stage = Stage::Ignored;
            return Action::Continue;
        }
        self.vouch(trusted::ROUTE, label.clone());
        self.vouch(trusted::MODE, mode.as_str());
        self.counted_as = Some((label, route.mode));
        self.vouch(trusted::REQUEST_ID, attempt_id);
        let idempotency_key = Self::idempotency_key(&headers);
        if let Ok(Some(key)) = &idempotency_key {
            self.vouch(trusted::IDEMPOTENCY_KEY, key.clone());
        }
        if mode == Mode::Off {
            if let Ok(tenant) = self.authenticate(&headers) {
                self.identify(tenant);
            }
            return self.send_headers();
        }
        self.shadow = mode == Mode::Shadow;
        self.outcome = "ok";

        let tenant = match host::staged("authenticate", || self.authenticate(&headers)) {
            Ok(tenant) => tenant,
            Err((reason, message)) => {
                // OpenAI's code for a missing or unknown key; weir's own for a known one refused.
                let code = if reason == "missing_api_key" {
                    "invalid_api_key"
                } else {
                    reason
                };
                let error = ApiError::new(401, message).with_code(code);
                return self.refuse(self.error_reply(&error), reason, Stage::Passthrough);
            }
        };
        if let Err(error) = idempotency_key {
            return self.refuse(
                self.error_reply(&error),
                "invalid_idempotency_key",
                Stage::Passthrough,
            );
        }
        self.withhold_api_key();
        self.identify(tenant);
        self.route_to_api(&headers, end_of_stream)
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
    fn withhold_api_key(&self) {
        if !self.gw.config.forward_api_key {
            host::set_header(Side::Request, "authorization", None);
            host::set_header(Side::Request, "x-api-key", None);
        }
    }

    /// Which API the request is for, by the canonical spelling of its path and by its method
    /// (deny by default, see [`path::route`]).
    fn route_to_api(&mut self, headers: &Headers, end_of_stream: bool) -> Action {
        let raw = headers.get(":path").unwrap_or_default();
        let method = headers.get(":method").unwrap_or_default();
        match path::route(raw, method, &self.gw.config.allowed_paths) {
            Ok(Route::Metered(endpoint)) => {
                self.endpoint = Some(endpoint);
                self.await_body(headers, end_of_stream)
            }
            Ok(Route::Unmetered) => {
                // Not inference (models, health, ...): authenticated, nothing to meter; the
                // answer still says where the key's limits stand.
                if let (Some(tenant), false) = (&self.tenant, self.shadow) {
                    self.standing =
                        reservation::standing(&SharedData, tenant, Ledger::Enforce, host::now_ms());
                }
                self.stage = Stage::Forwarded;
                self.send_headers()
            }
            Err(refusal) => {
                let mut reply = self.error_reply(&refusal.error);
                if let Some(allow) = refusal.allow {
                    reply.headers.push(("allow", allow.to_owned()));
                }
                self.refuse(reply, refusal.reason, Stage::Passthrough)
            }
        }
    }

    /// Sends the headers on and holds the body until it is read, unless the body cannot be
    /// admitted anyway.
    fn await_body(&mut self, headers: &Headers, end_of_stream: bool) -> Action {
        if let Some(encoding) = headers.get("content-encoding").filter(|e| !is_identity(e)) {
            let error = ApiError::new(
                415,
                format!(
                    "Compressed request bodies (content-encoding: {encoding}) are not accepted; \
                     send the JSON body uncompressed."
                ),
            )
            .with_code("unsupported_content_encoding");
            return self.refuse(
                self.error_reply(&error),
                "unsupported_encoding",
                Stage::Passthrough,
            );
        }
        // Usage is read from the response as it passes: the upstream must not compress it.
        host::set_header(Side::Request, "accept-encoding", Some("identity"));
        let limit = self.gw.config.max_body_bytes;
        let declared = headers.get("content-length").and_then(|v| v.parse().ok());
        if declared.is_some_and(|len: usize| len > limit) {
            let error = ApiError::payload_too_large(limit);
            return self.refuse(
                self.error_reply(&error),
                "body_too_large",
                Stage::Passthrough,
            );
        }
        if end_of_stream {
            let error = ApiError::bad_request("a JSON request body is required");
            return self.refuse(self.error_reply(&error), "missing_body", Stage::Passthrough);
        }
        // Admission may rewrite the body, whose length is not known until then.
        host::set_header(Side::Request, "content-length", None);
        self.stage = Stage::AwaitingBody;
        let action = host::staged("reserve", || self.reserve_request());
        if self.stage == Stage::Replied {
            return action;
        }
        self.send_headers()
    }

    fn on_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if self.stage != Stage::AwaitingBody {
            return Action::Continue;
        }
        let limit = self.gw.config.max_body_bytes;
        if size > limit {
            let error = ApiError::payload_too_large(limit);
            return self.refuse(
                self.error_reply(&error),
                "body_too_large",
                Stage::Passthrough,
            );
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.admit_body(host::body(Side::Request, size))
    }

    /// The request ended in trailers (HTTP/2 trailers frame, HTTP/1.1 chunked trailer fields):
    /// no body callback saw the end of the stream, so admission completes here with the body
    /// Envoy buffered.
    fn on_trailers(&mut self) -> Action {
        if self.stage != Stage::AwaitingBody {
            return Action::Continue;
        }
        let body = host::body(Side::Request, usize::MAX);
        let limit = self.gw.config.max_body_bytes;
        if body.len() > limit {
            let error = ApiError::payload_too_large(limit);
            return self.refuse(
                self.error_reply(&error),
                "body_too_large",
                Stage::Passthrough,
            );
        }
        self.admit_body(body)
    }

    /// Admission on the complete body, then the forward step. Fails closed: a request whose
    /// admission cannot complete is refused, never forwarded.
    fn admit_body(&mut self, body: Vec<u8>) -> Action {
        let size = body.len();
        if body.is_empty() {
            let error = ApiError::bad_request("a JSON request body is required");
            return self.refuse(self.error_reply(&error), "missing_body", Stage::Passthrough);
        }
        let (Some(tenant), Some(endpoint)) = (self.tenant.clone(), self.endpoint) else {
            let error = ApiError::internal("the request lost its admission state");
            return self.refuse(self.error_reply(&error), "internal", Stage::Passthrough);
        };
        let gw = Rc::clone(&self.gw);
        let admit = |counting| {
            host::staged("admission", || {
                admission::admit(&gw.config, &tenant, endpoint, &body, counting, |m| {
                    prediction::load_shared(&SharedData, &history_key(&gw, tenant.path(), m))
                })
            })
        };
        let mut admitted = match admit(Counting::Estimated) {
            Ok(admitted) => admitted,
            Err(rejection) => {
                let reply = self.error_reply(&rejection.error);
                return self.refuse(reply, rejection.reason, Stage::Passthrough);
            }
        };
        // Shadow mode may have let the request on without a reservation (its headers' charge
        // was refused): it goes on holding none.
        if self.reservation.is_some() {
            let mut charged = self.reserve_tokens(&admitted);
            // An estimate refused on a limit its count decides is counted exactly first.
            if let Err(denial) = &charged
                && admitted.recountable
                && depends_on_input(denial)
                && let Ok(exact) = admit(Counting::Exact)
                && exact.method == Method::Exact
            {
                admitted = exact;
                charged = self.reserve_tokens(&admitted);
            }
            match charged {
                Ok(()) => {
                    #[cfg(feature = "fault-injection")]
                    crate::fault::trap_if(self.fault.as_deref(), crate::fault::TRAP_AFTER_RESERVE);
                }
                Err(Denial::Unleased { .. }) if self.ask_lease() => {
                    if let Lease::Asked { waiting, .. } = &mut self.lease {
                        *waiting = Some(body);
                    }
                    return Action::Pause;
                }
                Err(denial) => {
                    let reply = Reply::denied(&denial, self.shape, host::now_ms());
                    let action = self.refuse(reply, denial_reason(&denial), Stage::AwaitingBody);
                    if self.stage == Stage::Replied {
                        return action;
                    }
                }
            }
        }

        if let Some(new_body) = &admitted.rewritten_body {
            host::replace_body(Side::Request, size, new_body);
        }
        self.meter = if admitted.stream {
            Meter::Stream(StreamMeter::new(
                admitted.endpoint,
                admitted.hide_usage_event,
            ))
        } else {
            Meter::Body(BodyMeter::new(admitted.endpoint, MAX_METERED_BODY))
        };
        self.admitted = Some(admitted);
        self.stage = Stage::Forwarded;
        Action::Continue
    }

    /// Adds the admitted request's tokens to its reservation.
    fn reserve_tokens(&mut self, admitted: &Admitted) -> Result<(), Denial> {
        let demand = Demand {
            input_tokens: admitted.prompt_tokens,
            output_tokens: admitted.reserved_output,
            cost_micros: self.cost(
                &admitted.model,
                admitted.prompt_tokens,
                0,
                admitted.reserved_output,
            ),
        };
        let Some(r) = self.reservation.as_mut() else {
            return Ok(());
        };
        reservation::extend(&SharedData, r, demand, host::now_ms())?;
        self.gw.metrics.add(telemetry::RESERVED, total(demand));
        if !self.shadow {
            self.standing = r.standing.clone();
        }
        Ok(())
    }

    fn on_response_headers(&mut self, end_of_stream: bool) -> Action {
        if let (Some(reason), true) = (self.would_reject, self.shadow) {
            let decision = format!("would-reject; reason={reason}");
            host::set_header(Side::Response, trusted::SHADOW_DECISION, Some(&decision));
        }
        if self.stage != Stage::Forwarded {
            return Action::Continue;
        }
        let headers = Headers::read(Side::Response);
        self.report_standing(&headers);
        self.upstream_status = headers
            .get(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        self.meter_as_answered(&headers);
        let encoded = headers
            .get("content-encoding")
            .is_some_and(|e| !is_identity(e));
        if encoded && !matches!(self.meter, Meter::None) {
            self.gw.metrics.add(telemetry::UNREADABLE_RESPONSES, 1);
            self.meter = Meter::Unreadable;
        }
        self.replayed = headers.get(REPLAYED_HEADER) == Some("true");
        if matches!(self.meter, Meter::Stream(_)) {
            // Hiding the usage chunk changes the length.
            host::set_header(Side::Response, "content-length", None);
        }
        self.stage = Stage::Responding;
        if end_of_stream {
            self.finish(self.completed_outcome());
        }
        Action::Continue
    }

    /// Puts the key's rate-limit headers on the answer, in place of any the upstream sent: a
    /// hosted API's figures are the platform's account, every tenant's usage, so they never
    /// reach a tenant, also when weir has none of its own to report (a key without limits, a
    /// shadow route).
    fn report_standing(&self, headers: &Headers) {
        for name in headers.names() {
            if reply::is_quota_header(name) {
                host::set_header(Side::Response, name, None);
            }
        }
        for (name, value) in reply::quota_headers(&self.standing, self.shape, host::now_ms()) {
            host::set_header(Side::Response, name, Some(&value));
        }
    }

    /// Meters the answer in the shape it came in, which its content type says: a stream asked
    /// for may come as one JSON body (a stream meter would find no event in it and charge no
    /// output), a plain request may be streamed (a body meter could not read it).
    fn meter_as_answered(&mut self, headers: &Headers) {
        let Some(admitted) = &self.admitted else {
            return;
        };
        let Some(content_type) = headers.get("content-type") else {
            return;
        };
        let streamed = weir_core::meter::is_event_stream(content_type);
        match (&self.meter, streamed) {
            (Meter::Stream(_), false) => {
                self.meter = Meter::Body(BodyMeter::new(admitted.endpoint, MAX_METERED_BODY));
            }
            (Meter::Body(_), true) => {
                self.meter = Meter::Stream(StreamMeter::new(
                    admitted.endpoint,
                    admitted.hide_usage_event,
                ));
            }
            _ => {}
        }
    }

    fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if self.stage != Stage::Responding {
            return Action::Continue;
        }
        let chunk = host::body(Side::Response, size);
        match &mut self.meter {
            Meter::Stream(meter) => {
                let out = meter.feed(&chunk, end_of_stream);
                if out != chunk {
                    host::replace_body(Side::Response, size, &out);
                }
            }
            Meter::Body(meter) => meter.feed(&chunk),
            Meter::None | Meter::Unreadable => {}
        }
        if end_of_stream {
            self.finish(self.completed_outcome());
        }
        Action::Continue
    }

    fn completed_outcome(&self) -> &'static str {
        if self.upstream_status >= 400 {
            "upstream_error"
        } else {
            "ok"
        }
    }

    /// Replaces the reservation with what was used: the engine's count when it reported one,
    /// nothing when the upstream failed before serving, else what was seen streaming past.
    fn finish(&mut self, outcome: &'static str) {
        if matches!(
            self.stage,
            Stage::Done | Stage::Replied | Stage::Passthrough
        ) {
            return;
        }
        self.stage = Stage::Done;
        self.outcome = outcome;
        let estimate = self.admitted.as_ref().map_or(0, |a| a.prompt_tokens);
        // A buffered body is parsed once, here, whatever it turns out to say.
        let body = match &self.meter {
            Meter::Body(m) => Some(m.finish()),
            _ => None,
        };
        let reported = match (&self.meter, body) {
            (Meter::Stream(m), _) => m.usage(),
            (_, Some(BodyUsage::Reported(u))) => Some(u),
            _ => None,
        };
        // What the answer's length was read from: a report or a count, not the reservation.
        let measured = reported.is_some()
            || matches!(self.meter, Meter::Stream(_))
            || matches!(body, Some(BodyUsage::Estimated { .. }));
        // Without a report, a response weir could not read is charged what would have been
        // reserved without a prediction (with one, a low prediction would be all it paid).
        let unread_output = self.admitted.as_ref().map_or(0, |a| a.unread_output);
        self.usage = match reported {
            Some(u) => {
                let off = estimate.abs_diff(u.prompt_tokens).saturating_mul(100);
                if let Some(err_pct) = off.checked_div(u.prompt_tokens) {
                    self.gw.metrics.record(telemetry::ESTIMATE_ERROR, err_pct);
                }
                Demand {
                    input_tokens: u.prompt_tokens,
                    output_tokens: u.completion_tokens,
                    cost_micros: 0,
                }
            }
            None if self.upstream_status >= 400 => Demand::default(),
            None => Demand {
                cost_micros: 0,
                input_tokens: estimate,
                output_tokens: match (&self.meter, body) {
                    (Meter::Stream(m), _) => m.generated_tokens(),
                    (_, Some(BodyUsage::Estimated { completion_tokens })) => completion_tokens,
                    (Meter::Body(_) | Meter::Unreadable, _) => unread_output,
                    (Meter::None, _) => 0,
                },
            },
        };
        let cached = reported.map_or(0, |u| u.cached_prompt_tokens);
        self.usage.cost_micros = self.admitted.as_ref().map_or(0, |a| {
            self.cost(
                &a.model,
                self.usage.input_tokens,
                cached,
                self.usage.output_tokens,
            )
        });
        if self.replayed {
            // The same completed work is never charged twice, to quota either.
            self.usage = Demand::default();
        } else if outcome == "ok" && measured {
            self.learn_output();
        }
        if let Some(r) = self.reservation.take() {
            if let Ok(mut in_flight) = self.gw.in_flight.try_borrow_mut() {
                in_flight.remove(&r.slot.id);
            }
            let conflicts = reservation::settle(&SharedData, &r, self.usage, host::now_ms());
            self.gw
                .metrics
                .add(telemetry::SETTLE_CONFLICTS, conflicts as i64);
            self.gw.metrics.add(telemetry::RESERVED, -total(r.demand));
        }
        self.gw
            .metrics
            .add(telemetry::TOKENS_IN, self.usage.input_tokens as i64);
        self.gw
            .metrics
            .add(telemetry::TOKENS_OUT, self.usage.output_tokens as i64);
    }

    /// What tokens of `model` cost at the configured price, in micro-units (0 without one).
    fn cost(&self, model: &str, input: u64, cached: u64, output: u64) -> u64 {
        let usage = price::Usage {
            input_tokens: input,
            cached_input_tokens: cached,
            output_tokens: output,
        };
        let prices = self.gw.config.prices.as_ref();
        prices
            .and_then(|p| p.of(model))
            .map_or(0, |p| p.cost_micros(usage))
    }

    /// The shared-data key of the tenant's output history on `model` (see
    /// [`prediction::shared_key`]: only configured models get their own).
    fn history_key(&self, model: &str) -> String {
        let tenant = self.tenant.as_ref().map_or("", |t| t.path());
        history_key(&self.gw, tenant, model)
    }

    /// A completed answer whose output was predicted: its real length per answer goes into the
    /// tenant's history, and how it compared into the metrics.
    fn learn_output(&self) {
        let Some(a) = self.admitted.as_ref().filter(|a| a.predicted) else {
            return;
        };
        let actual = self.usage.output_tokens;
        let per_answer = actual / a.answers.max(1);
        let config = &self.gw.config.prediction;
        if !prediction::learn_shared(&SharedData, &self.history_key(&a.model), per_answer, config) {
            self.gw.metrics.add(telemetry::SETTLE_CONFLICTS, 1);
        }
        if let Some(pct) = actual.saturating_mul(100).checked_div(a.reserved_output) {
            self.gw
                .metrics
                .record(telemetry::PREDICTION_ACTUAL_PCT, pct);
        }
        let overrun = actual.saturating_sub(a.reserved_output);
        self.gw
            .metrics
            .add(telemetry::PREDICTION_OVERRUN, overrun as i64);
    }

    fn on_log_entry(&mut self) {
        if self.stage == Stage::Ignored {
            return;
        }
        if let (Some((route, mode)), Some(decision)) = (&self.counted_as, self.decision()) {
            let name = telemetry::decision_metric(route, *mode, decision);
            self.gw.metrics.count(&name);
        }
        // The backstop: a stream that ended without its last chunk (client gone, upstream
        // reset) settles here with what was seen.
        if matches!(
            self.stage,
            Stage::AwaitingBody | Stage::Forwarded | Stage::Responding
        ) {
            self.finish("cancelled");
        }
        self.gw
            .metrics
            .add(&telemetry::request_metric(self.outcome), 1);
        if let Some(tenant) = &self.tenant {
            AccessRecord {
                tenant: tenant.path(),
                api: self.endpoint.map_or("-", Endpoint::name),
                model: self.admitted.as_ref().map_or("-", |a| a.model.as_str()),
                tokens_in: self.usage.input_tokens,
                tokens_out: self.usage.output_tokens,
                estimate: self.admitted.as_ref().map_or(0, |a| a.prompt_tokens),
                outcome: self.outcome,
            }
            .publish();
        }
    }
}

/// Whether a `content-encoding` value leaves the body as it is.
fn is_identity(encoding: &str) -> bool {
    let encoding = encoding.trim();
    encoding.is_empty() || encoding.eq_ignore_ascii_case("identity")
}

fn history_key(gw: &Gateway, tenant: &str, model: &str) -> String {
    prediction::shared_key(tenant, model, gw.config.models.contains_key(model))
}

/// Whether the prompt's token count took part in a refusal, so that counting it exactly might
/// have let the request in: every token limit and spend. Output limits too: a request without
/// an output limit of its own reserves the rest of the context (or a prediction capped by it),
/// which an estimate below the exact count makes larger.
fn depends_on_input(denial: &Denial) -> bool {
    match denial {
        Denial::Limit { kind, .. } => matches!(
            kind,
            LimitKind::InputTokens | LimitKind::OutputTokens | LimitKind::Budget(_)
        ),
        Denial::BudgetExceeded { .. } | Denial::TooLarge { .. } => true,
        // A lease asked for cures it, not a count.
        Denial::Unleased { .. } | Denial::QuotaUnavailable { .. } | Denial::Contended => false,
    }
}

/// The rejection reason of a refused reservation: the limit's name.
fn denial_reason(denial: &Denial) -> &'static str {
    match denial {
        Denial::Limit { kind, .. } | Denial::Unleased { kind, .. } => kind.name(),
        Denial::QuotaUnavailable { .. } => "quota_unavailable",
        Denial::BudgetExceeded { .. } => "budget_exceeded",
        Denial::TooLarge { .. } => "request_too_large",
        Denial::Contended => "contended",
    }
}

fn total(d: Demand) -> i64 {
    (d.input_tokens + d.output_tokens) as i64
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
fn rollout_bucket(request_id: &str) -> u32 {
    let hash = request_id.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    hash % 100
}

impl Context for Request {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        host::callback("lease", || self.on_lease(token, body_size));
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        host::callback("request_headers", || self.on_headers(end_of_stream))
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        host::callback("request_body", || self.on_body(size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _: usize) -> Action {
        host::callback("request_trailers", || self.on_trailers())
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        host::callback("response_headers", || {
            self.on_response_headers(end_of_stream)
        })
    }

    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        host::callback("response_body", || {
            self.on_response_body(size, end_of_stream)
        })
    }

    fn on_log(&mut self) {
        host::callback("log", || self.on_log_entry());
        host::report_stages();
    }
}

#[cfg(test)]
mod tests {
    use super::{depends_on_input, is_identity, rollout_bucket};
    use weir_core::reservation::{Denial, LimitKind};

    #[test]
    fn an_output_limit_refusal_is_recounted_too() {
        // Without max_tokens the output reserved is the context's rest after the prompt's
        // count: an undercounting estimate reserves more output than the exact count would.
        let limit = |kind| Denial::Limit {
            level: "o".into(),
            kind,
            limit: 100,
            remaining: 0,
            retry_after_ms: 1,
        };
        assert!(depends_on_input(&limit(LimitKind::InputTokens)));
        assert!(depends_on_input(&limit(LimitKind::OutputTokens)));
        assert!(!depends_on_input(&limit(LimitKind::Requests)));
        assert!(!depends_on_input(&limit(LimitKind::Concurrency)));
    }

    #[test]
    fn only_identity_leaves_a_body_readable() {
        assert!(is_identity("identity") && is_identity(" Identity ") && is_identity(""));
        assert!(!is_identity("gzip") && !is_identity("identity, gzip") && !is_identity("br"));
    }

    #[test]
    fn rollout_buckets_are_stable_and_spread() {
        assert_eq!(rollout_bucket("abc"), rollout_bucket("abc"));
        let ids: Vec<u32> = (0..10_000)
            .map(|i| rollout_bucket(&format!("req-{i}")))
            .collect();
        let under_half = ids.iter().filter(|&&b| b < 50).count();
        assert!((4_500..5_500).contains(&under_half), "{under_half}");
        assert!(ids.iter().all(|&b| b < 100));
    }
}

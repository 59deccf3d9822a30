//! The request body: held until complete, admitted (parsed, checked against the limits,
//! counted), its tokens added to the reservation the headers took, rewritten, and let go — or
//! refused. A fleet-wide limit with no lease on this Envoy holds the body for the quota
//! service's answer ([`super::Lease`]).

use std::rc::Rc;

use proxy_wasm::types::Action;
use weir_core::admission::{self, Admitted};
use weir_core::error::ApiError;
use weir_core::estimate::{Counting, Method};
use weir_core::meter::BodyMeter;
use weir_core::prediction;
use weir_core::renewal;
use weir_core::reply::Reply;
use weir_core::reservation::{self, Demand, Denial, LimitKind, SlotLease};

use super::respond::MAX_METERED_BODY;
use super::settle::{history_key, total};
use super::{Exchange, Host, Lease, Meter, Side, Stage};
use crate::host::staged;
use crate::telemetry::{self, runs::ToolWhere};

impl Exchange {
    pub fn on_body(&mut self, host: &impl Host, size: usize, end_of_stream: bool) -> Action {
        if self.stage != Stage::AwaitingBody {
            return Action::Continue;
        }
        let limit = self.gw.config.max_body_bytes;
        if size > limit {
            let error = ApiError::payload_too_large(limit);
            return self.refuse_with(host, &error, "body_too_large", Stage::Passthrough);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.admit_body(host, host.body(Side::Request, size))
    }

    /// The request ended in trailers (HTTP/2 trailers frame, HTTP/1.1 chunked trailer fields):
    /// no body callback saw the end of the stream, so admission completes here with the body
    /// Envoy buffered.
    pub fn on_trailers(&mut self, host: &impl Host) -> Action {
        if self.stage != Stage::AwaitingBody {
            return Action::Continue;
        }
        let body = host.body(Side::Request, usize::MAX);
        let limit = self.gw.config.max_body_bytes;
        if body.len() > limit {
            let error = ApiError::payload_too_large(limit);
            return self.refuse_with(host, &error, "body_too_large", Stage::Passthrough);
        }
        self.admit_body(host, body)
    }

    /// Takes the request and its concurrency slot at every level on the key's path before its
    /// headers go on; its tokens follow once the body says how many ([`Self::admit_body`]).
    pub(super) fn reserve_request(&mut self, host: &impl Host) -> Action {
        let Some(tenant) = self.tenant.clone() else {
            return Action::Continue;
        };
        let slot = SlotLease {
            id: host.random_u64(),
            ttl_ms: self.gw.config.slot_lease_ms,
        };
        let now = host.now_ms();
        match reservation::reserve(
            host.store(),
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
                self.refuse(host, reply, denial_reason(&denial), Stage::AwaitingBody)
            }
        }
    }

    /// Admission on the complete body, then the forward step. Fails closed: a request whose
    /// admission cannot complete is refused, never forwarded.
    fn admit_body(&mut self, host: &impl Host, body: Vec<u8>) -> Action {
        let size = body.len();
        if body.is_empty() {
            let error = ApiError::bad_request("a JSON request body is required");
            return self.refuse_with(host, &error, "missing_body", Stage::Passthrough);
        }
        if let Some(action) = self.check_retry(host, &body) {
            return action;
        }
        let (Some(tenant), Some(endpoint)) = (self.tenant.clone(), self.endpoint) else {
            let error = ApiError::internal("the request lost its admission state");
            return self.refuse_with(host, &error, "internal", Stage::Passthrough);
        };
        let gw = Rc::clone(&self.gw);
        let admit = |counting| {
            staged("admission", || {
                admission::admit(&gw.config, &tenant, endpoint, &body, counting, |m| {
                    prediction::load_shared(host.store(), &history_key(&gw, tenant.path(), m))
                })
            })
        };
        let mut admitted = match admit(Counting::Estimated) {
            Ok(admitted) => admitted,
            Err(rejection) => {
                let mut reply = self.error_reply(&rejection.error);
                if rejection.reason == "tool_blocked" {
                    let (name, value) = super::tools::SHOULD_RETRY;
                    reply.headers.push((name, value.to_owned()));
                    if !self.shadow {
                        telemetry::runs::tool_blocked(host, &tenant, ToolWhere::Offered);
                    }
                }
                return self.refuse(host, reply, rejection.reason, Stage::Passthrough);
            }
        };
        // Shadow mode may have let the request on without a reservation (its headers' charge
        // was refused): it goes on holding none.
        if self.reservation.is_some() {
            let mut charged = self.reserve_tokens(host, &admitted);
            // An estimate refused on a limit its count decides is counted exactly first.
            if let Err(denial) = &charged
                && admitted.recountable
                && depends_on_input(denial)
                && let Ok(exact) = admit(Counting::Exact)
                && exact.method == Method::Exact
            {
                admitted = exact;
                charged = self.reserve_tokens(host, &admitted);
            }
            if let Some(action) = self.charged(host, charged, body) {
                return action;
            }
        }
        if let Some(action) = self.charge_run(host, &admitted) {
            return action;
        }
        self.forward_run(host, admitted, size)
    }

    /// What the charge of the body's tokens makes of the request: `None` to let it go on, else
    /// the action that holds it (waiting for a lease) or ends it (refused).
    fn charged(
        &mut self,
        host: &impl Host,
        charged: Result<(), Denial>,
        body: Vec<u8>,
    ) -> Option<Action> {
        match charged {
            Ok(()) => {
                #[cfg(feature = "fault-injection")]
                crate::fault::trap_if(self.fault.as_deref(), crate::fault::TRAP_AFTER_RESERVE);
                None
            }
            Err(Denial::Unleased { .. }) if self.ask_lease(host) => {
                if let Lease::Asked { waiting, .. } = &mut self.lease {
                    *waiting = Some(body);
                }
                Some(Action::Pause)
            }
            Err(denial) => {
                let reply = Reply::denied(&denial, self.shape, host.now_ms());
                self.refuse_on_admission(host, reply, denial_reason(&denial))
            }
        }
    }

    /// Lets the admitted body go upstream (rewritten if admission rewrote it), its answer to
    /// be metered in the shape it asked for.
    pub(super) fn forward(&mut self, host: &impl Host, admitted: Admitted, size: usize) -> Action {
        if let Some(new_body) = &admitted.rewritten_body {
            host.replace_body(Side::Request, size, new_body);
        }
        self.meter = if admitted.stream {
            Meter::Stream(self.stream_meter(admitted.endpoint, admitted.hide_usage_event))
        } else {
            Meter::Body(BodyMeter::new(admitted.endpoint, MAX_METERED_BODY))
        };
        self.admitted = Some(admitted);
        self.stage = Stage::Forwarded;
        Action::Continue
    }

    /// Adds the admitted request's tokens to its reservation.
    fn reserve_tokens(&mut self, host: &impl Host, admitted: &Admitted) -> Result<(), Denial> {
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
        reservation::extend(host.store(), r, demand, host.now_ms())?;
        host.add(telemetry::RESERVED, total(demand));
        if !self.shadow {
            self.standing = r.standing.clone();
        }
        Ok(())
    }

    /// Asks the quota service at once for the leases the tenant's fleet-wide limits lack
    /// ([`Lease`]): `true` when the call went out, `false` when the request asked already,
    /// has nothing to ask, or the call cannot be sent (then the refusal stands, and the store
    /// counts as down for the next request).
    fn ask_lease(&mut self, host: &impl Host) -> bool {
        let (Lease::NotAsked, false, Some(fleet), Some(tenant)) = (
            &self.lease,
            self.shadow,
            self.gw.config.fleet.as_ref(),
            self.tenant.as_deref(),
        ) else {
            return false;
        };
        let now = host.now_ms();
        let ask = renewal::plan_for(host.store(), &renewal::specs([tenant]), now);
        if ask.counters.is_empty() {
            return false;
        }
        self.lease = Lease::Answered;
        let Some(token) = crate::renewal::send(host, fleet, self.gw.signer.as_ref(), ask, now)
        else {
            return false;
        };
        host.add(telemetry::FLEET_LEASES_ASKED_AT_ONCE, 1);
        self.lease = Lease::Asked {
            token,
            waiting: None,
        };
        true
    }

    /// The quota service answered this request's call ([`Self::ask_lease`]): its grants go to
    /// the leases, and a body that waited for them is admitted again.
    pub fn on_lease(&mut self, host: &impl Host, token: u32, body_size: usize) {
        if !matches!(self.lease, Lease::Asked { token: asked, .. } if asked == token) {
            return;
        }
        let Lease::Asked { waiting, .. } = std::mem::replace(&mut self.lease, Lease::Answered)
        else {
            return;
        };
        if let Some(tenant) = self.tenant.as_deref() {
            crate::renewal::answer(host, &renewal::specs([tenant]), body_size, host.now_ms());
        }
        if let Some(body) = waiting
            && matches!(self.admit_body(host, body), Action::Continue)
        {
            host.resume_request();
        }
    }
}

/// Whether the prompt's token count took part in a refusal, so that counting it exactly might
/// have let the request in: every token limit and spend. Output limits too: a request without
/// an output limit of its own reserves the rest of the context (or a prediction capped by it),
/// which an estimate below the exact count makes larger.
pub(super) fn depends_on_input(denial: &Denial) -> bool {
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

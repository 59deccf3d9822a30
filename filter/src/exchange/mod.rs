//! One HTTP exchange through the filter, from request headers to the access log, as a state
//! machine over a [`Host`]: each event (request headers, body chunk, trailers, a call's
//! answer, response headers, response chunk, the access log) moves the exchange from one
//! [`Stage`] to the next and answers Envoy's `Action`; what it does to the request on the way
//! (headers set, a local reply, a call sent, a reservation taken or settled) goes through the
//! host. `crate::request` maps proxy-wasm's callbacks onto it; `tests.rs` drives it natively.
//!
//! ```text
//! headers ─► strip x-weir-*, new attempt id, pick route mode, authenticate, route
//!        ─► charge the request and its concurrency slot at every level (a metered API)
//!        ─► send the headers on with the trusted x-weir-* identity headers, signed (every
//!           request, whatever the mode: off, shadow and out-of-rollout requests are scheduled
//!           too, as their tenant when the key is valid, else as the configured default tenant)
//!                                                                     (headers.rs)
//! body    ─► held until complete (at its end, or at its trailers when it ends in them)
//!        ─► admit (parse, limits, estimate) ─► reserve its tokens ─► rewrite ─► let it go
//!           (a refusal answers locally; the upstream, which had only the headers, is reset;
//!           a fleet-wide limit with no lease here waits for the quota service's answer)
//!                                                                     (admit.rs)
//! response─► meter the stream/body as it passes (usage chunk hidden unless asked for)
//!                                                                     (respond.rs)
//!        ─► under a tool policy, withhold the calls it does not pass (tools.rs)
//! end     ─► settle: engine usage replaces the reservation   (on_log settles anything left:
//!                                                             client gone, upstream reset)
//!                                                                     (settle.rs)
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

mod admit;
mod headers;
pub mod port;
mod respond;
mod retry;
mod run;
pub mod run_fleet;
mod settle;
#[cfg(test)]
mod tests;
mod tools;

use std::rc::Rc;
use std::sync::Arc;

use proxy_wasm::types::Action;
use weir_core::admission::Admitted;
use weir_core::config::{Mode, Tenant};
use weir_core::endpoint::Endpoint;
use weir_core::error::{ApiError, ErrorShape};
use weir_core::meter::{BodyMeter, StreamMeter};
use weir_core::reply::Reply;
use weir_core::reservation::{Demand, Ledger, Reservation, Standing};
use weir_core::run::{RunHold, RunKey};
use weir_core::trusted;

use crate::Gateway;
use crate::host::staged;
use crate::telemetry::{self, Decision};
pub use port::{Headers, Host, Side};
use tools::ToolGuard;

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
/// on this Envoy for its body ([`weir_core::reservation::Denial::Unleased`]: the first request
/// after a start, or after the tenant was idle), though the store may hold the tokens. Rather
/// than refused, the body waits for the answer (at most the fleet's `timeout_ms`; a failed call
/// marks the store down, and its `fail_open`/`fail_closed` rule decides), then is charged
/// again — once: a second shortage is the limit's refusal. (A request count found no lease at
/// the headers is owed instead, its slot held: see `Allowance::owe`.)
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

pub struct Exchange {
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
    /// The caller's `x-request-id`: with the body, what tells a retry (`retry.rs`).
    caller_request_id: Option<String>,
    /// The call sends a withheld call's request again for its approved call
    /// (`weir-approval-id`): the sidecar answers it, the engine does not run (`tools.rs`).
    approval_resend: bool,
    /// The call repeats one its key sent within the minute (`retry.rs`): a run counts it
    /// against its `retries` budget.
    retry: bool,
    /// The error body and rate-limit headers the caller's API uses.
    shape: ErrorShape,
    /// Where the limits on the key's path stood when the request was let through: reported on
    /// the answer.
    standing: Vec<Standing>,
    /// The run the call belongs to, when its key's runs have budgets (`run.rs`).
    run_key: Option<RunKey>,
    /// What the call holds of its run, from its admission to its settle.
    run: Option<RunHold>,
    /// Where the call stands with its run's fleet-wide budgets (`run_fleet.rs`).
    run_fleet: run_fleet::FleetRun,
    /// The answer's tool calls under the key's tool policy, while it is read.
    tools: Option<ToolGuard>,
    /// The fault a test asked this request for (`filter/src/fault.rs`).
    #[cfg(feature = "fault-injection")]
    fault: Option<String>,
}

impl Exchange {
    pub fn new(gw: Rc<Gateway>) -> Self {
        Exchange {
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
            caller_request_id: None,
            approval_resend: false,
            retry: false,
            shape: ErrorShape::OpenAi,
            standing: Vec::new(),
            run_key: None,
            run: None,
            run_fleet: run_fleet::FleetRun::None,
            tools: None,
            #[cfg(feature = "fault-injection")]
            fault: None,
        }
    }

    /// A local error reply in the caller's API's shape.
    fn error_reply(&self, error: &ApiError) -> Reply {
        Reply::error(error, self.shape)
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
    fn refuse(
        &mut self,
        host: &impl Host,
        reply: Reply,
        reason: &'static str,
        shadow_stage: Stage,
    ) -> Action {
        if let Some(action) = self.refusing(host, reason, shadow_stage) {
            return action;
        }
        host.local_reply(reply.status, &reply.headers, &reply.body);
        Action::Pause
    }

    /// What every refusal does but send its reply: gives back what the request holds, counts
    /// it, and ends the request (`None`: the caller sends the reply); in shadow mode notes it
    /// and lets the request go on (the action that does).
    fn refusing(
        &mut self,
        host: &impl Host,
        reason: &'static str,
        shadow_stage: Stage,
    ) -> Option<Action> {
        self.cancel_reservation(host);
        let counter = telemetry::rejection_metric(reason, self.shadow);
        host.add(&counter, 1);
        if self.shadow {
            host.add(telemetry::SHADOW_WOULD_REJECT, 1);
            self.would_reject.get_or_insert(reason);
            self.stage = shadow_stage;
            if shadow_stage == Stage::Passthrough {
                self.outcome = "passthrough";
            }
            return Some(self.send_headers(host));
        }
        self.stage = Stage::Replied;
        self.outcome = "rejected";
        None
    }

    /// Refuses a body on admission: `None` when shadow mode lets it go on (the refusal
    /// noted), else the action that ends it.
    fn refuse_on_admission(
        &mut self,
        host: &impl Host,
        reply: Reply,
        reason: &'static str,
    ) -> Option<Action> {
        let action = self.refuse(host, reply, reason, Stage::AwaitingBody);
        (self.stage == Stage::Replied).then_some(action)
    }

    /// Refuses with an error in the caller's API's shape.
    fn refuse_with(
        &mut self,
        host: &impl Host,
        error: &ApiError,
        reason: &'static str,
        shadow_stage: Stage,
    ) -> Action {
        self.refuse(host, self.error_reply(error), reason, shadow_stage)
    }

    /// The counters this request is charged to.
    fn ledger(&self) -> Ledger {
        if self.shadow {
            Ledger::Shadow
        } else {
            Ledger::Enforce
        }
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
        let approval: Vec<&str> = tenant.tools.approval_patterns().collect();
        if !approval.is_empty() {
            self.vouch(trusted::TOOL_APPROVAL, approval.join(","));
            self.vouch(trusted::APPROVAL_TERMS, tenant.tools.approval.to_header());
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
    fn send_headers(&mut self, host: &impl Host) -> Action {
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
            host.set_header(Side::Request, name, Some(value));
        }
        if let Some(signer) = &self.gw.signer {
            let view: Vec<(&str, &str)> =
                self.vouched.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let signature = staged("sign", || signer.sign(&view, host.now_ms()));
            host.set_header(Side::Request, trusted::SIGNATURE, signature.as_deref());
        }
        Action::Continue
    }
}

//! The approvals this sidecar holds, in memory, under one lock: every transition (held,
//! approved or rejected, delivered, expired) is one step under it, so a call is delivered at
//! most once however many re-sends race for it.

use std::collections::HashMap;
use std::sync::Mutex;

use sha2::{Digest, Sha256};
use weir_core::endpoint::Endpoint;

use crate::metrics::Metrics;

/// How long approvals wait, how many a tenant may have pending, and whether a key may approve
/// its own calls: the calling key's tool policy's `approval` terms, vouched by the filter (these
/// defaults for a call whose terms were not).
pub use weir_core::config::ApprovalTerms as Terms;

/// A tool call as the model made it, held for an approver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldCall {
    /// The API its answer was in.
    pub endpoint: Endpoint,
    pub model: String,
    /// The id the client answers the call with.
    pub call_id: String,
    pub name: String,
    /// The arguments verbatim (the Messages `input` as JSON text).
    pub arguments: String,
    /// Lowercase hex SHA-256 of `arguments`, as `approval_required` names it.
    pub arguments_sha256: String,
}

impl HeldCall {
    pub fn new(
        endpoint: Endpoint,
        model: &str,
        call_id: &str,
        name: &str,
        arguments: &str,
    ) -> HeldCall {
        HeldCall {
            endpoint,
            model: model.to_owned(),
            call_id: call_id.to_owned(),
            name: name.to_owned(),
            arguments: arguments.to_owned(),
            arguments_sha256: hex(&Sha256::digest(arguments.as_bytes())),
        }
    }
}

/// Lowercase hex.
pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where an approval stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    Pending,
    /// Approved by this key (its tenant path), not delivered yet.
    Approved {
        by: String,
    },
    Rejected {
        by: String,
    },
    /// Delivered to the re-send: used.
    Delivered,
}

impl State {
    pub fn name(&self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::Approved { .. } => "approved",
            State::Rejected { .. } => "rejected",
            State::Delivered => "delivered",
        }
    }

    /// The approver, once decided.
    pub fn by(&self) -> Option<&str> {
        match self {
            State::Approved { by } | State::Rejected { by } => Some(by),
            State::Pending | State::Delivered => None,
        }
    }

    /// Whether the gauge of held approvals counts it.
    fn held(&self) -> bool {
        matches!(self, State::Pending | State::Approved { .. })
    }
}

/// A held call and what binds it: the tenant, the run and the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Approval {
    pub id: String,
    /// The calling key's tenant path.
    pub tenant: String,
    /// The run the call was made in (the vouched run id), if it named one.
    pub run_id: Option<String>,
    /// SHA-256 of the request body as the sidecar received it: the re-send must be the same.
    pub request_sha256: [u8; 32],
    pub call: HeldCall,
    pub created_ms: u64,
    pub expires_ms: u64,
    pub state: State,
    /// The terms it was held under: how long a decision stands, who may decide.
    pub terms: Terms,
}

/// A key calling weir's approvals API: its tenant path and the subtrees it approves for.
#[derive(Clone, Debug)]
pub struct Approver {
    pub tenant: String,
    pub scopes: Vec<String>,
}

impl Approver {
    /// Whether one of its scopes is `tenant` or a level above it.
    pub fn covers(&self, tenant: &str) -> bool {
        self.scopes.iter().any(|scope| {
            tenant
                .strip_prefix(scope.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Approve,
    Reject,
}

/// A re-send asking for its approved call.
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a> {
    pub tenant: &'a str,
    pub run_id: Option<&'a str>,
    pub id: &'a str,
    pub request_sha256: [u8; 32],
}

/// Why an approval operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Unknown, expired, another tenant's or another run's, or outside the approver's scopes:
    /// all alike.
    NotFound,
    Pending,
    Rejected,
    /// Delivered already.
    Used,
    /// The re-send's body is not the request's.
    Mismatch,
    /// The approver is the calling key, and the terms do not allow it.
    SelfApproval,
    /// Approved or rejected already.
    Decided,
    /// The tenant has `max_pending` approvals pending.
    Full,
}

/// Every approval this sidecar holds.
pub struct Approvals {
    /// The terms of a call held without its own.
    terms: Terms,
    book: Mutex<Book>,
    metrics: Metrics,
}

#[derive(Default)]
struct Book {
    by_id: HashMap<String, Approval>,
    /// Pending approvals per tenant.
    pending: HashMap<String, usize>,
    /// What the held gauge shows, per tenant label and state.
    held: HashMap<(String, &'static str), i64>,
}

impl Approvals {
    pub fn new(terms: Terms, metrics: Metrics) -> Approvals {
        Approvals {
            terms,
            book: Mutex::new(Book::default()),
            metrics,
        }
    }

    /// Holds a call under `terms` (the store's own when `None`), pending, until
    /// `now_ms + ttl_ms`. Holding an id already held is a no-op.
    pub fn hold(
        &self,
        id: &str,
        (tenant, run_id): (&str, Option<&str>),
        request_sha256: [u8; 32],
        (call, terms): (HeldCall, Option<Terms>),
        now_ms: u64,
    ) -> Result<(), Refused> {
        let terms = terms.unwrap_or(self.terms);
        let mut book = self.book(now_ms);
        if book.by_id.contains_key(id) {
            return Ok(());
        }
        let pending = book.pending.entry(tenant.to_owned()).or_default();
        if *pending >= usize::try_from(terms.max_pending).unwrap_or(usize::MAX) {
            self.outcome(tenant, "capacity");
            return Err(Refused::Full);
        }
        *pending += 1;
        let approval = Approval {
            id: id.to_owned(),
            tenant: tenant.to_owned(),
            run_id: run_id.map(str::to_owned),
            request_sha256,
            call,
            created_ms: now_ms,
            expires_ms: now_ms.saturating_add(terms.ttl_ms),
            state: State::Pending,
            terms,
        };
        self.moved(&mut book.held, tenant, None, Some(&approval.state));
        self.outcome(tenant, "held");
        book.by_id.insert(id.to_owned(), approval);
        Ok(())
    }

    /// The approvals the approver's scopes cover, in a state if one is named, oldest first.
    pub fn list(&self, approver: &Approver, state: Option<&str>, now_ms: u64) -> Vec<Approval> {
        let book = self.book(now_ms);
        let mut found: Vec<Approval> = (book.by_id.values())
            .filter(|a| approver.covers(&a.tenant))
            .filter(|a| state.is_none_or(|s| a.state.name() == s))
            .cloned()
            .collect();
        found.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        found
    }

    /// One approval, if the approver's scopes cover it.
    pub fn get(&self, approver: &Approver, id: &str, now_ms: u64) -> Option<Approval> {
        let book = self.book(now_ms);
        (book.by_id.get(id))
            .filter(|a| approver.covers(&a.tenant))
            .cloned()
    }

    /// Approves or rejects a pending approval the approver's scopes cover; the decision then
    /// stands for `ttl_ms`.
    pub fn decide(
        &self,
        approver: &Approver,
        id: &str,
        decision: Decision,
        now_ms: u64,
    ) -> Result<Approval, Refused> {
        let mut book = self.book(now_ms);
        let book = &mut *book;
        let approval = (book.by_id.get_mut(id))
            .filter(|a| approver.covers(&a.tenant))
            .ok_or(Refused::NotFound)?;
        if approval.tenant == approver.tenant && !approval.terms.self_approve {
            return Err(Refused::SelfApproval);
        }
        if approval.state != State::Pending {
            return Err(Refused::Decided);
        }
        let by = approver.tenant.clone();
        let (state, outcome) = match decision {
            Decision::Approve => (State::Approved { by }, "approved"),
            Decision::Reject => (State::Rejected { by }, "rejected"),
        };
        self.moved(
            &mut book.held,
            &approval.tenant,
            Some(&approval.state),
            Some(&state),
        );
        self.outcome(&approval.tenant, outcome);
        unpend(&mut book.pending, &approval.tenant);
        approval.state = state;
        approval.expires_ms = now_ms.saturating_add(approval.terms.ttl_ms);
        Ok(approval.clone())
    }

    /// The approved call a re-send asks for, delivered once: approved becomes delivered in
    /// the same step.
    pub fn take(&self, claim: Claim<'_>, now_ms: u64) -> Result<HeldCall, Refused> {
        let mut book = self.book(now_ms);
        let Book { by_id, held, .. } = &mut *book;
        let approval = (by_id.get_mut(claim.id))
            .filter(|a| a.tenant == claim.tenant && a.run_id.as_deref() == claim.run_id)
            .ok_or(Refused::NotFound)?;
        if approval.request_sha256 != claim.request_sha256 {
            return Err(Refused::Mismatch);
        }
        match approval.state {
            State::Pending => Err(Refused::Pending),
            State::Rejected { .. } => Err(Refused::Rejected),
            State::Delivered => Err(Refused::Used),
            State::Approved { .. } => {
                self.moved(held, &approval.tenant, Some(&approval.state), None);
                self.outcome(&approval.tenant, "delivered");
                approval.state = State::Delivered;
                Ok(approval.call.clone())
            }
        }
    }

    /// The book, with what expired by `now_ms` gone.
    fn book(&self, now_ms: u64) -> std::sync::MutexGuard<'_, Book> {
        let mut book = self.book.lock().unwrap_or_else(|e| e.into_inner());
        let Book {
            by_id,
            pending,
            held,
        } = &mut *book;
        by_id.retain(|_, a| {
            if a.expires_ms > now_ms {
                return true;
            }
            if a.state.held() {
                self.moved(held, &a.tenant, Some(&a.state), None);
                self.outcome(&a.tenant, "expired");
            }
            if a.state == State::Pending {
                unpend(pending, &a.tenant);
            }
            false
        });
        book
    }

    /// Moves one approval of `tenant` between states in the held gauge.
    fn moved(
        &self,
        held: &mut HashMap<(String, &'static str), i64>,
        tenant: &str,
        from: Option<&State>,
        to: Option<&State>,
    ) {
        let label = self.metrics.tenant(tenant);
        for (state, delta) in [(from, -1), (to, 1)] {
            if let Some(state) = state.filter(|s| s.held()) {
                let count = held.entry((label.to_owned(), state.name())).or_default();
                *count += delta;
                let labels = &[("tenant", label), ("state", state.name())];
                self.metrics.approvals.held.set(labels, *count);
            }
        }
    }

    fn outcome(&self, tenant: &str, outcome: &str) {
        let labels = &[
            ("tenant", self.metrics.tenant(tenant)),
            ("outcome", outcome),
        ];
        self.metrics.approvals.outcomes.inc(labels);
    }
}

fn unpend(pending: &mut HashMap<String, usize>, tenant: &str) {
    if let Some(n) = pending.get_mut(tenant) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            pending.remove(tenant);
        }
    }
}

//! Tool calls held for an approver ([`crate::approvals`]): how many each tenant holds, by
//! state, and what became of them. Tenant labels at the configured depth; never a run id or an
//! approval id.

use super::instrument::Maker;
use super::{Counter, IntGauge};

#[derive(Clone)]
pub struct ApprovalMetrics {
    /// `weir_approvals_held{tenant,state}`: approvals held now, `pending` or `approved` (one
    /// family name of its own: a gauge named `weir_approvals` would clash with the counter's
    /// family).
    pub held: IntGauge,
    /// `weir_approvals_total{tenant,outcome}`: `held`, `approved`, `rejected`, `delivered`,
    /// `expired`, `capacity` (a call not held: the tenant's pending approvals were full).
    pub outcomes: Counter,
}

impl ApprovalMetrics {
    pub(super) fn register(m: &mut Maker) -> ApprovalMetrics {
        ApprovalMetrics {
            held: m.int_gauge(
                "approvals_held",
                "Tool calls held for an approver, per tenant and state (pending, approved)",
            ),
            outcomes: m.counter(
                "approvals",
                "Held tool calls by what became of them, per tenant",
            ),
        }
    }
}

//! The counters of what a run's policies refused, by tenant: calls refused by a run budget,
//! tools blocked (offered or called), retries refused by the tenant's retry budget. Each is one
//! stat per tenant and value, defined at its first count ([`Host::count`]); Envoy's
//! `stats_tags` (`envoy/envoy.yaml.tmpl`, `deploy/envoy/envoy.yaml`) turn the names into
//! `weir_run_refusals_total{tenant,budget}`, `weir_tools_blocked_total{tenant,where}` and
//! `weir_retries_refused_total{tenant}`. Never a run id, an agent or a key in a name: the
//! series grow with the orgs, not with the runs.

use weir_core::config::Tenant;
use weir_core::run::Budget;

use crate::exchange::Host;

/// A tenant as a stat-name segment of the run counters: its org, the depth the sidecar's
/// tenant labels have by default (`metrics.tenant_depth: org`; the filter's config sets no
/// depth), never the key; `.` (allowed in ids) as `_`, so the id cannot add a segment and shift
/// those Envoy's `stats_tags` extract.
pub fn tenant_label(tenant: &Tenant) -> String {
    tenant.org.replace('.', "_")
}

/// The counter of calls refused by a run budget, `weir.run_refusals_total.tenant.<t>.budget.<b>`
/// (`stats_tags` make it `weir_run_refusals_total{tenant,budget}`; never a run id).
pub fn run_refusal_metric(tenant: &str, budget: Budget) -> String {
    format!(
        "weir.run_refusals_total.tenant.{tenant}.budget.{}",
        budget.name()
    )
}

/// Counts a call refused because it would cross a run budget.
pub fn run_refused(host: &impl Host, tenant: &Tenant, budget: Budget) {
    host.count(&run_refusal_metric(&tenant_label(tenant), budget));
}

/// Where the tool policy met a blocked tool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolWhere {
    /// The request offered it.
    Offered,
    /// The model's answer called it.
    Called,
}

impl ToolWhere {
    fn as_str(self) -> &'static str {
        match self {
            ToolWhere::Offered => "offered",
            ToolWhere::Called => "called",
        }
    }
}

/// The counter of blocked tools, `weir.tools_blocked_total.tenant.<t>.where.<offered|called>`
/// (`weir_tools_blocked_total{tenant,where}`).
pub fn tool_blocked_metric(tenant: &str, where_: ToolWhere) -> String {
    format!(
        "weir.tools_blocked_total.tenant.{tenant}.where.{}",
        where_.as_str()
    )
}

/// Counts a blocked tool, offered (refused or removed) or called (withheld).
pub fn tool_blocked(host: &impl Host, tenant: &Tenant, where_: ToolWhere) {
    host.count(&tool_blocked_metric(&tenant_label(tenant), where_));
}

/// The counter of retries refused by the tenant's retry budget,
/// `weir.retries_refused_total.tenant.<t>` (`weir_retries_refused_total{tenant}`).
pub fn retry_refusal_metric(tenant: &str) -> String {
    format!("weir.retries_refused_total.tenant.{tenant}")
}

/// Counts a retry refused past the tenant's retries per minute.
pub fn retry_refused(host: &impl Host, tenant: &Tenant) {
    host.count(&retry_refusal_metric(&tenant_label(tenant)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_counters_name_the_tenant_s_org_and_what_was_refused() {
        assert_eq!(
            run_refusal_metric("acme", Budget::ToolCalls),
            "weir.run_refusals_total.tenant.acme.budget.tool_calls"
        );
        assert_eq!(
            tool_blocked_metric("acme", ToolWhere::Called),
            "weir.tools_blocked_total.tenant.acme.where.called"
        );
        assert_eq!(
            retry_refusal_metric("acme"),
            "weir.retries_refused_total.tenant.acme"
        );
    }
}

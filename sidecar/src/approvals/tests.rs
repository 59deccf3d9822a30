use std::sync::Arc;

use weir_core::endpoint::Endpoint;

use super::*;
use crate::config::metrics::MetricsConfig;
use crate::metrics::Metrics;

const T0: u64 = 1_000_000;
const TENANT: &str = "agentco/w/p/agent";
const BODY: [u8; 32] = [7; 32];

fn approvals(terms: Terms) -> (Approvals, prometheus_client::registry::Registry) {
    let (metrics, registry) = Metrics::new(&MetricsConfig::default(), None);
    (Approvals::new(terms, metrics), registry)
}

fn call() -> HeldCall {
    HeldCall::new(
        Endpoint::ChatCompletions,
        "tiny",
        "call_1",
        "deploy_prod",
        r#"{"env":"prod"}"#,
    )
}

fn hold(a: &Approvals, id: &str, tenant: &str, run: Option<&str>) -> Result<(), Refused> {
    a.hold(id, (tenant, run), BODY, (call(), None), T0)
}

fn approver(tenant: &str, scopes: &[&str]) -> Approver {
    Approver {
        tenant: tenant.to_owned(),
        scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
    }
}

fn claim<'a>(tenant: &'a str, run: Option<&'a str>, id: &'a str) -> Claim<'a> {
    Claim {
        tenant,
        run_id: run,
        id,
        request_sha256: BODY,
    }
}

fn ops() -> Approver {
    approver("agentco/w/p/ops", &["agentco"])
}

#[test]
fn take_is_single_use_under_concurrent_resends() {
    let (a, _) = approvals(Terms::default());
    let a = Arc::new(a);
    hold(&a, "apr_1", TENANT, Some("r1")).unwrap();
    assert_eq!(
        a.take(claim(TENANT, Some("r1"), "apr_1"), T0 + 1),
        Err(Refused::Pending)
    );
    a.decide(&ops(), "apr_1", Decision::Approve, T0 + 2)
        .unwrap();
    let racers: Vec<_> = (0..16)
        .map(|_| {
            let a = Arc::clone(&a);
            std::thread::spawn(move || a.take(claim(TENANT, Some("r1"), "apr_1"), T0 + 3))
        })
        .collect();
    let results: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
    let delivered: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(delivered, [&call()], "exactly one re-send gets the call");
    assert!(
        results
            .iter()
            .filter(|r| r.is_err())
            .all(|r| *r == Err(Refused::Used)),
        "{results:?}"
    );
    assert_eq!(
        a.get(&ops(), "apr_1", T0 + 4).map(|x| x.state),
        Some(State::Delivered)
    );
}

#[test]
fn other_tenant_or_run_not_found() {
    let (a, _) = approvals(Terms::default());
    hold(&a, "apr_1", TENANT, Some("r1")).unwrap();
    hold(&a, "apr_2", TENANT, None).unwrap();
    a.decide(&ops(), "apr_1", Decision::Approve, T0).unwrap();
    a.decide(&ops(), "apr_2", Decision::Approve, T0).unwrap();
    let not_found = Err(Refused::NotFound);
    // Another tenant (another key of the same org too), another run, no run, an unknown id.
    for (tenant, run, id) in [
        ("globex/w/p/agent", Some("r1"), "apr_1"),
        ("agentco/w/p/other", Some("r1"), "apr_1"),
        (TENANT, Some("r2"), "apr_1"),
        (TENANT, None, "apr_1"),
        (TENANT, Some("r1"), "apr_2"),
        (TENANT, Some("r1"), "apr_unknown"),
    ] {
        assert_eq!(
            a.take(claim(tenant, run, id), T0),
            not_found,
            "{tenant} {run:?} {id}"
        );
    }
    // A different body of the right tenant and run is named as such.
    let other_body = Claim {
        request_sha256: [8; 32],
        ..claim(TENANT, Some("r1"), "apr_1")
    };
    assert_eq!(a.take(other_body, T0), Err(Refused::Mismatch));
    // None of that used it up.
    assert_eq!(a.take(claim(TENANT, Some("r1"), "apr_1"), T0), Ok(call()));
    assert_eq!(a.take(claim(TENANT, None, "apr_2"), T0), Ok(call()));
}

#[test]
fn approver_scope_and_self_approval() {
    let (a, _) = approvals(Terms::default());
    for id in ["apr_1", "apr_2", "apr_3"] {
        hold(&a, id, TENANT, Some("r1")).unwrap();
    }
    hold(&a, "apr_g", "globex/w/p/agent", Some("r1")).unwrap();
    // Scopes cover their subtree only: a sibling prefix is not a parent.
    let narrow = approver("agentco/x/p/ops", &["agentco/w/p"]);
    let sibling = approver("agentco/x/p/ops", &["agentco/w/pp", "agentco/x"]);
    let none = approver("agentco/w/p/dev", &[]);
    assert!(narrow.covers(TENANT));
    assert!(!sibling.covers(TENANT));
    let ids = |who: &Approver| -> Vec<String> {
        (a.list(who, Some("pending"), T0).into_iter())
            .map(|x| x.id)
            .collect()
    };
    assert_eq!(ids(&ops()), ["apr_1", "apr_2", "apr_3"], "not globex's");
    assert_eq!(ids(&narrow), ["apr_1", "apr_2", "apr_3"]);
    assert!(ids(&sibling).is_empty() && ids(&none).is_empty());
    for who in [&sibling, &none] {
        assert_eq!(a.get(who, "apr_1", T0), None);
        let refused = a.decide(who, "apr_1", Decision::Approve, T0);
        assert_eq!(refused, Err(Refused::NotFound));
    }
    assert_eq!(
        a.decide(&ops(), "apr_g", Decision::Approve, T0),
        Err(Refused::NotFound),
        "another org's"
    );
    // The calling key may not approve its own call, even with a scope over it...
    let own = approver(TENANT, &["agentco"]);
    assert_eq!(
        a.decide(&own, "apr_1", Decision::Approve, T0),
        Err(Refused::SelfApproval)
    );
    // ...unless the terms say it may.
    let (lax, _) = approvals(Terms {
        self_approve: true,
        ..Terms::default()
    });
    hold(&lax, "apr_1", TENANT, Some("r1")).unwrap();
    assert!(lax.decide(&own, "apr_1", Decision::Approve, T0).is_ok());
    // A decision stands: no second one, and a rejected call is never delivered.
    let rejected = a.decide(&narrow, "apr_2", Decision::Reject, T0).unwrap();
    assert_eq!(
        rejected.state,
        State::Rejected {
            by: "agentco/x/p/ops".into()
        }
    );
    assert_eq!(
        a.decide(&ops(), "apr_2", Decision::Approve, T0),
        Err(Refused::Decided)
    );
    assert_eq!(
        a.take(claim(TENANT, Some("r1"), "apr_2"), T0),
        Err(Refused::Rejected)
    );
}

#[test]
fn expiry() {
    let ttl = 1_000;
    let terms = Terms {
        ttl_ms: ttl,
        max_pending: 2,
        ..Terms::default()
    };
    let (a, registry) = approvals(terms);
    hold(&a, "apr_1", TENANT, Some("r1")).unwrap();
    hold(&a, "apr_2", TENANT, Some("r1")).unwrap();
    assert_eq!(hold(&a, "apr_3", TENANT, Some("r1")), Err(Refused::Full));
    assert!(
        hold(&a, "apr_4", "agentco/w/p/other", None).is_ok(),
        "per tenant"
    );
    // Approved just before its expiry: the decision stands a ttl from then.
    a.decide(&ops(), "apr_1", Decision::Approve, T0 + ttl - 1)
        .unwrap();
    assert_eq!(a.get(&ops(), "apr_2", T0 + ttl), None, "pending expired");
    assert_eq!(
        a.decide(&ops(), "apr_2", Decision::Approve, T0 + ttl),
        Err(Refused::NotFound)
    );
    assert!(hold(&a, "apr_3", TENANT, Some("r1")).is_ok(), "room again");
    let resend = claim(TENANT, Some("r1"), "apr_1");
    assert_eq!(a.take(resend, T0 + 2 * ttl - 2), Ok(call()));
    assert_eq!(
        a.take(resend, T0 + 2 * ttl - 2),
        Err(Refused::Used),
        "used, while remembered"
    );
    assert_eq!(a.take(resend, T0 + 2 * ttl - 1), Err(Refused::NotFound));
    // The metrics say what became of them, by tenant at the configured depth, no ids.
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
    };
    let total = |outcome: &str| {
        line(&format!(
            "weir_approvals_total{{tenant=\"agentco\",outcome=\"{outcome}\"}}"
        ))
    };
    assert_eq!(total("held").as_deref(), Some("4"));
    assert_eq!(total("capacity").as_deref(), Some("1"));
    assert_eq!(
        total("expired").as_deref(),
        Some("3"),
        "apr_2, apr_3, apr_4"
    );
    assert_eq!(total("delivered").as_deref(), Some("1"));
    let held = |state: &str| {
        line(&format!(
            "weir_approvals_held{{tenant=\"agentco\",state=\"{state}\"}}"
        ))
    };
    assert_eq!(held("pending").as_deref(), Some("0"));
    assert_eq!(held("approved").as_deref(), Some("0"));
    assert!(!text.contains("apr_") && !text.contains("r1"), "{text}");
}

//! The attacker pass on agent-run budgets (issue 30, acceptance 8): each test showed a flaw on the
//! code as it stood, and holds its fix.

use super::runs::gateway_with_runs;
use super::*;

/// A chat call of run `run_id` (when named) with `body`: the exchange, its body delivered.
fn call(gw: &Rc<Gateway>, host: &Mock, run_id: Option<&str>, body: Vec<u8>) -> Exchange {
    *host.reply.borrow_mut() = None;
    let mut x = Exchange::new(Rc::clone(gw));
    let auth = format!("Bearer {KEY}");
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("authorization", auth.as_str()),
    ];
    if let Some(id) = run_id {
        headers.push(("x-weir-run-id", id));
    }
    *host.request_headers.borrow_mut() = pairs(&headers);
    x.on_headers(host, false);
    if host.reply.borrow().is_none() {
        body_arrives(&mut x, host, body);
    }
    x
}

/// An answer that names no `max_tokens` is bounded by nothing the run reserved: the call
/// reserves [`weir_core::admission::UNBOUNDED_OUTPUT_RESERVATION`] (1024) of the run's output
/// budget, the body goes upstream with no cap, and one call's answer may then pass the budget
/// by as much as the engine writes (filter/README.md says the budget "is never passed").
#[test]
fn attack_a_call_without_max_tokens_is_not_bounded_by_the_run_s_output_budget() {
    let (gw, host) = gateway_with_runs(json!({"budgets": {"output_tokens": 2000}}));
    let mut x = call(&gw, &host, Some("r1"), chat(None));
    if let Some((status, body)) = host.replied() {
        // Refused before it ran: nothing unbounded reached an engine.
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (400, Some("output_limit_required"))
        );
        x.on_log(&host);
        // With a limit of its own the call runs.
        let mut x = call(&gw, &host, Some("r1"), chat(Some(100)));
        assert!(host.replied().is_none(), "{:?}", host.replied());
        answered(&mut x, &host, 5, 100);
        return x.on_log(&host);
    }
    let sent: Value = serde_json::from_slice(&host.request_body.borrow()).unwrap();
    let cap = ["max_tokens", "max_completion_tokens"]
        .iter()
        .filter_map(|f| sent[f].as_u64())
        .min();
    // The engine may write up to its context; what it wrote is what the run is charged.
    answered(&mut x, &host, 5, 50_000);
    x.on_log(&host);
    assert!(
        cap.is_some_and(|c| c <= 2000),
        "the call went upstream with output cap {cap:?} against a run output budget of 2000"
    );
}

/// A shadowed route's calls hold and spend the run's real budget: the tenant's limits keep a
/// separate shadow ledger (`Ledger::Shadow`), so shadow traffic never refuses enforced traffic,
/// but a run's budget has no such ledger: a dark launch (or `rollout_percent`) refuses enforced
/// calls for what shadowed calls of the same run used.
#[test]
fn attack_shadowed_calls_spend_the_enforced_run_s_budget() {
    let (gw, mut host) = gateway_with_runs(json!({"budgets": {"model_calls": 1}}));
    host.route_name = Some("shadowed".into());
    let mut x = call(&gw, &host, Some("r1"), chat(Some(10)));
    assert!(host.replied().is_none());
    answered(&mut x, &host, 5, 5);
    x.on_log(&host);
    host.route_name = None;
    let mut x = call(&gw, &host, Some("r1"), chat(Some(10)));
    let refused = host.replied();
    x.on_log(&host);
    assert_eq!(
        refused, None,
        "an enforced call was refused for what a shadowed call of its run used"
    );
}

/// `runs.require_run_id: true` on a level with no budgets is silently not required: a
/// platform that wants every call attributed to a run (the ledger's run column, `weir usage
/// --by run`) gets calls with no run, and no word that its setting does nothing.
#[test]
fn attack_require_run_id_without_budgets_requires_nothing() {
    let (gw, host) = gateway_with_runs(json!({"require_run_id": true}));
    let mut x = call(&gw, &host, None, chat(Some(10)));
    let replied = host.replied();
    x.on_log(&host);
    let (status, body) = replied.expect("a call that names no run went on");
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("run_id_required"))
    );
}

/// A run's `retries` budget is accepted and documented but holds nothing: the filter never
/// marks a call as a retry (`Exchange::retry` is never set), so a run may repeat one call (the
/// same body, the same `Idempotency-Key`) as often as its other budgets allow.
#[test]
fn attack_a_run_s_retries_budget_holds_nothing() {
    let (gw, host) = gateway_with_runs(json!({"budgets": {"retries": 1}}));
    let mut refused = None;
    for _ in 0..3 {
        *host.reply.borrow_mut() = None;
        let mut x = Exchange::new(Rc::clone(&gw));
        let auth = format!("Bearer {KEY}");
        *host.request_headers.borrow_mut() = pairs(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("authorization", &auth),
            ("x-weir-run-id", "r1"),
            ("idempotency-key", "step-1"),
        ]);
        x.on_headers(&host, false);
        if host.reply.borrow().is_none() {
            body_arrives(&mut x, &host, chat(Some(10)));
        }
        if let Some((_, body)) = host.replied() {
            refused = body["error"]["budget"].as_str().map(str::to_owned);
        } else {
            answered(&mut x, &host, 5, 5);
        }
        x.on_log(&host);
    }
    assert_eq!(
        refused.as_deref(),
        Some("retries"),
        "the same call three times passed a run budget of 1 retry"
    );
}

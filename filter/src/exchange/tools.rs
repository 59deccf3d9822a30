//! The tool calls a model makes, judged by the key's tool policy before the client sees them
//! (nothing is read for a key without one, nor in shadow mode).
//!
//! A call is withheld when its tool is blocked, when the request did not offer it (a name the
//! client would run unchecked fails closed), when its tool needs an approver (class
//! `approval`; unless the sidecar is delivering an approved call, `weir-approval: delivered`),
//! or when the run it belongs to has no tool call left. In a stream, the events of a call
//! whose name is not final are held ([`ToolScan`]); a call that passes releases them in order,
//! byte for byte, and one withheld drops them and everything after, and the answer ends with
//! an error event in the API's shape ([`reply::stream_error_event`]) — an approval's once the
//! call is complete, so it carries the digest of the arguments as the client would have
//! assembled them. The meter has read every byte before anything is dropped, so every token
//! the engine made is billed. A whole (non-streamed) answer is held at its headers and read at
//! its end; one that makes a withheld call is answered with the error instead.

use weir_core::config::{ToolClass, ToolRule};
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;
use weir_core::meter::Frame;
use weir_core::reply;
use weir_core::run;
use weir_core::tools::{
    CallSeen, Policy, ScanStep, ToolCall, ToolScan, Withheld, approval_id, arguments_sha256,
    body_calls,
};
use weir_core::trusted;

use proxy_wasm::types::Action;
use weir_core::meter::StreamMeter;

use super::{Exchange, Host, Side};
use crate::telemetry::{self, runs::ToolWhere};

/// Set by the sidecar on an answer that delivers a call an approver approved.
pub(super) const APPROVAL_HEADER: &str = "weir-approval";

/// Names the approval a request is sent again for.
pub(super) const APPROVAL_ID_HEADER: &str = "weir-approval-id";

/// Room above the request body bound for an event held whole under a tool policy: a
/// Responses event repeats the request and the answer so far.
const EVENT_ROOM: usize = 1024 * 1024;

/// Set on an answer weir refuses for its tool policy: sending it again gets the same.
pub(super) const SHOULD_RETRY: (&str, &str) = ("x-should-retry", "false");

/// One answer's calls under the tool policy.
pub(super) struct ToolGuard {
    scan: ToolScan,
    endpoint: Endpoint,
    offered: Vec<String>,
    /// Events held until the call they belong to (or follow) is decided.
    held: Vec<u8>,
    state: State,
    /// The sidecar delivers an approved call: `approval` tools pass.
    delivered: bool,
    /// The answer cannot be read (it came compressed): it is withheld whole, as an error
    /// event when it streams (`Some(true)`), an error body when not.
    unread: Option<bool>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Open,
    /// A call to an `approval` tool (its choice and index) is withheld: dropped, and read on
    /// until it is complete, for its arguments' digest.
    Approving(u32, u32),
    /// The error event went: the rest is dropped.
    Ended,
}

/// What the policy makes of the calls decided together.
enum Verdict {
    Pass,
    Withhold(ApiError),
    /// The call with this choice and index needs an approver.
    Approval(u32, u32),
}

impl ToolGuard {
    pub(super) fn new(endpoint: Endpoint, offered: Vec<String>, delivered: bool) -> ToolGuard {
        ToolGuard {
            scan: ToolScan::new(endpoint),
            endpoint,
            offered,
            held: Vec::new(),
            state: State::Open,
            delivered,
            unread: None,
        }
    }

    /// The guard of an answer that cannot be read.
    pub(super) fn unread(endpoint: Endpoint, streamed: bool) -> ToolGuard {
        ToolGuard {
            unread: Some(streamed),
            ..ToolGuard::new(endpoint, Vec::new(), false)
        }
    }

    /// Whether the answer cannot be read (see [`Exchange::withhold_unread`]).
    pub(super) fn is_unread(&self) -> bool {
        self.unread.is_some()
    }

    /// Ends the answer with `error` (held events dropped).
    fn end(&mut self, error: &ApiError, out: &mut Vec<u8>) {
        self.held.clear();
        out.extend(reply::stream_error_event(self.endpoint, error));
        self.state = State::Ended;
    }

    /// The name of the first call not decided yet, for a call too large to hold (its first
    /// 128 characters: a name that never ends is what made it too large).
    fn undecided_name(&self) -> String {
        let calls = self.scan.calls();
        let call = calls.iter().find(|c| !c.decided).or(calls.last());
        call.map(|c| c.name.chars().take(128).collect())
            .unwrap_or_default()
    }
}

/// Whether a key's tool policy applies to answers of `endpoint`.
pub(super) fn guarded(endpoint: Endpoint) -> bool {
    matches!(
        endpoint,
        Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages
    )
}

impl Exchange {
    /// Whether the answers to this call are read for their calls: the key has a tool policy,
    /// or its runs a `tool_calls` budget (counted as the answer makes them).
    pub(super) fn tool_policy_applies(&self, endpoint: Endpoint) -> bool {
        let read = (self.tenant.as_ref())
            .is_some_and(|t| !t.tools.is_empty() || t.run_budgets.tool_calls.is_some());
        read && !self.shadow && guarded(endpoint)
    }

    /// The meter of a streamed answer. Under a tool policy it holds each event whole up to the
    /// request body bound and [`EVENT_ROOM`] (a Responses event repeating the request fits):
    /// an event it let pass as it came would reach the client unread, so one larger than that
    /// ends the answer (`tool_call_unreadable`).
    pub(super) fn stream_meter(&self, endpoint: Endpoint, hide_usage_event: bool) -> StreamMeter {
        let meter = StreamMeter::new(endpoint, hide_usage_event);
        if self.tool_policy_applies(endpoint) {
            meter.holding(self.gw.config.max_body_bytes.saturating_add(EVENT_ROOM))
        } else {
            meter
        }
    }

    /// An answer that cannot be read under the tool policy: none of it goes, and its end is
    /// the error in its shape. Its usage is settled as any unreadable answer's.
    pub(super) fn withhold_unread(
        &mut self,
        host: &impl Host,
        size: usize,
        end_of_stream: bool,
    ) -> Action {
        if !end_of_stream {
            host.replace_body(Side::Response, size, &[]);
            return Action::Continue;
        }
        let error = Withheld::Unreadable.error();
        let streamed = self.tools.as_ref().filter(|g| g.unread == Some(true));
        let out = match streamed {
            Some(guard) => reply::stream_error_event(guard.endpoint, &error),
            None => self.error_reply(&error).body,
        };
        host.replace_body(Side::Response, size, &out);
        self.finish(host, self.completed_outcome());
        Action::Continue
    }

    /// The bytes of a stream to forward, of those the meter forwards (`bytes`, framed into
    /// events), under the tool policy.
    pub(super) fn guard_stream(
        &mut self,
        host: &impl Host,
        guard: &mut ToolGuard,
        bytes: &[u8],
        frames: Vec<Frame>,
        end_of_stream: bool,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(bytes.len());
        for frame in frames {
            match frame {
                Frame::Event(range) => {
                    let event = bytes.get(range).unwrap_or_default();
                    self.guard_event(host, guard, event, &mut out);
                }
                // An event too large to hold (see `event_limit`) cannot be read for calls
                // before it goes: none of it does.
                Frame::Passing(_) => match guard.state {
                    State::Open if guard.held.is_empty() => {
                        guard.end(&Withheld::Unreadable.error(), &mut out);
                    }
                    State::Open => {
                        let tool = guard.undecided_name();
                        guard.end(&Withheld::TooLarge { tool }.error(), &mut out);
                    }
                    State::Approving(..) | State::Ended => {}
                },
            }
        }
        if end_of_stream {
            self.guard_end(host, guard, &mut out);
        }
        out
    }

    fn guard_event(
        &mut self,
        host: &impl Host,
        guard: &mut ToolGuard,
        event: &[u8],
        out: &mut Vec<u8>,
    ) {
        match guard.state {
            State::Ended => return,
            State::Approving(choice, index) => {
                guard.scan.observe(event);
                self.approve_if_complete(guard, (choice, index), false, out);
                return;
            }
            State::Open => {}
        }
        match guard.scan.observe(event) {
            ScanStep::Forward => out.extend_from_slice(event),
            ScanStep::Hold => guard.held.extend_from_slice(event),
            ScanStep::Decide { calls, hold } => match self.decide(host, guard, &calls) {
                Verdict::Pass => {
                    out.append(&mut guard.held);
                    if hold {
                        guard.held.extend_from_slice(event);
                    } else {
                        out.extend_from_slice(event);
                    }
                }
                Verdict::Withhold(error) => guard.end(&error, out),
                Verdict::Approval(choice, index) => {
                    guard.held.clear();
                    guard.state = State::Approving(choice, index);
                    self.approve_if_complete(guard, (choice, index), false, out);
                }
            },
            ScanStep::Unreadable => guard.end(&Withheld::Unreadable.error(), out),
            ScanStep::TooLarge => {
                let tool = guard.undecided_name();
                guard.end(&Withheld::TooLarge { tool }.error(), out);
            }
            ScanStep::Renamed { index } => {
                let calls = guard.scan.calls();
                let call = calls.iter().find(|c| c.index == index);
                let tool = call.map(|c| c.name.clone()).unwrap_or_default();
                let policy = Policy::Renamed;
                guard.end(&Withheld::Blocked { tool, policy }.error(), out);
            }
        }
    }

    /// The stream's end: calls still undecided are decided as they stand, and an approval
    /// still withheld is told with the arguments as far as they went.
    fn guard_end(&mut self, host: &impl Host, guard: &mut ToolGuard, out: &mut Vec<u8>) {
        if guard.state == State::Open {
            let calls = guard.scan.finish();
            match self.decide(host, guard, &calls) {
                Verdict::Pass => out.append(&mut guard.held),
                Verdict::Withhold(error) => guard.end(&error, out),
                Verdict::Approval(choice, index) => guard.state = State::Approving(choice, index),
            }
        }
        if let State::Approving(choice, index) = guard.state {
            self.approve_if_complete(guard, (choice, index), true, out);
        }
    }

    /// Ends the answer with `approval_required` once the withheld call is complete (or the
    /// stream ends).
    fn approve_if_complete(
        &self,
        guard: &mut ToolGuard,
        (choice, index): (u32, u32),
        ended: bool,
        out: &mut Vec<u8>,
    ) {
        let calls = guard.scan.calls();
        let Some(call) = calls
            .iter()
            .find(|c| c.choice == choice && c.index == index)
        else {
            return;
        };
        if call.complete || ended {
            let error = self.approval_required(call).error();
            guard.end(&error, out);
        }
    }

    /// The approval a withheld call is held as (bound, as the sidecar holds it, to the run
    /// the call named, budgeted or not).
    fn approval_required(&self, call: &ToolCall) -> Withheld {
        let vouched = |name| {
            (self.vouched.iter())
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
        };
        let attempt = vouched(trusted::REQUEST_ID).unwrap_or_default();
        Withheld::Approval {
            approval_id: approval_id(attempt, call.index, &call.id),
            tool: call.name.clone(),
            arguments_sha256: arguments_sha256(&call.arguments),
            run_id: vouched(trusted::RUN_ID).map(str::to_owned),
        }
    }

    /// The policy's verdict on calls decided together: the first withheld withholds them
    /// all; when all pass, each is counted against the run's tool calls.
    fn decide(&mut self, host: &impl Host, guard: &ToolGuard, calls: &[CallSeen]) -> Verdict {
        let Some(tenant) = self.tenant.clone() else {
            return Verdict::Pass;
        };
        let mut counted = 0;
        for call in calls {
            let class = match tenant.tools.rule(&call.name) {
                ToolRule::Blocked => Err(Policy::Blocked),
                // Without a tool policy the calls are only counted.
                ToolRule::Allowed(_)
                    if !tenant.tools.is_empty() && !guard.offered.contains(&call.name) =>
                {
                    Err(Policy::NotOffered)
                }
                ToolRule::Allowed(class) => Ok(class),
            };
            match class {
                Err(policy) => {
                    if !self.shadow {
                        telemetry::runs::tool_blocked(host, &tenant, ToolWhere::Called);
                    }
                    let tool = call.name.clone();
                    return Verdict::Withhold(Withheld::Blocked { tool, policy }.error());
                }
                // Delivered once approved: a call made, counted as any other.
                Ok(ToolClass::Approval) if !guard.delivered => {
                    return Verdict::Approval(call.choice, call.index);
                }
                Ok(_) => counted += 1,
            }
        }
        // The budgets held on this Envoy (a fleet-wide one is the quota store's). An answer
        // replayed from completed work made its calls when it first ran (and was counted
        // then); one delivering an approved call makes it now.
        let budgets = run::fleet::local_budgets(&tenant);
        let made_now = !self.replayed || guard.delivered;
        if let Some(hold) = self.run.as_mut().filter(|_| made_now) {
            for _ in 0..counted {
                let now = host.now_ms();
                if let Err(denial) = run::take_tool_call(host.store(), &budgets, hold, now) {
                    return Verdict::Withhold(denial.error());
                }
            }
        }
        Verdict::Pass
    }

    /// A whole answer's calls judged: the error to answer instead, if one is withheld. A body
    /// that cannot be read for its calls fails closed.
    pub(super) fn judge_body(&mut self, host: &impl Host, body: &[u8]) -> Option<ApiError> {
        let guard = self.tools.take()?;
        let endpoint = guard.endpoint;
        let Some(calls) = body_calls(endpoint, body) else {
            let tool = String::new();
            return Some(Withheld::TooLarge { tool }.error());
        };
        let seen: Vec<CallSeen> = calls.iter().map(ToolCall::seen).collect();
        let verdict = self.decide(host, &guard, &seen);
        match verdict {
            Verdict::Pass => None,
            Verdict::Withhold(error) => Some(error),
            Verdict::Approval(choice, index) => {
                let call = calls
                    .iter()
                    .find(|c| c.choice == choice && c.index == index)?;
                Some(self.approval_required(call).error())
            }
        }
    }
}

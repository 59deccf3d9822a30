//! The response: the key's rate-limit headers put on it, the shadow decision reported, and the
//! answer metered as it passes (the stream's usage chunk hidden unless the caller asked for
//! it), until its end settles the request (`settle.rs`).

use proxy_wasm::types::Action;
use weir_core::meter::BodyMeter;
use weir_core::reply;
use weir_core::trusted;

use super::tools::{self, ToolGuard};
use super::{Exchange, Headers, Host, Meter, Side, Stage};
use crate::telemetry;
use weir_core::outcome;

/// Set on a response the sidecar (or a hosted API) answered from completed work.
const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Non-streamed response bodies larger than this are not copied: only their usage is read, as
/// they pass (no estimate from their text when they report none).
pub(super) const MAX_METERED_BODY: usize = 4 * 1024 * 1024;

impl Exchange {
    pub fn on_response_headers(&mut self, host: &impl Host, end_of_stream: bool) -> Action {
        if let (Some(reason), true) = (self.would_reject, self.shadow) {
            let decision = format!("would-reject; reason={reason}");
            host.set_header(Side::Response, trusted::SHADOW_DECISION, Some(&decision));
        }
        if self.stage != Stage::Forwarded {
            return Action::Continue;
        }
        let headers = host.headers(Side::Response);
        self.report_standing(host, &headers);
        self.upstream_status = headers
            .get(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        self.meter_as_answered(&headers);
        let encoded = headers
            .get("content-encoding")
            .is_some_and(|e| !is_identity(e));
        if encoded && !matches!(self.meter, Meter::None) {
            host.add(telemetry::UNREADABLE_RESPONSES, 1);
            self.meter = Meter::Unreadable;
        }
        self.replayed = headers.get(REPLAYED_HEADER) == Some("true");
        if matches!(self.meter, Meter::Stream(_)) {
            // Hiding the usage chunk changes the length.
            host.set_header(Side::Response, "content-length", None);
        }
        self.stage = Stage::Responding;
        if end_of_stream {
            self.finish(host, self.completed_outcome());
            return Action::Continue;
        }
        self.tools = self.tool_guard(&headers);
        if self.tools.as_ref().is_some_and(ToolGuard::is_unread) {
            // Withheld whole, replaced by an error the client reads as it is.
            host.set_header(Side::Response, "content-encoding", None);
            host.set_header(Side::Response, "content-length", None);
        } else if self.tools.is_some() && matches!(self.meter, Meter::Body(_)) {
            // A whole answer is judged whole, and may be replaced by an error of another
            // length. Its headers cannot wait for it: without `allow_on_headers_stop_iteration`
            // (which a mesh cannot set) Envoy stops all iteration and never calls the body
            // callbacks, so they go now, and its status with them.
            host.set_header(Side::Response, "content-length", None);
        }
        Action::Continue
    }

    /// The guard of the answer's tool calls, when the key has a tool policy and the answer
    /// can make calls. One that cannot be read (compressed, though weir asked for it plain)
    /// fails closed.
    fn tool_guard(&self, headers: &Headers) -> Option<ToolGuard> {
        let admitted = self.admitted.as_ref()?;
        let answered = (200..300).contains(&self.upstream_status);
        if !answered || !self.tool_policy_applies(admitted.endpoint) {
            return None;
        }
        match self.meter {
            Meter::Stream(_) | Meter::Body(_) => {}
            Meter::Unreadable => {
                let streamed =
                    (headers.get("content-type")).is_some_and(weir_core::meter::is_event_stream);
                return Some(ToolGuard::unread(admitted.endpoint, streamed));
            }
            Meter::None => return None,
        }
        // Only the sidecar's answer to a re-send naming an approval delivers one.
        let delivered =
            self.approval_resend && headers.get(tools::APPROVAL_HEADER) == Some("delivered");
        let offered = admitted.offered_tools.clone();
        Some(ToolGuard::new(admitted.endpoint, offered, delivered))
    }

    /// Puts the key's rate-limit headers on the answer, in place of any the upstream sent: a
    /// hosted API's figures are the platform's account, every tenant's usage, so they never
    /// reach a tenant, also when weir has none of its own to report (a key without limits, a
    /// shadow route).
    fn report_standing(&self, host: &impl Host, headers: &Headers) {
        for name in headers.names() {
            if reply::is_quota_header(name) {
                host.set_header(Side::Response, name, None);
            }
        }
        for (name, value) in reply::quota_headers(&self.standing, self.shape, host.now_ms()) {
            host.set_header(Side::Response, name, Some(&value));
        }
    }

    /// Meters the answer in the shape it came in, which its content type says: a stream asked
    /// for may come as one JSON body (a stream meter would find no event in it and charge no
    /// output), a plain request may be streamed (a body meter could not read it).
    fn meter_as_answered(&mut self, headers: &Headers) {
        let Some(admitted) = &self.admitted else {
            return;
        };
        let Some(content_type) = headers.get("content-type") else {
            return;
        };
        let streamed = weir_core::meter::is_event_stream(content_type);
        match (&self.meter, streamed) {
            (Meter::Stream(_), false) => {
                self.meter = Meter::Body(BodyMeter::new(admitted.endpoint, MAX_METERED_BODY));
            }
            (Meter::Body(_), true) => {
                let meter = self.stream_meter(admitted.endpoint, admitted.hide_usage_event);
                self.meter = Meter::Stream(meter);
            }
            _ => {}
        }
    }

    pub fn on_response_body(
        &mut self,
        host: &impl Host,
        size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.stage != Stage::Responding {
            return Action::Continue;
        }
        if self.tools.as_ref().is_some_and(ToolGuard::is_unread) {
            return self.withhold_unread(host, size, end_of_stream);
        }
        if self.tools.is_some() && matches!(self.meter, Meter::Body(_)) {
            return self.judge_whole(host, size, end_of_stream);
        }
        let chunk = host.body(Side::Response, size);
        let mut guard = self.tools.take();
        let framed = match (&mut self.meter, guard.is_some()) {
            (Meter::Stream(meter), true) => Some(meter.feed_framed(&chunk, end_of_stream)),
            (Meter::Stream(meter), false) => {
                let out = meter.feed(&chunk, end_of_stream);
                if out != chunk {
                    host.replace_body(Side::Response, size, &out);
                }
                None
            }
            (Meter::Body(meter), _) => {
                meter.feed(&chunk);
                None
            }
            (Meter::None | Meter::Unreadable, _) => None,
        };
        if let (Some((bytes, frames)), Some(guard)) = (framed, guard.as_mut()) {
            let out = self.guard_stream(host, guard, &bytes, frames, end_of_stream);
            if out != chunk {
                host.replace_body(Side::Response, size, &out);
            }
        }
        self.tools = guard;
        if end_of_stream {
            self.finish(host, self.completed_outcome());
        }
        Action::Continue
    }

    /// The answer ended in trailers (HTTP/2 trailers, chunked trailer fields): no body callback
    /// saw its end, so it ends here — a whole answer held for the tool policy is judged on the
    /// body Envoy buffered (else Envoy would let it go unread), a stream's held events decided.
    pub fn on_response_trailers(&mut self, host: &impl Host) -> Action {
        if self.stage != Stage::Responding {
            return Action::Continue;
        }
        let whole = self.tools.is_some() && matches!(self.meter, Meter::Body(_));
        self.on_response_body(host, if whole { usize::MAX } else { 0 }, true)
    }

    /// A whole answer held for the tool policy: buffered (Envoy keeps the chunks) until its
    /// end, then metered and judged. One that makes a withheld call is replaced by the error
    /// body in the called API's shape; its status stays the engine's (the headers went on
    /// already, see `on_response_headers`), so the error object says what happened. Its
    /// usage is settled as it came.
    fn judge_whole(&mut self, host: &impl Host, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host.body(Side::Response, size);
        if let Meter::Body(meter) = &mut self.meter {
            meter.feed(&body);
        }
        let withheld = self.judge_body(host, &body);
        self.finish(host, self.completed_outcome());
        if let Some(error) = withheld {
            let answer = self.error_reply(&error);
            host.replace_body(Side::Response, body.len(), &answer.body);
        }
        Action::Continue
    }

    pub(super) fn completed_outcome(&self) -> &'static str {
        outcome::of_answer(self.upstream_status)
    }
}

/// Whether a `content-encoding` value leaves the body as it is.
pub(super) fn is_identity(encoding: &str) -> bool {
    let encoding = encoding.trim();
    encoding.is_empty() || encoding.eq_ignore_ascii_case("identity")
}

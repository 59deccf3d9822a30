//! [`ToolScan`]: the calls of a streamed answer, event by event.

use std::borrow::Cow;

use crate::endpoint::Endpoint;
use crate::sse::event_data;

use super::events::{ChatChunk, MessagesEvent, ResponsesEvent, string_value};
use super::{CallSeen, MAX_CALLS, MAX_HELD_BYTES, ScanStep, ToolCall};

/// Reads one answer's stream for the tool calls it makes.
#[derive(Debug)]
pub struct ToolScan {
    endpoint: Endpoint,
    calls: Vec<ToolCall>,
    /// Bytes of the events said [`ScanStep::Hold`] (or held by a decision) since the last
    /// release.
    held_bytes: usize,
    too_large: bool,
    done: bool,
}

/// What one event did to the calls.
#[derive(Default)]
struct Effect {
    decided: Vec<CallSeen>,
    renamed: Option<u32>,
    too_many: bool,
}

impl ToolScan {
    pub fn new(endpoint: Endpoint) -> Self {
        ToolScan {
            endpoint,
            calls: Vec::new(),
            held_bytes: 0,
            too_large: false,
            done: false,
        }
    }

    /// Reads one whole event (as [`crate::sse::event_end`] frames it) and says what to do
    /// with it.
    pub fn observe(&mut self, event: &[u8]) -> ScanStep {
        if self.too_large {
            return ScanStep::TooLarge;
        }
        let mut effect = Effect::default();
        if let Some(data) = event_data(event) {
            match self.endpoint {
                Endpoint::ChatCompletions => self.chat(&data, &mut effect),
                Endpoint::Responses => self.responses(&data, &mut effect),
                Endpoint::Messages => self.messages(&data, &mut effect),
                Endpoint::Completions | Endpoint::Embeddings => {}
            }
        }
        if effect.too_many {
            self.too_large = true;
            return ScanStep::TooLarge;
        }
        if let Some(index) = effect.renamed {
            return ScanStep::Renamed { index };
        }
        let hold = self.calls.iter().any(|c| !c.decided);
        if hold {
            let base = if effect.decided.is_empty() {
                self.held_bytes
            } else {
                0
            };
            self.held_bytes = base.saturating_add(event.len());
            if self.held_bytes > MAX_HELD_BYTES {
                self.too_large = true;
                return ScanStep::TooLarge;
            }
        } else {
            self.held_bytes = 0;
        }
        match (effect.decided.is_empty(), hold) {
            (true, true) => ScanStep::Hold,
            (true, false) => ScanStep::Forward,
            (false, hold) => ScanStep::Decide {
                calls: effect.decided,
                hold,
            },
        }
    }

    /// The stream ended (cut, or after its last event): the calls still undecided are
    /// decided as they stand (a cut stream's held events are then released or dropped).
    pub fn finish(&mut self) -> Vec<CallSeen> {
        let mut effect = Effect::default();
        self.decide_all(None, &mut effect);
        effect.decided
    }

    /// Every call the answer made so far, in the order they opened, with their arguments as
    /// far as they went: the completed ones are whole (for approvals).
    pub fn calls(&self) -> &[ToolCall] {
        &self.calls
    }

    /// The calls completed so far.
    pub fn completed(&self) -> impl Iterator<Item = &ToolCall> {
        self.calls.iter().filter(|c| c.complete)
    }

    /// Calls the answer made (decided), for a run's tool-call budget.
    pub fn calls_made(&self) -> u64 {
        self.calls.iter().filter(|c| c.decided).count() as u64
    }

    /// Bytes of the events held now.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Whether the API's last event has passed.
    pub fn saw_done(&self) -> bool {
        self.done
    }

    /// The call of a choice with an index, opened if new (`None` past [`MAX_CALLS`]).
    fn call(&mut self, choice: u32, index: u32, effect: &mut Effect) -> Option<&mut ToolCall> {
        let at = match self
            .calls
            .iter()
            .position(|c| c.choice == choice && c.index == index)
        {
            Some(at) => at,
            None => {
                if self.calls.len() >= MAX_CALLS {
                    effect.too_many = true;
                    return None;
                }
                self.calls.push(ToolCall {
                    choice,
                    index,
                    ..ToolCall::default()
                });
                self.calls.len() - 1
            }
        };
        self.calls.get_mut(at)
    }

    /// Decides the undecided calls (of one choice, or all), in the order they opened.
    fn decide_all(&mut self, choice: Option<u32>, effect: &mut Effect) {
        for call in &mut self.calls {
            if !call.decided && choice.is_none_or(|c| c == call.choice) {
                call.decided = true;
                effect.decided.push(call.seen());
            }
        }
    }

    /// Marks the calls (of one choice, or all) complete.
    fn complete_all(&mut self, choice: Option<u32>) {
        for call in &mut self.calls {
            if choice.is_none_or(|c| c == call.choice) {
                call.complete = true;
            }
        }
    }

    /// Opens the call with index `i` named whole in one event (a Responses item, a Messages
    /// block) and decides it; a call opened again under its index with another name is a
    /// rename. The call, when it was opened now.
    fn open_named(
        &mut self,
        i: u32,
        id: Option<Cow<'_, str>>,
        name: Option<Cow<'_, str>>,
        arguments: &str,
        effect: &mut Effect,
    ) -> Option<&mut ToolCall> {
        let name = name.unwrap_or_default();
        if let Some(call) = self.calls.iter().find(|c| c.index == i) {
            if call.name != name {
                effect.renamed = Some(i);
            }
            return None;
        }
        let call = self.call(0, i, effect)?;
        call.id = id.unwrap_or_default().into_owned();
        call.name = name.into_owned();
        call.set_arguments(arguments);
        call.decided = true;
        effect.decided.push(call.seen());
        Some(call)
    }

    fn terminal(&mut self, effect: &mut Effect) {
        self.done = true;
        self.decide_all(None, effect);
        self.complete_all(None);
    }

    fn chat(&mut self, data: &[u8], effect: &mut Effect) {
        if data.trim_ascii() == b"[DONE]" {
            self.terminal(effect);
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<ChatChunk>(data) else {
            return;
        };
        for (n, choice) in chunk.choices.unwrap_or_default().into_iter().enumerate() {
            let c = choice
                .index
                .unwrap_or_else(|| u32::try_from(n).unwrap_or(u32::MAX));
            let deltas = choice.delta.and_then(|d| d.tool_calls).unwrap_or_default();
            for (k, delta) in deltas.into_iter().enumerate() {
                let i = delta
                    .index
                    .unwrap_or_else(|| u32::try_from(k).unwrap_or(u32::MAX));
                // A delta of another index: the undecided call's name is final.
                for call in &mut self.calls {
                    if !call.decided && call.choice == c && call.index != i {
                        call.decided = true;
                        effect.decided.push(call.seen());
                    }
                }
                let Some(call) = self.call(c, i, effect) else {
                    return;
                };
                if let Some(id) = delta.id.filter(|id| !id.is_empty())
                    && call.id.is_empty()
                {
                    call.id = id.into_owned();
                }
                let function = delta.function;
                let (name, arguments) = function.map(|f| (f.name, f.arguments)).unwrap_or_default();
                if let Some(name) = name.filter(|n| !n.is_empty()) {
                    if call.decided {
                        effect.renamed = Some(i);
                        return;
                    }
                    call.name.push_str(&name);
                }
                if let Some(arguments) = arguments.filter(|a| !a.is_empty()) {
                    call.push_arguments(&arguments);
                    if !call.decided {
                        call.decided = true;
                        effect.decided.push(call.seen());
                    }
                }
            }
            if choice.finish_reason.is_some() {
                self.decide_all(Some(c), effect);
                self.complete_all(Some(c));
            }
        }
    }

    fn responses(&mut self, data: &[u8], effect: &mut Effect) {
        let Ok(event) = serde_json::from_slice::<ResponsesEvent>(data) else {
            return;
        };
        let index = event.output_index;
        let item = event
            .item
            .filter(|item| item.kind.as_deref() == Some("function_call"));
        match (event.kind.as_ref(), item, index) {
            ("response.output_item.added", Some(item), Some(i)) => {
                let arguments = item.arguments.unwrap_or_default();
                self.open_named(i, item.call_id, item.name, &arguments, effect);
            }
            ("response.output_item.done", Some(item), Some(i)) => {
                let Some(call) = self.calls.iter_mut().find(|c| c.index == i) else {
                    // Done without being added: opened and decided now.
                    let arguments = item.arguments.unwrap_or_default();
                    if let Some(call) =
                        self.open_named(i, item.call_id, item.name, &arguments, effect)
                    {
                        call.complete = true;
                    }
                    return;
                };
                if item.name.as_deref().is_some_and(|n| n != call.name) {
                    effect.renamed = Some(i);
                    return;
                }
                if let Some(arguments) = item.arguments {
                    call.set_arguments(&arguments);
                }
                call.complete = true;
            }
            ("response.function_call_arguments.delta", _, Some(i)) => {
                let fragment = event.delta.and_then(string_value);
                if let (Some(call), Some(fragment)) =
                    (self.calls.iter_mut().find(|c| c.index == i), fragment)
                {
                    call.push_arguments(&fragment);
                }
            }
            ("response.function_call_arguments.done", _, Some(i)) => {
                if let (Some(call), Some(arguments)) = (
                    self.calls.iter_mut().find(|c| c.index == i),
                    event.arguments,
                ) {
                    call.set_arguments(&arguments);
                }
            }
            ("response.completed" | "response.incomplete" | "response.failed", _, _) => {
                self.terminal(effect);
            }
            _ => {}
        }
    }

    fn messages(&mut self, data: &[u8], effect: &mut Effect) {
        let Ok(event) = serde_json::from_slice::<MessagesEvent>(data) else {
            return;
        };
        let Some(i) = event.index else {
            if event.kind == "message_stop" {
                self.terminal(effect);
            }
            return;
        };
        match event.kind.as_ref() {
            "content_block_start" => {
                let Some(block) = event
                    .content_block
                    .filter(|b| b.kind.as_deref() == Some("tool_use"))
                else {
                    return;
                };
                // The block's `input` is `{}` as Anthropic sends it, and clients build it from
                // the `input_json_delta`s; an engine that sends it whole there sends none.
                let input = block.input.map_or("", |input| input.get().trim());
                let input = if input == "{}" { "" } else { input };
                if let Some(call) = self.open_named(i, block.id, block.name, input, effect) {
                    call.input_from_start = !input.is_empty();
                }
            }
            "content_block_delta" => {
                let fragment = event
                    .delta
                    .filter(|d| d.kind.as_deref() == Some("input_json_delta"))
                    .and_then(|d| d.partial_json);
                if let (Some(call), Some(fragment)) =
                    (self.calls.iter_mut().find(|c| c.index == i), fragment)
                {
                    if std::mem::take(&mut call.input_from_start) {
                        call.set_arguments("");
                    }
                    call.push_arguments(&fragment);
                }
            }
            "content_block_stop" => {
                if let Some(call) = self.calls.iter_mut().find(|c| c.index == i) {
                    call.complete = true;
                }
            }
            _ => {}
        }
    }
}

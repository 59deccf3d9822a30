//! [`ToolScan`]: the calls of a streamed answer, event by event.

use std::borrow::Cow;

use crate::endpoint::Endpoint;
use crate::sse::event_data;

use super::events::{
    ChatChunk, MessagesBlock, MessagesEvent, ResponsesEvent, ResponsesItem, string_value,
};
use super::{CallSeen, LEGACY_INDEX, MAX_CALLS, MAX_HELD_BYTES, ScanStep, ToolCall};

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
    /// A data event not of its API's shape: a client may read a call in it that the scan
    /// cannot.
    unreadable: bool,
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
        // A stream may open with a byte order mark, which SSE parsers drop.
        let event = event.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(event);
        let mut effect = Effect::default();
        if let Some(data) = event_data(event) {
            match self.endpoint {
                Endpoint::ChatCompletions => self.chat(&data, &mut effect),
                Endpoint::Responses => self.responses(&data, &mut effect),
                Endpoint::Messages => self.messages(&data, &mut effect),
                Endpoint::Completions | Endpoint::Embeddings => {}
            }
        }
        if effect.unreadable {
            return ScanStep::Unreadable;
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

    /// States the call with index `i` named whole in one event (a Responses item, a Messages
    /// block, a snapshot of the answer so far): a new call is opened and decided; a known one
    /// must keep the name and id it was decided with (else it is a rename: a client would run
    /// another call), and takes the arguments stated. The call, when it was opened now.
    fn state(
        &mut self,
        i: u32,
        id: Option<Cow<'_, str>>,
        name: Option<Cow<'_, str>>,
        arguments: Option<Cow<'_, str>>,
        effect: &mut Effect,
    ) -> Option<&mut ToolCall> {
        // The call known by its index, or restated elsewhere by its id (a snapshot placing it
        // at another position): the same call.
        let same_id = |c: &ToolCall| id.as_deref().is_some_and(|d| !d.is_empty() && c.id == d);
        let known = (self.calls.iter().position(|c| c.index == i))
            .or_else(|| self.calls.iter().position(same_id));
        if let Some(call) = known.and_then(|at| self.calls.get_mut(at)) {
            let other_name = name.is_some_and(|n| n != call.name);
            let other_id = id.is_some_and(|d| !d.is_empty() && !call.id.is_empty() && d != call.id);
            if other_name || other_id {
                effect.renamed = Some(i);
            } else if let Some(arguments) = arguments {
                call.set_arguments(&arguments);
            }
            return None;
        }
        let call = self.call(0, i, effect)?;
        call.id = id.unwrap_or_default().into_owned();
        call.name = name.unwrap_or_default().into_owned();
        call.set_arguments(&arguments.unwrap_or_default());
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
            effect.unreadable = true;
            return;
        };
        for (n, choice) in chunk.choices.unwrap_or_default().into_iter().enumerate() {
            let c = choice
                .index
                .unwrap_or_else(|| u32::try_from(n).unwrap_or(u32::MAX));
            let (tool_calls, legacy) = choice
                .delta
                .map(|d| (d.tool_calls.unwrap_or_default(), d.function_call))
                .unwrap_or_default();
            let mut pieces = Vec::with_capacity(tool_calls.len() + 1);
            for (k, call) in tool_calls.into_iter().enumerate() {
                let i = (call.index).unwrap_or_else(|| u32::try_from(k).unwrap_or(u32::MAX));
                let id = call.id.clone();
                // The legacy call's index is not a `tool_calls` one; a call whose kind is
                // ambiguous is not one a client is sure to run as judged.
                let parts = call.parts().filter(|_| i != LEGACY_INDEX);
                let Some((name, arguments)) = parts else {
                    effect.unreadable = true;
                    return;
                };
                pieces.push((i, id, name, arguments));
            }
            pieces.extend(legacy.map(|f| (LEGACY_INDEX, None, f.name, f.arguments)));
            for (i, id, name, arguments) in pieces {
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
                if let Some(id) = id.filter(|id| !id.is_empty())
                    && call.id.is_empty()
                {
                    call.id = id.into_owned();
                }
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
            effect.unreadable = true;
            return;
        };
        // The answer so far, restated (or stated only here, by an engine that opened no item).
        let output = event.response.and_then(|r| r.output).unwrap_or_default();
        for (n, mut item) in output.into_iter().enumerate() {
            if item.is_call() {
                let i = u32::try_from(n).unwrap_or(u32::MAX);
                let (name, arguments) = (item.name(), item.arguments());
                self.state(i, item.call_id, name, arguments, effect);
            }
        }
        let index = event.output_index;
        let item = event.item.filter(ResponsesItem::is_call);
        match (event.kind.as_ref(), item, index) {
            // A call the client cannot place is not one to let pass unread.
            (_, Some(_), None) => effect.unreadable = true,
            ("response.output_item.added", Some(mut item), Some(i)) => {
                let (name, arguments) = (item.name(), Some(item.arguments().unwrap_or_default()));
                self.state(i, item.call_id, name, arguments, effect);
            }
            ("response.output_item.done", Some(mut item), Some(i)) => {
                let (name, arguments) = (item.name(), item.arguments());
                // Done without being added: opened and decided now.
                self.state(i, item.call_id, name, arguments, effect);
                if let Some(call) = self.calls.iter_mut().find(|c| c.index == i) {
                    call.complete = true;
                }
            }
            (
                "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta",
                _,
                Some(i),
            ) => {
                let fragment = event.delta.and_then(string_value);
                if let (Some(call), Some(fragment)) =
                    (self.calls.iter_mut().find(|c| c.index == i), fragment)
                {
                    call.push_arguments(&fragment);
                }
            }
            (
                "response.function_call_arguments.done" | "response.custom_tool_call_input.done",
                _,
                Some(i),
            ) => {
                if let (Some(call), Some(arguments)) = (
                    self.calls.iter_mut().find(|c| c.index == i),
                    event.arguments.or(event.input),
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
            effect.unreadable = true;
            return;
        };
        // `message_start`'s content (empty as Anthropic sends it) may open calls.
        let content = event.message.and_then(|m| m.content).unwrap_or_default();
        for (n, block) in content.into_iter().enumerate() {
            if block.kind.as_deref() == Some("tool_use") {
                let i = u32::try_from(n).unwrap_or(u32::MAX);
                self.open_block(i, block, effect);
            }
        }
        let block = (event.content_block).filter(|b| b.kind.as_deref() == Some("tool_use"));
        let Some(i) = event.index else {
            if block.is_some() {
                // A call the client cannot place is not one to let pass unread.
                effect.unreadable = true;
            } else if event.kind == "message_stop" {
                self.terminal(effect);
            }
            return;
        };
        match event.kind.as_ref() {
            "content_block_start" => {
                if let Some(block) = block {
                    self.open_block(i, block, effect);
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

    /// Opens a `tool_use` block at index `i`. Its `input` is `{}` as Anthropic sends it, and
    /// clients build it from the `input_json_delta`s; an engine that sends it whole there
    /// sends none.
    fn open_block(&mut self, i: u32, block: MessagesBlock<'_>, effect: &mut Effect) {
        let input = block.input.map_or("", |input| input.get().trim());
        let input = if input == "{}" { "" } else { input };
        let opened = self.state(i, block.id, block.name, Some(Cow::Borrowed(input)), effect);
        if let Some(call) = opened {
            call.input_from_start = !input.is_empty();
        }
    }
}

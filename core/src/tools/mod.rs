//! The tool calls a model makes, seen in its answer as it streams ([`ToolScan`]) or whole
//! ([`body_calls`]), in the shape of the API that was called.
//!
//! A stream is read one whole event at a time, framed as the meter frames it
//! ([`crate::sse::event_end`]; the filter feeds the events `StreamMeter` takes). For each event
//! the scan says what the caller does with it ([`ScanStep`]): forward it, hold it (it belongs
//! to a call whose name is not final yet), or decide the calls whose names just became final,
//! asking the tool policy for each, and then release or drop what it held.
//!
//! When a call's name is final:
//! - Chat Completions sends a call over several deltas of `choices[].delta.tool_calls[index]`,
//!   the name itself possibly split (clients concatenate the pieces). Its name is final at its
//!   first non-empty `arguments`, at a delta of another index in its choice, at its choice's
//!   `finish_reason`, or at `data: [DONE]` — until then its events, and every event after
//!   them, are held, so the order of the stream is kept. Between events at most one call is
//!   undecided (a delta of another index decides it).
//! - Responses (`response.output_item.added` with a `function_call` or `custom_tool_call`
//!   item) and Messages (`content_block_start` with a `tool_use` block) name a call whole in the
//!   event that opens it, which is decided at once. A snapshot of the answer (a Responses
//!   event's `response.output`, a Messages `message_start`'s `content`) states its calls too: one
//!   no event opened is decided there.
//! - Chat's custom tools (`custom.name`, `custom.input`) and the legacy `function_call` are
//!   read as calls like `tool_calls`.
//!
//! A piece of a name arriving after its call was decided, or the call stated again under
//! another name or id, would make the client run a call other than the one decided; the scan
//! reports it ([`ScanStep::Renamed`]) for the caller to end the stream. So does it an event it
//! cannot read ([`ScanStep::Unreadable`]): what a client's more lenient parser makes of it is
//! unknown. Held events are bounded by [`MAX_HELD_BYTES`], and the calls kept by
//! [`MAX_CALLS`]; past either the scan says [`ScanStep::TooLarge`]. Arguments are kept (for
//! approvals) up to [`MAX_ARGUMENT_BYTES`] per call, and the call is marked truncated past it.

mod body;
mod events;
pub mod offered;
mod scan;
#[cfg(test)]
mod tests;
mod withheld;

pub use body::body_calls;
pub use offered::offered_names;
pub use scan::ToolScan;
pub use withheld::{Policy, Withheld, arguments_sha256, tool_blocked};

/// Held events past this many bytes are too large to hold ([`ScanStep::TooLarge`]).
pub use crate::meter::MAX_HELD_BYTES;

/// Arguments kept per call; past this a call's arguments are truncated ([`ToolCall::truncated`]).
pub const MAX_ARGUMENT_BYTES: usize = 64 * 1024;

/// Calls kept per answer; a call past this makes the answer [`ScanStep::TooLarge`].
pub const MAX_CALLS: usize = 128;

/// The index the scan gives chat's legacy `function_call` (one a choice, read as a call so a
/// client still reading it runs nothing unjudged), apart from any `tool_calls` index.
pub const LEGACY_INDEX: u32 = u32::MAX;

/// A call whose name just became final: what the tool policy is asked about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallSeen {
    /// The chat choice it belongs to (0 in the other APIs).
    pub choice: u32,
    /// The call's index: chat's `tool_calls[].index`, the Responses `output_index`, the
    /// Messages content block `index`.
    pub index: u32,
    /// The id the client answers the call with (chat `id`, Responses `call_id`, Messages `id`).
    pub id: String,
    pub name: String,
    /// The arguments seen up to the decision (often none yet).
    pub arguments_so_far: String,
}

/// What the caller does with one event of the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScanStep {
    /// Forward it (and nothing is held).
    Forward,
    /// Hold it, after those held already: it belongs to, or follows, a call whose name is not
    /// final.
    Hold,
    /// These calls' names became final at this event (in the order they became so). If the
    /// policy passes them all, the events held before are released, and this one too unless
    /// `hold` (it opened a call still undecided: it is then held, alone); otherwise the held
    /// events and this one are dropped.
    Decide { calls: Vec<CallSeen>, hold: bool },
    /// The events held, or the calls kept, passed their bound: the caller withholds the
    /// calls undecided (`tool_call_too_large`). Once said, said for every later event.
    TooLarge,
    /// The event adds a piece to the name of the call with this index after it was decided,
    /// or states that call again under another name or id.
    Renamed { index: u32 },
    /// A data event not of its API's shape (not JSON, a field of the wrong type, a member
    /// repeated, a call without its index): a client's parser may find a call in it that the
    /// scan cannot, so the caller withholds the answer from here on (`tool_call_unreadable`).
    Unreadable,
}

/// A call the answer made, as far as it went.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    /// The chat choice it belongs to (0 in the other APIs).
    pub choice: u32,
    pub index: u32,
    pub id: String,
    pub name: String,
    /// The arguments as the client assembles them (the Messages `input` as JSON text).
    pub arguments: String,
    /// Its name was final and the caller was told so.
    pub decided: bool,
    /// The answer said the call ended (its item or block done, its choice finished, the
    /// stream's last event), so `arguments` are whole unless `truncated`.
    pub complete: bool,
    /// `arguments` stopped at [`MAX_ARGUMENT_BYTES`].
    pub truncated: bool,
    /// `arguments` are a Messages block's opening `input`, which its first `input_json_delta`
    /// replaces (as clients do).
    input_from_start: bool,
}

impl ToolCall {
    /// The call as the tool policy is asked about it.
    pub fn seen(&self) -> CallSeen {
        CallSeen {
            choice: self.choice,
            index: self.index,
            id: self.id.clone(),
            name: self.name.clone(),
            arguments_so_far: self.arguments.clone(),
        }
    }

    /// Adds a fragment of the arguments, up to the bound.
    fn push_arguments(&mut self, fragment: &str) {
        if self.truncated {
            return;
        }
        if self.arguments.len() + fragment.len() > MAX_ARGUMENT_BYTES {
            self.truncated = true;
            return;
        }
        self.arguments.push_str(fragment);
    }

    /// Replaces the arguments with the whole that an event restated.
    fn set_arguments(&mut self, whole: &str) {
        self.arguments.clear();
        self.truncated = false;
        self.push_arguments(whole);
    }
}

/// The id of an approval: `apr_` and 24 lowercase base-32 letters of
/// SHA-256(attempt id ‖ 0 ‖ index ‖ 0 ‖ call id). The filter (which withholds the call) and the
/// sidecar (which keeps it) compute it alike from what both see; weir's attempt id is random,
/// so no caller can guess another's.
pub fn approval_id(attempt_id: &str, index: u32, call_id: &str) -> String {
    use sha2::{Digest, Sha256};
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut h = Sha256::new();
    h.update(attempt_id.as_bytes());
    h.update([0]);
    h.update(index.to_string().as_bytes());
    h.update([0]);
    h.update(call_id.as_bytes());
    let digest = h.finalize();
    let mut id = String::from("apr_");
    // Five bits per letter, from the digest's bits in order.
    for i in 0..24usize {
        let bit = i * 5;
        let (byte, shift) = (bit / 8, bit % 8);
        let pair = u16::from(digest.get(byte).copied().unwrap_or(0)) << 8
            | u16::from(digest.get(byte + 1).copied().unwrap_or(0));
        let letter = (pair >> (11 - shift)) & 31;
        id.push(char::from(
            ALPHABET.get(usize::from(letter)).copied().unwrap_or(b'a'),
        ));
    }
    id
}

//! How a chat prompt ends, by vLLM's `add_generation_prompt` (default true: the assistant's
//! turn is opened for the reply) and `continue_final_message` (default false; true: the last
//! message is left open and the reply continues it, as when a client prefills the start of an
//! answer, or weir resumes a preempted stream). vLLM refuses both at once.

use weir_core::error::ApiError;
use weir_core::tokens::{Encoding, TokenId, TokenizerUnavailable};

/// The two fields of a chat request's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Framing {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
}

impl Framing {
    pub fn of_request(body: &[u8]) -> Result<Framing, ApiError> {
        let fields: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(body).unwrap_or_default();
        let flag = |name: &str, default: bool| match fields.get(name) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                ApiError::bad_request(format!("{name}: Input should be a valid boolean"))
                    .with_param(name)
            }),
        };
        let framing = Framing {
            add_generation_prompt: flag("add_generation_prompt", true)?,
            continue_final_message: flag("continue_final_message", false)?,
        };
        if framing.add_generation_prompt && framing.continue_final_message {
            return Err(ApiError::bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        Ok(framing)
    }

    /// A chat's token ids (framed and primed for the reply, as [`Encoding::encode_chat`]
    /// gives them) as this framing ends them.
    pub fn apply(
        self,
        mut ids: Vec<TokenId>,
        encoding: Encoding,
    ) -> Result<Vec<TokenId>, TokenizerUnavailable> {
        if !self.add_generation_prompt {
            let priming = encoding.encode_chat([])?.len();
            ids.truncate(ids.len().saturating_sub(priming));
        }
        if self.continue_final_message {
            // The last message's end-of-turn token.
            ids.pop();
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;
    use weir_core::tokens::ChatTurn;

    /// A chat's token ids, framed and primed for the reply.
    fn chat(e: Encoding, turns: &[(&str, &str)]) -> Vec<TokenId> {
        let turns = turns.iter().map(|&(role, text)| ChatTurn {
            role,
            name: None,
            content: vec![Cow::Borrowed(text)],
        });
        e.encode_chat(turns).unwrap()
    }

    #[test]
    fn a_continued_final_message_is_the_prompt_plus_its_text_and_both_flags_are_refused() {
        let e = Encoding::Cl100kBase;
        let framing = |body: &str| Framing::of_request(body.as_bytes());
        let plain = framing("{}").unwrap();
        let asked = chat(e, &[("user", "hi")]);
        assert_eq!(plain.apply(asked.clone(), e).unwrap(), asked);
        let continuing =
            framing(r#"{"continue_final_message": true, "add_generation_prompt": false}"#).unwrap();
        let text = " the cache of";
        let resumed = chat(e, &[("user", "hi"), ("assistant", text)]);
        let resumed = continuing.apply(resumed, e).unwrap();
        assert_eq!(
            resumed.len(),
            asked.len() + e.encode(text).unwrap().len(),
            "the reply's opening, then the text, left open"
        );
        assert_eq!(resumed[..asked.len()], asked[..]);
        let both = framing(r#"{"continue_final_message": true}"#).unwrap_err();
        assert_eq!(both.status, 400);
        assert!(both.message.contains("Cannot set both"));
        assert!(framing(r#"{"add_generation_prompt": "no"}"#).is_err());
    }
}

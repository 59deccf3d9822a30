//! Prompt tokenization with tiktoken BPE vocabularies, including chat-format overhead.
//!
//! Chat prompts are framed the way the OpenAI cookbook counts them: every message costs its
//! role and content plus three framing tokens, and the reply is primed with three more. The
//! framing is materialised as real token ids so prefix caches can hash the rendered prompt.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use tiktoken_rs::CoreBPE;

/// A token id in the encoding's vocabulary.
pub type TokenId = u32;

/// BPE vocabularies weir can count with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// The 100k vocabulary of GPT-4-era models; the default stand-in for open models.
    #[default]
    Cl100kBase,
    /// The 200k vocabulary of GPT-4o-era models.
    O200kBase,
}

/// No exact count: the vocabulary could not be loaded (only possible if the embedded table is
/// corrupt), or the text defeats the pre-tokenizer's backtracking regex (a long pathological run,
/// such as a million spaces before a word, on which tiktoken's `encode_ordinary` panics).
#[derive(Debug, thiserror::Error)]
#[error("tokenizer {0:?} cannot count this text exactly")]
pub struct TokenizerUnavailable(pub Encoding);

/// Chat framing markers (`<|im_start|>`, `<|im_sep|>`, `<|im_end|>` in cl100k_base). They sit in
/// the special-token range of both vocabularies, so they never collide with text tokens.
const IM_START: TokenId = 100_264;
const IM_END: TokenId = 100_265;
const IM_SEP: TokenId = 100_266;

impl Encoding {
    /// The loaded vocabulary. Loading parses a multi-megabyte table, so it happens once per
    /// process (or wasm VM) and is shared afterwards.
    pub fn bpe(self) -> Result<&'static CoreBPE, TokenizerUnavailable> {
        static CL100K: OnceLock<Option<CoreBPE>> = OnceLock::new();
        static O200K: OnceLock<Option<CoreBPE>> = OnceLock::new();
        let slot = match self {
            Encoding::Cl100kBase => CL100K.get_or_init(|| tiktoken_rs::cl100k_base().ok()),
            Encoding::O200kBase => O200K.get_or_init(|| tiktoken_rs::o200k_base().ok()),
        };
        slot.as_ref().ok_or(TokenizerUnavailable(self))
    }

    /// Token ids of plain text, with no special-token interpretation: tiktoken's fallible
    /// `encode` with no special token allowed (the same ids as `encode_ordinary`, which unwraps
    /// the regex's errors — a panic that would trap the filter's VM and every request on it).
    pub fn encode(self, text: &str) -> Result<Vec<TokenId>, TokenizerUnavailable> {
        self.bpe()?
            .encode(text, &HashSet::new())
            .map(|(ids, _)| ids)
            .map_err(|_| TokenizerUnavailable(self))
    }

    /// Token ids of a chat conversation, framed and primed for the assistant's reply.
    pub fn encode_chat<'a>(
        self,
        messages: impl IntoIterator<Item = ChatTurn<'a>>,
    ) -> Result<Vec<TokenId>, TokenizerUnavailable> {
        let mut ids = Vec::new();
        for turn in messages {
            ids.push(IM_START);
            ids.extend(self.encode(turn.role)?);
            if let Some(name) = turn.name {
                // The cookbook charges one extra token for a name beside its own tokens.
                ids.push(IM_SEP);
                ids.extend(self.encode(name)?);
            }
            ids.push(IM_SEP);
            for part in &turn.content {
                ids.extend(self.encode(part)?);
            }
            ids.push(IM_END);
        }
        ids.push(IM_START);
        ids.extend(self.encode("assistant")?);
        ids.push(IM_SEP);
        Ok(ids)
    }
}

/// One chat message as the tokenizer sees it: role, optional name, and text parts (its content
/// and anything else the engine renders with it, such as tool calls).
#[derive(Clone, Debug)]
pub struct ChatTurn<'a> {
    pub role: &'a str,
    pub name: Option<&'a str>,
    pub content: Vec<Cow<'a, str>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn<'a>(role: &'a str, content: &'a str) -> ChatTurn<'a> {
        ChatTurn {
            role,
            name: None,
            content: vec![content.into()],
        }
    }

    #[test]
    fn plain_text_counts_real_bpe_tokens() {
        let ids = Encoding::Cl100kBase
            .encode("hello world")
            .unwrap_or_default();
        assert_eq!(ids.len(), 2);
    }

    #[test]
    fn chat_overhead_matches_the_cookbook_rule() {
        // Cookbook: 3 per message + role + content tokens, +1 per name, + 3 reply priming.
        let enc = Encoding::Cl100kBase;
        let messages = [
            turn("system", "You are terse."),
            turn("user", "hello world"),
        ];
        let expected: usize = messages
            .iter()
            .map(|m| {
                3 + enc.encode(m.role).map_or(0, |v| v.len())
                    + m.content
                        .iter()
                        .map(|c| enc.encode(c).map_or(0, |v| v.len()))
                        .sum::<usize>()
            })
            .sum::<usize>()
            + 3;
        let ids = enc
            .encode_chat(messages.iter().cloned())
            .unwrap_or_default();
        assert_eq!(ids.len(), expected);

        let named = ChatTurn {
            name: Some("bob"),
            ..turn("user", "hello world")
        };
        let with_name = enc.encode_chat([named]).unwrap_or_default();
        let without = enc
            .encode_chat([turn("user", "hello world")])
            .unwrap_or_default();
        assert_eq!(
            with_name.len(),
            without.len() + 2,
            "one name token + one framing token"
        );
    }

    // Native only: under Node's WASI runner this test passes but Node segfaults at exit (it
    // does not after the same input in `estimate`'s tests, nor in Envoy's V8: tests/metering.rs).
    #[cfg(not(target_family = "wasm"))]
    #[test]
    fn pathological_text_is_an_error_not_a_panic() {
        let text = format!("{}x", " ".repeat(1_000_000));
        assert!(Encoding::Cl100kBase.encode(&text).is_err());
        let special = "<|endoftext|> is text here";
        assert_eq!(
            Encoding::Cl100kBase.encode(special).ok(),
            Encoding::Cl100kBase
                .bpe()
                .ok()
                .map(|b| b.encode_ordinary(special)),
            "special tokens are plain text, as before"
        );
    }

    #[test]
    fn o200k_differs_from_cl100k_on_non_english_text() {
        let text = "Ein mehrsprachiger Satz mit Umlauten: Größe, Übermaß, Äpfel.";
        let a = Encoding::Cl100kBase.encode(text).unwrap_or_default();
        let b = Encoding::O200kBase.encode(text).unwrap_or_default();
        assert!(!a.is_empty() && !b.is_empty());
        assert_ne!(a, b);
    }
}

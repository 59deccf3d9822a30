//! What a request puts into the engine's prompt, as the tokenizer sees it, and the reading of
//! the request fields that carry it.
//!
//! Each API's request model ([`crate::request::completions`], [`crate::request::responses`], [`crate::request::messages`],
//! [`crate::request::embeddings`]) reads its own fields and hands the rest to [`extra_texts`], which
//! keeps the text of every field not known to stay out of the prompt: a field weir does not
//! know, or one invented by a client, is counted rather than becoming a way around the estimate.
//! Fields are read as raw JSON text ([`RawObject`]), never as a tree: a few MB of small JSON
//! objects take many times their size as a tree, and a VM's memory never shrinks.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde_json::value::RawValue;

use crate::tokens::{ChatTurn, Encoding, TokenId, TokenizerUnavailable};

/// Top-level fields known to stay out of the prompt in every API, even when they hold strings.
pub const OUTSIDE_PROMPT: [&str; 13] = [
    "stop",
    "stop_token_ids",
    "bad_words",
    "allowed_token_ids",
    "logit_bias",
    "user",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "modalities",
    "request_id",
    "safety_identifier",
    "prompt_cache_key",
];

/// Everything a request puts into the engine's prompt.
#[derive(Clone, Debug)]
pub enum Prompt<'a> {
    /// A conversation the model's chat template renders; fields beside the messages (tools,
    /// schemas, ...) ride in the first turn, as templates render them into the system prompt.
    Chat(Vec<ChatTurn<'a>>),
    /// Sequences the engine runs each on its own: a completions prompt (or a batch of them),
    /// embedding inputs.
    Sequences(Vec<Sequence<'a>>),
}

/// One sequence of a [`Prompt::Sequences`]: pre-tokenized ids, if given, then texts.
#[derive(Clone, Debug, Default)]
pub struct Sequence<'a> {
    pub ids: &'a [TokenId],
    pub texts: Vec<Cow<'a, str>>,
}

impl<'a> Sequence<'a> {
    pub fn of_text(text: &'a str) -> Self {
        Sequence {
            ids: &[],
            texts: vec![Cow::Borrowed(text)],
        }
    }
}

impl Prompt<'_> {
    /// Every piece of text (roles and names included for chat).
    pub fn texts(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        match self {
            Prompt::Chat(turns) => Box::new(turns.iter().flat_map(|t| {
                std::iter::once(t.role)
                    .chain(t.name)
                    .chain(t.content.iter().map(|c| c.as_ref()))
            })),
            Prompt::Sequences(seqs) => {
                Box::new(seqs.iter().flat_map(|s| s.texts.iter().map(|c| c.as_ref())))
            }
        }
    }

    /// Token ids of each sequence as the engine would see it (a chat is one, framing included).
    pub fn encode(&self, encoding: Encoding) -> Result<Vec<Vec<TokenId>>, TokenizerUnavailable> {
        match self {
            Prompt::Chat(turns) => Ok(vec![encoding.encode_chat(turns.iter().cloned())?]),
            Prompt::Sequences(seqs) => seqs
                .iter()
                .map(|s| {
                    let mut out = s.ids.to_vec();
                    for text in &s.texts {
                        out.extend(encoding.encode(text)?);
                    }
                    Ok(out)
                })
                .collect(),
        }
    }
}

/// The text a JSON value brings into a prompt: a string as itself, a structure as its JSON
/// (how templates render tools and schemas), nothing for numbers, booleans and null.
pub fn rendered(raw: &RawValue) -> Option<String> {
    let text = raw.get();
    match text.as_bytes().first()? {
        b'"' => serde_json::from_str(text).ok(),
        b'[' | b'{' => Some(text.to_owned()),
        _ => None,
    }
}

/// A JSON object's fields, values left as raw JSON text (nothing is built from them).
pub type RawObject<'a> = BTreeMap<Cow<'a, str>, &'a RawValue>;

/// Its fields, if `raw` is an object. What is not is told by its first byte: a parse that
/// fails on a string would format the whole string into its error (a 1 MB prompt's content
/// cost the filter milliseconds so).
pub fn raw_object(raw: &RawValue) -> Option<RawObject<'_>> {
    let text = raw.get().trim_start();
    text.starts_with('{')
        .then(|| serde_json::from_str(text).ok())
        .flatten()
}

/// Its items, if `raw` is an array (see [`raw_object`]).
pub fn raw_array(raw: &RawValue) -> Option<Vec<&RawValue>> {
    let text = raw.get().trim_start();
    text.starts_with('[')
        .then(|| serde_json::from_str(text).ok())
        .flatten()
}

/// The rendered text of an object's fields other than those in `skip` (the fields the model
/// reads itself, and those known to stay out of the prompt).
pub fn extra_texts(object: &RawObject<'_>, skip: &[&[&str]]) -> Vec<String> {
    object
        .iter()
        .filter(|(k, _)| !skip.iter().any(|list| list.contains(&k.as_ref())))
        .filter_map(|(_, v)| rendered(v))
        .collect()
}

/// The texts as borrowed pieces.
pub fn borrowed(texts: &[String]) -> impl Iterator<Item = Cow<'_, str>> {
    texts.iter().map(|t| Cow::Borrowed(t.as_str()))
}

#[cfg(test)]
mod tests {
    use serde_json::value::RawValue;

    use super::{raw_array, raw_object};

    #[test]
    fn raw_arrays_and_objects_are_only_what_they_say() {
        let raw = |json: &str| RawValue::from_string(json.to_owned()).unwrap();
        assert_eq!(raw_array(&raw(r#"[1, "a"]"#)).map(|a| a.len()), Some(2));
        assert_eq!(raw_object(&raw(r#"{"a": 1}"#)).map(|o| o.len()), Some(1));
        for not_one in [r#""[not an array]""#, "null", "3", r#"{"a": 1}"#] {
            assert!(raw_array(&raw(not_one)).is_none(), "{not_one}");
        }
        for not_one in [r#""{not an object}""#, "[]", "true"] {
            assert!(raw_object(&raw(not_one)).is_none(), "{not_one}");
        }
    }
}

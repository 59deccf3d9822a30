//! OpenAI's Embeddings API: `input` is a string, an array of strings, a token array or an
//! array of token arrays; each input is a sequence of its own (its length, not the batch's,
//! meets the model's context). Nothing is generated.

use serde::Deserialize;

use crate::error::ApiError;
use crate::request::completions::MAX_BATCH;
use crate::request::fields::{COMMON_FIELDS, field};
use crate::request::prompt::{OUTSIDE_PROMPT, Prompt, RawObject, Sequence, borrowed, extra_texts};
use crate::tokens::TokenId;

#[derive(Clone, Debug, Default)]
pub struct EmbeddingsRequest {
    pub input: Option<EmbeddingInput>,
    pub extra: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Tokens(Vec<TokenId>),
    Texts(Vec<String>),
    TokenBatch(Vec<Vec<TokenId>>),
}

/// Fields read here, and those that stay out of the input.
const EMBEDDINGS_FIELDS: [&str; 7] = [
    "input",
    "encoding_format",
    "dimensions",
    "truncate_prompt_tokens",
    "normalize",
    "embed_dtype",
    "endianness",
];

impl EmbeddingsRequest {
    pub fn from_fields(top: &RawObject<'_>) -> Result<Self, ApiError> {
        Ok(EmbeddingsRequest {
            input: field(top, "input")?,
            extra: extra_texts(top, &[&COMMON_FIELDS, &EMBEDDINGS_FIELDS, &OUTSIDE_PROMPT]),
        })
    }

    fn inputs(&self) -> usize {
        match &self.input {
            None => 0,
            Some(EmbeddingInput::Tokens(ids)) if ids.is_empty() => 0,
            Some(EmbeddingInput::Text(_) | EmbeddingInput::Tokens(_)) => 1,
            Some(EmbeddingInput::Texts(t)) => t.len(),
            Some(EmbeddingInput::TokenBatch(b)) => b.len(),
        }
    }

    pub fn validate(&self) -> Result<(), ApiError> {
        match self.inputs() {
            0 => Err(
                ApiError::bad_request("input is required and must not be empty")
                    .with_param("input"),
            ),
            n if n > MAX_BATCH => Err(ApiError::bad_request(format!(
                "input may carry at most {MAX_BATCH} items"
            ))
            .with_param("input")),
            _ => Ok(()),
        }
    }

    /// Every input as its own sequence; any other text-bearing field is counted with each.
    pub fn prompt(&self) -> Prompt<'_> {
        let mut seqs: Vec<Sequence<'_>> = match &self.input {
            Some(EmbeddingInput::Text(t)) => vec![Sequence::of_text(t)],
            Some(EmbeddingInput::Texts(ts)) => ts.iter().map(|t| Sequence::of_text(t)).collect(),
            Some(EmbeddingInput::Tokens(ids)) => vec![Sequence {
                ids,
                texts: Vec::new(),
            }],
            Some(EmbeddingInput::TokenBatch(b)) => b
                .iter()
                .map(|ids| Sequence {
                    ids,
                    texts: Vec::new(),
                })
                .collect(),
            None => Vec::new(),
        };
        for seq in &mut seqs {
            seq.texts.extend(borrowed(&self.extra));
        }
        Prompt::Sequences(seqs)
    }
}

#[cfg(test)]
mod tests {
    use crate::endpoint::Endpoint;
    use crate::request::InferenceRequest;
    use crate::tokens::Encoding;

    fn sequences(body: &str) -> Option<Vec<Vec<u32>>> {
        let req = InferenceRequest::parse(Endpoint::Embeddings, body.as_bytes()).ok()?;
        req.validate().ok()?;
        req.prompt_tokens(Encoding::Cl100kBase).ok()
    }

    #[test]
    fn every_input_form_is_one_sequence_per_input() {
        assert_eq!(
            sequences(r#"{"model":"m","input":"hello world"}"#).map(|s| s.len()),
            Some(1)
        );
        let batch = sequences(
            r#"{"model":"m","input":["hello world","a","b c d"],"encoding_format":"float","dimensions":64}"#,
        );
        assert_eq!(
            batch.map(|s| s.iter().map(Vec::len).collect::<Vec<_>>()),
            Some(vec![2, 1, 3])
        );
        assert_eq!(
            sequences(r#"{"model":"m","input":[1,2,3]}"#),
            Some(vec![vec![1, 2, 3]])
        );
        assert_eq!(
            sequences(r#"{"model":"m","input":[[1,2],[3]]}"#),
            Some(vec![vec![1, 2], vec![3]])
        );
        assert_eq!(sequences(r#"{"model":"m","input":[]}"#), None);
        assert_eq!(sequences(r#"{"model":"m"}"#), None);
        assert_eq!(sequences(r#"{"model":"m","input":{"text":"x"}}"#), None);
    }
}

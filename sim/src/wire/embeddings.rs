//! The Embeddings API (`POST /v1/embeddings`) in vLLM's shape: one vector per input, a unit
//! vector drawn deterministically from a hash of the input's tokens, `dimensions` long
//! ([`DEFAULT_DIMENSIONS`] unless asked), as JSON floats or, with `"encoding_format":
//! "base64"`, as the base64 of its little-endian `f32`s. Usage counts the prompt tokens only.

use std::hash::{DefaultHasher, Hash, Hasher};

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use weir_core::error::ApiError;
use weir_core::tokens::TokenId;

use super::{Outcome, Params, Reply};

/// Vector length when the request does not set `dimensions`.
pub const DEFAULT_DIMENSIONS: u32 = 64;

/// Longest vector served.
pub const MAX_DIMENSIONS: u32 = 4096;

/// How the request wants its vectors, and the seed of each input's vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Format {
    pub dimensions: u32,
    pub base64: bool,
    /// One per input: a hash of its tokens.
    pub seeds: Vec<u64>,
}

#[derive(Deserialize)]
struct Fields {
    #[serde(default)]
    dimensions: Option<u32>,
    #[serde(default)]
    encoding_format: Option<String>,
}

impl Format {
    /// Reads `dimensions` and `encoding_format`, seeding each input's vector from its tokens.
    pub fn of_request(body: &[u8], inputs: &[Vec<TokenId>]) -> Result<Self, ApiError> {
        let fields: Fields = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))?;
        let dimensions = fields.dimensions.unwrap_or(DEFAULT_DIMENSIONS);
        if !(1..=MAX_DIMENSIONS).contains(&dimensions) {
            return Err(ApiError::bad_request(format!(
                "dimensions must be between 1 and {MAX_DIMENSIONS}"
            ))
            .with_param("dimensions"));
        }
        let base64 = match fields.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "encoding_format '{other}' is not one of 'float', 'base64'"
                ))
                .with_param("encoding_format"));
            }
        };
        let seeds = inputs
            .iter()
            .map(|tokens| {
                let mut h = DefaultHasher::new();
                tokens.hash(&mut h);
                h.finish()
            })
            .collect();
        Ok(Format {
            dimensions,
            base64,
            seeds,
        })
    }
}

/// The unit vector of `dimensions` components drawn from `seed`.
pub fn vector(seed: u64, dimensions: u32) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut v: Vec<f32> = (0..dimensions)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64, padded.
pub fn base64(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(BASE64[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[derive(Serialize)]
#[serde(untagged)]
enum Embedding {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct Datum {
    index: usize,
    object: &'static str,
    embedding: Embedding,
}

#[derive(Serialize)]
struct UsageBody {
    prompt_tokens: u64,
    total_tokens: u64,
    completion_tokens: u32,
    prompt_tokens_details: (),
}

#[derive(Serialize)]
struct List<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    data: Vec<Datum>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageBody>,
}

/// The whole answer: one vector per input, in input order.
pub fn body(reply: &Reply, outcome: &Outcome) -> String {
    let (dimensions, base64_wanted, seeds) = match &reply.params {
        Params::Embeddings(f) => (f.dimensions, f.base64, f.seeds.as_slice()),
        _ => (DEFAULT_DIMENSIONS, false, &[][..]),
    };
    let data = seeds
        .iter()
        .enumerate()
        .map(|(index, &seed)| {
            let v = vector(seed, dimensions);
            let embedding = if base64_wanted {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Embedding::Base64(base64(&bytes))
            } else {
                Embedding::Float(v)
            };
            Datum {
                index,
                object: "embedding",
                embedding,
            }
        })
        .collect();
    let prompt_tokens = outcome.done.usage.prompt_tokens;
    let list = List {
        id: &reply.head.id,
        object: "list",
        created: reply.head.created,
        model: &reply.head.model,
        data,
        usage: reply.usage.map(|_| UsageBody {
            prompt_tokens,
            total_tokens: prompt_tokens,
            completion_tokens: 0,
            prompt_tokens_details: (),
        }),
    };
    // Plain structs of strings and numbers always serialize.
    serde_json::to_string(&list).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_vectors() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded);
        }
        assert_eq!(base64(&1.0f32.to_le_bytes()), "AACAPw==");
    }

    #[test]
    fn vectors_are_unit_length_and_follow_their_seed() {
        let v = vector(7, 64);
        assert_eq!(v.len(), 64);
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        assert_eq!(v, vector(7, 64));
        assert_ne!(v, vector(8, 64));
    }

    #[test]
    fn format_reads_dimensions_and_encoding() {
        let inputs = [vec![1, 2], vec![3]];
        let f = Format::of_request(br#"{"dimensions":8,"encoding_format":"base64"}"#, &inputs);
        let f = f.unwrap();
        assert_eq!((f.dimensions, f.base64, f.seeds.len()), (8, true, 2));
        assert_ne!(f.seeds[0], f.seeds[1]);
        let default = Format::of_request(b"{}", &inputs).unwrap();
        assert_eq!(
            (default.dimensions, default.base64),
            (DEFAULT_DIMENSIONS, false)
        );
        assert!(Format::of_request(br#"{"dimensions":0}"#, &inputs).is_err());
        assert!(Format::of_request(br#"{"encoding_format":"int8"}"#, &inputs).is_err());
    }
}

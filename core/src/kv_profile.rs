//! KV-cache arithmetic: how many bytes one token of context holds, and how many tokens fit.
//!
//! The sidecar admits work against these numbers and the simulator sizes its paged cache with
//! them, so both agree on what "fits" means.

use serde::{Deserialize, Serialize};

/// Tokens per paged KV block (vLLM's default block size).
pub const BLOCK_TOKENS: u64 = 16;

/// How a model stores keys and values per layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Attention {
    /// Dense multi-head or grouped-query attention: a K and a V vector per KV head.
    Gqa { kv_heads: u64, head_dim: u64 },
    /// Multi-head latent attention: one compressed latent plus the decoupled RoPE key.
    Mla { kv_lora_rank: u64, rope_dim: u64 },
}

/// The part of a model's shape that decides its KV footprint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvShape {
    pub layers: u64,
    pub attention: Attention,
    /// Bytes per stored element (2 for BF16/FP16, 1 for FP8).
    pub kv_dtype_bytes: u64,
}

impl KvShape {
    /// Bytes of KV cache one token of context occupies across all layers.
    pub fn bytes_per_token(&self) -> u64 {
        let per_layer = match self.attention {
            Attention::Gqa { kv_heads, head_dim } => 2 * kv_heads * head_dim,
            Attention::Mla {
                kv_lora_rank,
                rope_dim,
            } => kv_lora_rank + rope_dim,
        };
        per_layer * self.kv_dtype_bytes * self.layers
    }

    /// Whole blocks that fit in `kv_bytes` of memory.
    pub fn blocks_in(&self, kv_bytes: u64) -> u64 {
        let block_bytes = BLOCK_TOKENS * self.bytes_per_token();
        kv_bytes.checked_div(block_bytes).unwrap_or(0)
    }
}

/// Blocks needed to hold `tokens` tokens of context.
pub fn blocks_for(tokens: u64) -> u64 {
    tokens.div_ceil(BLOCK_TOKENS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_8b() -> KvShape {
        KvShape {
            layers: 32,
            attention: Attention::Gqa {
                kv_heads: 8,
                head_dim: 128,
            },
            kv_dtype_bytes: 2,
        }
    }

    #[test]
    fn gqa_matches_seed_002_arithmetic() {
        // Seed 002: 2 x 32 layers x 8 heads x 128 x 2 bytes = 131,072 bytes = 128 KiB.
        assert_eq!(llama_8b().bytes_per_token(), 131_072);
        // 50 GB of KV / 128 KiB is about 381,000 tokens.
        let tokens = llama_8b().blocks_in(50_000_000_000) * BLOCK_TOKENS;
        assert!((381_000..381_500).contains(&tokens), "{tokens}");
    }

    #[test]
    fn mla_matches_seed_000_arithmetic() {
        // Seed 000: (512 + 64) x 2 bytes x 78 layers = 89,856 bytes.
        let glm = KvShape {
            layers: 78,
            attention: Attention::Mla {
                kv_lora_rank: 512,
                rope_dim: 64,
            },
            kv_dtype_bytes: 2,
        };
        assert_eq!(glm.bytes_per_token(), 89_856);
    }

    #[test]
    fn blocks_round_up() {
        assert_eq!(blocks_for(0), 0);
        assert_eq!(blocks_for(1), 1);
        assert_eq!(blocks_for(16), 1);
        assert_eq!(blocks_for(17), 2);
    }

    #[test]
    fn zero_sized_shape_fits_nothing() {
        let empty = KvShape {
            layers: 0,
            ..llama_8b()
        };
        assert_eq!(empty.blocks_in(1 << 30), 0);
    }
}

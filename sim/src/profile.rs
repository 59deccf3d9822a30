//! Model × GPU profiles: what the simulated engine serves and how fast its hardware runs it.
//!
//! A profile fixes the KV capacity (HBM × utilization − weights, in 16-token blocks) and the
//! roofline step time: prefill is compute-bound (2 · active params FLOPs per token), decode is
//! bandwidth-bound (active weights plus the KV read for every running sequence per step).

use std::path::Path;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use weir_core::kv_profile::{Attention, BLOCK_TOKENS, KvShape};
use weir_core::tokens::Encoding;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub model: ModelSpec,
    pub gpu: GpuSpec,
    #[serde(default)]
    pub engine: EngineSpec,
    #[serde(default)]
    pub output: OutputLength,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// The name served on the API (`model` in requests, `model_name` in metrics).
    pub name: String,
    /// Parameters held in memory.
    pub total_params: f64,
    /// Parameters touched per token (smaller than the total for mixture-of-experts models).
    pub active_params: f64,
    /// 2 for BF16 weights, 1 for FP8.
    pub weight_bytes_per_param: f64,
    pub kv: KvShape,
    pub max_model_len: u64,
    #[serde(default)]
    pub tokenizer: Encoding,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    pub name: String,
    /// GPUs the model is sharded over (tensor parallel); memory, bandwidth and FLOPs add up.
    pub count: u32,
    pub hbm_gb: f64,
    pub hbm_tb_per_s: f64,
    pub bf16_tflops: f64,
    /// Fraction of peak FLOPs reached in prefill.
    #[serde(default = "default_compute_efficiency")]
    pub compute_efficiency: f64,
    /// Fraction of peak bandwidth reached in decode.
    #[serde(default = "default_bandwidth_efficiency")]
    pub bandwidth_efficiency: f64,
}

fn default_compute_efficiency() -> f64 {
    0.6
}

fn default_bandwidth_efficiency() -> f64 {
    0.8
}

/// The serving engine's knobs, named after vLLM's flags.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineSpec {
    pub gpu_memory_utilization: f64,
    pub max_num_seqs: usize,
    /// Per-step token budget (prefill chunks plus one token per decoding sequence).
    pub max_num_batched_tokens: u64,
    pub enable_chunked_prefill: bool,
    pub enable_prefix_caching: bool,
    /// Fixed CPU-side cost of one step (scheduling, kernel launches).
    pub step_overhead_ms: f64,
}

impl Default for EngineSpec {
    fn default() -> Self {
        EngineSpec {
            gpu_memory_utilization: 0.9,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            step_overhead_ms: 0.5,
        }
    }
}

/// How many tokens a request generates before its natural end (capped by `max_tokens`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "distribution", rename_all = "snake_case")]
pub enum OutputLength {
    Fixed { tokens: u32 },
    Uniform { min: u32, max: u32 },
    Exponential { mean: f64 },
    LogNormal { median: f64, sigma: f64 },
}

impl Default for OutputLength {
    fn default() -> Self {
        OutputLength::LogNormal {
            median: 256.0,
            sigma: 0.8,
        }
    }
}

/// The work of one engine step, as the roofline needs it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepLoad {
    /// Tokens pushed through the model this step (prefill chunks plus decode tokens).
    pub tokens: u64,
    /// Context tokens whose KV is read by attention this step, summed over sequences.
    pub kv_tokens_read: u64,
}

impl Profile {
    pub const PRESETS: [&'static str; 4] = ["llama-3.1-8b", "llama-3.1-70b", "glm-5.2", "tiny"];

    pub fn preset(name: &str) -> anyhow::Result<Profile> {
        let h100 = |count| GpuSpec {
            name: "H100-SXM-80GB".into(),
            count,
            hbm_gb: 80.0,
            hbm_tb_per_s: 3.35,
            bf16_tflops: 989.0,
            compute_efficiency: default_compute_efficiency(),
            bandwidth_efficiency: default_bandwidth_efficiency(),
        };
        let gqa = |layers, kv_heads| KvShape {
            layers,
            attention: Attention::Gqa {
                kv_heads,
                head_dim: 128,
            },
            kv_dtype_bytes: 2,
        };
        let profile = match name {
            // Seed 002's capacity example: 16 GB of weights, 50 GB left for KV on one 80 GB GPU.
            "llama-3.1-8b" => Profile {
                model: ModelSpec {
                    name: "llama-3.1-8b".into(),
                    total_params: 8e9,
                    active_params: 8e9,
                    weight_bytes_per_param: 2.0,
                    kv: gqa(32, 8),
                    max_model_len: 131_072,
                    tokenizer: Encoding::Cl100kBase,
                },
                gpu: h100(1),
                engine: EngineSpec {
                    gpu_memory_utilization: 0.825,
                    ..EngineSpec::default()
                },
                output: OutputLength::default(),
            },
            // Seed 000's dense/GQA anchor: 80 layers, 8 KV heads, 320 KiB per token, on 4 GPUs.
            "llama-3.1-70b" => Profile {
                model: ModelSpec {
                    name: "llama-3.1-70b".into(),
                    total_params: 70e9,
                    active_params: 70e9,
                    weight_bytes_per_param: 2.0,
                    kv: gqa(80, 8),
                    max_model_len: 131_072,
                    tokenizer: Encoding::Cl100kBase,
                },
                gpu: h100(4),
                engine: EngineSpec::default(),
                output: OutputLength::default(),
            },
            // Seed 000's MLA example (78 layers, kv_lora_rank 512 + rope 64): an MoE with FP8
            // weights on 8 H200s. The parameter counts are assumptions that fix its shape.
            "glm-5.2" => Profile {
                model: ModelSpec {
                    name: "glm-5.2".into(),
                    total_params: 744e9,
                    active_params: 40e9,
                    weight_bytes_per_param: 1.0,
                    kv: KvShape {
                        layers: 78,
                        attention: Attention::Mla {
                            kv_lora_rank: 512,
                            rope_dim: 64,
                        },
                        kv_dtype_bytes: 2,
                    },
                    max_model_len: 1_048_576,
                    tokenizer: Encoding::O200kBase,
                },
                gpu: GpuSpec {
                    name: "H200-141GB".into(),
                    count: 8,
                    hbm_gb: 141.0,
                    hbm_tb_per_s: 4.8,
                    bf16_tflops: 989.0,
                    compute_efficiency: default_compute_efficiency(),
                    bandwidth_efficiency: default_bandwidth_efficiency(),
                },
                engine: EngineSpec::default(),
                output: OutputLength::default(),
            },
            // Small and slow enough that tests can fill its ~9.7k-token KV cache in a blink.
            "tiny" => Profile {
                model: ModelSpec {
                    name: "tiny".into(),
                    total_params: 20e6,
                    active_params: 20e6,
                    weight_bytes_per_param: 2.0,
                    kv: KvShape {
                        layers: 4,
                        attention: Attention::Gqa {
                            kv_heads: 2,
                            head_dim: 64,
                        },
                        kv_dtype_bytes: 2,
                    },
                    max_model_len: 4096,
                    tokenizer: Encoding::Cl100kBase,
                },
                gpu: GpuSpec {
                    name: "toy".into(),
                    count: 1,
                    hbm_gb: 0.1,
                    hbm_tb_per_s: 0.005,
                    bf16_tflops: 1.4,
                    compute_efficiency: default_compute_efficiency(),
                    bandwidth_efficiency: default_bandwidth_efficiency(),
                },
                engine: EngineSpec {
                    gpu_memory_utilization: 0.6,
                    max_num_seqs: 64,
                    max_num_batched_tokens: 512,
                    ..EngineSpec::default()
                },
                output: OutputLength::LogNormal {
                    median: 64.0,
                    sigma: 0.6,
                },
            },
            other => bail!(
                "unknown preset '{other}'; choose one of {}",
                Self::PRESETS.join(", ")
            ),
        };
        Ok(profile)
    }

    /// Loads a profile from JSON or YAML (chosen by the file extension).
    pub fn from_file(path: &Path) -> anyhow::Result<Profile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading profile {}", path.display()))?;
        let profile: Profile = match path.extension().and_then(|e| e.to_str()) {
            Some("json") => serde_json::from_str(&text)
                .with_context(|| format!("parsing JSON profile {}", path.display()))?,
            Some("yaml" | "yml") => serde_yaml_ng::from_str(&text)
                .with_context(|| format!("parsing YAML profile {}", path.display()))?,
            _ => bail!(
                "profile {} must end in .json, .yaml or .yml",
                path.display()
            ),
        };
        profile.validate()?;
        Ok(profile)
    }

    /// Rejects profiles that cannot serve a single full-length request.
    pub fn validate(&self) -> anyhow::Result<()> {
        let e = &self.engine;
        if !(0.0..=1.0).contains(&e.gpu_memory_utilization) || e.gpu_memory_utilization == 0.0 {
            bail!("engine.gpu_memory_utilization must be in (0, 1]");
        }
        if e.max_num_seqs == 0 || e.max_num_batched_tokens == 0 {
            bail!("engine.max_num_seqs and engine.max_num_batched_tokens must be positive");
        }
        let g = &self.gpu;
        if g.count == 0 || g.hbm_tb_per_s <= 0.0 || g.bf16_tflops <= 0.0 {
            bail!("gpu.count, gpu.hbm_tb_per_s and gpu.bf16_tflops must be positive");
        }
        if self.kv_blocks() == 0 {
            bail!(
                "no room for KV cache: {:.1} GB of weights exceed {:.0}% of {:.1} GB HBM",
                self.weight_bytes() / 1e9,
                e.gpu_memory_utilization * 100.0,
                self.hbm_bytes() / 1e9
            );
        }
        Ok(())
    }

    fn hbm_bytes(&self) -> f64 {
        self.gpu.hbm_gb * 1e9 * f64::from(self.gpu.count)
    }

    fn weight_bytes(&self) -> f64 {
        self.model.total_params * self.model.weight_bytes_per_param
    }

    /// Paged KV capacity in blocks: (HBM × utilization − weights) / (16 × KV bytes per token).
    pub fn kv_blocks(&self) -> u64 {
        let free = self.hbm_bytes() * self.engine.gpu_memory_utilization - self.weight_bytes();
        if free <= 0.0 {
            return 0;
        }
        self.model.kv.blocks_in(free as u64)
    }

    pub fn kv_capacity_tokens(&self) -> u64 {
        self.kv_blocks() * BLOCK_TOKENS
    }

    /// Model time of one engine step: the slower of compute and memory traffic, plus overhead.
    pub fn step_seconds(&self, load: StepLoad) -> f64 {
        let gpus = f64::from(self.gpu.count);
        let flops = 2.0 * self.model.active_params * load.tokens as f64;
        let compute = flops / (self.gpu.bf16_tflops * 1e12 * gpus * self.gpu.compute_efficiency);
        let bytes = self.model.active_params * self.model.weight_bytes_per_param
            + load.kv_tokens_read as f64 * self.model.kv.bytes_per_token() as f64;
        let memory = bytes / (self.gpu.hbm_tb_per_s * 1e12 * gpus * self.gpu.bandwidth_efficiency);
        compute.max(memory) + self.engine.step_overhead_ms / 1e3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid() {
        for name in Profile::PRESETS {
            let p = Profile::preset(name);
            assert!(
                p.as_ref().is_ok_and(|p| p.validate().is_ok()),
                "{name}: {p:?}"
            );
        }
        assert!(Profile::preset("nope").is_err());
    }

    #[test]
    fn llama_8b_has_seed_002_kv_budget() {
        let tokens = Profile::preset("llama-3.1-8b")
            .unwrap()
            .kv_capacity_tokens();
        // 50e9 / 131,072 = 381,470 tokens; whole 16-token blocks hold 381,456.
        assert!((381_000..=381_470).contains(&tokens), "{tokens}");
    }

    #[test]
    fn decode_is_bandwidth_bound_and_prefill_compute_bound() {
        let p = Profile::preset("llama-3.1-8b").unwrap();
        let one = p.step_seconds(StepLoad {
            tokens: 1,
            kv_tokens_read: 1000,
        });
        // 16 GB of weights at 0.8 × 3.35 TB/s is about 6 ms.
        assert!((0.005..0.008).contains(&one), "{one}");
        let chunk = p.step_seconds(StepLoad {
            tokens: 2048,
            kv_tokens_read: 2048,
        });
        let double = p.step_seconds(StepLoad {
            tokens: 4096,
            kv_tokens_read: 4096,
        });
        assert!(chunk > 5.0 * one, "prefill chunk {chunk} vs decode {one}");
        // Compute-bound: twice the tokens takes about twice the time.
        assert!((1.8..2.1).contains(&(double / chunk)), "{}", double / chunk);
    }

    #[test]
    fn weights_larger_than_memory_are_rejected() {
        let mut p = Profile::preset("llama-3.1-70b").unwrap();
        p.gpu.count = 1;
        let err = p.validate().unwrap_err().to_string();
        assert!(err.contains("no room for KV cache"), "{err}");
    }

    #[test]
    fn profiles_round_trip_through_yaml_and_json() {
        for name in Profile::PRESETS {
            let p = Profile::preset(name).unwrap();
            let yaml = serde_yaml_ng::to_string(&p).unwrap();
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(serde_yaml_ng::from_str::<Profile>(&yaml).unwrap(), p);
            assert_eq!(serde_json::from_str::<Profile>(&json).unwrap(), p);
        }
    }
}

//! The engine's physics, checked in model time on the pure state machine (no wall clock):
//! seed 002's KV budget and concurrency collapse, prefill/decode interference, batch-size ITL,
//! chunked prefill, preemption and prefix caching.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use weir_sim::engine::{Engine, SeqId, SeqSpec, StepReport};
use weir_sim::kv_cache::block_hashes;
use weir_sim::profile::Profile;

fn llama_8b() -> Profile {
    Profile::preset("llama-3.1-8b").unwrap()
}

/// A prompt of `len` tokens unique to `id`, so no two requests share cached blocks.
fn spec(id: SeqId, len: u32, output_len: u32) -> SeqSpec {
    let tokens: Vec<u32> = (0..len).map(|t| t ^ (id as u32) << 20).collect();
    SeqSpec {
        id,
        prompt_len: u64::from(len),
        block_hashes: block_hashes(None, &tokens),
        output_len,
    }
}

/// Steps until idle, calling `observe` after every step.
fn run(engine: &mut Engine, mut observe: impl FnMut(&Engine, &StepReport)) {
    while let Some(report) = engine.step() {
        observe(engine, &report);
    }
    assert!(engine.is_idle(), "engine stalled with work left");
}

#[derive(Default)]
struct Latencies {
    ttft: Vec<(SeqId, f64)>,
    /// Per sequence, every gap between consecutive tokens.
    gaps: std::collections::HashMap<SeqId, Vec<f64>>,
    last: std::collections::HashMap<SeqId, f64>,
}

impl Latencies {
    fn record(&mut self, report: &StepReport, arrival: f64) {
        for &(id, index) in &report.tokens {
            if index == 0 {
                self.ttft.push((id, report.end - arrival));
            } else if let Some(prev) = self.last.get(&id) {
                self.gaps.entry(id).or_default().push(report.end - prev);
            }
            self.last.insert(id, report.end);
        }
    }

    fn ttft_of(&self, id: SeqId) -> f64 {
        self.ttft.iter().find(|(s, _)| *s == id).unwrap().1
    }

    fn mean_gap(&self) -> f64 {
        let all: Vec<f64> = self.gaps.values().flatten().copied().collect();
        all.iter().sum::<f64>() / all.len() as f64
    }
}

#[test]
fn kv_budget_matches_seed_002() {
    let tokens = llama_8b().kv_capacity_tokens();
    let seed = 50e9 / 131_072.0; // about 381,000 tokens
    assert!(
        (tokens as f64 / seed - 1.0).abs() < 0.05,
        "{tokens} vs {seed}"
    );
}

#[test]
fn concurrency_collapses_as_context_grows() {
    // Seed 002: 381k tokens of KV hold 95 / 47 / 23 / 11 / 2 sequences at these contexts.
    for (context, seed_says) in [
        (4_000u32, 95usize),
        (8_000, 47),
        (16_000, 23),
        (32_000, 11),
        (128_000, 2),
    ] {
        // Whole-prompt prefill admits every prompt that fits in one step, so the count is set by
        // KV blocks alone rather than by how fast prefill chunks arrive.
        let mut profile = llama_8b();
        profile.engine.enable_chunked_prefill = false;
        let mut engine = Engine::new(profile);
        let output = 16;
        for id in 0..(seed_says as u64 + 4) {
            engine.submit(spec(id, context - output, output)).unwrap();
        }
        let mut peak = 0;
        run(&mut engine, |e, _| peak = peak.max(e.num_decoding()));
        let err = (peak as f64 - seed_says as f64).abs() / seed_says as f64;
        assert!(
            err <= 0.05,
            "context {context}: {peak} decoding at once, seed says {seed_says}"
        );
    }
}

#[test]
fn short_request_ttft_rises_while_long_prompts_prefill() {
    let ttft_of_short = |with_long_prompts: bool| {
        let mut engine = Engine::new(llama_8b());
        if with_long_prompts {
            for id in 1..=3 {
                engine.submit(spec(id, 32_000, 8)).unwrap();
            }
        }
        engine.submit(spec(100, 300, 8)).unwrap();
        let mut lat = Latencies::default();
        run(&mut engine, |_, r| lat.record(r, 0.0));
        lat.ttft_of(100)
    };
    let alone = ttft_of_short(false);
    let contended = ttft_of_short(true);
    assert!(
        contended > 10.0 * alone,
        "short TTFT alone {alone:.4}s vs behind 3 x 32k prompts {contended:.4}s"
    );
}

#[test]
fn inter_token_latency_rises_with_batch_size() {
    let mean_itl = |batch: u64| {
        let mut engine = Engine::new(llama_8b());
        for id in 0..batch {
            engine.submit(spec(id, 2_000, 64)).unwrap();
        }
        let mut lat = Latencies::default();
        run(&mut engine, |_, r| lat.record(r, 0.0));
        lat.mean_gap()
    };
    let itls: Vec<f64> = [1, 16, 64, 128].into_iter().map(mean_itl).collect();
    assert!(
        itls.windows(2).all(|w| w[1] > w[0]),
        "ITL must grow with batch size: {itls:?}"
    );
    assert!(itls[3] > 1.5 * itls[0], "{itls:?}");
}

#[test]
fn chunked_prefill_protects_running_streams() {
    // Eight streams are decoding when a 32k-token prompt arrives; measure their worst gap.
    let worst_gap = |chunked: bool| {
        let mut profile = llama_8b();
        profile.engine.enable_chunked_prefill = chunked;
        let mut engine = Engine::new(profile);
        for id in 0..8 {
            engine.submit(spec(id, 500, 400)).unwrap();
        }
        let mut lat = Latencies::default();
        // Let the streams get going before the long prompt lands.
        for _ in 0..20 {
            let r = engine.step().unwrap();
            lat.record(&r, 0.0);
        }
        engine.submit(spec(99, 32_000, 4)).unwrap();
        run(&mut engine, |_, r| lat.record(r, 0.0));
        (0..8)
            .flat_map(|id| lat.gaps[&id].iter().copied())
            .fold(0.0, f64::max)
    };
    let chunked = worst_gap(true);
    let whole = worst_gap(false);
    assert!(
        whole > 5.0 * chunked,
        "worst ITL with chunking {chunked:.4}s vs without {whole:.4}s"
    );
}

#[test]
fn oversubscribed_kv_preempts_and_still_completes_everything() {
    let mut engine = Engine::new(Profile::preset("tiny").unwrap());
    let capacity = engine.profile().kv_capacity_tokens();
    // 24 sequences that each grow to 1,000 tokens: well over the ~9.7k-token cache.
    for id in 0..24 {
        engine.submit(spec(id, 200, 800)).unwrap();
    }
    assert!(24 * 1_000 > 2 * capacity);
    let (mut preemptions, mut completed) = (0, 0);
    run(&mut engine, |_, r| {
        preemptions += r.preemptions;
        for f in &r.finished {
            assert_eq!(f.usage.completion_tokens, 800);
            completed += 1;
        }
    });
    assert!(preemptions > 0);
    assert_eq!(completed, 24);
}

#[test]
fn abort_frees_blocks_before_the_next_step() {
    let mut engine = Engine::new(Profile::preset("tiny").unwrap());
    engine.submit(spec(1, 1_000, 500)).unwrap();
    for _ in 0..5 {
        engine.step();
    }
    assert!(engine.kv_usage() > 0.0);
    assert!(engine.abort(1));
    assert_eq!(engine.kv_usage(), 0.0);
    assert!(engine.step().is_none());
    assert!(!engine.abort(1), "a second abort finds nothing");
}

#[test]
fn prefix_cache_hits_need_the_same_salt() {
    let mut engine = Engine::new(llama_8b());
    let tokens: Vec<u32> = (0..1_000).collect();
    let with_salt = |id, salt: &str| SeqSpec {
        id,
        prompt_len: tokens.len() as u64,
        block_hashes: block_hashes(Some(salt), &tokens),
        output_len: 4,
    };
    let mut cached = std::collections::HashMap::new();
    for (id, salt) in [(1, "tenant-a"), (2, "tenant-a"), (3, "tenant-b")] {
        engine.submit(with_salt(id, salt)).unwrap();
        run(&mut engine, |_, r| {
            for f in &r.finished {
                cached.insert(f.id, f.usage.cached_tokens);
            }
        });
    }
    assert_eq!(cached[&1], 0);
    assert_eq!(cached[&2], 992, "all 62 full blocks are reused");
    assert_eq!(cached[&3], 0, "another salt never hits");
}

#[test]
fn oversized_requests_are_refused_at_submission() {
    let mut engine = Engine::new(Profile::preset("tiny").unwrap());
    let capacity = engine.profile().kv_capacity_tokens() as u32;
    assert!(engine.submit(spec(1, capacity, 16)).is_err());
    assert!(engine.submit(spec(2, 0, 1)).is_err(), "an empty prompt");
    assert!(engine.submit(spec(3, 10, 1)).is_ok());
    assert!(engine.submit(spec(3, 10, 1)).is_err(), "duplicate id");
}

#[test]
fn prompt_only_sequences_prefill_hold_kv_and_finish_without_tokens() {
    let mut profile = llama_8b();
    profile.engine.max_num_batched_tokens = 512;
    let mut engine = Engine::new(profile);
    // An embedding of 2,000 tokens: four prefill chunks, then done, with no token produced.
    engine.submit(spec(1, 2000, 0)).unwrap();
    let (mut steps, mut tokens, mut peak_kv, mut finished) = (0, 0, 0.0f64, Vec::new());
    run(&mut engine, |e, r| {
        steps += 1;
        tokens += r.tokens.len();
        peak_kv = peak_kv.max(e.kv_usage());
        finished.extend(r.finished.iter().cloned());
    });
    assert_eq!((steps, tokens), (4, 0));
    assert!(peak_kv > 0.0, "the prompt held KV blocks while it ran");
    assert_eq!(engine.kv_usage(), 0.0, "and freed them at the end");
    let done = &finished[0];
    assert_eq!(done.usage.prompt_tokens, 2000);
    assert_eq!(done.usage.completion_tokens, 0);
    assert!(done.e2e_seconds > 0.0);
}

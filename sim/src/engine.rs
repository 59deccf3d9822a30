//! The engine: continuous batching at iteration level over a paged KV cache.
//!
//! Each [`Engine::step`] builds one batch the way vLLM's scheduler does: every running sequence
//! gets its next token (or its next prefill chunk) first, then waiting sequences are admitted
//! in arrival order while the per-step token budget and free KV blocks last. When a running
//! sequence needs a block and none is free, the newest running sequence is preempted: its blocks
//! are freed and it is recomputed later. The step's duration comes from the profile's roofline.
//! Time is model time, advanced by the steps themselves; the caller maps it to the wall clock.

use std::collections::{HashMap, VecDeque};

use weir_core::kv_profile::{BLOCK_TOKENS, blocks_for};

use crate::kv_cache::{BlockHash, BlockId, BlockPool};
use crate::profile::{Profile, StepLoad};

pub type SeqId = u64;

/// A request as the engine sees it: token counts and prefix hashes, no text.
#[derive(Clone, Debug)]
pub struct SeqSpec {
    pub id: SeqId,
    pub prompt_len: u64,
    /// Chained hashes of the prompt's full blocks (see [`crate::kv_cache::block_hashes`]).
    pub block_hashes: Vec<BlockHash>,
    /// Tokens to generate before the sequence ends; 0 runs the prompt only (an embedding) and
    /// finishes when its prefill does.
    pub output_len: u32,
}

/// Token counts as the API reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u32,
    pub cached_tokens: u64,
}

/// A sequence that generated all its tokens, with its latencies in model seconds.
#[derive(Clone, Debug)]
pub struct Finished {
    pub id: SeqId,
    pub usage: Usage,
    pub queue_seconds: f64,
    pub ttft_seconds: f64,
    pub e2e_seconds: f64,
    pub preemptions: u32,
}

/// What one step did.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// Model time at the end of the step, when its tokens become visible.
    pub end: f64,
    pub duration: f64,
    /// Tokens computed this step (prefill chunks plus decode tokens).
    pub batched_tokens: u64,
    /// Sequences in the batch.
    pub batched_sequences: usize,
    /// Sequences scheduled for the first time this step (the engine has started them), with the
    /// prompt tokens they found in the prefix cache.
    pub started: Vec<(SeqId, u64)>,
    /// `(sequence, index of the token it just produced)`.
    pub tokens: Vec<(SeqId, u32)>,
    pub finished: Vec<Finished>,
    pub preemptions: u32,
    /// Prompt tokens looked up in and served from the prefix cache at admission.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

#[derive(Debug)]
struct Seq {
    spec: SeqSpec,
    arrival: f64,
    blocks: Vec<BlockId>,
    /// Tokens whose KV has been computed.
    computed: u64,
    /// Leading blocks already published to the prefix cache.
    published: usize,
    generated: u32,
    cached_tokens: Option<u64>,
    first_scheduled: Option<f64>,
    first_token: Option<f64>,
    preemptions: u32,
}

impl Seq {
    /// Tokens whose KV the next output token depends on: the prompt plus what was generated.
    fn known(&self) -> u64 {
        self.spec.prompt_len + u64::from(self.generated)
    }
}

/// Why a sequence was refused at submission.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("sequence {0} is already in the engine")]
    Duplicate(SeqId),
    #[error("{needed} tokens of context can never fit in a KV cache of {capacity} tokens")]
    TooLarge { needed: u64, capacity: u64 },
    #[error("a sequence must have at least one prompt token")]
    EmptyPrompt,
}

pub struct Engine {
    profile: Profile,
    pool: BlockPool,
    seqs: HashMap<SeqId, Seq>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    now: f64,
}

impl Engine {
    pub fn new(profile: Profile) -> Self {
        let pool = BlockPool::new(
            profile.kv_blocks() as usize,
            profile.engine.enable_prefix_caching,
        );
        Engine {
            profile,
            pool,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            now: 0.0,
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    pub fn now(&self) -> f64 {
        self.now
    }

    /// Moves the clock forward over idle time; never backwards.
    pub fn advance_to(&mut self, t: f64) {
        self.now = self.now.max(t);
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Running sequences whose prompt is fully computed (they are producing tokens).
    pub fn num_decoding(&self) -> usize {
        self.running
            .iter()
            .filter(|id| self.seqs.get(id).is_some_and(|s| s.generated > 0))
            .count()
    }

    pub fn submit(&mut self, spec: SeqSpec) -> Result<(), SubmitError> {
        if self.seqs.contains_key(&spec.id) {
            return Err(SubmitError::Duplicate(spec.id));
        }
        if spec.prompt_len == 0 {
            return Err(SubmitError::EmptyPrompt);
        }
        let needed = spec.prompt_len + u64::from(spec.output_len);
        let capacity = self.profile.kv_capacity_tokens();
        if blocks_for(needed) > self.pool.total() as u64 {
            return Err(SubmitError::TooLarge { needed, capacity });
        }
        let id = spec.id;
        self.seqs.insert(
            id,
            Seq {
                spec,
                arrival: self.now,
                blocks: Vec::new(),
                computed: 0,
                published: 0,
                generated: 0,
                cached_tokens: None,
                first_scheduled: None,
                first_token: None,
                preemptions: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Removes a sequence wherever it is and frees its blocks at once.
    pub fn abort(&mut self, id: SeqId) -> bool {
        let Some(seq) = self.seqs.remove(&id) else {
            return false;
        };
        self.pool.release(&seq.blocks);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        true
    }

    /// Runs one iteration. Returns `None` when there is nothing to run.
    pub fn step(&mut self) -> Option<StepReport> {
        let mut report = StepReport::default();
        let mut batch: Vec<(SeqId, u64)> = Vec::new();
        let mut budget = if self.profile.engine.enable_chunked_prefill {
            self.profile.engine.max_num_batched_tokens
        } else {
            u64::MAX
        };

        self.schedule_running(&mut batch, &mut budget, &mut report);
        if report.preemptions == 0 {
            self.admit_waiting(&mut batch, &mut budget, &mut report);
        }
        if batch.is_empty() {
            return None;
        }

        let load = StepLoad {
            tokens: batch.iter().map(|&(_, chunk)| chunk).sum(),
            kv_tokens_read: batch
                .iter()
                .map(|(id, chunk)| self.seqs.get(id).map_or(0, |s| s.computed + chunk))
                .sum(),
        };
        report.batched_tokens = load.tokens;
        report.batched_sequences = batch.len();
        report.duration = self.profile.step_seconds(load);
        report.end = self.now + report.duration;
        self.now = report.end;

        for (id, chunk) in batch {
            self.advance(id, chunk, &mut report);
        }
        Some(report)
    }

    /// Gives every running sequence its next token or prefill chunk, oldest first, preempting
    /// the newest when blocks run out.
    fn schedule_running(
        &mut self,
        batch: &mut Vec<(SeqId, u64)>,
        budget: &mut u64,
        report: &mut StepReport,
    ) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let chunk = (seq.known() - seq.computed).min(*budget);
            let needed = blocks_for(seq.computed + chunk) as usize;
            let mut scheduled = true;
            while needed > self.seq_blocks(id) + self.pool.num_free() {
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                report.preemptions += 1;
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            if !self.grow(id, needed) {
                break;
            }
            *budget -= chunk;
            batch.push((id, chunk));
            i += 1;
        }
    }

    /// Admits waiting sequences in order while slots, budget and blocks allow.
    fn admit_waiting(
        &mut self,
        batch: &mut Vec<(SeqId, u64)>,
        budget: &mut u64,
        report: &mut StepReport,
    ) {
        let chunked = self.profile.engine.enable_chunked_prefill;
        while let Some(&id) = self.waiting.front() {
            if self.running.len() >= self.profile.engine.max_num_seqs || *budget == 0 {
                break;
            }
            let Some(seq) = self.seqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let known = seq.known();
            let mut hit = self.pool.cached_prefix(&seq.spec.block_hashes);
            // At least one token must be computed to produce logits.
            hit.truncate(((known - 1) / BLOCK_TOKENS) as usize);
            let cached = hit.len() as u64 * BLOCK_TOKENS;
            let pending = known - cached;
            let chunk = pending.min(*budget);
            if !chunked && chunk < pending {
                break;
            }
            let fresh = blocks_for(cached + chunk) as usize - hit.len();
            if fresh + self.pool.free_among(&hit) > self.pool.num_free() {
                break;
            }
            self.pool.acquire(&hit);
            let Some(new_blocks) = self.pool.allocate(fresh) else {
                self.pool.release(&hit);
                break;
            };
            let first_admission = seq.cached_tokens.is_none();
            if first_admission {
                report.prefix_queries += seq.spec.prompt_len;
                report.prefix_hits += cached;
                report.started.push((id, cached));
            }
            let now = self.now;
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.published = hit.len();
                seq.blocks = hit;
                seq.blocks.extend(new_blocks);
                seq.computed = cached;
                seq.cached_tokens.get_or_insert(cached);
                seq.first_scheduled.get_or_insert(now);
            }
            self.waiting.pop_front();
            self.running.push(id);
            *budget -= chunk;
            batch.push((id, chunk));
        }
    }

    fn seq_blocks(&self, id: SeqId) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.blocks.len())
    }

    /// Extends a sequence's block table to `needed` blocks.
    fn grow(&mut self, id: SeqId, needed: usize) -> bool {
        let have = self.seq_blocks(id);
        if needed <= have {
            return true;
        }
        match (self.pool.allocate(needed - have), self.seqs.get_mut(&id)) {
            (Some(blocks), Some(seq)) => {
                seq.blocks.extend(blocks);
                true
            }
            (Some(blocks), None) => {
                self.pool.release(&blocks);
                false
            }
            (None, _) => false,
        }
    }

    /// Frees a running sequence's blocks and queues it first in line for recomputation.
    fn preempt(&mut self, id: SeqId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            self.pool.release(&seq.blocks);
            seq.blocks.clear();
            seq.computed = 0;
            seq.published = 0;
            seq.preemptions += 1;
            self.waiting.push_front(id);
        }
    }

    /// Applies a computed chunk: publishes full prompt blocks, emits a token when the chunk
    /// completes the known context, and retires finished sequences.
    fn advance(&mut self, id: SeqId, chunk: u64, report: &mut StepReport) {
        let now = self.now;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        seq.computed += chunk;
        let full_prompt_blocks = (seq.computed.min(seq.spec.prompt_len) / BLOCK_TOKENS) as usize;
        let publishable = full_prompt_blocks.min(seq.spec.block_hashes.len());
        for i in seq.published..publishable {
            self.pool.publish(seq.blocks[i], seq.spec.block_hashes[i]);
        }
        seq.published = seq.published.max(publishable);

        if seq.computed < seq.known() {
            return;
        }
        if seq.spec.output_len > 0 {
            report.tokens.push((id, seq.generated));
            seq.generated += 1;
            seq.first_token.get_or_insert(now);
            if seq.generated < seq.spec.output_len {
                return;
            }
        }
        let finished = Finished {
            id,
            usage: Usage {
                prompt_tokens: seq.spec.prompt_len,
                completion_tokens: seq.generated,
                cached_tokens: seq.cached_tokens.unwrap_or(0),
            },
            queue_seconds: seq.first_scheduled.unwrap_or(now) - seq.arrival,
            ttft_seconds: seq.first_token.unwrap_or(now) - seq.arrival,
            e2e_seconds: now - seq.arrival,
            preemptions: seq.preemptions,
        };
        self.abort(id);
        report.finished.push(finished);
    }
}

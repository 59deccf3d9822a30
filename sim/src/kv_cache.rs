//! The paged KV cache: fixed 16-token blocks, reference-counted, with a prefix cache.
//!
//! Full prompt blocks are published under a hash chained from the request's `cache_salt` and
//! every token before them, so a block is reused only by a request with the same salt and the
//! same prefix. Freed blocks keep their contents until the LRU free list hands them out again.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use weir_core::kv_profile::BLOCK_TOKENS;
use weir_core::tokens::TokenId;

pub type BlockId = usize;
pub type BlockHash = u64;

/// Hashes of the prompt's full blocks, each chained from the salt and the block before it.
pub fn block_hashes(cache_salt: Option<&str>, tokens: &[TokenId]) -> Vec<BlockHash> {
    let mut parent = {
        let mut h = DefaultHasher::new();
        cache_salt.hash(&mut h);
        h.finish()
    };
    tokens
        .chunks_exact(BLOCK_TOKENS as usize)
        .map(|block| {
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            block.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

#[derive(Clone, Debug, Default)]
struct Block {
    refs: u32,
    hash: Option<BlockHash>,
    /// Position in the free list while unreferenced.
    free_stamp: Option<u64>,
}

/// All KV blocks of one engine.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Unreferenced blocks in eviction order (oldest stamp first).
    free: BTreeMap<u64, BlockId>,
    next_stamp: u64,
    cached: HashMap<BlockHash, BlockId>,
    prefix_caching: bool,
}

impl BlockPool {
    pub fn new(num_blocks: usize, prefix_caching: bool) -> Self {
        let mut pool = BlockPool {
            blocks: vec![Block::default(); num_blocks],
            free: BTreeMap::new(),
            next_stamp: 0,
            cached: HashMap::new(),
            prefix_caching,
        };
        for id in 0..num_blocks {
            pool.push_free(id);
        }
        pool
    }

    pub fn total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (unreferenced, cached or not).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Fraction of blocks referenced by live sequences (vLLM's `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }

    /// The longest run of leading blocks already cached for these hashes.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        if !self.prefix_caching {
            return Vec::new();
        }
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// How many of `ids` sit on the free list (acquiring them shrinks what can be allocated).
    pub fn free_among(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&id| self.blocks[id].free_stamp.is_some())
            .count()
    }

    /// Takes a reference on blocks found by [`cached_prefix`](Self::cached_prefix).
    pub fn acquire(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let block = &mut self.blocks[id];
            if let Some(stamp) = block.free_stamp.take() {
                self.free.remove(&stamp);
            }
            block.refs += 1;
        }
    }

    /// Hands out `n` blocks from the least recently freed, evicting their cached contents.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, id) = self.free.pop_first()?;
            let block = &mut self.blocks[id];
            block.free_stamp = None;
            block.refs = 1;
            if let Some(hash) = block.hash.take()
                && self.cached.get(&hash) == Some(&id)
            {
                self.cached.remove(&hash);
            }
            ids.push(id);
        }
        Some(ids)
    }

    /// Publishes a full block under its chained hash so later requests can reuse it.
    pub fn publish(&mut self, id: BlockId, hash: BlockHash) {
        if !self.prefix_caching {
            return;
        }
        self.blocks[id].hash = Some(hash);
        self.cached.entry(hash).or_insert(id);
    }

    /// Drops one reference on each block. Tail blocks are freed first so they are evicted first,
    /// keeping the shared head of a prefix cached the longest.
    pub fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let block = &mut self.blocks[id];
            block.refs = block.refs.saturating_sub(1);
            if block.refs == 0 && block.free_stamp.is_none() {
                self.push_free(id);
            }
        }
    }

    fn push_free(&mut self, id: BlockId) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.blocks[id].free_stamp = Some(stamp);
        self.free.insert(stamp, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: u32) -> Vec<TokenId> {
        (0..n).collect()
    }

    #[test]
    fn hashes_chain_over_full_blocks_and_salt() {
        let a = block_hashes(Some("s1"), &tokens(40));
        assert_eq!(a.len(), 2, "only full blocks are hashed");
        assert_eq!(a, block_hashes(Some("s1"), &tokens(47)));
        assert_ne!(a[0], block_hashes(Some("s2"), &tokens(40))[0]);
        assert_ne!(a[0], block_hashes(None, &tokens(40))[0]);
        // A different first block changes every later hash.
        let mut other = tokens(40);
        other[0] = 999;
        let b = block_hashes(Some("s1"), &other);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn published_blocks_survive_release_until_evicted() {
        let mut pool = BlockPool::new(4, true);
        let hashes = block_hashes(None, &tokens(32));
        let ids = pool.allocate(2).unwrap();
        pool.publish(ids[0], hashes[0]);
        pool.publish(ids[1], hashes[1]);
        assert_eq!(pool.usage(), 0.5);
        pool.release(&ids);
        assert_eq!(pool.usage(), 0.0);
        assert_eq!(pool.cached_prefix(&hashes), ids);

        // Two never-used blocks are handed out before the cached ones.
        pool.allocate(2).unwrap();
        assert_eq!(pool.cached_prefix(&hashes).len(), 2);
        // The next allocation evicts the tail block first: the prefix shrinks to one block.
        pool.allocate(1).unwrap();
        assert_eq!(pool.cached_prefix(&hashes), vec![ids[0]]);
    }

    #[test]
    fn acquiring_a_cached_block_takes_it_off_the_free_list() {
        let mut pool = BlockPool::new(2, true);
        let hashes = block_hashes(None, &tokens(16));
        let ids = pool.allocate(1).unwrap();
        pool.publish(ids[0], hashes[0]);
        pool.release(&ids);
        let hit = pool.cached_prefix(&hashes);
        assert_eq!(pool.free_among(&hit), 1);
        pool.acquire(&hit);
        assert_eq!(pool.num_free(), 1);
        assert!(pool.allocate(2).is_none());
    }

    #[test]
    fn caching_off_never_hits() {
        let mut pool = BlockPool::new(2, false);
        let hashes = block_hashes(None, &tokens(16));
        let ids = pool.allocate(1).unwrap();
        pool.publish(ids[0], hashes[0]);
        assert!(pool.cached_prefix(&hashes).is_empty());
    }
}

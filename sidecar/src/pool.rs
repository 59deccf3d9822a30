//! Pools of engine replicas serving one model, and where a request should run.
//!
//! Each replica has a KV token budget; the dispatcher reserves a request's KV need on the replica
//! it picks and gives it back when the request ends, so work is only sent where it fits.
//! Scraped engine metrics (`vllm:kv_cache_usage_perc`, `vllm:num_requests_waiting`) add what the
//! engine itself reports: a replica with requests waiting inside the engine gets no more, so
//! queueing happens here, in fair order, and not in the engine's arrival order.
//!
//! An engine that reports no KV capacity (no `vllm:cache_config_info`, as SGLang or llama.cpp)
//! and has no `kv_tokens_per_replica` in the config is admitted by concurrency alone:
//! `max_in_flight_without_kv` requests per replica at once, so such a pool is never stuck
//! behind a KV budget of zero.

use std::hash::{DefaultHasher, Hash, Hasher};

use crate::config::PoolConfig;
use crate::isolation::Isolation;

/// What a replica's `/metrics` said last.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineSample {
    pub kv_usage: f64,
    pub waiting: u64,
    pub running: u64,
    /// KV capacity in tokens, from `vllm:cache_config_info`.
    pub kv_tokens: Option<u64>,
}

impl EngineSample {
    /// Reads the vLLM metrics weir needs from a Prometheus/OpenMetrics exposition.
    pub fn parse(text: &str) -> EngineSample {
        let mut sample = EngineSample::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = || line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if line.starts_with("vllm:kv_cache_usage_perc") {
                sample.kv_usage = value().unwrap_or(0.0);
            } else if line.starts_with("vllm:num_requests_waiting{") {
                sample.waiting = value().unwrap_or(0.0) as u64;
            } else if line.starts_with("vllm:num_requests_running{") {
                sample.running = value().unwrap_or(0.0) as u64;
            } else if line.starts_with("vllm:cache_config_info") {
                let blocks = line
                    .split("num_gpu_blocks=\"")
                    .nth(1)
                    .and_then(|rest| rest.split('"').next())
                    .and_then(|n| n.parse::<u64>().ok());
                let block_size = line
                    .split("block_size=\"")
                    .nth(1)
                    .and_then(|rest| rest.split('"').next())
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(16);
                sample.kv_tokens = blocks.map(|b| b * block_size);
            }
        }
        sample
    }
}

#[derive(Clone, Debug)]
pub struct Replica {
    pub url: String,
    /// KV tokens this replica holds (config, else scraped).
    pub kv_budget: u64,
    /// KV tokens reserved by requests dispatched here and not finished.
    pub reserved: u64,
    pub in_flight: u64,
    /// Requests at once while the KV budget is unknown (0).
    pub max_in_flight_without_kv: u64,
    pub healthy: bool,
    /// How its prefix cache is kept per tenant; only some modes get work.
    pub isolation: Isolation,
    pub engine: EngineSample,
}

impl Replica {
    /// Fraction of the replica in use, by weir's reservations or the engine's own count.
    pub fn load(&self) -> f64 {
        let reserved = if self.kv_budget == 0 {
            self.in_flight as f64 / self.max_in_flight_without_kv.max(1) as f64
        } else {
            self.reserved as f64 / self.kv_budget as f64
        };
        reserved.max(self.engine.kv_usage)
    }

    /// Whether tenants' work may go here at all: healthy, and its prefix cache kept per
    /// tenant (or shared by the config's choice).
    pub fn serves(&self) -> bool {
        self.healthy && self.isolation.serves()
    }

    pub fn fits(&self, kv_need: u64) -> bool {
        let room = if self.kv_budget == 0 {
            self.in_flight < self.max_in_flight_without_kv
        } else {
            self.reserved + kv_need <= self.kv_budget || self.in_flight == 0
        };
        self.serves() && self.engine.waiting == 0 && room
    }
}

#[derive(Clone, Debug)]
pub struct Pool {
    pub model: String,
    pub replicas: Vec<Replica>,
    pub affinity_load_threshold: f64,
    pub affinity_prefix_bytes: usize,
}

impl Pool {
    pub fn new(config: &PoolConfig) -> Pool {
        Pool {
            model: config.model.clone(),
            replicas: config
                .replicas
                .iter()
                .map(|url| Replica {
                    url: url.trim_end_matches('/').to_owned(),
                    kv_budget: config.kv_tokens_per_replica.unwrap_or(0),
                    reserved: 0,
                    in_flight: 0,
                    max_in_flight_without_kv: config.max_in_flight_without_kv,
                    // Unknown until the first probe answers.
                    healthy: false,
                    isolation: Isolation::initial(config.cache_isolation),
                    engine: EngineSample::default(),
                })
                .collect(),
            affinity_load_threshold: config.affinity_load_threshold,
            affinity_prefix_bytes: config.affinity_prefix_bytes,
        }
    }

    pub fn fits(&self, kv_need: u64) -> bool {
        self.replicas.iter().any(|r| r.fits(kv_need))
    }

    /// KV tokens across the replicas that serve.
    pub fn capacity(&self) -> u64 {
        self.replicas
            .iter()
            .filter(|r| r.serves())
            .map(|r| r.kv_budget)
            .sum()
    }

    /// The replica a tenant's prefix maps to (rendezvous hashing over the replicas that
    /// serve), so its prompts keep landing where its prefix cache is warm.
    pub fn affine(&self, affinity: u64) -> Option<usize> {
        self.replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| r.serves())
            .max_by_key(|(i, _)| {
                let mut h = DefaultHasher::new();
                (affinity, i).hash(&mut h);
                h.finish()
            })
            .map(|(i, _)| i)
    }

    /// The affine replica unless it is over the load threshold or full; then the least
    /// loaded replica that fits.
    pub fn route(&self, affinity: u64, kv_need: u64) -> Option<usize> {
        if let Some(i) = self.affine(affinity) {
            let r = &self.replicas[i];
            if r.fits(kv_need) && r.load() < self.affinity_load_threshold {
                return Some(i);
            }
        }
        self.replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| r.fits(kv_need))
            .min_by(|(_, a), (_, b)| a.load().total_cmp(&b.load()))
            .map(|(i, _)| i)
    }
}

/// The key of tenant-scoped prefix affinity: the tenant and the leading bytes of its prompt.
pub fn affinity_key(tenant: &str, prompt_prefix: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    tenant.hash(&mut h);
    prompt_prefix.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> Pool {
        let mut p = Pool::new(&PoolConfig {
            model: "m".into(),
            replicas: (0..n).map(|i| format!("http://r{i}")).collect(),
            kv_tokens_per_replica: Some(1000),
            affinity_load_threshold: 0.8,
            affinity_prefix_bytes: 64,
            max_in_flight_without_kv: 2,
            cache_isolation: Default::default(),
        });
        for r in &mut p.replicas {
            r.healthy = true;
            r.isolation = Isolation::Salt;
        }
        p
    }

    #[test]
    fn parses_vllm_metrics() {
        let text = "# TYPE x gauge\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 7\n\
            vllm:cache_config_info{engine=\"0\",model_name=\"m\",block_size=\"16\",num_gpu_blocks=\"610\"} 1\n";
        let s = EngineSample::parse(text);
        assert_eq!(
            (s.kv_usage, s.waiting, s.running, s.kv_tokens),
            (0.25, 3, 7, Some(9760))
        );
    }

    #[test]
    fn the_same_tenant_prefix_goes_to_the_same_replica() {
        let p = pool(4);
        let a = affinity_key("t1", b"You are a helpful assistant");
        let b = affinity_key("t2", b"You are a helpful assistant");
        assert_eq!(p.route(a, 10), p.route(a, 10));
        let spread: std::collections::HashSet<_> = (0..64)
            .map(|i| p.affine(affinity_key(&format!("t{i}"), b"same prefix")))
            .collect();
        assert!(spread.len() > 1, "tenants spread over replicas");
        assert!(p.route(b, 10).is_some());
    }

    #[test]
    fn a_loaded_affine_replica_is_passed_over() {
        let mut p = pool(2);
        let key = affinity_key("t", b"prefix");
        let affine = p.affine(key).unwrap();
        p.replicas[affine].reserved = 900;
        p.replicas[affine].in_flight = 3;
        let other = 1 - affine;
        assert_eq!(p.route(key, 50), Some(other), "over the load threshold");
        p.replicas[other].reserved = 990;
        p.replicas[other].in_flight = 9;
        assert_eq!(p.route(key, 50), Some(affine), "the least loaded that fits");
        assert_eq!(p.route(key, 500), None, "nothing fits");
    }

    #[test]
    fn engines_with_a_queue_of_their_own_get_no_more() {
        let mut p = pool(1);
        assert!(p.fits(10));
        p.replicas[0].engine.waiting = 1;
        assert!(!p.fits(10));
        p.replicas[0].engine.waiting = 0;
        p.replicas[0].healthy = false;
        assert!(!p.fits(10));
    }

    #[test]
    fn a_replica_whose_cache_is_not_kept_per_tenant_gets_no_work() {
        use crate::isolation::Gap;
        let mut p = pool(2);
        let key = affinity_key("t", b"prefix");
        let affine = p.affine(key).unwrap();
        for mode in [Isolation::Unprobed, Isolation::Unisolated(Gap::SaltIgnored)] {
            p.replicas[affine].isolation = mode;
            assert_eq!(p.route(key, 10), Some(1 - affine), "{mode:?}");
            assert_eq!(p.affine(key), Some(1 - affine), "nor is it affine");
            assert_eq!(p.capacity(), 1000, "nor counted in the pool's KV");
        }
        p.replicas[1 - affine].isolation = Isolation::Unprobed;
        assert!(!p.fits(10), "no replica serves");
        for mode in [Isolation::CacheOff, Isolation::Shared] {
            p.replicas[affine].isolation = mode;
            assert_eq!(p.route(key, 10), Some(affine), "{mode:?}");
        }
    }

    #[test]
    fn a_replica_without_kv_figures_is_admitted_by_concurrency() {
        let mut p = pool(1);
        p.replicas[0].kv_budget = 0;
        assert!(p.fits(100_000), "no KV budget of 0 that blocks forever");
        p.replicas[0].in_flight = 1;
        assert!(p.fits(100_000));
        assert!(p.replicas[0].load() < 1.0);
        p.replicas[0].in_flight = 2;
        assert!(!p.fits(1), "but no more than its concurrency at once");
        assert_eq!(p.replicas[0].load(), 1.0);
    }
}

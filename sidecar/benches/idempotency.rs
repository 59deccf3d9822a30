//! An idempotency claim with the memory full, at 1,000, 100,000 and 1,000,000 remembered keys:
//! one tenant mints a new key per request among 100 quiet tenants holding a tenth of the keys;
//! each claim is run and completed with a kept response, expires the oldest kept response and
//! forgets the flood's oldest key. `cargo xtask bench --only idempotency` runs it, then counts
//! a claim's instructions at each size under callgrind (see `main`), and prints the claim at
//! 1,000,000 keys against 1,000: flat, as expiry and eviction take the front of ordered indexes.

use std::sync::Arc;

use axum::body::Bytes;
use criterion::{Criterion, criterion_group};
use weir_sidecar::config::idempotency::IdempotencyConfig;
use weir_sidecar::intake::idempotency::{Claimed, Idempotency, StoredResponse, fingerprint};
use weir_sidecar::ledger::KeyHistory;

/// A registry at its `max_keys`, and the time of its last claim (a millisecond a claim).
struct Full {
    registry: Arc<Idempotency>,
    now: u64,
}

impl Full {
    fn new(keys: usize) -> Full {
        let registry = Idempotency::new(IdempotencyConfig {
            // Half the keys keep a response: each claim expires one.
            replay_ttl_ms: keys as u64 / 2,
            max_keys: keys,
            max_cache_bytes: usize::MAX,
            ..IdempotencyConfig::default()
        });
        let mut full = Full { registry, now: 0 };
        for i in 0..keys {
            let quiet = format!("org-{}", i / 10 % 100);
            full.claim(if i % 10 == 0 { &quiet } else { "flood" });
        }
        full
    }

    /// A request under a new key, run and completed.
    fn claim(&mut self, tenant: &str) {
        self.now += 1;
        let key = format!("key-{}", self.now);
        let fingerprint = fingerprint("/v1/chat/completions", key.as_bytes());
        let history = || Some(KeyHistory::default());
        if let Claimed::Run(mut claim) =
            self.registry
                .claim(tenant, &key, fingerprint, self.now, history)
        {
            let response = StoredResponse {
                status: 200,
                content_type: "application/json",
                body: Bytes::from_static(br#"{"choices":[{"message":{"content":"ok"}}]}"#),
            };
            claim.finish(Some(Some(response)), self.now);
        }
    }
}

fn claims(c: &mut Criterion) {
    for (keys, size) in [(1_000, "1k"), (100_000, "100k"), (1_000_000, "1m")] {
        // Filled on first use, so a filter that skips the size skips the filling.
        let mut full = None;
        c.bench_function(&format!("idempotency_claim_{size}_keys"), |b| {
            let full = full.get_or_insert_with(|| Full::new(keys));
            b.iter(|| full.claim("flood"))
        });
    }
}

/// Claims made one after another, each as in the benchmark; never inlined, so callgrind can
/// count its instructions alone (`--toggle-collect`).
#[inline(never)]
fn measured_claims(full: &mut Full, claims: usize) {
    for _ in 0..claims {
        full.claim("flood");
    }
}

criterion_group!(benches, claims);

/// With `WEIR_CLAIMS_KEYS=<n>`, no criterion: fills `n` keys, then makes 10,000 claims in
/// `measured_claims`, for callgrind to count the instructions of a claim.
fn main() {
    match std::env::var("WEIR_CLAIMS_KEYS").map(|n| n.parse()) {
        Ok(Ok(keys)) => measured_claims(&mut Full::new(keys), 10_000),
        _ => {
            benches();
            Criterion::default().configure_from_args().final_summary();
        }
    }
}

//! Scheduler decisions at 10,000 and 100,000 backlogged tenants: pop the next request, charge
//! what it was served, queue the tenant's next one (the steady state of a saturated pool).

#![allow(clippy::expect_used)] // benchmark code: a panic is a failed run

use criterion::{Criterion, criterion_group, criterion_main};
use weir_core::config::Priority;
use weir_core::scheduler::{Policy, Scheduler, Share, TokenWeights};

fn saturated(policy: Policy, tenants: usize) -> (Scheduler<u64>, Vec<String>) {
    let names: Vec<String> = (0..tenants).map(|i| format!("org-{i}/ws/p/k")).collect();
    let mut s = Scheduler::new(policy, Share::Hierarchy, TokenWeights::default(), 60_000);
    for (i, name) in names.iter().enumerate() {
        let weights = [1.0, 1.0, 1.0, 1.0 + (i % 4) as f64];
        for _ in 0..2 {
            s.push(name, &weights, Priority::Interactive, i as u64, 0);
        }
    }
    (s, names)
}

fn decisions(c: &mut Criterion) {
    for (tenants, size) in [(10_000, "10k"), (100_000, "100k")] {
        for (label, policy) in [("fair", Policy::Fair), ("fifo", Policy::Fifo)] {
            let (mut s, names) = saturated(policy, tenants);
            c.bench_function(&format!("scheduler_decision_{label}_{size}_tenants"), |b| {
                b.iter(|| {
                    let d = s.pop(0).expect("backlogged");
                    let i = d.item as usize;
                    s.charge(&names[i], 300, 120);
                    s.push(
                        &names[i],
                        &[1.0, 1.0, 1.0, 1.0 + (i % 4) as f64],
                        Priority::Interactive,
                        i as u64,
                        0,
                    );
                })
            });
        }
    }
}

criterion_group!(benches, decisions);
criterion_main!(benches);

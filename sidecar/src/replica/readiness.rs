//! `/ready` on the admin port: whether every pool has a replica that can take work, and per
//! replica why or why not — for Kubernetes' readiness probe and for the operator reading it.
//! The dispatcher builds it from its pools on request ([`crate::dispatch::Event::Ready`]).

use serde::Serialize;

use crate::replica::pool::{Pool, Replica};

#[derive(Debug, Serialize)]
pub struct Readiness {
    /// Every pool has a replica that serves: 200, else 503.
    pub ready: bool,
    pub pools: Vec<PoolReadiness>,
}

#[derive(Debug, Serialize)]
pub struct PoolReadiness {
    pub model: String,
    /// At least one of its replicas serves.
    pub ready: bool,
    pub replicas: Vec<ReplicaReadiness>,
}

/// What weir knows of one replica; each per-replica fact weir acts on belongs here.
#[derive(Debug, Serialize)]
pub struct ReplicaReadiness {
    pub url: String,
    /// Answers its health probe (`/metrics`).
    pub healthy: bool,
    /// Healthy, and its prefix cache kept per tenant (or shared by the config's choice):
    /// weir sends it work.
    pub serving: bool,
    /// Gone from the pool's set ([`crate::replica::roster`]): no new work, dropped once its requests
    /// end. Absent while it belongs.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub leaving: bool,
    /// Requests weir runs there now.
    pub in_flight: u64,
    /// The isolation mode ([`crate::isolation`]).
    pub cache_isolation: &'static str,
    /// Why it gets no traffic, or that it is shared; absent when isolated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_isolation_reason: Option<&'static str>,
}

impl Readiness {
    /// The pools the config names (retired ones, draining, are not among them).
    pub fn of<'a>(pools: impl IntoIterator<Item = &'a Pool>) -> Readiness {
        let pools: Vec<PoolReadiness> = pools
            .into_iter()
            .filter(|p| !p.retired)
            .map(PoolReadiness::of)
            .collect();
        Readiness {
            ready: pools.iter().all(|p| p.ready),
            pools,
        }
    }
}

impl PoolReadiness {
    fn of(pool: &Pool) -> PoolReadiness {
        PoolReadiness {
            model: pool.model.clone(),
            ready: pool.replicas.iter().any(Replica::serves),
            replicas: pool.replicas.iter().map(ReplicaReadiness::of).collect(),
        }
    }
}

impl ReplicaReadiness {
    fn of(r: &Replica) -> ReplicaReadiness {
        ReplicaReadiness {
            url: r.url.clone(),
            healthy: r.healthy,
            serving: r.serves(),
            leaving: r.leaving,
            in_flight: r.in_flight,
            cache_isolation: r.isolation.label(),
            cache_isolation_reason: r.isolation.reason(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PoolConfig;
    use crate::config::engine::CacheIsolation;
    use crate::isolation::{Gap, Isolation};

    fn pool(model: &str, modes: &[Isolation]) -> Pool {
        let mut p = Pool::new(&PoolConfig {
            cache_isolation: CacheIsolation::Probe,
            ..PoolConfig::listing(
                model,
                (0..modes.len()).map(|i| format!("http://{model}{i}")),
            )
        });
        for (r, mode) in p.replicas.iter_mut().zip(modes) {
            r.healthy = true;
            r.isolation = *mode;
        }
        p
    }

    #[test]
    fn ready_while_every_pool_has_a_replica_that_serves() {
        let a = pool("a", &[Isolation::Salt, Isolation::Unprobed]);
        let b = pool("b", &[Isolation::CacheOff]);
        let ready = Readiness::of(&[a, b]);
        assert!(ready.ready);
        let json = serde_json::to_value(&ready).unwrap_or_default();
        let replica = &json["pools"][0]["replicas"][0];
        assert_eq!(
            (
                &replica["healthy"],
                &replica["serving"],
                &replica["cache_isolation"]
            ),
            (&true.into(), &true.into(), &"salt".into())
        );
        assert!(replica.get("cache_isolation_reason").is_none());
        assert_eq!(json["pools"][0]["replicas"][1]["serving"], false);
        assert_eq!(
            json["pools"][1]["replicas"][0]["cache_isolation"],
            "cache_off"
        );

        let mut down = pool("c", &[Isolation::Salt]);
        down.replicas[0].healthy = false;
        let unisolated = pool("d", &[Isolation::Unisolated(Gap::SaltIgnored)]);
        for p in [down, unisolated] {
            let ready = Readiness::of(&[pool("a", &[Isolation::Salt]), p]);
            assert!(!ready.ready, "a pool no replica of which can serve");
            assert!(!ready.pools[1].ready);
        }
        let ready = Readiness::of(&[pool("d", &[Isolation::Unisolated(Gap::SaltIgnored)])]);
        assert!(
            ready.pools[0].replicas[0]
                .cache_isolation_reason
                .is_some_and(|r| r.contains("ignores cache_salt")),
            "says why"
        );
    }
}

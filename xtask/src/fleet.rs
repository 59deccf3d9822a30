//! `cargo xtask up --fleet`: the fleet on one machine. Redis holds the fleet-wide quota,
//! PostgreSQL the ledger; two sidecars share the engines (each admits against half of every
//! replica, and Envoy hashes each org to one of them); two Envoys hold the demo tenants'
//! per-minute limits fleet-wide, with leases from the sidecars' quota service.

use std::path::Path;

use serde_json::{Value, json};
use weir_e2e::postgres::Postgres;
use weir_e2e::redis_server::Redis;
use weir_e2e::{Envoy, Sidecar};

/// What `up` runs, stopped in field order when dropped: Envoys, then sidecars, then stores.
pub struct Stack {
    pub envoys: Vec<Envoy>,
    pub sidecars: Vec<Sidecar>,
    stores: Option<Stores>,
}

struct Stores {
    redis: Redis,
    postgres: Postgres,
    /// The sidecars' spools (their local queues while PostgreSQL is away).
    _spools: tempfile::TempDir,
}

const SIDECARS: usize = 2;
const ENVOYS: u16 = 2;

impl Stack {
    /// One Envoy in front of one sidecar, as `cargo xtask up` runs.
    pub fn single(envoy: Envoy, sidecar: Sidecar) -> Stack {
        Stack {
            envoys: vec![envoy],
            sidecars: vec![sidecar],
            stores: None,
        }
    }

    /// Redis, PostgreSQL, two sidecars on both and two Envoys on `port` and `port + 1`.
    pub fn start(
        sidecar_bin: &Path,
        mut weir_config: Value,
        pools: Value,
        port: u16,
    ) -> anyhow::Result<Stack> {
        let redis = Redis::launch();
        let postgres = Postgres::start();
        let spools = tempfile::tempdir()?;
        let pools: Vec<Value> = pools
            .as_array()
            .into_iter()
            .flatten()
            .map(|pool| {
                let mut pool = pool.clone();
                pool["sidecars"] = json!(SIDECARS);
                pool
            })
            .collect();
        let sidecars: Vec<Sidecar> = (0..SIDECARS)
            .map(|i| {
                let config = json!({
                    "policy": "fair",
                    "pools": pools,
                    "ledger_store": {
                        "postgres": {"url_file": postgres.url_file()},
                        "spool": spools.path().join(format!("spool-{i}.sqlite")),
                    },
                    // Out of the gateways' rings before the port closes (they check every
                    // second): a stopped sidecar's tenants move without a failed request.
                    "shutdown_leave_ms": 1000,
                });
                Sidecar::start_with_quota(sidecar_bin, config, &redis)
            })
            .collect();
        make_fleet_wide(&mut weir_config);
        let ring: Vec<&Sidecar> = sidecars.iter().collect();
        let envoys = (0..ENVOYS)
            .map(|i| Envoy::start_ring_on(&weir_config, &ring, port + i))
            .collect();
        Ok(Stack {
            envoys,
            sidecars,
            stores: Some(Stores {
                redis,
                postgres,
                _spools: spools,
            }),
        })
    }

    /// Where usage and quota live, for the banner.
    pub fn print_stores(&self) {
        match &self.stores {
            None => {
                for sidecar in &self.sidecars {
                    println!(
                        "  Usage ledger      {}  (weir usage --ledger <path>; deleted at Ctrl-C)",
                        sidecar.ledger.display()
                    );
                }
            }
            Some(stores) => {
                println!(
                    "  Usage ledger      {}  (weir usage --postgres-url-file {}; a database deleted at Ctrl-C)",
                    stores.postgres.url(),
                    stores.postgres.url_file().display()
                );
                println!(
                    "  Quota store       {}  (fleet-wide limits; initech has a 5 USD monthly budget)",
                    stores.redis.url()
                );
            }
        }
    }
}

/// The demo config in fleet mode: leases from the sidecars' quota service (cluster `upstream`,
/// the sidecars), every org's per-minute limits fleet-wide (served from a local share while the
/// store is away), prices, and a monthly spend budget for the free tier.
fn make_fleet_wide(config: &mut Value) {
    config["fleet"] = json!({"cluster": "upstream"});
    config["prices"] = json!({
        "currency": "USD",
        "default": {"input": 0.10, "cached_input": 0.05, "output": 0.40},
    });
    let per_minute = [
        "requests_per_minute",
        "input_tokens_per_minute",
        "output_tokens_per_minute",
    ];
    for org in config["orgs"].as_array_mut().into_iter().flatten() {
        let free_tier = org["id"] == "initech";
        let limits = &mut org["limits"];
        let fleet_wide: serde_json::Map<String, Value> = per_minute
            .iter()
            .filter(|name| limits.get(**name).is_some())
            .map(|name| ((*name).to_owned(), json!("fail_open")))
            .collect();
        limits["fleet_wide"] = Value::Object(fleet_wide);
        if free_tier {
            limits["budgets"] = json!([{"window": "month", "spend": 5.0}]);
        }
    }
}

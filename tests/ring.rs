//! Envoy in front of several sidecars of one pool, as a fleet runs them: the template's
//! `upstream` cluster (a ring hashed on `x-weir-org`, over HTTP/2) listing every sidecar, each
//! health-checked on its admin port's `/ready` with the settings of the shipped
//! `deploy/envoy/envoy.yaml`, so the tests run what a platform deploys; and the same cluster
//! settings for one sidecar ([`http2_upstream`]).

use std::time::Duration;

use crate::{Envoy, EnvoyOptions, Sidecar, http_get, wait_for, workspace_root};

/// How long after the health checks pass every Envoy worker hashes over the whole ring.
pub const RING_SETTLE: Duration = Duration::from_secs(1);

impl Sidecar {
    /// The port of its admin address (`/ready`, `/metrics`).
    pub fn admin_port(&self) -> u16 {
        self.admin.rsplit(':').next().unwrap().parse().unwrap()
    }
}

/// A block of the shipped plain-Envoy config's sidecar cluster, as it stands: the line `key`
/// and the lines after it that start with `indent` (comments end it).
fn shipped_block(key: &str, indent: &str) -> String {
    let shipped =
        std::fs::read_to_string(workspace_root().join("deploy/envoy/envoy.yaml")).unwrap();
    let mut lines = shipped.lines().skip_while(|l| *l != key);
    let mut block = vec![
        lines
            .next()
            .unwrap_or_else(|| panic!("deploy/envoy/envoy.yaml's sidecar cluster has {key}")),
    ];
    block.extend(lines.take_while(|l| l.starts_with(indent) && !l.trim_start().starts_with('#')));
    block.join("\n") + "\n"
}

/// An edit of the template for [`Envoy::launch_edited`]: its `upstream` cluster speaks to the
/// sidecar as the shipped `deploy/envoy/envoy.yaml` does (HTTP/2 without TLS; an engine
/// speaks HTTP/1.1 only).
pub fn http2_upstream(template: String) -> String {
    let cluster = "  - name: upstream\n    type: STATIC\n";
    assert_eq!(
        template.matches(cluster).count(),
        1,
        "the template's upstream cluster"
    );
    let options = shipped_block("    typed_extension_protocol_options:", "      ");
    template.replace(cluster, &format!("{cluster}{options}"))
}

impl Envoy {
    /// [`Envoy::start`], speaking HTTP/2 to the sidecar on `upstream_port` as the shipped
    /// configs do.
    pub fn start_http2(
        weir_config: &serde_json::Value,
        upstream_port: u16,
        alt_port: u16,
    ) -> Envoy {
        let opts = EnvoyOptions::filtering(weir_config, upstream_port, alt_port);
        Envoy::launch_edited(opts, http2_upstream)
    }

    /// Starts Envoy with the filter (`weir_config`) in front of `sidecars`, all of one pool,
    /// and waits until every one of them is in the ring (health-checked healthy). The `/alt/`
    /// route goes to the first.
    pub fn start_ring(weir_config: &serde_json::Value, sidecars: &[&Sidecar]) -> Envoy {
        Envoy::start_ring_on(weir_config, sidecars, 0)
    }

    /// [`Envoy::start_ring`] listening on `listen_port` (0: a free one).
    pub fn start_ring_on(
        weir_config: &serde_json::Value,
        sidecars: &[&Sidecar],
        listen_port: u16,
    ) -> Envoy {
        let opts = EnvoyOptions {
            weir_config,
            upstream_port: sidecars[0].port,
            alt_port: sidecars[0].port,
            listen_port,
            with_filter: true,
        };
        let endpoints: String = sidecars
            .iter()
            .map(|s| {
                format!(
                    "        - endpoint:\n            address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }}\n            health_check_config: {{ port_value: {} }}\n",
                    s.port,
                    s.admin_port()
                )
            })
            .collect();
        let envoy = Envoy::launch_edited(opts, |template| {
            let start = template.find("        # @@UPSTREAM_ENDPOINTS@@").unwrap();
            let end = template
                .find("        # @@UPSTREAM_ENDPOINTS_END@@")
                .unwrap();
            let mut template = template;
            template.replace_range(start..end, &endpoints);
            http2_upstream(template.replace(
                "    # @@UPSTREAM_HEALTH_CHECKS@@\n",
                &shipped_block("    health_checks:", "    "),
            ))
        });
        envoy.wait_for_healthy("upstream", sidecars.len());
        // The workers' rings follow the main thread's health view a moment later: requests in
        // that moment were seen hashed over fewer sidecars.
        std::thread::sleep(RING_SETTLE);
        envoy
    }

    /// Hosts of `cluster` that Envoy's health checks pass now.
    pub fn healthy_in(&self, cluster: &str) -> usize {
        let clusters =
            http_get(self.admin.trim_start_matches("http://"), "/clusters").unwrap_or_default();
        clusters
            .lines()
            .filter(|l| l.starts_with(&format!("{cluster}::")))
            .filter(|l| l.ends_with("::health_flags::healthy"))
            .count()
    }

    /// Waits (up to 15 s, else panics) until `n` hosts of `cluster` are healthy.
    pub fn wait_for_healthy(&self, cluster: &str, n: usize) {
        wait_for(Duration::from_secs(15), || {
            (self.healthy_in(cluster) == n).then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "{} of {n} hosts of {cluster} healthy",
                self.healthy_in(cluster)
            )
        });
    }
}

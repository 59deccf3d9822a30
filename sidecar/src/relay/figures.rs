//! The attempt's latencies as chunks pass (time to first token, inter-chunk latency), kept
//! for the figures published when it settles ([`crate::relay::publish`]).

use std::time::Instant;

use crate::intake::app::App;
use crate::metrics::{HistogramSeries, Labels, Metrics};

/// When the attempt arrived and its chunks came.
pub struct Figures {
    pub(super) arrived: Instant,
    /// Until when it could wait for dispatch (Unix ms): an answer after it is not goodput.
    pub(super) deadline_ms: u64,
    /// The tenant's inter-chunk latency series, observed per chunk.
    itl: HistogramSeries,
    pub(super) first_chunk: Option<Instant>,
    last_chunk: Option<Instant>,
}

impl Figures {
    pub(super) fn new(app: &App, tenant: &str, arrived: Instant, deadline_ms: u64) -> Figures {
        let tenant = app.metrics.tenant(tenant);
        Figures {
            arrived,
            deadline_ms,
            itl: app.metrics.itl.series(&[("tenant", tenant)]),
            first_chunk: None,
            last_chunk: None,
        }
    }

    /// A chunk on its way to the client: the first times the first token, the rest the
    /// latency between chunks.
    pub(super) fn chunk(&mut self, metrics: &Metrics, tenant: &str) {
        let now = Instant::now();
        match self.last_chunk {
            None => {
                let labels: Labels = &[("tenant", metrics.tenant(tenant))];
                metrics
                    .ttft
                    .observe(labels, self.arrived.elapsed().as_secs_f64());
                self.first_chunk = Some(now);
            }
            Some(prev) => self.itl.observe((now - prev).as_secs_f64()),
        }
        self.last_chunk = Some(now);
    }
}

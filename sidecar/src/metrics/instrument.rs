//! One instrument, two exports: each metric records into its Prometheus family (served on
//! `/metrics`) and, when OTLP export is on, into the OpenTelemetry instrument of the same name
//! (pushed by the SDK's periodic reader). Call sites record once and never see either API.
//!
//! Names and label keys are written the OpenTelemetry way (`gen_ai.request.model`); the
//! Prometheus side spells them with `_`, as the OpenTelemetry-to-Prometheus mapping does.

use std::sync::atomic::{AtomicI64, AtomicU64};

use opentelemetry::KeyValue;
use opentelemetry::metrics::Meter;
use prometheus_client::metrics::counter::Counter as PromCounter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::{Atomic, Gauge as PromGauge};
use prometheus_client::metrics::histogram::Histogram as PromHistogram;
use prometheus_client::registry::{Metric, Registry, Unit};

/// A series' labels: (key, value) pairs, keys as OpenTelemetry spells them.
pub type Labels<'a> = &'a [(&'static str, &'a str)];

type PromLabels = Vec<(String, String)>;

fn prom_labels(labels: Labels) -> PromLabels {
    labels
        .iter()
        .map(|(k, v)| (k.replace('.', "_"), (*v).to_owned()))
        .collect()
}

fn attributes(labels: Labels) -> Vec<KeyValue> {
    labels
        .iter()
        .map(|(k, v)| KeyValue::new(*k, (*v).to_owned()))
        .collect()
}

/// Where instruments are made: a Prometheus registry and, with OTLP on, a meter.
pub struct Maker<'r> {
    pub registry: &'r mut Registry,
    pub meter: Option<&'r Meter>,
    /// Put before every name on both sides (`weir.`), empty for the conventions' own names.
    pub prefix: &'static str,
    /// The Prometheus family names made so far (what `/metrics` can show).
    pub families: Vec<String>,
}

impl Maker<'_> {
    fn family(&mut self, name: &str, suffix: &str) {
        let full = format!("{}{name}{suffix}", self.prefix);
        self.families.push(full.replace('.', "_"));
    }

    fn otel_name(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Registers `prom` under `name` and, with a meter, makes its OpenTelemetry twin with
    /// `otel` (given the name and description).
    fn register<P: Metric + Clone, O>(
        &mut self,
        name: &str,
        help: &str,
        prom: P,
        otel: impl FnOnce(&Meter, String, String) -> O,
    ) -> (P, Option<O>) {
        self.family(name, "");
        (self.registry).register(name.replace('.', "_"), help, prom.clone());
        let twin = self
            .meter
            .map(|m| otel(m, self.otel_name(name), help.to_owned()));
        (prom, twin)
    }

    pub fn counter(&mut self, name: &str, help: &str) -> Counter {
        let (prom, otel) = self.register(name, help, Family::default(), |m, name, help| {
            m.u64_counter(name).with_description(help).build()
        });
        Counter { prom, otel }
    }

    pub fn gauge(&mut self, name: &str, help: &str) -> Gauge {
        let (prom, otel) = self.register(name, help, Family::default(), |m, name, help| {
            m.f64_gauge(name).with_description(help).build()
        });
        Gauge { prom, otel }
    }

    /// A gauge of whole numbers (Prometheus shows `3`, not `3.0`).
    pub fn int_gauge(&mut self, name: &str, help: &str) -> IntGauge {
        let (prom, otel) = self.register(name, help, Family::default(), |m, name, help| {
            m.i64_gauge(name).with_description(help).build()
        });
        IntGauge { prom, otel }
    }

    /// A histogram with explicit `buckets`. In seconds when `seconds` (Prometheus appends
    /// `_seconds`, OpenTelemetry gets unit `s`); `unit` is OpenTelemetry's annotation otherwise
    /// (`{token}`), which Prometheus names leave out.
    pub fn histogram(
        &mut self,
        name: &str,
        help: &str,
        unit: HistogramUnit,
        buckets: &'static [f64],
    ) -> Histogram {
        let prom = Family::new_with_constructor(Buckets(buckets));
        let prom_name = name.replace('.', "_");
        match unit {
            HistogramUnit::Seconds => self.family(name, "_seconds"),
            HistogramUnit::Annotation(_) => self.family(name, ""),
        }
        match unit {
            HistogramUnit::Seconds => {
                self.registry
                    .register_with_unit(prom_name, help, Unit::Seconds, prom.clone())
            }
            HistogramUnit::Annotation(_) => self.registry.register(prom_name, help, prom.clone()),
        }
        let otel = self.meter.map(|m| {
            m.f64_histogram(self.otel_name(name))
                .with_description(help.to_owned())
                .with_unit(unit.otel())
                .with_boundaries(buckets.to_vec())
                .build()
        });
        Histogram { prom, otel }
    }
}

#[derive(Clone, Copy)]
pub enum HistogramUnit {
    Seconds,
    Annotation(&'static str),
}

impl HistogramUnit {
    fn otel(self) -> &'static str {
        match self {
            HistogramUnit::Seconds => "s",
            HistogramUnit::Annotation(unit) => unit,
        }
    }
}

/// A histogram family's constructor: every series gets the instrument's buckets.
#[derive(Clone)]
struct Buckets(&'static [f64]);

impl MetricConstructor<PromHistogram> for Buckets {
    fn new_metric(&self) -> PromHistogram {
        PromHistogram::new(self.0.iter().copied())
    }
}

#[derive(Clone)]
pub struct Counter {
    prom: Family<PromLabels, PromCounter>,
    otel: Option<opentelemetry::metrics::Counter<u64>>,
}

impl Counter {
    pub fn inc_by(&self, labels: Labels, n: u64) {
        self.prom.get_or_create(&prom_labels(labels)).inc_by(n);
        if let Some(o) = &self.otel {
            o.add(n, &attributes(labels));
        }
    }

    pub fn inc(&self, labels: Labels) {
        self.inc_by(labels, 1);
    }

    #[cfg(test)]
    pub fn get(&self, labels: Labels) -> u64 {
        self.prom.get_or_create(&prom_labels(labels)).get()
    }

    /// Drops a series from `/metrics` (OpenTelemetry's cumulative series stay until restart).
    pub fn remove(&self, labels: Labels) {
        self.prom.remove(&prom_labels(labels));
    }
}

/// A gauge of `N` (`f64`, or `i64` for whole numbers, which Prometheus shows as `3`, not `3.0`).
pub struct GaugeOf<N, A> {
    prom: Family<PromLabels, PromGauge<N, A>>,
    otel: Option<opentelemetry::metrics::Gauge<N>>,
}

pub type Gauge = GaugeOf<f64, AtomicU64>;
pub type IntGauge = GaugeOf<i64, AtomicI64>;

impl<N: Clone, A> Clone for GaugeOf<N, A> {
    fn clone(&self) -> Self {
        GaugeOf {
            prom: self.prom.clone(),
            otel: self.otel.clone(),
        }
    }
}

impl<N: Copy, A: Atomic<N> + Default> GaugeOf<N, A> {
    pub fn set(&self, labels: Labels, v: N) {
        self.prom.get_or_create(&prom_labels(labels)).set(v);
        if let Some(o) = &self.otel {
            o.record(v, &attributes(labels));
        }
    }

    #[cfg(test)]
    pub fn get(&self, labels: Labels) -> Option<N> {
        self.prom.get(&prom_labels(labels)).map(|g| g.get())
    }

    pub fn remove(&self, labels: Labels) {
        self.prom.remove(&prom_labels(labels));
    }
}

#[derive(Clone)]
pub struct Histogram {
    prom: Family<PromLabels, PromHistogram, Buckets>,
    otel: Option<opentelemetry::metrics::Histogram<f64>>,
}

impl Histogram {
    pub fn observe(&self, labels: Labels, v: f64) {
        self.series(labels).observe(v);
    }

    /// The series of `labels`, looked up once for what observes it many times (a stream, per
    /// chunk).
    pub fn series(&self, labels: Labels) -> HistogramSeries {
        HistogramSeries {
            prom: self.prom.get_or_create(&prom_labels(labels)).clone(),
            otel: (self.otel.clone()).map(|o| (o, attributes(labels))),
        }
    }
}

/// One series of a [`Histogram`].
pub struct HistogramSeries {
    prom: PromHistogram,
    otel: Option<(opentelemetry::metrics::Histogram<f64>, Vec<KeyValue>)>,
}

impl HistogramSeries {
    pub fn observe(&self, v: f64) {
        self.prom.observe(v);
        if let Some((o, attributes)) = &self.otel {
            o.record(v, attributes);
        }
    }
}

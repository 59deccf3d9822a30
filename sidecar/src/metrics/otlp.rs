//! OTLP export (optional, off by default): the same instruments pushed over OTLP/HTTP
//! (protobuf) to a collector by the OpenTelemetry SDK's periodic reader, for platforms that
//! collect with OpenTelemetry rather than scrape.

use std::time::Duration;

use anyhow::{Context, bail};
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_otlp::{MetricExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};

use crate::config::metrics::OtlpConfig;

impl OtlpConfig {
    /// The URL exported to. One with a user or password is refused (secrets never inline),
    /// and the error never repeats what was written.
    fn url(&self) -> anyhow::Result<String> {
        let mut url = reqwest::Url::parse(&self.endpoint)
            .map_err(|e| anyhow::anyhow!("metrics.otlp.endpoint is not a URL: {e}"))?;
        if !url.username().is_empty() || url.password().is_some() {
            bail!("metrics.otlp.endpoint holds credentials: a secret never goes in the config");
        }
        if !matches!(url.scheme(), "http" | "https") {
            bail!("metrics.otlp.endpoint must be http:// or https://");
        }
        if url.path() == "/" {
            url.set_path("/v1/metrics");
        }
        Ok(url.to_string())
    }
}

/// The exporter's provider: hand its meter to [`super::Metrics::new`], and shut it down at exit
/// so the last figures go out.
pub struct Export {
    provider: SdkMeterProvider,
}

impl Export {
    pub fn start(config: &OtlpConfig) -> anyhow::Result<Export> {
        let exporter = MetricExporter::builder()
            .with_http()
            .with_endpoint(config.url()?)
            .with_timeout(Duration::from_secs(5))
            .build()
            .context("metrics.otlp: the OTLP exporter")?;
        let reader = PeriodicReader::builder(exporter)
            .with_interval(Duration::from_millis(config.interval_ms.max(100)))
            .build();
        let resource = Resource::builder()
            .with_service_name("weir-sidecar")
            .build();
        let provider = SdkMeterProvider::builder()
            .with_reader(reader)
            .with_resource(resource)
            .build();
        Ok(Export { provider })
    }

    pub fn meter(&self) -> opentelemetry::metrics::Meter {
        self.provider.meter("weir")
    }

    /// Pushes what is left and stops the reader.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!("OTLP export did not shut down cleanly: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// What the process logs, for the one test here that sets the global subscriber (the
    /// exporter logs from its own thread).
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<u8>>>);

    impl Write for Log {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn url(endpoint: &str) -> anyhow::Result<String> {
        OtlpConfig {
            endpoint: endpoint.to_owned(),
            interval_ms: crate::config::metrics::default_interval_ms(),
        }
        .url()
    }

    #[test]
    fn the_metrics_path_is_added_where_none_is_given_and_credentials_are_refused() {
        assert_eq!(url("http://c:4318").unwrap(), "http://c:4318/v1/metrics");
        assert_eq!(url("http://c:4318/").unwrap(), "http://c:4318/v1/metrics");
        assert_eq!(
            url("http://c:4318?x=1").unwrap(),
            "http://c:4318/v1/metrics?x=1"
        );
        assert_eq!(
            url("http://c/otlp/v1/metrics").unwrap(),
            "http://c/otlp/v1/metrics"
        );
        let refused = url("http://user:hunter2@c:4318").unwrap_err().to_string();
        assert!(
            refused.contains("credentials") && !refused.contains("hunter2"),
            "{refused}"
        );
        let bad = url("hunter2 not a url").unwrap_err().to_string();
        assert!(!bad.contains("hunter2"), "{bad}");
        assert!(url("ftp://c").is_err());
    }

    #[test]
    fn an_export_the_collector_refuses_is_logged() {
        let log = Log::default();
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .init();
        // A port nothing listens on: every export is refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let export = Export::start(&OtlpConfig {
            endpoint: format!("http://127.0.0.1:{port}"),
            interval_ms: 60_000,
        })
        .unwrap();
        let counter = export.meter().u64_counter("weir.test").build();
        counter.add(1, &[]);
        let _ = export.provider.force_flush();
        export.shutdown();
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("ExportError"), "nothing logged: {text:?}");
    }
}

//! Per-tenant results: a table, JSON, and an SVG of TTFT over time.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use crate::load::Record;

#[derive(Clone, Debug, Default, Serialize)]
pub struct TenantStats {
    pub requests: usize,
    pub ok: usize,
    pub rejected_429: usize,
    pub other_errors: usize,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub output_tokens: u64,
    /// Output tokens per second of successful requests.
    pub goodput_tps: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

fn percentiles(mut xs: Vec<f64>) -> Percentiles {
    if xs.is_empty() {
        return Percentiles::default();
    }
    xs.sort_by(f64::total_cmp);
    let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize] * 1e3;
    Percentiles {
        p50: at(0.50),
        p95: at(0.95),
        p99: at(0.99),
    }
}

pub fn summarize(records: &[Record], duration_s: f64) -> BTreeMap<String, TenantStats> {
    let mut by_tenant: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for r in records {
        by_tenant.entry(r.tenant.clone()).or_default().push(r);
    }
    by_tenant
        .into_iter()
        .map(|(tenant, rs)| {
            let ok: Vec<&&Record> = rs.iter().filter(|r| r.status == 200).collect();
            let stats = TenantStats {
                requests: rs.len(),
                ok: ok.len(),
                rejected_429: rs.iter().filter(|r| r.status == 429).count(),
                other_errors: rs
                    .iter()
                    .filter(|r| r.status != 200 && r.status != 429)
                    .count(),
                ttft_ms: percentiles(ok.iter().filter_map(|r| r.ttft_s).collect()),
                itl_ms: percentiles(ok.iter().filter_map(|r| r.itl_s).collect()),
                e2e_ms: percentiles(ok.iter().map(|r| r.e2e_s).collect()),
                output_tokens: ok.iter().map(|r| r.output_tokens).sum(),
                goodput_tps: ok.iter().map(|r| r.output_tokens).sum::<u64>() as f64 / duration_s,
            };
            (tenant, stats)
        })
        .collect()
}

pub fn table(stats: &BTreeMap<String, TenantStats>) -> String {
    let mut out = format!(
        "{:<12} {:>6} {:>6} {:>5} {:>5} {:>21} {:>9} {:>21} {:>10} {:>9}\n",
        "tenant",
        "reqs",
        "ok",
        "429",
        "err",
        "TTFT ms p50/p95/p99",
        "ITL p50",
        "E2E ms p50/p95/p99",
        "tokens",
        "tok/s"
    );
    for (tenant, s) in stats {
        out.push_str(&format!(
            "{tenant:<12} {:>6} {:>6} {:>5} {:>5} {:>21} {:>9.1} {:>21} {:>10} {:>9.0}\n",
            s.requests,
            s.ok,
            s.rejected_429,
            s.other_errors,
            format!(
                "{:.0}/{:.0}/{:.0}",
                s.ttft_ms.p50, s.ttft_ms.p95, s.ttft_ms.p99
            ),
            s.itl_ms.p50,
            format!(
                "{:.0}/{:.0}/{:.0}",
                s.e2e_ms.p50, s.e2e_ms.p95, s.e2e_ms.p99
            ),
            s.output_tokens,
            s.goodput_tps,
        ));
    }
    out
}

/// TTFT of every streamed request over the run, one colour per tenant (log scale).
pub fn plot(records: &[Record], title: &str, path: &Path) -> anyhow::Result<()> {
    let points: Vec<(&str, f64, f64)> = records
        .iter()
        .filter_map(|r| {
            r.ttft_s
                .map(|t| (r.tenant.as_str(), r.sent_s, (t * 1e3).max(0.1)))
        })
        .collect();
    let x_max = points.iter().map(|p| p.1).fold(1.0, f64::max);
    let y_max = points.iter().map(|p| p.2).fold(10.0, f64::max) * 1.5;
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, (0.1..y_max).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("seconds into the run")
        .y_desc("time to first token, ms")
        .draw()?;
    let tenants: Vec<&str> = {
        let mut t: Vec<&str> = points.iter().map(|p| p.0).collect();
        t.sort_unstable();
        t.dedup();
        t
    };
    for (i, tenant) in tenants.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        chart
            .draw_series(
                points
                    .iter()
                    .filter(|p| p.0 == *tenant)
                    .map(|p| Circle::new((p.1, p.2), 2, colour.filled())),
            )?
            .label(*tenant)
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, colour.filled()));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tenant: &str, status: u16, ttft: f64) -> Record {
        Record {
            tenant: tenant.into(),
            sent_s: 0.5,
            status,
            ttft_s: Some(ttft),
            itl_s: Some(0.01),
            e2e_s: ttft * 2.0,
            output_tokens: 10,
        }
    }

    #[test]
    fn stats_split_by_tenant_and_outcome() {
        let records = vec![
            rec("a", 200, 0.010),
            rec("a", 200, 0.030),
            rec("a", 429, 0.0),
            rec("b", 503, 0.0),
        ];
        let s = summarize(&records, 2.0);
        assert_eq!((s["a"].requests, s["a"].ok, s["a"].rejected_429), (3, 2, 1));
        assert_eq!(s["b"].other_errors, 1);
        assert_eq!(s["a"].ttft_ms.p50, 30.0);
        assert_eq!(s["a"].goodput_tps, 10.0);
        assert!(table(&s).contains("a "));
    }
}

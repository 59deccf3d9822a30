//! What each engine says about its load, in its own words.
//!
//! Engines name the same figures differently. weir reads, per replica: requests **running**,
//! requests **waiting** inside the engine (weir dispatches no flood's request to a replica
//! whose engine holds a queue), **KV usage** and **KV capacity** where the engine reports them, and
//! the most requests the engine runs at once (its **concurrency limit**) where it says:
//!
//! | dialect | running | waiting | KV usage / capacity | concurrency limit |
//! |---|---|---|---|---|
//! | vLLM | `vllm:num_requests_running` | `vllm:num_requests_waiting` | `vllm:kv_cache_usage_perc` / `vllm:cache_config_info` | — (not in its metrics) |
//! | SGLang | `sglang:num_running_reqs` | `sglang:num_queue_reqs` | `sglang:token_usage` / `sglang:max_total_num_tokens` | `GET /get_server_info` `max_running_requests` (the scheduler's effective one where it says) |
//! | llama.cpp | `llamacpp:requests_processing` | `llamacpp:requests_deferred` | — | `GET /props` `total_slots` |
//! | TGI | `tgi_batch_current_size` | `tgi_queue_size` | — | — |
//!
//! The dialect is detected from the metric names `/metrics` serves (or forced per pool with
//! `engine:`). Several series of one name (data-parallel engines) add up; KV usage takes the
//! fullest. A line weir reads whose value is not a finite, non-negative number is ignored and
//! reported to the caller, never trusted and never a panic.

use serde_json::Value;

use crate::config::engine::EngineChoice;

/// An engine's metric dialect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    Vllm,
    Sglang,
    Llamacpp,
    Tgi,
}

impl EngineChoice {
    /// The dialect of a replica whose `/metrics` said `metrics`: the configured one, else the
    /// one its metric names show (`None`: no engine weir knows).
    pub fn dialect(self, metrics: &str) -> Option<Dialect> {
        match self {
            EngineChoice::Auto => Dialect::detect(metrics),
            EngineChoice::Vllm => Some(Dialect::Vllm),
            EngineChoice::Sglang => Some(Dialect::Sglang),
            EngineChoice::Llamacpp => Some(Dialect::Llamacpp),
            EngineChoice::Tgi => Some(Dialect::Tgi),
        }
    }
}

/// What a replica's `/metrics` said last.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineSample {
    /// Fraction of the engine's KV in use (0 when it does not say).
    pub kv_usage: f64,
    pub waiting: u64,
    pub running: u64,
    /// KV capacity in tokens, when the metrics carry it.
    pub kv_tokens: Option<u64>,
}

/// What an engine says of its own limits, read when a replica joins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineLimits {
    /// Requests it runs at once; more wait inside it.
    pub max_concurrency: Option<u64>,
    /// KV capacity in tokens.
    pub kv_tokens: Option<u64>,
}

/// The figure a metric line carries, in one dialect.
enum Figure {
    Running,
    Waiting,
    KvUsage,
    KvTokens,
    /// vLLM's info metric: KV capacity is `num_gpu_blocks × block_size`, in its labels.
    VllmCacheConfig,
}

impl Dialect {
    /// Whether it continues a final assistant message (vLLM's `continue_final_message`, which
    /// SGLang reads too; llama.cpp does it by itself): what resuming a preempted stream needs.
    pub fn resumes(self) -> bool {
        !matches!(self, Dialect::Tgi)
    }

    /// Whether the engine closes a connection once it has streamed a response on it, though its
    /// headers say keep-alive (llama.cpp's server). Taken back from the pool for the next
    /// request (at once, when that one was queued for the slot), such a connection fails it:
    /// "connection closed before message completed", nothing run, the replica marked failed.
    pub fn closes_after_a_stream(self) -> bool {
        matches!(self, Dialect::Llamacpp)
    }

    /// `gen_ai.provider.name` of an engine speaking `dialect`, or `openai` for one whose
    /// dialect weir does not know (it speaks OpenAI's API).
    pub fn provider(dialect: Option<Dialect>) -> &'static str {
        dialect.map_or("openai", Dialect::name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Dialect::Vllm => "vllm",
            Dialect::Sglang => "sglang",
            Dialect::Llamacpp => "llamacpp",
            Dialect::Tgi => "tgi",
        }
    }

    /// The dialect of the first metric name it recognises.
    pub fn detect(metrics: &str) -> Option<Dialect> {
        metrics.lines().filter_map(metric_name).find_map(|name| {
            let prefixes = [
                ("vllm:", Dialect::Vllm),
                ("sglang:", Dialect::Sglang),
                ("llamacpp:", Dialect::Llamacpp),
                ("tgi_", Dialect::Tgi),
            ];
            prefixes
                .into_iter()
                .find(|(prefix, _)| name.starts_with(prefix))
                .map(|(_, dialect)| dialect)
        })
    }

    fn figure(self, name: &str) -> Option<Figure> {
        let figure = match (self, name) {
            (Dialect::Vllm, "vllm:num_requests_running")
            | (Dialect::Sglang, "sglang:num_running_reqs")
            | (Dialect::Llamacpp, "llamacpp:requests_processing")
            | (Dialect::Tgi, "tgi_batch_current_size") => Figure::Running,
            (Dialect::Vllm, "vllm:num_requests_waiting")
            | (Dialect::Sglang, "sglang:num_queue_reqs")
            | (Dialect::Llamacpp, "llamacpp:requests_deferred")
            | (Dialect::Tgi, "tgi_queue_size") => Figure::Waiting,
            // `gpu_cache_usage_perc` is the name vLLM used before 0.10.
            (Dialect::Vllm, "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc")
            | (Dialect::Sglang, "sglang:token_usage") => Figure::KvUsage,
            (Dialect::Sglang, "sglang:max_total_num_tokens") => Figure::KvTokens,
            (Dialect::Vllm, "vllm:cache_config_info") => Figure::VllmCacheConfig,
            _ => return None,
        };
        Some(figure)
    }

    /// Reads the figures weir needs from a Prometheus/OpenMetrics exposition in this dialect.
    /// `bad_line` gets each line weir would have read but whose value it cannot trust.
    pub fn parse(self, metrics: &str, mut bad_line: impl FnMut(&str)) -> EngineSample {
        let mut sample = EngineSample::default();
        for raw in metrics.lines() {
            let Some(figure) = metric_name(raw).and_then(|name| self.figure(name)) else {
                continue;
            };
            let line = parse_line(raw);
            let value = line.as_ref().and_then(|l| l.value.parse::<f64>().ok());
            let (Some(line), Some(value)) = (line, value.filter(|v| v.is_finite() && *v >= 0.0))
            else {
                bad_line(raw);
                continue;
            };
            match figure {
                // Saturating: an engine's absurd figures must not wrap (or panic) weir.
                Figure::Running => sample.running = sample.running.saturating_add(value as u64),
                Figure::Waiting => sample.waiting = sample.waiting.saturating_add(value as u64),
                Figure::KvUsage => sample.kv_usage = sample.kv_usage.max(value.min(1.0)),
                Figure::KvTokens => add(&mut sample.kv_tokens, value as u64),
                Figure::VllmCacheConfig => {
                    let number = |key| label(line.labels, key)?.parse::<u64>().ok();
                    // Blocks are "None" until the engine has profiled its memory.
                    if let Some(blocks) = number("num_gpu_blocks") {
                        let block_size = number("block_size").unwrap_or(16);
                        add(&mut sample.kv_tokens, blocks.saturating_mul(block_size));
                    }
                }
            }
        }
        sample
    }

    /// Where the engine says how many requests it runs at once, if it says so anywhere.
    pub fn limits_path(self) -> Option<&'static str> {
        match self {
            Dialect::Llamacpp => Some("/props"),
            Dialect::Sglang => Some("/get_server_info"),
            Dialect::Vllm | Dialect::Tgi => None,
        }
    }

    /// Reads the answer from [`limits_path`](Self::limits_path); `None` when it says nothing
    /// weir can use (not JSON, or no limit in it).
    pub fn parse_limits(self, body: &str) -> Option<EngineLimits> {
        let v: Value = serde_json::from_str(body).ok()?;
        let positive = |v: &Value| v.as_u64().filter(|&n| n > 0);
        let limits = match self {
            Dialect::Llamacpp => EngineLimits {
                max_concurrency: positive(&v["total_slots"]),
                kv_tokens: None,
            },
            // The scheduler's own view (`internal_states`) is what it runs with: current SGLang
            // says `effective_max_running_requests_per_dp` (per data-parallel rank); the top
            // level holds the server arguments.
            Dialect::Sglang => {
                let scheduler = &v["internal_states"][0];
                let either = |key: &str| positive(&scheduler[key]).or_else(|| positive(&v[key]));
                let ranks = positive(&v["dp_size"]).unwrap_or(1);
                let effective = positive(&scheduler["effective_max_running_requests_per_dp"])
                    .map(|n| n.saturating_mul(ranks));
                EngineLimits {
                    max_concurrency: effective.or_else(|| either("max_running_requests")),
                    kv_tokens: either("max_total_num_tokens"),
                }
            }
            Dialect::Vllm | Dialect::Tgi => return None,
        };
        limits.max_concurrency.map(|_| limits)
    }
}

fn add(total: &mut Option<u64>, n: u64) {
    *total = Some(total.unwrap_or(0).saturating_add(n));
}

/// One sample of an exposition, `name{labels} value [timestamp]`, after its name.
struct Line<'a> {
    /// Between the braces, unparsed.
    labels: &'a str,
    value: &'a str,
}

/// The metric a line is a sample of (`None` for comments and blank lines).
fn metric_name(line: &str) -> Option<&str> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    Some(&line[..end])
}

fn parse_line(line: &str) -> Option<Line<'_>> {
    let line = line.trim();
    let name = metric_name(line)?;
    let rest = &line[name.len()..];
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let close = closing_brace(inner)?;
            (&inner[..close], &inner[close + 1..])
        }
        None => ("", rest),
    };
    let value = rest.split_whitespace().next()?;
    Some(Line { labels, value })
}

/// Where the label block closes: the first `}` outside a quoted value.
fn closing_brace(labels: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in labels.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// A label's value (escapes left as they are: weir reads only numbers from labels).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let (name, after) = rest.split_once("=\"")?;
        let end = closing_quote(after)?;
        if name.trim_start_matches([',', ' ']) == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
}

fn closing_quote(value: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in value.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = include_str!("../../tests/fixtures/vllm-0.32-metrics.prom");
    const SGLANG: &str = include_str!("../../tests/fixtures/sglang-metrics.prom");
    const LLAMACPP: &str = include_str!("../../tests/fixtures/llamacpp-metrics.prom");
    const LLAMACPP_PROPS: &str = include_str!("../../tests/fixtures/llamacpp-props.json");
    const SGLANG_INFO: &str = include_str!("../../tests/fixtures/sglang-server-info.json");
    /// TGI's gauges as its metrics reference names them (no capture at hand).
    const TGI: &str = "# TYPE tgi_queue_size gauge\ntgi_queue_size 3\n\
        # TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 12\n\
        tgi_batch_current_max_tokens 4096\n";

    fn parse(dialect: Dialect, text: &str) -> (EngineSample, Vec<String>) {
        let mut bad = Vec::new();
        let sample = dialect.parse(text, |l| bad.push(l.to_owned()));
        (sample, bad)
    }

    #[test]
    fn each_engine_is_recognised_by_its_metric_names() {
        assert_eq!(Dialect::detect(VLLM), Some(Dialect::Vllm));
        assert_eq!(Dialect::detect(SGLANG), Some(Dialect::Sglang));
        assert_eq!(Dialect::detect(LLAMACPP), Some(Dialect::Llamacpp));
        assert_eq!(Dialect::detect(TGI), Some(Dialect::Tgi));
        let other = "# HELP process_cpu_seconds_total x\nprocess_cpu_seconds_total 1.5\n";
        assert_eq!(Dialect::detect(other), None);
        assert_eq!(Dialect::detect(""), None);
        assert_eq!(
            EngineChoice::Llamacpp.dialect(VLLM),
            Some(Dialect::Llamacpp)
        );
        assert_eq!(EngineChoice::Auto.dialect(SGLANG), Some(Dialect::Sglang));
    }

    #[test]
    fn reads_a_real_vllm_exposition() {
        let (s, bad) = parse(Dialect::Vllm, VLLM);
        assert!(bad.is_empty(), "{bad:?}");
        // 8192 blocks of 128 tokens; `num_requests_waiting_by_reason` is not the waiting count.
        assert_eq!(
            s,
            EngineSample {
                kv_usage: 0.0,
                waiting: 0,
                running: 0,
                kv_tokens: Some(1_048_576),
            }
        );
        let busy = "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"capacity\"} 3.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 7.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n";
        let (s, _) = parse(Dialect::Vllm, busy);
        assert_eq!((s.waiting, s.running, s.kv_usage), (3, 9, 0.5));
    }

    #[test]
    fn reads_sglang_llamacpp_and_tgi_expositions() {
        let (s, bad) = parse(Dialect::Sglang, SGLANG);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(
            (s.running, s.waiting, s.kv_usage, s.kv_tokens),
            (162, 2826, 0.28, Some(442_393))
        );
        let (s, bad) = parse(Dialect::Llamacpp, LLAMACPP);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(s, EngineSample::default(), "idle, and no KV figures");
        let deferred = LLAMACPP
            .replace(
                "llamacpp:requests_processing 0",
                "llamacpp:requests_processing 4",
            )
            .replace(
                "llamacpp:requests_deferred 0",
                "llamacpp:requests_deferred 5",
            );
        let (s, _) = parse(Dialect::Llamacpp, &deferred);
        assert_eq!((s.running, s.waiting, s.kv_tokens), (4, 5, None));
        let (s, _) = parse(Dialect::Tgi, TGI);
        assert_eq!((s.running, s.waiting, s.kv_tokens), (12, 3, None));
    }

    #[test]
    fn another_dialect_s_names_are_not_read() {
        assert_eq!(parse(Dialect::Llamacpp, VLLM).0, EngineSample::default());
        assert_eq!(parse(Dialect::Vllm, SGLANG).0, EngineSample::default());
    }

    #[test]
    fn garbage_lines_are_ignored_and_reported() {
        let text = "vllm:num_requests_waiting{engine=\"0\"} NaN\n\
            vllm:num_requests_waiting{engine=\"1\"} -4\n\
            vllm:num_requests_running{engine=\"0\"} lots\n\
            vllm:num_requests_running{engine=\"0\"\n\
            vllm:num_requests_running{engine=\"1\"} 2 1700000000000\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} +Inf\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0\n\
            \u{0}\u{ff}{{{}}} 12\n\
            vllm:num_requests_waiting{weird=\"a } b\",other=\"x\\\"y\"} 1\n";
        let (s, bad) = parse(Dialect::Vllm, text);
        assert_eq!(
            (s.waiting, s.running, s.kv_usage, s.kv_tokens),
            (1, 2, 0.0, None),
            "a timestamp after the value and braces in quoted labels are read right"
        );
        assert_eq!(bad.len(), 5, "{bad:?}");
    }

    #[test]
    fn huge_series_saturate_rather_than_overflow() {
        let text = "vllm:num_requests_running{engine=\"0\"} 1e19\n\
            vllm:num_requests_running{engine=\"1\"} 1e19\n\
            vllm:num_requests_waiting{engine=\"0\"} 1e300\n\
            vllm:num_requests_waiting{engine=\"1\"} 1e300\n";
        let (s, bad) = parse(Dialect::Vllm, text);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!((s.running, s.waiting), (u64::MAX, u64::MAX));
    }

    #[test]
    fn engines_say_their_concurrency_limits() {
        assert_eq!(
            Dialect::Llamacpp.parse_limits(LLAMACPP_PROPS),
            Some(EngineLimits {
                max_concurrency: Some(4),
                kv_tokens: None,
            })
        );
        assert_eq!(
            Dialect::Sglang.parse_limits(SGLANG_INFO),
            Some(EngineLimits {
                max_concurrency: Some(128),
                kv_tokens: Some(20_480),
            })
        );
        // The scheduler's figure is read first; the server arguments are the fallback.
        let info = r#"{"max_running_requests": null, "max_total_num_tokens": 900,
            "internal_states": [{"max_running_requests": 48}]}"#;
        assert_eq!(
            Dialect::Sglang.parse_limits(info),
            Some(EngineLimits {
                max_concurrency: Some(48),
                kv_tokens: Some(900),
            })
        );
        let per_rank = r#"{"max_running_requests": 64, "dp_size": 2,
            "internal_states": [{"effective_max_running_requests_per_dp": 24}]}"#;
        assert_eq!(
            Dialect::Sglang
                .parse_limits(per_rank)
                .and_then(|l| l.max_concurrency),
            Some(48)
        );
        let top_only = r#"{"max_running_requests": 16}"#;
        assert_eq!(
            Dialect::Sglang
                .parse_limits(top_only)
                .and_then(|l| l.max_concurrency),
            Some(16)
        );
        assert_eq!(Dialect::Llamacpp.limits_path(), Some("/props"));
        assert_eq!(Dialect::Sglang.limits_path(), Some("/get_server_info"));
        assert_eq!(Dialect::Vllm.limits_path(), None);
        assert_eq!(Dialect::Tgi.limits_path(), None);
    }

    #[test]
    fn garbage_limits_are_no_limits() {
        for body in [
            "",
            "<html>",
            "[]",
            r#"{"total_slots": 0}"#,
            r#"{"total_slots": -3}"#,
            r#"{"total_slots": "4"}"#,
            r#"{"total_slots": 2.5}"#,
            r#"{"n_ctx": 2048}"#,
        ] {
            assert_eq!(Dialect::Llamacpp.parse_limits(body), None, "{body}");
        }
        assert_eq!(
            Dialect::Sglang.parse_limits(r#"{"internal_states": 3}"#),
            None
        );
    }
}

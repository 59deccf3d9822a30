use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use axum::serve::ListenerExt;
use clap::Parser;
use tracing_subscriber::EnvFilter;
use weir_sim::app::{App, Settings};
use weir_sim::dialect::DialectName;
use weir_sim::driver::EngineHandle;
use weir_sim::faults::{FaultFlags, Faults};
use weir_sim::profile::{OutputLength, Profile};
use weir_sim::server::router;
use weir_sim::shape::ShapeFlags;

/// An OpenAI-compatible LLM engine simulator with vLLM's scheduling physics, playing vLLM,
/// SGLang or llama.cpp on the wire.
///
/// Models continuous batching, a paged KV cache (16-token blocks), chunked prefill, preemption
/// and a salted prefix cache, with step times from a roofline of the model and GPU profile.
/// Prints `weir-sim listening on http://ADDR` on stdout once it accepts connections.
#[derive(Parser, Debug)]
#[command(name = "weir-sim", version)]
struct Cli {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind; 0 picks a free one (read it from the first line on stdout).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// A built-in model × GPU profile: llama-3.1-8b, llama-3.1-70b, glm-5.2 or tiny.
    #[arg(long, default_value = "llama-3.1-8b", conflicts_with = "profile")]
    preset: String,
    /// A profile file (JSON or YAML) instead of a preset; see `--print-profile` for the format.
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
    /// Model seconds per wall-clock second: 10 runs the GPU ten times faster than real.
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    time_scale: f64,
    /// The model name served on the API (defaults to the profile's).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Seed for generated text and lengths (a request's own `seed` takes precedence).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Natural output length: `fixed:N`, `uniform:MIN-MAX`, `exp:MEAN` or `lognormal:MEDIAN,SIGMA`.
    #[arg(long, value_name = "DIST", value_parser = parse_output_len)]
    output_len: Option<OutputLength>,
    /// Which engine to play: its metric names, info endpoints, errors, wire shape and
    /// admission (vllm: as vLLM; sglang: as SGLang; llamacpp: as llama.cpp's llama-server).
    #[arg(long, value_enum, default_value = "vllm", value_name = "ENGINE")]
    metrics_dialect: DialectName,
    /// Largest number of sequences in one batch.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// llama.cpp's slots (its `--parallel`): the sequences it runs at once, each with an equal
    /// share of the KV cache as its context; more requests wait inside the engine.
    /// Only with `--metrics-dialect llamacpp`, where it defaults to 4.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    slots: Option<u16>,
    /// Token budget of one step (prefill chunks plus decode tokens).
    #[arg(long)]
    max_num_batched_tokens: Option<u64>,
    /// Prefill whole prompts in one step instead of budget-sized chunks.
    #[arg(long)]
    no_chunked_prefill: bool,
    /// Never reuse cached prefix blocks.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Fraction of HBM the engine may use for weights and KV cache.
    #[arg(long, value_name = "F")]
    gpu_memory_utilization: Option<f64>,
    /// Largest request body accepted; larger ones get 413.
    #[arg(long, default_value_t = 32 * 1024 * 1024, value_name = "BYTES")]
    max_body_bytes: usize,
    /// Keep the last N requests (headers and body) for `GET /debug/requests`, so tests can see
    /// what a proxy in front forwarded. Off by default: prompts are never kept otherwise.
    #[arg(long, default_value_t = 0, value_name = "N")]
    record_requests: usize,
    #[command(flatten)]
    faults: FaultFlags,
    #[command(flatten)]
    shape: ShapeFlags,
    /// Print the resolved profile as YAML and exit.
    #[arg(long)]
    print_profile: bool,
}

/// llama-server's slots when `--parallel` is not given.
const DEFAULT_SLOTS: u16 = 4;

fn parse_output_len(s: &str) -> Result<OutputLength, String> {
    let (kind, args) = s.split_once(':').ok_or("expected KIND:ARGS")?;
    let num = |v: &str| v.trim().parse::<f64>().map_err(|e| format!("{v}: {e}"));
    match kind {
        "fixed" => Ok(OutputLength::Fixed {
            tokens: num(args)? as u32,
        }),
        "uniform" => {
            let (a, b) = args.split_once('-').ok_or("uniform:MIN-MAX")?;
            Ok(OutputLength::Uniform {
                min: num(a)? as u32,
                max: num(b)? as u32,
            })
        }
        "exp" => Ok(OutputLength::Exponential { mean: num(args)? }),
        "lognormal" => {
            let (m, s) = args.split_once(',').ok_or("lognormal:MEDIAN,SIGMA")?;
            Ok(OutputLength::LogNormal {
                median: num(m)?,
                sigma: num(s)?,
            })
        }
        other => Err(format!("unknown distribution '{other}'")),
    }
}

impl Cli {
    fn resolve_profile(&self) -> anyhow::Result<Profile> {
        let mut p = match &self.profile {
            Some(path) => Profile::from_file(path)?,
            None => Profile::preset(&self.preset)?,
        };
        let e = &mut p.engine;
        e.max_num_seqs = match (self.metrics_dialect, self.slots, self.max_num_seqs) {
            (DialectName::Llamacpp, _, Some(_)) => {
                bail!("llama.cpp runs --slots sequences at once, not --max-num-seqs")
            }
            (DialectName::Llamacpp, slots, None) => usize::from(slots.unwrap_or(DEFAULT_SLOTS)),
            (_, Some(_), _) => {
                bail!("--slots is llama.cpp's; use it with --metrics-dialect llamacpp")
            }
            (_, None, seqs) => seqs.unwrap_or(e.max_num_seqs),
        };
        e.max_num_batched_tokens = self
            .max_num_batched_tokens
            .unwrap_or(e.max_num_batched_tokens);
        e.gpu_memory_utilization = self
            .gpu_memory_utilization
            .unwrap_or(e.gpu_memory_utilization);
        e.enable_chunked_prefill &= !self.no_chunked_prefill;
        e.enable_prefix_caching &= !self.no_prefix_caching;
        if let Some(output) = &self.output_len {
            p.output = output.clone();
        }
        if let Some(name) = &self.served_model_name {
            p.model.name = name.clone();
        }
        p.validate()?;
        Ok(p)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let profile = cli.resolve_profile()?;
    if cli.print_profile {
        print!("{}", serde_yaml_ng::to_string(&profile)?);
        return Ok(());
    }
    if !(cli.time_scale.is_finite() && cli.time_scale > 0.0) {
        bail!("--time-scale must be a positive number");
    }
    for (flag, rate) in [
        ("--error-rate", cli.faults.error_rate),
        ("--throttle-rate", cli.faults.throttle_rate),
    ] {
        if !(0.0..=1.0).contains(&rate) {
            bail!("{flag} must be between 0 and 1");
        }
    }

    let (dialect, metrics) = cli.metrics_dialect.build(&profile);
    let engine = EngineHandle::spawn(profile.clone(), cli.time_scale, metrics)?;
    let model = profile.model.name.clone();
    let summary = format!(
        "{:?} dialect, model {model}, {} KV blocks = {} tokens, time-scale {}",
        cli.metrics_dialect,
        profile.kv_blocks(),
        profile.kv_capacity_tokens(),
        cli.time_scale
    );
    let settings = Settings {
        model,
        seed: cli.seed,
        max_body_bytes: cli.max_body_bytes,
        record_requests: cli.record_requests,
        shape: cli.shape.clone(),
    };
    let faults = Faults::new(cli.faults.clone(), cli.seed);
    let app = App::new(engine, profile, dialect, faults, settings);

    let addr: SocketAddr = format!("{}:{}", cli.host, cli.port)
        .parse()
        .with_context(|| format!("invalid address {}:{}", cli.host, cli.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    println!(
        "weir-sim listening on http://{} ({summary})",
        listener.local_addr()?
    );
    // Tokens are small writes: without TCP_NODELAY, Nagle holds them for the peer's delayed ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let server = axum::serve(listener, router(Arc::new(app)));
    tokio::select! {
        result = server => result?,
        _ = shutdown_signal() => {}
    }
    Ok(())
}

/// Ctrl-C or SIGTERM: exit at once; in-flight streams end with the process, as an engine's do.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

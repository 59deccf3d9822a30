//! Each replica's health check: its `/metrics` read every [`PROBE_EVERY`], which is also how
//! weir learns its engine's load. When a replica joins — its first answer, the first after it
//! was unreachable, or the first after its metrics showed another engine than it joined as —
//! its engine's limits are read first ([`ReplicaEvent::Joined`]) and its
//! prefix-cache isolation probed ([`crate::replica::isolation_probe`]) before it gets work.
//!
//! The dispatcher starts and stops one check per replica as replicas join and leave
//! ([`Command`], run by [`supervise`]). Each check follows its pool's [`Link`]: a reload that
//! changes the pool's CA or credential takes effect at the next read; one that changes its
//! engine dialect or isolation policy makes every replica of it join again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::engine::CacheIsolation;
use crate::config::engine::EngineChoice;
use crate::replica::engine::{Dialect, EngineLimits, EngineSample};
use crate::replica::event::ReplicaEvent;
use crate::replica::isolation_probe::Prober;
use crate::replica::pool::ReplicaId;
use crate::replica::upstream::Upstream;
use crate::support::answer::{MAX_ANSWER_BYTES, read_bounded};

/// How often each replica's `/metrics` is read.
pub const PROBE_EVERY: Duration = Duration::from_millis(100);

/// What a pool's health checks need of its config.
#[derive(Debug)]
pub struct Link {
    pub model: String,
    pub engine: EngineChoice,
    pub cache_isolation: CacheIsolation,
    pub upstream: Arc<Upstream>,
}

impl PartialEq for Link {
    /// The same settings and the same upstream (each reload builds its own, from the files it
    /// read).
    fn eq(&self, other: &Link) -> bool {
        (&self.model, self.engine, self.cache_isolation)
            == (&other.model, other.engine, other.cache_isolation)
            && Arc::ptr_eq(&self.upstream, &other.upstream)
    }
}

impl Link {
    /// Whether replicas must join again under `other`: what they are was read under this.
    fn rejoin_under(&self, other: &Link) -> bool {
        (self.engine, self.cache_isolation) != (other.engine, other.cache_isolation)
    }
}

/// Sent by the dispatcher as replicas join and leave.
pub enum Command {
    Start {
        pool: usize,
        replica: ReplicaId,
        url: String,
        link: watch::Receiver<Arc<Link>>,
    },
    Stop {
        pool: usize,
        replica: ReplicaId,
    },
}

/// Runs the health checks the dispatcher asks for, until it stops asking.
pub async fn supervise<E: From<ReplicaEvent> + Send + 'static>(
    mut commands: mpsc::UnboundedReceiver<Command>,
    events: mpsc::UnboundedSender<E>,
) {
    let mut checks: HashMap<(usize, ReplicaId), JoinHandle<()>> = HashMap::new();
    while let Some(command) = commands.recv().await {
        match command {
            Command::Start {
                pool,
                replica,
                url,
                link,
            } => {
                let task = tokio::spawn(check(events.clone(), pool, replica, url, link));
                if let Some(old) = checks.insert((pool, replica), task) {
                    old.abort();
                }
            }
            Command::Stop { pool, replica } => {
                if let Some(task) = checks.remove(&(pool, replica)) {
                    task.abort();
                }
            }
        }
        checks.retain(|_, task| !task.is_finished());
    }
    for task in checks.into_values() {
        task.abort();
    }
}

/// Reads a replica's metrics until stopped; an unreadable replica is reported unhealthy and
/// ejected until it answers again.
async fn check<E: From<ReplicaEvent> + Send + 'static>(
    events: mpsc::UnboundedSender<E>,
    pool: usize,
    replica: ReplicaId,
    url: String,
    mut link: watch::Receiver<Arc<Link>>,
) {
    let current = link.borrow_and_update().clone();
    let mut check = Check {
        isolation: prober(&current, &url),
        events,
        pool,
        replica,
        url,
        link,
        current,
        joined: None,
        warned: false,
    };
    let mut tick = tokio::time::interval(PROBE_EVERY);
    // An isolation probe takes a while: no burst of catch-up reads after it.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if check.round().await.is_err() {
            return;
        }
    }
}

/// The dispatcher is gone (its events' receiver dropped): the check ends.
struct Gone;

/// One replica's check, between its reads.
struct Check<E> {
    events: mpsc::UnboundedSender<E>,
    pool: usize,
    replica: ReplicaId,
    url: String,
    link: watch::Receiver<Arc<Link>>,
    /// The pool's settings the replica is read under.
    current: Arc<Link>,
    isolation: Prober,
    /// Once joined, the dialect it joined as: what the dispatcher holds of it (`ReplicaEvent::Joined`).
    joined: Option<Option<Dialect>>,
    /// Odd engine output is logged once per replica, not ten times a second.
    warned: bool,
}

/// The isolation prober of the replica at `url` under `link`'s settings.
fn prober(link: &Link, url: &str) -> Prober {
    Prober::new(
        link.upstream.clone(),
        url.to_owned(),
        link.model.clone(),
        link.cache_isolation,
    )
}

impl<E: From<ReplicaEvent>> Check<E> {
    /// One read: the pool's settings followed, the sample reported, and the isolation probe
    /// stepped on.
    async fn round(&mut self) -> Result<(), Gone> {
        self.follow_link();
        let sample = self.sample().await?;
        let healthy = sample.is_some();
        let (pool, replica) = (self.pool, self.replica);
        self.send(ReplicaEvent::Sample {
            pool,
            replica,
            sample,
        })?;
        if let Some(isolation) = self.isolation.after_sample(healthy).await {
            self.send(ReplicaEvent::Isolated {
                pool,
                replica,
                isolation,
            })?;
        }
        Ok(())
    }

    fn send(&self, event: ReplicaEvent) -> Result<(), Gone> {
        self.events.send(event.into()).map_err(|_| Gone)
    }

    /// Takes the pool's new settings, if a reload changed them: a new dialect or isolation
    /// policy makes the replica join again, a new CA or credential takes effect at this read.
    fn follow_link(&mut self) {
        if !self.link.has_changed().unwrap_or(false) {
            return;
        }
        let next = self.link.borrow_and_update().clone();
        if self.current.rejoin_under(&next) {
            tracing::info!(replica = %self.url, "pool settings changed: the replica joins again");
            self.isolation = prober(&next, &self.url);
            self.joined = None;
        } else {
            self.isolation.set_upstream(next.upstream.clone());
        }
        self.current = next;
    }

    /// The engine's figures from its `/metrics`, `None` when it did not answer (or another
    /// engine did); a replica that joins is announced first.
    async fn sample(&mut self) -> Result<Option<EngineSample>, Gone> {
        let url = format!("{}/metrics", self.url);
        let Some(text) = get_text(&self.current.upstream, &url).await else {
            self.joined = None;
            return Ok(None);
        };
        let dialect = self.current.engine.dialect(&text);
        if self
            .joined
            .is_some_and(|joined_as| swapped(joined_as, dialect))
        {
            // Another engine answers at this address (a rolling update behind one URL): its
            // limits, its dialect (`Connection: close` for llama.cpp's streams) and its cache
            // isolation are not the last one's. Out for this read, it joins again at the
            // next, probed before it gets work, as after an outage.
            tracing::warn!(replica = %self.url, "another engine answers: the replica joins again");
            self.joined = None;
            return Ok(None);
        }
        if self.joined.is_none() {
            self.join(dialect).await?;
        }
        Ok(Some(self.parse(dialect, &text)))
    }

    /// The replica joins: its engine's limits read and sent to the dispatcher.
    async fn join(&mut self, dialect: Option<Dialect>) -> Result<(), Gone> {
        let limits = read_limits(&self.current.upstream, &self.url, dialect).await;
        tracing::info!(
            replica = %self.url,
            engine = dialect.map_or("unknown", Dialect::name),
            concurrency = ?limits.max_concurrency,
            kv_tokens = ?limits.kv_tokens,
            "replica joined"
        );
        self.send(ReplicaEvent::Joined {
            pool: self.pool,
            replica: self.replica,
            limits,
            dialect,
        })?;
        self.joined = Some(dialect);
        Ok(())
    }

    /// The sample in the engine's metrics `text`, read in its `dialect`.
    fn parse(&mut self, dialect: Option<Dialect>, text: &str) -> EngineSample {
        let (url, warned) = (&self.url, &mut self.warned);
        match dialect {
            Some(dialect) => dialect.parse(text, |line| {
                if !std::mem::replace(warned, true) {
                    tracing::warn!(replica = %url, "ignoring a metrics line weir cannot read: {line:.200}");
                }
            }),
            None => {
                if !std::mem::replace(warned, true) {
                    tracing::warn!(replica = %url, "no metrics of a known engine: admitted by its concurrency limit alone");
                }
                EngineSample::default()
            }
        }
    }
}

/// Whether a replica that joined as `joined_as` now shows the metrics of another engine. One
/// that shows none weir knows keeps what it joined as (its answer says nothing of its engine).
fn swapped(joined_as: Option<Dialect>, now: Option<Dialect>) -> bool {
    now.is_some() && now != joined_as
}

/// A successful answer's text, within a second and [`MAX_ANSWER_BYTES`].
async fn get_text(upstream: &Upstream, url: &str) -> Option<String> {
    let resp = upstream
        .get(url)
        .timeout(Duration::from_secs(1))
        .send()
        .await
        .ok()?;
    let body = read_bounded(resp.error_for_status().ok()?, MAX_ANSWER_BYTES).await?;
    Some(String::from_utf8_lossy(&body).into_owned())
}

/// What a replica's engine says of its limits: nothing for engines that do not say, or that
/// say it in a way weir cannot read (logged).
async fn read_limits(upstream: &Upstream, url: &str, dialect: Option<Dialect>) -> EngineLimits {
    let Some((dialect, path)) = dialect.and_then(|d| Some((d, d.limits_path()?))) else {
        return EngineLimits::default();
    };
    let limits = get_text(upstream, &format!("{url}{path}"))
        .await
        .and_then(|body| dialect.parse_limits(&body));
    limits.unwrap_or_else(|| {
        tracing::warn!(replica = %url, "no concurrency limit readable at {path}: the configured or adaptive limit holds");
        EngineLimits::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::Isolation;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-shot engine that answers any request with `len` bytes of metric comments.
    async fn engine_answering(len: usize) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let mut request = [0u8; 4096];
            let _ = conn.read(&mut request).await;
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
            let _ = conn.write_all(head.as_bytes()).await;
            let line = b"# filler\n".repeat(1 << 16);
            let mut sent = 0;
            while sent < len {
                let n = line.len().min(len - sent);
                if conn.write_all(&line[..n]).await.is_err() {
                    return;
                }
                sent += n;
            }
        });
        url
    }

    /// An engine whose `/metrics` are vLLM's for its first `vllm_reads` answers, then
    /// llama.cpp's (4 slots at `/props`): another engine behind the same URL.
    async fn engine_swapped_after(vllm_reads: usize) -> String {
        use axum::routing::get;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let reads = Arc::new(AtomicUsize::new(0));
        let metrics = move || {
            let reads = reads.clone();
            async move {
                if reads.fetch_add(1, Ordering::Relaxed) < vllm_reads {
                    "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                } else {
                    "llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n"
                }
            }
        };
        // Isolation probes read no cached tokens: found unisolated, each time.
        let chat = || async { r#"{"usage": {"prompt_tokens_details": {"cached_tokens": 0}}}"# };
        let router = axum::Router::new()
            .route("/metrics", get(metrics))
            .route("/props", get(|| async { r#"{"total_slots": 4}"# }))
            .route("/v1/chat/completions", axum::routing::post(chat));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await });
        url
    }

    #[tokio::test]
    async fn a_replica_behind_which_another_engine_answers_joins_again_as_that_engine() {
        let url = engine_swapped_after(3).await;
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let link = watch::Sender::new(Arc::new(Link {
            model: "m".into(),
            engine: EngineChoice::Auto,
            cache_isolation: CacheIsolation::Probe,
            upstream: Upstream::plain(),
        }));
        let task = tokio::spawn(check(events_tx, 0, 0, url, link.subscribe()));
        let (mut joined, mut out_between, mut isolations) = (Vec::new(), false, Vec::new());
        let watched = tokio::time::timeout(Duration::from_secs(3), async {
            while let Some(event) = events.recv().await {
                match event {
                    ReplicaEvent::Joined {
                        dialect, limits, ..
                    } => {
                        joined.push((dialect, limits.max_concurrency));
                        if joined.len() == 2 {
                            return;
                        }
                    }
                    ReplicaEvent::Sample { sample: None, .. } => out_between = !joined.is_empty(),
                    ReplicaEvent::Isolated { isolation, .. } => isolations.push(isolation),
                    _ => {}
                }
            }
        })
        .await;
        task.abort();
        assert!(watched.is_ok(), "joined only as {joined:?}");
        assert_eq!(
            joined,
            [
                (Some(Dialect::Vllm), None),
                (Some(Dialect::Llamacpp), Some(4))
            ]
        );
        assert!(out_between, "no work between the two engines");
        assert_eq!(
            isolations.last(),
            Some(&Isolation::Unprobed),
            "what was probed of the last engine no longer holds: {isolations:?}"
        );
    }

    #[tokio::test]
    async fn an_engine_s_oversized_answer_is_not_read_whole() {
        let upstream = Upstream::plain();
        let small = engine_answering(1_000).await;
        assert_eq!(
            get_text(&upstream, &small).await.map(|t| t.len()),
            Some(1_000)
        );
        let huge = engine_answering(256 << 20).await;
        assert_eq!(get_text(&upstream, &huge).await.map(|t| t.len()), None);
    }
}

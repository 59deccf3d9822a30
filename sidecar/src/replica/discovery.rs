//! Replicas found in DNS: a pool's `discovery: {dns, port, scheme, interval_ms}` names a
//! Kubernetes headless Service (or any name with one address per engine), resolved again every
//! `interval_ms`; each answer becomes the pool's discovered set, and replicas join and leave as
//! it changes ([`crate::replica::roster`]).
//!
//! Names are resolved by a [`Resolver`]: the system's ([`SystemResolver`]: `getaddrinfo`
//! through tokio, so `/etc/resolv.conf` search domains and `/etc/hosts` apply as for any
//! program in the pod), or a file of names and addresses ([`FileResolver`], for tests and
//! set-ups without DNS). A resolution that fails (timeout, no such name, no answer) keeps the
//! last set: a DNS outage must not empty a pool, and replicas that really went away fail their
//! health checks and get no traffic anyway. An answer with no addresses (a file entry without
//! any) empties the set.

use std::collections::BTreeSet;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::config::DiscoveryConfig;
use crate::replica::event::ReplicaEvent;
use crate::replica::pool::url_of;

/// Longest one resolution may take before it counts as failed.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

pub type Resolution<'a> = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send + 'a>>;

/// Turns a name into the addresses of its replicas.
pub trait Resolver: Send + Sync {
    fn resolve<'a>(&'a self, name: &'a str, port: u16) -> Resolution<'a>;
}

/// The system's resolver (`getaddrinfo`, on tokio's blocking pool).
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve<'a>(&'a self, name: &'a str, port: u16) -> Resolution<'a> {
        Box::pin(async move { Ok(tokio::net::lookup_host((name, port)).await?.collect()) })
    }
}

/// Names and addresses from a file read at every resolution, one name a line:
/// `NAME ADDRESS ...`, each address an IP (the discovery's port is added) or `IP:PORT`; `#`
/// starts a comment. A name on no line does not resolve; a name alone on its line resolves to
/// no address.
pub struct FileResolver {
    pub path: PathBuf,
}

impl Resolver for FileResolver {
    fn resolve<'a>(&'a self, name: &'a str, port: u16) -> Resolution<'a> {
        Box::pin(async move {
            let text = tokio::fs::read_to_string(&self.path).await?;
            lookup(&text, name, port)
        })
    }
}

/// `name`'s addresses in a [`FileResolver`] file.
fn lookup(text: &str, name: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
    let line = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default())
        .find(|l| l.split_whitespace().next() == Some(name))
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{name}: no such name")))?;
    line.split_whitespace()
        .skip(1)
        .map(|a| {
            a.parse::<SocketAddr>()
                .or_else(|_| a.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, port)))
                .map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("{name}: {a} is not an address"),
                    )
                })
        })
        .collect()
}

/// The replica URLs of a resolution, deduplicated (`getaddrinfo` answers once per socket type).
pub fn replicas(spec: &DiscoveryConfig, addrs: &[SocketAddr]) -> BTreeSet<String> {
    addrs.iter().map(|a| url_of(spec.scheme, *a)).collect()
}

/// Resolves `spec` for the pool at index `pool` every `interval_ms`, for ever, and reports each
/// answer ([`ReplicaEvent::Discovered`]); ends when the dispatcher has gone.
pub async fn run<E: From<ReplicaEvent> + Send + 'static>(
    resolver: Arc<dyn Resolver>,
    pool: usize,
    spec: DiscoveryConfig,
    events: mpsc::UnboundedSender<E>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(spec.interval_ms.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    let mut last: Option<BTreeSet<String>> = None;
    loop {
        tick.tick().await;
        let answer =
            tokio::time::timeout(RESOLVE_TIMEOUT, resolver.resolve(&spec.dns, spec.port)).await;
        let found = match answer {
            Ok(Ok(addrs)) => replicas(&spec, &addrs),
            Ok(Err(e)) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(name = %spec.dns, "discovery: {e}; the pool keeps the replicas it has");
                }
                continue;
            }
            Err(_) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(name = %spec.dns, "discovery: no answer within {RESOLVE_TIMEOUT:?}; the pool keeps the replicas it has");
                }
                continue;
            }
        };
        if std::mem::replace(&mut failing, false) {
            tracing::info!(name = %spec.dns, "discovery: resolving again");
        }
        if last.as_ref() == Some(&found) {
            continue;
        }
        tracing::info!(name = %spec.dns, replicas = ?found, "discovery: the name's addresses changed");
        last = Some(found.clone());
        let event = ReplicaEvent::Discovered {
            pool,
            source: spec.clone(),
            replicas: found,
        };
        if events.send(event.into()).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Scheme;

    #[test]
    fn a_file_names_each_replica_s_address() {
        let file = "# replicas\nvllm.models 10.0.0.5 10.0.0.6:9000 # two\nempty\nv6 ::1\n";
        let found = lookup(file, "vllm.models", 8000).unwrap();
        assert_eq!(
            found,
            [
                "10.0.0.5:8000".parse::<SocketAddr>().unwrap(),
                "10.0.0.6:9000".parse().unwrap()
            ]
        );
        assert_eq!(lookup(file, "empty", 1).unwrap(), []);
        assert_eq!(lookup(file, "v6", 80).unwrap()[0].to_string(), "[::1]:80");
        assert_eq!(
            lookup(file, "missing", 1).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        assert!(lookup("bad 10.0.0.300", "bad", 1).is_err());
    }

    #[test]
    fn an_answer_becomes_the_pool_s_replica_urls() {
        let spec = DiscoveryConfig {
            dns: "svc".into(),
            port: 8443,
            scheme: Scheme::Https,
            interval_ms: 1000,
        };
        let a: SocketAddr = "10.0.0.5:8443".parse().unwrap();
        let found = replicas(&spec, &[a, a]);
        assert_eq!(
            found.into_iter().collect::<Vec<_>>(),
            ["https://10.0.0.5:8443"]
        );
    }

    /// Answers from a list, then fails.
    struct Scripted(std::sync::Mutex<Vec<io::Result<Vec<SocketAddr>>>>);

    impl Resolver for Scripted {
        fn resolve<'a>(&'a self, _: &'a str, _: u16) -> Resolution<'a> {
            let next = self.0.lock().ok().and_then(|mut v| v.pop());
            Box::pin(async move { next.unwrap_or_else(|| Err(io::Error::other("resolver down"))) })
        }
    }

    #[tokio::test]
    async fn each_new_answer_is_reported_and_a_failure_keeps_the_last() {
        let a: SocketAddr = "10.0.0.1:80".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:80".parse().unwrap();
        // Popped from the end: [a], [a] again (not reported), [a, b], then failures.
        let script = vec![Ok(vec![a, b]), Ok(vec![a]), Ok(vec![a])];
        let resolver: Arc<dyn Resolver> = Arc::new(Scripted(std::sync::Mutex::new(script)));
        let spec = DiscoveryConfig {
            dns: "svc".into(),
            port: 80,
            scheme: Scheme::Http,
            interval_ms: 1,
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(resolver, 3, spec, tx));
        let mut seen = Vec::new();
        for _ in 0..2 {
            match rx.recv().await {
                Some(ReplicaEvent::Discovered { pool, replicas, .. }) => {
                    assert_eq!(pool, 3);
                    seen.push(replicas.into_iter().collect::<Vec<_>>());
                }
                _ => panic!("not a discovery"),
            }
        }
        assert_eq!(
            seen,
            [
                vec!["http://10.0.0.1:80".to_owned()],
                vec![
                    "http://10.0.0.1:80".to_owned(),
                    "http://10.0.0.2:80".to_owned()
                ]
            ]
        );
        // Failures since: nothing more is reported.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(rx.try_recv().is_err());
        task.abort();
    }
}

//! How the sidecar's ports take connections. The serving port speaks HTTP/1.1 and HTTP/2
//! without TLS, so a gateway's streams share a few connections; the admin port speaks
//! HTTP/1.1 only: probes and Prometheus need nothing more, and over HTTP/2 one connection could
//! have up to [`STREAMS_PER_CONNECTION`] `/metrics` pages buffered for a reader that never
//! takes them.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// Streams one HTTP/2 connection may carry at once; past it a stream is refused
/// (`REFUSED_STREAM`, safe to retry) and a gateway opens another connection.
pub const STREAMS_PER_CONNECTION: u32 = 200;

/// Streams a peer may open and reset before the sidecar takes them up, per connection. h2's
/// default (20) answers more with GOAWAY, closing the connection: from a gateway that is every
/// tenant's streams on it cut because of one tenant's burst of cancelled requests. Such a
/// stream costs the sidecar almost nothing (no handler runs), so the bound only keeps a
/// flood's memory in check.
const PENDING_RESETS_PER_CONNECTION: usize = 10_000;

/// What a port speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocols {
    Http1AndHttp2,
    Http1,
}

/// Serves `router` on `listener` until `shutdown` resolves; then takes no new connection, asks
/// those open to finish (HTTP/2: GOAWAY) and returns once they have.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    protocols: Protocols,
    shutdown: impl Future<Output = ()>,
) {
    let builder = builder(protocols);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    pause_after(&e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Chunks are small writes: without TCP_NODELAY, Nagle holds them for the peer's
        // delayed ACK.
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let connection = builder
            .serve_connection(TokioIo::new(tcp), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

fn builder(protocols: Protocols) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    match protocols {
        Protocols::Http1 => builder.http1_only(),
        Protocols::Http1AndHttp2 => {
            builder
                .http2()
                .max_concurrent_streams(STREAMS_PER_CONNECTION)
                .max_pending_accept_reset_streams(PENDING_RESETS_PER_CONNECTION);
            builder
        }
    }
}

/// After a failed accept: nothing for a connection that failed on its own; a second's pause
/// when the process is out of file descriptors or memory (retrying at once would spin).
async fn pause_after(e: &std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if !matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        tracing::warn!("accepting a connection: {e}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

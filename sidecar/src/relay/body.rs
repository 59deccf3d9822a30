//! The pump's hand-over to the response body: a one-chunk channel the client's reads drain.

use std::time::Duration;

use axum::body::Bytes;
use tokio::sync::mpsc;

/// What the pump hands the response body.
pub(super) enum Piece {
    Chunk(Bytes),
    /// weir's closing event (an error and `[DONE]`), after what was still pending: nothing
    /// follows it.
    Last(Bytes),
    /// The stream is complete; without it, a closed channel means the pump gave up on the client.
    End,
}

/// How a chunk's hand-over to the client went.
pub(super) enum Delivery {
    Taken,
    ClientGone,
    ClientStalled,
}

/// Hands a piece to the response body, waiting at most `stall` for the client to take the last.
pub(super) async fn deliver(tx: &mpsc::Sender<Piece>, piece: Piece, stall: Duration) -> Delivery {
    match tokio::time::timeout(stall, tx.send(piece)).await {
        Ok(Ok(())) => Delivery::Taken,
        Ok(Err(_)) => Delivery::ClientGone,
        Err(_) => Delivery::ClientStalled,
    }
}

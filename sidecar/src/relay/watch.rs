//! What the pump waits on besides the replica and the client: how long each has kept it
//! waiting.

use std::time::Duration;

use tokio::time::Instant as TokioInstant;

/// Longest silence from a replica before the stream is declared lost.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the replica and the client have kept the pump waiting. One timer serves both; it
/// is moved when it fires and when bytes start waiting for the client with a limit before it,
/// never per chunk. On tokio's clock, as the timer is.
pub(super) struct Watch {
    idle: Duration,
    stall: Duration,
    /// Since when the pump has been waiting for the replica's next bytes.
    pub(super) replica_since: TokioInstant,
    /// Since when bytes have been pending for a client that has not taken the last chunk.
    pub(super) client_since: Option<TokioInstant>,
}

/// Who kept the pump waiting too long.
#[derive(Debug, PartialEq)]
pub(super) enum Lapse {
    /// No bytes from the replica for `IDLE_TIMEOUT` while the pump was reading.
    Replica,
    /// Bytes pending for the client longer than `relay.client_stall_ms`.
    Client,
}

impl Watch {
    pub(super) fn new(stall: Duration, now: TokioInstant) -> Watch {
        Watch {
            idle: IDLE_TIMEOUT,
            stall,
            replica_since: now,
            client_since: None,
        }
    }

    /// Bytes are pending for the client at `now`: when its limit is up, if they were not
    /// already.
    pub(super) fn client_waits(&mut self, now: TokioInstant) -> Option<TokioInstant> {
        if self.client_since.is_some() {
            return None;
        }
        self.client_since = Some(now);
        Some(now + self.stall)
    }

    /// The client took what was pending (or a resumed stream starts over) at `now`: neither
    /// has kept the pump waiting yet.
    pub(super) fn caught_up(&mut self, now: TokioInstant) {
        self.client_since = None;
        self.replica_since = now;
    }

    /// Who has lapsed at `now`; the replica counts only while the pump is `reading` it (while
    /// it is not, its silence starts over, so the next check is never one already past).
    pub(super) fn lapsed(&mut self, now: TokioInstant, reading: bool) -> Option<Lapse> {
        if !reading {
            self.replica_since = now;
        }
        // A replica silent while the pump reads it is reported even if the client is slow too.
        if reading && now >= self.replica_since + self.idle {
            Some(Lapse::Replica)
        } else if self.client_since.is_some_and(|t| now >= t + self.stall) {
            Some(Lapse::Client)
        } else {
            None
        }
    }

    /// When to look again.
    pub(super) fn next_check(&self) -> TokioInstant {
        let replica = self.replica_since + self.idle;
        self.client_since
            .map_or(replica, |t| replica.min(t + self.stall))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// While the pump is not reading (16 KiB pending), the replica's silence does not count,
    /// and its deadline must not set a check already past: the timer re-armed in the past fired
    /// at once, again and again (a busy loop that, biased ahead of the body channel, also kept
    /// the client from its bytes) until a stall limit above 30 s lapsed.
    #[test]
    fn a_check_with_nothing_lapsed_is_never_due_already() {
        let stall = Duration::from_secs(60);
        let t0 = TokioInstant::now();
        let mut watch = Watch::new(stall, t0);
        // 16 KiB came at t0 for a client that has not taken the last chunk: no more reading.
        watch.client_since = Some(t0);
        for secs in [29, 30, 31, 45, 59] {
            let now = t0 + Duration::from_secs(secs);
            if watch.lapsed(now, false).is_none() {
                assert!(
                    watch.next_check() > now,
                    "at {secs} s nothing lapsed, yet the next check is due already"
                );
            }
        }
        assert_eq!(
            watch.lapsed(t0 + stall, false),
            Some(Lapse::Client),
            "the client's stall still lapses"
        );
    }
}

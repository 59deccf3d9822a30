//! Refusals of retries held back before they are sent. A client that retries with no backoff
//! sends its next retry the moment its refusal arrives, so however cheap each refusal is, a
//! storm of them keeps the proxy's workers busy (a core's worth on loopback) and slows every
//! other tenant's requests through them. Held for [`HOLD_MS`], each such client retries at
//! most once a hold; the root context's tick sends the replies that are due, each on its own
//! request's context. At most [`MAX_HELD`] are held per worker VM: past that a refusal goes at
//! once, so the hold never becomes memory a storm can grow.

use std::collections::VecDeque;

use weir_core::reply::Reply;

/// How long a retry's refusal is held back.
pub const HOLD_MS: u64 = 1_000;

/// Replies held at once per worker VM: a few hundred bytes each, and the request they answer is
/// open anyway. A key holding more retries in flight than this is bounded by its concurrency
/// limits, which its requests took before their retries were told.
pub const MAX_HELD: usize = 16_384;

/// How often the root context looks for replies due: the hold's precision.
pub const TICK_MS: u64 = 100;

/// A reply held back: the request it answers, when it goes, what it says.
pub struct Held {
    pub context_id: u32,
    pub due_ms: u64,
    pub reply: Reply,
}

/// The replies held on one worker VM, in the order they are due (every hold is as long).
#[derive(Default)]
pub struct Tarpit {
    held: VecDeque<Held>,
}

impl Tarpit {
    /// Holds `reply` to the request on `context_id` until [`HOLD_MS`] past `now_ms`; gives it
    /// back when [`MAX_HELD`] are held already.
    pub fn hold(&mut self, context_id: u32, reply: Reply, now_ms: u64) -> Result<(), Reply> {
        if self.held.len() >= MAX_HELD {
            return Err(reply);
        }
        let due_ms = now_ms.saturating_add(HOLD_MS);
        self.held.push_back(Held {
            context_id,
            due_ms,
            reply,
        });
        Ok(())
    }

    /// The replies due at `now_ms`, taken out.
    pub fn due(&mut self, now_ms: u64) -> Vec<Held> {
        let n = self.held.iter().take_while(|h| h.due_ms <= now_ms).count();
        self.held.drain(..n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(n: u8) -> Reply {
        Reply {
            status: 429,
            headers: Vec::new(),
            body: vec![n],
        }
    }

    #[test]
    fn replies_go_in_order_once_their_hold_is_over() {
        let mut tarpit = Tarpit::default();
        assert!(tarpit.hold(7, reply(1), 1_000).is_ok());
        assert!(tarpit.hold(9, reply(2), 1_050).is_ok());
        assert!(tarpit.due(1_999).is_empty());
        let first = tarpit.due(2_000);
        assert_eq!((first.len(), first[0].context_id), (1, 7));
        assert_eq!(first[0].reply.body, [1]);
        let second = tarpit.due(5_000);
        assert_eq!((second.len(), second[0].context_id), (1, 9));
        assert!(tarpit.due(9_000).is_empty());
    }

    #[test]
    fn past_the_bound_a_reply_is_given_back_to_go_at_once() {
        let mut tarpit = Tarpit::default();
        for id in 0..MAX_HELD {
            assert!(tarpit.hold(id as u32, reply(0), 0).is_ok());
        }
        let back = tarpit.hold(99_999, reply(5), 0).unwrap_err();
        assert_eq!(back.body, [5]);
        assert_eq!(tarpit.due(HOLD_MS).len(), MAX_HELD);
        assert!(tarpit.hold(1, reply(0), HOLD_MS).is_ok(), "room again");
    }
}

//! Headroom: a turn for every active tenant.
//!
//! Tenants share a pool as *shares* (orgs, or keys with `fair_share: key`), active for
//! `active_window_ms` after their last request. While several are active, each share's fair
//! part of the pool's slots is `⌊slots · weight / active weights⌋` (at least one) and of its KV
//! `capacity · weight / active weights`. A share holding nothing always starts a request (its
//! turn; one larger than the pool runs alone). Any other request leaves a slot free for each
//! other active share holding nothing; one that takes a share past its fair part (a flood)
//! also leaves `kv_headroom` of the slots (rounded up) and of the KV free while another active
//! share is below its part. The rule is collective: however many tenants flood, together they
//! never take the room kept for the others, so a quiet tenant's request starts at the next
//! decision instead of waiting for the longest of the flood's streams. A share alone uses the
//! whole pool.

use std::collections::HashMap;

use crate::pool::{Pool, Replica};

/// What one share holds of a pool: slots (sequences running) and KV tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Holding {
    pub slots: u64,
    pub kv: u64,
}

/// A pool's resources and how much of them is in use (weir's own accounting).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Room {
    pub slots: u64,
    pub slots_used: u64,
    /// KV tokens; 0 where the engines report none (the pool admits by slots alone).
    pub kv: u64,
    pub kv_used: u64,
}

impl Room {
    /// What `pool`'s replicas that serve have, and hold for weir's requests.
    pub fn of(pool: &Pool) -> Room {
        let serving = || pool.replicas.iter().filter(|r| r.serves());
        let sum = |figure: fn(&Replica) -> u64| serving().map(figure).fold(0, u64::saturating_add);
        Room {
            slots: pool.concurrency(),
            slots_used: sum(|r| r.in_flight),
            kv: pool.capacity(),
            kv_used: sum(|r| r.reserved),
        }
    }
}

/// The active shares of a pool at one decision, and what each holds.
pub struct Headroom<'a> {
    room: Room,
    fraction: f64,
    weights: &'a HashMap<String, f64>,
    held: &'a HashMap<String, Holding>,
    total_weight: f64,
    /// Active shares below their fair part of slots, of KV, and holding no slot at all.
    below_slots: usize,
    below_kv: usize,
    idle: usize,
}

impl<'a> Headroom<'a> {
    /// `weights`: the active shares and their weights; `held`: what shares hold (active or
    /// not); `fraction`: `queue.kv_headroom`.
    pub fn new(
        room: Room,
        fraction: f64,
        weights: &'a HashMap<String, f64>,
        held: &'a HashMap<String, Holding>,
    ) -> Self {
        let total_weight = weights.values().sum::<f64>();
        let mut headroom = Headroom {
            room,
            fraction,
            weights,
            held,
            total_weight,
            below_slots: 0,
            below_kv: 0,
            idle: 0,
        };
        for share in weights.keys() {
            let h = headroom.holding(share);
            headroom.below_slots += usize::from(h.slots < headroom.fair_slots(share));
            headroom.below_kv += usize::from((h.kv as f64) < headroom.fair_kv(share));
            headroom.idle += usize::from(h.slots == 0);
        }
        headroom
    }

    fn holding(&self, share: &str) -> Holding {
        self.held.get(share).copied().unwrap_or_default()
    }

    fn weight(&self, share: &str) -> f64 {
        self.weights.get(share).copied().unwrap_or(1.0)
    }

    /// The share's fair part of the slots: at least one.
    pub fn fair_slots(&self, share: &str) -> u64 {
        let part =
            self.room.slots as f64 * self.weight(share) / self.total_weight.max(f64::MIN_POSITIVE);
        (part.floor() as u64).max(1)
    }

    fn fair_kv(&self, share: &str) -> f64 {
        self.room.kv as f64 * self.weight(share) / self.total_weight.max(f64::MIN_POSITIVE)
    }

    /// Whether `share` may start a request of `sequences` slots and `kv_need` KV tokens now
    /// (if it fits a replica: that is the pool's to say).
    pub fn admits(&self, share: &str, sequences: u64, kv_need: u64) -> bool {
        let active = self.weights.contains_key(share);
        let others = self.weights.len() - usize::from(active);
        if others == 0 {
            return true;
        }
        let h = self.holding(share);
        let minus_own = |count: usize, own: bool| count - usize::from(active && own);
        // Every other active share holding nothing keeps a slot free for its turn; past its
        // fair part a share also leaves the headroom free while another is below its part.
        let within = h.slots + sequences <= self.fair_slots(share);
        let below = minus_own(self.below_slots, h.slots < self.fair_slots(share));
        let idle = minus_own(self.idle, h.slots == 0) as u64;
        let kept = if within || below == 0 {
            idle
        } else {
            ((self.fraction * self.room.slots as f64).ceil() as u64).max(idle)
        };
        let used = self.room.slots_used.saturating_add(sequences);
        let slots_ok = h.slots == 0 || (used <= self.room.slots && self.room.slots - used >= kept);
        let kv_ok =
            self.room.kv == 0 || h.kv == 0 || (h.kv + kv_need) as f64 <= self.fair_kv(share) || {
                let below = minus_own(self.below_kv, (h.kv as f64) < self.fair_kv(share));
                let kept = if below == 0 {
                    0.0
                } else {
                    self.fraction * self.room.kv as f64
                };
                let used = self.room.kv_used.saturating_add(kv_need);
                self.room.kv.saturating_sub(used) as f64 >= kept
            };
        slots_ok && kv_ok
    }
}

/// A pool's shares: which are active (and since when, with what weight) and what each holds.
#[derive(Debug, Default)]
pub struct Shares {
    seen: HashMap<String, u64>,
    weights: HashMap<String, f64>,
    held: HashMap<String, Holding>,
}

impl Shares {
    /// A request of `share` arrived (or was queued again) at `now_ms`.
    pub fn arrived(&mut self, share: &str, weight: f64, now_ms: u64) {
        self.seen.insert(share.to_owned(), now_ms);
        self.weights.insert(share.to_owned(), weight);
    }

    /// Shares with no request for `window_ms` are no longer active.
    pub fn expire(&mut self, now_ms: u64, window_ms: u64) {
        let weights = &mut self.weights;
        self.seen.retain(|share, seen| {
            let active = now_ms.saturating_sub(*seen) < window_ms;
            if !active {
                weights.remove(share);
            }
            active
        });
    }

    /// Active shares.
    pub fn active(&self) -> usize {
        self.weights.len()
    }

    /// `share`'s weight over the active shares' (1 when it is the only one).
    pub fn part(&self, share: &str) -> f64 {
        let total: f64 = self.weights.values().sum();
        let own = self.weights.get(share).copied().unwrap_or(1.0);
        if total > 0.0 {
            (own / total).min(1.0)
        } else {
            1.0
        }
    }

    /// `share` starts (`add`) or ends holding `slots` and `kv` tokens.
    pub fn hold(&mut self, share: &str, slots: u64, kv: u64, add: bool) {
        let h = self.held.entry(share.to_owned()).or_default();
        if add {
            h.slots = h.slots.saturating_add(slots);
            h.kv = h.kv.saturating_add(kv);
        } else {
            h.slots = h.slots.saturating_sub(slots);
            h.kv = h.kv.saturating_sub(kv);
        }
        if *h == Holding::default() {
            self.held.remove(share);
        }
    }

    /// What `share` holds.
    pub fn holding(&self, share: &str) -> Holding {
        self.held.get(share).copied().unwrap_or_default()
    }

    /// The rule at one decision, over `room`.
    pub fn headroom(&self, room: Room, fraction: f64) -> Headroom<'_> {
        Headroom::new(room, fraction, &self.weights, &self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares(list: &[(&str, f64, u64, u64)]) -> (HashMap<String, f64>, HashMap<String, Holding>) {
        let weights = list.iter().map(|&(s, w, _, _)| (s.to_owned(), w)).collect();
        let held = list
            .iter()
            .map(|&(s, _, slots, kv)| (s.to_owned(), Holding { slots, kv }))
            .collect();
        (weights, held)
    }

    fn slots(
        total: u64,
        list: &[(&str, f64, u64, u64)],
    ) -> (Room, HashMap<String, f64>, HashMap<String, Holding>) {
        let (w, h) = shares(list);
        let used = list.iter().map(|s| s.2).sum();
        let room = Room {
            slots: total,
            slots_used: used,
            kv: 0,
            kv_used: 0,
        };
        (room, w, h)
    }

    /// How many more slots `share` may take, one at a time, as nobody else moves.
    fn takes(total: u64, list: &[(&str, f64, u64, u64)], share: &str) -> u64 {
        let mut list: Vec<(&str, f64, u64, u64)> = list.to_vec();
        let mut taken = 0;
        loop {
            let (room, w, h) = slots(total, &list);
            if room.slots_used == total || !Headroom::new(room, 0.2, &w, &h).admits(share, 1, 0) {
                return taken;
            }
            taken += 1;
            if let Some(s) = list.iter_mut().find(|s| s.0 == share) {
                s.2 += 1;
            }
        }
    }

    #[test]
    fn alone_a_share_uses_the_whole_pool() {
        assert_eq!(takes(8, &[("flood", 1.0, 0, 0)], "flood"), 8);
    }

    #[test]
    fn however_many_shares_flood_a_turn_stays_free_for_each_quiet_one() {
        // One to four flooders, one to six quiet tenants holding nothing, 2 to 16 slots:
        // the flooders, taking turns, leave a slot for each quiet one (and the headroom
        // fraction), as far as the pool has slots beyond one each.
        for flooders in 1..=4usize {
            for quiet in 1..=6usize {
                for total in 2..=16u64 {
                    let names: Vec<String> = (0..flooders).map(|i| format!("f{i}")).collect();
                    let mut list: Vec<(&str, f64, u64, u64)> =
                        names.iter().map(|n| (n.as_str(), 1.0, 0, 0)).collect();
                    let quiet_names: Vec<String> = (0..quiet).map(|i| format!("q{i}")).collect();
                    list.extend(quiet_names.iter().map(|n| (n.as_str(), 1.0, 0, 0)));
                    // Round robin among the flooders until none may take more.
                    loop {
                        let mut moved = false;
                        for i in 0..flooders {
                            let (room, w, h) = slots(total, &list);
                            if room.slots_used < total
                                && Headroom::new(room, 0.2, &w, &h).admits(list[i].0, 1, 0)
                            {
                                list[i].2 += 1;
                                moved = true;
                            }
                        }
                        if !moved {
                            break;
                        }
                    }
                    let used: u64 = list.iter().map(|s| s.2).sum();
                    let free = total - used;
                    let owed = (quiet as u64).min(total.saturating_sub(flooders as u64));
                    assert!(
                        free >= owed,
                        "{flooders} flooders, {quiet} quiet, {total} slots: {free} free"
                    );
                    // Every quiet tenant may start one request now.
                    let (room, w, h) = slots(total, &list);
                    let headroom = Headroom::new(room, 0.2, &w, &h);
                    assert!(quiet_names.iter().all(|q| headroom.admits(q, 1, 0)));
                }
            }
        }
    }

    #[test]
    fn a_share_within_its_fair_part_takes_it_beside_a_busy_share() {
        // 8 slots, two shares: 4 each.
        assert_eq!(takes(8, &[("a", 1.0, 0, 0), ("b", 1.0, 4, 0)], "a"), 4);
        // Weighted: 3 to 1 of 8 slots is 6 and 2.
        assert!(takes(8, &[("a", 3.0, 0, 0), ("b", 1.0, 2, 0)], "a") >= 6);
    }

    #[test]
    fn once_every_other_share_has_its_part_the_rest_may_go_to_a_flood() {
        // b holds its fair part (4 of 8): nothing is kept for it.
        assert_eq!(takes(8, &[("a", 1.0, 0, 0), ("b", 1.0, 4, 0)], "a"), 4);
        // b holds 1 of its 4: the headroom (2 slots) stays free.
        assert_eq!(takes(8, &[("a", 1.0, 0, 0), ("b", 1.0, 1, 0)], "a"), 5);
    }

    #[test]
    fn kv_past_its_fair_part_leaves_the_headroom_free() {
        let (w, h) = shares(&[("flood", 1.0, 1, 500), ("quiet", 1.0, 0, 0)]);
        let room = |used| Room {
            slots: 100,
            slots_used: 1,
            kv: 1_000,
            kv_used: used,
        };
        // 500 held of a fair 500: 300 more would leave 200 free (20%), 301 would not.
        assert!(Headroom::new(room(500), 0.2, &w, &h).admits("flood", 1, 300));
        assert!(!Headroom::new(room(500), 0.2, &w, &h).admits("flood", 1, 301));
        // A share holding nothing starts a request of any size.
        assert!(Headroom::new(room(500), 0.2, &w, &h).admits("quiet", 1, 5_000));
    }
}

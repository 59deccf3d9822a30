//! The children of a tree node with work queued, in serving order.
//!
//! Most nodes have one such child or a few (a workspace of one project, a project of one
//! key): they keep them in a sorted array inside the node, so a decision passing through them
//! neither follows a pointer nor allocates. A node with many (the root of a pool shared by
//! thousands of orgs) keeps a B-tree.

use std::cmp::Ordering;
use std::collections::{BTreeSet, btree_set};

use smallvec::SmallVec;

/// A counter value with a total order, so it can key an ordered set.
#[derive(Clone, Copy, Debug)]
pub(super) struct Counter(pub(super) f64);

/// Equal as the order has it (`f64`'s `==` has 0.0 == -0.0, which the order tells apart): a
/// key found unchanged by `==` must also be found where the set put it.
impl PartialEq for Counter {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Counter {}

impl PartialOrd for Counter {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Counter {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// A child's place: its counter, its tie-break, the child.
pub(super) type Key = (Counter, u64, usize);

/// Beyond this many children, a B-tree; back to the array below a quarter of it (so a node
/// near the bound does not convert on every change).
const MANY: usize = 32;

#[derive(Debug)]
pub(super) enum Ready {
    Few(SmallVec<[Key; 2]>),
    Many(BTreeSet<Key>),
}

impl Default for Ready {
    fn default() -> Self {
        Ready::Few(SmallVec::new())
    }
}

impl Ready {
    pub(super) fn insert(&mut self, key: Key) {
        match self {
            Ready::Few(few) => {
                if let Err(at) = few.binary_search(&key) {
                    few.insert(at, key);
                }
                if few.len() > MANY {
                    *self = Ready::Many(few.drain(..).collect());
                }
            }
            Ready::Many(many) => {
                many.insert(key);
            }
        }
    }

    pub(super) fn remove(&mut self, key: &Key) {
        match self {
            Ready::Few(few) => {
                if let Ok(at) = few.binary_search(key) {
                    few.remove(at);
                }
            }
            Ready::Many(many) => {
                many.remove(key);
                if many.len() < MANY / 4 {
                    *self = Ready::Few(many.iter().copied().collect());
                }
            }
        }
    }

    pub(super) fn first(&self) -> Option<&Key> {
        match self {
            Ready::Few(few) => few.first(),
            Ready::Many(many) => many.first(),
        }
    }

    pub(super) fn iter(&self) -> Iter<'_> {
        match self {
            Ready::Few(few) => Iter::Few(few.iter()),
            Ready::Many(many) => Iter::Many(many.iter()),
        }
    }
}

/// The children in serving order.
pub(super) enum Iter<'a> {
    Few(std::slice::Iter<'a, Key>),
    Many(btree_set::Iter<'a, Key>),
}

impl<'a> Iterator for Iter<'a> {
    type Item = &'a Key;

    fn next(&mut self) -> Option<&'a Key> {
        match self {
            Iter::Few(few) => few.next(),
            Iter::Many(many) => many.next(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_equal_exactly_when_the_order_says_so() {
        for (a, b) in [(0.0, -0.0), (1.0, 1.0), (f64::NAN, f64::NAN)] {
            let (a, b) = (Counter(a), Counter(b));
            assert_eq!(a == b, a.cmp(&b) == Ordering::Equal, "{a:?} {b:?}");
        }
    }

    #[test]
    fn it_keeps_serving_order_as_it_grows_past_the_array_and_shrinks_back() {
        let mut ready = Ready::default();
        let key = |i: usize| (Counter((i % 7) as f64), i as u64, i);
        let mut expected = BTreeSet::new();
        for i in (0..100).rev() {
            ready.insert(key(i));
            ready.insert(key(i));
            expected.insert(key(i));
            assert!(ready.iter().eq(expected.iter()));
        }
        assert!(matches!(ready, Ready::Many(_)));
        for i in 0..98 {
            ready.remove(&key(i));
            ready.remove(&key(i));
            expected.remove(&key(i));
            assert!(ready.iter().eq(expected.iter()));
            assert_eq!(ready.first(), expected.first());
        }
        assert!(matches!(ready, Ready::Few(_)));
    }
}

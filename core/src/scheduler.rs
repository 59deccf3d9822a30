//! Who goes next: hierarchical fair queues served by virtual token counters (Sheng et al.,
//! OSDI 2024, applied at every level of the tenant hierarchy).
//!
//! Tenants form a tree: org → workspace → project → key. Every node has a counter that grows
//! by the tokens served below it, divided by the node's weight among its siblings
//! (`(w_in · input + w_out · output) / weight`). A decision descends from the root, at each
//! level to the child with work queued and the smallest counter, down to a key, whose oldest
//! request goes. So a pool is shared among orgs by weight, each org's share among its
//! workspaces, and so on: an org that mints ten keys still has one org's share, and an idle
//! key's share goes to its active siblings first (their org's counter only grows by what they
//! are served). A node returning from idle cannot bank credit while away (the paper's
//! Algorithm 2, at every level): it is lifted to the smallest counter among its backlogged
//! siblings, or, when none is backlogged, to the counter of the sibling whose queue emptied
//! last. The rule holds per priority class: a node with only batch work queued is idle to the
//! interactive class (its batch work waits, so its counter stands still), and its interactive
//! work is lifted to its interactive siblings' smallest counter. Without the second rule counters drift apart while the pool is unsaturated, and a
//! tenant that ran alone for an hour would be starved by one that stayed quiet once contention
//! starts.
//!
//! Priority classes are strict at the same decision point (interactive before batch), but a
//! batch request that has waited longer than the aging bound goes next, so batch never
//! starves. Each decision is O(depth · log n). [`Share::Key`] flattens the tree (every key a
//! child of the root, weighted by the product of its path's weights): fair share per key.
//! A FIFO policy exists as the baseline for benchmarks.

use std::collections::{BTreeSet, HashMap, VecDeque};

use smallvec::SmallVec;

use crate::config::Priority;

pub mod headroom;
mod ready;

use ready::{Counter, Key, Ready};

/// How input and output tokens weigh in a tenant's counter (the paper's w_in and w_out:
/// output tokens cost more, being generated one step at a time).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenWeights {
    pub input: f64,
    pub output: f64,
}

impl Default for TokenWeights {
    fn default() -> Self {
        TokenWeights {
            input: 1.0,
            output: 2.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Virtual token counters with strict priority classes and aging.
    Fair,
    /// Arrival order across all tenants: the baseline.
    Fifo,
}

/// What fair share is divided among.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Share {
    /// Orgs, then workspaces within an org, projects within a workspace, keys within a project.
    #[default]
    Hierarchy,
    /// Keys, each on its own: an org's share grows with the keys it mints.
    Key,
}

impl Share {
    /// What `tenant` shares a pool as at the top of the tree: its org, or the key itself.
    pub fn of(self, tenant: &str) -> &str {
        match self {
            Share::Hierarchy => org_of(tenant),
            Share::Key => tenant,
        }
    }
}

const CLASSES: usize = 2;
const ROOT: usize = 0;

/// The org of a tenant path: its first id.
fn org_of(tenant: &str) -> &str {
    tenant.split('/').next().unwrap_or(tenant)
}

fn class_of(priority: Priority) -> usize {
    match priority {
        Priority::Interactive => 0,
        Priority::Batch => 1,
    }
}

struct Entry<T> {
    item: T,
    seq: u64,
    enqueued_ms: u64,
    /// Its place in its class's [`Arrivals`].
    arrival: Arrival,
}

/// Where a request is in its class's [`Arrivals`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arrival {
    /// Its number in the log.
    Logged(u64),
    /// In `late`, by its stamp and sequence number.
    Late,
}

/// The requests of one class in the order they were queued, for the oldest wait without an
/// ordered index that every decision would update: a request leaving its queue is marked
/// gone, and gone ones are dropped as they reach the front (so it reaches back to the oldest
/// request still queued; see `Scheduler::compact_arrivals` for when that one stays).
///
/// The log's front is the oldest only while stamps rise with queueing order. They need not:
/// the dispatcher's clock is wall-clock time, which can step back, and handlers stamp a
/// request before they queue it. A request stamped before the last one logged goes to `late`
/// instead, an ordered set that stays empty while the clock behaves.
#[derive(Default)]
struct Arrivals {
    /// When each was queued, and whether it still is; the first is number `first`. Stamps
    /// never decrease along it.
    log: VecDeque<(u64, bool)>,
    first: u64,
    /// Requests in the log still queued.
    logged: usize,
    /// Requests stamped before the log's last: by stamp, then sequence number.
    late: BTreeSet<(u64, u64)>,
}

impl Arrivals {
    /// Notes request `seq` queued at `now_ms`; returns where it went.
    fn push(&mut self, now_ms: u64, seq: u64) -> Arrival {
        if self.log.back().is_some_and(|&(last, _)| now_ms < last) {
            self.late.insert((now_ms, seq));
            return Arrival::Late;
        }
        self.log.push_back((now_ms, true));
        self.logged += 1;
        Arrival::Logged(self.first + self.log.len() as u64 - 1)
    }

    /// Notes that `entry` left its queue.
    fn gone<T>(&mut self, entry: &Entry<T>) {
        let number = match entry.arrival {
            Arrival::Late => {
                self.late.remove(&(entry.enqueued_ms, entry.seq));
                return;
            }
            Arrival::Logged(number) => number,
        };
        let at = number
            .checked_sub(self.first)
            .and_then(|i| usize::try_from(i).ok());
        if let Some((_, queued)) = at.and_then(|i| self.log.get_mut(i))
            && *queued
        {
            *queued = false;
            self.logged -= 1;
        }
        while self.log.front().is_some_and(|&(_, queued)| !queued) {
            self.log.pop_front();
            self.first += 1;
        }
    }

    /// When the longest-waiting request still queued was queued.
    fn oldest_ms(&self) -> Option<u64> {
        let logged = self.log.front().map(|&(ms, _)| ms);
        let late = self.late.first().map(|&(ms, _)| ms);
        logged.into_iter().chain(late).min()
    }
}

/// One node of the tenant tree: the root, an org, workspace or project, or a key (a leaf, with
/// the queues).
struct Node<T> {
    /// The full tenant path for a key; the path so far for the levels above.
    name: String,
    parent: usize,
    weight: f64,
    counter: f64,
    /// Number of the node's last charge: ties on the counter go to whoever was charged least
    /// recently (a newcomer first). Kept with the counter, so a decision reorders a node's
    /// siblings once, as it is charged, not again as it is served.
    last_charged: u64,
    /// Requests queued below, per class.
    backlog: [usize; CLASSES],
    /// Children with requests of a class queued below, by counter, then least recently charged.
    ready: [Ready; CLASSES],
    /// By id; a key and a level of the same id are different children.
    children: HashMap<(String, bool), usize>,
    /// The child whose queues emptied last: where a child arriving to an idle node is lifted to.
    last_left: Option<usize>,
    /// A key's requests, per class (empty above the keys).
    queues: [VecDeque<Entry<T>>; CLASSES],
    /// A key's org's slot in the scheduler's `org_depth` (0 above the keys).
    org: usize,
}

impl<T> Node<T> {
    fn new(name: String, parent: usize) -> Self {
        Node {
            name,
            parent,
            weight: 1.0,
            counter: 0.0,
            last_charged: 0,
            backlog: [0; CLASSES],
            ready: Default::default(),
            children: HashMap::new(),
            last_left: None,
            queues: Default::default(),
            org: 0,
        }
    }

    fn backlogged(&self) -> bool {
        self.backlog.iter().any(|&n| n > 0)
    }

    fn key(&self, n: usize) -> Key {
        (Counter(self.counter), self.last_charged, n)
    }
}

/// What the dispatcher says of a candidate request in [`Scheduler::pop_where`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Dispatch it.
    Take,
    /// Its tenant may not go now (over its own cap): it keeps its place, the next tenant is
    /// considered.
    Skip,
    /// It is next but does not fit yet: nobody else goes ahead of it, so the room it needs
    /// builds up (no starvation of large requests by a stream of small ones).
    Wait,
}

/// A request handed out by [`Scheduler::pop`].
#[derive(Debug, PartialEq)]
pub struct Dispatch<'a, T> {
    pub tenant: &'a str,
    pub priority: Priority,
    pub item: T,
    pub waited_ms: u64,
}

/// The outcome of looking for the next request below a node.
enum Found {
    Take(usize, usize),
    Wait,
    Nothing,
}

/// Nodes on a tenant's path: one per level, kept inline (a decision allocates nothing).
type Path = SmallVec<[usize; 8]>;

/// A key's queue head in arrival order: time queued, sequence number, the key.
type Head = (u64, u64, usize);

pub struct Scheduler<T> {
    policy: Policy,
    share: Share,
    weights: TokenWeights,
    aging_ms: u64,
    /// The tree; the root first.
    nodes: Vec<Node<T>>,
    /// Keys by tenant path.
    by_name: HashMap<String, usize>,
    /// Each org's slot in `org_depth` (the org: the first id of a tenant path).
    orgs: HashMap<String, usize>,
    /// Requests queued per org, whatever the share: what an org's queue bound is held to. A
    /// key's node holds its org's slot, so a decision counts without hashing a name.
    org_depth: Vec<usize>,
    /// Keys' queue heads per class, by arrival (time queued, then sequence), where decisions
    /// read them: batch heads for aging, and both classes for FIFO.
    heads: [BTreeSet<Head>; CLASSES],
    /// Every queued request per class, by arrival: for the oldest wait.
    arrivals: [Arrivals; CLASSES],
    next_seq: u64,
    charges: u64,
    len: usize,
}

impl<T> Scheduler<T> {
    /// `aging_ms`: a batch request waiting this long is served ahead of interactive work.
    pub fn new(policy: Policy, share: Share, weights: TokenWeights, aging_ms: u64) -> Self {
        Scheduler {
            policy,
            share,
            weights,
            aging_ms,
            nodes: vec![Node::new(String::new(), ROOT)],
            by_name: HashMap::new(),
            orgs: HashMap::new(),
            org_depth: Vec::new(),
            heads: Default::default(),
            arrivals: Default::default(),
            next_seq: 0,
            charges: 0,
            len: 0,
        }
    }

    /// A new aging bound, for the next decision (a reloaded config).
    pub fn set_aging_ms(&mut self, aging_ms: u64) {
        self.aging_ms = aging_ms;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Requests a tenant has waiting.
    pub fn depth(&self, tenant: &str) -> usize {
        self.by_name
            .get(tenant)
            .map_or(0, |&n| self.nodes[n].queues.iter().map(VecDeque::len).sum())
    }

    /// Requests of a tenant's that a new one of `priority` would wait behind in its own
    /// queues: its interactive ones, and for batch work its batch ones too.
    pub fn queued_ahead(&self, tenant: &str, priority: Priority) -> usize {
        self.by_name.get(tenant).map_or(0, |&n| {
            let queues = &self.nodes[n].queues;
            queues[..=class_of(priority)]
                .iter()
                .map(VecDeque::len)
                .sum()
        })
    }

    /// Removes and returns a tenant's newest queued request (its batch work first) if `may`
    /// allows it: what a full queue gives up to take a newcomer from a tenant with less
    /// queued.
    pub fn pop_newest_where(&mut self, tenant: &str, may: impl Fn(&T) -> bool) -> Option<T> {
        let &leaf = self.by_name.get(tenant)?;
        let class = (0..CLASSES).rev().find(|&c| {
            self.nodes[leaf].queues[c]
                .back()
                .is_some_and(|e| may(&e.item))
        })?;
        let only = self.nodes[leaf].queues[class].len() == 1;
        if only {
            self.unindex_head(leaf, class);
        }
        let entry = self.nodes[leaf].queues[class].pop_back()?;
        self.arrivals[class].gone(&entry);
        let path = self.ancestry(leaf);
        self.remove_backlog(&path, class, 1);
        self.count_org(leaf, 1, false);
        self.len -= 1;
        Some(entry.item)
    }

    /// Requests the org of a tenant has waiting, under all its keys.
    pub fn org_depth(&self, tenant: &str) -> usize {
        self.orgs
            .get(org_of(tenant))
            .and_then(|&slot| self.org_depth.get(slot))
            .copied()
            .unwrap_or(0)
    }

    /// Counts `k` more (`add`) or fewer queued requests for the org of key `leaf`.
    fn count_org(&mut self, leaf: usize, k: usize, add: bool) {
        if let Some(n) = self.org_depth.get_mut(self.nodes[leaf].org) {
            *n = if add { *n + k } else { n.saturating_sub(k) };
        }
    }

    /// The slot of `tenant`'s org in `org_depth`, made on its first key.
    fn org_slot(&mut self, tenant: &str) -> usize {
        let org = org_of(tenant);
        if let Some(&slot) = self.orgs.get(org) {
            return slot;
        }
        self.org_depth.push(0);
        let slot = self.org_depth.len() - 1;
        self.orgs.insert(org.to_owned(), slot);
        slot
    }

    /// A tenant's (a key's) virtual token counter (0 for a tenant never seen).
    pub fn counter(&self, tenant: &str) -> f64 {
        self.by_name
            .get(tenant)
            .map_or(0.0, |&n| self.nodes[n].counter)
    }

    /// What `tenant` shares the pool as at the top of the tree: its org, or the key itself
    /// with [`Share::Key`].
    pub fn share_of<'a>(&self, tenant: &'a str) -> &'a str {
        self.share.of(tenant)
    }

    /// The top-level shares with work queued: name, weight among its siblings and virtual
    /// counter (what [`crate::fairness`] measures).
    pub fn backlogged_shares(&self) -> impl Iterator<Item = (&str, f64, f64)> {
        let root = &self.nodes[ROOT];
        let mut ids: Vec<usize> = root
            .ready
            .iter()
            .flat_map(Ready::iter)
            .map(|&(_, _, n)| n)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter().map(|n| {
            let node = &self.nodes[n];
            (node.name.as_str(), node.weight, node.counter)
        })
    }

    /// The weight of a top-level share (1 for one never seen).
    pub fn share_weight(&self, share: &str) -> f64 {
        let root = &self.nodes[ROOT];
        [false, true]
            .iter()
            .find_map(|&leaf| root.children.get(&(share.to_owned(), leaf)))
            .map_or(1.0, |&n| self.nodes[n].weight)
    }

    /// The virtual counter of a level of the tree (`acme`, `acme/search`) or of a key; `None`
    /// where the tree has no such node (a level with [`Share::Key`], or one never seen).
    pub fn counter_at(&self, path: &str) -> Option<f64> {
        if let Some(&leaf) = self.by_name.get(path) {
            return Some(self.nodes[leaf].counter);
        }
        let mut at = ROOT;
        for id in path.split('/') {
            at = *self.nodes[at].children.get(&(id.to_owned(), false))?;
        }
        Some(self.nodes[at].counter)
    }

    /// The nodes from the top level down to the tenant's key, created as needed, with the
    /// weights given (`weights[i]` for level `i`, org first; 1 where missing or out of range).
    fn intern(&mut self, tenant: &str, weights: &[f64]) -> Path {
        let sane = |w: Option<&f64>| match w {
            Some(&w) if w.is_finite() && w > 0.0 => w,
            _ => 1.0,
        };
        // A tenant seen before: its nodes are known, only the weights may have changed.
        if let Some(&leaf) = self.by_name.get(tenant) {
            let mut path = self.ancestry(leaf);
            path.reverse();
            match self.share {
                Share::Hierarchy => {
                    for (i, &n) in path.iter().enumerate() {
                        self.nodes[n].weight = sane(weights.get(i));
                    }
                }
                Share::Key => {
                    self.nodes[leaf].weight = weights.iter().map(|w| sane(Some(w))).product();
                }
            }
            return path;
        }
        let levels: Vec<(&str, f64)> = match self.share {
            Share::Hierarchy => tenant
                .split('/')
                .enumerate()
                .map(|(i, id)| (id, sane(weights.get(i))))
                .collect(),
            Share::Key => {
                let product = weights.iter().map(|w| sane(Some(w))).product::<f64>();
                vec![(tenant, product)]
            }
        };
        let mut path = Path::new();
        let mut at = ROOT;
        for (i, (id, weight)) in levels.iter().enumerate() {
            let leaf = i + 1 == levels.len();
            let child = match self.nodes[at].children.get(&((*id).to_owned(), leaf)) {
                Some(&c) => c,
                None => {
                    let c = self.nodes.len();
                    let name = if leaf {
                        tenant.to_owned()
                    } else {
                        tenant.split('/').take(i + 1).collect::<Vec<_>>().join("/")
                    };
                    self.nodes.push(Node::new(name, at));
                    self.nodes[at].children.insert(((*id).to_owned(), leaf), c);
                    if leaf {
                        self.by_name.insert(tenant.to_owned(), c);
                        self.nodes[c].org = self.org_slot(tenant);
                    }
                    c
                }
            };
            self.nodes[child].weight = *weight;
            path.push(child);
            at = child;
        }
        path
    }

    /// The nodes from a key up to the top level (the root excluded).
    fn ancestry(&self, leaf: usize) -> Path {
        let mut path = Path::new();
        let mut at = leaf;
        while at != ROOT {
            path.push(at);
            at = self.nodes[at].parent;
        }
        path
    }

    /// Changes a node's counter or tie-break through `change`, keeping its place in its
    /// parent's ordered sets.
    fn rekey(&mut self, n: usize, change: impl FnOnce(&mut Node<T>)) {
        let parent = self.nodes[n].parent;
        let old = self.nodes[n].key(n);
        let backlog = self.nodes[n].backlog;
        change(&mut self.nodes[n]);
        let new = self.nodes[n].key(n);
        if n == ROOT || old == new {
            return;
        }
        for (ready, queued) in self.nodes[parent].ready.iter_mut().zip(backlog) {
            if queued > 0 {
                ready.remove(&old);
                ready.insert(new);
            }
        }
    }

    /// Where child `n` of `parent`, with nothing of `class` queued below it, is lifted to as
    /// work of `class` arrives: the smallest counter among its siblings with work of that class
    /// queued (its competitors in it); with none, if `n` has nothing queued at all, the smallest
    /// among the siblings with any work queued, else that of the child that went idle last.
    /// Work of another class queued below `n` earns it no credit in this one: a batch request
    /// waiting behind interactive traffic is not served, so its counter stands still.
    fn floor(&self, parent: usize, n: usize, class: usize) -> Option<f64> {
        let node = &self.nodes[parent];
        let first = |r: &Ready| r.first().map(|(c, _, _)| c.0);
        if let Some(floor) = first(&node.ready[class]) {
            return Some(floor);
        }
        if self.nodes[n].backlogged() {
            return None;
        }
        node.ready
            .iter()
            .filter_map(first)
            .reduce(f64::min)
            .or_else(|| node.last_left.map(|l| self.nodes[l].counter))
    }

    /// Counts `k` more requests of `class` below every node of `path` (key first), entering
    /// them in their parents' ready sets as they become backlogged.
    fn add_backlog(&mut self, path: &[usize], class: usize, k: usize) {
        for &n in path {
            let was = self.nodes[n].backlog[class];
            self.nodes[n].backlog[class] += k;
            if was == 0 {
                let (parent, key) = (self.nodes[n].parent, self.nodes[n].key(n));
                self.nodes[parent].ready[class].insert(key);
            }
        }
        self.nodes[ROOT].backlog[class] += k;
    }

    /// Counts `k` fewer requests of `class` below every node of `path` (key first); a node
    /// whose queues all emptied is remembered by its parent, for lifting the next arrival.
    fn remove_backlog(&mut self, path: &[usize], class: usize, k: usize) {
        for &n in path {
            let left = self.nodes[n].backlog[class].saturating_sub(k);
            self.nodes[n].backlog[class] = left;
            let (parent, key) = (self.nodes[n].parent, self.nodes[n].key(n));
            if left == 0 {
                self.nodes[parent].ready[class].remove(&key);
            }
            if !self.nodes[n].backlogged() {
                self.nodes[parent].last_left = Some(n);
            }
        }
        let root = &mut self.nodes[ROOT].backlog[class];
        *root = root.saturating_sub(k);
    }

    /// Queues a request. `weights` are the tenant's scheduling weights, one per level of its
    /// path, org first (each > 0; others count as 1).
    pub fn push(
        &mut self,
        tenant: &str,
        weights: &[f64],
        priority: Priority,
        item: T,
        now_ms: u64,
    ) {
        self.queue(tenant, weights, priority, item, now_ms, false);
    }

    /// Queues a request at the head of its tenant's queue of its class, ahead of the tenant's
    /// other waiting requests (a preempted request resumes before the tenant's next one starts).
    /// Otherwise as [`push`](Self::push): the lift rule applies, and its wait (for aging and
    /// [`oldest_ms`](Self::oldest_ms)) counts from `now_ms`.
    pub fn push_front(
        &mut self,
        tenant: &str,
        weights: &[f64],
        priority: Priority,
        item: T,
        now_ms: u64,
    ) {
        self.queue(tenant, weights, priority, item, now_ms, true);
    }

    fn queue(
        &mut self,
        tenant: &str,
        weights: &[f64],
        priority: Priority,
        item: T,
        now_ms: u64,
        front: bool,
    ) {
        let mut path = self.intern(tenant, weights);
        let class = class_of(priority);
        // Returning from idle (in this class), at any level: no credit for the time away.
        for &n in &path {
            if self.nodes[n].backlog[class] == 0
                && let Some(floor) = self.floor(self.nodes[n].parent, n, class)
            {
                self.rekey(n, |node| node.counter = node.counter.max(floor));
            }
        }
        path.reverse();
        let Some(&leaf) = path.first() else {
            return;
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = Entry {
            item,
            seq,
            enqueued_ms: now_ms,
            arrival: self.arrivals[class].push(now_ms, seq),
        };
        // The head is indexed by its own arrival: a new head is indexed afresh (an entry
        // queued behind others leaves the head as it was).
        let new_head = front || self.nodes[leaf].queues[class].is_empty();
        if new_head {
            self.unindex_head(leaf, class);
        }
        if front {
            self.nodes[leaf].queues[class].push_front(entry);
        } else {
            self.nodes[leaf].queues[class].push_back(entry);
        }
        if new_head {
            self.index_head(leaf, class);
        }
        self.add_backlog(&path, class, 1);
        self.count_org(leaf, 1, true);
        self.len += 1;
        self.compact_arrivals(class);
    }

    /// Renumbers the log of `class` once requests gone behind a long-waiting one make up most
    /// of it, so it stays within about twice what is queued. Its front leaves only as its
    /// request does, and one can wait without bound: a preempted request resumes with no
    /// queue deadline, and is passed over while its tenant is over its share. Amortized over
    /// the pushes since the last renumbering, as many as the requests it walks.
    fn compact_arrivals(&mut self, class: usize) {
        let arrivals = &self.arrivals[class];
        // Small under test, so the random operations renumber often.
        const SLACK: usize = if cfg!(test) { 16 } else { 1_024 };
        if arrivals.log.len() <= 2 * arrivals.logged + SLACK {
            return;
        }
        let mut logged: Vec<(u64, &mut Entry<T>)> = self
            .nodes
            .iter_mut()
            .flat_map(|n| n.queues[class].iter_mut())
            .filter_map(|e| match e.arrival {
                Arrival::Logged(number) => Some((number, e)),
                Arrival::Late => None,
            })
            .collect();
        // In log order, so stamps still never decrease along it.
        logged.sort_unstable_by_key(|&(number, _)| number);
        let arrivals = &mut self.arrivals[class];
        arrivals.log.clear();
        arrivals.first = 0;
        arrivals.logged = logged.len();
        for (i, (_, e)) in logged.into_iter().enumerate() {
            e.arrival = Arrival::Logged(i as u64);
            arrivals.log.push_back((e.enqueued_ms, true));
        }
    }

    /// Whether heads of `class` are indexed (see `heads`).
    fn indexed(&self, class: usize) -> bool {
        class == 1 || self.policy == Policy::Fifo
    }

    fn index_head(&mut self, leaf: usize, class: usize) {
        if !self.indexed(class) {
            return;
        }
        if let Some(head) = self.nodes[leaf].queues[class].front() {
            self.heads[class].insert((head.enqueued_ms, head.seq, leaf));
        }
    }

    fn unindex_head(&mut self, leaf: usize, class: usize) {
        if !self.indexed(class) {
            return;
        }
        if let Some(head) = self.nodes[leaf].queues[class].front() {
            self.heads[class].remove(&(head.enqueued_ms, head.seq, leaf));
        }
    }

    /// The request `judge` rules on first below `n`, in fair order: children by counter,
    /// depth first.
    fn descend(
        &self,
        n: usize,
        class: usize,
        judge: &mut impl FnMut(&str, &T) -> Verdict,
    ) -> Found {
        let node = &self.nodes[n];
        if let Some(head) = node.queues[class].front() {
            return match judge(&node.name, &head.item) {
                Verdict::Take => Found::Take(n, class),
                Verdict::Skip => Found::Nothing,
                Verdict::Wait => Found::Wait,
            };
        }
        for &(_, _, child) in node.ready[class].iter() {
            match self.descend(child, class, judge) {
                Found::Nothing => continue,
                found => return found,
            }
        }
        Found::Nothing
    }

    /// The first of `heads` (keys' queue heads, by key and class) that `judge` takes, unless
    /// one it must wait for comes first.
    fn first_in_line(
        &self,
        heads: impl Iterator<Item = (usize, usize)>,
        judge: &mut impl FnMut(&str, &T) -> Verdict,
    ) -> Found {
        for (leaf, class) in heads {
            let node = &self.nodes[leaf];
            let Some(head) = node.queues[class].front() else {
                continue;
            };
            match judge(&node.name, &head.item) {
                Verdict::Take => return Found::Take(leaf, class),
                Verdict::Wait => return Found::Wait,
                Verdict::Skip => continue,
            }
        }
        Found::Nothing
    }

    /// Every queue head, of either class, in arrival order (keys and classes).
    fn by_arrival(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let [mut interactive, mut batch] = self.heads.each_ref().map(|h| h.iter().peekable());
        std::iter::from_fn(move || {
            let class = match (interactive.peek(), batch.peek()) {
                (Some(i), Some(b)) => usize::from(b < i),
                (Some(_), None) => 0,
                (None, Some(_)) => 1,
                (None, None) => return None,
            };
            let next = if class == 0 {
                interactive.next()
            } else {
                batch.next()
            };
            next.map(|&(_, _, leaf)| (leaf, class))
        })
    }

    /// The key and class to serve next, in policy order, as `judge` allows.
    fn choose(
        &self,
        now_ms: u64,
        judge: &mut impl FnMut(&str, &T) -> Verdict,
    ) -> Option<(usize, usize)> {
        let in_line = match self.policy {
            Policy::Fifo => self.first_in_line(self.by_arrival(), judge),
            Policy::Fair => self.first_in_line(
                self.heads[1]
                    .iter()
                    .take_while(|&&(enqueued, _, _)| {
                        now_ms.saturating_sub(enqueued) >= self.aging_ms
                    })
                    .map(|&(_, _, t)| (t, 1)),
                judge,
            ),
        };
        match in_line {
            Found::Take(leaf, class) => return Some((leaf, class)),
            Found::Wait => return None,
            Found::Nothing => {}
        }
        if self.policy == Policy::Fifo {
            return None;
        }
        for class in 0..CLASSES {
            match self.descend(ROOT, class, judge) {
                Found::Take(leaf, class) => return Some((leaf, class)),
                Found::Wait => return None,
                Found::Nothing => continue,
            }
        }
        None
    }

    /// Hands out the next request. Charge what it is served with [`charge`](Self::charge).
    pub fn pop(&mut self, now_ms: u64) -> Option<Dispatch<'_, T>> {
        self.pop_where(now_ms, |_, _| Verdict::Take)
    }

    /// Hands out the next request in policy order that `judge` takes; see [`Verdict`].
    pub fn pop_where(
        &mut self,
        now_ms: u64,
        mut judge: impl FnMut(&str, &T) -> Verdict,
    ) -> Option<Dispatch<'_, T>> {
        let (leaf, class) = self.choose(now_ms, &mut judge)?;
        self.unindex_head(leaf, class);
        let entry = self.nodes[leaf].queues[class].pop_front();
        self.index_head(leaf, class);
        let entry = entry?;
        self.arrivals[class].gone(&entry);
        let path = self.ancestry(leaf);
        self.remove_backlog(&path, class, 1);
        self.count_org(leaf, 1, false);
        self.len -= 1;
        Some(Dispatch {
            tenant: &self.nodes[leaf].name,
            priority: if class == 0 {
                Priority::Interactive
            } else {
                Priority::Batch
            },
            item: entry.item,
            waited_ms: now_ms.saturating_sub(entry.enqueued_ms),
        })
    }

    /// Adds `cost` weighted tokens to the counters from a tenant's key up, each by its weight.
    fn add_cost(&mut self, tenant: &str, cost: f64) {
        let Some(&leaf) = self.by_name.get(tenant) else {
            return;
        };
        self.charges += 1;
        let charge = self.charges;
        for n in self.ancestry(leaf) {
            self.rekey(n, |node| {
                node.counter += cost / node.weight;
                node.last_charged = charge;
            });
        }
    }

    /// Adds served tokens to a tenant's counters; returns the weighted tokens charged.
    pub fn charge(&mut self, tenant: &str, input_tokens: u64, output_tokens: u64) -> f64 {
        let cost =
            self.weights.input * input_tokens as f64 + self.weights.output * output_tokens as f64;
        self.add_cost(tenant, cost);
        cost
    }

    /// Replaces an input charge made from an estimate with the engine's count: an
    /// underestimate is charged in full, an overestimate refunded. Returns the weighted
    /// tokens charged (negative for a refund).
    pub fn correct_input(&mut self, tenant: &str, estimated: u64, reported: u64) -> f64 {
        let cost = self.weights.input * (reported as f64 - estimated as f64);
        self.add_cost(tenant, cost);
        cost
    }

    /// Removes and returns every queued request matching `drop` (deadline passed, client gone).
    pub fn remove_where(&mut self, mut drop: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut removed = Vec::new();
        let leaves: Vec<usize> = self.by_name.values().copied().collect();
        for leaf in leaves {
            for class in 0..CLASSES {
                if !self.nodes[leaf].queues[class].iter().any(|e| drop(&e.item)) {
                    continue;
                }
                self.unindex_head(leaf, class);
                let queue = std::mem::take(&mut self.nodes[leaf].queues[class]);
                let (gone, kept): (VecDeque<_>, VecDeque<_>) =
                    queue.into_iter().partition(|e| drop(&e.item));
                self.nodes[leaf].queues[class] = kept;
                self.index_head(leaf, class);
                let path = self.ancestry(leaf);
                self.remove_backlog(&path, class, gone.len());
                self.count_org(leaf, gone.len(), false);
                self.len -= gone.len();
                for e in &gone {
                    self.arrivals[class].gone(e);
                }
                removed.extend(gone.into_iter().map(|e| e.item));
            }
        }
        removed
    }

    /// Arrival time of the oldest queued request of a class (wherever it is in its tenant's
    /// queue), for projecting waits.
    pub fn oldest_ms(&self, priority: Priority) -> Option<u64> {
        self.arrivals[class_of(priority)].oldest_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const I: Priority = Priority::Interactive;
    const B: Priority = Priority::Batch;

    /// The fair policy over the hierarchy, with batch aging after `aging_ms`.
    fn fair_aged(aging_ms: u64) -> Scheduler<u32> {
        Scheduler::new(
            Policy::Fair,
            Share::Hierarchy,
            TokenWeights::default(),
            aging_ms,
        )
    }

    fn fair() -> Scheduler<u32> {
        fair_aged(60_000)
    }

    /// Queues four requests for each of `tenants` (path and per-level weights), then serves
    /// `decisions` requests of 100 + 100 tokens, keeping every tenant backlogged; returns tokens
    /// served per tenant.
    fn serve(
        s: &mut Scheduler<u32>,
        decisions: usize,
        tenants: &[(&str, &[f64])],
    ) -> HashMap<String, u64> {
        for (name, weights) in tenants {
            for _ in 0..4 {
                s.push(name, weights, I, 0, 0);
            }
        }
        let mut served = HashMap::new();
        for _ in 0..decisions {
            let d = s.pop(0).unwrap();
            let tenant = d.tenant.to_owned();
            s.charge(&tenant, 100, 100);
            *served.entry(tenant.clone()).or_insert(0) += 200;
            let weights = tenants.iter().find(|(n, _)| *n == tenant).unwrap().1;
            s.push(&tenant, weights, I, 0, 0);
        }
        served
    }

    /// The next `n` keys served 100 + 100 tokens each; those under `refill` (a path prefix;
    /// empty: none) queue another request after each turn, so they stay backlogged.
    fn turns(s: &mut Scheduler<u32>, n: usize, refill: &str) -> Vec<String> {
        (0..n)
            .map(|_| {
                let t = s.pop(0).unwrap().tenant.to_owned();
                s.charge(&t, 100, 100);
                if !refill.is_empty() && t.starts_with(refill) {
                    s.push(&t, &[], I, 0, 0);
                }
                t
            })
            .collect()
    }

    /// Tokens served below `prefix` (a tenant path or a level of one).
    fn below(served: &HashMap<String, u64>, prefix: &str) -> u64 {
        served
            .iter()
            .filter(|(t, _)| t.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    }

    fn near(ratio: f64, expected: f64) -> bool {
        (ratio / expected - 1.0).abs() < 0.05
    }

    #[test]
    fn weights_divide_served_tokens() {
        let mut s = fair();
        let served = serve(&mut s, 4_000, &[("a", &[3.0]), ("b", &[1.0])]);
        let ratio = served["a"] as f64 / served["b"] as f64;
        assert!(near(ratio, 3.0), "a:b = {ratio:.2}");
    }

    /// Org `a` with one key, org `b` with ten (one weighted 3); every weight above the keys 1.
    fn one_key_against_ten(share: Share) -> HashMap<String, u64> {
        let names: Vec<String> = (0..10).map(|i| format!("b/w/p/k{i}")).collect();
        let mut tenants: Vec<(&str, &[f64])> = vec![("a/w/p/k", &[1.0, 1.0, 1.0, 1.0])];
        for (i, name) in names.iter().enumerate() {
            let weights: &[f64] = if i == 0 {
                &[1.0, 1.0, 1.0, 3.0]
            } else {
                &[1.0, 1.0, 1.0, 1.0]
            };
            tenants.push((name, weights));
        }
        let mut s = Scheduler::new(Policy::Fair, share, TokenWeights::default(), 60_000);
        serve(&mut s, 12_000, &tenants)
    }

    #[test]
    fn orgs_share_by_org_weight_however_many_keys_they_mint() {
        let served = one_key_against_ten(Share::Hierarchy);
        let (a, b) = (below(&served, "a/"), below(&served, "b/"));
        assert!(near(a as f64 / b as f64, 1.0), "a:b = {a}:{b}");
        // Within b, keys share b's half by their weights.
        let ratio = served["b/w/p/k0"] as f64 / served["b/w/p/k1"] as f64;
        assert!(near(ratio, 3.0), "k0:k1 = {ratio:.2}");
        // Per key, b's keys take twelve shares to a's one.
        let served = one_key_against_ten(Share::Key);
        let (a, b) = (below(&served, "a/"), below(&served, "b/"));
        assert!(near(b as f64 / a as f64, 12.0), "a:b = {a}:{b}");
    }

    #[test]
    fn the_backlogged_top_level_shares_and_each_level_s_counter_are_visible() {
        let mut s = fair();
        s.push("x/b/p/k", &[2.0, 1.0, 1.0, 1.0], I, 0, 0);
        s.push("y/a/p/k", &[1.0, 1.0, 1.0, 1.0], B, 1, 0);
        s.charge("x/b/p/k", 100, 0);
        let shares: Vec<(&str, f64, f64)> = s.backlogged_shares().collect();
        assert_eq!(shares, vec![("x", 2.0, 50.0), ("y", 1.0, 0.0)]);
        assert_eq!(s.share_of("x/b/p/k"), "x");
        assert_eq!(s.share_weight("x"), 2.0);
        assert_eq!(s.counter_at("x/b"), Some(100.0));
        assert_eq!(s.counter_at("x/b/p/k"), Some(100.0));
        assert_eq!(s.counter_at("z"), None);
        s.pop(0);
        let left: Vec<&str> = s.backlogged_shares().map(|(n, _, _)| n).collect();
        assert_eq!(left, vec!["y"], "x's queue emptied");
    }

    #[test]
    fn level_weights_divide_each_level_and_an_idle_key_s_share_goes_to_its_siblings() {
        let mut s = fair();
        // Org x weighted 2 against y; within x, workspaces 1:1; x's workspace "b" has two
        // keys, of which one is served once and then stays idle.
        s.push("x/b/p/k2", &[2.0, 1.0, 1.0, 1.0], I, 0, 0);
        s.pop(0);
        s.charge("x/b/p/k2", 100, 100);
        let served = serve(
            &mut s,
            12_000,
            &[
                ("x/a/p/k", &[2.0, 1.0, 1.0, 1.0]),
                ("x/b/p/k1", &[2.0, 1.0, 1.0, 1.0]),
                ("y/a/p/k", &[1.0, 1.0, 1.0, 1.0]),
            ],
        );
        let (x, y) = (below(&served, "x/"), below(&served, "y/"));
        assert!(near(x as f64 / y as f64, 2.0), "x:y = {x}:{y}");
        let (xa, xb) = (below(&served, "x/a/"), below(&served, "x/b/"));
        assert!(near(xa as f64 / xb as f64, 1.0), "x/a:x/b = {xa}:{xb}");
    }

    #[test]
    fn a_level_returning_from_idle_is_lifted_among_its_siblings() {
        let mut s = fair();
        // Workspaces a and b of org o run up their counters; workspace c is idle.
        let served = serve(&mut s, 100, &[("o/a/p/k", &[]), ("o/b/p/k", &[])]);
        assert_eq!(served.len(), 2);
        let workspace = |s: &Scheduler<u32>, key: &str| {
            let project = s.nodes[s.by_name[key]].parent;
            s.nodes[s.nodes[project].parent].counter
        };
        let floor = workspace(&s, "o/a/p/k").min(workspace(&s, "o/b/p/k"));
        assert!(floor > 10_000.0, "{floor}");
        s.push("o/c/p/k", &[], I, 7, 0);
        assert_eq!(
            workspace(&s, "o/c/p/k"),
            floor,
            "lifted to its backlogged siblings' minimum"
        );
        // So c gets a turn, not a burst.
        assert_eq!(s.pop(0).unwrap().item, 7);
        s.charge("o/c/p/k", 100, 100);
        for _ in 0..3 {
            s.push("o/c/p/k", &[], I, 8, 0);
        }
        let next = turns(&mut s, 3, "");
        assert!(
            next.iter().filter(|t| *t == "o/c/p/k").count() <= 2,
            "{next:?}"
        );
    }

    #[test]
    fn queued_batch_work_banks_no_interactive_credit() {
        // An org (then, within an org, a workspace) keeps a batch request queued while its
        // interactive key is idle (interactive traffic goes first, no aging); another org's
        // (workspace's) interactive key is served meanwhile. When the idle key wakes up it
        // takes turns with the busy one, not the pool until it has caught up on everything
        // the busy one was served while the batch request waited.
        for (batch, busy, waking) in [
            ("x/w/p/batch", "y/w/p/chat", "x/w/p/chat"),
            ("o/bulk/p/k", "o/chat/p/k", "o/bulk/p/chat"),
        ] {
            let mut s = fair();
            s.push(batch, &[], B, 0, 0);
            serve(&mut s, 200, &[(busy, &[])]);
            for _ in 0..20 {
                s.push(waking, &[], I, 1, 0);
            }
            let next = turns(&mut s, 20, busy);
            let woken = next.iter().filter(|t| *t == waking).count();
            assert!((9..=11).contains(&woken), "{waking} took {woken} of 20");
        }
    }

    #[test]
    fn a_small_tenant_goes_ahead_of_a_flood() {
        let mut s = fair();
        for i in 0..100 {
            s.push("noisy", &[1.0], I, i, 0);
        }
        // The flood has been served a while.
        for _ in 0..10 {
            let d = s.pop(0).unwrap();
            assert_eq!(d.tenant, "noisy");
            s.charge("noisy", 2_000, 0);
        }
        s.push("small", &[1.0], I, 999, 0);
        assert_eq!(
            s.pop(0).unwrap().item,
            999,
            "the new tenant's counter is lowest"
        );
    }

    #[test]
    fn a_request_pushed_to_the_front_goes_before_its_tenant_s_others_and_ages_from_then() {
        let mut s = fair_aged(1_000);
        s.push("a", &[1.0], B, 1, 0);
        s.push("a", &[1.0], B, 2, 0);
        s.push("b", &[1.0], I, 3, 0);
        s.push_front("a", &[1.0], B, 0, 900);
        assert_eq!(s.len(), 4);
        assert_eq!(s.depth("a"), 3);
        assert_eq!(
            s.oldest_ms(B),
            Some(0),
            "a's others, behind it, have waited since 0"
        );
        // At 1500 a's head has waited 600 ms, under the aging bound: interactive first.
        assert_eq!(s.pop(1_500).unwrap().item, 3);
        assert_eq!(s.pop(1_500).unwrap().item, 0, "the head of a's batch queue");
        assert_eq!(s.pop(1_500).unwrap().item, 1);
        assert_eq!(s.oldest_ms(B), Some(0));
        assert_eq!(s.pop(1_500).unwrap().item, 2);
        assert_eq!(s.oldest_ms(B), None);
        // Aged from its push: ahead of interactive work once the bound has passed.
        s.push("b", &[1.0], I, 4, 2_000);
        s.push_front("a", &[1.0], B, 5, 2_000);
        assert_eq!(s.pop(3_000).unwrap().item, 5);
    }

    #[test]
    fn returning_from_idle_lifts_to_the_backlogged_minimum() {
        let mut s = fair();
        s.push("a", &[1.0], I, 1, 0);
        s.push("b", &[1.0], I, 2, 0);
        // a and b run up their counters while c is idle.
        for _ in 0..2 {
            let d = s.pop(0).unwrap();
            let t = d.tenant.to_owned();
            s.charge(&t, 1_000, 0);
            s.push(&t, &[1.0], I, 0, 0);
        }
        assert_eq!(s.counter("c"), 0.0);
        s.push("c", &[1.0], I, 3, 0);
        assert_eq!(s.counter("c"), 1_000.0, "lifted, not left at 0");
        // So c gets one turn, not a burst: after one charge it is behind a and b again.
        assert_eq!(s.pop(0).unwrap().tenant, "c");
        s.charge("c", 1_000, 0);
        s.push("c", &[1.0], I, 4, 0);
        assert_ne!(s.pop(0).unwrap().tenant, "c");
    }

    #[test]
    fn an_arrival_to_an_empty_queue_is_lifted_to_the_last_tenant_that_left() {
        let mut s = fair();
        // a runs alone, unsaturated: its queue empties after every request.
        for i in 0..10 {
            s.push("a", &[1.0], I, i, 0);
            let d = s.pop(0).unwrap();
            assert_eq!(d.tenant, "a");
            s.charge("a", 1_000, 0);
        }
        assert!(s.is_empty());
        // b shows up to an empty queue: no credit for the hour a ran alone...
        s.push("b", &[1.0], I, 100, 0);
        assert_eq!(s.counter("b"), 10_000.0);
        // ...so when contention starts they alternate instead of b monopolising.
        s.push("a", &[1.0], I, 11, 0);
        let mut order = Vec::new();
        for _ in 0..6 {
            let d = s.pop(0).unwrap();
            let t = d.tenant.to_owned();
            s.charge(&t, 1_000, 0);
            s.push(&t, &[1.0], I, 0, 0);
            order.push(t);
        }
        let b_turns = order.iter().filter(|t| *t == "b").count();
        assert_eq!(b_turns, 3, "{order:?}");
        // A counter never goes down by lifting.
        let mut s = fair();
        s.push("x", &[1.0], I, 1, 0);
        s.pop(0);
        s.push("y", &[1.0], I, 2, 0);
        s.pop(0);
        s.charge("y", 5_000, 0);
        s.push("x", &[1.0], I, 3, 0);
        assert_eq!(s.counter("x"), 5_000.0);
        s.pop(0);
        s.charge("y", 1_000, 0);
        s.push("y", &[1.0], I, 4, 0);
        assert_eq!(s.counter("y"), 6_000.0, "lifting never lowers a counter");
    }

    #[test]
    fn the_oldest_wait_is_the_oldest_stamp_when_the_clock_steps_back() {
        let mut s = fair();
        s.push("a", &[1.0], I, 1, 10_000);
        // The wall clock stepped back a second; b's request has waited longest in fact.
        s.push("b", &[1.0], I, 2, 9_000);
        s.push("c", &[1.0], I, 3, 9_500);
        assert_eq!(s.oldest_ms(I), Some(9_000));
        s.remove_where(|&i| i == 2);
        assert_eq!(s.oldest_ms(I), Some(9_500));
        s.remove_where(|&i| i == 3);
        assert_eq!(s.oldest_ms(I), Some(10_000));
        s.remove_where(|_| true);
        assert_eq!(s.oldest_ms(I), None);
    }

    #[test]
    fn the_arrival_log_stays_bounded_behind_a_request_that_waits_forever() {
        let mut s = fair();
        // A resumed request its tenant is never allowed to take (over its share), while
        // another tenant's batch traffic flows.
        s.push_front("stuck", &[1.0], B, 0, 0);
        let skip_stuck = |t: &str, _: &u32| {
            if t == "stuck" {
                Verdict::Skip
            } else {
                Verdict::Take
            }
        };
        for i in 1..=100_000u64 {
            s.push("flow", &[1.0], B, 1, i);
            assert_eq!(s.pop_where(i, skip_stuck).unwrap().tenant, "flow");
        }
        assert!(
            s.arrivals[1].log.len() < 2_000,
            "{}",
            s.arrivals[1].log.len()
        );
        assert_eq!(s.oldest_ms(B), Some(0));
        assert_eq!(s.pop(100_000).unwrap().item, 0);
        assert_eq!(s.oldest_ms(B), None);
        assert!(s.arrivals[1].log.is_empty());
    }

    #[test]
    fn interactive_goes_before_batch_and_batch_ages() {
        let mut s = fair_aged(5_000);
        s.push("bulk", &[1.0], B, 1, 0);
        s.push("chat", &[1.0], I, 2, 1_000);
        assert_eq!(s.pop(1_000).unwrap().item, 2);
        s.push("chat", &[1.0], I, 3, 1_000);
        assert_eq!(
            s.pop(4_999).unwrap().item,
            3,
            "batch waits while interactive is queued"
        );
        s.push("chat", &[1.0], I, 4, 5_000);
        let aged = s.pop(5_000).unwrap();
        assert_eq!((aged.item, aged.priority, aged.waited_ms), (1, B, 5_000));
        assert_eq!(s.pop(5_000).unwrap().item, 4);
        assert!(s.pop(5_000).is_none());
    }

    #[test]
    fn fifo_serves_in_arrival_order() {
        let mut s = Scheduler::new(
            Policy::Fifo,
            Share::Hierarchy,
            TokenWeights::default(),
            60_000,
        );
        for (i, t) in ["noisy", "noisy", "small", "noisy"].iter().enumerate() {
            s.push(t, &[1.0], I, i as u32, 0);
        }
        let order: Vec<u32> = std::iter::from_fn(|| s.pop(0).map(|d| d.item)).collect();
        assert_eq!(order, vec![0, 1, 2, 3]);
    }

    #[test]
    fn removal_keeps_the_index_consistent() {
        let mut s = fair();
        for i in 0..6 {
            s.push(if i % 2 == 0 { "a" } else { "b" }, &[1.0], I, i, 0);
        }
        let gone = s.remove_where(|&i| i < 3);
        assert_eq!(gone.len(), 3);
        assert_eq!((s.len(), s.depth("a"), s.depth("b")), (3, 1, 2));
        let rest: Vec<u32> = std::iter::from_fn(|| s.pop(0).map(|d| d.item)).collect();
        let mut sorted = rest.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![3, 4, 5]);
        assert!(s.is_empty());
    }

    #[test]
    fn skipped_tenants_keep_their_place_and_waiting_blocks_the_rest() {
        let mut s = fair();
        s.push("hog", &[1.0], I, 1, 0);
        s.push("other", &[1.0], I, 2, 0);
        s.charge("other", 500, 0);
        let skip_hog = |t: &str, _: &u32| {
            if t == "hog" {
                Verdict::Skip
            } else {
                Verdict::Take
            }
        };
        assert_eq!(
            s.pop_where(0, skip_hog).unwrap().item,
            2,
            "over its cap: skipped"
        );
        assert_eq!(s.pop(0).unwrap().item, 1, "and still first afterwards");

        s.push("big", &[1.0], I, 3, 0);
        s.push("small", &[1.0], I, 4, 0);
        s.charge("small", 500, 0);
        let big_waits = |t: &str, _: &u32| {
            if t == "big" {
                Verdict::Wait
            } else {
                Verdict::Take
            }
        };
        assert!(
            s.pop_where(0, big_waits).is_none(),
            "nobody overtakes a head that waits for room"
        );
    }

    #[test]
    fn fifo_blocks_behind_a_head_that_does_not_fit() {
        let mut s = Scheduler::new(
            Policy::Fifo,
            Share::Hierarchy,
            TokenWeights::default(),
            60_000,
        );
        s.push("noisy", &[1.0], I, 1, 0);
        s.push("small", &[1.0], I, 2, 0);
        let fits = |_: &str, item: &u32| {
            if *item == 1 {
                Verdict::Wait
            } else {
                Verdict::Take
            }
        };
        assert!(s.pop_where(0, fits).is_none());
    }

    #[test]
    fn an_estimate_is_replaced_by_the_engines_count() {
        let mut s = fair();
        s.push("x", &[2.0], I, 1, 0);
        s.pop(0);
        s.charge("x", 10, 0);
        s.correct_input("x", 10, 3_000);
        assert_eq!(s.counter("x"), 1_500.0, "charged in full, by weight");
        s.correct_input("x", 3_000, 1_000);
        assert_eq!(s.counter("x"), 500.0, "an overestimate is refunded");
    }

    #[test]
    fn bad_weights_fall_back_to_one() {
        let mut s = fair();
        s.push("x", &[0.0], I, 1, 0);
        s.pop(0);
        s.charge("x", 10, 0);
        assert_eq!(s.counter("x"), 10.0);
    }
}

#[cfg(test)]
mod invariants {
    //! Random pushes, pops (with every verdict), charges and removals, checking after each
    //! operation that the tree's bookkeeping matches its queues.
    use super::*;

    use crate::draw::Rng;

    /// Tenant paths of different depths, some of whose levels share ids with others' keys.
    const TENANTS: &[&str] = &[
        "a", "a/b", "a/b/c/d", "a/b/c/e", "a/x/c/d", "b/a", "b/a/c/d", "c/c/c/c", "d",
    ];

    fn check(s: &Scheduler<u32>) {
        let mut queued = vec![[0usize; CLASSES]; s.nodes.len()];
        let mut heads: [BTreeSet<Head>; CLASSES] = Default::default();
        let mut oldest = [None; CLASSES];
        for (name, &leaf) in &s.by_name {
            assert_eq!(s.nodes[leaf].name, *name);
            for (c, q) in s.nodes[leaf].queues.iter().enumerate() {
                if let Some(h) = q.front()
                    && s.indexed(c)
                {
                    heads[c].insert((h.enqueued_ms, h.seq, leaf));
                }
                for e in q {
                    oldest[c] =
                        Some(oldest[c].map_or(e.enqueued_ms, |o: u64| o.min(e.enqueued_ms)));
                }
                let mut at = leaf;
                loop {
                    queued[at][c] += q.len();
                    if at == ROOT {
                        break;
                    }
                    at = s.nodes[at].parent;
                }
            }
        }
        assert_eq!(heads, s.heads, "queue heads");
        for (c, priority) in [Priority::Interactive, Priority::Batch]
            .into_iter()
            .enumerate()
        {
            assert_eq!(s.oldest_ms(priority), oldest[c], "oldest of class {c}");
        }
        let mut by_org: HashMap<String, usize> = HashMap::new();
        for (name, &leaf) in &s.by_name {
            let n: usize = s.nodes[leaf].queues.iter().map(VecDeque::len).sum();
            if n > 0 {
                *by_org.entry(org_of(name).to_owned()).or_default() += n;
            }
        }
        let depths: HashMap<String, usize> = s
            .orgs
            .iter()
            .map(|(org, &slot)| (org.clone(), s.org_depth[slot]))
            .filter(|&(_, n)| n > 0)
            .collect();
        assert_eq!(by_org, depths, "queued per org");
        assert_eq!(s.len, queued[ROOT].iter().sum::<usize>(), "len");
        for (n, node) in s.nodes.iter().enumerate() {
            assert_eq!(node.backlog, queued[n], "backlog of {:?}", node.name);
            for (c, ready) in node.ready.iter().enumerate() {
                let expected: BTreeSet<_> = node
                    .children
                    .values()
                    .filter(|&&child| queued[child][c] > 0)
                    .map(|&child| s.nodes[child].key(child))
                    .collect();
                let ready: BTreeSet<_> = ready.iter().copied().collect();
                assert_eq!(ready, expected, "ready set {c} of {:?}", node.name);
            }
        }
    }

    /// Queued requests of `class` below node `n`, counted from the queues themselves.
    fn queued_below(s: &Scheduler<u32>, n: usize, class: usize) -> usize {
        s.nodes[n].queues[class].len()
            + s.nodes[n]
                .children
                .values()
                .map(|&c| queued_below(s, c, class))
                .sum::<usize>()
    }

    /// The fair order worked out from the counters alone (no ready sets): children with work
    /// queued, by counter, then least recently charged, then index; depth first.
    fn model_descend(
        s: &Scheduler<u32>,
        n: usize,
        class: usize,
        judge: &impl Fn(&str) -> Verdict,
    ) -> Found {
        let node = &s.nodes[n];
        if !node.queues[class].is_empty() {
            return match judge(&node.name) {
                Verdict::Take => Found::Take(n, class),
                Verdict::Skip => Found::Nothing,
                Verdict::Wait => Found::Wait,
            };
        }
        let mut children: Vec<usize> = node
            .children
            .values()
            .copied()
            .filter(|&c| queued_below(s, c, class) > 0)
            .collect();
        children.sort_by(|&a, &b| {
            let (x, y) = (&s.nodes[a], &s.nodes[b]);
            x.counter
                .total_cmp(&y.counter)
                .then(x.last_charged.cmp(&y.last_charged))
                .then(a.cmp(&b))
        });
        for c in children {
            match model_descend(s, c, class, judge) {
                Found::Nothing => continue,
                found => return found,
            }
        }
        Found::Nothing
    }

    /// What the next decision should be, from the queues and counters alone.
    fn model_choose(
        s: &Scheduler<u32>,
        now: u64,
        judge: &impl Fn(&str) -> Verdict,
    ) -> Option<(usize, usize)> {
        let mut heads: Vec<(u64, u64, usize, usize)> = Vec::new();
        for &leaf in s.by_name.values() {
            for c in 0..CLASSES {
                if let Some(h) = s.nodes[leaf].queues[c].front() {
                    heads.push((h.enqueued_ms, h.seq, leaf, c));
                }
            }
        }
        heads.sort_unstable();
        let in_line: Vec<(usize, usize)> = match s.policy {
            Policy::Fifo => heads.iter().map(|&(_, _, l, c)| (l, c)).collect(),
            Policy::Fair => heads
                .iter()
                .filter(|&&(_, _, _, c)| c == 1)
                .take_while(|&&(e, _, _, _)| now.saturating_sub(e) >= s.aging_ms)
                .map(|&(_, _, l, c)| (l, c))
                .collect(),
        };
        for (leaf, c) in in_line {
            match judge(&s.nodes[leaf].name) {
                Verdict::Take => return Some((leaf, c)),
                Verdict::Wait => return None,
                Verdict::Skip => {}
            }
        }
        if s.policy == Policy::Fifo {
            return None;
        }
        for class in 0..CLASSES {
            match model_descend(s, ROOT, class, judge) {
                Found::Take(l, c) => return Some((l, c)),
                Found::Wait => return None,
                Found::Nothing => {}
            }
        }
        None
    }

    /// Each node's ready sets in iteration order: sorted, without duplicates. Returns whether
    /// one of them is a B-tree.
    fn check_ready_order(s: &Scheduler<u32>) -> bool {
        let mut many = false;
        for node in &s.nodes {
            for ready in &node.ready {
                let keys: Vec<Key> = ready.iter().copied().collect();
                assert!(
                    keys.windows(2).all(|w| w[0] < w[1]),
                    "ready set of {:?} out of order or duplicated: {keys:?}",
                    node.name
                );
                assert_eq!(ready.first(), keys.first());
                many |= matches!(ready, Ready::Many(_));
            }
        }
        many
    }

    struct Options {
        tenants: Vec<String>,
        /// The clock may step back (now_ms is wall-clock time in the dispatcher).
        jumpy_clock: bool,
        steps: u64,
    }

    fn run(policy: Policy, share: Share, seed: u64) {
        let options = Options {
            tenants: TENANTS.iter().map(|t| (*t).to_owned()).collect(),
            jumpy_clock: false,
            steps: 3_000,
        };
        run_with(policy, share, seed, &options);
    }

    /// Returns how many steps ended with a B-tree among the ready sets.
    fn run_with(policy: Policy, share: Share, seed: u64, o: &Options) -> u64 {
        let mut many = 0;
        let mut rng = Rng::new(seed);
        let mut s = Scheduler::new(policy, share, TokenWeights::default(), 500);
        let mut item = 0u32;
        let mut clock = 10_000u64;
        for _ in 0..o.steps {
            clock = if o.jumpy_clock && rng.below(40) == 0 {
                clock.saturating_sub(rng.below(3_000))
            } else {
                clock + rng.below(20)
            };
            let now = clock;
            let tenant = o.tenants[rng.below(o.tenants.len() as u64) as usize].as_str();
            match rng.below(12) {
                0..=3 => {
                    let weights: Vec<f64> = (0..rng.below(6))
                        .map(|_| [0.5, 1.0, 3.0, 0.0, f64::NAN][rng.below(5) as usize])
                        .collect();
                    let priority = if rng.below(3) == 0 {
                        Priority::Batch
                    } else {
                        Priority::Interactive
                    };
                    item += 1;
                    if rng.below(4) == 0 {
                        s.push_front(tenant, &weights, priority, item, now);
                    } else {
                        s.push(tenant, &weights, priority, item, now);
                    }
                }
                4..=6 => {
                    let verdicts = [Verdict::Take, Verdict::Skip, Verdict::Wait];
                    let chosen: HashMap<&str, Verdict> = o
                        .tenants
                        .iter()
                        .map(|t| (t.as_str(), verdicts[(rng.below(7) as usize).min(2)]))
                        .collect();
                    let judge = |t: &str| chosen[t];
                    let expected = model_choose(&s, now, &judge)
                        .map(|(l, c)| (s.nodes[l].name.clone(), s.nodes[l].queues[c][0].item));
                    let popped = s
                        .pop_where(now, |t, _| chosen[t])
                        .map(|d| (d.tenant.to_owned(), d.item));
                    assert_eq!(popped, expected, "decision at {now}");
                    if let Some((t, _)) = popped {
                        // Zero-token charges (a resumed request) and none at all (a refusal
                        // after the pop) happen too.
                        match rng.below(6) {
                            0 => {}
                            1 => {
                                s.charge(&t, 0, 0);
                            }
                            _ => {
                                s.charge(&t, rng.below(500), rng.below(500));
                            }
                        }
                    }
                }
                7 => {
                    s.charge(tenant, rng.below(300), rng.below(300));
                }
                8 => {
                    s.correct_input(tenant, rng.below(300), rng.below(300));
                }
                9 => {
                    // A large refund: counters go below their siblings', even below zero.
                    s.correct_input(tenant, rng.below(100_000), 0);
                }
                10 => {
                    let m = rng.below(5) as u32 + 2;
                    s.remove_where(|&i| i % m == 0);
                }
                _ => {
                    // A full queue gives up a tenant's newest request (its batch work first)
                    // that it may give up.
                    let m = rng.below(3) as u32 + 2;
                    let may = |i: &u32| !i.is_multiple_of(m);
                    let newest = s.by_name.get(tenant).and_then(|&n| {
                        let q = &s.nodes[n].queues;
                        let back = |c: usize| q[c].back().map(|e| e.item).filter(may);
                        back(1).or(back(0))
                    });
                    let before = s.queued_ahead(tenant, Priority::Batch);
                    assert_eq!(s.pop_newest_where(tenant, may), newest);
                    assert_eq!(
                        s.queued_ahead(tenant, Priority::Batch),
                        before - usize::from(newest.is_some())
                    );
                }
            }
            check(&s);
            many += u64::from(check_ready_order(&s));
        }
        while s.pop(u64::MAX).is_some() {
            check(&s);
        }
        assert!(s.is_empty());
        many
    }

    /// Keys enough that the root (and, under the hierarchy, one org) has more than
    /// `ready::MANY` children with work queued, and falls back below a quarter of it.
    fn many_tenants() -> Vec<String> {
        let mut tenants: Vec<String> = (0..40).map(|i| format!("o{i}")).collect();
        tenants.extend((0..40).map(|i| format!("big/w{i}/p/k")));
        tenants.extend(TENANTS.iter().map(|t| (*t).to_owned()));
        tenants
    }

    #[test]
    fn many_tenants_keep_the_bookkeeping_and_the_fair_order() {
        let options = Options {
            tenants: many_tenants(),
            jumpy_clock: false,
            steps: 4_000,
        };
        let mut many = 0;
        for seed in 1..=6u64 {
            let seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            many += run_with(Policy::Fair, Share::Hierarchy, seed, &options);
            many += run_with(Policy::Fair, Share::Key, seed, &options);
            many += run_with(Policy::Fifo, Share::Hierarchy, seed, &options);
        }
        assert!(many > 1_000, "B-trees in {many} steps only");
    }

    #[test]
    fn a_clock_stepping_back_keeps_the_bookkeeping_and_the_fair_order() {
        let options = Options {
            tenants: many_tenants(),
            jumpy_clock: true,
            steps: 3_000,
        };
        for seed in 1..=6u64 {
            let seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            run_with(Policy::Fair, Share::Hierarchy, seed, &options);
            run_with(Policy::Fair, Share::Key, seed, &options);
            run_with(Policy::Fifo, Share::Hierarchy, seed, &options);
        }
    }

    #[test]
    fn the_tree_s_bookkeeping_matches_its_queues_under_random_operations() {
        for seed in 1..=20u64 {
            let seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            run(Policy::Fair, Share::Hierarchy, seed);
            run(Policy::Fair, Share::Key, seed);
            run(Policy::Fifo, Share::Hierarchy, seed);
        }
    }
}

//! Who goes first among the requests one worker holds for one (pool, account): a fair queue.
//!
//! Releases are shared by weight among the hold classes that have requests waiting, and within
//! a class equally among the values of `hold.fair_key` that have requests waiting; within a
//! value, arrival order. It is start-time fair queueing (Goyal, Vin and Cheng, 1996), which is
//! deficit round robin's fairness with costs known only when a request leaves: every class and
//! every value carries a tag, the service it had (the cost of its releases, over its weight),
//! and the next release goes to the least-served class, in it to the least-served value, ties
//! to the one waiting longest. A class or value that starts waiting starts at the tag of the
//! last one served: it gets no credit for the time it did not wait. Nothing is kept for a
//! class or value with nothing waiting. With one class and no fair key there is one value:
//! arrival order.
//!
//! A wait is kept where it applies: a gate of the whole (pool, account) (its cooldown, its pace,
//! a limit keyed by account or pool) stops the queue; a limit of a value's own (a tenant's
//! bucket) stops that value only, and the next value goes.

use crate::blocked::Blocked;
use crate::request::Flow;
use std::collections::VecDeque;

/// A request being held.
#[derive(Debug)]
pub struct Held {
    pub id: u32,
    pub flow: Flow,
    pub since_ms: u64,
    /// Why it waits, as of `blocked_at_ms`.
    pub blocked: Blocked,
    pub blocked_at_ms: u64,
}

/// The tag a release of cost 1 adds to a class of weight 1: tags stay whole numbers for every
/// weight up to the configured maximum (1000).
pub(crate) const SCALE: u64 = 1_000_000;

/// Why requests wait, since when, and when the gates are asked again.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wait {
    pub(crate) blocked: Blocked,
    pub(crate) at_ms: u64,
    pub(crate) check_ms: u64,
}

impl Wait {
    pub(crate) fn new(blocked: Blocked, now: u64) -> Wait {
        Wait {
            blocked,
            at_ms: now,
            check_ms: now.saturating_add(blocked.recheck_in_ms()),
        }
    }

    /// A wait asked about again at `check_ms`, whatever it says.
    pub(crate) fn until(blocked: Blocked, now: u64, check_ms: u64) -> Wait {
        Wait {
            blocked,
            at_ms: now,
            check_ms,
        }
    }

    /// The wait as it stands at `now`.
    pub(crate) fn at(&self, now: u64) -> Blocked {
        self.blocked.aged(now.saturating_sub(self.at_ms))
    }
}

/// Where a held request is: its class and value (indices into the queue) and its place in
/// its value's arrival order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    class: usize,
    value: usize,
    pub(crate) pos: usize,
}

struct Value {
    id: u64,
    tag: u64,
    order: u64,
    held: VecDeque<Held>,
    /// A limit of this value's own refused its first request.
    wait: Option<Wait>,
}

struct Class {
    /// Its index in `hold.classes`.
    index: usize,
    weight: u64,
    tag: u64,
    order: u64,
    /// The tag of the value served last: where a value that starts waiting starts.
    vtime: u64,
    values: Vec<Value>,
}

/// The held requests of one (pool, account) on one worker, in the order they leave.
#[derive(Default)]
pub(crate) struct Queue {
    classes: Vec<Class>,
    /// The tag of the class served last.
    vtime: u64,
    /// How many classes and values started waiting so far: ties go to the earlier.
    order: u64,
    len: usize,
    /// A gate of the whole (pool, account) refused: nobody asks before its check.
    pub(crate) wait: Option<Wait>,
    /// Why the request that joined last waits: what a newcomer waits for when no gate has
    /// refused since.
    pub(crate) recent: Option<Wait>,
    releases: Releases,
    /// Per hold class, the latest turn a request of it was told when it could not wait for
    /// it: the next one told is told a turn after that, so they come back one after another.
    promised: Vec<u64>,
}

/// The requests that go before one, at the order's current tags, each release costing the
/// same: those of its own class (it can tell which), and how many of other classes.
pub(crate) struct Ahead<'a> {
    pub(crate) mine: Vec<&'a Held>,
    pub(crate) others: u64,
}

impl Queue {
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Values waiting now, over all classes.
    pub(crate) fn values(&self) -> usize {
        self.classes.iter().map(|c| c.values.len()).sum()
    }

    pub(crate) fn has_value(&self, class: usize, id: u64) -> bool {
        self.class_of(class)
            .is_some_and(|c| self.classes[c].values.iter().any(|v| v.id == id))
    }

    fn class_of(&self, index: usize) -> Option<usize> {
        self.classes.iter().position(|c| c.index == index)
    }

    /// Hold `h`, of class `class` (its `weight`) and fair-key value `id`: last of its value,
    /// or first when it was held before (it keeps its place). Where it is now.
    pub(crate) fn push(
        &mut self,
        h: Held,
        class: usize,
        weight: u64,
        id: u64,
        first: bool,
    ) -> Place {
        self.recent = Some(Wait::new(h.blocked, h.blocked_at_ms));
        let c = match self.class_of(class) {
            Some(c) => c,
            None => {
                self.order += 1;
                self.classes.push(Class {
                    index: class,
                    weight: weight.max(1),
                    tag: self.vtime,
                    order: self.order,
                    vtime: 0,
                    values: Vec::new(),
                });
                self.classes.len() - 1
            }
        };
        let class = &mut self.classes[c];
        let v = match class.values.iter().position(|v| v.id == id) {
            Some(v) => v,
            None => {
                self.order += 1;
                class.values.push(Value {
                    id,
                    tag: class.vtime,
                    order: self.order,
                    held: VecDeque::new(),
                    wait: None,
                });
                class.values.len() - 1
            }
        };
        let held = &mut class.values[v].held;
        let pos = if first {
            held.push_front(h);
            0
        } else {
            held.push_back(h);
            held.len() - 1
        };
        self.len += 1;
        Place {
            class: c,
            value: v,
            pos,
        }
    }

    /// Whose turn it is at `now`: the first request of the least-served value, with no wait
    /// of its own still running, of the least-served class that has one. None while a gate of
    /// the whole (pool, account) has not yet come due.
    pub(crate) fn next(&self, now: u64) -> Option<Place> {
        self.next_where(now, |_, _| true)
    }

    /// `next`, among the values `turn(class, value)` lets go (the others wait for their turn
    /// across workers, `board`).
    pub(crate) fn next_where(&self, now: u64, turn: impl Fn(usize, u64) -> bool) -> Option<Place> {
        if self.wait.is_some_and(|w| now < w.check_ms) {
            return None;
        }
        let ready = |c: &Class, v: &Value| {
            v.wait.map_or(true, |w| now >= w.check_ms) && turn(c.index, v.id)
        };
        let (class, c) = self
            .classes
            .iter()
            .enumerate()
            .filter(|(_, c)| c.values.iter().any(|v| ready(c, v)))
            .min_by_key(|(_, c)| (c.tag, c.order))?;
        let (value, _) = c
            .values
            .iter()
            .enumerate()
            .filter(|(_, v)| ready(c, v))
            .min_by_key(|(_, v)| (v.tag, v.order))?;
        Some(Place {
            class,
            value,
            pos: 0,
        })
    }

    /// The (class, value) of every value waiting for a gate of the whole (pool, account) (or
    /// for none): not for a limit of its own.
    pub(crate) fn ready(&self, now: u64) -> Vec<(usize, u64)> {
        let ready = |v: &&Value| v.wait.map_or(true, |w| now >= w.check_ms);
        let values = self.classes.iter().flat_map(|c| {
            let class = c.index;
            c.values.iter().filter(ready).map(move |v| (class, v.id))
        });
        values.collect()
    }

    /// The class (its index in `hold.classes`) of the request at `p`.
    pub(crate) fn class_at(&self, p: Place) -> usize {
        self.classes[p.class].index
    }

    pub(crate) fn get(&self, p: Place) -> Option<&Held> {
        self.classes
            .get(p.class)?
            .values
            .get(p.value)?
            .held
            .get(p.pos)
    }

    pub(crate) fn get_mut(&mut self, p: Place) -> Option<&mut Held> {
        let v = self.classes.get_mut(p.class)?.values.get_mut(p.value)?;
        v.held.get_mut(p.pos)
    }

    /// The fair-key value of the request at `p`.
    pub(crate) fn value_at(&self, p: Place) -> u64 {
        self.classes[p.class].values[p.value].id
    }

    /// What the request at `p` waits for: its value's own limit, else the gate of the whole
    /// (pool, account) (None: neither refused since it was held).
    pub(crate) fn wait_at(&self, p: Place) -> Option<Wait> {
        let own = self.classes.get(p.class)?.values.get(p.value)?.wait;
        own.or(self.wait)
    }

    /// When the gates are asked next: the check of the gate that stops the whole queue, else
    /// the earliest of the values' own (0: some value is free to ask now).
    pub(crate) fn next_check_ms(&self) -> Option<u64> {
        if let Some(w) = self.wait {
            return Some(w.check_ms);
        }
        let values = self.classes.iter().flat_map(|c| &c.values);
        values.map(|v| v.wait.map_or(0, |w| w.check_ms)).min()
    }

    /// The value of `p` waits for a limit of its own; the others go on. It is asked again at
    /// the next tick at the soonest, even when any answer may end its wait.
    pub(crate) fn hold_value(&mut self, p: Place, wait: Wait) {
        if let Some(v) = self
            .classes
            .get_mut(p.class)
            .and_then(|c| c.values.get_mut(p.value))
        {
            let check_ms = wait.check_ms.max(wait.at_ms.saturating_add(1));
            v.wait = Some(Wait { check_ms, ..wait });
        }
    }

    /// What waits for the value `id` of class `class` now: its own limit, else the gate of the
    /// whole (pool, account), else what the last to join waited for.
    pub(crate) fn wait_for(&self, class: usize, id: u64) -> Option<Wait> {
        let own = self.class_of(class).and_then(|c| {
            let v = self.classes[c].values.iter().find(|v| v.id == id)?;
            v.wait
        });
        own.or(self.wait).or(self.recent)
    }

    /// The first request of `p`'s value leaves: its class and value are charged `cost` (at
    /// least 1), and the waits it passed are over.
    pub(crate) fn release(&mut self, p: Place, cost: u64, now: u64) -> Option<Held> {
        let cost = cost.max(1);
        self.vtime = self.vtime.max(self.classes.get(p.class)?.tag);
        let class = &mut self.classes[p.class];
        class.tag = class
            .tag
            .saturating_add(cost.saturating_mul(SCALE) / class.weight);
        let v = class.values.get_mut(p.value)?;
        class.vtime = class.vtime.max(v.tag);
        v.tag = v.tag.saturating_add(cost);
        v.wait = None;
        self.wait = None;
        self.releases.note(now);
        self.take(p)
    }

    /// Remove the request at `p` without charging anyone (answered, or gone).
    pub(crate) fn take(&mut self, p: Place) -> Option<Held> {
        let class = self.classes.get_mut(p.class)?;
        let v = class.values.get_mut(p.value)?;
        let h = v.held.remove(p.pos)?;
        if v.held.is_empty() {
            class.values.swap_remove(p.value);
            if class.values.is_empty() {
                self.classes.swap_remove(p.class);
            }
        }
        self.len -= 1;
        Some(h)
    }

    /// Every held request with its place.
    pub(crate) fn places(&self) -> impl Iterator<Item = (Place, &Held)> + '_ {
        self.classes.iter().enumerate().flat_map(|(class, c)| {
            c.values.iter().enumerate().flat_map(move |(value, v)| {
                v.held.iter().enumerate().map(move |(pos, h)| {
                    let p = Place { class, value, pos };
                    (p, h)
                })
            })
        })
    }

    /// Remove and return every held request `leaves` picks, in the order of `places`.
    pub(crate) fn remove_where(&mut self, mut leaves: impl FnMut(&Held) -> bool) -> Vec<Held> {
        let mut out = Vec::new();
        for c in &mut self.classes {
            for v in &mut c.values {
                let mut kept = VecDeque::with_capacity(v.held.len());
                for h in v.held.drain(..) {
                    if leaves(&h) {
                        out.push(h);
                    } else {
                        kept.push_back(h);
                    }
                }
                v.held = kept;
            }
            c.values.retain(|v| !v.held.is_empty());
        }
        self.classes.retain(|c| !c.values.is_empty());
        self.len -= out.len();
        out
    }

    /// How many requests of value `id` of class `class` are held.
    pub(crate) fn len_of(&self, class: usize, id: u64) -> usize {
        let c = self.class_of(class);
        c.and_then(|c| self.classes[c].values.iter().find(|v| v.id == id))
            .map_or(0, |v| v.held.len())
    }

    /// The requests that leave before the `pos`-th of value `id` of class `class` (of `weight`;
    /// with `pos` its value's length: before one that joins it now), were every release to
    /// cost `step`: the order's tags say how many of each value and class go first.
    pub(crate) fn ahead(
        &self,
        (class, weight): (usize, u64),
        id: u64,
        pos: usize,
        step: u64,
    ) -> Ahead<'_> {
        let step = step.max(1);
        let mut order = self.order;
        let mut fresh = || {
            order += 1;
            order
        };
        let c = self.class_of(class);
        let (ctag, corder, weight) = match c {
            Some(c) => {
                let c = &self.classes[c];
                (c.tag, c.order, c.weight)
            }
            None => (self.vtime, fresh(), weight.max(1)),
        };
        let values = c.map_or(&[][..], |c| &self.classes[c].values[..]);
        let (vtag, vorder) = match values.iter().find(|v| v.id == id) {
            Some(v) => (v.tag, v.order),
            None => (c.map_or(0, |c| self.classes[c].vtime), fresh()),
        };
        // Its value's tag once it has left, then how many of each value of its class leave
        // with a tag below that (the same tag: the one waiting longer goes first).
        let finish = vtag.saturating_add((pos as u64 + 1).saturating_mul(step));
        let mut mine = Vec::new();
        for v in values {
            let n = if v.id == id {
                pos
            } else {
                count_before(finish, vorder, v.tag, v.order, step, v.held.len())
            };
            mine.extend(v.held.iter().take(n));
        }
        // Its class's tag once it has left, and how many of each other class go before.
        let served = mine.len() as u64 + 1;
        let cost = step.saturating_mul(SCALE);
        let cfinish = ctag.saturating_add(served.saturating_mul(cost) / weight);
        let others = self
            .classes
            .iter()
            .filter(|o| o.index != class)
            .map(|o| {
                let len = o.values.iter().map(|v| v.held.len()).sum();
                count_before(cfinish, corder, o.tag, o.order, cost / o.weight, len) as u64
            })
            .sum();
        Ahead { mine, others }
    }

    /// The latest turn a request of class `class` was told (0: none).
    pub(crate) fn promised(&self, class: usize) -> u64 {
        self.promised.get(class).copied().unwrap_or(0)
    }

    pub(crate) fn promise(&mut self, class: usize, at_ms: u64) {
        if self.promised.len() <= class {
            self.promised.resize(class + 1, 0);
        }
        self.promised[class] = self.promised[class].max(at_ms);
    }

    /// How many ms one release of this queue took lately on this worker (None: too few seen).
    pub(crate) fn ms_per_release(&self, now: u64) -> Option<u64> {
        self.releases.ms_per_release(now)
    }
}

/// How many of `len` releases, each adding `step` to a tag that starts at `tag` (order
/// `order`), end at or below `finish` (won ties with `mine`, the order of the one asked about).
fn count_before(finish: u64, mine: u64, tag: u64, order: u64, step: u64, len: usize) -> usize {
    let room = finish.saturating_sub(tag);
    let mut n = room / step.max(1);
    if n > 0 && room % step.max(1) == 0 && order > mine {
        n -= 1; // the same tag as its own: it goes first
    }
    usize::try_from(n).unwrap_or(usize::MAX).min(len)
}

/// Releases counted in two-second epochs: the pace the turns of a queue come at, on this
/// worker (its share of the (pool, account)'s).
#[derive(Default)]
struct Releases {
    epoch: u64,
    this: u32,
    last: u32,
}

const EPOCH_MS: u64 = 2_000;

impl Releases {
    fn note(&mut self, now: u64) {
        let epoch = now / EPOCH_MS;
        if epoch != self.epoch {
            self.last = if epoch == self.epoch + 1 {
                self.this
            } else {
                0
            };
            self.this = 0;
            self.epoch = epoch;
        }
        self.this = self.this.saturating_add(1);
    }

    fn ms_per_release(&self, now: u64) -> Option<u64> {
        let epoch = now / EPOCH_MS;
        let (this, last) = match epoch.checked_sub(self.epoch) {
            Some(0) => (self.this, self.last),
            Some(1) => (0, self.this),
            _ => (0, 0),
        };
        let seen = this.saturating_add(last);
        (seen >= 2).then(|| (EPOCH_MS + now % EPOCH_MS) / u64::from(seen))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Class;
    use crate::config::Config;
    use crate::headers::Headers;
    use crate::keys::HashKey;
    use crate::policy::Governor;
    use crate::request::RequestView;

    fn held(id: u32) -> Held {
        let gov = Governor::new(Config::default(), HashKey::from_words(1, 2));
        let hs = Vec::new();
        let flow = gov.pools().flow_for(&RequestView::of(Headers::new(&hs)));
        let blocked = Blocked::Cooling {
            class: Class::RateLimited,
            remaining_ms: 1,
        };
        Held {
            id,
            flow,
            since_ms: 0,
            blocked,
            blocked_at_ms: 0,
        }
    }

    /// Requests (id, class, class weight, value) joined in that order, then every release
    /// at once, each costing `cost(value)`: the ids in the order they leave.
    fn order(joins: &[(u32, usize, u64, u64)], cost: impl Fn(u64) -> u64) -> Vec<u32> {
        let mut q = Queue::default();
        for &(id, class, weight, value) in joins {
            q.push(held(id), class, weight, value, false);
        }
        let mut out = Vec::new();
        while let Some(p) = q.next(0) {
            let value = q.value_at(p);
            if let Some(h) = q.release(p, cost(value), 0) {
                out.push(h.id);
            }
        }
        out
    }

    #[test]
    fn releases_share_by_cost_and_weight_in_start_time_order() {
        let a = |id| (id, 0, 1, 1);
        let b = |id| (id, 0, 1, 2);
        type Row = (
            &'static str,
            Vec<(u32, usize, u64, u64)>,
            fn(u64) -> u64,
            Vec<u32>,
        );
        let rows: [Row; 4] = [
            (
                "values in turn",
                vec![a(1), a(2), a(3), b(4), b(5), b(6)],
                |_| 1,
                vec![1, 4, 2, 5, 3, 6],
            ),
            (
                "by tokens: a's releases cost 1000, b's 250, so b gets four per a",
                vec![
                    a(1),
                    a(2),
                    a(3),
                    b(4),
                    b(5),
                    b(6),
                    b(7),
                    b(8),
                    b(9),
                    b(10),
                    b(11),
                ],
                |v| if v == 1 { 1000 } else { 250 },
                vec![1, 4, 5, 6, 7, 2, 8, 9, 10, 11, 3],
            ),
            (
                "classes by weight, 3:1",
                vec![
                    (1, 0, 3, 7),
                    (2, 0, 3, 7),
                    (3, 0, 3, 7),
                    (4, 0, 3, 7),
                    (5, 0, 3, 7),
                    (6, 1, 1, 8),
                    (7, 1, 1, 8),
                    (8, 1, 1, 8),
                ],
                |_| 1,
                vec![1, 6, 2, 3, 4, 7, 5, 8],
            ),
            (
                "a value that starts waiting starts level with the last served",
                vec![a(1), a(2), a(3), a(4), b(5)],
                |_| 1,
                vec![1, 5, 2, 3, 4],
            ),
        ];
        for (what, joins, cost, want) in rows {
            assert_eq!(order(&joins, cost), want, "{what}");
        }
    }

    #[test]
    fn ahead_counts_what_leaves_first_at_equal_costs() {
        let mut q = Queue::default();
        for id in 1..=3 {
            q.push(held(id), 0, 1, 1, false);
        }
        q.push(held(4), 0, 1, 2, false);
        // The order is 1, 4, 2, 3.
        let ids = |a: Ahead| {
            let mut ids: Vec<u32> = a.mine.iter().map(|h| h.id).collect();
            ids.sort_unstable();
            (ids, a.others)
        };
        assert_eq!(
            ids(q.ahead((0, 1), 2, 0, 1)),
            (vec![1], 0),
            "4 goes after 1"
        );
        assert_eq!(
            ids(q.ahead((0, 1), 1, 2, 1)),
            (vec![1, 2, 4], 0),
            "3 goes after 1, 4, 2"
        );
        assert_eq!(
            ids(q.ahead((0, 1), 2, 1, 1)),
            (vec![1, 2, 4], 0),
            "b's next goes after 1, 4, 2 and before 3"
        );
        // Another class of weight 1 behind: one of its requests per request of this one.
        assert_eq!(
            q.ahead((1, 1), 9, 0, 1).others,
            1,
            "a new class goes after one of the first"
        );
    }
}

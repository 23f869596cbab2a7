//! The fair key's turns across workers: each worker orders its own held requests (`fair`), and
//! the releases of the shared pace go to whichever worker asks first, so a value held on one
//! worker only got that worker's share (a chat tenant whose connections all landed on one of
//! two workers got a quarter of the releases while batch flooded both, not half). The workers
//! holding requests of one (pool, account) keep a small board in the shared store: the values
//! waiting now (refreshed every tick) and the service each had. A worker whose next value had
//! more service than one waiting elsewhere leaves the release to that worker's next tick.
//!
//! Bounded: one board per (pool, account) that holds with `hold.fair_key` or `hold.classes`
//! (counted against `max_keys`), `SEATS` values on it; a value with no seat neither waits for
//! others nor makes them wait. A value whose worker stopped refreshing it (gone, or nothing of
//! it held any more) no longer counts after `LIVE_MS`.

use crate::store::{Reader, Record, Writer};

/// Values on one board.
pub(crate) const SEATS: usize = 8;
/// How long a value counts as waiting after its worker last said so (it says so every tick).
pub(crate) const LIVE_MS: u64 = 60;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Seat {
    /// The value (its class mixed in).
    pub(crate) id: u64,
    /// Its service so far: what its releases cost, over its class's weight.
    pub(crate) served: u64,
    /// When a worker last said it waits (0: a free seat).
    pub(crate) seen_ms: u64,
    /// The worker that said so.
    pub(crate) by: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Board {
    pub(crate) seats: [Seat; SEATS],
}

impl Board {
    const LEN: usize = SEATS * 32;

    fn live(&self, now: u64) -> impl Iterator<Item = &Seat> + '_ {
        let live = move |s: &&Seat| s.seen_ms > 0 && now < s.seen_ms.saturating_add(LIVE_MS);
        self.seats.iter().filter(live)
    }

    /// The least service a value waiting now had.
    fn floor(&self, now: u64) -> Option<u64> {
        self.live(now).map(|s| s.served).min()
    }

    /// Values `ids` wait on worker `by` at `now`, and no others: each keeps its seat, or takes
    /// a free one or one no longer waiting, starting level with the least-served value waiting
    /// (no credit for the time it did not wait); a value this worker said waits and no longer
    /// holds (and no other worker said so since) leaves its seat.
    pub(crate) fn seen(mut self, ids: &[u64], by: u64, now: u64) -> Board {
        for s in &mut self.seats {
            if s.by == by && !ids.contains(&s.id) {
                s.seen_ms = 0;
            }
        }
        for &id in ids {
            let floor = self.floor(now).unwrap_or(0);
            let live = |s: &Seat| s.seen_ms > 0 && now < s.seen_ms.saturating_add(LIVE_MS);
            if let Some(s) = self.seats.iter_mut().find(|s| s.id == id && s.seen_ms > 0) {
                if !live(s) {
                    s.served = floor;
                }
                s.seen_ms = now;
                s.by = by;
            } else if let Some(s) = self.seats.iter_mut().find(|s| !live(s)) {
                *s = Seat {
                    id,
                    served: floor,
                    seen_ms: now,
                    by,
                };
            }
        }
        self
    }

    /// Whether value `id` may take the next release: no value waiting now had less service.
    pub(crate) fn may_go(&self, id: u64, now: u64) -> bool {
        match (self.live(now).find(|s| s.id == id), self.floor(now)) {
            (Some(s), Some(floor)) => s.served <= floor,
            _ => true,
        }
    }

    /// Value `id` took a release worth `service`; `emptied`: worker `emptied` held its last
    /// request, and leaves its seat unless another worker said since that it waits there too.
    pub(crate) fn served(mut self, id: u64, service: u64, emptied: Option<u64>) -> Board {
        if let Some(s) = self.seats.iter_mut().find(|s| s.id == id && s.seen_ms > 0) {
            s.served = s.served.saturating_add(service);
            if emptied == Some(s.by) {
                s.seen_ms = 0;
            }
        }
        self
    }
}

impl Record for Board {
    fn to_bytes(&self) -> Vec<u8> {
        let w = Writer::<{ Board::LEN }>::default();
        let w = self
            .seats
            .iter()
            .fold(w, |w, s| w.u64(s.id).u64(s.served).u64(s.seen_ms).u64(s.by));
        w.done().to_vec()
    }

    fn from_bytes(bytes: &[u8]) -> Option<Board> {
        let mut r = Reader::exact(bytes, Board::LEN)?;
        let mut board = Board::default();
        for s in &mut board.seats {
            *s = Seat {
                id: r.u64()?,
                served: r.u64()?,
                seen_ms: r.u64()?,
                by: r.u64()?,
            };
        }
        Some(board)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_served_value_waiting_goes_first() {
        let (w1, w2) = (11, 22);
        let b = Board::default().seen(&[1], w1, 1_000).seen(&[2], w2, 1_000);
        assert!(
            b.may_go(1, 1_000) && b.may_go(2, 1_000),
            "level at the start"
        );
        let b = b.served(1, 10, None);
        assert!(!b.may_go(1, 1_000), "1 had more than 2");
        assert!(b.may_go(2, 1_000));
        // 2's worker stops saying it waits: 1 goes again once 2 is no longer seen.
        let b = b.seen(&[1], w1, 1_050);
        assert!(b.may_go(1, 1_070), "2 last seen 70 ms ago");
        // 2 comes back level with 1, not with its old service.
        let b = b.served(1, 30, None).seen(&[2], w2, 1_100);
        assert_eq!(
            b.seats.iter().find(|s| s.id == 2).map(|s| s.served),
            Some(40)
        );
        assert!(b.may_go(2, 1_100) && b.may_go(1, 1_100));
        // A worker whose last request of 2 left takes 2 off at once; one that no longer holds
        // 1 says so with the values it still holds.
        let b = b.served(2, 10, Some(w2));
        assert!(b.may_go(1, 1_100), "2 is gone: it holds no one back");
        let b = b.seen(&[], w1, 1_110);
        assert!(
            b.may_go(3, 1_110) && b.floor(1_110).is_none(),
            "nothing waits"
        );
        // A value with no seat (all taken by values waiting) holds no one back.
        let full = (10..18).fold(Board::default(), |b, id| b.seen(&[id], id, 2_000));
        let full = full.seen(&[99], 99, 2_000).served(10, 5, None);
        assert!(full.may_go(99, 2_000) && !full.may_go(10, 2_000));
        assert_eq!(Board::from_bytes(&full.to_bytes()), Some(full));
        assert_eq!(Board::from_bytes(&[0; 10]), None);
    }
}

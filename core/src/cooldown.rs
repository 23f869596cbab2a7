//! The state of one (pool, account) as the provider sees it, shared by every worker: whether it
//! is cooling (the provider said "not now" until a deadline), and, once the cooldown ended,
//! how fast traffic may come back (the pace). Pure functions over a fixed-width record; the
//! policy reads and writes it with one compare-and-swap.
//!
//! Pacing, in short: a cooldown ends with one probe; its success opens `remaining` more
//! releases when the provider reports it, else two per success (1, 2, 4, ...); a new "not now"
//! cools again and the credits are gone. Pacing ends once the provider plainly has room.

use crate::classify::Class;
use crate::store::{Reader, Writer};

/// How long a released request may go unanswered before another one is let through: rate
/// limiters answer at once, so a request unanswered this long was accepted (it is generating),
/// and one whose holder vanished must not stall the account.
pub const PROBE_PATIENCE_MS: u64 = 1000;
/// Pacing ends when this many releases are open at once: the provider has plain room.
pub const PACE_OPEN_AT: u64 = 64;
/// Pacing left behind by traffic that stopped is forgotten after this long.
pub const PACE_IDLE_MS: u64 = 60_000;

/// A cooldown and its pace, as stored in shared data: 41 fixed-width bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CooldownRecord {
    /// Until when the provider said "not now", Unix ms (0: not cooling).
    pub deadline_ms: u64,
    /// The provider's time in the answer that set the deadline.
    pub period_ms: u32,
    /// What returning clients are spread over: the longest period of the episode this
    /// cooldown belongs to (see `merge`).
    pub spread_ms: u32,
    pub class: Class,
    /// Consecutive failed cooldown rounds; a success resets it.
    pub streak: u8,
    pub pace: Pace,
    /// The latest deadline the answers of one burst stated (see `merge`): clients are told the
    /// first one, but held requests are released only after this one, when a provider whose
    /// window counts rejected requests has really reopened.
    pub burst_end_ms: u64,
}

/// How traffic comes back after a cooldown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pace {
    pub active: bool,
    /// The "not now" that started this pace reported requests left (a concurrency or token
    /// limit, not the request window): `remaining` then says nothing about what the provider
    /// can take, and releases double instead.
    pub ignore_remaining: bool,
    /// Releases open now.
    pub credits: u16,
    /// Released requests whose answer has not come yet.
    pub out: u16,
    /// The last release, Unix ms.
    pub last_release_ms: u64,
    /// Releases handed out so far (wrapping), each released request keeping its number (its
    /// `Ticket`): the `remaining` an answer reports counts none of the releases handed out
    /// after its own, whether they are still on their way or already answered.
    pub seq: u16,
}

/// What a released request keeps of the pace: its number, and how many releases before it were
/// still unanswered when it went. Those may have reached the provider after it (released by
/// another worker in the same instant, or overtaken on the way), so its answer's `remaining`
/// may not count them either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    pub seq: u16,
    pub ahead: u16,
}

impl Ticket {
    /// The ticket of the release `rec` records as its last.
    pub fn of(rec: &CooldownRecord) -> Ticket {
        Ticket {
            seq: rec.pace.seq,
            ahead: rec.pace.out.saturating_sub(1),
        }
    }
}

impl CooldownRecord {
    pub const LEN: usize = 41;

    /// Not cooling, not pacing.
    pub fn idle(class: Class) -> CooldownRecord {
        CooldownRecord {
            deadline_ms: 0,
            period_ms: 0,
            spread_ms: 0,
            class,
            streak: 0,
            pace: Pace::default(),
            burst_end_ms: 0,
        }
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let pace = &self.pace;
        Writer::default()
            .u64(self.deadline_ms)
            .u32(self.period_ms)
            .u32(self.spread_ms)
            .u8(self.class.to_byte())
            .u8(self.streak)
            .u8(u8::from(pace.active) | u8::from(pace.ignore_remaining) << 1)
            .u16(pace.credits)
            .u16(pace.out)
            .u64(pace.last_release_ms)
            .u64(self.burst_end_ms)
            .u16(pace.seq)
            .done()
    }

    /// None for bytes this code did not write.
    pub fn decode(b: &[u8]) -> Option<CooldownRecord> {
        let mut r = Reader::exact(b, Self::LEN)?;
        let (deadline_ms, period_ms, spread_ms) = (r.u64()?, r.u32()?, r.u32()?);
        let (class, streak, flags) = (Class::from_byte(r.u8()?)?, r.u8()?, r.u8()?);
        if flags > 3 {
            return None;
        }
        let (credits, out, last_release_ms) = (r.u16()?, r.u16()?, r.u64()?);
        let (burst_end_ms, seq) = (r.u64()?, r.u16()?);
        Some(CooldownRecord {
            deadline_ms,
            period_ms,
            spread_ms,
            class,
            streak,
            pace: Pace {
                active: flags & 1 == 1,
                ignore_remaining: flags & 2 == 2,
                credits,
                out,
                last_release_ms,
                seq,
            },
            burst_end_ms,
        })
    }

    pub fn remaining_ms(&self, now_ms: u64) -> u64 {
        self.deadline_ms.saturating_sub(now_ms)
    }

    /// Whether pacing still governs this (pool, account) at `now_ms`.
    pub fn pacing(&self, now_ms: u64) -> bool {
        self.pace.active
            && now_ms
                < self
                    .deadline_ms
                    .max(self.pace.last_release_ms)
                    .saturating_add(PACE_IDLE_MS)
    }
}

/// A new "not now" from the provider: cool for `ms` from `now_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub class: Class,
    pub ms: u64,
}

/// The record after an answer: `wanted` is the cooldown it asks for (None: it gave no time),
/// `streak` the failed rounds counting it, `jitter` the configured fraction clients were told
/// on top of the provider's time. One row of `core/tests/cooldown_merge.rs` per rule.
pub fn merge(
    old: Option<CooldownRecord>,
    wanted: Option<Wanted>,
    streak: u8,
    now_ms: u64,
    jitter: f64,
) -> CooldownRecord {
    let Some(w) = wanted else {
        // No time given: the deadline stays, only the streak moves.
        return match old {
            Some(o) => CooldownRecord { streak, ..o },
            None => CooldownRecord {
                streak,
                ..CooldownRecord::idle(Class::RateLimited)
            },
        };
    };
    let period = u32::try_from(w.ms).unwrap_or(u32::MAX);
    let fresh = CooldownRecord {
        deadline_ms: now_ms.saturating_add(w.ms),
        period_ms: period,
        spread_ms: period,
        class: w.class,
        streak,
        pace: old.map(|o| o.pace).unwrap_or_default(),
        burst_end_ms: 0,
    };
    let Some(o) = old else {
        return fresh;
    };
    if o.deadline_ms >= fresh.deadline_ms {
        // Re-cooling keeps the later deadline, never the shorter.
        return CooldownRecord { streak, ..o };
    }
    let same_statement = o.class == w.class && o.period_ms == period;
    if o.deadline_ms > now_ms
        && same_statement
        && (fresh.deadline_ms - o.deadline_ms) as f64 <= f64::from(o.period_ms) * jitter
    {
        // The answers of one burst arrive over tens or hundreds of milliseconds, each with the
        // same "N s from now", and clients were already told N s plus up to `jitter` of it.
        // Moving the deadline by less than that band would only turn away the clients that
        // come back on time, after the provider has recovered. The burst's own end is kept
        // apart: held requests wait for it (a window that counts rejected requests reopens
        // only after the burst's last one).
        return CooldownRecord {
            streak,
            burst_end_ms: o.burst_end_ms.max(fresh.deadline_ms),
            ..o
        };
    }
    if o.class == w.class && o.deadline_ms.saturating_add(u64::from(o.spread_ms)) > now_ms {
        // Soon after the previous cooldown ended, this one is part of the same episode (a
        // window reopening a slot at a time): it keeps the episode's longest period as its
        // spread, so clients answered in a short cooldown are not all sent back within a few
        // milliseconds to collide at the next slot.
        return CooldownRecord {
            spread_ms: period.max(o.spread_ms),
            ..fresh
        };
    }
    fresh
}

/// The resolution of the hosts' clocks: whole milliseconds, rounded down. A deadline set at
/// `now + wait` as the provider's answer is read can fall up to this much before the moment the
/// provider meant, and a held request goes the instant the gate opens: the gate opens this much
/// after the deadline, so no request reaches a window that has not yet reopened.
pub const CLOCK_GRAIN_MS: u64 = 1;

/// Whether a request of this (pool, account) may go now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Nothing is cooling or pacing.
    Open,
    /// Cooling for `remaining_ms` more.
    Cooling { class: Class, remaining_ms: u64 },
    /// Released by the pace: the request took a release and must report its answer.
    Released,
    /// Pacing, and no release is open: wait for an answer (at most `retry_in_ms`).
    Paced { retry_in_ms: u64 },
}

/// The gate for a request at `now_ms`, and the record to write when it took a release.
/// `paced` is false when holding is off: then a cooldown's end lets everything through (no
/// request could wait for a release, so none is rationed).
pub fn pass(rec: CooldownRecord, now_ms: u64, paced: bool) -> (Gate, Option<CooldownRecord>) {
    // With holding on, a request waits for the end of the whole burst; without it, clients
    // told the first deadline are let through from then on (the burst-band rule). Either way
    // the gate opens a clock's grain after it.
    let end = if paced {
        rec.deadline_ms.max(rec.burst_end_ms)
    } else {
        rec.deadline_ms
    };
    let until = match end {
        0 => 0,
        end => end.saturating_add(CLOCK_GRAIN_MS),
    };
    if until > now_ms {
        let gate = Gate::Cooling {
            class: rec.class,
            remaining_ms: until - now_ms,
        };
        return (gate, None);
    }
    if !paced || !rec.pacing(now_ms) {
        return (Gate::Open, None);
    }
    let p = rec.pace;
    let patience_over = now_ms >= p.last_release_ms.saturating_add(PROBE_PATIENCE_MS);
    // An open release; else the probe: the first request after a cooldown (or after every
    // release was answered), whose answer may open more than the last one left; else one more
    // after an answer that is long in coming.
    let credits = if p.credits > 0 {
        p.credits - 1
    } else if p.out == 0 || patience_over {
        0
    } else {
        let retry_in_ms = p.last_release_ms + PROBE_PATIENCE_MS - now_ms;
        return (Gate::Paced { retry_in_ms }, None);
    };
    let pace = Pace {
        credits,
        out: p.out.saturating_add(1),
        last_release_ms: now_ms,
        seq: p.seq.wrapping_add(1),
        ..p
    };
    (Gate::Released, Some(CooldownRecord { pace, ..rec }))
}

/// Give back a release that was taken but not used (a later gate of the same request refused).
pub fn unpass(rec: CooldownRecord) -> CooldownRecord {
    let p = rec.pace;
    CooldownRecord {
        pace: Pace {
            credits: p.credits.saturating_add(1),
            out: p.out.saturating_sub(1),
            ..p
        },
        ..rec
    }
}

/// What became of a released request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A success; `remaining` is the provider's remaining requests, when it said.
    Success { remaining: Option<u64> },
    /// The provider said "not now" again (the caller also merges the new cooldown);
    /// `requests_left`: its own headers still reported requests left in the window.
    NotNow { requests_left: bool },
    /// Anything else: an error that is not a rate limit, or a stream that ended unanswered.
    Other,
}

/// The pace after the answer of a released request (`released`: the ticket of the release it
/// took) or of any request while pacing.
pub fn answered(rec: CooldownRecord, answer: Answer, released: Option<Ticket>) -> CooldownRecord {
    let mut p = rec.pace;
    if released.is_some() {
        p.out = p.out.saturating_sub(1);
    }
    match answer {
        Answer::NotNow { requests_left } => {
            p.active = true;
            p.credits = 0;
            p.ignore_remaining = requests_left;
        }
        Answer::Success { .. } if !p.active => {}
        Answer::Success { remaining } => {
            // What the provider had left when it took this request, less every release it
            // may not have counted: those handed out after it, and those still on their way
            // when it went; for a request the pace did not release, those on their way.
            let uncounted = match released {
                Some(t) => p.seq.wrapping_sub(t.seq).saturating_add(t.ahead),
                None => p.out,
            };
            let open = match remaining.filter(|_| !p.ignore_remaining) {
                Some(r) => r.saturating_sub(u64::from(uncounted)),
                // Slow start: each success brings its own release back and one more.
                None => u64::from(p.credits) + 2,
            };
            if open >= PACE_OPEN_AT {
                // The numbering goes on: answers of releases still out keep their place.
                p = Pace {
                    seq: p.seq,
                    ..Pace::default()
                };
            } else {
                p.credits = u16::try_from(open).unwrap_or(u16::MAX);
            }
        }
        Answer::Other => {}
    }
    CooldownRecord { pace: p, ..rec }
}

impl crate::store::Record for CooldownRecord {
    fn to_bytes(&self) -> Vec<u8> {
        self.encode().to_vec()
    }

    fn from_bytes(bytes: &[u8]) -> Option<CooldownRecord> {
        CooldownRecord::decode(bytes)
    }
}

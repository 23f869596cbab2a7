//! The module's timer thread: Envoy 1.40 gives an HTTP filter no timer, only a scheduler per
//! stream (commit from any thread, run on the stream's worker). Each worker that waits for time
//! says when (`arm`); at that moment the thread commits to the scheduler of one of the worker's
//! paused streams, whose `scheduled` hook runs the worker's tick on its own thread and arms the
//! next deadline. Until the worker re-arms, the thread commits again every `RETRY_MS`, so a
//! commit lost with its stream (a client gone meanwhile) delays a tick by that much, never
//! for ever. A worker due with no paused stream (it keeps a fleet turn to give back, and every
//! stream of it is upstream or gone) is ticked on the main thread instead, through the
//! configuration's scheduler (`IDLE_TICK`), when the fleet gave it one.

use super::abi::{ConfigScheduler, Scheduler};
use super::adapters::now_ms;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How soon an armed deadline is committed again when the worker has not re-armed.
const RETRY_MS: u64 = llm_governor_core::effects::TICK_MS;

/// No deadline.
const NONE: u64 = u64::MAX;

/// The configuration scheduler's event that ticks the workers due with no paused stream.
pub const IDLE_TICK: u64 = 1;

pub struct Timer {
    state: Mutex<State>,
    wake: Condvar,
    /// Per worker, the deadline armed now (`NONE`): read without the lock on every hook.
    armed: Vec<AtomicU64>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Runs `IDLE_TICK` on the main thread (None: no fleet, nothing ticks without a stream).
    idle: Option<ConfigScheduler>,
}

#[derive(Default)]
struct State {
    stop: bool,
    /// Per worker: its deadline and the schedulers of its paused streams (by stream id).
    workers: Vec<WorkerTimer>,
    /// The worker woken first when several are due at once, in turn: the first to tick takes
    /// the release the pace opened at that moment, and a fixed order gave every one of them
    /// to worker 0 (its held requests went, another worker's waited seconds).
    first: usize,
}

#[derive(Default)]
struct WorkerTimer {
    due: Option<u64>,
    wakers: Vec<(u32, Scheduler)>,
}

impl Timer {
    /// The timer of `workers` workers, its thread started; None (logged) if it cannot start.
    /// `idle` ticks a worker due with no paused stream, on the main thread.
    pub fn start(workers: usize, idle: Option<ConfigScheduler>) -> Option<Arc<Timer>> {
        let timer = Arc::new(Timer {
            state: Mutex::new(State {
                stop: false,
                workers: (0..workers).map(|_| WorkerTimer::default()).collect(),
                first: 0,
            }),
            wake: Condvar::new(),
            armed: (0..workers).map(|_| AtomicU64::new(NONE)).collect(),
            thread: Mutex::new(None),
            idle,
        });
        let runs = timer.clone();
        let spawned = std::thread::Builder::new()
            .name("llm_governor_timer".into())
            .spawn(move || runs.run());
        match spawned {
            Ok(handle) => {
                if let Ok(mut t) = timer.thread.lock() {
                    *t = Some(handle);
                }
                Some(timer)
            }
            Err(e) => {
                log::error!("llm_governor: could not start the timer thread: {e}");
                None
            }
        }
    }

    /// Worker `w` next has something to do at `due` (None: nothing waits). Free when unchanged.
    /// Workers are woken on one grid of `RETRY_MS` (as proxy-wasm ticks them every 20 ms), the
    /// first due tick of the grid: a worker never ticks twice in a grid step, and every worker
    /// waiting for the same moment ticks in the same step. Woken at once instead, the worker
    /// that read the answer opening a release took it first, round after round (seconds of
    /// one worker's held requests waiting while the other's went), and a worker waiting for
    /// an answer on another worker asked every millisecond.
    pub fn arm(&self, w: usize, due: Option<u64>) {
        let Some(armed) = self.armed.get(w) else {
            return;
        };
        let want = due.map_or(NONE, |due| {
            let step = due.max(now_ms() + 1).div_ceil(RETRY_MS);
            step.saturating_mul(RETRY_MS)
        });
        if armed.load(Ordering::Relaxed) == want {
            return;
        }
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        armed.store(want, Ordering::Relaxed);
        if let Some(t) = state.workers.get_mut(w) {
            t.due = (want != NONE).then_some(want);
        }
        drop(state);
        self.wake.notify_one();
    }

    pub fn add_waker(&self, w: usize, id: u32, scheduler: Scheduler) {
        if let Ok(mut state) = self.state.lock() {
            if let Some(t) = state.workers.get_mut(w) {
                t.wakers.push((id, scheduler));
            }
        }
    }

    /// Stream `id` is gone: its scheduler is deleted (under the lock, so never while the
    /// thread commits to it).
    pub fn remove_waker(&self, w: usize, id: u32) {
        if let Ok(mut state) = self.state.lock() {
            if let Some(t) = state.workers.get_mut(w) {
                t.wakers.retain(|(i, _)| *i != id);
            }
        }
    }

    /// Stop the thread (the configuration is going away) and wait for it.
    pub fn stop(&self) {
        if let Ok(mut state) = self.state.lock() {
            state.stop = true;
            state.workers.clear();
        }
        self.wake.notify_one();
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }

    fn run(&self) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        while !state.stop {
            let now = now_ms();
            let mut next = NONE;
            let count = state.workers.len();
            state.first = (state.first + 1) % count.max(1);
            let first = state.first;
            for w in (0..count).map(|i| (i + first) % count) {
                let Some(t) = state.workers.get_mut(w) else {
                    continue;
                };
                let Some(due) = t.due else { continue };
                let due = if due <= now {
                    // The newest paused stream is the likeliest to still be there.
                    match (t.wakers.last(), &self.idle) {
                        (Some((_, scheduler)), _) => scheduler.commit(w as u64),
                        (None, Some(idle)) => idle.commit(IDLE_TICK),
                        (None, None) => {}
                    }
                    let again = now + RETRY_MS;
                    t.due = Some(again);
                    if let Some(armed) = self.armed.get(w) {
                        armed.store(again, Ordering::Relaxed);
                    }
                    again
                } else {
                    due
                };
                next = next.min(due);
            }
            let wait = match next {
                NONE => Duration::from_secs(3600),
                at => Duration::from_millis(at.saturating_sub(now).max(1)),
            };
            state = match self.wake.wait_timeout(state, wait) {
                Ok((s, _)) => s,
                Err(_) => return,
            };
        }
    }
}

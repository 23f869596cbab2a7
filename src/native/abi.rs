//! The Envoy dynamic-module ABI (Envoy 1.40, ABI version `v0.2.0`) as this module uses it, and
//! nothing more: our own declarations of the few callbacks we call (each exported by the 1.40
//! binary: `nm -D envoy`), the hooks Envoy looks up, and a safe handle over each pointer Envoy
//! lends. This is the only unsafe code of the native host.
//!
//! Why nothing here can crash Envoy, by construction:
//! - every exported hook runs its body under `catch_unwind` (the native build unwinds:
//!   `[profile.native]`), so a panic becomes "go on, ungoverned" and never crosses into Envoy;
//! - a `(NULL, n)` buffer from Envoy is read as empty, never dereferenced, and every length is
//!   Envoy's own (no pointer arithmetic is done here beyond the slices Envoy describes);
//! - the module's pointers (`Arc<Module>`, `Box<Filter>`) are made here, checked for NULL and
//!   freed exactly once, in the destroy hook Envoy calls once for each.

use super::{Filter, Module};
use llm_governor_core::effects::Direction;
use llm_governor_core::protocol::StreamOps;
use llm_governor_core::reply::LocalReply;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{null, null_mut, NonNull};
use std::sync::Arc;

/// The ABI version this module was written against (Envoy 1.40).
static ABI_VERSION: &[u8] = b"v0.2.0\0";

/// A buffer Envoy owns, valid until the hook returns (or a setter touches its map).
#[repr(C)]
#[derive(Clone, Copy)]
struct EnvoyBuffer {
    ptr: *const u8,
    length: usize,
}

/// A buffer the module owns, read by Envoy during the call only.
#[repr(C)]
#[derive(Clone, Copy)]
struct ModuleBuffer {
    ptr: *const u8,
    length: usize,
}

/// A header of Envoy's map (name and value owned by Envoy).
#[repr(C)]
#[derive(Clone, Copy)]
struct EnvoyHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

/// How many headers `with_headers` reads without allocating.
const INLINE_HEADERS: usize = 32;
const EMPTY_HEADER: EnvoyHeader = EnvoyHeader {
    key_ptr: null(),
    key_length: 0,
    value_ptr: null(),
    value_length: 0,
};

/// A header the module hands Envoy for a local reply.
#[repr(C)]
struct ModuleHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

/// Header pairs as the ABI's list; the list borrows `headers`, which must outlive its use.
fn module_headers(headers: &[(&str, String)]) -> Vec<ModuleHeader> {
    headers
        .iter()
        .map(|(k, v)| ModuleHeader {
            key_ptr: k.as_ptr(),
            key_length: k.len(),
            value_ptr: v.as_ptr(),
            value_length: v.len(),
        })
        .collect()
}

/// A list's pointer for Envoy: NULL when empty.
fn list_ptr<T>(list: &mut [T]) -> *mut T {
    if list.is_empty() {
        null_mut()
    } else {
        list.as_mut_ptr()
    }
}

fn lend(bytes: &[u8]) -> ModuleBuffer {
    ModuleBuffer {
        ptr: bytes.as_ptr(),
        length: bytes.len(),
    }
}

/// The bytes of an Envoy buffer; empty for `(NULL, n)` or `(p, 0)`.
///
/// # Safety
/// A non-null `ptr` must point to `length` readable bytes that outlive `'a` (Envoy's buffers
/// live until the hook returns; callers bound `'a` by it).
unsafe fn bytes<'a>(ptr: *const u8, length: usize) -> &'a [u8] {
    list(ptr, length)
}

// Enum values of the ABI (C enums, passed as 32-bit integers).
/// `header_type`: the request's or the response's header map.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Map {
    Request = 0,
    Response = 2,
}

/// `body_type`: which body buffer.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Body {
    ReceivedRequest = 0,
    BufferedRequest = 1,
    ReceivedResponse = 2,
    BufferedResponse = 3,
}

const HEADERS_CONTINUE: u32 = 0;
const HEADERS_STOP_ITERATION: u32 = 1;
const BODY_CONTINUE: u32 = 0;
const BODY_STOP_AND_BUFFER: u32 = 1;
const TRAILERS_CONTINUE: u32 = 0;
const TRAILERS_STOP_ITERATION: u32 = 1;
const METRICS_SUCCESS: u32 = 0;
/// `attribute_id` of `response.code_details`.
const ATTRIBUTE_RESPONSE_CODE_DETAILS: u32 = 16;

/// Log levels of the ABI (spdlog's: Trace 0 … Critical 5).
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;
pub const LOG_TRACE: u32 = 0;

// The callbacks this module calls, one a line (`e` = Envoy's filter object, `cfg` = Envoy's
// filter-config object, in `config_new` and the config's own hooks on the main thread; `s` = a
// scheduler this module created).
#[rustfmt::skip]
extern "C" {
    fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);
    fn envoy_dynamic_module_callback_log_enabled(level: u32) -> bool;
    fn envoy_dynamic_module_callback_get_concurrency() -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(cfg: *mut c_void, name: ModuleBuffer, labels: *mut ModuleBuffer, n: usize, id: *mut usize) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(cfg: *mut c_void, name: ModuleBuffer, labels: *mut ModuleBuffer, n: usize, id: *mut usize) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_histogram(cfg: *mut c_void, name: ModuleBuffer, labels: *mut ModuleBuffer, n: usize, id: *mut usize) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(e: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_set_gauge(e: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_gauge(e: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_decrement_gauge(e: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_record_histogram_value(e: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(cfg: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_set_gauge(cfg: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(cfg: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(cfg: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(cfg: *mut c_void, id: usize, labels: *mut ModuleBuffer, n: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_get_worker_index(e: *mut c_void) -> u32;
    fn envoy_dynamic_module_callback_http_get_headers_size(e: *mut c_void, map: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(e: *mut c_void, map: u32, out: *mut EnvoyHeader) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(e: *mut c_void, map: u32, key: ModuleBuffer, value: ModuleBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_clear_route_cache(e: *mut c_void);
    fn envoy_dynamic_module_callback_http_send_response(e: *mut c_void, status: u32, headers: *mut ModuleHeader, n: usize, body: ModuleBuffer, details: ModuleBuffer);
    fn envoy_dynamic_module_callback_http_get_body_size(e: *mut c_void, body: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(e: *mut c_void, body: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(e: *mut c_void, body: u32, out: *mut EnvoyBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_drain_body(e: *mut c_void, body: u32, n: usize) -> bool;
    fn envoy_dynamic_module_callback_http_set_filter_state_bytes(e: *mut c_void, key: ModuleBuffer, value: ModuleBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(e: *mut c_void, id: u32, out: *mut EnvoyBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(e: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_continue_encoding(e: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(e: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(s: *mut c_void, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(s: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_http_callout(e: *mut c_void, id: *mut u64, cluster: ModuleBuffer, headers: *mut ModuleHeader, n: usize, body: ModuleBuffer, timeout_ms: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_http_callout(cfg: *mut c_void, id: *mut u64, cluster: ModuleBuffer, headers: *mut ModuleHeader, n: usize, body: ModuleBuffer, timeout_ms: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(cfg: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(s: *mut c_void, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(s: *mut c_void);
}

/// Write `message` to Envoy's log (logger `dynamic_modules`).
pub fn log(level: u32, message: &str) {
    // SAFETY: the buffer is read during the call only; any thread may log.
    unsafe { envoy_dynamic_module_callback_log(level, lend(message.as_bytes())) }
}

pub fn log_enabled(level: u32) -> bool {
    // SAFETY: no pointer; any thread.
    unsafe { envoy_dynamic_module_callback_log_enabled(level) }
}

/// Envoy's worker count; only on the main thread (it answers 0 elsewhere).
pub fn concurrency() -> u32 {
    // SAFETY: no pointer; called from `config_new`, which runs on the main thread.
    unsafe { envoy_dynamic_module_callback_get_concurrency() }
}

/// What kind of stat to define.
#[derive(Clone, Copy)]
pub enum StatKind {
    Counter,
    Gauge,
    Histogram,
}

/// Envoy's filter-config object, lent to `config_new` only (stats can be defined only there).
pub struct ConfigHandle<'a> {
    raw: NonNull<c_void>,
    _during: std::marker::PhantomData<&'a ()>,
}

impl ConfigHandle<'_> {
    /// The config object for a call made from `config_new` itself (on the main thread).
    pub fn main(&self) -> MainThread {
        MainThread { raw: self.raw }
    }

    /// Define a stat family `name` with these label names; its id, or None if Envoy refused.
    pub fn define(&self, kind: StatKind, name: &str, labels: &[&str]) -> Option<usize> {
        let mut names: Vec<ModuleBuffer> = labels.iter().map(|l| lend(l.as_bytes())).collect();
        let mut id = 0usize;
        let define = match kind {
            StatKind::Counter => envoy_dynamic_module_callback_http_filter_config_define_counter,
            StatKind::Gauge => envoy_dynamic_module_callback_http_filter_config_define_gauge,
            StatKind::Histogram => {
                envoy_dynamic_module_callback_http_filter_config_define_histogram
            }
        };
        // SAFETY: `raw` is Envoy's config object during `config_new` (the handle cannot leave
        // it); the name and label buffers outlive the call, which copies them.
        let result = unsafe {
            define(
                self.raw.as_ptr(),
                lend(name.as_bytes()),
                names.as_mut_ptr(),
                names.len(),
                &mut id,
            )
        };
        (result == METRICS_SUCCESS).then_some(id)
    }
}

/// How a stat is moved.
#[derive(Clone, Copy)]
pub enum StatOp {
    Increment,
    Set,
    Raise,
    Lower,
    Record,
}

/// A stat update callback: the filter's or the config's (same shape).
type StatCall = unsafe extern "C" fn(*mut c_void, usize, *mut ModuleBuffer, usize, u64) -> u32;

/// Move stat `id` (label values `labels`, at most two) through `call` on Envoy's object `on`.
///
/// # Safety
/// `on` must be the object `call` takes, alive for the call, on a thread that may use it.
unsafe fn write_stat(call: StatCall, on: *mut c_void, id: usize, labels: &[&str], value: u64) {
    let mut values = [lend(b""), lend(b"")];
    let n = labels.len().min(values.len());
    for (slot, label) in values.iter_mut().zip(labels) {
        *slot = lend(label.as_bytes());
    }
    // The label buffers outlive the call. A wrong id or label count is an error result,
    // never a crash.
    let _ = call(on, id, values.as_mut_ptr(), n, value);
}

/// Envoy's filter object of one stream. Made only by the hooks below from the pointer Envoy
/// passes; the host keeps one past a hook only in its map of paused streams, from which the
/// stream's destroy hook removes it, and uses it only on the stream's worker thread (where
/// every hook of the stream runs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Stream {
    raw: NonNull<c_void>,
}

// SAFETY: a `Stream` is only moved between threads inside the worker's mutex-guarded state;
// its callbacks are called only on the stream's own worker thread (see `Stream`).
unsafe impl Send for Stream {}

impl Stream {
    fn e(self) -> *mut c_void {
        self.raw.as_ptr()
    }

    pub fn worker_index(self) -> u32 {
        // SAFETY: a live filter object (see `Stream`), on its worker thread.
        unsafe { envoy_dynamic_module_callback_http_filter_get_worker_index(self.e()) }
    }

    /// Call `f` with the (name, value) pairs of a header map, read in place. The slices live
    /// only for `f`: nothing may set a header of the map meanwhile (the core only reads; its
    /// effects are applied after it returns).
    pub fn with_headers<T>(self, map: Map, f: impl FnOnce(&[(&[u8], &[u8])]) -> T) -> T {
        // SAFETY: a live filter object on its worker thread.
        let n =
            unsafe { envoy_dynamic_module_callback_http_get_headers_size(self.e(), map as u32) };
        // A usual map fits on the stack: no allocation per hook.
        if n <= INLINE_HEADERS {
            let mut raw = [EMPTY_HEADER; INLINE_HEADERS];
            let mut pairs: [(&[u8], &[u8]); INLINE_HEADERS] = [(&[], &[]); INLINE_HEADERS];
            let got = self.read_headers(map, &mut raw[..n], &mut pairs[..n]);
            return f(&pairs[..got]);
        }
        let mut raw = vec![EMPTY_HEADER; n];
        let mut pairs: Vec<(&[u8], &[u8])> = vec![(&[], &[]); n];
        let got = self.read_headers(map, &mut raw, &mut pairs);
        f(&pairs[..got])
    }

    /// Fill `raw` (sized by Envoy's count) with the map's headers and `pairs` with slices of
    /// them; how many were read (0 if Envoy wrote none).
    fn read_headers<'r>(
        self,
        map: Map,
        raw: &'r mut [EnvoyHeader],
        pairs: &mut [(&'r [u8], &'r [u8])],
    ) -> usize {
        // SAFETY: Envoy writes exactly the count it just reported into `raw`, which has that
        // length; it returns false if it wrote nothing.
        let filled = !raw.is_empty()
            && unsafe {
                envoy_dynamic_module_callback_http_get_headers(
                    self.e(),
                    map as u32,
                    raw.as_mut_ptr(),
                )
            };
        if !filled {
            return 0;
        }
        for (pair, h) in pairs.iter_mut().zip(raw.iter()) {
            // SAFETY: the entries point into Envoy's map, which lives until the hook returns;
            // the slices do not leave the hook (`with_headers`' `f`). Names and values are any
            // bytes (the core never assumes UTF-8); a NULL pointer reads as empty.
            *pair = unsafe {
                (
                    bytes(h.key_ptr, h.key_length),
                    bytes(h.value_ptr, h.value_length),
                )
            };
        }
        raw.len()
    }

    /// Set (replace) a header; `value` None removes it.
    pub fn set_header(self, map: Map, name: &str, value: Option<&str>) -> bool {
        let value = value.map_or(
            ModuleBuffer {
                ptr: null(),
                length: 0,
            },
            |v| lend(v.as_bytes()),
        );
        // SAFETY: a live filter object on its worker thread; Envoy copies both buffers.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.e(),
                map as u32,
                lend(name.as_bytes()),
                value,
            )
        }
    }

    /// Let the router pick the route again (after a header it matches on changed).
    pub fn clear_route_cache(self) {
        // SAFETY: a live filter object on its worker thread.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.e()) }
    }

    /// Answer locally; Envoy copies everything before it returns.
    pub fn send_response(
        self,
        status: u32,
        headers: &[(&str, String)],
        body: &[u8],
        details: &str,
    ) {
        let mut hs = module_headers(headers);
        let hs_ptr = list_ptr(&mut hs);
        // SAFETY: a live filter object on its worker thread; every buffer outlives the call.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.e(),
                status,
                hs_ptr,
                hs.len(),
                lend(body),
                lend(details.as_bytes()),
            )
        }
    }

    /// The bytes in a body buffer (0 when there is none).
    pub fn body_size(self, kind: Body) -> usize {
        // SAFETY: a live filter object on its worker thread.
        unsafe { envoy_dynamic_module_callback_http_get_body_size(self.e(), kind as u32) }
    }

    /// Up to `max` bytes of these body buffers, in order, copied.
    pub fn body(self, kinds: &[Body], max: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for kind in kinds {
            // SAFETY: a live filter object on its worker thread; Envoy writes at most the
            // chunk count it just reported; each chunk is read before the hook returns.
            unsafe {
                let n =
                    envoy_dynamic_module_callback_http_get_body_chunks_size(self.e(), *kind as u32);
                if n == 0 {
                    continue;
                }
                let mut chunks: Vec<EnvoyBuffer> = Vec::with_capacity(n);
                if !envoy_dynamic_module_callback_http_get_body_chunks(
                    self.e(),
                    *kind as u32,
                    chunks.as_mut_ptr(),
                ) {
                    continue;
                }
                chunks.set_len(n);
                for c in &chunks {
                    let room = max.saturating_sub(out.len());
                    let chunk = bytes(c.ptr, c.length);
                    out.extend_from_slice(&chunk[..chunk.len().min(room)]);
                }
            }
            if out.len() >= max {
                break;
            }
        }
        out
    }

    /// Drop up to `n` bytes from the front of a body buffer; false if it has none.
    pub fn drain(self, kind: Body, n: usize) -> bool {
        // SAFETY: a live filter object on its worker thread.
        unsafe { envoy_dynamic_module_callback_http_drain_body(self.e(), kind as u32, n) }
    }

    /// Record a filter-state value (read by access logs as `%FILTER_STATE(key:PLAIN)%`).
    pub fn set_filter_state(self, key: &str, value: &str) -> bool {
        // SAFETY: a live filter object on its worker thread; Envoy copies both buffers.
        unsafe {
            envoy_dynamic_module_callback_http_set_filter_state_bytes(
                self.e(),
                lend(key.as_bytes()),
                lend(value.as_bytes()),
            )
        }
    }

    /// `f` of `response.code_details`, read in place (None when Envoy has none).
    pub fn with_code_details<T>(self, f: impl FnOnce(Option<&[u8]>) -> T) -> T {
        let mut out = EnvoyBuffer {
            ptr: null(),
            length: 0,
        };
        // SAFETY: a live filter object on its worker thread; the buffer is read before the
        // hook returns, inside this call.
        unsafe {
            let found = envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.e(),
                ATTRIBUTE_RESPONSE_CODE_DETAILS,
                &mut out,
            );
            f(found.then(|| bytes(out.ptr, out.length)))
        }
    }

    pub fn continue_decoding(self) {
        // SAFETY: a live filter object on its worker thread.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.e()) }
    }

    pub fn continue_encoding(self) {
        // SAFETY: a live filter object on its worker thread.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_encoding(self.e()) }
    }

    /// Move a stat defined in `config_new` (`labels`: its label values, in order).
    pub fn stat(self, op: StatOp, id: usize, labels: &[&str], value: u64) {
        let call = match op {
            StatOp::Increment => envoy_dynamic_module_callback_http_filter_increment_counter,
            StatOp::Set => envoy_dynamic_module_callback_http_filter_set_gauge,
            StatOp::Raise => envoy_dynamic_module_callback_http_filter_increment_gauge,
            StatOp::Lower => envoy_dynamic_module_callback_http_filter_decrement_gauge,
            StatOp::Record => envoy_dynamic_module_callback_http_filter_record_histogram_value,
        };
        // SAFETY: a live filter object on its worker thread.
        unsafe { write_stat(call, self.e(), id, labels, value) }
    }
}

/// A stream's primitives as callbacks on it.
impl StreamOps for Stream {
    fn request_header(&self, name: &str, value: Option<&str>) -> bool {
        let done = self.set_header(Map::Request, name, value);
        // Envoy picked the route before the filters ran: again, by the new headers.
        self.clear_route_cache();
        done
    }

    fn response_header(&self, name: &str, value: &str) -> bool {
        self.set_header(Map::Response, name, Some(value))
    }

    /// The key the wasm module's field has (Envoy prefixes a wasm filter's with `wasm.`), so
    /// one access-log format serves both modules.
    fn filter_state(&self, key: &str, value: &str) -> bool {
        self.set_filter_state(&format!("wasm.{key}"), value)
    }

    /// What Envoy kept so far and the chunk of this hook, if any.
    fn drop_request_body(&self, n: usize) -> bool {
        let kept = self.drain(Body::BufferedRequest, n);
        self.drain(Body::ReceivedRequest, n) | kept
    }

    fn send_reply(&self, r: &LocalReply) -> bool {
        self.send_response(r.status, &r.headers, &r.body, r.details);
        true
    }

    fn resume(&self, direction: Direction) -> bool {
        match direction {
            Direction::Request => self.continue_decoding(),
            Direction::Response => self.continue_encoding(),
        }
        true
    }
}

/// A scheduler of one stream: `commit` posts an event to the stream's worker, from any thread,
/// and is a no-op once the stream is gone. Deleted when dropped.
#[derive(Debug)]
pub struct Scheduler {
    raw: NonNull<c_void>,
}

// SAFETY: Envoy's scheduler is made to be committed from any thread (it posts to the stream's
// dispatcher through a weak pointer); it is deleted once, by its owner's drop.
unsafe impl Send for Scheduler {}
unsafe impl Sync for Scheduler {}

impl Scheduler {
    pub fn new(stream: Stream) -> Option<Scheduler> {
        // SAFETY: a live filter object on its worker thread.
        let raw = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(stream.e()) };
        NonNull::new(raw).map(|raw| Scheduler { raw })
    }

    pub fn commit(&self, event_id: u64) {
        // SAFETY: the scheduler is alive until dropped; commit is thread-safe.
        unsafe {
            envoy_dynamic_module_callback_http_filter_scheduler_commit(self.raw.as_ptr(), event_id)
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: made by `scheduler_new`, deleted exactly once, here.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.raw.as_ptr()) }
    }
}

/// An HTTP call to a cluster: the request (headers, body, timeout) as the callout callbacks take
/// it; `Err` is Envoy's refusal to start it (`init_result`: 2 = no such cluster, …).
pub struct Callout<'a> {
    pub cluster: &'a str,
    pub headers: &'a [(&'a str, String)],
    pub body: &'a [u8],
    pub timeout_ms: u64,
}

type CalloutFn = unsafe extern "C" fn(
    *mut c_void,
    *mut u64,
    ModuleBuffer,
    *mut ModuleHeader,
    usize,
    ModuleBuffer,
    u64,
) -> u32;

impl Callout<'_> {
    /// # Safety
    /// `owner` must be what `send` expects: a live filter object on its worker thread, or the
    /// filter-config object on the main thread.
    unsafe fn send(&self, send: CalloutFn, owner: *mut c_void) -> Result<u64, u32> {
        let mut hs = module_headers(self.headers);
        let mut id = 0u64;
        // Every buffer outlives the call, which copies what it keeps.
        let result = send(
            owner,
            &mut id,
            lend(self.cluster.as_bytes()),
            list_ptr(&mut hs),
            hs.len(),
            lend(self.body),
            self.timeout_ms,
        );
        if result == CALLOUT_SUCCESS {
            Ok(id)
        } else {
            Err(result)
        }
    }
}

const CALLOUT_SUCCESS: u32 = 0;
/// `http_callout_init_result` of a callout to a cluster Envoy does not have.
pub const CALLOUT_NO_SUCH_CLUSTER: u32 = 2;

/// Envoy's `http_callout_init_result` refusing a callout, for the log.
pub fn callout_refusal(code: u32) -> &'static str {
    match code {
        1 => "missing required headers",
        CALLOUT_NO_SUCH_CLUSTER => "no such cluster",
        3 => "duplicate callout id",
        4 => "cannot create the request (no healthy host?)",
        _ => "refused",
    }
}
/// `http_callout_result`: the answer came (whatever its status).
const CALLOUT_ANSWERED: u32 = 0;

impl Stream {
    /// Start `call` for this stream; the answer comes to this stream's `http_callout_done`
    /// hook (Envoy cancels the call if the stream ends first).
    pub fn callout(self, call: &Callout) -> Result<u64, u32> {
        // SAFETY: a live filter object on its worker thread.
        unsafe {
            call.send(
                envoy_dynamic_module_callback_http_filter_http_callout,
                self.e(),
            )
        }
    }
}

/// Envoy's filter-config object as its own hooks lend it, on the main thread.
pub struct MainThread {
    raw: NonNull<c_void>,
}

impl MainThread {
    /// Start `call` for the configuration (it outlives every stream); the answer comes to the
    /// config's `http_callout_done` hook, on the main thread.
    pub fn callout(&self, call: &Callout) -> Result<u64, u32> {
        // SAFETY: Envoy's config object, lent by a config hook on the main thread.
        unsafe {
            call.send(
                envoy_dynamic_module_callback_http_filter_config_http_callout,
                self.raw.as_ptr(),
            )
        }
    }

    /// Move a stat for the configuration: what no stream is at hand to write (the answers
    /// to the calls owed by no stream).
    pub fn stat(&self, op: StatOp, id: usize, labels: &[&str], value: u64) {
        let call = match op {
            StatOp::Increment => envoy_dynamic_module_callback_http_filter_config_increment_counter,
            StatOp::Set => envoy_dynamic_module_callback_http_filter_config_set_gauge,
            StatOp::Raise => envoy_dynamic_module_callback_http_filter_config_increment_gauge,
            StatOp::Lower => envoy_dynamic_module_callback_http_filter_config_decrement_gauge,
            StatOp::Record => {
                envoy_dynamic_module_callback_http_filter_config_record_histogram_value
            }
        };
        // SAFETY: Envoy's config object, lent by a config hook on the main thread.
        unsafe { write_stat(call, self.raw.as_ptr(), id, labels, value) }
    }
}

/// The config's scheduler: a commit from any thread runs the config's `scheduled` hook on the
/// main thread.
pub struct ConfigScheduler {
    raw: NonNull<c_void>,
}

// SAFETY: as `Scheduler`: commit is made to be called from any thread; deleted once, on drop.
unsafe impl Send for ConfigScheduler {}
unsafe impl Sync for ConfigScheduler {}

impl ConfigScheduler {
    pub fn new(cfg: &ConfigHandle) -> Option<ConfigScheduler> {
        // SAFETY: Envoy's config object during `config_new`.
        let raw = unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_new(cfg.raw.as_ptr())
        };
        NonNull::new(raw).map(|raw| ConfigScheduler { raw })
    }

    pub fn commit(&self, event_id: u64) {
        // SAFETY: alive until dropped; commit is thread-safe.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                self.raw.as_ptr(),
                event_id,
            )
        }
    }
}

impl Drop for ConfigScheduler {
    fn drop(&mut self) {
        // SAFETY: made by `config_scheduler_new`, deleted exactly once, here.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.raw.as_ptr())
        }
    }
}

/// What came back of a callout, copied out of Envoy's buffers: whether an answer came, its
/// `:status` and `grpc-status`, and its body.
pub struct Answer {
    pub answered: bool,
    pub status: Option<Vec<u8>>,
    pub grpc_status: Option<Vec<u8>>,
    pub body: Vec<u8>,
}

impl Answer {
    /// # Safety
    /// `headers` and `chunks` are NULL or Envoy's lists of `n` and `chunks_n` entries, valid
    /// for the hook that lends them.
    unsafe fn read(
        result: u32,
        headers: *const EnvoyHeader,
        n: usize,
        chunks: *const EnvoyBuffer,
        chunks_n: usize,
    ) -> Answer {
        let headers = list(headers, n);
        let find = |name: &[u8]| {
            headers
                .iter()
                .find(|h| bytes(h.key_ptr, h.key_length).eq_ignore_ascii_case(name))
                .map(|h| bytes(h.value_ptr, h.value_length).to_vec())
        };
        let mut body = Vec::new();
        for c in list(chunks, chunks_n) {
            body.extend_from_slice(bytes(c.ptr, c.length));
        }
        Answer {
            answered: result == CALLOUT_ANSWERED,
            status: find(b":status"),
            grpc_status: find(b"grpc-status"),
            body,
        }
    }
}

/// Envoy's list of `n` entries; empty for NULL.
///
/// # Safety
/// A non-null `ptr` must point to `n` entries that outlive `'a`.
unsafe fn list<'a, T>(ptr: *const T, n: usize) -> &'a [T] {
    if ptr.is_null() || n == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr, n)
    }
}

/// The continue-or-stop a hook returns, from the core's action.
fn headers_status(pause: bool) -> u32 {
    if pause {
        HEADERS_STOP_ITERATION
    } else {
        HEADERS_CONTINUE
    }
}

fn body_status(pause: bool) -> u32 {
    if pause {
        BODY_STOP_AND_BUFFER
    } else {
        BODY_CONTINUE
    }
}

fn trailers_status(pause: bool) -> u32 {
    if pause {
        TRAILERS_STOP_ITERATION
    } else {
        TRAILERS_CONTINUE
    }
}

/// Run a hook's body; a panic is logged and answered with `otherwise` (fail open).
fn guarded<T>(hook: &str, otherwise: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        log(
            LOG_ERROR,
            &format!("llm_governor: a bug in {hook} was caught; the stream goes on ungoverned"),
        );
        otherwise
    })
}

/// The stream and our filter of a hook, or None for a NULL pointer.
///
/// # Safety
/// `f` must be NULL or a pointer `filter_new` returned whose destroy hook has not run; Envoy
/// calls a stream's hooks one at a time on its worker thread, so the `&mut` is unique.
unsafe fn filter<'a>(e: *mut c_void, f: *const c_void) -> Option<(Stream, &'a mut Filter)> {
    let stream = Stream {
        raw: NonNull::new(e)?,
    };
    let filter = (f as *mut Filter).as_mut()?;
    Some((stream, filter))
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    guarded("program_init", (), super::init);
    ABI_VERSION.as_ptr()
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    cfg: *mut c_void,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    let Some(raw) = NonNull::new(cfg) else {
        return null();
    };
    guarded("http_filter_config_new", null(), || {
        let handle = ConfigHandle {
            raw,
            _during: std::marker::PhantomData,
        };
        // SAFETY: Envoy's buffers live for this call; the module copies what it keeps.
        let (name, config) = unsafe {
            (
                bytes(name.ptr, name.length),
                bytes(config.ptr, config.length),
            )
        };
        match super::config_new(&handle, name, config) {
            Some(module) => Arc::into_raw(module).cast(),
            None => null(),
        }
    })
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(m: *const c_void) {
    if m.is_null() {
        return;
    }
    guarded("http_filter_config_destroy", (), || {
        // SAFETY: `m` is the `Arc::into_raw` of `config_new`, released once, here.
        let module = unsafe { Arc::from_raw(m.cast::<Module>()) };
        super::config_destroy(module);
    })
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_new(
    m: *const c_void,
    e: *mut c_void,
) -> *const c_void {
    let Some(raw) = NonNull::new(e) else {
        return null();
    };
    if m.is_null() {
        return null();
    }
    guarded("http_filter_new", null(), || {
        // SAFETY: `m` is the live `Arc<Module>` of `config_new` (Envoy destroys the config only
        // after its last filter); taking a count of it keeps it alive for this filter.
        let module = unsafe {
            Arc::increment_strong_count(m.cast::<Module>());
            Arc::from_raw(m.cast::<Module>())
        };
        let filter = super::filter_new(module, Stream { raw });
        Box::into_raw(Box::new(filter)).cast_const().cast()
    })
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_destroy(f: *const c_void) {
    if f.is_null() {
        return;
    }
    guarded("http_filter_destroy", (), || {
        // SAFETY: `f` is the `Box::into_raw` of `filter_new`, freed once, here.
        drop(unsafe { Box::from_raw(f as *mut Filter) });
    })
}

/// One hook over our filter of a stream: its body, or `otherwise` for a NULL pointer or a panic.
macro_rules! stream_hook {
    ($name:ident, $what:literal, ($($arg:ident: $ty:ty),*) -> $ret:ty, $otherwise:expr, |$s:ident, $f:ident| $body:expr) => {
        #[no_mangle]
        extern "C" fn $name(e: *mut c_void, fp: *const c_void $(, $arg: $ty)*) -> $ret {
            guarded($what, $otherwise, || {
                // SAFETY: see `filter`: Envoy's pointers for this stream's hook.
                match unsafe { filter(e, fp) } {
                    Some(($s, $f)) => $body,
                    None => $otherwise,
                }
            })
        }
    };
}

stream_hook!(envoy_dynamic_module_on_http_filter_request_headers, "request_headers",
    (end_of_stream: bool) -> u32, HEADERS_CONTINUE,
    |s, f| headers_status(f.request_headers(s, end_of_stream)));
stream_hook!(envoy_dynamic_module_on_http_filter_request_body, "request_body",
    (end_of_stream: bool) -> u32, BODY_CONTINUE,
    |s, f| body_status(f.request_body(s, end_of_stream)));
stream_hook!(envoy_dynamic_module_on_http_filter_request_trailers, "request_trailers",
    () -> u32, TRAILERS_CONTINUE,
    |s, f| trailers_status(f.request_trailers(s)));
stream_hook!(envoy_dynamic_module_on_http_filter_response_headers, "response_headers",
    (end_of_stream: bool) -> u32, HEADERS_CONTINUE,
    |s, f| headers_status(f.response_headers(s, end_of_stream)));
stream_hook!(envoy_dynamic_module_on_http_filter_response_body, "response_body",
    (end_of_stream: bool) -> u32, BODY_CONTINUE,
    |s, f| body_status(f.response_body(s, end_of_stream)));
stream_hook!(envoy_dynamic_module_on_http_filter_response_trailers, "response_trailers",
    () -> u32, TRAILERS_CONTINUE,
    |s, f| trailers_status(f.response_trailers(s)));
stream_hook!(envoy_dynamic_module_on_http_filter_stream_complete, "stream_complete",
    () -> (), (), |s, f| f.complete(s));
stream_hook!(envoy_dynamic_module_on_http_filter_scheduled, "scheduled",
    (_event_id: u64) -> (), (), |s, f| f.scheduled(s));

/// A stream's call to the fleet's service came back (or failed).
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    e: *mut c_void,
    fp: *const c_void,
    id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    n: usize,
    chunks: *const EnvoyBuffer,
    chunks_n: usize,
) {
    guarded("http_callout_done", (), || {
        // SAFETY: see `filter`; Envoy's lists for this hook.
        let Some((s, f)) = (unsafe { filter(e, fp) }) else {
            return;
        };
        let answer = unsafe { Answer::read(result, headers, n, chunks, chunks_n) };
        f.callout_done(s, id, &answer);
    })
}

/// The module's `Module` of a config hook, borrowed (the config still owns it).
///
/// # Safety
/// `m` must be NULL or the live `Arc::into_raw` of `config_new`.
unsafe fn module<'a>(m: *const c_void) -> Option<&'a Module> {
    m.cast::<Module>().as_ref()
}

/// Work committed to the config's scheduler, on the main thread: the calls owed by no stream.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    cfg: *mut c_void,
    m: *const c_void,
    event_id: u64,
) {
    guarded("http_filter_config_scheduled", (), || {
        // SAFETY: Envoy's config object and our module of it, on the main thread.
        let (Some(raw), Some(module)) = (NonNull::new(cfg), unsafe { module(m) }) else {
            return;
        };
        super::fleet::scheduled(module, &MainThread { raw }, event_id);
    })
}

/// A call owed by no stream came back (or failed), on the main thread.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    cfg: *mut c_void,
    m: *const c_void,
    id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    n: usize,
    chunks: *const EnvoyBuffer,
    chunks_n: usize,
) {
    guarded("http_filter_config_http_callout_done", (), || {
        // SAFETY: Envoy's config object and our module of it, on the main thread; Envoy's
        // lists for this hook.
        let (Some(raw), Some(module)) = (NonNull::new(cfg), unsafe { module(m) }) else {
            return;
        };
        let answer = unsafe { Answer::read(result, headers, n, chunks, chunks_n) };
        super::fleet::owed_done(module, &MainThread { raw }, id, &answer);
    })
}

// Hooks Envoy requires that this module has no use for: it opens no streams of its own, and
// leaves downstream flow control to Envoy.

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _e: *mut c_void,
    _f: *const c_void,
    _id: u64,
    _headers: *const EnvoyHeader,
    _n: usize,
    _end: bool,
) {
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _e: *mut c_void,
    _f: *const c_void,
    _id: u64,
    _data: *const EnvoyBuffer,
    _n: usize,
    _end: bool,
) {
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _e: *mut c_void,
    _f: *const c_void,
    _id: u64,
    _trailers: *const EnvoyHeader,
    _n: usize,
) {
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _e: *mut c_void,
    _f: *const c_void,
    _id: u64,
) {
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _e: *mut c_void,
    _f: *const c_void,
    _id: u64,
    _reason: u32,
) {
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _e: *mut c_void,
    _f: *const c_void,
) {
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _e: *mut c_void,
    _f: *const c_void,
) {
}

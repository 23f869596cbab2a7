//! The proxy-wasm hostcalls this filter uses, called directly so that every status becomes an
//! error value. The SDK's own wrappers `panic!` on statuses they do not expect, and a panic
//! kills the worker's VM.

use llm_governor_core::headers::WireHeaders;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::ptr::null_mut;

/// A hostcall's result: its error is the host's status (shown with `{:?}`).
pub type HostResult<T> = Result<T, Status>;

// The ABI's declarations, one a line (a `(name, name_len)` pair is one byte string; `out` and
// `out_len` receive a buffer the host allocated through the SDK's `proxy_on_memory_allocate`).
#[rustfmt::skip]
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, msg: *const u8, msg_len: usize) -> Status;
    fn proxy_get_current_time_nanoseconds(out: *mut u64) -> Status;
    fn proxy_get_buffer_bytes(t: BufferType, start: usize, max: usize, out: *mut *mut u8, out_len: *mut usize) -> Status;
    fn proxy_set_buffer_bytes(t: BufferType, start: usize, size: usize, data: *const u8, data_len: usize) -> Status;
    fn proxy_get_header_map_pairs(t: MapType, out: *mut *mut u8, out_len: *mut usize) -> Status;
    fn proxy_replace_header_map_value(t: MapType, key: *const u8, key_len: usize, value: *const u8, value_len: usize) -> Status;
    fn proxy_remove_header_map_value(t: MapType, key: *const u8, key_len: usize) -> Status;
    fn proxy_send_local_response(status: u32, details: *const u8, details_len: usize, body: *const u8, body_len: usize,
                                 headers: *const u8, headers_len: usize, grpc_status: i32) -> Status;
    fn proxy_get_shared_data(key: *const u8, key_len: usize, out: *mut *mut u8, out_len: *mut usize, cas: *mut u32) -> Status;
    fn proxy_set_shared_data(key: *const u8, key_len: usize, value: *const u8, value_len: usize, cas: u32) -> Status;
    fn proxy_define_metric(t: MetricType, name: *const u8, name_len: usize, id: *mut u32) -> Status;
    fn proxy_increment_metric(id: u32, offset: i64) -> Status;
    fn proxy_record_metric(id: u32, value: u64) -> Status;
    fn proxy_set_effective_context(context_id: u32) -> Status;
    fn proxy_continue_stream(stream_type: u32) -> Status;
    fn proxy_set_tick_period_milliseconds(period: u32) -> Status;
    fn proxy_get_property(path: *const u8, path_len: usize, out: *mut *mut u8, out_len: *mut usize) -> Status;
    fn proxy_set_property(path: *const u8, path_len: usize, value: *const u8, value_len: usize) -> Status;
}

fn check(s: Status) -> HostResult<()> {
    (s == Status::Ok).then_some(()).ok_or(s)
}

/// Take ownership of a buffer the host allocated through the SDK's `proxy_on_memory_allocate`.
///
/// # Safety
/// `ptr` must be null or a buffer of exactly `size` bytes allocated by that function.
unsafe fn owned(ptr: *mut u8, size: usize) -> Vec<u8> {
    if ptr.is_null() {
        Vec::new()
    } else {
        Vec::from_raw_parts(ptr, size, size)
    }
}

/// What a getter returned: the buffer the host allocated (see `owned`), None when it has none.
///
/// # Safety
/// As `owned`, when `s` is `Ok`.
unsafe fn got(s: Status, ptr: *mut u8, size: usize) -> HostResult<Option<Vec<u8>>> {
    match s {
        Status::Ok => Ok(Some(owned(ptr, size))),
        Status::NotFound | Status::Empty => Ok(None),
        other => Err(other),
    }
}

pub fn log(level: u32, msg: &str) {
    // Nothing sensible can be done if logging fails.
    let _ = unsafe { proxy_log(level, msg.as_ptr(), msg.len()) };
}

pub fn now_ms() -> u64 {
    let mut ns: u64 = 0;
    check(unsafe { proxy_get_current_time_nanoseconds(&mut ns) }).map_or(0, |()| ns / 1_000_000)
}

pub fn buffer(kind: BufferType, start: usize, max: usize) -> HostResult<Vec<u8>> {
    let mut ptr = null_mut();
    let mut size = 0;
    let status = unsafe { proxy_get_buffer_bytes(kind, start, max, &mut ptr, &mut size) };
    Ok(unsafe { got(status, ptr, size) }?.unwrap_or_default())
}

/// Replace `size` bytes from `start` of a buffer with `data`.
pub fn set_buffer(kind: BufferType, start: usize, size: usize, data: &[u8]) -> HostResult<()> {
    check(unsafe { proxy_set_buffer_bytes(kind, start, size, data.as_ptr(), data.len()) })
}

/// A header map as the host serialises it: one copy, read in place (see `WireHeaders`).
pub fn header_map(kind: MapType) -> HostResult<WireHeaders> {
    let mut ptr = null_mut();
    let mut size = 0;
    check(unsafe { proxy_get_header_map_pairs(kind, &mut ptr, &mut size) })?;
    let bytes = unsafe { owned(ptr, size) };
    Ok(WireHeaders::parse(bytes).unwrap_or_default())
}

pub fn replace_header(kind: MapType, name: &str, value: &str) -> HostResult<()> {
    check(unsafe {
        proxy_replace_header_map_value(kind, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

pub fn remove_header(kind: MapType, name: &str) -> HostResult<()> {
    check(unsafe { proxy_remove_header_map_value(kind, name.as_ptr(), name.len()) })
}

#[rustfmt::skip] // one argument pair a line reads better than one argument a line
pub fn send_local_response(status: u32, details: &str, headers: &[(&str, String)], body: &[u8]) -> HostResult<()> {
    let map = WireHeaders::encode(headers.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
    check(unsafe {
        proxy_send_local_response(status, details.as_ptr(), details.len(), body.as_ptr(), body.len(),
                                  map.as_ptr(), map.len(), -1)
    })
}

pub fn get_shared(key: &str) -> HostResult<Option<(Vec<u8>, u32)>> {
    let mut ptr = null_mut();
    let mut size = 0;
    let mut cas = 0;
    let status =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut ptr, &mut size, &mut cas) };
    Ok(unsafe { got(status, ptr, size) }?.map(|value| (value, cas)))
}

/// `cas = 0` writes unconditionally.
pub fn set_shared(key: &str, value: &[u8], cas: u32) -> HostResult<()> {
    check(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
    })
}

pub fn define_metric(kind: MetricType, name: &str) -> HostResult<u32> {
    let mut id = 0;
    check(unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment_metric(id: u32, by: i64) -> HostResult<()> {
    check(unsafe { proxy_increment_metric(id, by) })
}

pub fn record_metric(id: u32, value: u64) -> HostResult<()> {
    check(unsafe { proxy_record_metric(id, value) })
}

pub fn set_effective_context(id: u32) -> HostResult<()> {
    check(unsafe { proxy_set_effective_context(id) })
}

/// Resume a paused request (stream type 0 = HTTP request).
pub fn resume_request() -> HostResult<()> {
    check(unsafe { proxy_continue_stream(0) })
}

/// Resume a paused response (stream type 1 = HTTP response).
pub fn resume_response() -> HostResult<()> {
    check(unsafe { proxy_continue_stream(1) })
}

pub fn set_tick_period_ms(ms: u32) -> HostResult<()> {
    check(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

/// Read a stream property (`response.code_details`, ...); None when Envoy has none.
pub fn get_property(path: &[&str]) -> HostResult<Option<Vec<u8>>> {
    let p = path.join("\0");
    let mut ptr = null_mut();
    let mut size = 0;
    let status = unsafe { proxy_get_property(p.as_ptr(), p.len(), &mut ptr, &mut size) };
    unsafe { got(status, ptr, size) }
}

/// Set a filter-state property (readable by access logs as `%FILTER_STATE(...)%`).
pub fn set_property(path: &[&str], value: &[u8]) -> HostResult<()> {
    // Segments are NUL-separated, with no NUL after the last: Envoy would keep it in the key.
    let p = path.join("\0");
    check(unsafe { proxy_set_property(p.as_ptr(), p.len(), value.as_ptr(), value.len()) })
}

/// Call a gRPC method on an Envoy cluster; the answer comes to `on_grpc_call_response` with the
/// returned token. This one goes through the SDK, whose dispatcher must know the token to route
/// the answer; it panics on a status Envoy does not return for a plain cluster name (Envoy
/// answers an unknown cluster with ParseFailure, a call it cannot start with InternalFailure:
/// both are errors here).
pub fn grpc_call(
    cluster: &str,
    service: &str,
    method: &str,
    message: &[u8],
    timeout_ms: u64,
) -> HostResult<u32> {
    proxy_wasm::hostcalls::dispatch_grpc_call(
        cluster,
        service,
        method,
        Vec::new(),
        Some(message),
        std::time::Duration::from_millis(timeout_ms),
    )
}

//! An Envoy 1.40 dynamic module with an HTTP filter that does nothing: every hook Envoy
//! requires, each answering "continue". It calls no callback, so it declares none.

use std::ffi::c_void;

/// Envoy's `{ptr, length}` buffer, passed by value to `config_new`.
#[repr(C)]
#[allow(dead_code)] // Envoy's layout; never read here
pub struct Buffer {
    ptr: *const u8,
    length: usize,
}

/// Any non-null pointer is a config or filter object for Envoy; this module needs no state.
static OBJECT: u8 = 0;

fn object() -> *const c_void {
    (&OBJECT as *const u8).cast()
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    b"v0.2.0\0".as_ptr()
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_new(_: *mut c_void, _: Buffer, _: Buffer) -> *const c_void {
    object()
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_new(_: *const c_void, _: *mut c_void) -> *const c_void {
    object()
}

/// Hooks that answer "continue" (0) to a stream event.
macro_rules! go_on {
    ($($name:ident($($arg:ty),*);)*) => {$(
        #[no_mangle]
        extern "C" fn $name(_: *mut c_void, _: *const c_void $(, _: $arg)*) -> u32 { 0 }
    )*};
}

go_on! {
    envoy_dynamic_module_on_http_filter_request_headers(bool);
    envoy_dynamic_module_on_http_filter_request_body(bool);
    envoy_dynamic_module_on_http_filter_request_trailers();
    envoy_dynamic_module_on_http_filter_response_headers(bool);
    envoy_dynamic_module_on_http_filter_response_body(bool);
    envoy_dynamic_module_on_http_filter_response_trailers();
}

/// Hooks with nothing to do.
macro_rules! nothing {
    ($($name:ident($($arg:ty),*);)*) => {$(
        #[no_mangle]
        extern "C" fn $name($(_: $arg),*) {}
    )*};
}

nothing! {
    envoy_dynamic_module_on_http_filter_config_destroy(*const c_void);
    envoy_dynamic_module_on_http_filter_destroy(*const c_void);
    envoy_dynamic_module_on_http_filter_stream_complete(*mut c_void, *const c_void);
    envoy_dynamic_module_on_http_filter_scheduled(*mut c_void, *const c_void, u64);
    envoy_dynamic_module_on_http_filter_http_callout_done(*mut c_void, *const c_void, u64, u32, *const c_void, usize, *const c_void, usize);
    envoy_dynamic_module_on_http_filter_http_stream_headers(*mut c_void, *const c_void, u64, *const c_void, usize, bool);
    envoy_dynamic_module_on_http_filter_http_stream_data(*mut c_void, *const c_void, u64, *const c_void, usize, bool);
    envoy_dynamic_module_on_http_filter_http_stream_trailers(*mut c_void, *const c_void, u64, *const c_void, usize);
    envoy_dynamic_module_on_http_filter_http_stream_complete(*mut c_void, *const c_void, u64);
    envoy_dynamic_module_on_http_filter_http_stream_reset(*mut c_void, *const c_void, u64, u32);
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(*mut c_void, *const c_void);
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(*mut c_void, *const c_void);
}

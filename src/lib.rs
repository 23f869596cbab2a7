//! llm-governor's Envoy artifacts: thin hosts over the pure core (`llm-governor-core`, in
//! `core/`), each the only code that names its ABI. Built for wasm32, this is the proxy-wasm
//! module (`host/`).

#[cfg(target_arch = "wasm32")]
mod host;

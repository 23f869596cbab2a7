//! llm-governor's Envoy artifacts: thin hosts over the pure core (`llm-governor-core`, in
//! `core/`), each the only code that names its ABI. Which host is built is chosen by the target:
//! for wasm32 this is the proxy-wasm module (`host/`, `make build`); for the host's own target,
//! the Envoy dynamic module (`native/`, `make build-native`).

#[cfg(target_arch = "wasm32")]
mod host;

#[cfg(not(target_arch = "wasm32"))]
mod native;

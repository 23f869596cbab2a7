//! limitador-rls: a Limitador-compatible rate-limit service for llm-governor's tests.
//!
//! It stands in for Kuadrant's `limitador-server` (not published on the Rust registry): the
//! counting, the CEL conditions and variables, the storages and Reserve/Commit are the
//! `limitador` crate's own; this crate adds the gRPC front (Envoy's RLS v3 and Kuadrant's
//! `kuadrant.service.ratelimit.v1`), the command line and fault injection. See README.md.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod config;
pub mod context;
pub mod fault;
pub mod limiter;
pub mod limits;
pub mod pb;
pub mod server;
pub mod service;

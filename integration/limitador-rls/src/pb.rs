//! The messages and tonic stubs generated from proto/ (our own reduced copies of the wire
//! contracts). The module tree mirrors the proto packages, as the generated code expects.
#![allow(clippy::all, clippy::unwrap_used, clippy::expect_used, missing_docs)]

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
    }
}

pub mod kuadrant {
    pub mod service {
        pub mod ratelimit {
            pub mod v1 {
                tonic::include_proto!("kuadrant.service.ratelimit.v1");
            }
        }
    }
}

pub use envoy::config::core::v3::HeaderValue;
pub use envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
pub use envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
pub use envoy::service::ratelimit::v3::rate_limit_response::Code;
pub use envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
pub use kuadrant::service::ratelimit::v1::{
    CommitRequest, CommitResponse, ReserveRequest, ReserveResponse,
};

/// A descriptor from `(key, value)` pairs (tests and the example client).
pub fn descriptor<K: Into<String>, V: Into<String>>(
    entries: impl IntoIterator<Item = (K, V)>,
) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .into_iter()
            .map(|(key, value)| Entry {
                key: key.into(),
                value: value.into(),
            })
            .collect(),
    }
}

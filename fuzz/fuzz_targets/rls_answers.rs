//! `rls::decode_response` and `rls::decode_reserve` over any bytes a rate-limit service (or
//! whatever answers in its place) may send: an answer or an error value, never a panic; and
//! what the filter encodes always reads back as a well-formed message. The same bytes as the
//! body of a gRPC answer over an HTTP callout (`fleet::grpc::reply`, the native module's way):
//! a message within the body or a failure, never a panic; our own frame reads back whole.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::fleet::grpc::{self, ServiceReply};
use llm_governor_core::fleet::rls;

fuzz_target!(|data: &[u8]| {
    if let Ok(a) = rls::decode_response(data) {
        // A decoded answer is stable: the same bytes read the same.
        assert_eq!(rls::decode_response(data), Ok(a));
    }
    let _ = rls::decode_reserve(data);
    let status = data.first().map(|b| if b % 2 == 0 { b"200".as_slice() } else { b"503".as_slice() });
    let grpc_status = data.get(1..2).filter(|b| b[0] < 0x20);
    if let ServiceReply::Message(m) = grpc::reply(status, grpc_status, data) {
        assert!(m.len() + 5 <= data.len(), "a message lies within the body");
    }
    assert_eq!(
        grpc::reply(Some(b"200"), None, &grpc::frame(data)),
        ServiceReply::Message(data)
    );
    // What the filter sends always reads back as a message of known fields.
    let names = match data.len() % 3 {
        0 => rls::Names::Limit,
        1 => rls::Names::Guard,
        _ => rls::Names::Both,
    };
    let d = [rls::Descriptor {
        limit: String::from_utf8_lossy(data).into_owned(),
        key: "k".into(),
        names,
    }];
    let req = rls::should_rate_limit("d", &d, data.len() as u32);
    assert!(rls::decode_response(&req).is_ok(), "our own request is a well-formed message");
});

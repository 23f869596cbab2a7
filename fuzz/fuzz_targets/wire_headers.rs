//! `headers::WireHeaders::parse` on arbitrary host buffers: `None` or a header list whose
//! view reads exactly like the same pairs held as owned strings, never a panic. The input is
//! also read as the HTTP-like text of the other targets and sent through the wire format and
//! back: every pair must survive.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::headers::{Headers, WireHeaders};
use llm_governor_fuzz::Http;

/// Owned pairs as `Headers::new` takes them, when every name is UTF-8.
fn owned(pairs: &[(&[u8], &[u8])]) -> Option<Vec<(String, Vec<u8>)>> {
    pairs
        .iter()
        .map(|(n, v)| Some((String::from_utf8(n.to_vec()).ok()?, v.to_vec())))
        .collect()
}

fuzz_target!(|data: &[u8]| {
    if let Some(wire) = WireHeaders::parse(data.to_vec()) {
        let pairs: Vec<(&[u8], &[u8])> = wire.pairs().collect();
        let again = WireHeaders::parse(WireHeaders::encode(pairs.iter().copied()));
        assert_eq!(again.as_ref().map(|w| w.pairs().count()), Some(pairs.len()));
        if let Some(list) = owned(&pairs) {
            let (view, plain) = (Headers::wire(&wire), Headers::new(&list));
            for (name, _) in &list {
                assert_eq!(view.get(name), plain.get(name), "{name:?}");
                assert_eq!(view.all(name).count(), plain.all(name).count(), "{name:?}");
                assert_eq!(view.get_str(name), plain.get_str(name), "{name:?}");
            }
        }
    }
    let text = Http::parse(data);
    let sent: Vec<(&[u8], &[u8])> = text
        .headers
        .iter()
        .map(|(n, v)| (n.as_bytes(), v.as_slice()))
        .collect();
    let received = WireHeaders::parse(WireHeaders::encode(sent.iter().copied()));
    let received: Option<Vec<(&[u8], &[u8])>> = received.as_ref().map(|w| w.pairs().collect());
    assert_eq!(received.as_deref(), Some(&sent[..]));
});

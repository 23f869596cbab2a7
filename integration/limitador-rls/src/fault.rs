//! Fault injection, process-wide (one process is one instance): a delay before every answer,
//! and what the answers are (`ok`, `garbage` bytes, gRPC `UNAVAILABLE`, or `UNIMPLEMENTED` for
//! `Reserve` and `Commit` alone).
//!
//! Set at start (`--delay-ms`, `--answer`), at run time through `GET|POST /faults?...` on the
//! gRPC port (HTTP/1.1), and SIGUSR1 swaps the delay between `--delay-ms` and
//! `--toggle-delay-ms`.

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use prost::bytes::BufMut;
use prost::Message;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder, ProstCodec};
use tonic::Status;

/// What the service answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Real answers.
    Ok = 0,
    /// Every response message is replaced by [`GARBAGE`]: a gRPC frame with status OK whose
    /// bytes are not a valid protobuf message (the client's decode fails).
    Garbage = 1,
    /// Every RPC fails with gRPC `UNAVAILABLE` ("fault injected"), as on a storage error.
    Unavailable = 2,
    /// `Reserve` and `Commit` fail with gRPC `UNIMPLEMENTED`, the rest answers for real: what
    /// limitador-server released before its reservations answers (and its gossip storage).
    NoReservations = 3,
    /// `CheckRateLimit` fails with gRPC `UNIMPLEMENTED`, the rest answers for real: a server
    /// without Kuadrant's `kuadrant.service.ratelimit.v1` service (only Envoy's RLS).
    NoCheck = 4,
}

impl Answer {
    pub fn parse(s: &str) -> Option<Answer> {
        match s {
            "ok" => Some(Answer::Ok),
            "garbage" => Some(Answer::Garbage),
            "unavailable" => Some(Answer::Unavailable),
            "no-reservations" => Some(Answer::NoReservations),
            "no-check" => Some(Answer::NoCheck),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Answer::Ok => "ok",
            Answer::Garbage => "garbage",
            Answer::Unavailable => "unavailable",
            Answer::NoReservations => "no-reservations",
            Answer::NoCheck => "no-check",
        }
    }

    fn from_u8(v: u8) -> Answer {
        match v {
            1 => Answer::Garbage,
            2 => Answer::Unavailable,
            3 => Answer::NoReservations,
            4 => Answer::NoCheck,
            _ => Answer::Ok,
        }
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The bytes sent in place of a message with `--answer garbage`: the first byte is a tag of
/// field 1 with wire type 7, which does not exist, so no protobuf decoder accepts it.
pub const GARBAGE: &[u8] = b"\x0f\xffnot a protobuf message";

/// The process-wide fault state.
pub struct Faults {
    delay_ms: AtomicU64,
    answer: AtomicU8,
    start_delay_ms: AtomicU64,
    toggle_delay_ms: AtomicU64,
}

static FAULTS: Faults = Faults {
    delay_ms: AtomicU64::new(0),
    answer: AtomicU8::new(0),
    start_delay_ms: AtomicU64::new(0),
    toggle_delay_ms: AtomicU64::new(1000),
};

/// The fault state of this process.
pub fn faults() -> &'static Faults {
    &FAULTS
}

impl Faults {
    /// Sets the state a process starts with.
    pub fn init(&self, delay_ms: u64, toggle_delay_ms: u64, answer: Answer) {
        self.start_delay_ms.store(delay_ms, Ordering::Relaxed);
        self.toggle_delay_ms.store(toggle_delay_ms, Ordering::Relaxed);
        self.delay_ms.store(delay_ms, Ordering::Relaxed);
        self.set_answer(answer);
    }

    pub fn delay_ms(&self) -> u64 {
        self.delay_ms.load(Ordering::Relaxed)
    }

    pub fn set_delay_ms(&self, ms: u64) {
        self.delay_ms.store(ms, Ordering::Relaxed);
    }

    pub fn answer(&self) -> Answer {
        Answer::from_u8(self.answer.load(Ordering::Relaxed))
    }

    pub fn set_answer(&self, answer: Answer) {
        self.answer.store(answer as u8, Ordering::Relaxed);
    }

    /// SIGUSR1: the delay becomes `--toggle-delay-ms` if it is not already, else `--delay-ms`.
    /// Returns the new delay.
    pub fn toggle_delay(&self) -> u64 {
        let toggle = self.toggle_delay_ms.load(Ordering::Relaxed);
        let next = if self.delay_ms() == toggle {
            self.start_delay_ms.load(Ordering::Relaxed)
        } else {
            toggle
        };
        self.set_delay_ms(next);
        next
    }

    /// The state as one line of JSON (the `/faults` answer).
    pub fn to_json(&self) -> String {
        format!(
            "{{\"delay_ms\":{},\"answer\":\"{}\"}}\n",
            self.delay_ms(),
            self.answer()
        )
    }

    /// Applies a `/faults` query string (`delay_ms=N&answer=ok|garbage|unavailable`); nothing
    /// is changed if any part is wrong.
    pub fn apply_query(&self, query: &str) -> Result<(), String> {
        let mut delay = None;
        let mut answer = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "delay_ms" => {
                    delay = Some(
                        v.parse::<u64>()
                            .map_err(|_| format!("delay_ms: not a whole number: {v:?}"))?,
                    )
                }
                "answer" => {
                    answer = Some(Answer::parse(v).ok_or_else(|| {
                        format!("answer: expected ok, garbage or unavailable, got {v:?}")
                    })?)
                }
                _ => return Err(format!("unknown parameter {k:?} (delay_ms, answer)")),
            }
        }
        if let Some(d) = delay {
            self.set_delay_ms(d);
        }
        if let Some(a) = answer {
            self.set_answer(a);
        }
        Ok(())
    }

    /// Sleeps for the current delay (the handlers call it once their answer is decided).
    pub async fn wait(&self) {
        let ms = self.delay_ms();
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
}

/// The codec of every RPC (tonic-build `codec_path`): prost, except that with
/// `Answer::Garbage` the encoder writes [`GARBAGE`] instead of the message.
pub struct FaultCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for FaultCodec<T, U> {
    fn default() -> Self {
        FaultCodec(PhantomData)
    }
}

impl<T, U> Codec for FaultCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = FaultEncoder<T, U>;
    type Decoder = <ProstCodec<T, U> as Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        FaultEncoder(ProstCodec::<T, U>::raw_encoder(BufferSettings::default()))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::default())
    }
}

/// See [`FaultCodec`].
pub struct FaultEncoder<T, U>(<ProstCodec<T, U> as Codec>::Encoder)
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static;

impl<T, U> Encoder for FaultEncoder<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        if faults().answer() == Answer::Garbage {
            buf.put_slice(GARBAGE);
            return Ok(());
        }
        self.0.encode(item, buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{RateLimitResponse, ReserveResponse};

    #[test]
    fn garbage_is_not_a_message() {
        assert!(RateLimitResponse::decode(GARBAGE).is_err());
        assert!(ReserveResponse::decode(GARBAGE).is_err());
        assert!(crate::pb::CommitResponse::decode(GARBAGE).is_err());
    }

    #[test]
    fn query_is_all_or_nothing() {
        let f = Faults {
            delay_ms: AtomicU64::new(0),
            answer: AtomicU8::new(0),
            start_delay_ms: AtomicU64::new(0),
            toggle_delay_ms: AtomicU64::new(250),
        };
        f.apply_query("delay_ms=40&answer=garbage").unwrap();
        assert_eq!((f.delay_ms(), f.answer()), (40, Answer::Garbage));
        assert!(f.apply_query("delay_ms=5&answer=nope").is_err());
        assert_eq!((f.delay_ms(), f.answer()), (40, Answer::Garbage));
        assert!(f.apply_query("speed=1").is_err());
        f.apply_query("answer=ok").unwrap();
        assert_eq!(f.to_json(), "{\"delay_ms\":40,\"answer\":\"ok\"}\n");
        f.set_delay_ms(0);
        assert_eq!(f.toggle_delay(), 250);
        assert_eq!(f.toggle_delay(), 0);
    }
}

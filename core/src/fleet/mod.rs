//! Fleet limits (`limits[].scope: "fleet"`): budgets several Envoys share through a rate-limit
//! service (Envoy's RLS protocol, answered by Limitador on Redis). Sans-IO: the worker sends the
//! calls as effects and hears the answers; a host only moves the bytes.
//!
//! - `limits`: the fleet limits and the service's settings, built once at load; what a request
//!   asks and what a stream owes at its end.
//! - `ask`: one request's admission: its calls, what each answer means, the verdict.
//! - `calls`: a worker's calls in flight and owed, by the host's token.
//! - `turn`: cooldowns shared by the fleet: the turn of a (pool, account), held by one worker
//!   at a time; `handoff`: what a worker owes the service for its turns.
//! - `grpc`: a call and its answer as a host moves them (and as gRPC over an HTTP callout).
//! - `rls`: the protobuf messages, by hand.
//!
//! Token budgets reserve (Limitador's Reserve, settled by Commit at the stream's end) or, on a
//! server without reservations, charge at admission and top up after with positive hits only:
//! nothing is ever sent that a server could read as a refund.

pub mod ask;
pub mod calls;
pub mod grpc;
pub mod handoff;
pub mod key;
pub mod limits;
pub mod rls;
pub mod side;
pub mod slots;
pub mod turn;
pub mod watch;

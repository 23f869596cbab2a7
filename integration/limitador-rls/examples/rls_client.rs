//! A tiny client for limitador-rls (or any server of the same protocols), for the manual
//! checks in the README.
//!
//!   rls-client ADDR CALL DOMAIN [DESCRIPTOR ...] [--hits N] [--amount N] [--ttl-ms N]
//!              [--id ID] [--actual N] [--repeat N] [--timeout-ms N]
//!
//! CALL is should (ShouldRateLimit), check (CheckRateLimit), report, reserve or commit;
//! each DESCRIPTOR is `key=value[,key=value...]`. One line is printed per call:
//! `OK ...`, `OVER_LIMIT ...`, `UNKNOWN`, `released=BOOL`, or `ERROR CODE: message`, each
//! followed by the call's time. Exit status: 0 if the last call was answered, 1 if it failed,
//! 2 on bad arguments.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use limitador_rls::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient as EnvoyClient;
use limitador_rls::pb::kuadrant::service::ratelimit::v1::rate_limit_service_client::RateLimitServiceClient as KuadrantClient;
use limitador_rls::pb::{
    descriptor, Code, CommitRequest, RateLimitDescriptor, RateLimitRequest, RateLimitResponse,
    ReserveRequest,
};
use tonic::transport::{Channel, Endpoint};

struct Args {
    addr: String,
    call: String,
    domain: String,
    descriptors: Vec<RateLimitDescriptor>,
    hits: u32,
    amount: u64,
    ttl_ms: Option<u64>,
    id: String,
    actual: u64,
    repeat: u32,
    timeout: Duration,
}

fn parse() -> Result<Args, String> {
    let mut pos = Vec::new();
    let mut a = Args {
        addr: String::new(),
        call: String::new(),
        domain: String::new(),
        descriptors: Vec::new(),
        hits: 0,
        amount: 1,
        ttl_ms: None,
        id: String::new(),
        actual: 0,
        repeat: 1,
        timeout: Duration::from_millis(2000),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        let num = |name: &str, v: String| -> Result<u64, String> {
            v.parse().map_err(|_| format!("{name}: not a number: {v}"))
        };
        match arg.as_str() {
            "--hits" => a.hits = num("--hits", val("--hits")?)? as u32,
            "--amount" => a.amount = num("--amount", val("--amount")?)?,
            "--ttl-ms" => a.ttl_ms = Some(num("--ttl-ms", val("--ttl-ms")?)?),
            "--id" => a.id = val("--id")?,
            "--actual" => a.actual = num("--actual", val("--actual")?)?,
            "--repeat" => a.repeat = num("--repeat", val("--repeat")?)? as u32,
            "--timeout-ms" => {
                a.timeout = Duration::from_millis(num("--timeout-ms", val("--timeout-ms")?)?)
            }
            _ if arg.starts_with("--") => return Err(format!("unknown option {arg}")),
            _ => pos.push(arg),
        }
    }
    if pos.len() < 3 {
        return Err("usage: rls-client ADDR should|check|report|reserve|commit DOMAIN [k=v[,k=v]] ...".into());
    }
    a.addr = pos[0].clone();
    a.call = pos[1].clone();
    a.domain = pos[2].clone();
    for d in &pos[3..] {
        let mut entries = Vec::new();
        for kv in d.split(',') {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("descriptor entry is not key=value: {kv}"))?;
            entries.push((k.to_string(), v.to_string()));
        }
        a.descriptors.push(descriptor(entries));
    }
    Ok(a)
}

fn code_name(code: i32) -> &'static str {
    match Code::try_from(code) {
        Ok(Code::Ok) => "OK",
        Ok(Code::OverLimit) => "OVER_LIMIT",
        _ => "UNKNOWN",
    }
}

fn rls_line(r: &RateLimitResponse) -> String {
    let mut line = code_name(r.overall_code).to_string();
    for h in &r.response_headers_to_add {
        line.push_str(&format!(" {}={:?}", h.key, h.value));
    }
    line
}

async fn once(a: &Args, ch: Channel) -> Result<String, tonic::Status> {
    let rls_req = || RateLimitRequest {
        domain: a.domain.clone(),
        descriptors: a.descriptors.clone(),
        hits_addend: a.hits,
    };
    Ok(match a.call.as_str() {
        "should" => rls_line(&EnvoyClient::new(ch).should_rate_limit(rls_req()).await?.into_inner()),
        "check" => rls_line(&KuadrantClient::new(ch).check_rate_limit(rls_req()).await?.into_inner()),
        "report" => rls_line(&KuadrantClient::new(ch).report(rls_req()).await?.into_inner()),
        "reserve" => {
            let r = KuadrantClient::new(ch)
                .reserve(ReserveRequest {
                    domain: a.domain.clone(),
                    descriptors: a.descriptors.clone(),
                    amount: a.amount,
                    ttl: a.ttl_ms.map(|ms| prost_types::Duration {
                        seconds: (ms / 1000) as i64,
                        nanos: ((ms % 1000) * 1_000_000) as i32,
                    }),
                })
                .await?
                .into_inner();
            if r.reservation_id.is_empty() {
                code_name(r.code).to_string()
            } else {
                format!("{} id={}", code_name(r.code), r.reservation_id)
            }
        }
        "commit" => {
            let r = KuadrantClient::new(ch)
                .commit(CommitRequest {
                    domain: a.domain.clone(),
                    descriptors: a.descriptors.clone(),
                    reservation_id: a.id.clone(),
                    actual_amount: a.actual,
                })
                .await?
                .into_inner();
            format!("released={}", r.reservation_released)
        }
        other => return Err(tonic::Status::invalid_argument(format!("unknown call {other}"))),
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rls-client: {e}");
            return ExitCode::from(2);
        }
    };
    let endpoint = match Endpoint::from_shared(format!("http://{}", a.addr)) {
        Ok(e) => e.connect_timeout(a.timeout).timeout(a.timeout),
        Err(e) => {
            eprintln!("rls-client: {}: {e}", a.addr);
            return ExitCode::from(2);
        }
    };
    // Lazy: a server that is down shows as an error per call, not as a failure to start.
    let ch = endpoint.connect_lazy();
    let mut ok = false;
    for _ in 0..a.repeat.max(1) {
        let t = Instant::now();
        let line = match once(&a, ch.clone()).await {
            Ok(line) => {
                ok = true;
                line
            }
            Err(s) => {
                ok = false;
                format!("ERROR {:?}: {}", s.code(), s.message())
            }
        };
        println!("{line} ({} ms)", t.elapsed().as_millis());
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

//! limitador-rls: see README.md and `limitador-rls --help`.

use std::io::Write;
use std::process::ExitCode;

use limitador_rls::config::{parse_args, Command, USAGE};
use limitador_rls::fault::faults;
use limitador_rls::server::start;

fn main() -> ExitCode {
    let settings = match parse_args(std::env::args().skip(1)) {
        Ok(Command::Run(s)) => s,
        Ok(Command::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!(
                "limitador-rls {} (limitador crate 0.14)",
                env!("CARGO_PKG_VERSION")
            );
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("limitador-rls: {e}");
            return ExitCode::from(2);
        }
    };
    faults().init(settings.delay_ms, settings.toggle_delay_ms, settings.answer);

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("limitador-rls: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let running = match start(&settings).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("limitador-rls: {e}");
                return ExitCode::FAILURE;
            }
        };
        tokio::spawn(sigusr1_toggles_delay());
        eprintln!(
            "limitador-rls: storage {}, limits {}, faults {}",
            match &settings.storage {
                limitador_rls::config::StorageKind::Memory => "memory".to_string(),
                limitador_rls::config::StorageKind::Redis(url) => url.clone(),
            },
            settings
                .limits
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "none".into()),
            faults().to_json().trim_end()
        );
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "limitador-rls listening on {}", running.addr);
        let _ = out.flush();
        drop(out);
        match running.server.await {
            Ok(Ok(())) => ExitCode::SUCCESS,
            Ok(Err(e)) => {
                eprintln!("limitador-rls: server: {e}");
                ExitCode::FAILURE
            }
            Err(e) => {
                eprintln!("limitador-rls: server task: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

async fn sigusr1_toggles_delay() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut usr1) = signal(SignalKind::user_defined1()) else {
        eprintln!("limitador-rls: SIGUSR1 cannot be handled here");
        return;
    };
    while usr1.recv().await.is_some() {
        let ms = faults().toggle_delay();
        eprintln!("limitador-rls: SIGUSR1: every answer is now {ms} ms late");
    }
}

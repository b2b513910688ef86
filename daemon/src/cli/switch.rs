//! `commd switch`: runs the software switch (`commd_switch::server`) until SIGINT/SIGTERM, with
//! its `/metrics` on the daemon's HTTP endpoint and the exit codes of every `commd` command.

use std::sync::Arc;

pub use commd_switch::server::SwitchArgs;

/// Runs `commd switch`; returns the process exit code.
pub fn main(a: &SwitchArgs) -> i32 {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("commd switch: {e}");
            return crate::exit::RUNTIME;
        }
    };
    let mut r = match commd_switch::server::start(a, &rt) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("commd switch: {e}");
            return crate::exit::USAGE;
        }
    };
    if let Some(l) = r.metrics_listener.take() {
        let sw = r.switch.clone();
        rt.spawn(crate::telemetry::http::serve_with(
            l,
            Arc::new(move || sw.metrics_text()),
        ));
    }
    println!(
        "commd switch: controller {} data {} metrics {} faults drop={} dup={} reorder={}",
        r.listen,
        r.data,
        r.metrics.map_or("off".into(), |m| m.to_string()),
        a.drop,
        a.dup,
        a.reorder
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { if let Some(t) = term.as_mut() { t.recv().await; } else { std::future::pending::<()>().await } } => {}
        }
    });
    drop(r);
    crate::exit::OK
}

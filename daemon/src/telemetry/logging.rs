//! The log subscriber and the init lines that say what was chosen and why.
//!
//! Levels and subsystems as `NCCL_DEBUG` / `NCCL_DEBUG_SUBSYS`: `debug` (`COMMD_DEBUG`) is the
//! level, `debug_subsys` (`COMMD_DEBUG_SUBSYS`) the subsystems logged at that level (targets
//! `commd::<subsys>`); everything else logs warnings and errors only. `log_format = json` writes
//! one JSON object per line. Per-op spans (`commd::op`) are for trace export; they reach the
//! log only at TRACE. The OpenTelemetry layer is added for `commd serve` when an endpoint is set.

use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::Config;

/// The log filter directives for `cfg`.
pub fn filter(cfg: &Config) -> String {
    let level = cfg.debug.to_ascii_lowercase();
    let mut f = if cfg.debug_subsys.iter().any(|s| s == "ALL") {
        format!("warn,commd={level}")
    } else {
        let mut f = String::from("warn");
        for s in &cfg.debug_subsys {
            f.push_str(&format!(",commd::{}={level}", s.to_ascii_lowercase()));
        }
        f
    };
    if level != "trace" {
        f.push_str(",commd::op=warn");
    }
    // The serving daemon's ready line shows at the default level (WARN), as a service's start
    // line does; ERROR (or an unknown level) keeps it quiet.
    if matches!(level.as_str(), "warn" | "info" | "debug" | "trace") {
        f.push_str(",commd::ready=info");
    }
    f
}

/// Whether text logs are coloured: only on a terminal, and not when `NO_COLOR` is set to a
/// non-empty value (no-color.org). Logs written to a file or the journal carry no escape codes.
pub fn colour(stderr_is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Installs the process's subscriber: stderr (text or JSON) and, when `serving` and an OTLP
/// endpoint is configured, trace export. Safe to call more than once (later calls do nothing).
pub fn init(cfg: &Config, serving: bool) {
    let json = cfg.telemetry.log_json;
    let ansi = colour(
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
        commd_settings::system("NO_COLOR").as_deref(),
    );
    let text_layer = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .with_thread_names(true)
            .with_filter(EnvFilter::new(filter(cfg)))
    });
    let json_layer = json.then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_thread_names(true)
            .with_filter(EnvFilter::new(filter(cfg)))
    });
    let (otel, otel_err) = if serving {
        match super::trace::layer(&cfg.telemetry) {
            Ok(l) => (l, None),
            Err(e) => (None, Some(e)),
        }
    } else {
        (None, None)
    };
    let traced = otel.is_some();
    let installed = tracing_subscriber::registry()
        .with(text_layer)
        .with(json_layer)
        .with(otel)
        .try_init()
        .is_ok();
    if !installed || !serving {
        return;
    }
    let t = &cfg.telemetry;
    match (otel_err, traced) {
        (Some(e), _) => {
            tracing::error!(target: "commd::telemetry", "trace export disabled: {e}")
        }
        (None, true) => tracing::info!(target: "commd::telemetry",
            "exporting traces to {} over OTLP {:?} (op sample ratio {})",
            t.otlp_endpoint.as_deref().unwrap_or(""), t.otlp_protocol, t.otlp_sample_ratio),
        (None, false) => {
            tracing::info!(target: "commd::telemetry", "trace export: off (otlp_endpoint is empty)")
        }
    }
}

/// Logs (INFO, subsystem INIT) the transport chosen for a path of a communicator and why, as
/// `NCCL_DEBUG=INFO` does at init: `comm 7 (id 3fa2b1c0, 8 ranks): rank 0 -> rank 4 via TCP: no
/// RDMA device on this node`. `path` is free text ("rank 0 -> rank 4", "ranks 0-3 (every pair)").
pub fn log_path(comm: &str, path: &str, transport: &str, reason: &str) {
    tracing::info!(target: "commd::init", comm, path, transport, reason,
        "{comm}: {path} via {transport}: {reason}");
}

#[cfg(test)]
mod tests {
    use super::colour;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(
            !colour(false, None),
            "a file or the journal gets no escape codes"
        );
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(
            colour(true, Some(OsStr::new(""))),
            "NO_COLOR= (empty) does not disable"
        );
    }
}

//! `commd status`: sessions, communicators, registrations and op counts of the running daemon,
//! asked over its control socket.

use crate::config::Config;
use crate::serve::exit;

pub fn status(cfg: &Config, json: bool) -> i32 {
    let c = match commd_client::Client::connect(Some(&cfg.socket)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("commd status: {e}");
            return exit::RUNTIME;
        }
    };
    let s = match c.status() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("commd status: {e}");
            return exit::RUNTIME;
        }
    };
    // Our own session is counted by the daemon; leave it out so the numbers describe others.
    let others: Vec<_> = s
        .session_list
        .iter()
        .filter(|x| x.session_id != c.session_id())
        .collect();
    if json {
        let sessions: Vec<_> = others
            .iter()
            .map(|x| serde_json::json!({"session_id": x.session_id, "uid": x.uid, "pid": x.pid, "name": x.name,
                "communicators": x.communicators, "registrations": x.registrations, "mapped_bytes": x.mapped_bytes,
                "ops_completed": x.ops_completed, "ops_failed": x.ops_failed}))
            .collect();
        let j = serde_json::json!({"daemon_version": s.daemon_version, "pid": s.pid, "uptime_ms": s.uptime_ms,
            "sessions": others.len(), "communicators": s.communicators, "registrations": s.registrations,
            "mapped_bytes": s.mapped_bytes, "ops_completed": s.ops_completed, "ops_failed": s.ops_failed,
            "pending_joins": s.pending_joins, "workers": s.workers, "session_list": sessions});
        println!("{j}");
    } else {
        println!(
            "commd {} pid {} up {:.1}s: {} sessions, {} communicators ({} forming), {} registrations ({} bytes), ops {} ok / {} failed",
            s.daemon_version,
            s.pid,
            s.uptime_ms as f64 / 1e3,
            others.len(),
            s.communicators,
            s.pending_joins,
            s.registrations,
            s.mapped_bytes,
            s.ops_completed,
            s.ops_failed
        );
        for x in others {
            println!("{}", crate::cli::stat::session_line(x));
        }
    }
    exit::OK
}

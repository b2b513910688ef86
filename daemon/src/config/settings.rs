//! The typed values of settings that other modules own the behaviour of (observability, the
//! switch client, the RDMA GID choice), with their parsers and checks, and the bounds config
//! shares with them, so that config depends on no module above it.
//!
//! May use: std, `http` (URL syntax).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// The largest chunk a daemon sends to another in one frame (`net::wire`; the `net_chunk_bytes`
/// setting's bound).
pub const MAX_CHUNK_BYTES: u32 = 1 << 28;

/// How traces are sent to the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OtlpProtocol {
    Grpc,
    HttpProtobuf,
    HttpJson,
}

/// The observability settings of [`Config`](super::Config).
#[derive(Clone, Debug)]
pub struct TelemetrySettings {
    pub log_json: bool,
    /// `None`: no /metrics.
    pub metrics_listen: Option<SocketAddr>,
    /// Series per session and communicator (labels that churn with every job), else sums.
    pub metrics_per_job: bool,
    /// `None`: no trace export.
    pub otlp_endpoint: Option<String>,
    pub otlp_protocol: OtlpProtocol,
    pub otlp_sample_ratio: f64,
}

impl TelemetrySettings {
    /// From the validated config values (`get(key)`).
    pub fn from_values(get: impl Fn(&str) -> String) -> Self {
        let ep = get("otlp_endpoint");
        Self {
            log_json: get("log_format").eq_ignore_ascii_case("json"),
            metrics_listen: get("metrics_listen").parse().ok(),
            metrics_per_job: parse_switch(&get("metrics_per_job")).unwrap_or(false),
            otlp_endpoint: (!ep.trim().is_empty()).then(|| ep.trim().to_string()),
            otlp_protocol: parse_protocol(&get("otlp_protocol"))
                .unwrap_or(OtlpProtocol::HttpProtobuf),
            otlp_sample_ratio: get("otlp_sample_ratio").parse().unwrap_or(1.0),
        }
    }
}

fn parse_switch(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Some(true),
        "off" | "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

fn parse_protocol(v: &str) -> Option<OtlpProtocol> {
    match v.trim().to_ascii_lowercase().as_str() {
        "grpc" => Some(OtlpProtocol::Grpc),
        "http/protobuf" => Some(OtlpProtocol::HttpProtobuf),
        "http/json" => Some(OtlpProtocol::HttpJson),
        _ => None,
    }
}

/// Validates the observability keys (called by the config registry).
pub fn validate_telemetry_key(name: &str, value: &str) -> Result<(), String> {
    let v = value.trim();
    match name {
        "log_format" => match v.to_ascii_lowercase().as_str() {
            "text" | "json" => Ok(()),
            _ => Err("expected text or json".into()),
        },
        "metrics_listen" => {
            if v.eq_ignore_ascii_case("off") || v.parse::<SocketAddr>().is_ok() {
                Ok(())
            } else {
                Err("expected IP:PORT (e.g. 127.0.0.1:9464, [::]:9464) or off".into())
            }
        }
        "otlp_endpoint" => {
            if v.is_empty() {
                return Ok(());
            }
            if v.starts_with("https://") {
                return Err("TLS is not supported: send to a local collector over http://".into());
            }
            match v.strip_prefix("http://") {
                Some(rest) if !rest.is_empty() && v.parse::<::http::Uri>().is_ok() => Ok(()),
                _ => Err("expected a URL such as http://127.0.0.1:4318".into()),
            }
        }
        "metrics_per_job" => parse_switch(v)
            .map(|_| ())
            .ok_or_else(|| "expected on or off".into()),
        "otlp_protocol" => parse_protocol(v)
            .map(|_| ())
            .ok_or_else(|| "expected grpc, http/protobuf or http/json".into()),
        "otlp_sample_ratio" => match v.parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => Ok(()),
            _ => Err("expected a number from 0 to 1".into()),
        },
        _ => Ok(()),
    }
}

/// The daemon's switch settings (config keys `switch*`).
#[derive(Clone, Debug)]
pub struct SwitchSettings {
    /// Controller HOST:PORT, or "off".
    pub controller: String,
    /// Worker IPv4 ("" = the advertised IP).
    pub bind: String,
    pub threads: usize,
    pub window: usize,
    pub packet_bytes: usize,
    pub timeout: Duration,
    pub pin: bool,
}

/// Checks a `switch` value: "off" or HOST:PORT.
pub fn check_controller(v: &str) -> Result<(), String> {
    if v == "off" {
        return Ok(());
    }
    match v.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0) => Ok(()),
        _ => {
            Err("expected HOST:PORT of a SwitchML controller (e.g. 10.0.0.9:50099) or 'off'".into())
        }
    }
}

/// How the GID is chosen (`rdma_gid`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GidChoice {
    /// The RoCE v2 GID of the advertised IP (InfiniBand: index 0).
    Auto,
    Index(u32),
    Addr(Ipv6Addr),
}

impl GidChoice {
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        if let Ok(i) = s.parse::<u32>() {
            return Ok(Self::Index(i));
        }
        match s.parse::<IpAddr>() {
            Ok(IpAddr::V6(a)) => Ok(Self::Addr(a)),
            Ok(IpAddr::V4(a)) => Ok(Self::Addr(a.to_ipv6_mapped())),
            Err(_) => Err(
                "expected a GID table index (e.g. 3) or a GID/IP address (e.g. ::ffff:10.0.0.1)"
                    .into(),
            ),
        }
    }
}

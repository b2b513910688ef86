//! Trace export: `tracing` spans (`commd::session`, `commd::init` communicator init, `commd::op`
//! per matched op) become OpenTelemetry spans through `tracing-opentelemetry`, sent to an OTLP
//! collector when `otlp_endpoint` is set. Without an endpoint no layer is installed: op spans
//! are then disabled at their call sites and cost nothing.
//!
//! Protocols: `grpc` (tonic, on a one-thread runtime of its own, `commd-otlp`), `http/protobuf`
//! and `http/json` (a small blocking HTTP/1.1 client of our own, run on the SDK's batch thread).
//! Plain `http://` only: send to a collector on the node or the cluster network. The SDK's own
//! `OTEL_BSP_*` and `OTEL_EXPORTER_OTLP_HEADERS` variables apply. Export failures are logged as
//! warnings by the SDK and never reach the data path.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::trace::{Link, SpanKind, TraceId, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SamplingResult, SdkTracerProvider, ShouldSample};
use tracing::Subscriber;
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

use super::{OtlpProtocol, Settings};

/// How long one export may take before the SDK gives up on it.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

static PROVIDER: Mutex<Option<SdkTracerProvider>> = Mutex::new(None);

/// The OpenTelemetry layer for `s`, or `None` when no endpoint is configured.
pub fn layer<S>(s: &Settings) -> Result<Option<Box<dyn Layer<S> + Send + Sync>>, String>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    let Some(endpoint) = &s.otlp_endpoint else {
        return Ok(None);
    };
    let exporter = exporter(endpoint, s.otlp_protocol)?;
    let mut resource = Resource::builder().with_attributes([
        KeyValue::new("service.version", commd_proto::VERSION),
        KeyValue::new("process.pid", i64::from(std::process::id())),
        KeyValue::new("host.name", hostname()),
    ]);
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("commd");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(OpSampler {
            ops: Sampler::TraceIdRatioBased(s.otlp_sample_ratio),
        })
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("commd");
    *PROVIDER.lock().unwrap_or_else(|e| e.into_inner()) = Some(provider);
    let targets = tracing_subscriber::filter::Targets::new()
        .with_target("commd::op", tracing::Level::INFO)
        .with_target("commd::session", tracing::Level::INFO)
        .with_target("commd::init", tracing::Level::INFO);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_tracked_inactivity(false)
        .with_filter(targets);
    Ok(Some(Box::new(layer)))
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// Ends export: the batch in flight is sent (bounded by a timeout).
pub fn shutdown() {
    let p = PROVIDER.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(p) = p
        && let Err(e) = p.shutdown_with_timeout(Duration::from_secs(5))
    {
        tracing::warn!(target: "commd::telemetry", "trace export did not finish at exit: {e}");
    }
}

fn exporter(
    endpoint: &str,
    protocol: OtlpProtocol,
) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let built = match protocol {
        OtlpProtocol::Grpc => {
            // tonic's channel tasks need a tokio runtime; the SDK's batch thread only waits on them.
            let rt = runtime()?;
            let _in_rt = rt.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .build()
        }
        OtlpProtocol::HttpProtobuf | OtlpProtocol::HttpJson => {
            let p = if protocol == OtlpProtocol::HttpJson {
                Protocol::HttpJson
            } else {
                Protocol::HttpBinary
            };
            opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(BlockingHttp {
                    timeout: EXPORT_TIMEOUT,
                })
                .with_protocol(p)
                .with_endpoint(traces_url(endpoint))
                .with_timeout(EXPORT_TIMEOUT)
                .build()
        }
    };
    built.map_err(|e| format!("OTLP exporter for {endpoint}: {e}"))
}

/// `http://host:port` gets OTLP/HTTP's `/v1/traces`; a URL with a path is used as given.
pub fn traces_url(endpoint: &str) -> String {
    let rest = endpoint.strip_prefix("http://").unwrap_or(endpoint);
    if rest.trim_end_matches('/').contains('/') {
        endpoint.to_string()
    } else {
        format!("{}/v1/traces", endpoint.trim_end_matches('/'))
    }
}

fn runtime() -> Result<&'static tokio::runtime::Runtime, String> {
    static RT: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("commd-otlp")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the OTLP runtime: {e}"))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Keeps every session and communicator-init span; samples op traces by `ops`.
#[derive(Clone, Debug)]
struct OpSampler {
    ops: Sampler,
}

impl ShouldSample for OpSampler {
    fn should_sample(
        &self,
        parent: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let s = match name {
            "session" | "comm_init" => &Sampler::AlwaysOn,
            _ => &self.ops,
        };
        s.should_sample(parent, trace_id, name, kind, attributes, links)
    }
}

/// A minimal blocking HTTP/1.1 client for OTLP/HTTP (one request per connection, plain HTTP).
#[derive(Debug)]
struct BlockingHttp {
    timeout: Duration,
}

#[tonic::async_trait]
impl HttpClient for BlockingHttp {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        post(&request, self.timeout).map_err(Into::into)
    }
}

const MAX_RESPONSE: usize = 4 << 20;

fn post(req: &Request<Bytes>, timeout: Duration) -> std::io::Result<Response<Bytes>> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let uri = req.uri();
    let host = uri.host().ok_or_else(|| bad(format!("no host in {uri}")))?;
    let port = uri.port_u16().unwrap_or(80);
    let addr = (host.trim_start_matches('[').trim_end_matches(']'), port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| bad(format!("{host} does not resolve")))?;
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let body = req.body();
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut head = format!(
        "{} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        req.method(),
        uri.authority().map(|a| a.as_str()).unwrap_or(host),
        body.len()
    );
    for (k, v) in req.headers() {
        if matches!(k.as_str(), "host" | "content-length" | "connection") {
            continue;
        }
        if let Ok(v) = v.to_str() {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.take(MAX_RESPONSE as u64).read_to_end(&mut raw)?;
    parse_response(&raw).map_err(bad)
}

/// Parses a whole HTTP/1.1 response (Content-Length, chunked, or read to the end).
fn parse_response(raw: &[u8]) -> Result<Response<Bytes>, String> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("truncated HTTP response")?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "non-UTF-8 HTTP response head")?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or("bad HTTP status line")?;
    let mut b = Response::builder().status(status);
    let mut chunked = false;
    let mut length = None;
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim(), v.trim());
            if k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked") {
                chunked = true;
            } else if k.eq_ignore_ascii_case("content-length") {
                length = v.parse::<usize>().ok();
            }
            b = b.header(k, v);
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest[..length.unwrap_or(rest.len()).min(rest.len())].to_vec()
    };
    b.body(Bytes::from(body)).map_err(|e| e.to_string())
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("bad chunk")?;
        let size = std::str::from_utf8(&rest[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .ok_or("bad chunk size")?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if rest.len() < size {
            return Err("truncated chunk".into());
        }
        out.extend_from_slice(&rest[..size]);
        rest = rest.get(size + 2..).unwrap_or(&[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_url_appends_the_signal_path_only_without_a_path() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/custom"), "http://c:4318/custom");
    }

    #[test]
    fn parses_length_and_chunked_responses() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA").unwrap();
        assert_eq!((r.status().as_u16(), r.body().as_ref()), (200, &b"ok"[..]));
        let r = parse_response(
            b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(
            (r.status().as_u16(), r.body().as_ref()),
            (400, &b"abcde"[..])
        );
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }

    /// A real export over gRPC to an in-process OTLP trace service.
    #[test]
    fn grpc_export_reaches_a_collector() {
        use opentelemetry::trace::{Tracer, TracerProvider};
        use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
            TraceService, TraceServiceServer,
        };
        use opentelemetry_proto::tonic::collector::trace::v1::{
            ExportTraceServiceRequest, ExportTraceServiceResponse,
        };
        struct Sink(std::sync::mpsc::Sender<Vec<String>>);
        #[tonic::async_trait]
        impl TraceService for Sink {
            async fn export(
                &self,
                r: tonic::Request<ExportTraceServiceRequest>,
            ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
                let names = r
                    .into_inner()
                    .resource_spans
                    .iter()
                    .flat_map(|rs| &rs.scope_spans)
                    .flat_map(|ss| &ss.spans)
                    .map(|s| s.name.clone())
                    .collect();
                let _ = self.0.send(names);
                Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
            }
        }
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(Sink(tx)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let exporter = exporter(&format!("http://{addr}"), OtlpProtocol::Grpc).unwrap();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter)
            .build();
        provider.tracer("t").in_span("all_reduce", |_| {});
        let names = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!(names, vec!["all_reduce".to_string()]);
        provider.shutdown().unwrap();
    }
}

//! Trace export: `tracing` spans (`commd::session`, `commd::init` communicator init, `commd::op`
//! per matched op) become OpenTelemetry spans through `tracing-opentelemetry`, sent to an OTLP
//! collector when `otlp_endpoint` is set. Without an endpoint no layer is installed: op spans
//! are then disabled at their call sites and cost nothing.
//!
//! Protocols: `grpc` (tonic, on a one-thread runtime of its own, `commd-otlp`), `http/protobuf`
//! and `http/json` (opentelemetry-otlp's reqwest blocking client, run on the SDK's batch
//! thread). Plain `http://` only: send to a collector on the node or the cluster network
//! (TLS would bring reqwest's rustls with aws-lc, a C build needing cmake and clang on every
//! machine that builds commd). The SDK's own
//! `OTEL_BSP_*` and `OTEL_EXPORTER_OTLP_HEADERS` variables apply. Export failures are logged as
//! warnings by the SDK and never reach the data path.

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::trace::{Link, SpanKind, TraceId, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
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
    if commd_settings::system("OTEL_SERVICE_NAME").is_none() {
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
            // The exporter's own client (reqwest's blocking one, feature
            // `reqwest-blocking-client`), on the SDK's batch thread.
            opentelemetry_otlp::SpanExporter::builder()
                .with_http()
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

//! The `/metrics` endpoint, on hyper's HTTP/1.1 server (the tree already carries hyper under
//! tonic). `GET` or `HEAD /metrics` returns the OpenMetrics text exposition, rendered per
//! scrape, or Prometheus' text format 0.0.4 to a client whose `Accept` asks for `text/plain`
//! and not OpenMetrics (promtool, older scrapers); `/` a pointer to it; other paths 404, other
//! methods 405. Each connection serves one
//! request at a time with a deadline for its request head (`header_read_timeout`) and a cap on
//! what hyper buffers, so a slow or hostile client only costs its own task.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// What hyper may buffer of one request (its head: scrapers send a few hundred bytes).
const MAX_BUF: usize = 16 * 1024;
/// How long a client may take to send its request head.
const READ_DEADLINE: Duration = Duration::from_secs(10);
/// How long one connection may live (a scraper makes one request, or a few kept alive).
const CONN_DEADLINE: Duration = Duration::from_secs(60);
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CONTENT_TYPE_004: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether the request's `Accept` asks for Prometheus' text format and not OpenMetrics
/// (Prometheus itself lists both, OpenMetrics first; no `Accept` gets OpenMetrics).
fn wants_text_004<B>(req: &Request<B>) -> bool {
    let accept = req
        .headers()
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",")
        .to_ascii_lowercase();
    accept.contains("text/plain") && !accept.contains("application/openmetrics-text")
}

/// The OpenMetrics exposition `om` in Prometheus' text format 0.0.4: a counter family is named
/// by its samples (`x_total`, in its HELP and TYPE lines too), `info` and `stateset` families
/// are gauges, `unknown` is `untyped`; `# UNIT`, `# EOF`, `_created` samples and exemplars
/// have no place there and are left out.
pub fn text_004(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut help: Option<(&str, &str)> = None;
    let mut created: Option<String> = None;
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" if !name.ends_with("_total") => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "stateset" => (name.to_string(), "gauge"),
                "unknown" => (name.to_string(), "untyped"),
                k => (name.to_string(), k),
            };
            created =
                (kind == "counter").then(|| format!("{}_created", name.trim_end_matches("_total")));
            if let Some((_, text)) = help.take() {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        if line.starts_with("# UNIT ") || line == "# EOF" || line.is_empty() {
            continue;
        }
        if let Some(c) = &created {
            let base = line.split(['{', ' ']).next().unwrap_or("");
            if base == c {
                continue;
            }
        }
        // An exemplar follows " # " after the value; 0.0.4 has none.
        let sample = line.split_once(" # ").map_or(line, |(s, _)| s);
        out.push_str(sample);
        out.push('\n');
    }
    out
}

/// The body of `/metrics`: rendered per scrape.
pub type Body = Arc<dyn Fn() -> String + Send + Sync>;

/// Serves the daemon's metrics until the runtime stops.
pub async fn serve(listener: TcpListener) {
    serve_with(listener, Arc::new(|| super::metrics().encode())).await
}

/// Serves `body` at `/metrics` until the runtime stops (also used by `commd switch`).
pub async fn serve_with(listener: TcpListener, body: Body) {
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                let body = body.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let body = body.clone();
                        async move { Ok::<_, Infallible>(route(&req, &*body)) }
                    });
                    let conn = http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(READ_DEADLINE)
                        .max_buf_size(MAX_BUF)
                        .serve_connection(TokioIo::new(s), svc);
                    if let Ok(Err(e)) = tokio::time::timeout(CONN_DEADLINE, conn).await {
                        tracing::debug!(target: "commd::telemetry", "metrics connection: {e}");
                    }
                });
            }
            Err(e) => {
                tracing::debug!(target: "commd::telemetry", "metrics accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The response to one request (hyper leaves out a HEAD response's body itself).
fn route<B>(req: &Request<B>, body: &(dyn Fn() -> String + Send + Sync)) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, ctype: &'static str, text: Bytes| {
        let mut r = Response::new(Full::new(text));
        *r.status_mut() = status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static(ctype),
        );
        r
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            Bytes::from_static(b"only GET\n"),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match req.uri().path() {
        "/metrics" if wants_text_004(req) => reply(
            StatusCode::OK,
            CONTENT_TYPE_004,
            Bytes::from(text_004(&body())),
        ),
        "/metrics" => reply(StatusCode::OK, CONTENT_TYPE, Bytes::from(body())),
        "/" => reply(
            StatusCode::OK,
            "text/plain",
            Bytes::from_static(b"commd: Prometheus metrics at /metrics\n"),
        ),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            Bytes::from_static(b"not found; try /metrics\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn status(method: &str, uri: &str) -> (StatusCode, String) {
        let req = Request::builder().method(method).uri(uri).body(()).unwrap();
        let r = route(&req, &|| super::super::metrics().encode());
        let ct = r.headers()[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_string();
        (r.status(), ct)
    }

    #[test]
    fn routes() {
        assert_eq!(
            status("GET", "/metrics"),
            (StatusCode::OK, CONTENT_TYPE.into())
        );
        assert_eq!(status("HEAD", "/metrics?x=1").0, StatusCode::OK);
        assert_eq!(status("GET", "/nope").0, StatusCode::NOT_FOUND);
        assert_eq!(status("POST", "/metrics").0, StatusCode::METHOD_NOT_ALLOWED);
    }

    #[test]
    fn text_004_names_counters_by_their_samples() {
        let om = "# HELP commd_ops Ops completed.\n# TYPE commd_ops counter\n# UNIT commd_ops ops\n\
                  commd_ops_total{op=\"all_reduce\"} 3 # {trace_id=\"ab\"} 1.0\n\
                  commd_ops_created{op=\"all_reduce\"} 1700000000.0\n\
                  # HELP commd_build Build.\n# TYPE commd_build info\ncommd_build_info{v=\"1\"} 1\n\
                  # HELP commd_rss Bytes.\n# TYPE commd_rss gauge\ncommd_rss 7\n# EOF\n";
        assert_eq!(
            text_004(om),
            "# HELP commd_ops_total Ops completed.\n# TYPE commd_ops_total counter\n\
             commd_ops_total{op=\"all_reduce\"} 3\n\
             # HELP commd_build_info Build.\n# TYPE commd_build_info gauge\ncommd_build_info{v=\"1\"} 1\n\
             # HELP commd_rss Bytes.\n# TYPE commd_rss gauge\ncommd_rss 7\n"
        );
        let want = |accept: &str| {
            let r = Request::builder()
                .uri("/metrics")
                .header(header::ACCEPT, accept)
                .body(())
                .unwrap();
            wants_text_004(&r)
        };
        assert!(want("text/plain;version=0.0.4"));
        assert!(!want(
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        ));
        assert!(!want("*/*"));
    }

    fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(request).unwrap();
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    }

    #[test]
    fn serves_over_real_http() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let l = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = l.local_addr().unwrap();
        rt.spawn(serve(l));
        let out = exchange(
            addr,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(out.contains("application/openmetrics-text"));
        assert!(out.trim_end().ends_with("# EOF"), "{out}");
        // Prometheus' text format to a client that asks for it (promtool).
        let out = exchange(
            addr,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain;version=0.0.4\r\nConnection: close\r\n\r\n",
        );
        assert!(out.contains(CONTENT_TYPE_004), "{out}");
        assert!(!out.contains("# EOF"), "{out}");
        // HEAD: the headers of GET, no body.
        let out = exchange(
            addr,
            b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(!out.contains("# EOF"), "{out}");
        // A request head larger than the cap is refused, not buffered.
        let mut big = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', 64 * 1024));
        big.extend_from_slice(b"\r\n\r\n");
        let out = exchange(addr, &big);
        assert!(out.starts_with("HTTP/1.1 431"), "{out:.200}");
    }
}

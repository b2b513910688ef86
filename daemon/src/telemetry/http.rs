//! The `/metrics` endpoint, on hyper's HTTP/1.1 server (the tree already carries hyper under
//! tonic). `GET` or `HEAD /metrics` returns the OpenMetrics text exposition, rendered per
//! scrape; `/` a pointer to it; other paths 404, other methods 405. Each connection serves one
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

//! The `/metrics` endpoint: a minimal HTTP/1.1 responder on tokio (one request per connection).
//! `GET /metrics` returns the OpenMetrics text exposition; `GET /` a pointer to it; anything else
//! 404/405. Requests are read with a deadline and a size cap, so a slow or hostile client only
//! costs its own task.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MAX_HEAD: usize = 16 * 1024;
const READ_DEADLINE: Duration = Duration::from_secs(10);
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The body of `/metrics`: rendered per scrape.
pub type Body = std::sync::Arc<dyn Fn() -> String + Send + Sync>;

/// Serves the daemon's metrics until the runtime stops.
pub async fn serve(listener: TcpListener) {
    serve_with(listener, std::sync::Arc::new(|| super::metrics().encode())).await
}

/// Serves `body` at `/metrics` until the runtime stops (also used by `commd switch`).
pub async fn serve_with(listener: TcpListener, body: Body) {
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                let body = body.clone();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(READ_DEADLINE, handle(s, &*body)).await;
                });
            }
            Err(e) => {
                tracing::debug!(target: "commd::telemetry", "metrics accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn handle(
    mut s: TcpStream,
    body: &(dyn Fn() -> String + Send + Sync),
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_HEAD {
            return respond(
                &mut s,
                431,
                "text/plain",
                b"request head too large\n",
                false,
            )
            .await;
        }
    }
    let line = buf.split(|b| *b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let (status, ctype, body, head) = route(&line, body);
    respond(&mut s, status, ctype, &body, head).await
}

/// (status, content type, body, HEAD request) for a request line.
fn route(line: &str, body: &dyn Fn() -> String) -> (u16, &'static str, Vec<u8>, bool) {
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or("");
    let target = parts.next().unwrap_or("");
    let path = target.split('?').next().unwrap_or("");
    let head = method == "HEAD";
    if method != "GET" && !head {
        return (405, "text/plain", b"only GET\n".to_vec(), false);
    }
    match path {
        "/metrics" => (200, CONTENT_TYPE, body().into_bytes(), head),
        "/" => (
            200,
            "text/plain",
            b"commd: Prometheus metrics at /metrics\n".to_vec(),
            head,
        ),
        _ => (
            404,
            "text/plain",
            b"not found; try /metrics\n".to_vec(),
            head,
        ),
    }
}

async fn respond(
    s: &mut TcpStream,
    status: u16,
    ctype: &str,
    body: &[u8],
    head_only: bool,
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Request Header Fields Too Large",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    if !head_only {
        s.write_all(body).await?;
    }
    s.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route_daemon(line: &str) -> (u16, &'static str, Vec<u8>, bool) {
        route(line, &|| super::super::metrics().encode())
    }

    #[test]
    fn routes() {
        let (st, ct, body, head) = route_daemon("GET /metrics HTTP/1.1");
        assert_eq!((st, ct, head), (200, CONTENT_TYPE, false));
        assert!(String::from_utf8(body).unwrap().contains("# EOF"));
        assert!(route_daemon("HEAD /metrics?x=1 HTTP/1.1").3);
        assert_eq!(route_daemon("GET /nope HTTP/1.1").0, 404);
        assert_eq!(route_daemon("POST /metrics HTTP/1.1").0, 405);
    }

    #[test]
    fn serves_over_real_http() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let l = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = l.local_addr().unwrap();
        rt.spawn(serve(l));
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(out.contains("application/openmetrics-text"));
        assert!(out.trim_end().ends_with("# EOF"), "{out}");
    }
}

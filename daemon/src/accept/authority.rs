//! The `:authority` of requests on the control socket, made acceptable to h2.
//!
//! gRPC C-core clients (grpcio, since 1.57) send the percent-encoded socket path as the
//! `:authority` of a Unix-socket channel (`run%2Fcommd%2Fcommd.sock`), grpc-java and others the
//! path itself. An authority means nothing on a Unix socket, but h2, tonic's HTTP/2, refuses a
//! `%` or `/` in it and resets every such stream with PROTOCOL_ERROR (hyperium/h2#487, open), so
//! those clients failed every call unless they set `grpc.default_authority`.
//!
//! So the bytes a client sends are read through a [`Rewriter`]: HTTP/2 frames are parsed up to
//! the connection's first header block. When its authority is one h2 accepts (tonic, grpc-go),
//! that block and the rest of the connection pass through untouched and unparsed. Otherwise
//! every header block of the connection is decoded (HPACK) and encoded again with
//! `:authority: localhost`, in frames of at most 16 KiB (the size every HTTP/2 peer accepts);
//! all other frames pass through as they are. A stream that is not HTTP/2 ends the connection
//! with an error, as h2 itself would.

use loona_hpack::{Decoder, Encoder};

const PREFACE: usize = 24;
const HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame accepted from a client (HTTP/2's ceiling for SETTINGS_MAX_FRAME_SIZE).
const MAX_FRAME: usize = (1 << 24) - 1;
/// The largest header block accepted (h2's own default limit on a header list is 16 MiB; a
/// gRPC call's headers are a few hundred bytes).
const MAX_BLOCK: usize = 1 << 20;
/// Frames written here stay within HTTP/2's default SETTINGS_MAX_FRAME_SIZE.
const OUT_FRAME: usize = 16384;
/// HPACK's default dynamic table size, which h2 advertises (it sends no other).
const TABLE: usize = 4096;

enum State {
    Preface(usize),
    Frames,
    /// The first header block was fine: the rest is copied.
    Pass,
}

/// A header block being collected (HEADERS, then CONTINUATION frames until END_HEADERS).
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// The frames as received, for a pass-through decision.
    raw: Vec<u8>,
}

/// Rewrites the client-to-server half of one HTTP/2 connection (the module doc).
pub struct Rewriter {
    state: State,
    input: Vec<u8>,
    out: Vec<u8>,
    block: Option<Block>,
    /// Set once the connection's blocks are rewritten: the client's HPACK context as decoded,
    /// and ours towards h2.
    codec: Option<(Decoder<'static>, Encoder<'static>)>,
    rewritten: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl Rewriter {
    pub fn new() -> Self {
        Self {
            state: State::Preface(PREFACE),
            input: Vec::new(),
            out: Vec::new(),
            block: None,
            codec: None,
            rewritten: 0,
        }
    }

    /// Whether the connection passes through from here on, with nothing buffered: the reader
    /// can drop the rewriter.
    pub fn done(&self) -> bool {
        matches!(self.state, State::Pass) && self.input.is_empty() && self.out.is_empty()
    }

    /// Header blocks rewritten so far.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Bytes ready for the server, taken (at most `max`).
    pub fn take(&mut self, max: usize) -> Vec<u8> {
        let n = max.min(self.out.len());
        self.out.drain(..n).collect()
    }

    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    /// Feeds bytes read from the client.
    pub fn feed(&mut self, data: &[u8]) -> Result<(), String> {
        self.input.extend_from_slice(data);
        loop {
            match self.state {
                State::Pass => {
                    self.out.append(&mut self.input);
                    return Ok(());
                }
                State::Preface(left) => {
                    let n = left.min(self.input.len());
                    self.out.extend(self.input.drain(..n));
                    if n < left {
                        self.state = State::Preface(left - n);
                        return Ok(());
                    }
                    self.state = State::Frames;
                }
                State::Frames => {
                    if self.input.len() < HEADER {
                        return Ok(());
                    }
                    let len = usize::from(self.input[0]) << 16
                        | usize::from(self.input[1]) << 8
                        | usize::from(self.input[2]);
                    if len > MAX_FRAME {
                        return Err(format!("HTTP/2 frame of {len} bytes"));
                    }
                    if self.input.len() < HEADER + len {
                        return Ok(());
                    }
                    let frame: Vec<u8> = self.input.drain(..HEADER + len).collect();
                    self.frame(frame)?;
                }
            }
        }
    }

    fn frame(&mut self, frame: Vec<u8>) -> Result<(), String> {
        let (kind, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[HEADER..];
        match kind {
            HEADERS => {
                if self.block.is_some() {
                    return Err("HEADERS frame inside another header block".into());
                }
                let mut p = payload;
                let mut pad = 0;
                if flags & PADDED != 0 {
                    let (&n, rest) = p
                        .split_first()
                        .ok_or("HEADERS frame without its padding length")?;
                    pad = usize::from(n);
                    p = rest;
                }
                let priority = if flags & PRIORITY != 0 {
                    let (pri, rest) = p
                        .split_at_checked(5)
                        .ok_or("HEADERS frame shorter than its priority")?;
                    p = rest;
                    Some(<[u8; 5]>::try_from(pri).map_err(|_| "priority")?)
                } else {
                    None
                };
                let fragment = p
                    .get(
                        ..p.len()
                            .checked_sub(pad)
                            .ok_or("HEADERS padding longer than the frame")?,
                    )
                    .ok_or("padding")?
                    .to_vec();
                self.block = Some(Block {
                    stream,
                    end_stream: flags & END_STREAM != 0,
                    priority,
                    fragment,
                    raw: Vec::new(),
                });
            }
            CONTINUATION => {
                let b = self
                    .block
                    .as_mut()
                    .ok_or("CONTINUATION frame without a header block")?;
                if b.stream != stream {
                    return Err("CONTINUATION frame of another stream".into());
                }
                b.fragment.extend_from_slice(payload);
            }
            _ => {
                if self.block.is_some() {
                    return Err("a frame inside a header block".into());
                }
                self.out.extend_from_slice(&frame);
                return Ok(());
            }
        }
        let b = self.block.as_mut().ok_or("header block")?;
        if b.fragment.len() > MAX_BLOCK {
            return Err(format!("a header block of more than {MAX_BLOCK} bytes"));
        }
        b.raw.extend_from_slice(&frame);
        if flags & END_HEADERS != 0 {
            let b = self.block.take().ok_or("header block")?;
            self.finish(b)?;
        }
        Ok(())
    }

    fn finish(&mut self, b: Block) -> Result<(), String> {
        let decode = |d: &mut Decoder<'static>, bytes: &[u8]| {
            d.decode(bytes)
                .map_err(|e| format!("HPACK header block: {e:?}"))
        };
        let headers = match &mut self.codec {
            Some((d, _)) => decode(d, &b.fragment)?,
            None => {
                let mut d = decoder();
                let headers = decode(&mut d, &b.fragment)?;
                if !headers.iter().any(|(n, v)| refused_authority(n, v)) {
                    // h2 takes this connection's authority: hand it the frames as they were.
                    self.out.extend_from_slice(&b.raw);
                    self.state = State::Pass;
                    return Ok(());
                }
                self.codec = Some((d, Encoder::new()));
                headers
            }
        };
        let Some((_, enc)) = &mut self.codec else {
            return Err("HPACK context".into());
        };
        let block = enc.encode(headers.iter().map(|(n, v)| {
            let v: &[u8] = if refused_authority(n, v) {
                b"localhost"
            } else {
                v
            };
            (n.as_slice(), v)
        }));
        self.rewritten += 1;
        self.emit(&b, &block);
        Ok(())
    }

    /// Writes `block` as a HEADERS frame and as many CONTINUATION frames as it needs.
    fn emit(&mut self, b: &Block, block: &[u8]) {
        let pri = b.priority.map_or(0, |_| 5);
        let first = block.len().min(OUT_FRAME - pri);
        let mut flags = if b.end_stream { END_STREAM } else { 0 };
        if b.priority.is_some() {
            flags |= PRIORITY;
        }
        if first == block.len() {
            flags |= END_HEADERS;
        }
        self.header(first + pri, HEADERS, flags, b.stream);
        if let Some(p) = b.priority {
            self.out.extend_from_slice(&p);
        }
        self.out.extend_from_slice(&block[..first]);
        let mut rest = &block[first..];
        while !rest.is_empty() {
            let n = rest.len().min(OUT_FRAME);
            let flags = if n == rest.len() { END_HEADERS } else { 0 };
            self.header(n, CONTINUATION, flags, b.stream);
            self.out.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
        }
    }

    fn header(&mut self, len: usize, kind: u8, flags: u8, stream: u32) {
        let l = u32::try_from(len).expect("frames written here are at most 16 KiB");
        self.out.extend_from_slice(&l.to_be_bytes()[1..]);
        self.out.extend_from_slice(&[kind, flags]);
        self.out.extend_from_slice(&stream.to_be_bytes());
    }
}

/// An `:authority` header that h2 would refuse.
fn refused_authority(name: &[u8], value: &[u8]) -> bool {
    name == b":authority" && http::uri::Authority::try_from(value).is_err()
}

fn decoder() -> Decoder<'static> {
    let mut d = Decoder::new();
    d.set_max_allowed_table_size(TABLE);
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = u32::try_from(payload.len()).unwrap().to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn request(enc: &mut Encoder<'static>, authority: &[u8], extra: usize) -> Vec<u8> {
        let pad = vec![b'x'; extra];
        enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/commd.v1.Local/Status"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"x-big", &pad[..]),
        ])
    }

    /// Parses the rewritten stream back: (preface ok, frames as (kind, flags, stream, payload)).
    fn frames(out: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert_eq!(&out[..24], PRE);
        let mut v = Vec::new();
        let mut p = &out[24..];
        while !p.is_empty() {
            let len = (usize::from(p[0]) << 16) | (usize::from(p[1]) << 8) | usize::from(p[2]);
            let s = u32::from_be_bytes([p[5], p[6], p[7], p[8]]);
            v.push((p[3], p[4], s, p[9..9 + len].to_vec()));
            p = &p[9 + len..];
        }
        v
    }

    fn feed_in_pieces(rw: &mut Rewriter, bytes: &[u8], piece: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for c in bytes.chunks(piece) {
            rw.feed(c).unwrap();
            out.extend(rw.take(usize::MAX));
        }
        out
    }

    #[test]
    fn a_percent_encoded_authority_becomes_localhost_in_every_block_of_the_connection() {
        let mut client = Encoder::new();
        let mut input = PRE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        let b1 = request(&mut client, b"tmp%2Fcommd.sock", 10);
        // The first block split over HEADERS (padded, with priority) and a CONTINUATION.
        let mut p1 = vec![3u8];
        p1.extend_from_slice(&[0, 0, 0, 0, 16]);
        p1.extend_from_slice(&b1[..5]);
        p1.extend_from_slice(&[0, 0, 0]);
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &p1));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, &b1[5..]));
        input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0")); // DATA
        // A second request on the same connection uses the client's dynamic table.
        let b2 = request(&mut client, b"tmp%2Fcommd.sock", 40000);
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &b2));
        for piece in [1, 7, 100, 1 << 20] {
            let mut rw = Rewriter::new();
            let out = feed_in_pieces(&mut rw, &input, piece);
            assert_eq!(rw.rewritten(), 2);
            let f = frames(&out);
            assert_eq!((f[0].0, f[0].3.len()), (0x4, 0), "SETTINGS passes");
            let mut server = decoder();
            // Block 1: one HEADERS frame with the priority kept and the padding dropped.
            assert_eq!(
                (f[1].0, f[1].1, f[1].2),
                (HEADERS, PRIORITY | END_HEADERS, 1)
            );
            assert_eq!(&f[1].3[..5], &[0, 0, 0, 0, 16]);
            let h1 = server.decode(&f[1].3[5..]).unwrap();
            assert!(
                h1.contains(&(b":authority".to_vec(), b"localhost".to_vec())),
                "{h1:?}"
            );
            assert!(h1.contains(&(b":path".to_vec(), b"/commd.v1.Local/Status".to_vec())));
            assert_eq!(
                (f[2].0, f[2].1, &f[2].3[..]),
                (0x0, END_STREAM, &b"\0\0\0\0\0"[..])
            );
            // Block 2 (40 KB of headers): HEADERS + CONTINUATIONs of at most 16 KiB.
            assert_eq!((f[3].0, f[3].1, f[3].2), (HEADERS, END_STREAM, 3));
            let mut block = f[3].3.clone();
            for c in &f[4..] {
                assert_eq!((c.0, c.2), (CONTINUATION, 3));
                assert!(c.3.len() <= OUT_FRAME);
                block.extend_from_slice(&c.3);
            }
            assert_eq!(f.last().unwrap().1, END_HEADERS);
            let h2 = server.decode(&block).unwrap();
            assert!(h2.contains(&(b":authority".to_vec(), b"localhost".to_vec())));
            assert!(h2.iter().any(|(n, v)| n == b"x-big" && v.len() == 40000));
        }
    }

    #[test]
    fn a_valid_authority_passes_byte_for_byte_and_the_rewriter_steps_aside() {
        let mut client = Encoder::new();
        let mut input = PRE.to_vec();
        input.extend(frame(0x4, 0, 0, &[]));
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &request(&mut client, b"localhost", 0),
        ));
        input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0"));
        let mut rw = Rewriter::new();
        let out = feed_in_pieces(&mut rw, &input, 5);
        assert_eq!(out, input);
        assert!(rw.done() && rw.rewritten() == 0);
    }

    #[test]
    fn a_stream_that_is_not_http2_is_refused() {
        let mut bad = PRE.to_vec();
        bad.extend(frame(CONTINUATION, END_HEADERS, 1, b"x"));
        assert!(Rewriter::new().feed(&bad).is_err());
        let mut huge = PRE.to_vec();
        huge.extend(frame(HEADERS, 0, 1, &[0x40]));
        for _ in 0..70 {
            huge.extend(frame(CONTINUATION, 0, 1, &vec![b'a'; 16000]));
        }
        assert!(Rewriter::new().feed(&huge).is_err());
        let mut garbage = PRE.to_vec();
        garbage.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff]));
        assert!(Rewriter::new().feed(&garbage).is_err());
    }
}

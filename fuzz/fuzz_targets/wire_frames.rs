//! Daemon-to-daemon wire frames (TCP, from a peer node): a real `Wire` with one peer whose
//! receive stream carries the fuzzer's bytes, a receive of 4 KiB posted, pumped until the peer's
//! bytes end or the wire reports an error. Never a panic, never a write outside the posted
//! buffer, never an allocation the frame's claims alone can make huge.
#![no_main]

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use commd_daemon::net::link::Link;
use commd_daemon::net::wire::{PeerLinks, Sig, Tag, Wire};
use libfuzzer_sys::fuzz_target;

fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

fuzz_target!(|data: &[u8]| {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let (mut feed, rx) = pair(&l);
    let (tx, _sink) = pair(&l);
    let wake = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    let links = vec![
        None,
        Some(PeerLinks {
            tx: vec![Link::Tcp(tx)],
            rx: vec![Link::Tcp(rx)],
        }),
    ];
    let mut w = Wire::new(0, links, 1 << 16, Duration::from_secs(5), wake).unwrap();
    let mut buf = vec![0u8; 4096 + 64];
    let fmt: fn(&Sig) -> String = |s| format!("{s:?}");
    for (i, a) in [0u64, 1].into_iter().enumerate() {
        let tag = Tag {
            class: i as u8,
            a,
            b: 0,
        };
        // SAFETY: the posted range is inside `buf`, which outlives the wire (dropped below).
        let _ = unsafe { w.recv(1, tag, None, buf.as_mut_ptr(), 4096, fmt) };
    }
    let _ = feed.write_all(data);
    drop(feed);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(200) {
        if w.pump(Some(Instant::now() + Duration::from_millis(2)), fmt)
            .is_err()
        {
            break;
        }
    }
    drop(w);
    assert!(
        buf[4096..].iter().all(|&b| b == 0),
        "write past the posted receive"
    );
});

//! SwitchML packets (UDP, from anyone who can reach the switch's data port): the header parser
//! and the aggregation pool of the software switch never panic on any sequence of packets from
//! any workers. Input: [worker byte, length byte, packet bytes]...
#![no_main]

use commd_switch::agg::Pool;
use commd_switch::packet::{Header, get_values};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut pool = Pool::new(3, 256, 64);
    let mut rest = data;
    while rest.len() >= 2 {
        let w = u32::from(rest[0] % 4); // worker 3 is out of range on purpose
        let n = usize::from(rest[1]) * 8;
        rest = &rest[2..];
        let pkt = &rest[..n.min(rest.len())];
        rest = &rest[pkt.len()..];
        if let Ok(h) = Header::parse(pkt) {
            let mut vals = [0i32; 256];
            get_values(
                &pkt[commd_switch::packet::HEADER_BYTES..],
                &mut vals,
            );
            // The server's own checks before the pool (server.rs): a known worker, a packet
            // that fits the session's pool.
            if w < pool.workers() && pool.fits(&h) {
                let _ = pool.on_packet(w, &h, pkt);
            }
        }
    }
});

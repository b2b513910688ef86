//! Control-plane request bodies (gRPC, protobuf): from local clients over the Unix socket and
//! from other daemons over TCP. Each is decoded as prost decodes it in tonic, then run through
//! the daemon's checks that need no session: unique ids (carried in CreateCommunicator and
//! named by every join), and the addresses a joining daemon announces. Never a panic; a unique
//! id that decodes encodes back to the same bytes' meaning.
#![no_main]

use commd_proto::pb;
use commd_proto::uid::UniqueId;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let (which, body) = match data.split_first() {
        Some((w, b)) => (*w, b),
        None => return,
    };
    match which % 6 {
        0 => {
            if let Ok(r) = pb::CreateCommunicatorRequest::decode(body) {
                uid_checks(&r.unique_id);
            }
        }
        1 => {
            if let Ok(r) = pb::PeerJoinRequest::decode(body) {
                let from = "10.1.2.3:4000".parse().ok();
                let _ = commd_daemon::peer::announced_from(&r, from);
                let _ = commd_daemon::ranks::list(&[r.rank, r.nranks]);
            }
        }
        2 => {
            let _ = pb::RegisterCudaMemoryRequest::decode(body);
        }
        3 => {
            let _ = pb::MapCudaPiecesRequest::decode(body);
        }
        4 => {
            let _ = pb::HelloRequest::decode(body);
        }
        _ => uid_checks(body),
    }
});

fn uid_checks(b: &[u8]) {
    if let Ok(u) = UniqueId::decode(b) {
        let again = UniqueId::decode(&u.encode()).expect("an encoded unique id decodes");
        assert_eq!(again.token, u.token);
        assert_eq!(again.root, u.root);
        let _ = u.short();
    }
}

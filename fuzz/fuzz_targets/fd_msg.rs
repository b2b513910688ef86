//! fd-socket messages (SOCK_SEQPACKET, from any local process): decoding never panics, and
//! whatever decodes encodes back to a message that decodes to the same fields (the text may be
//! re-truncated at a character boundary, so it is not compared).
#![no_main]

use commd_proto::fdproto::FdMsg;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(m) = FdMsg::decode(data) else { return };
    let again = FdMsg::decode(&m.encode()).expect("an encoded message decodes");
    assert_eq!(again.kind, m.kind);
    assert_eq!(again.session_id, m.session_id);
    assert_eq!(again.token, m.token);
    assert_eq!(again.arg, m.arg);
});

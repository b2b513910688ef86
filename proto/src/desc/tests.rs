use super::*;
use proptest::prelude::*;

fn arb_desc() -> impl Strategy<Value = SubmitDesc> {
    (
        any::<[u64; 6]>(),
        any::<(u16, u8, u8, u32, u32, u32, u32, u32)>(),
    )
        .prop_map(|(w, (op, dt, ro, fl, cm, pe, sm, rm))| SubmitDesc {
            user_data: w[0],
            opcode: op % 12,
            dtype: dt % 10,
            redop: ro % 10,
            flags: if fl % 4 == 0 { fl } else { fl & 31 },
            comm: cm,
            peer: pe,
            count: if w[1] % 3 == 0 { w[1] } else { w[1] % 4096 },
            send_mem: sm,
            recv_mem: rm,
            send_off: w[2],
            recv_off: w[3],
            ticket: if w[4] % 4 == 0 { w[5] } else { w[5] % 3 },
        })
}

#[test]
fn cuda_shape_covers_the_op_and_alternates_scratch_buffers() {
    let slot = 1 << 20;
    for (kind, one_shot) in [
        (OpKind::AllReduce, false),
        (OpKind::AllReduce, true),
        (OpKind::ReduceScatter, false),
        (OpKind::Reduce, false),
    ] {
        for n in [2u32, 3, 4, 8] {
            for count in [0u64, 1, 1000, 262_144, 262_145, 3 << 20, 10_000_001] {
                if one_shot && !cuda_one_shot_fits(kind, count, 4, slot) {
                    continue;
                }
                let s = cuda_shape(kind, count, 4, n, slot, one_shot);
                assert!(s.rounds >= 1 && s.phases == s.rounds + 1, "{kind:?} {s:?}");
                assert!(
                    s.rounds * s.round_elems >= count,
                    "{kind:?} n={n} {count}: {s:?}"
                );
                assert!((s.rounds - 1) * s.round_elems < count.max(1), "{s:?}");
                // A rank's part of a round fits one slot.
                let part = match kind {
                    OpKind::AllReduce if !one_shot => s.round_elems.div_ceil(u64::from(n)),
                    _ => s.round_elems.min(count),
                };
                assert!(part * 4 <= slot, "{kind:?} n={n} {count}: {s:?}");
            }
        }
    }
    assert_eq!(
        cuda_shape(OpKind::AllGather, 5, 4, 4, slot, false).phases,
        1
    );
    // Two buffers of n - 1 slots; consecutive rounds never share a slot.
    let n = 4;
    assert_eq!(cuda_scratch_bytes(n, slot), 6 * slot);
    let offs: Vec<u64> = (0..2)
        .flat_map(|j| (0..3).map(move |k| cuda_scratch_off(j, k, n, slot)))
        .collect();
    for (i, a) in offs.iter().enumerate() {
        assert!(a + slot <= cuda_scratch_bytes(n, slot));
        for b in &offs[i + 1..] {
            assert!(a.abs_diff(*b) >= slot, "{offs:?}");
        }
    }
    assert_eq!(
        cuda_scratch_off(2, 1, n, slot),
        cuda_scratch_off(0, 1, n, slot)
    );
    assert!(!cuda_one_shot_fits(OpKind::ReduceScatter, 1, 4, slot));
    assert!(!cuda_one_shot_fits(
        OpKind::AllReduce,
        (slot / 4) + 1,
        4,
        slot
    ));
}

#[test]
fn one_shot_flag_only_on_gpu_all_reduce() {
    let mut d = SubmitDesc {
        opcode: opcode::ALL_REDUCE,
        dtype: dtype::F32,
        redop: redop::SUM,
        flags: flags::CUDA | flags::ONE_SHOT,
        count: 4,
        ..Default::default()
    };
    assert!(d.decode().unwrap().one_shot);
    d.flags = flags::ONE_SHOT;
    assert!(matches!(d.decode(), Err(DescError::OneShot(_))));
    d.flags = flags::CUDA | flags::ONE_SHOT;
    d.opcode = opcode::REDUCE_SCATTER;
    assert!(matches!(d.decode(), Err(DescError::OneShot(_))));
}

#[test]
fn host_staged_flag_only_on_gpu_ops_without_one_shot() {
    let mut d = SubmitDesc {
        opcode: opcode::ALL_GATHER,
        dtype: dtype::BF16,
        flags: flags::CUDA | flags::HOST_STAGED,
        count: 7,
        ..Default::default()
    };
    let op = d.decode().unwrap();
    assert!(op.staged && !op.one_shot);
    d.flags = flags::HOST_STAGED;
    assert!(matches!(d.decode(), Err(DescError::Staged)));
    d.opcode = opcode::ALL_REDUCE;
    d.redop = redop::SUM;
    d.flags = flags::CUDA | flags::HOST_STAGED | flags::ONE_SHOT;
    assert!(matches!(d.decode(), Err(DescError::Staged)));
    d.flags = flags::CUDA;
    assert!(!d.decode().unwrap().staged);
}

#[test]
fn persistent_flag_only_on_gpu_ops_with_a_graph_slot() {
    let mut d = SubmitDesc {
        opcode: opcode::ALL_REDUCE,
        dtype: dtype::F32,
        redop: redop::SUM,
        flags: flags::CUDA | flags::PERSISTENT,
        count: 7,
        ticket: u64::from(graph_doorbell::SLOTS - 1),
        ..Default::default()
    };
    let op = d.decode().unwrap();
    assert!(op.persistent);
    assert_eq!(op.cuda_ticket, Some(graph_doorbell::SLOTS - 1));
    d.ticket = (9 << 32) | 5;
    let op = d.decode().unwrap();
    assert_eq!((op.cuda_ticket, op.graph_tag), (Some(5), 9));
    d.ticket = u64::from(graph_doorbell::SLOTS);
    assert!(matches!(d.decode(), Err(DescError::Persistent)));
    d.ticket = 0;
    d.flags = flags::PERSISTENT;
    assert!(matches!(d.decode(), Err(DescError::Persistent)));
    d.flags = flags::CUDA | flags::PERSISTENT | flags::HOST_STAGED;
    assert!(matches!(d.decode(), Err(DescError::Persistent)));
    d.flags = flags::CUDA;
    assert!(!d.decode().unwrap().persistent);
}

#[test]
fn any_source_flag_only_on_host_recv_with_peer_zero() {
    let mut d = SubmitDesc {
        opcode: opcode::RECV,
        dtype: dtype::F32,
        flags: flags::ANY_SOURCE,
        count: 4,
        ..Default::default()
    };
    assert!(d.decode().unwrap().any_source);
    d.peer = 1;
    assert!(matches!(d.decode(), Err(DescError::AnySource(_))));
    d.peer = 0;
    d.opcode = opcode::SEND;
    assert!(matches!(d.decode(), Err(DescError::AnySource(_))));
    d.opcode = opcode::RECV;
    d.flags = flags::ANY_SOURCE | flags::CUDA;
    assert!(matches!(d.decode(), Err(DescError::AnySource(_))));
    d.flags = 0;
    assert!(!d.decode().unwrap().any_source);
}

proptest! {
    #[test]
    fn decode_never_panics_and_accepts_only_valid(d in arb_desc()) {
        if let Ok(op) = d.decode() {
            prop_assert!(OpKind::from_code(d.opcode).is_some());
            prop_assert!(DType::from_code(d.dtype).is_some());
            prop_assert!(d.count <= MAX_COUNT);
            prop_assert_eq!(d.flags & !flags::KNOWN, 0);
            let cuda = d.flags & flags::CUDA != 0;
            prop_assert_eq!(op.one_shot, d.flags & flags::ONE_SHOT != 0);
            prop_assert!(!op.one_shot || (cuda && op.kind == OpKind::AllReduce));
            prop_assert_eq!(op.staged, d.flags & flags::HOST_STAGED != 0);
            prop_assert!(!op.staged || (cuda && !op.one_shot));
            prop_assert_eq!(op.persistent, d.flags & flags::PERSISTENT != 0);
            prop_assert_eq!(op.any_source, d.flags & flags::ANY_SOURCE != 0);
            prop_assert!(!op.any_source || (!cuda && op.kind == OpKind::Recv && op.peer == 0));
            prop_assert!(!op.persistent || (cuda && !op.staged && low_half(d.ticket) < graph_doorbell::SLOTS));
            let ticket_ok = if op.persistent { true } else if cuda { d.ticket <= u64::from(u32::MAX) } else { d.ticket == 0 };
            prop_assert!(ticket_ok);
            prop_assert_eq!(op.cuda_ticket.map(u64::from), cuda.then_some(d.ticket & u64::from(u32::MAX)));
            prop_assert_eq!(op.redop.is_some(), op.kind.reduces());
            let float_bitwise = op.dtype.is_float() && op.redop.is_some_and(RedOp::is_bitwise);
            prop_assert_eq!(op.check().is_err(), float_bitwise);
        }
    }

    #[test]
    fn decode_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 64)) {
        let mut d = SubmitDesc::default();
        // SAFETY: SubmitDesc is repr(C) made only of integers, so every 64-byte pattern is valid.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (&mut d as *mut SubmitDesc).cast::<u8>(), 64) };
        let _ = d.decode();
    }

    #[test]
    fn range_check_matches_wide_arithmetic(off in any::<u64>(), bytes in any::<u64>(), len in any::<u64>()) {
        let wide = off as u128 + bytes as u128 <= len as u128;
        prop_assert_eq!(range_in_bounds(off, bytes, len), wide);
    }
}

#[test]
fn codes_round_trip() {
    for o in ALL_OPS {
        assert_eq!(OpKind::from_code(o.code()), Some(o));
        assert_eq!(OpKind::parse(o.name()), Some(o));
    }
    for d in ALL_DTYPES {
        assert_eq!(DType::from_code(d.code()), Some(d));
        assert_eq!(DType::parse(d.name()), Some(d));
    }
    for r in ALL_REDOPS {
        assert_eq!(RedOp::from_code(r.code()), Some(r));
        assert_eq!(RedOp::parse(r.name()), Some(r));
    }
    assert_eq!(OpKind::from_code(0), None);
    assert_eq!(DType::from_code(13), None);
    assert_eq!(RedOp::from_code(0), None);
    assert_eq!(RedOp::from_code(9), None);
    assert_eq!(
        [redop::BAND, redop::BOR, redop::BXOR].map(RedOp::from_code),
        [Some(RedOp::Band), Some(RedOp::Bor), Some(RedOp::Bxor)]
    );
    assert_eq!(
        [RedOp::Band, RedOp::Bor, RedOp::Bxor].map(RedOp::name),
        ["band", "bor", "bxor"]
    );
}

#[test]
fn bitwise_redops_are_for_integer_dtypes_only() {
    for r in ALL_REDOPS {
        for d in ALL_DTYPES {
            let op = SubmitDesc {
                opcode: opcode::ALL_REDUCE,
                dtype: d.code(),
                redop: r.code(),
                ..Default::default()
            }
            .decode()
            .expect("every redop and dtype code decodes");
            let want_err = r.is_bitwise() && d.is_float();
            assert_eq!(op.check().is_err(), want_err, "{r:?} {d:?}");
            assert_eq!(r.check_dtype(d).is_err(), want_err, "{r:?} {d:?}");
        }
    }
    assert!(!RedOp::Sum.is_bitwise() && !RedOp::Avg.is_bitwise());
    let e = RedOp::Bxor.check_dtype(DType::F32).unwrap_err();
    assert_eq!(
        e.to_string(),
        "bitwise reduction bxor is defined for integer dtypes only (got f32)"
    );
    let e = RedOp::Band.check_dtype(DType::BF16).unwrap_err();
    assert_eq!(
        e.to_string(),
        "bitwise reduction band is defined for integer dtypes only (got bf16)"
    );
}

#[test]
fn rejects_redop_on_non_reducing_op() {
    let d = SubmitDesc {
        opcode: opcode::BROADCAST,
        dtype: dtype::F32,
        redop: redop::SUM,
        ..Default::default()
    };
    assert_eq!(
        d.decode(),
        Err(DescError::UnexpectedRedop(redop::SUM, "broadcast"))
    );
    let d = SubmitDesc {
        opcode: opcode::ALL_REDUCE,
        dtype: dtype::F32,
        redop: 0,
        ..Default::default()
    };
    assert!(matches!(d.decode(), Err(DescError::Redop(0, "all_reduce"))));
}

#[test]
fn buffer_sizes_follow_nccl() {
    assert_eq!(OpKind::AllGather.send_elems(5, 3), Some(5));
    assert_eq!(OpKind::AllGather.recv_elems(5, 3), Some(15));
    assert_eq!(OpKind::ReduceScatter.send_elems(5, 3), Some(15));
    assert_eq!(OpKind::ReduceScatter.recv_elems(5, 3), Some(5));
    assert_eq!(OpKind::AllToAll.recv_elems(5, 3), Some(15));
    assert_eq!(OpKind::AllToAll.send_elems(u64::MAX, 3), None);
}

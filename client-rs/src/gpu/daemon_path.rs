//! A GPU op on the daemon's path, in the order its phases run: its buffers bound to
//! registrations, its plan (staging across nodes, scratch, one-shot or rounds, the reduction
//! kernel compiled), the caller's stream ordered after the op's inputs and the communicator's
//! previous op, its doorbell words (an eager ticket, or a captured op's graph slot), the wait
//! mode, the daemon marks, the descriptor posted, then the stream work: ready writes, waits
//! for done, and the reduction kernels between them (docs/contracts.md #4).
//!
//! Everything that can fail is done before the descriptor is posted. After it, a failure to
//! enqueue is returned, but the phases still end as far as they can (the daemon's op timeout
//! catches a stream that never runs).

#![allow(unsafe_code)] // stream writes, waits and kernel launches through the CUDA driver

use std::sync::Arc;

use commd_proto::desc::{CudaShape, OpKind, SubmitDesc, doorbell, flags};

use super::cu::{self, ck, sys};
use super::{
    CommGpu, CudaEvent, CudaOpArgs, CudaPosted, Scratch, SessionGpu, algo, ensure_context, graph,
    kernels, wait,
};
use commd_proto::pb;

use super::device_uuid;
use crate::{Communicator, Error, Request, Result, lock};

/// The op's buffers as registrations of the daemon, and the eager doorbell's words.
struct Bound {
    /// (mem id, offset) of the send and receive buffers; (0, 0) when the op uses none.
    send: (u32, u64),
    recv: (u32, u64),
    /// The device of the op's buffers (none: a rank that sends or receives nothing).
    device: Option<i32>,
    /// Device addresses of the communicator's ready and done words.
    ready: sys::CUdeviceptr,
    done: sys::CUdeviceptr,
}

/// What the daemon and this rank's stream do for the op, decided before anything is queued.
struct Plan {
    /// Across nodes: the daemons reduce in host memory (one phase, no scratch, no kernel).
    staged: bool,
    kernel_reduces: bool,
    scratch: Option<Scratch>,
    slot_bytes: u64,
    one_shot: bool,
    shape: CudaShape,
    /// `shape.phases` and `shape.rounds`, which the stream counts in u32 tickets.
    phases: u32,
    rounds: u32,
    /// The graph doorbell area (captured ops).
    gdev: Option<sys::CUdeviceptr>,
}

/// The stream's order: the op's device, and the events recorded after it.
struct Order {
    dev: i32,
    /// Recorded after the op's stream work: the communicator's next op on another stream waits
    /// for it.
    order_ev: Option<CudaEvent>,
    /// The caller's event after the op (`CudaOpArgs::record`).
    done_ev: Option<CudaEvent>,
}

/// The doorbell words the op's phases use.
#[derive(Clone, Copy)]
struct Words {
    /// A captured op's graph slot, its graph area and its capture id.
    graph_slot: Option<(u32, sys::CUdeviceptr, u64)>,
    ticket: u32,
    ready: sys::CUdeviceptr,
    done: sys::CUdeviceptr,
}

/// How the stream waits for done, and whether the rounds of a reduction run in one launch.
struct Waits {
    /// The size that picks how the stream waits (`wait::auto_bytes`), not the data moved.
    op_bytes: u64,
    /// The rounds kernel's barrier, its block cap and whether it launches cooperatively.
    fused: Option<(sys::CUdeviceptr, u32, bool)>,
}

/// The tag of capture `id` in a persistent op's ticket (`flags::PERSISTENT`): never 0.
// Truncation is the point: the tag only tells one graph's ops from another's, and the low 32
// bits of the driver's capture ids (sequential per process) do.
#[allow(clippy::cast_possible_truncation)]
fn capture_tag(id: u64) -> u32 {
    (id as u32).max(1)
}

/// Queues `ready = v` on `s`.
fn write_ready(s: sys::CUstream, ready: sys::CUdeviceptr, v: u32) -> Result<()> {
    ck(
        // SAFETY: `ready` is a device-mapped address of the registered doorbell page (or the
        // graph area); `s` is the op's stream, validated before the descriptor was built.
        unsafe { sys::cuStreamWriteValue32_v2(s, ready, v, 0) },
        "cuStreamWriteValue32",
    )?;
    Ok(())
}

impl Communicator {
    /// Posts `a` on the daemon's path (`cap`: the capture its stream is in).
    ///
    /// # Safety
    /// As [`Communicator::post_cuda_ordered`].
    pub(super) unsafe fn post_daemon(
        &self,
        a: &CudaOpArgs,
        cap: Option<graph::Capture>,
    ) -> Result<CudaPosted> {
        let i = &self.client;
        let mut c = lock(&self.gpu);
        let mut g = lock(&i.gpu);
        let bound = self.bind(a, &mut g)?;
        let plan = self.plan(a, cap.is_some(), bound.device, &mut c, &mut g)?;
        // SAFETY: the caller's contract (live streams).
        let order = unsafe { self.order(a, cap.is_none(), bound.device, &mut c, &g)? };
        let words = self.words(a, cap, &bound, &plan, &c, &mut g)?;
        let d = self.descriptor(a, &bound, &plan, &words);
        let waits = self.waits(a, &plan, &words, &mut c)?;
        let s = a.stream;
        // Resolved once for the op's waits (a reduction waits rounds + 1 times).
        // SAFETY: `s` was validated by `order`.
        let waiter = unsafe { wait::Waiter::new(s, waits.op_bytes)? };
        // SAFETY: the caller's contract; `s` is of the op's device, current.
        unsafe {
            self.leave_marks(
                a,
                cap.is_none(),
                plan.staged,
                bound.device,
                order.dev,
                &mut c,
            )?
        };
        // A captured op's slot, once posted, is released only with its graph (the daemon may
        // hold it); posting can only fail before the daemon sees it.
        let user_data = i.post(d)?;
        let phases = plan.phases;
        if words.graph_slot.is_none() {
            c.next_ticket = words.ticket.wrapping_add(phases);
        }
        let req = Request::new(i.clone(), user_data, None, None);
        let kernels = g.kernels.as_ref();
        let Order {
            dev,
            order_ev,
            done_ev,
        } = order;
        // SAFETY: the caller's contract; everything named was set up above for `s`.
        let enq = unsafe {
            self.enqueue(a, &plan, &words, &waits, &waiter, kernels, &mut c)
                .and_then(|()| finish_order(s, order_ev, done_ev.as_ref(), &mut c))
        };
        enq.map(|()| CudaPosted {
            request: req,
            done: done_ev.map(Arc::new),
            device: dev,
            last_ticket: words.ticket.wrapping_add(phases).wrapping_sub(1),
            bytes: waits.op_bytes,
            captured: words.graph_slot.is_some(),
        })
    }

    /// The op's buffers resolved to registrations (one pointer query per buffer: allocation,
    /// registration and device), the device's context made current, and the eager doorbell's
    /// words.
    fn bind(&self, a: &CudaOpArgs, g: &mut SessionGpu) -> Result<Bound> {
        let i = &self.client;
        let n = u64::from(self.nranks);
        let es = a.dtype.size();
        let me_root = a.peer == self.rank;
        let bytes = |e: Option<u64>| {
            e.and_then(|e| e.checked_mul(es))
                .ok_or_else(|| Error::InvalidArgument(format!("count {} overflows", a.count)))
        };
        let mut device = None;
        let mut resolve = |what: &str, p: Option<u64>, elems: Option<u64>| -> Result<(u32, u64)> {
            let p = p.ok_or_else(|| {
                Error::InvalidArgument(format!("{} needs a {what} buffer", a.kind.name()))
            })?;
            let (m, o, d) = i.cuda_resolve(g, p, bytes(elems)?)?;
            device.get_or_insert(d);
            Ok((m, o))
        };
        let mut send = (0, 0);
        let mut recv = (0, 0);
        if a.kind.uses_send(me_root) {
            send = resolve("send", a.send, a.kind.send_elems(a.count, n))?;
        }
        if a.kind.uses_recv(me_root) {
            recv = resolve("recv", a.recv, a.kind.recv_elems(a.count, n))?;
        }
        if let Some(d) = device {
            ensure_context(d)?;
        }
        let db = i.doorbell_dev(g)?;
        let slot = u64::from(self.doorbell_slot);
        Ok(Bound {
            send,
            recv,
            device,
            ready: db + doorbell::READY_OFF + 4 * slot,
            done: db + doorbell::DONE_OFF + 4 * slot,
        })
    }

    /// The op's plan: staged across nodes or reduced by this rank's kernel in the daemon's
    /// scratch, one-shot or in rounds (`commd_proto::desc::cuda_shape`), with the kernel
    /// compiled and loaded now, so that a compile error fails the call before anything is
    /// posted.
    fn plan(
        &self,
        a: &CudaOpArgs,
        captured: bool,
        device: Option<i32>,
        c: &mut CommGpu,
        g: &mut SessionGpu,
    ) -> Result<Plan> {
        let es = a.dtype.size();
        let staged = self.nodes > 1;
        if staged && captured {
            return Err(Error::Unsupported(format!(
                "{}: capturing GPU ops into CUDA graphs is not supported yet on a communicator that spans nodes (its ops are staged through the daemons' host memory). The op was refused (nothing was enqueued or posted)",
                a.kind.name()
            )));
        }
        let kernel_reduces = a.kind.reduces() && !staged;
        let scratch = if kernel_reduces {
            Some(self.scratch(c, g, device.unwrap_or(0))?)
        } else {
            None
        };
        if kernel_reduces && self.nranks > 8 {
            return Err(Error::InvalidArgument(format!(
                "GPU reductions support up to 8 ranks per communicator (this one has {})",
                self.nranks
            )));
        }
        let slot_bytes = scratch.map(|s| s.slot_bytes).unwrap_or(1 << 20);
        let one_shot = !staged && algo::one_shot(a.kind, a.count, es, self.nranks, slot_bytes)?;
        let shape = if staged {
            CudaShape {
                rounds: 1,
                round_elems: a.count,
                phases: 1,
            }
        } else {
            commd_proto::desc::cuda_shape(a.kind, a.count, es, self.nranks, slot_bytes, one_shot)
        };
        let (Ok(phases), Ok(rounds)) = (u32::try_from(shape.phases), u32::try_from(shape.rounds))
        else {
            return Err(Error::InvalidArgument(format!(
                "{}: {} elements take {} doorbell phases with scratch slots of {slot_bytes} bytes, more than a u32 ticket counts. The op was refused (nothing was enqueued or posted)",
                a.kind.name(),
                a.count,
                shape.phases
            )));
        };
        let gdev = match captured {
            true => Some(self.client.graph_dev(g)?),
            false => None,
        };
        if kernel_reduces {
            let k = g.kernels.get_or_insert_with(kernels::Kernels::new);
            if let Some(op) = a.redop {
                k.prepare(a.dtype, op)?;
            }
        }
        Ok(Plan {
            staged,
            kernel_reduces,
            scratch,
            slot_bytes,
            one_shot,
            shape,
            phases,
            rounds,
            gdev,
        })
    }

    /// Orders the op's stream: validated once per stream, after the work queued on `after`,
    /// and after the communicator's previous eager op when that ran on another stream; and
    /// takes the events recorded after the op.
    ///
    /// # Safety
    /// `a.stream` and `a.after` must be live streams of this process.
    unsafe fn order(
        &self,
        a: &CudaOpArgs,
        eager: bool,
        device: Option<i32>,
        c: &mut CommGpu,
        g: &SessionGpu,
    ) -> Result<Order> {
        // An invalid stream fails here, before the op is posted (checked once per stream: a
        // communicator's ops normally all use one communication stream).
        if eager && c.checked_stream != Some(a.stream as usize) {
            // SAFETY: cuStreamQuery only reads the handle; the driver validates it.
            let q = unsafe { sys::cuStreamQuery(a.stream) };
            if q != sys::CUresult::CUDA_SUCCESS && q != sys::CUresult::CUDA_ERROR_NOT_READY {
                ck(q, "cuStreamQuery(stream of the op)")?;
            }
            c.checked_stream = Some(a.stream as usize);
        }
        let dev = match device {
            Some(d) => d,
            None if a.after.is_some() || a.record => {
                return Err(Error::InvalidArgument(format!(
                    "{} on this rank has no GPU buffer, so no device to order its stream on",
                    a.kind.name()
                )));
            }
            None => 0,
        };
        let pool = g.events.clone();
        // SAFETY: the caller's contract; `a.stream` was validated above.
        unsafe { super::order::wait_after(&pool, dev, a)? };
        // A communicator's eager ops share one ready counter (docs/contracts.md #4), which only
        // works if the ops' ready writes land in ticket order. Ops of one communicator on
        // several streams (FSDP's all-gathers on its unshard stream and reduce-scatters on its
        // post-backward stream, blocking collectives on the current stream beside async ones
        // on the communication stream) would race: a later op's write could land first and an
        // earlier op's then lower the counter, so the daemon would see an op ready before its
        // stream reached it, and the next op never. So an op on another stream than the
        // previous op's waits (on the GPU) for the previous op's stream work, in issue order
        // across streams as NCCL orders a communicator's ops.
        if eager
            && let Some((ls, ev)) = &c.last
            && *ls != a.stream as usize
        {
            // SAFETY: `a.stream` was validated above; the event is live (owned by `c`).
            unsafe { ev.wait_on(a.stream)? };
        }
        let order_ev = if eager && device.is_some() {
            Some(pool.get(dev)?)
        } else {
            None
        };
        let done_ev = if a.record && !(a.defer_wait && a.kind.is_p2p()) {
            Some(pool.get(dev)?)
        } else {
            None
        };
        Ok(Order {
            dev,
            order_ev,
            done_ev,
        })
    }

    /// The op's doorbell words. Eager: tickets of the communicator's doorbell. Captured: the
    /// op's own graph doorbell slot with constant values from 1 (`commd_proto::graph`), tied to
    /// the graph's life.
    fn words(
        &self,
        a: &CudaOpArgs,
        cap: Option<graph::Capture>,
        bound: &Bound,
        plan: &Plan,
        c: &CommGpu,
        g: &mut SessionGpu,
    ) -> Result<Words> {
        let _ = a;
        let graph_slot = match (cap, plan.gdev) {
            (Some(cp), Some(gd)) => {
                let slot = g.graphs.alloc(&self.client, self.handle)?;
                // SAFETY: `cp.graph` is the graph being captured.
                if let Err(e) = unsafe { graph::retain_slot(cp.graph, &g.graphs.released, slot) } {
                    g.graphs.unalloc(slot);
                    return Err(e);
                }
                Some((slot, gd, cp.id))
            }
            _ => None,
        };
        Ok(match graph_slot {
            Some((slot, gd, _)) => Words {
                graph_slot,
                ticket: commd_proto::graph::phase_value(0),
                ready: gd + commd_proto::desc::graph_doorbell::READY_OFF + 4 * u64::from(slot),
                done: gd + commd_proto::desc::graph_doorbell::DONE_OFF + 4 * u64::from(slot),
            },
            None => Words {
                graph_slot,
                ticket: c.next_ticket,
                ready: bound.ready,
                done: bound.done,
            },
        })
    }

    /// The op's descriptor for the daemon.
    fn descriptor(&self, a: &CudaOpArgs, bound: &Bound, plan: &Plan, words: &Words) -> SubmitDesc {
        SubmitDesc {
            user_data: 0,
            opcode: a.kind.code(),
            dtype: a.dtype.code(),
            redop: a.redop.map(|r| r.code()).unwrap_or(0),
            flags: flags::CUDA
                | if plan.one_shot { flags::ONE_SHOT } else { 0 }
                | if plan.staged { flags::HOST_STAGED } else { 0 }
                | if words.graph_slot.is_some() {
                    flags::PERSISTENT
                } else {
                    0
                },
            comm: self.handle,
            peer: a.peer,
            count: a.count,
            send_mem: bound.send.0,
            recv_mem: bound.recv.0,
            send_off: bound.send.1,
            recv_off: bound.recv.1,
            // A captured op: its slot, and its capture as the tag (`flags::PERSISTENT`).
            ticket: match words.graph_slot {
                Some((slot, _, id)) => u64::from(slot) | (u64::from(capture_tag(id)) << 32),
                None => u64::from(words.ticket),
            },
        }
    }

    /// How the stream waits for done, and whether a reduction's rounds run in one launch.
    fn waits(&self, a: &CudaOpArgs, plan: &Plan, words: &Words, c: &mut CommGpu) -> Result<Waits> {
        let es = a.dtype.size();
        let me_root = a.peer == self.rank;
        // Ranks sharing this GPU (the daemon's hint, set once every rank bound its scratch):
        // 0, the memory op under `auto`, since a polling kernel would be time-sliced against
        // the daemon's same-GPU copy kernels.
        let hint = self
            .client
            .ring
            .doorbell_hint(self.doorbell_slot)
            .map_or(0, |h| h.load(std::sync::atomic::Ordering::Acquire));
        let shared_gpu = hint & doorbell::HINT_SHARED_GPU != 0;
        let own_gpu = hint & doorbell::HINT_OWN_GPU != 0 && !shared_gpu;
        let op_bytes = if shared_gpu {
            0
        } else {
            wait::auto_bytes(a.kind, a.count.saturating_mul(es))
        };
        // An eager reduction of several rounds, where this rank reduces every round: one launch
        // of the rounds kernel for all of them (`kernels::rounds`), so a GEMM holding the SMs
        // delays the op once, not once per round. Only once the daemon has said that this
        // rank's GPU is its own (`HINT_OWN_GPU`): ranks sharing a GPU would time-slice against
        // a kernel that waits inside, or under MPS keep each other's kernels from starting.
        let wants_fused = plan.kernel_reduces
            && plan.scratch.is_some()
            && words.graph_slot.is_none()
            && plan.shape.rounds >= 2
            && own_gpu
            && (me_root || a.kind != OpKind::Reduce);
        let fused = match wants_fused {
            true => {
                let f = algo::fused()?;
                match f.on {
                    true => Some((
                        self.rounds_barrier(c, a.stream)?,
                        f.max_blocks,
                        f.cooperative,
                    )),
                    false => None,
                }
            }
            false => None,
        };
        Ok(Waits { op_bytes, fused })
    }

    /// The rounds kernel's grid barrier on the communicator's GPU (allocated and zeroed on `s`
    /// at its first use, kept for the process's life).
    fn rounds_barrier(&self, c: &mut CommGpu, s: sys::CUstream) -> Result<sys::CUdeviceptr> {
        if let Some(b) = c.rounds_bar {
            return Ok(b);
        }
        let mut b: sys::CUdeviceptr = 0;
        ck(
            // SAFETY: the op's context is current (`bind`); `b` is a valid out pointer.
            unsafe { sys::cuMemAlloc_v2(&mut b, 16) },
            "cuMemAlloc(rounds barrier)",
        )?;
        ck(
            // SAFETY: `b` was just allocated with 16 bytes; `s` is the op's stream, validated
            // by `order`, so the kernel runs after the memset.
            unsafe { sys::cuMemsetD32Async(b, 0, 4, s) },
            "cuMemsetD32Async(rounds barrier)",
        )?;
        c.rounds_bar = Some(b);
        Ok(b)
    }

    /// The daemon marks an eager op on the daemon's path leaves for the communicator's direct
    /// ops: a collective's (`Communicator::mark_daemon_op`), so that a peer that runs it as a
    /// direct op is told at once; a send/recv's, counted for its pair's later direct ops (their
    /// signature carries it: a receive whose peer put another number of messages there first
    /// fails as a mismatch), so that the peer's direct op waiting for its counterpart fails at
    /// once.
    ///
    /// # Safety
    /// `a.stream` must be a live stream of device `dev`, whose context is current.
    unsafe fn leave_marks(
        &self,
        a: &CudaOpArgs,
        eager: bool,
        staged: bool,
        device: Option<i32>,
        dev: i32,
        c: &mut CommGpu,
    ) -> Result<()> {
        let s = a.stream;
        if eager && !staged && !a.kind.is_p2p() && device.is_some() {
            // SAFETY: the caller's contract.
            unsafe { self.mark_daemon_op(&mut c.eager, a.kind, s, dev)? };
        }
        if eager && a.kind.is_p2p() {
            // SAFETY: as above.
            unsafe { c.p2p_daemon_op(a.peer, a.kind == OpKind::Send, s, device)? };
        }
        Ok(())
    }

    /// The op's stream work, once it is posted: each phase's ready write and wait for done
    /// (a replay ending with its done word reset, `commd_proto::graph`), the reduction kernels
    /// between them, then the events after the op.
    ///
    /// # Safety
    /// Everything named was set up for `a.stream` by `post_daemon`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue(
        &self,
        a: &CudaOpArgs,
        plan: &Plan,
        words: &Words,
        waits: &Waits,
        waiter: &wait::Waiter,
        kernels: Option<&kernels::Kernels>,
        c: &mut CommGpu,
    ) -> Result<()> {
        let s = a.stream;
        let ticket = words.ticket;
        // SAFETY: `done` is a device-mapped doorbell word; `waiter` was made for `s`.
        let wait = |v: u32| unsafe { waiter.enqueue(s, words.done, v) };
        let reset = || match words.graph_slot {
            Some(_) => ck(
                // SAFETY: `done` is a device-mapped address of the registered graph area.
                unsafe {
                    sys::cuStreamWriteValue32_v2(s, words.done, commd_proto::graph::DONE_RESET, 0)
                },
                "cuStreamWriteValue32",
            ),
            None => Ok(()),
        };
        if !plan.kernel_reduces {
            write_ready(s, words.ready, ticket)?;
            if a.defer_wait && a.kind.is_p2p() {
                let phases = plan.phases;
                match words.graph_slot {
                    Some((slot, _, id)) => {
                        c.captured_deferred.push((id, slot, phases, waits.op_bytes))
                    }
                    None => {
                        let most = c.deferred.map_or(0, |(_, b)| b).max(waits.op_bytes);
                        c.deferred = Some((ticket, most));
                    }
                }
            } else {
                wait(ticket)?;
                reset()?;
            }
        } else {
            let k = kernels.ok_or_else(|| Error::InvalidArgument("kernels".into()))?;
            // SAFETY: as ours.
            unsafe { self.enqueue_reduction(a, plan, words, waits, k, &wait)? };
            reset()?;
        }
        Ok(())
    }

    /// A reduction's phases: round j's inputs land in the scratch (for all-reduce, round
    /// j - 1's pieces are being pushed out), then this rank's kernel reduces round j; the last
    /// phase follows the last kernel (`commd_proto::desc::CudaShape`). With the rounds kernel
    /// every round runs in one launch: round 0's phase waited for here, the later ones inside
    /// the kernel.
    ///
    /// # Safety
    /// As [`Communicator::enqueue`].
    unsafe fn enqueue_reduction(
        &self,
        a: &CudaOpArgs,
        plan: &Plan,
        words: &Words,
        waits: &Waits,
        k: &kernels::Kernels,
        wait: &dyn Fn(u32) -> std::result::Result<(), cu::CuError>,
    ) -> Result<()> {
        let s = a.stream;
        let es = a.dtype.size();
        let n = u64::from(self.nranks);
        let me_root = a.peer == self.rank;
        let (shape, ticket) = (plan.shape, words.ticket);
        let sc = plan.scratch.unwrap_or(Scratch {
            ptr: 0,
            slot_bytes: plan.slot_bytes,
            device: 0,
        });
        let op = a
            .redop
            .ok_or_else(|| Error::InvalidArgument("reduction op missing".into()))?;
        let mut from = 0u32;
        if let Some((bar, max_blocks, coop)) = waits.fused {
            write_ready(s, words.ready, ticket)?;
            wait(ticket)?;
            let (src, piecewise) = match a.kind {
                OpKind::AllReduce => (a.send.unwrap_or(0), 1),
                OpKind::Reduce => (a.send.unwrap_or(0), 0),
                _ => (a.send.unwrap_or(0) + u64::from(self.rank) * a.count * es, 0),
            };
            let ra = kernels::RoundsArgs {
                dst: a.recv.unwrap_or(0),
                src,
                scratch: sc.ptr,
                slot_bytes: sc.slot_bytes,
                round_elems: shape.round_elems,
                count: a.count,
                ready: words.ready,
                done: words.done,
                bar,
                n: self.nranks,
                rank: self.rank,
                piecewise,
                rounds: plan.rounds,
                ticket,
                divisor: self.nranks,
            };
            // SAFETY: the pieces of every round lie inside the op's buffers and this rank's
            // scratch (as for the per-round launches); `ready`/`done` are the doorbell's
            // device-mapped words; the barrier is this communicator's, whose GPU work is
            // ordered (one stream, or events across streams).
            match unsafe { k.launch_rounds(s, a.dtype, op, max_blocks, coop, &ra) } {
                Ok(_) => from = plan.rounds,
                // A launch refused (e.g. too few SMs free for a cooperative grid on this GPU):
                // the op goes on with one launch per round, which writes round 0's ready again
                // (the same value) and finds its wait satisfied.
                Err(e) => warn_once_rounds(&e),
            }
        }
        for j in from..plan.rounds {
            let t = ticket.wrapping_add(j);
            write_ready(s, words.ready, t)?;
            wait(t)?;
            let j = u64::from(j);
            let s0 = j * shape.round_elems;
            let len = shape.round_elems.min(a.count - s0.min(a.count));
            // This rank's piece of the round and where its inputs sit.
            let (start, plen, src_base, dst_base, reduces_here) = match a.kind {
                OpKind::AllReduce if plan.one_shot => {
                    (s0, len, a.send.unwrap_or(0), a.recv.unwrap_or(0), true)
                }
                OpKind::AllReduce => {
                    let (ps, pl) = cu::piece(s0, len, n, u64::from(self.rank));
                    (ps, pl, a.send.unwrap_or(0), a.recv.unwrap_or(0), true)
                }
                OpKind::Reduce => (s0, len, a.send.unwrap_or(0), a.recv.unwrap_or(0), me_root),
                _ => {
                    let off = u64::from(self.rank) * a.count * es;
                    (
                        s0,
                        len,
                        a.send.unwrap_or(0) + off,
                        a.recv.unwrap_or(0),
                        true,
                    )
                }
            };
            if reduces_here && plen > 0 {
                // Every rank's input in ascending rank order, as the host engine and the fused
                // rounds kernel reduce: a one-shot all-reduce then gives every rank the same
                // bits (float rounding and a NaN's min/max depend on the order). The scratch
                // slots hold the peers' inputs in that order, skipping this rank.
                let me = u64::from(self.rank);
                let ins: Vec<u64> = (0..u64::from(self.nranks))
                    .map(|k| match k.cmp(&me) {
                        std::cmp::Ordering::Equal => src_base + start * es,
                        o => {
                            let slot = if o == std::cmp::Ordering::Less {
                                k
                            } else {
                                k - 1
                            };
                            sc.ptr
                                + commd_proto::desc::cuda_scratch_off(
                                    j,
                                    slot,
                                    self.nranks,
                                    sc.slot_bytes,
                                )
                        }
                    })
                    .collect();
                let dst = dst_base + start * es;
                // SAFETY: every pointer addresses `plen` elements inside the op's buffers or
                // this rank's scratch (checked above / sized by the daemon).
                unsafe { k.launch(s, a.dtype, op, dst, &ins, plen, self.nranks)? };
            }
        }
        let last = ticket.wrapping_add(plan.rounds);
        write_ready(s, words.ready, last)?;
        wait(last)?;
        Ok(())
    }
}

impl Communicator {
    /// This rank's share of the daemon's GPU scratch for the communicator, opened in this process
    /// once per IPC handle (every communicator of a session on one GPU shares it).
    fn scratch(&self, c: &mut CommGpu, g: &mut SessionGpu, device: i32) -> Result<Scratch> {
        if let Some(s) = c.scratch {
            if s.device != device {
                return Err(Error::InvalidArgument(format!(
                    "communicator {} already runs GPU reductions on device {}; this tensor is on device {device} (use one device per rank and communicator)",
                    self.comm_id, s.device
                )));
            }
            return Ok(s);
        }
        let i = &self.client;
        let rep = i
            .watched(i.rpc.clone().get_comm_scratch(pb::CommScratchRequest {
                session_id: i.session_id,
                comm: self.handle,
                device_uuid: device_uuid(device)?.to_vec(),
            }))?
            .map_err(|s| Error::rpc("get_comm_scratch", s))?
            .into_inner();
        let need = commd_proto::desc::cuda_scratch_bytes(self.nranks, rep.slot_bytes);
        if !rep.ipc_handle.is_empty() && rep.bytes < need {
            return Err(Error::InvalidArgument(format!(
                "the daemon's GPU scratch for communicator {} has {} bytes, this client needs {need} (two buffers of {} peer slots of {} bytes): client and daemon versions differ",
                self.comm_id,
                rep.bytes,
                self.nranks.saturating_sub(1),
                rep.slot_bytes
            )));
        }
        let ptr = if rep.ipc_handle.is_empty() {
            0
        } else {
            match g.scratch_maps.get(&rep.ipc_handle) {
                Some(&p) => p,
                None => {
                    let p = cu::ipc_open(&rep.ipc_handle, "cuIpcOpenMemHandle(daemon scratch)")?;
                    g.scratch_maps.insert(rep.ipc_handle.clone(), p);
                    p
                }
            }
        };
        let s = Scratch {
            ptr,
            slot_bytes: rep.slot_bytes,
            device,
        };
        c.scratch = Some(s);
        Ok(s)
    }
}

/// Once the op's stream work is queued: the event the communicator's next op on another stream
/// waits for (`order_ev`, kept as the communicator's last), and the caller's event after the
/// op.
///
/// # Safety
/// `s` must be the op's stream, validated, of the events' device.
unsafe fn finish_order(
    s: sys::CUstream,
    order_ev: Option<CudaEvent>,
    done_ev: Option<&CudaEvent>,
    c: &mut CommGpu,
) -> Result<()> {
    if let Some(ev) = order_ev {
        // SAFETY: the caller's contract.
        unsafe { ev.record(s)? };
        c.last = Some((s as usize, Arc::new(ev)));
    }
    if let Some(e) = done_ev {
        // SAFETY: as above.
        unsafe { e.record(s)? };
    }
    Ok(())
}

/// Logs, once per process, that the rounds kernel could not be launched (the op used one launch
/// per round instead).
fn warn_once_rounds(e: &kernels::KernelError) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "commd: the rounds kernel could not be launched ({e}); multi-round GPU reductions \
             use one launch per round"
        )
    });
}

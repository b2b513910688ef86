//! NCCL's profiling aliases: for each function of its API, `pnccl<Name>` is the same entry point
//! as `nccl<Name>` (profilers interpose the `nccl*` names and call the `pnccl*` ones). Each alias
//! here is a naked function that jumps to its `nccl*` counterpart, so it takes any signature
//! with the arguments untouched. The list is NCCL 2.32.3's (`pnccl*` exports of its
//! `libnccl.so.2`, checked in CI against `nccl/nccl-2.32.3-exports.txt`).

#![allow(unsafe_code)] // exported by name, naked: the C ABI

macro_rules! aliases {
    ($($alias:ident => $target:ident;)*) => {
        $(
            #[unsafe(naked)]
            #[unsafe(no_mangle)]
            pub extern "C" fn $alias() {
                #[cfg(target_arch = "x86_64")]
                core::arch::naked_asm!("jmp {f}", f = sym crate::$target);
                #[cfg(target_arch = "aarch64")]
                core::arch::naked_asm!("b {f}", f = sym crate::$target);
            }
        )*
    };
}

aliases! {
    pncclAllGather => ncclAllGather;
    pncclAllGatherConfig => ncclAllGatherConfig;
    pncclAllReduce => ncclAllReduce;
    pncclAllReduceConfig => ncclAllReduceConfig;
    pncclAlltoAll => ncclAlltoAll;
    pncclAlltoAllConfig => ncclAlltoAllConfig;
    pncclBcast => ncclBcast;
    pncclBroadcast => ncclBroadcast;
    pncclBroadcastConfig => ncclBroadcastConfig;
    pncclCommAbort => ncclCommAbort;
    pncclCommCount => ncclCommCount;
    pncclCommCuDevice => ncclCommCuDevice;
    pncclCommDeregister => ncclCommDeregister;
    pncclCommDestroy => ncclCommDestroy;
    pncclCommFinalize => ncclCommFinalize;
    pncclCommGetAsyncError => ncclCommGetAsyncError;
    pncclCommGetUniqueId => ncclCommGetUniqueId;
    pncclCommGrow => ncclCommGrow;
    pncclCommInitAll => ncclCommInitAll;
    pncclCommInitRank => ncclCommInitRank;
    pncclCommInitRankConfig => ncclCommInitRankConfig;
    pncclCommInitRankScalable => ncclCommInitRankScalable;
    pncclCommMemStats => ncclCommMemStats;
    pncclCommQueryProperties => ncclCommQueryProperties;
    pncclCommRegister => ncclCommRegister;
    pncclCommResume => ncclCommResume;
    pncclCommRevoke => ncclCommRevoke;
    pncclCommShrink => ncclCommShrink;
    pncclCommSplit => ncclCommSplit;
    pncclCommSuspend => ncclCommSuspend;
    pncclCommUserRank => ncclCommUserRank;
    pncclCommWindowDeregister => ncclCommWindowDeregister;
    pncclCommWindowRegister => ncclCommWindowRegister;
    pncclDevCommCreate => ncclDevCommCreate;
    pncclDevCommDestroy => ncclDevCommDestroy;
    pncclGather => ncclGather;
    pncclGatherConfig => ncclGatherConfig;
    pncclGetCftDeviceLeInfo => ncclGetCftDeviceLeInfo;
    pncclGetErrorString => ncclGetErrorString;
    pncclGetLastError => ncclGetLastError;
    pncclGetLsaDevicePointer => ncclGetLsaDevicePointer;
    pncclGetLsaMultimemDevicePointer => ncclGetLsaMultimemDevicePointer;
    pncclGetMultimemDeviceLeInfo => ncclGetMultimemDeviceLeInfo;
    pncclGetMultimemDevicePointer => ncclGetMultimemDevicePointer;
    pncclGetPeerDeviceLeInfo => ncclGetPeerDeviceLeInfo;
    pncclGetPeerDevicePointer => ncclGetPeerDevicePointer;
    pncclGetUniqueId => ncclGetUniqueId;
    pncclGetVersion => ncclGetVersion;
    pncclGinBarrierCreateRequirement => ncclGinBarrierCreateRequirement;
    pncclGinInboxA2ACreateRequirement => ncclGinInboxA2ACreateRequirement;
    pncclGinOutboxCreateRequirement => ncclGinOutboxCreateRequirement;
    pncclGroupEnd => ncclGroupEnd;
    pncclGroupSimulateEnd => ncclGroupSimulateEnd;
    pncclGroupStart => ncclGroupStart;
    pncclLLA2ACalcSlots => ncclLLA2ACalcSlots;
    pncclLLA2ACreateRequirement => ncclLLA2ACreateRequirement;
    pncclLsaBarrierCreateRequirement => ncclLsaBarrierCreateRequirement;
    pncclMemAlloc => ncclMemAlloc;
    pncclMemFree => ncclMemFree;
    pncclParamBind => ncclParamBind;
    pncclParamDumpAll => ncclParamDumpAll;
    pncclParamGet => ncclParamGet;
    pncclParamGetAllParameterKeys => ncclParamGetAllParameterKeys;
    pncclParamGetI16 => ncclParamGetI16;
    pncclParamGetI32 => ncclParamGetI32;
    pncclParamGetI64 => ncclParamGetI64;
    pncclParamGetI8 => ncclParamGetI8;
    pncclParamGetParameter => ncclParamGetParameter;
    pncclParamGetStr => ncclParamGetStr;
    pncclParamGetU16 => ncclParamGetU16;
    pncclParamGetU32 => ncclParamGetU32;
    pncclParamGetU64 => ncclParamGetU64;
    pncclParamGetU8 => ncclParamGetU8;
    pncclPutSignal => ncclPutSignal;
    pncclRecv => ncclRecv;
    pncclRedOpCreatePreMulSum => ncclRedOpCreatePreMulSum;
    pncclRedOpDestroy => ncclRedOpDestroy;
    pncclReduce => ncclReduce;
    pncclReduceConfig => ncclReduceConfig;
    pncclReduceScatter => ncclReduceScatter;
    pncclReduceScatterConfig => ncclReduceScatterConfig;
    pncclResetDebugInit => ncclResetDebugInit;
    pncclScatter => ncclScatter;
    pncclScatterConfig => ncclScatterConfig;
    pncclSend => ncclSend;
    pncclSetEncryption => ncclSetEncryption;
    pncclSignal => ncclSignal;
    pncclTeamCft => ncclTeamCft;
    pncclTeamCftMultimem => ncclTeamCftMultimem;
    pncclTeamLsa => ncclTeamLsa;
    pncclTeamRail => ncclTeamRail;
    pncclTeamRankToLsa => ncclTeamRankToLsa;
    pncclTeamRankToWorld => ncclTeamRankToWorld;
    pncclTeamWorld => ncclTeamWorld;
    pncclWaitSignal => ncclWaitSignal;
    pncclWinGetUserPtr => ncclWinGetUserPtr;
}

//! The library answers to NCCL's SONAME, so a preloaded copy satisfies every `NEEDED
//! libnccl.so.2` of the process (torch's libtorch_cuda.so among them) and the real NCCL is never
//! loaded beside it.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rerun-if-changed=build.rs");
}

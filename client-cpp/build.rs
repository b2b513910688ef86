// A build script reads Cargo's own variables (OUT_DIR, CARGO_*), not commd settings.
#![allow(clippy::disallowed_methods)]

//! Generates the C header from this crate's `extern "C"` items into `$OUT_DIR/commd.h` (the
//! committed `include/commd.h` must equal it; see `header_is_current` in src/lib.rs), and gives
//! the shared library a SONAME so installed programs bind to a compatible ABI.

use std::path::PathBuf;

fn main() {
    let dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");

    let major: u32 = env_num("CARGO_PKG_VERSION_MAJOR");
    let minor: u32 = env_num("CARGO_PKG_VERSION_MINOR");
    let patch: u32 = env_num("CARGO_PKG_VERSION_PATCH");

    // 0.x: every minor version may break the ABI (semver), so it is part of the SONAME.
    let soname = if major == 0 {
        format!("libcommd.so.0.{minor}")
    } else {
        format!("libcommd.so.{major}")
    };
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    }

    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("client-cpp/cbindgen.toml: {e}"));
    let version = format!(
        "#define COMMD_VERSION_MAJOR {major}\n#define COMMD_VERSION_MINOR {minor}\n#define COMMD_VERSION_PATCH {patch}\n\
         /** The version this header belongs to; compare with commd_version() at run time. */\n\
         #define COMMD_VERSION \"{major}.{minor}.{patch}\""
    );
    cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .with_after_include(version)
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen could not generate commd.h from client-cpp/src: {e}"))
        .write_to_file(out.join("commd.h"));
}

fn env_num(key: &str) -> u32 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("cargo sets {key} to a number"))
}

//! Compiles `commd/v1/*.proto` and `switchml/switchml.proto` with protox (pure Rust), so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "commd/v1/local.proto",
        "commd/v1/peer.proto",
        "commd/v1/admin.proto",
        "switchml/switchml.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}

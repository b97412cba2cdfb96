//! Generates the gRPC code of Envoy's rate limit service and of Kuadrant
//! limitador's from `proto/`.
//!
//! The .proto files are parsed by protox, in Rust, so building needs no
//! `protoc`; tonic-prost-build then writes the messages, the server trait
//! and a client (used by the tests, and by anyone calling the service from
//! Rust) into `OUT_DIR`, with `envoy.rs` nesting them by package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const ROOTS: [&str; 2] = [
        "envoy/service/ratelimit/v3/rls.proto",
        "kuadrant/service/ratelimit/v1/kuadrantrls.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    let files = protox::compile(ROOTS, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // A generic client: no dependency on tonic's channel in the library.
        .build_transport(false)
        .include_file("envoy.rs")
        .compile_fds(files)?;
    Ok(())
}

// Generates the messages and the tonic server/client stubs from our own .proto files
// (proto/, written for this fixture) with Debian's protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/envoy/service/ratelimit/v3/rls.proto",
        "proto/kuadrant/service/ratelimit/v1/kuadrantrls.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    println!("cargo:rerun-if-changed=proto");
    tonic_build::configure()
        // Every RPC goes through crate::fault::FaultCodec: prost unless `--answer garbage`.
        .codec_path("crate::fault::FaultCodec")
        .compile_protos(&protos, &["proto"])?;
    Ok(())
}

//! With feature `grpc`: the KV session service's code, generated from
//! proto/orbite/kv/v1/kv_session.proto.

fn main() {
    #[cfg(feature = "grpc")]
    grpc();
}

#[cfg(feature = "grpc")]
fn grpc() {
    let proto = "../proto/orbite/kv/v1/kv_session.proto";
    println!("cargo:rerun-if-changed={proto}");
    if std::env::var_os("PROTOC").is_none() && !on_path("protoc") {
        panic!(
            "feature `grpc` needs protoc to build {proto}: install it (apt-get install protobuf-compiler) or set PROTOC"
        );
    }
    tonic_prost_build::configure()
        .codec_path("crate::session::grpc::codec::Codec")
        .compile_protos(&[proto], &["../proto"])
        .unwrap_or_else(|e| panic!("cannot compile {proto}: {e}"));
}

#[cfg(feature = "grpc")]
fn on_path(name: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

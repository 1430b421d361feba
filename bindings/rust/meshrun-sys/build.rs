//! Generates the declarations of wrapper.h's headers with the `bindgen`
//! command (Debian's bindgen package; no crate is fetched), from
//! $MESHRUN_INCLUDE_DIR or the checkout's abi/include. bindgen also writes
//! a layout test per struct (size, alignment, every field's offset as
//! clang lays it out), which `cargo test` runs.
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let include = env::var("MESHRUN_INCLUDE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| manifest.join("../../../abi/include"));
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    let bindgen = env::var("BINDGEN").unwrap_or_else(|_| "bindgen".to_string());
    let status = Command::new(&bindgen)
        .arg(manifest.join("wrapper.h"))
        .arg("-o")
        .arg(&out)
        .args(["--allowlist-function", "meshrun_.*"])
        .args(["--allowlist-type", "meshrun_.*|DL.*"])
        .args(["--allowlist-var", "MESHRUN_.*|kDL.*"])
        .args(["--no-prepend-enum-name", "--use-core"])
        .arg("--")
        .arg(format!("-I{}", include.display()))
        .status()
        .unwrap_or_else(|error| {
            panic!("meshrun-sys: cannot run `{}` ({}): install Debian's bindgen", bindgen, error)
        });
    assert!(status.success(), "meshrun-sys: bindgen failed on {}", include.display());
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed={}", include.display());
    println!("cargo:rerun-if-env-changed=MESHRUN_INCLUDE_DIR");
}

//! Links libmeshrun.so: from $MESHRUN_LIB_DIR (a build's lib/ or an install
//! prefix's), else the checkout's build/lib, else the loader's path.
use std::env;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let dir = env::var("MESHRUN_LIB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| manifest.join("../../../build/lib"));
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    println!("cargo:rustc-link-lib=dylib=meshrun");
    println!("cargo:rerun-if-env-changed=MESHRUN_LIB_DIR");
}

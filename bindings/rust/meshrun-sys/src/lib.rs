//! The meshrun C ABI as Rust declarations, generated from the headers
//! (build.rs). Unsafe and raw: `meshrun` wraps the host API safely; a
//! plugin written in Rust fills these tables itself. The headers are the
//! documentation of every item.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

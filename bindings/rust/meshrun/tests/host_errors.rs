//! The host API's refusals as a Rust host meets them: each is an Err with
//! the library's code and a message naming the call or the argument, and
//! the process goes on. One process that never joins a job.
use meshrun::{Error, Run, Runtime};

const INVALID_ARGUMENT: i32 = 1;
const NOT_FOUND: i32 = 2;
const FAILED_PRECONDITION: i32 = 3;

fn refused<T>(result: meshrun::Result<T>) -> Error {
    match result {
        Ok(_) => panic!("the call succeeded"),
        Err(error) => error,
    }
}

#[test]
fn abi_version_is_the_headers() {
    assert_eq!(
        meshrun::abi_version(),
        (meshrun_sys::MESHRUN_ABI_VERSION_MAJOR as i32, meshrun_sys::MESHRUN_ABI_VERSION_MINOR as i32)
    );
}

#[test]
fn a_missing_config_file_is_not_found() {
    let error = refused(Runtime::from_file("/nonexistent/meshrun.toml"));
    assert_eq!(error.code, NOT_FOUND, "{}", error);
    assert!(error.message.contains("/nonexistent/meshrun.toml"), "{}", error);
}

#[test]
fn a_bad_override_names_the_key() {
    let mut runtime = Runtime::from_text("", "<test>").unwrap();
    let error = refused(runtime.set("train.stepz=3"));
    assert_eq!(error.code, INVALID_ARGUMENT, "{}", error);
    assert!(error.message.contains("stepz"), "{}", error);
    runtime.set("train.steps=3").unwrap();
}

#[test]
fn a_nul_byte_is_refused_before_the_call() {
    let error = refused(Runtime::from_text("a\0b", "<test>"));
    assert_eq!(error.code, INVALID_ARGUMENT);
    assert!(error.message.contains("NUL"), "{}", error);
}

#[test]
fn training_or_a_rank_before_join_is_failed_precondition() {
    let mut runtime = Runtime::from_text("", "<test>").unwrap();
    let error = refused(Run::new(&mut runtime).on_step(|_| true).train());
    assert_eq!(error.code, FAILED_PRECONDITION, "{}", error);
    assert!(error.message.contains("meshrun_runtime_join"), "{}", error);
    let error = refused(runtime.rank());
    assert_eq!(error.code, FAILED_PRECONDITION, "{}", error);
    assert!(error.to_string().starts_with("FAILED_PRECONDITION: "));
}

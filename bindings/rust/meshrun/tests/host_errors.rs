//! The host API's refusals as a Rust host meets them: each is an Err with
//! the library's code and a message naming the call or the argument, and
//! the process goes on. One process that never joins a job. The tests made
//! of raw `meshrun_sys` calls are what a host in any language can get wrong
//! (a destroyed handle, a wrong struct_size, a NULL buffer) and the safe
//! wrapper rules out.
use std::ffi::CString;
use std::os::raw::c_char;
use std::ptr;
use std::sync::Mutex;

use meshrun::{Error, Run, Runtime};
use meshrun_sys as sys;

/// Held by every test that creates a runtime: cargo runs tests on threads of
/// one process, and a runtime made on another thread could take the address
/// of the one a test has just destroyed, which would make it live again.
static HANDLES: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    HANDLES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn raw_refusal(error: *mut sys::meshrun_error) -> Error {
    assert!(!error.is_null(), "the call succeeded");
    unsafe { Error::from_raw(error) }
}

fn raw_runtime() -> *mut sys::meshrun_runtime {
    let text = CString::new("").unwrap();
    let mut runtime = ptr::null_mut();
    let error =
        unsafe { sys::meshrun_runtime_create_from_text(text.as_ptr(), ptr::null(), &mut runtime) };
    assert!(error.is_null());
    runtime
}

fn c_text(text: &'static [u8]) -> *const c_char {
    text.as_ptr() as *const c_char
}

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
        (
            meshrun_sys::MESHRUN_ABI_VERSION_MAJOR as i32,
            meshrun_sys::MESHRUN_ABI_VERSION_MINOR as i32
        )
    );
}

#[test]
fn a_missing_config_file_is_not_found() {
    let _serial = serial();
    let error = refused(Runtime::from_file("/nonexistent/meshrun.toml"));
    assert_eq!(error.code, NOT_FOUND, "{}", error);
    assert!(
        error.message.contains("/nonexistent/meshrun.toml"),
        "{}",
        error
    );
}

#[test]
fn a_bad_override_names_the_key() {
    let _serial = serial();
    let mut runtime = Runtime::from_text("", "<test>").unwrap();
    let error = refused(runtime.set("train.stepz=3"));
    assert_eq!(error.code, INVALID_ARGUMENT, "{}", error);
    assert!(error.message.contains("stepz"), "{}", error);
    runtime.set("train.steps=3").unwrap();
}

#[test]
fn a_nul_byte_is_refused_before_the_call() {
    let _serial = serial();
    let error = refused(Runtime::from_text("a\0b", "<test>"));
    assert_eq!(error.code, INVALID_ARGUMENT);
    assert!(error.message.contains("NUL"), "{}", error);
}

#[test]
fn training_or_a_rank_before_join_is_failed_precondition() {
    let _serial = serial();
    let mut runtime = Runtime::from_text("", "<test>").unwrap();
    let error = refused(Run::new(&mut runtime).on_step(|_| true).train());
    assert_eq!(error.code, FAILED_PRECONDITION, "{}", error);
    assert!(error.message.contains("meshrun_runtime_join"), "{}", error);
    let error = refused(runtime.rank());
    assert_eq!(error.code, FAILED_PRECONDITION, "{}", error);
    assert!(error.to_string().starts_with("FAILED_PRECONDITION: "));
}

#[test]
fn a_destroyed_foreign_or_wrong_typed_handle_is_refused_not_read() {
    let _serial = serial();
    let destroyed = raw_runtime();
    let mut size = 0i64;
    let mut sharded = 0i32;
    unsafe {
        sys::meshrun_runtime_destroy(destroyed);
        sys::meshrun_runtime_destroy(destroyed); // twice: the second does nothing
        let error = raw_refusal(sys::meshrun_mesh_axis_size(
            destroyed,
            c_text(b"dp\0"),
            &mut size,
        ));
        assert_eq!(error.code, INVALID_ARGUMENT, "{}", error);
        assert_eq!(
            error.message,
            "meshrun_mesh_axis_size: argument 'runtime' is not a live meshrun_runtime: it was \
             destroyed, or never returned by this library"
        );
        let mut foreign = [0u64; 8]; // memory the library never handed out
        let error = raw_refusal(sys::meshrun_runtime_join(
            foreign.as_mut_ptr() as *mut sys::meshrun_runtime
        ));
        assert!(
            error
                .message
                .starts_with("meshrun_runtime_join: argument 'runtime' is not a live"),
            "{}",
            error
        );
        let live = raw_runtime();
        let error = raw_refusal(sys::meshrun_strategy_sharded(
            live as *const sys::meshrun_strategy,
            &mut sharded,
        ));
        assert_eq!(
            error.message,
            "meshrun_strategy_sharded: argument 'strategy' is a meshrun_runtime, not a meshrun_strategy"
        );
        assert!(sys::meshrun_runtime_build_mesh(live, 2, 0).is_null());
        assert!(sys::meshrun_mesh_axis_size(live, c_text(b"dp\0"), &mut size).is_null());
        assert_eq!(size, 2); // the live runtime is untouched
        sys::meshrun_runtime_destroy(live);
    }
}

#[test]
fn a_wrong_struct_size_or_a_null_buffer_is_named() {
    let _serial = serial();
    let runtime = raw_runtime();
    let name = CString::new("w").unwrap();
    let names = [name.as_ptr()];
    let (numels, rows, units) = ([4i64], [1i64], [0i32]);
    let (mut values, mut grads) = ([0f32; 4], [0f32; 4]);
    let mut shape = [4i64];
    let tensor = |data: *mut f32, shape: *mut i64| sys::DLTensor {
        data: data as *mut std::ffi::c_void,
        device: sys::DLDevice {
            device_type: sys::kDLCPU,
            device_id: 0,
        },
        ndim: 1,
        dtype: sys::DLDataType {
            code: sys::kDLFloat as u8,
            bits: 32,
            lanes: 1,
        },
        shape,
        strides: ptr::null_mut(),
        byte_offset: 0,
    };
    let params = sys::meshrun_strategy_parameters {
        struct_size: std::mem::size_of::<sys::meshrun_strategy_parameters>() as sys::size_t,
        num_parameters: 1,
        names: names.as_ptr(),
        numels: numels.as_ptr(),
        rows: rows.as_ptr(),
        units: units.as_ptr(),
        num_units: 1,
        root_unit: 0,
        parameters: tensor(values.as_mut_ptr(), shape.as_mut_ptr()),
        gradients: tensor(grads.as_mut_ptr(), shape.as_mut_ptr()),
        extensions: ptr::null(),
        compute_stream: ptr::null_mut(),
        comm_stream: ptr::null_mut(),
    };
    let cases = [
        (
            sys::meshrun_strategy_parameters { struct_size: 8, ..params },
            "meshrun_strategy_create: meshrun_strategy_parameters: struct_size 8 is smaller than its ABI 1.5 layout",
        ),
        (
            sys::meshrun_strategy_parameters { parameters: tensor(ptr::null_mut(), shape.as_mut_ptr()), ..params },
            "meshrun_strategy_create: params->parameters: data is NULL",
        ),
        (
            sys::meshrun_strategy_parameters { gradients: tensor(grads.as_mut_ptr(), ptr::null_mut()), ..params },
            "meshrun_strategy_create: params->gradients: shape is NULL",
        ),
    ];
    let mut strategy = ptr::null_mut();
    unsafe {
        for (bad, expected) in &cases {
            let error = raw_refusal(sys::meshrun_strategy_create(runtime, bad, &mut strategy));
            assert_eq!(error.code, INVALID_ARGUMENT, "{}", error);
            assert!(error.message.starts_with(expected), "{}", error);
            assert!(strategy.is_null()); // out-parameters are written only on success
        }
        let error = raw_refusal(sys::meshrun_strategy_create(
            runtime,
            ptr::null(),
            &mut strategy,
        ));
        assert_eq!(
            error.message,
            "meshrun_strategy_create: argument 'params' is NULL"
        );
        let error = raw_refusal(sys::meshrun_strategy_create(
            runtime,
            &params,
            &mut strategy,
        ));
        assert_eq!(error.code, FAILED_PRECONDITION, "{}", error); // well formed, not joined
        let error = raw_refusal(sys::meshrun_run_train(
            ptr::null_mut(),
            ptr::null(),
            None,
            ptr::null_mut(),
        ));
        assert_eq!(
            error.message,
            "meshrun_run_train: argument 'runtime' is NULL"
        );
        sys::meshrun_runtime_destroy(runtime);
    }
}

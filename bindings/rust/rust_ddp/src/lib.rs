//! rust_ddp: a meshrun strategy plugin in Rust (`distributed.strategy =
//! "rust_ddp"`), loaded by name like the shipped ones.
//!
//! Data parallelism over the host's flat float32 buffers: rank 0's
//! parameters are broadcast at the start; gradients accumulate in the
//! host's buffer over a step's micro-batches, and after the sync
//! micro-batch's backward one all-reduce averages the whole buffer over the
//! data-parallel ranks. The shipped ddp averages the same elements with the
//! same operation, bucket by bucket while backward runs; on 2 ranks an
//! element's average is the same number either way (a + b is b + a), so
//! the two train bit-identically there. It takes no options: the config
//! refuses DDPConfig's keys (bucket_cap_mb, ...) for any strategy but ddp,
//! and every element is reduced whether backward reported it or not.
//!
//! Nothing unwinds into the host: each entry point catches panics and
//! returns an INTERNAL error object made by the host.
use std::ffi::{CStr, CString};
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use meshrun_sys::*;

const NAME: &str = "rust_ddp";

/// An error on its way back to the host: a code and a message.
struct Failure {
    code: u32,
    message: String,
}

fn failure(code: u32, message: impl Into<String>) -> Failure {
    Failure { code, message: format!("{}: {}", NAME, message.into()) }
}

type Outcome = Result<(), Failure>;

struct RustDdp {
    host: *const meshrun_host_services,
    comm: *const meshrun_comm_api, // null until setup
    data_parallel: *mut meshrun_communicator,
    parameters: DLTensor,
    gradients: DLTensor,
    numel: i64,
    in_micro_batch: bool,
    sync: bool,
}

impl RustDdp {
    fn require_setup(&self, call: &str) -> Outcome {
        if self.comm.is_null() {
            return Err(failure(MESHRUN_FAILED_PRECONDITION, format!("{} before setup", call)));
        }
        Ok(())
    }

    /// The comm backend's error, its message prefixed with what failed.
    unsafe fn comm_result(&self, error: *mut meshrun_error, what: &str) -> Outcome {
        if error.is_null() {
            return Ok(());
        }
        let failed = Failure {
            code: (*error).code as u32,
            message: format!(
                "{}: {}: {}",
                NAME,
                what,
                CStr::from_ptr((*error).message).to_string_lossy()
            ),
        };
        if let Some(destroy) = (*error).destroy {
            destroy(error);
        }
        Err(failed)
    }

    unsafe fn setup(&mut self, setup: *const meshrun_strategy_setup) -> Outcome {
        if !self.comm.is_null() {
            return Err(failure(MESHRUN_FAILED_PRECONDITION, "setup was already called"));
        }
        if setup.is_null() || (*setup).comm.is_null() || (*setup).parameter_offsets.is_null() {
            return Err(failure(MESHRUN_INVALID_ARGUMENT, "setup, its comm or its offsets is NULL"));
        }
        let setup = &*setup;
        let numel = *setup.parameter_offsets.offset(setup.num_parameters as isize);
        for (tensor, what) in [(&setup.parameters, "parameters"), (&setup.gradients, "gradients")] {
            check_flat_float32(tensor, what, numel)?;
        }
        self.comm = setup.comm;
        self.data_parallel = setup.data_parallel;
        self.parameters = setup.parameters;
        self.gradients = setup.gradients;
        self.numel = numel;
        Ok(())
    }

    unsafe fn broadcast_parameters(&mut self) -> Outcome {
        self.require_setup("broadcast_parameters")?;
        if self.in_micro_batch {
            return Err(failure(MESHRUN_FAILED_PRECONDITION, "broadcast_parameters in a micro-batch"));
        }
        let broadcast = (*self.comm).broadcast.expect("a comm table has broadcast");
        let error = broadcast(self.data_parallel, &mut self.parameters, 0, ptr::null_mut());
        self.comm_result(error, "broadcast of the parameters from data-parallel rank 0")
    }

    fn begin_micro_batch(&mut self, sync: bool) -> Outcome {
        self.require_setup("begin_micro_batch")?;
        if self.in_micro_batch && self.sync {
            return Err(failure(
                MESHRUN_FAILED_PRECONDITION,
                "begin_micro_batch after the step's sync micro-batch without finish_gradients",
            ));
        }
        self.in_micro_batch = true;
        self.sync = sync;
        Ok(())
    }

    fn gradients_ready(&self, begin: i64, end: i64) -> Outcome {
        self.require_setup("gradients_ready")?;
        if !self.in_micro_batch {
            return Err(failure(MESHRUN_FAILED_PRECONDITION, "gradients_ready outside a micro-batch"));
        }
        if begin < 0 || end < begin || end > self.numel {
            return Err(failure(
                MESHRUN_INVALID_ARGUMENT,
                format!("gradients_ready [{}, {}) is outside [0, {})", begin, end, self.numel),
            ));
        }
        Ok(())
    }

    unsafe fn finish_gradients(&mut self) -> Outcome {
        self.require_setup("finish_gradients")?;
        if !self.in_micro_batch || !self.sync {
            return Err(failure(
                MESHRUN_FAILED_PRECONDITION,
                "finish_gradients without a sync micro-batch: begin the step's last micro-batch \
                 with sync = 1",
            ));
        }
        self.in_micro_batch = false;
        let all_reduce = (*self.comm).all_reduce.expect("a comm table has all_reduce");
        let gradients: *mut DLTensor = &mut self.gradients;
        let error = all_reduce(
            self.data_parallel,
            gradients,
            gradients,
            MESHRUN_REDUCE_AVG as i32,
            ptr::null_mut(),
        );
        self.comm_result(error, "all_reduce (average) of the gradients")
    }
}

fn check_flat_float32(tensor: &DLTensor, what: &str, numel: i64) -> Outcome {
    let flat = tensor.ndim == 1 && !tensor.shape.is_null() && tensor.strides.is_null();
    let float32 = tensor.dtype.code as u32 == kDLFloat && tensor.dtype.bits == 32;
    let length = if flat { unsafe { *tensor.shape } } else { -1 };
    if !flat || !float32 || length != numel || tensor.device.device_type != kDLCPU {
        return Err(failure(
            MESHRUN_INVALID_ARGUMENT,
            format!("setup: {} must be a flat float32 CPU buffer of {} elements", what, numel),
        ));
    }
    Ok(())
}

/// The host's error object for `failure`.
unsafe fn to_error(host: *const meshrun_host_services, failure: Failure) -> *mut meshrun_error {
    let message = CString::new(failure.message.replace('\0', " ")).unwrap();
    let make_error = (*host).make_error.expect("the host services have make_error");
    make_error((*host).context, failure.code as i32, message.as_ptr())
}

/// Runs `body` on the instance, turning failures and panics into errors.
unsafe fn on_instance(
    instance: *mut meshrun_plugin_instance,
    body: impl FnOnce(&mut RustDdp) -> Outcome,
) -> *mut meshrun_error {
    if instance.is_null() {
        // No host to make an error with: the static one says so.
        return ptr::addr_of_mut!(NULL_INSTANCE);
    }
    let ddp = &mut *(instance as *mut RustDdp);
    let host = ddp.host;
    match catch_unwind(AssertUnwindSafe(|| body(ddp))) {
        Ok(Ok(())) => ptr::null_mut(),
        Ok(Err(failed)) => to_error(host, failed),
        Err(_) => to_error(host, failure(MESHRUN_INTERNAL, "panicked")),
    }
}

unsafe extern "C" fn static_error_destroy(_error: *mut meshrun_error) {}

static mut NULL_INSTANCE: meshrun_error = meshrun_error {
    struct_size: std::mem::size_of::<meshrun_error>() as size_t,
    code: MESHRUN_INVALID_ARGUMENT as i32,
    message: b"rust_ddp: the instance is NULL\0".as_ptr() as *const c_char,
    destroy: Some(static_error_destroy),
};

static mut NULL_HOST: meshrun_error = meshrun_error {
    struct_size: std::mem::size_of::<meshrun_error>() as size_t,
    code: MESHRUN_INVALID_ARGUMENT as i32,
    message: b"rust_ddp: the host services table is NULL or smaller than ABI 1.0's\0".as_ptr()
        as *const c_char,
    destroy: Some(static_error_destroy),
};

unsafe extern "C" fn create(
    host: *const meshrun_host_services,
    out: *mut *mut meshrun_plugin_instance,
) -> *mut meshrun_error {
    if host.is_null() || (*host).struct_size < std::mem::size_of::<meshrun_host_services>() as size_t
    {
        return ptr::addr_of_mut!(NULL_HOST);
    }
    if (*host).abi_major != MESHRUN_ABI_VERSION_MAJOR as i32 {
        return to_error(host, failure(MESHRUN_VERSION_MISMATCH, "the host's ABI major differs"));
    }
    if out.is_null() {
        return to_error(host, failure(MESHRUN_INVALID_ARGUMENT, "create: out is NULL"));
    }
    let ddp = Box::new(RustDdp {
        host,
        comm: ptr::null(),
        data_parallel: ptr::null_mut(),
        parameters: std::mem::zeroed(),
        gradients: std::mem::zeroed(),
        numel: 0,
        in_micro_batch: false,
        sync: false,
    });
    *out = Box::into_raw(ddp) as *mut meshrun_plugin_instance;
    ptr::null_mut()
}

unsafe extern "C" fn destroy(instance: *mut meshrun_plugin_instance) {
    if !instance.is_null() {
        drop(Box::from_raw(instance as *mut RustDdp));
    }
}

unsafe extern "C" fn setup(
    instance: *mut meshrun_plugin_instance,
    setup: *const meshrun_strategy_setup,
) -> *mut meshrun_error {
    on_instance(instance, |ddp| ddp.setup(setup))
}

unsafe extern "C" fn broadcast_parameters(
    instance: *mut meshrun_plugin_instance,
) -> *mut meshrun_error {
    on_instance(instance, |ddp| ddp.broadcast_parameters())
}

unsafe extern "C" fn begin_micro_batch(
    instance: *mut meshrun_plugin_instance,
    sync: i32,
) -> *mut meshrun_error {
    on_instance(instance, |ddp| ddp.begin_micro_batch(sync != 0))
}

unsafe extern "C" fn gradients_ready(
    instance: *mut meshrun_plugin_instance,
    begin: i64,
    end: i64,
) -> *mut meshrun_error {
    on_instance(instance, |ddp| ddp.gradients_ready(begin, end))
}

unsafe extern "C" fn finish_gradients(
    instance: *mut meshrun_plugin_instance,
) -> *mut meshrun_error {
    on_instance(instance, |ddp| ddp.finish_gradients())
}

/// No buffers of its own: the all-reduce works in the host's gradients.
unsafe extern "C" fn memory(
    instance: *mut meshrun_plugin_instance,
    out: *mut meshrun_strategy_memory,
) -> *mut meshrun_error {
    on_instance(instance, |_| {
        if out.is_null() {
            return Err(failure(MESHRUN_INVALID_ARGUMENT, "memory: out is NULL"));
        }
        write_zeros(out as *mut u8, (*out).struct_size, std::mem::size_of::<size_t>());
        Ok(())
    })
}

/// Every rank updates every parameter and holds no buffers.
unsafe extern "C" fn plan_memory(
    instance: *mut meshrun_plugin_instance,
    input: *const meshrun_strategy_plan_input,
    out: *mut meshrun_strategy_memory_plan,
) -> *mut meshrun_error {
    on_instance(instance, |_| {
        if input.is_null() || out.is_null() || (*input).parameter_offsets.is_null() {
            return Err(failure(MESHRUN_INVALID_ARGUMENT, "plan_memory: input or out is NULL"));
        }
        let numel = *(*input).parameter_offsets.offset((*input).num_parameters as isize);
        (*out).local_numel = numel;
        (*out).buffers_held = 0;
        Ok(())
    })
}

/// Zeroes the fields of a struct of `struct_size` bytes after its header,
/// as far as this plugin knows them: the caller's struct may be older.
unsafe fn write_zeros(out: *mut u8, struct_size: size_t, header: usize) {
    let known = std::mem::size_of::<meshrun_strategy_memory>();
    let end = (struct_size as usize).min(known);
    if end > header {
        ptr::write_bytes(out.add(header), 0, end - header);
    }
}

struct Table<T>(T);
// The tables are read-only after load and point at static data only.
unsafe impl<T> Sync for Table<T> {}

static STRATEGY: Table<meshrun_strategy_api> = Table(meshrun_strategy_api {
    struct_size: std::mem::size_of::<meshrun_strategy_api>() as size_t,
    mesh_family: MESHRUN_MESH_FAMILY_DDP as i32,
    extensions: ptr::null(),
    setup: Some(setup),
    broadcast_parameters: Some(broadcast_parameters),
    begin_micro_batch: Some(begin_micro_batch),
    gradients_ready: Some(gradients_ready),
    finish_gradients: Some(finish_gradients),
    memory: Some(memory),
    pre_forward: None,
    post_forward: None,
    pre_backward: None,
    post_backward: None,
    unit_views: None,
    local_shard: None,
    shard_segments: None,
    gather_parameters: None,
    weights_by_shard: 0,
    plan_memory: Some(plan_memory),
    unit_views_bfloat16: None,
});

static API: Table<meshrun_plugin_api> = Table(meshrun_plugin_api {
    struct_size: std::mem::size_of::<meshrun_plugin_api>() as size_t,
    abi_major: MESHRUN_ABI_VERSION_MAJOR as i32,
    abi_minor: MESHRUN_ABI_VERSION_MINOR as i32,
    kind: MESHRUN_PLUGIN_KIND_STRATEGY as i32,
    name: b"rust_ddp\0".as_ptr() as *const c_char,
    version: b"0.1.0\0".as_ptr() as *const c_char,
    description: b"data parallelism written in Rust: rank 0's parameters broadcast, gradients \
averaged over the dp ranks in one all-reduce after the step's last backward; deferred sync on \
earlier micro-batches; every element reduced whether reported ready or not; no tp, pp, cp or \
ep\0"
        .as_ptr() as *const c_char,
    create: Some(create),
    destroy: Some(destroy),
    strategy: &STRATEGY.0,
    schedule: ptr::null(),
    sidecar: ptr::null(),
    comm: ptr::null(),
    extensions: ptr::null(),
    model: ptr::null(),
});

/// The plugin's one exported symbol (meshrun/plugin.h).
#[no_mangle]
pub extern "C" fn meshrun_plugin_get_api() -> *const meshrun_plugin_api {
    &API.0
}

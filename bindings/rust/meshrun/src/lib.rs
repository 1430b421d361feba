//! meshrun from Rust: a safe wrapper over libmeshrun.so's host API
//! (abi/include/meshrun/host.h, declared by `meshrun-sys`).
//!
//! ```no_run
//! let mut runtime = meshrun::Runtime::from_file("examples/llama-tiny.toml")?;
//! runtime.set("train.steps=20")?;
//! runtime.join()?; // collective: every rank of the job
//! meshrun::Run::new(&mut runtime)
//!     .output_dir("runs/rust")
//!     .on_step(|metrics| {
//!         println!("{}", metrics);
//!         true // go on
//!     })
//!     .train()?;
//! # Ok::<(), meshrun::Error>(())
//! ```
//!
//! Every failing call returns an [`Error`] carrying the library's code and
//! message; nothing panics across the boundary and nothing exits the
//! process. A [`Runtime`] and what is borrowed from it belong to one thread.

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use meshrun_sys as sys;

/// A failed call: one of the `MESHRUN_*` codes of error.h and the
/// library's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub code: i32,
    pub message: String,
}

impl Error {
    /// The code and message of an error object a raw `meshrun_sys` call
    /// returned, releasing the object.
    ///
    /// # Safety
    /// `error` must be a non-NULL error object the library returned, not yet
    /// released.
    pub unsafe fn from_raw(error: *mut sys::meshrun_error) -> Error {
        let taken = Error {
            code: (*error).code,
            message: CStr::from_ptr((*error).message)
                .to_string_lossy()
                .into_owned(),
        };
        if let Some(destroy) = (*error).destroy {
            destroy(error);
        }
        taken
    }

    /// An error made on this side of the boundary (a string with a NUL).
    fn invalid_argument(message: String) -> Error {
        Error {
            code: sys::MESHRUN_INVALID_ARGUMENT as i32,
            message,
        }
    }

    /// The code's name, "INVALID_ARGUMENT" for 1.
    pub fn code_name(&self) -> &'static str {
        match self.code as u32 {
            sys::MESHRUN_INVALID_ARGUMENT => "INVALID_ARGUMENT",
            sys::MESHRUN_NOT_FOUND => "NOT_FOUND",
            sys::MESHRUN_FAILED_PRECONDITION => "FAILED_PRECONDITION",
            sys::MESHRUN_OUT_OF_RANGE => "OUT_OF_RANGE",
            sys::MESHRUN_UNIMPLEMENTED => "UNIMPLEMENTED",
            sys::MESHRUN_VERSION_MISMATCH => "VERSION_MISMATCH",
            sys::MESHRUN_INTERNAL => "INTERNAL",
            sys::MESHRUN_UNAVAILABLE => "UNAVAILABLE",
            sys::MESHRUN_DEADLINE_EXCEEDED => "DEADLINE_EXCEEDED",
            _ => "UNKNOWN",
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code_name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn check(error: *mut sys::meshrun_error) -> Result<()> {
    if error.is_null() {
        Ok(())
    } else {
        Err(unsafe { Error::from_raw(error) })
    }
}

fn c_string(text: &str, what: &str) -> Result<CString> {
    CString::new(text).map_err(|_| Error::invalid_argument(format!("{} holds a NUL byte", what)))
}

/// The ABI version of the loaded library, (major, minor).
pub fn abi_version() -> (i32, i32) {
    unsafe {
        (
            sys::meshrun_abi_version_major(),
            sys::meshrun_abi_version_minor(),
        )
    }
}

/// A config, its device mesh and, once joined, this process's rank of a
/// running job (`meshrun_runtime`). Destroyed when dropped.
pub struct Runtime {
    handle: *mut sys::meshrun_runtime,
}

impl Runtime {
    /// Parses and checks the TOML file at `path` (INVALID_ARGUMENT naming
    /// the key and its place for a bad one, NOT_FOUND for a missing file).
    pub fn from_file(path: &str) -> Result<Runtime> {
        let path = c_string(path, "the config path")?;
        let mut handle = ptr::null_mut();
        check(unsafe { sys::meshrun_runtime_create_from_file(path.as_ptr(), &mut handle) })?;
        Ok(Runtime { handle })
    }

    /// The same from TOML text; `source_name` names it in messages.
    pub fn from_text(toml: &str, source_name: &str) -> Result<Runtime> {
        let toml = c_string(toml, "the config text")?;
        let source = c_string(source_name, "the source name")?;
        let mut handle = ptr::null_mut();
        check(unsafe {
            sys::meshrun_runtime_create_from_text(toml.as_ptr(), source.as_ptr(), &mut handle)
        })?;
        Ok(Runtime { handle })
    }

    /// Applies one "key.path=value" override, as on `meshrun train`'s
    /// command line; before the mesh is built or joined.
    pub fn set(&mut self, assignment: &str) -> Result<()> {
        let assignment = c_string(assignment, "the override")?;
        check(unsafe { sys::meshrun_runtime_override(self.handle, assignment.as_ptr()) })
    }

    /// Joins the job this process was launched in (`meshrun launch`,
    /// mpirun, srun; alone, a job of one rank). Collective over the job.
    pub fn join(&mut self) -> Result<()> {
        check(unsafe { sys::meshrun_runtime_join(self.handle) })
    }

    /// This process's rank, the job's size, and the rank on its node.
    pub fn rank(&self) -> Result<(i64, i64, i64)> {
        let (mut rank, mut size, mut local) = (0i64, 0i64, 0i64);
        check(unsafe { sys::meshrun_runtime_rank(self.handle, &mut rank, &mut size, &mut local) })?;
        Ok((rank, size, local))
    }

    /// The mesh of a built or joined runtime.
    pub fn mesh(&self) -> Mesh<'_> {
        Mesh { runtime: self }
    }

    /// The communicator of `axis` ("world" or a mesh axis); the runtime
    /// owns it.
    pub fn comm(&mut self, axis: &str) -> Result<Comm<'_>> {
        let name = c_string(axis, "the axis")?;
        let mut handle = ptr::null_mut();
        check(unsafe { sys::meshrun_runtime_comm(self.handle, name.as_ptr(), &mut handle) })?;
        Ok(Comm {
            handle,
            _runtime: std::marker::PhantomData,
        })
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        unsafe { sys::meshrun_runtime_destroy(self.handle) }
    }
}

/// The device mesh of a runtime: axis sizes.
pub struct Mesh<'a> {
    runtime: &'a Runtime,
}

impl Mesh<'_> {
    /// The size of `axis` (a name of host.h: "pp", "dp", "tp", ...).
    pub fn axis_size(&self, axis: &str) -> Result<i64> {
        let name = c_string(axis, "the axis")?;
        let mut size = 0i64;
        check(unsafe {
            sys::meshrun_mesh_axis_size(self.runtime.handle, name.as_ptr(), &mut size)
        })?;
        Ok(size)
    }
}

/// A communicator of a joined runtime, borrowed from it. Every rank of the
/// communicator issues its collectives in the same order (comm.h).
pub struct Comm<'a> {
    handle: *mut sys::meshrun_comm,
    _runtime: std::marker::PhantomData<&'a mut Runtime>,
}

/// What a reduction computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Avg,
    Max,
}

impl Reduce {
    fn code(self) -> i32 {
        (match self {
            Reduce::Sum => sys::MESHRUN_REDUCE_SUM,
            Reduce::Avg => sys::MESHRUN_REDUCE_AVG,
            Reduce::Max => sys::MESHRUN_REDUCE_MAX,
        }) as i32
    }
}

/// An element type the collectives move: the DLPack dtype the comm
/// backends take for it.
pub trait Element: Copy {
    const DTYPE: sys::DLDataType;
}

impl Element for f32 {
    const DTYPE: sys::DLDataType = sys::DLDataType {
        code: sys::kDLFloat as u8,
        bits: 32,
        lanes: 1,
    };
}
impl Element for i32 {
    const DTYPE: sys::DLDataType = sys::DLDataType {
        code: sys::kDLInt as u8,
        bits: 32,
        lanes: 1,
    };
}
impl Element for i64 {
    const DTYPE: sys::DLDataType = sys::DLDataType {
        code: sys::kDLInt as u8,
        bits: 64,
        lanes: 1,
    };
}

/// A one-dimensional CPU DLTensor over a slice, with the shape it points at
/// (boxed, so that it stays where the tensor points while the value moves).
struct Tensor {
    tensor: sys::DLTensor,
    _shape: Box<[i64; 1]>,
}

impl Tensor {
    fn over<T: Element>(data: *const T, len: usize) -> Tensor {
        let mut shape = Box::new([len as i64]);
        let tensor = sys::DLTensor {
            data: data as *mut c_void,
            device: sys::DLDevice {
                device_type: sys::kDLCPU,
                device_id: 0,
            },
            ndim: 1,
            dtype: T::DTYPE,
            shape: shape.as_mut_ptr(),
            strides: ptr::null_mut(),
            byte_offset: 0,
        };
        Tensor {
            tensor,
            _shape: shape,
        }
    }
    fn of<T: Element>(values: &[T]) -> Tensor {
        Tensor::over(values.as_ptr(), values.len())
    }
    fn of_mut<T: Element>(values: &mut [T]) -> Tensor {
        Tensor::over(values.as_mut_ptr() as *const T, values.len())
    }
}

/// An operation in flight (the `_start` calls): it borrows its buffers
/// until it is done, so they cannot be read or written meanwhile. `wait`
/// completes it; dropping it waits too (up to the comm timeout).
pub struct Op<'b> {
    handle: *mut sys::meshrun_op,
    _tensors: Vec<Tensor>,
    _buffers: std::marker::PhantomData<&'b mut ()>,
}

impl Op<'_> {
    /// Waits until the operation completes, or `timeout_seconds` pass
    /// (negative: the comm timeout); DEADLINE_EXCEEDED then.
    pub fn wait(self, timeout_seconds: f64) -> Result<()> {
        check(unsafe { sys::meshrun_op_wait(self.handle, timeout_seconds) })
    }

    /// Whether the operation has completed, without waiting.
    pub fn test(&mut self) -> Result<bool> {
        let mut done = 0i32;
        check(unsafe { sys::meshrun_op_test(self.handle, &mut done) })?;
        Ok(done != 0)
    }
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        unsafe { sys::meshrun_op_destroy(self.handle) }
    }
}

/// A host API collective over a communicator and the tensors it reads and
/// writes, given its out_op (NULL: complete it before returning).
trait Issue:
    FnOnce(*mut sys::meshrun_comm, &mut [Tensor], *mut *mut sys::meshrun_op) -> *mut sys::meshrun_error
{
}
impl<F> Issue for F where
    F: FnOnce(
        *mut sys::meshrun_comm,
        &mut [Tensor],
        *mut *mut sys::meshrun_op,
    ) -> *mut sys::meshrun_error
{
}

/// meshrun_all_reduce of the one tensor in place.
fn reduce_in_place(op: Reduce) -> impl Issue {
    move |comm, t: &mut [Tensor], out| unsafe {
        let tensor: *mut sys::DLTensor = &mut t[0].tensor;
        sys::meshrun_all_reduce(comm, tensor, tensor, op.code(), out)
    }
}

impl<'a> Comm<'a> {
    pub fn rank(&self) -> Result<i64> {
        let mut rank = 0i64;
        check(unsafe { sys::meshrun_comm_rank(self.handle, &mut rank) })?;
        Ok(rank)
    }

    pub fn size(&self) -> Result<i64> {
        let mut size = 0i64;
        check(unsafe { sys::meshrun_comm_size(self.handle, &mut size) })?;
        Ok(size)
    }

    /// Runs `call` (a host API collective over `tensors`, given a NULL
    /// out_op) to completion.
    fn complete(&mut self, mut tensors: Vec<Tensor>, call: impl Issue) -> Result<()> {
        check(call(self.handle, &mut tensors, ptr::null_mut()))
    }

    /// Starts `call` and hands back its Op, which holds `tensors` (the
    /// shapes the library points at) until it is done.
    fn start<'b>(&mut self, mut tensors: Vec<Tensor>, call: impl Issue) -> Result<Op<'b>> {
        let mut handle = ptr::null_mut();
        check(call(self.handle, &mut tensors, &mut handle))?;
        Ok(Op {
            handle,
            _tensors: tensors,
            _buffers: std::marker::PhantomData,
        })
    }

    /// Reduces `values` in place over the communicator's ranks; returns
    /// when done. Collective.
    pub fn all_reduce<T: Element>(&mut self, values: &mut [T], op: Reduce) -> Result<()> {
        self.complete(vec![Tensor::of_mut(values)], reduce_in_place(op))
    }

    /// all_reduce, started: the values are the result once the Op is done.
    pub fn all_reduce_start<'b, T: Element>(
        &mut self,
        values: &'b mut [T],
        op: Reduce,
    ) -> Result<Op<'b>> {
        self.start(vec![Tensor::of_mut(values)], reduce_in_place(op))
    }

    /// `recv` = every rank's `send` in rank order (recv.len() = size x
    /// send.len()). Collective.
    pub fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.complete(
            vec![Tensor::of(send), Tensor::of_mut(recv)],
            |comm, t, out| unsafe {
                let (send, recv) = t.split_at_mut(1);
                sys::meshrun_all_gather(comm, &send[0].tensor, &mut recv[0].tensor, out)
            },
        )
    }

    /// `recv` = this rank's part (rank r: the r-th send.len() / size
    /// elements) of the reduction of every rank's `send`. Collective.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: Reduce,
    ) -> Result<()> {
        self.complete(
            vec![Tensor::of(send), Tensor::of_mut(recv)],
            |comm, t, out| unsafe {
                let (send, recv) = t.split_at_mut(1);
                sys::meshrun_reduce_scatter(
                    comm,
                    &send[0].tensor,
                    &mut recv[0].tensor,
                    op.code(),
                    out,
                )
            },
        )
    }

    /// Every rank's `values` become rank `root`'s. Collective.
    pub fn broadcast<T: Element>(&mut self, values: &mut [T], root: i64) -> Result<()> {
        self.complete(vec![Tensor::of_mut(values)], |comm, t, out| unsafe {
            sys::meshrun_broadcast(comm, &mut t[0].tensor, root, out)
        })
    }

    /// Each rank sends send_counts[r] elements (in rank order) to rank r
    /// and receives recv_counts[r] from it, one count per rank. Collective.
    pub fn all_to_all<T: Element>(
        &mut self,
        send: &[T],
        send_counts: &[i64],
        recv: &mut [T],
        recv_counts: &[i64],
    ) -> Result<()> {
        let ranks = self.size()? as usize;
        if send_counts.len() != ranks || recv_counts.len() != ranks {
            return Err(Error::invalid_argument(format!(
                "all_to_all: {} send counts and {} receive counts for {} ranks",
                send_counts.len(),
                recv_counts.len(),
                ranks
            )));
        }
        self.complete(
            vec![Tensor::of(send), Tensor::of_mut(recv)],
            |comm, t, out| unsafe {
                let (send, recv) = t.split_at_mut(1);
                sys::meshrun_all_to_all(
                    comm,
                    &send[0].tensor,
                    send_counts.as_ptr(),
                    &mut recv[0].tensor,
                    recv_counts.as_ptr(),
                    out,
                )
            },
        )
    }

    /// Sends `values` to rank `peer` of this communicator; `tag` tells
    /// transfers between the same two ranks apart.
    pub fn send<T: Element>(&mut self, values: &[T], peer: i64, tag: i64) -> Result<()> {
        self.complete(vec![Tensor::of(values)], |comm, t, out| unsafe {
            sys::meshrun_send(comm, &t[0].tensor, peer, tag, out)
        })
    }

    /// send, started: a rank may start a send and a receive, then wait for
    /// both (a ring's exchange with its neighbours).
    pub fn send_start<'b, T: Element>(
        &mut self,
        values: &'b [T],
        peer: i64,
        tag: i64,
    ) -> Result<Op<'b>> {
        self.start(
            vec![Tensor::of(values)],
            move |comm, t: &mut [Tensor], out| unsafe {
                sys::meshrun_send(comm, &t[0].tensor, peer, tag, out)
            },
        )
    }

    /// Receives `values` from rank `peer`.
    pub fn recv<T: Element>(&mut self, values: &mut [T], peer: i64, tag: i64) -> Result<()> {
        self.complete(vec![Tensor::of_mut(values)], |comm, t, out| unsafe {
            sys::meshrun_recv(comm, &mut t[0].tensor, peer, tag, out)
        })
    }

    /// Returns when every rank has called it. Collective.
    pub fn barrier(&mut self) -> Result<()> {
        check(unsafe { sys::meshrun_barrier(self.handle, ptr::null_mut()) })
    }
}

/// The whole of `meshrun train` as one call in this process
/// (`meshrun_run_train`): this rank's model, strategy and schedule from the
/// runtime's config, the steps, validation, checkpoints and the export,
/// metrics.jsonl on rank 0.
pub struct Run<'a> {
    runtime: &'a mut Runtime,
    output_dir: Option<String>,
    on_step: Option<Box<dyn FnMut(&str) -> bool + 'a>>,
}

impl<'a> Run<'a> {
    pub fn new(runtime: &'a mut Runtime) -> Run<'a> {
        Run {
            runtime,
            output_dir: None,
            on_step: None,
        }
    }

    /// Where rank 0 writes; unset: runs/<start time>.
    pub fn output_dir(mut self, dir: &str) -> Run<'a> {
        self.output_dir = Some(dir.to_string());
        self
    }

    /// Called on every rank after each step with its metrics.jsonl object
    /// (JSON text; "mem" is this rank's). Returning false stops the run
    /// after that step on every rank. A panic in it stops the run too; it
    /// is reported as an INTERNAL error.
    pub fn on_step<F: FnMut(&str) -> bool + 'a>(mut self, on_step: F) -> Run<'a> {
        self.on_step = Some(Box::new(on_step));
        self
    }

    /// Trains until train.steps or until on_step stops it. Collective over
    /// the joined job; FAILED_PRECONDITION before join.
    pub fn train(mut self) -> Result<()> {
        let dir = match &self.output_dir {
            Some(dir) => Some(c_string(dir, "the output folder")?),
            None => None,
        };
        let dir_ptr = dir.as_ref().map_or(ptr::null(), |d| d.as_ptr());
        let mut state = StepState {
            on_step: self.on_step.take(),
            panicked: false,
        };
        let (callback, context): (sys::meshrun_step_callback, *mut c_void) =
            if state.on_step.is_some() {
                (
                    Some(step_trampoline),
                    &mut state as *mut StepState as *mut c_void,
                )
            } else {
                (None, ptr::null_mut())
            };
        check(unsafe { sys::meshrun_run_train(self.runtime.handle, dir_ptr, callback, context) })?;
        if state.panicked {
            return Err(Error {
                code: sys::MESHRUN_INTERNAL as i32,
                message: "the on_step callback panicked; the run stopped after that step"
                    .to_string(),
            });
        }
        Ok(())
    }
}

struct StepState<'a> {
    on_step: Option<Box<dyn FnMut(&str) -> bool + 'a>>,
    panicked: bool,
}

// Called by libmeshrun on the thread that called meshrun_run_train; a
// panic must not unwind into C.
unsafe extern "C" fn step_trampoline(context: *mut c_void, metrics_json: *const c_char) -> i32 {
    let state = &mut *(context as *mut StepState);
    if state.panicked {
        return 1;
    }
    let metrics = CStr::from_ptr(metrics_json).to_string_lossy();
    let on_step = state
        .on_step
        .as_mut()
        .expect("a trampoline is set with a callback only");
    match catch_unwind(AssertUnwindSafe(|| on_step(&metrics))) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(_) => {
            state.panicked = true;
            1
        }
    }
}

"""The example C model (examples/c_model) through the model ABI, as a host
drives it, from Python's ctypes and nothing else:

- its [model] config: defaults, and every bad value refused with
  INVALID_ARGUMENT and a message starting "model.<key>: ";
- init_parameter: the same values whatever the order, seed-dependent;
- the hooks in model.h's order (checked on every call): the root's pre_
  first and post_ last, parameter views only inside their unit, every
  parameter's gradient_ready once per backward, before its unit's post_;
- gradients against central finite differences of the loss;
- two pipeline stages with two microbatches in flight, against one stage;
- errors: a hook's error object comes back unchanged and the microbatch is
  dropped; calls out of order, bad tokens.

Usage: c_model_stage.py PLUGIN.so

Tolerances: the plugin computes in float32. A central difference with step
1e-2 of a float32 loss of about 5.5 carries a rounding error of about
5.5 * 6e-8 / 2e-2 ~ 2e-5 at worst, and a truncation error of step^2 / 6
times the third derivative; the largest difference measured is 5.4e-6 for
gradients of 0.02 .. 0.2, so an entry passes within 2e-5 + 0.1% of the
larger magnitude (a gradient off by 1% fails). The pipeline computes the
same float32 operations in the same order as one stage, so it must match
exactly.
"""

import ctypes as C
import json
import random
import sys
import unittest

PLUGIN = sys.argv[1] if len(sys.argv) > 1 else "meshrun_model_byte_mlp.so"
INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE, INTERNAL = 1, 3, 4, 7
KDL_INT, KDL_FLOAT, KDL_CPU = 0, 2, 1


class Error(C.Structure):
    pass


ERROR_DESTROY = C.CFUNCTYPE(None, C.POINTER(Error))
Error._fields_ = [("struct_size", C.c_size_t), ("code", C.c_int32),
                  ("message", C.c_char_p), ("destroy", ERROR_DESTROY)]
ERR = C.c_void_p  # meshrun_error*, as an address


class DLTensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("device_type", C.c_int32), ("device_id", C.c_int32),
                ("ndim", C.c_int32), ("code", C.c_uint8), ("bits", C.c_uint8),
                ("lanes", C.c_uint16), ("shape", C.POINTER(C.c_int64)),
                ("strides", C.POINTER(C.c_int64)), ("byte_offset", C.c_uint64)]


LOG = C.CFUNCTYPE(None, C.c_void_p, C.c_int32, C.c_char_p)
MAKE_ERROR = C.CFUNCTYPE(ERR, C.c_void_p, C.c_int32, C.c_char_p)
ALLOCATE = C.CFUNCTYPE(C.c_void_p, C.c_void_p, C.c_size_t, C.c_size_t)
DEALLOCATE = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p)


class HostServices(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("abi_major", C.c_int32), ("abi_minor", C.c_int32),
                ("context", C.c_void_p), ("log", LOG), ("make_error", MAKE_ERROR),
                ("allocate", ALLOCATE), ("deallocate", DEALLOCATE), ("extensions", C.c_void_p)]


UNIT_TENSOR = C.CFUNCTYPE(ERR, C.c_void_p, C.c_int32, C.POINTER(DLTensor))
UNIT = C.CFUNCTYPE(ERR, C.c_void_p, C.c_int32)
PARAMETER_READY = C.CFUNCTYPE(ERR, C.c_void_p, C.c_int64)
PARAMETER_VIEWS = C.CFUNCTYPE(ERR, C.c_void_p, C.c_int64, C.POINTER(DLTensor),
                              C.POINTER(DLTensor))


class Hooks(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("context", C.c_void_p),
                ("pre_forward", UNIT_TENSOR), ("post_forward", UNIT_TENSOR),
                ("pre_backward", UNIT), ("post_backward", UNIT),
                ("gradient_ready", PARAMETER_READY), ("parameter", PARAMETER_VIEWS),
                ("extensions", C.c_void_p)]


class StageSetup(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("num_modules", C.c_int64),
                ("modules", C.POINTER(C.c_char_p)), ("hooks", C.POINTER(Hooks)),
                ("comm", C.c_void_p), ("tp", C.c_void_p), ("cp", C.c_void_p),
                ("ep", C.c_void_p), ("plan_json", C.c_char_p), ("options_json", C.c_char_p),
                ("extensions", C.c_void_p)]


P = C.c_void_p
I64P = C.POINTER(C.c_int64)
T = C.POINTER(DLTensor)


class ModelApi(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("model_type", C.c_char_p),
                ("config_keys", C.POINTER(C.c_char_p)), ("extensions", P),
                ("model_create", C.CFUNCTYPE(ERR, P, C.c_char_p, C.POINTER(P))),
                ("model_destroy", C.CFUNCTYPE(None, P)),
                ("describe", C.CFUNCTYPE(ERR, P, C.POINTER(C.c_void_p))),
                ("init_parameter", C.CFUNCTYPE(ERR, P, C.c_uint64, C.c_int64, T)),
                ("stage_create", C.CFUNCTYPE(ERR, P, C.POINTER(StageSetup), C.POINTER(P))),
                ("stage_destroy", C.CFUNCTYPE(None, P)),
                ("set_shape", C.CFUNCTYPE(ERR, P, C.c_int64, C.c_int64, I64P, I64P)),
                ("forward", C.CFUNCTYPE(ERR, P, C.c_int32, T, T, T, T, C.POINTER(C.c_double))),
                ("backward", C.CFUNCTYPE(ERR, P, C.c_int32, C.c_float, T, T)),
                ("backward_input", P), ("backward_weight", P),
                ("discard", C.CFUNCTYPE(ERR, P, C.c_int32)),
                ("activation_bytes", C.CFUNCTYPE(ERR, P, I64P))]


class PluginApi(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("abi_major", C.c_int32), ("abi_minor", C.c_int32),
                ("kind", C.c_int32), ("name", C.c_char_p), ("version", C.c_char_p),
                ("description", C.c_char_p),
                ("create", C.CFUNCTYPE(ERR, C.POINTER(HostServices), C.POINTER(P))),
                ("destroy", C.CFUNCTYPE(None, P)), ("strategy", P), ("schedule", P),
                ("sidecar", P), ("comm", P), ("extensions", P), ("model", C.POINTER(ModelApi))]


class PluginError(Exception):
    def __init__(self, code, message, address):
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.address = code, message, address


class Host:
    """Host services whose errors and memory are tracked, so that a test can
    tell an error object it made from one the plugin made, and find leaks."""

    def __init__(self):
        libc = C.CDLL(None)
        libc.aligned_alloc.restype = C.c_void_p
        libc.aligned_alloc.argtypes = [C.c_size_t, C.c_size_t]
        libc.free.argtypes = [C.c_void_p]
        self.errors, self.blocks = {}, set()

        def make_error(_, code, message):
            error = Error(C.sizeof(Error), code, message, self._destroy)
            self.errors[C.addressof(error)] = error
            return C.addressof(error)

        def allocate(_, size, alignment):
            address = libc.aligned_alloc(alignment, (size + alignment - 1) // alignment * alignment)
            self.blocks.add(address)
            return address

        def deallocate(_, address):
            if address:
                self.blocks.remove(address)
                libc.free(address)

        def destroy(error):
            del self.errors[C.addressof(error.contents)]

        self._destroy = ERROR_DESTROY(destroy)
        self.table = HostServices(C.sizeof(HostServices), 1, 5, None, LOG(lambda *_: None),
                                  MAKE_ERROR(make_error), ALLOCATE(allocate),
                                  DEALLOCATE(deallocate), None)

    def check(self, address):
        """Raises PluginError for an error address, releasing the error."""
        if not address:
            return
        error = Error.from_address(address)
        code, message = error.code, error.message.decode()
        error.destroy(C.cast(address, C.POINTER(Error)))
        raise PluginError(code, message, address)


class Plugin:
    def __init__(self, path):
        self.library = C.CDLL(path)
        self.library.meshrun_plugin_get_api.restype = C.POINTER(PluginApi)
        self.table = self.library.meshrun_plugin_get_api().contents
        self.api = self.table.model.contents
        self.host = Host()
        instance = P()
        self.host.check(self.table.create(C.byref(self.host.table), C.byref(instance)))
        self.instance = instance

    def model(self, config):
        handle = P()
        self.host.check(self.api.model_create(self.instance, json.dumps(config).encode(),
                                              C.byref(handle)))
        return Model(self, handle)


def float_tensor(array, shape):
    dims = (C.c_int64 * len(shape))(*shape)
    return DLTensor(C.cast(array, C.c_void_p), KDL_CPU, 0, len(shape), KDL_FLOAT, 32, 1, dims,
                    None, 0), dims


class Model:
    def __init__(self, plugin, handle):
        self.plugin, self.api, self.handle = plugin, plugin.api, handle
        text = C.c_void_p()
        plugin.host.check(self.api.describe(handle, C.byref(text)))
        self.description = json.loads(C.string_at(text.value).decode())
        plugin.host.table.deallocate(None, text.value)
        self.parameters = self.description["parameters"]
        self.units = self.description["units"]
        self.unit_of = [self.units.index(p["unit"]) for p in self.parameters]

    def numel(self, p):
        n = 1
        for extent in self.parameters[p]["shape"]:
            n *= extent
        return n

    def init(self, seed, order=None):
        values = [None] * len(self.parameters)
        for p in order if order is not None else range(len(self.parameters)):
            array = (C.c_float * self.numel(p))()
            tensor, _dims = float_tensor(array, self.parameters[p]["shape"])
            self.plugin.host.check(self.api.init_parameter(self.handle, seed, p, C.byref(tensor)))
            values[p] = array
        return values

    def destroy(self):
        self.api.model_destroy(self.handle)


class Stage:
    """A stage of some modules over host storage, with hooks that check
    model.h's order on every call: a breach goes back to the plugin as the
    hook's error, and so comes out of the stage's call."""

    def __init__(self, model, modules, values, grads):
        self.model, self.api, self.host = model, model.api, model.plugin.host
        self.values, self.grads = values, grads
        index = {p["name"]: i for i, p in enumerate(model.parameters)}
        self.held = {index[name] for module in model.description["modules"]
                     if module["name"] in modules for name in module["parameters"]}
        self.held_units = {model.unit_of[p] for p in self.held}
        self.root = len(model.units) - 1
        self.entered, self.backward, self.ready = [], False, set()
        self.shape, self.hidden_numel = (0, 0), 0
        self.fail_on = None  # (hook name, unit or parameter): return an error there
        self.made_error = None
        self._keep = []

        def hook(name, body):
            def call(_, which, *rest):
                if self.fail_on == (name, which):
                    address = self.host.table.make_error(None, INTERNAL, b"injected")
                    self.made_error = address
                    return address
                try:
                    body(which, *rest)
                except AssertionError as e:
                    return self.host.table.make_error(None, INTERNAL, str(e).encode())
                return None
            return call

        def pre(unit, tensor=None):
            assert unit in self.held_units, f"pre hook of unit {unit}, which the stage lacks"
            assert unit not in self.entered, f"unit {unit} entered twice"
            if self.held_units != {unit} and self.root in self.held_units:
                assert (unit == self.root) == (not self.entered), "the root's pre_ comes first"
            if tensor is not None:
                expect_tensor(unit, tensor)
            self.entered.append(unit)

        def post(unit, tensor=None):
            assert self.entered and self.entered[-1] == unit, f"post of {unit}: {self.entered}"
            if tensor is not None:
                expect_tensor(unit, tensor)
            if self.backward:
                missing = [p for p in self.held if self.model.unit_of[p] == unit
                           and p not in self.ready]
                assert not missing, f"post_backward({unit}) before gradient_ready of {missing}"
            self.entered.pop()

        def expect_tensor(unit, tensor):
            is_root = unit == self.root
            assert bool(tensor) != is_root, f"unit {unit}: hidden states given {bool(tensor)}"
            if tensor:
                t = tensor.contents
                n = 1
                for d in range(t.ndim):
                    n *= t.shape[d]
                assert (t.code, t.bits, n) == (KDL_FLOAT, 32, self.hidden_numel), "hidden"

        def ready(p):
            assert self.backward and p in self.held, f"gradient_ready({p}) outside a backward"
            assert p not in self.ready, f"gradient_ready({p}) twice in one backward"
            assert self.model.unit_of[p] in self.entered, f"gradient_ready({p}) outside its unit"
            self.ready.add(p)

        def parameter(p, value, gradient):
            assert p in self.held, f"parameter {p} is not the stage's"
            assert self.model.unit_of[p] in self.entered, f"parameter {p} outside its unit"
            shape = self.model.parameters[p]["shape"]
            if value:
                value[0], dims = float_tensor(self.values[p], shape)
                self._keep.append(dims)
            if gradient:
                gradient[0], dims = float_tensor(self.grads[p] if self.backward else None, shape)
                self._keep.append(dims)

        self.hooks = Hooks(C.sizeof(Hooks), None,
                           UNIT_TENSOR(hook("pre_forward", pre)),
                           UNIT_TENSOR(hook("post_forward", post)),
                           UNIT(hook("pre_backward", pre)), UNIT(hook("post_backward", post)),
                           PARAMETER_READY(hook("gradient_ready", ready)),
                           PARAMETER_VIEWS(hook("parameter", parameter)), None)
        names = (C.c_char_p * len(modules))(*[m.encode() for m in modules])
        setup = StageSetup(C.sizeof(StageSetup), len(modules), names, C.pointer(self.hooks),
                           None, None, None, None, b"{}", b"{}", None)
        handle = P()
        self.host.check(self.api.stage_create(model.handle, C.byref(setup), C.byref(handle)))
        self.handle = handle

    def set_shape(self, batch, seq_len):
        numel_in, numel_out = C.c_int64(), C.c_int64()
        self.host.check(self.api.set_shape(self.handle, batch, seq_len, C.byref(numel_in),
                                           C.byref(numel_out)))
        self.shape, self.hidden_numel = (batch, seq_len), batch * seq_len * self.model_hidden()
        return numel_in.value, numel_out.value

    def model_hidden(self):
        return self.model.description["config"]["hidden_size"]

    def ids(self, values):
        array = (C.c_int32 * len(values))(*values)
        dims = (C.c_int64 * 2)(*self.shape)
        self._keep += [array, dims]
        return DLTensor(C.cast(array, C.c_void_p), KDL_CPU, 0, 2, KDL_INT, 32, 1, dims, None, 0)

    def hidden(self, array):
        if array is None:
            return None
        tensor, dims = float_tensor(array, [len(array)])
        self._keep.append(dims)
        return C.pointer(tensor)

    def forward(self, mb, tokens, targets, input=None, output=None):
        loss = C.c_double()
        self.backward = False
        t, g = self.ids(tokens), self.ids(targets)
        self.host.check(self.api.forward(self.handle, mb, C.byref(t), C.byref(g),
                                         self.hidden(input), self.hidden(output),
                                         C.byref(loss)))
        assert not self.entered, f"units left entered after forward: {self.entered}"
        return loss.value

    def run_backward(self, mb, scale=1.0, grad_output=None, grad_input=None):
        self.backward, self.ready = True, set()
        try:
            self.host.check(self.api.backward(self.handle, mb, scale, self.hidden(grad_output),
                                              self.hidden(grad_input)))
        finally:
            self.backward = False
        assert not self.entered, f"units left entered after backward: {self.entered}"
        assert self.ready == self.held, f"not announced: {sorted(self.held - self.ready)}"

    def activation_bytes(self):
        out = C.c_int64()
        self.host.check(self.api.activation_bytes(self.handle, C.byref(out)))
        return out.value

    def destroy(self):
        self.api.stage_destroy(self.handle)


CONFIG = {"hidden_size": 6, "intermediate_size": 10, "num_layers": 2, "initializer_range": 0.5}
BATCH, SEQ = 2, 5


def batch(seed):
    rng = random.Random(seed)
    data = [rng.randrange(256) for _ in range(BATCH * SEQ + 1)]
    return data[:-1], data[1:]


def zeros(model):
    return [(C.c_float * model.numel(p))() for p in range(len(model.parameters))]


class CModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.plugin = Plugin(PLUGIN)

    def tearDown(self):
        # Whatever a test made, the plugin gave back: only the instance is left.
        self.assertEqual(len(self.plugin.host.blocks), 1)
        self.assertEqual(self.plugin.host.errors, {})

    def assert_refused(self, config, code, prefix):
        with self.assertRaises(PluginError) as caught:
            self.plugin.model(config).destroy()
        self.assertEqual(caught.exception.code, code, caught.exception.message)
        self.assertTrue(caught.exception.message.startswith(prefix), caught.exception.message)

    def test_config(self):
        model = self.plugin.model({})
        config = model.description["config"]
        self.assertEqual((config["hidden_size"], config["intermediate_size"],
                          config["num_layers"], config["initializer_range"]), (64, 256, 2, 0.02))
        self.assertEqual(model.units, ["blocks.0", "blocks.1", "root"])
        self.assertEqual([m["name"] for m in model.description["modules"]],
                         ["embed", "blocks.0", "blocks.1", "head"])
        model.destroy()
        bad = [({"hidden_size": 0}, "model.hidden_size: expected an integer in [1, 16384], got 0"),
               ({"hidden_size": "64"}, "model.hidden_size: expected an integer"),
               ({"num_layers": 1.5}, "model.num_layers: "),
               ({"num_layers": 10**30}, "model.num_layers: "),
               ({"intermediate_size": None}, "model.intermediate_size: "),
               ({"initializer_range": -1}, "model.initializer_range: expected a number in (0, 1]"),
               ({"initializer_range": [1]}, "model.initializer_range: "),
               ({"hidden_sise": 8}, "model.hidden_sise: unknown key")]
        for config, prefix in bad:
            with self.subTest(config=config):
                self.assert_refused(config, INVALID_ARGUMENT, prefix)
        for text in ["", "[]", "{", '{"hidden_size": 8,}', '{"hidden_size" 8}',
                     '{"hidden_size": 08}', '{"hidden_size": 8} x', '{"a\\q": 1}']:
            with self.subTest(text=text):
                handle = P()
                with self.assertRaises(PluginError) as caught:
                    self.plugin.host.check(self.plugin.api.model_create(
                        self.plugin.instance, text.encode(), C.byref(handle)))
                self.assertEqual(caught.exception.code, INVALID_ARGUMENT)
                self.assertTrue(caught.exception.message.startswith("model: the config is not"),
                                caught.exception.message)

    def test_init_is_per_parameter(self):
        model = self.plugin.model(CONFIG)
        forward = model.init(7)
        backward = model.init(7, order=reversed(range(len(model.parameters))))
        other = model.init(8)
        for p in range(len(model.parameters)):
            self.assertEqual(list(forward[p]), list(backward[p]))
        self.assertNotEqual(list(forward[0]), list(other[0]))
        self.assertTrue(all(v == 0 for v in forward[3]))  # blocks.0.fc1.bias
        model.destroy()

    def loss_and_gradients(self, model, values, tokens, targets):
        grads = zeros(model)
        stage = Stage(model, [m["name"] for m in model.description["modules"]], values, grads)
        stage.set_shape(BATCH, SEQ)
        loss = stage.forward(0, tokens, targets)
        self.assertGreater(stage.activation_bytes(), 0)
        stage.run_backward(0)
        self.assertEqual(stage.activation_bytes(), 0)
        stage.destroy()
        return loss, grads

    def test_gradients_match_finite_differences(self):
        model = self.plugin.model(CONFIG)
        values = model.init(3)
        tokens, targets = batch(1)
        _, grads = self.loss_and_gradients(model, values, tokens, targets)
        stage = Stage(model, [m["name"] for m in model.description["modules"]], values,
                      zeros(model))
        stage.set_shape(BATCH, SEQ)

        def loss():
            value = stage.forward(0, tokens, targets)
            stage.api.discard(stage.handle, 0)
            return value

        rng = random.Random(5)
        step = 1e-2
        used_rows = sorted(set(tokens))
        for p, parameter in enumerate(model.parameters):
            # The largest gradients, a few anywhere (most rows of an
            # embedding are unused: their gradient is 0 and must stay so),
            # and a few in the rows of the batch's bytes.
            n, shape = model.numel(p), parameter["shape"]
            order = sorted(range(n), key=lambda i: -abs(grads[p][i]))
            picked = order[:6] + rng.sample(range(n), min(n, 6))
            if shape[0] == 256 and len(shape) == 2:
                picked += [rng.choice(used_rows) * shape[1] + rng.randrange(shape[1])
                           for _ in range(6)]
            for i in sorted(set(picked)):
                saved = values[p][i]
                values[p][i] = saved + step
                up = loss()
                values[p][i] = saved - step
                down = loss()
                values[p][i] = saved
                numeric = (up - down) / (2 * step)
                analytic = grads[p][i]
                with self.subTest(parameter=parameter["name"], element=i):
                    self.assertLessEqual(abs(analytic - numeric),
                                         2e-5 + 1e-3 * max(abs(analytic), abs(numeric)),
                                         f"analytic {analytic} numeric {numeric}")
        stage.destroy()
        model.destroy()

    def test_pipeline_stages_match_one_stage(self):
        model = self.plugin.model(CONFIG)
        values = model.init(11)
        batches = [batch(20), batch(21)]
        # Both microbatches in flight, then their backward in reverse: the
        # order of the gradient sums is the pipeline's.
        whole = zeros(model)
        one = Stage(model, ["embed", "blocks.0", "blocks.1", "head"], values, whole)
        one.set_shape(BATCH, SEQ)
        losses = [one.forward(mb, tokens, targets) for mb, (tokens, targets) in enumerate(batches)]
        for mb in (1, 0):
            one.run_backward(mb, 0.5)
        one.destroy()

        split = zeros(model)
        first = Stage(model, ["embed", "blocks.0"], values, split)
        last = Stage(model, ["blocks.1", "head"], values, split)
        hidden = BATCH * SEQ * CONFIG["hidden_size"]
        self.assertEqual(first.set_shape(BATCH, SEQ), (0, hidden))
        self.assertEqual(last.set_shape(BATCH, SEQ), (hidden, 0))
        boundary = [(C.c_float * hidden)() for _ in batches]
        piped = []
        for mb, (tokens, targets) in enumerate(batches):
            first.forward(mb, tokens, targets, output=boundary[mb])
            piped.append(last.forward(mb, tokens, targets, input=boundary[mb]))
        self.assertGreater(first.activation_bytes(), 0)
        with self.assertRaises(PluginError) as caught:
            first.set_shape(BATCH + 1, SEQ)
        self.assertEqual(caught.exception.code, FAILED_PRECONDITION)
        for mb in (1, 0):
            grad = (C.c_float * hidden)()
            last.run_backward(mb, 0.5, grad_input=grad)
            first.run_backward(mb, 0.5, grad_output=grad)
        self.assertEqual((first.activation_bytes(), last.activation_bytes()), (0, 0))
        self.assertEqual(losses, piped)
        for p in range(len(model.parameters)):
            self.assertEqual(list(whole[p]), list(split[p]), model.parameters[p]["name"])
        first.destroy()
        last.destroy()
        model.destroy()

    def test_errors(self):
        model = self.plugin.model(CONFIG)
        values, grads = model.init(1), zeros(model)
        stage = Stage(model, ["embed", "blocks.0", "blocks.1", "head"], values, grads)
        tokens, targets = batch(2)
        with self.assertRaises(PluginError) as caught:
            stage.forward(0, tokens, targets)
        self.assertEqual(caught.exception.code, FAILED_PRECONDITION)  # before set_shape
        stage.set_shape(BATCH, SEQ)
        for hook, which in [("pre_forward", 1), ("parameter", 0), ("post_forward", 2)]:
            with self.subTest(hook=hook):
                stage.fail_on, stage.entered = (hook, which), []
                with self.assertRaises(PluginError) as caught:
                    stage.forward(0, tokens, targets)
                self.assertEqual(caught.exception.address, stage.made_error)
                self.assertEqual(stage.activation_bytes(), 0)  # the microbatch was dropped
        stage.fail_on, stage.entered = ("gradient_ready", 2), []
        stage.forward(0, tokens, targets)
        with self.assertRaises(PluginError) as caught:
            stage.run_backward(0)
        self.assertEqual(caught.exception.address, stage.made_error)
        self.assertEqual(stage.activation_bytes(), 0)
        stage.fail_on, stage.entered = None, []
        cases = [(lambda: stage.run_backward(5), FAILED_PRECONDITION),
                 (lambda: stage.host.check(stage.api.discard(stage.handle, 5)),
                  FAILED_PRECONDITION),
                 (lambda: stage.forward(0, [256] + tokens[1:], targets), OUT_OF_RANGE),
                 (lambda: stage.forward(0, tokens, targets[:-1] + [-1]), OUT_OF_RANGE)]
        for call, code in cases:
            with self.assertRaises(PluginError) as caught:
                call()
            self.assertEqual(caught.exception.code, code, caught.exception.message)
        stage.forward(3, tokens, targets)
        with self.assertRaises(PluginError) as caught:
            stage.forward(3, tokens, targets)
        self.assertEqual(caught.exception.code, FAILED_PRECONDITION)
        stage.destroy()  # with microbatch 3 in flight
        for modules in (["blocks.0", "embed"], ["blocks.2"], ["embed", "blocks.1"]):
            with self.subTest(modules=modules), self.assertRaises(PluginError) as caught:
                Stage(model, modules, values, grads)
            self.assertEqual(caught.exception.code, INVALID_ARGUMENT)
        model.destroy()



if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)

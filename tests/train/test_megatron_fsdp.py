"""`meshrun train` with distributed.strategy = "megatron_fsdp": each
zero_dp_strategy (0, 1, 2, 3) on 2 and 4 ranks, and with tp = 2, against
DDP on the same ranks and global batch, and as one bucket; the overlap
switches, double buffering and activation checkpointing; shards started
by their ranks (init_fsdp_with_meta_device); checkpoints that cross to
fsdp2 and back; report_nan_in_param_grad; bad input.

Run by ctest: test_megatron_fsdp.py MESHRUN_EXE [TestClass ...]

Every run computes in float32 (megatron_fsdp gathers and reduces in the
models' dtype; DDP too). The ZeRO levels change where gradients are summed:
a reduce-scatter (average) per micro-batch (2, 3), once per step over
accumulated whole gradients (1), or an all-reduce per unit once per step
(0), against DDP's bucketed all-reduce. These
are ~1e-7 relative roundings carried through a few AdamW steps, so losses,
gradient norms and validation losses agree to test_train.py's 1e-4
relative, and exported weights to 1e-4 absolute (as test_tensor_parallel.py
states for the same steps). The overlap switches change when collectives
start, not what they sum or in which order the results are added, so runs
with them off are bit-identical to runs with them on; double buffering
changes only where gathered units are held, so it is bit-identical too. average_in_collective
= false (the default) scales each rank's gradients by 1/dp and sums; on 2
and 4 ranks that is exact and gives the bits of averaging, on 3 it rounds.
"""

import json
import math
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
from fsdp2_memory import predicted_peak_buffers, unit_sizes  # noqa: E402
from meshrun_testing import InputErrorAssertions  # noqa: E402
from test_tensor_parallel import TensorParallelTest, grad_norms, val_losses  # noqa: E402
from test_train import MESHRUN, Runs, TrainTest, losses, metrics, run  # noqa: E402

MEGATRON = ("distributed.strategy=megatron_fsdp",)
DDP = ("distributed.strategy=ddp",)
FSDP2_FP32 = ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32")


def persistent(memory):
    return memory["params"] + memory["grads"] + memory["optimizer"]


def plan_json(config, nproc, *overrides):
    return json.loads(subprocess.run(
        [MESHRUN, "plan", config, "--world-size", str(nproc), "--json", *overrides],
        check=True, capture_output=True, text=True).stdout)


def zero(level):
    return MEGATRON + (f"distributed.zero_dp_strategy={level}",)


class MegatronTest(TensorParallelTest):
    """assert_matches / assert_same_weights against DDP on the same ranks."""

    @classmethod
    def setUpClass(cls):
        cls.runs = Runs()
        cls.ddp = {n: cls.runs.train(f"ddp{n}", n, *DDP) for n in (2, 4)}
        cls.ddp_memory = metrics(cls.ddp[4])[-1]["mem"]

    def assert_trains_as_ddp(self, name, nproc, *overrides):
        output = self.runs.train(name, nproc, *overrides)
        self.assert_matches(self.ddp[nproc], output)
        self.assert_same_weights(self.ddp[nproc], output)
        return output


class Equivalence(MegatronTest):
    def test_every_zero_level_matches_ddp_on_2_and_4_ranks(self):
        for level in (0, 1, 2, 3):
            for nproc in (2, 4):
                with self.subTest(zero=level, ranks=nproc):
                    self.assert_trains_as_ddp(f"zero{level}-{nproc}", nproc, *zero(level))

    def test_one_bucket_matches_ddp_and_holds_what_its_schedule_predicts(self):
        # disable_bucketing: one all-gather and one reduction of every unit
        # per micro-batch, which the walk predicts as a model of one unit.
        plan = plan_json(self.runs.config, 4, *MEGATRON)
        sizes = unit_sizes(plan, 4)
        total = sum(full for _, full, _ in sizes)
        merged = [("root", total, -(-total // 4))]
        for level in (1, 3):
            with self.subTest(zero=level):
                output = self.assert_trains_as_ddp(f"one-bucket-{level}", 4, *zero(level),
                                                   "distributed.disable_bucketing=true")
                memory = metrics(output)[-1]["mem"]
                low, high = (predicted_peak_buffers(
                    merged, 4, 4, 4, 1, 1, progress, keep_gathered=level < 3,
                    defer=level <= 1) for progress in ("asap", "serial"))
                self.assertLessEqual(low, memory["buffers_peak"])
                self.assertLessEqual(memory["buffers_peak"], high)

    def test_zero3_with_tp2_matches_ddp(self):
        self.assert_trains_as_ddp("zero3-tp2", 4, *zero(3), "distributed.tp_size=2")

    def test_every_level_holds_what_its_schedule_predicts(self):
        # Two micro-batches per rank, so that ZeRO-1's whole gradients
        # accumulate. The master weights, their gradients and AdamW's state
        # are sharded at every level (1/4 of DDP's, up to the padding of
        # 4 shards). What a step holds beyond them (mem.buffers_peak: gathered
        # parameters, unit gradients, collective buffers) is predicted by
        # walking the step's hooks with the level's rules
        # (tests/bench/fsdp2_memory.py): at least what it holds when every
        # collective completes by the next hook, at most what it holds when
        # they complete no sooner than the comm backend's one-at-a-time order
        # makes certain.
        for level, double_buffer in ((0, False), (1, False), (2, False), (3, False), (3, True)):
            with self.subTest(zero=level, double_buffer=double_buffer):
                plan = plan_json(self.runs.config, 4, *zero(level))
                output = self.runs.train(f"memory-zero{level}-{double_buffer}", 4, *zero(level),
                                         "train.micro_batch_size=1",
                                         f"distributed.fsdp_double_buffer={str(double_buffer).lower()}")
                memory = metrics(output)[-1]["mem"]
                # What `meshrun plan` predicted, exactly; ZeRO-0 replicates
                # everything over the 4 ranks, as DDP does.
                ranks = 1 if level == 0 else 4
                self.assertEqual(plan["memory"]["sharded_over"], ranks)
                self.assertEqual(persistent(memory), persistent(plan["memory"]))
                self.assertLessEqual(persistent(memory),
                                     1.02 * persistent(self.ddp_memory) / ranks)
                low, high = (predicted_peak_buffers(
                    unit_sizes(plan, ranks), ranks, 4, 4, 1, 1, progress,
                    keep_gathered=level < 3, micro_batches=2, defer=level <= 1,
                    replicas=4 // ranks, double_buffer=double_buffer)
                    for progress in ("asap", "serial"))
                self.assertLessEqual(low, memory["buffers_peak"])
                self.assertLessEqual(memory["buffers_peak"], high)

    def test_averaging_in_the_collective_or_before_it_both_match_ddp(self):
        # On 3 ranks 1/3 rounds: scaling each rank's gradients before a sum
        # and averaging the sum give different bits, both within tolerance
        # of DDP (which averages in its all-reduce).
        batch = ("train.global_batch_size=6",)
        ddp = self.runs.train("ddp3", 3, *DDP, *batch)
        exports = []
        for average in ("true", "false"):
            output = self.runs.train(f"average-{average}", 3, *zero(3), *batch,
                                     f"distributed.average_in_collective={average}")
            self.assert_matches(ddp, output)
            self.assert_same_weights(ddp, output)
            with open(os.path.join(output, "model.safetensors"), "rb") as f:
                exports.append(f.read())
        self.assertNotEqual(exports[0], exports[1])

    def test_double_buffering_changes_nothing_but_where_units_are_gathered(self):
        plan = plan_json(self.runs.config, 2, *MEGATRON)
        largest_layer = max(2 * chunk for name, _, chunk in unit_sizes(plan, 2) if name != "root")
        double_plan = plan_json(self.runs.config, 2, *zero(3), "distributed.fsdp_double_buffer=true")
        single = self.runs.train("single-buffer", 2, *zero(3))
        double = self.runs.train("double-buffer", 2, *zero(3), "distributed.fsdp_double_buffer=true")
        self.assertEqual(losses(single), losses(double))
        self.assertEqual(grad_norms(single), grad_norms(double))
        with open(os.path.join(single, "model.safetensors"), "rb") as a, \
                open(os.path.join(double, "model.safetensors"), "rb") as b:
            self.assertEqual(a.read(), b.read())
        # After a step (the first: no validation forward has gathered units
        # since) every unit is freed but the two buffers, held from setup on.
        # `meshrun plan` predicted both.
        self.assertEqual(metrics(single)[0]["mem"]["buffers"], 0)
        self.assertEqual(plan["memory"]["buffers_held"], 0)
        self.assertEqual(metrics(double)[0]["mem"]["buffers"], 2 * 4 * largest_layer)
        self.assertEqual(double_plan["memory"]["buffers_held"], 2 * 4 * largest_layer)

    def test_activation_checkpointing_changes_nothing_but_the_activations_held(self):
        # A checkpointed layer's backward gathers the unit (ZeRO-3) and
        # recomputes its forward from the same parameters: the same bits.
        for level in (1, 3):
            kept = self.runs.train(f"ac-none-{level}", 2, *zero(level))
            for mode in ("full", "selective"):
                with self.subTest(zero=level, mode=mode):
                    recomputed = self.runs.train(f"ac-{mode}-{level}", 2, *zero(level),
                                                 f"distributed.activation_checkpointing={mode}")
                    self.assertEqual(losses(kept), losses(recomputed))
                    self.assertEqual(grad_norms(kept), grad_norms(recomputed))
                    with open(os.path.join(kept, "model.safetensors"), "rb") as a, \
                            open(os.path.join(recomputed, "model.safetensors"), "rb") as b:
                        self.assertEqual(a.read(), b.read())
                    self.assertLess(metrics(recomputed)[-1]["mem"]["activations_peak"],
                                    metrics(kept)[-1]["mem"]["activations_peak"])

    def test_overlap_off_changes_nothing(self):
        for level in (1, 3):
            with self.subTest(zero=level):
                on = self.runs.train(f"overlap-on-{level}", 2, *zero(level))
                off = self.runs.train(f"overlap-off-{level}", 2, *zero(level),
                                      "distributed.overlap_grad_reduce=false",
                                      "distributed.overlap_param_gather=false")
                self.assertEqual(losses(on), losses(off))
                self.assertEqual(grad_norms(on), grad_norms(off))
                self.assertEqual(val_losses(on), val_losses(off))
                with open(os.path.join(on, "model.safetensors"), "rb") as a, \
                        open(os.path.join(off, "model.safetensors"), "rb") as b:
                    self.assertEqual(a.read(), b.read())


class Checkpoints(MegatronTest):
    """megatron_fsdp shards as fsdp2 does, so their checkpoints cross."""

    def resume(self, name, nproc, saved, *overrides):
        return self.runs.train(name, nproc, *overrides,
                               f"checkpoint.resume_from={os.path.join(saved, 'checkpoints', 'step_2')}")

    def test_megatron_on_4_ranks_resumes_with_fsdp2_on_2_and_back(self):
        saved = self.runs.train("zero3-saving", 4, *zero(3), "checkpoint.save_every=2")
        self.assert_close(losses(saved)[2:],
                          losses(self.resume("fsdp2-from-zero3", 2, saved, *FSDP2_FP32)))
        fsdp2 = self.runs.train("fsdp2-saving", 2, *FSDP2_FP32, "checkpoint.save_every=2")
        self.assert_close(losses(fsdp2)[2:],
                          losses(self.resume("zero1-from-fsdp2", 4, fsdp2, *zero(1))))
        # The consolidated export of one checkpoint is the same bytes under either strategy.
        exports = [self.resume(f"export-{name}", nproc, saved, *overrides, "train.steps=2")
                   for name, nproc, overrides in (("zero3", 4, zero(3)), ("fsdp2", 2, FSDP2_FP32))]
        with open(os.path.join(exports[0], "model.safetensors"), "rb") as a, \
                open(os.path.join(exports[1], "model.safetensors"), "rb") as b:
            self.assertEqual(a.read(), b.read())


def same_bytes(test, a, b, name):
    with open(os.path.join(a, name), "rb") as x, open(os.path.join(b, name), "rb") as y:
        test.assertEqual(x.read(), y.read())


class MetaDeviceInit(MegatronTest):
    """init_fsdp_with_meta_device = true: each rank starts only its shard."""

    META = ("distributed.init_fsdp_with_meta_device=true",)

    def test_shards_started_by_their_ranks_train_bit_for_bit_as_the_whole_model(self):
        # A parameter's initial values do not depend on which others a rank
        # makes, and a checkpoint's are read whole: a shard started by its
        # rank holds the bits it would take from the whole model.
        cases = (("zero3", 4, zero(3)), ("zero1", 2, zero(1)),
                 ("zero3-tp2", 4, zero(3) + ("distributed.tp_size=2",)),
                 ("zero3-from-export", 2, zero(3) + (f"model.checkpoint={self.ddp[2]}",)))
        for name, nproc, overrides in cases:
            with self.subTest(name):
                whole = self.runs.train(f"whole-{name}", nproc, *overrides)
                by_shard = self.runs.train(f"by-shard-{name}", nproc, *overrides, *self.META)
                self.assertEqual(losses(whole), losses(by_shard))
                self.assertEqual(grad_norms(whole), grad_norms(by_shard))
                same_bytes(self, whole, by_shard, "model.safetensors")

    def test_no_rank_holds_the_whole_model_at_start(self):
        # A model of 26 MB, so that what starting holds shows in the peak
        # RSS. Started whole, each rank holds the weights and a gradient
        # buffer of the whole model (2 x) until the strategy took its shard
        # (a quarter, and its gradients); started by shard, the shard and
        # one parameter at a time: about 1.5 x the model's bytes less.
        larger = ("model.hidden_size=256", "model.intermediate_size=768",
                  "model.num_hidden_layers=8", "train.steps=1", "train.val_every=0",
                  "train.global_batch_size=4", "train.micro_batch_size=1")
        plan = plan_json(self.runs.config, 4, *zero(3), *larger)
        model_bytes = 4 * sum(math.prod(p["shape"]) for p in plan["model"]["parameters"])
        starts = [metrics(self.runs.train(name, 4, *zero(3), *larger, *meta))[0]["mem"]
                  ["peak_rss_at_start"] for name, meta in (("start-whole", ()),
                                                           ("start-by-shard", self.META))]
        self.assertGreaterEqual(starts[0] - starts[1], model_bytes, starts)


class Faults(TrainTest):
    def test_a_gradient_that_is_not_finite_is_named_with_its_rank_before_reduction(self):
        # train.lr = 1e30 makes step 2's gradients overflow (test_faults.py).
        result = run(self.runs.config, "--nproc-per-node", "2", "--output",
                     os.path.join(self.runs.root, "nan"), *zero(3), "train.lr=1e30",
                     "train.steps=4", "distributed.report_nan_in_param_grad=true",
                     "distributed.check_for_nan_in_grad=true")
        self.assertEqual(result.returncode, 3, result.stderr)
        self.assertRegex(result.stderr, r"step 2: .*report_nan_in_param_grad: the gradient of "
                                        r"'model\.[a-z_.0-9]+weight' holds \S+ \(element \d+\) "
                                        r"on data-parallel rank [01], before its reduction")
        self.assertEqual(result.stderr.count("check_for_nan_in_grad has no effect"), 1)


class BadInput(TrainTest, InputErrorAssertions):
    def test_what_megatron_fsdp_does_not_compute_is_refused_naming_the_key(self):
        cases = (
            (("distributed.dp_replicate_size=2",), "distributed.dp_replicate_size", "fsdp2"),
            (("distributed.ep_size=2",), "distributed.ep_size", "no MoE mesh"),
            (("distributed.fsdp_double_buffer=true", "distributed.zero_dp_strategy=1"),
             "distributed.fsdp_double_buffer", "set distributed.zero_dp_strategy to 3"),
            (("distributed.zero_dp_strategy=0", "distributed.cp_size=2"), "distributed.cp_size",
             "must be 1 with zero_dp_strategy 0"),
            (("distributed.fsdp_double_buffer=true", "distributed.disable_bucketing=true"),
             "distributed.fsdp_double_buffer", "gathers every unit as one bucket"),
            (("distributed.keep_fp8_transpose_cache=true",),
             "distributed.keep_fp8_transpose_cache", "no FP8 compute"),
        )
        for overrides, key, needle in cases:
            with self.subTest(key=key):
                self.assert_input_error(run(self.runs.config, "--nproc-per-node", "4",
                                            *MEGATRON, *overrides), key, needle)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)

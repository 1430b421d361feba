"""`meshrun train` with tensor parallelism (distributed.tp_size > 1), with and
without sequence parallelism, and with distributed.tp_plan replicating some
of the model's blocks, against 1 rank.
Activation checkpointing at tp = 2 recomputes the same operations, so it is
checked bit for bit against tp = 2 without it.

Run by ctest: test_tensor_parallel.py MESHRUN_EXE [TestClass ...]

Every run computes in float32 (mp_policy.param_dtype = float32) on the same
global batch as the 1-rank reference. Tensor parallelism changes only the
order of sums: a row-parallel projection adds the ranks' partial products,
the vocabulary-parallel cross-entropy adds the ranks' exp-sums, and the
gradient norm adds the ranks' squares, each ~1e-7 relative, carried through
a few AdamW steps. So losses, gradient norms and validation losses agree to
test_train.py's 1e-4 relative. Exported weights agree to 1e-4 absolute:
AdamW's m / sqrt(v) turns a 1e-7 difference in a near-zero gradient into a
visible one in the update, but 4 steps at lr 3e-3 move a weight by at most
1.2e-2, and the differences seen are ~1e-5. Names, shapes and dtypes are
identical.
"""

import array
import json
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402
from test_gpt2 import TINY_GPT2  # noqa: E402
from test_moe import TINY_MOE  # noqa: E402
from test_train import (MESHRUN, Runs, TrainTest, losses, metrics,  # noqa: E402
                        read_safetensors, run)

FP32 = ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32")
TP2 = FP32 + ("distributed.tp_size=2",)
SP = ("distributed.sequence_parallel=true",)
PP2 = ("distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2",
       "distributed.pipeline.pp_batch_size=8")
WEIGHT_TOLERANCE = 1e-4


def grad_norms(output):
    return [m["grad_norm"] for m in metrics(output)]


def val_losses(output):
    return [m["val_loss"] for m in metrics(output) if "val_loss" in m]


def exported(output):
    return {name: (dtype, shape, array.array("f", raw)) for name, (dtype, shape, raw)
            in read_safetensors(os.path.join(output, "model.safetensors")).items()}


class TensorParallelTest(TrainTest):
    @classmethod
    def setUpClass(cls):
        cls.runs = Runs()
        cls.reference = cls.runs.train("one", 1)

    def assert_matches(self, reference, output):
        self.assert_close(losses(reference), losses(output))
        self.assert_close(grad_norms(reference), grad_norms(output))
        self.assert_close(val_losses(reference), val_losses(output))

    def assert_trains_as_one_rank(self, name, nproc, *overrides):
        """Trains `name` and checks its metrics and exported weights against
        the 1-rank reference; returns its output folder."""
        output = self.runs.train(name, nproc, *overrides)
        self.assert_matches(self.reference, output)
        self.assert_same_weights(self.reference, output)
        return output

    def assert_same_weights(self, reference, output):
        expected, actual = exported(reference), exported(output)
        self.assertEqual({k: v[:2] for k, v in expected.items()},
                         {k: v[:2] for k, v in actual.items()})
        for name, (_, _, values) in expected.items():
            difference = max(abs(a - b) for a, b in zip(values, actual[name][2]))
            self.assertLessEqual(difference, WEIGHT_TOLERANCE, name)


class Equivalence(TensorParallelTest):
    def test_tp2_matches_one_rank(self):
        self.assert_trains_as_one_rank("tp2", 2, *TP2)

    def test_sequence_parallel_tp2_matches_one_rank(self):
        output = self.assert_trains_as_one_rank("sp", 2, *TP2, *SP)
        # The same bytes as without sequence parallelism (an all-gather and a
        # reduce-scatter weigh one all-reduce), plus the norm weights'
        # gradients summed over tp: 2 per layer and the final norm, H floats
        # each, per micro-batch.
        plain = self.runs.train("no-sp", 2, *TP2)
        hidden, layers, micro_batches = 32, 2, 4
        self.assertEqual(metrics(output)[0]["tp_bytes"] - metrics(plain)[0]["tp_bytes"],
                         micro_batches * 4 * hidden * (2 * layers + 1))
        self.assertLess(metrics(output)[0]["mem"]["activations"],
                        metrics(plain)[0]["mem"]["activations"])

    def test_sequence_parallel_pp2_by_tp2_matches_one_rank(self):
        output = self.runs.train("sp-pp2tp2", 4, *TP2, *SP, *PP2)
        self.assert_matches(self.reference, output)

    def test_tp2_by_dp_shard2_matches_one_rank(self):
        self.assert_trains_as_one_rank("tp2dp2", 4, *TP2)

    def test_pp2_by_tp2_matches_one_rank(self):
        self.assert_trains_as_one_rank("pp2tp2", 4, *TP2, *PP2)

    def test_split_backward_schedule_with_tp2_matches_one_rank(self):
        layers = "model.num_hidden_layers=4"
        reference = self.runs.train("one-4-layers", 1, layers)
        output = self.runs.train("zb-tp2", 4, *TP2, *PP2, layers,
                                 "distributed.pipeline.pp_schedule=interleaved_zero_bubble")
        self.assert_matches(reference, output)

    def test_activation_checkpointing_with_tp2_is_exact(self):
        for name, layout in (("tp2", TP2), ("sp", TP2 + SP)):
            plain = self.runs.train(f"{name}-plain", 2, *layout)
            for mode in ("full", "selective"):
                with self.subTest(layout=name, mode=mode):
                    output = self.runs.train(f"{name}-{mode}", 2, *layout,
                                             f"distributed.activation_checkpointing={mode}")
                    self.assertEqual(losses(plain), losses(output))
                    self.assertEqual(exported(plain), exported(output))

    def test_async_tensor_parallel_changes_no_bit(self):
        for name, layout in (("tp2", TP2), ("sp", TP2 + SP)):
            with self.subTest(layout=name):
                plain = self.runs.train(f"{name}-sync", 2, *layout)
                overlapped = self.runs.train(f"{name}-async", 2, *layout,
                                             "distributed.enable_async_tensor_parallel=true")
                self.assertEqual(losses(plain), losses(overlapped))
                self.assertEqual(exported(plain), exported(overlapped))
                self.assertEqual(metrics(plain)[0]["tp_bytes"],
                                 metrics(overlapped)[0]["tp_bytes"])

    def test_gpt2_tp2_matches_one_rank(self):
        runs = Runs()
        with open(runs.config, "w") as f:
            f.write(TINY_GPT2)
        try:
            reference = runs.train("gpt2-one", 1)
            output = runs.train("gpt2-tp2", 2, *TP2)
            self.assert_matches(reference, output)
            self.assert_same_weights(reference, output)
            overlapped = runs.train("gpt2-tp2-async", 2, *TP2,
                                    "distributed.enable_async_tensor_parallel=true")
            self.assertEqual(losses(output), losses(overlapped))
            self.assertEqual(exported(output), exported(overlapped))
        finally:
            runs.cleanup()

    def test_placements_are_in_the_plan(self):
        import subprocess
        result = subprocess.run([MESHRUN, "plan", self.runs.config, "--json", "--world-size", "2",
                                 *TP2], capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        placement = {p["name"]: (p["tp"], p["local_shape"])
                     for p in json.loads(result.stdout)["model"]["parameters"]}
        self.assertEqual(placement["model.layers.0.self_attn.k_proj.weight"],
                         ("shard(0)", [8, 32]))
        self.assertEqual(placement["model.layers.0.mlp.down_proj.weight"], ("shard(1)", [32, 32]))
        self.assertEqual(placement["model.norm.weight"], ("replicate", [32]))
        text = subprocess.run([MESHRUN, "plan", self.runs.config, "--world-size", "2", *TP2],
                              capture_output=True, text=True).stdout
        self.assertIn("tensors placed replicate 5, shard(0) 12, shard(1) 4; 17568 parameters per "
                      "tp rank", text)


# A tp_plan file: attention, embedding and lm_head over tp, the MLPs
# replicated (a module the file does not name is replicated).
ATTENTION_ONLY = """
"model.embed_tokens" = "rowwise"
"model.layers.*.self_attn.q_proj" = "colwise"
"model.layers.*.self_attn.k_proj" = "colwise"
"model.layers.*.self_attn.v_proj" = "colwise"
"model.layers.*.self_attn.o_proj" = "rowwise"
"lm_head" = "colwise"
"""


def write_plan(runs, name, text):
    path = os.path.join(runs.root, name)
    with open(path, "w") as f:
        f.write(text)
    return path


class Plans(TensorParallelTest, InputErrorAssertions):
    """distributed.tp_plan: replicated blocks compute whole on every rank, so
    the run still matches 1 rank, with fewer tp bytes and more parameters per
    rank."""

    def test_layers_plan_matches_one_rank(self):
        for name, layout in (("layers", TP2), ("layers-sp", TP2 + SP)):
            with self.subTest(layout=name):
                self.assert_trains_as_one_rank(name, 2, *layout, "distributed.tp_plan=layers")

    def test_file_plan_replicating_the_mlps_matches_one_rank(self):
        plan = write_plan(self.runs, "attention.toml", ATTENTION_ONLY)
        default = self.runs.train("default-plan", 2, *TP2)
        for name, layout in (("file", TP2), ("file-sp", TP2 + SP)):
            with self.subTest(layout=name):
                output = self.assert_trains_as_one_rank(name, 2, *layout,
                                                        f"distributed.tp_plan={plan}")
        # Two all-reduces of [N, H] floats per layer and micro-batch are gone
        # (the MLP's output forward and its input gradient backward), each
        # 2 (p - 1) / p N H 4 bus bytes, N H 4 at p = 2.
        hidden, layers, micro_batches, rows = 32, 2, 4, 2 * 32
        default_bytes = metrics(default)[0]["tp_bytes"]
        self.assertEqual(default_bytes - metrics(self.runs.train("file-bytes", 2, *TP2,
                                                                 f"distributed.tp_plan={plan}"))
                         [0]["tp_bytes"], micro_batches * layers * 2 * rows * hidden * 4)

    def test_file_plan_checkpoint_resumes_with_the_default_plan(self):
        plan = write_plan(self.runs, "attention-resume.toml", ATTENTION_ONLY)
        saving = self.runs.train("file-saving", 2, *TP2, f"distributed.tp_plan={plan}",
                                 "checkpoint.save_every=2")
        step2 = os.path.join(saving, "checkpoints", "step_2")
        resumed = self.runs.train("default-resumed", 2, *TP2, f"checkpoint.resume_from={step2}")
        self.assert_close(losses(saving)[2:], losses(resumed))

    def test_gpt2_layers_plan_trains_a_vocabulary_tp_does_not_divide(self):
        runs = Runs()
        with open(runs.config, "w") as f:
            f.write(TINY_GPT2.replace("vocab_size = 256", "vocab_size = 257"))
        try:
            self.assert_input_error(run(runs.config, "--nproc-per-node", "2", *TP2),
                                    "transformer.wte.weight", "257", "distributed.tp_plan")
            reference = runs.train("gpt2-257-one", 1)
            output = runs.train("gpt2-257-layers", 2, *TP2, "distributed.tp_plan=layers")
            self.assert_matches(reference, output)
            self.assert_same_weights(reference, output)
        finally:
            runs.cleanup()

    def test_the_plan_prints_the_effective_placement(self):
        import subprocess
        plan = write_plan(self.runs, "attention-plan.toml", ATTENTION_ONLY)
        text = subprocess.run([MESHRUN, "plan", self.runs.config, "--world-size", "2", *TP2,
                               f"distributed.tp_plan={plan}"], capture_output=True,
                              text=True).stdout
        self.assertRegex(text, r"tp +model\.layers\.\*\.mlp\.down_proj +replicate +computed "
                               r"whole on every rank")
        self.assertRegex(text, r"tp +model\.layers\.\*\.self_attn\.o_proj +rowwise +output "
                               r"replicated")


class BadInput(TrainTest, InputErrorAssertions):
    def test_tp_plans_the_model_cannot_compute_are_refused_naming_the_line(self):
        cases = (
            ('"model.layers.*.mlp.up_proj" = "rowwise"\n', "plan.toml:1",
             "model.layers.0.mlp.up_proj is 'rowwise', but the model computes it 'colwise'; "
             "valid: 'colwise' or 'replicate'"),
            ('"model.layers.*.mlp.up_proj" = "colwise"\n', "plan.toml:1",
             "same block ('mlp')"),
            ('\n"model.layers.*.attn.q_proj" = "colwise"\n', "plan.toml:2",
             "names none of the model's modules"),
            ('"model.norm" = "colwise"\n', "plan.toml:1", "valid: 'replicate'"),
            ('"lm_head" = "sequence_parallel"\n', "plan.toml:1",
             'must be "colwise", "rowwise" or "replicate"'),
        )
        for text, position, needle in cases:
            with self.subTest(plan=text):
                plan = write_plan(self.runs, "plan.toml", text)
                self.assert_input_error(run(self.runs.config, "--nproc-per-node", "2", *TP2,
                                            f"distributed.tp_plan={plan}"),
                                        "distributed.tp_plan", position, needle)
        for value, needle in (("megatron", "valid are \"default\", \"layers\""),
                              ("missing.toml", "missing.toml")):
            with self.subTest(plan=value):
                self.assert_input_error(run(self.runs.config, "--nproc-per-node", "2", *TP2,
                                            f"distributed.tp_plan={value}"),
                                        "distributed.tp_plan", needle)
        self.assert_input_error(run(self.runs.config, *FP32, "distributed.tp_plan=layers"),
                                "distributed.tp_plan", "needs distributed.tp_size > 1")


    def test_sequence_parallel_needs_a_model_that_computes_it_and_whole_rows(self):
        """hand_gpt2 (the test plugin of tests/kit, found on MESHRUN_PLUGIN_PATH)
        computes tp but not sequence parallelism; Mixtral computes no tp."""
        runs = Runs()
        try:
            with open(runs.config, "w") as f:
                f.write(TINY_GPT2)
            self.assert_input_error(run(runs.config, "--nproc-per-node", "2", *TP2, *SP,
                                        "model.model_type=hand_gpt2"),
                                    "distributed.sequence_parallel", "meshrun_model_hand_gpt2")
            with open(runs.config, "w") as f:
                f.write(TINY_MOE)
            self.assert_input_error(run(runs.config, "--nproc-per-node", "2", *TP2, *SP),
                                    "distributed.tp_size", "meshrun_model_mixtral",
                                    "computes no tensor parallelism")
        finally:
            runs.cleanup()
        self.assert_input_error(run(self.runs.config, "--nproc-per-node", "2", *TP2, *SP,
                                    "data.seq_len=33"), "data.seq_len", "tp_size (2)")


class Checkpoints(TensorParallelTest):
    """Sharded checkpoints hold the full model's elements, whatever the layout."""

    def resume(self, name, nproc, step2, *overrides):
        return self.runs.train(name, nproc, *overrides, f"checkpoint.resume_from={step2}")

    def test_tp2_checkpoint_resumes_at_tp1_and_dp4_and_back(self):
        full = self.runs.train("tp2-saving", 2, *TP2, "checkpoint.save_every=2")
        step2 = os.path.join(full, "checkpoints", "step_2")
        self.assertEqual(losses(full)[2:], losses(self.resume("tp2-again", 2, step2, *TP2)))
        for name, nproc, overrides in (("tp1", 1, FP32), ("dp4", 4, FP32), ("ddp2", 2, ())):
            with self.subTest(layout=name):
                self.assert_close(losses(full)[2:],
                                  losses(self.resume(name, nproc, step2, *overrides)))
        # Exported from the step-2 checkpoint under any layout or tp_plan, the
        # consolidated weights are the same bytes.
        export = self.runs.train("tp2-export", 2, *TP2, f"checkpoint.resume_from={step2}",
                                 "train.steps=2")
        with open(os.path.join(export, "model.safetensors"), "rb") as f:
            expected = f.read()
        for name, nproc, overrides in (("tp1-export", 1, FP32), ("dp4-export", 4, FP32),
                                       ("layers-export", 2, TP2 + ("distributed.tp_plan=layers",))):
            with self.subTest(export=name):
                output = self.resume(name, nproc, step2, *overrides, "train.steps=2")
                with open(os.path.join(output, "model.safetensors"), "rb") as f:
                    self.assertEqual(expected, f.read())
        dp4 = self.runs.train("dp4-saving", 4, *FP32, "checkpoint.save_every=2")
        back = self.resume("back-to-tp2", 2, os.path.join(dp4, "checkpoints", "step_2"), *TP2)
        self.assert_close(losses(dp4)[2:], losses(back))


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)

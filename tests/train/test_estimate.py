"""`meshrun plan --estimate` checked against `meshrun train` on this machine.

- Memory: for ddp, fsdp2 (bfloat16 gathers), fsdp2 with full activation
  checkpointing, a 1F1B pipeline (pp 2 x dp 2), tp 2 x dp 2 (two
  micro-batches a step), fsdp2 with two micro-batches a step and
  Megatron-FSDP ZeRO-1 with two on 4 ranks, the estimated per-rank total
  (parameters, gradients, AdamW moments, buffers, activations) is within
  10% of what the run reports (mem.params + grads + optimizer +
  buffers_peak + activations_peak of metrics.jsonl; a sharded run's
  buffers peak leaves out the bfloat16 send copies and varies a little
  with how its gathers and reduce-scatters overlap), and
  without checkpointing the activations the model describes
  are exactly what the run holds. Apart from that overlap
  memory does not depend on the machine's load, so these hold under the
  sanitizers too; the step time does, and is compared by
  tests/bench/estimate_vs_runs.py instead.
- A Hugging Face config.json (Llama-3 8B) plans and estimates on h100-sxm.
- Bad input: unknown profiles, profile files with bad keys, estimate
  options without --estimate, exit 2 naming what is wrong.

Run by ctest: test_estimate.py MESHRUN_EXE [TestClass ...]
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CONFIG = os.path.join(ROOT, "examples", "llama-tiny.toml")
LLAMA3_8B = os.path.join(ROOT, "examples", "models", "llama3-8b.json")
LAUNCHER_VARIABLES = ("OMPI_", "PMI_", "PMIX_", "SLURM_")
LAYOUTS = {
    "ddp": ["distributed.strategy=ddp"],
    "fsdp2": [],
    "fsdp2-full-checkpointing": ["distributed.activation_checkpointing=\"full\""],
    "pipeline": ["distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=1",
                 "distributed.pipeline.pp_batch_size=4"],
    "tensor-parallel": ["distributed.tp_size=2"],
    # Two micro-batches a step: fsdp2 holds every unit's gradients whole
    # until the last (defer_fsdp_grad_sync), Megatron-FSDP at ZeRO-1 its
    # parameters gathered for the step too.
    "fsdp2-accumulating": ["train.micro_batch_size=1"],
    "megatron-zero1-accumulating": ["distributed.strategy=megatron_fsdp",
                                    "distributed.zero_dp_strategy=1", "train.micro_batch_size=1"],
}


def environment():
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}


def meshrun(*args, timeout=300):
    return subprocess.run([MESHRUN, *args], capture_output=True, text=True, errors="replace",
                          timeout=timeout, env=environment())


def estimate(*args):
    result = meshrun("plan", CONFIG, "--estimate", "--json", *args)
    if result.returncode != 0:
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)


class Memory(unittest.TestCase):
    def test_estimate_within_ten_percent_of_runs(self):
        for name, overrides in LAYOUTS.items():
            with self.subTest(layout=name), tempfile.TemporaryDirectory() as output:
                estimated = estimate("--world-size", "4", *overrides)["estimate"]
                guess, time = estimated["memory"], estimated["time"]
                result = meshrun("train", CONFIG, "--nproc-per-node", "4", "--output", output,
                                 "train.steps=2", "train.val_every=0", "checkpoint.export=false",
                                 *overrides)
                self.assertEqual(result.returncode, 0, result.stderr)
                with open(os.path.join(output, "metrics.jsonl")) as f:
                    mem = json.loads(f.readlines()[-1])["mem"]
                held = (mem["params"] + mem["grads"] + mem["optimizer"] + mem["buffers_peak"] +
                        mem["activations_peak"])
                self.assertLessEqual(abs(guess["total"] - held), 0.10 * held, (guess, mem))
                self.assertEqual(guess["params"], mem["params"])
                self.assertLessEqual(time["exposed_communication"], time["communication"])
                if guess["checkpointing"] == "none":
                    self.assertEqual(guess["activations"]["none"], mem["activations_peak"])


class ClusterScale(unittest.TestCase):
    def test_llama3_8b_on_h100(self):
        result = meshrun("plan", CONFIG, "--world-size", "8", "--estimate", "--json",
                         "--hardware", "h100-sxm", "--model-config", LLAMA3_8B,
                         "data.seq_len=8192", "train.global_batch_size=8",
                         "train.micro_batch_size=1")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("not estimated: architectures, attention_bias", result.stderr)
        plan = json.loads(result.stdout)
        parameters = sum(eval("*".join(map(str, p["shape"])))
                         for p in plan["model"]["parameters"])
        self.assertEqual(parameters, 8030261248)
        guess = plan["estimate"]
        self.assertEqual(guess["hardware"]["name"], "h100-sxm")
        self.assertEqual(guess["nodes"], 1)
        # 6 per matmul weight (32 layers of 218,103,808 and the 525,336,576
        # of lm_head) + 12 x 32 layers x 4096 x 8192 for attention.
        self.assertEqual(guess["flops_per_token"],
                         6 * (32 * 218103808 + 525336576) + 12 * 32 * 4096 * 8192)
        self.assertGreater(guess["time"]["step"], 0)

    def test_llama3_8b_fits_an_h100_with_selective_checkpointing(self):
        """As torchtitan trains it: seq 8192, one sequence per GPU, FSDP2 in
        bfloat16. The embedding and the head are units of their own, so the
        buffers hold the head (final norm and lm_head) and the two layers
        prefetched after it, in bfloat16 and float32, and the float32
        gradients of the head and of the last layer, computed while the
        head's are reduce-scattered."""
        head = 4096 + 128256 * 4096
        layer = 218103808 + 2 * 4096  # the matmuls and two norms
        result = meshrun("plan", CONFIG, "--world-size", "8", "--estimate", "--json",
                         "--hardware", "h100-sxm", "--model-config", LLAMA3_8B,
                         "data.seq_len=8192", "train.global_batch_size=8",
                         "train.micro_batch_size=1",
                         "distributed.activation_checkpointing=\"selective\"")
        self.assertEqual(result.returncode, 0, result.stderr)
        memory = json.loads(result.stdout)["estimate"]["memory"]
        self.assertEqual(memory["buffers"], (head + 2 * layer) * 6 + (head + layer) * 4)
        self.assertTrue(memory["fits"], memory)
        self.assertLess(memory["total"], 80 * 2**30)

    def test_nodes_and_inter_node_links(self):
        guess = estimate("--world-size", "16", "--hardware", "h200", "--nproc-per-node", "8")
        self.assertEqual(guess["estimate"]["nodes"], 2)
        one_node = estimate("--world-size", "8", "--hardware", "h200")
        self.assertGreater(guess["estimate"]["time"]["communication"],
                           one_node["estimate"]["time"]["communication"])


class BadInput(InputErrorAssertions):
    def test_refusals(self):
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as profile:
            profile.write('name = "x"\nranks_per_node = 4\nbogus = 1\n')
            profile.flush()
            cases = [
                (["--estimate", "--hardware", "a100"], ["--hardware a100", "h100-sxm"]),
                (["--hardware", "h200"], ["--hardware", "--estimate"]),
                (["--estimate", "--model-config", "/nonexistent.json"], ["/nonexistent.json"]),
                (["--estimate", "--hardware", profile.name], [f"{profile.name}:3:", "bogus",
                                                             "matmul_flops_per_s_bfloat16"]),
            ]
            for args, needles in cases:
                with self.subTest(args=args):
                    self.assert_input_error(meshrun("plan", CONFIG, *args), *needles)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)

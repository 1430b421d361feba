"""A Python run's metrics.jsonl and run.json against `meshrun train`'s.

llama-tiny (seq 64, 3 steps) by `meshrun train` on 2 ranks, and the PyTorch
Llama of the same [model] by 2 Python ranks under meshrun.torch writing
through meshrun.metrics.RunMetrics (metrics_rank.py), fsdp2 in float32:
- every line has the same keys, and "mem" the same keys, as `meshrun
  train`'s;
- run.json has the same keys, and the FLOPs meshrun.torch counts for the
  torch module (its nn.Linear weights, and attention) equal those meshrun's
  model describes for the same config, exactly;
- each line is consistent: flops_per_s = flops_per_step / step_time_s, mfu
  = flops_per_s / peak_flops_per_s, tokens_per_s = tokens / step_time_s,
  grad_sync_wait_s <= comm_wait_s <= step_time_s, mem.params and grads the
  local shard's float32 bytes (the model's bytes / 2 ranks, padding aside),
  the optimizer's twice that, activations kept > 0 and the same every step;
- with train.profile=true the ranks write trace.json, which `meshrun trace
  summary` reads: 2 ranks of 3 steps, with compute and exposed
  communication; each unit's forward and backward compute and each strategy
  hook are spans named as meshrun train names them, inside the steps.

Run by ctest: test_metrics.py MESHRUN_EXE
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import environment, metrics  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
CONFIG = os.path.join(ROOT, "examples", "llama-tiny.toml")
KEYS = ["train.steps=3", "data.seq_len=64", "train.val_every=0", "train.global_batch_size=4",
        "train.micro_batch_size=2", "distributed.mp_policy.param_dtype=float32"]
LAYERS = 4  # llama-tiny's num_hidden_layers


def run_json(output):
    with open(os.path.join(output, "run.json")) as f:
        return json.load(f)


class PythonMetrics(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        root = tempfile.mkdtemp(prefix="meshrun-python-metrics-")
        cls.cli, cls.python = os.path.join(root, "cli"), os.path.join(root, "python")
        for command in ([MESHRUN, "train", CONFIG, "--nproc-per-node", "2", "--output", cls.cli,
                         *KEYS],
                        [MESHRUN, "launch", "--nproc-per-node", "2", "--", sys.executable,
                         os.path.join(HERE, "metrics_rank.py"), CONFIG, cls.python, *KEYS]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                    env=environment())
            assert result.returncode == 0, result.stdout + result.stderr

    def test_same_fields_as_meshrun_train(self):
        cli, python = metrics(self.cli), metrics(self.python)
        self.assertEqual(len(python), 3)
        for line in python:
            self.assertEqual(list(line), list(cli[0]))
            self.assertEqual(list(line["mem"]), list(cli[0]["mem"]))
        self.assertEqual(list(run_json(self.python)), list(run_json(self.cli)))

    def test_flops_are_the_models(self):
        self.assertEqual(run_json(self.python)["flops_per_token"],
                         run_json(self.cli)["flops_per_token"])

    def test_each_line_is_consistent(self):
        run = run_json(self.python)
        numel = 3279104  # llama-tiny's parameters
        activations = set()
        for line in metrics(self.python):
            time = line["step_time_s"]
            self.assertAlmostEqual(line["flops_per_s"], run["flops_per_step"] / time,
                                   delta=1e-9 * line["flops_per_s"])
            self.assertAlmostEqual(line["mfu"], line["flops_per_s"] / run["peak_flops_per_s"],
                                   delta=1e-12)
            self.assertAlmostEqual(line["tokens_per_s"], 4 * 64 / time,
                                   delta=1e-9 * line["tokens_per_s"])
            self.assertLessEqual(line["grad_sync_wait_s"], line["comm_wait_s"])
            self.assertLessEqual(line["comm_wait_s"], time)
            mem = line["mem"]
            self.assertGreaterEqual(mem["params"], numel * 4 // 2)
            self.assertLess(mem["params"], numel * 4 // 2 + 4 * 1024)
            self.assertEqual(mem["grads"], mem["params"])
            self.assertEqual(mem["optimizer"], 2 * mem["params"])
            self.assertGreater(mem["activations"], 0)
            self.assertEqual(mem["activations_peak"], mem["activations"])
            activations.add(mem["activations"])
        self.assertEqual(len(activations), 1)

    def test_profile_writes_the_trace_meshrun_trace_summary_reads(self):
        output = self.python + "-profiled"
        result = subprocess.run(
            [MESHRUN, "launch", "--nproc-per-node", "2", "--", sys.executable,
             os.path.join(HERE, "metrics_rank.py"), CONFIG, output, *KEYS, "train.profile=true"],
            capture_output=True, text=True, timeout=300, env=environment())
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        result = subprocess.run([MESHRUN, "trace", "summary", output, "--json"],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        ranks = [json.loads(line) for line in result.stdout.splitlines()]
        self.assertEqual([rank["rank"] for rank in ranks], [0, 1], result.stdout)
        for rank in ranks:
            self.assertEqual(rank["steps"], 3, rank)
            self.assertGreater(rank["comm"], 0, rank)
            self.assertGreater(rank["compute"], 0, rank)
        with open(os.path.join(output, "trace.json")) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        units = ["root"] + [f"model.layers.{i}" for i in range(LAYERS)]
        for rank in (0, 1):
            spans = [(e["cat"], e["name"]) for e in events if e["pid"] == rank]
            # Each unit's compute, once per direction and step, named as meshrun
            # train names its units; each strategy hook as meshrun train names it.
            for unit in units:
                for direction in ("forward", "backward"):
                    self.assertEqual(spans.count(("compute", f"{direction} {unit}")), 3, unit)
            for unit in range(len(units)):
                self.assertEqual(spans.count(("comm", f"strategy pre_forward {unit}")), 3)
            self.assertEqual(spans.count(("comm", "finish_gradients")), 3)
            steps = [e for e in events if e["pid"] == rank and e["cat"] == "step"]
            for e in events:
                if e["pid"] == rank and e["cat"] == "compute":
                    self.assertTrue(any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <=
                                        s["ts"] + s["dur"] for s in steps), e)


if __name__ == "__main__":
    MESHRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)

"""What the Python tests of the meshrun CLI share.

- InputErrorAssertions: the project's contract for bad input (docs/design.md):
  exit status 2 and exactly one line, "meshrun: error: ...", that names the
  key or argument, and nothing on stdout.
- environment(): this process's environment without a launcher's variables,
  so that a run a test starts is a job of its own.
- metrics(output): the objects of OUTPUT/metrics.jsonl.
- same_export(a, b): whether two runs' model.safetensors are equal byte for
  byte, and their config.json the same.
"""

import json
import os
import unittest

LAUNCHER_VARIABLES = ("OMPI_", "PMI_", "PMIX_", "SLURM_")


def environment(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    env.update(extra)
    return env


def metrics(output):
    with open(os.path.join(output, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class InputErrorAssertions(unittest.TestCase):
    def assert_input_error(self, result, *needles):
        """`result` (a subprocess.CompletedProcess) is one clean input error
        whose line contains every needle."""
        self.assertEqual(result.returncode, 2, result.stderr + result.stdout)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertTrue(lines[0].startswith("meshrun: error: "), lines[0])
        for needle in needles:
            self.assertIn(needle, lines[0])
        self.assertEqual(result.stdout, "")


def same_export(a, b):
    """Whether two exports hold the same model.safetensors, byte for byte,
    and the same config.json."""
    with open(os.path.join(a, "model.safetensors"), "rb") as first, \
            open(os.path.join(b, "model.safetensors"), "rb") as second:
        if first.read() != second.read():
            return False
    with open(os.path.join(a, "config.json")) as first, \
            open(os.path.join(b, "config.json")) as second:
        return json.load(first) == json.load(second)

"""`meshrun plan` with plugins that cannot be used or that crash.

A plugin of another ABI major is bad input: exit status 2 and one line
naming the file and the versions. A plugin that crashes inside a call is
named on one line, with the signal and the entry point, and the process
still dies by the signal.
Run by ctest: test_plugin_failures.py MESHRUN_EXE SOURCE_DIR TEST_PLUGIN_DIR
"""

import os
import signal
import subprocess
import sys
import unittest
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
SOURCE_DIR = sys.argv[2] if len(sys.argv) > 2 else "."
TEST_PLUGIN_DIR = os.path.abspath(sys.argv[3] if len(sys.argv) > 3 else "test-plugins")
CONFIG = os.path.join(SOURCE_DIR, "examples", "llama-tiny.toml")


def plan(*overrides):
    env = dict(os.environ, MESHRUN_PLUGIN_PATH=TEST_PLUGIN_DIR)
    return subprocess.run([MESHRUN, "plan", CONFIG, "--world-size", "1", *overrides],
                          capture_output=True, text=True, errors="replace", timeout=30, env=env)


class PluginFailureTest(InputErrorAssertions):
    def test_another_abi_major_is_an_input_error(self):
        plugin = os.path.join(TEST_PLUGIN_DIR, "meshrun_strategy_wrong_major.so")
        self.assert_input_error(plan("distributed.strategy=wrong_major"), "distributed.strategy",
                                plugin, "ABI version 2.0 is another major version",
                                "(supported: 1.0 .. 1.x)")

    def test_a_crash_in_a_plugin_names_the_plugin_and_keeps_the_signal(self):
        result = plan("model.model_type=crashy")
        self.assertEqual(result.returncode, -signal.SIGSEGV, result.stderr)
        plugin = os.path.join(TEST_PLUGIN_DIR, "meshrun_sidecar_crashy.so")
        self.assertEqual(result.stderr.splitlines(),
                         [f"meshrun: error: plugin {plugin} crashed "
                          f"(signal {signal.SIGSEGV.value}, SIGSEGV) in sidecar plan"])
        self.assertEqual(result.stdout, "")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])

"""`meshrun plan` with plugins that crash.

A plugin that crashes inside a call is named on one line, with the signal
and the entry point, and the process still dies by the signal.
Run by ctest: test_plugin_failures.py MESHRUN_EXE SOURCE_DIR TEST_PLUGIN_DIR
"""

import os
import signal
import subprocess
import sys
import unittest

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
SOURCE_DIR = sys.argv[2] if len(sys.argv) > 2 else "."
TEST_PLUGIN_DIR = os.path.abspath(sys.argv[3] if len(sys.argv) > 3 else "test-plugins")
CONFIG = os.path.join(SOURCE_DIR, "examples", "llama-tiny.toml")


def plan(*overrides):
    env = dict(os.environ, MESHRUN_PLUGIN_PATH=TEST_PLUGIN_DIR)
    return subprocess.run([MESHRUN, "plan", CONFIG, "--world-size", "1", *overrides],
                          capture_output=True, text=True, errors="replace", timeout=30, env=env)


class PluginFailureTest(unittest.TestCase):
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

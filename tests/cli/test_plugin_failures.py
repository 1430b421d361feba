"""`meshrun plan` and `meshrun train` with plugins that cannot be used or
that crash.

A plugin of another ABI major, a missing model plugin, and a sidecar whose
plan is empty, not JSON, or does not fit its model are bad input: exit
status 2 and one line naming the plugin files and the key, before any rank
starts. A plugin that crashes inside a call is named on one line, with the
signal and the entry point, and the process still dies by the signal.
Run by ctest: test_plugin_failures.py MESHRUN_EXE SOURCE_DIR TEST_PLUGIN_DIR
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
SOURCE_DIR = sys.argv[2] if len(sys.argv) > 2 else "."
TEST_PLUGIN_DIR = os.path.abspath(sys.argv[3] if len(sys.argv) > 3 else "test-plugins")
CONFIG = os.path.join(SOURCE_DIR, "examples", "llama-tiny.toml")


def run(command, config, *args):
    env = dict(os.environ, MESHRUN_PLUGIN_PATH=TEST_PLUGIN_DIR)
    return subprocess.run([MESHRUN, command, config, *args], capture_output=True, text=True,
                          errors="replace", timeout=60, env=env)


def plan(*overrides):
    return run("plan", CONFIG, "--world-size", "1", *overrides)


def test_model_config(folder, model_type):
    """A config of the test model `model_type` (tests/plugins/test_model.cpp)."""
    path = os.path.join(folder, f"{model_type}.toml")
    with open(path, "w") as f:
        f.write(f'[model]\nmodel_type = "{model_type}"\n[data]\nseq_len = 16\n'
                '[train]\nsteps = 2\nglobal_batch_size = 4\nmicro_batch_size = 2\n'
                '[distributed]\nstrategy = "ddp"\n')
    return path


class PluginFailureTest(InputErrorAssertions):
    def test_another_abi_major_is_an_input_error(self):
        plugin = os.path.join(TEST_PLUGIN_DIR, "meshrun_strategy_wrong_major.so")
        self.assert_input_error(plan("distributed.strategy=wrong_major"), "distributed.strategy",
                                plugin, "ABI version 2.0 is another major version",
                                "(supported: 1.0 .. 1.x)")

    def test_a_crash_in_a_plugin_names_the_plugin_and_keeps_the_signal(self):
        with tempfile.TemporaryDirectory() as folder:
            result = run("plan", test_model_config(folder, "crashy"), "--world-size", "1")
        self.assertEqual(result.returncode, -signal.SIGSEGV, result.stderr)
        plugin = os.path.join(TEST_PLUGIN_DIR, "meshrun_sidecar_crashy.so")
        self.assertEqual(result.stderr.splitlines(),
                         [f"meshrun: error: plugin {plugin} crashed "
                          f"(signal {signal.SIGSEGV.value}, SIGSEGV) in sidecar plan"])
        self.assertEqual(result.stdout, "")

    def test_a_missing_model_plugin_names_the_key_and_the_models_there_are(self):
        self.assert_input_error(plan("model.model_type=nosuch"), "model.model_type",
                                "no model plugin named 'nosuch'", "llama")

    def test_sidecar_plans_that_do_not_fit_are_refused_before_any_rank_starts(self):
        cases = {  # model_type: what the one line must also say
            "empty_plan": 'the plan has no "units" array',
            "not_json": "its plan is not JSON",
            "mismatch": "unit 'layers.9' is not a unit of the model",
        }
        with tempfile.TemporaryDirectory() as folder:
            for model_type, reason in cases.items():
                config = test_model_config(folder, model_type)
                sidecar = os.path.join(TEST_PLUGIN_DIR, f"meshrun_sidecar_{model_type}.so")
                for command in ("plan", "train"):
                    with self.subTest(model_type=model_type, command=command):
                        output = os.path.join(folder, f"run-{model_type}")
                        args = ("--world-size", "1") if command == "plan" else (
                            "--nproc-per-node", "2", "--output", output)
                        result = run(command, config, *args)
                        self.assert_input_error(result, f"{config}:2:1: model.model_type",
                                                sidecar, reason)
                        self.assertFalse(os.path.exists(output))
                model = os.path.join(TEST_PLUGIN_DIR, f"meshrun_model_{model_type}.so")
                if model_type == "mismatch":
                    self.assertIn(model, run("plan", config).stderr)

    def test_the_test_model_trains_without_its_sidecar_problems(self):
        # The crash and the bad plans come from the sidecars alone: the model
        # of the same name trains on the default plan once they are gone.
        with tempfile.TemporaryDirectory() as folder:
            env = dict(os.environ, MESHRUN_PLUGIN_PATH=folder)
            for name in ("meshrun_model_crashy.so",):
                os.symlink(os.path.join(TEST_PLUGIN_DIR, name), os.path.join(folder, name))
            result = subprocess.run(
                [MESHRUN, "train", test_model_config(folder, "crashy"), "--nproc-per-node", "2",
                 "--output", os.path.join(folder, "run")],
                capture_output=True, text=True, errors="replace", timeout=60, env=env)
            self.assertEqual(result.returncode, 0, result.stderr)
            with open(os.path.join(folder, "run", "metrics.jsonl")) as f:
                self.assertEqual(len(f.readlines()), 2)


class PluginPathTest(InputErrorAssertions):
    def meshrun(self, plugin_path, *args):
        return subprocess.run([MESHRUN, *args], capture_output=True, text=True, errors="replace",
                              timeout=60, env=dict(os.environ, MESHRUN_PLUGIN_PATH=plugin_path))

    def test_relative_folders_are_refused(self):
        for plugin_path, element in ((".", "."), (f"{TEST_PLUGIN_DIR}::plugins", "plugins")):
            for args in (("plugins",), ("plan", CONFIG, "--world-size", "1")):
                self.assert_input_error(self.meshrun(plugin_path, *args), "MESHRUN_PLUGIN_PATH",
                                        f"element '{element}' is a relative path",
                                        "use absolute paths (here: '/")

    def test_what_every_user_can_write_is_named_once(self):
        with tempfile.TemporaryDirectory() as folder:
            plugins = [os.path.join(folder, name) for name in
                       ("meshrun_schedule_plain_c.so", "meshrun_schedule_kind_mismatch.so")]
            for plugin in plugins:
                shutil.copy(os.path.join(TEST_PLUGIN_DIR, os.path.basename(plugin)), plugin)
                os.chmod(plugin, 0o755)

            def warnings():
                result = self.meshrun(folder, "plugins", "--kind", "schedule")
                self.assertEqual(result.returncode, 0, result.stderr)
                return [line for line in result.stderr.splitlines() if "warning" in line]

            self.assertEqual(warnings(), [])
            advice = "is writable by every user ({}), who can make meshrun run their code; " \
                     "remove that permission (chmod o-w)"
            # The sticky bit does not help: anyone may still add a plugin.
            os.chmod(folder, 0o1777)
            os.chmod(plugins[1], 0o666)
            self.assertEqual(warnings(), [
                f"meshrun: warning: plugin folder {folder} " + advice.format("mode 1777"),
                f"meshrun: warning: plugin file {plugins[1]} " + advice.format("mode 0666")])


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])

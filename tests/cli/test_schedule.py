"""`meshrun schedule` as a user runs it.

Every shipped schedule prints its action grid and figures, one JSON object
with docs/design.md's fields, and a well-formed SVG; a CSV written from a
schedule's actions reads back to the same schedule; bad input exits with
status 2 and one line naming the flag.
Run by ctest: test_schedule.py MESHRUN_EXE
"""

import csv
import json
import os
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ElementTree
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
SVG = "{http://www.w3.org/2000/svg}"


def run(*args, timeout=60):
    env = dict(os.environ, MESHRUN_PLUGIN_PATH="")
    return subprocess.run([MESHRUN, "schedule", *args], capture_output=True, text=True,
                          errors="replace", timeout=timeout, env=env)


def shipped_schedules():
    result = subprocess.run([MESHRUN, "plugins", "--kind", "schedule", "--json"],
                            capture_output=True, text=True, check=True,
                            env=dict(os.environ, MESHRUN_PLUGIN_PATH=""))
    return sorted({p["name"] for p in json.loads(result.stdout)["plugins"] if not p["error"]})


def schedule_json(*args):
    result = run(*args, "--json")
    if result.returncode != 0:
        raise AssertionError(" ".join(args) + ": " + result.stderr)
    return json.loads(result.stdout)


def write_csv(directory, name, rows):
    path = os.path.join(directory, name)
    with open(path, "w", newline="", encoding="utf-8") as file:
        csv.writer(file).writerows(rows)
    return path


COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleTest(unittest.TestCase):
    SIZES = ("--pp", "4", "--microbatches", "8")

    def test_every_shipped_schedule(self):
        names = shipped_schedules()
        self.assertGreaterEqual(len(names), 7, names)
        with tempfile.TemporaryDirectory() as directory:
            for name in names:
                with self.subTest(schedule=name):
                    self.check_text(name)
                    self.check_json(name)
                    self.check_svg(name, os.path.join(directory, name + ".svg"))

    def check_text(self, name):
        result = run(name, *self.SIZES)
        self.assertEqual(result.returncode, 0, result.stderr)
        lines = result.stdout.splitlines()
        self.assertTrue(lines[0].startswith("time "), lines[0])
        self.assertTrue(lines[1].startswith("rank 0 "), lines[1])
        self.assertTrue(lines[4].startswith("rank 3 "), lines[4])
        self.assertIn("0F0", lines[1])
        for figure in ("makespan:", "bubble fraction:", "peak activations per rank:"):
            self.assertIn(figure, result.stdout)

    def check_json(self, name):
        data = schedule_json(name, *self.SIZES)
        for field in ("name", "pp", "microbatches", "stages_per_rank", "actions", "makespan",
                      "bubble_fraction", "peak_activations"):
            self.assertIn(field, data)
        self.assertEqual((data["name"], data["pp"], data["microbatches"]), (name, 4, 8))
        self.assertEqual(len(data["actions"]), 4)
        self.assertEqual(len(data["peak_activations"]), 4)
        self.assertTrue(all(isinstance(a, str) for rank in data["actions"] for a in rank))
        # Lowered: ranks send and receive between stages.
        self.assertTrue(any("SEND_F" in a for a in data["actions"][0]))
        self.assertGreater(data["makespan"], 0)
        self.assertTrue(0 <= data["bubble_fraction"] < 1)

    def check_svg(self, name, path):
        result = run(name, *self.SIZES, "--svg", path)
        self.assertEqual(result.returncode, 0, result.stderr)
        root = ElementTree.parse(path).getroot()
        self.assertEqual(root.tag, SVG + "svg")
        texts = [t.text for t in root.iter(SVG + "text")]
        self.assertIn("rank 3", texts)
        self.assertIn("F forward", texts)
        labels = [t.text for t in root.iter(SVG + "text") if t.get("class") == "mb"]
        self.assertIn("7", labels)

    def test_figures_of_1f1b(self):
        data = schedule_json("1f1b", "--pp", "4", "--microbatches", "8")
        self.assertEqual(data["makespan"], 22)
        self.assertAlmostEqual(data["bubble_fraction"], 3 / 11, places=12)
        self.assertEqual(data["peak_activations"], [4, 3, 2, 1])
        costly = schedule_json("1f1b", "--pp", "4", "--microbatches", "8", "--costs", "F=2,B=4")
        self.assertEqual(costly["makespan"], 66)
        self.assertEqual(costly["costs"]["F"], 2)

    def test_large_schedule_still_draws(self):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "large.svg")
            result = run("interleaved_1f1b", "--pp", "16", "--microbatches", "256", "--svg", path,
                         "--json")
            self.assertEqual(result.returncode, 0, result.stderr)
            root = ElementTree.parse(path).getroot()
            self.assertLessEqual(float(root.get("width")), 4200)

    def test_csv_round_trip(self):
        data = schedule_json("interleaved_1f1b", "--pp", "4", "--microbatches", "8")
        with tempfile.TemporaryDirectory() as directory:
            full = write_csv(directory, "full.csv", data["actions"])
            compute = write_csv(directory, "compute.csv",
                                [[a for a in rank if not any(c in a for c in COMMUNICATION)]
                                 for rank in data["actions"]])
            sizes = ("--pp", "4", "--microbatches", "8", "--stages-per-rank", "2")
            for path in (full, compute):
                with self.subTest(csv=os.path.basename(path)):
                    again = schedule_json("--csv", path, *sizes)
                    self.assertEqual(again["actions"], data["actions"])
                    self.assertEqual(again["makespan"], data["makespan"])
                    self.assertEqual(again["bubble_fraction"], data["bubble_fraction"])


class BadInputTest(InputErrorAssertions):
    def test_flags(self):
        self.assert_input_error(run("1f2b", "--pp", "4", "--microbatches", "8"), "1f1b", "gpipe")
        self.assert_input_error(run("1f1b", "--pp", "0", "--microbatches", "8"), "--pp")
        self.assert_input_error(run("1f1b", "--pp", "x", "--microbatches", "8"), "--pp")
        self.assert_input_error(run("1f1b", "--microbatches", "8"), "--pp")
        self.assert_input_error(run("1f1b", "--pp", "4"), "--microbatches")
        self.assert_input_error(run("1f1b", "--pp", "4", "--microbatches", "-1"), "--microbatches")
        self.assert_input_error(run("dualpipev", "--pp", "4", "--microbatches", "3"),
                                "--microbatches", "dualpipev")
        self.assert_input_error(
            run("zbv_zero_bubble", "--pp", "4", "--microbatches", "8", "--stages-per-rank", "3"),
            "--stages-per-rank")
        self.assert_input_error(run("1f1b", "--pp", "4", "--microbatches", "8", "--costs", "F=-1"),
                                "--costs")
        self.assert_input_error(run("1f1b", "--pp", "4", "--microbatches", "8", "--costs", "X=1"),
                                "--costs", "send")
        self.assert_input_error(run("1f1b", "--pp", "4", "--microbatches", "8", "--cost", "F=1"),
                                "--costs")
        self.assert_input_error(run("--pp", "4", "--microbatches", "8"), "NAME", "--csv")
        self.assert_input_error(run("1f1b", "gpipe", "--pp", "4", "--microbatches", "8"), "gpipe")
        self.assert_input_error(
            run("1f1b", "--pp", "4", "--microbatches", "8", "--svg", "/nonexistent/dir/x.svg"),
            "--svg")
        self.assert_input_error(run("1f1b", "--pp", "64", "--microbatches", "1048576"),
                                "--microbatches")

    def test_csv(self):
        sizes = ("--pp", "2", "--microbatches", "2")
        self.assert_input_error(run("--csv", "/nonexistent/s.csv", *sizes), "--csv",
                                "/nonexistent/s.csv")
        self.assert_input_error(run("1f1b", "--csv", "/nonexistent/s.csv", *sizes), "--csv")
        with tempfile.TemporaryDirectory() as directory:
            bad_cell = write_csv(directory, "bad.csv", [["0F0", "0F1", "0Q0"], ["1F0"]])
            self.assert_input_error(run("--csv", bad_cell, *sizes), "--csv", "row 1")
            missing = write_csv(directory, "missing.csv", [["0F0", "0F1", "0B0", "0B1"], ["1F0"]])
            self.assert_input_error(run("--csv", missing, *sizes), "--csv")
            fifo = os.path.join(directory, "fifo.csv")
            os.mkfifo(fifo)  # opening it would block until a writer comes
            self.assert_input_error(run("--csv", fifo, *sizes, timeout=20), "--csv", fifo,
                                    "is a FIFO (named pipe); expected a regular file")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])

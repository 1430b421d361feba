"""What every Python test of the meshrun CLI asserts about bad input.

The project's contract (docs/design.md): bad input exits with status 2 and prints
exactly one line, "meshrun: error: ...", that names the key or argument, and
nothing on stdout.
"""

import unittest


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

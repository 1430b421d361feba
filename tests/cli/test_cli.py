"""`meshrun plan` and `meshrun plugins` as a user runs them.

Bad input of every kind must exit with status 2 and print exactly one line
on stderr that names the key (and its file position where there is one);
nothing may crash. Every example config must plan, in text and JSON.
Run by ctest: test_cli.py MESHRUN_EXE SOURCE_DIR
"""

import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import unittest
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
SOURCE_DIR = sys.argv[2] if len(sys.argv) > 2 else "."
EXAMPLES = sorted(glob.glob(os.path.join(SOURCE_DIR, "examples", "*.toml")))


def run(*args, timeout=30):
    env = dict(os.environ, MESHRUN_PLUGIN_PATH="")
    return subprocess.run([MESHRUN, *args], capture_output=True, text=True, errors="replace",
                          timeout=timeout, env=env)


class ConfigFile:
    """A temporary TOML file holding `text` (str or bytes)."""

    def __init__(self, text):
        self.text = text

    def __enter__(self):
        mode = "wb" if isinstance(self.text, bytes) else "w"
        self.file = tempfile.NamedTemporaryFile(mode, suffix=".toml", delete=False)
        self.file.write(self.text)
        self.file.close()
        return self.file.name

    def __exit__(self, *exc):
        os.unlink(self.file.name)


class BadInputTest(InputErrorAssertions):
    def plan_text(self, text, *args, needles=()):
        with ConfigFile(text) as path:
            result = run("plan", path, *args)
            needles = [n.replace("{path}", path) for n in needles]
            self.assert_input_error(result, *needles)
        return result

    def test_missing_file(self):
        self.assert_input_error(run("plan", "/nonexistent/x.toml"), "/nonexistent/x.toml")

    def test_malformed_toml(self):
        self.plan_text("[distributed\ntp_size = 2\n", needles=["{path}:1:"])
        self.plan_text("[model]\nhidden_size = = 3\n", needles=["{path}:2:"])

    def test_wrong_type(self):
        self.plan_text('[distributed]\ntp_size = "two"\n',
                       needles=["{path}:2:", "distributed.tp_size"])
        self.plan_text("[model]\ntie_word_embeddings = 1\n",
                       needles=["{path}:2:", "model.tie_word_embeddings"])

    def test_negative_and_overflowing_numbers(self):
        self.plan_text("[distributed]\ntp_size = -2\n", needles=["{path}:2:", "distributed.tp_size"])
        self.plan_text("[distributed]\npp_size = 99999999999999999999\n", needles=["{path}:2:"])
        self.plan_text("[distributed]\ntp_size = 9223372036854775807\n",
                       needles=["distributed.tp_size"])
        self.plan_text("[train]\nlr = -0.1\n", needles=["{path}:2:", "train.lr"])

    def test_unknown_keys_suggest(self):
        self.plan_text("[distributed]\ntp_sise = 2\n", needles=["{path}:2:", "tp_size"])
        self.plan_text("[modle]\nvocab_size = 2\n", needles=["{path}:1:", "model"])

    def test_data_and_schedule_files_must_be_regular_files(self):
        # Read whole, /dev/zero would fill the memory and a FIFO would block
        # forever; plan refuses them, and a missing schedule CSV, itself.
        with tempfile.TemporaryDirectory() as folder:
            fifo = os.path.join(folder, "fifo")
            os.mkfifo(fifo)
            for data, reason in (("/dev/zero", "'/dev/zero' is a character device"),
                                 (fifo, "is a FIFO (named pipe)"),
                                 (folder, "is a directory"),
                                 ("/nonexistent/text", "No such file or directory")):
                self.plan_text(f'[data]\npath = "{data}"\n',
                               needles=["{path}:2:1: data.path: ", reason,
                                        "expected a", "regular file"])
        self.plan_text('[distributed]\npp_size = 2\n[distributed.pipeline]\n'
                       'pp_schedule_csv = "/nonexistent/s.csv"\n',
                       needles=["{path}:4:1: distributed.pipeline.pp_schedule_csv: ",
                                "cannot read '/nonexistent/s.csv'"])

    def test_unknown_plugin_names_list_what_exists(self):
        self.plan_text('[distributed]\nstrategy = "fsdp3"\n',
                       needles=["{path}:2:", "distributed.strategy", "fsdp2", "ddp"])
        self.plan_text('[model]\nmodel_type = "lama"\n',
                       needles=["{path}:2:", "model.model_type", "llama"])
        self.plan_text('[distributed]\npp_size = 2\n[distributed.pipeline]\npp_schedule = "1f2b"\n'
                       '[model]\nnum_hidden_layers = 4\n',
                       needles=["{path}:4:", "pp_schedule", "1f1b"])

    def test_sizes_that_do_not_fit_the_world(self):
        self.plan_text("[distributed]\ntp_size = 3\n", "--world-size", "8",
                       needles=["{path}:2:", "divisible"])
        self.plan_text("[distributed]\ndp_size = 3\n", "--world-size", "8",
                       needles=["{path}:2:", "distributed.dp_size"])
        self.plan_text('[distributed]\nstrategy = "ddp"\ntp_size = 2\n', "--world-size", "8",
                       needles=["{path}:3:", "tp_size"])

    def test_random_bytes(self):
        rng = random.Random(1234)
        for _ in range(20):
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
            with ConfigFile(data) as path:
                result = run("plan", path)
                self.assert_input_error(result, path)

    def test_mutated_example_configs_never_crash(self):
        rng = random.Random(42)
        sources = [open(p, encoding="utf-8").read() for p in EXAMPLES]
        for _ in range(60):
            text = list(rng.choice(sources))
            for _ in range(rng.randrange(1, 4)):
                position = rng.randrange(len(text))
                text[position] = rng.choice('=[]"#.0123456789-_abcxyz\n ')
            with ConfigFile("".join(text)) as path:
                result = run("plan", path, "--world-size", str(rng.choice([1, 2, 4, 8, 16])))
                self.assertIn(result.returncode, (0, 2), result.stderr)
                if result.returncode == 2:
                    self.assert_input_error(result)

    def test_nesting_and_key_length_are_bounded(self):
        # toml++ recurses over nested tables: 100,000 levels overflowed the stack.
        deep = ".".join(["a"] * 100000)
        self.plan_text(deep + " = 1\n", needles=["{path}:1:", "nested more than 32"])
        self.plan_text("[" + deep + "]\n", needles=["{path}:1:", "nested more than 32"])
        self.plan_text('[model]\nmodel_type = "llama"\n' + deep + " = 1\n",
                       needles=["{path}:3:", "nested more than 32"])
        self.plan_text("x = " + "[" * 100 + "]" * 100 + "\n", needles=["{path}:1:", "nested"])
        # The closest valid key of an 8 MiB key took a minute to find.
        self.plan_text("k" * (8 << 20) + " = 1\n", needles=["{path}:1:", "longer than 256"])
        self.plan_text('["' + "k" * 300 + '"]\n', needles=["{path}:1:", "longer than 256"])
        example = EXAMPLES[0]
        self.assert_input_error(run("plan", example, deep[:20000] + "=1"), "more than 32 parts")
        self.assert_input_error(run("plan", example, "model.x={" + deep[:20000] + "=1}"),
                                "nested more than 32")

    def test_model_sizes_are_bounded(self):
        llama = '[model]\nmodel_type = "llama"\n'
        for layers in (65536, 2**31, 2**62):
            self.plan_text(llama + f"num_hidden_layers = {layers}\n",
                           needles=["{path}:3:", "model.num_hidden_layers", "[1, 2048]"])
        self.plan_text(llama + f"vocab_size = {2**62}\n",
                       needles=["{path}:3:", "model.vocab_size", "1.845e+19 bytes"])
        self.plan_text(llama + "hidden_size = 1048576\nintermediate_size = 1099511627776\n",
                       needles=["{path}:4:", "model.intermediate_size", "bytes", "2^47"])
        gpt2 = '[model]\nmodel_type = "gpt2"\n'
        self.plan_text(gpt2 + f"n_embd = {2**61}\n", needles=["{path}:3:", "model.n_embd", "bytes"])
        self.plan_text(gpt2 + "n_inner = 4611686018427387904\n",
                       needles=["{path}:3:", "model.n_inner", "bytes"])

    def test_keys_meshrun_does_not_act_on_are_refused_before_any_rank_starts(self):
        # One refusal of each kind; tests/unit/test_config_keys.cpp walks every key.
        cases = [("[distributed]\nenable_compile = true\n", "distributed.enable_compile",
                  "no graph compiler"),
                 ("[distributed]\nstrategy = \"megatron_fsdp\"\nmegatron_fsdp_unit_modules = "
                  "[\"LlamaMLP\"]\n", "distributed.megatron_fsdp_unit_modules",
                  "set it to [\"LlamaDecoderLayer\"]"),
                 ("[distributed]\ntp_plan = \"layers\"\n", "distributed.tp_plan",
                  "needs distributed.tp_size > 1"),
                 ("[distributed]\npp_size = 2\n[distributed.pipeline]\npp_batch_size = 4\n",
                  "distributed.pipeline.pp_batch_size", "set it to 16"),
                 ("[comm]\nbackend = \"nccl\"\n", "comm.backend",
                  "set dist_env.backend = \"nccl\"")]
        for text, key, reason in cases:
            with self.subTest(key=key), ConfigFile(text) as path:
                needles = (f"{path}:", key, reason)
                self.assert_input_error(run("plan", path), *needles)
                with tempfile.TemporaryDirectory() as folder:
                    output = os.path.join(folder, "run")
                    result = run("train", path, "--nproc-per-node", "2", "--output", output)
                    self.assert_input_error(result, *needles)
                    self.assertFalse(os.path.exists(output))

    def test_a_cuda_run_is_refused_before_any_rank_starts_where_it_cannot_train(self):
        # Where the kit has no GPU compute (a build without the toolkit) the
        # plan refuses "nccl"; where it has, the plan is made (a pipeline's
        # too), context parallelism is refused at its key, and without a GPU
        # (this machine, CI) `meshrun train` refuses the run saying why.
        cuda = "[dist_env]\nbackend = \"nccl\"\n"
        with ConfigFile(cuda) as path:
            planned = run("plan", path)
            if planned.returncode != 0:
                self.assert_input_error(planned, f"{path}:2:1", "dist_env.backend",
                                        "computes on the CPU only")
                return
            self.assertIn("cuda: a GPU per local rank, 1 rank a node (one node)", planned.stdout)
            # Each rank's node and GPU, the launch filling each node in order.
            planned = run("plan", path, "--world-size", "4", "--nproc-per-node", "2")
            self.assertEqual(planned.returncode, 0, planned.stderr)
            self.assertIn("2 ranks a node (--nproc-per-node), rank r on GPU r % 2 of node r / 2",
                          planned.stdout)
            table = [line.split() for line in planned.stdout.splitlines()
                     if line.split() and line.split()[0].isdigit()]
            self.assertEqual([(row[0], row[-2], row[-1]) for row in table],
                             [("0", "0", "cuda:0"), ("1", "0", "cuda:1"),
                              ("2", "1", "cuda:0"), ("3", "1", "cuda:1")])
            listed = json.loads(run("plan", path, "--world-size", "4", "--nproc-per-node", "2",
                                    "--json").stdout)
            self.assertEqual([(r["node"], r["device"]) for r in listed["ranks"]],
                             [(0, "cuda:0"), (0, "cuda:1"), (1, "cuda:0"), (1, "cuda:1")])
            if not os.path.exists("/dev/nvidia0"):
                with tempfile.TemporaryDirectory() as folder:
                    output = os.path.join(folder, "run")
                    result = run("train", path, "--nproc-per-node", "2", "--output", output)
                    self.assert_input_error(result, f"{path}:2:1", "dist_env.backend",
                                            "\"nccl\" puts every rank on a CUDA GPU",
                                            "set it to \"gloo\" or \"mpi\"")
                    self.assertFalse(os.path.exists(output))
        pipeline = "[model]\nnum_hidden_layers = 2\n[distributed]\npp_size = 2\n" \
                   "[distributed.pipeline]\npp_schedule = \"1f1b\"\n"
        with ConfigFile(cuda + pipeline) as path:
            planned = run("plan", path, "--world-size", "2")
            self.assertEqual(planned.returncode, 0, planned.stderr)
            self.assertIn("cuda: a GPU per local rank, 2 ranks a node (one node)", planned.stdout)
        with ConfigFile(cuda + "[distributed]\ncp_size = 2\n") as path:
            planned = run("plan", path, "--world-size", "2")
            self.assertEqual(planned.returncode, 0, planned.stderr)
            self.assertIn("cuda: a GPU per local rank", planned.stdout)

    def test_a_comm_backend_without_its_plugin_is_refused_before_any_rank_starts(self):
        with tempfile.TemporaryDirectory() as folder:
            output = os.path.join(folder, "run")
            example = os.path.join(SOURCE_DIR, "examples", "llama-tiny.toml")
            result = run("train", example, "comm.backend=nosuch", "--nproc-per-node", "2",
                         "--output", output)
            self.assert_input_error(result, "comm.backend: the ranks join its world",
                                    "no comm plugin named 'nosuch'", "available: ")
            self.assertFalse(os.path.exists(output))

    def test_command_line_errors(self):
        example = EXAMPLES[0]
        self.assert_input_error(run("plan", example, "--world-size", "abc"), "--world-size")
        self.assert_input_error(run("plan", example, "--world-size", "0"), "--world-size")
        self.assert_input_error(run("plan", example, "--wrold-size", "4"), "--world-size")
        self.assert_input_error(run("plan", example, "distributed.tp_sise=2"), "tp_size")
        self.assert_input_error(run("plan", example, "distributed.tp_size=x"),
                                "distributed.tp_size")
        self.assert_input_error(run("plan"), "CONFIG")
        self.assert_input_error(run("plna"), "plan")
        self.assert_input_error(run("plugins", "--kind", "strategie"), "strategy")
        self.assert_input_error(run("bench", "comm", "--sizes", "12Q"), "--sizes")
        self.assert_input_error(run("bench", "comm", "--ops", "allreduce"), "all_reduce")
        self.assert_input_error(run("bench", "comm", "--dtype", "int8"), "--dtype")
        self.assert_input_error(run("bench", "comm", "--nproc", "0"), "--nproc")
        self.assert_input_error(run("bench", "comms"), "comm")
        self.assert_input_error(run("bench", "memcpy", "--threads", "2"),
                                "--threads: meshrun bench memcpy takes no such option")
        self.assert_input_error(run("bench", "comm", "--device", "cuda"), "--device")
        self.assert_input_error(run("bench", "peak", "--device", "tpu"),
                                "--device: 'tpu'", "cpu, cuda, cuda:N")
        self.assert_input_error(run("bench", "peak", "--device", "cuda", "--threads", "2"),
                                "--threads")
        self.assert_input_error(run("bench", "peak", "--device", "cuda", "--dtype", "float32"),
                                "--dtype", "bfloat16 GEMMs only")

    def test_bench_peak_on_cuda_without_a_gpu_says_why(self):
        # Where a GPU and the peak library are, this measures; elsewhere it is
        # an input error naming what is missing: the driver or device, or the
        # library of a build without cuBLASLt.
        result = run("bench", "peak", "--device", "cuda", "--seconds", "0.2", "--json",
                     timeout=120)
        if result.returncode == 0:
            peak = json.loads(result.stdout)
            self.assertEqual((peak["op"], peak["dtype"], peak["device"]),
                             ("gemm_peak", "bfloat16", "cuda:0"))
            self.assertGreater(peak["flops_per_s"], 0)
            return
        self.assert_input_error(result, "--device cuda")
        self.assertTrue("no usable CUDA device (" in result.stderr or
                        "libmeshrun_cuda_peak.so is missing" in result.stderr, result.stderr)


class PlanTest(unittest.TestCase):
    def test_every_example_plans_in_text_and_json(self):
        self.assertGreaterEqual(len(EXAMPLES), 3)
        for example in EXAMPLES:
            text = run("plan", example)
            self.assertEqual(text.returncode, 0, example + text.stderr)
            self.assertIn("rank", text.stdout)
            result = run("plan", example, "--json")
            self.assertEqual(result.returncode, 0, example + result.stderr)
            plan = json.loads(result.stdout)
            self.assertIn("device    cpu, every rank", text.stdout)
            for field in ("world_size", "strategy", "device", "axes", "flattened", "moe", "ranks"):
                self.assertIn(field, plan, example)
            axes = plan["axes"]
            self.assertEqual(list(axes), ["pp", "dp_replicate", "dp_shard", "cp", "tp"])
            product = 1
            for size in axes.values():
                product *= size
            self.assertEqual(product, plan["world_size"], example)
            self.assertEqual(plan["flattened"]["dp"], axes["dp_replicate"] * axes["dp_shard"])
            self.assertEqual(len(plan["ranks"]), plan["world_size"])

    def test_override_changes_the_plan(self):
        result = run("plan", EXAMPLES[0], "--json", "--world-size", "8",
                     "distributed.strategy=fsdp2", "distributed.tp_size=2")
        self.assertEqual(result.returncode, 0, result.stderr)
        plan = json.loads(result.stdout)
        self.assertEqual((plan["strategy"], plan["axes"]["tp"]), ("fsdp2", 2))
        self.assertEqual(plan["ranks"][3]["coords"], {**plan["ranks"][3]["coords"], "tp": 1})

    def test_large_world_omits_ranks_and_collapses_text(self):
        result = run("plan", EXAMPLES[0], "--json", "--world-size", "100000",
                     "distributed.strategy=fsdp2", "distributed.tp_size=4")
        self.assertEqual(result.returncode, 0, result.stderr)
        plan = json.loads(result.stdout)
        self.assertNotIn("ranks", plan)
        self.assertEqual(plan["flattened"]["dp"], 25000)
        text = run("plan", EXAMPLES[0], "--world-size", "100000", "distributed.strategy=fsdp2")
        self.assertIn("ranks not shown", text.stdout)
        self.assertLess(len(text.stdout.splitlines()), 48)
        full = run("plan", EXAMPLES[0], "--json", "--all-ranks", "--world-size", "5000",
                   "distributed.strategy=fsdp2")
        self.assertEqual(len(json.loads(full.stdout)["ranks"]), 5000)

    def plan_json(self, *args):
        result = run("plan", os.path.join(SOURCE_DIR, "examples", "pipeline-1f1b.toml"), "--json",
                     *args)
        self.assertEqual(result.returncode, 0, result.stderr)
        return json.loads(result.stdout)["model"]

    def test_sidecar_units_and_tensor_parallel_placement(self):
        model = self.plan_json("--world-size", "4", "distributed.tp_size=2",
                               "distributed.pp_size=1")
        # The embedding and the head are units of their own (as torchtitan
        # wraps them); the untied root holds nothing.
        self.assertEqual([u["name"] for u in model["units"]],
                         ["root", "embedding"] + [f"model.layers.{i}" for i in range(4)] +
                         ["head"])
        self.assertEqual([u["parameters"] for u in model["units"] if "layers" not in u["name"]],
                         [[], ["model.embed_tokens.weight"],
                          ["model.norm.weight", "lm_head.weight"]])
        placement = {p["name"]: (p["tp"], p["local_shape"]) for p in model["parameters"]}
        self.assertEqual(placement["model.layers.0.self_attn.q_proj.weight"], ("shard(0)", [128, 256]))
        self.assertEqual(placement["model.layers.0.self_attn.k_proj.weight"], ("shard(0)", [64, 256]))
        self.assertEqual(placement["model.layers.0.mlp.down_proj.weight"], ("shard(1)", [256, 384]))
        self.assertEqual(placement["model.layers.0.input_layernorm.weight"], ("replicate", [256]))
        self.assertEqual(placement["model.embed_tokens.weight"], ("shard(0)", [128, 256]))
        self.assertEqual(placement["lm_head.weight"], ("shard(0)", [128, 256]))
        styles = {r["module"]: r["style"] for r in model["tensor_parallel"]}
        self.assertEqual(styles["model.layers.*.self_attn.o_proj"], "rowwise")
        self.assertEqual(styles["model.layers.*.mlp.gate_proj"], "colwise")

    def test_sidecar_pipeline_split_puts_the_remainder_first(self):
        stages = self.plan_json("--world-size", "2", "model.num_hidden_layers=5")["pipeline"]
        self.assertEqual([s["modules"] for s in stages],
                         [["model.embed_tokens", "model.layers.0", "model.layers.1",
                           "model.layers.2"],
                          ["model.layers.3", "model.layers.4", "model.norm", "lm_head"]])
        v_stages = self.plan_json("--world-size", "2",
                                  "distributed.pipeline.pp_schedule=zbv_zero_bubble")["pipeline"]
        self.assertEqual([s["rank"] for s in v_stages], [0, 1, 1, 0])
        looped = self.plan_json("--world-size", "2",
                                "distributed.pipeline.pp_schedule=interleaved_1f1b")["pipeline"]
        self.assertEqual([s["rank"] for s in looped], [0, 1, 0, 1])

    def test_sidecar_rejects_what_does_not_fit(self):
        example = os.path.join(SOURCE_DIR, "examples", "pipeline-1f1b.toml")
        BadInputTest.assert_input_error(self, run("plan", example, "--world-size", "6",
                                                  "distributed.tp_size=3"),
                                        "model.num_attention_heads", "distributed.tp_size")
        BadInputTest.assert_input_error(self, run("plan", example, "--world-size", "8",
                                                  "distributed.pp_size=8"),
                                        "model.num_hidden_layers")
        BadInputTest.assert_input_error(self, run("plan", example, "--world-size", "2",
                                                  "distributed.pipeline.layers_per_stage=3",
                                                  "model.num_hidden_layers=9"),
                                        "layers_per_stage", "round_virtual_stages_to_pp_multiple")

    def test_plugins_lists_shipped_plugins(self):
        result = run("plugins")
        self.assertEqual(result.returncode, 0, result.stderr)
        for name in ("ddp", "fsdp2", "megatron_fsdp", "llama", "1f1b", "gpipe"):
            self.assertIn(name, result.stdout)
        strategies = run("plugins", "--kind", "strategy")
        self.assertNotIn("llama", strategies.stdout)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])

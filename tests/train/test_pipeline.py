"""`meshrun train` with pipeline parallelism (pp > 1), against 1 rank.

Run by ctest: test_pipeline.py MESHRUN_EXE [TestClass ...]

Tolerance: the stages run the same float32 kernels as the whole model, and
activations and their gradients cross ranks unchanged; only the summation
order of the gradients differs (per microbatch, then over microbatches, and
over data-parallel shards with pp x dp), so losses agree with 1 rank to a
relative 1e-4, as for data parallelism (test_train.py).
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import Runs, TrainTest, losses, metrics, run  # noqa: E402
from meshrun_testing import InputErrorAssertions  # noqa: E402

FP32 = ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32",
        "model.num_hidden_layers=4")
PP2 = FP32 + ("distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2",
              "distributed.pipeline.pp_batch_size=8")
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
             "zbv_zero_bubble", "dualpipev"]

CSV_1F1B = """0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3
,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,
"""


class PipelineTest(TrainTest):
    @classmethod
    def setUpClass(cls):
        cls.runs = Runs()
        cls.reference = cls.runs.train("one", 1, *FP32)


class Equivalence(PipelineTest):
    def test_every_schedule_matches_one_rank(self):
        for name in SCHEDULES:
            with self.subTest(schedule=name):
                output = self.runs.train(name, 2, *PP2, f"distributed.pipeline.pp_schedule={name}")
                self.assert_close(losses(self.reference), losses(output))
                self.assert_close([m["grad_norm"] for m in metrics(self.reference)],
                                  [m["grad_norm"] for m in metrics(output)])
                self.assert_close([m["val_loss"] for m in metrics(self.reference)
                                   if "val_loss" in m],
                                  [m["val_loss"] for m in metrics(output) if "val_loss" in m])

    def test_pipeline_by_data_parallel_matches_one_rank(self):
        output = self.runs.train("pp2dp2", 4, *FP32, "distributed.pp_size=2",
                                 "distributed.pipeline.pp_microbatch_size=2",
                                 "distributed.pipeline.pp_batch_size=4")
        self.assert_close(losses(self.reference), losses(output))

    def test_gradient_scaling_in_or_after_the_schedule(self):
        inside = self.runs.train("scaled", 2, *PP2,
                                 "distributed.pipeline.scale_grads_in_schedule=true")
        self.assert_close(losses(self.reference), losses(inside))

    def test_explicit_module_split(self):
        parts = ('[["model.embed_tokens", "model.layers.0"], '
                 '["model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"]]')
        output = self.runs.train("parts", 2, *PP2,
                                 f"distributed.pipeline.module_fqns_per_model_part={parts}")
        self.assert_close(losses(self.reference), losses(output))

    def test_csv_schedule(self):
        path = os.path.join(self.runs.root, "1f1b.csv")
        with open(path, "w") as f:
            f.write(CSV_1F1B)
        output = self.runs.train("csv", 2, *PP2, f"distributed.pipeline.pp_schedule_csv={path}")
        self.assert_close(losses(self.reference), losses(output))


class ReceiveBufferPool(PipelineTest):
    """distributed.pipeline.pp_recv_buffer_pool: received activations land in
    buffers kept from earlier receives, which changes no value."""

    def test_pooled_receives_train_the_same_bits(self):
        for name in ("1f1b", "interleaved_zero_bubble"):
            with self.subTest(schedule=name):
                schedule = f"distributed.pipeline.pp_schedule={name}"
                plain = self.runs.train(f"{name}-unpooled", 2, *PP2, schedule)
                pooled = self.runs.train(f"{name}-pooled", 2, *PP2, schedule,
                                         "distributed.pipeline.pp_recv_buffer_pool=true")
                self.assertEqual(losses(plain), losses(pooled))
                with open(os.path.join(plain, "model.safetensors"), "rb") as a, \
                        open(os.path.join(pooled, "model.safetensors"), "rb") as b:
                    self.assertEqual(a.read(), b.read())
                # The pool holds whole activations [micro-batch 2, seq_len, hidden]
                # between steps, in buffers_reserved.
                kept = (metrics(pooled)[0]["mem"]["buffers_reserved"]
                        - metrics(plain)[0]["mem"]["buffers_reserved"])
                activation = 2 * 32 * 32 * 4
                self.assertGreater(kept, 0)
                self.assertEqual(kept % activation, 0)


class Checkpoints(PipelineTest):
    def test_resume_across_pipeline_and_data_parallel(self):
        full = self.runs.train("full", 2, *PP2, "checkpoint.save_every=2")
        step2 = os.path.join(full, "checkpoints", "step_2")
        same = self.runs.train("same", 2, *PP2, f"checkpoint.resume_from={step2}")
        self.assertEqual(losses(full)[2:], losses(same))
        flat = self.runs.train("flat", 2, *FP32, f"checkpoint.resume_from={step2}")
        self.assert_close(losses(full)[2:], losses(flat))

    def test_export_reloads(self):
        full = self.runs.train("export", 2, *PP2)
        reloaded = self.runs.train("reload", 1, *FP32, f"model.checkpoint={full}",
                                   "train.steps=1", "train.lr=1e-30", "train.min_lr=0",
                                   "train.weight_decay=0")
        self.assert_close([metrics(full)[-1]["val_loss"]], [metrics(reloaded)[-1]["val_loss"]])


class BadInput(PipelineTest, InputErrorAssertions):
    def assert_refused(self, key, *overrides):
        result = run(self.runs.config, "--nproc-per-node", "2", "--output",
                     os.path.join(self.runs.root, "bad"), *overrides)
        self.assert_input_error(result, key)

    def test_bad_pipelines_name_their_key(self):
        # 6 sequences per pipeline step, but a rank's share of the batch is 8
        self.assert_refused("distributed.pipeline.pp_batch_size", *PP2,
                            "distributed.pipeline.pp_microbatch_size=3",
                            "distributed.pipeline.pp_batch_size=6")
        # one layer per stage makes 4 stages: 2 per rank, which 1F1B cannot run
        self.assert_refused("distributed.pipeline.pp_schedule", *PP2,
                            "distributed.pipeline.pp_schedule=1f1b",
                            "distributed.pipeline.layers_per_stage=1")
        self.assert_refused("distributed.pipeline.module_fqns_per_model_part", *PP2,
                            'distributed.pipeline.module_fqns_per_model_part=[["model.embed_tokens",'
                            ' "model.layers.0", "model.layers.1", "model.layers.2", '
                            '"model.layers.3", "model.norm"], ["lm_head"]]')
        path = os.path.join(self.runs.root, "bad.csv")
        with open(path, "w") as f:
            f.write(CSV_1F1B.replace("1B2", "1X2"))
        self.assert_refused("distributed.pipeline.pp_schedule_csv", *PP2,
                            f"distributed.pipeline.pp_schedule_csv={path}")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)

"""One rank of tests/python/test_metrics.py: `meshrun launch --nproc-per-node
2 -- python3 metrics_rank.py CONFIG OUTPUT [key=value ...]`; with
train.profile=true among the keys, it records the trace too.

Trains the PyTorch Llama of CONFIG's [model] (examples/python/torch_llama.py)
under meshrun.torch for train.steps steps of one micro-batch per rank,
writing OUTPUT/metrics.jsonl and run.json through meshrun.metrics.RunMetrics
with the FLOPs meshrun.torch counts for the module.
"""

import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))
import meshrun  # noqa: E402
import meshrun.metrics  # noqa: E402
import meshrun.torch  # noqa: E402
from torch_llama import LlamaForCausalLM, load_config  # noqa: E402


def main():
    config, output, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    job = meshrun.init(config, overrides=overrides)
    model_config, data, train = load_config(config, overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config)
    wrapped = meshrun.torch.DistributedModule(model, job, units=model.model.layers)
    optimizer = wrapped.adamw(lr=train["lr"], weight_decay=train["weight_decay"])
    seq, batch = data["seq_len"], train["global_batch_size"]
    width = model_config["hidden_size"]
    flops = meshrun.torch.matmul_flops_per_token(
        model, attention=(model_config["num_hidden_layers"], width, seq))
    log = meshrun.metrics.RunMetrics(job, output, batch * seq, flops,
                                     profile="train.profile=true" in overrides)
    per_rank = batch // job.world_size
    generator = torch.Generator().manual_seed(1)
    for step in range(train["steps"]):
        tokens = torch.randint(0, model_config["vocab_size"], (batch, seq + 1),
                               generator=generator)
        mine = tokens[job.rank * per_rank:(job.rank + 1) * per_rank]
        log.begin_step()
        start = time.perf_counter()
        comm_before, sync_before = wrapped.strategy_seconds, wrapped.grad_sync_seconds
        wrapped.zero_grad()
        loss = wrapped(mine[:, :-1], mine[:, 1:])
        loss.backward()
        grad_norm = wrapped.clip_grad_norm_(train["max_grad_norm"])
        optimizer.step()
        step_time = time.perf_counter() - start
        log.write(step + 1, float(loss), train["lr"], grad_norm, step_time,
                  wrapped.memory_use(optimizer),
                  comm_wait_s=wrapped.strategy_seconds - comm_before,
                  grad_sync_wait_s=wrapped.grad_sync_seconds - sync_before)
    log.close()


if __name__ == "__main__":
    main()

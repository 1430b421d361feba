"""One rank of the checkpoint round trip of tests/python/test_interop.py:
`meshrun launch --nproc-per-node 2 -- python3 interop_rank.py CONFIG LOAD
SAVE [key=value ...]`.

Builds the PyTorch Llama of CONFIG's [model] (examples/python/torch_llama.py,
Hugging Face names), wraps it with meshrun.torch under the configured
strategy, loads the sharded checkpoint LOAD (written by `meshrun train`) into
its parameters and AdamW moments, writes the full parameters rank 0 then
holds to SAVE.npz (by name), exports them as SAVE.export/model.safetensors
(DistributedModule.export_safetensors), and saves them back as the sharded
checkpoint SAVE (meshrun train's format, the step LOAD had).
"""

import os
import sys

import numpy
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))
import meshrun  # noqa: E402
import meshrun.torch  # noqa: E402
from torch_llama import LlamaForCausalLM, load_config  # noqa: E402


def main():
    config, load, save, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    torch.set_num_threads(1)
    job = meshrun.init(config, overrides=overrides)
    model_config, _, train = load_config(config, overrides)
    model = LlamaForCausalLM(model_config)
    wrapped = meshrun.torch.DistributedModule(model, job, units=model.model.layers)
    optimizer = wrapped.adamw(lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"],
                              weight_decay=train["weight_decay"])
    step = wrapped.load_checkpoint(load, optimizer)
    full = wrapped.gather_parameters()
    if job.rank == 0:
        arrays, offset = {}, 0
        for name, parameter in model.named_parameters():
            arrays[name] = full[offset:offset + parameter.numel()].view(parameter.shape).numpy()
            offset += parameter.numel()
        numpy.savez(save + ".npz", **arrays)
    wrapped.export_safetensors(save + ".export")
    wrapped.save_checkpoint(save, step, optimizer)


if __name__ == "__main__":
    main()

"""One rank of the checkpoint round trip of tests/python/test_interop.py:
`meshrun launch --nproc-per-node 2 -- python3 interop_rank.py CONFIG LOAD
SAVE HF_CONFIG ORDER [key=value ...]`.

Builds the PyTorch Llama of CONFIG's [model] (examples/python/torch_llama.py,
Hugging Face names), its parameters registered in Hugging Face's order (ORDER
"hf": each layer's norms last) or in meshrun's forward order ("forward",
meshrun train's flat layout element for element), wraps it with meshrun.torch under the configured
strategy, loads the sharded checkpoint LOAD (written by `meshrun train`) into
its parameters and AdamW moments, writes the full parameters rank 0 then
holds to SAVE.npz (by name), exports them as SAVE.export/model.safetensors
with HF_CONFIG as its config.json (DistributedModule.export_safetensors),
and saves them back as the sharded
checkpoint SAVE (meshrun train's format, the step LOAD had).
"""

import collections
import json
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


FORWARD_ORDER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def main():
    config, load, save, hf_config, order = sys.argv[1:6]
    overrides = sys.argv[6:]
    torch.set_num_threads(1)
    job = meshrun.init(config, overrides=overrides)
    model_config, _, train = load_config(config, overrides)
    model = LlamaForCausalLM(model_config)
    if order == "forward":  # meshrun's own layout, element for element
        for layer in model.model.layers:
            layer._modules = collections.OrderedDict(
                (name, layer._modules[name]) for name in FORWARD_ORDER)
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
    with open(hf_config) as f:
        wrapped.export_safetensors(save + ".export", config=json.load(f))
    wrapped.save_checkpoint(save, step, optimizer)


if __name__ == "__main__":
    main()

"""Every registered family of the trainable kinds, sharded: run under torchrun (tests/test_sharded.py).

    torchrun --standalone --nproc_per_node 2 tests/_shard_families.py OUT_DIR

For each architecture of kind causal-lm, seq2seq, classifier or image-classifier, its "tiny"
preset is wrapped by :func:`attnlab.train.sharded.shard_model` (through the Trainer, --shard) and
trained for 2 steps. Rank 0 writes OUT_DIR/families.json: per architecture the tied parameter
names before wrapping and whether each pair is still one parameter after it, the largest
difference between the wrapped model's outputs and an unwrapped copy's before training (relative
to the outputs' scale), the 2 losses, whether the weights moved, and whether the tied weights are
still equal in the gathered checkpoint weights after training.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

import attnlab.models  # noqa: F401  (registers every family)
import contract
from attnlab.models.registry import architectures
from attnlab.train import TrainConfig, Trainer
from attnlab.train.distributed import init_distributed, shutdown
from attnlab.train.sharded import full_state_dict

KINDS = ("causal-lm", "seq2seq", "classifier", "image-classifier")


def tied_names(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(first name, further name) of each parameter registered under two names."""
    first, pairs = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((first[id(p)], name))
        first.setdefault(id(p), name)
    return pairs


class ProjectionTask:
    """Loss: the sum of each output times a fixed random tensor; "tokens": the outputs' size."""

    def __init__(self, arch, model):
        self.arch, self.model = arch, model
        self.batches = [contract.example(arch, model.config, seed=10 + i) for i in range(4)]
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            shapes = [o.shape for o in contract.outputs(copy.deepcopy(model)(**self.batches[0]))]
        self.weights = [torch.randn(s, generator=g) for s in shapes]

    def plan(self, epoch: int, seed: int) -> list:
        return list(self.batches)

    def loss(self, model, batch):
        outs = contract.outputs(model(**batch))
        return sum((o.float() * w).sum() for o, w in zip(outs, self.weights)), sum(o.numel() for o in outs), {}


def check(arch, out: Path, env) -> dict:
    model = contract.tiny(arch, seed=0, randomize=True).train()
    reference = copy.deepcopy(model).eval()
    pairs = tied_names(model)
    task = ProjectionTask(arch, model)
    trainer = Trainer(task, TrainConfig(out_dir=out / arch.model_type, steps=2, lr=1e-2, schedule="constant",
                                        shard=True, device="cpu", progress=False, precision="fp32", log_every=1,
                                        clip_norm=None))
    params = dict(model.named_parameters(remove_duplicate=False))
    still_tied = [params[a] is params[b] for a, b in pairs]
    x = contract.example(arch, model.config, seed=99)
    with torch.no_grad():
        model.eval()
        got, want = contract.outputs(model(**x)), contract.outputs(reference(**x))
        model.train()
    diff = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
    trainer.fit()
    losses = [r["loss"] for r in trainer.records if r["kind"] == "train"]
    whole = full_state_dict(model)
    before = reference.state_dict()
    trained = env.is_main and any(not torch.equal(whole[k], before[k]) for k in before if k in whole)
    tied_after = [bool(env.is_main and torch.equal(whole[a], whole[b])) for a, b in pairs if a in whole and b in whole]
    trainer.close()
    return {"tied": pairs, "still_tied": still_tied, "tied_after_training": tied_after, "output_diff": diff,
            "losses": losses, "trained": trained}


def main() -> None:
    out = Path(sys.argv[1])
    env = init_distributed("cpu")            # one group for every Trainer below (none of them owns it)
    results = {}
    for arch in architectures():
        if arch.kind in KINDS:
            results[f"{arch.model_type}/{arch.name}"] = check(arch, out, env)
    if env.is_main:
        (out / "families.json").write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()
    shutdown(env)


if __name__ == "__main__":
    main()

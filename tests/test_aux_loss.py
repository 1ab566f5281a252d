"""The auxiliary-loss interface of causal LMs: ``aux_loss()``, ``aux_loss_coef`` and
``aux_stats()`` read the last forward from the model itself, so a training loop needs no hooks
and no knowledge of mixtures of experts; it holds through DDP and gradient checkpointing."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from attnlab.models import GPT, GPTConfig, Mixtral, MixtralConfig
from attnlab.nn import load_balancing_loss
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

X, K, V = 4, 2, 40


def _mixtral(coef=0.5):
    torch.manual_seed(0)
    return Mixtral(MixtralConfig(vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=48,
                                 max_position_embeddings=16, num_experts=X, top_k=K, router_aux_loss_coef=coef))


def _batch(B=3, T=8):
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :3], mask[2, :5] = False, False                 # left padding
    return ids, mask


def close(got, want, what):
    assert_close_scaled(got, want, FP32, what)


def test_mixtral_aux_loss_and_stats_exclude_padding():
    model = _mixtral()
    with pytest.raises(RuntimeError, match="forward"):
        model.aux_loss()
    ids, mask = _batch()
    model(ids, attention_mask=mask)
    routers, kept = model.routing()
    assert torch.equal(kept, mask.flatten()) and len(routers) == 2
    real = mask.flatten()
    # padding excluded = the loss over the real tokens' rows alone
    close(model.aux_loss(), load_balancing_loss([r[real] for r in routers], X, K), "aux loss, padding excluded")
    assert model.aux_loss_coef == 0.5
    stats = model.aux_stats()
    assert set(stats) == {f"expert_{e}" for e in range(X)}
    chosen = torch.cat([r[real].softmax(-1).topk(K, dim=-1).indices.flatten() for r in routers])
    want = torch.bincount(chosen, minlength=X).double() / (2 * K * int(real.sum()))
    close(torch.stack([stats[f"expert_{e}"] for e in range(X)]), want, "expert shares over real tokens")
    assert not any(s.requires_grad for s in stats.values())


def test_dense_model_has_no_aux_loss():
    gpt = GPT(GPTConfig(vocab_size=V, n_positions=16, d_model=16, num_heads=2, num_layers=1))
    gpt(torch.zeros(1, 4, dtype=torch.long))
    assert gpt.aux_loss() is None and gpt.aux_loss_coef == 0.0 and gpt.aux_stats() == {}


def _loss(model, ids, mask):
    logits = model(ids, attention_mask=mask)
    ce = F.cross_entropy(logits[mask], ids[mask])
    return ce + model.aux_loss_coef * model.aux_loss()


def test_gradient_checkpointing_gives_the_same_aux_loss_and_gradients():
    model = _mixtral().train()
    ids, mask = _batch()
    loss = _loss(model, ids, mask)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing = True
    ck = _loss(model, ids, mask)
    recorded = model.routing()[0][0]
    ck.backward()
    assert model.routing()[0][0] is recorded, "the backward's recomputation must not overwrite the routing"
    close(ck, loss, "loss with checkpointing")
    for n, p in model.named_parameters():
        close(p.grad, want[n], f"gradient of {n} with checkpointing")
    assert model.layers[0].ff.gate.weight.grad.abs().sum() > 0


def test_copies_do_not_carry_the_routing():
    model = _mixtral().train()
    model(*_batch()[:1])
    twin = copy.deepcopy(model)                           # a record with a graph would not deep-copy
    with pytest.raises(RuntimeError, match="forward"):
        twin.aux_loss()
    assert model.aux_loss().requires_grad


def test_aux_loss_through_a_ddp_wrapper(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = _mixtral().train()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ids, mask = _batch()
        logits = ddp(ids, attention_mask=mask)
        loss = F.cross_entropy(logits[mask], ids[mask]) + model.aux_loss_coef * model.aux_loss()
        loss.backward()
        plain = _mixtral().train()
        _loss(plain, ids, mask).backward()
        close(model.layers[1].ff.gate.weight.grad, plain.layers[1].ff.gate.weight.grad, "router gradient under DDP")
    finally:
        dist.destroy_process_group()

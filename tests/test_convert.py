"""models/convert.py's Fuse and Split with pieces of unequal sizes (Mamba's x_proj: Δ's rank, then
B's and C's state widths; Mamba-2's in_proj: z, x, B, C, Δ): exact inverses both ways, sizes read
from the config, through a rule and a whole state dict, and one clear error when sizes disagree."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from attnlab.models.convert import Fuse, Rule, Split, from_hf_state_dict, to_hf_state_dict


@dataclass
class _Config:
    dt_rank: int = 3
    d_state: int = 5

    @property
    def conv_dim(self) -> int:          # a composite width, as a config property
        return 2 * self.d_state


def test_fuse_and_split_with_unequal_sizes_are_exact_inverses():
    g = torch.Generator().manual_seed(0)
    config = _Config()
    parts = [torch.randn(7, n, generator=g) for n in (3, 5, 5)]
    for sizes in ((3, 5, 5), ("dt_rank", "d_state", "d_state"), ("dt_rank", "conv_dim")):
        fuse = Fuse(1, sizes=sizes)
        given = parts if len(sizes) == 3 else [parts[0], torch.cat(parts[1:], 1)]
        (fused,) = fuse.to_hf(given, config)
        assert fused.shape == (7, 13) and torch.equal(fused[:, 3:8], parts[1])
        back = fuse.from_hf([fused], config)
        assert [t.shape[1] for t in back] == [t.shape[1] for t in given]
        assert all(torch.equal(a, b) for a, b in zip(back, given))
        split = Split(1, sizes=sizes)                    # the other way round: ours fused, theirs apart
        assert all(torch.equal(a, b) for a, b in zip(split.to_hf([fused], config), given))
        assert torch.equal(split.from_hf(given, config)[0], fused)
    assert repr(Fuse(0, sizes=("dt_rank", 4))) == "fuse(dim=0, sizes=('dt_rank', 4))"
    assert repr(Split(0, 3)) == "split(dim=0, parts=3)"


def test_sizes_that_do_not_add_up_are_refused_naming_them():
    config = _Config()
    with pytest.raises(ValueError, match=r"fuse\(dim=0, sizes=\('dt_rank', 'd_state'\)\): the sizes \[3, 5\] add "
                                         r"up to 8, but dim 0 of shape \(9, 2\) has 9"):
        Fuse(0, sizes=("dt_rank", "d_state")).from_hf([torch.zeros(9, 2)], config)
    with pytest.raises(ValueError, match=r"the tensors have sizes \[5, 3\] along dim 0, the rule \[3, 5\]"):
        Fuse(0, sizes=(3, 5)).to_hf([torch.zeros(5, 2), torch.zeros(3, 2)], config)
    with pytest.raises(ValueError, match=r"the tensors have sizes \[2, 4\] along dim 0, the rule \[3, 3\]"):
        Fuse(0, 2).to_hf([torch.zeros(2, 1), torch.zeros(4, 1)], config)        # equal parts that are not
    with pytest.raises(ValueError, match="give the number of equal parts or their sizes, not both"):
        Fuse(0, 2, sizes=(1, 1))
    with pytest.raises(ValueError, match="sizes must be two or more ints or config field names"):
        Split(0, sizes=(4,))


class _Mamba(nn.Module):
    """The shape of Mamba's x_proj, as a model might keep it: three projections of unequal widths."""

    def __init__(self, config: _Config, d_inner: int = 6):
        super().__init__()
        self.config = config
        self.dt = nn.Linear(d_inner, config.dt_rank, bias=False)
        self.B = nn.Linear(d_inner, config.d_state, bias=False)
        self.C = nn.Linear(d_inner, config.d_state, bias=False)


def test_a_rule_with_unequal_sizes_round_trips_a_state_dict():
    rules = [Rule(("dt.weight", "B.weight", "C.weight"), "x_proj.weight", Fuse(0, sizes=("dt_rank", "d_state",
                                                                                          "d_state")))]
    torch.manual_seed(0)
    model = _Mamba(_Config())
    theirs = to_hf_state_dict(model, rules)
    assert list(theirs) == ["x_proj.weight"] and theirs["x_proj.weight"].shape == (13, 6)
    assert torch.equal(theirs["x_proj.weight"][8:], model.C.weight)
    other = _Mamba(_Config())
    ours = from_hf_state_dict(other, theirs, rules)
    assert ours.keys() == model.state_dict().keys()
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())

"""attnlab.tasks.pretrained.base_from_checkpoint: a base read out of a checkpoint with a head may
miss only what the base declares that no output reads (BERT's pooler, which a masked-LM
checkpoint does not hold); any other missing weight is refused, naming it."""
import pytest
import torch

import contract
from attnlab.models.pretrained import to_hf_state_dict
from attnlab.models.registry import family
from attnlab.tasks.pretrained import base_from_checkpoint
from attnlab.tasks.run import RunError


def test_a_masked_lm_checkpoint_gives_its_base_and_only_the_unread_pooler_may_be_missing():
    bert = family("bert")
    mlm = contract.tiny(bert.architectures["BertForMaskedLM"], randomize=True)
    tensors = to_hf_state_dict(mlm)
    assert not any("pooler" in k for k in tensors)             # a masked-LM checkpoint holds no pooler
    base = base_from_checkpoint(bert.architectures["BertForMaskedLM"], mlm.config, tensors, "--init X")
    ids = torch.randint(0, mlm.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = contract.tiny(bert.architectures["BertModel"])
    shared = {k: v for k, v in mlm.state_dict().items() if k in reference.state_dict()}
    assert len(shared) == len(reference.state_dict()) - 2          # all but the pooler's weight and bias
    reference.load_state_dict(shared, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(base(ids), reference.eval()(ids), rtol=0, atol=0)
    gap = {k: v for k, v in tensors.items() if k != "bert.encoder.layer.0.attention.self.query.weight"}
    with pytest.raises(RunError, match=r"--init X: the checkpoint lacks weights its encoder uses: layers\.0\."):
        base_from_checkpoint(bert.architectures["BertForMaskedLM"], mlm.config, gap, "--init X")

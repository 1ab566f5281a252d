"""`attnlab train vlm` on tiny settings: question/answer examples whose only targets are the answer
and its end token, the image placeholder expanded to the model's image tokens, greedy answers
equal to the teacher-forced argmax, the report on the held-out digits, an exact resume."""
import torch

from attnlab.models.objective import IGNORE_INDEX
from attnlab.tasks import get_task, open_run
from _multimodal import VLM_TINY as _TINY, cli as _cli


def test_vlm_trains_answers_and_resumes_bit_identically(tmp_path, capsys):
    code, out, err = _cli(capsys, "train", "vlm", "--out", tmp_path / "whole", "--steps", "6", *_TINY)
    assert code == 0, err
    assert out.count("held-out test images, ") == 3 and "of 200" in out
    assert _cli(capsys, "train", "vlm", "--out", tmp_path / "part", "--steps", "3", *_TINY)[0] == 0
    code, _, err = _cli(capsys, "train", "vlm", "--out", tmp_path / "part", "--resume", "--steps", "6",
                        "--no-progress")
    assert code == 0, err
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / r / "step-0000006" / "model.safetensors")) for r in ("whole", "part"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    vlm = get_task("vlm").load(open_run(tmp_path / "whole"))
    tok, config = vlm.tokenizer, vlm.model.config
    assert config.image_token_id == tok.vocab_size - 1 == tok.encode("<image>")[0]
    task = get_task("vlm")
    setup = task.prepare(task.settings(out=str(tmp_path / "x")), None)
    ids, mask, tgt = setup.task.examples([3, 7], seed=0)
    for row in range(2):
        n = int(mask[row].sum())
        assert (ids[row, :config.image_tokens] == config.image_token_id).all()
        assert int((ids[row] == config.image_token_id).sum()) == config.image_tokens
        answer = tgt[row][tgt[row] != IGNORE_INDEX].tolist()       # the answer's word, then <eos>
        assert answer == tok.encode(["3", "7"][row]) + [2] and tgt[row, n - 1] == 2
    # greedy answers are the teacher-forced argmax of the prompt and the answer so far
    from attnlab.tasks.vlm import _prompt
    pixels = vlm.processor.finish(setup.task.valid_x[:4])
    got = vlm.answer([x for x in setup.task.valid_x[:4].permute(0, 2, 3, 1).numpy()], "what digit is this?")
    prompt = torch.tensor(_prompt(tok, "what digit is this?", config.image_tokens)).expand(4, -1)
    with torch.no_grad():
        first = vlm.model(prompt, pixels).argmax(-1)[:, -1]
    assert [a.split()[0] if a else "" for a in got] == [tok.decode([int(t)]) for t in first]

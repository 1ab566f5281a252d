"""The defaults of `attnlab train image` on a user's image folder: what it trains with unless a flag
says otherwise, chosen from what the folder holds (:class:`attnlab.data.images.FolderSurvey`) and
the time budget. The image task applies them to the options no flag gave, prints them as the flags
in use and saves them with the run (attnlab.tasks.image); the figures behind each choice are in
benchmarks/results/vision.md ("Image folders: defaults that follow the data")."""
from __future__ import annotations

from ..data.images import FolderSurvey

__all__ = ["folder_defaults"]


def folder_defaults(survey: FolderSurvey, budget: float | None, family_options: set[str]) -> dict:
    """The settings a user's image folder trains with unless a flag gives them, from what it holds
    (``survey``), the time budget in minutes (None: about ten epochs) and the options the model
    family takes (``family_options``: a tokenizer or pooling the family lacks is not chosen).

    - Images at their own size when they are small (a side of at most 48 px, rounded to a multiple
      of 4: 28x28 scans stay 28x28), photos at 32 px; grey images in one channel; patches of 4
      (of 2 below 16 px).
    - Sequence pooling where the family has it (CCT, Hassani et al. 2021): the classifier reads an
      attention-weighted mean of the patches from the first step, where a class token must first
      learn to gather them; within a few minutes it scored far higher (benchmarks/results/vision.md).
      The patch embedding stays: CCT's convolutional tokeniser (``--tokenizer conv``) costs about
      twice the time a step on a CPU, and in budgets of minutes the lost steps cost more than the
      convolutions gave.
    - Grey images (scans, drawings) turn, zoom and move a little (``affine``) and are never
      mirrored, which can change their class (a digit); colour photos take a random crop and a
      horizontal flip. Label smoothing 0.1, as DeiT and CCT train. Grey images train without
      dropout (the affine augmentation regularises enough, as on the digits, and dropout costs
      time); photos, whose folders are small, keep 0.1.
    - Width: 64 x 4 layers; 128 wide when a budget of 10 minutes or more meets 5,000 images or more
      (a rule stated ahead of its measurement: benchmarks/results/vision.md says what was measured).
    """
    small = survey.side <= 48
    size = max(8, 4 * round(survey.side / 4)) if small else 32
    chosen = dict(image_size=size, channels=1 if survey.grey else 3, patch_size=4 if size >= 16 else 2,
                  augment="affine" if survey.grey else "crop-flip", label_smoothing=0.1,
                  dropout=0.0 if survey.grey else 0.1, ema=0.0, heads=4, layers=4,
                  d_model=128 if budget is not None and budget >= 10 and survey.images >= 5000 else 64)
    if "tokenizer" in family_options:
        chosen["tokenizer"] = "patch"
    if "pooling" in family_options:
        chosen["pooling"] = "seq"
    return chosen

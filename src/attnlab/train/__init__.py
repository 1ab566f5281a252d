"""attnlab.train: one Trainer for every model, with schedules, losses, checkpoints and DDP.

    from attnlab.train import Trainer, TrainConfig
    Trainer(task, TrainConfig(out_dir="runs/x", steps=1000), resume=True).fit()

See :class:`attnlab.train.trainer.Task` for what a task provides.
"""
from .checkpoint import CheckpointManager, load_checkpoint, resolve_checkpoint, save_checkpoint
from .losses import count_tokens, label_smoothed_cross_entropy
from .schedules import constant_schedule, cosine_schedule, make_schedule, noam, noam_schedule
from .metrics import plot_metrics, read_metrics
from .trainer import Task, TrainConfig, Trainer, build_optimizer, param_groups, split_decay

__all__ = ["Task", "TrainConfig", "Trainer", "build_optimizer", "param_groups", "split_decay", "plot_metrics",
           "label_smoothed_cross_entropy", "count_tokens", "noam", "noam_schedule", "cosine_schedule",
           "constant_schedule", "make_schedule", "CheckpointManager", "save_checkpoint", "load_checkpoint",
           "resolve_checkpoint"]

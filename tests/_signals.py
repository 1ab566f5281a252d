"""A real SIGINT to this process while the Trainer runs a given optimizer step (for the tests of
interruption and resume in-process)."""
import os
import signal


def sigint_during_step(monkeypatch, step: int) -> None:
    """Patch the Trainer so that this process gets SIGINT inside optimizer step ``step`` (1-based);
    ``monkeypatch.undo()`` puts the Trainer back."""
    from attnlab.train import Trainer
    real_step = Trainer._optimizer_step

    def step_then_signal(self):
        if self.step == step - 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self)

    monkeypatch.setattr(Trainer, "_optimizer_step", step_then_signal)

"""The learner: FSDP2 ranks on Ray that turn mini-batches of TrainSequences into policy versions.

    from asyncrl.learner import LearnerGroup
    group = LearnerGroup(cfg, model_path, sample_special_tokens=False)  # the task's token ban (data/tokens.py)
    result = group.train_step(minibatches)   # StepResult: .version, .metrics

Modules: group.py (driver handle), actor.py (one rank), step.py (the optimizer step as plain
functions), fsdp.py (all FSDP2 code), optim.py (AdamW + schedule), checkpoint.py (DCP),
validate.py (driver-side batch checks), loss.py (micro-batch loss assembly).
"""

from asyncrl.learner.group import LearnerError, LearnerGroup

__all__ = ["LearnerError", "LearnerGroup"]

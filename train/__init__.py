"""train: the Lightning side of specdec.

`python -m train experiment=...` runs `train.run.run(cfg)`: one of the tasks in `train.tasks`
(one file each: the joint prophet, a prophet on a frozen main model, draft distillation, Hugging
Face draft distillation) on a DataModule of `train.data`, with the evaluation callback of
`train.callbacks`, and exports through `train.checkpoints`. Configs live in `conf/`; the models
themselves in `specdec_models`.
"""

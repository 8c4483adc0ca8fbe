"""train: the Lightning side of specdec.

`python -m train experiment=...` trains a main decoder with its prophet (`train.run.run`), on
enwik8 bytes (`train.data`), with the LightningModule and export writer of `train.module`.
Configs live in `conf/`; the models themselves in `specdec_models`.
"""

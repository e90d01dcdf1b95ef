"""train/: distilling a draft against a frozen HF causal LM (`dspark train`), and the demo pair's build.

- options.py      `TrainOptions` and the names of a checkpoint's trainer files
- run.py          `prepare_run`: target, data and draft (new or resumed) checked and loaded for one run
- trainer.py      `DraftTrainer` (one optimizer step, checkpoints), `train_loop`, `latest_checkpoint`
- loss.py         the objective: anchors, query blocks, the teacher-forced draft forward, the loss sums
- features.py     the feature contract (FeatureSpec, FeatureRecord, TargetFeatures), hook capture, TargetHead
- tau.py          τ during training: the greedy loop's τ on held-out prompts (chained teacher-forced acceptance)
- new_draft.py    a new draft for a target: `DraftShape`, mask token, config.json, shared weights
- checks.py       checks before allocating (window, memory), resume points, `checkpoint_shape`
- data.py         text / JSONL / chat data -> token stream;  output.py: the output folder, claimed up front
- tiny_target.py  next-token training of a tiny target;  demo_build.py: the deterministic demo-pair builder
- demo_large.py   the demo-large pair: the demo target grown by inert layers (its function, a real target's cost)
- feature_cache.py `dspark features`' cache on disk: shards, manifest, `FeatureCache`, `FeatureBank` (train --features)
- features_run.py  one `dspark features` run;  speculators.py: speculators' hs_<i>.safetensors as records
- head_weights.py  the target's embedding / final norm / lm_head alone;  cached.py: train --features' checks
- shard_target.py  the frozen target sharded across torchrun's processes (FSDP2, train --shard-target)
Many processes under torchrun: `dspark_cli.runtime.distributed`.
"""

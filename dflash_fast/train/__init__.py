"""The DeepSpeed training job (`deepspeed train.py`), as a loop over small components.

    config              the typed YAML config, overrides, validation: one source of truth
    data                the run's hidden-state source (store or runner), its batches, TrainStream, data identity
    model               the run's drafter: built from the target or model.init_from, matched to the store
    optim               DeepSpeed JSON, parameter groups, AdamW / Muon, the LR schedule
    memory              the memory of a step per rank before it runs (--plan, the refusal)
    checkpoint          checkpoints: safetensors weights, RNG state, the checksummed marker, resume
    distributed         process group, precision, rank sharing, gathered state
    metrics             Sums, windows, metrics.jsonl, TensorBoard, the progress bar
    trainer             the loop: step, validate, checkpoint, export (reads like spec.md §5-6)
    export_checkpoint   `dflash-fast export`: a run's checkpoint -> an export
"""

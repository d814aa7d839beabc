"""`deepspeed train.py --config configs/tiny.yaml [key=value ...]` — see dflash_fast.train.trainer.

The trainer (train/) cannot import the evaluator (evaluate/ is above it: docs/layout.md); this script hands it
real speculative decoding while training (validation.prompts: dflash_fast.evaluate.validation)."""
from dflash_fast.evaluate.validation import RealAcceptance
from dflash_fast.train.trainer import main

if __name__ == "__main__":
    main(real_acceptance=RealAcceptance)

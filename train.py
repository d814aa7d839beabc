"""`deepspeed train.py --config configs/tiny.yaml [key=value ...]` — see dflash_fast.train.trainer."""
from dflash_fast.train.trainer import main

if __name__ == "__main__":
    main()
